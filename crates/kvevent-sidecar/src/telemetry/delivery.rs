//! Delivery to the InferenceCache server: what the forwarder sent, dropped and failed, its
//! queue, limit and timings (counted, and written, by `kvevent-forwarder`: its `collector`),
//! and what the sidecar knows beside it (whether the server can be reached: the watch's probe).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kvevent_forwarder as fwd;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::lock;

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
        let around = fwd::collector::Around {
            reports_after_shutdown: d.reports_after_shutdown.load(Relaxed),
            server_reachable: d
                .has_server
                .load(Relaxed)
                .then(|| d.server_probed.load(Relaxed) && lock(&d.server_unreachable).is_none()),
            last_success_unix_ms: d.stats_last_success_unix_ms.load(Relaxed),
        };
        fwd::collector::encode(&mut enc, &d.forwarder, &around)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A feed-only sidecar exports no gauge of a server it does not have: one reading 0 for
    /// good fired the critical KVEventServerUnreachable on every such sidecar.
    #[test]
    fn server_reachable_is_exported_only_with_a_server() {
        let telemetry =
            crate::telemetry::Telemetry::new(Vec::new(), Vec::new(), Vec::new(), Arc::default());
        assert!(
            telemetry
                .render()
                .contains("\nkvevent_server_reachable 0\n")
        );
        telemetry.delivery.has_server.store(false, Relaxed);
        assert!(!telemetry.render().contains("kvevent_server_reachable"));
    }
}
