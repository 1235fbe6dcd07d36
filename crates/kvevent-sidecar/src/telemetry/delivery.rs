//! Delivery to the InferenceCache server: what the forwarder sent, dropped and failed, its
//! queue, limit and timings (counted by `kvevent-forwarder`), and whether the server can be
//! reached (the watch's probe).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kvevent_forwarder as fwd;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::{encode, lock};

/// Delivery's counters.
#[derive(Debug)]
pub struct Delivery {
    /// The forwarder's counters.
    pub forwarder: Arc<fwd::Metrics>,
    /// Reports not handed to the forwarder because it had shut down.
    pub reports_after_shutdown: AtomicU64,
    /// Unix time (ms) of the last stats report the server accepted.
    pub stats_last_success_unix_ms: AtomicU64,
    /// Why the server could not be reached at the last probe (`None`: reached, or not probed
    /// yet).
    pub server_unreachable: Mutex<Option<String>>,
    /// The server was probed at least once.
    pub server_probed: AtomicBool,
    /// A server is configured. Feed only, there is none, and no `kvevent_server_reachable`: a
    /// gauge of a server that does not exist would read 0 for good (and page someone).
    pub has_server: AtomicBool,
}

impl Delivery {
    /// Around the forwarder's counters.
    pub fn new(forwarder: Arc<fwd::Metrics>) -> Self {
        Self {
            forwarder,
            reports_after_shutdown: AtomicU64::new(0),
            stats_last_success_unix_ms: AtomicU64::new(0),
            server_unreachable: Mutex::new(None),
            server_probed: AtomicBool::new(false),
            has_server: AtomicBool::new(true),
        }
    }

    /// Unix time (ms) of the last report the server accepted, events or stats.
    pub fn last_success_unix_ms(&self) -> u64 {
        self.forwarder
            .last_success_unix_ms
            .load(Relaxed)
            .max(self.stats_last_success_unix_ms.load(Relaxed))
    }
}

/// Writes [`Delivery`].
#[derive(Debug)]
pub(crate) struct DeliveryCollector(pub(crate) Arc<Delivery>);

impl Collector for DeliveryCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let d = &*self.0;
        let f = &*d.forwarder;
        encode::single(
            &mut enc,
            true,
            "kvevent_prefixes_sent_total",
            "Prefix entries delivered to the server.",
            f.prefixes_sent.load(Relaxed),
        )?;
        encode::single(
            &mut enc,
            true,
            "kvevent_updates_sent_total",
            "CacheStateUpdates delivered to the server.",
            f.updates_sent.load(Relaxed),
        )?;
        {
            let mut m = encode::counter(
                &mut enc,
                "kvevent_events_sent_total",
                "CacheEvents delivered to the server, by type.",
            )?;
            encode::count(
                &mut m,
                &[("type", "prefix_evicted")],
                f.evictions_sent.load(Relaxed),
            )?;
            encode::count(
                &mut m,
                &[("type", "all_cleared")],
                f.clears_sent.load(Relaxed),
            )?;
        }
        {
            let mut m = encode::counter(
                &mut enc,
                "kvevent_rpc_errors_total",
                "Failed RPCs to the server, by gRPC code.",
            )?;
            for (i, c) in f.rpc_errors.iter().enumerate() {
                let v = c.load(Relaxed);
                if v > 0 {
                    let code = format!("{:?}", tonic::Code::from_i32(i as i32));
                    encode::count(&mut m, &[("code", &code)], v)?;
                }
            }
        }
        {
            let mut m = encode::counter(
                &mut enc,
                "kvevent_dropped_total",
                "Reports dropped instead of delivered, by kind and reason.",
            )?;
            for reason in fwd::DropReason::ALL {
                encode::count(
                    &mut m,
                    &[("kind", "prefix"), ("reason", reason.as_str())],
                    f.dropped_prefixes(reason),
                )?;
                encode::count(
                    &mut m,
                    &[("kind", "event"), ("reason", reason.as_str())],
                    f.dropped_events(reason),
                )?;
            }
            encode::count(
                &mut m,
                &[("kind", "report"), ("reason", "after_shutdown")],
                d.reports_after_shutdown.load(Relaxed),
            )?;
        }
        encode::single(
            &mut enc,
            false,
            "kvevent_queue_depth",
            "Pending prefix entries plus events.",
            f.queue_depth.load(Relaxed),
        )?;
        if d.has_server.load(Relaxed) {
            let unreachable = lock(&d.server_unreachable).is_some();
            encode::single(
                &mut enc,
                false,
                "kvevent_server_reachable",
                "1 when the last probe (a gRPC health check; any answer counts) reached the server, 0 when it did not.",
                u64::from(d.server_probed.load(Relaxed) && !unreachable),
            )?;
        }
        encode::single(
            &mut enc,
            false,
            "kvevent_in_flight_limit",
            "RPCs the forwarder lets be in flight now (adapted up to --max-in-flight).",
            f.in_flight_limit.load(Relaxed),
        )?;
        encode::single(
            &mut enc,
            true,
            "kvevent_coalesced_prefixes_total",
            "Prefix entries merged into a pending identical one.",
            f.coalesced.load(Relaxed),
        )?;
        encode::single(
            &mut enc,
            true,
            "kvevent_cancelled_total",
            "Adds and evictions not sent: a prefix stored and evicted again before either was sent.",
            f.cancelled.load(Relaxed),
        )?;
        encode::single(
            &mut enc,
            true,
            "kvevent_superseded_by_clear_total",
            "Pending reports discarded by a later clear.",
            f.superseded_by_clear.load(Relaxed),
        )?;
        encode::level(
            &mut encode::gauge(
                &mut enc,
                "kvevent_last_success_timestamp_seconds",
                "Unix time of the last report the server accepted.",
            )?,
            &[],
            d.last_success_unix_ms() as f64 / 1000.0,
        )?;
        let h = &f.histograms;
        {
            let mut m = encode::histogram(
                &mut enc,
                "kvevent_rpc_duration_seconds",
                "Durations of RPCs to the server (retries are separate calls), by method.",
            )?;
            encode::buckets(&mut m, &[("method", "ReportCacheState")], &h.report_seconds)?;
            encode::buckets(&mut m, &[("method", "PublishEvent")], &h.publish_seconds)?;
        }
        encode::buckets(
            &mut encode::histogram(
                &mut enc,
                "kvevent_report_age_seconds",
                "Engine batch time to server acknowledgement, per update and event delivered (includes the window and any outage).",
            )?,
            &[],
            &h.age_seconds,
        )?;
        encode::buckets(
            &mut encode::histogram(
                &mut enc,
                "kvevent_update_entries",
                "Prefix entries per CacheStateUpdate sent, after coalescing.",
            )?,
            &[],
            &h.update_entries,
        )?;
        encode::buckets(
            &mut encode::histogram(
                &mut enc,
                "kvevent_window_send_seconds",
                "Time a window took to send, first call to last answer (over the window: falling behind).",
            )?,
            &[],
            &h.window_send_seconds,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A feed-only sidecar exports no gauge of a server it does not have: one reading 0 for
    /// good fired the critical KVEventServerUnreachable on every such sidecar.
    #[test]
    fn server_reachable_is_exported_only_with_a_server() {
        let telemetry = crate::telemetry::Telemetry::new(Vec::new(), Vec::new(), Arc::default());
        assert!(
            telemetry
                .render()
                .contains("\nkvevent_server_reachable 0\n")
        );
        telemetry.delivery.has_server.store(false, Relaxed);
        assert!(!telemetry.render().contains("kvevent_server_reachable"));
    }
}
