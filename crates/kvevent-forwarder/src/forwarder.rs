//! The forwarding task: one owner of all pending work.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::{Client, DropReason, Metrics, Retry, classify, pb};

/// How the forwarder batches, bounds and retries.
#[derive(Debug, Clone)]
pub struct Config {
    /// Adds are coalesced over this window before a flush. Default 100 ms.
    pub window: Duration,
    /// Most pending prefix entries plus events; past it the oldest work is dropped.
    /// Default 100,000.
    pub max_pending: usize,
    /// Capacity of the input channel. Default 4,096 reports.
    pub input_capacity: usize,
    /// First retry delay after a retryable failure; doubles up to `backoff_max`. Default 100 ms.
    pub backoff_initial: Duration,
    /// Longest retry delay. Default 10 s.
    pub backoff_max: Duration,
    /// Drain deadline used when every handle is dropped without a shutdown. Default 5 s.
    pub drain_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            window: Duration::from_millis(100),
            max_pending: 100_000,
            input_capacity: 4096,
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(5),
        }
    }
}

/// The outcome of [`Handle::try_submit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submit {
    /// Queued for delivery.
    Queued,
    /// The input channel is full: the report was dropped and counted.
    Full,
    /// The forwarder has shut down: the report was dropped.
    Closed,
}

/// The forwarder has shut down: the report was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the forwarder has shut down")]
pub struct Closed;

/// Hands reports to the forwarder. Cheap to clone; never waits on the network.
#[derive(Debug, Clone)]
pub struct Handle {
    tx: mpsc::Sender<pb::Report>,
    metrics: Arc<Metrics>,
}

impl Handle {
    /// Queues a report without waiting; a full channel drops it (counted as `input_full`).
    pub fn try_submit(&self, report: pb::Report) -> Submit {
        match self.tx.try_send(report) {
            Ok(()) => Submit::Queued,
            Err(mpsc::error::TrySendError::Full(report)) => {
                count_drop(&self.metrics, &report, DropReason::InputFull);
                Submit::Full
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Submit::Closed,
        }
    }

    /// Queues a report, waiting for room in the channel (never for the network: the forwarder
    /// task empties the channel continuously). `Err` when the forwarder has shut down.
    pub async fn submit(&self, report: pb::Report) -> Result<(), Closed> {
        self.tx.send(report).await.map_err(|_| Closed)
    }

    /// Like [`Self::submit`], from a plain thread (never from inside the async runtime).
    pub fn blocking_submit(&self, report: pb::Report) -> Result<(), Closed> {
        self.tx.blocking_send(report).map_err(|_| Closed)
    }

    /// The forwarder's counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// The running forwarder: shut it down to drain.
#[derive(Debug)]
pub struct Forwarder {
    shutdown: oneshot::Sender<Duration>,
    task: tokio::task::JoinHandle<DrainReport>,
}

/// What was left when the forwarder stopped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Prefix entries that could not be sent before the deadline.
    pub unsent_prefixes: u64,
    /// Events that could not be sent before the deadline.
    pub unsent_events: u64,
}

impl Forwarder {
    /// Stops intake, sends everything pending within `deadline`, and reports what was left.
    /// Reports still queued in the channel are taken in first.
    pub async fn shutdown(self, deadline: Duration) -> DrainReport {
        let _ = self.shutdown.send(deadline);
        self.task.await.unwrap_or_default()
    }
}

/// Starts the forwarding task on the current tokio runtime.
pub fn spawn(client: Client, config: Config) -> (Handle, Forwarder) {
    let (tx, rx) = mpsc::channel(config.input_capacity.max(1));
    let (shutdown_tx, shutdown_rx) = oneshot::channel();
    let metrics = Arc::new(Metrics::default());
    let task = tokio::spawn(
        Task {
            client,
            config,
            metrics: metrics.clone(),
            queue: VecDeque::new(),
            pending: 0,
            in_flight: false,
        }
        .run(rx, shutdown_rx),
    );
    (
        Handle { tx, metrics },
        Forwarder {
            shutdown: shutdown_tx,
            task,
        },
    )
}

fn count_drop(metrics: &Metrics, report: &pb::Report, reason: DropReason) {
    match report {
        pb::Report::Update(u) => metrics.drop_prefixes(reason, u.prefixes.len() as u64),
        pb::Report::Event(_) => metrics.drop_events(reason, 1),
    }
}

/// Pending adds for one flush, merged by (group, key, tier).
#[derive(Debug)]
struct Adds {
    /// One update per identity and adapter.
    groups: Vec<pb::CacheStateUpdate>,
    index: HashMap<(usize, Vec<u8>, i32), usize>,
    entries: usize,
    opened: Instant,
    /// No more merging: an event is queued behind it, or it was sent at least once.
    sealed: bool,
}

#[derive(Debug)]
enum Op {
    Adds(Adds),
    Event(pb::CacheEvent),
}

impl Op {
    fn size(&self) -> usize {
        match self {
            Op::Adds(a) => a.entries,
            Op::Event(_) => 1,
        }
    }
}

fn same_group(a: &pb::CacheStateUpdate, b: &pb::CacheStateUpdate) -> bool {
    a.replica_id == b.replica_id
        && a.model_id == b.model_id
        && a.tenant_id == b.tenant_id
        && a.hash_scheme == b.hash_scheme
        && a.adapter_id == b.adapter_id
}

type Call = Pin<Box<dyn Future<Output = Result<pb::Ack, tonic::Status>> + Send>>;

struct Task {
    client: Client,
    config: Config,
    metrics: Arc<Metrics>,
    /// Work in arrival order. The front is in flight when `in_flight` is set.
    queue: VecDeque<Op>,
    /// Prefix entries plus events in `queue`.
    pending: usize,
    in_flight: bool,
}

impl Task {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<pb::Report>,
        mut shutdown: oneshot::Receiver<Duration>,
    ) -> DrainReport {
        let mut call: Option<Call> = None;
        let mut retry_at: Option<Instant> = None;
        let mut backoff = self.config.backoff_initial;
        let mut drain_by: Option<Instant> = None;
        let mut input_open = true;
        loop {
            let now = Instant::now();
            if call.is_none() && retry_at.is_none_or(|t| now >= t) {
                retry_at = None;
                call = self.next_call(now, drain_by.is_some());
            }
            if drain_by.is_some() && call.is_none() && self.queue.is_empty() {
                break;
            }
            if drain_by.is_some_and(|d| now >= d) {
                break;
            }
            let wake = [retry_at, self.flush_at(), drain_by]
                .into_iter()
                .flatten()
                .min();
            tokio::select! {
                outcome = async { call.as_mut().expect("guarded").await }, if call.is_some() => {
                    call = None;
                    match self.finish(outcome) {
                        None => backoff = self.config.backoff_initial,
                        Some(()) => {
                            retry_at = Some(Instant::now() + backoff);
                            backoff = (backoff * 2).min(self.config.backoff_max);
                        }
                    }
                }
                report = rx.recv(), if input_open => match report {
                    Some(report) => self.push(report),
                    None => {
                        input_open = false;
                        drain_by.get_or_insert(Instant::now() + self.config.drain_timeout);
                        self.seal_all();
                    }
                },
                deadline = &mut shutdown, if drain_by.is_none() => {
                    let deadline = deadline.unwrap_or(self.config.drain_timeout);
                    drain_by = Some(Instant::now() + deadline);
                    rx.close();
                    while let Ok(report) = rx.try_recv() {
                        self.push(report);
                    }
                    input_open = false;
                    self.seal_all();
                    // A retry waiting on backoff goes now: the deadline bounds it.
                    retry_at = None;
                }
                () = sleep_until(wake), if wake.is_some() => {}
            }
        }
        self.leftovers()
    }

    /// When the open batch at the front becomes due.
    fn flush_at(&self) -> Option<Instant> {
        match self.queue.front() {
            Some(Op::Adds(a)) if !self.in_flight && !a.sealed => {
                Some(a.opened + self.config.window)
            }
            _ => None,
        }
    }

    fn seal_all(&mut self) {
        for op in &mut self.queue {
            if let Op::Adds(a) = op {
                a.sealed = true;
            }
        }
    }

    fn push(&mut self, report: pb::Report) {
        match report {
            pb::Report::Update(update) => self.merge(update),
            pb::Report::Event(event) => {
                if event.r#type == pb::cache_event::Type::AllCleared as i32 {
                    self.supersede(&event.replica_id);
                }
                if let Some(Op::Adds(a)) = self.queue.back_mut() {
                    a.sealed = true;
                }
                self.queue.push_back(Op::Event(event));
                self.pending += 1;
            }
        }
        self.enforce_bound();
        self.metrics.queue_depth.store(self.pending as u64, Relaxed);
    }

    fn merge(&mut self, mut update: pb::CacheStateUpdate) {
        // The front batch is sealed when sent, so an open batch is never in flight.
        if !matches!(self.queue.back(), Some(Op::Adds(a)) if !a.sealed) {
            self.queue.push_back(Op::Adds(Adds {
                groups: Vec::new(),
                index: HashMap::new(),
                entries: 0,
                opened: Instant::now(),
                sealed: false,
            }));
        }
        let Some(Op::Adds(adds)) = self.queue.back_mut() else {
            return;
        };
        let g = match adds.groups.iter().position(|g| same_group(g, &update)) {
            Some(g) => g,
            None => {
                let mut group = update.clone();
                group.prefixes.clear();
                group.stats = None;
                adds.groups.push(group);
                adds.groups.len() - 1
            }
        };
        let group = &mut adds.groups[g];
        group.timestamp_us = group.timestamp_us.max(update.timestamp_us);
        if update.stats.is_some() {
            group.stats = update.stats.take();
        }
        for entry in update.prefixes {
            let key = (g, entry.prefix_hash.clone(), entry.tier);
            match adds.index.get(&key) {
                Some(&i) => {
                    group.prefixes[i] = entry;
                    self.metrics.coalesced.fetch_add(1, Relaxed);
                }
                None => {
                    adds.index.insert(key, group.prefixes.len());
                    group.prefixes.push(entry);
                    adds.entries += 1;
                    self.pending += 1;
                }
            }
        }
    }

    /// A clear for `replica` makes every queued, not in-flight add and event of it moot.
    fn supersede(&mut self, replica: &str) {
        let skip = usize::from(self.in_flight);
        let mut superseded = 0;
        let mut kept = VecDeque::with_capacity(self.queue.len());
        for (i, mut op) in self.queue.drain(..).enumerate() {
            if i < skip {
                kept.push_back(op);
                continue;
            }
            match &mut op {
                Op::Event(e) if e.replica_id == replica => {
                    superseded += 1;
                    continue;
                }
                Op::Adds(a) => {
                    let before = a.entries;
                    a.groups.retain(|g| g.replica_id != replica);
                    a.entries = a.groups.iter().map(|g| g.prefixes.len()).sum();
                    superseded += before - a.entries;
                    if a.groups.is_empty() {
                        continue;
                    }
                    if a.entries != before {
                        // Group indices shifted: rebuild the merge index.
                        a.index = a
                            .groups
                            .iter()
                            .enumerate()
                            .flat_map(|(g, u)| {
                                u.prefixes
                                    .iter()
                                    .enumerate()
                                    .map(move |(i, p)| ((g, p.prefix_hash.clone(), p.tier), i))
                            })
                            .collect();
                    }
                }
                Op::Event(_) => {}
            }
            kept.push_back(op);
        }
        self.queue = kept;
        self.pending -= superseded;
        self.metrics
            .superseded_by_clear
            .fetch_add(superseded as u64, Relaxed);
    }

    /// Drops the oldest work that is not in flight until the bound holds.
    fn enforce_bound(&mut self) {
        let skip = usize::from(self.in_flight);
        while self.pending > self.config.max_pending && self.queue.len() > skip {
            let Some(op) = self.queue.remove(skip) else {
                break;
            };
            self.pending -= op.size();
            match &op {
                Op::Adds(a) => self
                    .metrics
                    .drop_prefixes(DropReason::Overflow, a.entries as u64),
                Op::Event(_) => self.metrics.drop_events(DropReason::Overflow, 1),
            }
            tracing::warn!(
                dropped = op.size(),
                bound = self.config.max_pending,
                "pending reports over their bound: dropped the oldest"
            );
        }
    }

    /// The RPC for the front of the queue, if it is due.
    fn next_call(&mut self, now: Instant, draining: bool) -> Option<Call> {
        let window = self.config.window;
        let client = self.client.clone();
        let call: Call = match self.queue.front_mut()? {
            Op::Adds(a) => {
                if !(a.sealed || draining || now >= a.opened + window) {
                    return None;
                }
                a.sealed = true;
                let updates = a.groups.clone();
                Box::pin(async move { client.report(updates).await })
            }
            Op::Event(e) => {
                let event = e.clone();
                Box::pin(async move { client.publish(event).await })
            }
        };
        self.in_flight = true;
        Some(call)
    }

    /// Settles the front after its RPC. `Some(())` means: keep it and retry after a backoff.
    fn finish(&mut self, outcome: Result<pb::Ack, tonic::Status>) -> Option<()> {
        self.in_flight = false;
        let result = match outcome {
            Ok(ack) if ack.accepted => Ok(()),
            Ok(ack) => {
                tracing::warn!(reason = %ack.reason_code, "server did not accept a report");
                Err(DropReason::Rejected)
            }
            Err(status) => {
                self.metrics.rpc_error(status.code());
                match classify(&status) {
                    Retry::Retry => {
                        tracing::debug!(code = ?status.code(), message = status.message(), "rpc failed; will retry");
                        return Some(());
                    }
                    Retry::GiveUp => {
                        tracing::warn!(code = ?status.code(), message = status.message(), "rpc failed for good; dropped");
                        Err(DropReason::GaveUp)
                    }
                }
            }
        };
        let op = self.queue.pop_front()?;
        self.pending -= op.size();
        self.metrics.queue_depth.store(self.pending as u64, Relaxed);
        match (result, &op) {
            (Ok(()), Op::Adds(a)) => {
                self.metrics.success_now();
                self.metrics.report_calls.fetch_add(1, Relaxed);
                self.metrics
                    .updates_sent
                    .fetch_add(a.groups.len() as u64, Relaxed);
                self.metrics
                    .prefixes_sent
                    .fetch_add(a.entries as u64, Relaxed);
            }
            (Ok(()), Op::Event(e)) => {
                self.metrics.success_now();
                if e.r#type == pb::cache_event::Type::AllCleared as i32 {
                    self.metrics.clears_sent.fetch_add(1, Relaxed);
                } else {
                    self.metrics.evictions_sent.fetch_add(1, Relaxed);
                }
            }
            (Err(reason), Op::Adds(a)) => self.metrics.drop_prefixes(reason, a.entries as u64),
            (Err(reason), Op::Event(_)) => self.metrics.drop_events(reason, 1),
        }
        None
    }

    fn leftovers(&mut self) -> DrainReport {
        let mut report = DrainReport::default();
        for op in self.queue.drain(..) {
            match op {
                Op::Adds(a) => report.unsent_prefixes += a.entries as u64,
                Op::Event(_) => report.unsent_events += 1,
            }
        }
        self.metrics
            .drop_prefixes(DropReason::DrainTimeout, report.unsent_prefixes);
        self.metrics
            .drop_events(DropReason::DrainTimeout, report.unsent_events);
        self.pending = 0;
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

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
