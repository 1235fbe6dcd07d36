#![doc = include_str!("../README.md")]

#[cfg(feature = "http")]
mod fetch;
#[cfg(feature = "http")]
mod health;
mod load;
#[cfg(feature = "http")]
mod load_reader;
pub mod stats;
pub mod text;
pub mod url;

#[cfg(feature = "http")]
use std::time::Duration;

#[cfg(feature = "http")]
pub use fetch::{FetchError, Fetcher};
#[cfg(feature = "http")]
pub use health::EngineHealth;
pub use load::{Figure, Load, LoadError, RankLoad, read_load};
#[cfg(feature = "http")]
pub use load_reader::{LoadFailure, LoadReader};
pub use stats::{CacheTier, Profile, Reading, Stats, StatsConfig, StatsError};

/// Why a scrape produced no stats.
#[cfg(feature = "http")]
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

#[cfg(feature = "http")]
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
#[cfg(feature = "http")]
#[derive(Debug)]
pub struct Scraper {
    fetcher: Fetcher,
    config: StatsConfig,
    deltas: stats::Deltas,
}

#[cfg(feature = "http")]
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
    with_causes(e.to_string(), e)
}

/// `head`, then each cause in `e`'s chain that the line does not say already, joined by `: `:
/// [`error_chain`] with words of the caller's own in place of `e`'s (tonic's "transport error"
/// says less than its causes).
pub fn with_causes(mut head: String, e: &dyn std::error::Error) -> String {
    let mut source = e.source();
    while let Some(s) = source {
        let cause = s.to_string();
        if !head.contains(&cause) {
            head.push_str(": ");
            head.push_str(&cause);
        }
        source = s.source();
    }
    head
}
