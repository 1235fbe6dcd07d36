//! Per-source counters, shared with whoever exports them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use crate::{RankHealth, ResetReason};

/// Decode failure kinds, as exported.
pub const DECODE_FAILURE_KINDS: [&str; 6] = [
    "truncated",
    "unexpected_type",
    "limit_exceeded",
    "invalid_utf8",
    "out_of_range",
    "other",
];

/// What happened on one source: counters (monotonic; `last_seq` a gauge), and the rank's
/// health as its state machine said it last, read through [`SourceMetrics::health`].
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
    /// The rank's health as its state machine said it last ([`SourceMetrics::health`]): only
    /// the source's thread writes it.
    degraded: AtomicBool,
    connected: AtomicBool,
    unverified: AtomicBool,
    /// When the source last became degraded or unverified, in milliseconds since the Unix
    /// epoch; 0 while it is neither.
    untrusted_since_ms: AtomicU64,
}

impl SourceMetrics {
    /// The rank's health, as its source state machine (and its socket) said it last: the one
    /// reading of it for every consumer.
    pub fn health(&self) -> RankHealth {
        RankHealth::of(self.connected(), self.degraded(), self.unverified())
    }

    /// The SUB socket has a connection to the engine.
    pub fn connected(&self) -> bool {
        self.connected.load(Relaxed)
    }

    /// The state is known to be incomplete (a gap or truncation not yet healed by a clear),
    /// connected or not.
    pub fn degraded(&self) -> bool {
        self.degraded.load(Relaxed)
    }

    /// Not yet proven the same engine process (or a new one) since a disconnect or the start,
    /// connected or not.
    pub fn unverified(&self) -> bool {
        self.unverified.load(Relaxed)
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Relaxed);
    }

    pub(crate) fn set_degraded(&self, degraded: bool) {
        self.degraded.store(degraded, Relaxed);
        self.note_trust();
    }

    pub(crate) fn set_unverified(&self, unverified: bool) {
        self.unverified.store(unverified, Relaxed);
        self.note_trust();
    }

    fn note_trust(&self) {
        let untrusted = self.degraded.load(Relaxed) || self.unverified.load(Relaxed);
        let since = self.untrusted_since_ms.load(Relaxed);
        if untrusted && since == 0 {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_millis() as u64);
            self.untrusted_since_ms.store(now.max(1), Relaxed);
        } else if !untrusted && since != 0 {
            self.untrusted_since_ms.store(0, Relaxed);
        }
    }

    /// How long the source has been degraded or unverified, if it is.
    pub fn untrusted_for(&self) -> Option<std::time::Duration> {
        let since = self.untrusted_since_ms.load(Relaxed);
        (since != 0).then(|| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            std::time::Duration::from_millis(now.saturating_sub(since))
        })
    }

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
