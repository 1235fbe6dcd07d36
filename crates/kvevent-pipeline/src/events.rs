//! The events thread: subscriber → mapper → forwarder, on a named std thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use kvevent_forwarder as fwd;
use kvevent_mapper::Mapper;
use kvevent_proto as pb;
use kvevent_source::{ResetReason, Subscriber, View};

use crate::telemetry::Telemetry;

pub(crate) struct EventsLoop {
    pub(crate) subscriber: Subscriber,
    /// One mapper per source.
    pub(crate) mappers: Vec<Mapper>,
    pub(crate) forwarder: fwd::Handle,
    /// Resident blocks are re-reported once per this interval (0: off).
    pub(crate) refresh_interval: Duration,
    /// A source silent this long is warned about, once per silence.
    pub(crate) silence_grace: Duration,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) telemetry: Arc<Telemetry>,
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

impl EventsLoop {
    pub(crate) fn run(self) {
        let EventsLoop {
            mut subscriber,
            mut mappers,
            forwarder,
            refresh_interval,
            silence_grace,
            stop,
            telemetry,
        } = self;
        let mut reports: Vec<pb::Report> = Vec::new();
        // The replica's server state is cleared once, at the first contact with any source.
        let mut cleared_at_start = false;
        let several = mappers.len() > 1;
        let mut warned = vec![false; mappers.len()];
        let labels: Vec<String> = subscriber.sources().iter().map(|s| s.label()).collect();
        while !stop.load(Relaxed) {
            let mapped = subscriber.next_with(Duration::from_millis(100), |view| match view {
                View::Batch { source, batch, .. } => {
                    if let Some(last) = telemetry.last_batch_unix_ms.get(source) {
                        last.store(crate::telemetry::unix_ms(), Relaxed);
                    }
                    let mapper = mappers.get_mut(source)?;
                    mapper.map_batch(batch, &mut reports);
                    Some(source)
                }
                View::Reset { source, reason } => {
                    let mapper = mappers.get_mut(source)?;
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
                    Some(source)
                }
            });
            // A source that never sent anything within the grace is most likely misconfigured
            // (an idle engine that did send stays quiet, and that is fine): say so once.
            for (source, warned) in warned.iter_mut().enumerate() {
                let never = telemetry.last_batch_unix_ms[source].load(Relaxed) == 0;
                let silent =
                    never && telemetry.silence_seconds(source) >= silence_grace.as_secs_f64();
                if silent && !*warned {
                    tracing::warn!(
                        source = %labels[source],
                        silent_for = ?silence_grace,
                        "no KV events from this engine source yet: is vLLM started with --kv-events-config (publisher zmq), and does --engine-endpoint name its PUB socket (host, port, DP rank)?"
                    );
                    *warned = true;
                }
                if !never && *warned {
                    tracing::info!(source = %labels[source], "KV events arriving");
                    *warned = false;
                }
            }
            // The share of the refresh cycle due by now, after the batch (never before an
            // eviction it follows: the mapper refreshes only blocks it still tracks).
            let now = std::time::Instant::now();
            let mut refreshed = false;
            for mapper in &mut mappers {
                refreshed |= mapper.refresh(now, refresh_interval, now_us(), &mut reports) > 0;
            }
            let touched: Vec<usize> = match mapped {
                Some(Some(source)) if !refreshed => vec![source],
                _ if refreshed => (0..mappers.len()).collect(),
                _ => Vec::new(),
            };
            if !touched.is_empty() {
                let mut stats = telemetry.mappers.lock().unwrap_or_else(|e| e.into_inner());
                for source in touched {
                    if let (Some(slot), Some(mapper)) = (stats.get_mut(source), mappers.get(source))
                    {
                        *slot = (mapper.stats().clone(), mapper.tracked_blocks());
                    }
                }
            }
            for report in reports.drain(..) {
                // Waits only for room in the forwarder's channel, never for the network.
                if forwarder.blocking_submit(report).is_err() {
                    telemetry.reports_after_shutdown.fetch_add(1, Relaxed);
                }
            }
        }
        subscriber.shutdown();
        tracing::info!("engine subscription closed");
    }
}
