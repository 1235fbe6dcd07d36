//! The per-source mapper.

use std::cell::Cell;
use std::sync::Arc;

use std::time::{Duration, Instant};

use crate::blocks::{BlockId, Blocks, Insert, Snapshot, T1, T2, Touched, Tracked};
use crate::{Identity, KeyMode, Options, Tier, fingerprint, fingerprint_key, pb, tier_of, wire};

/// What the mapper did and refused, since it was made. Plain counters: the caller exports them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapperStats {
    /// Batches mapped.
    pub batches: u64,
    /// BlockStored events seen.
    pub stored_events: u64,
    /// BlockRemoved events seen.
    pub removed_events: u64,
    /// AllBlocksCleared events seen.
    pub cleared_events: u64,
    /// Events of unknown type skipped by the decoder.
    pub unknown_events: u64,
    /// Prefix entries produced (adds and T2 re-reports).
    pub prefixes: u64,
    /// `PREFIX_EVICTED` events produced.
    pub evictions: u64,
    /// Removals re-reported at the tier that still holds the block instead of evicted: GPU
    /// removals with an offload tier, or blocks also stored on another medium.
    pub offload_rereports: u64,
    /// Offloading placeholders (`block_size` 0): carry no prefix, not forwarded.
    pub placeholder_stores: u64,
    /// Stores dropped because their `lora_id` has no configured name.
    pub unknown_adapter_drops: u64,
    /// Stores whose non-nil parent was never seen (count restarts at 0).
    pub unknown_parents: u64,
    /// Removed hashes never seen stored (fingerprint mode: skipped).
    pub unknown_removals: u64,
    /// Blocks that could not be keyed correctly (fingerprint mode: token ids do not cover the
    /// blocks, or the parent was itself unkeyable): not reported.
    pub unkeyable_blocks: u64,
    /// Blocks not tracked because the per-source map was full.
    pub map_refusals: u64,
    /// Blocks stored with fewer tokens than the source's page size (the largest `block_size`
    /// it has sent): SGLang sends a radix node's last page short. Reported as they come, keyed
    /// over their own tokens, so a query matches them only where its blocks end as theirs do;
    /// counted so that a page size that varies for another reason shows.
    pub short_blocks: u64,
    /// Block hashes that were an empty `bin`: not a key, skipped.
    pub empty_hashes: u64,
    /// Prefix entries re-reported by [`Mapper::refresh`] (resident blocks, so the server's TTL
    /// never expires them).
    pub refreshed: u64,
    /// Blocks of hybrid-model groups that are not full attention, by `kv_cache_spec_kind`:
    /// not reported (unless `Options::all_kv_groups`).
    pub non_prefix_groups: std::collections::BTreeMap<String, u64>,
}

/// Where a mapper's output goes: the contract's reports ([`Mapper::map_batch`]), or the keys
/// straight into a consumer's own index ([`Mapper::map_batch_into`]), with no protobuf
/// message made. Calls come in event order.
pub trait Sink {
    /// A prefix is present at `tier` (`new`: the first report of this block, the server cannot
    /// hold it yet). `key` is the reported key: 8 bytes (an int hash or a fingerprint,
    /// big-endian) or a digest's bytes; `tokens` the cumulative token count.
    fn prefix(&mut self, key: &[u8], tokens: u32, tier: Tier, adapter: &Arc<str>, new: bool);
    /// The prefixes since the last call belong together (one stored event, or one re-report
    /// at another tier), made at batch time `ts` (µs).
    fn end_update(&mut self, ts: i64);
    /// A prefix is gone from the engine.
    fn evicted(&mut self, key: &[u8], adapter: &Arc<str>, ts: i64);
    /// Everything of this source is gone (an engine clear).
    fn cleared(&mut self, ts: i64);
}

/// The contract's reports: one update per stored event (first reports as `New`, re-reports as
/// `Update`), one event per eviction or clear.
struct Reports<'o> {
    identity: Arc<Identity>,
    out: &'o mut Vec<pb::Report>,
    fresh: Vec<pb::PrefixEntry>,
    again: Vec<pb::PrefixEntry>,
}

impl<'o> Reports<'o> {
    fn new(identity: Arc<Identity>, out: &'o mut Vec<pb::Report>) -> Self {
        Self {
            identity,
            out,
            fresh: Vec::new(),
            again: Vec::new(),
        }
    }
}

impl Sink for Reports<'_> {
    fn prefix(&mut self, key: &[u8], tokens: u32, tier: Tier, adapter: &Arc<str>, new: bool) {
        let entry = pb::PrefixEntry {
            prefix_hash: key.to_vec(),
            token_count: i32::try_from(tokens).unwrap_or(i32::MAX),
            tier: pb::CacheTier::from(tier) as i32,
            adapter_id: adapter.to_string(),
            ..Default::default()
        };
        if new {
            self.fresh.push(entry);
        } else {
            self.again.push(entry);
        }
    }

    fn end_update(&mut self, ts: i64) {
        for new in [true, false] {
            let list = if new {
                &mut self.fresh
            } else {
                &mut self.again
            };
            if list.is_empty() {
                continue;
            }
            let mut update = self.identity.update(ts);
            update.prefixes = std::mem::take(list);
            self.out.push(if new {
                pb::Report::New(update)
            } else {
                pb::Report::Update(update)
            });
        }
    }

    fn evicted(&mut self, key: &[u8], adapter: &Arc<str>, ts: i64) {
        self.out.push(pb::Report::Event(self.identity.event(
            pb::cache_event::Type::PrefixEvicted,
            key.to_vec(),
            adapter,
            ts,
        )));
    }

    fn cleared(&mut self, ts: i64) {
        self.out.push(pb::Report::Event(self.identity.event(
            pb::cache_event::Type::AllCleared,
            Vec::new(),
            "",
            ts,
        )));
    }
}

/// Where a block's changes go, given its reported key (`None`: it has none in this key mode)
/// and its fingerprint (`None`: not kept, or not keyable).
trait Emit {
    fn prefix(
        &mut self,
        key: Option<&[u8]>,
        fingerprint: Option<u64>,
        tokens: u32,
        tier: Tier,
        adapter: &Arc<str>,
        new: bool,
    );
    fn end_update(&mut self, ts: i64);
    fn evicted(
        &mut self,
        key: Option<&[u8]>,
        fingerprint: Option<u64>,
        adapter: &Arc<str>,
        ts: i64,
    );
    fn cleared(&mut self, ts: i64);
}

/// The key mode's keys into `keys`; with `fingerprints`, fingerprints into it too, from the same
/// pass.
struct Out<'s, S, F> {
    keys: &'s mut S,
    fingerprints: Option<&'s mut F>,
}

impl<S: Sink, F: Sink> Emit for Out<'_, S, F> {
    fn prefix(
        &mut self,
        key: Option<&[u8]>,
        fingerprint: Option<u64>,
        tokens: u32,
        tier: Tier,
        adapter: &Arc<str>,
        new: bool,
    ) {
        if let Some(key) = key {
            self.keys.prefix(key, tokens, tier, adapter, new);
        }
        if let (Some(out), Some(p)) = (self.fingerprints.as_deref_mut(), fingerprint) {
            out.prefix(&fingerprint::wire_key(p), tokens, tier, adapter, new);
        }
    }

    fn end_update(&mut self, ts: i64) {
        self.keys.end_update(ts);
        if let Some(out) = self.fingerprints.as_deref_mut() {
            out.end_update(ts);
        }
    }

    fn evicted(
        &mut self,
        key: Option<&[u8]>,
        fingerprint: Option<u64>,
        adapter: &Arc<str>,
        ts: i64,
    ) {
        if let Some(key) = key {
            self.keys.evicted(key, adapter, ts);
        }
        if let (Some(out), Some(p)) = (self.fingerprints.as_deref_mut(), fingerprint) {
            out.evicted(&fingerprint::wire_key(p), adapter, ts);
        }
    }

    fn cleared(&mut self, ts: i64) {
        self.keys.cleared(ts);
        if let Some(out) = self.fingerprints.as_deref_mut() {
            out.cleared(ts);
        }
    }
}

/// Maps one engine source's batches to reports. Keep one per (endpoint, DP rank).
#[derive(Debug)]
pub struct Mapper {
    pub(crate) identity: Arc<Identity>,
    pub(crate) options: Options,
    base_adapter: Arc<str>,
    pub(crate) blocks: Blocks,
    stats: MapperStats,
    /// KV-cache groups seen with a kind that is not a reusable prefix.
    pub(crate) skipped_groups: Vec<Option<i64>>,
    /// The refresh cycle under way.
    refresh: Option<RefreshCycle>,
    /// The largest `block_size` seen: the source's page size.
    page_size: u32,
}

/// Most elements a store's scratch buffers keep between stores (16 KiB of token ids).
const SCRATCH_KEPT: usize = 4096;

thread_local! {
    /// A store's token ids and prefix fingerprints, kept for their capacity: one pair per
    /// thread, not per mapper, so a writer that drives many sources' mappers (an index of 1,024
    /// replicas) writes into buffers still in its cache rather than into each mapper's cold
    /// ones. Empty between stores. A store that fingerprints takes them out while it runs: a
    /// sink that maps a store on the same thread gets new buffers, never a borrow panic.
    static SCRATCH: Cell<(Vec<u32>, Vec<u64>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// One pass of [`Mapper::refresh`] over the blocks tracked when it began.
#[derive(Debug)]
struct RefreshCycle {
    ids: Snapshot,
    next: usize,
    started: Instant,
}

/// A store's adapter name: borrowed from the mapper, or shared from a name the store sent.
enum Adapter<'m> {
    Borrowed(&'m Arc<str>),
    Shared(Arc<str>),
}

impl Adapter<'_> {
    fn get(&self) -> &Arc<str> {
        match self {
            Self::Borrowed(a) => a,
            Self::Shared(a) => a,
        }
    }
}

/// A reported key, without a heap copy: a fingerprint, or the engine hash's bytes.
enum Key<'h> {
    Fingerprint([u8; 8]),
    Engine(BlockId<'h>),
}

impl Key<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Fingerprint(k) => k,
            Self::Engine(id) => id.bytes(),
        }
    }
}

fn tier_bit(tier: Tier) -> u8 {
    if tier == Tier::T1 { T1 } else { T2 }
}

impl Mapper {
    /// A mapper for one source.
    pub fn new(identity: Identity, options: Options) -> Self {
        let blocks = Blocks::new(options.max_tracked_blocks);
        Self {
            identity: Arc::new(identity),
            options,
            base_adapter: Arc::from(""),
            blocks,
            stats: MapperStats::default(),
            skipped_groups: Vec::new(),
            refresh: None,
            page_size: 0,
        }
    }

    /// What the mapper did so far.
    pub fn stats(&self) -> &MapperStats {
        &self.stats
    }

    /// Engine blocks currently tracked for this source.
    pub fn tracked_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Tracked blocks whose hashes collide with many others' (kept aside, searched after the
    /// map's buckets): 0 unless the engine's hashes are crafted or broken.
    pub fn stashed_blocks(&self) -> usize {
        self.blocks.stashed()
    }

    /// Bytes held by the tracked-block map (its tables and any long digests).
    pub fn tracked_bytes(&self) -> usize {
        self.blocks.heap_bytes()
    }

    /// The identity stamped on every report.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Maps one batch, appending its reports to `out` in event order.
    pub fn map_batch(&mut self, batch: &wire::EventBatch<'_>, out: &mut Vec<pb::Report>) {
        let mut reports = Reports::new(self.identity.clone(), out);
        self.map_batch_into(batch, &mut reports);
    }

    /// Maps one batch into `sink`, in event order: the same keys, counts, tiers and adapters as
    /// [`Mapper::map_batch`] reports, with no message made.
    pub fn map_batch_into(&mut self, batch: &wire::EventBatch<'_>, sink: &mut impl Sink) {
        self.map_into(
            batch,
            &mut Out::<_, Reports<'_>> {
                keys: sink,
                fingerprints: None,
            },
        );
    }

    /// Maps one batch in one pass to both its reports under the key mode's keys (`out`, as
    /// [`Mapper::map_batch`]) and the same under fingerprint keys (`fingerprints`): what the
    /// router feed needs beside engine-keyed reports. The fingerprints are those of the blocks
    /// stored with [`Options::fingerprints_too`] (or in fingerprint mode); without it
    /// `fingerprints` gets only the clears.
    pub fn map_batch_with_fingerprints(
        &mut self,
        batch: &wire::EventBatch<'_>,
        out: &mut Vec<pb::Report>,
        fingerprints: &mut Vec<pb::Report>,
    ) {
        let mut keys = Reports::new(self.identity.clone(), out);
        let mut fingerprints = Reports::new(self.identity.clone(), fingerprints);
        let mut two = Out {
            keys: &mut keys,
            fingerprints: Some(&mut fingerprints),
        };
        self.map_into(batch, &mut two);
    }

    fn map_into(&mut self, batch: &wire::EventBatch<'_>, sink: &mut impl Emit) {
        self.touch(batch);
        self.stats.batches += 1;
        self.stats.unknown_events += batch.unknown_events as u64;
        let ts = timestamp_us(batch.ts);
        for event in &batch.events {
            match event {
                wire::Event::BlockStored(e) => self.stored(e, ts, sink),
                wire::Event::BlockRemoved(e) => self.removed(e, ts, sink),
                wire::Event::AllBlocksCleared(c) => {
                    self.stats.cleared_events += 1;
                    match &c.medium {
                        // A clear of the whole cache.
                        None => {
                            self.forget();
                            sink.cleared(ts);
                        }
                        // A clear of one tier: the other tier's prefixes stay.
                        Some(medium) => self.clear_tier(tier_of(Some(medium)), ts, sink),
                    }
                }
            }
        }
    }

    /// Prefetches the map memory of the blocks the batch names (a store's parent and blocks, a
    /// removal's blocks), up to [`kvevent_table::TOUCH_AHEAD`], before any is looked up: every
    /// block's bucket control words, then, reading those, every block's slot. Their cache
    /// misses overlap instead of adding up, which is most of a lookup's cost once the map
    /// outgrows the cache. Beyond that many the first ones would leave the cache before their
    /// turn.
    fn touch(&self, batch: &wire::EventBatch<'_>) {
        let mut noted = [Touched::default(); kvevent_table::TOUCH_AHEAD];
        let mut n = 0;
        // At most TOUCH_AHEAD blocks.
        self.each_block(batch, |id, stored| {
            if let Some(t) = self.blocks.prefetch(id, stored) {
                noted[n] = t;
                n += 1;
            }
        });
        for &t in &noted[..n] {
            self.blocks.prefetch_slot(t);
        }
    }

    /// Calls `f` with the first [`kvevent_table::TOUCH_AHEAD`] blocks the batch names, in a
    /// known group, and whether each is stored: each store's parent (looked up) and blocks
    /// (stored), each removal's blocks (looked up).
    fn each_block(&self, batch: &wire::EventBatch<'_>, mut f: impl FnMut(BlockId<'_>, bool)) {
        let mut left = kvevent_table::TOUCH_AHEAD;
        for event in &batch.events {
            let (group, hashes, parent, stored) = match event {
                wire::Event::BlockStored(e) => (
                    e.group_idx,
                    &e.block_hashes,
                    e.parent_block_hash.as_ref(),
                    true,
                ),
                wire::Event::BlockRemoved(e) => (e.group_idx, &e.block_hashes, None, false),
                wire::Event::AllBlocksCleared(_) => continue,
            };
            let Some(group) = self.blocks.known_group(group) else {
                continue;
            };
            let named = parent
                .map(|p| (p, false))
                .into_iter()
                .chain(hashes.iter().map(|h| (h, stored)));
            for (hash, stored) in named {
                if left == 0 {
                    return;
                }
                left -= 1;
                f(BlockId::new(hash, group), stored);
            }
        }
    }

    /// Forgets everything known of the source and returns the `ALL_CLEARED` to send: for an
    /// engine clear, an engine restart, or state that became stale.
    pub fn reset(&mut self, timestamp_us: i64) -> pb::Report {
        self.forget();
        pb::Report::Event(self.identity.event(
            pb::cache_event::Type::AllCleared,
            Vec::new(),
            "",
            timestamp_us,
        ))
    }

    /// Re-reports resident blocks so that each is reported at least once per `interval`: the
    /// server expires entries nobody re-reported within its TTL, and an engine announces a
    /// block only when it stores it (a hot shared prefix can stay resident for hours). Call it
    /// often (every tick): it appends the share of the current cycle due by `now`, spread
    /// evenly, as one `Update` (never `New`). A cycle walks the blocks tracked when it began,
    /// sorted, in half the interval; blocks gone since are skipped, blocks stored since are in
    /// the next cycle. So every resident block is reported again within one interval of its
    /// last report, and a server that lost its memory has every block back within one
    /// interval. Returns how many entries it appended. `interval` 0 does nothing.
    pub fn refresh(
        &mut self,
        now: Instant,
        interval: Duration,
        timestamp_us: i64,
        out: &mut Vec<pb::Report>,
    ) -> usize {
        if interval.is_zero() {
            return 0;
        }
        // A cycle walks its snapshot in half the interval, in a stable (sorted) order: a block
        // refreshed at some point of one cycle comes at about the same point of the next, half
        // an interval later, and a block stored just after a cycle's snapshot was taken is in
        // the next one, at most a whole interval after its store was reported.
        let interval = interval / 2;
        let over = self
            .refresh
            .as_ref()
            .is_none_or(|c| c.next >= c.ids.len() && now >= c.started + interval);
        if over {
            self.refresh = Some(RefreshCycle {
                ids: self.blocks.snapshot(),
                next: 0,
                started: now,
            });
        }
        let Some(cycle) = self.refresh.as_mut() else {
            return 0;
        };
        let share =
            now.saturating_duration_since(cycle.started).as_secs_f64() / interval.as_secs_f64();
        let due = ((cycle.ids.len() as f64 * share).ceil() as usize).min(cycle.ids.len());
        if due <= cycle.next {
            return 0;
        }
        let ids = std::mem::take(&mut cycle.ids);
        let from = cycle.next;
        cycle.next = due;
        let mut update = self.identity.update(timestamp_us);
        for owned in (from..due).filter_map(|i| ids.get(i)) {
            if let Some(entry) = self.entry(owned.id()) {
                update.prefixes.push(entry);
            }
        }
        if let Some(cycle) = self.refresh.as_mut() {
            cycle.ids = ids;
        }
        let n = update.prefixes.len();
        if n > 0 {
            self.stats.refreshed += n as u64;
            out.push(pb::Report::Update(update));
        }
        n
    }

    /// The entry that reports tracked block `id` as it is now (`None`: untracked or unkeyed).
    fn entry(&mut self, id: BlockId<'_>) -> Option<pb::PrefixEntry> {
        let t = self.blocks.get(id)?;
        let key = self.key_of(id, t)?;
        let tier = if t.tiers() & T1 != 0 {
            Tier::T1
        } else {
            Tier::T2
        };
        Some(pb::PrefixEntry {
            prefix_hash: key.bytes().to_vec(),
            token_count: i32::try_from(t.tokens()).unwrap_or(i32::MAX),
            tier: pb::CacheTier::from(tier) as i32,
            adapter_id: self.blocks.adapter(t.adapter()).to_string(),
            ..Default::default()
        })
    }

    /// Every keyed block tracked, as one `Update` (never `New`; `None` when there is none):
    /// what a consumer that knows nothing of the source needs, such as the router feed after
    /// the mapper was restored from a state file.
    pub fn resident(&mut self, timestamp_us: i64) -> Option<pb::Report> {
        let mut update = self.identity.update(timestamp_us);
        let ids = self.blocks.snapshot();
        update.prefixes.extend(
            (0..ids.len())
                .filter_map(|i| ids.get(i))
                .filter_map(|owned| self.entry(owned.id())),
        );
        (!update.prefixes.is_empty()).then_some(pb::Report::Update(update))
    }

    /// The adapter a store belongs to: its `lora_name`, else the configured name of its
    /// `lora_id`, else the base model. `None` for a `lora_id` without a name. A name sent on
    /// the wire is the interned one when the source has seen it (no allocation per store);
    /// the base model's and configured names are borrowed (no reference count touched).
    /// Borrows only the options and the base name, so the block map stays free to change.
    fn adapter<'m>(
        e: &wire::BlockStored<'_>,
        blocks: &Blocks,
        options: &'m Options,
        base: &'m Arc<str>,
    ) -> Option<Adapter<'m>> {
        let adapter = match (&e.lora_name, e.lora_id) {
            (Some(name), _) => Adapter::Shared(match blocks.adapter_named(name) {
                Some(known) => known.clone(),
                None => Arc::from(&**name),
            }),
            (None, Some(id)) => Adapter::Borrowed(options.lora_adapters.get(&id)?),
            (None, None) => Adapter::Borrowed(base),
        };
        // SGLang's cache salt: a salted prefix is a namespace of its own, as an adapter is.
        let Some(salt) = e.cache_salt.as_deref() else {
            return Some(adapter);
        };
        let name = salted_adapter(adapter.get(), salt);
        Some(Adapter::Shared(match blocks.adapter_named(&name) {
            Some(known) => known.clone(),
            None => Arc::from(name),
        }))
    }

    /// Forgets every tracked block.
    fn forget(&mut self) {
        self.blocks.clear();
        self.refresh = None;
    }

    /// The key a tracked block was reported under.
    fn key_of<'h>(&self, id: BlockId<'h>, block: Tracked) -> Option<Key<'h>> {
        if !block.keyed() {
            return None;
        }
        match self.options.key_mode {
            KeyMode::Engine => Some(Key::Engine(id)),
            KeyMode::Fingerprint => block
                .prefix()
                .map(|p| Key::Fingerprint(fingerprint::wire_key(p))),
        }
    }

    fn stored(&mut self, e: &wire::BlockStored<'_>, ts: i64, sink: &mut impl Emit) {
        self.stats.stored_events += 1;
        if e.block_size == 0 {
            self.stats.placeholder_stores += 1;
            return;
        }
        if e.block_size < self.page_size {
            self.stats.short_blocks += e.block_hashes.len() as u64;
        }
        self.page_size = self.page_size.max(e.block_size);
        let kind = e.kv_cache_spec_kind.as_deref();
        if !self.options.all_kv_groups && !crate::is_prefix_group(kind) {
            *self
                .stats
                .non_prefix_groups
                .entry(kind.unwrap_or_default().to_owned())
                .or_default() += e.block_hashes.len() as u64;
            // Its removals carry only the group: remember which groups are not reported.
            if e.group_idx.is_some()
                && !self.skipped_groups.contains(&e.group_idx)
                && self.skipped_groups.len() < 1024
            {
                self.skipped_groups.push(e.group_idx);
            }
            return;
        }
        let Some(adapter) = Self::adapter(e, &self.blocks, &self.options, &self.base_adapter)
        else {
            self.stats.unknown_adapter_drops += 1;
            return;
        };
        let adapter = adapter.get();
        let tier = tier_of(e.medium.as_ref());
        let group = self.blocks.group(e.group_idx);
        let adapter_id = self.blocks.adapter_id(adapter);
        let parent = e.parent_block_hash.as_ref().map(|p| {
            let known = group.and_then(|g| self.blocks.get(BlockId::new(p, g)));
            (known.map(Tracked::tokens), known.map(Tracked::prefix))
        });
        let (base_tokens, parent_prefix) = match parent {
            None => (0, None),
            Some((Some(tokens), prefix)) => (tokens, prefix),
            Some((None, _)) => {
                self.stats.unknown_parents += 1;
                (0, None)
            }
        };
        let n = e.block_hashes.len();
        // Fingerprints need every block's tokens, and a keyable parent when there is one; the
        // thread's buffers are taken only then (`prefixes` stays empty when blocks are not keyed).
        let mut scratch = None;
        if self.options.key_mode == KeyMode::Fingerprint || self.options.fingerprints_too {
            let covered = e.token_ids.len() == n * e.block_size as usize;
            let parent_keyable = !matches!(parent_prefix, Some(None));
            if covered && parent_keyable {
                let (mut token_ids, mut prefixes) = SCRATCH.take();
                e.token_ids.extend_into(&mut token_ids);
                let parent = parent_prefix.flatten();
                fingerprint::prefixes_into(
                    &token_ids,
                    e.block_size as usize,
                    parent,
                    &mut prefixes,
                );
                scratch = Some((token_ids, prefixes));
            } else {
                self.stats.unkeyable_blocks += n as u64;
            }
        }
        let prefixes: &[u64] = scratch.as_ref().map_or(&[], |(_, p)| p);
        // First reports of a block go as `New` (the forwarder may cancel them against an
        // eviction that finds them unsent); re-reports of tracked blocks as `Update`. Every entry
        // carries its adapter; the update-level `adapter_id` (the server's default for entries
        // without one) stays empty, as the Go sidecar sends it.
        for (i, hash) in e.block_hashes.iter().enumerate() {
            let prefix = prefixes.get(i).copied();
            let tokens = base_tokens.saturating_add((i as u32 + 1).saturating_mul(e.block_size));
            if is_empty_hash(hash) {
                // Not a key: never forwarded as an empty `prefix_hash`, never tracked.
                self.stats.empty_hashes += 1;
                continue;
            }
            let keyed = match self.options.key_mode {
                KeyMode::Engine => true,
                KeyMode::Fingerprint => prefix.is_some(),
            };
            let inserted = match (group, adapter_id) {
                (Some(g), Some(a)) => self.blocks.insert(
                    BlockId::new(hash, g),
                    Tracked::new(keyed, prefix, tokens, a, tier_bit(tier)),
                ),
                _ => Insert::Refused,
            };
            if inserted == Insert::Refused {
                self.stats.map_refusals += 1;
            }
            // An untracked block may be on the server already: never `New`. With an offload
            // tier, a block the map forgot may still be on the server at T2.
            let new = inserted == Insert::New && !self.options.engine_has_offload_tier;
            match (self.options.key_mode, prefix) {
                (KeyMode::Engine, _) => {
                    let id = BlockId::new(hash, 0);
                    sink.prefix(Some(id.bytes()), prefix, tokens, tier, adapter, new);
                }
                (KeyMode::Fingerprint, Some(p)) => {
                    let key = fingerprint::wire_key(p);
                    sink.prefix(Some(&key), prefix, tokens, tier, adapter, new);
                }
                (KeyMode::Fingerprint, None) => continue,
            }
            self.stats.prefixes += 1;
        }
        // Given back empty, cut back to a bounded size if a long prompt made them large.
        if let Some((mut token_ids, mut prefixes)) = scratch {
            token_ids.clear();
            token_ids.shrink_to(SCRATCH_KEPT);
            prefixes.clear();
            prefixes.shrink_to(SCRATCH_KEPT);
            SCRATCH.set((token_ids, prefixes));
        }
        sink.end_update(ts);
    }

    fn removed(&mut self, e: &wire::BlockRemoved<'_>, ts: i64, sink: &mut impl Emit) {
        self.stats.removed_events += 1;
        if e.group_idx.is_some() && self.skipped_groups.contains(&e.group_idx) {
            // A group whose blocks are not reported (see `stored`): nothing to evict.
            return;
        }
        let tier = tier_of(e.medium.as_ref());
        let group = self.blocks.known_group(e.group_idx);
        for hash in &e.block_hashes {
            if is_empty_hash(hash) {
                self.stats.empty_hashes += 1;
                continue;
            }
            self.remove_one(hash, group, tier, ts, sink);
        }
    }

    /// A clear of one tier (`AllBlocksCleared` with a medium): every block held there is
    /// removed from it, as if the engine had sent a removal for each. The other tier's
    /// prefixes stay.
    fn clear_tier(&mut self, tier: Tier, ts: i64, sink: &mut impl Emit) {
        for (hash, group) in self.blocks.ids_in_tier(tier_bit(tier)) {
            let hash = wire::BlockHash::Bytes(std::borrow::Cow::Owned(hash));
            self.remove_one(&hash, Some(group), tier, ts, sink);
        }
    }

    /// The engine no longer holds `hash` (of interned `group`) at `tier`: evict the prefix, or
    /// re-report it at the tier still holding it.
    fn remove_one(
        &mut self,
        hash: &wire::BlockHash<'_>,
        group: Option<u16>,
        tier: Tier,
        ts: i64,
        sink: &mut impl Emit,
    ) {
        let offload = self.options.engine_has_offload_tier && tier == Tier::T1;
        // The tiers still holding the block after this removal, in one walk: the block goes
        // when none holds it any more, or when it leaves the GPU with an offload tier (it is
        // re-reported at T2: the map never grows with the offload tier's contents).
        // One of several copies of the block going leaves the others: nothing changes.
        let mut copy_left = false;
        let known = group.map(|g| BlockId::new(hash, g)).and_then(|id| {
            let t = self.blocks.change_or_remove(id, |t| {
                if t.extra_copies() > 0 && t.tiers() & tier_bit(tier) != 0 {
                    t.set_extra_copies(t.extra_copies() - 1);
                    copy_left = true;
                    return false;
                }
                let mut tiers = t.tiers() & !tier_bit(tier);
                if offload {
                    tiers |= T2;
                }
                t.set_tiers(tiers);
                tiers == 0 || offload
            })?;
            Some((id, t))
        });
        if copy_left {
            return;
        }
        let (key, adapter_id, tokens, remaining) = match known {
            Some((id, t)) => (self.key_of(id, t), Some(t.adapter()), t.tokens(), t.tiers()),
            None => {
                self.stats.unknown_removals += 1;
                // An engine hash is its own key; a fingerprint cannot be recovered.
                let key = match self.options.key_mode {
                    KeyMode::Engine => Some(Key::Engine(BlockId::new(hash, 0))),
                    KeyMode::Fingerprint => None,
                };
                let remaining = if offload { T2 } else { 0 };
                (key, None, 0, remaining)
            }
        };
        // Its fingerprint, when kept: the second output of a two-key pass.
        let fingerprint = known.and_then(|(_, t)| t.prefix());
        if key.is_some() || fingerprint.is_some() {
            // Borrowed, not cloned: no reference count touched per removal.
            let adapter = match adapter_id {
                Some(a) => self.blocks.adapter(a),
                None => &self.base_adapter,
            };
            let reported = key.as_ref().map(Key::bytes);
            if remaining != 0 {
                // Another tier still holds the block (an offload tier, or a store we saw on
                // another medium): report it there instead of evicting the prefix.
                let still = if remaining & T1 != 0 {
                    Tier::T1
                } else {
                    Tier::T2
                };
                if key.is_some() {
                    self.stats.offload_rereports += 1;
                    self.stats.prefixes += 1;
                }
                sink.prefix(reported, fingerprint, tokens, still, adapter, false);
                sink.end_update(ts);
            } else {
                if key.is_some() {
                    self.stats.evictions += 1;
                }
                sink.evicted(reported, fingerprint, adapter, ts);
            }
        }
        // The interned names go with the last block, once its report is made.
        if known.is_some() {
            self.blocks.shrink_if_empty();
        }
    }
}

/// An empty `bin` hash: no key can be made of it.
fn is_empty_hash(hash: &wire::BlockHash<'_>) -> bool {
    matches!(hash, wire::BlockHash::Bytes(b) if b.is_empty())
}

/// The batch time in microseconds (`ts` × 1e6); 0 ("server now") when not a finite time.
pub fn timestamp_us(ts: f64) -> i64 {
    if ts.is_finite() && ts > 0.0 {
        (ts * 1e6) as i64
    } else {
        0
    }
}

impl Mapper {
    /// Evicts every keyed block tracked for this source, one `PREFIX_EVICTED` each, and
    /// forgets them: a reset of one source among several of the same replica (DP ranks), where
    /// an `ALL_CLEARED` would also wipe the other ranks' prefixes.
    pub fn evict_all(&mut self, timestamp_us: i64) -> Vec<pb::Report> {
        self.evict_all_into(timestamp_us, None)
    }

    /// [`Mapper::evict_all`], with the same evictions under fingerprint keys in the second list
    /// (the blocks whose fingerprint is kept, see [`Mapper::map_batch_with_fingerprints`]).
    pub fn evict_all_with_fingerprints(
        &mut self,
        timestamp_us: i64,
    ) -> (Vec<pb::Report>, Vec<pb::Report>) {
        let mut fingerprints = Vec::new();
        let out = self.evict_all_into(timestamp_us, Some(&mut fingerprints));
        (out, fingerprints)
    }

    fn evict_all_into(
        &mut self,
        timestamp_us: i64,
        mut fingerprints: Option<&mut Vec<pb::Report>>,
    ) -> Vec<pb::Report> {
        let blocks = self.blocks.drain();
        let mut out = Vec::with_capacity(blocks.len());
        let evicted = |key: Vec<u8>, adapter: &str| {
            pb::Report::Event(self.identity.event(
                pb::cache_event::Type::PrefixEvicted,
                key,
                adapter,
                timestamp_us,
            ))
        };
        for (engine_key, block) in blocks {
            let adapter = self.blocks.adapter(block.adapter());
            if let (Some(list), Some(prefix)) = (fingerprints.as_deref_mut(), block.prefix()) {
                list.push(evicted(fingerprint_key(prefix), adapter));
            }
            let key = match self.options.key_mode {
                _ if !block.keyed() => None,
                KeyMode::Engine => Some(engine_key),
                KeyMode::Fingerprint => block.prefix().map(fingerprint_key),
            };
            if let Some(key) = key {
                self.stats.evictions += 1;
                out.push(evicted(key, adapter));
            }
        }
        self.blocks.clear();
        out
    }
}

/// The adapter name a store salted with SGLang's `cache_salt` is reported under:
/// `<adapter>#cache_salt=<salt>` (the base model's adapter is ""). A salted prefix never
/// matches an unsalted query nor another salt's; a router asks with this adapter name.
pub fn salted_adapter(adapter: &str, salt: &str) -> String {
    format!("{adapter}#cache_salt={salt}")
}
