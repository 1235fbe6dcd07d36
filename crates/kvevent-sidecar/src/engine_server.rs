//! With a router feed: the engine's HTTP server, asked at `/health` on its own cadence. Its
//! cache may be known while it serves nothing (vLLM's API server gone, its engine core
//! publishing on): the feed says so, and routers do not send it requests.

use std::sync::Arc;
use std::time::Duration;

use kvevent_scrape::EngineHealth;
use tokio::sync::watch;

pub(crate) struct EngineServer {
    pub(crate) check: EngineHealth,
    pub(crate) interval: Duration,
    pub(crate) hub: Arc<kvevent_feed::Hub>,
}

impl EngineServer {
    /// Asks every `interval` until `stop` changes; tells the hub when the answer changes, and
    /// logs it then (never once a tick).
    pub(crate) async fn run(self, mut stop: watch::Receiver<bool>) {
        let mut failing: Option<String> = None;
        let url = self.check.url().to_owned();
        let watch = self.check.run(self.interval, |now| {
            if now != failing {
                match &now {
                    Some(why) => {
                        tracing::warn!(error = %why, "the engine's HTTP server does not answer its health check: routers following the feed see the replica degraded")
                    }
                    None => {
                        tracing::info!(%url, "the engine's HTTP server answers its health check again")
                    }
                }
                self.hub.set_engine_server(now.clone());
                failing = now;
            }
        });
        tokio::select! {
            () = watch => {}
            _ = stop.changed() => {}
        }
    }
}
