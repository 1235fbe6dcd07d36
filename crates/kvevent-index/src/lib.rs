//! An in-process prefix index for routers: which replica already holds the longest prefix of a
//! request.
//!
//! Fed by decoded batches and resets per source (a replica's engine, or one DP rank of it),
//! through a [`kvevent_mapper::Mapper`] per source, so the keys follow the mapper's rules:
//! content fingerprints of the token ids or engine block hashes ([`KeyMode`]), cumulative token
//! counts, LoRA adapter partitions, tiers from the medium, the hybrid-model rule. [`Index::score`]
//! answers, per replica, how many blocks and tokens of the query are present from block 0 on,
//! at which tier, and how far the replica's state can be trusted ([`Score::state`]).
//!
//! - **Layout.** One table, (prefix key, adapter) → (token count, holders), 24 bytes a slot
//!   and a tag byte in a [`kvevent_table::Table`] (bucketed cuckoo hashing, any size, 72–90 %
//!   full, no tombstones: churn never grows it). A holder is a source, its
//!   reset epoch and the tier; one is kept in the slot, two or more in a shared list, sorted
//!   by source so scoring intersects holder lists block by block (one lookup per query
//!   block, whatever the number of replicas).
//!   Batches come in through the mapper's [`Sink`](mapper::Sink): no protobuf is made. A
//!   batch's changes are queued, their slots loaded at once (the cache misses overlap), then
//!   applied in order.
//! - **Resets** of one source are O(1): its epoch moves on and older holders no longer count
//!   (they are dropped when next touched). Removing a replica resets its sources.
//! - **Keyed changes and atomic snapshots.** [`Index::apply_keys`] takes changes already keyed
//!   (a sidecar's feed); a snapshot loads into [`Index::add_loading_source`], which counts in
//!   no answer until [`Index::promote`] swaps it for the source it replaces, in one lock.
//! - **Byte budget.** Entries live in two generations; when a new key would take the key
//!   tables and holder lists past the budget (measured by the tables' capacity, free slots
//!   included), the old one is dropped (counted in [`IndexStats::evicted_keys`]) and the young one
//!   becomes old: an entry not stored again during a whole generation goes first. The key
//!   tables stay within the budget however many blocks churn through.
//! - **Concurrency.** One `RwLock`: any number of threads score while one applies events.
//!
//! Pure: no IO, no async runtime. Keys longer than 8 bytes (engine mode with `bin` digests) are
//! folded to their first 8 bytes, uniformly random in practice.
//!
//! ```
//! use kvevent_index::{Config, Degraded, Index, Query, QueryKeys, ReplicaState, Tier};
//! use kvevent_wire as wire;
//!
//! let index = Index::new(Config::default()); // content fingerprints of the token ids
//! let a = index.add_source("replica-a").expect("a source");
//! let b = index.add_source("replica-b").expect("a source");
//! let prompt: Vec<u32> = (0..64).collect();
//! // Replica a stored the prompt's 4 blocks of 16, replica b its first 2.
//! let stored = |n: u64| wire::EventBatch {
//!     ts: 0.0,
//!     events: vec![wire::Event::BlockStored(wire::BlockStored {
//!         block_hashes: (1..=n).map(|h| wire::BlockHash::Int(wire::Int::U64(h))).collect(),
//!         token_ids: wire::TokenIds::from(prompt[..16 * n as usize].to_vec()),
//!         block_size: 16,
//!         ..Default::default()
//!     })],
//!     data_parallel_rank: None,
//!     unknown_events: 0,
//! };
//! index.apply(a, &stored(4));
//! index.apply(b, &stored(2));
//! // Its follower says its source is replaying: every answer carries it.
//! index.set_replica_state("replica-b", ReplicaState::Degraded(Degraded::Replaying));
//!
//! let scores = index.score(&Query {
//!     adapter: "",
//!     keys: QueryKeys::Tokens { ids: &prompt[..40], block_size: 16 },
//! });
//! let best: Vec<_> = scores
//!     .iter()
//!     .map(|s| (s.replica, s.matched_blocks, s.matched_tokens, s.tier, s.state.is_exact()))
//!     .collect();
//! assert_eq!(
//!     best,
//!     [("replica-a", 2, 32, Tier::T1, true), ("replica-b", 2, 32, Tier::T1, false)]
//! );
//! ```

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use kvevent_mapper::{self as mapper, Identity, Mapper};
use kvevent_table::Entry as TableEntry;
use kvevent_wire as wire;

pub use mapper::KeyMode;

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

/// Why a replica's known state may be incomplete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degraded {
    /// Not yet connected, or connecting again (its entries, if any, still count).
    Connecting,
    /// A snapshot is loading (the previous state, if any, still counts).
    SnapshotLoading,
    /// Its engine's events are replaying, or lost batches that could not be replayed.
    Replaying,
    /// Its sidecar is there, but the sidecar lost the engine (for less than `dead_after`).
    EngineLost,
    /// Its engine's connection was made again (or its follower just started), and the engine
    /// is not yet proven the same process, or a new one (then cleared): what is known may be
    /// another process's.
    Unverified,
    /// Its source's stream is open, but nothing came from it for two heartbeats: changes may
    /// be missing (a link cut without a word, or blackholed).
    Silent,
    /// Its source's messages arrive late: what they say was true more than the follower's
    /// `lag_after` ago (a congested link).
    Lagging,
    /// Its engine's HTTP server does not answer its health check (for less than
    /// `dead_after`): its cache may be known, but it serves nothing.
    ServerDown,
}

impl Degraded {
    /// A short name for logs and answers.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::SnapshotLoading => "snapshot_loading",
            Self::Replaying => "replaying_or_gap",
            Self::EngineLost => "engine_lost",
            Self::Unverified => "unverified",
            Self::Silent => "silent",
            Self::Lagging => "lagging",
            Self::ServerDown => "server_down",
        }
    }
}

/// What was lost, for a [`ReplicaState::Stale`] replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// The replica's source itself: its sidecar's feed, or, followed directly, its engine.
    Source,
    /// The engine behind a sidecar that is still there.
    Engine,
    /// The engine's HTTP server: its cache may be known, but it serves nothing.
    Server,
}

impl Lost {
    /// `source`, `engine` or `server`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Source => "source",
            Self::Engine => "engine",
            Self::Server => "server",
        }
    }
}

/// How far a replica's entries can be trusted: the one trust signal of every answer. Whoever
/// follows the replica says ([`Index::set_replica_state`]); a replica nobody said anything of
/// is `Exact`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaState {
    /// In sync with its source.
    Exact,
    /// Its source is there, but what is known may be incomplete.
    Degraded(Degraded),
    /// Lost since this instant (for at least the follower's `dead_after`): what is known may
    /// be wrong. Its entries count until the follower drops them.
    Stale {
        /// Since when.
        since: std::time::Instant,
        /// What was lost.
        lost: Lost,
    },
}

impl ReplicaState {
    /// In sync with its source: the only state to route on.
    pub fn is_exact(self) -> bool {
        self == Self::Exact
    }

    /// `exact`, `degraded` or `stale`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Degraded(_) => "degraded",
            Self::Stale { .. } => "stale",
        }
    }

    /// The reason, for a state other than `Exact`: a [`Degraded`] reason, or `source_lost`,
    /// `engine_lost` or `server_down`.
    pub fn reason(self) -> Option<&'static str> {
        match self {
            Self::Exact => None,
            Self::Degraded(d) => Some(d.as_str()),
            Self::Stale {
                lost: Lost::Source, ..
            } => Some("source_lost"),
            Self::Stale {
                lost: Lost::Engine, ..
            } => Some("engine_lost"),
            Self::Stale {
                lost: Lost::Server, ..
            } => Some("server_down"),
        }
    }
}

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

/// One replica's match, as `LookupRouteResponse.replica_scores` means it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Score<'a> {
    /// The replica's name.
    pub replica: &'a str,
    /// Blocks of the query present from block 0 on (on one of the replica's sources).
    pub matched_blocks: u32,
    /// Tokens those blocks cover (the last matched block's cumulative count).
    pub matched_tokens: u32,
    /// T2 when any matched block is only in the offload tier.
    pub tier: Tier,
    /// How far the replica's entries can be trusted ([`ReplicaState`]): route on
    /// [`ReplicaState::Exact`], fail open otherwise.
    pub state: ReplicaState,
}

/// The answer to a query: a [`Score`] per replica holding block 0 of the query (with
/// [`Index::score_among`], per candidate the index knows, matching or not), best first (most
/// tokens, most blocks, T1 before T2, then by name). It shares the index's list of names: one
/// reference taken per answer, not one per replica.
#[derive(Debug, Clone, Default)]
pub struct Scores {
    names: Arc<Vec<Arc<str>>>,
    entries: Vec<Answer>,
    /// With [`Index::score_among`]: the positions of the candidates the index does not know.
    unknown: Vec<usize>,
}

/// One replica's match, named by number.
#[derive(Debug, Clone, Copy)]
struct Answer {
    replica: u32,
    blocks: u32,
    tokens: u32,
    tier: Tier,
    state: ReplicaState,
}

impl Scores {
    /// Replicas in the answer.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no replica holds block 0 of the query.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `i`-th best.
    pub fn get(&self, i: usize) -> Option<Score<'_>> {
        self.entries.get(i).map(|e| self.score(e))
    }

    /// The best, if any.
    pub fn first(&self) -> Option<Score<'_>> {
        self.get(0)
    }

    /// Best first.
    pub fn iter(&self) -> ScoresIter<'_> {
        ScoresIter {
            scores: self,
            entries: self.entries.iter(),
        }
    }

    /// With [`Index::score_among`]: the positions, in the candidates asked about, of those the
    /// index does not know (no source of theirs is followed, and nobody set their state). They
    /// are in no [`Score`]. Empty for [`Index::score`].
    pub fn unknown(&self) -> &[usize] {
        &self.unknown
    }

    fn score(&self, e: &Answer) -> Score<'_> {
        Score {
            replica: &self.names[e.replica as usize],
            matched_blocks: e.blocks,
            matched_tokens: e.tokens,
            tier: e.tier,
            state: e.state,
        }
    }
}

impl<'a> IntoIterator for &'a Scores {
    type Item = Score<'a>;
    type IntoIter = ScoresIter<'a>;

    fn into_iter(self) -> ScoresIter<'a> {
        self.iter()
    }
}

/// The scores of an answer, best first ([`Scores::iter`]).
#[derive(Debug, Clone)]
pub struct ScoresIter<'a> {
    scores: &'a Scores,
    entries: std::slice::Iter<'a, Answer>,
}

impl<'a> Iterator for ScoresIter<'a> {
    type Item = Score<'a>;

    fn next(&mut self) -> Option<Score<'a>> {
        self.entries.next().map(|e| self.scores.score(e))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.entries.size_hint()
    }
}

impl ExactSizeIterator for ScoresIter<'_> {}

/// Counters and sizes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Keys in the index (both generations).
    pub keys: usize,
    /// (key, source) pairs, stale ones included until touched.
    pub pairs: usize,
    /// Bytes of the key tables and holder lists (what the byte budget counts).
    pub bytes: usize,
    /// Bytes of the key map's tables themselves (buckets, control bytes, free slots).
    pub table_bytes: usize,
    /// Bytes of the per-source block maps the key rules need (engine hash → fingerprint,
    /// tokens, tier), not counted by the byte budget.
    pub mapper_bytes: usize,
    /// Keys dropped by the byte budget.
    pub evicted_keys: u64,
    /// Keys, and blocks in the per-source maps, whose hashes collide with many others' (kept
    /// aside, searched after the buckets): 0 unless the hashes are crafted or broken.
    pub stashed: usize,
    /// Block events applied.
    pub applied: u64,
    /// Sources followed now (loading ones included).
    pub sources: usize,
    /// Source slots the index keeps (in use and free): the most sources it followed at once,
    /// not every source it ever had.
    pub source_slots: usize,
    /// Replica numbers the index keeps (in use and free), likewise.
    pub replica_slots: usize,
    /// Pairs of sources holding the same key (a key held by h sources makes h(h−1)/2), stale
    /// ones included until touched, as in `pairs`.
    pub shared_pairs: u64,
}

impl IndexStats {
    /// The share of (key, source) pairs whose key another source also holds: 1 − keys ÷
    /// pairs, 0 when empty. What prefix-aware placement could win back of the fleet's cache.
    /// A source is an engine's DP rank (each its own cache). Kept up to date as changes apply
    /// (no scan); a source's lapsed holders (after a clear, a restart, a removal) count until
    /// the sweep or a store of the key drops them.
    pub fn duplication(&self) -> f64 {
        if self.pairs == 0 {
            0.0
        } else {
            1.0 - self.keys as f64 / self.pairs as f64
        }
    }
}

/// (key, source) pairs and pairs of sources sharing a key, kept as holders change.
#[derive(Debug, Clone, Copy, Default)]
struct Shares {
    held: u64,
    shared: u64,
}

impl Shares {
    /// A key's holders went from `before` to `after`.
    fn changed(&mut self, before: usize, after: usize) {
        let pairs = |h: usize| (h * h.saturating_sub(1) / 2) as u64;
        self.held = (self.held + after as u64).saturating_sub(before as u64);
        self.shared = (self.shared + pairs(after)).saturating_sub(pairs(before));
    }
}

/// A source holding a key, in one word: the source in bits 35–63, its epoch in 3–34, the
/// tier in bit 2, bits 0–1 clear (where [`Holders`] keeps its kind, so one holder is kept inline
/// as this same word). Words sort by source; two holders of the same source and epoch compare
/// by tier, so the larger is the worse tier; scoring compares and merges whole words (eight at
/// a time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Holder(u64);

impl Holder {
    const TIER_SHIFT: u32 = 2;
    const EPOCH_SHIFT: u32 = 3;
    const SOURCE_SHIFT: u32 = 35;
    /// The bits naming the source and its epoch.
    const ID: u64 = !((1 << Self::EPOCH_SHIFT) - 1);

    fn new(source: u32, epoch: u32, tier: u8) -> Self {
        debug_assert!(source < MAX_SOURCES && tier <= 1);
        Self(
            (u64::from(source) << Self::SOURCE_SHIFT)
                | (u64::from(epoch) << Self::EPOCH_SHIFT)
                | (u64::from(tier & 1) << Self::TIER_SHIFT),
        )
    }

    fn source(self) -> u32 {
        (self.0 >> Self::SOURCE_SHIFT) as u32
    }

    fn epoch(self) -> u32 {
        (self.0 >> Self::EPOCH_SHIFT) as u32
    }

    fn tier(self) -> u8 {
        ((self.0 >> Self::TIER_SHIFT) & 1) as u8
    }

    fn same_id(self, other: Self) -> bool {
        (self.0 ^ other.0) & Self::ID == 0
    }
}

/// Sources an index follows at once, at most (29 bits of a holder word).
pub const MAX_SOURCES: u32 = 1 << 29;

/// The sources holding a key, sorted by source (one holder a source at most), in one word:
/// none, one inline (the [`Holder`] word, its kind in bits 0–1), or the number of a list in
/// [`Lists`] (two or more) and, in bits 2–31, the [`Inner::lapses`] count (its low 30 bits)
/// when the list was last rid of lapsed holders. Keeps a table slot at 24 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holders(u64);

const ONE: u64 = 1;
const LIST: u64 = 2;
/// Where a list's lapse stamp sits.
const STAMP: u64 = ((1 << 30) - 1) << 2;

/// The holder lists of keys held by two sources or more; a freed slot is reused. The slot
/// vector keeps the length of its peak (24 bytes a slot, not counted by the budget, which
/// counts the slots in use and their lists).
#[derive(Debug, Default)]
struct Lists {
    lists: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

/// An entry's holders, borrowed for reading.
enum HolderView<'a> {
    One(Holder),
    Many(&'a [Holder]),
}

impl HolderView<'_> {
    fn as_slice(&self) -> &[Holder] {
        match self {
            Self::One(h) => std::slice::from_ref(h),
            Self::Many(v) => v,
        }
    }
}

impl Holders {
    const NONE: Self = Self(0);

    fn one(h: Holder) -> Self {
        Self(h.0 | ONE)
    }

    fn list(i: u32) -> Self {
        Self((u64::from(i) << 32) | LIST)
    }

    fn view(self, lists: &Lists) -> HolderView<'_> {
        match self.0 & 3 {
            ONE => HolderView::One(Holder(self.0 & !3)),
            LIST => HolderView::Many(&lists.lists[(self.0 >> 32) as usize]),
            _ => HolderView::Many(&[]),
        }
    }

    fn len(self, lists: &Lists) -> usize {
        self.view(lists).as_slice().len()
    }

    fn list_mut(self, lists: &mut Lists) -> Option<(u32, &mut Vec<Holder>)> {
        if self.0 & 3 == LIST {
            let i = (self.0 >> 32) as u32;
            Some((i, &mut lists.lists[i as usize]))
        } else {
            None
        }
    }

    /// A list stamped with `lapses` (one holder stays as it is).
    fn stamped(self, lapses: u32) -> Self {
        if self.0 & 3 == LIST {
            Self((self.0 & !STAMP) | ((u64::from(lapses) << 2) & STAMP))
        } else {
            self
        }
    }

    /// True for a list stamped with `lapses`: no holder of it lapsed since it was stamped.
    fn stamped_with(self, lapses: u32) -> bool {
        self.0 & 3 == LIST && self.0 & STAMP == (u64::from(lapses) << 2) & STAMP
    }

    /// Without `source`'s holder: a binary search in a list, not a scan (a key of a shared
    /// system prompt can have a holder on every replica of the fleet).
    fn remove(self, lists: &mut Lists, source: u32) -> Self {
        let Some((_, v)) = self.list_mut(lists) else {
            return match self.view(lists) {
                HolderView::One(h) if h.source() == source => Self::NONE,
                _ => self,
            };
        };
        if let Ok(i) = v.binary_search_by_key(&source, |h| h.source()) {
            v.remove(i);
        }
        self.collapsed(lists)
    }

    /// A list that lost holders: one holder inline when one is left, none when none is (its
    /// list given back either way).
    fn collapsed(self, lists: &mut Lists) -> Self {
        match self.view(lists).as_slice() {
            &[only] => {
                self.free(lists);
                Self::one(only)
            }
            [] => {
                self.free(lists);
                Self::NONE
            }
            _ => self,
        }
    }

    /// Without lapsed holders (`valid` says which stand) and then with `holder` (replacing
    /// its source's), stamped with `lapses`. A list stamped with `lapses` already is not
    /// scanned: no holder of it can have lapsed since.
    fn store(
        self,
        lists: &mut Lists,
        lapses: u32,
        valid: impl Fn(&Holder) -> bool,
        holder: Holder,
    ) -> Self {
        if self == Self::NONE {
            // A new key (most stores): nothing to keep or merge.
            return Self::one(holder);
        }
        let kept = if self.stamped_with(lapses) {
            self
        } else {
            self.retain(lists, valid)
        };
        kept.upsert(lists, holder).stamped(lapses)
    }

    /// Gives its list back, if it has one.
    fn free(self, lists: &mut Lists) {
        if let Some((i, v)) = self.list_mut(lists) {
            *v = Vec::new();
            lists.free.push(i);
        }
    }

    /// The holders `keep` keeps.
    fn retain(self, lists: &mut Lists, keep: impl Fn(&Holder) -> bool) -> Self {
        match self.view(lists) {
            HolderView::One(h) => {
                if keep(&h) {
                    self
                } else {
                    Self::NONE
                }
            }
            HolderView::Many(_) => {
                let Some((_, v)) = self.list_mut(lists) else {
                    return Self::NONE;
                };
                v.retain(|h| keep(h));
                self.collapsed(lists)
            }
        }
    }

    /// Adds `holder`, replacing the same source's.
    fn upsert(self, lists: &mut Lists, holder: Holder) -> Self {
        match self.view(lists) {
            HolderView::Many([]) => Self::one(holder),
            HolderView::One(h) if h.source() == holder.source() => Self::one(holder),
            HolderView::One(h) => {
                let pair = if h.source() < holder.source() {
                    vec![h, holder]
                } else {
                    vec![holder, h]
                };
                let i = match lists.free.pop() {
                    Some(i) => {
                        lists.lists[i as usize] = pair;
                        i
                    }
                    None => {
                        lists.lists.push(pair);
                        (lists.lists.len() - 1) as u32
                    }
                };
                Self::list(i)
            }
            HolderView::Many(_) => {
                if let Some((_, v)) = self.list_mut(lists) {
                    match v.binary_search_by_key(&holder.source(), |h| h.source()) {
                        Ok(i) => v[i] = holder,
                        Err(i) => v.insert(i, holder),
                    }
                }
                self
            }
        }
    }
}

/// A key's identity: its prefix key and adapter number, 12 bytes. The key is kept mixed
/// with the adapter (a bijection for each adapter, so no two identities meet): it is its own
/// hash, and a probe walk does not hash every entry it passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(C, packed(4))]
struct KeyId {
    mixed: u64,
    adapter: u32,
}

impl KeyId {
    fn new(key: u64, adapter: u32) -> Self {
        Self {
            mixed: kvevent_table::mix(key ^ u64::from(adapter).rotate_left(32)),
            adapter,
        }
    }
}

impl kvevent_table::Key for KeyId {
    fn hash(&self) -> u64 {
        self.mixed
    }
}

/// What the index knows of a key, 12 bytes: the prefix's token count and its holders.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct Entry {
    tokens: u32,
    holders: Holders,
}

impl Default for Entry {
    fn default() -> Self {
        Self {
            tokens: 0,
            holders: Holders::NONE,
        }
    }
}

/// The key table (see `kvevent_table`): 24-byte slots and a tag byte each, 72–90 % full, no
/// tombstones.
type Keys = kvevent_table::Table<KeyId, Entry>;

/// Heap bytes of an entry's holders: none for one (kept inline), else its list's slot and the
/// list's block (capacity doubling from 4, plus the allocator's header).
fn entry_bytes(holders: usize) -> usize {
    if holders <= 1 {
        0
    } else {
        std::mem::size_of::<Vec<Holder>>()
            + holders.next_power_of_two().max(4) * std::mem::size_of::<Holder>()
            + 16
    }
}

#[derive(Debug)]
struct Source {
    replica: u32,
    /// Moves on at each reset or clear and when the source is removed ([`Inner::lapse`]):
    /// holders of older epochs no longer count, and a slot reused never meets its previous
    /// source's holders. 32 bits: a slot lapsing every millisecond wraps it after 49 days,
    /// and a wrap drops its holders for real.
    epoch: u32,
    /// Which use of the slot this is ([`SourceId`]).
    generation: u32,
    live: bool,
    /// False while a snapshot loads into it ([`Index::add_loading_source`]): it takes changes
    /// but counts in no answer until [`Index::promote`].
    counting: bool,
    /// The adapter its last change named and its number: the mapper hands the same `Arc` for
    /// a source's blocks of one adapter, so a pointer compare, not a string lookup, per change.
    adapter: Option<(Arc<str>, u32)>,
}

/// A replica's number's use. A number is given back, and its name forgotten, once the
/// replica has no live source and no state set ([`Index::set_replica_state`]).
#[derive(Debug, Clone, Copy, Default)]
struct ReplicaSlot {
    in_use: bool,
    /// Its live sources, loading ones included.
    sources: u32,
    /// What its follower said ([`Index::set_replica_state`]); it keeps the replica known.
    state: Option<ReplicaState>,
}

impl ReplicaSlot {
    fn state(&self) -> ReplicaState {
        self.state.unwrap_or(ReplicaState::Exact)
    }
}

/// Where the incremental sweep of lapsed holders is ([`Inner::sweep`]).
#[derive(Debug, Default)]
struct Sweep {
    /// A holder lapsed since the pass began (or one is under way): a pass is owed.
    owed: bool,
    /// The pass is in the old table (else the young one).
    in_old: bool,
    /// The next slot to visit.
    cursor: usize,
    /// [`Inner::lapses`] when the pass began: a lapse after it needs another pass.
    lapses_at_start: u32,
}

#[derive(Debug, Default)]
struct Inner {
    /// Replica names by number; answers share them (a replica added while an answer holds
    /// them copies the list). A free number keeps its last name until it is reused.
    replicas: Arc<Vec<Arc<str>>>,
    replica_ids: Map<Arc<str>, u32>,
    /// The replicas in use, in name order: answers are sorted stably from it, by numbers,
    /// not names.
    by_name: Vec<u32>,
    replica_slots: Vec<ReplicaSlot>,
    free_replicas: Vec<u32>,
    sources: Vec<Source>,
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
    /// Changes, in order, with their sources, waiting for [`Inner::flush`] (kept for its
    /// capacity).
    pending: Vec<(u32, Op)>,
}

/// One change of the index, as the mapper makes it.
#[derive(Debug, Clone, Copy)]
enum Op {
    Store { key: KeyId, tier: u8, tokens: u32 },
    Evict { key: KeyId },
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

fn key_of(prefix_hash: &[u8]) -> u64 {
    if let Some(first) = prefix_hash.first_chunk::<8>() {
        return u64::from_be_bytes(*first);
    }
    let mut b = [0u8; 8];
    b[..prefix_hash.len()].copy_from_slice(prefix_hash);
    u64::from_be_bytes(b)
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
        }
        if let Some(old) = retire.filter(|old| *old != source) {
            inner.retire(old, mappers, || self.mapper());
        }
        inner.sweep(SWEEP_PER_CALL);
    }

    /// Stops following `source` (one of a replica's): its entries stop counting at once and
    /// are reclaimed incrementally; its slot is free for another source.
    pub fn remove_source(&self, source: SourceId) {
        let mut state = self.write();
        let State { inner, mappers } = &mut *state;
        inner.retire(source, mappers, || self.mapper());
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
        for change in changes {
            match *change {
                KeyChange::Stored {
                    key,
                    tokens,
                    tier,
                    adapter,
                } => {
                    let key = KeyId::new(key, inner.adapter(adapter));
                    let tier = u8::from(tier != Tier::T1);
                    inner.store(key, slot, tier, tokens, budget);
                }
                KeyChange::Evicted { key, adapter } => {
                    let Some(&adapter) = inner.adapters.get(adapter) else {
                        continue;
                    };
                    inner.evict(KeyId::new(key, adapter), slot);
                }
                KeyChange::Cleared => inner.lapse(slot),
            }
        }
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
                    epoch: 0,
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
        Ok(SourceId {
            slot,
            generation: s.generation,
        })
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
        inner.replica_slots[id as usize].state = Some(state);
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
        inner.replica_slots[id as usize].state = None;
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

/// Slots of the key tables the incremental sweep visits on each call that changes the index,
/// while a pass is owed: a few microseconds at most under the write lock.
const SWEEP_PER_CALL: usize = 1024;

/// More slots visited for each change a call applies: the sweep keeps pace with the changes
/// that make garbage, so lapsed holders never outnumber the live ones by much.
const SWEEP_PER_CHANGE: usize = 8;

/// Query blocks looked up together: their keys are made (chained from token ids), then their
/// slots loaded at once so the cache misses overlap, then they are matched in order. A query
/// stops at its first miss, so the blocks after it are never hashed.
const SCORE_CHUNK: usize = 16;

/// The buffers a scoring thread reuses from query to query (the answer's own list is the only
/// allocation of a query). Each holds what the largest query and fleet it served needed.
#[derive(Debug, Default)]
struct Scratch {
    /// A chunk's prefix keys.
    keys: Vec<u64>,
    /// The sources matching every block so far.
    alive: Vec<Holder>,
    /// (source, blocks, tokens, tier) of the sources whose match ended.
    done: Vec<(u32, u32, u32, u8)>,
    /// Per replica, its best source's (blocks, tokens, tier).
    best: Vec<Option<(u32, u32, u8)>>,
    /// (sort key, replica) of the replicas in the answer.
    order: Vec<(u64, u32)>,
    /// Per replica, whether it is among the candidates asked about.
    asked: Vec<bool>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

impl QueryKeys<'_> {
    /// Replaces `out` with the keys of blocks `from..from + SCORE_CHUNK` (fewer at the end);
    /// `parent` is the prefix key of block `from - 1`.
    fn chunk(&self, from: usize, parent: Option<u64>, out: &mut Vec<u64>) {
        out.clear();
        match *self {
            QueryKeys::Keys(keys) => {
                out.extend(keys.iter().skip(from).take(SCORE_CHUNK));
            }
            QueryKeys::Tokens { ids, block_size } => {
                let start = (from * block_size).min(ids.len());
                let end = ((from + SCORE_CHUNK) * block_size).min(ids.len());
                kvevent_fingerprint::prefixes_into(&ids[start..end], block_size, parent, out);
            }
        }
    }
}

/// One source's batch, written into the index as the mapper makes its keys.
struct Apply<'a> {
    inner: &'a mut Inner,
    source: u32,
    budget: usize,
}

impl Apply<'_> {
    #[inline]
    fn adapter(&mut self, name: &Arc<str>) -> u32 {
        match &self.inner.sources[self.source as usize].adapter {
            Some((last, id)) if Arc::ptr_eq(last, name) => *id,
            _ => self.new_adapter(name),
        }
    }

    /// [`Apply::adapter`] for an adapter other than the source's last.
    #[cold]
    #[inline(never)]
    fn new_adapter(&mut self, name: &Arc<str>) -> u32 {
        let id = self.inner.adapter(name);
        self.inner.sources[self.source as usize].adapter = Some((name.clone(), id));
        id
    }
}

impl mapper::Sink for Apply<'_> {
    fn prefix(&mut self, key: &[u8], tokens: u32, tier: Tier, adapter: &Arc<str>, _new: bool) {
        let key = KeyId::new(key_of(key), self.adapter(adapter));
        let tier = u8::from(tier != Tier::T1);
        self.inner.prefetch_key(&key);
        self.inner
            .pending
            .push((self.source, Op::Store { key, tier, tokens }));
    }

    fn end_update(&mut self, _ts: i64) {}

    fn evicted(&mut self, key: &[u8], adapter: &Arc<str>, _ts: i64) {
        let key = KeyId::new(key_of(key), self.adapter(adapter));
        self.inner.prefetch_key(&key);
        self.inner.pending.push((self.source, Op::Evict { key }));
    }

    /// An engine clear: the source's entries stop counting (after the changes before it).
    fn cleared(&mut self, _ts: i64) {
        self.inner.flush(self.inner.pending.len(), self.budget);
        self.inner.lapse(self.source);
    }
}

/// Whether `h` counts: its source is followed and has not lapsed since `h` was stored.
fn counts(sources: &[Source], h: &Holder) -> bool {
    sources
        .get(h.source() as usize)
        .is_some_and(|s| s.live && s.counting && s.epoch == h.epoch())
}

/// Whether `h` counts or will once its source's snapshot is promoted: what the sweep keeps.
fn counts_or_loading(sources: &[Source], h: &Holder) -> bool {
    sources
        .get(h.source() as usize)
        .is_some_and(|s| s.live && s.epoch == h.epoch())
}

impl Inner {
    fn adapter(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.adapters.get(name) {
            return id;
        }
        let id = self.adapters.len() as u32;
        self.adapters.insert(name.to_owned(), id);
        id
    }

    /// Starts loading the control words of `key`'s buckets in either generation, as the
    /// mapper makes the change: they come in while the rest of its batch is mapped.
    #[inline]
    fn prefetch_key(&self, key: &KeyId) {
        self.young.prefetch(key);
        self.old.prefetch(key);
    }

    /// The slot of `source` if it is still followed (a handle of a removed source names
    /// nothing, even once its slot is reused).
    fn live(&self, source: SourceId) -> Option<u32> {
        self.sources
            .get(source.slot as usize)
            .filter(|s| s.live && s.generation == source.generation)
            .map(|_| source.slot)
    }

    /// The number of `name`, given one (a free one first) if it has none.
    fn replica(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.replica_ids.get(name) {
            return id;
        }
        let name: Arc<str> = Arc::from(name);
        let id = match self.free_replicas.pop() {
            Some(id) => {
                Arc::make_mut(&mut self.replicas)[id as usize] = name.clone();
                id
            }
            None => {
                Arc::make_mut(&mut self.replicas).push(name.clone());
                self.replica_slots.push(ReplicaSlot::default());
                (self.replicas.len() - 1) as u32
            }
        };
        self.replica_slots[id as usize] = ReplicaSlot {
            in_use: true,
            ..ReplicaSlot::default()
        };
        let names = &self.replicas;
        let at = self
            .by_name
            .partition_point(|r| names[*r as usize] < names[id as usize]);
        self.by_name.insert(at, id);
        self.replica_ids.insert(name, id);
        id
    }

    /// Gives `id`'s number back if nothing keeps it: no live source, no state set.
    fn release_replica(&mut self, id: u32) {
        let r = &self.replica_slots[id as usize];
        if !r.in_use || r.sources > 0 || r.state.is_some() {
            return;
        }
        self.replica_slots[id as usize] = ReplicaSlot::default();
        let name = &self.replicas[id as usize];
        self.replica_ids.remove(name);
        let names = &self.replicas;
        if let Ok(at) = self
            .by_name
            .binary_search_by(|r| names[*r as usize].cmp(&names[id as usize]))
        {
            self.by_name.remove(at);
        }
        self.free_replicas.push(id);
    }

    /// `source` is no longer followed: it stops counting at once (its epoch moves on), its
    /// holders are reclaimed by the sweep, its mapper's memory goes, and its slot is free.
    fn retire(&mut self, source: SourceId, mappers: &mut [Mapper], blank: impl Fn() -> Mapper) {
        let Some(slot) = self.live(source) else {
            return;
        };
        let s = &mut self.sources[slot as usize];
        let replica = s.replica;
        let r = &mut self.replica_slots[replica as usize];
        r.sources -= 1;
        s.live = false;
        s.counting = false;
        s.adapter = None;
        self.lapse(slot);
        if let Some(m) = mappers.get_mut(slot as usize) {
            *m = blank();
        }
        self.free_sources.push(slot);
        self.release_replica(replica);
    }

    /// Everything `source` held stops counting: its epoch moves on, so its older holders are
    /// invalid ([`counts`]); the sweep reclaims them, and a store that meets one drops it.
    /// Should the epoch wrap, they are dropped now, so that none can count again.
    fn lapse(&mut self, source: u32) {
        let Some(s) = self.sources.get_mut(source as usize) else {
            return;
        };
        s.epoch = s.epoch.wrapping_add(1);
        self.lapses = self.lapses.wrapping_add(1);
        if !self.sweep.owed {
            self.sweep = Sweep {
                owed: true,
                in_old: false,
                cursor: 0,
                lapses_at_start: self.lapses,
            };
        }
        if s.epoch == 0 {
            self.drop_holders(|h| h.source() == source);
        }
    }

    /// Visits up to `slots` slots of the key tables while a pass is owed, dropping lapsed
    /// holders and the keys left with none. A pass goes over the young table, then the old;
    /// another follows when a holder lapsed during it. Bounded work per call: removing a
    /// replica never scans the table under the write lock, and what it held goes within a
    /// pass.
    fn sweep(&mut self, mut slots: usize) {
        while self.sweep.owed && slots > 0 {
            let lapses = self.lapses;
            let sources = &self.sources;
            let lists = &mut self.lists;
            let (table, bytes) = if self.sweep.in_old {
                (&mut self.old, &mut self.old_bytes)
            } else {
                (&mut self.young, &mut self.young_bytes)
            };
            let shares = &mut self.shares;
            let (visited, next) = table.sweep(self.sweep.cursor, slots, |e| {
                let holders = e.holders;
                if holders.stamped_with(lapses) {
                    return true;
                }
                let had = holders.len(lists);
                let before = entry_bytes(had);
                let kept = holders.retain(lists, |h| counts_or_loading(sources, h));
                shares.changed(had, kept.len(lists));
                let after = entry_bytes(kept.len(lists));
                *bytes = (*bytes + after).saturating_sub(before);
                e.holders = kept.stamped(lapses);
                kept != Holders::NONE
            });
            slots = slots.saturating_sub(visited.max(1));
            match next {
                Some(cursor) => self.sweep.cursor = cursor,
                None if !self.sweep.in_old => {
                    self.sweep.in_old = true;
                    self.sweep.cursor = 0;
                }
                None => {
                    self.sweep = Sweep {
                        owed: self.sweep.lapses_at_start != lapses,
                        in_old: false,
                        cursor: 0,
                        lapses_at_start: lapses,
                    };
                }
            }
        }
    }

    /// Makes the first `n` pending changes, in order.
    fn flush(&mut self, n: usize, budget: usize) {
        let mut pending = std::mem::take(&mut self.pending);
        for (source, op) in pending.drain(..n) {
            match op {
                Op::Store { key, tier, tokens } => self.store(key, source, tier, tokens, budget),
                Op::Evict { key } => self.evict(key, source),
            }
        }
        self.pending = pending;
    }

    /// `source` no longer holds `key`.
    fn evict(&mut self, key: KeyId, source: u32) {
        self.stats.applied += 1;
        let lists = &mut self.lists;
        for (map, bytes) in [
            (&mut self.young, &mut self.young_bytes),
            (&mut self.old, &mut self.old_bytes),
        ] {
            // One walk finds the key and removes it when its last holder goes.
            if let TableEntry::Occupied(mut entry) = map.entry(key) {
                let holders = entry.get().holders;
                let had = holders.len(lists);
                let before = entry_bytes(had);
                let after = holders.remove(lists, source);
                self.shares.changed(had, after.len(lists));
                if after == Holders::NONE {
                    entry.remove();
                    *bytes = bytes.saturating_sub(before);
                } else {
                    entry.get_mut().holders = after;
                    *bytes = (*bytes + entry_bytes(after.len(lists))).saturating_sub(before);
                }
                // A key lives in one generation only (a store moves it to the young one).
                return;
            }
        }
    }

    fn store(&mut self, key: KeyId, source: u32, tier: u8, tokens: u32, budget: usize) {
        self.stats.applied += 1;
        let epoch = self.sources[source as usize].epoch;
        let holder = Holder::new(source, epoch, tier);
        let sources = &self.sources;
        // A loading source's holders stay: they count once its snapshot is promoted.
        let valid = |h: &Holder| counts_or_loading(sources, h);
        let lists = &mut self.lists;
        // What the young table would take with one more key, read before its entry is borrowed.
        let young_after_insert = self.young.bytes_after_insert();
        let vacant = match self.young.entry(key) {
            TableEntry::Occupied(o) => {
                // Already young: updated where it is (one lookup, no move).
                let entry = o.into_mut();
                let holders = entry.holders;
                let had = holders.len(lists);
                let before = entry_bytes(had);
                let after = holders.store(lists, self.lapses, valid, holder);
                self.shares.changed(had, after.len(lists));
                *entry = Entry {
                    tokens,
                    holders: after,
                };
                self.young_bytes =
                    (self.young_bytes + entry_bytes(after.len(lists))).saturating_sub(before);
                return;
            }
            TableEntry::Vacant(v) => v,
        };
        // An entry stored again moves to the young generation.
        let known = match self.old.remove(&key) {
            Some(e) => {
                let holders = e.holders;
                self.old_bytes = self
                    .old_bytes
                    .saturating_sub(entry_bytes(holders.len(lists)));
                holders
            }
            None => Holders::NONE,
        };
        let had = known.len(lists);
        let holders = known.store(lists, self.lapses, valid, holder);
        self.shares.changed(had, holders.len(lists));
        let heap = entry_bytes(holders.len(lists));
        // The budget counts what the key tables really hold: when this insert would make the
        // young table grow past it, the old generation goes first and the young one becomes
        // old (an entry not stored again for a whole generation is dropped).
        let after =
            self.old.bytes() + young_after_insert + self.old_bytes + self.young_bytes + heap;
        if after > budget {
            // The young table moves to the old generation: the walk's place is gone with it.
            self.stats.evicted_keys += self.old.len() as u64;
            for e in self.old.values() {
                let h = e.holders;
                self.shares.changed(h.len(lists), 0);
                h.free(lists);
            }
            let fresh = Keys::new();
            self.old = std::mem::replace(&mut self.young, fresh);
            self.old_bytes = std::mem::take(&mut self.young_bytes);
            self.young.insert_new(key, Entry { tokens, holders });
        } else {
            // Where the lookup's walk ended.
            vacant.insert(Entry { tokens, holders });
        }
        self.young_bytes += heap;
    }

    fn drop_holders(&mut self, gone: impl Fn(&Holder) -> bool) {
        let lists = &mut self.lists;
        for (map, bytes) in [
            (&mut self.young, &mut self.young_bytes),
            (&mut self.old, &mut self.old_bytes),
        ] {
            let shares = &mut self.shares;
            map.retain(|e| {
                let had = { e.holders }.len(lists);
                let kept = { e.holders }.retain(lists, |h| !gone(h));
                shares.changed(had, kept.len(lists));
                e.holders = kept;
                kept != Holders::NONE
            });
            *bytes = map
                .values()
                .map(|e| {
                    let h = e.holders;
                    entry_bytes(h.len(lists))
                })
                .sum();
        }
    }

    fn lookup(&self, key: &KeyId) -> Option<Entry> {
        self.young.get(key).or_else(|| self.old.get(key)).copied()
    }

    fn score(&self, query: &QueryKeys<'_>, adapter: &str, candidates: Option<&[&str]>) -> Scores {
        SCRATCH.with(|scratch| {
            let scratch = &mut *scratch.borrow_mut();
            scratch.best.clear();
            scratch.best.resize(self.replicas.len(), None);
            let adapter = self.adapters.get(adapter);
            if let Some(&adapter) = adapter
                && !matches!(query, QueryKeys::Tokens { block_size: 0, .. })
            {
                self.match_blocks(query, adapter, scratch);
            }
            self.answer(candidates, scratch)
        })
    }

    /// Per replica in `scratch.best`, its best source's match of the query.
    fn match_blocks(&self, query: &QueryKeys<'_>, adapter: u32, scratch: &mut Scratch) {
        let Scratch {
            keys,
            alive,
            done,
            best,
            ..
        } = scratch;
        // Sources still matching, sorted by source, each with its worst tier so far. They all
        // matched the same blocks so far (`matched`, covering `tokens`); one that drops out goes
        // to `done` with them. Validity is checked at block 0; later blocks need the same epoch.
        alive.clear();
        done.clear();
        let (mut matched, mut tokens) = (0u32, 0u32);
        // The blocks are looked up one after another until one misses, `SCORE_CHUNK` at a
        // time: each chunk's slots are loaded first, so their cache misses overlap.
        for i in 0.. {
            if i % SCORE_CHUNK == 0 {
                let parent = if i == 0 { None } else { keys.last().copied() };
                query.chunk(i, parent, keys);
                for k in keys.iter() {
                    let key = KeyId::new(*k, adapter);
                    self.young.prefetch(&key);
                    self.old.prefetch(&key);
                }
                for k in keys.iter() {
                    let key = KeyId::new(*k, adapter);
                    self.young.prefetch_slot(&key);
                    self.old.prefetch_slot(&key);
                }
            }
            let Some(k) = keys.get(i % SCORE_CHUNK) else {
                break;
            };
            let Some(entry) = self.lookup(&KeyId::new(*k, adapter)) else {
                break;
            };
            let view = { entry.holders }.view(&self.lists);
            let holders = view.as_slice();
            if i == 0 {
                alive.extend(holders.iter().filter(|h| counts(&self.sources, h)));
            } else {
                // Merge the two sorted lists in place: who holds block i too goes on, with the
                // worse tier (the larger word: same source and epoch). The blocks of a shared
                // prompt mostly have the same holders, tiers included, so runs of eight equal
                // words are taken whole (compared with no branch but one a run of eight) and
                // only the words around a difference are merged one by one.
                let (mut r, mut j, mut kept) = (0, 0, 0);
                while r < alive.len() {
                    let run = alive[r..]
                        .chunks_exact(8)
                        .zip(holders[j..].chunks_exact(8))
                        .take_while(|(a, h)| {
                            a.iter().zip(*h).fold(0, |d, (a, h)| d | (a.0 ^ h.0)) == 0
                        })
                        .count()
                        * 8;
                    if kept != r {
                        alive.copy_within(r..r + run, kept);
                    }
                    (r, j, kept) = (r + run, j + run, kept + run);
                    let Some(&a) = alive.get(r) else { break };
                    while holders.get(j).is_some_and(|h| h.source() < a.source()) {
                        j += 1;
                    }
                    match holders.get(j) {
                        Some(&h) if h.same_id(a) => {
                            alive[kept] = a.max(h);
                            kept += 1;
                            j += 1;
                        }
                        _ => done.push((a.source(), matched, tokens, a.tier())),
                    }
                    r += 1;
                }
                alive.truncate(kept);
            }
            if alive.is_empty() {
                break;
            }
            matched += 1;
            tokens = entry.tokens;
        }
        done.extend(
            alive
                .iter()
                .map(|a| (a.source(), matched, tokens, a.tier())),
        );
        // Per replica, its best source.
        for &(source, blocks, tokens, tier) in done.iter() {
            let replica = self.sources[source as usize].replica as usize;
            let candidate = (blocks, tokens, tier);
            let better = |b: &(u32, u32, u8)| {
                (blocks, tokens, std::cmp::Reverse(tier)) > (b.0, b.1, std::cmp::Reverse(b.2))
            };
            if best[replica].as_ref().is_none_or(better) {
                best[replica] = Some(candidate);
            }
        }
    }

    /// The answer from `scratch.best`: the replicas matching block 0, or every candidate
    /// known (matching or not) and the positions of those unknown.
    fn answer(&self, candidates: Option<&[&str]>, scratch: &mut Scratch) -> Scores {
        let Scratch {
            best, order, asked, ..
        } = scratch;
        let mut unknown = Vec::new();
        if let Some(candidates) = candidates {
            asked.clear();
            asked.resize(self.replicas.len(), false);
            for (i, name) in candidates.iter().enumerate() {
                match self.replica_ids.get(*name) {
                    Some(&id) => {
                        asked[id as usize] = true;
                        best[id as usize].get_or_insert((0, 0, 0));
                    }
                    None => unknown.push(i),
                }
            }
        }
        // Best first: most tokens, most blocks, T1 before T2, then by name. The replicas are
        // taken in name order and sorted stably by the rest as one number: many tie on a
        // shared prompt, and sorting runs of equal keys is cheap.
        order.clear();
        order.extend(self.by_name.iter().filter_map(|&replica| {
            if candidates.is_some() && !asked[replica as usize] {
                return None;
            }
            let (blocks, tokens, tier) = best[replica as usize]?;
            // A query of 2^31 blocks or more is not a real one: such counts tie.
            let blocks = u64::from(blocks.min(u32::MAX >> 1));
            let key = (u64::from(!tokens) << 32) | ((!blocks & 0x7fff_ffff) << 1) | u64::from(tier);
            Some((key, replica))
        }));
        order.sort_by_key(|&(key, _)| key);
        let mut entries = Vec::with_capacity(order.len());
        entries.extend(order.iter().map(|&(_, replica)| {
            let (blocks, tokens, tier) = best[replica as usize].unwrap_or_default();
            let tier = if tier == 0 { Tier::T1 } else { Tier::T2 };
            let slot = &self.replica_slots[replica as usize];
            Answer {
                replica,
                blocks,
                tokens,
                tier,
                state: slot.state(),
            }
        }));
        Scores {
            names: self.replicas.clone(),
            entries,
            unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hash: u64) -> wire::EventBatch<'static> {
        wire::EventBatch {
            ts: 0.0,
            events: vec![wire::Event::BlockStored(wire::BlockStored {
                block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(hash))],
                token_ids: wire::TokenIds::from(vec![0u32; 4]),
                block_size: 4,
                ..Default::default()
            })],
            data_parallel_rank: None,
            unknown_events: 0,
        }
    }

    fn holders(index: &Index, key: u64) -> Vec<String> {
        let answer = index.score(&Query {
            adapter: "",
            keys: QueryKeys::Keys(&[key]),
        });
        answer.iter().map(|s| s.replica.to_owned()).collect()
    }

    #[test]
    fn a_holder_is_one_word_inline_or_in_a_list() {
        let h = Holder::new(MAX_SOURCES - 1, u32::MAX, 1);
        assert_eq!(
            (h.source(), h.epoch(), h.tier()),
            (MAX_SOURCES - 1, u32::MAX, 1)
        );
        let lists = Lists::default();
        assert!(matches!(Holders::one(h).view(&lists), HolderView::One(v) if v == h));
        // Words sort by source first, and by tier last.
        assert!(Holder::new(1, u32::MAX, 1) < Holder::new(2, 0, 0));
        assert!(Holder::new(2, 5, 0) < Holder::new(2, 5, 1));
        assert!(Holder::new(2, 5, 0).same_id(Holder::new(2, 5, 1)));
        assert!(!Holder::new(2, 5, 0).same_id(Holder::new(2, 6, 0)));
    }

    /// The scan the counters replace: every key's holders, as stored.
    fn scanned(index: &Index) -> (usize, u64, u64) {
        let state = index.read();
        let inner = &state.inner;
        let lens: Vec<usize> = inner
            .young
            .values()
            .chain(inner.old.values())
            .map(|e| {
                let h = e.holders;
                h.len(&inner.lists)
            })
            .collect();
        let held = lens.iter().sum::<usize>() as u64;
        let shared = lens
            .iter()
            .map(|h| (h * h.saturating_sub(1) / 2) as u64)
            .sum();
        (lens.len(), held, shared)
    }

    /// The duplication figures, kept as changes apply, equal a full scan after every change:
    /// stores, evictions, resets (lapses the sweep then drops), removals, a budget that drops
    /// the old generation, sources added back into freed slots.
    #[test]
    fn the_sharing_counters_equal_a_scan_after_every_change() {
        let config = Config {
            mapping: mapper::Options {
                key_mode: KeyMode::Engine,
                ..mapper::Options::default()
            },
            byte_budget: 16 << 10,
        };
        let index = Index::new(config);
        let mut sources: Vec<SourceId> = ["a", "b", "c", "d"]
            .iter()
            .map(|r| index.add_source(r).expect("source"))
            .collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..20_000u64 {
            let r = next();
            let s = sources[(r % sources.len() as u64) as usize];
            let key = (r >> 8) % 3_000 + 1;
            match (r >> 40) % 1000 {
                0..=1 => index.reset(s),
                2..=3 if sources.len() > 2 => {
                    index.remove_source(s);
                    sources.retain(|x| *x != s);
                }
                4..=5 if sources.len() < 6 => {
                    sources.push(index.add_source(&format!("r{step}")).expect("source"));
                }
                6..=200 => index.apply(
                    s,
                    &wire::EventBatch {
                        ts: 0.0,
                        events: vec![wire::Event::BlockRemoved(wire::BlockRemoved {
                            block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(key))],
                            ..Default::default()
                        })],
                        data_parallel_rank: None,
                        unknown_events: 0,
                    },
                ),
                _ => index.apply(s, &stored(key)),
            }
            let stats = index.stats();
            let (keys, held, shared) = scanned(&index);
            assert_eq!(
                (stats.keys, stats.pairs as u64, stats.shared_pairs),
                (keys, held, shared),
                "step {step}"
            );
            let d = stats.duplication();
            assert!((0.0..1.0).contains(&d) || stats.pairs == 0, "{d}");
        }
        assert!(
            index.stats().evicted_keys > 0,
            "the budget dropped a generation: {:?}",
            index.stats()
        );
    }

    /// Should an epoch ever wrap, the source's older holders go at once: none of them can
    /// count again when the epoch comes back round.
    #[test]
    fn an_epoch_that_wraps_drops_the_holders_of_its_source() {
        let keys = Config {
            mapping: mapper::Options {
                key_mode: KeyMode::Engine,
                ..mapper::Options::default()
            },
            ..Config::default()
        };
        let index = Index::new(keys);
        let [a, b] = ["a", "b"].map(|r| index.add_source(r).expect("a source"));
        index.apply(b, &stored(1));
        // `a` stores key 1 at epoch 0, then its epoch is taken to the last before the wrap.
        index.apply(a, &stored(1));
        index.write().inner.sources[a.slot as usize].epoch = u32::MAX;
        assert_eq!(holders(&index, 1), ["b"]);
        index.reset(a); // u32::MAX -> 0: the epoch `a`'s holder was stored at.
        assert_eq!(index.read().inner.sources[a.slot as usize].epoch, 0);
        assert_eq!(holders(&index, 1), ["b"]);
        assert_eq!(index.stats().pairs, 1, "a's holder is gone, not lapsed");
    }
}
