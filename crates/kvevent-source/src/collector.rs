//! The sources' families for a `/metrics` (feature `metrics`): what each source's
//! [`SourceMetrics`] counted and its [`Health`], written at each scrape, one sample per source
//! (label `source`). The caller says how long each source has been silent, as it knows when it
//! started.

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;

use kvevent_metrics as fam;
use prometheus_client::encoding::DescriptorEncoder;

use crate::{DECODE_FAILURE_KINDS, Health, ResetReason, SourceMetrics};

/// One source as a scrape sees it.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    /// The `source` label.
    pub label: &'a str,
    /// Its counters.
    pub metrics: &'a SourceMetrics,
    /// Its health, as its state machine says it.
    pub health: &'a Health,
    /// Seconds since its last batch, or since the start when none came.
    pub silent_s: f64,
}

/// Writes the families of `sources`.
pub fn encode(enc: &mut DescriptorEncoder<'_>, sources: &[Source<'_>]) -> fmt::Result {
    // A family with one sample per source.
    let per_source = |enc: &mut DescriptorEncoder<'_>,
                      name: &'static str,
                      counter: bool,
                      help: &str,
                      f: &dyn Fn(&Source<'_>) -> u64|
     -> std::fmt::Result {
        let mut family = if counter {
            fam::counter(enc, name, help)?
        } else {
            fam::gauge(enc, name, help)?
        };
        for s in sources {
            if counter {
                fam::count(&mut family, &[("source", s.label)], f(s))?;
            } else {
                fam::level(&mut family, &[("source", s.label)], f(s))?;
            }
        }
        Ok(())
    };
    let mut f = fam::counter(
        enc,
        "kvevent_events_received_total",
        "Events received from the engine, by type.",
    )?;
    for &Source {
        label, metrics: m, ..
    } in sources
    {
        for (t, count) in m.events.by_type() {
            fam::count(
                &mut f,
                &[("source", label), ("type", t)],
                count.load(Relaxed),
            )?;
        }
    }
    per_source(
        enc,
        "kvevent_batches_received_total",
        true,
        "Batches received and applied.",
        &|s| s.metrics.batches.load(Relaxed),
    )?;
    let mut f = fam::counter(
        enc,
        "kvevent_decode_failures_total",
        "Payloads that failed to decode, by kind.",
    )?;
    for &Source {
        label, metrics: m, ..
    } in sources
    {
        for (i, kind) in DECODE_FAILURE_KINDS.iter().enumerate() {
            fam::count(
                &mut f,
                &[("source", label), ("kind", kind)],
                m.decode_failures[i].load(Relaxed),
            )?;
        }
    }
    per_source(
        enc,
        "kvevent_seq_gaps_total",
        true,
        "Gaps in the sequence numbers.",
        &|s| s.metrics.gaps.load(Relaxed),
    )?;
    per_source(
        enc,
        "kvevent_seq_missing_total",
        true,
        "Sequence numbers missing across gaps.",
        &|s| s.metrics.missing_seqs.load(Relaxed),
    )?;
    let mut f = fam::counter(enc, "kvevent_replays_total", "Replays by outcome.")?;
    for &Source {
        label, metrics: m, ..
    } in sources
    {
        for (outcome, c) in [
            ("requested", &m.replays_requested),
            ("complete", &m.replays_complete),
            ("truncated", &m.replays_truncated),
            ("timed_out", &m.replays_timed_out),
            ("failed", &m.replays_failed),
            ("unavailable", &m.replays_unavailable),
        ] {
            fam::count(
                &mut f,
                &[("source", label), ("outcome", outcome)],
                c.load(Relaxed),
            )?;
        }
    }
    let mut f = fam::counter(
        enc,
        "kvevent_state_resumes_total",
        "Saved states (--state-file) resumed or refused at start, by outcome.",
    )?;
    for &Source {
        label, metrics: m, ..
    } in sources
    {
        for (outcome, c) in [
            ("verified", &m.resumes_verified),
            ("refused", &m.resumes_refused),
        ] {
            fam::count(
                &mut f,
                &[("source", label), ("outcome", outcome)],
                c.load(Relaxed),
            )?;
        }
    }
    per_source(
        enc,
        "kvevent_engine_restarts_total",
        true,
        "Engine restarts detected (sequence regressions).",
        &|s| s.metrics.restarts.load(Relaxed),
    )?;
    let mut f = fam::gauge(
        enc,
        "kvevent_source_last_batch_age_seconds",
        "Seconds since the source's last batch (since the start when none came).",
    )?;
    for &Source {
        label,
        silent_s: age,
        ..
    } in sources
    {
        fam::level(
            &mut f,
            &[("source", label)],
            (age * 1000.0).round() / 1000.0,
        )?;
    }
    per_source(
        enc,
        "kvevent_engine_disconnects_total",
        true,
        "Connection drops to the engine (libzmq reconnects by itself).",
        &|s| s.metrics.disconnects.load(Relaxed),
    )?;
    per_source(
        enc,
        "kvevent_duplicate_batches_total",
        true,
        "Duplicate batches dropped.",
        &|s| s.metrics.duplicates.load(Relaxed),
    )?;
    per_source(
        enc,
        "kvevent_malformed_messages_total",
        true,
        "Malformed ZMQ messages skipped.",
        &|s| s.metrics.malformed_frames.load(Relaxed),
    )?;
    let mut f = fam::counter(
        enc,
        "kvevent_source_resets_total",
        "Source resets (the replica's state cleared), by reason.",
    )?;
    for &Source {
        label, metrics: m, ..
    } in sources
    {
        for reason in ResetReason::ALL {
            fam::count(
                &mut f,
                &[("source", label), ("reason", reason.as_str())],
                m.resets(reason),
            )?;
        }
    }
    per_source(
        enc,
        "kvevent_source_last_seq",
        false,
        "Last sequence number applied.",
        &|s| s.metrics.last_seq.load(Relaxed),
    )?;
    per_source(
        enc,
        "kvevent_source_degraded",
        false,
        "1 while the source's state is known to be incomplete.",
        &|s| u64::from(s.health.degraded()),
    )?;
    per_source(
        enc,
        "kvevent_source_connected",
        false,
        "1 while the source's socket has a connection to the engine (not proof it publishes: see kvevent_source_last_batch_age_seconds).",
        &|s| u64::from(s.health.get().is_connected()),
    )?;
    per_source(
        enc,
        "kvevent_hold_buffer_overflows_total",
        true,
        "Live batches dropped from the hold buffer during replays.",
        &|s| s.metrics.buffer_overflows.load(Relaxed),
    )
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;

    use prometheus_client::collector::Collector;
    use prometheus_client::encoding::DescriptorEncoder;

    use super::Source;
    use crate::{Health, ResetReason, SourceMetrics};

    #[derive(Debug, Default)]
    struct Two([SourceMetrics; 2], [Health; 2]);

    impl Collector for Two {
        fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
            let source = |i: usize, label, silent_s| Source {
                label,
                metrics: &self.0[i],
                health: &self.1[i],
                silent_s,
            };
            super::encode(
                &mut enc,
                &[source(0, "rank0", 1.25), source(1, "rank1", 0.0)],
            )
        }
    }

    #[test]
    fn each_source_is_a_sample_of_every_family() {
        let two = Two::default();
        two.0[0].batches.store(7, Relaxed);
        two.0[1].restarts.store(2, Relaxed);
        two.0[1].reset(ResetReason::Restart);
        two.1[1].set_connected(true);
        two.1[1].set_degraded(true);
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(two));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for line in [
            "# TYPE kvevent_batches_received counter",
            "kvevent_batches_received_total{source=\"rank0\"} 7",
            "kvevent_batches_received_total{source=\"rank1\"} 0",
            "kvevent_engine_restarts_total{source=\"rank1\"} 2",
            "kvevent_source_resets_total{source=\"rank1\",reason=\"restart\"} 1",
            "kvevent_source_last_batch_age_seconds{source=\"rank0\"} 1.25",
            "kvevent_source_connected{source=\"rank0\"} 0",
            "kvevent_source_connected{source=\"rank1\"} 1",
            "kvevent_source_degraded{source=\"rank1\"} 1",
        ] {
            assert!(text.contains(line), "missing {line:?} in:\n{text}");
        }
    }
}
