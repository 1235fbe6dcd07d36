#![doc = include_str!("../README.md")]

/// Most keys to [`Table::prefetch`] ahead of their lookups: lines beyond this many would leave
/// the cache before their turn (a long batch prefetches its first ones only).
pub const TOUCH_AHEAD: usize = 64;

/// A key the table can hold.
pub trait Key: Copy + Eq + Default {
    /// The key's hash: its high bits pick one bucket, its low bits the other and the tag, so
    /// all of them must be well mixed (see [`mix`]).
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

/// The most tenths of its slots a table holds.
const MOST_TENTHS: usize = 9;

/// Slots for `n` entries at 8/9 of the most (4/5 full): a rebuild's size.
fn slots_for(n: usize) -> usize {
    n * 10 / (MOST_TENTHS * 8 / 9) + 1
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

/// A cache line's bytes (x86-64's and most others').
const LINE: usize = 64;

/// Slots a bucket holds: its control word has a tag byte for each (and one byte unused).
const G: usize = 15;

/// The fewest buckets a table that holds anything has.
const MIN_BUCKETS: usize = 1;

/// A key's tag: its hash's low seven bits, the top bit set so that no tag is 0 (an empty
/// slot) or 1 (an entry waiting for a rebuild to move it).
fn tag_of(h: u64) -> u8 {
    0x80 | (h as u8 & 0x7F)
}

/// A bucket's control word: a byte a slot (its tag, 0 when empty, 1 while a rebuild moves its
/// entry) and one byte unused (0), aligned to be read as one vector.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(16))]
struct Ctrl([u8; 16]);

/// A set of a bucket's slots: bit `i` is slot `i`.
type Mask = u32;

/// Every slot of a bucket.
const ALL: Mask = (1 << G) - 1;

/// The slots of `ctrl` whose tag is `tag`.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline]
fn matching(ctrl: Ctrl, tag: u8) -> Mask {
    use safe_arch::{cmp_eq_mask_i8_m128i, m128i, move_mask_i8_m128i, set_splat_i8_m128i};
    let equal = cmp_eq_mask_i8_m128i(m128i::from(ctrl.0), set_splat_i8_m128i(tag as i8));
    move_mask_i8_m128i(equal) as Mask & ALL
}

/// The slots of `ctrl` whose byte has no top bit: empty slots, and those of entries waiting to
/// move.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline]
fn empties(ctrl: Ctrl) -> Mask {
    !(safe_arch::move_mask_i8_m128i(safe_arch::m128i::from(ctrl.0)) as Mask) & ALL
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
use portable::{empties, matching};

/// [`matching`] and [`empties`] on 64-bit words, for targets without SSE2 (tested on all).
#[cfg_attr(all(target_arch = "x86_64", target_feature = "sse2"), allow(dead_code))]
mod portable {
    use super::{ALL, Ctrl, Mask};

    /// A byte of 1 in each of a control word's tag bytes (not in its unused byte).
    const ONES: u128 = (u128::MAX / 0xFF) >> 8;
    const HIGH: u128 = ONES * 0x80;
    const LOW: u128 = ONES * 0x7F;

    /// The slots of the bytes of `high` (top bits only) that have their top bit.
    fn pack(high: u128) -> Mask {
        // Each byte's top bit moved to bit 0, then gathered into the top byte by a multiply
        // whose partial products never overlap.
        let gather = |w: u64| ((w >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) as Mask;
        gather(high as u64) | gather((high >> 64) as u64) << 8
    }

    pub(super) fn matching(ctrl: Ctrl, tag: u8) -> Mask {
        let x = u128::from_le_bytes(ctrl.0) ^ (ONES * u128::from(tag));
        // A byte's top bit ends clear only when the byte is 0 (no carry crosses bytes: 0x7F +
        // 0x7F < 0x100).
        pack(!(((x & LOW) + LOW) | x | LOW) & HIGH)
    }

    pub(super) fn empties(ctrl: Ctrl) -> Mask {
        pack(!u128::from_le_bytes(ctrl.0) & HIGH) & ALL
    }
}

/// True when `a` holds at least as many slots as `b`.
#[inline]
fn at_least_as_many(a: Mask, b: Mask) -> bool {
    if cfg!(target_feature = "popcnt") {
        a.count_ones() >= b.count_ones()
    } else {
        let (a, b) = counts(a, b);
        a >= b
    }
}

/// The slots of `a` and of `b`, both counted at once, a half of a word each (without the
/// `popcnt` instruction, which x86-64's baseline lacks, each `count_ones` is a dozen).
#[inline]
fn counts(a: Mask, b: Mask) -> (u32, u32) {
    let mut x = a | b << 16;
    x -= (x >> 1) & 0x5555_5555;
    x = (x & 0x3333_3333) + ((x >> 2) & 0x3333_3333);
    x = (x + (x >> 4)) & 0x0F0F_0F0F;
    // Each half's low byte: the sum of its two bytes' counts (at most 15).
    x += x >> 8;
    (x & 0x1F, (x >> 16) & 0x1F)
}

/// The slot within its bucket of the lowest slot of `mask`.
fn lowest(mask: Mask) -> usize {
    mask.trailing_zeros() as usize
}

/// Where an insert goes among buckets `a` and `b` (control words `ca`, `cb`): the first free
/// slot of the emptier, as (bucket, slot within it); `None` when both are full.
#[inline]
fn free_slot(a: usize, ca: Ctrl, b: usize, cb: Ctrl) -> Option<(usize, usize)> {
    let (za, zb) = (matching(ca, 0), matching(cb, 0));
    if za | zb == 0 {
        None
    } else if at_least_as_many(za, zb) {
        Some((a, lowest(za)))
    } else {
        Some((b, lowest(zb)))
    }
}

/// Most entries an insert moves to their other bucket before the table grows instead.
const MAX_KICKS: usize = 256;

/// The table. An empty slot holds a default or a removed entry, never read.
#[derive(Debug, Clone)]
pub struct Table<K, V> {
    /// Per bucket of [`G`] slots: a tag byte a slot (0: empty).
    ctrl: Vec<Ctrl>,
    slots: Vec<(K, V)>,
    /// Entries no bucket had room for in a table far from full: only keys whose hashes
    /// collide (many keys with the same two buckets at every size) end here, so they cost
    /// memory as they come instead of growing the table without end. Slot `slots.len() + i`
    /// is `stash[i]`.
    stash: Vec<(K, V)>,
    len: usize,
}

impl<K, V> Default for Table<K, V> {
    fn default() -> Self {
        Self {
            ctrl: Vec::new(),
            slots: Vec::new(),
            stash: Vec::new(),
            len: 0,
        }
    }
}

/// The control byte of slot `slot` (0: empty).
fn byte(ctrl: &[Ctrl], slot: usize) -> u8 {
    ctrl[slot / G].0[slot % G]
}

impl<K, V> Table<K, V> {
    fn occupied(&self, slot: usize) -> bool {
        byte(&self.ctrl, slot) != 0
    }
}

/// The bucket of hash bits `h` in a table of `n`.
fn home_of(h: u64, n: usize) -> usize {
    ((u128::from(h) * n as u128) >> 64) as usize
}

/// The two buckets of a key with hash `h` in a table of `n`: from its high bits, and from its
/// low bits (the next bucket when they agree).
fn buckets(h: u64, n: usize) -> (usize, usize) {
    let a = home_of(h, n);
    let b = home_of(h.rotate_left(32), n);
    if a == b && n > 1 {
        (a, if a + 1 == n { 0 } else { a + 1 })
    } else {
        (a, b)
    }
}

/// Buckets for `slots` slots.
fn buckets_for(slots: usize) -> usize {
    slots.div_ceil(G).max(MIN_BUCKETS)
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

    /// Entries kept aside because no bucket had room in a table far from full: only keys whose
    /// hashes collide end there (a crafted or broken hash), so anything but 0 is worth a look.
    #[must_use]
    pub fn stashed(&self) -> usize {
        self.stash.len()
    }

    /// Bytes of the slot array and its control words.
    #[must_use]
    pub fn bytes(&self) -> usize {
        (self.slots.capacity() + self.stash.capacity()) * std::mem::size_of::<(K, V)>()
            + self.ctrl.capacity() * std::mem::size_of::<Ctrl>()
    }

    /// Bytes the table would take after one more insert.
    #[must_use]
    pub fn bytes_after_insert(&self) -> usize {
        if self.grows_on_insert() {
            self.grown() * (G * std::mem::size_of::<(K, V)>() + std::mem::size_of::<Ctrl>())
        } else {
            self.bytes()
        }
    }

    /// Entries the table takes before an insert grows it.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.slots.len() * MOST_TENTHS / 10
    }

    fn grows_on_insert(&self) -> bool {
        (self.len + 1) * 10 > self.slots.len() * MOST_TENTHS
    }

    /// Buckets after a growth: for the next of the slot counts 16, 20, 25, … (each ×1.25),
    /// whatever the table's size now (a shrink or a reserve leaves it between two).
    fn grown(&self) -> usize {
        let mut n = 16;
        while n <= self.slots.len() {
            n = n * 5 / 4;
        }
        buckets_for(n).max(self.ctrl.len() + 1)
    }

    fn set_tag(&mut self, slot: usize, tag: u8) {
        self.ctrl[slot / G].0[slot % G] = tag;
    }

    /// The slot holding `key` (in one of its two buckets).
    #[inline]
    fn find(&self, key: &K) -> Option<usize> {
        self.find_hashed(key, key.hash())
    }

    /// [`Self::find`] for a key whose hash is `h`.
    #[inline]
    fn find_hashed(&self, key: &K, h: u64) -> Option<usize> {
        let n = self.ctrl.len();
        if n == 0 {
            return None;
        }
        let tag = tag_of(h);
        let (a, b) = buckets(h, n);
        for c in [a, b] {
            let mut m = matching(self.ctrl[c], tag);
            while m != 0 {
                let slot = c * G + lowest(m);
                if self.slots[slot].0 == *key {
                    return Some(slot);
                }
                m &= m - 1;
            }
        }
        if self.stash.is_empty() {
            return None;
        }
        let i = self.stash.iter().position(|e| e.0 == *key)?;
        Some(self.slots.len() + i)
    }

    /// The entry in (occupied) slot `slot`, in a bucket or the stash.
    fn at(&self, slot: usize) -> &(K, V) {
        match self.slots.get(slot) {
            Some(e) => e,
            None => &self.stash[slot - self.slots.len()],
        }
    }

    fn at_mut(&mut self, slot: usize) -> &mut (K, V) {
        let n = self.slots.len();
        match self.slots.get_mut(slot) {
            Some(e) => e,
            None => &mut self.stash[slot - n],
        }
    }

    /// `key`'s entry, to read, change, remove or insert after one lookup.
    #[inline]
    pub fn entry(&mut self, key: K) -> Entry<'_, K, V> {
        let hash = key.hash();
        match self.find_hashed(&key, hash) {
            Some(slot) => Entry::Occupied(Occupied { table: self, slot }),
            None => Entry::Vacant(Vacant {
                table: self,
                key,
                hash,
            }),
        }
    }

    /// The value of `key`.
    #[must_use]
    pub fn get(&self, key: &K) -> Option<&V> {
        self.find(key).map(|i| &self.at(i).1)
    }

    /// Starts loading the control words of `key`'s two buckets, without waiting for them (a
    /// prefetch: nothing is read and nothing waits for it). At most [`TOUCH_AHEAD`] keys
    /// ahead of their lookups; [`Table::prefetch_slot`] follows once the words came.
    pub fn prefetch(&self, key: &K) {
        self.prefetch_hashed(key.hash());
    }

    /// [`Table::prefetch`] for a key whose [`Key::hash`] is `h`.
    pub fn prefetch_hashed(&self, h: u64) {
        if !self.ctrl.is_empty() {
            let (a, b) = buckets(h, self.ctrl.len());
            prefetch(&self.ctrl[a]);
            prefetch(&self.ctrl[b]);
        }
    }

    /// Starts loading the slots a lookup of `key` reads, reading the control words
    /// [`Table::prefetch`] brought in: every slot whose tag matches, in either bucket (the
    /// first may be another key's, one in 128 of a bucket's keys having the same tag, and the
    /// key's own the next); with none, the slot an insert would take.
    pub fn prefetch_slot(&self, key: &K) {
        self.prefetch_slot_hashed(key.hash());
    }

    /// [`Table::prefetch_slot`] for a key whose [`Key::hash`] is `h` (the table may have been
    /// resized since its [`Table::prefetch_hashed`]: the slots are found at its size now).
    pub fn prefetch_slot_hashed(&self, h: u64) {
        self.prefetch_slots(h, false);
    }

    /// [`Table::prefetch_slot`] for a key about to be stored (most likely absent): the slot
    /// its insert takes as well as the slots whose tag matches, which the insert's lookup
    /// reads first (a key absent from both buckets meets another's tag one time in six at
    /// these loads, and its insert then wrote a slot no prefetch asked for).
    pub fn prefetch_insert(&self, key: &K) {
        self.prefetch_insert_hashed(key.hash());
    }

    /// [`Table::prefetch_insert`] for a key whose [`Key::hash`] is `h`.
    pub fn prefetch_insert_hashed(&self, h: u64) {
        self.prefetch_slots(h, true);
    }

    /// The slots whose tag matches `h`'s; the slot an insert takes too when there are none or
    /// `insert` says the key is about to be stored.
    fn prefetch_slots(&self, h: u64, insert: bool) {
        if self.ctrl.is_empty() {
            return;
        }
        let tag = tag_of(h);
        let (a, b) = buckets(h, self.ctrl.len());
        let (ca, cb) = (self.ctrl[a], self.ctrl[b]);
        let (ma, mb) = (matching(ca, tag), matching(cb, tag));
        for (c, mut m) in [(a, ma), (b, mb)] {
            while m != 0 {
                self.prefetch_entry(c * G + lowest(m));
                m &= m - 1;
            }
        }
        if (insert || ma | mb == 0)
            && let Some((c, j)) = free_slot(a, ca, b, cb)
        {
            self.prefetch_entry(c * G + j);
        }
    }

    /// Prefetches the entry in slot `slot`, both of its lines when it crosses into a second:
    /// entries are unpadded (25, 28 bytes…), and the next slot starts in that line.
    #[inline]
    fn prefetch_entry(&self, slot: usize) {
        let entry = &self.slots[slot];
        prefetch(entry);
        let offset = std::ptr::from_ref(entry) as usize % LINE;
        if offset + std::mem::size_of::<(K, V)>() > LINE
            && let Some(next) = self.slots.get(slot + 1)
        {
            prefetch(next);
        }
    }

    /// The value of `key`, to change in place.
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.find(key).map(|i| &mut self.at_mut(i).1)
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

    /// Puts an entry in one of its buckets, growing the table when no room can be made.
    fn place(&mut self, key: K, value: V) {
        self.place_hashed(key, value, key.hash());
    }

    /// [`Self::place`] for a key whose hash is `h`.
    #[inline]
    fn place_hashed(&mut self, key: K, value: V, h: u64) {
        // Nearly always an empty slot in one of its buckets: taken here, without the walk.
        let (a, b) = buckets(h, self.ctrl.len());
        match free_slot(a, self.ctrl[a], b, self.ctrl[b]) {
            Some((c, j)) => self.put(c, j, (key, value), h),
            None => self.place_walking(key, value, h),
        }
    }

    /// [`Self::place_hashed`] when both buckets are full: the walk, growing the table when it
    /// makes no room.
    #[cold]
    #[inline(never)]
    fn place_walking(&mut self, key: K, value: V, h: u64) {
        let mut hand = (key, value);
        let mut h = h;
        while let Err(left) = self.settle(hand, h, self.ctrl.len()) {
            // No room made in a table under half its most: keys crowding the same buckets at
            // every size (their hashes collide), which a growth would not part.
            if self.len * 20 < self.slots.len() * MOST_TENTHS {
                self.stash.push(left);
                return;
            }
            hand = left;
            h = hand.0.hash();
            self.resize(self.grown());
        }
    }

    /// Puts `hand` in one of its buckets in a table of the first `n` buckets: in an empty slot
    /// of either (the emptier bucket's) when there is one; else in a slot whose entry waits
    /// for a rebuild to move it (its byte 1), that entry taken in hand next; else in a slot of
    /// a full bucket whose entry goes to its other bucket, at most [`MAX_KICKS`] times. `Err`:
    /// the entry in hand then (another one, maybe), for a larger table. `h` is `hand`'s hash.
    fn settle(&mut self, mut hand: (K, V), mut h: u64, n: usize) -> Result<(), (K, V)> {
        let mut kicks = 0;
        // The bucket the entry in hand was just moved out of.
        let mut from = usize::MAX;
        loop {
            let (a, b) = buckets(h, n);
            let (ca, cb) = (self.ctrl[a], self.ctrl[b]);
            if let Some((c, j)) = free_slot(a, ca, b, cb) {
                self.put(c, j, hand, h);
                return Ok(());
            }
            // No byte is 0: a byte without its top bit is an entry waiting to move.
            let (wa, wb) = (empties(ca), empties(cb));
            if wa | wb != 0 {
                let slot = if wa != 0 {
                    a * G + lowest(wa)
                } else {
                    b * G + lowest(wb)
                };
                let waiting = self.slots[slot];
                self.put_at(slot, hand, h);
                hand = waiting;
                h = hand.0.hash();
                from = usize::MAX;
                continue;
            }
            if kicks == MAX_KICKS {
                return Err(hand);
            }
            let c = if a == from { b } else { a };
            let slot = c * G + (h as usize >> 7).wrapping_add(kicks) % G;
            let out = self.slots[slot];
            self.put_at(slot, hand, h);
            hand = out;
            h = hand.0.hash();
            from = c;
            kicks += 1;
        }
    }

    fn put_at(&mut self, slot: usize, e: (K, V), h: u64) {
        self.put(slot / G, slot % G, e, h);
    }

    /// Puts entry `e` (hash `h`) in slot `j` of bucket `c`.
    fn put(&mut self, c: usize, j: usize, e: (K, V), h: u64) {
        self.ctrl[c].0[j] = tag_of(h);
        self.slots[c * G + j] = e;
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let slot = self.find(key)?;
        Some(self.remove_at(slot))
    }

    /// Removes the entry in (occupied) slot `slot`, returning its value.
    fn remove_at(&mut self, slot: usize) -> V {
        let removed = if slot < self.slots.len() {
            self.set_tag(slot, 0);
            self.slots[slot].1
        } else {
            self.stash.swap_remove(slot - self.slots.len()).1
        };
        self.len -= 1;
        // Below a third of the most (3/10): rebuilt at two thirds of it.
        if self.ctrl.len() > MIN_BUCKETS && self.len * 30 < self.slots.len() * MOST_TENTHS {
            self.resize(buckets_for(self.len * 15 / MOST_TENTHS));
        }
        removed
    }

    /// Forgets every entry; the memory goes back too.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Room for `additional` more entries without growing.
    pub fn reserve(&mut self, additional: usize) {
        let want = self.buckets_with_room(additional);
        if want > self.ctrl.len() {
            self.resize(want);
        }
    }

    /// What [`Table::bytes`] would be after [`Table::reserve`]`(additional)`.
    #[must_use]
    pub fn bytes_with_room(&self, additional: usize) -> usize {
        let buckets = self.buckets_with_room(additional).max(self.ctrl.len());
        buckets * (G * std::mem::size_of::<(K, V)>() + std::mem::size_of::<Ctrl>())
    }

    fn buckets_with_room(&self, additional: usize) -> usize {
        buckets_for(self.len.saturating_add(additional) * 10 / MOST_TENTHS + 1)
    }

    /// Gives back room a [`Table::reserve`] left unused: a table under half of its most is
    /// rebuilt in place at a rebuild's size (4/5 full). One pass over the entries.
    pub fn fit(&mut self) {
        if self.ctrl.len() > MIN_BUCKETS && self.len * 20 < self.slots.len() * MOST_TENTHS {
            self.resize(buckets_for(slots_for(self.len)));
        }
    }

    /// Moves every entry (slots whose tag is not 0) into a table of `n` buckets, in place: the
    /// arrays grow first or shrink after, so the old and the new are never both in memory.
    /// Every entry is marked waiting (byte 1), then each waiting one, in slot order, is
    /// settled among the first `n` buckets, taking the waiting entry whose slot it takes in
    /// hand next.
    fn resize(&mut self, n: usize) {
        let old = self.ctrl.len();
        let stashed = std::mem::take(&mut self.stash);
        if self.len == 0 {
            self.ctrl = vec![Ctrl::default(); n];
            self.slots = vec![Default::default(); n * G];
            return;
        }
        if n > old {
            self.ctrl.reserve_exact(n - old);
            self.ctrl.resize(n, Ctrl::default());
            self.slots.reserve_exact((n - old) * G);
            self.slots.resize(n * G, Default::default());
        }
        // Each tag byte becomes 1 (its top bit moved down), each empty one stays 0.
        for c in &mut self.ctrl {
            for b in &mut c.0 {
                *b >>= 7;
            }
        }
        let mut left = Vec::new();
        for slot in 0..old * G {
            if byte(&self.ctrl, slot) == 1 {
                self.set_tag(slot, 0);
                let e = self.slots[slot];
                if let Err(e) = self.settle(e, e.0.hash(), n) {
                    left.push(e);
                }
            }
        }
        if n < old {
            self.ctrl.truncate(n);
            self.ctrl.shrink_to_fit();
            self.slots.truncate(n * G);
            self.slots.shrink_to_fit();
        }
        // Entries no room could be made for (all but impossible below 9/10 full) and those
        // kept aside, which may fit now.
        for (k, v) in left.into_iter().chain(stashed) {
            self.place(k, v);
        }
    }

    /// Every entry, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(i, _)| self.occupied(*i))
            .map(|(_, e)| e)
            .chain(&self.stash)
            .map(|(k, v)| (k, v))
    }

    /// Every value, in table order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    /// Every entry, taken out; the table is left empty and its memory goes back.
    pub fn drain(&mut self) -> impl Iterator<Item = (K, V)> + use<K, V> {
        self.len = 0;
        let ctrl = std::mem::take(&mut self.ctrl);
        std::mem::take(&mut self.slots)
            .into_iter()
            .enumerate()
            .filter(move |(i, _)| byte(&ctrl, *i) != 0)
            .map(|(_, e)| e)
            .chain(std::mem::take(&mut self.stash))
    }

    /// [`Table::retain`] a little at a time: visits the slots from `from` on, at most `max`,
    /// keeping the entries `keep` (which may change them) says to keep. Returns how many slots
    /// it visited and where to go on, or `None` once it has visited the last slot (and the
    /// entries kept aside): then the table shrinks if it is sparse, as after a removal.
    /// Nothing moves before that, so a walk that goes on from where it left off visits every
    /// entry that was there when it began and is still there, once; an insert or a removal
    /// between two calls may make it visit one twice or miss one that moved.
    pub fn sweep(
        &mut self,
        from: usize,
        max: usize,
        mut keep: impl FnMut(&mut V) -> bool,
    ) -> (usize, Option<usize>) {
        let end = from.saturating_add(max).min(self.slots.len());
        for slot in from..end {
            if self.occupied(slot) && !keep(&mut self.slots[slot].1) {
                self.set_tag(slot, 0);
                self.len -= 1;
            }
        }
        let visited = end.saturating_sub(from);
        if end < self.slots.len() {
            return (visited, Some(end));
        }
        let before = self.stash.len();
        self.stash.retain_mut(|e| keep(&mut e.1));
        self.len -= before - self.stash.len();
        if self.ctrl.len() > MIN_BUCKETS && self.len * 30 < self.slots.len() * MOST_TENTHS {
            self.resize(buckets_for(self.len * 15 / MOST_TENTHS));
        }
        (visited + before, None)
    }

    /// Keeps the entries `keep` (which may change them) says to keep; rebuilt to fit.
    pub fn retain(&mut self, mut keep: impl FnMut(&mut V) -> bool) {
        for slot in 0..self.slots.len() {
            if self.occupied(slot) && !keep(&mut self.slots[slot].1) {
                self.set_tag(slot, 0);
                self.len -= 1;
            }
        }
        let before = self.stash.len();
        self.stash.retain_mut(|e| keep(&mut e.1));
        self.len -= before - self.stash.len();
        self.resize(buckets_for(slots_for(self.len)));
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
        &self.table.at(self.slot).1
    }

    /// The value, to change in place.
    pub fn get_mut(&mut self) -> &mut V {
        &mut self.table.at_mut(self.slot).1
    }

    /// The value, to change in place, for as long as the table is borrowed.
    #[must_use]
    pub fn into_mut(self) -> &'t mut V {
        &mut self.table.at_mut(self.slot).1
    }

    /// Removes the entry, returning its value.
    pub fn remove(self) -> V {
        self.table.remove_at(self.slot)
    }
}

/// An absent key's entry.
#[derive(Debug)]
pub struct Vacant<'t, K, V> {
    table: &'t mut Table<K, V>,
    key: K,
    /// The key's hash.
    hash: u64,
}

impl<K: Key, V: Copy + Default> Vacant<'_, K, V> {
    /// Inserts the key with `value`.
    #[inline]
    pub fn insert(self, value: V) {
        let table = self.table;
        if table.grows_on_insert() {
            table.resize(table.grown());
        }
        table.place_hashed(self.key, value, self.hash);
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

    /// A key whose hash is its own value: collisions on demand.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    struct Raw(u64);

    impl Key for Raw {
        fn hash(&self) -> u64 {
            self.0
        }
    }

    /// A key whose hash is the same whatever its value: every key in the same two buckets.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    struct Same(u64);

    impl Key for Same {
        fn hash(&self) -> u64 {
            0x0123_4567_89AB_CDEF
        }
    }

    fn rng(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    fn check_invariant<K: Key + std::fmt::Debug, V: Copy + Default>(t: &Table<K, V>) {
        let n = t.ctrl.len();
        assert_eq!(t.slots.len(), n * G);
        let mut held = t.stash.len();
        for (c, ctrl) in t.ctrl.iter().enumerate() {
            assert_eq!(ctrl.0[G], 0, "bucket {c}: the unused byte");
            for j in 0..G {
                let byte = ctrl.0[j];
                if byte == 0 {
                    continue;
                }
                held += 1;
                let k = t.slots[c * G + j].0;
                let h = k.hash();
                assert_eq!(byte, tag_of(h), "{k:?} at {c}/{j}: tag");
                let (a, b) = buckets(h, n);
                assert!(c == a || c == b, "{k:?} in bucket {c}, not {a} or {b}");
                assert_eq!(t.find(&k), Some(c * G + j), "{k:?} not found where it is");
            }
        }
        for e in &t.stash {
            assert!(t.find(&e.0).is_some(), "{:?} in the stash not found", e.0);
        }
        assert_eq!(held, t.len);
    }

    #[test]
    fn agrees_with_a_hash_map_under_random_inserts_and_removes() {
        let mut table: Table<K2, u32> = Table::new();
        let mut model: HashMap<(u64, u32), u32> = HashMap::new();
        let mut x = rng(0x2545_F491_4F6C_DD1D);
        for step in 0..200_000u32 {
            let r = x();
            // Few distinct keys (buckets full, kicks), clustered low bits too.
            let k = (r % 3_000) << (r % 3);
            let a = (r >> 40) as u32 % 3;
            match r % 7 {
                0..=2 => {
                    if let Some(v) = table.get_mut(&K2(k, a)) {
                        *v = step;
                    } else {
                        table.insert_new(K2(k, a), step);
                    }
                    model.insert((k, a), step);
                }
                3 | 4 => match table.entry(K2(k, a)) {
                    Entry::Occupied(mut o) => {
                        assert_eq!(Some(o.get()), model.get(&(k, a)), "step {step}");
                        *o.get_mut() = step;
                        model.insert((k, a), step);
                    }
                    Entry::Vacant(v) => {
                        assert!(!model.contains_key(&(k, a)), "step {step}");
                        v.insert(step);
                        model.insert((k, a), step);
                    }
                },
                5 => {
                    let got = table.remove(&K2(k, a));
                    assert_eq!(got, model.remove(&(k, a)), "step {step}");
                }
                _ => {
                    let got = match table.entry(K2(k, a)) {
                        Entry::Occupied(o) => Some(o.remove()),
                        Entry::Vacant(_) => None,
                    };
                    assert_eq!(got, model.remove(&(k, a)), "step {step}");
                }
            }
            assert_eq!(table.len(), model.len());
            if step % 20_000 == 0 {
                check_invariant(&table);
                assert!(table.len() * 10 <= table.slots.len() * MOST_TENTHS);
            }
        }
        check_invariant(&table);
        assert!(table.stash.is_empty(), "well-spread keys never go aside");
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
    fn full_buckets_move_entries_to_their_other_bucket() {
        // Keys whose buckets are among six of a small table, nearly filling them: their
        // inserts must move entries to their other buckets (the table is not grown for it).
        let mut table: Table<Raw, u64> = Table::new();
        table.reserve(130);
        let n = table.ctrl.len() as u64;
        assert!(n >= 8);
        let bytes = table.bytes();
        let width = (1u64 << 32) / n;
        let mut x = rng(7);
        let mut keys = std::collections::BTreeSet::new();
        while keys.len() < 6 * G - 5 {
            // First bucket 0, 1 or 2 (high half of the hash), second 5, 6 or 7 (low half).
            let hi = (x() % 3) * width + 1 + x() % (width - 2);
            let lo = (5 + x() % 3) * width + 1 + x() % (width - 2);
            keys.insert(hi << 32 | lo);
        }
        for &k in &keys {
            table.insert_new(Raw(k), !k);
        }
        check_invariant(&table);
        assert_eq!(table.bytes(), bytes, "no growth");
        assert!(table.stash.is_empty());
        for &k in &keys {
            assert_eq!(buckets(k, n as usize).0 / 3, 0);
            assert_eq!(table.get(&Raw(k)), Some(&!k));
        }
    }

    #[test]
    fn keys_with_one_hash_go_aside_instead_of_growing_the_table() {
        let mut table: Table<Same, u64> = Table::new();
        for k in 0..200u64 {
            table.insert_new(Same(k), k);
            check_invariant(&table);
        }
        assert_eq!(table.len(), 200);
        assert!(table.stashed() >= 200 - 2 * G, "{}", table.stashed());
        assert!(
            table.slots.len() <= 200 * 4,
            "grew to {} slots for 200 colliding keys",
            table.slots.len()
        );
        for k in 0..200u64 {
            assert_eq!(table.get(&Same(k)), Some(&k));
        }
        for k in (0..200u64).step_by(3) {
            assert_eq!(table.remove(&Same(k)), Some(k));
        }
        check_invariant(&table);
        for k in 0..200u64 {
            assert_eq!(table.get(&Same(k)), (k % 3 != 0).then_some(&k));
        }
        let mut all: Vec<u64> = table.values().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..200).filter(|k| k % 3 != 0).collect::<Vec<_>>());
        table.retain(|v| *v % 2 == 0);
        check_invariant(&table);
        assert_eq!(
            table.len(),
            (0..200).filter(|k| k % 3 != 0 && k % 2 == 0).count()
        );
    }

    #[test]
    fn structured_keys_spread() {
        // Small integers as big-endian bytes: the high bits vary last. No bucket pair crowds.
        let mut table: Table<K2, u32> = Table::new();
        for k in 0..50_000u64 {
            table.insert_new(K2(k << 56 | k, 0), 0);
        }
        check_invariant(&table);
        assert!(table.stash.is_empty());
    }

    #[test]
    fn churn_does_not_grow_it_and_emptying_shrinks_it() {
        let loads = 0.72..=0.9;
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
        assert_eq!(
            table.bytes(),
            MIN_BUCKETS * (G * std::mem::size_of::<(K2, u32)>() + 16)
        );
        // Between 72 % and 90 % full (dense) whatever the count (no power-of-two steps).
        for n in [1_000u64, 4_096, 5_000, 33_000, 40_960, 100_000] {
            let mut table: Table<K2, u32> = Table::new();
            for k in 0..n {
                table.insert_new(K2(k, 0), 0);
            }
            let load = n as f64 / table.slots.len() as f64;
            assert!(loads.contains(&load), "{n}: {load}");
            check_invariant(&table);
            // Emptied down to a tenth, it shrinks and stays under its most.
            for k in n / 10..n {
                table.remove(&K2(k, 0));
            }
            let load = (n / 10) as f64 / table.slots.len() as f64;
            assert!(
                load * 3.0 >= *loads.end() * 0.99 || table.ctrl.len() == MIN_BUCKETS,
                "{n}: {load} after emptying"
            );
            check_invariant(&table);
            for k in 0..n / 10 {
                assert_eq!(table.get(&K2(k, 0)), Some(&0));
            }
        }
    }

    #[test]
    fn growing_and_shrinking_in_place_keep_every_entry() {
        // Growth one step at a time from one bucket, then shrinks, then a retain: every
        // entry found after each, none aside.
        let mut table: Table<K2, u64> = Table::new();
        let mut x = rng(0x9E37_79B9_7F4A_7C15);
        let keys: Vec<K2> = (0..30_000).map(|_| K2(x(), 0)).collect();
        let mut sizes = Vec::new();
        for (i, &k) in keys.iter().enumerate() {
            table.insert_new(k, i as u64);
            if sizes.last() != Some(&table.ctrl.len()) {
                sizes.push(table.ctrl.len());
                check_invariant(&table);
            }
        }
        assert!(sizes.len() > 20, "{sizes:?}");
        for (i, k) in keys.iter().enumerate().skip(1_000) {
            assert_eq!(table.remove(k), Some(i as u64));
        }
        check_invariant(&table);
        assert!(table.ctrl.len() < sizes[sizes.len() - 1] / 5);
        for (i, k) in keys.iter().enumerate().take(1_000) {
            assert_eq!(table.get(k), Some(&(i as u64)));
        }
        table.retain(|v| *v < 10);
        check_invariant(&table);
        assert_eq!(table.len(), 10);
        assert!(table.stash.is_empty());
    }

    #[test]
    fn a_reserve_takes_its_room_at_once_and_fit_gives_back_what_went_unused() {
        let mut table: Table<K2, u64> = Table::new();
        let mut x = rng(7);
        let keys: Vec<K2> = (0..20_000).map(|_| K2(x(), 0)).collect();
        table.insert_new(keys[0], 0);
        let bytes = table.bytes_with_room(20_000);
        table.reserve(20_000);
        assert_eq!(
            table.bytes(),
            bytes,
            "bytes_with_room says what reserve takes"
        );
        let buckets = table.ctrl.len();
        for (i, &k) in keys.iter().enumerate().skip(1).take(4_999) {
            table.insert_new(k, i as u64);
        }
        assert_eq!(table.ctrl.len(), buckets, "no growth within the room");
        // A quarter of the room used: fit rebuilds at a rebuild's size, every entry kept.
        table.fit();
        check_invariant(&table);
        assert!(
            table.ctrl.len() < buckets / 3,
            "{} of {buckets}",
            table.ctrl.len()
        );
        assert_eq!(table.len(), 5_000);
        for (i, k) in keys.iter().enumerate().take(5_000) {
            assert_eq!(table.get(k), Some(&(i as u64)));
        }
        // A table at its grown size is left as it is.
        let fitted = table.ctrl.len();
        table.fit();
        assert_eq!(table.ctrl.len(), fitted);
    }

    #[test]
    fn the_sizes_are_the_slot_counts_of_steps_of_a_quarter() {
        // 16, 20, 25, 31, … slots, rounded up to whole buckets: the mapper's default cap of
        // 917,504 blocks sits in 1,043,652 of them (87.9 % full).
        let mut table: Table<K2, u32> = Table::new();
        for k in 0..917_504u64 {
            table.insert_new(K2(k, 7), 0);
        }
        assert_eq!(table.ctrl.len(), 1_043_652usize.div_ceil(G));
    }

    #[test]
    fn prefetching_any_key_at_any_size_changes_nothing() {
        // Prefetches read control words and compute slots: on an empty table, beside a stash,
        // across resizes, for present and absent keys, they must neither panic nor change a
        // thing.
        let mut table: Table<Same, u64> = Table::new();
        let mut spread: Table<K2, u64> = Table::new();
        let probe = |t: &Table<K2, u64>, k: &K2| {
            t.prefetch(k);
            t.prefetch_slot(k);
            t.prefetch_insert(k);
        };
        probe(&spread, &K2(1, 0));
        for k in 0..3_000u64 {
            spread.insert_new(K2(k, 0), k);
            probe(&spread, &K2(k, 0));
            probe(&spread, &K2(k + 1_000_000, 0));
            if k < 100 {
                table.insert_new(Same(k), k);
                table.prefetch_slot(&Same(k));
                table.prefetch_insert(&Same(k + 1_000));
            }
        }
        for k in 0..2_900u64 {
            spread.remove(&K2(k, 0));
            probe(&spread, &K2(k, 0));
        }
        check_invariant(&spread);
        check_invariant(&table);
        assert_eq!(spread.len(), 100);
        assert!(table.stashed() > 0);
        for k in 2_900..3_000u64 {
            assert_eq!(spread.get(&K2(k, 0)), Some(&k));
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

    #[test]
    fn counts_are_count_ones() {
        let mut x = rng(7);
        for _ in 0..100_000 {
            let (a, b) = (x() as Mask & ALL, x() as Mask & ALL);
            assert_eq!(
                counts(a, b),
                (a.count_ones(), b.count_ones()),
                "{a:b} {b:b}"
            );
        }
        assert_eq!(counts(ALL, ALL), (15, 15));
        assert_eq!(counts(0, ALL), (0, 15));
    }

    #[test]
    fn matching_finds_what_a_byte_by_byte_scan_finds() {
        let slots = |mut m: Mask| {
            let mut got = Vec::new();
            while m != 0 {
                got.push(lowest(m));
                m &= m - 1;
            }
            got
        };
        let mut x = rng(0x2545_F491_4F6C_DD1D);
        for _ in 0..20_000 {
            let bytes: [u8; 16] = std::array::from_fn(|j| match x() % 4 {
                // The unused byte is always 0.
                _ if j == G => 0,
                0 => 0,
                1 => 1,
                _ => 0x80 | (x() as u8 & 0x7F),
            });
            let ctrl = Ctrl(bytes);
            for tag in [0, 0x80 | (x() as u8 & 0x7F), bytes[(x() % 15) as usize]] {
                let want: Vec<usize> = (0..G).filter(|&j| bytes[j] == tag).collect();
                assert_eq!(slots(matching(ctrl, tag)), want, "{bytes:?} {tag}");
                assert_eq!(
                    slots(portable::matching(ctrl, tag)),
                    want,
                    "{bytes:?} {tag}"
                );
            }
            let free: Vec<usize> = (0..G).filter(|&j| bytes[j] < 0x80).collect();
            assert_eq!(slots(empties(ctrl)), free);
            assert_eq!(slots(portable::empties(ctrl)), free);
        }
    }
}
