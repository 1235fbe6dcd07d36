//! Sources, replicas and lapses: a source's epoch moves on at each reset, clear or removal
//! ([`Inner::lapse`]), so its older holders stop counting at once, in O(1); the incremental
//! [`Inner::sweep`] reclaims them a bounded number of slots a call.
//!
//! Invariants: a holder counts only while its source is live, counting and at the holder's
//! epoch; a handle of a removed source names nothing, even once its slot is reused; a replica's
//! number is given back once nothing keeps it (no live source, no state set); no write call
//! scans a whole table.

use super::*;

#[derive(Debug)]
pub(crate) struct Source {
    pub(crate) replica: u32,
    /// Moves on at each reset or clear and when the source is removed ([`Inner::lapse`]):
    /// holders of older epochs no longer count, and a slot reused never meets its previous
    /// source's holders. 1 to [`Holder::EPOCHS`] (14 bits of a holder word): at a wrap, a live
    /// source's older holders are dropped for real (one scan of the tables, once every 16,383
    /// resets of one source), and a removed source's slot is not used again (its holders go
    /// with the sweep).
    pub(crate) epoch: u32,
    /// Which use of the slot this is ([`SourceId`]).
    pub(crate) generation: u32,
    pub(crate) live: bool,
    /// False while a snapshot loads into it ([`Index::add_loading_source`]): it takes changes
    /// but counts in no answer until [`Index::promote`].
    pub(crate) counting: bool,
    /// The adapter its last change named and its number: the mapper hands the same `Arc` for
    /// a source's blocks of one adapter, so a pointer compare, not a string lookup, per change.
    pub(crate) adapter: Option<(Arc<str>, u32)>,
}

/// A replica's number's use. A number is given back, and its name forgotten, once the
/// replica has no live source and no state set ([`Index::set_replica_state`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ReplicaSlot {
    pub(crate) in_use: bool,
    /// Its live sources, loading ones included.
    pub(crate) sources: u32,
    /// A state was set ([`Index::set_replica_state`]): it keeps the replica known.
    pub(crate) state_set: bool,
}

/// Where the incremental sweep of lapsed holders is ([`Inner::sweep`]).
#[derive(Debug, Default)]
pub(crate) struct Sweep {
    /// A holder lapsed since the pass began (or one is under way): a pass is owed.
    pub(crate) owed: bool,
    /// The pass is in the old table (else the young one).
    pub(crate) in_old: bool,
    /// The next slot to visit.
    pub(crate) cursor: usize,
    /// [`Inner::lapses`] when the pass began: a lapse after it needs another pass.
    pub(crate) lapses_at_start: u32,
}

/// Slots of the key tables the incremental sweep visits on each call that changes the index,
/// while a pass is owed: a few microseconds at most under the write lock.
pub(crate) const SWEEP_PER_CALL: usize = 1024;

/// More slots visited for each change a call applies: the sweep keeps pace with the changes
/// that make garbage, so lapsed holders never outnumber the live ones by much.
pub(crate) const SWEEP_PER_CHANGE: usize = 8;

/// What scoring needs of a source slot, kept beside [`Source`] (8 bytes, not 40, and one
/// compare): the holder word, tier bit clear, that counts now (0, which no holder is, when
/// none does: removed or loading), and the replica. [`Inner::rescore`] keeps it in step.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Scoring {
    pub(crate) counts: u32,
    pub(crate) replica: u32,
}

/// Whether `h` counts: its source is followed and has not lapsed since `h` was stored.
#[inline]
pub(crate) fn counts(scoring: &[Scoring], h: Holder) -> bool {
    scoring
        .get(h.source() as usize)
        .is_some_and(|s| s.counts == h.0 & !1)
}

/// Whether `h` counts or will once its source's snapshot is promoted: what the sweep keeps.
pub(crate) fn counts_or_loading(sources: &[Source], h: &Holder) -> bool {
    sources
        .get(h.source() as usize)
        .is_some_and(|s| s.live && s.epoch == h.epoch())
}

impl Inner {
    /// The slot of `source` if it is still followed (a handle of a removed source names
    /// nothing, even once its slot is reused).
    pub(crate) fn live(&self, source: SourceId) -> Option<u32> {
        self.sources
            .get(source.slot as usize)
            .filter(|s| s.live && s.generation == source.generation)
            .map(|_| source.slot)
    }

    /// `slot`'s [`Scoring`] after its source changed (added, promoted, removed, lapsed).
    pub(crate) fn rescore(&mut self, slot: u32) {
        let Some(s) = self.sources.get(slot as usize) else {
            return;
        };
        let scoring = Scoring {
            counts: if s.live && s.counting {
                Holder::new(slot, s.epoch, 0).0
            } else {
                0
            },
            replica: s.replica,
        };
        if self.scoring.len() <= slot as usize {
            self.scoring.resize(slot as usize + 1, Scoring::default());
        }
        self.scoring[slot as usize] = scoring;
    }

    /// The number of `name`, given one (a free one first) if it has none.
    pub(crate) fn replica(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.replica_ids.get(name) {
            return id;
        }
        let name: Arc<str> = Arc::from(name);
        let id = match self.free_replicas.pop() {
            Some(id) => {
                Arc::make_mut(&mut self.replicas)[id as usize] = name.clone();
                Arc::make_mut(&mut self.states)[id as usize] = ReplicaState::Exact;
                Arc::make_mut(&mut self.loads)[id as usize] = None;
                self.leases.set(id, None);
                id
            }
            None => {
                Arc::make_mut(&mut self.replicas).push(name.clone());
                Arc::make_mut(&mut self.states).push(ReplicaState::Exact);
                Arc::make_mut(&mut self.loads).push(None);
                self.replica_slots.push(ReplicaSlot::default());
                if self.leases.len() < self.replicas.len() {
                    self.leases = Arc::new(self.leases.grown(2 * self.replicas.len()));
                }
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
    pub(crate) fn release_replica(&mut self, id: u32) {
        let r = &self.replica_slots[id as usize];
        if !r.in_use || r.sources > 0 || r.state_set {
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
    /// holders are reclaimed by the sweep, its mapper's memory goes, and its slot is free,
    /// unless its epoch wrapped: then holders of its new epoch may still be in the tables, so
    /// the slot is never used again (one slot every 16,383 uses, not a scan of the tables).
    pub(crate) fn retire(
        &mut self,
        source: SourceId,
        mappers: &mut [Mapper],
        blank: impl Fn() -> Mapper,
    ) {
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
        // Epoch 1 after a lapse: it wrapped.
        if self.sources[slot as usize].epoch != 1 {
            self.free_sources.push(slot);
        }
        self.release_replica(replica);
    }

    /// Everything `source` held stops counting: its epoch moves on, so its older holders are
    /// invalid ([`counts`]); the sweep reclaims them, and a store that meets one drops it.
    /// Should the epoch of a live source wrap, they are dropped now, so that none can count
    /// again (a removed source's slot is not used again instead: see [`Inner::retire`]).
    pub(crate) fn lapse(&mut self, source: u32) {
        let Some(s) = self.sources.get_mut(source as usize) else {
            return;
        };
        let wrapped = s.epoch == Holder::EPOCHS;
        s.epoch = if wrapped { 1 } else { s.epoch + 1 };
        let live = s.live;
        self.rescore(source);
        self.lapses = self.lapses.wrapping_add(1);
        if !self.sweep.owed {
            self.sweep = Sweep {
                owed: true,
                in_old: false,
                cursor: 0,
                lapses_at_start: self.lapses,
            };
        }
        if wrapped && live {
            self.drop_holders(|h| h.source() == source);
        }
    }

    /// Visits up to `slots` slots of the key tables while a pass is owed, dropping lapsed
    /// holders and the keys left with none. A pass goes over the young table, then the old;
    /// another follows when a holder lapsed during it. Bounded work per call: removing a
    /// replica never scans the table under the write lock, and what it held goes within a
    /// pass.
    pub(crate) fn sweep(&mut self, mut slots: usize) {
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

    pub(crate) fn drop_holders(&mut self, gone: impl Fn(&Holder) -> bool) {
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
}
