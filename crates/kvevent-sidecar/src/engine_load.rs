//! With a router feed: the engine's load (requests running and waiting, KV-cache usage, per DP
//! rank), read from its `/metrics` on a cadence of its own and handed to the hub, which sends
//! it to routers as it changes. One read at a time, each bounded by a deadline; it never
//! touches the events thread. A read that fails or says nonsense leaves the last load to age
//! (routers see its age and the reason) and is logged when the reason changes, at most once
//! every [`LOG_EVERY`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvevent_scrape::{Fetcher, StatsConfig};
use tokio::sync::watch;

use crate::telemetry::Telemetry;

/// The fewest seconds between two warnings of failing reads.
const LOG_EVERY: Duration = Duration::from_secs(10);

pub(crate) struct EngineLoad {
    pub(crate) fetcher: Fetcher,
    pub(crate) url: String,
    pub(crate) config: StatsConfig,
    pub(crate) interval: Duration,
    pub(crate) hub: Arc<kvevent_feed::Hub>,
    pub(crate) telemetry: Arc<Telemetry>,
}

/// Why one read gave no load, in our words, and its kind.
fn read_error(url: &str, e: &(dyn std::error::Error + 'static), kind: &'static str) -> Failure {
    Failure {
        kind,
        why: format!("{url}: {}", crate::stats_reporter::error_chain(e)),
    }
}

struct Failure {
    kind: &'static str,
    why: String,
}

impl EngineLoad {
    /// One read: fetched, parsed, read as a load.
    async fn read(&self) -> Result<kvevent_scrape::Load, Failure> {
        let body = self
            .fetcher
            .fetch()
            .await
            .map_err(|e| read_error(&self.url, &e, e.kind()))?;
        let exposition =
            kvevent_scrape::text::parse(&body).map_err(|e| read_error(&self.url, &e, "parse"))?;
        kvevent_scrape::read_load(&exposition, &self.config)
            .map_err(|e| read_error(&self.url, &e, e.kind()))
    }

    /// Reads every `interval` until `stop` changes.
    pub(crate) async fn run(self, mut stop: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        // The kind of the failing reads, and when a warning was last written.
        let mut failing: Option<&'static str> = None;
        let mut logged: Option<Instant> = None;
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.changed() => return,
            }
            match self.read().await {
                Ok(load) => {
                    self.telemetry.scrapes.load_read("ok");
                    let ranks: Vec<kvevent_feed::RankLoad> = load
                        .ranks
                        .iter()
                        .map(|r| kvevent_feed::RankLoad {
                            rank: r.rank,
                            running: r.running,
                            waiting: r.waiting,
                            kv_usage: r.kv_usage,
                        })
                        .collect();
                    self.hub.set_load(&ranks);
                    if failing.take().is_some() {
                        tracing::info!(url = %self.url, "the engine's load is read again");
                    }
                }
                Err(f) => {
                    self.telemetry.scrapes.load_read(f.kind);
                    let due = logged.is_none_or(|t| t.elapsed() >= LOG_EVERY);
                    if failing != Some(f.kind) && due {
                        tracing::warn!(
                            error = %f.why,
                            "the engine's load cannot be read: routers following the feed see its last load age, and weigh this replica without it once it is old"
                        );
                        logged = Some(Instant::now());
                        failing = Some(f.kind);
                    }
                    self.hub.set_load_error(f.why);
                }
            }
        }
    }
}
