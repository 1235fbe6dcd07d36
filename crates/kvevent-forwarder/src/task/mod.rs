//! The task that owns all pending work: it takes reports in, sends the front stage when it
//! may, settles calls as they finish, retries with backoff, sheds past the bound, logs at a
//! bounded rate and drains on shutdown.
//!
//! It delivers through [`Deliver`] (the gRPC [`Client`]; a fake in the property tests), so its
//! rules can be tested under tokio's paused time without a server. Its child `flight` holds
//! the front stage's calls and the in-flight limit (the methods of [`Task`] only the stage on
//! the wire needs).

mod flight;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use crate::pending::{Pending, Stage};
use crate::{Client, Config, DrainReport, DropReason, Metrics, pb};
pub use flight::INITIAL_IN_FLIGHT;
use flight::{Call, Flight, in_flight_floor};

/// Reports taken in between two checks of the bound.
const INTAKE_CHUNK: usize = 256;

/// Where the task sends its calls.
pub(crate) trait Deliver: Send + 'static {
    /// One `ReportCacheState` client stream of these updates.
    fn report(
        &self,
        updates: Vec<pb::CacheStateUpdate>,
    ) -> impl Future<Output = Result<pb::Ack, tonic::Status>> + Send + 'static;
    /// One `PublishEvent` call.
    fn publish(
        &self,
        event: pb::CacheEvent,
    ) -> impl Future<Output = Result<pb::Ack, tonic::Status>> + Send + 'static;
    /// The server, as logs name it.
    fn address(&self) -> String;
}

impl Deliver for Client {
    fn report(
        &self,
        updates: Vec<pb::CacheStateUpdate>,
    ) -> impl Future<Output = Result<pb::Ack, tonic::Status>> + Send + 'static {
        let client = self.clone();
        async move { client.report(updates).await }
    }

    fn publish(
        &self,
        event: pb::CacheEvent,
    ) -> impl Future<Output = Result<pb::Ack, tonic::Status>> + Send + 'static {
        let client = self.clone();
        async move { client.publish(event).await }
    }

    fn address(&self) -> String {
        Client::address(self).to_owned()
    }
}

/// Counts drops and failures between two log lines, so overload logs once per interval.
#[derive(Debug, Default)]
pub(crate) struct LogGate {
    last: Option<Instant>,
    dropped_prefixes: [u64; DropReason::ALL.len()],
    dropped_events: [u64; DropReason::ALL.len()],
    /// Failed calls since the last line.
    pub(crate) rpc_failures: u64,
    pub(crate) last_failure: Option<(tonic::Code, String)>,
    pub(crate) failing: bool,
    /// While `failing`: when the outage began and its failed calls so far, so that every line
    /// of one outage counts up from its start.
    pub(crate) outage: Option<(Instant, u64)>,
    /// The input-full drops (prefixes, events) already taken into the log: a handle counts
    /// them where it drops them, the task logs them.
    input_full_seen: (u64, u64),
}

/// Where the task is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Taking reports in; a window is sent when it is due.
    Open,
    /// The input is closed (a shutdown, or every handle dropped): everything pending is sent
    /// at once, until `by`.
    Draining { by: Instant },
}

pub(crate) struct Task<D> {
    pub(crate) deliver: D,
    pub(crate) config: Config,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) pending: Pending,
    /// The front stage is on the wire.
    pub(crate) flight: Option<Flight>,
    /// Calls allowed in flight now, adapted between [`crate::INITIAL_IN_FLIGHT`] and
    /// `config.max_in_flight`.
    pub(crate) in_flight: usize,
    pub(crate) log: LogGate,
    phase: Phase,
}

impl<D: Deliver> Task<D> {
    pub(crate) fn new(deliver: D, config: Config, metrics: Arc<Metrics>) -> Self {
        let in_flight = in_flight_floor(&config);
        metrics.in_flight_limit.store(in_flight as u64, Relaxed);
        Self {
            deliver,
            config,
            metrics,
            pending: Pending::new(),
            flight: None,
            in_flight,
            log: LogGate::default(),
            phase: Phase::Open,
        }
    }

    fn drain_by(&self) -> Option<Instant> {
        match self.phase {
            Phase::Open => None,
            Phase::Draining { by } => Some(by),
        }
    }

    /// Closes the input: what is queued is sealed and goes now, until `by` at the latest.
    fn close(&mut self, by: Instant) {
        if self.phase == Phase::Open {
            self.phase = Phase::Draining { by };
        }
        self.pending.seal_all();
    }

    /// Takes one report in. Past the bound, while the server answers (so this thread is what
    /// limits delivery: every entry taken in costs it work whether it is sent or shed later)
    /// an add or eviction is dropped as it arrives, and the thread's time goes to sending
    /// what is queued, in order. While calls fail or time out (an outage) it is taken in and
    /// the oldest queued work is shed instead ([`Task::bound`]), so the server gets the
    /// newest state when it is back. Both are counted as `overflow`. A clear always gets in.
    fn take(&mut self, report: pb::Report) {
        let in_flight = self.flight.is_some();
        if !self.log.failing
            && !report.is_barrier()
            && self.pending.queued(in_flight) >= self.config.max_pending
        {
            let (prefixes, events) = report.entries();
            self.dropped(DropReason::Overflow, prefixes, events);
            return;
        }
        self.pending.push(report, in_flight, &self.metrics);
    }

    /// After intake: sheds past the bound, publishes the depth.
    fn bound(&mut self) {
        let (prefixes, events) = self
            .pending
            .enforce_bound(self.config.max_pending, self.flight.is_some());
        self.dropped(DropReason::Overflow, prefixes, events);
        self.metrics
            .queue_depth
            .store(self.pending.count as u64, Relaxed);
        self.pending.check();
    }

    pub(crate) async fn run(
        mut self,
        mut rx: mpsc::Receiver<pb::Report>,
        bell: Arc<Notify>,
        mut shutdown: oneshot::Receiver<Duration>,
    ) -> DrainReport {
        let mut calls: FuturesUnordered<Call> = FuturesUnordered::new();
        let mut retry_at: Option<Instant> = None;
        let mut backoff = self.config.backoff_initial;
        let mut batch = Vec::with_capacity(INTAKE_CHUNK);
        // One timer, moved when the next wakeup changes (not a new one every turn).
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        let mut timer_at: Option<Instant> = None;
        loop {
            let now = Instant::now();
            if retry_at.is_some_and(|t| now >= t) {
                retry_at = None;
            }
            let open = self.phase == Phase::Open;
            let flush_at = self
                .pending
                .flush_at(self.config.window, self.flight.is_some());
            // A window that is due takes in everything that arrived while it was open.
            if open && flush_at.is_some_and(|t| now >= t) {
                self.take_queued(&mut rx);
            }
            if retry_at.is_none() {
                let draining = self.drain_by().is_some();
                self.dispatch(now, draining, &mut calls);
            }
            if self.pending.stages.is_empty() && self.flight.is_none() {
                if self.drain_by().is_some() {
                    break;
                }
                self.pending.forget_interned();
            }
            if self.drain_by().is_some_and(|d| now >= d) {
                break;
            }
            let open = self.phase == Phase::Open;
            let flush_at = self
                .pending
                .flush_at(self.config.window, self.flight.is_some());
            self.collect_input_full();
            let wake = [retry_at, flush_at, self.drain_by(), self.log_due()]
                .into_iter()
                .flatten()
                .min();
            if wake != timer_at {
                timer_at = wake;
                if let Some(at) = wake {
                    timer.as_mut().reset(at);
                }
            }
            // While a window waits for its time, reports wait in the channel: the task wakes
            // for the window, not for every report (the bell rings if the channel fills).
            let eager = open && flush_at.is_none();
            tokio::select! {
                Some((id, outcome, took)) = calls.next(), if !calls.is_empty() => {
                    let mut failed = self.finish(id, outcome, took);
                    // Settle every call that is already done before dispatching more.
                    while let Some(Some((id, outcome, took))) = futures_util::FutureExt::now_or_never(calls.next()) {
                        failed |= self.finish(id, outcome, took);
                    }
                    self.pending.check();
                    if failed {
                        retry_at = Some(Instant::now() + backoff);
                        backoff = (backoff * 2).min(self.config.backoff_max);
                    } else if retry_at.is_none() {
                        backoff = self.config.backoff_initial;
                    }
                }
                n = rx.recv_many(&mut batch, INTAKE_CHUNK), if eager => {
                    if n == 0 {
                        self.close(Instant::now() + self.config.drain_timeout);
                    } else {
                        for report in batch.drain(..) {
                            self.take(report);
                        }
                        self.bound();
                    }
                },
                deadline = &mut shutdown, if open => {
                    let deadline = deadline.unwrap_or(self.config.drain_timeout);
                    rx.close();
                    while let Ok(report) = rx.try_recv() {
                        self.take(report);
                    }
                    self.bound();
                    self.close(Instant::now() + deadline);
                    // A retry waiting on backoff goes now: the deadline bounds it.
                    retry_at = None;
                }
                () = bell.notified(), if open && !eager => {
                    self.take_queued(&mut rx);
                }
                () = &mut timer, if timer_at.is_some() => {
                    timer_at = None;
                    self.log_now(Instant::now(), false);
                }
            }
        }
        drop(calls);
        self.collect_input_full();
        self.log_now(Instant::now(), true);
        self.leftovers()
    }

    /// Takes the reports queued in the channel without waiting, at most a channel's worth (a
    /// sender that refills it as fast as it is emptied would otherwise keep the task here for
    /// good), shedding past the bound every [`INTAKE_CHUNK`] reports so the queue never
    /// outgrows it while it is filled; closes the input when the channel is closed.
    fn take_queued(&mut self, rx: &mut mpsc::Receiver<pb::Report>) {
        for taken in 1..=rx.max_capacity() {
            match rx.try_recv() {
                Ok(report) => self.take(report),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.bound();
                    self.close(Instant::now() + self.config.drain_timeout);
                    return;
                }
            }
            if taken % INTAKE_CHUNK == 0 {
                self.bound();
            }
        }
        self.bound();
    }

    // --- logging and leftovers ---------------------------------------------------------------

    pub(crate) fn dropped(&mut self, reason: DropReason, prefixes: u64, events: u64) {
        if prefixes + events == 0 {
            return;
        }
        self.metrics.drop_prefixes(reason, prefixes);
        self.metrics.drop_events(reason, events);
        let i = DropReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or_default();
        self.log.dropped_prefixes[i] += prefixes;
        self.log.dropped_events[i] += events;
        if self.log.last.is_none() {
            self.log_now(Instant::now(), true);
        }
    }

    /// Takes the reports the handles dropped at a full channel since the last look into the
    /// next log line (the first at once).
    fn collect_input_full(&mut self) {
        let now = (
            self.metrics.dropped_prefixes(DropReason::InputFull),
            self.metrics.dropped_events(DropReason::InputFull),
        );
        let (seen_p, seen_e) = std::mem::replace(&mut self.log.input_full_seen, now);
        let (p, e) = (now.0 - seen_p, now.1 - seen_e);
        if p + e == 0 {
            return;
        }
        let i = DropReason::ALL
            .iter()
            .position(|r| *r == DropReason::InputFull)
            .unwrap_or_default();
        self.log.dropped_prefixes[i] += p;
        self.log.dropped_events[i] += e;
        if self.log.last.is_none() {
            self.log_now(Instant::now(), true);
        }
    }

    /// When the held-back log line is due, if there is one.
    fn log_due(&self) -> Option<Instant> {
        let pending = self
            .log
            .dropped_prefixes
            .iter()
            .chain(&self.log.dropped_events)
            .any(|n| *n > 0)
            || (self.log.failing && self.log.rpc_failures > 0);
        match (pending, self.log.last) {
            (true, Some(last)) => Some(last + self.config.log_interval),
            (true, None) => Some(Instant::now()),
            _ => None,
        }
    }

    /// Logs what was dropped and what failed since the last line, at most once per interval
    /// unless `force`d.
    pub(crate) fn log_now(&mut self, now: Instant, force: bool) {
        if !force
            && self
                .log
                .last
                .is_some_and(|l| now < l + self.config.log_interval)
        {
            return;
        }
        let g = &mut self.log;
        let mut wrote = false;
        for (i, reason) in DropReason::ALL.iter().enumerate() {
            let (p, e) = (g.dropped_prefixes[i], g.dropped_events[i]);
            if p + e > 0 {
                tracing::warn!(
                    reason = reason.as_str(),
                    prefixes = p,
                    events = e,
                    pending = self.pending.count,
                    bound = self.config.max_pending,
                    "reports dropped (counted in kvevent_dropped_total; logged at most once per {:?})",
                    self.config.log_interval
                );
                wrote = true;
            }
        }
        g.dropped_prefixes = Default::default();
        g.dropped_events = Default::default();
        if g.rpc_failures > 0 && g.failing {
            let (code, message) = g
                .last_failure
                .clone()
                .unwrap_or((tonic::Code::Unknown, String::new()));
            let (since, total) = g.outage.get_or_insert((now, 0));
            *total += g.rpc_failures;
            tracing::warn!(
                server = %self.deliver.address(),
                code = ?code,
                message = %message,
                failed_calls = *total,
                failing_for = %format_args!("{}s", now.duration_since(*since).as_secs()),
                "rpcs to the server failing; keeping the work and retrying"
            );
            g.rpc_failures = 0;
            wrote = true;
        }
        if wrote {
            g.last = Some(now);
        }
    }

    fn leftovers(&mut self) -> DrainReport {
        let mut report = DrainReport::default();
        self.flight = None;
        for stage in self.pending.stages.drain(..) {
            match stage {
                Stage::Window(w) => {
                    let (adds, evicts) = w.entries();
                    report.unsent_prefixes += adds;
                    report.unsent_events += evicts;
                }
                Stage::Barrier(_) => report.unsent_events += 1,
            }
        }
        self.metrics
            .drop_prefixes(DropReason::DrainTimeout, report.unsent_prefixes);
        self.metrics
            .drop_events(DropReason::DrainTimeout, report.unsent_events);
        self.pending.count = 0;
        self.metrics.queue_depth.store(0, Relaxed);
        if report != DrainReport::default() {
            tracing::warn!(
                unsent_prefixes = report.unsent_prefixes,
                unsent_events = report.unsent_events,
                "drain deadline passed with reports unsent"
            );
        } else {
            tracing::info!("forwarder drained: nothing left unsent");
        }
        report
    }
}
