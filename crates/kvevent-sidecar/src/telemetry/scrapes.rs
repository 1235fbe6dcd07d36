//! Engine `/metrics` scrapes and the stats reports made from them, counted by the stats
//! reporter; the reads of the engine's load for the feed, counted by their task.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kvevent_forwarder as fwd;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::{encode, lock};

/// Bounds of the scrape duration histogram, in seconds.
const SCRAPE_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// The scrapes' and stats reports' counters.
#[derive(Debug)]
pub struct Scrapes {
    /// Scrapes by outcome (`ok` or the error kind).
    pub outcomes: Mutex<BTreeMap<&'static str, u64>>,
    /// Stats reports by outcome (`ok`, `rejected`, `rpc_error`).
    pub stats_reports: Mutex<BTreeMap<&'static str, u64>>,
    /// Reads of the engine's load for the feed, by outcome (`ok` or the error kind).
    pub load_reads: Mutex<BTreeMap<&'static str, u64>>,
    /// Scrapes that lacked a series the stats use (reported as 0), by series.
    pub absent: Mutex<BTreeMap<&'static str, u64>>,
    /// Samples skipped because they were NaN or ±Inf.
    pub non_finite: AtomicU64,
    /// Scrape durations.
    pub seconds: fwd::Histogram,
}

impl Default for Scrapes {
    fn default() -> Self {
        Self {
            outcomes: Mutex::default(),
            stats_reports: Mutex::default(),
            load_reads: Mutex::default(),
            absent: Mutex::default(),
            non_finite: AtomicU64::new(0),
            seconds: fwd::Histogram::new(SCRAPE_SECONDS),
        }
    }
}

impl Scrapes {
    /// Counts one scrape outcome.
    pub fn scrape(&self, outcome: &'static str) {
        *lock(&self.outcomes).entry(outcome).or_default() += 1;
    }

    /// Counts one read of the engine's load.
    pub fn load_read(&self, outcome: &'static str) {
        *lock(&self.load_reads).entry(outcome).or_default() += 1;
    }

    /// Counts one stats report outcome.
    pub fn stats_report(&self, outcome: &'static str) {
        *lock(&self.stats_reports).entry(outcome).or_default() += 1;
    }
}

/// Writes [`Scrapes`].
#[derive(Debug)]
pub(crate) struct ScrapesCollector(pub(crate) Arc<Scrapes>);

impl Collector for ScrapesCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = &*self.0;
        encode::buckets(
            &mut encode::histogram(
                &mut enc,
                "kvevent_scrape_duration_seconds",
                "Durations of engine /metrics scrapes (fetch and parse).",
            )?,
            &[],
            &s.seconds,
        )?;
        {
            let mut f = encode::counter(
                &mut enc,
                "kvevent_scrapes_total",
                "Engine metrics scrapes, by outcome.",
            )?;
            for (outcome, v) in lock(&s.outcomes).iter() {
                encode::count(&mut f, &[("outcome", outcome)], *v)?;
            }
        }
        {
            let mut f = encode::counter(
                &mut enc,
                "kvevent_scrape_series_absent_total",
                "Scrapes that lacked a series the stats use (reported as 0, unknown), by series.",
            )?;
            for (series, v) in lock(&s.absent).iter() {
                encode::count(&mut f, &[("series", series)], *v)?;
            }
        }
        encode::count(
            &mut encode::counter(
                &mut enc,
                "kvevent_scrape_non_finite_samples_total",
                "Scraped samples skipped because they were NaN or +-Inf.",
            )?,
            &[],
            s.non_finite.load(Relaxed),
        )?;
        {
            let mut f = encode::counter(
                &mut enc,
                "kvevent_engine_load_reads_total",
                "Reads of the engine's load (requests running and waiting, KV usage) for the router feed, by outcome.",
            )?;
            for (outcome, v) in lock(&s.load_reads).iter() {
                encode::count(&mut f, &[("outcome", outcome)], *v)?;
            }
        }
        let mut f = encode::counter(
            &mut enc,
            "kvevent_stats_reports_total",
            "Stats reports, by outcome.",
        )?;
        for (outcome, v) in lock(&s.stats_reports).iter() {
            encode::count(&mut f, &[("outcome", outcome)], *v)?;
        }
        Ok(())
    }
}
