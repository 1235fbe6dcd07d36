//! Counters the forwarder keeps, for the caller's metrics endpoint.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Why work was dropped instead of delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The input channel was full ([`Handle::try_submit`](crate::Handle::try_submit)).
    InputFull,
    /// Pending work reached its bound: new work dropped as it arrived while the server
    /// answered, the oldest queued work while calls failed.
    Overflow,
    /// The server answered with a status that retrying cannot fix.
    GaveUp,
    /// The server's `Ack` said not accepted.
    Rejected,
    /// Still pending when the drain deadline passed.
    DrainTimeout,
}

impl DropReason {
    /// Every reason, for exporting.
    pub const ALL: [DropReason; 5] = [
        Self::InputFull,
        Self::Overflow,
        Self::GaveUp,
        Self::Rejected,
        Self::DrainTimeout,
    ];

    /// The reason's label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InputFull => "input_full",
            Self::Overflow => "overflow",
            Self::GaveUp => "gave_up",
            Self::Rejected => "rejected",
            Self::DrainTimeout => "drain_timeout",
        }
    }
}

/// The forwarder's counters. All monotonic except `queue_depth` and `last_success_unix_ms`.
#[derive(Debug, Default)]
pub struct Metrics {
    /// `ReportCacheState` calls that succeeded.
    pub report_calls: AtomicU64,
    /// `CacheStateUpdate`s delivered.
    pub updates_sent: AtomicU64,
    /// Prefix entries delivered.
    pub prefixes_sent: AtomicU64,
    /// `PREFIX_EVICTED` events delivered.
    pub evictions_sent: AtomicU64,
    /// `ALL_CLEARED` events delivered.
    pub clears_sent: AtomicU64,
    /// Work discarded because a later clear superseded it (intended, not a loss).
    pub superseded_by_clear: AtomicU64,
    /// Prefix entries merged into an already pending identical entry.
    pub coalesced: AtomicU64,
    /// Adds and evictions not sent because they cancelled out while queued (a prefix stored
    /// and evicted again before either was sent, or evicted twice).
    pub cancelled: AtomicU64,
    /// Failed RPCs by gRPC status code (index = `tonic::Code as usize`).
    pub rpc_errors: [AtomicU64; 17],
    /// Prefix entries and events dropped, by [`DropReason`] (index = position in `ALL`).
    pub dropped_prefixes: [AtomicU64; 5],
    /// Events dropped, by [`DropReason`].
    pub dropped_events: [AtomicU64; 5],
    /// Pending prefix entries and events.
    pub queue_depth: AtomicU64,
    /// Calls the forwarder lets be in flight now (it adapts, up to `Config::max_in_flight`).
    pub in_flight_limit: AtomicU64,
    /// Unix time (ms) of the last successful RPC; 0 before the first.
    pub last_success_unix_ms: AtomicU64,
    /// Distributions: RPC durations, event age at delivery, update sizes.
    pub histograms: Histograms,
}

/// A Prometheus histogram on atomics: fixed upper bounds, a count per bucket, a sum.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One per bound, then +Inf (not cumulative).
    counts: Box<[AtomicU64]>,
    /// The sum, as f64 bits.
    sum: AtomicU64,
}

impl Histogram {
    /// A histogram with these upper bounds (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Records one value (NaN is ignored).
    pub fn observe(&self, v: f64) {
        if v.is_nan() {
            return;
        }
        let i = self.bounds.partition_point(|b| *b < v);
        self.counts[i].fetch_add(1, Relaxed);
        let _ = self.sum.fetch_update(Relaxed, Relaxed, |bits| {
            Some((f64::from_bits(bits) + v).to_bits())
        });
    }

    /// Cumulative counts per upper bound (the last is +Inf), the sum, and the count.
    pub fn snapshot(&self) -> (Vec<(f64, u64)>, f64, u64) {
        let mut total = 0;
        let mut buckets = Vec::with_capacity(self.counts.len());
        for (i, c) in self.counts.iter().enumerate() {
            total += c.load(Relaxed);
            buckets.push((self.bounds.get(i).copied().unwrap_or(f64::INFINITY), total));
        }
        (buckets, f64::from_bits(self.sum.load(Relaxed)), total)
    }
}

/// Bounds for durations of calls, in seconds.
pub(crate) const RPC_SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Bounds for the age of reports when the server acknowledged them, in seconds.
pub(crate) const AGE_SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
/// Bounds for the time a window takes to send, in seconds (finer around the default 100 ms
/// window: a window's sends must take less than the window to keep up).
pub(crate) const WINDOW_SEND_SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Bounds for entries per `CacheStateUpdate`.
pub(crate) const UPDATE_ENTRIES: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

/// The forwarder's distributions.
#[derive(Debug)]
pub struct Histograms {
    /// `ReportCacheState` call durations.
    pub report_seconds: Histogram,
    /// `PublishEvent` call durations.
    pub publish_seconds: Histogram,
    /// Engine batch time → server acknowledgement, per update and event delivered.
    pub age_seconds: Histogram,
    /// Prefix entries per `CacheStateUpdate` sent (after coalescing).
    pub update_entries: Histogram,
    /// A window's sends, from its first call to its last answer (retries included).
    pub window_send_seconds: Histogram,
}

impl Default for Histograms {
    fn default() -> Self {
        Self {
            report_seconds: Histogram::new(RPC_SECONDS),
            publish_seconds: Histogram::new(RPC_SECONDS),
            age_seconds: Histogram::new(AGE_SECONDS),
            update_entries: Histogram::new(UPDATE_ENTRIES),
            window_send_seconds: Histogram::new(WINDOW_SEND_SECONDS),
        }
    }
}

fn index(reason: DropReason) -> usize {
    DropReason::ALL
        .iter()
        .position(|r| *r == reason)
        .unwrap_or_default()
}

impl Metrics {
    pub(crate) fn drop_prefixes(&self, reason: DropReason, n: u64) {
        self.dropped_prefixes[index(reason)].fetch_add(n, Relaxed);
    }

    pub(crate) fn drop_events(&self, reason: DropReason, n: u64) {
        self.dropped_events[index(reason)].fetch_add(n, Relaxed);
    }

    /// Prefix entries dropped for `reason`.
    pub fn dropped_prefixes(&self, reason: DropReason) -> u64 {
        self.dropped_prefixes[index(reason)].load(Relaxed)
    }

    /// Events dropped for `reason`.
    pub fn dropped_events(&self, reason: DropReason) -> u64 {
        self.dropped_events[index(reason)].load(Relaxed)
    }

    /// Failed RPCs with this status code.
    pub fn rpc_errors(&self, code: tonic::Code) -> u64 {
        self.rpc_errors[code as usize].load(Relaxed)
    }

    pub(crate) fn rpc_error(&self, code: tonic::Code) {
        self.rpc_errors[code as usize].fetch_add(1, Relaxed);
    }

    pub(crate) fn success_now(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.last_success_unix_ms.store(now, Relaxed);
    }
}
