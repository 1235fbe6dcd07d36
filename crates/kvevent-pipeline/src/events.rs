//! The events thread: subscriber → mapper → forwarder, on a named std thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use kvevent_forwarder as fwd;
use kvevent_mapper::Mapper;
use kvevent_proto as pb;
use kvevent_source::{ResetReason, Subscriber, Update};

use crate::telemetry::Telemetry;

pub(crate) struct EventsLoop {
    pub(crate) subscriber: Subscriber,
    /// One mapper per source.
    pub(crate) mappers: Vec<Mapper>,
    pub(crate) forwarder: fwd::Handle,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) telemetry: Arc<Telemetry>,
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

impl EventsLoop {
    pub(crate) fn run(mut self) {
        let mut reports: Vec<pb::Report> = Vec::new();
        // The replica's server state is cleared once, at the first contact with any source.
        let mut cleared_at_start = false;
        let several = self.mappers.len() > 1;
        while !self.stop.load(Relaxed) {
            let Some(update) = self.subscriber.next(Duration::from_millis(100)) else {
                continue;
            };
            let source = match &update {
                Update::Batch(b) => b.source,
                Update::Reset { source, .. } => *source,
            };
            let Some(mapper) = self.mappers.get_mut(source) else {
                continue;
            };
            match update {
                Update::Batch(batch) => match batch.decode() {
                    Ok(decoded) => mapper.map_batch(&decoded, &mut reports),
                    // The subscriber checked it decodes: this cannot happen, but never panic.
                    Err(e) => tracing::error!(error = %e, "a checked batch failed to decode"),
                },
                Update::Reset { reason, .. } => {
                    let ts = now_us();
                    match reason {
                        ResetReason::Startup if cleared_at_start => {}
                        ResetReason::Startup => {
                            cleared_at_start = true;
                            reports.push(mapper.reset(ts));
                        }
                        // Other ranks of the replica are still valid: evict only this one's.
                        _ if several => reports.extend(mapper.evict_all(ts)),
                        _ => reports.push(mapper.reset(ts)),
                    }
                }
            }
            {
                let mut stats = self
                    .telemetry
                    .mappers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if let Some(slot) = stats.get_mut(source) {
                    *slot = (mapper.stats().clone(), mapper.tracked_blocks());
                }
            }
            for report in reports.drain(..) {
                // Waits only for room in the forwarder's channel, never for the network.
                if self.forwarder.blocking_submit(report).is_err() {
                    self.telemetry.reports_after_shutdown.fetch_add(1, Relaxed);
                }
            }
        }
        self.subscriber.shutdown();
        tracing::info!("engine subscription closed");
    }
}
