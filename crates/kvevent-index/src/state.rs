//! The fleet's state vocabulary, what every answer carries: [`ReplicaState`] (exact, degraded,
//! stale) and its reasons, [`Degraded`] and [`Lost`]; and beside it the replica's [`Load`].
//!
//! Invariant: [`ReplicaState::is_exact`] is the one trust signal; the index never makes a state
//! up, it carries what a replica's follower said ([`Index::set_replica_state`](crate::Index::set_replica_state)),
//! for as long as the follower's lease says its word holds.

/// Why a replica's known state may be incomplete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degraded {
    /// Not yet connected, or connecting again (its entries, if any, still count).
    Connecting,
    /// A snapshot is loading (the previous state, if any, still counts).
    SnapshotLoading,
    /// Its engine's events are replaying (or, after a feed resumed, the changes missed while
    /// away), or lost batches that could not be replayed.
    Replaying,
    /// Its sidecar is there, but the sidecar lost the engine (for less than `dead_after`).
    EngineLost,
    /// Its engine's connection was made again (or its follower just started), and the engine
    /// is not yet proven the same process, or a new one (then cleared): what is known may be
    /// another process's.
    Unverified,
    /// Its source's stream is open, but nothing came from it for two heartbeats: changes may
    /// be missing (a link cut without a word, or blackholed).
    Silent,
    /// Its source's messages arrive late: what they say was true more than the follower's
    /// `lag_after` ago (a congested link).
    Lagging,
    /// Its engine's HTTP server does not answer its health check (for less than
    /// `dead_after`): its cache may be known, but it serves nothing.
    ServerDown,
    /// Its replica is not ready to take requests (a pod that is not Ready, as discovery
    /// says): followed, but not routed to while another candidate can serve.
    NotReady,
    /// Its follower's word ran out: the follower has not renewed its lease in time
    /// ([`Index::renew_lease`](crate::Index::renew_lease)), as when the task or thread that
    /// follows it is starved or stopped. What it said last may be out of date.
    LeaseExpired,
}

impl Degraded {
    /// A short name for logs and answers.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::SnapshotLoading => "snapshot_loading",
            Self::Replaying => "replaying_or_gap",
            Self::EngineLost => "engine_lost",
            Self::Unverified => "unverified",
            Self::Silent => "silent",
            Self::Lagging => "lagging",
            Self::ServerDown => "server_down",
            Self::NotReady => "not_ready",
            Self::LeaseExpired => "lease_expired",
        }
    }
}

/// What was lost, for a [`ReplicaState::Stale`] replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// The replica's source itself: its sidecar's feed, or, followed directly, its engine.
    Source,
    /// The engine behind a sidecar that is still there.
    Engine,
    /// The engine's HTTP server: its cache may be known, but it serves nothing.
    Server,
}

impl Lost {
    /// `source`, `engine` or `server`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Source => "source",
            Self::Engine => "engine",
            Self::Server => "server",
        }
    }
}

/// How far a replica's entries can be trusted: the one trust signal of every answer. Whoever
/// follows the replica says ([`Index::set_replica_state`](crate::Index::set_replica_state)); a replica nobody said anything of
/// is `Exact`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaState {
    /// In sync with its source.
    Exact,
    /// Its source is there, but what is known may be incomplete.
    Degraded(Degraded),
    /// Lost since this instant (for at least the follower's `dead_after`): what is known may
    /// be wrong. Its entries count until the follower drops them.
    Stale {
        /// Since when.
        since: std::time::Instant,
        /// What was lost.
        lost: Lost,
    },
}

impl ReplicaState {
    /// In sync with its source: the only state to route on.
    #[inline]
    pub fn is_exact(self) -> bool {
        matches!(self, Self::Exact)
    }

    /// Its engine can take a request, as far as its follower knows: it is not stale, and not
    /// degraded by its engine lost, its server down or its replica not ready. A router passes
    /// over a replica that cannot serve while another can.
    #[inline]
    pub fn can_serve(self) -> bool {
        !matches!(
            self,
            Self::Stale { .. }
                | Self::Degraded(Degraded::EngineLost | Degraded::ServerDown | Degraded::NotReady)
        )
    }

    /// `exact`, `degraded` or `stale`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Degraded(_) => "degraded",
            Self::Stale { .. } => "stale",
        }
    }

    /// The reason, for a state other than `Exact`: a [`Degraded`] reason, or `source_lost`,
    /// `engine_lost` or `server_down`.
    pub fn reason(self) -> Option<&'static str> {
        match self {
            Self::Exact => None,
            Self::Degraded(d) => Some(d.as_str()),
            Self::Stale {
                lost: Lost::Source, ..
            } => Some("source_lost"),
            Self::Stale {
                lost: Lost::Engine, ..
            } => Some("engine_lost"),
            Self::Stale {
                lost: Lost::Server, ..
            } => Some("server_down"),
        }
    }
}

/// What a replica's engine was doing when it was last read (its `/metrics`, through its
/// sidecar or by a fleet following it directly): what a router weighs against what the replica
/// holds. Whoever follows the replica says
/// ([`Index::set_replica_load`](crate::Index::set_replica_load)); it is a reading with its
/// time, never refreshed by the index: a reader judges its age.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReading {
    /// The load, rank by rank, as the engine said it.
    pub load: kvevent_scrape::Load,
    /// When the engine was read, on the follower's clock.
    pub read_at: std::time::Instant,
    /// The reads after this one fail (the engine's `/metrics` slow, failing, or saying
    /// nonsense): it will only age.
    pub failing: bool,
}

impl LoadReading {
    /// Requests in the engine when it was read, running or waiting (every rank).
    pub fn queued(&self) -> u32 {
        self.load.queued()
    }

    /// How long ago it was read, at `now`.
    pub fn age(&self, now: std::time::Instant) -> std::time::Duration {
        now.saturating_duration_since(self.read_at)
    }
}
