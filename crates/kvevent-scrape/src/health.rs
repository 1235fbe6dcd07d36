//! An engine's HTTP server, asked at `/health`: the one check a sidecar makes for its feed and
//! a `Fleet` makes of an engine it follows directly. An engine's cache may be known while it
//! serves nothing (vLLM's API server gone, its engine core publishing on): a router must not
//! send it requests then.

use std::time::Duration;

use crate::{FetchError, Fetcher, error_chain};

/// `GET http://HOST:PORT/health`, bounded in time.
#[derive(Debug, Clone)]
pub struct EngineHealth {
    fetcher: Fetcher,
    url: String,
}

impl EngineHealth {
    /// The check of the server at `base` (`http://HOST:PORT`, a trailing `/` allowed, no
    /// path), each ask bounded by `timeout`.
    pub fn new(base: &str, timeout: Duration) -> Result<Self, FetchError> {
        let base = crate::url::server_url(base)?;
        let url = format!("{base}/health");
        Ok(Self {
            fetcher: Fetcher::new(&url, timeout, 64 << 10)?,
            url,
        })
    }

    /// The URL asked.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// One ask: `None` when the server answers with a success, else why not, in words
    /// (`URL: cause: cause`).
    pub async fn ask(&self) -> Option<String> {
        match self.fetcher.fetch().await {
            Ok(_) => None,
            Err(e) => Some(format!("{}: {}", self.url, error_chain(&e))),
        }
    }

    /// Asks every `every` (the first at once) for as long as it is polled, handing each answer
    /// to `answered`, which decides what one that did not change is worth.
    pub async fn run(&self, every: Duration, mut answered: impl FnMut(Option<String>)) {
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            ticker.tick().await;
            answered(self.ask().await);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::EngineHealth;
    use std::time::Duration;

    #[test]
    fn only_a_server_is_taken() {
        let ok = EngineHealth::new("http://127.0.0.1:8000/", Duration::from_secs(1)).expect("ok");
        assert_eq!(ok.url(), "http://127.0.0.1:8000/health");
        for bad in [
            "127.0.0.1:8000",
            "http://",
            "http://h:1/metrics",
            "https://h:1",
        ] {
            assert!(
                EngineHealth::new(bad, Duration::from_secs(1)).is_err(),
                "{bad}"
            );
        }
    }

    /// Nothing listens: the answer names the URL and the innermost cause once.
    #[tokio::test]
    async fn a_server_that_does_not_answer_says_why() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let check = EngineHealth::new(&format!("http://127.0.0.1:{port}"), Duration::from_secs(1))
            .expect("check");
        let why = check.ask().await.expect("not answering");
        assert!(
            why.starts_with(&format!("http://127.0.0.1:{port}/health: ")),
            "{why}"
        );
        assert_eq!(why.matches("Connection refused").count(), 1, "{why}");
    }
}
