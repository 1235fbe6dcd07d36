//! How long a follower's word on a replica holds ([`Index::renew_lease`](crate::Index::renew_lease)):
//! a follower that renews its lease whenever it hears from the replica (and, at most, twice a
//! heartbeat) makes every answer read past the lease say [`Degraded::LeaseExpired`] instead of
//! `Exact`, so that a follower that stopped running (a starved runtime, a stopped thread)
//! cannot leave `exact` answers behind it.
//!
//! Invariants: renewing takes no write lock (an atomic store per replica); a replica without a
//! lease (never renewed, or cleared) is as its follower said; an answer judges every lease at
//! the instant it is made, once.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Each replica's lease, by number: nanoseconds after `origin` it holds until (not at), plus one
/// (0: none). Grown by a new table (answers keep theirs).
#[derive(Debug)]
pub(crate) struct Leases {
    origin: Instant,
    until: Box<[AtomicU64]>,
}

impl Default for Leases {
    fn default() -> Self {
        Self::new(Instant::now(), 0)
    }
}

impl Leases {
    pub(crate) fn new(origin: Instant, len: usize) -> Self {
        Self {
            origin,
            until: (0..len).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.until.len()
    }

    /// A table of `len` with these leases.
    pub(crate) fn grown(&self, len: usize) -> Self {
        let grown = Self::new(self.origin, len.max(self.len()));
        for (to, from) in grown.until.iter().zip(self.until.iter()) {
            to.store(from.load(Relaxed), Relaxed);
        }
        grown
    }

    pub(crate) fn set(&self, replica: u32, until: Option<Instant>) {
        let v = until.map_or(0, |t| self.nanos(t) + 1);
        if let Some(slot) = self.until.get(replica as usize) {
            slot.store(v, Relaxed);
        }
    }

    /// Now, as the leases count.
    pub(crate) fn now(&self) -> u64 {
        self.nanos(Instant::now()) + 1
    }

    /// True when `replica`'s lease ran out by `now`.
    pub(crate) fn expired(&self, replica: u32, now: u64) -> bool {
        let until = self
            .until
            .get(replica as usize)
            .map_or(0, |u| u.load(Relaxed));
        until != 0 && now >= until
    }

    fn nanos(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.origin).as_nanos() as u64
    }
}
