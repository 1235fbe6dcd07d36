//! One replica's status as its follower keeps it, and the rule that makes its state.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvevent_index::{Degraded, Lost, ReplicaState, SourceId};

use crate::{Core, RankStatus, ReplicaStatus, lock};

/// What one replica's follower knows; [`Fleet::replicas`](crate::Fleet::replicas) reads it.
#[derive(Debug)]
pub(crate) struct Status {
    /// The sidecar's URL or the engine's endpoint.
    pub(crate) address: String,
    /// The source itself (the feed, or an engine socket) is lost, or not yet connected, since
    /// then; `None`: connected.
    pub(crate) source_lost: Option<Instant>,
    /// The engine behind a sidecar is lost since then, as the sidecar says.
    pub(crate) engine_lost: Option<Instant>,
    /// What is known may be incomplete, while the source is there: the follower's own view
    /// (a snapshot loading).
    pub(crate) degraded: Option<Degraded>,
    /// What the engine's ranks say, as their follower (the sidecar, or the engine thread)
    /// sees them: a rank unverified or degraded.
    pub(crate) engine_degraded: Option<Degraded>,
    /// Lost for `drop_after`: its entries no longer count.
    pub(crate) dropped: bool,
    /// The source's stream is open but nothing came for two heartbeats.
    pub(crate) silent: bool,
    /// Its source refused to be followed as asked (another replica or model, a credential):
    /// stale at once, not after `dead_after`, until a stream is followed.
    pub(crate) refused: bool,
    /// The replica left the fleet: its follower publishes nothing more.
    pub(crate) removed: bool,
    pub(crate) newest: Option<Instant>,
    pub(crate) block_size: u32,
    /// Engine batches received, or feed messages of changes applied.
    pub(crate) batches: u64,
    /// Blocks held as a feed says (an engine's are counted by its sources' mappers).
    pub(crate) blocks: u64,
    /// The index sources an engine's ranks are followed into (for their block counts).
    pub(crate) sources: Vec<SourceId>,
    pub(crate) error: Option<String>,
    /// Each rank, and when what the follower saw of it last changed (connected or lost).
    pub(crate) ranks: Vec<(RankStatus, Option<Instant>)>,
    /// The state last published to the index.
    published: Option<ReplicaState>,
}

pub(crate) type Shared = Arc<Mutex<Status>>;

impl Status {
    pub(crate) fn new(address: &str) -> Self {
        Self {
            address: address.to_owned(),
            source_lost: Some(Instant::now()),
            engine_lost: None,
            degraded: None,
            engine_degraded: None,
            dropped: false,
            silent: false,
            refused: false,
            removed: false,
            newest: None,
            block_size: 0,
            batches: 0,
            blocks: 0,
            sources: Vec::new(),
            error: None,
            ranks: Vec::new(),
            published: None,
        }
    }

    /// The state at `now`: the source lost, then the engine lost, then degraded, else exact.
    pub(crate) fn state(&self, dead_after: Duration, now: Instant) -> ReplicaState {
        let lost = |since: Instant, lost: Lost, degraded: Degraded| {
            if now.saturating_duration_since(since) >= dead_after {
                ReplicaState::Stale { since, lost }
            } else {
                ReplicaState::Degraded(degraded)
            }
        };
        match (self.source_lost, self.engine_lost) {
            (Some(since), _) if self.refused => ReplicaState::Stale {
                since,
                lost: Lost::Source,
            },
            (Some(since), _) => lost(since, Lost::Source, Degraded::Connecting),
            (None, Some(since)) => lost(since, Lost::Engine, Degraded::EngineLost),
            (None, None) => self
                .degraded
                .or(self.silent.then_some(Degraded::Silent))
                .or(self.engine_degraded)
                .map_or(ReplicaState::Exact, ReplicaState::Degraded),
        }
    }

    /// When the state changes next by time alone (`dead_after` reached), or its entries
    /// stop counting (`drop_after`), if ever.
    pub(crate) fn next_deadline(&self, core: &Core) -> Option<Instant> {
        let since = self.source_lost.or(self.engine_lost)?;
        let (dead, drop) = (
            since + core.config.dead_after,
            since + core.config.drop_after,
        );
        let now = Instant::now();
        [dead, drop].into_iter().find(|t| *t > now)
    }

    pub(crate) fn report(&self, name: &str, core: &Core, now: Instant) -> ReplicaStatus {
        let blocks = if self.sources.is_empty() {
            self.blocks
        } else {
            self.sources
                .iter()
                .map(|s| core.index.source_blocks(*s) as u64)
                .sum()
        };
        ReplicaStatus {
            name: name.to_owned(),
            source: self.address.clone(),
            state: self.state(core.config.dead_after, now),
            blocks,
            newest_change: self.newest.map(|t| now.saturating_duration_since(t)),
            block_size: (self.block_size > 0).then_some(self.block_size),
            batches: self.batches,
            error: self.error.clone(),
            ranks: self
                .ranks
                .iter()
                .map(|(r, changed)| RankStatus {
                    since: r
                        .since
                        .map(|s| s + changed.map_or(Duration::ZERO, |c| now - c))
                        .or_else(|| changed.map(|c| now - c)),
                    ..r.clone()
                })
                .collect(),
        }
    }

    /// Sets the error, logging it the first time it is seen (a follower that keeps failing
    /// the same way logs once, not on every retry).
    pub(crate) fn set_error(&mut self, name: &str, error: String) {
        if self.error.as_deref() != Some(error.as_str()) {
            tracing::warn!(replica = %name, source = %self.address, error = %error, "cannot follow this replica; trying again");
        }
        self.error = Some(error);
    }
}

/// Publishes `status`'s state to the index if it changed, telling [`Core::changes`]: every
/// answer from now on carries it. Logs a replica's loss and return.
pub(crate) fn publish(core: &Core, name: &str, status: &Mutex<Status>) {
    let mut s = lock(status);
    if s.removed {
        return;
    }
    let state = s.state(core.config.dead_after, Instant::now());
    if s.published == Some(state) {
        return;
    }
    match (s.published, state) {
        (_, ReplicaState::Stale { lost, .. }) => {
            tracing::warn!(replica = %name, source = %s.address, lost = lost.as_str(), "replica stale: its state may be wrong");
        }
        (Some(ReplicaState::Stale { .. }), _) => {
            tracing::info!(replica = %name, source = %s.address, state = state.as_str(), "replica back");
        }
        _ => {}
    }
    s.published = Some(state);
    // Under the status's lock, which the fleet takes to remove the replica: a follower being
    // stopped never brings its name back into the index.
    core.index.set_replica_state(name, state);
    drop(s);
    core.changed();
}
