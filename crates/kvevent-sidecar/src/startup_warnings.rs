//! Says, within seconds of the start and then at a bounded rate, what does not answer: an
//! engine socket with no connection, a server that cannot be reached. Nobody should have to
//! read a counter to learn that nothing listens at either end.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use kvevent_forwarder as fwd;
use tokio::time::Instant;

use crate::telemetry::Telemetry;

/// The first look, after the start: time for a local engine or server to accept.
const FIRST_LOOK: Duration = Duration::from_secs(3);
/// How often the sockets are looked at and the server probed.
const EVERY: Duration = Duration::from_secs(5);
/// A warning about the same thing is repeated at most this often while it lasts.
const REPEAT: Duration = Duration::from_secs(30);

pub(crate) struct Watch {
    /// The server's client; none for a feed-only sidecar (nothing to probe, nothing to warn).
    pub(crate) client: Option<fwd::Client>,
    pub(crate) telemetry: Arc<Telemetry>,
    /// The engine sockets bind (the engine connects to us) rather than connect.
    pub(crate) engine_binds: bool,
    /// Bound on one probe of the server.
    pub(crate) connect_timeout: Duration,
}

/// When a warning was last given about one thing, while it lasts.
#[derive(Default)]
struct Said(Option<Instant>);

impl Said {
    /// True when the warning is due (first time, or `REPEAT` since the last).
    fn due(&mut self, now: Instant) -> bool {
        if self.0.is_some_and(|at| now < at + REPEAT) {
            return false;
        }
        self.0 = Some(now);
        true
    }

    /// It no longer lasts: true when a warning had been given.
    fn over(&mut self) -> bool {
        self.0.take().is_some()
    }
}

impl Watch {
    /// Runs until `stop` turns true.
    pub(crate) async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut engines: Vec<Said> = self
            .telemetry
            .sources
            .labels
            .iter()
            .map(|_| Said::default())
            .collect();
        let mut server = Said::default();
        let mut wait = FIRST_LOOK;
        loop {
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            wait = EVERY;
            let now = Instant::now();
            self.look_at_engines(&mut engines, now);
            if let Some(client) = &self.client {
                self.probe_server(client, &mut server, now).await;
            }
        }
    }

    fn look_at_engines(&self, said: &mut [Said], now: Instant) {
        let t = &self.telemetry;
        for ((label, health), said) in t.sources.labels.iter().zip(&t.sources.health).zip(said) {
            if health.get().is_connected() {
                if said.over() {
                    tracing::info!(source = %label, "engine socket connected");
                }
            } else if said.due(now) {
                if self.engine_binds {
                    tracing::warn!(
                        source = %label,
                        "no engine has connected to this bound socket: is the engine's KV-event endpoint pointed here (--engine-bind)?"
                    );
                } else {
                    tracing::warn!(
                        source = %label,
                        "no connection to the engine's KV-event socket: nothing listens there or the host cannot be reached (is vLLM started with --kv-events-config, on this host and port?)"
                    );
                }
            }
        }
    }

    async fn probe_server(&self, client: &fwd::Client, said: &mut Said, now: Instant) {
        let outcome = client.probe(self.connect_timeout).await;
        self.telemetry.delivery.server_probed.store(true, Relaxed);
        let mut unreachable = self
            .telemetry
            .delivery
            .server_unreachable
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match outcome {
            Ok(()) => {
                *unreachable = None;
                if said.over() {
                    tracing::info!(server = %client.address(), "server reachable");
                }
            }
            Err(why) => {
                if said.due(now) {
                    tracing::warn!(
                        server = %client.address(),
                        error = %why,
                        "the InferenceCache server cannot be reached: reports wait (bounded by --max-pending) and are retried"
                    );
                }
                *unreachable = Some(why);
            }
        }
    }
}
