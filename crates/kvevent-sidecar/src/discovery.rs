//! Endpoint discovery for the sidecar: the listing's rules are `kvevent-discovery`'s; here,
//! the watcher that reads the listing again when a rank's connection is lost for good.

use std::time::{Duration, Instant};

pub use kvevent_discovery::{DiscoveryError, discover, discover_patiently, parse};
use kvevent_zmq as transport;

/// Reads the listing again when a rank's connection is lost for good: disconnected and no
/// batch for `lost_for_good`. When the listing names other endpoints it says so on the
/// channel; when it names the same ones, libzmq keeps reconnecting.
pub(crate) struct Watcher {
    pub(crate) lost_for_good: Duration,
    pub(crate) url: String,
    pub(crate) timeout: Duration,
    pub(crate) topic: Vec<u8>,
    pub(crate) current: Vec<transport::Source>,
    pub(crate) metrics: Vec<std::sync::Arc<kvevent_source::SourceMetrics>>,
}

impl Watcher {
    pub(crate) async fn run(self, changed: tokio::sync::watch::Sender<Option<String>>) {
        use std::sync::atomic::Ordering::Relaxed;
        let read = |m: &kvevent_source::SourceMetrics| {
            (m.disconnects.load(Relaxed), m.batches.load(Relaxed))
        };
        let mut seen: Vec<(u64, u64)> = self.metrics.iter().map(|m| read(m)).collect();
        // Per source: since when it has been disconnected with no batch, and the batch count then.
        let mut lost: Vec<Option<(Instant, u64)>> = vec![None; self.metrics.len()];
        let every =
            (self.lost_for_good / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            tokio::time::sleep(every).await;
            let mut recheck = false;
            for (i, m) in self.metrics.iter().enumerate() {
                let (disconnects, batches) = read(m);
                if disconnects > seen[i].0 && lost[i].is_none() {
                    lost[i] = Some((Instant::now(), batches));
                }
                if let Some((since, at)) = lost[i] {
                    if batches > at {
                        lost[i] = None;
                    } else if since.elapsed() >= self.lost_for_good {
                        recheck = true;
                    }
                }
                seen[i] = (disconnects, batches);
            }
            if !recheck {
                continue;
            }
            match discover(&self.url, self.timeout, &self.topic).await {
                Ok(now) if now != self.current => {
                    let what = format!(
                        "engine endpoints changed: {:?} -> {:?}",
                        self.current
                            .iter()
                            .map(transport::Source::label)
                            .collect::<Vec<_>>(),
                        now.iter().map(transport::Source::label).collect::<Vec<_>>()
                    );
                    tracing::warn!(url = %self.url, "{what}");
                    let _ = changed.send(Some(what));
                    return;
                }
                Ok(_) => {
                    tracing::info!(url = %self.url, "a rank's connection is lost, but the engine still lists the same endpoints: reconnecting");
                    lost.iter_mut().for_each(|l| *l = None);
                }
                Err(e) => {
                    tracing::warn!(url = %self.url, error = %kvevent_scrape::error_chain(&e), "a rank's connection is lost and the endpoint listing does not answer; reading it again later");
                    lost.iter_mut()
                        .for_each(|l| *l = l.map(|(_, at)| (Instant::now(), at)));
                }
            }
        }
    }
}
