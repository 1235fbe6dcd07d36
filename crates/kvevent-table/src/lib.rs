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
//! - A slot is the entry itself, `(K, V)`, and beside the slots one byte a slot says how far
//!   its entry is from the entry's home slot (0: empty). Walks read the bytes, not the keys:
//!   no key is hashed but the one looked up, and only entries with the same home as it are
//!   compared with it.
//! - Any number of slots (the home is the hash scaled to the table, not masked), from 16:
//!   grows ×1.25 past 9/10 full, shrinks to 3/5 full below 3/10 (a [`Fill::Sparse`] table:
//!   past 1/2, to 1/3 below 1/6, for shorter runs at about 1.75 times the memory). So a growing table is
//!   72–90 % full whatever it holds (80 % on average: about 1.25 slots a key, 1.25 bytes a
//!   key for the distance bytes), where a power-of-two table can be half empty; one that
//!   shrank is 60–90 % full.
//! - An insert goes where Robin Hood puts it and the entries after it, up to the next empty
//!   slot, move one slot on in one copy; a deletion moves the following entries of its run one
//!   slot back the same way. No tombstone: the table's size depends only on how many keys it
//!   holds, never on its history. (Hashing each entry a walk passes, as the first version
//!   did, cost 500–800 instructions an insert or deletion at these loads, where runs are
//!   long: callgrind on `index-probe`.)
//! - Robin Hood: an entry never sits further from its home than the entries before it in its
//!   run are from theirs, which keeps probe runs short and even at 9/10 full; a lookup stops
//!   as soon as it passes where its key would have been.
//! - A growth (or shrink, or `retain`) never holds the old and the new slot array whole at
//!   once: the new layout is worked out from the hashes (in home order it is plain), then the
//!   entries move from the last old slot down while the old array is given back in chunks
//!   and the new one grows. Inserting them one by one held both at the peak of every growth:
//!   a mapper at its default cap peaked at 53 B a block for 31 resident, now 33.
//!
//! Invariant: every stored key sits at or after its home slot (cyclically), no empty slot and
//! no entry nearer its own home lies between its home and it, and the distance byte of a slot
//! is 0 when it is empty, else its entry's distance + 1, or 255 when that is 255 or
//! more (such a distance is computed from the key's hash; only many keys with nearly the same
//! hash make one).

use std::cell::Cell;
use std::collections::BTreeMap;

/// Most keys to [`Table::touch`] ahead of their lookups: loads beyond this many would leave
/// the cache before their turn (a long batch touches its first ones only).
pub const TOUCH_AHEAD: usize = 64;

/// The distance byte of an entry `SAT - 1` slots or more from its home.
const SAT: u8 = u8::MAX;

/// A key the table can hold.
pub trait Key: Copy + Eq + Default {
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

/// A rebuild gives the old slot array back this many slots at a time.
const RELEASE: usize = 1 << 16;

/// How full a table may get before it grows: memory against speed.
///
/// At fleet scale (tables far larger than the cache) a lookup, insert or removal costs
/// mostly the cache lines it touches, and an insert or removal touches its whole run up to
/// the next empty slot (a dense table's runs average about 13 slots). Measured with
/// `index-probe` (the index and its sources' block maps): dense 2.16–2.39 M block events/s
/// at 256 replicas, 63 bytes a resident (block, replica) pair; sparse 3.32–3.45 M/s, 110.5
/// bytes; at 4 replicas (every table in cache) 5.55–5.60 against 7.12–7.48 M/s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fill {
    /// Grows ×1.25 past 9/10 full: a growing table is 72–90 % full, about 1.25 slots a key.
    #[default]
    Dense,
    /// Grows ×1.25 past 1/2 full: a growing table is 40–50 % full, about 2.2 slots a key.
    Sparse,
}

impl Fill {
    /// The most tenths of its slots a table holds.
    fn max_tenths(self) -> usize {
        match self {
            Fill::Dense => 9,
            Fill::Sparse => 5,
        }
    }

    /// Slots for `n` entries at 8/9 of the most (4/5 full dense, 2/5 sparse): a rebuild's
    /// size.
    fn slots_for(self, n: usize) -> usize {
        (n * 10 / (self.max_tenths() * 8 / 9) + 1).max(MIN_SLOTS)
    }
}

/// The distance byte of an entry `d` slots from its home.
fn byte_of(d: usize) -> u8 {
    u8::try_from(d + 1).unwrap_or(SAT)
}

/// The first of `bytes` below `limit` (1 or 2), read eight at a time.
fn first_below(bytes: &[u8], limit: u8) -> Option<usize> {
    // A byte below 1 or 2 is one whose bits other than the lowest `limit - 1` are all 0.
    let keep = u64::from_ne_bytes([!(limit - 1); 8]);
    const LOW: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    let mut words = bytes.chunks_exact(8);
    let mut at = 0;
    for w in &mut words {
        let v = u64::from_le_bytes(w.try_into().unwrap_or([0; 8])) & keep;
        // The lowest set high bit marks the first zero byte (bytes above it may be flagged
        // wrongly by the borrow; the first never is).
        let zero = v.wrapping_sub(LOW) & !v & HIGH;
        if zero != 0 {
            return Some(at + zero.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
    words
        .remainder()
        .iter()
        .position(|&b| b < limit)
        .map(|k| at + k)
}

/// Asks the core to bring the cache line holding `r` closer, without waiting for it.
#[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
pub fn prefetch<T>(r: &T) {
    safe_arch::prefetch_t0(r);
}

/// Asks the core to bring the cache line holding `r` closer (a no-op on this target).
#[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
pub fn prefetch<T>(r: &T) {
    let _ = r;
}

/// The table. Empty slots hold `K::default()` and `V::default()` (never read).
#[derive(Debug, Clone)]
pub struct Table<K, V> {
    slots: Vec<(K, V)>,
    /// Per slot: 0 when empty, else its entry's distance from home + 1, saturated at [`SAT`].
    dist: Vec<u8>,
    len: usize,
    fill: Fill,
}

impl<K, V> Default for Table<K, V> {
    fn default() -> Self {
        Self::with_fill(Fill::Dense)
    }
}

impl<K, V> Table<K, V> {
    /// An empty table that grows as `fill` says (no allocation until the first insert).
    #[must_use]
    pub fn with_fill(fill: Fill) -> Self {
        Self {
            slots: Vec::new(),
            dist: Vec::new(),
            len: 0,
            fill,
        }
    }

    /// How full it may get.
    #[must_use]
    pub fn fill(&self) -> Fill {
        self.fill
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

    /// Bytes of the slot array and its distance bytes.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(K, V)>() + self.dist.capacity()
    }

    /// Bytes the table would take after one more insert.
    #[must_use]
    pub fn bytes_after_insert(&self) -> usize {
        if self.grows_on_insert() {
            self.grown() * (std::mem::size_of::<(K, V)>() + 1)
        } else {
            self.bytes()
        }
    }

    fn grows_on_insert(&self) -> bool {
        (self.len + 1) * 10 > self.slots.len() * self.fill.max_tenths()
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

    /// How far the entry in (occupied) slot `i` is from its home.
    fn distance_at(&self, i: usize) -> usize {
        match self.dist[i] {
            SAT => self.distance(i, self.home(&self.slots[i].0)),
            b => usize::from(b) - 1,
        }
    }

    /// The slot holding `key`, if any.
    fn find(&self, key: &K) -> Option<usize> {
        self.search(key).ok()
    }

    /// The slot holding `key`, or where an insert of it goes (the slot and its distance from
    /// `key`'s home): the first slot whose entry is nearer its own home than `key` would be
    /// there, or empty. One walk serves a lookup and the insert or removal after it.
    #[inline]
    fn search(&self, key: &K) -> Result<usize, (usize, usize)> {
        if self.len == 0 {
            // Every slot is empty (and with no slots, an insert grows the table first).
            let home = if self.slots.is_empty() {
                0
            } else {
                self.home(key)
            };
            return Err((home, 0));
        }
        let mut i = self.home(key);
        // `key` would be `d` slots from its home here: the slot's byte would be `d + 1`. A
        // smaller byte (0: empty) is an entry nearer its home: `key` would have taken this
        // slot, so it is not here. While `d + 1` is below `SAT`, a saturated byte is an entry
        // further from its home than `key` would be.
        for d in 0..usize::from(SAT) - 1 {
            let b = usize::from(self.dist[i]);
            if b <= d {
                return Err((i, d));
            }
            if b == d + 1 && self.slots[i].0 == *key {
                return Ok(i);
            }
            i = self.next(i);
        }
        let mut d = usize::from(SAT) - 1;
        loop {
            if self.dist[i] == 0 {
                return Err((i, d));
            }
            let di = self.distance_at(i);
            if di < d {
                return Err((i, d));
            }
            if di == d && self.slots[i].0 == *key {
                return Ok(i);
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// `key`'s entry, to read, change, remove or insert after one walk.
    #[inline]
    pub fn entry(&mut self, key: K) -> Entry<'_, K, V> {
        match self.search(&key) {
            Ok(slot) => Entry::Occupied(Occupied { table: self, slot }),
            Err((slot, d)) => Entry::Vacant(Vacant {
                table: self,
                key,
                slot,
                d,
            }),
        }
    }

    /// The value of `key`.
    #[must_use]
    pub fn get(&self, key: &K) -> Option<&V> {
        self.find(key).map(|i| &self.slots[i].1)
    }

    /// Loads `key`'s home slot and distance byte into the cache, for a lookup that follows
    /// soon. A batch that touches all its keys first has their cache misses overlap (the
    /// loads do not depend on each other) instead of paying them one after another: in a table
    /// much larger than the cache, a lookup is mostly those misses. Touch at most
    /// [`TOUCH_AHEAD`] keys ahead.
    pub fn touch(&self, key: &K) {
        if !self.slots.is_empty() {
            let home = self.home(key);
            std::hint::black_box((self.dist[home], self.slots[home].0));
        }
    }

    /// Starts loading `key`'s home slot, its distance byte and the `lines` cache lines of
    /// slots after it, without waiting for them (a prefetch: nothing is read and nothing
    /// waits for it, unlike [`Table::touch`]'s loads, which hold the core's queue until they
    /// arrive). For keys whose turn comes a batch or more later; an insert or
    /// removal moves the entries after its slot up to the next empty one, `lines` covers them.
    pub fn prefetch(&self, key: &K, lines: usize) {
        if self.slots.is_empty() {
            return;
        }
        let home = self.home(key);
        prefetch(&self.dist[home]);
        let per_line = (64 / std::mem::size_of::<(K, V)>()).max(1);
        for l in 0..=lines {
            if let Some(slot) = self.slots.get(home + l * per_line) {
                prefetch(slot);
            }
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
    /// In debug builds, when `key` is already present.
    pub fn insert_new(&mut self, key: K, value: V) {
        debug_assert!(self.find(&key).is_none());
        if self.grows_on_insert() {
            self.resize(self.grown());
        }
        self.place(key, value);
        self.len += 1;
    }

    /// Puts an entry where Robin Hood wants it: after the entries of its run at least as far
    /// from their homes, the rest of the run moved one slot on.
    fn place(&mut self, key: K, value: V) {
        let mut i = self.home(&key);
        let mut d = 0;
        // Past the entries at least `d` from their homes (byte above `d`; see `find`).
        while d + 1 < usize::from(SAT) && usize::from(self.dist[i]) > d {
            i = self.next(i);
            d += 1;
        }
        while self.dist[i] != 0 && self.distance_at(i) >= d {
            i = self.next(i);
            d += 1;
        }
        self.put(i, d, key, value);
    }

    /// Puts an entry in slot `i`, `d` from its home, where Robin Hood wants it (found by
    /// [`Self::place`] or a missed [`Self::search`]), moving the rest of the run on.
    fn put(&mut self, i: usize, d: usize, key: K, value: V) {
        if self.dist[i] != 0 {
            self.shift_on(i);
        }
        self.slots[i] = (key, value);
        self.dist[i] = byte_of(d);
    }

    /// Moves the entries from slot `at` up to the next empty slot one slot on.
    fn shift_on(&mut self, at: usize) {
        let n = self.slots.len();
        let end = match first_below(&self.dist[at..], 1) {
            Some(k) => at + k,
            // The run wraps: the empty slot is before `at` (there is one: the table is never
            // full). The wrapped part moves first, then the last slot to the first.
            None => {
                let e = first_below(&self.dist, 1).unwrap_or(0);
                self.move_on(0, e);
                self.slots[0] = self.slots[n - 1];
                self.dist[0] = self.dist[n - 1].saturating_add(1);
                n - 1
            }
        };
        self.move_on(at, end);
    }

    /// Moves slots `from..to` one slot on (slot `to` is free), one further from their homes.
    fn move_on(&mut self, from: usize, to: usize) {
        self.slots.copy_within(from..to, from + 1);
        self.dist.copy_within(from..to, from + 1);
        for b in &mut self.dist[from + 1..=to] {
            *b = b.saturating_add(1);
        }
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let hole = self.find(key)?;
        Some(self.remove_at(hole))
    }

    /// Removes the entry in (occupied) slot `hole`, returning its value.
    fn remove_at(&mut self, hole: usize) -> V {
        let removed = self.slots[hole].1;
        // Backward shift: the entries after the hole that are not at their home (distance
        // byte 2 or more) move back one slot.
        let n = self.slots.len();
        let moved = |dist: &[u8]| first_below(dist, 2);
        let last = match moved(&self.dist[hole + 1..]) {
            Some(k) => {
                self.move_back(hole, hole + k);
                hole + k
            }
            None => {
                // The run wraps past the end of the table.
                let k = moved(&self.dist).unwrap_or(0);
                self.move_back(hole, n - 1);
                if k > 0 {
                    self.slots[n - 1] = self.slots[0];
                    self.dist[n - 1] = self.dist[0];
                    self.settle(n - 1);
                    self.move_back(0, k - 1);
                    k - 1
                } else {
                    n - 1
                }
            }
        };
        self.slots[last] = (K::default(), V::default());
        self.dist[last] = 0;
        self.len -= 1;
        // Below a third of the most (3/10 dense): rebuilt at two thirds of it.
        let most = self.fill.max_tenths();
        if self.slots.len() > MIN_SLOTS && self.len * 30 < self.slots.len() * most {
            self.resize((self.len * 15 / most).max(MIN_SLOTS));
        }
        removed
    }

    /// Moves slots `hole + 1..=last` one slot back, one nearer their homes.
    fn move_back(&mut self, hole: usize, last: usize) {
        if last == hole {
            return;
        }
        self.slots.copy_within(hole + 1..=last, hole);
        self.dist.copy_within(hole + 1..=last, hole);
        // One pass with no branch a byte: a byte one nearer, but a saturated byte stays (its
        // distance is worked out from its key's hash after).
        let mut saturated = false;
        for b in &mut self.dist[hole..last] {
            saturated |= *b == SAT;
            *b -= u8::from(*b != SAT);
        }
        if saturated {
            for i in hole..last {
                if self.dist[i] == SAT {
                    self.settle(i);
                }
            }
        }
    }

    /// The distance byte of slot `i`, whose entry just moved one slot back.
    fn settle(&mut self, i: usize) {
        self.dist[i] = match self.dist[i] {
            SAT => byte_of(self.distance(i, self.home(&self.slots[i].0))),
            b => b - 1,
        };
    }

    /// Forgets every entry; the memory goes back too.
    pub fn clear(&mut self) {
        *self = Self::with_fill(self.fill);
    }

    /// Room for `additional` more entries without growing.
    pub fn reserve(&mut self, additional: usize) {
        let want = (self.len + additional) * 10 / self.fill.max_tenths() + 1;
        if want > self.slots.len() {
            self.resize(want.max(MIN_SLOTS));
        }
    }

    fn resize(&mut self, slots: usize) {
        // A table is at most 9/10 full (dense): it has an empty slot.
        let start = first_below(&self.dist, 1).unwrap_or(0);
        self.rebuild(slots, start);
    }

    /// Moves every entry (slots whose distance byte is not 0) into a table of `n` slots.
    /// `start` is a slot that was empty while the table last held its invariant (entries
    /// since taken out by setting their byte to 0 may have left others away from their
    /// homes, which the rebuild does not mind).
    ///
    /// The old and the new slot arrays are never both whole in memory: the entries are laid
    /// out first (where each one goes, from the hashes), then moved from the last old slot to
    /// the first, the old array given back in chunks as it empties while the new one is
    /// filled from its end (built reversed, so it grows as a `Vec` does, and reversed in
    /// place). Placing them one by one, as an insert does, wants the whole new array at once.
    fn rebuild(&mut self, n: usize, start: usize) {
        if self.len == 0 {
            self.slots = vec![Default::default(); n];
            self.dist = vec![0; n];
            return;
        }
        let mut moved = std::mem::take(&mut self.dist);
        let (dist, far) = Self::layout(&self.slots, Cell::from_mut(&mut moved[..]), n, start);
        let mut old = std::mem::take(&mut self.slots);
        // The new array reversed: `rev[j]` is slot `n - 1 - j`.
        let mut rev: Vec<(K, V)> = Vec::with_capacity(n);
        // Entries going much further than the array has grown so far (where a run wraps
        // past the end of either table): placed once it is whole.
        let mut late = Vec::new();
        for i in (0..old.len()).rev() {
            let b = moved[i];
            if b != 0 {
                let slot = match b {
                    SAT => far.get(&i).copied().unwrap_or_default(),
                    b => (home_of(old[i].0.hash(), n) + usize::from(b) - 1) % n,
                };
                let j = n - 1 - slot;
                if j == rev.len() {
                    rev.push(old[i]);
                } else if j < rev.len() {
                    rev[j] = old[i];
                } else if j - rev.len() < RELEASE {
                    rev.resize(j, Default::default());
                    rev.push(old[i]);
                } else {
                    late.push((j, old[i]));
                }
            }
            if i % RELEASE == 0 {
                old.truncate(i);
                old.shrink_to_fit();
            }
        }
        rev.resize(n, Default::default());
        for (j, e) in late {
            rev[j] = e;
        }
        rev.reverse();
        self.slots = rev;
        self.dist = dist;
    }

    /// Lays the entries of `slots` (those whose byte in `moved` is not 0) out in a table of
    /// `n` slots: returns its distance bytes, and leaves in `moved` each entry's distance byte
    /// there; where that byte is saturated, the returned map has the entry's new slot.
    ///
    /// In home order, Robin Hood's layout is plain: an entry sits at its home, or right after
    /// the entry before it when that one reached its home or beyond. Positions count on past
    /// the end (an entry whose home is before `start` is one lap on), so a run that wraps
    /// past the end of the new table is one that goes past `n`; when the last run reaches the
    /// first entries, they are laid out again behind it until one stays where it was.
    fn layout(
        slots: &[(K, V)],
        moved: &Cell<[u8]>,
        n: usize,
        start: usize,
    ) -> (Vec<u8>, BTreeMap<usize, usize>) {
        let moved = moved.as_slice_of_cells();
        let mut dist = vec![0u8; n];
        let mut far = BTreeMap::new();
        let mut put = |i: usize, pos: usize, home: usize| {
            let b = byte_of(pos - home);
            dist[pos % n] = b;
            moved[i].set(b);
            if b == SAT {
                far.insert(i, pos % n);
            }
        };
        let mut first = None;
        let mut last = 0;
        Self::in_home_order(slots, moved, n, start, |i, home| {
            let pos = match first {
                None => {
                    first = Some(home);
                    home
                }
                Some(_) => home.max(last + 1),
            };
            put(i, pos, home);
            last = pos;
            true
        });
        if first.is_some_and(|first| last >= first + n) {
            // The last run wraps onto the first entries: each goes one lap on, behind it.
            let mut was = None;
            Self::in_home_order(slots, moved, n, start, |i, home| {
                let before = was.map_or(home, |w: usize| home.max(w + 1));
                was = Some(before);
                let pos = (home + n).max(last + 1);
                if pos == before + n {
                    return false;
                }
                put(i, pos, home + n);
                last = pos;
                true
            });
        }
        (dist, far)
    }

    /// Calls `f(slot, home)` for every entry of `slots` (byte in `occupied` not 0), ordered
    /// by its home in a table of `n` slots, one lap on (`+ n`) for entries whose home now is
    /// before `start`, until `f` says false. From a slot that was empty the entries come in
    /// their homes' order (Robin Hood keeps a run sorted by home), but for entries of one home
    /// now, which may have different homes in `n` slots: those are sorted first.
    fn in_home_order(
        slots: &[(K, V)],
        occupied: &[Cell<u8>],
        n: usize,
        start: usize,
        mut f: impl FnMut(usize, usize) -> bool,
    ) {
        let old_n = slots.len();
        let mut group: Vec<(usize, usize)> = Vec::new();
        let mut group_home = usize::MAX;
        let mut flush = |group: &mut Vec<(usize, usize)>| {
            group.sort_unstable();
            let go = group.iter().all(|&(home, i)| f(i, home));
            group.clear();
            go
        };
        for i in (start + 1..old_n).chain(0..=start) {
            if occupied[i].get() == 0 {
                continue;
            }
            let h = slots[i].0.hash();
            let home_now = home_of(h, old_n);
            if home_now != group_home {
                if !flush(&mut group) {
                    return;
                }
                group_home = home_now;
            }
            let lap = if home_now < start { n } else { 0 };
            group.push((home_of(h, n) + lap, i));
        }
        flush(&mut group);
    }

    /// Moves every entry into a table of `n` slots by inserting them one by one (both arrays
    /// whole at once): what [`Self::rebuild`] must agree with.
    #[cfg(test)]
    fn rebuild_by_placing(&mut self, n: usize) {
        let old = std::mem::replace(&mut self.slots, vec![Default::default(); n]);
        let dist = std::mem::replace(&mut self.dist, vec![0; n]);
        for ((k, v), b) in old.into_iter().zip(dist) {
            if b != 0 {
                self.place(k, v);
            }
        }
    }

    /// Every entry, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.slots
            .iter()
            .zip(&self.dist)
            .filter(|(_, b)| **b != 0)
            .map(|((k, v), _)| (k, v))
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
            .zip(std::mem::take(&mut self.dist))
            .filter(|(_, b)| *b != 0)
            .map(|(e, _)| e)
    }

    /// Keeps the entries `keep` (which may change them) says to keep; rebuilt to fit.
    pub fn retain(&mut self, mut keep: impl FnMut(&mut V) -> bool) {
        let start = first_below(&self.dist, 1).unwrap_or(0);
        for (slot, b) in self.slots.iter_mut().zip(&mut self.dist) {
            if *b != 0 && !keep(&mut slot.1) {
                *b = 0;
                self.len -= 1;
            }
        }
        self.rebuild(self.fill.slots_for(self.len), start);
    }
}

/// A key's place in a [`Table`], from [`Table::entry`].
#[derive(Debug)]
pub enum Entry<'t, K, V> {
    /// The key is present.
    Occupied(Occupied<'t, K, V>),
    /// The key is absent.
    Vacant(Vacant<'t, K, V>),
}

/// A present key's entry.
#[derive(Debug)]
pub struct Occupied<'t, K, V> {
    table: &'t mut Table<K, V>,
    slot: usize,
}

impl<'t, K: Key, V: Copy + Default> Occupied<'t, K, V> {
    /// The value.
    #[must_use]
    pub fn get(&self) -> &V {
        &self.table.slots[self.slot].1
    }

    /// The value, to change in place.
    pub fn get_mut(&mut self) -> &mut V {
        &mut self.table.slots[self.slot].1
    }

    /// The value, to change in place, for as long as the table is borrowed.
    #[must_use]
    pub fn into_mut(self) -> &'t mut V {
        &mut self.table.slots[self.slot].1
    }

    /// Removes the entry, returning its value.
    pub fn remove(self) -> V {
        self.table.remove_at(self.slot)
    }
}

/// An absent key's entry: where an insert of it goes.
#[derive(Debug)]
pub struct Vacant<'t, K, V> {
    table: &'t mut Table<K, V>,
    key: K,
    slot: usize,
    d: usize,
}

impl<K: Key, V: Copy + Default> Vacant<'_, K, V> {
    /// Inserts the key with `value` (where the walk that found it absent ended, unless the
    /// table must grow first).
    #[inline]
    pub fn insert(self, value: V) {
        let table = self.table;
        if table.grows_on_insert() {
            table.resize(table.grown());
            table.place(self.key, value);
        } else {
            table.put(self.slot, self.d, self.key, value);
        }
        table.len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    struct K2(u64, u32);

    impl Key for K2 {
        fn hash(&self) -> u64 {
            mix(self.0 ^ u64::from(self.1).rotate_left(32))
        }
    }

    /// A key whose hash is its own value: collisions and long runs on demand.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    struct Raw(u64);

    impl Key for Raw {
        fn hash(&self) -> u64 {
            self.0
        }
    }

    /// A key whose hash keeps only its high bits: runs of hundreds of keys with one home.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    struct Coarse(u64);

    impl Key for Coarse {
        fn hash(&self) -> u64 {
            self.0 & !0xFFFF
        }
    }

    fn check_invariant<K: Key + std::fmt::Debug, V: Copy + Default>(t: &Table<K, V>) {
        let n = t.slots.len();
        assert_eq!(t.dist.len(), n);
        let mut held = 0;
        for (i, (k, _)) in t.slots.iter().enumerate() {
            if t.dist[i] == 0 {
                continue;
            }
            held += 1;
            let home = t.home(k);
            let d = t.distance(i, home);
            assert_eq!(t.dist[i], byte_of(d), "{k:?} at {i}: distance byte");
            // Every slot from home up to i is taken by an entry at least as far from its home.
            for step in 0..d {
                let j = (home + step) % n;
                assert!(t.dist[j] != 0, "{k:?} at {i}: slot {j} empty before it");
                let other = t.slots[j].0;
                let dj = t.distance(j, t.home(&other));
                assert!(dj >= step, "{k:?} at {i}: {other:?} at {j} nearer its home");
            }
            assert_eq!(t.find(k), Some(i), "{k:?} not found at {i}");
        }
        assert_eq!(held, t.len);
    }

    #[test]
    fn agrees_with_a_hash_map_under_random_inserts_and_removes() {
        for fill in [Fill::Dense, Fill::Sparse] {
            agrees_with_a_hash_map(fill);
        }
    }

    fn agrees_with_a_hash_map(fill: Fill) {
        let mut table: Table<K2, u32> = Table::with_fill(fill);
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
                assert!(table.len() * 10 <= table.slots.len() * fill.max_tenths());
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
        assert_eq!(table.fill(), fill);
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
    fn runs_longer_than_a_distance_byte_holds_stay_whole() {
        // Hundreds of keys with one home, at the end of the table so the run wraps too:
        // distances past 254 are computed from the hash, on lookups, inserts and shifts.
        for base in [0u64, !0xFFFF] {
            let mut table: Table<Coarse, u64> = Table::new();
            let mut model = std::collections::BTreeMap::new();
            let mut x = 0x9E37_79B9_7F4A_7C15u64;
            for step in 0..6_000u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let k = Coarse(base | (x % 700));
                if x.is_multiple_of(3) {
                    assert_eq!(table.remove(&k), model.remove(&k.0), "step {step}");
                } else if let Some(v) = table.get_mut(&k) {
                    *v = step;
                    model.insert(k.0, step);
                } else {
                    table.insert_new(k, step);
                    model.insert(k.0, step);
                }
                if step % 500 == 0 {
                    check_invariant(&table);
                }
            }
            check_invariant(&table);
            assert!(table.dist.contains(&SAT), "no saturated distance exercised");
            for (k, v) in &model {
                assert_eq!(table.get(&Coarse(*k)), Some(v));
            }
        }
    }

    /// Drives `entry` and the plain calls with the same random stream: the two tables must
    /// hold the same layout, slot for slot, after every step (an entry's insert goes where
    /// its walk ended; a removal through it is `remove`'s).
    fn entry_agrees_with_plain_calls<K: Key + std::fmt::Debug>(key: impl Fn(u64) -> K) {
        let mut plain: Table<K, u64> = Table::new();
        let mut entries: Table<K, u64> = Table::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = key(x);
            if x.is_multiple_of(3) {
                let want = plain.remove(&k);
                let got = match entries.entry(k) {
                    Entry::Occupied(o) => Some(o.remove()),
                    Entry::Vacant(_) => None,
                };
                assert_eq!(got, want, "step {step}");
            } else {
                match plain.get_mut(&k) {
                    Some(v) => *v = step,
                    None => plain.insert_new(k, step),
                }
                match entries.entry(k) {
                    Entry::Occupied(mut o) => {
                        assert_eq!(plain.get(&k), Some(&step));
                        *o.get_mut() = step;
                    }
                    Entry::Vacant(v) => v.insert(step),
                }
            }
            assert_eq!(entries.len(), plain.len(), "step {step}");
            assert_eq!(entries.dist, plain.dist, "step {step}");
            assert!(entries.slots == plain.slots, "step {step}");
            if step % 2_000 == 0 {
                check_invariant(&entries);
            }
        }
        check_invariant(&entries);
    }

    #[test]
    fn an_entry_walks_once_and_places_as_an_insert_does() {
        // Spread keys, crowded keys (long runs), and hundreds of keys with one home at the
        // end of the table (saturated distances, runs that wrap).
        entry_agrees_with_plain_calls(|x| K2((x % 3_000) << (x % 3), (x >> 40) as u32 % 3));
        entry_agrees_with_plain_calls(|x| Coarse(!0xFFFF | (x % 700)));
        entry_agrees_with_plain_calls(|x| Coarse(x % 700));
    }

    #[test]
    fn first_below_finds_what_a_byte_by_byte_scan_finds() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for len in 0..40 {
            for _ in 0..200 {
                let bytes: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        // Mostly large, sometimes 0, 1 or 2, sometimes 255 and 128.
                        [0, 1, 2, 255, 128, 3][(x % 6) as usize].max((x >> 8) as u8 % 4 * 60)
                    })
                    .collect();
                for limit in [1, 2] {
                    let want = bytes.iter().position(|&b| b < limit);
                    assert_eq!(first_below(&bytes, limit), want, "{bytes:?} below {limit}");
                }
            }
        }
    }

    #[test]
    fn structured_keys_spread() {
        // Small integers as big-endian bytes: the high bits vary last. Probe runs stay short.
        let mut table: Table<K2, u32> = Table::new();
        for k in 0..50_000u64 {
            table.insert_new(K2(k << 56 | k, 0), 0);
        }
        let longest = (0..table.slots.len())
            .filter(|&i| table.dist[i] != 0)
            .map(|i| table.distance(i, table.home(&table.slots[i].0)))
            .max()
            .unwrap_or(0);
        assert!(longest < 64, "longest probe {longest}");
    }

    #[test]
    fn churn_does_not_grow_it_and_emptying_shrinks_it() {
        for (fill, loads) in [(Fill::Dense, 0.72..=0.9), (Fill::Sparse, 0.4..=0.5)] {
            churn_and_empty(fill, loads);
        }
    }

    fn churn_and_empty(fill: Fill, loads: std::ops::RangeInclusive<f64>) {
        let mut table: Table<K2, u32> = Table::with_fill(fill);
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
        assert_eq!(
            table.bytes(),
            MIN_SLOTS * (std::mem::size_of::<(K2, u32)>() + 1)
        );
        // Between 72 % and 90 % full (dense) whatever the count (no power-of-two steps).
        for n in [1_000u64, 4_096, 5_000, 33_000, 40_960, 100_000] {
            let mut table: Table<K2, u32> = Table::with_fill(fill);
            for k in 0..n {
                table.insert_new(K2(k, 0), 0);
            }
            let load = n as f64 / table.slots.len() as f64;
            assert!(loads.contains(&load), "{fill:?} {n}: {load}");
            // Emptied down to a tenth, it shrinks and stays under its most.
            for k in n / 10..n {
                table.remove(&K2(k, 0));
            }
            let load = (n / 10) as f64 / table.slots.len() as f64;
            assert!(
                load * 3.0 >= *loads.end() * 0.99 || table.slots.len() == MIN_SLOTS,
                "{fill:?} {n}: {load} after emptying"
            );
            check_invariant(&table);
        }
    }

    /// A `Raw` key whose home is `home` in a table of `n` slots.
    fn raw_at(home: usize, n: usize, k: u64) -> Raw {
        let step = u64::MAX / n as u64;
        Raw(home as u64 * step + step / 2 + k)
    }

    #[test]
    fn rebuilds_lay_out_runs_that_wrap_in_either_table() {
        // Keys crowded at the end of the hash space (runs wrapping past the end) and at its
        // start (runs the wrapped ones push on), moved into tables from barely large enough to
        // three times larger and back: every entry where Robin Hood puts it, whether it came
        // in a run that wrapped or not, and the same entries as placing them one by one.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rand = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..300 {
            let mut table: Table<Raw, u64> = Table::new();
            let len = 5 + rand() as usize % 200;
            table.reserve(len);
            let n = table.slots.len();
            let mut keys = std::collections::BTreeSet::new();
            while keys.len() < len {
                let k = match rand() % 4 {
                    0 => raw_at(n - 1 - rand() as usize % 3, n, rand() % 1_000),
                    1 => raw_at(rand() as usize % 3, n, rand() % 1_000),
                    2 => Raw(u64::MAX - rand() % 1_000),
                    _ => Raw(rand()),
                };
                keys.insert(k.0);
            }
            for &k in &keys {
                table.insert_new(Raw(k), !k);
            }
            check_invariant(&table);
            let mut sizes = vec![len * 10 / 9 + 1, n + 1, n * 5 / 4, n * 3];
            sizes.push(len * 10 / 9 + 1 + rand() as usize % (2 * n));
            for slots in sizes {
                let mut placed = table.clone();
                placed.rebuild_by_placing(slots);
                table.resize(slots);
                assert_eq!(table.slots.len(), slots);
                check_invariant(&table);
                for &k in &keys {
                    assert_eq!(
                        table.get(&Raw(k)),
                        Some(&!k),
                        "round {round}: {k} in {slots}"
                    );
                }
                let mut a: Vec<_> = table.iter().map(|(k, v)| (k.0, *v)).collect();
                let mut b: Vec<_> = placed.iter().map(|(k, v)| (k.0, *v)).collect();
                a.sort_unstable();
                b.sort_unstable();
                assert_eq!(a, b);
            }
            // Taking entries out and shrinking to fit starts from a table with holes.
            table.retain(|v| *v % 3 != 0);
            keys.retain(|k| !k % 3 != 0);
            check_invariant(&table);
            assert_eq!(table.len(), keys.len());
            for &k in &keys {
                assert_eq!(table.get(&Raw(k)), Some(&!k));
            }
        }
    }

    #[test]
    fn a_run_that_wraps_past_the_end_pushes_the_first_entries_on() {
        // Shrunk to 20 slots: five keys with home 19 wrap to slots 0..4, where keys with homes
        // 0 and 1 must follow them. In the larger table they sat apart, the home-0 keys first
        // in the rebuild's order: laid out at their homes, then pushed on.
        let n = 20;
        let mut table: Table<Raw, u64> = Table::new();
        table.reserve(200);
        let m = table.slots.len();
        let keys: Vec<Raw> = (0..5)
            .map(|k| raw_at(n - 1, n, k))
            .chain((0..3).map(|k| raw_at(k as usize % 2, n, k)))
            .collect();
        for &k in &keys {
            table.insert_new(k, k.0);
        }
        assert_ne!(m, n);
        table.resize(n);
        check_invariant(&table);
        let homes: Vec<_> = (0..n)
            .map(|i| (table.dist[i] != 0).then(|| table.home(&table.slots[i].0)))
            .collect();
        assert_eq!(
            &homes[..8],
            &[
                Some(19),
                Some(19),
                Some(19),
                Some(19),
                Some(0),
                Some(0),
                Some(1),
                None
            ]
        );
        for k in keys {
            assert_eq!(table.get(&k), Some(&k.0));
        }
    }

    #[test]
    fn reserve_then_fill_does_not_grow() {
        for fill in [Fill::Dense, Fill::Sparse] {
            let mut table: Table<K2, u32> = Table::with_fill(fill);
            table.reserve(10_000);
            let bytes = table.bytes();
            for k in 0..10_000u64 {
                table.insert_new(K2(k, 1), 0);
            }
            assert_eq!(table.bytes(), bytes, "{fill:?}");
            table.clear();
            assert_eq!((table.len(), table.bytes(), table.fill()), (0, 0, fill));
        }
    }
}
