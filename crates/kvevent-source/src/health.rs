//! A rank's health: the one reading of whether what a source delivered can be vouched for,
//! made by its state machine (connected, degraded, unverified) and shared with every consumer
//! through a [`Health`] handle ([`Subscriber::health`](crate::Subscriber::health),
//! [`SourceState::health`](crate::SourceState::health)).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A rank's health, worst first: a consumer calls a rank exact only while it is
/// [`RankHealth::Trusted`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankHealth {
    /// No connection to the engine's socket: what was delivered may be out of date.
    Disconnected,
    /// Something was lost that replay could not bring back (a gap or a truncation not yet
    /// healed by a clear).
    Degraded,
    /// Connected and whole so far, but not yet proven the same engine process (or a new one,
    /// cleared) since it connected or started.
    Unverified,
    /// Connected, proven the same process, whole.
    Trusted,
}

impl RankHealth {
    /// The health of a rank connected or not, degraded or not, unverified or not: the worst
    /// that holds.
    pub fn of(connected: bool, degraded: bool, unverified: bool) -> Self {
        if !connected {
            Self::Disconnected
        } else if degraded {
            Self::Degraded
        } else if unverified {
            Self::Unverified
        } else {
            Self::Trusted
        }
    }

    /// Connected, proven and whole.
    pub fn is_trusted(self) -> bool {
        self == Self::Trusted
    }

    /// Its socket has a connection to the engine.
    pub fn is_connected(self) -> bool {
        self != Self::Disconnected
    }

    /// A short name for logs and answers.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disconnected => "disconnected",
            Self::Degraded => "degraded",
            Self::Unverified => "unverified",
            Self::Trusted => "trusted",
        }
    }
}

/// A rank's health as its source state machine last said it, shared (`Arc`) with whoever
/// reads it: the sidecar's feed, `/readyz` and startup warnings, the fleet's engine thread.
/// Only the state machine writes it ([`SourceState`](crate::SourceState)); readers take
/// [`Health::get`].
#[derive(Debug, Default)]
pub struct Health {
    connected: AtomicBool,
    degraded: AtomicBool,
    unverified: AtomicBool,
    /// When the rank last became degraded or unverified, in milliseconds since the Unix
    /// epoch; 0 while it is neither.
    untrusted_since_ms: AtomicU64,
}

impl Health {
    /// The rank's health now: the worst that holds.
    pub fn get(&self) -> RankHealth {
        RankHealth::of(
            self.connected.load(Relaxed),
            self.degraded(),
            self.unverified(),
        )
    }

    /// Something was lost and not yet healed by a clear, connected or not (what a saved state
    /// and the `degraded` gauge record).
    pub fn degraded(&self) -> bool {
        self.degraded.load(Relaxed)
    }

    /// Not yet proven the same engine process (or a new one) since a disconnect or the start,
    /// connected or not.
    pub fn unverified(&self) -> bool {
        self.unverified.load(Relaxed)
    }

    /// How long the rank has been degraded or unverified, if it is.
    pub fn untrusted_for(&self) -> Option<Duration> {
        let since = self.untrusted_since_ms.load(Relaxed);
        (since != 0).then(|| Duration::from_millis(unix_ms().saturating_sub(since)))
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Relaxed);
    }

    pub(crate) fn set_degraded(&self, degraded: bool) {
        self.degraded.store(degraded, Relaxed);
        self.note_trust();
    }

    pub(crate) fn set_unverified(&self, unverified: bool) {
        self.unverified.store(unverified, Relaxed);
        self.note_trust();
    }

    fn note_trust(&self) {
        let untrusted = self.degraded() || self.unverified();
        let since = self.untrusted_since_ms.load(Relaxed);
        if untrusted && since == 0 {
            self.untrusted_since_ms.store(unix_ms().max(1), Relaxed);
        } else if !untrusted && since != 0 {
            self.untrusted_since_ms.store(0, Relaxed);
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::RankHealth::{self, *};

    #[test]
    fn the_worst_that_holds_is_the_health() {
        assert_eq!(RankHealth::of(false, true, true), Disconnected);
        assert_eq!(RankHealth::of(true, true, true), Degraded);
        assert_eq!(RankHealth::of(true, false, true), Unverified);
        assert_eq!(RankHealth::of(true, false, false), Trusted);
        assert!(Trusted.is_trusted() && !Unverified.is_trusted());
        assert!(Degraded.is_connected() && !Disconnected.is_connected());
        // What the handle holds is read through it.
        let h = super::Health::default();
        assert_eq!(h.get(), Disconnected);
        h.set_connected(true);
        h.set_unverified(true);
        assert_eq!(h.get(), Unverified);
        assert!(h.untrusted_for().is_some());
        h.set_degraded(true);
        assert_eq!((h.get(), h.unverified()), (Degraded, true));
        h.set_degraded(false);
        h.set_unverified(false);
        assert_eq!((h.get(), h.untrusted_for()), (Trusted, None));
    }
}
