//! A compact hash table for many small `Copy` entries: open addressing, Robin Hood probing,
//! backward-shift deletion, any size. The index's key table and the mapper's per-source block
//! maps are both one.
//!
//! Why not hashbrown: its deletions leave tombstones, and a table more than 7/16 full whose
//! free room the tombstones used up doubles instead of rehashing in place, so under an
//! engine's steady churn (a block stored, the oldest evicted) a table holding the same keys
//! settled at twice its size (measured with `churn-scan`: 10,000–14,000, 20,000–28,000 and
//! 40,000–56,000 keys all doubled). And it sizes by powers of two: 4,096 blocks sit in 8,192
//! buckets. Here:
//!
//! - A slot is the entry itself, `(K, V)`, no control byte: a key equal to [`Key::EMPTY`]
//!   marks an empty slot (the key type reserves one value for it).
//! - Any number of slots (the slot is the hash scaled to the table, not masked), from 16:
//!   grows ×1.25 past 9/10 full, shrinks to 3/5 full below 3/10. So a growing table is
//!   72–90 % full whatever it holds (80 % on average: about 1.25 slots a key), where a
//!   power-of-two table can be half empty; one that shrank is 60–90 % full.
//! - A deletion shifts the following entries of its run back, leaving no tombstone: the
//!   table's size depends only on how many keys it holds, never on its history.
//! - Robin Hood: an insert takes the slot of an entry closer to its home than the insert is
//!   to its own, which keeps probe runs short and even at 9/10 full; a lookup stops as soon
//!   as it passes where its key would have been.
//!
//! Invariant: every stored key sits at or after its home slot (cyclically), and no empty slot
//! and no entry nearer its own home lies between its home and it.

/// Most keys to [`Table::touch`] ahead of their lookups: loads beyond this many would leave
/// the cache before their turn (a long batch touches its first ones only).
pub const TOUCH_AHEAD: usize = 64;

/// A key the table can hold.
pub trait Key: Copy + Eq {
    /// A value no stored key ever takes: it marks an empty slot.
    const EMPTY: Self;
    /// The key's hash; its high bits pick the slot, so they must be well mixed (see [`mix`]).
    fn hash(&self) -> u64;
}

/// A 64-bit finaliser (MurmurHash3's): every input bit moves every output bit, so sequential
/// or structured keys (small integers, big-endian bytes) spread over the table too.
#[must_use]
pub fn mix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h ^= h >> 33;
    h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^ (h >> 33)
}

const MIN_SLOTS: usize = 16;

/// Slots for `n` entries at 4/5 full (a rebuild's size).
fn slots_for(n: usize) -> usize {
    (n * 5 / 4 + 1).max(MIN_SLOTS)
}

/// The table. `V::default()` fills empty slots (never read).
#[derive(Debug, Clone)]
pub struct Table<K, V> {
    slots: Vec<(K, V)>,
    len: usize,
}

impl<K, V> Default for Table<K, V> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            len: 0,
        }
    }
}

/// Where a key with hash `h` would sit in a table of `n` slots, undisturbed.
fn home_of(h: u64, n: usize) -> usize {
    ((u128::from(h) * n as u128) >> 64) as usize
}

impl<K: Key, V: Copy + Default> Table<K, V> {
    /// An empty table (no allocation until the first insert).
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds no entry.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the slot array.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(K, V)>()
    }

    /// Bytes the slot array would take after one more insert.
    #[must_use]
    pub fn bytes_after_insert(&self) -> usize {
        if self.grows_on_insert() {
            self.grown() * std::mem::size_of::<(K, V)>()
        } else {
            self.bytes()
        }
    }

    fn grows_on_insert(&self) -> bool {
        (self.len + 1) * 10 > self.slots.len() * 9
    }

    fn grown(&self) -> usize {
        (self.slots.len() * 5 / 4).max(MIN_SLOTS)
    }

    fn home(&self, key: &K) -> usize {
        home_of(key.hash(), self.slots.len())
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() { 0 } else { i + 1 }
    }

    /// How far slot `i` is from `home`.
    fn distance(&self, i: usize, home: usize) -> usize {
        if i >= home {
            i - home
        } else {
            i + self.slots.len() - home
        }
    }

    /// The slot holding `key`, if any.
    fn find(&self, key: &K) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = self.home(key);
        let mut d = 0;
        loop {
            let k = self.slots[i].0;
            if k == *key {
                return Some(i);
            }
            // An empty slot, or an entry nearer its home than `key` would be: `key` would
            // have taken this slot, so it is not here.
            if k == K::EMPTY || self.distance(i, self.home(&k)) < d {
                return None;
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// The value of `key`.
    #[must_use]
    pub fn get(&self, key: &K) -> Option<&V> {
        self.find(key).map(|i| &self.slots[i].1)
    }

    /// Loads `key`'s home slot into the cache, for a lookup that follows soon. A batch that
    /// touches all its keys first has their cache misses overlap (the loads do not depend on
    /// each other) instead of paying them one after another: in a table much larger than the
    /// cache, a lookup is mostly that one miss. Touch at most [`TOUCH_AHEAD`] keys ahead.
    pub fn touch(&self, key: &K) {
        if !self.slots.is_empty() {
            std::hint::black_box(self.slots[self.home(key)].0);
        }
    }

    /// The value of `key`, to change in place.
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.find(key).map(|i| &mut self.slots[i].1)
    }

    /// Inserts a key that is not in the table (checked in debug builds).
    ///
    /// # Panics
    ///
    /// In debug builds, when `key` is [`Key::EMPTY`] or already present.
    pub fn insert_new(&mut self, key: K, value: V) {
        debug_assert!(key != K::EMPTY && self.find(&key).is_none());
        if self.grows_on_insert() {
            self.resize(self.grown());
        }
        self.place(key, value);
        self.len += 1;
    }

    fn place(&mut self, key: K, value: V) {
        let mut cur = (key, value);
        let mut i = self.home(&key);
        let mut d = 0;
        loop {
            let k = self.slots[i].0;
            if k == K::EMPTY {
                self.slots[i] = cur;
                return;
            }
            let dk = self.distance(i, self.home(&k));
            if dk < d {
                // Robin Hood: the richer entry moves on.
                std::mem::swap(&mut self.slots[i], &mut cur);
                d = dk;
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let mut hole = self.find(key)?;
        let removed = self.slots[hole].1;
        // Backward shift: the entries after the hole that are not at their home move back.
        let mut j = self.next(hole);
        loop {
            let k = self.slots[j].0;
            if k == K::EMPTY || self.home(&k) == j {
                break;
            }
            self.slots[hole] = self.slots[j];
            hole = j;
            j = self.next(j);
        }
        self.slots[hole] = (K::EMPTY, V::default());
        self.len -= 1;
        if self.slots.len() > MIN_SLOTS && self.len * 10 < self.slots.len() * 3 {
            self.resize((self.len * 5 / 3).max(MIN_SLOTS));
        }
        Some(removed)
    }

    /// Forgets every entry; the memory goes back too.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Room for `additional` more entries without growing.
    pub fn reserve(&mut self, additional: usize) {
        let want = (self.len + additional) * 10 / 9 + 1;
        if want > self.slots.len() {
            self.resize(want.max(MIN_SLOTS));
        }
    }

    fn resize(&mut self, slots: usize) {
        let old = std::mem::replace(&mut self.slots, vec![(K::EMPTY, V::default()); slots]);
        for (k, v) in old {
            if k != K::EMPTY {
                self.place(k, v);
            }
        }
    }

    /// Every entry, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.slots
            .iter()
            .filter(|(k, _)| *k != K::EMPTY)
            .map(|(k, v)| (k, v))
    }

    /// Every value, in table order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    /// Every entry, taken out; the table is left empty and its memory goes back.
    pub fn drain(&mut self) -> impl Iterator<Item = (K, V)> + use<K, V> {
        self.len = 0;
        std::mem::take(&mut self.slots)
            .into_iter()
            .filter(|(k, _)| *k != K::EMPTY)
    }

    /// Keeps the entries `keep` (which may change them) says to keep; rebuilt to fit.
    pub fn retain(&mut self, mut keep: impl FnMut(&mut V) -> bool) {
        let mut kept = Vec::with_capacity(self.len);
        for (k, mut v) in std::mem::take(&mut self.slots) {
            if k != K::EMPTY && keep(&mut v) {
                kept.push((k, v));
            }
        }
        self.len = kept.len();
        self.slots = vec![(K::EMPTY, V::default()); slots_for(kept.len())];
        for (k, v) in kept {
            self.place(k, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct K2(u64, u32);

    impl Key for K2 {
        const EMPTY: Self = K2(0, u32::MAX);
        fn hash(&self) -> u64 {
            mix(self.0 ^ u64::from(self.1).rotate_left(32))
        }
    }

    /// A key whose hash is its own value: collisions and long runs on demand.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Raw(u64);

    impl Key for Raw {
        const EMPTY: Self = Raw(u64::MAX);
        fn hash(&self) -> u64 {
            self.0
        }
    }

    fn check_invariant<K: Key + std::fmt::Debug, V: Copy + Default>(t: &Table<K, V>) {
        let n = t.slots.len();
        let mut held = 0;
        for (i, (k, _)) in t.slots.iter().enumerate() {
            if *k == K::EMPTY {
                continue;
            }
            held += 1;
            let home = t.home(k);
            let d = t.distance(i, home);
            // Every slot from home up to i is taken by an entry at least as far from its home.
            for step in 0..d {
                let j = (home + step) % n;
                let other = t.slots[j].0;
                assert!(other != K::EMPTY, "{k:?} at {i}: slot {j} empty before it");
            }
            assert_eq!(t.find(k), Some(i), "{k:?} not found at {i}");
        }
        assert_eq!(held, t.len);
    }

    #[test]
    fn agrees_with_a_hash_map_under_random_inserts_and_removes() {
        let mut table: Table<K2, u32> = Table::new();
        let mut model: HashMap<(u64, u32), u32> = HashMap::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys (collisions and long runs), clustered low bits too.
            let k = (x % 3_000) << (x % 3);
            let a = (x >> 40) as u32 % 3;
            if x % 5 < 3 {
                if let Some(v) = table.get_mut(&K2(k, a)) {
                    *v = step;
                } else {
                    table.insert_new(K2(k, a), step);
                }
                model.insert((k, a), step);
            } else {
                let got = table.remove(&K2(k, a));
                assert_eq!(got, model.remove(&(k, a)), "step {step}");
            }
            assert_eq!(table.len(), model.len());
            if step % 20_000 == 0 {
                check_invariant(&table);
            }
        }
        for ((k, a), v) in &model {
            assert_eq!(table.get(&K2(*k, *a)), Some(v));
        }
        table.retain(|v| *v % 2 == 0);
        model.retain(|_, v| *v % 2 == 0);
        assert_eq!(table.len(), model.len());
        check_invariant(&table);
        for ((k, a), v) in &model {
            assert_eq!(table.get(&K2(*k, *a)), Some(v));
        }
        let mut drained: Vec<_> = table.drain().map(|(k, v)| ((k.0, k.1), v)).collect();
        let mut want: Vec<_> = model.into_iter().collect();
        drained.sort_unstable();
        want.sort_unstable();
        assert_eq!(drained, want);
        assert!(table.is_empty());
        assert_eq!(table.bytes(), 0);
    }

    #[test]
    fn runs_that_wrap_around_the_end_are_found_and_shifted_back() {
        // Every key's home is the last slot or the one before it: the runs wrap.
        let mut table: Table<Raw, u64> = Table::new();
        table.reserve(10);
        let n = table.slots.len() as u64;
        let last = u64::MAX / n * (n - 1) + 1;
        let keys: Vec<u64> = (0..6).map(|i| last + i).collect();
        for &k in &keys {
            table.insert_new(Raw(k), k);
        }
        check_invariant(&table);
        table.remove(&Raw(keys[0]));
        table.remove(&Raw(keys[3]));
        check_invariant(&table);
        for &k in &[keys[1], keys[2], keys[4], keys[5]] {
            assert_eq!(table.get(&Raw(k)), Some(&k));
        }
        assert_eq!(table.get(&Raw(keys[0])), None);
    }

    #[test]
    fn structured_keys_spread() {
        // Small integers as big-endian bytes: the high bits vary last. Probe runs stay short.
        let mut table: Table<K2, u32> = Table::new();
        for k in 0..50_000u64 {
            table.insert_new(K2(k << 56 | k, 0), 0);
        }
        let longest = (0..table.slots.len())
            .filter(|&i| table.slots[i].0 != K2::EMPTY)
            .map(|i| table.distance(i, table.home(&table.slots[i].0)))
            .max()
            .unwrap_or(0);
        assert!(longest < 64, "longest probe {longest}");
    }

    #[test]
    fn churn_does_not_grow_it_and_emptying_shrinks_it() {
        let mut table: Table<K2, u32> = Table::new();
        for k in 0..20_000u64 {
            table.insert_new(K2(k, 0), 0);
        }
        let full = table.bytes();
        for k in 20_000..220_000u64 {
            table.insert_new(K2(k, 0), 0);
            table.remove(&K2(k - 20_000, 0));
        }
        assert_eq!(table.bytes(), full);
        for k in 200_000..220_000u64 {
            table.remove(&K2(k, 0));
        }
        assert_eq!(table.bytes(), MIN_SLOTS * std::mem::size_of::<(K2, u32)>());
        // Between 72 % and 90 % full whatever the count (no power-of-two steps).
        for n in [1_000u64, 4_096, 5_000, 33_000, 40_960, 100_000] {
            let mut table: Table<K2, u32> = Table::new();
            for k in 0..n {
                table.insert_new(K2(k, 0), 0);
            }
            let load = n as f64 / table.slots.len() as f64;
            assert!((0.72..=0.9).contains(&load), "{n}: {load}");
        }
    }

    #[test]
    fn reserve_then_fill_does_not_grow() {
        let mut table: Table<K2, u32> = Table::new();
        table.reserve(10_000);
        let bytes = table.bytes();
        for k in 0..10_000u64 {
            table.insert_new(K2(k, 1), 0);
        }
        assert_eq!(table.bytes(), bytes);
        table.clear();
        assert_eq!((table.len(), table.bytes()), (0, 0));
    }
}
