//! The work waiting to be sent, in *stages* sent strictly one after the other, and the
//! netting rules that keep it small.
//!
//! - A **window** collects adds and evictions. Within it, work on one prefix is netted as it
//!   arrives: a repeated add replaces the queued one, an eviction drops the queued adds of its
//!   prefix (and is itself dropped when the first of them was [`pb::Report::New`]: the server
//!   never held the prefix), so per prefix a window holds nothing, an add, an eviction, or an
//!   eviction followed by an add. Its adds form two streams ([`Adds`]): those with no eviction
//!   of their prefix queued before them, and those after one.
//! - A **barrier** is any other event; a clear (`ALL_CLEARED`) also discards the queued, unsent
//!   work of its replica. It waits for everything before it and everything after waits for it.
//!
//! [`Pending::count`] is the live work in the stages (prefix entries and events); a debug
//! build checks it against the stages after each change ([`Pending::check`]). Past the bound
//! the oldest queued work is shed ([`Pending::enforce_bound`]), never what is on the wire.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;

use tokio::time::Instant;

use crate::{Metrics, pb};

/// The maps of the hot path hash with foldhash (keys are engine hashes and short ids).
pub(crate) type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The two streams of a window's adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Adds {
    /// Adds with no eviction of their prefix queued before them: sent with the evictions.
    Plain,
    /// Adds that follow an eviction of their prefix: sent once every eviction is acknowledged.
    AfterEvict,
}

// ---------------------------------------------------------------------------------------------
// Interning: identities and adapters are stored once, work refers to them by number.

/// Values stored once and referred to by index. Emptied when the forwarder is idle.
#[derive(Debug)]
pub(crate) struct Interner<T> {
    pub(crate) values: Vec<T>,
    index: Map<T, u32>,
    /// The value asked for last: reports come in runs from one identity, so most lookups are
    /// one compare, not a hash.
    last: Option<u32>,
}

impl<T: Clone + Eq + std::hash::Hash> Interner<T> {
    pub(crate) fn new() -> Self {
        Self {
            values: Vec::new(),
            index: Map::default(),
            last: None,
        }
    }

    pub(crate) fn id(&mut self, value: &T) -> u32 {
        if let Some(last) = self.last
            && self.values[last as usize] == *value
        {
            return last;
        }
        let id = match self.index.get(value) {
            Some(&id) => id,
            None => {
                let id = self.values.len() as u32;
                self.values.push(value.clone());
                self.index.insert(value.clone(), id);
                id
            }
        };
        self.last = Some(id);
        id
    }

    pub(crate) fn get(&self, id: u32) -> &T {
        &self.values[id as usize]
    }

    pub(crate) fn clear(&mut self) {
        self.values.clear();
        self.index.clear();
        self.last = None;
    }
}

/// Who a message is about: replica, model, tenant.
pub(crate) type Scope = (String, String, String);
/// How adds are reported: scope, hash scheme, update-level adapter.
pub(crate) type Group = (u32, String, String);

/// A prefix hash, inline up to 16 bytes (engine ints, fingerprints, xxhash digests).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Prefix {
    Inline(u8, [u8; 16]),
    Heap(Box<[u8]>),
}

impl Prefix {
    fn new(bytes: &[u8]) -> Self {
        if bytes.len() <= 16 {
            let mut b = [0; 16];
            b[..bytes.len()].copy_from_slice(bytes);
            Self::Inline(bytes.len() as u8, b)
        } else {
            Self::Heap(bytes.into())
        }
    }

    pub(crate) fn to_vec(&self) -> Vec<u8> {
        match self {
            Self::Inline(n, b) => b[..*n as usize].to_vec(),
            Self::Heap(b) => b.to_vec(),
        }
    }
}

/// What work on one prefix is keyed by: the add of one adapter conflicts with its eviction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub(crate) scope: u32,
    pub(crate) adapter: u32,
    pub(crate) prefix: Prefix,
}

// ---------------------------------------------------------------------------------------------
// Windows

/// The rarely used parts of a prefix entry, kept out of line.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Extra {
    pub(crate) block_hashes: Vec<Vec<u8>>,
    pub(crate) block_token_counts: Vec<i32>,
}

#[derive(Debug)]
pub(crate) enum Op {
    /// Cancelled, superseded or shed.
    Gone,
    Add {
        key: Key,
        group: u32,
        /// The entry's own `adapter_id` ("" when it leaves it to the update).
        entry_adapter: u32,
        tier: i32,
        token_count: i32,
        timestamp_us: i64,
        /// Which stream carries it: after an eviction of its prefix queued before it, or not.
        stream: Adds,
        extra: Option<Box<Extra>>,
    },
    Evict {
        key: Key,
        timestamp_us: i64,
    },
}

/// A sequence number in a window, or none (`u32::MAX`): 4 bytes instead of 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot(u32);

impl Slot {
    pub(crate) const NONE: Self = Self(u32::MAX);

    pub(crate) fn of(seq: Option<u64>) -> Self {
        seq.and_then(|s| u32::try_from(s).ok())
            .filter(|s| *s != u32::MAX)
            .map_or(Self::NONE, Self)
    }

    pub(crate) fn get(self) -> Option<u64> {
        (self != Self::NONE).then_some(u64::from(self.0))
    }

    pub(crate) fn take(&mut self) -> Option<u64> {
        std::mem::replace(self, Self::NONE).get()
    }
}

impl Default for Slot {
    fn default() -> Self {
        Self::NONE
    }
}

/// The queued work of one prefix in a window (sequence numbers of its ops).
#[derive(Debug, Default)]
pub(crate) struct KeyOps {
    pub(crate) evict: Slot,
    /// By tier (`CacheTier` value 0–3).
    pub(crate) adds: [Slot; 4],
    /// The first of the queued adds was a [`pb::Report::New`].
    pub(crate) first_add_new: bool,
}

impl KeyOps {
    pub(crate) fn has_adds(&self) -> bool {
        self.adds.iter().any(|a| a.get().is_some())
    }
}

#[derive(Debug)]
pub(crate) struct Window {
    pub(crate) opened: Instant,
    /// No more work merges into it: a barrier is queued behind it, or it is in flight.
    pub(crate) sealed: bool,
    pub(crate) ops: VecDeque<Op>,
    /// Sequence number of `ops[0]`.
    pub(crate) first_seq: u64,
    pub(crate) keys: Map<Key, KeyOps>,
    /// Stats-only (or empty) updates: the latest per group.
    pub(crate) stats: Vec<(u32, Option<pb::ReplicaStats>, i64)>,
    /// Live prefix entries and evictions.
    pub(crate) live: usize,
}

impl Window {
    pub(crate) fn new() -> Self {
        Self {
            opened: Instant::now(),
            sealed: false,
            ops: VecDeque::new(),
            first_seq: 0,
            keys: Map::default(),
            stats: Vec::new(),
            live: 0,
        }
    }

    pub(crate) fn op_mut(&mut self, seq: u64) -> Option<&mut Op> {
        let i = seq.checked_sub(self.first_seq)?;
        self.ops.get_mut(i as usize)
    }

    pub(crate) fn push(&mut self, op: Op) -> u64 {
        let seq = self.first_seq + self.ops.len() as u64;
        self.ops.push_back(op);
        self.live += 1;
        seq
    }

    /// Marks the op at `seq` gone; true when it was live.
    pub(crate) fn cancel(&mut self, seq: u64) -> bool {
        match self.op_mut(seq) {
            Some(op) if !matches!(op, Op::Gone) => {
                *op = Op::Gone;
                self.live -= 1;
                true
            }
            _ => false,
        }
    }

    pub(crate) fn entries(&self) -> (u64, u64) {
        let mut adds = 0;
        let mut evicts = 0;
        for op in &self.ops {
            match op {
                Op::Add { .. } => adds += 1,
                Op::Evict { .. } => evicts += 1,
                Op::Gone => {}
            }
        }
        (adds, evicts)
    }
}

#[derive(Debug)]
pub(crate) enum Stage {
    Window(Window),
    /// A clear or another event that orders everything around it.
    Barrier(pb::CacheEvent),
}

impl Stage {
    pub(crate) fn size(&self) -> usize {
        match self {
            Stage::Window(w) => w.live,
            Stage::Barrier(_) => 1,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Intake

/// Every stage not yet settled, the values its work refers to, and its live count.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) scopes: Interner<Scope>,
    pub(crate) groups: Interner<Group>,
    pub(crate) adapters: Interner<String>,
    pub(crate) stages: VecDeque<Stage>,
    /// Live work in the stages, in flight or not: what [`Stage::size`] adds up to.
    pub(crate) count: usize,
}

impl Pending {
    pub(crate) fn new() -> Self {
        Self {
            scopes: Interner::new(),
            groups: Interner::new(),
            adapters: Interner::new(),
            stages: VecDeque::new(),
            count: 0,
        }
    }

    /// In debug builds: the count is what the stages hold.
    pub(crate) fn check(&self) {
        debug_assert_eq!(
            self.count,
            self.stages.iter().map(Stage::size).sum::<usize>(),
            "the pending count strayed from the stages"
        );
    }

    /// Nothing waits: the interned values may go (nothing refers to them).
    pub(crate) fn forget_interned(&mut self) {
        if self.stages.is_empty() && self.scopes.values.len() > 64 {
            self.scopes.clear();
            self.groups.clear();
            self.adapters.clear();
        }
    }

    /// When the open window at the front becomes due, unless the front is on the wire.
    pub(crate) fn flush_at(&self, window: std::time::Duration, in_flight: bool) -> Option<Instant> {
        if in_flight {
            return None;
        }
        match self.stages.front() {
            Some(Stage::Window(w)) if !w.sealed => Some(w.opened + window),
            _ => None,
        }
    }

    /// No more work merges into any window.
    pub(crate) fn seal_all(&mut self) {
        for stage in &mut self.stages {
            if let Stage::Window(w) = stage {
                w.sealed = true;
            }
        }
    }

    /// Takes one report in: into the open window (netted against the work queued there), or
    /// as a barrier stage of its own.
    pub(crate) fn push(&mut self, report: pb::Report, in_flight: bool, metrics: &Metrics) {
        match report {
            pb::Report::Update(update) => self.add(update, false, metrics),
            pb::Report::New(update) => self.add(update, true, metrics),
            pb::Report::Event(event) => {
                let kind = event.r#type;
                if kind == pb::cache_event::Type::PrefixEvicted as i32 {
                    self.evict(event, metrics);
                } else {
                    if kind == pb::cache_event::Type::AllCleared as i32 {
                        self.supersede(&event.replica_id, in_flight, metrics);
                    }
                    if let Some(Stage::Window(w)) = self.stages.back_mut() {
                        w.sealed = true;
                    }
                    self.stages.push_back(Stage::Barrier(event));
                    self.count += 1;
                }
            }
        }
    }

    /// The open window at the back, made if needed.
    pub(crate) fn open_window(&mut self) -> &mut Window {
        // Sequence numbers are kept in 32 bits: a window that shed work for hours starts anew.
        let open =
            |w: &Window| !w.sealed && w.first_seq + (w.ops.len() as u64) < u64::from(u32::MAX - 1);
        if !matches!(self.stages.back(), Some(Stage::Window(w)) if open(w)) {
            if let Some(Stage::Window(w)) = self.stages.back_mut() {
                w.sealed = true;
            }
            self.stages.push_back(Stage::Window(Window::new()));
        }
        match self.stages.back_mut() {
            Some(Stage::Window(w)) => w,
            _ => unreachable!("a window was just pushed"),
        }
    }

    fn add(&mut self, mut update: pb::CacheStateUpdate, new: bool, metrics: &Metrics) {
        let scope = self.scopes.id(&(
            std::mem::take(&mut update.replica_id),
            std::mem::take(&mut update.model_id),
            std::mem::take(&mut update.tenant_id),
        ));
        let group = (
            scope,
            std::mem::take(&mut update.hash_scheme),
            std::mem::take(&mut update.adapter_id),
        );
        let update_adapter = self.adapters.id(&group.2);
        let group = self.groups.id(&group);
        let entries: Vec<(Key, u32, pb::PrefixEntry)> = update
            .prefixes
            .into_iter()
            .map(|mut p| {
                let entry_adapter = self.adapters.id(&p.adapter_id);
                let adapter = if p.adapter_id.is_empty() {
                    update_adapter
                } else {
                    entry_adapter
                };
                let key = Key {
                    scope,
                    adapter,
                    prefix: Prefix::new(&std::mem::take(&mut p.prefix_hash)),
                };
                (key, entry_adapter, p)
            })
            .collect();
        let ts = update.timestamp_us;
        let w = self.open_window();
        if entries.is_empty() {
            match w.stats.iter_mut().find(|(g, _, _)| *g == group) {
                Some(slot) => *slot = (group, update.stats, ts),
                None => w.stats.push((group, update.stats, ts)),
            }
            return;
        }
        let mut added: usize = 0;
        let mut coalesced = 0;
        for (key, entry_adapter, p) in entries {
            let tier = p.tier.clamp(0, 3);
            let extra =
                (!p.block_hashes.is_empty() || !p.block_token_counts.is_empty()).then(|| {
                    Box::new(Extra {
                        block_hashes: p.block_hashes,
                        block_token_counts: p.block_token_counts,
                    })
                });
            let ko = w.keys.entry(key.clone()).or_default();
            let stream = if ko.evict.get().is_some() {
                Adds::AfterEvict
            } else {
                Adds::Plain
            };
            let existing = ko.adds[tier as usize].get();
            if existing.is_none() && !ko.has_adds() {
                ko.first_add_new = new;
            }
            let seq = w.first_seq + w.ops.len() as u64;
            ko.adds[tier as usize] = Slot::of(Some(seq));
            // A repeated add replaces the queued one and moves to the back, so adds of one
            // prefix at several tiers keep their order (the last tier reported wins).
            if existing.is_some_and(|old| w.cancel(old)) {
                coalesced += 1;
            } else {
                added += 1;
            }
            w.push(Op::Add {
                key,
                group,
                entry_adapter,
                tier,
                token_count: p.token_count,
                timestamp_us: ts,
                stream,
                extra,
            });
        }
        self.count += added;
        metrics.coalesced.fetch_add(coalesced, Relaxed);
    }

    fn evict(&mut self, event: pb::CacheEvent, metrics: &Metrics) {
        let scope = self
            .scopes
            .id(&(event.replica_id, event.model_id, event.tenant_id));
        let adapter = self.adapters.id(&event.adapter_id);
        let key = Key {
            scope,
            adapter,
            prefix: Prefix::new(&event.prefix_hash),
        };
        let ts = event.timestamp_us;
        let w = self.open_window();
        let ko = w.keys.entry(key.clone()).or_default();
        let adds: Vec<u64> = ko.adds.iter_mut().filter_map(Slot::take).collect();
        let earlier_evict = ko.evict.get().is_some();
        let first_new = ko.first_add_new;
        // The queued adds of the prefix are moot: it is evicted after them.
        let mut cancelled = 0;
        for seq in adds.iter().copied() {
            cancelled += u64::from(w.cancel(seq));
        }
        let removed = cancelled as usize;
        // The server does not hold the prefix if an eviction of it is queued already, or if
        // the first queued add was its first report: then this eviction is moot too.
        let moot = earlier_evict || (!adds.is_empty() && first_new);
        if moot {
            cancelled += 1;
            if !earlier_evict {
                w.keys.remove(&key);
            }
            self.count -= removed;
        } else {
            let seq = w.push(Op::Evict {
                key: key.clone(),
                timestamp_us: ts,
            });
            if let Some(ko) = w.keys.get_mut(&key) {
                ko.evict = Slot::of(Some(seq));
            }
            self.count = self.count - removed + 1;
        }
        metrics.cancelled.fetch_add(cancelled, Relaxed);
    }

    /// A clear for `replica` makes every queued, not in-flight add and event of it moot.
    fn supersede(&mut self, replica: &str, in_flight: bool, metrics: &Metrics) {
        let skip = usize::from(in_flight);
        let scopes: Vec<u32> = (0..self.scopes.values.len() as u32)
            .filter(|&s| self.scopes.get(s).0 == replica)
            .collect();
        let mut superseded = 0;
        let groups = &self.groups;
        let mut kept = VecDeque::with_capacity(self.stages.len());
        for (i, mut stage) in self.stages.drain(..).enumerate() {
            if i < skip {
                kept.push_back(stage);
                continue;
            }
            match &mut stage {
                Stage::Barrier(e) if e.replica_id == replica => {
                    superseded += 1;
                    continue;
                }
                Stage::Barrier(_) => {}
                Stage::Window(w) => {
                    for op in w.ops.iter_mut() {
                        let mine = match op {
                            Op::Add { key, .. } | Op::Evict { key, .. } => {
                                scopes.contains(&key.scope)
                            }
                            Op::Gone => false,
                        };
                        if mine {
                            *op = Op::Gone;
                            w.live -= 1;
                            superseded += 1;
                        }
                    }
                    w.keys.retain(|k, _| !scopes.contains(&k.scope));
                    w.stats
                        .retain(|(g, _, _)| !scopes.contains(&groups.get(*g).0));
                    if w.live == 0 && w.stats.is_empty() {
                        continue;
                    }
                }
            }
            kept.push_back(stage);
        }
        self.stages = kept;
        self.count -= superseded;
        metrics
            .superseded_by_clear
            .fetch_add(superseded as u64, Relaxed);
    }

    /// The live work waiting behind the stage on the wire (all of it when none is).
    pub(crate) fn queued(&self, in_flight: bool) -> usize {
        let on_the_wire = match self.stages.front() {
            Some(stage) if in_flight => stage.size(),
            _ => 0,
        };
        self.count - on_the_wire
    }

    /// Sheds the oldest queued work (never what is in flight, never a barrier) until at most
    /// `max_pending` waits behind the flight: the (prefixes, events) shed.
    pub(crate) fn enforce_bound(&mut self, max_pending: usize, in_flight: bool) -> (u64, u64) {
        let skip = usize::from(in_flight);
        let mut queued = self.queued(in_flight);
        if queued <= max_pending {
            return (0, 0);
        }
        let mut shed = [0u64; 2];
        for stage in self.stages.iter_mut().skip(skip) {
            let Stage::Window(w) = stage else {
                continue;
            };
            while queued > max_pending {
                let Some(op) = w.ops.pop_front() else {
                    break;
                };
                let seq = w.first_seq;
                w.first_seq += 1;
                let (key, is_add) = match op {
                    Op::Gone => continue,
                    Op::Add { key, .. } => (key, true),
                    Op::Evict { key, .. } => (key, false),
                };
                w.live -= 1;
                queued -= 1;
                shed[usize::from(!is_add)] += 1;
                if let Some(ko) = w.keys.get_mut(&key) {
                    if ko.evict.get() == Some(seq) {
                        ko.evict = Slot::NONE;
                    }
                    for a in &mut ko.adds {
                        if a.get() == Some(seq) {
                            *a = Slot::NONE;
                        }
                    }
                    if ko.evict.get().is_none() && !ko.has_adds() {
                        w.keys.remove(&key);
                    }
                }
            }
            if queued <= max_pending {
                break;
            }
        }
        self.stages.retain(
            |s| !matches!(s, Stage::Window(w) if w.live == 0 && w.stats.is_empty() && w.sealed),
        );
        self.count -= (shed[0] + shed[1]) as usize;
        (shed[0], shed[1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a queued entry costs: its op, plus its key and slots in the window's index.
    #[test]
    fn queued_entries_are_small() {
        let op = std::mem::size_of::<Op>();
        let index = std::mem::size_of::<(Key, KeyOps)>() + 1;
        assert!(op <= 72, "op {op} bytes");
        assert!(index <= 64, "index entry {index} bytes");
    }
}
