//! The key table: open addressing with linear probing and backward-shift deletion.
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
//! - Power-of-two sizes from 16 slots; grows ×2 past 4/5 full, shrinks ×1/2 below 1/5 (after
//!   either, the table is 2/5 full: no size flapping).
//! - Keys are uniformly random in practice (fingerprints, engine hashes): the slot is taken
//!   from a multiplicative hash of the key and adapter.

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

fn home(key: &KeyId, mask: usize) -> usize {
    let k = key.key;
    let a = key.adapter;
    let h = (k ^ (u64::from(a)).rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (h ^ (h >> 29)) as usize & mask
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
            (self.slots.len() * 2).max(MIN_SLOTS) * std::mem::size_of::<(KeyId, Entry)>()
        } else {
            self.bytes()
        }
    }

    fn grows_on_insert(&self) -> bool {
        (self.len + 1) * 5 > self.slots.len() * 4
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slot holding `key`, if any.
    fn find(&self, key: &KeyId) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.mask();
        let mut i = home(key, mask);
        loop {
            let k = self.slots[i].0;
            if k == *key {
                return Some(i);
            }
            if k == EMPTY {
                return None;
            }
            i = (i + 1) & mask;
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
            self.resize((self.slots.len() * 2).max(MIN_SLOTS));
        }
        self.place(key, value);
        self.len += 1;
    }

    fn place(&mut self, key: KeyId, value: Entry) {
        let mask = self.mask();
        let mut i = home(&key, mask);
        while self.slots[i].0 != EMPTY {
            i = (i + 1) & mask;
        }
        self.slots[i] = (key, value);
    }

    pub(crate) fn remove(&mut self, key: &KeyId) -> Option<Entry> {
        let mut hole = self.find(key)?;
        let removed = self.slots[hole].1;
        let mask = self.mask();
        // Backward shift: an entry after the hole moves into it when its home is not in the
        // stretch between the hole and it (it would otherwise be unreachable from its home).
        let mut j = (hole + 1) & mask;
        loop {
            let k = self.slots[j].0;
            if k == EMPTY {
                break;
            }
            let h = home(&k, mask);
            let distance_to_hole = hole.wrapping_sub(h) & mask;
            let distance_to_j = j.wrapping_sub(h) & mask;
            if distance_to_hole < distance_to_j {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = (EMPTY, empty_entry());
        self.len -= 1;
        if self.slots.len() > MIN_SLOTS && self.len * 5 < self.slots.len() {
            self.resize(self.slots.len() / 2);
        }
        Some(removed)
    }

    fn resize(&mut self, slots: usize) {
        let old = std::mem::replace(&mut self.slots, vec![(EMPTY, empty_entry()); slots]);
        self.slots.shrink_to_fit();
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
        self.len = 0;
        let mut slots = MIN_SLOTS;
        while kept.len() * 5 > slots * 2 {
            slots *= 2;
        }
        self.slots = vec![(EMPTY, empty_entry()); slots];
        for (k, v) in kept {
            self.place(k, v);
            self.len += 1;
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
    }
}
