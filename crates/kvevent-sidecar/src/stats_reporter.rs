//! The stats loop: scrape the engine, report a stats-only update, on its own cadence.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use kvevent_forwarder as fwd;
use kvevent_mapper::Identity;
use kvevent_proto as pb;
use kvevent_scrape::Scraper;
use tokio::sync::watch;

use crate::telemetry::Telemetry;

/// `client_version` in every ReplicaStats.
pub const CLIENT_VERSION: &str = concat!("kvevent-subscriber/", env!("CARGO_PKG_VERSION"));

pub(crate) struct StatsReporter {
    pub(crate) scraper: Scraper,
    pub(crate) client: fwd::Client,
    pub(crate) identity: Identity,
    pub(crate) interval: Duration,
    pub(crate) telemetry: Arc<Telemetry>,
}

fn now() -> (i64, u64) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_micros() as i64, d.as_millis() as u64)
}

impl StatsReporter {
    /// Ticks until `stop` changes. A failed scrape or RPC logs, counts and skips the tick.
    pub(crate) async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.changed() => return,
            }
            let started = std::time::Instant::now();
            let scraped = self.scraper.scrape().await;
            self.telemetry
                .scrapes
                .seconds
                .observe(started.elapsed().as_secs_f64());
            let stats = match scraped {
                Ok(stats) => {
                    self.telemetry.scrapes.scrape("ok");
                    self.count_gaps(&stats);
                    stats
                }
                Err(e) => {
                    tracing::warn!(url = %self.scraper.url(), error = %error_chain(&e), "engine metrics scrape failed; skipping this tick");
                    self.telemetry.scrapes.scrape(e.kind());
                    continue;
                }
            };
            let (ts_us, ts_ms) = now();
            let mut update = self.identity.update(ts_us);
            update.stats = Some(pb::ReplicaStats {
                replica_id: self.identity.replica_id().to_owned(),
                cache_memory_bytes: stats.cache_memory_bytes,
                hit_rate: stats.hit_rate,
                pressure: stats.pressure,
                client_version: CLIENT_VERSION.into(),
                t2_hit_tokens: stats.t2_hit_tokens,
                t2_query_tokens: stats.t2_query_tokens,
            });
            match self.client.report(vec![update]).await {
                Ok(ack) if ack.accepted => {
                    self.telemetry.scrapes.stats_report("ok");
                    self.telemetry
                        .delivery
                        .stats_last_success_unix_ms
                        .store(ts_ms, Relaxed);
                }
                Ok(ack) => {
                    tracing::warn!(reason = %ack.reason_code, "server did not accept the stats");
                    self.telemetry.scrapes.stats_report("rejected");
                }
                Err(status) => {
                    tracing::warn!(code = ?status.code(), message = status.message(), "stats report failed; skipping this tick");
                    self.telemetry.scrapes.stats_report("rpc_error");
                }
            }
        }
    }
}

impl StatsReporter {
    /// Counts what the scrape lacked; says so once per series (the stat is reported as 0).
    fn count_gaps(&self, stats: &kvevent_scrape::Stats) {
        self.telemetry
            .scrapes
            .non_finite
            .fetch_add(stats.non_finite, Relaxed);
        let mut absent = self
            .telemetry
            .scrapes
            .absent
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for series in &stats.absent {
            let n = absent.entry(series).or_default();
            if *n == 0 {
                tracing::warn!(
                    series,
                    "engine metrics lack this series: its stat is reported as 0 (unknown)"
                );
            }
            *n += 1;
        }
    }
}

/// `a: b: c` from an error and its sources (written once, with discovery's words).
use kvevent_scrape::error_chain;
