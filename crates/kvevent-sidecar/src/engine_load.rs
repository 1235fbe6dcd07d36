//! With a router feed: the engine's load (requests running and waiting, KV-cache usage, per DP
//! rank), read from its `/metrics` on a cadence of its own and handed to the hub, which sends
//! it to routers as it changes. One read at a time, each bounded by a deadline; it never
//! touches the events thread. A read that fails or says nonsense leaves the last load to age
//! (routers see its age and the reason) and is logged when the reason changes, at most once
//! every [`LOG_EVERY`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvevent_scrape::LoadReader;
use tokio::sync::watch;

use crate::telemetry::Telemetry;

/// The fewest seconds between two warnings of failing reads.
const LOG_EVERY: Duration = Duration::from_secs(10);

pub(crate) struct EngineLoad {
    pub(crate) reader: LoadReader,
    pub(crate) interval: Duration,
    pub(crate) hub: Arc<kvevent_feed::Hub>,
    pub(crate) telemetry: Arc<Telemetry>,
}

impl EngineLoad {
    /// Reads every `interval` until `stop` changes.
    pub(crate) async fn run(self, mut stop: watch::Receiver<bool>) {
        // The kind of the failing reads, and when a warning was last written.
        let mut failing: Option<&'static str> = None;
        let mut logged: Option<Instant> = None;
        let reads = self.reader.run(self.interval, |read| match read {
            Ok(load) => {
                self.telemetry.scrapes.load_read("ok");
                self.hub.set_load(load);
                if failing.take().is_some() {
                    tracing::info!(url = %self.reader.url(), "the engine's load is read again");
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
        });
        tokio::select! {
            () = reads => {}
            _ = stop.changed() => {}
        }
    }
}
