//! Scrapes an inference engine's Prometheus `/metrics` into replica stats.
//!
//! - [`text`]: a pure parser of the Prometheus text format and OpenMetrics (HELP/TYPE, label
//!   escaping, NaN and ±Inf, timestamps, `# EOF`, counters with or without `_total`, names
//!   written with `_` for `:`).
//! - [`stats`]: engine profiles (vLLM current and legacy names, SGLang; detected or set), the
//!   `model_name` filter, SGLang's `priority` breakdowns left out of their totals, aggregation
//!   over DP engines (sums for counters and request gauges, mean for usage), the hit rate
//!   between scrapes, offload-tier counters as running totals, pressure. NaN and ±Inf samples
//!   are skipped and counted. A series the engine lacks is reported as 0 ("unknown") and named
//!   in [`Stats::absent`]; only an exposition with none of the profile's series fails.
//! - [`read_load`]: an engine's load for routers (requests running and waiting, KV-cache
//!   usage, per DP rank), refused whole when a series is missing or a value is not sane.
//! - [`Fetcher`]: one HTTP GET (hyper), bounded in time and body size, gzip handled: the
//!   workspace's client of an engine's HTTP server ([`EngineHealth`]: its `/health`;
//!   `kvevent-discovery`: its listing of KV-event endpoints). [`error_chain`] words an error
//!   with its causes, as every log line and answer of the workspace does.
//! - [`Scraper`]: the three together, keeping the previous scrape for deltas.
//!
//! It knows nothing of gRPC: the caller wraps [`Stats`] in its report. Scraping is a failure
//! domain of its own: an error here never touches the event path.
//!
//! ```
//! use kvevent_scrape::{stats, text, StatsConfig};
//!
//! let scrape = |running: f64, hits: f64, queries: f64| format!(
//!     "vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}\n\
//!      vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} 1\n\
//!      vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} 0.25\n\
//!      vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"m\"}} {hits}\n\
//!      vllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"m\"}} {queries}\n");
//! let config = StatsConfig { cache_size_bytes: 1 << 30, concurrency_ceiling: 8, ..StatsConfig::default() };
//! let mut deltas = stats::Deltas::default();
//! let first = stats::read(&text::parse(&scrape(3.0, 10.0, 100.0))?, &config)?;
//! deltas.next(first, &config);
//! // The hit rate is over what happened between two scrapes: 40 hits of 50 queries.
//! let second = stats::read(&text::parse(&scrape(4.0, 50.0, 150.0))?, &config)?;
//! let s = deltas.next(second, &config);
//! assert!((s.hit_rate - 0.8).abs() < 1e-6);
//! assert_eq!(s.cache_memory_bytes, 1 << 28);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod fetch;
mod health;
mod load;
pub mod stats;
pub mod text;

use std::time::Duration;

pub use fetch::{FetchError, Fetcher};
pub use health::EngineHealth;
pub use load::{Load, LoadError, RankLoad, read_load};
pub use stats::{CacheTier, Profile, Reading, Stats, StatsConfig, StatsError};

/// Why a scrape produced no stats.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The HTTP exchange failed.
    #[error("fetch")]
    Fetch(#[from] FetchError),
    /// The body is not exposition text.
    #[error("parse")]
    Parse(#[from] text::ParseError),
    /// The exposition lacks what the profile needs.
    #[error("stats")]
    Stats(#[from] StatsError),
}

impl ScrapeError {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Fetch(e) => e.kind(),
            Self::Parse(_) => "parse",
            Self::Stats(_) => "missing_series",
        }
    }
}

/// Fetch, parse, read and diff, one scrape at a time.
#[derive(Debug)]
pub struct Scraper {
    fetcher: Fetcher,
    config: StatsConfig,
    deltas: stats::Deltas,
}

impl Scraper {
    /// The URL it scrapes.
    pub fn url(&self) -> &http::Uri {
        self.fetcher.uri()
    }

    /// A scraper of `url`. Bodies over `max_body` bytes are refused.
    pub fn new(
        url: &str,
        timeout: Duration,
        max_body: usize,
        config: StatsConfig,
    ) -> Result<Self, FetchError> {
        Ok(Self {
            fetcher: Fetcher::new(url, timeout, max_body)?,
            config,
            deltas: stats::Deltas::default(),
        })
    }

    /// Scrapes once. A failed scrape leaves the previous reading as the base for deltas.
    pub async fn scrape(&mut self) -> Result<Stats, ScrapeError> {
        let body = self.fetcher.fetch().await?;
        let exposition = text::parse(&body)?;
        let reading = stats::read(&exposition, &self.config)?;
        Ok(self.deltas.next(reading, &self.config))
    }
}

/// `a: b: c` from an error and its causes, a cause its line already says left out (hyper's
/// errors repeat their source's text): how the sidecar, the tools and the Fleet word an error.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let cause = s.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
        source = s.source();
    }
    text
}
