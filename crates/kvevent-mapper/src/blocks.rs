//! The per-source block map, compact: what is known of each engine block in ≤ 64 bytes.
//!
//! An engine block is identified by its hash and KV-cache group. Hashes of 8 bytes (every int
//! hash, as its 8 bytes big-endian, and an 8-byte `bin`), 16 bytes and 32 bytes each key a map
//! of fixed-size keys, so a digest costs just its length on top; other lengths (none seen in
//! practice) key a fourth map by boxed bytes. Groups and adapters are interned (`u16`), and
//! the reported key is never stored: in engine mode it is the hash itself, in fingerprint mode
//! the 8-byte prefix fingerprint.
//!
//! Layout: key 10 bytes (8-byte hash + group), value 15 bytes (fingerprint, token count,
//! adapter, flags), packed to 25 bytes an entry (unaligned), and the table's tag byte (16 bytes
//! a bucket of 15), in a [`kvevent_table::Table`]: any size, 72–90 % full whatever the count
//! (1.25 slots a block on average), and no tombstones, so an int-hashed block costs 29–36
//! bytes (29.7 at the default cap), and an engine's churn never grows the map (measured by
//! `cargo run --release -p kvevent-benches --bin mapper-memory`).

use std::collections::HashMap;
use std::sync::Arc;

use kvevent_table::{Entry as TableEntry, Key, Table};

use crate::wire;

type Hasher = foldhash::fast::RandomState;

/// The tier bit of T1 in [`Tracked::tiers`]; T2 (and any offload tier) is `T2`.
pub(crate) const T1: u8 = 1;
pub(crate) const T2: u8 = 2;
const KEYED: u8 = 4;
const HAS_PREFIX: u8 = 8;
const TIERS: u8 = T1 | T2;
/// The copies of the block beyond the first, in the high four bits: vLLM caches one hash in
/// two blocks when two requests compute the same prefix, or when a prompt cached whole is sent
/// again (its last block computed anew), and removes it once per block.
const COPIES_SHIFT: u8 = 4;
const MAX_EXTRA_COPIES: u8 = 15;

/// What is known of one engine block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C, packed)]
pub(crate) struct Tracked {
    /// Its prefix fingerprint (fingerprint mode), valid with `HAS_PREFIX`.
    prefix: u64,
    /// Tokens covered by the prefix up to and including this block.
    tokens: u32,
    /// Interned adapter name.
    adapter: u16,
    /// Tier bits (`T1`, `T2`), `KEYED` (reported under a key), `HAS_PREFIX`.
    flags: u8,
}

impl Tracked {
    pub(crate) fn new(
        keyed: bool,
        prefix: Option<u64>,
        tokens: u32,
        adapter: u16,
        tiers: u8,
    ) -> Self {
        let mut flags = tiers & TIERS;
        if keyed {
            flags |= KEYED;
        }
        if prefix.is_some() {
            flags |= HAS_PREFIX;
        }
        Self {
            prefix: prefix.unwrap_or(0),
            tokens,
            adapter,
            flags,
        }
    }

    pub(crate) fn keyed(self) -> bool {
        self.flags & KEYED != 0
    }

    pub(crate) fn prefix(self) -> Option<u64> {
        (self.flags & HAS_PREFIX != 0).then_some(self.prefix)
    }

    pub(crate) fn tokens(self) -> u32 {
        self.tokens
    }

    pub(crate) fn adapter(self) -> u16 {
        self.adapter
    }

    pub(crate) fn tiers(self) -> u8 {
        self.flags & TIERS
    }

    pub(crate) fn set_tiers(&mut self, tiers: u8) {
        self.flags = (self.flags & !TIERS) | (tiers & TIERS);
    }

    /// The engine's copies of the block beyond the first (saturating at 15).
    pub(crate) fn extra_copies(self) -> u8 {
        self.flags >> COPIES_SHIFT
    }

    pub(crate) fn set_extra_copies(&mut self, n: u8) {
        let n = n.min(MAX_EXTRA_COPIES);
        self.flags = (self.flags & ((1 << COPIES_SHIFT) - 1)) | (n << COPIES_SHIFT);
    }

    /// Its fields as saved: prefix, tokens, adapter, flags.
    pub(crate) fn raw(self) -> (u64, u32, u16, u8) {
        (self.prefix, self.tokens, self.adapter, self.flags)
    }

    /// Back from [`Tracked::raw`].
    pub(crate) fn from_raw(prefix: u64, tokens: u32, adapter: u16, flags: u8) -> Self {
        Self {
            prefix,
            tokens,
            adapter,
            flags,
        }
    }
}

/// A hash of `N` bytes and its interned group: 8 + 2, 16 + 2 or 32 + 2 bytes, unpadded (and
/// unaligned, as [`Tracked`] is: a slot is 25 bytes, not 26).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, packed)]
struct Fixed<const N: usize> {
    hash: [u8; N],
    group: u16,
}

impl<const N: usize> Default for Fixed<N> {
    fn default() -> Self {
        Self {
            hash: [0; N],
            group: 0,
        }
    }
}

impl<const N: usize> Key for Fixed<N> {
    fn hash(&self) -> u64 {
        let bytes = self.hash;
        let mut x = u64::from(self.group);
        for chunk in bytes.chunks_exact(8) {
            let word: [u8; 8] = chunk.try_into().expect("chunks of 8");
            x = x.rotate_left(29) ^ u64::from_le_bytes(word);
        }
        kvevent_table::mix(x)
    }
}

/// The digests of another length, keyed by the digest followed by the group's two bytes.
type OtherMap = HashMap<Box<[u8]>, Tracked, Hasher>;

/// An engine block's identity, borrowed from the event.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BlockId<'h> {
    /// An 8-byte hash (every int, big-endian, and an 8-byte `bin`).
    H8([u8; 8], u16),
    /// A 16-byte digest (xxhash-128).
    H16([u8; 16], u16),
    /// A 32-byte digest (sha256).
    H32([u8; 32], u16),
    /// A digest of another length.
    Other(&'h [u8], u16),
}

impl<'h> BlockId<'h> {
    pub(crate) fn new(hash: &'h wire::BlockHash<'_>, group: u16) -> Self {
        match hash {
            wire::BlockHash::Int(i) => Self::H8(i.to_be_bytes(), group),
            wire::BlockHash::Bytes(b) => {
                if let Ok(h) = <[u8; 8]>::try_from(&**b) {
                    Self::H8(h, group)
                } else if let Ok(h) = <[u8; 16]>::try_from(&**b) {
                    Self::H16(h, group)
                } else if let Ok(h) = <[u8; 32]>::try_from(&**b) {
                    Self::H32(h, group)
                } else {
                    Self::Other(b, group)
                }
            }
        }
    }

    /// The hash's bytes (the engine-mode key), borrowed.
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Self::H8(h, _) => h,
            Self::H16(h, _) => h,
            Self::H32(h, _) => h,
            Self::Other(b, _) => b,
        }
    }
}

/// A block whose map memory [`Blocks::prefetch`] asked for: its table, whether it is about to
/// be stored, and its hash, so that the slot's prefetch does not hash it again.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Touched {
    /// 0, 1, 2: the table of 8-, 16-, 32-byte hashes.
    map: u8,
    stored: bool,
    hash: u64,
}

/// A block's identity, owned.
#[derive(Debug, Clone)]
pub(crate) enum OwnedId {
    H8([u8; 8], u16),
    Other(Box<[u8]>, u16),
}

/// The identities of the blocks tracked at one moment.
#[derive(Debug, Default)]
pub(crate) struct Snapshot {
    h8: Vec<([u8; 8], u16)>,
    other: Vec<OwnedId>,
}

impl Snapshot {
    pub(crate) fn len(&self) -> usize {
        self.h8.len() + self.other.len()
    }

    /// The `i`th identity (8-byte hashes first).
    pub(crate) fn get(&self, i: usize) -> Option<OwnedId> {
        match self.h8.get(i) {
            Some((h, g)) => Some(OwnedId::H8(*h, *g)),
            None => self.other.get(i - self.h8.len()).cloned(),
        }
    }
}

impl OwnedId {
    fn sort_key(&self) -> (&[u8], u16) {
        match self {
            Self::H8(h, g) => (&h[..], *g),
            Self::Other(b, g) => (&b[..], *g),
        }
    }

    /// The identity to look the block up with.
    pub(crate) fn id(&self) -> BlockId<'_> {
        match self {
            Self::H8(h, g) => BlockId::H8(*h, *g),
            Self::Other(b, g) => match (<[u8; 16]>::try_from(&**b), <[u8; 32]>::try_from(&**b)) {
                (Ok(h), _) => BlockId::H16(h, *g),
                (_, Ok(h)) => BlockId::H32(h, *g),
                _ => BlockId::Other(b, *g),
            },
        }
    }
}

/// The key of a digest of another length: the digest, then the group's two bytes.
fn other_key(b: &[u8], group: u16) -> Vec<u8> {
    let mut key = Vec::with_capacity(b.len() + 2);
    key.extend_from_slice(b);
    key.extend_from_slice(&group.to_be_bytes());
    key
}

/// How an insert went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Insert {
    /// Not tracked before.
    New,
    /// Already tracked: updated, tiers merged.
    Updated,
    /// The map is full, or too many groups or adapters: not tracked.
    Refused,
}

/// Most distinct KV-cache groups or adapters per source (interned as `u16`, below `u16::MAX`).
const MAX_INTERNED: usize = u16::MAX as usize;

/// The calls [`Blocks`] makes on each of its maps, each one walk, so [`with_map!`] bodies
/// read the same for every map.
trait BlockMap<K> {
    /// Tracks `block` (tiers merged with what was known of it), or refuses a new one when
    /// `full`.
    fn upsert(&mut self, key: K, block: Tracked, full: bool) -> Insert;
    /// Lets `change` update a tracked block and say whether it goes; the block as changed.
    fn change_or_remove(
        &mut self,
        key: K,
        change: impl FnOnce(&mut Tracked) -> bool,
    ) -> Option<Tracked>;
}

/// A block stored again: its tiers joined, and one more copy when a tier already held it.
fn merge(known: &mut Tracked, mut block: Tracked) {
    let again = block.tiers() & known.tiers() != 0;
    block.set_tiers(block.tiers() | known.tiers());
    block.set_extra_copies(known.extra_copies().saturating_add(u8::from(again)));
    *known = block;
}

impl<const N: usize> BlockMap<Fixed<N>> for Table<Fixed<N>, Tracked> {
    #[inline]
    fn upsert(&mut self, key: Fixed<N>, block: Tracked, full: bool) -> Insert {
        // A new block goes where the lookup's walk ended.
        match self.entry(key) {
            TableEntry::Occupied(o) => {
                merge(o.into_mut(), block);
                Insert::Updated
            }
            TableEntry::Vacant(_) if full => Insert::Refused,
            TableEntry::Vacant(v) => {
                v.insert(block);
                Insert::New
            }
        }
    }

    #[inline]
    fn change_or_remove(
        &mut self,
        key: Fixed<N>,
        change: impl FnOnce(&mut Tracked) -> bool,
    ) -> Option<Tracked> {
        let TableEntry::Occupied(mut o) = self.entry(key) else {
            return None;
        };
        let gone = change(o.get_mut());
        let t = *o.get();
        if gone {
            o.remove();
        }
        Some(t)
    }
}

impl BlockMap<Box<[u8]>> for OtherMap {
    fn upsert(&mut self, key: Box<[u8]>, block: Tracked, full: bool) -> Insert {
        match self.entry(key) {
            std::collections::hash_map::Entry::Occupied(mut o) => {
                merge(o.get_mut(), block);
                Insert::Updated
            }
            std::collections::hash_map::Entry::Vacant(_) if full => Insert::Refused,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(block);
                Insert::New
            }
        }
    }

    fn change_or_remove(
        &mut self,
        key: Box<[u8]>,
        change: impl FnOnce(&mut Tracked) -> bool,
    ) -> Option<Tracked> {
        let std::collections::hash_map::Entry::Occupied(mut o) = self.entry(key) else {
            return None;
        };
        let gone = change(o.get_mut());
        let t = *o.get();
        if gone {
            o.remove();
        }
        Some(t)
    }
}

/// Runs `$body` with `$map` the map that holds `$id` and `$key` its key there.
macro_rules! with_map {
    ($blocks:expr, $id:expr, |$map:ident, $key:ident| $body:expr) => {
        match $id {
            BlockId::H8(hash, group) => {
                let $map = &mut $blocks.h8;
                let $key = Fixed { hash, group };
                $body
            }
            BlockId::H16(hash, group) => {
                let $map = &mut $blocks.h16;
                let $key = Fixed { hash, group };
                $body
            }
            BlockId::H32(hash, group) => {
                let $map = &mut $blocks.h32;
                let $key = Fixed { hash, group };
                $body
            }
            BlockId::Other(b, group) => {
                let $map = &mut $blocks.other;
                let $key: Box<[u8]> = other_key(b, group).into();
                $body
            }
        }
    };
}

#[derive(Debug)]
pub(crate) struct Blocks {
    h8: Table<Fixed<8>, Tracked>,
    h16: Table<Fixed<16>, Tracked>,
    h32: Table<Fixed<32>, Tracked>,
    other: OtherMap,
    groups: Vec<Option<i64>>,
    adapters: Vec<Arc<str>>,
    adapter_ids: HashMap<Arc<str>, u16, Hasher>,
    /// The adapter interned or found last: a source's stores nearly always name the same
    /// `Arc` (the mapper's base name, a configured one), found again without hashing it.
    last_adapter: Option<u16>,
    max: usize,
}

impl Blocks {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            h8: Table::new(),
            h16: Table::new(),
            h32: Table::new(),
            other: HashMap::default(),
            groups: Vec::new(),
            adapters: Vec::new(),
            adapter_ids: HashMap::default(),
            last_adapter: None,
            max,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.h8.len() + self.h16.len() + self.h32.len() + self.other.len()
    }

    /// Blocks kept aside in the tables (see [`Table::stashed`]).
    pub(crate) fn stashed(&self) -> usize {
        self.h8.stashed() + self.h16.stashed() + self.h32.stashed()
    }

    /// The interned number of a group, or `None` when there are too many groups.
    pub(crate) fn group(&mut self, group: Option<i64>) -> Option<u16> {
        if let Some(i) = self.known_group(group) {
            return Some(i);
        }
        if self.groups.len() >= MAX_INTERNED {
            return None;
        }
        self.groups.push(group);
        Some((self.groups.len() - 1) as u16)
    }

    /// The interned number of a group already seen.
    pub(crate) fn known_group(&self, group: Option<i64>) -> Option<u16> {
        self.groups
            .iter()
            .position(|g| *g == group)
            .map(|i| i as u16)
    }

    /// The interned number of an adapter, or `None` when there are too many adapters.
    pub(crate) fn adapter_id(&mut self, name: &Arc<str>) -> Option<u16> {
        // The same `Arc` as the one interned last: the same name, compared by address.
        if let Some(id) = self.last_adapter
            && self
                .adapters
                .get(usize::from(id))
                .is_some_and(|a| Arc::ptr_eq(a, name))
        {
            return Some(id);
        }
        let id = match self.adapter_ids.get(name) {
            Some(&id) => id,
            None if self.adapters.len() >= MAX_INTERNED => return None,
            None => {
                let id = self.adapters.len() as u16;
                self.adapters.push(name.clone());
                self.adapter_ids.insert(name.clone(), id);
                id
            }
        };
        self.last_adapter = Some(id);
        Some(id)
    }

    /// The interned adapter of this name, if any (no allocation for a name seen before).
    pub(crate) fn adapter_named(&self, name: &str) -> Option<&Arc<str>> {
        let &id = self.adapter_ids.get(name)?;
        Some(&self.adapters[usize::from(id)])
    }

    pub(crate) fn adapter(&self, id: u16) -> &Arc<str> {
        &self.adapters[usize::from(id)]
    }

    pub(crate) fn get(&mut self, id: BlockId<'_>) -> Option<Tracked> {
        self.get_mut(id).map(|t| *t)
    }

    /// Starts loading the control words of `id`'s buckets (see [`Table::prefetch`]); what
    /// [`Blocks::prefetch_slot`] needs to follow, for a block in a table (`stored`: one a store
    /// names, most likely new, rather than one looked up or removed).
    pub(crate) fn prefetch(&self, id: BlockId<'_>, stored: bool) -> Option<Touched> {
        let (map, hash) = match id {
            BlockId::H8(hash, group) => (0, Fixed { hash, group }.hash()),
            BlockId::H16(hash, group) => (1, Fixed { hash, group }.hash()),
            BlockId::H32(hash, group) => (2, Fixed { hash, group }.hash()),
            BlockId::Other(..) => return None,
        };
        let touched = Touched { map, stored, hash };
        match touched.map {
            0 => self.h8.prefetch_hashed(touched.hash),
            1 => self.h16.prefetch_hashed(touched.hash),
            _ => self.h32.prefetch_hashed(touched.hash),
        }
        Some(touched)
    }

    /// Starts loading the slots the block's lookup reads, and the one its insert takes for a
    /// block about to be stored (see [`Table::prefetch_slot`], [`Table::prefetch_insert`]).
    pub(crate) fn prefetch_slot(&self, touched: Touched) {
        match (touched.map, touched.stored) {
            (0, false) => self.h8.prefetch_slot_hashed(touched.hash),
            (0, true) => self.h8.prefetch_insert_hashed(touched.hash),
            (1, false) => self.h16.prefetch_slot_hashed(touched.hash),
            (1, true) => self.h16.prefetch_insert_hashed(touched.hash),
            (_, false) => self.h32.prefetch_slot_hashed(touched.hash),
            (_, true) => self.h32.prefetch_insert_hashed(touched.hash),
        }
    }

    pub(crate) fn get_mut(&mut self, id: BlockId<'_>) -> Option<&mut Tracked> {
        with_map!(self, id, |map, key| map.get_mut(&key))
    }

    /// Tracks a block, merging tiers with what was known of it.
    pub(crate) fn insert(&mut self, id: BlockId<'_>, block: Tracked) -> Insert {
        let full = self.len() >= self.max;
        with_map!(self, id, |map, key| map.upsert(key, block, full))
    }

    /// Lets `change` update a tracked block and say whether it goes (one walk); the block as
    /// changed. Call [`Self::shrink_if_empty`] once done with the block's adapter.
    pub(crate) fn change_or_remove(
        &mut self,
        id: BlockId<'_>,
        change: impl FnOnce(&mut Tracked) -> bool,
    ) -> Option<Tracked> {
        with_map!(self, id, |map, key| map.change_or_remove(key, change))
    }

    /// When no block is left, gives the maps' memory back and forgets the interned names.
    pub(crate) fn shrink_if_empty(&mut self) {
        if self.len() == 0 {
            self.shrink();
        }
    }

    /// Forgets every block; the memory goes back too.
    pub(crate) fn clear(&mut self) {
        self.other = HashMap::default();
        self.shrink();
    }

    /// Gives the memory of the (empty) maps back and forgets the interned names.
    fn shrink(&mut self) {
        self.h8.clear();
        self.h16.clear();
        self.h32.clear();
        self.other.shrink_to(1024);
        self.groups.clear();
        self.adapters.clear();
        self.adapter_ids.clear();
        self.last_adapter = None;
    }

    /// Every tracked block's identity, owned (a refresh cycle walks it while the map changes):
    /// 8-byte hashes packed in 10 bytes each, others boxed. Sorted, so a block keeps about the
    /// same place from one cycle to the next and is refreshed about once per interval (in the
    /// map's own order a block could come first in one cycle and last in the next: nearly two
    /// intervals apart).
    pub(crate) fn snapshot(&self) -> Snapshot {
        let mut h8: Vec<([u8; 8], u16)> =
            self.h8.iter().map(|(id, _)| (id.hash, id.group)).collect();
        h8.sort_unstable();
        let mut out = Vec::new();
        out.extend(self.h16.iter().map(|(id, _)| {
            let hash = id.hash;
            OwnedId::Other(Box::from(&hash[..]), id.group)
        }));
        out.extend(self.h32.iter().map(|(id, _)| {
            let hash = id.hash;
            OwnedId::Other(Box::from(&hash[..]), id.group)
        }));
        out.extend(self.other.keys().map(|b| {
            let (hash, group) = b.split_at(b.len() - 2);
            OwnedId::Other(Box::from(hash), u16::from_be_bytes([group[0], group[1]]))
        }));
        out.sort_unstable_by(|a, b| a.sort_key().cmp(&b.sort_key()));
        Snapshot { h8, other: out }
    }

    /// The blocks (hash bytes, interned group) held at `tier` (a tier bit).
    pub(crate) fn ids_in_tier(&self, tier: u8) -> Vec<(Vec<u8>, u16)> {
        let held = |t: &Tracked| t.tiers() & tier != 0;
        let mut out = Vec::new();
        out.extend(
            self.h8
                .iter()
                .filter(|(_, t)| held(t))
                .map(|(id, _)| ({ id.hash }.to_vec(), { id.group })),
        );
        out.extend(
            self.h16
                .iter()
                .filter(|(_, t)| held(t))
                .map(|(id, _)| ({ id.hash }.to_vec(), { id.group })),
        );
        out.extend(
            self.h32
                .iter()
                .filter(|(_, t)| held(t))
                .map(|(id, _)| ({ id.hash }.to_vec(), { id.group })),
        );
        out.extend(self.other.iter().filter(|(_, t)| held(t)).map(|(b, _)| {
            let (hash, group) = b.split_at(b.len() - 2);
            (hash.to_vec(), u16::from_be_bytes([group[0], group[1]]))
        }));
        out
    }

    /// Every block, with its engine-mode key; the map is left empty.
    pub(crate) fn drain(&mut self) -> Vec<(Vec<u8>, Tracked)> {
        let mut out = Vec::with_capacity(self.len());
        out.extend(self.h8.drain().map(|(id, t)| ({ id.hash }.to_vec(), t)));
        out.extend(self.h16.drain().map(|(id, t)| ({ id.hash }.to_vec(), t)));
        out.extend(self.h32.drain().map(|(id, t)| ({ id.hash }.to_vec(), t)));
        self.other.shrink_to(1024);
        out.extend(self.other.drain().map(|(b, t)| {
            let mut b = b.into_vec();
            b.truncate(b.len() - 2);
            (b, t)
        }));
        out
    }

    /// The interned groups and adapters, in interned order.
    pub(crate) fn interned(&self) -> (&[Option<i64>], &[Arc<str>]) {
        (&self.groups, &self.adapters)
    }

    /// Sets the interned groups and adapters of an empty map (a restore). False when they
    /// repeat or are too many.
    pub(crate) fn set_interned(
        &mut self,
        groups: Vec<Option<i64>>,
        adapters: Vec<Arc<str>>,
    ) -> bool {
        if self.len() != 0 || groups.len() > MAX_INTERNED || adapters.len() > MAX_INTERNED {
            return false;
        }
        let ids: HashMap<Arc<str>, u16, Hasher> = adapters
            .iter()
            .enumerate()
            .map(|(i, a)| (a.clone(), i as u16))
            .collect();
        let distinct_groups = groups
            .iter()
            .enumerate()
            .all(|(i, g)| !groups[..i].contains(g));
        if ids.len() != adapters.len() || !distinct_groups {
            return false;
        }
        self.groups = groups;
        self.adapters = adapters;
        self.adapter_ids = ids;
        true
    }

    /// Room for `n` more blocks of 8-byte hashes.
    pub(crate) fn reserve(&mut self, n: usize) {
        self.h8.reserve(n.min(self.max));
    }

    /// Calls `f` with every block's hash bytes, interned group and what is known of it.
    pub(crate) fn for_each(&self, mut f: impl FnMut(&[u8], u16, Tracked)) {
        for (id, t) in self.h8.iter() {
            f(&{ id.hash }, id.group, *t);
        }
        for (id, t) in self.h16.iter() {
            f(&{ id.hash }, id.group, *t);
        }
        for (id, t) in self.h32.iter() {
            f(&{ id.hash }, id.group, *t);
        }
        for (b, t) in &self.other {
            let (hash, group) = b.split_at(b.len() - 2);
            f(hash, u16::from_be_bytes([group[0], group[1]]), *t);
        }
    }

    /// Tracks a saved block. False when it refers to a group or adapter not interned, repeats
    /// a block, or the map is full.
    pub(crate) fn restore_one(&mut self, hash: &[u8], group: u16, block: Tracked) -> bool {
        if usize::from(group) >= self.groups.len()
            || usize::from(block.adapter()) >= self.adapters.len()
        {
            return false;
        }
        let hash = wire::BlockHash::Bytes(std::borrow::Cow::Borrowed(hash));
        let id = BlockId::new(&hash, group);
        self.get_mut(id).is_none() && self.insert(id, block) == Insert::New
    }

    /// Bytes the maps hold (tables and out-of-line digests), for telemetry and the bench.
    pub(crate) fn heap_bytes(&self) -> usize {
        // hashbrown keeps capacity at 7/8 of its buckets; one control byte a bucket.
        let other =
            self.other.capacity() * 8 / 7 * (std::mem::size_of::<(Box<[u8]>, Tracked)>() + 1);
        let digests: usize = self.other.keys().map(|b| b.len()).sum();
        self.h8.bytes() + self.h16.bytes() + self.h32.bytes() + other + digests
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_unpadded() {
        assert_eq!(std::mem::size_of::<(Fixed<8>, Tracked)>(), 25);
        assert_eq!(std::mem::size_of::<(Fixed<16>, Tracked)>(), 33);
        assert_eq!(std::mem::size_of::<(Fixed<32>, Tracked)>(), 49);
    }

    #[test]
    fn an_int_and_its_8_bytes_are_the_same_block() {
        let int = wire::BlockHash::Int(wire::Int::U64(0x0102_0304_0506_0708));
        let bin = wire::BlockHash::Bytes(vec![1, 2, 3, 4, 5, 6, 7, 8].into());
        let mut b = Blocks::new(10);
        let t = Tracked::new(true, None, 16, 0, T1);
        assert_eq!(b.insert(BlockId::new(&int, 0), t), Insert::New);
        assert_eq!(b.insert(BlockId::new(&bin, 0), t), Insert::Updated);
        assert_eq!(b.len(), 1);
        let long = wire::BlockHash::Bytes(vec![9; 32].into());
        assert_eq!(b.insert(BlockId::new(&long, 0), t), Insert::New);
        assert_eq!(b.get(BlockId::new(&long, 0)), Some(t));
        assert_eq!(b.get(BlockId::new(&long, 1)), None);
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn digests_crafted_to_one_hash_are_kept_aside_and_still_found() {
        // Two words folded into one: the second chosen to undo the first, so every digest
        // hashes alike (what a broken or hostile engine could send).
        let digest = |w0: u64| {
            let w1 = w0.rotate_left(29) ^ 0x5EED;
            let mut d = w0.to_le_bytes().to_vec();
            d.extend(w1.to_le_bytes());
            wire::BlockHash::Bytes(d.into())
        };
        let ids: Vec<_> = (1..=200u64).map(digest).collect();
        let mut b = Blocks::new(1_000);
        let t = Tracked::new(true, None, 16, 0, T1);
        assert_eq!(b.stashed(), 0);
        for id in &ids {
            assert_eq!(b.insert(BlockId::new(id, 0), t), Insert::New);
        }
        assert_eq!(b.len(), 200);
        // Two buckets of 15 hold the first ones; the rest wait aside, costing memory as they
        // come (a few times the entries' 33 bytes, not a table doubled for each collision).
        assert_eq!(b.stashed(), 200 - 30, "{}", b.stashed());
        assert!(b.heap_bytes() < 200 * 33 * 5, "{}", b.heap_bytes());
        for id in &ids {
            assert_eq!(b.get(BlockId::new(id, 0)), Some(t));
        }
        for id in &ids[..100] {
            assert!(b.change_or_remove(BlockId::new(id, 0), |_| true).is_some());
        }
        // (At most two buckets' worth in the buckets after the shrink's rebuild.)
        assert_eq!(b.len(), 100);
        assert!(b.stashed() >= 70, "{}", b.stashed());
        assert_eq!(b.get(BlockId::new(&ids[0], 0)), None);
        assert_eq!(b.get(BlockId::new(&ids[150], 0)), Some(t));
    }
}
