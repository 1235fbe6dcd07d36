//! An engine's load read from its `/metrics` on a cadence: the one reading task of the
//! workspace, run by a sidecar for its router feed and by a `Fleet` for an engine it follows
//! directly. One read at a time, each bounded by the fetcher's timeout; what each read gave is
//! handed to the caller, who keeps the last good load to age and says why reads fail.

use std::time::Duration;

use crate::{FetchError, Fetcher, Load, StatsConfig, error_chain, read_load, text};

/// Reads an engine's load from its `/metrics`.
#[derive(Debug)]
pub struct LoadReader {
    fetcher: Fetcher,
    config: StatsConfig,
}

/// Why one read gave no load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadFailure {
    /// A short label for metrics: the fetch's kind (`timeout`, `status`, ...), `parse`, or the
    /// load's (`missing_series`, `nonsense`, `unknown_engine`).
    pub kind: &'static str,
    /// In the workspace's words: `URL: cause: cause`.
    pub why: String,
}

impl LoadReader {
    /// A reader of `url` (`http://HOST:PORT/metrics`), each read bounded by `timeout` and
    /// `max_body` bytes, read with `config`'s profile and model filter.
    pub fn new(
        url: &str,
        timeout: Duration,
        max_body: usize,
        config: StatsConfig,
    ) -> Result<Self, FetchError> {
        Ok(Self {
            fetcher: Fetcher::new(url, timeout, max_body)?,
            config,
        })
    }

    /// The URL read.
    pub fn url(&self) -> &http::Uri {
        self.fetcher.uri()
    }

    /// One read: fetched, parsed, read as a load.
    pub async fn read(&self) -> Result<Load, LoadFailure> {
        let failure = |e: &(dyn std::error::Error + 'static), kind| LoadFailure {
            kind,
            why: format!("{}: {}", self.fetcher.uri(), error_chain(e)),
        };
        let body = self
            .fetcher
            .fetch()
            .await
            .map_err(|e| failure(&e, e.kind()))?;
        let exposition = text::parse(&body).map_err(|e| failure(&e, "parse"))?;
        read_load(&exposition, &self.config).map_err(|e| failure(&e, e.kind()))
    }

    /// Reads every `interval` (the first at once; a read slower than that delays the next),
    /// handing each outcome to `on`, for as long as the future is polled.
    pub async fn run(&self, interval: Duration, mut on: impl FnMut(Result<Load, LoadFailure>)) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            ticker.tick().await;
            on(self.read().await);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_read_that_fails_says_where_and_why_with_its_kind() {
        // Nothing listens on port 1.
        let reader = LoadReader::new(
            "http://127.0.0.1:1/metrics",
            Duration::from_secs(1),
            1 << 20,
            StatsConfig::default(),
        )
        .expect("reader");
        let failure = reader.read().await.expect_err("no server");
        assert_eq!(failure.kind, "request", "{failure:?}");
        assert!(
            failure.why.starts_with("http://127.0.0.1:1/metrics: "),
            "{failure:?}"
        );
    }
}
