//! The state file (`--state-file`): writes, size, time. Counted by the events thread and the
//! state-file writer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::encode;

/// The state file's counters.
#[derive(Debug, Default)]
pub struct StateFile {
    /// Writes by outcome.
    pub writes: StateWrites,
    /// Size of the last state file written, in bytes.
    pub bytes: AtomicU64,
    /// Time the last write took (encode, write, fsync, rename), in microseconds.
    pub write_us: AtomicU64,
}

/// State file writes by outcome.
#[derive(Debug, Default)]
pub struct StateWrites {
    /// Written.
    pub written: AtomicU64,
    /// Failed (the disk, the path).
    pub failed: AtomicU64,
    /// Skipped: the previous write was still running.
    pub skipped: AtomicU64,
}

impl StateWrites {
    /// Each outcome's label, as `/metrics` names it, with its count.
    pub fn by_outcome(&self) -> [(&'static str, &AtomicU64); 3] {
        [
            ("written", &self.written),
            ("failed", &self.failed),
            ("skipped", &self.skipped),
        ]
    }
}

/// Writes [`StateFile`].
#[derive(Debug)]
pub(crate) struct StateFileCollector(pub(crate) Arc<StateFile>);

impl Collector for StateFileCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = &*self.0;
        {
            let mut f = encode::counter(
                &mut enc,
                "kvevent_state_file_writes_total",
                "State file writes by outcome (skipped: the previous write was still running).",
            )?;
            for (outcome, c) in s.writes.by_outcome() {
                encode::count(&mut f, &[("outcome", outcome)], c.load(Relaxed))?;
            }
        }
        {
            let mut f = encode::gauge(
                &mut enc,
                "kvevent_state_file_bytes",
                "Size of the last state file written.",
            )?;
            encode::level(&mut f, &[], s.bytes.load(Relaxed))?;
        }
        let mut f = encode::gauge(
            &mut enc,
            "kvevent_state_file_write_seconds",
            "Duration of the last state file write (encode, write, fsync, rename).",
        )?;
        encode::level(&mut f, &[], s.write_us.load(Relaxed) as f64 / 1e6)
    }
}
