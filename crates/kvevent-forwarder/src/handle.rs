//! The forwarder's public face: its [`Config`], the [`Handle`] that takes reports, the
//! running [`Forwarder`] and [`spawn`], which starts its task ([`crate::task`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, mpsc, oneshot};

use crate::task::{Deliver, Task};
use crate::{Client, DropReason, Metrics, pb};

/// Most prefix entries in one `CacheStateUpdate` message (about 100–300 KB on the wire), far
/// below the 4 MB default message limit of gRPC servers.
pub const MAX_ENTRIES_PER_UPDATE: usize = 8192;

/// How the forwarder batches, bounds and retries.
#[derive(Debug, Clone)]
pub struct Config {
    /// Adds and evictions are collected over this window before they are sent. Default 100 ms.
    pub window: Duration,
    /// Most prefix entries plus events waiting behind the work in flight; past it new adds and
    /// evictions are dropped while the server answers, the oldest queued work while calls
    /// fail. Default 100,000.
    pub max_pending: usize,
    /// Capacity of the input channel. Default 4,096 reports.
    pub input_capacity: usize,
    /// Most RPCs in flight at once on the connection. Default 256. Every call in flight costs
    /// CPU, and too few cap the rate near the limit / round trip, so the task adapts its own
    /// limit below this one: it starts at [`INITIAL_IN_FLIGHT`](crate::INITIAL_IN_FLIGHT) (or
    /// this, if lower), doubles it after a window whose evictions
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
    spawn_with(client, config)
}

/// [`spawn`], delivering through `deliver`.
pub(crate) fn spawn_with<D: Deliver>(deliver: D, config: Config) -> (Handle, Forwarder) {
    let (tx, rx) = mpsc::channel(config.input_capacity.max(1));
    let (shutdown_tx, shutdown_rx) = oneshot::channel();
    let metrics = Arc::new(Metrics::default());
    let bell = Arc::new(Notify::new());
    let task = tokio::spawn(Task::new(deliver, config, metrics.clone()).run(
        rx,
        bell.clone(),
        shutdown_rx,
    ));
    (
        Handle { tx, metrics, bell },
        Forwarder {
            shutdown: shutdown_tx,
            task,
        },
    )
}

pub(crate) fn count_drop(metrics: &Metrics, report: &pb::Report, reason: DropReason) {
    let (prefixes, events) = report.entries();
    metrics.drop_prefixes(reason, prefixes);
    metrics.drop_events(reason, events);
}
