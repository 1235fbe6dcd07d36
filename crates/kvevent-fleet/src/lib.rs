#![doc = include_str!("../README.md")]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvevent_index::Index;

pub mod accounting;
#[cfg(feature = "discover")]
pub mod discover;
#[cfg(feature = "engines")]
mod engines;
mod feed;
pub mod json;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod route;
mod status;

pub use accounting::{ERROR_BUCKETS, Outcome, Prediction, ReplicaAccounting};
pub use kvevent_index::{
    Config as IndexConfig, Degraded, IndexStats, KeyMode, Load, LoadReading, Lost, Query,
    QueryKeys, RankLoad, ReplicaState, Score, Scores, ScoresIter, Tier,
};
pub use kvevent_scrape::Figure;
pub use tonic::transport::ClientTlsConfig;

use status::{Shared, Status};

/// How a fleet follows its replicas.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// The prefix index ([`IndexConfig`]: its byte budget; its key mode must stay fingerprints
    /// for feeds).
    pub index: kvevent_index::Config,
    /// A replica whose source is lost (a feed's stream ended or went silent, an engine's
    /// socket lost its connection, a sidecar lost its engine) for this long is
    /// [`ReplicaState::Stale`]. Default 3 s.
    pub dead_after: Duration,
    /// A replica whose source is lost for this long stops counting in answers (it comes back
    /// with a snapshot, or its engine's replay). Default 60 s.
    pub drop_after: Duration,
    /// Deadline of a connection attempt to a sidecar. Default 5 s.
    pub connect_timeout: Duration,
    /// Largest feed message taken (a snapshot chunk is about 200 KB). Default 16 MiB.
    pub max_message_bytes: usize,
    /// The first wait before following a sidecar's feed again after it was lost (doubling
    /// after each failed attempt up to `reconnect_max`; back to this once a stream was
    /// followed). Default 100 ms.
    pub reconnect_initial: Duration,
    /// The longest wait between attempts to follow a feed again. Default 2 s.
    pub reconnect_max: Duration,
    /// A sidecar's messages that arrive this much later than the fastest did on their stream
    /// (each says when it was made) make the replica [`Degraded::Lagging`]: what it says was
    /// true that long ago (a congested link). Default 300 ms.
    pub lag_after: Duration,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            index: kvevent_index::Config::default(),
            dead_after: Duration::from_secs(3),
            drop_after: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            max_message_bytes: 16 << 20,
            reconnect_initial: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(2),
            lag_after: Duration::from_millis(300),
        }
    }
}

/// Where a replica's state comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaSource {
    /// A sidecar's feed (`kvevent-subscriber --feed-address`): a snapshot of everything the
    /// replica holds, then its changes and its engine's health.
    Sidecar(SidecarFeed),
    /// The engine's own sockets: what its replay buffer still holds, then its events.
    #[cfg(feature = "engines")]
    Engine(EngineSockets),
}

impl ReplicaSource {
    /// The sidecar's URL, or the engine's endpoint.
    pub fn address(&self) -> &str {
        match self {
            Self::Sidecar(feed) => &feed.url,
            #[cfg(feature = "engines")]
            Self::Engine(e) => &e.endpoint,
        }
    }
}

/// A sidecar's feed. Two are the same source when they name the same URL, replica, model and
/// token and both use TLS or neither (TLS settings themselves are not compared).
#[derive(Clone)]
pub struct SidecarFeed {
    /// `http://host:port` or `https://host:port`.
    pub url: String,
    /// The replica the sidecar must serve (its `--replica-id`); "" takes any.
    pub replica: String,
    /// The model it must serve; "" takes any.
    pub model: String,
    /// A bearer token to send, if the sidecar asks for one.
    pub token: Option<String>,
    /// TLS settings for `https://`.
    pub tls: Option<ClientTlsConfig>,
}

impl std::fmt::Debug for SidecarFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SidecarFeed")
            .field("url", &self.url)
            .field("replica", &self.replica)
            .field("model", &self.model)
            .field("token", &self.token.is_some())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl PartialEq for SidecarFeed {
    fn eq(&self, other: &Self) -> bool {
        let key = |f: &Self| {
            (
                f.url.clone(),
                f.replica.clone(),
                f.model.clone(),
                f.token.clone(),
                f.tls.is_some(),
            )
        };
        key(self) == key(other)
    }
}

impl Eq for SidecarFeed {}

impl SidecarFeed {
    /// A feed at `url` taking whatever replica and model it serves.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            replica: String::new(),
            model: String::new(),
            token: None,
            tls: None,
        }
    }
}

#[cfg(feature = "engines")]
pub use kvevent_zmq::EngineSockets;

/// One engine rank as its follower (the sidecar, or the fleet's engine thread) last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankStatus {
    /// The DP rank.
    pub rank: u32,
    /// Its events socket has a connection to the engine.
    pub connected: bool,
    /// How long it has been connected, or lost (`None`: not known, an older sidecar).
    pub since: Option<Duration>,
    /// Replaying, or a gap that could not be repaired: what is known may be incomplete.
    pub degraded: bool,
}

/// One replica as the fleet knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaStatus {
    /// Its name.
    pub name: String,
    /// Where it is followed from: the sidecar's URL, or the engine's endpoint.
    pub source: String,
    /// How far its state can be trusted.
    pub state: ReplicaState,
    /// Prefixes (blocks) it holds, as known.
    pub blocks: u64,
    /// Time since its newest change was applied (`None`: none yet).
    pub newest_change: Option<Duration>,
    /// Tokens per block, from its events (`None` until its first stored block).
    pub block_size: Option<u32>,
    /// Engine batches received (all ranks), or feed messages of changes applied.
    pub batches: u64,
    /// The last error or refusal, in our words (`refused: the sidecar serves replica `x``),
    /// until the source is followed again.
    pub error: Option<String>,
    /// Each engine rank, where the source reports ranks (a sidecar's feed from this version
    /// on, or the engine followed directly).
    pub ranks: Vec<RankStatus>,
    /// What the engine was doing when its sidecar last read its load (all ranks; judge its
    /// age with [`LoadReading::age`]), if the sidecar reads it.
    pub load: Option<LoadReading>,
    /// Why the sidecar's reads of the load fail since then, in its words.
    pub load_error: Option<String>,
}

/// A query the fleet cannot answer truthfully.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScoreError {
    /// The query chains token ids with another block size than the replicas' events use.
    #[error("the query's block size is {asked}, the replicas' events use {known}")]
    BlockSize {
        /// The block size of the query.
        asked: usize,
        /// The block size the events use.
        known: u32,
    },
    /// No replica said its block size yet (none stored a block, none is connected): token ids
    /// cannot be chained into the keys the replicas will hold. Route as if nothing matched.
    #[error("no replica said its block size yet")]
    BlockSizeUnknown,
}

/// The fleet could not start, or a replica cannot be followed as asked.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// No tokio runtime to run on: make the fleet inside one, or give it a handle.
    #[error(
        "the fleet runs on the caller's tokio runtime: make it inside one, or use Fleet::with_runtime"
    )]
    NoRuntime,
    /// A thread could not be started.
    #[error("cannot start the fleet's engine thread: {0}")]
    Thread(#[source] std::io::Error),
    /// A sidecar's feed carries fingerprints: it cannot be followed into an index of engine
    /// keys.
    #[error(
        "replica `{0}`: a sidecar's feed carries fingerprint keys, and this fleet's index is set to engine keys (FleetConfig::index.mapping.key_mode)"
    )]
    KeyMode(String),
    /// A sidecar's URL is not `http://HOST:PORT` or `https://HOST:PORT`.
    #[error("replica `{replica}`: `{url}` is not http://HOST:PORT or https://HOST:PORT")]
    Url {
        /// The replica.
        replica: String,
        /// The URL given.
        url: String,
    },
    /// An engine endpoint is not one ZeroMQ can connect to.
    #[cfg(feature = "engines")]
    #[error(
        "replica `{replica}`: `{endpoint}` is not tcp://HOST:PORT, ipc://PATH or inproc://NAME"
    )]
    Endpoint {
        /// The replica.
        replica: String,
        /// The endpoint given.
        endpoint: String,
    },
    /// An engine's HTTP server URL is not `http://HOST:PORT`.
    #[cfg(feature = "engines")]
    #[error("replica `{replica}`: `{url}` is not http://HOST:PORT")]
    EngineHttp {
        /// The replica.
        replica: String,
        /// The URL given.
        url: String,
    },
    /// An engine's endpoints are not valid.
    #[cfg(feature = "engines")]
    #[error("replica `{replica}`: {source}")]
    Engine {
        /// The replica.
        replica: String,
        /// Why.
        #[source]
        source: kvevent_zmq::Error,
    },
}

/// The replicas named did not all become exact in time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not exact after {waited:?}: {}", .replicas.iter().map(|(n, s)| format!("{n} ({s})")).collect::<Vec<_>>().join(", "))]
pub struct NotReady {
    /// How long it waited.
    pub waited: Duration,
    /// Each replica not exact, with its state and reason.
    pub replicas: Vec<(String, String)>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the fleet's followers share with it.
#[derive(Debug)]
struct Core {
    index: Arc<Index>,
    config: FleetConfig,
    /// The block size the replicas' events use (0: not known yet).
    block_size: AtomicU32,
    /// Bumped on every change of a replica's state, error or ranks, and on every replica
    /// added or removed.
    changes: tokio::sync::watch::Sender<u64>,
}

impl Core {
    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn note_block_size(&self, size: u32) {
        if size > 0 {
            self.block_size.store(size, Relaxed);
        }
    }
}

struct Replica {
    source: ReplicaSource,
    status: Shared,
    /// Stops its follower: a feed task's abort handle, or the engine thread's removal.
    stop: Stop,
}

enum Stop {
    Task(tokio::task::AbortHandle),
    /// The engine thread's removal, and the task asking its HTTP server, if any.
    #[cfg(feature = "engines")]
    Engine(Option<tokio::task::AbortHandle>),
}

/// The router's fleet: replicas by name, each followed through a sidecar's feed or its engine,
/// in one prefix index. See the crate's documentation.
pub struct Fleet {
    core: Arc<Core>,
    replicas: Mutex<HashMap<String, Replica>>,
    runtime: tokio::runtime::Handle,
    #[cfg(feature = "engines")]
    engines: Mutex<Option<engines::Engines>>,
    accounting: Mutex<accounting::Accounting>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("replicas", &lock(&self.replicas).len())
            .finish()
    }
}

impl Fleet {
    /// An empty fleet on the tokio runtime this is called in.
    pub fn new(config: FleetConfig) -> Result<Self, FleetError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| FleetError::NoRuntime)?;
        Ok(Self::with_runtime(config, runtime))
    }

    /// An empty fleet whose feeds are followed on `runtime` (from any thread).
    pub fn with_runtime(config: FleetConfig, runtime: tokio::runtime::Handle) -> Self {
        let index = Arc::new(Index::new(config.index.clone()));
        Self {
            core: Arc::new(Core {
                index,
                config,
                block_size: AtomicU32::new(0),
                changes: tokio::sync::watch::channel(0).0,
            }),
            replicas: Mutex::new(HashMap::new()),
            runtime,
            #[cfg(feature = "engines")]
            engines: Mutex::new(None),
            accounting: Mutex::default(),
        }
    }

    /// The index the replicas are followed into.
    pub fn index(&self) -> &Arc<Index> {
        &self.core.index
    }

    /// The index's counters: distinct prefixes (`keys`), (prefix, source) pairs, pairs of
    /// sources sharing a prefix and the duplication share ([`IndexStats::duplication`]), kept
    /// as changes apply.
    pub fn stats(&self) -> IndexStats {
        self.core.index.stats()
    }

    /// Told of every change of a replica's state, error or ranks, and of every replica added
    /// or removed: `changed().await`, then read [`Fleet::replicas`]. It is a counter, not a
    /// queue: changes made while the receiver was not looking fold into one wake-up, and
    /// [`Fleet::replicas`] then shows where they ended (a replica that went degraded and back
    /// within that time may show no change at all). Poll [`Fleet::replicas`] to see every
    /// state a replica passes through.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.core.changes.subscribe()
    }

    /// Waits until every replica followed is [`ReplicaState::Exact`], for at most `timeout`.
    pub async fn ready(&self, timeout: Duration) -> Result<(), NotReady> {
        self.ready_among(&[], timeout).await
    }

    /// [`Fleet::ready`] for the replicas `names` only (all of them when empty).
    pub async fn ready_among(&self, names: &[&str], timeout: Duration) -> Result<(), NotReady> {
        let started = Instant::now();
        let missing: Vec<(String, String)> = {
            let replicas = lock(&self.replicas);
            names
                .iter()
                .filter(|n| !replicas.contains_key(**n))
                .map(|n| ((*n).to_owned(), "not followed".to_owned()))
                .collect()
        };
        if !missing.is_empty() {
            // Waiting cannot help: nothing follows them.
            return Err(NotReady {
                waited: started.elapsed(),
                replicas: missing,
            });
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.changes();
        loop {
            changes.borrow_and_update();
            let not_ready: Vec<(String, String)> = self
                .replicas()
                .into_iter()
                .filter(|r| names.is_empty() || names.contains(&r.name.as_str()))
                .filter(|r| r.state != ReplicaState::Exact)
                .map(|r| {
                    let why = r.state.reason().unwrap_or_default();
                    let detail = r.error.map(|e| format!(": {e}")).unwrap_or_default();
                    (r.name, format!("{} {why}{detail}", r.state.as_str()))
                })
                .collect();
            let missing = names
                .iter()
                .filter(|n| !lock(&self.replicas).contains_key(**n))
                .map(|n| ((*n).to_owned(), "not followed".to_owned()));
            let not_ready: Vec<_> = not_ready.into_iter().chain(missing).collect();
            if not_ready.is_empty() {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => {
                    return Err(NotReady {
                        waited: started.elapsed(),
                        replicas: not_ready,
                    });
                }
            }
        }
    }

    /// Follows `name` from `source`; nothing happens if it is already followed from the same
    /// source, and a replica whose source changed is followed from the new one. Call it from a
    /// discovery loop or a pod watch as often as you like. A source that cannot be followed as
    /// given is an error, and nothing changes.
    pub fn ensure_replica(&self, name: &str, source: ReplicaSource) -> Result<(), FleetError> {
        // Checked before anything changes: bad input loses nothing.
        match &source {
            ReplicaSource::Sidecar(_)
                if self.core.config.index.mapping.key_mode != KeyMode::Fingerprint =>
            {
                return Err(FleetError::KeyMode(name.to_owned()));
            }
            ReplicaSource::Sidecar(feed) => {
                if !feed::valid_url(&feed.url) {
                    return Err(FleetError::Url {
                        replica: name.to_owned(),
                        url: feed.url.clone(),
                    });
                }
            }
            #[cfg(feature = "engines")]
            ReplicaSource::Engine(_) => {}
        }
        #[cfg(feature = "engines")]
        let engine_sources = match &source {
            ReplicaSource::Engine(e) => Some(engines::sources(name, e)?),
            ReplicaSource::Sidecar(_) => None,
        };
        #[cfg(feature = "engines")]
        let server = match &source {
            ReplicaSource::Engine(EngineSockets {
                http: Some(url), ..
            }) => Some(engines::server(name, url)?),
            _ => None,
        };
        let mut replicas = lock(&self.replicas);
        if replicas.get(name).is_some_and(|r| r.source == source) {
            return Ok(());
        }
        if let Some(old) = replicas.remove(name) {
            self.stop(name, old);
        }
        let status: Shared = Arc::new(Mutex::new(Status::new(source.address())));
        let stop = match &source {
            ReplicaSource::Sidecar(feed) => {
                let follower =
                    feed::FeedFollower::new(self.core.clone(), name, feed.clone(), status.clone());
                Stop::Task(self.runtime.spawn(follower.run()).abort_handle())
            }
            #[cfg(feature = "engines")]
            ReplicaSource::Engine(e) => {
                let mut engines = lock(&self.engines);
                if engines.is_none() {
                    *engines = Some(
                        engines::Engines::start(self.core.clone()).map_err(FleetError::Thread)?,
                    );
                }
                if let Some(engines) = engines.as_ref() {
                    engines.add(
                        name,
                        engine_sources.unwrap_or_default(),
                        e.engine,
                        status.clone(),
                    );
                }
                let probe = server.map(|server| {
                    let task = server.run(self.core.clone(), name.to_owned(), status.clone());
                    self.runtime.spawn(task).abort_handle()
                });
                Stop::Engine(probe)
            }
        };
        status::publish(&self.core, name, &status);
        replicas.insert(
            name.to_owned(),
            Replica {
                source,
                status,
                stop,
            },
        );
        drop(replicas);
        self.core.changed();
        Ok(())
    }

    /// Says whether `name`'s replica is ready to take requests (discovery's word: a pod that
    /// is not Ready is followed but not routed to). A replica not ready is
    /// [`Degraded::NotReady`] (unless stale), and a router passes over it while another
    /// candidate can serve ([`ReplicaState::can_serve`]). Replicas start ready. False for an
    /// unknown name (nothing changes).
    pub fn set_ready(&self, name: &str, ready: bool) -> bool {
        let replicas = lock(&self.replicas);
        let Some(r) = replicas.get(name) else {
            return false;
        };
        let status = r.status.clone();
        drop(replicas);
        {
            let mut s = lock(&status);
            if s.not_ready != ready {
                return true;
            }
            s.on(name, status::Event::Ready(ready), Instant::now());
        }
        status::publish(&self.core, name, &status);
        true
    }

    /// Stops following `name` and forgets what it held. Nothing happens for an unknown name.
    pub fn remove_replica(&self, name: &str) {
        let old = lock(&self.replicas).remove(name);
        if let Some(old) = old {
            self.stop(name, old);
            lock(&self.accounting).forget(name);
            self.core.changed();
        }
    }

    /// Records what the engine reused for a request routed on `prediction` (the cached tokens
    /// its response reports, `usage.prompt_tokens_details.cached_tokens` in vLLM's): counted
    /// per replica as exact, optimistic or pessimistic, with its error in blocks (see
    /// [`accounting`] for the last-block rule). A replica whose predictions drift while it is
    /// exact is warned about, naming it, at most once a minute.
    pub fn record(&self, prediction: &Prediction, realized_cached_tokens: u32) -> Outcome {
        lock(&self.accounting).record(prediction, realized_cached_tokens)
    }

    /// Every replica's predictions so far, by name ([`Fleet::record`]).
    pub fn accounting(&self) -> Vec<(String, ReplicaAccounting)> {
        lock(&self.accounting).snapshot()
    }

    fn stop(&self, name: &str, replica: Replica) {
        match replica.stop {
            Stop::Task(task) => task.abort(),
            #[cfg(feature = "engines")]
            Stop::Engine(probe) => {
                if let Some(probe) = probe {
                    probe.abort();
                }
                if let Some(engines) = lock(&self.engines).as_ref() {
                    engines.remove(&replica.status);
                }
            }
        }
        let mut status = lock(&replica.status);
        status.on(name, status::Event::Removed, Instant::now());
        // Under the status's lock: its follower, if still running, publishes nothing more.
        self.core.index.remove_replica(name);
    }

    /// Every replica followed, by name.
    pub fn replicas(&self) -> Vec<ReplicaStatus> {
        let replicas = lock(&self.replicas);
        let now = Instant::now();
        let mut out: Vec<ReplicaStatus> = replicas
            .iter()
            .map(|(name, r)| lock(&r.status).report(name, &self.core, now))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// The block size the replicas' events use, once one said it.
    pub fn block_size(&self) -> Option<u32> {
        Some(self.core.block_size.load(Relaxed)).filter(|b| *b > 0)
    }

    /// Every replica holding block 0 of the query, best first (see
    /// [`kvevent_index::Index::score`]), each with its state.
    pub fn score(&self, query: &Query<'_>) -> Result<Scores, ScoreError> {
        self.check(query)?;
        Ok(self.core.index.score(query))
    }

    /// [`Fleet::score`] among `candidates` only (the replicas a router may send this request
    /// to): every candidate followed is in the answer, matching or not, with its state; the
    /// positions of those not followed are in [`Scores::unknown`].
    pub fn score_among(
        &self,
        query: &Query<'_>,
        candidates: &[&str],
    ) -> Result<Scores, ScoreError> {
        self.check(query)?;
        Ok(self.core.index.score_among(query, candidates))
    }

    fn check(&self, query: &Query<'_>) -> Result<(), ScoreError> {
        if let QueryKeys::Tokens { block_size, .. } = query.keys {
            match self.block_size() {
                None => return Err(ScoreError::BlockSizeUnknown),
                Some(known) if known as usize != block_size => {
                    return Err(ScoreError::BlockSize {
                        asked: block_size,
                        known,
                    });
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for (_, r) in lock(&self.replicas).drain() {
            match r.stop {
                Stop::Task(t) => t.abort(),
                #[cfg(feature = "engines")]
                Stop::Engine(probe) => {
                    if let Some(probe) = probe {
                        probe.abort();
                    }
                }
            }
        }
        #[cfg(feature = "engines")]
        if let Some(engines) = lock(&self.engines).take() {
            engines.stop();
        }
    }
}
