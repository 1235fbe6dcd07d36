//! Who holds a key: the [`Holder`] word (source, epoch, tier) and an entry's [`Holders`], up to
//! three inline in the key's slot or more in a list of [`Lists`]; the pair and sharing counts
//! ([`Shares`]).
//!
//! Invariants: an entry's holders are sorted by source, one holder a source at most; a list
//! holds four holders or more (up to three are kept inline, none is no entry); a holder word is
//! never 0 (an unused inline word) nor [`LIST`]; a list stamped with the current lapse count
//! holds no lapsed holder.

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

/// A source holding a key, in 32 bits: the source in bits 15–31, its epoch (1 to
/// [`Holder::EPOCHS`], never 0) in bits 1–14, the tier in bit 0. Words sort by source; two
/// holders of the same source and epoch compare by tier, so the larger is the worse tier;
/// scoring compares and merges whole words (eight at a time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
#[repr(transparent)]
pub(crate) struct Holder(pub(crate) u32);

impl Holder {
    const EPOCH_SHIFT: u32 = 1;
    const SOURCE_SHIFT: u32 = 15;
    /// Epochs run from 1 to this, then wrap to 1 ([`Inner::lapse`]).
    pub(crate) const EPOCHS: u32 = (1 << 14) - 1;
    /// The bits naming the source and its epoch.
    const ID: u32 = !1;

    pub(crate) fn new(source: u32, epoch: u32, tier: u8) -> Self {
        debug_assert!(source < MAX_SOURCES && (1..=Self::EPOCHS).contains(&epoch) && tier <= 1);
        Self((source << Self::SOURCE_SHIFT) | (epoch << Self::EPOCH_SHIFT) | u32::from(tier & 1))
    }

    pub(crate) fn source(self) -> u32 {
        self.0 >> Self::SOURCE_SHIFT
    }

    pub(crate) fn epoch(self) -> u32 {
        (self.0 >> Self::EPOCH_SHIFT) & Self::EPOCHS
    }

    pub(crate) fn tier(self) -> u8 {
        (self.0 & 1) as u8
    }

    pub(crate) fn same_id(self, other: Self) -> bool {
        (self.0 ^ other.0) & Self::ID == 0
    }
}

/// The first word of an entry whose holders are in a list: no holder has it (its source,
/// 2^17 − 1, is [`MAX_SOURCES`], one past the last).
pub(crate) const LIST: Holder = Holder(u32::MAX);

/// The sources holding a key, sorted by source (one holder a source at most), in 12 bytes: up
/// to three holders inline, the words after the last 0; or [`LIST`], the number of a list in
/// [`Lists`] (four holders or more) and the [`Inner::lapses`] count when the list was last rid
/// of lapsed holders. Keeps a table slot at 24 bytes with its key and token count: in a fleet
/// most keys have one to three holders, and they cost no allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Holders([Holder; 3]);

/// The holder lists of keys held by four sources or more; a freed slot is reused. The slot
/// vector keeps the length of its peak (24 bytes a slot, not counted by the budget, which
/// counts the slots in use and their lists).
#[derive(Debug, Default)]
pub(crate) struct Lists {
    pub(crate) lists: Vec<Vec<Holder>>,
    pub(crate) free: Vec<u32>,
}

impl Holders {
    pub(crate) const NONE: Self = Self([Holder(0); 3]);

    /// Up to three holders, inline.
    fn inline(holders: &[Holder]) -> Self {
        debug_assert!(holders.len() <= 3);
        let mut words = [Holder(0); 3];
        words[..holders.len()].copy_from_slice(holders);
        Self(words)
    }

    /// The number of its list, if its holders are in one.
    fn list(&self) -> Option<usize> {
        (self.0[0] == LIST).then_some(self.0[1].0 as usize)
    }

    /// The holders, sorted by source.
    pub(crate) fn view<'a>(&'a self, lists: &'a Lists) -> &'a [Holder] {
        match self.list() {
            Some(i) => &lists.lists[i],
            None => {
                let n = self.0.iter().take_while(|h| h.0 != 0).count();
                &self.0[..n]
            }
        }
    }

    pub(crate) fn len(&self, lists: &Lists) -> usize {
        self.view(lists).len()
    }

    /// A list stamped with `lapses` (inline holders stay as they are: checking three costs less
    /// than a stamp).
    pub(crate) fn stamped(mut self, lapses: u32) -> Self {
        if self.list().is_some() {
            self.0[2] = Holder(lapses);
        }
        self
    }

    /// True for a list stamped with `lapses`: no holder of it lapsed since it was stamped.
    pub(crate) fn stamped_with(&self, lapses: u32) -> bool {
        self.list().is_some() && self.0[2].0 == lapses
    }

    /// Without `source`'s holder: a binary search in a list, not a scan (a key of a shared
    /// system prompt can have a holder on every replica of the fleet).
    pub(crate) fn remove(self, lists: &mut Lists, source: u32) -> Self {
        let found = |v: &[Holder]| v.binary_search_by_key(&source, |h| h.source());
        match self.list() {
            Some(i) => {
                let v = &mut lists.lists[i];
                if let Ok(at) = found(v) {
                    v.remove(at);
                }
                self.collapsed(lists)
            }
            None => {
                let v = self.view(lists);
                match found(v) {
                    Ok(at) => {
                        let mut kept = [Holder(0); 3];
                        kept[..at].copy_from_slice(&v[..at]);
                        kept[at..v.len() - 1].copy_from_slice(&v[at + 1..]);
                        Self(kept)
                    }
                    Err(_) => self,
                }
            }
        }
    }

    /// A list that lost holders: inline when three or fewer are left (its list given back).
    fn collapsed(self, lists: &mut Lists) -> Self {
        match self.list() {
            Some(i) if lists.lists[i].len() <= 3 => {
                let inline = Self::inline(&lists.lists[i]);
                self.free(lists);
                inline
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
            return Self::inline(&[holder]);
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
        if let Some(i) = self.list() {
            lists.lists[i] = Vec::new();
            lists.free.push(i as u32);
        }
    }

    /// The holders `keep` keeps.
    pub(crate) fn retain(self, lists: &mut Lists, keep: impl Fn(&Holder) -> bool) -> Self {
        match self.list() {
            Some(i) => {
                lists.lists[i].retain(|h| keep(h));
                self.collapsed(lists)
            }
            None => {
                let mut kept = [Holder(0); 3];
                for (n, h) in self.view(lists).iter().filter(|h| keep(h)).enumerate() {
                    kept[n] = *h;
                }
                Self(kept)
            }
        }
    }

    /// Adds `holder`, replacing the same source's.
    pub(crate) fn upsert(self, lists: &mut Lists, holder: Holder) -> Self {
        if let Some(i) = self.list() {
            let v = &mut lists.lists[i];
            match v.binary_search_by_key(&holder.source(), |h| h.source()) {
                Ok(at) => v[at] = holder,
                Err(at) => v.insert(at, holder),
            }
            return self;
        }
        let v = self.view(lists);
        let at = match v.binary_search_by_key(&holder.source(), |h| h.source()) {
            Ok(at) => {
                let mut words = self;
                words.0[at] = holder;
                return words;
            }
            Err(at) => at,
        };
        if v.len() < 3 {
            let mut words = [Holder(0); 3];
            words[..at].copy_from_slice(&v[..at]);
            words[at] = holder;
            words[at + 1..=v.len()].copy_from_slice(&v[at..]);
            return Self(words);
        }
        // A fourth holder: the four go to a list.
        let mut list = Vec::with_capacity(4);
        list.extend_from_slice(&v[..at]);
        list.push(holder);
        list.extend_from_slice(&v[at..]);
        let i = match lists.free.pop() {
            Some(i) => {
                lists.lists[i as usize] = list;
                i
            }
            None => {
                lists.lists.push(list);
                (lists.lists.len() - 1) as u32
            }
        };
        Self([LIST, Holder(i), Holder(0)])
    }
}

/// Heap bytes of an entry's holders: none for three or fewer (kept inline), else its list's
/// slot and the list's block (capacity doubling from 4, plus the allocator's header).
pub(crate) fn entry_bytes(holders: usize) -> usize {
    if holders <= 3 {
        0
    } else {
        std::mem::size_of::<Vec<Holder>>()
            + holders.next_power_of_two() * std::mem::size_of::<Holder>()
            + 16
    }
}
