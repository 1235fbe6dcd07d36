#![doc = include_str!("../README.md")]

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Instant;

use kvevent_mapper::{self as mapper, Identity, Mapper};
use kvevent_table::Entry as TableEntry;
use kvevent_wire as wire;

pub use mapper::KeyMode;

mod holders;
mod keys;
mod lapse;
mod lease;
mod score;
mod state;
#[cfg(test)]
mod tests;

pub use keys::{IndexStats, fold_key};
pub use kvevent_scrape::{Load, RankLoad};
pub use score::{Score, Scores, ScoresIter};
pub use state::{Degraded, LoadReading, Lost, ReplicaState};

use holders::*;
use keys::*;
use lapse::*;
use lease::Leases;

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A source's handle, from [`Index::add_source`]: its slot and which use of the slot it is.
/// A source's slot is reused once it is removed; a handle kept after that names nothing, and
/// every call with it does nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceId {
    slot: u32,
    generation: u32,
}

/// The index follows [`MAX_SOURCES`] sources at once already: no slot is free for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the index follows {MAX_SOURCES} sources at once already (remove some first)")]
pub struct TooManySources;

/// Where a matched prefix is: the mapper's tier of its blocks.
pub use mapper::Tier;

/// How the index is bounded.
#[derive(Debug, Clone)]
pub struct Config {
    /// Most bytes the key tables and holder lists may hold (tables by their capacity, free
    /// slots included). The per-source block maps the key rules need are apart
    /// ([`IndexStats::mapper_bytes`]), bounded by `mapping.max_tracked_blocks` a source.
    /// Default 1 GiB.
    pub byte_budget: usize,
    /// How sources map events to keys (key mode, adapters, offload tier, hybrid models).
    pub mapping: mapper::Options,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            byte_budget: 1 << 30,
            mapping: mapper::Options {
                key_mode: KeyMode::Fingerprint,
                ..mapper::Options::default()
            },
        }
    }
}

/// What a query asks about.
#[derive(Debug, Clone)]
pub enum QueryKeys<'a> {
    /// Token ids, chained into fingerprints with this block size (fingerprint key mode).
    Tokens {
        /// The prompt's token ids.
        ids: &'a [u32],
        /// The model's block size.
        block_size: usize,
    },
    /// Prefix keys as the index stores them, block 0 first.
    Keys(&'a [u64]),
}

/// One request: its adapter ("" for the base model) and its blocks.
#[derive(Debug, Clone)]
pub struct Query<'a> {
    /// The LoRA adapter's name, "" for the base model.
    pub adapter: &'a str,
    /// The request's blocks.
    pub keys: QueryKeys<'a>,
}

/// A change already keyed, for [`Index::apply_keys`]: what a sidecar's feed carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyChange<'a> {
    /// The source holds the prefix `key` (its fingerprint) of `adapter` ("" for the base model)
    /// covering `tokens` tokens, at `tier`.
    Stored {
        /// The prefix key.
        key: u64,
        /// Cumulative token count.
        tokens: u32,
        /// Where it is held.
        tier: Tier,
        /// The LoRA adapter, "" for the base model.
        adapter: &'a str,
    },
    /// The source no longer holds the prefix.
    Evicted {
        /// The prefix key.
        key: u64,
        /// The LoRA adapter, "" for the base model.
        adapter: &'a str,
    },
    /// Everything the source held is gone.
    Cleared,
}

/// Sources an index follows at once, at most (17 bits of a holder word, less one value).
pub const MAX_SOURCES: u32 = (1 << 17) - 1;

#[derive(Debug, Default)]
struct Inner {
    /// Replica names by number; answers share them (a replica added while an answer holds
    /// them copies the list). A free number keeps its last name until it is reused.
    replicas: Arc<Vec<Arc<str>>>,
    /// Each replica's state, by number, as its follower last said (exact until then); answers
    /// share it like the names.
    states: Arc<Vec<ReplicaState>>,
    /// Each replica's load, by number, as its follower last said (none until then); answers
    /// share it like the states.
    loads: Arc<Vec<Option<Arc<LoadReading>>>>,
    /// Each replica's lease, by number (none until its follower renews one); answers share
    /// the table and judge it when made.
    leases: Arc<Leases>,
    replica_ids: Map<Arc<str>, u32>,
    /// The replicas in use, in name order: answers are sorted stably from it, by numbers,
    /// not names.
    by_name: Vec<u32>,
    replica_slots: Vec<ReplicaSlot>,
    free_replicas: Vec<u32>,
    sources: Vec<Source>,
    /// Per source slot, what scoring reads of it ([`Scoring`]).
    scoring: Vec<Scoring>,
    /// Slots of removed sources, reused first.
    free_sources: Vec<u32>,
    sweep: Sweep,
    adapters: Map<String, u32>,
    young: Keys,
    old: Keys,
    lists: Lists,
    /// How many times a source's holders lapsed (an epoch moved on, a source was removed),
    /// wrapping: a holder list stamped with the current count holds no lapsed holder.
    lapses: u32,
    /// Heap bytes of the holder lists in each generation (the tables are measured by their
    /// capacity).
    young_bytes: usize,
    old_bytes: usize,
    /// Holders and sharing, as they change.
    shares: Shares,
    stats: IndexStats,
    /// Keys expected once every snapshot announced is in ([`Index::reserve`]); 0 once they
    /// are all in and the room not used went back.
    room: usize,
    /// Changes, in order, with their sources, waiting for [`Inner::flush`] (kept for its
    /// capacity).
    pending: Vec<(u32, Op)>,
}

/// The index and, beside it (so that a mapper can write into the index while it maps), a
/// mapper per source for the key rules.
#[derive(Debug, Default)]
struct State {
    inner: Inner,
    mappers: Vec<Mapper>,
}

/// The prefix index. Share it (`Arc<Index>`) between the thread applying events and the
/// threads scoring.
#[derive(Debug)]
pub struct Index {
    config: Config,
    /// The identity of every source's mapper (stamped on reports; the index takes keys only).
    identity: Identity,
    state: RwLock<State>,
}

impl Index {
    /// An empty index.
    pub fn new(config: Config) -> Self {
        Self {
            config,
            // Constant and valid: the mapper's identity is stamped on reports, which the index never
            // makes.
            identity: Identity::new("index", "index", "", "index").expect("a valid identity"),
            state: RwLock::new(State::default()),
        }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn mapper(&self) -> Mapper {
        Mapper::new(self.identity.clone(), self.config.mapping.clone())
    }

    /// Starts following a source of `replica` (its engine, or one DP rank of it). A removed
    /// source's slot is reused, so an index's memory follows the sources followed now, not
    /// every one it ever had.
    pub fn add_source(&self, replica: &str) -> Result<SourceId, TooManySources> {
        self.add(replica, true)
    }

    /// A source of `replica` that takes changes but counts in no answer until
    /// [`Index::promote`]: a snapshot loads into it while the replica's previous source goes
    /// on counting, so no answer ever sees half a replica.
    pub fn add_loading_source(&self, replica: &str) -> Result<SourceId, TooManySources> {
        self.add(replica, false)
    }

    /// Makes a loading source count and, in the same step, stops `retire` (the source the
    /// snapshot replaces) from counting: one write lock, so an answer sees the old state or
    /// the new, never a mix. The retired source's entries are reclaimed incrementally.
    pub fn promote(&self, source: SourceId, retire: Option<SourceId>) {
        let mut state = self.write();
        let State { inner, mappers } = &mut *state;
        if let Some(slot) = inner.live(source) {
            inner.sources[slot as usize].counting = true;
            inner.rescore(slot);
        }
        if let Some(old) = retire.filter(|old| *old != source) {
            inner.retire(old, mappers, || self.mapper());
        }
        inner.fit_after_load();
        inner.sweep(SWEEP_PER_CALL);
    }

    /// Makes room for the keys of `blocks` blocks about to arrive at once (a snapshot of a
    /// replica joining, [`Index::add_loading_source`]): the key tables grow once instead of
    /// step by step as the blocks come (each step moves every key; a fleet joining from empty
    /// spent more than half its load growing). Blocks other sources already hold add no key,
    /// so the room is estimated from the keys a pair so far; what goes unused is given back
    /// when no snapshot loads any more ([`Index::promote`]). Nothing is reserved past the byte
    /// budget, nor for a load small beside what the index holds.
    pub fn reserve(&self, blocks: usize) {
        let budget = self.config.byte_budget;
        self.write().inner.reserve(blocks, budget);
    }

    /// Stops following `source` (one of a replica's): its entries stop counting at once and
    /// are reclaimed incrementally; its slot is free for another source.
    pub fn remove_source(&self, source: SourceId) {
        let mut state = self.write();
        let State { inner, mappers } = &mut *state;
        let loading = inner
            .live(source)
            .is_some_and(|slot| !inner.sources[slot as usize].counting);
        inner.retire(source, mappers, || self.mapper());
        if loading {
            // A snapshot given up (its stream lost, or another replacing it): what was
            // announced no longer counts, or streams that keep reconnecting would make the
            // room grow without end. Snapshots still loading announce again only if they
            // start over; the ordinary growth covers the rest.
            inner.room = inner.room.min(inner.young.len());
        }
        inner.fit_after_load();
        inner.sweep(SWEEP_PER_CALL);
    }

    /// Applies changes already keyed (a sidecar's feed: prefix fingerprints, not engine
    /// events), in order.
    pub fn apply_keys(&self, source: SourceId, changes: &[KeyChange<'_>]) {
        let mut state = self.write();
        let inner = &mut state.inner;
        let Some(slot) = inner.live(source) else {
            return;
        };
        let budget = self.config.byte_budget;
        // Changes are queued with their buckets prefetched, then applied in order, a window of
        // `TOUCH_AHEAD` at a time: their cache misses overlap. The adapter's number is looked
        // up once for a run of changes of one adapter.
        let mut last: Option<(&str, Option<u32>)> = None;
        for change in changes {
            let (key, op) = match *change {
                KeyChange::Stored {
                    key,
                    tokens,
                    tier,
                    adapter,
                } => {
                    let id = match last {
                        Some((name, Some(id))) if name == adapter => id,
                        _ => inner.adapter(adapter),
                    };
                    last = Some((adapter, Some(id)));
                    let key = KeyId::new(key, id);
                    let tier = u8::from(tier != Tier::T1);
                    (key, Op::Store { key, tier, tokens })
                }
                KeyChange::Evicted { key, adapter } => {
                    let id = match last {
                        Some((name, id)) if name == adapter => id,
                        _ => inner.adapters.get(adapter).copied(),
                    };
                    last = Some((adapter, id));
                    // An adapter never stored holds nothing.
                    let Some(id) = id else { continue };
                    let key = KeyId::new(key, id);
                    (key, Op::Evict { key })
                }
                KeyChange::Cleared => {
                    inner.flush(inner.pending.len(), budget);
                    inner.lapse(slot);
                    continue;
                }
            };
            inner.prefetch_key(&key);
            inner.pending.push((slot, op));
            if inner.pending.len() >= kvevent_table::TOUCH_AHEAD {
                inner.flush(inner.pending.len(), budget);
            }
        }
        inner.flush(inner.pending.len(), budget);
        inner.sweep(SWEEP_PER_CALL + SWEEP_PER_CHANGE * changes.len());
    }

    fn add(&self, replica: &str, counting: bool) -> Result<SourceId, TooManySources> {
        let mut state = self.write();
        let State { inner, mappers } = &mut *state;
        let slot = match inner.free_sources.pop() {
            Some(slot) => slot,
            None if inner.sources.len() >= MAX_SOURCES as usize => return Err(TooManySources),
            None => {
                inner.sources.push(Source {
                    replica: 0,
                    epoch: 1,
                    generation: 0,
                    live: false,
                    counting: false,
                    adapter: None,
                });
                mappers.push(self.mapper());
                (inner.sources.len() - 1) as u32
            }
        };
        let replica = inner.replica(replica);
        inner.replica_slots[replica as usize].sources += 1;
        let s = &mut inner.sources[slot as usize];
        // A reused slot keeps its epoch (moved on when its source was removed) and its fresh
        // mapper; only which use of it this is changes.
        s.generation = s.generation.wrapping_add(1);
        *s = Source {
            replica,
            epoch: s.epoch,
            generation: s.generation,
            live: true,
            counting,
            adapter: None,
        };
        let generation = s.generation;
        inner.rescore(slot);
        Ok(SourceId { slot, generation })
    }

    /// Applies one decoded batch of `source`, in seq order.
    pub fn apply(&self, source: SourceId, batch: &wire::EventBatch<'_>) {
        self.apply_many(&[(source, batch)]);
    }

    /// Applies decoded batches, in order (each source's in seq order), under one write lock:
    /// the same as applying them one by one. Each batch's map memory is prefetched before it
    /// is mapped, and its key-table control words as the mapper makes each change.
    pub fn apply_many(&self, batches: &[(SourceId, &wire::EventBatch<'_>)]) {
        let mut state = self.write();
        let State { inner, mappers } = &mut *state;
        let budget = self.config.byte_budget;
        let mut events = 0;
        for &(source, batch) in batches {
            let Some(slot) = inner.live(source) else {
                continue;
            };
            // The mapper writes keys straight in: no report is made.
            let mut apply = Apply {
                inner,
                source: slot,
                budget,
            };
            mappers[slot as usize].map_batch_into(batch, &mut apply);
            let n = inner.pending.len();
            events += n;
            inner.flush(n, budget);
        }
        inner.sweep(SWEEP_PER_CALL + SWEEP_PER_CHANGE * events);
    }

    /// Everything known of `source` is stale (an engine restart, a gap that could not be
    /// repaired): its entries stop counting, the other sources' stay.
    pub fn reset(&self, source: SourceId) {
        let mut state = self.write();
        let State { inner, mappers } = &mut *state;
        let Some(slot) = inner.live(source) else {
            return;
        };
        mappers[slot as usize].reset(0);
        inner.lapse(slot);
        inner.sweep(SWEEP_PER_CALL);
    }

    /// Says how far `replica`'s entries can be trusted, as its follower knows: every
    /// [`Score`] of it carries this state from now on. A replica whose state was set stays
    /// known (in [`Index::score_among`]'s answers, matching nothing) even while it has no
    /// source, until [`Index::remove_replica`].
    pub fn set_replica_state(&self, replica: &str, state: ReplicaState) {
        let mut guard = self.write();
        let inner = &mut guard.inner;
        let id = inner.replica(replica);
        inner.replica_slots[id as usize].state_set = true;
        Arc::make_mut(&mut inner.states)[id as usize] = state;
    }

    /// Says how long what `replica`'s follower said holds: until `until` (`None`: for as long
    /// as it says, the default). An answer made later says its state is
    /// [`Degraded::LeaseExpired`] where the follower said `Exact`. A follower renews it each
    /// time it hears from the replica (no write lock: an atomic store), so that a follower that
    /// stops running cannot leave `exact` answers behind it. Does nothing for a replica the
    /// index does not know.
    pub fn renew_lease(&self, replica: &str, until: Option<Instant>) {
        let guard = self.read();
        if let Some(&id) = guard.inner.replica_ids.get(replica) {
            guard.inner.leases.set(id, until);
        }
    }

    /// True when `replica`'s follower's lease has run out ([`Index::renew_lease`]): what it
    /// said is not to be taken as exact now.
    pub fn lease_expired(&self, replica: &str) -> bool {
        let guard = self.read();
        let leases = &guard.inner.leases;
        guard
            .inner
            .replica_ids
            .get(replica)
            .is_some_and(|&id| leases.expired(id, leases.now()))
    }

    /// Says what `replica`'s engine was doing when last read (`None`: nothing known): every
    /// [`Score`] of it carries this load from now on. Like the state, it makes the replica
    /// known.
    pub fn set_replica_load(&self, replica: &str, load: Option<LoadReading>) {
        let mut guard = self.write();
        let inner = &mut guard.inner;
        let id = inner.replica(replica);
        inner.replica_slots[id as usize].state_set = true;
        Arc::make_mut(&mut inner.loads)[id as usize] = load.map(Arc::new);
    }

    /// Stops following every source of `replica` and forgets it: its entries stop counting
    /// at once and are reclaimed incrementally (no scan of the table here), its sources' slots
    /// and its name are free for others.
    pub fn remove_replica(&self, replica: &str) {
        let mut state = self.write();
        let State { inner, mappers } = &mut *state;
        let Some(&id) = inner.replica_ids.get(replica) else {
            return;
        };
        inner.replica_slots[id as usize].state_set = false;
        Arc::make_mut(&mut inner.states)[id as usize] = ReplicaState::Exact;
        Arc::make_mut(&mut inner.loads)[id as usize] = None;
        inner.leases.set(id, None);
        let gone: Vec<SourceId> = inner
            .sources
            .iter()
            .enumerate()
            .filter(|(_, s)| s.live && s.replica == id)
            .map(|(slot, s)| SourceId {
                slot: slot as u32,
                generation: s.generation,
            })
            .collect();
        for source in gone {
            inner.retire(source, mappers, || self.mapper());
        }
        // With no source, nothing keeps it now.
        inner.release_replica(id);
        inner.sweep(SWEEP_PER_CALL);
    }

    /// Engine blocks `source` holds now, as its mapper tracks them (0 for a source fed keys
    /// with [`Index::apply_keys`], which has no mapper state, and for one no longer followed).
    pub fn source_blocks(&self, source: SourceId) -> usize {
        let state = self.read();
        match state.inner.live(source) {
            Some(slot) => state.mappers[slot as usize].tracked_blocks(),
            None => 0,
        }
    }

    /// Sizes and counters.
    pub fn stats(&self) -> IndexStats {
        let state = self.read();
        let inner = &state.inner;
        let mut stats = inner.stats.clone();
        stats.keys = inner.young.len() + inner.old.len();
        stats.pairs = inner.shares.held as usize;
        stats.shared_pairs = inner.shares.shared;
        stats.table_bytes = inner.young.bytes() + inner.old.bytes();
        stats.sources = inner.sources.iter().filter(|s| s.live).count();
        stats.source_slots = inner.sources.len();
        stats.replica_slots = inner.replica_slots.len();
        stats.stashed = inner.young.stashed()
            + inner.old.stashed()
            + state
                .mappers
                .iter()
                .map(Mapper::stashed_blocks)
                .sum::<usize>();
        stats.bytes = stats.table_bytes + inner.young_bytes + inner.old_bytes;
        stats.mapper_bytes = inner
            .sources
            .iter()
            .zip(&state.mappers)
            .filter(|(s, _)| s.live)
            .map(|(_, m)| m.tracked_bytes())
            .sum();
        stats
    }

    /// Per replica holding at least block 0 of the query: its longest match from block 0 on,
    /// best first (most tokens, most blocks, T1 before T2, then name).
    pub fn score(&self, query: &Query<'_>) -> Scores {
        self.read().inner.score(&query.keys, query.adapter, None)
    }

    /// [`Index::score`] among `candidates` (the replicas a request may go to): every
    /// candidate the index knows is in the answer, matching or not (0 blocks), best first;
    /// those it does not know are named by position in [`Scores::unknown`]. A candidate named
    /// twice is answered once.
    pub fn score_among(&self, query: &Query<'_>, candidates: &[&str]) -> Scores {
        self.read()
            .inner
            .score(&query.keys, query.adapter, Some(candidates))
    }
}
