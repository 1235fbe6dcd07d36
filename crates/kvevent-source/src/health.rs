//! A rank's health: the one reading of whether what a source delivered can be vouched for,
//! made by its state machine (degraded, unverified) and its socket (connected), read by every
//! consumer through [`SourceMetrics::health`](crate::SourceMetrics::health).

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
        // What the metrics hold is read through it.
        let m = crate::SourceMetrics::default();
        assert_eq!(m.health(), Disconnected);
        m.set_connected(true);
        m.set_unverified(true);
        assert_eq!(m.health(), Unverified);
        m.set_degraded(true);
        assert_eq!((m.health(), m.unverified()), (Degraded, true));
        m.set_degraded(false);
        m.set_unverified(false);
        assert_eq!(m.health(), Trusted);
    }
}
