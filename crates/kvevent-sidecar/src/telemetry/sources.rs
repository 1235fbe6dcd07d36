//! The engine sources: events, batches, sequence state, replays, connections. Counted, and
//! written, by `kvevent-source` (each source's [`SourceMetrics`] and [`Health`], its
//! `collector`); the last batch times by the events thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kvevent_source::collector::Source;
use kvevent_source::{Health, SourceMetrics};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::unix_ms;

/// The sources' counters.
#[derive(Debug)]
pub struct Sources {
    /// Source labels, in index order.
    pub labels: Vec<String>,
    /// Per-source transport and state counters.
    pub metrics: Vec<Arc<SourceMetrics>>,
    /// Per-source health, as each source's state machine says it.
    pub health: Vec<Arc<Health>>,
    /// Per source: Unix ms of its last batch (0: none yet).
    pub last_batch_unix_ms: Vec<AtomicU64>,
    /// Unix ms the sidecar started.
    pub started_unix_ms: u64,
}

impl Sources {
    /// Counters for these sources, from now.
    pub fn new(
        labels: Vec<String>,
        metrics: Vec<Arc<SourceMetrics>>,
        health: Vec<Arc<Health>>,
    ) -> Self {
        let n = labels.len();
        Self {
            labels,
            metrics,
            health,
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
}

/// Writes [`Sources`].
#[derive(Debug)]
pub(crate) struct SourcesCollector(pub(crate) Arc<Sources>);

impl Collector for SourcesCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = &*self.0;
        let sources: Vec<Source<'_>> = (s.labels.iter().zip(&s.metrics).zip(&s.health))
            .enumerate()
            .map(|(i, ((label, metrics), health))| Source {
                label,
                metrics,
                health,
                silent_s: s.silence_seconds(i),
            })
            .collect();
        kvevent_source::collector::encode(&mut enc, &sources)
    }
}
