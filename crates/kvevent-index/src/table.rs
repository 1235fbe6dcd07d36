//! The key table: open addressing, Robin Hood probing, backward-shift deletion, any size.
//!
//! Why not hashbrown: its deletions leave tombstones, and a table more than 7/16 full whose
//! free room the tombstones used up doubles instead of rehashing in place, so under an
//! engine's steady churn (a block stored, the oldest evicted) a table holding the same keys
//! settled at twice its size (measured with `churn-scan`: 10,000–14,000, 20,000–28,000 and
//! 40,000–56,000 keys all doubled). Here a deletion shifts the following entries of its run
//! back, leaving no tombstone: the table's size depends only on how many keys it holds.
//!
//! - Slots are 24 bytes (a 12-byte key, a 12-byte value), no control bytes; a key whose
//!   `adapter` is `u32::MAX` marks an empty slot (adapter numbers never reach it).
//! - Any number of slots (the slot is the hash scaled to the table, not masked), from 16:
//!   grows ×1.5 past 7/8 full, shrinks to 3/5 full below 3/10. So a table is 58–88 % full
//!   (about 33 bytes a key), where a power-of-two table can be half empty.
//! - Robin Hood: an insert takes the slot of an entry closer to its home than the insert is
//!   to its own, which keeps probe runs short at 7/8 full; a lookup stops as soon as it
//!   passes where its key would have been.

use crate::{Entry, KeyId};

const EMPTY: KeyId = KeyId {
    key: 0,
    adapter: u32::MAX,
};
const MIN_SLOTS: usize = 16;

#[derive(Debug, Default)]
pub(crate) struct Table {
    slots: Vec<(KeyId, Entry)>,
    len: usize,
}

/// Where `key` would sit in a table of `n` slots, undisturbed.
fn home(key: &KeyId, n: usize) -> usize {
    let k = key.key;
    let a = key.adapter;
    let h = (k ^ u64::from(a).rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let h = h ^ (h >> 29);
    ((u128::from(h) * n as u128) >> 64) as usize
}

impl Table {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the slot array.
    pub(crate) fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(KeyId, Entry)>()
    }

    /// Bytes the slot array would take after one more insert.
    pub(crate) fn bytes_after_insert(&self) -> usize {
        if self.grows_on_insert() {
            self.grown() * std::mem::size_of::<(KeyId, Entry)>()
        } else {
            self.bytes()
        }
    }

    fn grows_on_insert(&self) -> bool {
        (self.len + 1) * 8 > self.slots.len() * 7
    }

    fn grown(&self) -> usize {
        (self.slots.len() * 3 / 2).max(MIN_SLOTS)
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
    fn find(&self, key: &KeyId) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let n = self.slots.len();
        let mut i = home(key, n);
        let mut d = 0;
        loop {
            let k = self.slots[i].0;
            if k == *key {
                return Some(i);
            }
            // An empty slot, or an entry nearer its home than `key` would be: `key` would
            // have taken this slot, so it is not here.
            if k == EMPTY || self.distance(i, home(&k, n)) < d {
                return None;
            }
            i = self.next(i);
            d += 1;
        }
    }

    pub(crate) fn get(&self, key: &KeyId) -> Option<&Entry> {
        self.find(key).map(|i| &self.slots[i].1)
    }

    pub(crate) fn get_mut(&mut self, key: &KeyId) -> Option<&mut Entry> {
        self.find(key).map(|i| &mut self.slots[i].1)
    }

    /// Inserts a key that is not in the table.
    pub(crate) fn insert_new(&mut self, key: KeyId, value: Entry) {
        debug_assert!(key != EMPTY && self.find(&key).is_none());
        if self.grows_on_insert() {
            self.resize(self.grown());
        }
        self.place(key, value);
        self.len += 1;
    }

    fn place(&mut self, key: KeyId, value: Entry) {
        let n = self.slots.len();
        let mut cur = (key, value);
        let mut i = home(&key, n);
        let mut d = 0;
        loop {
            let k = self.slots[i].0;
            if k == EMPTY {
                self.slots[i] = cur;
                return;
            }
            let dk = self.distance(i, home(&k, n));
            if dk < d {
                // Robin Hood: the richer entry moves on.
                std::mem::swap(&mut self.slots[i], &mut cur);
                d = dk;
            }
            i = self.next(i);
            d += 1;
        }
    }

    pub(crate) fn remove(&mut self, key: &KeyId) -> Option<Entry> {
        let mut hole = self.find(key)?;
        let removed = self.slots[hole].1;
        let n = self.slots.len();
        // Backward shift: the entries after the hole that are not at their home move back.
        let mut j = self.next(hole);
        loop {
            let k = self.slots[j].0;
            if k == EMPTY || home(&k, n) == j {
                break;
            }
            self.slots[hole] = self.slots[j];
            hole = j;
            j = self.next(j);
        }
        self.slots[hole] = (EMPTY, empty_entry());
        self.len -= 1;
        if self.slots.len() > MIN_SLOTS && self.len * 10 < self.slots.len() * 3 {
            self.resize((self.len * 5 / 3).max(MIN_SLOTS));
        }
        Some(removed)
    }

    fn resize(&mut self, slots: usize) {
        let old = std::mem::replace(&mut self.slots, vec![(EMPTY, empty_entry()); slots]);
        for (k, v) in old {
            if k != EMPTY {
                self.place(k, v);
            }
        }
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &Entry> {
        self.slots
            .iter()
            .filter(|(k, _)| *k != EMPTY)
            .map(|(_, v)| v)
    }

    /// Keeps the entries `keep` (which may change them) says to keep; rebuilt to fit.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&mut Entry) -> bool) {
        let mut kept = Vec::with_capacity(self.len);
        for (k, mut v) in std::mem::take(&mut self.slots) {
            if k != EMPTY && keep(&mut v) {
                kept.push((k, v));
            }
        }
        self.len = kept.len();
        self.slots = vec![(EMPTY, empty_entry()); (kept.len() * 5 / 3).max(MIN_SLOTS)];
        for (k, v) in kept {
            self.place(k, v);
        }
    }
}

fn empty_entry() -> Entry {
    Entry {
        tokens: 0,
        holders: crate::Holders::NONE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn key(k: u64, adapter: u32) -> KeyId {
        KeyId { key: k, adapter }
    }

    fn entry(t: u32) -> Entry {
        Entry {
            tokens: t,
            holders: crate::Holders::NONE,
        }
    }

    #[test]
    fn agrees_with_a_hash_map_under_random_inserts_and_removes() {
        let mut table = Table::default();
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
                if let Some(e) = table.get_mut(&key(k, a)) {
                    e.tokens = step;
                } else {
                    table.insert_new(key(k, a), entry(step));
                }
                model.insert((k, a), step);
            } else {
                let got = table.remove(&key(k, a)).map(|e| e.tokens);
                assert_eq!(got, model.remove(&(k, a)), "step {step}");
            }
            assert_eq!(table.len(), model.len());
        }
        for ((k, a), t) in &model {
            assert_eq!(table.get(&key(*k, *a)).map(|e| e.tokens), Some(*t));
        }
        table.retain(|e| e.tokens % 2 == 0);
        model.retain(|_, t| *t % 2 == 0);
        assert_eq!(table.len(), model.len());
        for ((k, a), t) in &model {
            assert_eq!(table.get(&key(*k, *a)).map(|e| e.tokens), Some(*t));
        }
    }

    #[test]
    fn churn_does_not_grow_it_and_emptying_shrinks_it() {
        let mut table = Table::default();
        for k in 0..20_000u64 {
            table.insert_new(key(k, 0), entry(0));
        }
        let full = table.bytes();
        for k in 20_000..220_000u64 {
            table.insert_new(key(k, 0), entry(0));
            table.remove(&key(k - 20_000, 0));
        }
        assert_eq!(table.bytes(), full);
        for k in 200_000..220_000u64 {
            table.remove(&key(k, 0));
        }
        assert_eq!(table.bytes(), MIN_SLOTS * 24);
        // Between 58 % and 88 % full whatever the count (no power-of-two steps).
        for n in [1_000u64, 4_096, 5_000, 33_000] {
            let mut table = Table::default();
            for k in 0..n {
                table.insert_new(key(k, 0), entry(0));
            }
            let load = n as f64 / (table.bytes() / 24) as f64;
            assert!((0.58..=0.875).contains(&load), "{n}: {load}");
        }
    }
}
