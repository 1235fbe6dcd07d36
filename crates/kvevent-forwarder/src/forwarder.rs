//! The forwarding task: one owner of all pending work.
//!
//! Work is kept in *stages*, sent strictly one stage after the other:
//!
//! - a **window** collects adds and evictions for [`Config::window`]. Within it, work on one
//!   prefix is netted as it arrives: a repeated add replaces the queued one, an eviction drops
//!   the queued adds of its prefix (and is itself dropped when the first of them was
//!   [`Report::New`](pb::Report::New): the server never held the prefix), so per prefix a window
//!   holds nothing, an add, an eviction, or an eviction followed by an add. When the window is
//!   sent, its evictions go as concurrent `PublishEvent` calls (at most
//!   [`Config::max_in_flight`] at once, sharing the one HTTP/2 connection) together with one
//!   `ReportCacheState` stream of the adds whose prefix has no queued eviction; the adds that
//!   follow an eviction of their prefix go in a second stream once every eviction is
//!   acknowledged. A failed call is retried inside its stage, so it can never be overtaken by
//!   later work on the same prefix.
//! - a **clear** (`ALL_CLEARED`) discards the queued, unsent work of its replica and is a stage of
//!   its own: it waits for everything before it, and everything after waits for it. Other event
//!   types are barriers the same way, without discarding anything.
//!
//! Only the front stage is ever in flight. Pending work is bounded by [`Config::max_pending`]
//! counted over the stages *behind* the front one once that is in flight (work on the wire
//! cannot be taken back); past the bound the oldest queued work is shed, so delivery never
//! stops while the server keeps up at all.

use std::collections::{HashMap, VecDeque};

/// The maps of the hot path hash with foldhash (keys are engine hashes and short ids).
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use crate::{Client, DropReason, Metrics, Retry, classify, pb};

/// Most prefix entries in one `CacheStateUpdate` message (about 100–300 KB on the wire), far
/// below the 4 MB default message limit of gRPC servers.
pub const MAX_ENTRIES_PER_UPDATE: usize = 8192;

/// How the forwarder batches, bounds and retries.
#[derive(Debug, Clone)]
pub struct Config {
    /// Adds and evictions are collected over this window before they are sent. Default 100 ms.
    pub window: Duration,
    /// Most prefix entries plus events waiting behind the work in flight; past it the oldest
    /// queued work is dropped. Default 100,000.
    pub max_pending: usize,
    /// Capacity of the input channel. Default 4,096 reports.
    pub input_capacity: usize,
    /// Most RPCs in flight at once on the connection. Default 256. Every call in flight costs
    /// CPU (the load benchmark at 10k + 10k blocks/s, the limit fixed: 17–18 % of a core with
    /// 64, 23 % with 256, 28 % with 1,024), and too few cap the rate near the limit / round
    /// trip, so the task adapts its own limit below this one: it starts at
    /// [`INITIAL_IN_FLIGHT`] (or this, if lower), doubles it after a window whose evictions
    /// outnumbered it took longer than three quarters of a window to send, and halves it
    /// (not below the start) after one that took under three eighths.
    pub max_in_flight: usize,
    /// First retry delay after a retryable failure; doubles up to `backoff_max`. Default 100 ms.
    pub backoff_initial: Duration,
    /// Longest retry delay. Default 10 s.
    pub backoff_max: Duration,
    /// Drain deadline used when every handle is dropped without a shutdown. Default 5 s.
    pub drain_timeout: Duration,
    /// Least time between two log lines about drops or failing RPCs. Default 10 s.
    pub log_interval: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            window: Duration::from_millis(100),
            max_pending: 100_000,
            input_capacity: 4096,
            max_in_flight: 256,
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(5),
            log_interval: Duration::from_secs(10),
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
    /// Rung when the channel is half full. While a window is open the task takes its input
    /// only when the window is due (one wakeup a window, not one a report), or at this bell.
    bell: Arc<Notify>,
}

impl Handle {
    /// Queues a report without waiting; a full channel drops it (counted as `input_full`).
    pub fn try_submit(&self, report: pb::Report) -> Submit {
        match self.tx.try_send(report) {
            Ok(()) => {
                self.ring_if_filling();
                Submit::Queued
            }
            Err(mpsc::error::TrySendError::Full(report)) => {
                count_drop(&self.metrics, &report, DropReason::InputFull);
                Submit::Full
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Submit::Closed,
        }
    }

    /// Queues a report, waiting for room in the channel (never for the network: the forwarder
    /// task empties the channel at least once a window, and at once when it is half full).
    /// `Err` when the forwarder has shut down.
    pub async fn submit(&self, report: pb::Report) -> Result<(), Closed> {
        self.tx.send(report).await.map_err(|_| Closed)?;
        self.ring_if_filling();
        Ok(())
    }

    /// Like [`Self::submit`], from a plain thread (never from inside the async runtime).
    pub fn blocking_submit(&self, report: pb::Report) -> Result<(), Closed> {
        // Waiting for room takes a park-and-poll round; the channel almost always has room.
        match self.tx.try_send(report) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(report)) => {
                self.tx.blocking_send(report).map_err(|_| Closed)?;
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(Closed),
        }
        self.ring_if_filling();
        Ok(())
    }

    fn ring_if_filling(&self) {
        if self.tx.capacity() <= self.tx.max_capacity() / 2 {
            self.bell.notify_one();
        }
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
    let bell = Arc::new(Notify::new());
    let task =
        tokio::spawn(Task::new(client, config, metrics.clone()).run(rx, bell.clone(), shutdown_rx));
    (
        Handle { tx, metrics, bell },
        Forwarder {
            shutdown: shutdown_tx,
            task,
        },
    )
}

fn count_drop(metrics: &Metrics, report: &pb::Report, reason: DropReason) {
    match report {
        pb::Report::Update(u) | pb::Report::New(u) => {
            metrics.drop_prefixes(reason, u.prefixes.len() as u64)
        }
        pb::Report::Event(_) => metrics.drop_events(reason, 1),
    }
}

// ---------------------------------------------------------------------------------------------
// Interning: identities and adapters are stored once, work refers to them by number.

/// Values stored once and referred to by index. Emptied when the forwarder is idle.
#[derive(Debug)]
struct Interner<T> {
    values: Vec<T>,
    index: Map<T, u32>,
}

impl<T: Clone + Eq + std::hash::Hash> Interner<T> {
    fn new() -> Self {
        Self {
            values: Vec::new(),
            index: Map::default(),
        }
    }

    fn id(&mut self, value: &T) -> u32 {
        if let Some(&id) = self.index.get(value) {
            return id;
        }
        let id = self.values.len() as u32;
        self.values.push(value.clone());
        self.index.insert(value.clone(), id);
        id
    }

    fn get(&self, id: u32) -> &T {
        &self.values[id as usize]
    }

    fn clear(&mut self) {
        self.values.clear();
        self.index.clear();
    }
}

/// Who a message is about: replica, model, tenant.
type Scope = (String, String, String);
/// How adds are reported: scope, hash scheme, update-level adapter.
type Group = (u32, String, String);

/// A prefix hash, inline up to 16 bytes (engine ints, fingerprints, xxhash digests).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Prefix {
    Inline(u8, [u8; 16]),
    Heap(Box<[u8]>),
}

impl Prefix {
    fn new(bytes: &[u8]) -> Self {
        if bytes.len() <= 16 {
            let mut b = [0; 16];
            b[..bytes.len()].copy_from_slice(bytes);
            Self::Inline(bytes.len() as u8, b)
        } else {
            Self::Heap(bytes.into())
        }
    }

    fn to_vec(&self) -> Vec<u8> {
        match self {
            Self::Inline(n, b) => b[..*n as usize].to_vec(),
            Self::Heap(b) => b.to_vec(),
        }
    }
}

/// What work on one prefix is keyed by: the add of one adapter conflicts with its eviction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    scope: u32,
    adapter: u32,
    prefix: Prefix,
}

// ---------------------------------------------------------------------------------------------
// Windows

/// The rarely used parts of a prefix entry, kept out of line.
#[derive(Debug, Clone, PartialEq)]
struct Extra {
    block_hashes: Vec<Vec<u8>>,
    block_token_counts: Vec<i32>,
}

#[derive(Debug)]
enum Op {
    /// Cancelled, superseded or shed.
    Gone,
    Add {
        key: Key,
        group: u32,
        /// The entry's own `adapter_id` ("" when it leaves it to the update).
        entry_adapter: u32,
        tier: i32,
        token_count: i32,
        timestamp_us: i64,
        /// An eviction of the prefix is queued before it: sent after the evictions.
        after_evict: bool,
        extra: Option<Box<Extra>>,
    },
    Evict {
        key: Key,
        timestamp_us: i64,
    },
}

/// A sequence number in a window, or none (`u32::MAX`): 4 bytes instead of 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot(u32);

impl Slot {
    const NONE: Self = Self(u32::MAX);

    fn of(seq: Option<u64>) -> Self {
        seq.and_then(|s| u32::try_from(s).ok())
            .filter(|s| *s != u32::MAX)
            .map_or(Self::NONE, Self)
    }

    fn get(self) -> Option<u64> {
        (self != Self::NONE).then_some(u64::from(self.0))
    }

    fn take(&mut self) -> Option<u64> {
        std::mem::replace(self, Self::NONE).get()
    }
}

impl Default for Slot {
    fn default() -> Self {
        Self::NONE
    }
}

/// The queued work of one prefix in a window (sequence numbers of its ops).
#[derive(Debug, Default)]
struct KeyOps {
    evict: Slot,
    /// By tier (`CacheTier` value 0–3).
    adds: [Slot; 4],
    /// The first of the queued adds was a [`pb::Report::New`].
    first_add_new: bool,
}

impl KeyOps {
    fn has_adds(&self) -> bool {
        self.adds.iter().any(|a| a.get().is_some())
    }
}

#[derive(Debug)]
struct Window {
    opened: Instant,
    /// No more work merges into it: a barrier is queued behind it, or it is in flight.
    sealed: bool,
    ops: VecDeque<Op>,
    /// Sequence number of `ops[0]`.
    first_seq: u64,
    keys: Map<Key, KeyOps>,
    /// Stats-only (or empty) updates: the latest per group.
    stats: Vec<(u32, Option<pb::ReplicaStats>, i64)>,
    /// Live prefix entries and evictions.
    live: usize,
}

impl Window {
    fn new() -> Self {
        Self {
            opened: Instant::now(),
            sealed: false,
            ops: VecDeque::new(),
            first_seq: 0,
            keys: Map::default(),
            stats: Vec::new(),
            live: 0,
        }
    }

    fn op_mut(&mut self, seq: u64) -> Option<&mut Op> {
        let i = seq.checked_sub(self.first_seq)?;
        self.ops.get_mut(i as usize)
    }

    fn push(&mut self, op: Op) -> u64 {
        let seq = self.first_seq + self.ops.len() as u64;
        self.ops.push_back(op);
        self.live += 1;
        seq
    }

    /// Marks the op at `seq` gone; true when it was live.
    fn cancel(&mut self, seq: u64) -> bool {
        match self.op_mut(seq) {
            Some(op) if !matches!(op, Op::Gone) => {
                *op = Op::Gone;
                self.live -= 1;
                true
            }
            _ => false,
        }
    }

    fn entries(&self) -> (u64, u64) {
        let mut adds = 0;
        let mut evicts = 0;
        for op in &self.ops {
            match op {
                Op::Add { .. } => adds += 1,
                Op::Evict { .. } => evicts += 1,
                Op::Gone => {}
            }
        }
        (adds, evicts)
    }
}

#[derive(Debug)]
enum Stage {
    Window(Window),
    /// A clear or another event that orders everything around it.
    Barrier(pb::CacheEvent),
}

impl Stage {
    fn size(&self) -> usize {
        match self {
            Stage::Window(w) => w.live,
            Stage::Barrier(_) => 1,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Flight: the front stage on the wire

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallId {
    /// An eviction: the op's sequence number.
    Evict(u64),
    /// The adds without a queued eviction of their prefix (0), or after one (1).
    Adds(u8),
    Barrier,
}

#[derive(Debug, Default)]
struct Flight {
    /// Evictions not started yet (sequence numbers), oldest first; retries go to the front.
    evicts: VecDeque<u64>,
    /// Calls started and not finished.
    running: usize,
    /// Evictions not yet settled (acknowledged, refused or given up).
    evicts_left: usize,
    /// Adds streams not started: [without eviction, after eviction].
    adds_ready: [bool; 2],
    adds_left: [bool; 2],
    /// Updates the adds streams carry, counted when they are built.
    updates: [u64; 2],
    barrier_ready: bool,
    barrier_left: bool,
    /// When the stage went on the wire, and how many evictions it had: a window of more
    /// evictions than the in-flight limit that took long to send raises the limit.
    started: Option<Instant>,
    evictions: usize,
}

impl Flight {
    fn done(&self) -> bool {
        self.running == 0
            && self.evicts_left == 0
            && !self.adds_left[0]
            && !self.adds_left[1]
            && !self.barrier_left
    }
}

/// Now, in microseconds since the epoch.
fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// The age of a report the server just acknowledged: now − its batch time. A report without
/// a time (0: "server now") or from the future (clock skew) is not observed.
fn observe_age(metrics: &Metrics, now_us: i64, timestamp_us: i64) {
    if timestamp_us > 0 && now_us >= timestamp_us {
        metrics
            .histograms
            .age_seconds
            .observe((now_us - timestamp_us) as f64 / 1e6);
    }
}

/// Where the forwarder's own in-flight limit starts, and its floor (see
/// [`Config::max_in_flight`]): in the load benchmark's sweep 32–64 calls in flight cost the
/// least CPU per call.
pub const INITIAL_IN_FLIGHT: usize = 64;

/// The forwarder's in-flight limit at the start, and the least it adapts down to.
fn in_flight_floor(config: &Config) -> usize {
    INITIAL_IN_FLIGHT.min(config.max_in_flight).max(1)
}

type Call =
    Pin<Box<dyn Future<Output = (CallId, Result<pb::Ack, tonic::Status>, Duration)> + Send>>;

/// Counts drops and failures between two log lines, so overload logs once per interval.
#[derive(Debug, Default)]
struct LogGate {
    last: Option<Instant>,
    dropped_prefixes: [u64; DropReason::ALL.len()],
    dropped_events: [u64; DropReason::ALL.len()],
    rpc_failures: u64,
    last_failure: Option<(tonic::Code, String)>,
    failing: bool,
}

struct Task {
    client: Client,
    config: Config,
    metrics: Arc<Metrics>,
    scopes: Interner<Scope>,
    groups: Interner<Group>,
    adapters: Interner<String>,
    stages: VecDeque<Stage>,
    /// The front stage is on the wire.
    flight: Option<Flight>,
    /// Live work in the stages, in flight or not.
    pending: usize,
    /// Calls allowed in flight now, adapted between [`INITIAL_IN_FLIGHT`] and
    /// `config.max_in_flight`.
    in_flight: usize,
    log: LogGate,
}

impl Task {
    fn new(client: Client, config: Config, metrics: Arc<Metrics>) -> Self {
        let in_flight = in_flight_floor(&config);
        metrics.in_flight_limit.store(in_flight as u64, Relaxed);
        Self {
            client,
            config,
            metrics,
            scopes: Interner::new(),
            groups: Interner::new(),
            adapters: Interner::new(),
            stages: VecDeque::new(),
            flight: None,
            pending: 0,
            in_flight,
            log: LogGate::default(),
        }
    }

    async fn run(
        mut self,
        mut rx: mpsc::Receiver<pb::Report>,
        bell: Arc<Notify>,
        mut shutdown: oneshot::Receiver<Duration>,
    ) -> DrainReport {
        let mut calls: FuturesUnordered<Call> = FuturesUnordered::new();
        let mut retry_at: Option<Instant> = None;
        let mut backoff = self.config.backoff_initial;
        let mut drain_by: Option<Instant> = None;
        let mut input_open = true;
        let mut batch = Vec::with_capacity(256);
        // One timer, moved when the next wakeup changes (not a new one every turn).
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        let mut timer_at: Option<Instant> = None;
        loop {
            let now = Instant::now();
            if retry_at.is_some_and(|t| now >= t) {
                retry_at = None;
            }
            // A window that is due takes in everything that arrived while it was open.
            if input_open && self.flush_at().is_some_and(|t| now >= t) {
                input_open = self.take_queued(&mut rx, &mut drain_by);
            }
            if retry_at.is_none() {
                self.dispatch(now, drain_by.is_some(), &mut calls);
            }
            if self.stages.is_empty() && self.flight.is_none() {
                if drain_by.is_some() {
                    break;
                }
                // Idle: nothing refers to the interned values any more.
                if self.scopes.values.len() > 64 {
                    self.scopes.clear();
                    self.groups.clear();
                    self.adapters.clear();
                }
            }
            if drain_by.is_some_and(|d| now >= d) {
                break;
            }
            let log_at = self.log_due();
            let flush_at = self.flush_at();
            let wake = [retry_at, flush_at, drain_by, log_at]
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
            let eager = input_open && flush_at.is_none();
            tokio::select! {
                Some((id, outcome, took)) = calls.next(), if !calls.is_empty() => {
                    let mut failed = self.finish(id, outcome, took);
                    // Settle every call that is already done before dispatching more.
                    while let Some(Some((id, outcome, took))) = futures_util::FutureExt::now_or_never(calls.next()) {
                        failed |= self.finish(id, outcome, took);
                    }
                    if failed {
                        retry_at = Some(Instant::now() + backoff);
                        backoff = (backoff * 2).min(self.config.backoff_max);
                    } else if retry_at.is_none() {
                        backoff = self.config.backoff_initial;
                    }
                }
                n = rx.recv_many(&mut batch, 256), if eager => {
                    if n == 0 {
                        input_open = false;
                        drain_by.get_or_insert(Instant::now() + self.config.drain_timeout);
                        self.seal_all();
                    } else {
                        for report in batch.drain(..) {
                            self.push(report);
                        }
                        self.enforce_bound();
                        self.metrics.queue_depth.store(self.pending as u64, Relaxed);
                    }
                },
                deadline = &mut shutdown, if drain_by.is_none() => {
                    let deadline = deadline.unwrap_or(self.config.drain_timeout);
                    drain_by = Some(Instant::now() + deadline);
                    rx.close();
                    while let Ok(report) = rx.try_recv() {
                        self.push(report);
                    }
                    self.enforce_bound();
                    input_open = false;
                    self.seal_all();
                    // A retry waiting on backoff goes now: the deadline bounds it.
                    retry_at = None;
                }
                () = bell.notified(), if input_open && !eager => {
                    input_open = self.take_queued(&mut rx, &mut drain_by);
                }
                () = &mut timer, if timer_at.is_some() => {
                    timer_at = None;
                    self.log_now(Instant::now(), false);
                }
            }
        }
        drop(calls);
        self.log_now(Instant::now(), true);
        self.leftovers()
    }

    /// Takes every report queued in the channel without waiting; false once it is closed.
    fn take_queued(
        &mut self,
        rx: &mut mpsc::Receiver<pb::Report>,
        drain_by: &mut Option<Instant>,
    ) -> bool {
        loop {
            match rx.try_recv() {
                Ok(report) => self.push(report),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    drain_by.get_or_insert(Instant::now() + self.config.drain_timeout);
                    self.enforce_bound();
                    self.seal_all();
                    return false;
                }
            }
        }
        self.enforce_bound();
        self.metrics.queue_depth.store(self.pending as u64, Relaxed);
        true
    }

    /// When the open window at the front becomes due.
    fn flush_at(&self) -> Option<Instant> {
        if self.flight.is_some() {
            return None;
        }
        match self.stages.front() {
            Some(Stage::Window(w)) if !w.sealed => Some(w.opened + self.config.window),
            _ => None,
        }
    }

    fn seal_all(&mut self) {
        for stage in &mut self.stages {
            if let Stage::Window(w) = stage {
                w.sealed = true;
            }
        }
    }

    // --- intake ------------------------------------------------------------------------------

    fn push(&mut self, report: pb::Report) {
        match report {
            pb::Report::Update(update) => self.add(update, false),
            pb::Report::New(update) => self.add(update, true),
            pb::Report::Event(event) => {
                let kind = event.r#type;
                if kind == pb::cache_event::Type::PrefixEvicted as i32 {
                    self.evict(event);
                } else {
                    if kind == pb::cache_event::Type::AllCleared as i32 {
                        self.supersede(&event.replica_id);
                    }
                    if let Some(Stage::Window(w)) = self.stages.back_mut() {
                        w.sealed = true;
                    }
                    self.stages.push_back(Stage::Barrier(event));
                    self.pending += 1;
                }
            }
        }
    }

    /// The open window at the back, made if needed.
    fn open_window(&mut self) -> &mut Window {
        // Sequence numbers are kept in 32 bits: a window that shed work for hours starts anew.
        let open =
            |w: &Window| !w.sealed && w.first_seq + (w.ops.len() as u64) < u64::from(u32::MAX - 1);
        if !matches!(self.stages.back(), Some(Stage::Window(w)) if open(w)) {
            if let Some(Stage::Window(w)) = self.stages.back_mut() {
                w.sealed = true;
            }
            self.stages.push_back(Stage::Window(Window::new()));
        }
        match self.stages.back_mut() {
            Some(Stage::Window(w)) => w,
            _ => unreachable!("a window was just pushed"),
        }
    }

    fn add(&mut self, mut update: pb::CacheStateUpdate, new: bool) {
        let scope = self.scopes.id(&(
            std::mem::take(&mut update.replica_id),
            std::mem::take(&mut update.model_id),
            std::mem::take(&mut update.tenant_id),
        ));
        let group = self.groups.id(&(
            scope,
            std::mem::take(&mut update.hash_scheme),
            update.adapter_id.clone(),
        ));
        let update_adapter = self.adapters.id(&update.adapter_id);
        let entries: Vec<(Key, u32, pb::PrefixEntry)> = update
            .prefixes
            .into_iter()
            .map(|mut p| {
                let entry_adapter = self.adapters.id(&p.adapter_id);
                let adapter = if p.adapter_id.is_empty() {
                    update_adapter
                } else {
                    entry_adapter
                };
                let key = Key {
                    scope,
                    adapter,
                    prefix: Prefix::new(&std::mem::take(&mut p.prefix_hash)),
                };
                (key, entry_adapter, p)
            })
            .collect();
        let ts = update.timestamp_us;
        let w = self.open_window();
        if entries.is_empty() {
            match w.stats.iter_mut().find(|(g, _, _)| *g == group) {
                Some(slot) => *slot = (group, update.stats, ts),
                None => w.stats.push((group, update.stats, ts)),
            }
            return;
        }
        let mut added: usize = 0;
        let mut coalesced = 0;
        for (key, entry_adapter, p) in entries {
            let tier = p.tier.clamp(0, 3);
            let extra =
                (!p.block_hashes.is_empty() || !p.block_token_counts.is_empty()).then(|| {
                    Box::new(Extra {
                        block_hashes: p.block_hashes,
                        block_token_counts: p.block_token_counts,
                    })
                });
            let ko = w.keys.entry(key.clone()).or_default();
            let after_evict = ko.evict.get().is_some();
            let existing = ko.adds[tier as usize].get();
            if existing.is_none() && !ko.has_adds() {
                ko.first_add_new = new;
            }
            let seq = w.first_seq + w.ops.len() as u64;
            ko.adds[tier as usize] = Slot::of(Some(seq));
            // A repeated add replaces the queued one and moves to the back, so adds of one
            // prefix at several tiers keep their order (the last tier reported wins).
            if existing.is_some_and(|old| w.cancel(old)) {
                coalesced += 1;
            } else {
                added += 1;
            }
            w.push(Op::Add {
                key,
                group,
                entry_adapter,
                tier,
                token_count: p.token_count,
                timestamp_us: ts,
                after_evict,
                extra,
            });
        }
        self.pending += added;
        self.metrics.coalesced.fetch_add(coalesced, Relaxed);
    }

    fn evict(&mut self, event: pb::CacheEvent) {
        let scope = self
            .scopes
            .id(&(event.replica_id, event.model_id, event.tenant_id));
        let adapter = self.adapters.id(&event.adapter_id);
        let key = Key {
            scope,
            adapter,
            prefix: Prefix::new(&event.prefix_hash),
        };
        let ts = event.timestamp_us;
        let w = self.open_window();
        let ko = w.keys.entry(key.clone()).or_default();
        let adds: Vec<u64> = ko.adds.iter_mut().filter_map(Slot::take).collect();
        let earlier_evict = ko.evict.get().is_some();
        let first_new = ko.first_add_new;
        // The queued adds of the prefix are moot: it is evicted after them.
        let mut cancelled = 0;
        for seq in adds.iter().copied() {
            cancelled += u64::from(w.cancel(seq));
        }
        let removed = cancelled as usize;
        // The server does not hold the prefix if an eviction of it is queued already, or if
        // the first queued add was its first report: then this eviction is moot too.
        let moot = earlier_evict || (!adds.is_empty() && first_new);
        if moot {
            cancelled += 1;
            if !earlier_evict {
                w.keys.remove(&key);
            }
            self.pending -= removed;
        } else {
            let seq = w.push(Op::Evict {
                key: key.clone(),
                timestamp_us: ts,
            });
            if let Some(ko) = w.keys.get_mut(&key) {
                ko.evict = Slot::of(Some(seq));
            }
            self.pending = self.pending - removed + 1;
        }
        self.metrics.cancelled.fetch_add(cancelled, Relaxed);
    }

    /// A clear for `replica` makes every queued, not in-flight add and event of it moot.
    fn supersede(&mut self, replica: &str) {
        let skip = usize::from(self.flight.is_some());
        let scopes: Vec<u32> = (0..self.scopes.values.len() as u32)
            .filter(|&s| self.scopes.get(s).0 == replica)
            .collect();
        let mut superseded = 0;
        let groups = &self.groups;
        let mut kept = VecDeque::with_capacity(self.stages.len());
        for (i, mut stage) in self.stages.drain(..).enumerate() {
            if i < skip {
                kept.push_back(stage);
                continue;
            }
            match &mut stage {
                Stage::Barrier(e) if e.replica_id == replica => {
                    superseded += 1;
                    continue;
                }
                Stage::Barrier(_) => {}
                Stage::Window(w) => {
                    for op in w.ops.iter_mut() {
                        let mine = match op {
                            Op::Add { key, .. } | Op::Evict { key, .. } => {
                                scopes.contains(&key.scope)
                            }
                            Op::Gone => false,
                        };
                        if mine {
                            *op = Op::Gone;
                            w.live -= 1;
                            superseded += 1;
                        }
                    }
                    w.keys.retain(|k, _| !scopes.contains(&k.scope));
                    w.stats
                        .retain(|(g, _, _)| !scopes.contains(&groups.get(*g).0));
                    if w.live == 0 && w.stats.is_empty() {
                        continue;
                    }
                }
            }
            kept.push_back(stage);
        }
        self.stages = kept;
        self.pending -= superseded;
        self.metrics
            .superseded_by_clear
            .fetch_add(superseded as u64, Relaxed);
    }

    /// Sheds the oldest queued work (never what is in flight, never a barrier) until the
    /// bound holds for what waits behind the flight.
    fn enforce_bound(&mut self) {
        let skip = usize::from(self.flight.is_some());
        let in_flight: usize = self.stages.iter().take(skip).map(Stage::size).sum();
        let mut queued = self.pending - in_flight;
        if queued <= self.config.max_pending {
            return;
        }
        let mut shed = [0u64; 2];
        for stage in self.stages.iter_mut().skip(skip) {
            let Stage::Window(w) = stage else {
                continue;
            };
            while queued > self.config.max_pending {
                let Some(op) = w.ops.pop_front() else {
                    break;
                };
                let seq = w.first_seq;
                w.first_seq += 1;
                let (key, is_add) = match op {
                    Op::Gone => continue,
                    Op::Add { key, .. } => (key, true),
                    Op::Evict { key, .. } => (key, false),
                };
                w.live -= 1;
                queued -= 1;
                shed[usize::from(!is_add)] += 1;
                if let Some(ko) = w.keys.get_mut(&key) {
                    if ko.evict.get() == Some(seq) {
                        ko.evict = Slot::NONE;
                    }
                    for a in &mut ko.adds {
                        if a.get() == Some(seq) {
                            *a = Slot::NONE;
                        }
                    }
                    if ko.evict.get().is_none() && !ko.has_adds() {
                        w.keys.remove(&key);
                    }
                }
            }
            if queued <= self.config.max_pending {
                break;
            }
        }
        self.stages.retain(
            |s| !matches!(s, Stage::Window(w) if w.live == 0 && w.stats.is_empty() && w.sealed),
        );
        self.pending -= (shed[0] + shed[1]) as usize;
        self.dropped(DropReason::Overflow, shed[0], shed[1]);
    }

    // --- sending -----------------------------------------------------------------------------

    /// Starts what the front stage may start now.
    fn dispatch(&mut self, now: Instant, draining: bool, calls: &mut FuturesUnordered<Call>) {
        if self.flight.is_none() {
            let window = self.config.window;
            let Some(front) = self.stages.front_mut() else {
                return;
            };
            let flight = match front {
                Stage::Window(w) => {
                    if !(w.sealed || draining || now >= w.opened + window) {
                        return;
                    }
                    w.sealed = true;
                    // Nothing merges into it any more: the index is not needed.
                    w.keys = Map::default();
                    let mut f = Flight::default();
                    let mut adds = [false; 2];
                    for (i, op) in w.ops.iter().enumerate() {
                        match op {
                            Op::Evict { .. } => f.evicts.push_back(w.first_seq + i as u64),
                            Op::Add { after_evict, .. } => adds[usize::from(*after_evict)] = true,
                            Op::Gone => {}
                        }
                    }
                    adds[0] |= !w.stats.is_empty();
                    f.evicts_left = f.evicts.len();
                    f.evictions = f.evicts.len();
                    f.started = Some(now);
                    f.adds_ready = adds;
                    f.adds_left = adds;
                    f
                }
                Stage::Barrier(_) => Flight {
                    barrier_ready: true,
                    barrier_left: true,
                    ..Flight::default()
                },
            };
            self.flight = Some(flight);
        }
        let Some(flight) = self.flight.as_mut() else {
            return;
        };
        let Some(stage) = self.stages.front() else {
            return;
        };
        let max = self.in_flight;
        match stage {
            Stage::Barrier(event) => {
                if flight.barrier_ready {
                    flight.barrier_ready = false;
                    flight.running += 1;
                    let client = self.client.clone();
                    let event = event.clone();
                    calls.push(Box::pin(async move {
                        let t = Instant::now();
                        (CallId::Barrier, client.publish(event).await, t.elapsed())
                    }));
                }
            }
            Stage::Window(w) => {
                if flight.adds_ready[0] && flight.running < max {
                    flight.adds_ready[0] = false;
                    flight.running += 1;
                    let updates =
                        build_updates(w, false, &self.scopes, &self.groups, &self.adapters);
                    flight.updates[0] = updates.len() as u64;
                    let client = self.client.clone();
                    for u in &updates {
                        self.metrics
                            .histograms
                            .update_entries
                            .observe(u.prefixes.len() as f64);
                    }
                    calls.push(Box::pin(async move {
                        let t = Instant::now();
                        (CallId::Adds(0), client.report(updates).await, t.elapsed())
                    }));
                }
                while flight.running < max {
                    let Some(seq) = flight.evicts.pop_front() else {
                        break;
                    };
                    let i = (seq - w.first_seq) as usize;
                    let Some(Op::Evict { key, timestamp_us }) = w.ops.get(i) else {
                        continue;
                    };
                    let (replica_id, model_id, tenant_id) = self.scopes.get(key.scope).clone();
                    let event = pb::CacheEvent {
                        r#type: pb::cache_event::Type::PrefixEvicted as i32,
                        replica_id,
                        model_id,
                        tenant_id,
                        prefix_hash: key.prefix.to_vec(),
                        timestamp_us: *timestamp_us,
                        adapter_id: self.adapters.get(key.adapter).clone(),
                    };
                    flight.running += 1;
                    let client = self.client.clone();
                    calls.push(Box::pin(async move {
                        let t = Instant::now();
                        (CallId::Evict(seq), client.publish(event).await, t.elapsed())
                    }));
                }
                if flight.adds_ready[1] && flight.evicts_left == 0 && flight.running < max {
                    flight.adds_ready[1] = false;
                    flight.running += 1;
                    let updates =
                        build_updates(w, true, &self.scopes, &self.groups, &self.adapters);
                    flight.updates[1] = updates.len() as u64;
                    let client = self.client.clone();
                    for u in &updates {
                        self.metrics
                            .histograms
                            .update_entries
                            .observe(u.prefixes.len() as f64);
                    }
                    calls.push(Box::pin(async move {
                        let t = Instant::now();
                        (CallId::Adds(1), client.report(updates).await, t.elapsed())
                    }));
                }
            }
        }
    }

    /// Settles one call. True when it failed in a way worth retrying (it was put back).
    fn finish(
        &mut self,
        id: CallId,
        outcome: Result<pb::Ack, tonic::Status>,
        took: Duration,
    ) -> bool {
        let h = &self.metrics.histograms;
        match id {
            CallId::Adds(_) => h.report_seconds.observe(took.as_secs_f64()),
            CallId::Evict(_) | CallId::Barrier => h.publish_seconds.observe(took.as_secs_f64()),
        }
        let now_us = unix_us();
        let Some(flight) = self.flight.as_mut() else {
            return false;
        };
        flight.running -= 1;
        let result = match outcome {
            Ok(ack) if ack.accepted => Ok(()),
            Ok(ack) => {
                self.log.last_failure = Some((
                    tonic::Code::Ok,
                    format!("not accepted: {}", ack.reason_code),
                ));
                Err(DropReason::Rejected)
            }
            Err(status) => {
                self.metrics.rpc_error(status.code());
                self.log.rpc_failures += 1;
                self.log.last_failure = Some((status.code(), status.message().to_owned()));
                match classify(&status) {
                    Retry::Retry => {
                        match id {
                            CallId::Evict(seq) => flight.evicts.push_front(seq),
                            CallId::Adds(i) => flight.adds_ready[usize::from(i)] = true,
                            CallId::Barrier => flight.barrier_ready = true,
                        }
                        if !self.log.failing {
                            self.log.failing = true;
                            self.log_now(Instant::now(), true);
                        }
                        return true;
                    }
                    Retry::GiveUp => Err(DropReason::GaveUp),
                }
            }
        };
        if result.is_ok() && self.log.failing {
            self.log.failing = false;
            tracing::info!("server accepting reports again");
        }
        let Some(stage) = self.stages.front_mut() else {
            return false;
        };
        let mut settled = 0;
        match (id, stage) {
            (CallId::Evict(seq), Stage::Window(w)) => {
                flight.evicts_left -= 1;
                if let (Ok(()), Some(Op::Evict { timestamp_us, .. })) =
                    (&result, w.ops.get((seq - w.first_seq) as usize))
                {
                    observe_age(&self.metrics, now_us, *timestamp_us);
                }
                settled += usize::from(w.cancel(seq));
                match result {
                    Ok(()) => {
                        self.metrics.success_now();
                        self.metrics.evictions_sent.fetch_add(1, Relaxed);
                    }
                    Err(reason) => self.dropped(reason, 0, 1),
                }
            }
            (CallId::Adds(i), Stage::Window(w)) => {
                flight.adds_left[usize::from(i)] = false;
                let after = i == 1;
                let updates = flight.updates[usize::from(i)];
                let mut entries = 0;
                // One observation per batch time (an update), not per entry; a window's adds
                // come in runs of one batch time, so only a change of time is looked up.
                let mut ages = std::collections::BTreeSet::new();
                let mut last_ts = None;
                for op in w.ops.iter_mut() {
                    if let Op::Add {
                        after_evict,
                        timestamp_us,
                        ..
                    } = op
                        && *after_evict == after
                    {
                        if last_ts != Some(*timestamp_us) {
                            last_ts = Some(*timestamp_us);
                            ages.insert(*timestamp_us);
                        }
                        *op = Op::Gone;
                        entries += 1;
                    }
                }
                if result.is_ok() {
                    for ts in ages {
                        observe_age(&self.metrics, now_us, ts);
                    }
                }
                w.live -= entries;
                settled += entries;
                if !after {
                    w.stats.clear();
                }
                match result {
                    Ok(()) => {
                        self.metrics.success_now();
                        self.metrics.report_calls.fetch_add(1, Relaxed);
                        self.metrics.updates_sent.fetch_add(updates, Relaxed);
                        self.metrics
                            .prefixes_sent
                            .fetch_add(entries as u64, Relaxed);
                    }
                    Err(reason) => self.dropped(reason, entries as u64, 0),
                }
            }
            (CallId::Barrier, Stage::Barrier(e)) => {
                flight.barrier_left = false;
                settled += 1;
                if result.is_ok() {
                    observe_age(&self.metrics, now_us, e.timestamp_us);
                }
                let clear = e.r#type == pb::cache_event::Type::AllCleared as i32;
                match result {
                    Ok(()) => {
                        self.metrics.success_now();
                        if clear {
                            self.metrics.clears_sent.fetch_add(1, Relaxed);
                        } else {
                            self.metrics.evictions_sent.fetch_add(1, Relaxed);
                        }
                    }
                    Err(reason) => self.dropped(reason, 0, 1),
                }
            }
            _ => {}
        }
        self.pending -= settled;
        if let Some(flight) = self.flight.take_if(|f| f.done()) {
            self.stages.pop_front();
            if let Some(started) = flight.started {
                let took = started.elapsed();
                self.metrics
                    .histograms
                    .window_send_seconds
                    .observe(took.as_secs_f64());
                self.adapt_in_flight(flight.evictions, took);
            }
        }
        self.metrics.queue_depth.store(self.pending as u64, Relaxed);
        false
    }

    /// After a window's stage is settled: more calls in flight when its evictions outnumbered
    /// the limit and took over three quarters of a window to send (close to falling behind),
    /// fewer when they took under three eighths (each call in flight costs CPU). Between the
    /// two the limit stays: when the round trip bounds the sends, halving the limit at most
    /// doubles their time, which stays under the raising mark; when the CPU bounds them, a
    /// higher limit does not make them faster, so a window half sent never raises it.
    fn adapt_in_flight(&mut self, evictions: usize, took: Duration) {
        let floor = in_flight_floor(&self.config);
        let window = self.config.window;
        let limit = if evictions > self.in_flight && took > window * 3 / 4 {
            (self.in_flight * 2).min(self.config.max_in_flight.max(1))
        } else if took < window * 3 / 8 {
            (self.in_flight / 2).max(floor)
        } else {
            self.in_flight
        };
        if limit != self.in_flight {
            self.in_flight = limit;
            self.metrics.in_flight_limit.store(limit as u64, Relaxed);
        }
    }

    // --- logging and leftovers ---------------------------------------------------------------

    fn dropped(&mut self, reason: DropReason, prefixes: u64, events: u64) {
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
    fn log_now(&mut self, now: Instant, force: bool) {
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
                    pending = self.pending,
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
            tracing::warn!(
                server = %self.client.address(),
                code = ?code,
                message = %message,
                failures = g.rpc_failures,
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
        for stage in self.stages.drain(..) {
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

/// The `CacheStateUpdate`s of a window's adds (those after an eviction of their prefix, or the
/// others), one per (group, timestamp), at most [`MAX_ENTRIES_PER_UPDATE`] entries each, in the
/// order their first entry arrived; the stats-only updates go with the first stream.
fn build_updates(
    w: &Window,
    after: bool,
    scopes: &Interner<Scope>,
    groups: &Interner<Group>,
    adapters: &Interner<String>,
) -> Vec<pb::CacheStateUpdate> {
    let mut out: Vec<pb::CacheStateUpdate> = Vec::new();
    let mut open: Map<(u32, i64), usize> = Map::default();
    let header = |group: u32, ts: i64| {
        let (scope, scheme, adapter) = groups.get(group);
        let (replica, model, tenant) = scopes.get(*scope);
        pb::CacheStateUpdate {
            replica_id: replica.clone(),
            model_id: model.clone(),
            tenant_id: tenant.clone(),
            hash_scheme: scheme.clone(),
            timestamp_us: ts,
            adapter_id: adapter.clone(),
            ..Default::default()
        }
    };
    for op in &w.ops {
        let Op::Add {
            key,
            group,
            entry_adapter,
            tier,
            token_count,
            timestamp_us,
            after_evict,
            extra,
        } = op
        else {
            continue;
        };
        if *after_evict != after {
            continue;
        }
        let slot = match open.get(&(*group, *timestamp_us)) {
            Some(&i) if out[i].prefixes.len() < MAX_ENTRIES_PER_UPDATE => i,
            _ => {
                out.push(header(*group, *timestamp_us));
                open.insert((*group, *timestamp_us), out.len() - 1);
                out.len() - 1
            }
        };
        let (block_hashes, block_token_counts) = match extra {
            Some(x) => (x.block_hashes.clone(), x.block_token_counts.clone()),
            None => (Vec::new(), Vec::new()),
        };
        out[slot].prefixes.push(pb::PrefixEntry {
            prefix_hash: key.prefix.to_vec(),
            token_count: *token_count,
            block_hashes,
            block_token_counts,
            tier: *tier,
            adapter_id: adapters.get(*entry_adapter).clone(),
        });
    }
    if !after {
        for (group, stats, ts) in &w.stats {
            let mut u = header(*group, *ts);
            u.stats = stats.clone();
            out.push(u);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a queued entry costs: its op, plus its key and slots in the window's index.
    #[test]
    fn queued_entries_are_small() {
        let op = std::mem::size_of::<Op>();
        let index = std::mem::size_of::<(Key, KeyOps)>() + 1;
        assert!(op <= 72, "op {op} bytes");
        assert!(index <= 64, "index entry {index} bytes");
    }
}
