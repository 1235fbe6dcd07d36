//! The engine sources: events, batches, sequence state, replays, connections. Counted by
//! `kvevent-source` (each source's [`SourceMetrics`]) and the events thread (last batch times).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kvevent_source::{DECODE_FAILURE_KINDS, ResetReason, SourceMetrics};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::{encode, unix_ms};

/// The sources' counters.
#[derive(Debug)]
pub struct Sources {
    /// Source labels, in index order.
    pub labels: Vec<String>,
    /// Per-source transport and state counters.
    pub metrics: Vec<Arc<SourceMetrics>>,
    /// Per source: Unix ms of its last batch (0: none yet).
    pub last_batch_unix_ms: Vec<AtomicU64>,
    /// Unix ms the pipeline started.
    pub started_unix_ms: u64,
}

impl Sources {
    /// Counters for these sources, from now.
    pub fn new(labels: Vec<String>, metrics: Vec<Arc<SourceMetrics>>) -> Self {
        let n = labels.len();
        Self {
            labels,
            metrics,
            last_batch_unix_ms: (0..n).map(|_| AtomicU64::new(0)).collect(),
            started_unix_ms: unix_ms(),
        }
    }

    /// Seconds since `source`'s last batch, or since the start when it sent none.
    pub fn silence_seconds(&self, source: usize) -> f64 {
        let last = self
            .last_batch_unix_ms
            .get(source)
            .map_or(0, |l| l.load(Relaxed));
        let since = if last == 0 {
            self.started_unix_ms
        } else {
            last
        };
        unix_ms().saturating_sub(since) as f64 / 1000.0
    }

    /// True once any source delivered a batch.
    pub fn any_batch(&self) -> bool {
        self.last_batch_unix_ms.iter().any(|l| l.load(Relaxed) > 0)
    }

    /// Each source's label with its counters.
    fn each(&self) -> impl Iterator<Item = (&str, &SourceMetrics)> {
        self.labels
            .iter()
            .map(String::as_str)
            .zip(self.metrics.iter().map(|m| &**m))
    }
}

/// Writes [`Sources`].
#[derive(Debug)]
pub(crate) struct SourcesCollector(pub(crate) Arc<Sources>);

impl Collector for SourcesCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = &*self.0;
        // A family with one sample per source.
        let per_source = |enc: &mut DescriptorEncoder<'_>,
                          name: &'static str,
                          counter: bool,
                          help: &str,
                          f: &dyn Fn(&SourceMetrics) -> u64|
         -> std::fmt::Result {
            let mut family = if counter {
                encode::counter(enc, name, help)?
            } else {
                encode::gauge(enc, name, help)?
            };
            for (label, m) in s.each() {
                if counter {
                    encode::count(&mut family, &[("source", label)], f(m))?;
                } else {
                    encode::level(&mut family, &[("source", label)], f(m))?;
                }
            }
            Ok(())
        };
        let mut f = encode::counter(
            &mut enc,
            "kvevent_events_received_total",
            "Events received from the engine, by type.",
        )?;
        for (label, m) in s.each() {
            for (t, count) in m.events.by_type() {
                encode::count(
                    &mut f,
                    &[("source", label), ("type", t)],
                    count.load(Relaxed),
                )?;
            }
        }
        per_source(
            &mut enc,
            "kvevent_batches_received_total",
            true,
            "Batches received and applied.",
            &|m| m.batches.load(Relaxed),
        )?;
        let mut f = encode::counter(
            &mut enc,
            "kvevent_decode_failures_total",
            "Payloads that failed to decode, by kind.",
        )?;
        for (label, m) in s.each() {
            for (i, kind) in DECODE_FAILURE_KINDS.iter().enumerate() {
                encode::count(
                    &mut f,
                    &[("source", label), ("kind", kind)],
                    m.decode_failures[i].load(Relaxed),
                )?;
            }
        }
        per_source(
            &mut enc,
            "kvevent_seq_gaps_total",
            true,
            "Gaps in the sequence numbers.",
            &|m| m.gaps.load(Relaxed),
        )?;
        per_source(
            &mut enc,
            "kvevent_seq_missing_total",
            true,
            "Sequence numbers missing across gaps.",
            &|m| m.missing_seqs.load(Relaxed),
        )?;
        let mut f = encode::counter(&mut enc, "kvevent_replays_total", "Replays by outcome.")?;
        for (label, m) in s.each() {
            for (outcome, c) in [
                ("requested", &m.replays_requested),
                ("complete", &m.replays_complete),
                ("truncated", &m.replays_truncated),
                ("timed_out", &m.replays_timed_out),
                ("failed", &m.replays_failed),
                ("unavailable", &m.replays_unavailable),
            ] {
                encode::count(
                    &mut f,
                    &[("source", label), ("outcome", outcome)],
                    c.load(Relaxed),
                )?;
            }
        }
        let mut f = encode::counter(
            &mut enc,
            "kvevent_state_resumes_total",
            "Saved states (--state-file) resumed or refused at start, by outcome.",
        )?;
        for (label, m) in s.each() {
            for (outcome, c) in [
                ("verified", &m.resumes_verified),
                ("refused", &m.resumes_refused),
            ] {
                encode::count(
                    &mut f,
                    &[("source", label), ("outcome", outcome)],
                    c.load(Relaxed),
                )?;
            }
        }
        per_source(
            &mut enc,
            "kvevent_engine_restarts_total",
            true,
            "Engine restarts detected (sequence regressions).",
            &|m| m.restarts.load(Relaxed),
        )?;
        let mut f = encode::gauge(
            &mut enc,
            "kvevent_source_last_batch_age_seconds",
            "Seconds since the source's last batch (since the start when none came).",
        )?;
        for (i, label) in s.labels.iter().enumerate() {
            encode::level(
                &mut f,
                &[("source", label)],
                (s.silence_seconds(i) * 1000.0).round() / 1000.0,
            )?;
        }
        per_source(
            &mut enc,
            "kvevent_engine_disconnects_total",
            true,
            "Connection drops to the engine (libzmq reconnects by itself).",
            &|m| m.disconnects.load(Relaxed),
        )?;
        per_source(
            &mut enc,
            "kvevent_duplicate_batches_total",
            true,
            "Duplicate batches dropped.",
            &|m| m.duplicates.load(Relaxed),
        )?;
        per_source(
            &mut enc,
            "kvevent_malformed_messages_total",
            true,
            "Malformed ZMQ messages skipped.",
            &|m| m.malformed_frames.load(Relaxed),
        )?;
        let mut f = encode::counter(
            &mut enc,
            "kvevent_source_resets_total",
            "Source resets (the replica's state cleared), by reason.",
        )?;
        for (label, m) in s.each() {
            for reason in ResetReason::ALL {
                encode::count(
                    &mut f,
                    &[("source", label), ("reason", reason.as_str())],
                    m.resets(reason),
                )?;
            }
        }
        per_source(
            &mut enc,
            "kvevent_source_last_seq",
            false,
            "Last sequence number applied.",
            &|m| m.last_seq.load(Relaxed),
        )?;
        per_source(
            &mut enc,
            "kvevent_source_degraded",
            false,
            "1 while the source's state is known to be incomplete.",
            &|m| u64::from(m.degraded.load(Relaxed)),
        )?;
        per_source(
            &mut enc,
            "kvevent_source_connected",
            false,
            "1 while the source's socket has a connection to the engine (not proof it publishes: see kvevent_source_last_batch_age_seconds).",
            &|m| u64::from(m.connected.load(Relaxed)),
        )?;
        per_source(
            &mut enc,
            "kvevent_hold_buffer_overflows_total",
            true,
            "Live batches dropped from the hold buffer during replays.",
            &|m| m.buffer_overflows.load(Relaxed),
        )
    }
}
