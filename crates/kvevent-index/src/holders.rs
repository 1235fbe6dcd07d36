//! Who holds a key: the [`Holder`] word (source, epoch, tier) and an entry's [`Holders`], inline
//! or in a shared [`Lists`] list; the pair and sharing counts ([`Shares`]).
//!
//! Invariants: an entry's holders are sorted by source, one holder a source at most; a list
//! holds two holders or more (one is kept inline, none is no entry); a list stamped with the
//! current lapse count holds no lapsed holder.

use super::*;

/// (key, source) pairs and pairs of sources sharing a key, kept as holders change.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Shares {
    pub(crate) held: u64,
    pub(crate) shared: u64,
}

impl Shares {
    /// A key's holders went from `before` to `after`.
    pub(crate) fn changed(&mut self, before: usize, after: usize) {
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
pub(crate) struct Holder(pub(crate) u64);

impl Holder {
    pub(crate) const TIER_SHIFT: u32 = 2;
    pub(crate) const EPOCH_SHIFT: u32 = 3;
    pub(crate) const SOURCE_SHIFT: u32 = 35;
    /// The bits naming the source and its epoch.
    pub(crate) const ID: u64 = !((1 << Self::EPOCH_SHIFT) - 1);

    pub(crate) fn new(source: u32, epoch: u32, tier: u8) -> Self {
        debug_assert!(source < MAX_SOURCES && tier <= 1);
        Self(
            (u64::from(source) << Self::SOURCE_SHIFT)
                | (u64::from(epoch) << Self::EPOCH_SHIFT)
                | (u64::from(tier & 1) << Self::TIER_SHIFT),
        )
    }

    pub(crate) fn source(self) -> u32 {
        (self.0 >> Self::SOURCE_SHIFT) as u32
    }

    pub(crate) fn epoch(self) -> u32 {
        (self.0 >> Self::EPOCH_SHIFT) as u32
    }

    pub(crate) fn tier(self) -> u8 {
        ((self.0 >> Self::TIER_SHIFT) & 1) as u8
    }

    pub(crate) fn same_id(self, other: Self) -> bool {
        (self.0 ^ other.0) & Self::ID == 0
    }
}

/// The sources holding a key, sorted by source (one holder a source at most), in one word:
/// none, one inline (the [`Holder`] word, its kind in bits 0–1), or the number of a list in
/// [`Lists`] (two or more) and, in bits 2–31, the [`Inner::lapses`] count (its low 30 bits)
/// when the list was last rid of lapsed holders. Keeps a table slot at 24 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holders(pub(crate) u64);

pub(crate) const ONE: u64 = 1;
pub(crate) const LIST: u64 = 2;
/// Where a list's lapse stamp sits.
pub(crate) const STAMP: u64 = ((1 << 30) - 1) << 2;

/// The holder lists of keys held by two sources or more; a freed slot is reused. The slot
/// vector keeps the length of its peak (24 bytes a slot, not counted by the budget, which
/// counts the slots in use and their lists).
#[derive(Debug, Default)]
pub(crate) struct Lists {
    pub(crate) lists: Vec<Vec<Holder>>,
    pub(crate) free: Vec<u32>,
}

/// An entry's holders, borrowed for reading.
pub(crate) enum HolderView<'a> {
    One(Holder),
    Many(&'a [Holder]),
}

impl HolderView<'_> {
    pub(crate) fn as_slice(&self) -> &[Holder] {
        match self {
            Self::One(h) => std::slice::from_ref(h),
            Self::Many(v) => v,
        }
    }
}

impl Holders {
    pub(crate) const NONE: Self = Self(0);

    pub(crate) fn one(h: Holder) -> Self {
        Self(h.0 | ONE)
    }

    pub(crate) fn list(i: u32) -> Self {
        Self((u64::from(i) << 32) | LIST)
    }

    pub(crate) fn view(self, lists: &Lists) -> HolderView<'_> {
        match self.0 & 3 {
            ONE => HolderView::One(Holder(self.0 & !3)),
            LIST => HolderView::Many(&lists.lists[(self.0 >> 32) as usize]),
            _ => HolderView::Many(&[]),
        }
    }

    pub(crate) fn len(self, lists: &Lists) -> usize {
        self.view(lists).as_slice().len()
    }

    pub(crate) fn list_mut(self, lists: &mut Lists) -> Option<(u32, &mut Vec<Holder>)> {
        if self.0 & 3 == LIST {
            let i = (self.0 >> 32) as u32;
            Some((i, &mut lists.lists[i as usize]))
        } else {
            None
        }
    }

    /// A list stamped with `lapses` (one holder stays as it is).
    pub(crate) fn stamped(self, lapses: u32) -> Self {
        if self.0 & 3 == LIST {
            Self((self.0 & !STAMP) | ((u64::from(lapses) << 2) & STAMP))
        } else {
            self
        }
    }

    /// True for a list stamped with `lapses`: no holder of it lapsed since it was stamped.
    pub(crate) fn stamped_with(self, lapses: u32) -> bool {
        self.0 & 3 == LIST && self.0 & STAMP == (u64::from(lapses) << 2) & STAMP
    }

    /// Without `source`'s holder: a binary search in a list, not a scan (a key of a shared
    /// system prompt can have a holder on every replica of the fleet).
    pub(crate) fn remove(self, lists: &mut Lists, source: u32) -> Self {
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
    pub(crate) fn collapsed(self, lists: &mut Lists) -> Self {
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
    pub(crate) fn store(
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
    pub(crate) fn free(self, lists: &mut Lists) {
        if let Some((i, v)) = self.list_mut(lists) {
            *v = Vec::new();
            lists.free.push(i);
        }
    }

    /// The holders `keep` keeps.
    pub(crate) fn retain(self, lists: &mut Lists, keep: impl Fn(&Holder) -> bool) -> Self {
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
    pub(crate) fn upsert(self, lists: &mut Lists, holder: Holder) -> Self {
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

/// Heap bytes of an entry's holders: none for one (kept inline), else its list's slot and the
/// list's block (capacity doubling from 4, plus the allocator's header).
pub(crate) fn entry_bytes(holders: usize) -> usize {
    if holders <= 1 {
        0
    } else {
        std::mem::size_of::<Vec<Holder>>()
            + holders.next_power_of_two().max(4) * std::mem::size_of::<Holder>()
            + 16
    }
}
