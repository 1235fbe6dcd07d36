//! Counters the forwarder keeps, for the caller's metrics endpoint.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Why work was dropped instead of delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The input channel was full ([`Handle::try_submit`](crate::Handle::try_submit)).
    InputFull,
    /// Pending work exceeded its bound: the oldest was dropped.
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
    /// Unix time (ms) of the last successful RPC; 0 before the first.
    pub last_success_unix_ms: AtomicU64,
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
