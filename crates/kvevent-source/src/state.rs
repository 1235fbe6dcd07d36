//! The per-source state machine: pure, driven by what arrives, answering with [`Step`]s.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crate::counters::SourceMetrics;
use crate::health::Health;

/// Why a source's state was declared stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResetReason {
    /// First message from the source: whatever the server holds for it may be stale.
    Startup,
    /// The seq went backwards: a new engine process.
    Restart,
    /// Batches were lost and could not be replayed.
    Gap,
    /// A replay began later than asked: the engine's buffer no longer had them.
    TruncatedReplay,
    /// A payload could not be decoded: its events are lost.
    Corrupt,
    /// A gap right after a reconnect: the engine may be a new process whose seqs passed ours.
    Reconnect,
    /// A saved state could not be resumed: the engine no longer holds (or never sent) the
    /// last batch it was saved at.
    StaleCheckpoint,
}

impl ResetReason {
    /// Every reason, for exporting.
    pub const ALL: [ResetReason; 7] = [
        Self::Startup,
        Self::Restart,
        Self::Gap,
        Self::TruncatedReplay,
        Self::Corrupt,
        Self::Reconnect,
        Self::StaleCheckpoint,
    ];

    /// The reason's label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Startup => "startup",
            Self::Restart => "restart",
            Self::Gap => "gap",
            Self::TruncatedReplay => "truncated_replay",
            Self::Corrupt => "corrupt",
            Self::Reconnect => "reconnect",
            Self::StaleCheckpoint => "stale_checkpoint",
        }
    }
}

/// What the state asks its driver to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Apply this batch (seqs strictly increase between resets).
    Deliver {
        /// The batch's seq.
        seq: u64,
        /// The msgpack payload.
        payload: Vec<u8>,
        /// When it arrived: held back during a replay, it is delivered later than that.
        arrived: Instant,
        /// It came from the replay endpoint (else live).
        replayed: bool,
    },
    /// Everything known of the source is stale: clear it.
    Reset(ResetReason),
    /// Ask the engine to replay from this seq.
    Replay {
        /// First seq wanted.
        from: u64,
    },
}

/// How a replay ended, as the driver saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayEnd {
    /// The end marker arrived.
    Complete,
    /// Nothing more arrived for the idle timeout.
    TimedOut,
    /// The request could not be sent.
    Failed,
}

impl ReplayEnd {
    /// How the transport says a replay ended, as the state takes it.
    pub fn of(outcome: &kvevent_zmq::ReplayOutcome) -> Self {
        match outcome {
            kvevent_zmq::ReplayOutcome::Complete => Self::Complete,
            kvevent_zmq::ReplayOutcome::TimedOut => Self::TimedOut,
            kvevent_zmq::ReplayOutcome::Failed(_) => Self::Failed,
        }
    }
}

/// Settings of one source's state.
#[derive(Debug, Clone)]
pub struct StateConfig {
    /// The engine has a replay endpoint.
    pub has_replay: bool,
    /// Live batches kept while a replay runs; beyond, the oldest are dropped (a gap).
    pub max_buffered: usize,
    /// Wait after a failed replay before the next; doubles up to `replay_backoff_max`.
    pub replay_backoff_initial: Duration,
    /// Longest wait between failed replays.
    pub replay_backoff_max: Duration,
    /// The source's name in log lines (its endpoint and rank).
    pub label: String,
    /// Without a replay endpoint nothing can tell a reconnect to the same engine process from
    /// a new process whose seqs happen to continue ours: reset at every reconnect (true: a
    /// sidecar beside its engine, where a reconnect is rare and most likely a restart) or mark
    /// the source degraded until something clears it (false, the default: a router, which
    /// fails open on degraded replicas).
    pub reset_on_unverified_reconnect: bool,
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            reset_on_unverified_reconnect: false,
            has_replay: false,
            max_buffered: 20_000,
            replay_backoff_initial: Duration::from_secs(1),
            replay_backoff_max: Duration::from_secs(60),
            label: String::new(),
        }
    }
}

/// Where a saved state left a source: what a restarted consumer resumes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// The last seq applied to the saved state.
    pub last_seq: u64,
    /// [`payload_digest`] of that batch's payload.
    pub digest: u64,
    /// The saved state was known to be incomplete.
    pub degraded: bool,
}

/// The digest a [`Resume`] names its last batch by: XXH3-64 of the payload.
pub fn payload_digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

#[derive(Debug)]
struct Replay {
    from: u64,
    first: Option<u64>,
    /// A resume or a reconnect: the first batch must be `from`, with this digest.
    verify: Option<u64>,
    /// The check is of a reconnect (not of a saved state).
    reconnect: bool,
    /// The resume failed: the rest of this replay is ignored, and a bootstrap from 0 follows.
    abandoned: bool,
    /// This replay rebuilds the source from nothing (first message, restart).
    bootstrap: bool,
    /// Something was lost on the way: the state is not whole after this replay.
    lossy: bool,
    /// Batches it delivered.
    delivered: u64,
    /// A repair of a degraded state: its first reply must be seq 0 (then the state is reset
    /// and rebuilt from it), else the rest is ignored.
    rebuild: bool,
}

/// One source's state: last seq, a running replay and the live batches held back meanwhile.
#[derive(Debug)]
pub struct SourceState {
    config: StateConfig,
    last: Option<u64>,
    /// [`payload_digest`] of the last batch delivered (kept with a replay endpoint, to check
    /// the engine's identity after a reconnect).
    last_digest: Option<u64>,
    replay: Option<Replay>,
    buffered: VecDeque<(u64, Vec<u8>, Arrival)>,
    /// How the batch being handled came: what it delivers or holds carries it.
    arrival: Arrival,
    /// Seqs at or above this that are not above `last` are replay duplicates, not a restart.
    dup_floor: Option<u64>,
    /// Draining the batches held during a replay: a gap now is not replayed again.
    draining: bool,
    failures: u32,
    backoff_until: Option<Instant>,
    /// The connection to the engine dropped since the last batch.
    reconnected: bool,
    /// The startup reset was emitted (by [`SourceState::on_start`]).
    started: bool,
    /// Degraded by a replay that failed or timed out: [`SourceState::on_tick`] asks again
    /// once its backoff is over.
    repair: bool,
    /// Digests (low 32 bits) of the last batches delivered, of seqs `recent_base..`: a seq
    /// seen again is a duplicate only when its payload is the one delivered.
    recent: VecDeque<u32>,
    recent_base: u64,
    metrics: Arc<SourceMetrics>,
    /// The rank's health as this state says it, shared with its readers: connected, degraded,
    /// and unverified (not yet proven that what is held is this engine process's: since a
    /// disconnect, or since the start with a replay endpoint, until continuity or a new
    /// process is proven).
    health: Arc<Health>,
}

/// How a batch came: when, and from where.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    at: Instant,
    replayed: bool,
}

/// Batches whose digests are kept to tell a duplicate from a new process's batch (a PUB's
/// queue flushed into a sidecar that restarted holds at most its HWM).
const RECENT: usize = 4096;

impl SourceState {
    /// A fresh state reporting into `metrics`.
    pub fn new(config: StateConfig, metrics: Arc<SourceMetrics>) -> Self {
        Self {
            config,
            last: None,
            last_digest: None,
            replay: None,
            buffered: VecDeque::new(),
            arrival: Arrival {
                at: Instant::now(),
                replayed: false,
            },
            dup_floor: None,
            draining: false,
            failures: 0,
            backoff_until: None,
            reconnected: false,
            started: false,
            repair: false,
            recent: VecDeque::new(),
            recent_base: 0,
            metrics,
            health: Arc::default(),
        }
    }

    /// The rank's health as this state machine says it, shared: hand it to whoever reads it.
    pub fn health(&self) -> &Arc<Health> {
        &self.health
    }

    /// Publishes `unverified` (and when trouble began).
    fn set_unverified(&mut self, unverified: bool) {
        self.health.set_unverified(unverified);
    }

    /// The source was just opened. With a replay endpoint, what the engine already published
    /// is asked for at once: a subscriber joining an idle engine learns its blocks without
    /// waiting for the engine's next batch. Without one, the first live batch starts it.
    pub fn on_start(&mut self, now: Instant, out: &mut Vec<Step>) {
        if self.started || self.last.is_some() || self.replay.is_some() || !self.can_replay(now) {
            return;
        }
        self.started = true;
        self.set_unverified(true);
        self.reset(ResetReason::Startup, out);
        self.start_replay(0, true, out);
    }

    /// The source is opened again after a restart of its consumer, whose state was saved at
    /// `resume`: nothing is reset. With a replay endpoint the engine is asked for the saved
    /// last batch and what followed: the first reply must be that very batch (same seq, same
    /// digest), proving the same engine process still holds everything after it; then the
    /// rest is delivered as usual. Otherwise (another process, or the batch is no longer in
    /// the engine's buffer) the source is reset (`StaleCheckpoint`) and rebuilt from seq 0.
    /// Without a replay endpoint, or when the replay cannot be had, the first live batch
    /// decides as after a reconnect: seq `last + 1` continues, anything else resets.
    pub fn on_resume(&mut self, resume: Resume, now: Instant, out: &mut Vec<Step>) {
        if self.started || self.last.is_some() {
            return;
        }
        self.started = true;
        self.last = Some(resume.last_seq);
        self.last_digest = Some(resume.digest);
        self.metrics.last_seq.store(resume.last_seq, Relaxed);
        self.health.set_degraded(resume.degraded);
        self.reconnected = true;
        self.set_unverified(true);
        if self.can_replay(now) {
            self.start_check(resume.last_seq, resume.digest, false, out);
        }
    }

    /// What we hold does not continue on this engine: a saved state it cannot resume
    /// (`reconnect` false) or, after a reconnect, a new process. Reset; the replay from seq 0
    /// follows when the check's replay ends.
    fn does_not_continue(&mut self, why: &str, reconnect: bool, out: &mut Vec<Step>) {
        let last = self.last.unwrap_or_default();
        let source = &self.config.label;
        if reconnect {
            tracing::info!(%source, last, why, "engine restarted across a reconnect: clearing and rebuilding from its replay buffer");
            self.metrics.restarts.fetch_add(1, Relaxed);
            self.reset(ResetReason::Restart, out);
        } else {
            tracing::warn!(%source, last, why, "saved state does not continue on this engine: clearing and rebuilding from its replay buffer");
            self.metrics.resumes_refused.fetch_add(1, Relaxed);
            self.reset(ResetReason::StaleCheckpoint, out);
        }
        self.last = None;
        self.last_digest = None;
        self.reconnected = false;
        self.repair = false;
        self.health.set_degraded(false);
    }

    /// The last seq delivered.
    pub fn last_seq(&self) -> Option<u64> {
        self.last
    }

    /// True while a replay runs.
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// The seq the running replay was asked from, if one runs.
    pub fn replaying_from(&self) -> Option<u64> {
        self.replay.as_ref().map(|r| r.from)
    }

    /// The events seen cover what the engine holds again (e.g. after `AllBlocksCleared`).
    pub fn mark_whole(&self) {
        self.health.set_degraded(false);
    }

    /// Something made the state incomplete.
    pub fn mark_degraded(&self) {
        self.health.set_degraded(true);
    }

    fn can_replay(&self, now: Instant) -> bool {
        self.config.has_replay && self.backoff_until.is_none_or(|t| now >= t)
    }

    fn deliver(&mut self, seq: u64, payload: Vec<u8>, out: &mut Vec<Step>) {
        self.last = Some(seq);
        let digest = payload_digest(&payload);
        self.last_digest = Some(digest);
        if self.recent_base + self.recent.len() as u64 != seq || self.recent.is_empty() {
            self.recent.clear();
            self.recent_base = seq;
        }
        self.recent.push_back(digest as u32);
        if self.recent.len() > RECENT {
            self.recent.pop_front();
            self.recent_base += 1;
        }
        self.metrics.last_seq.store(seq, Relaxed);
        self.metrics.batches.fetch_add(1, Relaxed);
        if let Some(r) = self.replay.as_mut() {
            r.delivered += 1;
        }
        out.push(Step::Deliver {
            seq,
            payload,
            arrived: self.arrival.at,
            replayed: self.arrival.replayed,
        });
    }

    fn reset(&mut self, reason: ResetReason, out: &mut Vec<Step>) {
        self.metrics.reset(reason);
        out.push(Step::Reset(reason));
    }

    fn start_replay(&mut self, from: u64, bootstrap: bool, out: &mut Vec<Step>) {
        self.metrics.replays_requested.fetch_add(1, Relaxed);
        self.replay = Some(Replay {
            from,
            first: None,
            verify: None,
            reconnect: false,
            abandoned: false,
            bootstrap,
            lossy: false,
            delivered: 0,
            rebuild: false,
        });
        self.dup_floor = Some(from);
        out.push(Step::Replay { from });
    }

    /// Asks the engine for batch `from` again: it must come back with `digest` (the same
    /// process) for what we hold to continue ([`SourceState::on_replayed`]).
    fn start_check(&mut self, from: u64, digest: u64, reconnect: bool, out: &mut Vec<Step>) {
        self.start_replay(from, false, out);
        if let Some(r) = self.replay.as_mut() {
            r.verify = Some(digest);
            r.reconnect = reconnect;
        }
    }

    fn hold(&mut self, seq: u64, payload: Vec<u8>) {
        self.buffered.push_back((seq, payload, self.arrival));
        if self.buffered.len() > self.config.max_buffered {
            self.buffered.pop_front();
            self.metrics.buffer_overflows.fetch_add(1, Relaxed);
        }
    }

    /// The connection to the engine dropped (libzmq reconnects by itself). Seqs carry no
    /// process identity: a new engine process that published past our last seq before we were
    /// back would look like a plain gap. So the first gap after a disconnect is treated as a
    /// possible restart: reset and rebuild from the replay buffer, never patched. Until the
    /// engine is proven the same process or a new one, its health is
    /// [`Unverified`](crate::RankHealth::Unverified) at best.
    pub fn on_disconnected(&mut self) {
        self.reconnected = true;
        self.health.set_connected(false);
        if self.last.is_some() || self.config.has_replay {
            self.set_unverified(true);
        }
        self.metrics.disconnects.fetch_add(1, Relaxed);
    }

    /// The connection to the engine is up. After a disconnect, seqs alone cannot tell the same
    /// engine process from a new one whose seqs happen to continue ours (it published as many
    /// batches before we were back). With a replay endpoint the engine is asked for our last
    /// batch at once (a new connection ends any backoff): the same seq with the same payload
    /// digest proves the same process (what it published meanwhile follows); anything else is
    /// a restart, and the source is reset and rebuilt from its replay buffer. An idle new
    /// process is recognised this way too: its buffer holds nothing at our seq. Without one,
    /// the first live batch decides (`last + 1` continues); a sidecar resets at once instead
    /// ([`StateConfig::reset_on_unverified_reconnect`]). A source still unverified with nothing
    /// asking (the transport ends a replay when the connection is made again) asks at once.
    pub fn on_connected(&mut self, now: Instant, out: &mut Vec<Step>) {
        self.health.set_connected(true);
        // Unverified with nothing asking (a replay cut by this very connection): asked now,
        // not after a failure's backoff.
        if !(self.reconnected || (self.health.unverified() && self.replay.is_none())) {
            return;
        }
        if self.config.has_replay {
            self.failures = 0;
            self.backoff_until = None;
        }
        self.verify(now, out);
    }

    /// Asks what proves the source again, when nothing is asking already: our last batch
    /// back from the engine, or (nothing held) its whole buffer.
    fn verify(&mut self, now: Instant, out: &mut Vec<Step>) {
        if self.replay.is_some() {
            return;
        }
        match (self.last, self.last_digest) {
            (Some(last), Some(digest)) if self.can_replay(now) => {
                self.start_check(last, digest, true, out);
            }
            (None, _) if self.health.unverified() && self.can_replay(now) => {
                self.start_replay(0, true, out);
            }
            _ if self.config.has_replay => {}
            (Some(_), _) if self.config.reset_on_unverified_reconnect => {
                tracing::info!(
                    source = %self.config.label,
                    "reconnected to an engine with no replay endpoint: it may be a new process, so the source is cleared and rebuilt"
                );
                self.reconnected = false;
                self.reset(ResetReason::Reconnect, out);
                self.last = None;
                self.last_digest = None;
                self.dup_floor = None;
                // The next batch starts it (seq 0: whole; later: degraded).
            }
            // A router: the first live batch decides; unverified until then.
            _ => {}
        }
    }

    /// Time passed: whatever is due is asked again. An unverified source whose check could
    /// not be asked (or failed) asks again when its backoff is over; a source degraded by a
    /// replay that failed asks the engine for its whole buffer, which makes it whole when it
    /// still begins at seq 0. Call it regularly (the [`Subscriber`](crate::Subscriber) does,
    /// at every read).
    pub fn on_tick(&mut self, now: Instant, out: &mut Vec<Step>) {
        if self.replay.is_some() || !self.config.has_replay || !self.can_replay(now) {
            return;
        }
        if self.health.unverified() && (self.health.get().is_connected() || self.last.is_none()) {
            self.verify(now, out);
        } else if self.repair && self.last.is_some() && self.health.degraded() {
            self.repair = false;
            tracing::info!(source = %self.config.label, "degraded: asking the engine for its whole buffer to repair the state");
            self.start_replay(0, false, out);
            if let Some(r) = self.replay.as_mut() {
                r.rebuild = true;
            }
        }
    }

    /// A live batch arrived.
    pub fn on_live(&mut self, seq: u64, payload: Vec<u8>, now: Instant, out: &mut Vec<Step>) {
        self.arrival = Arrival {
            at: now,
            replayed: false,
        };
        self.live(seq, payload, now, out);
    }

    /// A live batch, arrived as [`SourceState::arrival`] says.
    fn live(&mut self, seq: u64, payload: Vec<u8>, now: Instant, out: &mut Vec<Step>) {
        if self.replay.is_some() {
            self.hold(seq, payload);
            return;
        }
        let reconnected = std::mem::take(&mut self.reconnected);
        if reconnected && let Some(last) = self.last {
            if seq > last.wrapping_add(1) {
                tracing::info!(
                    source = %self.config.label,
                    seq,
                    last,
                    "gap across a reconnect: the engine may have restarted"
                );
                self.metrics.gaps.fetch_add(1, Relaxed);
                self.metrics.missing_seqs.fetch_add(seq - last - 1, Relaxed);
                self.reset(ResetReason::Reconnect, out);
                self.last = None;
                self.dup_floor = None;
                self.begin(seq, payload, now, out);
                return;
            }
            if seq <= last {
                // A PUB never sends a seq twice, nor an old one on a new connection: after a
                // disconnect it is a new process.
                self.restart(seq, payload, now, out);
                return;
            }
        }
        match self.last {
            None => {
                if !std::mem::replace(&mut self.started, true) {
                    self.reset(ResetReason::Startup, out);
                }
                self.begin(seq, payload, now, out);
            }
            Some(last) if seq == last.wrapping_add(1) => {
                // Continuity: the process we hold goes on.
                self.set_unverified(false);
                self.deliver(seq, payload, out);
            }
            Some(last) if seq <= last => self.seen_again(seq, payload, now, out),
            Some(last) => {
                let missing = seq - last - 1;
                // While draining, this is the gap the replay was for (already counted), or one
                // the hold buffer made (counted as buffer_overflows).
                if !self.draining {
                    self.metrics.gaps.fetch_add(1, Relaxed);
                    self.metrics.missing_seqs.fetch_add(missing, Relaxed);
                }
                if !self.draining && self.can_replay(now) {
                    tracing::info!(source = %self.config.label, from = last + 1, missing, "gap: replaying");
                    self.start_replay(last + 1, false, out);
                    self.hold(seq, payload);
                } else {
                    tracing::warn!(source = %self.config.label, missing, "gap that cannot be replayed: resetting the source");
                    self.mark_degraded();
                    // With a replay endpoint, asked again once the backoff is over.
                    self.repair = self.config.has_replay;
                    self.set_unverified(false);
                    self.reset(ResetReason::Gap, out);
                    self.deliver(seq, payload, out);
                }
            }
        }
    }

    /// A live seq at or below ours on the same connection: a duplicate when its payload is the
    /// batch we delivered (a PUB's queue flushed into a restarted sidecar, a replay's
    /// overlap), a new process when it is another. Older than the digests kept: a duplicate
    /// while draining a replay that covered it; else, with a replay endpoint, the engine is
    /// asked for our last batch (its answer decides, the batch held meanwhile); else a restart.
    fn seen_again(&mut self, seq: u64, payload: Vec<u8>, now: Instant, out: &mut Vec<Step>) {
        let kept = seq
            .checked_sub(self.recent_base)
            .and_then(|i| self.recent.get(usize::try_from(i).ok()?).copied());
        match kept {
            Some(d) if d == payload_digest(&payload) as u32 => {
                self.metrics.duplicates.fetch_add(1, Relaxed);
            }
            Some(_) => self.restart(seq, payload, now, out),
            None if self.dup_floor.is_some_and(|f| seq >= f) => {
                self.metrics.duplicates.fetch_add(1, Relaxed);
            }
            None => match (self.last, self.last_digest) {
                (Some(last), Some(digest)) if !self.draining && self.can_replay(now) => {
                    tracing::info!(source = %self.config.label, seq, last, "an older seq than ours: asking the engine for our last batch");
                    self.set_unverified(true);
                    self.start_check(last, digest, true, out);
                    self.hold(seq, payload);
                }
                _ => self.restart(seq, payload, now, out),
            },
        }
    }

    /// A new engine process: forget the old one's seqs and rebuild.
    fn restart(&mut self, seq: u64, payload: Vec<u8>, now: Instant, out: &mut Vec<Step>) {
        match self.last {
            Some(last) => {
                tracing::info!(source = %self.config.label, seq, last, "engine restarted: seq went back")
            }
            None => tracing::info!(source = %self.config.label, seq, "engine restarted"),
        }
        self.metrics.restarts.fetch_add(1, Relaxed);
        self.reset(ResetReason::Restart, out);
        self.last = None;
        self.dup_floor = None;
        self.begin(seq, payload, now, out);
    }

    /// The first batch of a source (or of a new engine process), after its reset.
    fn begin(&mut self, seq: u64, payload: Vec<u8>, now: Instant, out: &mut Vec<Step>) {
        if seq == 0 {
            self.mark_whole();
            self.set_unverified(false);
            self.deliver(seq, payload, out);
        } else if self.can_replay(now) {
            // Unverified until the new process's buffer is in.
            self.set_unverified(true);
            self.start_replay(0, true, out);
            self.hold(seq, payload);
        } else {
            if !self.config.has_replay {
                self.metrics.replays_unavailable.fetch_add(1, Relaxed);
            }
            self.mark_degraded();
            self.repair = self.config.has_replay;
            self.set_unverified(false);
            self.deliver(seq, payload, out);
        }
    }

    /// A replayed batch arrived.
    pub fn on_replayed(&mut self, seq: u64, payload: Vec<u8>, now: Instant, out: &mut Vec<Step>) {
        self.arrival = Arrival {
            at: now,
            replayed: true,
        };
        let Some(replay) = self.replay.as_mut() else {
            self.metrics.duplicates.fetch_add(1, Relaxed);
            return;
        };
        if replay.abandoned {
            return;
        }
        if replay.first.is_none()
            && let Some(digest) = replay.verify
        {
            replay.first = Some(seq);
            let reconnect = replay.reconnect;
            if seq == replay.from && payload_digest(&payload) == digest {
                // The last batch, as we had it: the same process, the state continues; any
                // older seq held meanwhile is one we had.
                self.metrics.duplicates.fetch_add(1, Relaxed);
                self.reconnected = false;
                self.dup_floor = Some(0);
                self.set_unverified(false);
                if self.recent.is_empty() {
                    self.recent_base = seq;
                    self.recent.push_back(digest as u32);
                }
                if reconnect {
                    tracing::debug!(source = %self.config.label, seq, "the same engine process after the reconnect");
                } else {
                    self.metrics.resumes_verified.fetch_add(1, Relaxed);
                    tracing::info!(
                        source = %self.config.label,
                        seq,
                        "saved state resumed: the engine still holds its last batch"
                    );
                }
            } else {
                replay.abandoned = true;
                let why = if seq == replay.from {
                    "the engine's batch at our last seq differs (a new engine process)"
                } else {
                    "the engine's buffer no longer holds our last seq"
                };
                self.does_not_continue(why, reconnect, out);
            }
            return;
        }
        if replay.first.is_none() && replay.rebuild {
            replay.first = Some(seq);
            if seq != 0 {
                // The buffer no longer reaches back to seq 0: nothing can repair the state.
                replay.abandoned = true;
                tracing::warn!(source = %self.config.label, first = seq, "the engine's buffer no longer begins at seq 0: degraded until the engine clears its cache");
                return;
            }
            tracing::info!(source = %self.config.label, "the engine's buffer begins at seq 0: rebuilding the state from it");
            self.reset(ResetReason::Gap, out);
            self.last = None;
            self.dup_floor = Some(0);
        }
        let Some(replay) = self.replay.as_mut() else {
            return;
        };
        if replay.first.is_none() {
            replay.first = Some(seq);
            if seq > replay.from {
                replay.lossy = true;
                let bootstrap = replay.bootstrap;
                self.metrics.replays_truncated.fetch_add(1, Relaxed);
                self.metrics
                    .missing_seqs
                    .fetch_add(seq - replay.from, Relaxed);
                self.mark_degraded();
                // A bootstrap already reset the source; a gap repair must clear what is stale.
                if !bootstrap {
                    self.reset(ResetReason::TruncatedReplay, out);
                }
            }
        }
        match self.last {
            Some(last) if seq <= last => {
                self.metrics.duplicates.fetch_add(1, Relaxed);
            }
            Some(last) if seq > last + 1 && replay_first(&self.replay) != Some(seq) => {
                // The engine's ROUTER dropped some replies (its HWM): a hole inside the replay.
                if let Some(r) = self.replay.as_mut() {
                    r.lossy = true;
                }
                self.metrics.gaps.fetch_add(1, Relaxed);
                self.metrics.missing_seqs.fetch_add(seq - last - 1, Relaxed);
                self.mark_degraded();
                self.reset(ResetReason::Gap, out);
                self.deliver(seq, payload, out);
            }
            _ => self.deliver(seq, payload, out),
        }
    }

    /// The replay is over; apply the live batches held back meanwhile.
    pub fn on_replay_done(&mut self, end: ReplayEnd, now: Instant, out: &mut Vec<Step>) {
        let Some(replay) = self.replay.take() else {
            return;
        };
        if replay.verify.is_some() && replay.first.is_none() && end == ReplayEnd::Complete {
            // Nothing at or after our last seq: this engine's seqs are all below ours.
            self.does_not_continue(
                "the engine has published less than our last seq (a new engine process)",
                replay.reconnect,
                out,
            );
        }
        if replay.verify.is_some() && (replay.abandoned || self.last.is_none()) {
            // Rebuild from nothing; the live batches held meanwhile wait for it.
            self.dup_floor = None;
            self.start_replay(0, true, out);
            return;
        }
        match end {
            ReplayEnd::Complete => {
                tracing::info!(
                    source = %self.config.label,
                    from = replay.from,
                    delivered = replay.delivered,
                    held = self.buffered.len(),
                    lossy = replay.lossy,
                    "replay complete"
                );
                self.metrics.replays_complete.fetch_add(1, Relaxed);
                self.failures = 0;
                self.backoff_until = None;
                let from_zero = replay.first == Some(0)
                    || (replay.first.is_none() && self.last.is_none() && self.buffered.is_empty());
                if (replay.bootstrap || replay.rebuild) && !replay.lossy && from_zero {
                    self.mark_whole();
                }
                if replay.bootstrap {
                    // The process's buffer is in: what is held is its.
                    self.set_unverified(false);
                }
            }
            ReplayEnd::TimedOut | ReplayEnd::Failed => {
                if end == ReplayEnd::TimedOut {
                    self.metrics.replays_timed_out.fetch_add(1, Relaxed);
                } else {
                    self.metrics.replays_failed.fetch_add(1, Relaxed);
                }
                self.failures = self.failures.saturating_add(1);
                let backoff = self
                    .config
                    .replay_backoff_initial
                    .saturating_mul(1 << self.failures.min(16).saturating_sub(1))
                    .min(self.config.replay_backoff_max);
                self.backoff_until = Some(now + backoff);
                // Asked again once the backoff is over (on_tick).
                self.repair |= replay.rebuild;
            }
        }
        self.draining = true;
        while self.replay.is_none() {
            let Some((seq, payload, arrival)) = self.buffered.pop_front() else {
                break;
            };
            self.arrival = arrival;
            if self.last.is_none() {
                // Nothing came back at all: start from the first held batch.
                if seq > 0 {
                    self.mark_degraded();
                    self.repair = self.config.has_replay;
                }
                self.set_unverified(false);
                self.deliver(seq, payload, out);
                continue;
            }
            self.live(seq, payload, now, out);
        }
        self.draining = false;
        if self.buffered.is_empty() && self.replay.is_none() {
            self.dup_floor = None;
        }
    }
}

fn replay_first(replay: &Option<Replay>) -> Option<u64> {
    replay.as_ref().and_then(|r| r.first)
}
