//! The key tables and the byte budget: [`KeyId`] → [`Entry`] in two generations (young, old),
//! stores and evictions in order, the mapper's [`Apply`] sink, [`IndexStats`].
//!
//! Invariants: a key lives in one generation at most, and a store moves it to the young one;
//! the tables and holder lists stay within the budget (the old generation goes first); an
//! entry with no holder is no entry; the byte counts are what the tables and lists hold.

use super::*;

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

/// A key's identity, 8 bytes: its prefix key mixed (a bijection), then, for an adapter other
/// than the base model's, told apart by a word of the adapter's own (`mix(key) ^ salt`). It is
/// its own hash, so a probe walk hashes nothing. Two identities of one adapter never meet; of
/// two adapters they meet only where their 64-bit keys would (one chance in 2^64 a pair, as
/// for any two fingerprints), so the adapter is not kept beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct KeyId(u64);

impl KeyId {
    pub(crate) fn new(key: u64, adapter: u32) -> Self {
        let salt = match adapter {
            0 => 0,
            a => kvevent_table::mix(u64::from(a) | 1 << 63),
        };
        Self(kvevent_table::mix(key) ^ salt)
    }
}

impl kvevent_table::Key for KeyId {
    fn hash(&self) -> u64 {
        self.0
    }
}

/// What the index knows of a key, 16 bytes: the prefix's token count and its holders.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Entry {
    pub(crate) tokens: u32,
    pub(crate) holders: Holders,
}

/// The key table (see `kvevent_table`): 24-byte slots and a tag byte each, 72–90 % full, no
/// tombstones.
pub(crate) type Keys = kvevent_table::Table<KeyId, Entry>;

/// One change of the index, as the mapper makes it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    Store { key: KeyId, tier: u8, tokens: u32 },
    Evict { key: KeyId },
}

/// A prefix's key (the mapper's bytes: a fingerprint, or an engine's hash) as the index keeps
/// it: its first 8 bytes, big-endian; a shorter one left-aligned (zeros after it). Offline
/// tools fold keys with it to count as a router's index does.
///
/// ```
/// use kvevent_index::fold_key;
/// assert_eq!(fold_key(&[1, 2, 3, 4, 5, 6, 7, 8, 9]), 0x0102_0304_0506_0708);
/// assert_eq!(fold_key(&[1, 2]), 0x0102_0000_0000_0000);
/// ```
pub fn fold_key(prefix_hash: &[u8]) -> u64 {
    if let Some(first) = prefix_hash.first_chunk::<8>() {
        return u64::from_be_bytes(*first);
    }
    let mut b = [0u8; 8];
    b[..prefix_hash.len()].copy_from_slice(prefix_hash);
    u64::from_be_bytes(b)
}

/// One source's batch, written into the index as the mapper makes its keys.
pub(crate) struct Apply<'a> {
    pub(crate) inner: &'a mut Inner,
    pub(crate) source: u32,
    pub(crate) budget: usize,
}

impl Apply<'_> {
    #[inline]
    pub(crate) fn adapter(&mut self, name: &Arc<str>) -> u32 {
        match &self.inner.sources[self.source as usize].adapter {
            Some((last, id)) if Arc::ptr_eq(last, name) => *id,
            _ => self.new_adapter(name),
        }
    }

    /// [`Apply::adapter`] for an adapter other than the source's last.
    #[cold]
    #[inline(never)]
    pub(crate) fn new_adapter(&mut self, name: &Arc<str>) -> u32 {
        let id = self.inner.adapter(name);
        self.inner.sources[self.source as usize].adapter = Some((name.clone(), id));
        id
    }
}

impl mapper::Sink for Apply<'_> {
    fn prefix(&mut self, key: &[u8], tokens: u32, tier: Tier, adapter: &Arc<str>, _new: bool) {
        let key = KeyId::new(fold_key(key), self.adapter(adapter));
        let tier = u8::from(tier != Tier::T1);
        self.inner.prefetch_key(&key);
        self.inner
            .pending
            .push((self.source, Op::Store { key, tier, tokens }));
    }

    fn end_update(&mut self, _ts: i64) {}

    fn evicted(&mut self, key: &[u8], adapter: &Arc<str>, _ts: i64) {
        let key = KeyId::new(fold_key(key), self.adapter(adapter));
        self.inner.prefetch_key(&key);
        self.inner.pending.push((self.source, Op::Evict { key }));
    }

    /// An engine clear: the source's entries stop counting (after the changes before it).
    fn cleared(&mut self, _ts: i64) {
        self.inner.flush(self.inner.pending.len(), self.budget);
        self.inner.lapse(self.source);
    }
}

impl Inner {
    pub(crate) fn adapter(&mut self, name: &str) -> u32 {
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
    pub(crate) fn prefetch_key(&self, key: &KeyId) {
        self.young.prefetch(key);
        self.old.prefetch(key);
    }

    /// Makes the first `n` pending changes, in order.
    pub(crate) fn flush(&mut self, n: usize, budget: usize) {
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
    pub(crate) fn evict(&mut self, key: KeyId, source: u32) {
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

    pub(crate) fn store(&mut self, key: KeyId, source: u32, tier: u8, tokens: u32, budget: usize) {
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
                // A list that grew is held to the budget like a new key.
                self.hold_to(budget);
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
            self.rotate();
            self.young.insert_new(key, Entry { tokens, holders });
        } else {
            // Where the lookup's walk ended.
            vacant.insert(Entry { tokens, holders });
        }
        self.young_bytes += heap;
        self.hold_to(budget);
    }

    /// Bytes the key tables (by capacity) and holder lists hold.
    pub(crate) fn bytes(&self) -> usize {
        self.young.bytes() + self.old.bytes() + self.young_bytes + self.old_bytes
    }

    /// Past `budget` (a holder list grew, or the old generation alone is past it): the old
    /// generation goes and the young one becomes old; still past, that goes too.
    fn hold_to(&mut self, budget: usize) {
        if self.bytes() > budget {
            self.rotate();
        }
        if self.bytes() > budget {
            self.drop_old();
        }
    }

    /// The old generation goes and the young one becomes old.
    fn rotate(&mut self) {
        self.drop_old();
        self.old = std::mem::take(&mut self.young);
        self.old_bytes = std::mem::take(&mut self.young_bytes);
    }

    /// The old generation's entries go (counted in `evicted_keys`).
    fn drop_old(&mut self) {
        self.stats.evicted_keys += self.old.len() as u64;
        for e in self.old.values() {
            self.shares.changed(e.holders.len(&self.lists), 0);
            e.holders.free(&mut self.lists);
        }
        self.old = Keys::new();
        self.old_bytes = 0;
    }

    /// Room in the young table for the keys of `blocks` more blocks arriving at once (see
    /// [`Index::reserve`]); `room` remembers what was asked while snapshots load, so that the
    /// snapshots of a fleet joining together add up.
    pub(crate) fn reserve(&mut self, blocks: usize, budget: usize) {
        // Blocks other sources hold add no key: the new keys are estimated from the keys a
        // pair so far (one when empty).
        let keys = self.young.len() + self.old.len();
        let want = match self.shares.held {
            0 => blocks,
            held => (blocks as u128 * keys as u128).div_ceil(u128::from(held)) as usize,
        };
        // The keys expected once every snapshot announced is in (a fleet's snapshots
        // announced while others load add up).
        let len = self.young.len();
        let room = self.room.max(len).saturating_add(want);
        self.room = room;
        // Room the table has, or little beside what it holds (its ordinary growth of ×1.25
        // does as well): nothing to take now.
        if room - len < len / 4 || self.young.bytes_with_room(room - len) <= self.young.bytes() {
            return;
        }
        // Growing moves every key held: when it grows, the table at least doubles, so that a
        // fleet whose announcements trickle in while the first snapshots load moves each key
        // a bounded number of times (fleet-join: 64 sidecars' hellos over seconds made one
        // move of everything each, half of its join). What goes unused is given back after
        // the load ([`Self::fit_after_load`]); within the budget, else only what was asked.
        let doubled = room.max(self.young.capacity().saturating_mul(2)) - len;
        for additional in [doubled, room - len] {
            let after = self.bytes() - self.young.bytes() + self.young.bytes_with_room(additional);
            if after <= budget {
                self.young.reserve(additional);
                return;
            }
        }
    }

    /// Once no snapshot loads, room reserved and not used goes back ([`Table::fit`]).
    pub(crate) fn fit_after_load(&mut self) {
        if self.room == 0 || self.sources.iter().any(|s| s.live && !s.counting) {
            return;
        }
        self.room = 0;
        self.young.fit();
    }

    pub(crate) fn lookup(&self, key: &KeyId) -> Option<Entry> {
        self.young.get(key).or_else(|| self.old.get(key)).copied()
    }
}
