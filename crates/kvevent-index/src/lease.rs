//! How long a follower's word on a replica holds ([`Index::renew_lease`](crate::Index::renew_lease)):
//! a follower that renews its lease whenever it hears from the replica (and, at most, twice a
//! heartbeat) makes every answer read past the lease say [`Degraded::LeaseExpired`] instead of
//! `Exact`, so that a follower that stopped running (a starved runtime, a stopped thread)
//! cannot leave `exact` answers behind it.
//!
//! Invariants: renewing takes no write lock (an atomic store per replica); a replica without a
//! lease (never renewed, or cleared) is as its follower said; an answer judges every lease at
//! the instant it is made, once. A floor below every lease held lets an answer made before it
//! judge them all with one load (every lease is looked at only past the floor: it was 0.2 µs
//! of a 2 µs score at 256 replicas); a renewal lowers the floor, a look at every lease raises
//! it only when no renewal came meanwhile.

use std::sync::atomic::{
    AtomicU64,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};
use std::time::Instant;

/// Each replica's lease, by number: nanoseconds after `origin` it holds until (not at), plus one
/// (0: none). Grown by a new table (answers keep theirs).
#[derive(Debug)]
pub(crate) struct Leases {
    origin: Instant,
    until: Box<[AtomicU64]>,
    /// No lease held runs out before this many milliseconds after `origin` ([`NONE`]: none
    /// held), packed with a count of [`Leases::set`]s: `ms << 16 | sets`. A set lowers it; a
    /// look at every lease raises it only when the count did not move meanwhile.
    floor: AtomicU64,
}

/// The floor's milliseconds with no lease held.
const NONE: u64 = (1 << 48) - 1;

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
            floor: AtomicU64::new(NONE << 16),
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
        grown.floor.store(self.floor.load(Acquire), Release);
        grown
    }

    pub(crate) fn set(&self, replica: u32, until: Option<Instant>) {
        let v = until.map_or(0, |t| self.nanos(t) + 1);
        let Some(slot) = self.until.get(replica as usize) else {
            return;
        };
        slot.store(v, Release);
        let ms = if v == 0 { NONE } else { (v - 1) / 1_000_000 };
        let _ = self.floor.fetch_update(AcqRel, Acquire, |f| {
            Some(((f >> 16).min(ms) << 16) | ((f + 1) & 0xFFFF))
        });
    }

    /// Those of `replicas` whose lease ran out by now: mostly none, known from the floor.
    pub(crate) fn expired_among(&self, replicas: impl Iterator<Item = u32>) -> Vec<u32> {
        let now = self.now();
        let floor = self.floor.load(Acquire);
        if (now - 1) / 1_000_000 < floor >> 16 {
            return Vec::new();
        }
        // Past the floor: every lease is looked at, and the floor raised to the earliest held
        // unless a lease was set meanwhile (its count moved).
        let earliest = (self.until.iter())
            .map(|u| u.load(Acquire))
            .filter(|&u| u != 0)
            .min()
            .map_or(NONE, |u| (u - 1) / 1_000_000);
        let raised = (earliest << 16) | ((floor + 1) & 0xFFFF);
        let _ = self.floor.compare_exchange(floor, raised, AcqRel, Relaxed);
        replicas.filter(|&r| self.expired(r, now)).collect()
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
            .map_or(0, |u| u.load(Acquire));
        until != 0 && now >= until
    }

    fn nanos(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.origin).as_nanos() as u64
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::Leases;

    /// The floor never hides a lease that ran out: one set later, one lowered, one cleared,
    /// the table grown, each answer judged against every lease.
    #[test]
    fn the_floor_never_hides_a_lease_that_ran_out() {
        let origin = Instant::now();
        let leases = Leases::new(origin, 4);
        let all = || leases.expired_among(0..4);
        assert!(all().is_empty(), "none held");
        let later = Instant::now() + Duration::from_secs(60);
        leases.set(0, Some(later));
        leases.set(1, Some(later));
        assert!(all().is_empty());
        // Lowered below the floor: seen at once.
        leases.set(1, Some(Instant::now()));
        assert_eq!(all(), [1]);
        assert_eq!(all(), [1], "past the floor, looked at again");
        leases.set(1, None);
        assert!(all().is_empty(), "cleared");
        let grown = leases.grown(8);
        grown.set(6, Some(Instant::now()));
        assert_eq!(grown.expired_among(0..8), [6]);
        grown.set(6, Some(later));
        assert!(grown.expired_among(0..8).is_empty());
        // A lease that runs out while the floor stands is seen once its time comes.
        let soon = Instant::now() + Duration::from_millis(30);
        grown.set(2, Some(soon));
        assert!(grown.expired_among(0..8).is_empty());
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(grown.expired_among(0..8), [2]);
    }
}
