#![doc = include_str!("../README.md")]

pub mod credentials;
pub mod demo;
pub mod discovery;
mod engine_load;
mod engine_server;
mod events;
mod http_server;
pub mod settings;
mod startup_warnings;

/// An error and its causes, in one line (`a: b: c`).
pub use kvevent_scrape::error_chain;
pub mod state_file;
mod stats_reporter;
pub mod telemetry;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use kvevent_forwarder as fwd;
use kvevent_mapper as mapper;
use kvevent_source as source;
use kvevent_zmq as transport;

use settings::Words as _;
pub use settings::{ConfigError, Settings};
pub use stats_reporter::CLIENT_VERSION;
pub use telemetry::Telemetry;

/// What went wrong starting the sidecar.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The settings are invalid (built in code: [`Settings::load`] refuses them first).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The identity or mapping options are invalid.
    #[error("mapping options")]
    Mapper(#[from] mapper::Error),
    /// The engine endpoints could not be derived or opened.
    #[error("engine subscription")]
    Transport(#[from] transport::Error),
    /// The server address or TLS settings are unusable.
    #[error("server connection")]
    Forwarder(#[from] fwd::Error),
    /// TLS files could not be read.
    #[error("tls")]
    Tls(#[from] credentials::TlsFileError),
    /// The engine metrics URL is unusable.
    #[error("engine metrics")]
    Scrape(#[from] kvevent_scrape::FetchError),
    /// Our HTTP endpoint could not be bound.
    #[error("bind --metrics-address {0}")]
    MetricsAddress(String, #[source] std::io::Error),
    /// The events thread could not be started.
    #[error("spawn events thread")]
    Spawn(#[source] std::io::Error),
    /// The engine's endpoints could not be discovered.
    #[error("engine endpoint discovery")]
    Discovery(#[from] discovery::DiscoveryError),
    /// The state file cannot be written where `--state-file` says.
    #[error("--state-file {0}: cannot create a file there")]
    StateFile(String, #[source] std::io::Error),
    /// The router feed cannot be served.
    #[error("--feed-address")]
    Feed(#[from] kvevent_feed::ServeError),
}

/// The running sidecar.
pub struct Running {
    stop_events: Arc<AtomicBool>,
    events: Option<std::thread::JoinHandle<()>>,
    /// None for a feed-only sidecar (no server).
    forwarder: Option<fwd::Forwarder>,
    stop_stats: tokio::sync::watch::Sender<bool>,
    stats: Option<tokio::task::JoinHandle<()>>,
    /// Says what does not answer (engine sockets, the server).
    watch: Option<tokio::task::JoinHandle<()>>,
    http: Option<(SocketAddr, tokio::task::JoinHandle<()>)>,
    telemetry: Arc<Telemetry>,
    /// Set (with what changed) when the discovered endpoint layout changed.
    layout: tokio::sync::watch::Receiver<Option<String>>,
    watcher: Option<tokio::task::JoinHandle<()>>,
    /// The router feed: where it listens, its server task, and what stops it.
    feed: Option<FeedServer>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("metrics_addr", &self.metrics_addr())
            .finish()
    }
}

fn identity(s: &Settings) -> Result<mapper::Identity, mapper::Error> {
    mapper::Identity::new(&s.replica_id, &s.model_id, &s.tenant_id, &s.hash_scheme)
}

fn client_config(s: &Settings) -> Result<fwd::ClientConfig, StartError> {
    let tls = credentials::tls_config(s.tls_files())?;
    let address = s.server().unwrap_or_default();
    let mut config = fwd::ClientConfig::new(address);
    config.rpc_timeout = s.rpc_timeout.0;
    config.connect_timeout = s.connect_timeout.0;
    config.tls = tls;
    if let Some(token_file) = &s.token_file {
        config.credentials = Some(Arc::new(credentials::TokenFile::new(token_file)));
    }
    Ok(config)
}

fn stats_config(s: &Settings) -> kvevent_scrape::StatsConfig {
    kvevent_scrape::StatsConfig {
        profile: s.engine_profile,
        cache_tier: s.cache_tier,
        model_name: (!s.engine_model_name.is_empty()).then(|| s.engine_model_name.clone()),
        cache_size_bytes: s.engine_cache_size_bytes,
        concurrency_ceiling: s.max_concurrency_ceiling,
    }
}

/// The feed's server: where it listens, its task, what stops it.
type FeedServer = (
    SocketAddr,
    tokio::task::JoinHandle<()>,
    tokio::sync::oneshot::Sender<()>,
);

/// Starts the router feed: its hub, holding what restored mappers hold, and its server.
async fn start_feed(
    settings: &Settings,
    sources: &[transport::Source],
    mappers: &mut [mapper::Mapper],
    restored: bool,
    saved_feed: Option<state_file::FeedPosition>,
) -> Result<(events::Feed, FeedServer), StartError> {
    let ranks: Vec<u32> = sources.iter().map(|s| s.dp_rank).collect();
    let hub = kvevent_feed::Hub::new(kvevent_feed::HubConfig {
        ring_bytes: settings.feed_ring_bytes,
        // A follower before the events thread's first turn hears of ranks not yet connected.
        ranks: ranks.clone(),
        ..kvevent_feed::HubConfig::new(&settings.replica_id, &settings.model_id)
    });
    // The feed carries fingerprints: with engine keys for the server, the mappers make them
    // in the same pass (`Options::fingerprints_too`).
    let two_keys = settings.key_mode != mapper::KeyMode::Fingerprint;
    if restored {
        if two_keys {
            tracing::warn!(
                "the state file holds engine keys: the router feed starts empty and fills as the engine stores blocks (use --key-mode fingerprint for a feed that resumes whole)"
            );
        } else {
            for (m, rank) in mappers.iter_mut().zip(&ranks) {
                if let Some(report) = m.resident(0) {
                    hub.load(*rank, &report);
                }
            }
            match saved_feed {
                // The same history: followers at the saved position miss nothing.
                Some(p) => hub.resume_at(p.epoch, p.seq),
                None => hub.commit(),
            }
        }
    }
    let mut options = kvevent_feed::ServeOptions::default();
    if let (Some(cert), Some(key)) = (&settings.feed_tls_cert_file, &settings.feed_tls_key_file) {
        let identity =
            tonic::transport::Identity::from_pem(credentials::read(cert)?, credentials::read(key)?);
        options.tls = Some(tonic::transport::ServerTlsConfig::new().identity(identity));
    }
    if let Some(path) = &settings.feed_token_file {
        use fwd::Credentials as _;
        let file = credentials::TokenFile::new(path);
        options.token = Some(Arc::new(move || file.bearer_token()));
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let address = settings
        .feed_address
        .addr()
        .map_or_else(|| settings.feed_address.to_string(), |a| a.to_string());
    let (bound, task) = kvevent_feed::serve(&address, hub.clone(), options, async {
        let _ = stopped.await;
    })
    .await?;
    tracing::info!(address = %bound, "serving the router feed");
    Ok((
        events::Feed {
            hub,
            two_keys,
            ranks,
            reports: Vec::new(),
            health: Vec::new(),
        },
        (bound, task, stop),
    ))
}

/// Starts the sidecar on the current tokio runtime; `ctx` is the ZMQ context (shared with an
/// in-process engine for `inproc://` endpoints). `settings` are validated first: settings built
/// in code are refused with the problems [`Settings::load`] would report.
pub async fn start(settings: &Settings, ctx: &zmq::Context) -> Result<Running, StartError> {
    settings.validate()?;
    let identity = identity(settings)?;
    let options = mapper::Options {
        key_mode: settings.key_mode,
        engine_has_offload_tier: settings.ignore_block_removed,
        all_kv_groups: settings.all_kv_groups,
        fingerprints_too: !settings.feed_address.is_empty(),
        lora_adapters: settings.lora_adapter_names.map().clone(),
        max_tracked_blocks: settings.max_tracked_blocks,
        // One engine's map, dense: it keeps the sidecar within its memory target at the
        // highest store rate measured (docs/performance.md, `load --store-only`).
    };
    // No server (a feed-only sidecar): no client, forwarder, server watch or stats.
    let client = match settings.server() {
        Some(_) => Some(fwd::connect(&client_config(settings)?)?),
        None => None,
    };
    let sources = match settings.engine_discovery_url.get() {
        None => settings.engine_sources().map_err(ConfigError)?,
        Some(url) => {
            discovery::discover_patiently(
                url,
                settings.scrape_timeout.0,
                settings.engine_discovery_timeout.0,
                settings.topic.as_bytes(),
            )
            .await?
        }
    };
    let scraper = match settings.engine_metrics_url.get() {
        Some(url) if client.is_some() && !settings.stats_interval.0.is_zero() => {
            Some(kvevent_scrape::Scraper::new(
                url,
                settings.scrape_timeout.0,
                settings.scrape_max_bytes,
                stats_config(settings),
            )?)
        }
        _ => None,
    };

    let fwd_config = fwd::Config {
        window: settings.window.0,
        max_pending: settings.max_pending,
        max_in_flight: settings.max_in_flight,
        backoff_max: settings.max_backoff.0,
        drain_timeout: settings.drain_timeout.0,
        ..fwd::Config::default()
    };
    let (handle, forwarder) = match &client {
        Some(client) => {
            let (handle, forwarder) = fwd::spawn(client.clone(), fwd_config);
            (Some(handle), Some(forwarder))
        }
        None => (None, None),
    };

    let labels: Vec<String> = sources.iter().map(transport::Source::label).collect();
    let key_mode = settings.key_mode.word();
    let restored = match &settings.state_file {
        Some(path) => restore(path, &identity, key_mode, &labels, &options)?,
        None => None,
    };
    let mut sub_config = source::Config::new(sources.clone());
    // The engine is local: a reconnect that no replay can check is most likely a restart.
    sub_config.state.reset_on_unverified_reconnect = true;
    sub_config.engine = settings.engine;
    sub_config.socket.replay_idle_timeout = settings.replay_timeout.0;
    sub_config.socket.rcvhwm = settings.engine_rcvhwm;
    sub_config.socket.heartbeat_interval = settings.engine_heartbeat_interval.0;
    sub_config.socket.heartbeat_timeout = settings.engine_heartbeat_timeout.0;
    sub_config.socket.reconnect_interval_max = settings.engine_reconnect_max.0;
    let mut saved_feed = None;
    let (mut mappers, restored) = match restored {
        Some(loaded) => {
            sub_config.resume = loaded.resume;
            saved_feed = loaded.header.feed;
            (loaded.mappers, true)
        }
        None => (
            sources
                .iter()
                .map(|_| mapper::Mapper::new(identity.clone(), options.clone()))
                .collect(),
            false,
        ),
    };
    let subscriber = source::Subscriber::start(ctx, sub_config)?;
    let telemetry = Arc::new(Telemetry::new(
        sources.iter().map(transport::Source::label).collect(),
        subscriber.metrics().to_vec(),
        subscriber.health().cloned().collect(),
        handle
            .as_ref()
            .map_or_else(Default::default, |h| h.metrics().clone()),
    ));
    telemetry.subscribed.store(true, Relaxed);
    telemetry
        .delivery
        .has_server
        .store(client.is_some(), Relaxed);

    let http = if settings.metrics_address.is_empty() {
        None
    } else {
        let addr: SocketAddr = settings.metrics_address.addr().ok_or_else(|| {
            StartError::MetricsAddress(
                settings.metrics_address.to_string(),
                std::io::Error::other("not host:port"),
            )
        })?;
        let readiness = http_server::Readiness {
            silence_grace: settings.engine_silence_grace.0,
            max_silence: (settings.stats_interval.0 * 3).max(Duration::from_secs(30)),
            feed_only: client.is_none(),
        };
        let served = http_server::serve(addr, telemetry.clone(), readiness)
            .await
            .map_err(|e| StartError::MetricsAddress(settings.metrics_address.to_string(), e))?;
        tracing::info!(address = %served.0, "serving /metrics, /healthz, /readyz");
        Some(served)
    };

    let (feed, feed_server) = if settings.feed_address.is_empty() {
        (None, None)
    } else {
        let (feed, served) =
            start_feed(settings, &sources, &mut mappers, restored, saved_feed).await?;
        telemetry.set_feed(feed.hub.clone());
        (Some(feed), Some(served))
    };
    let feed_hub = feed.as_ref().map(|f| f.hub.clone());

    let stop_events = Arc::new(AtomicBool::new(false));
    let events = events::EventsLoop {
        subscriber,
        mappers,
        forwarder: handle,
        restored,
        saver: settings.state_file.as_ref().map(|path| events::Saver {
            path: path.clone(),
            interval: settings.state_interval.0,
            header: state_file::Header {
                written_unix_ms: 0,
                at_shutdown: false,
                replica_id: identity.replica_id().to_owned(),
                model_id: identity.model_id().to_owned(),
                tenant_id: identity.tenant_id().to_owned(),
                hash_scheme: identity.hash_scheme().to_owned(),
                key_mode: key_mode.to_owned(),
                sources: Vec::new(),
                feed: None,
            },
        }),
        refresh_interval: settings.refresh_interval.0,
        silence_grace: settings.engine_silence_grace.0,
        stop: stop_events.clone(),
        telemetry: telemetry.clone(),
        feed,
    };
    let events = std::thread::Builder::new()
        .name("kvevent-events".into())
        .spawn(move || events.run())
        .map_err(StartError::Spawn)?;

    let (layout_tx, layout) = tokio::sync::watch::channel(None);
    let watcher = (!settings.engine_discovery_url.is_empty()).then(|| {
        tokio::spawn(
            discovery::Watcher {
                lost_for_good: settings.engine_discovery_recheck.0,
                url: settings.engine_discovery_url.to_string(),
                timeout: settings.scrape_timeout.0,
                topic: settings.topic.as_bytes().to_vec(),
                current: sources.clone(),
                metrics: telemetry.sources.metrics.clone(),
            }
            .run(layout_tx),
        )
    });
    let (stop_stats, stop_rx) = tokio::sync::watch::channel(false);
    // With a feed, the engine's HTTP server is asked whether it answers: the one its
    // discovery listing is on, else the one its metrics are on.
    let server_url = if settings.engine_discovery_url.is_empty() {
        &settings.engine_metrics_url
    } else {
        &settings.engine_discovery_url
    };
    let engine_server = server_url
        .server()
        .filter(|_| !settings.engine_health_interval.0.is_zero());
    // With a feed, the engine's load is read for routers from its metrics.
    if let (Some(hub), Some(url)) = (&feed_hub, settings.engine_metrics_url.get())
        && !settings.engine_load_interval.0.is_zero()
    {
        let interval = settings.engine_load_interval.0;
        let timeout = interval
            .max(Duration::from_secs(1))
            .min(settings.scrape_timeout.0);
        tokio::spawn(
            engine_load::EngineLoad {
                reader: kvevent_scrape::LoadReader::new(
                    url,
                    timeout,
                    settings.scrape_max_bytes,
                    stats_config(settings),
                )?,
                interval,
                hub: hub.clone(),
                telemetry: telemetry.clone(),
            }
            .run(stop_rx.clone()),
        );
    }
    if let (Some(hub), Some(server)) = (feed_hub, engine_server) {
        let timeout = settings
            .engine_health_interval
            .0
            .min(settings.scrape_timeout.0);
        tokio::spawn(
            engine_server::EngineServer {
                check: kvevent_scrape::EngineHealth::new(&server, timeout)?,
                interval: settings.engine_health_interval.0,
                hub,
            }
            .run(stop_rx.clone()),
        );
    }
    let watch = tokio::spawn(
        startup_warnings::Watch {
            client: client.clone(),
            telemetry: telemetry.clone(),
            engine_binds: settings.engine_bind,
            connect_timeout: settings.connect_timeout.0,
        }
        .run(stop_rx.clone()),
    );
    let stats = scraper.zip(client).map(|(scraper, client)| {
        tokio::spawn(
            stats_reporter::StatsReporter {
                scraper,
                client,
                identity,
                interval: settings.stats_interval.0,
                telemetry: telemetry.clone(),
            }
            .run(stop_rx),
        )
    });
    tracing::info!(
        engine = %labels.join(" "),
        server = %settings.server().unwrap_or_else(|| "none (a feed-only sidecar)".into()),
        replica = %settings.replica_id,
        model = %settings.model_id,
        key_mode = key_mode,
        "sidecar started"
    );
    Ok(Running {
        stop_events,
        events: Some(events),
        forwarder,
        stop_stats,
        stats,
        watch: Some(watch),
        http,
        telemetry,
        layout,
        watcher,
        feed: feed_server,
    })
}

/// Loads `--state-file` if there is one this sidecar can use: a file that cannot be used is
/// logged with the reason and the start goes on as without one (clear + rebuild). A path
/// where no file can be created fails the start.
fn restore(
    path: &std::path::Path,
    identity: &mapper::Identity,
    key_mode: &str,
    labels: &[String],
    options: &mapper::Options,
) -> Result<Option<state_file::Loaded>, StartError> {
    state_file::check_writable(path)
        .map_err(|e| StartError::StateFile(path.display().to_string(), e))?;
    let expected = state_file::Expected {
        identity,
        key_mode,
        sources: labels,
        options,
    };
    match state_file::load(path, &expected) {
        Ok(Some(loaded)) => {
            let age_s = telemetry::unix_ms().saturating_sub(loaded.header.written_unix_ms) / 1000;
            tracing::info!(
                path = %path.display(),
                age_s,
                at_shutdown = loaded.header.at_shutdown,
                blocks = loaded.mappers.iter().map(mapper::Mapper::tracked_blocks).sum::<usize>(),
                "state file loaded: resuming each source from its last batch if the engine still holds it"
            );
            Ok(Some(loaded))
        }
        Ok(None) => {
            tracing::info!(path = %path.display(), "no state file yet: starting afresh");
            Ok(None)
        }
        Err(e) => {
            tracing::warn!(
                path = %path.display(),
                error = %e,
                "state file not used: clearing the replica and rebuilding from the engine's replay"
            );
            Ok(None)
        }
    }
}

impl Running {
    /// Where `/metrics` is served, if it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(|(a, _)| *a)
    }

    /// Where the router feed listens, when served.
    pub fn feed_addr(&self) -> Option<SocketAddr> {
        self.feed.as_ref().map(|(a, ..)| *a)
    }

    /// Every counter.
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    /// Resolves when the engine's discovered endpoint layout changed (a rank's connection was
    /// lost for good and the listing now names other endpoints), with what changed. The
    /// subscription cannot follow in place: drain and start again. Never resolves without
    /// discovery.
    pub async fn layout_changed(&mut self) -> String {
        loop {
            if let Some(what) = self.layout.borrow_and_update().clone() {
                return what;
            }
            if self.layout.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops taking events, flushes what is pending within `drain`, stops the stats loop and
    /// the HTTP endpoint. Returns what could not be sent.
    pub async fn shutdown(mut self, drain: Duration) -> fwd::DrainReport {
        self.stop_events.store(true, Relaxed);
        if let Some(events) = self.events.take() {
            // The events thread notices within its 100 ms poll; it holds no lock we need.
            let _ = tokio::task::spawn_blocking(move || events.join()).await;
        }
        let _ = self.stop_stats.send(true);
        if let Some(stats) = self.stats.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), stats).await;
        }
        if let Some(watcher) = self.watcher.take() {
            watcher.abort();
        }
        if let Some(watch) = self.watch.take() {
            watch.abort();
        }
        if let Some((_, task, stop)) = self.feed.take() {
            let _ = stop.send(());
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
        let report = match self.forwarder.take() {
            Some(forwarder) => forwarder.shutdown(drain).await,
            None => fwd::DrainReport::default(),
        };
        if let Some((_, task)) = self.http.take() {
            task.abort();
        }
        report
    }
}
