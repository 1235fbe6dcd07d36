//! Per-source counters, shared with whoever exports them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::ResetReason;

/// Decode failure kinds, as exported.
pub const DECODE_FAILURE_KINDS: [&str; 6] = [
    "truncated",
    "unexpected_type",
    "limit_exceeded",
    "invalid_utf8",
    "out_of_range",
    "other",
];

/// What happened on one source: counters (monotonic; `last_seq` a gauge). Its health is not
/// here: it is the state machine's ([`Health`](crate::Health)).
#[derive(Debug, Default)]
pub struct SourceMetrics {
    /// Batches delivered (live and replayed).
    pub batches: AtomicU64,
    /// Events in delivered batches, by type.
    pub events: EventCounts,
    /// Batches whose seq was already delivered (replay overlap).
    pub duplicates: AtomicU64,
    /// Gaps in the seq (seq > last + 1).
    pub gaps: AtomicU64,
    /// Seqs missing across all gaps and truncated replays.
    pub missing_seqs: AtomicU64,
    /// Seq regressions: engine restarts.
    pub restarts: AtomicU64,
    /// Resets by reason (index = position in `ResetReason::ALL`).
    pub resets: [AtomicU64; 7],
    /// Times the connection to the engine dropped.
    pub disconnects: AtomicU64,
    /// Replays asked for.
    pub replays_requested: AtomicU64,
    /// Replays that ended with the end marker.
    pub replays_complete: AtomicU64,
    /// Replays that began later than asked.
    pub replays_truncated: AtomicU64,
    /// Replays that stopped answering before the end marker.
    pub replays_timed_out: AtomicU64,
    /// Replays that could not be requested.
    pub replays_failed: AtomicU64,
    /// Times a replay was needed but the source has no replay endpoint.
    pub replays_unavailable: AtomicU64,
    /// Saved states resumed: the engine still held their last batch.
    pub resumes_verified: AtomicU64,
    /// Saved states refused (reset and rebuilt): another engine process, or too old.
    pub resumes_refused: AtomicU64,
    /// Live batches dropped from the hold buffer during a long replay.
    pub buffer_overflows: AtomicU64,
    /// Messages whose frames were neither a live message nor a replay reply.
    pub malformed_frames: AtomicU64,
    /// Payloads that failed to decode, by kind (index into `DECODE_FAILURE_KINDS`).
    pub decode_failures: [AtomicU64; 6],
    /// The last seq delivered.
    pub last_seq: AtomicU64,
}

impl SourceMetrics {
    pub(crate) fn reset(&self, reason: ResetReason) {
        let i = ResetReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or_default();
        self.resets[i].fetch_add(1, Relaxed);
    }

    /// Resets for `reason` so far.
    pub fn resets(&self, reason: ResetReason) -> u64 {
        let i = ResetReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or_default();
        self.resets[i].load(Relaxed)
    }

    pub(crate) fn decode_failure(&self, kind: &kvevent_wire::ErrorKind) {
        use kvevent_wire::ErrorKind as K;
        let i = match kind {
            K::Truncated => 0,
            K::UnexpectedType { .. } | K::ReservedMarker | K::MissingField { .. } => 1,
            K::LimitExceeded { .. } => 2,
            K::InvalidUtf8 => 3,
            K::IntOutOfRange { .. } => 4,
            _ => 5,
        };
        self.decode_failures[i].fetch_add(1, Relaxed);
    }

    /// Decode failures so far, all kinds.
    pub fn decode_failures_total(&self) -> u64 {
        self.decode_failures.iter().map(|c| c.load(Relaxed)).sum()
    }
}

/// Events in delivered batches, by type.
#[derive(Debug, Default)]
pub struct EventCounts {
    /// `BlockStored`.
    pub stored: AtomicU64,
    /// `BlockRemoved`.
    pub removed: AtomicU64,
    /// `AllBlocksCleared`.
    pub cleared: AtomicU64,
    /// Events of a type this build does not know (skipped).
    pub unknown: AtomicU64,
}

impl EventCounts {
    /// Each type's label, as `/metrics` names it, with its count.
    pub fn by_type(&self) -> [(&'static str, &AtomicU64); 4] {
        [
            ("stored", &self.stored),
            ("removed", &self.removed),
            ("cleared", &self.cleared),
            ("unknown", &self.unknown),
        ]
    }
}
