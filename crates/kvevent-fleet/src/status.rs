//! One replica's status as its follower keeps it: a state machine. Its follower (a feed task,
//! or the engine thread) says what happened as an [`Event`]; [`Status::on`] is the one place
//! that changes it, [`Status::state`] the one rule that makes a [`ReplicaState`] of it, and
//! [`Status::expire`] the one place `drop_after` is reached.
//!
//! Invariants: a replica is exact only while its source is there, is neither silent nor
//! lagging, has no
//! snapshot loading, and its engine's ranks are all connected, verified and whole; a refusal
//! is stale at once; `drop_after` is reached once per loss.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvevent_feed::RankState;
use kvevent_index::{Degraded, LoadReading, Lost, ReplicaState, SourceId};

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
    /// The engine's HTTP server fails its health check, since then, and why.
    pub(crate) server_down: Option<(Instant, String)>,
    /// Lost for `drop_after`: its entries no longer count.
    pub(crate) dropped: bool,
    /// The source's stream is open but nothing came for two heartbeats.
    pub(crate) silent: bool,
    /// The source's messages arrive more than `lag_after` later than the fastest did.
    pub(crate) lagging: bool,
    /// Its source refused to be followed as asked (another replica or model, a credential):
    /// stale at once, not after `dead_after`, until a stream is followed.
    pub(crate) refused: bool,
    /// The replica left the fleet: its follower publishes nothing more.
    pub(crate) removed: bool,
    /// Its replica is not ready to take requests (discovery says: a pod not Ready).
    pub(crate) not_ready: bool,
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
    /// The engine's load as its sidecar last read it, and why reads since fail.
    pub(crate) load: Option<LoadReading>,
    pub(crate) load_error: Option<String>,
    /// The state last published to the index.
    published: Option<ReplicaState>,
}

pub(crate) type Shared = Arc<Mutex<Status>>;

/// What happened to a replica's source, as its follower saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Event {
    /// The source answered: a feed's hello (a snapshot follows unless `resumed`), or every
    /// rank's socket of an engine followed directly.
    Connected {
        /// A snapshot does not follow: what counts goes on.
        resumed: bool,
    },
    /// Resumed behind the source: the changes missed while away follow (true), or they are
    /// in (false). Meanwhile what counts is the state from before: `Replaying`, not exact.
    CatchingUp(bool),
    /// A snapshot began loading beside what counts.
    SnapshotStarted,
    /// A whole snapshot of `blocks` was promoted.
    SnapshotWhole {
        /// Blocks it holds.
        blocks: u64,
    },
    /// Changes were applied: `blocks` held now.
    Changed {
        /// Blocks held.
        blocks: u64,
    },
    /// What the engine's ranks say: lost since (any rank), and not yet proven the same
    /// process (unverified) or incomplete (degraded). Continuity proven, or a restart cleared
    /// and rebuilt, is this event with no view.
    Engine {
        /// The longest-lost rank's loss, if any.
        lost_since: Option<Instant>,
        /// `Unverified` or `Replaying`, if any rank is.
        view: Option<Degraded>,
        /// Each rank as last seen.
        ranks: Vec<(RankStatus, Option<Instant>)>,
    },
    /// The engine's HTTP server fails its health check (since when, and why), or answers.
    Server(Option<(Instant, String)>),
    /// The stream is open but nothing came for two heartbeats (true), or something came
    /// again (false).
    Silent(bool),
    /// The source's messages arrive more than `lag_after` later than the fastest did on this
    /// stream (true), or in time again (false).
    Lagging(bool),
    /// The source was lost (since `since`), with what was seen, if anything.
    Lost {
        /// When.
        since: Instant,
        /// Why, in our words.
        error: Option<String>,
    },
    /// The source refuses to be followed as asked: stale at once.
    Refused {
        /// The refusal, in our words.
        error: String,
    },
    /// The replica left the fleet: nothing more is published of it.
    Removed,
    /// Its replica is ready to take requests (true), or not (a pod not Ready).
    Ready(bool),
}

impl Status {
    pub(crate) fn new(address: &str) -> Self {
        Self {
            address: address.to_owned(),
            source_lost: Some(Instant::now()),
            engine_lost: None,
            degraded: None,
            engine_degraded: None,
            server_down: None,
            dropped: false,
            silent: false,
            lagging: false,
            refused: false,
            removed: false,
            not_ready: false,
            newest: None,
            block_size: 0,
            batches: 0,
            blocks: 0,
            sources: Vec::new(),
            error: None,
            ranks: Vec::new(),
            load: None,
            load_error: None,
            published: None,
        }
    }

    /// The one place a replica's status changes. `name` is for the log lines.
    pub(crate) fn on(&mut self, name: &str, event: Event, now: Instant) {
        match event {
            Event::Connected { resumed } => {
                self.source_lost = None;
                self.dropped = false;
                self.refused = false;
                self.silent = false;
                self.lagging = false;
                self.error = None;
                self.degraded = (!resumed).then_some(Degraded::SnapshotLoading);
            }
            Event::CatchingUp(true) => {
                self.degraded = self.degraded.or(Some(Degraded::Replaying));
            }
            Event::CatchingUp(false) => {
                if self.degraded == Some(Degraded::Replaying) {
                    self.degraded = None;
                }
            }
            Event::SnapshotStarted => self.degraded = Some(Degraded::SnapshotLoading),
            Event::SnapshotWhole { blocks } => {
                self.blocks = blocks;
                self.degraded = None;
                self.newest = Some(now);
            }
            Event::Changed { blocks } => {
                self.blocks = blocks;
                self.newest = Some(now);
                self.batches += 1;
            }
            Event::Engine {
                lost_since,
                view,
                ranks,
            } => {
                // The engine stays lost since it was first seen lost, until every rank is back.
                self.engine_lost = lost_since.map(|since| self.engine_lost.unwrap_or(since));
                self.engine_degraded = view;
                self.ranks = ranks;
            }
            Event::Server(down) => {
                // Down since it was first seen down, until it answers.
                self.server_down = down.map(|(since, why)| {
                    (self.server_down.as_ref().map_or(since, |(t, _)| *t), why)
                });
            }
            Event::Silent(silent) => self.silent = silent,
            Event::Lagging(lagging) => self.lagging = lagging,
            Event::Lost { since, error } => {
                self.source_lost.get_or_insert(since);
                self.silent = false;
                self.lagging = false;
                if let Some(error) = error {
                    self.set_error(name, error);
                }
            }
            Event::Refused { error } => {
                self.source_lost.get_or_insert(now);
                self.silent = false;
                self.lagging = false;
                self.refused = true;
                self.set_error(name, error);
            }
            Event::Removed => self.removed = true,
            Event::Ready(ready) => self.not_ready = !ready,
        }
    }

    /// `drop_after` reached: true once per loss (the follower then drops what the replica
    /// held, and it stops counting until its source is back).
    pub(crate) fn expire(&mut self, drop_after: Duration, now: Instant) -> bool {
        let expired = !self.dropped
            && self
                .source_lost
                .is_some_and(|t| now.saturating_duration_since(t) >= drop_after);
        if expired {
            self.dropped = true;
            self.blocks = 0;
        }
        expired
    }

    /// The state at `now`: stale, then not ready, then the source lost, then the engine lost,
    /// then degraded, else exact.
    pub(crate) fn state(&self, dead_after: Duration, now: Instant) -> ReplicaState {
        match self.followed_state(dead_after, now) {
            ReplicaState::Exact | ReplicaState::Degraded(_) if self.not_ready => {
                ReplicaState::Degraded(Degraded::NotReady)
            }
            s => s,
        }
    }

    /// The state as its source makes it.
    fn followed_state(&self, dead_after: Duration, now: Instant) -> ReplicaState {
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
            (None, None) if let Some((since, _)) = &self.server_down => {
                lost(*since, Lost::Server, Degraded::ServerDown)
            }
            (None, None) => self
                .degraded
                .or(self.silent.then_some(Degraded::Silent))
                .or(self.lagging.then_some(Degraded::Lagging))
                .or(self.engine_degraded)
                .map_or(ReplicaState::Exact, ReplicaState::Degraded),
        }
    }

    /// When the state changes next by time alone (`dead_after` reached), or its entries
    /// stop counting (`drop_after`), if ever.
    pub(crate) fn next_deadline(&self, core: &Core) -> Option<Instant> {
        let since = self
            .source_lost
            .or(self.engine_lost)
            .or(self.server_down.as_ref().map(|(t, _)| *t))?;
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
            state: match self.state(core.config.dead_after, now) {
                // Its follower's word ran out (the follower is not running to say more).
                s if s.is_exact() && core.index.lease_expired(name) => {
                    ReplicaState::Degraded(Degraded::LeaseExpired)
                }
                s => s,
            },
            blocks,
            newest_change: self.newest.map(|t| now.saturating_duration_since(t)),
            block_size: (self.block_size > 0).then_some(self.block_size),
            batches: self.batches,
            error: self
                .error
                .clone()
                .or_else(|| self.server_down.as_ref().map(|(_, why)| why.clone())),
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
            load: self.load.clone(),
            load_error: self.load_error.clone(),
        }
    }

    /// The engine's load, as its sidecar (or the fleet) read it (`None`: none is read), and why
    /// reads since fail: published to the index when it changed or was read again since (not
    /// for each heartbeat's new age); a new reason is logged.
    pub(crate) fn set_load(
        &mut self,
        core: &Core,
        name: &str,
        load: Option<LoadReading>,
        error: Option<String>,
    ) {
        // Said when the reason changes, not on every failing read.
        if error != self.load_error && !self.removed {
            match &error {
                Some(why) => {
                    tracing::warn!(replica = %name, source = %self.address, error = %why, "the replica's load cannot be read: its last load ages and is not routed on once old")
                }
                None => {
                    tracing::info!(replica = %name, source = %self.address, "the replica's load is read again")
                }
            }
        }
        self.load_error = error;
        let same = match (&self.load, &load) {
            (None, None) => true,
            (Some(a), Some(b)) => {
                (&a.load, a.failing) == (&b.load, b.failing)
                    && b.read_at.saturating_duration_since(a.read_at) < Duration::from_millis(100)
                    && a.read_at.saturating_duration_since(b.read_at) < Duration::from_millis(100)
            }
            _ => false,
        };
        if same {
            return;
        }
        self.load = load.clone();
        // Under the status's lock, as the state: a removed replica is not brought back.
        if !self.removed {
            core.index.set_replica_load(name, load);
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

/// One rank as answers show it, from its health as its source state machine says it.
pub(crate) fn rank_status(rank: u32, health: RankState, since: Option<Duration>) -> RankStatus {
    RankStatus {
        rank,
        connected: health != RankState::Disconnected,
        since,
        degraded: matches!(health, RankState::Degraded | RankState::Unverified),
    }
}

/// What an engine's ranks' health says of the replica, the one fold of it: not yet proven the
/// same process (any rank), else incomplete (any rank), else nothing. A rank without a
/// connection adds nothing here: the replica is lost while it is ([`Event::Engine`]).
pub(crate) fn rank_view(ranks: impl Iterator<Item = RankState>) -> Option<Degraded> {
    let (mut degraded, mut unverified) = (false, false);
    for health in ranks {
        degraded |= health == RankState::Degraded;
        unverified |= health == RankState::Unverified;
    }
    if unverified {
        Some(Degraded::Unverified)
    } else if degraded {
        Some(Degraded::Replaying)
    } else {
        None
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

#[cfg(test)]
mod tests {
    //! The state machine, transition by transition: each event from each state it can meet,
    //! and the state that follows, at once and after `dead_after`.

    use super::*;

    const DEAD: Duration = Duration::from_secs(3);

    fn state_after(events: &[Event], at: Duration) -> ReplicaState {
        let t0 = Instant::now();
        let mut s = Status::new("http://sidecar:7070");
        s.source_lost = Some(t0);
        for e in events {
            s.on("r", e.clone(), t0);
        }
        s.state(DEAD, t0 + at)
    }

    fn lost(t: Instant) -> Event {
        Event::Lost {
            since: t,
            error: Some("the stream ended".into()),
        }
    }

    fn engine(lost_since: Option<Instant>, view: Option<Degraded>) -> Event {
        Event::Engine {
            lost_since,
            view,
            ranks: Vec::new(),
        }
    }

    const CONNECTED: Event = Event::Connected { resumed: false };
    const RESUMED: Event = Event::Connected { resumed: true };
    const WHOLE: Event = Event::SnapshotWhole { blocks: 3 };

    fn is_stale(s: ReplicaState, want: Lost) -> bool {
        matches!(s, ReplicaState::Stale { lost, .. } if lost == want)
    }

    #[test]
    fn a_new_replica_connects_loads_its_snapshot_and_is_exact_only_then() {
        let zero = Duration::ZERO;
        assert_eq!(
            state_after(&[], zero),
            ReplicaState::Degraded(Degraded::Connecting)
        );
        assert!(is_stale(state_after(&[], DEAD), Lost::Source));
        assert_eq!(
            state_after(&[CONNECTED], zero),
            ReplicaState::Degraded(Degraded::SnapshotLoading)
        );
        assert_eq!(
            state_after(&[CONNECTED], DEAD * 10),
            ReplicaState::Degraded(Degraded::SnapshotLoading),
            "loading is not lost: no deadline"
        );
        assert_eq!(state_after(&[CONNECTED, WHOLE], zero), ReplicaState::Exact);
        assert_eq!(state_after(&[RESUMED], zero), ReplicaState::Exact);
        // A new epoch's snapshot loads beside what counts.
        assert_eq!(
            state_after(&[CONNECTED, WHOLE, Event::SnapshotStarted], zero),
            ReplicaState::Degraded(Degraded::SnapshotLoading)
        );
        assert_eq!(
            state_after(&[CONNECTED, WHOLE, Event::Changed { blocks: 4 }], zero),
            ReplicaState::Exact
        );
    }

    #[test]
    fn the_engine_lost_unverified_or_incomplete_is_degraded_and_lost_long_is_stale() {
        let t0 = Instant::now();
        let zero = Duration::ZERO;
        let up = [CONNECTED, WHOLE];
        let with = |e: Event| [up[0].clone(), up[1].clone(), e];
        assert_eq!(
            state_after(&with(engine(Some(t0), None)), zero),
            ReplicaState::Degraded(Degraded::EngineLost)
        );
        assert!(is_stale(
            state_after(&with(engine(Some(t0), None)), DEAD),
            Lost::Engine
        ));
        assert_eq!(
            state_after(&with(engine(None, Some(Degraded::Unverified))), DEAD * 10),
            ReplicaState::Degraded(Degraded::Unverified),
            "reconnected, not yet proven: degraded, not stale (the sidecar re-asks)"
        );
        assert_eq!(
            state_after(&with(engine(None, Some(Degraded::Replaying))), zero),
            ReplicaState::Degraded(Degraded::Replaying)
        );
        // Continuity proven (or a restart cleared and rebuilt): exact again.
        let back = [
            CONNECTED,
            WHOLE,
            engine(Some(t0), None),
            engine(None, Some(Degraded::Unverified)),
            engine(None, None),
        ];
        assert_eq!(state_after(&back, zero), ReplicaState::Exact);
        // The engine stays lost since it was first seen lost.
        let t1 = t0 + Duration::from_secs(2);
        let mut s = Status::new("x");
        s.on("r", RESUMED, t0);
        s.on("r", engine(Some(t0), None), t0);
        s.on("r", engine(Some(t1), None), t1);
        assert!(is_stale(s.state(DEAD, t0 + DEAD), Lost::Engine));
    }

    #[test]
    fn an_engine_whose_server_is_gone_is_degraded_then_stale_and_exact_when_it_answers() {
        let t0 = Instant::now();
        let down = Event::Server(Some((t0, "http://e:8000/health: refused".into())));
        assert_eq!(
            state_after(&[CONNECTED, WHOLE, down.clone()], Duration::ZERO),
            ReplicaState::Degraded(Degraded::ServerDown)
        );
        assert!(is_stale(
            state_after(&[CONNECTED, WHOLE, down.clone()], DEAD),
            Lost::Server
        ));
        assert_eq!(
            state_after(&[CONNECTED, WHOLE, down, Event::Server(None)], DEAD),
            ReplicaState::Exact
        );
    }

    #[test]
    fn silence_lag_loss_and_refusal() {
        let t0 = Instant::now();
        let zero = Duration::ZERO;
        assert_eq!(
            state_after(&[CONNECTED, WHOLE, Event::Silent(true)], zero),
            ReplicaState::Degraded(Degraded::Silent)
        );
        assert_eq!(
            state_after(
                &[CONNECTED, WHOLE, Event::Silent(true), Event::Silent(false)],
                zero
            ),
            ReplicaState::Exact
        );
        assert_eq!(
            state_after(&[CONNECTED, WHOLE, Event::Lagging(true)], zero),
            ReplicaState::Degraded(Degraded::Lagging)
        );
        assert_eq!(
            state_after(
                &[
                    CONNECTED,
                    WHOLE,
                    Event::Lagging(true),
                    Event::Lagging(false)
                ],
                zero
            ),
            ReplicaState::Exact
        );
        assert_eq!(
            state_after(
                &[
                    CONNECTED,
                    WHOLE,
                    Event::Lagging(true),
                    Event::Connected { resumed: true }
                ],
                zero
            ),
            ReplicaState::Exact,
            "a new stream measures its own lag"
        );
        // Silence says less than an engine lost or a snapshot loading.
        assert_eq!(
            state_after(&[CONNECTED, Event::Silent(true)], zero),
            ReplicaState::Degraded(Degraded::SnapshotLoading)
        );
        assert_eq!(
            state_after(&[CONNECTED, WHOLE, lost(t0)], zero),
            ReplicaState::Degraded(Degraded::Connecting)
        );
        assert!(is_stale(
            state_after(&[CONNECTED, WHOLE, lost(t0)], DEAD),
            Lost::Source
        ));
        // A refusal is stale at once, and goes when a stream is followed again.
        let refused = Event::Refused {
            error: "refused: the sidecar serves replica `b`, not `a`".into(),
        };
        assert!(is_stale(
            state_after(std::slice::from_ref(&refused), zero),
            Lost::Source
        ));
        assert_eq!(
            state_after(&[refused, CONNECTED, WHOLE], zero),
            ReplicaState::Exact
        );
        let mut s = Status::new("x");
        s.on("r", RESUMED, t0);
        s.on("r", lost(t0), t0);
        assert_eq!(s.error.as_deref(), Some("the stream ended"));
        s.on("r", RESUMED, t0);
        assert_eq!(s.error, None, "followed again: the error goes");
    }

    #[test]
    fn drop_after_is_reached_once_per_loss() {
        let t0 = Instant::now();
        let drop_after = Duration::from_secs(60);
        let mut s = Status::new("x");
        s.on("r", RESUMED, t0);
        s.on("r", Event::Changed { blocks: 7 }, t0);
        assert!(!s.expire(drop_after, t0 + drop_after), "not lost");
        s.on("r", lost(t0), t0);
        assert!(!s.expire(drop_after, t0 + Duration::from_secs(59)));
        assert!(s.expire(drop_after, t0 + drop_after));
        assert_eq!(s.blocks, 0);
        assert!(!s.expire(drop_after, t0 + drop_after * 2), "once");
        // Back, and lost again: once more.
        s.on("r", RESUMED, t0 + drop_after * 2);
        let t1 = t0 + drop_after * 3;
        s.on("r", lost(t1), t1);
        assert!(s.expire(drop_after, t1 + drop_after));
    }

    #[test]
    fn a_removed_replica_is_not_published_again() {
        let mut s = Status::new("x");
        s.on("r", Event::Removed, Instant::now());
        assert!(s.removed);
    }
}
