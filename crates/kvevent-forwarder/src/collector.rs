//! The forwarder's families for a `/metrics` (feature `metrics`): what [`Metrics`] counted,
//! written at each scrape, with the facts its owner keeps beside it ([`Around`]).

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;

use kvevent_metrics as fam;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder};

use crate::{DropReason, Histogram, Metrics};

/// What the forwarder's owner knows beside it, written among its families.
#[derive(Debug, Clone, Copy, Default)]
pub struct Around {
    /// Reports not handed to the forwarder because it had shut down
    /// (`kvevent_dropped_total{kind="report",reason="after_shutdown"}`).
    pub reports_after_shutdown: u64,
    /// Whether the server answered the last probe (`kvevent_server_reachable`); `None`: no
    /// server, and no such gauge (one reading 0 for good would page someone).
    pub server_reachable: Option<bool>,
    /// Unix ms of the last report the server accepted outside the forwarder (stats); the later
    /// of it and the forwarder's is `kvevent_last_success_timestamp_seconds`.
    pub last_success_unix_ms: u64,
}

/// Writes the families of `f`, with what its owner knows beside it.
pub fn encode(enc: &mut DescriptorEncoder<'_>, f: &Metrics, sidecar: &Around) -> fmt::Result {
    fam::single(
        enc,
        true,
        "kvevent_prefixes_sent_total",
        "Prefix entries delivered to the server.",
        f.prefixes_sent.load(Relaxed),
    )?;
    fam::single(
        enc,
        true,
        "kvevent_updates_sent_total",
        "CacheStateUpdates delivered to the server.",
        f.updates_sent.load(Relaxed),
    )?;
    {
        let mut m = fam::counter(
            enc,
            "kvevent_events_sent_total",
            "CacheEvents delivered to the server, by type.",
        )?;
        fam::count(
            &mut m,
            &[("type", "prefix_evicted")],
            f.evictions_sent.load(Relaxed),
        )?;
        fam::count(
            &mut m,
            &[("type", "all_cleared")],
            f.clears_sent.load(Relaxed),
        )?;
    }
    {
        let mut m = fam::counter(
            enc,
            "kvevent_rpc_errors_total",
            "Failed RPCs to the server, by gRPC code.",
        )?;
        for (i, c) in f.rpc_errors.iter().enumerate() {
            let v = c.load(Relaxed);
            if v > 0 {
                let code = format!("{:?}", tonic::Code::from_i32(i as i32));
                fam::count(&mut m, &[("code", &code)], v)?;
            }
        }
    }
    {
        let mut m = fam::counter(
            enc,
            "kvevent_dropped_total",
            "Reports dropped instead of delivered, by kind and reason.",
        )?;
        for reason in DropReason::ALL {
            fam::count(
                &mut m,
                &[("kind", "prefix"), ("reason", reason.as_str())],
                f.dropped_prefixes(reason),
            )?;
            fam::count(
                &mut m,
                &[("kind", "event"), ("reason", reason.as_str())],
                f.dropped_events(reason),
            )?;
        }
        fam::count(
            &mut m,
            &[("kind", "report"), ("reason", "after_shutdown")],
            sidecar.reports_after_shutdown,
        )?;
    }
    fam::single(
        enc,
        false,
        "kvevent_queue_depth",
        "Pending prefix entries plus events.",
        f.queue_depth.load(Relaxed),
    )?;
    if let Some(reachable) = sidecar.server_reachable {
        fam::single(
            enc,
            false,
            "kvevent_server_reachable",
            "1 when the last probe (a gRPC health check; any answer counts) reached the server, 0 when it did not.",
            u64::from(reachable),
        )?;
    }
    fam::single(
        enc,
        false,
        "kvevent_in_flight_limit",
        "RPCs the forwarder lets be in flight now (adapted up to --max-in-flight).",
        f.in_flight_limit.load(Relaxed),
    )?;
    fam::single(
        enc,
        true,
        "kvevent_coalesced_prefixes_total",
        "Prefix entries merged into a pending identical one.",
        f.coalesced.load(Relaxed),
    )?;
    fam::single(
        enc,
        true,
        "kvevent_cancelled_total",
        "Adds and evictions not sent: a prefix stored and evicted again before either was sent.",
        f.cancelled.load(Relaxed),
    )?;
    fam::single(
        enc,
        true,
        "kvevent_superseded_by_clear_total",
        "Pending reports discarded by a later clear.",
        f.superseded_by_clear.load(Relaxed),
    )?;
    fam::level(
        &mut fam::gauge(
            enc,
            "kvevent_last_success_timestamp_seconds",
            "Unix time of the last report the server accepted.",
        )?,
        &[],
        f.last_success_unix_ms
            .load(Relaxed)
            .max(sidecar.last_success_unix_ms) as f64
            / 1000.0,
    )?;
    let h = &f.histograms;
    {
        let mut m = fam::histogram(
            enc,
            "kvevent_rpc_duration_seconds",
            "Durations of RPCs to the server (retries are separate calls), by method.",
        )?;
        buckets(&mut m, &[("method", "ReportCacheState")], &h.report_seconds)?;
        buckets(&mut m, &[("method", "PublishEvent")], &h.publish_seconds)?;
    }
    buckets(
        &mut fam::histogram(
            enc,
            "kvevent_report_age_seconds",
            "Engine batch time to server acknowledgement, per update and event delivered (includes the window and any outage).",
        )?,
        &[],
        &h.age_seconds,
    )?;
    buckets(
        &mut fam::histogram(
            enc,
            "kvevent_update_entries",
            "Prefix entries per CacheStateUpdate sent, after coalescing.",
        )?,
        &[],
        &h.update_entries,
    )?;
    buckets(
        &mut fam::histogram(
            enc,
            "kvevent_window_send_seconds",
            "Time a window took to send, first call to last answer (over the window: falling behind).",
        )?,
        &[],
        &h.window_send_seconds,
    )
}

/// One histogram's buckets, sum and count.
fn buckets(family: &mut MetricEncoder<'_>, labels: fam::Labels<'_>, h: &Histogram) -> fmt::Result {
    let (cumulative, sum, count) = h.snapshot();
    fam::buckets(family, labels, &cumulative, sum, count)
}
