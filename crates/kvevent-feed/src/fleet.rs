//! The router's side: a [`Fleet`] of replicas, each followed through its sidecar's feed or its
//! engine's sockets, into one prefix index, keyed by replica name.
//!
//! Feeds run as tasks on a small tokio runtime the fleet owns (one thread, `kvevent-feeds`);
//! engines are read by one thread (`kvevent-engines`) with one `poll(2)` over their sockets.
//! Neither needs the caller to run an async runtime.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvevent_index::{Index, KeyChange, Query, QueryKeys, SourceId, Tier};
use kvevent_source::{Subscriber, View};
use tonic::transport::{ClientTlsConfig, Endpoint};

use crate::pb;

/// How a fleet follows its replicas.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// The prefix index ([`crate::IndexConfig`]: its byte budget; its key mode must stay
    /// fingerprints for feeds).
    pub index: kvevent_index::Config,
    /// A replica whose source is lost (a feed's stream ended or went silent, an engine's
    /// socket lost its connection) for this long is [`ReplicaState::Stale`]. Default 3 s.
    pub dead_after: Duration,
    /// A replica lost for this long stops counting in answers (it comes back with a snapshot,
    /// or its engine's replay). Default 60 s.
    pub drop_after: Duration,
    /// Deadline of a connection attempt to a sidecar. Default 5 s.
    pub connect_timeout: Duration,
    /// Largest feed message taken (a snapshot chunk is about 200 KB). Default 16 MiB.
    pub max_message_bytes: usize,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            index: kvevent_index::Config::default(),
            dead_after: Duration::from_secs(3),
            drop_after: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            max_message_bytes: 16 << 20,
        }
    }
}

/// Where a replica's state comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaSource {
    /// A sidecar's feed (`kvevent-subscriber --feed-address`): a snapshot of everything the
    /// replica holds, then its changes.
    Sidecar(SidecarFeed),
    /// The engine's own sockets: what its replay buffer still holds, then its events.
    Engine(EngineSockets),
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
        (
            &self.url,
            &self.replica,
            &self.model,
            &self.token,
            self.tls.is_some(),
        ) == (
            &other.url,
            &other.replica,
            &other.model,
            &other.token,
            other.tls.is_some(),
        )
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

/// An engine's sockets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSockets {
    /// Rank 0's PUB endpoint, `tcp://host:port`.
    pub endpoint: String,
    /// Rank 0's replay endpoint, if any.
    pub replay: Option<String>,
    /// Data-parallel ranks (ports offset by rank, vLLM's rule). Default 1.
    pub dp: u32,
    /// The topic subscribed to; empty for all.
    pub topic: Vec<u8>,
    /// Whose KV-event wire it speaks: vLLM's (the default) or SGLang's.
    pub engine: kvevent_wire::Engine,
}

impl EngineSockets {
    /// One rank at `endpoint`, no replay.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay: None,
            dp: 1,
            topic: Vec::new(),
            engine: kvevent_wire::Engine::Vllm,
        }
    }
}

/// Why a replica's known state may be incomplete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degraded {
    /// Not yet connected, or connecting again.
    Connecting,
    /// A snapshot is loading (the previous state, if any, still counts).
    SnapshotLoading,
    /// An engine source is replaying, or lost batches it could not replay.
    Replaying,
}

impl Degraded {
    /// A short name for logs and answers.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::SnapshotLoading => "snapshot_loading",
            Self::Replaying => "replaying_or_gap",
        }
    }
}

/// How far a replica's state in the index can be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaState {
    /// In sync with its source.
    Exact,
    /// Its source is there, but what is known may be incomplete.
    Degraded(Degraded),
    /// Its source has been lost since this instant (for at least `dead_after`). Its entries
    /// count until `drop_after`.
    Stale(Instant),
}

impl ReplicaState {
    /// `exact`, `degraded` or `stale`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Degraded(_) => "degraded",
            Self::Stale(_) => "stale",
        }
    }
}

/// One replica as the fleet knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// Its name.
    pub name: String,
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
}

/// One replica's match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetScore {
    /// The replica's name.
    pub replica: String,
    /// Blocks of the query present from block 0 on.
    pub matched_blocks: u32,
    /// Tokens those blocks cover.
    pub matched_tokens: u32,
    /// T2 when any matched block is only in the offload tier.
    pub tier: Tier,
    /// How far the replica's state can be trusted.
    pub state: ReplicaState,
    /// Time since the replica's newest change.
    pub newest_change: Option<Duration>,
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
}

/// The fleet could not start.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The runtime for feeds could not start.
    #[error("cannot start the fleet's feed runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A sidecar's feed carries fingerprints: it cannot be followed into an index of engine
    /// keys.
    #[error(
        "replica `{0}`: a sidecar's feed carries fingerprint keys, and this fleet's index is set to engine keys (FleetConfig::index.mapping.key_mode)"
    )]
    KeyMode(String),
    /// An engine endpoint is not one ZeroMQ can connect to.
    #[error(
        "replica `{replica}`: `{endpoint}` is not tcp://HOST:PORT, ipc://PATH or inproc://NAME"
    )]
    Endpoint {
        /// The replica.
        replica: String,
        /// The endpoint given.
        endpoint: String,
    },
    /// An engine's endpoints are not valid.
    #[error("replica `{replica}`: {source}")]
    Engine {
        /// The replica.
        replica: String,
        /// Why.
        #[source]
        source: kvevent_zmq::Error,
    },
}

/// What one replica's follower reports, read by answers.
#[derive(Debug, Default)]
struct Status {
    /// The source is lost (or not yet connected) since then; `None`: connected.
    lost_since: Option<Instant>,
    /// Lost for `drop_after`: its entries no longer count.
    dropped: bool,
    degraded: Option<Degraded>,
    blocks: u64,
    newest: Option<Instant>,
    block_size: u32,
    /// Engine batches received, or feed messages of changes applied.
    batches: u64,
}

type Shared = Arc<Mutex<Status>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Status {
    fn state(&self, dead_after: Duration) -> ReplicaState {
        match self.lost_since {
            Some(since) if since.elapsed() >= dead_after => ReplicaState::Stale(since),
            Some(_) => ReplicaState::Degraded(Degraded::Connecting),
            None => self
                .degraded
                .map_or(ReplicaState::Exact, ReplicaState::Degraded),
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
    Engine,
}

/// The router's fleet: replicas by name, each followed through a sidecar's feed or its engine,
/// in one prefix index.
///
/// ```no_run
/// use kvevent_feed::{Fleet, FleetConfig, Query, QueryKeys, ReplicaSource, SidecarFeed};
///
/// let fleet = Fleet::new(FleetConfig::default())?;
/// fleet.ensure_replica("a", ReplicaSource::Sidecar(SidecarFeed::new("http://10.0.0.1:7070")))?;
/// let prompt: Vec<u32> = (0..64).collect();
/// let scores = fleet.score_among(
///     &Query { adapter: "", keys: QueryKeys::Tokens { ids: &prompt, block_size: 16 } },
///     &["a", "b"],
/// )?;
/// for s in &scores {
///     println!("{} holds {} tokens ({})", s.replica, s.matched_tokens, s.state.as_str());
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Fleet {
    index: Arc<Index>,
    config: FleetConfig,
    replicas: Mutex<HashMap<String, Replica>>,
    runtime: tokio::runtime::Handle,
    /// Ends the feed runtime's thread when the fleet goes.
    _runtime_stop: tokio::sync::oneshot::Sender<()>,
    engines: Arc<Engines>,
    engine_thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("replicas", &lock(&self.replicas).len())
            .finish()
    }
}

impl Fleet {
    /// An empty fleet, its feed runtime and engine thread started.
    pub fn new(config: FleetConfig) -> Result<Self, FleetError> {
        let index = Arc::new(Index::new(config.index.clone()));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(FleetError::Runtime)?;
        let handle = runtime.handle().clone();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("kvevent-feeds".into())
            .spawn(move || {
                runtime.block_on(async {
                    let _ = stop_rx.await;
                });
            })
            .map_err(FleetError::Runtime)?;
        let engines = Arc::new(Engines {
            commands: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            context: zmq::Context::new(),
        });
        let engine_thread = {
            let (engines, index, dead_after) = (engines.clone(), index.clone(), config.drop_after);
            std::thread::Builder::new()
                .name("kvevent-engines".into())
                .spawn(move || engines.run(&index, dead_after))
                .map_err(FleetError::Runtime)?
        };
        Ok(Self {
            index,
            config,
            replicas: Mutex::new(HashMap::new()),
            runtime: handle,
            _runtime_stop: stop_tx,
            engines,
            engine_thread: Some(engine_thread),
        })
    }

    /// The index the replicas are followed into.
    pub fn index(&self) -> &Arc<Index> {
        &self.index
    }

    /// Follows `name` from `source`; nothing happens if it is already followed from the same
    /// source, and a replica whose source changed is followed from the new one. Call it from a
    /// discovery loop or a pod watch as often as you like.
    pub fn ensure_replica(&self, name: &str, source: ReplicaSource) -> Result<(), FleetError> {
        // Checked before anything changes: bad input loses nothing.
        let engine_sources = match &source {
            ReplicaSource::Sidecar(_)
                if self.config.index.mapping.key_mode != kvevent_index::KeyMode::Fingerprint =>
            {
                return Err(FleetError::KeyMode(name.to_owned()));
            }
            ReplicaSource::Sidecar(_) => None,
            ReplicaSource::Engine(e) => Some({
                for endpoint in std::iter::once(&e.endpoint).chain(&e.replay) {
                    if !connectable(endpoint) {
                        return Err(FleetError::Endpoint {
                            replica: name.to_owned(),
                            endpoint: endpoint.clone(),
                        });
                    }
                }
                kvevent_zmq::dp_sources(&e.endpoint, e.replay.as_deref(), e.dp, &e.topic, false)
                    .map_err(|source| FleetError::Engine {
                        replica: name.to_owned(),
                        source,
                    })?
            }),
        };
        let mut replicas = lock(&self.replicas);
        if replicas.get(name).is_some_and(|r| r.source == source) {
            return Ok(());
        }
        if let Some(old) = replicas.remove(name) {
            self.stop(name, old);
        }
        let status: Shared = Arc::new(Mutex::new(Status {
            lost_since: Some(Instant::now()),
            ..Status::default()
        }));
        let stop = match &source {
            ReplicaSource::Sidecar(feed) => {
                let follower = FeedFollower {
                    index: self.index.clone(),
                    name: name.to_owned(),
                    feed: feed.clone(),
                    status: status.clone(),
                    config: self.config.clone(),
                    source: None,
                    at: None,
                };
                Stop::Task(self.runtime.spawn(follower.run()).abort_handle())
            }
            ReplicaSource::Engine(e) => {
                let sources = engine_sources.unwrap_or_default();
                lock(&self.engines.commands).push(Command::Add {
                    name: name.to_owned(),
                    engine: e.engine,
                    sources,
                    status: status.clone(),
                });
                Stop::Engine
            }
        };
        replicas.insert(
            name.to_owned(),
            Replica {
                source,
                status,
                stop,
            },
        );
        Ok(())
    }

    /// Stops following `name` and forgets what it held. Nothing happens for an unknown name.
    pub fn remove_replica(&self, name: &str) {
        if let Some(old) = lock(&self.replicas).remove(name) {
            self.stop(name, old);
        }
    }

    fn stop(&self, name: &str, replica: Replica) {
        match replica.stop {
            Stop::Task(task) => task.abort(),
            Stop::Engine => lock(&self.engines.commands).push(Command::Remove {
                status: replica.status.clone(),
            }),
        }
        self.index.remove_replica(name);
    }

    /// Every replica followed, by name.
    pub fn replicas(&self) -> Vec<ReplicaStatus> {
        let replicas = lock(&self.replicas);
        let mut out: Vec<ReplicaStatus> = replicas
            .iter()
            .map(|(name, r)| {
                let s = lock(&r.status);
                ReplicaStatus {
                    name: name.clone(),
                    state: s.state(self.config.dead_after),
                    blocks: s.blocks,
                    newest_change: s.newest.map(|t| t.elapsed()),
                    block_size: (s.block_size > 0).then_some(s.block_size),
                    batches: s.batches,
                }
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// The block size the replicas' events use, once one has stored a block.
    pub fn block_size(&self) -> Option<u32> {
        lock(&self.replicas)
            .values()
            .map(|r| lock(&r.status).block_size)
            .find(|b| *b > 0)
    }

    /// Every replica holding block 0 of the query, best first (see
    /// [`kvevent_index::Index::score`]), each with its state.
    pub fn score(&self, query: &Query<'_>) -> Result<Vec<FleetScore>, ScoreError> {
        self.answer(query, None)
    }

    /// [`Fleet::score`] among `candidates` only (the replicas a router may send this request
    /// to); a candidate the fleet does not follow is not in the answer.
    pub fn score_among(
        &self,
        query: &Query<'_>,
        candidates: &[&str],
    ) -> Result<Vec<FleetScore>, ScoreError> {
        self.answer(query, Some(candidates))
    }

    fn answer(
        &self,
        query: &Query<'_>,
        candidates: Option<&[&str]>,
    ) -> Result<Vec<FleetScore>, ScoreError> {
        if let (QueryKeys::Tokens { block_size, .. }, Some(known)) =
            (&query.keys, self.block_size())
            && *block_size != known as usize
        {
            return Err(ScoreError::BlockSize {
                asked: *block_size,
                known,
            });
        }
        let scores = self.index.score(query);
        let replicas = lock(&self.replicas);
        Ok(scores
            .iter()
            .filter(|s| candidates.is_none_or(|c| c.contains(&s.replica)))
            .filter_map(|s| {
                let r = replicas.get(s.replica)?;
                let status = lock(&r.status);
                Some(FleetScore {
                    replica: s.replica.to_owned(),
                    matched_blocks: s.matched_blocks,
                    matched_tokens: s.matched_tokens,
                    tier: s.tier,
                    state: status.state(self.config.dead_after),
                    newest_change: status.newest.map(|t| t.elapsed()),
                })
            })
            .collect())
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for (_, r) in lock(&self.replicas).drain() {
            if let Stop::Task(t) = r.stop {
                t.abort();
            }
        }
        self.engines.stop.store(true, Relaxed);
        if let Some(t) = self.engine_thread.take() {
            let _ = t.join();
        }
    }
}

// --- sidecar feeds ------------------------------------------------------------------------------

/// Follows one sidecar's feed for as long as the replica is in the fleet.
struct FeedFollower {
    index: Arc<Index>,
    name: String,
    feed: SidecarFeed,
    status: Shared,
    config: FleetConfig,
    /// The source counting for the replica now.
    source: Option<SourceId>,
    /// The (epoch, seq) of the last change applied.
    at: Option<(u64, u64)>,
}

/// The snapshot loading: its source, epoch, seq and blocks so far.
type Loading = (SourceId, u64, u64, u64);

/// Why a feed's stream ended.
#[derive(Debug, thiserror::Error)]
enum FeedError {
    #[error("cannot connect: {0}")]
    Connect(#[source] tonic::transport::Error),
    #[error("the address is not valid: {0}")]
    Address(String),
    #[error("{}: {}", .0.code(), .0.message())]
    Status(tonic::Status),
    #[error("nothing heard for {0:?}")]
    Silent(Duration),
    #[error("the sidecar serves {what} `{served}`, not `{asked}`")]
    Mismatch {
        what: &'static str,
        served: String,
        asked: String,
    },
    #[error("a malformed feed: {0}")]
    Malformed(&'static str),
}

impl FeedFollower {
    async fn run(mut self) {
        let mut backoff = Duration::from_millis(100);
        let mut last_log: Option<Instant> = None;
        loop {
            let result = self.follow_once().await;
            {
                let mut s = lock(&self.status);
                s.lost_since.get_or_insert_with(Instant::now);
            }
            match &result {
                Ok(()) => backoff = Duration::from_millis(100),
                Err(e) => {
                    if last_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(30)) {
                        tracing::warn!(replica = %self.name, url = %self.feed.url, error = %e, "lost the sidecar's feed; following again");
                        last_log = Some(Instant::now());
                    }
                }
            }
            self.drop_if_lost_too_long();
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
            self.drop_if_lost_too_long();
        }
    }

    /// After `drop_after` without its source, a replica's entries stop counting.
    fn drop_if_lost_too_long(&mut self) {
        let lost = lock(&self.status)
            .lost_since
            .is_some_and(|t| t.elapsed() >= self.config.drop_after);
        if lost && let Some(source) = self.source.take() {
            self.index.remove_source(source);
            self.at = None;
            lock(&self.status).blocks = 0;
        }
    }

    async fn follow_once(&mut self) -> Result<(), FeedError> {
        let endpoint = Endpoint::from_shared(self.feed.url.clone())
            .map_err(|e| FeedError::Address(e.to_string()))?
            .connect_timeout(self.config.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5));
        let endpoint = match &self.feed.tls {
            Some(tls) => endpoint
                .tls_config(tls.clone())
                .map_err(FeedError::Connect)?,
            None => endpoint,
        };
        let channel = endpoint.connect().await.map_err(FeedError::Connect)?;
        let mut client = pb::feed_client::FeedClient::new(channel)
            .max_decoding_message_size(self.config.max_message_bytes);
        let mut request = tonic::Request::new(pb::FollowRequest {
            replica: self.feed.replica.clone(),
            model: self.feed.model.clone(),
            resume: self.at.map(|(epoch, seq)| pb::Position { epoch, seq }),
        });
        if let Some(token) = &self.feed.token {
            let value = format!("Bearer {token}")
                .parse()
                .map_err(|_| FeedError::Address("the token is not a valid header value".into()))?;
            request.metadata_mut().insert("authorization", value);
        }
        let mut stream = client
            .follow(request)
            .await
            .map_err(FeedError::Status)?
            .into_inner();
        // Until the Hello says otherwise.
        let mut silent_after = self.config.dead_after;
        let mut loading: Option<Loading> = None;
        let result = loop {
            let message = match tokio::time::timeout(silent_after, stream.message()).await {
                Err(_) => break Err(FeedError::Silent(silent_after)),
                Ok(Err(status)) => break Err(FeedError::Status(status)),
                Ok(Ok(None)) => break Ok(()),
                Ok(Ok(Some(m))) => m,
            };
            if let Err(e) = self.take(message, &mut loading, &mut silent_after) {
                break Err(e);
            }
        };
        self.stream_ended(&mut loading);
        result
    }

    /// A stream ended (or failed): a snapshot cut short never counts, and the state before it
    /// goes on counting (degraded, then stale) until a whole snapshot arrives.
    fn stream_ended(&mut self, loading: &mut Option<Loading>) {
        if let Some((source, ..)) = loading.take() {
            self.index.remove_source(source);
        }
        let mut s = lock(&self.status);
        s.lost_since.get_or_insert_with(Instant::now);
    }

    fn take(
        &mut self,
        message: pb::FeedMessage,
        loading: &mut Option<Loading>,
        silent_after: &mut Duration,
    ) -> Result<(), FeedError> {
        use pb::feed_message::Body;
        let (epoch, seq) = (message.epoch, message.seq);
        match message.body {
            Some(Body::Hello(hello)) => {
                for (what, asked, served) in [
                    ("replica", &self.feed.replica, &hello.replica),
                    ("model", &self.feed.model, &hello.model),
                ] {
                    if !asked.is_empty() && asked != served {
                        return Err(FeedError::Mismatch {
                            what,
                            served: served.clone(),
                            asked: asked.clone(),
                        });
                    }
                }
                // Three heartbeats missed: the stream is lost.
                if hello.heartbeat_ms > 0 {
                    *silent_after = Duration::from_millis(u64::from(hello.heartbeat_ms) * 3)
                        .max(Duration::from_millis(500));
                }
                let mut s = lock(&self.status);
                s.lost_since = None;
                s.dropped = false;
                if hello.block_size > 0 {
                    s.block_size = hello.block_size;
                }
                s.degraded = (!hello.resumed).then_some(Degraded::SnapshotLoading);
            }
            Some(Body::Snapshot(chunk)) => {
                let fresh = !loading.is_some_and(|l| l.1 == epoch && l.2 == seq);
                if fresh {
                    if let Some((old, ..)) = loading.take() {
                        self.index.remove_source(old);
                    }
                    *loading = Some((self.index.add_loading_source(&self.name), epoch, seq, 0));
                    lock(&self.status).degraded = Some(Degraded::SnapshotLoading);
                }
                let Some(l) = loading.as_mut() else {
                    return Err(FeedError::Malformed("no snapshot loading"));
                };
                let changes: Vec<KeyChange<'_>> = chunk.blocks.iter().map(stored).collect();
                self.index.apply_keys(l.0, &changes);
                l.3 += chunk.blocks.len() as u64;
            }
            Some(Body::SnapshotEnd(end)) => {
                let (source, count) = match loading.take() {
                    Some((source, e, s, count)) if e == epoch && s == seq => (source, count),
                    Some(_) => return Err(FeedError::Malformed("a snapshot's end of another")),
                    // An empty snapshot has no chunk.
                    None => (self.index.add_loading_source(&self.name), 0),
                };
                if count != end.blocks {
                    self.index.remove_source(source);
                    return Err(FeedError::Malformed("a snapshot's chunks do not add up"));
                }
                self.index.promote(source, self.source);
                self.source = Some(source);
                self.at = Some((epoch, seq));
                let mut s = lock(&self.status);
                s.blocks = count;
                s.degraded = None;
                s.newest = Some(Instant::now());
            }
            Some(Body::Changes(changes)) => {
                let (Some((at_epoch, _)), Some(source)) = (self.at, self.source) else {
                    return Err(FeedError::Malformed("changes before any snapshot"));
                };
                if at_epoch != epoch {
                    return Err(FeedError::Malformed("changes of another epoch"));
                }
                let mut applied = Vec::with_capacity(changes.changes.len());
                let mut blocks = lock(&self.status).blocks as i64;
                for c in &changes.changes {
                    match &c.kind {
                        Some(pb::change::Kind::Stored(b)) => {
                            blocks += 1;
                            applied.push(stored(b));
                        }
                        Some(pb::change::Kind::Moved(b)) => applied.push(stored(b)),
                        Some(pb::change::Kind::Removed(r)) => {
                            blocks -= 1;
                            applied.push(KeyChange::Evicted {
                                key: r.key,
                                adapter: &r.adapter,
                            });
                        }
                        None => {}
                    }
                }
                self.index.apply_keys(source, &applied);
                self.at = Some((epoch, seq));
                let mut s = lock(&self.status);
                s.blocks = blocks.max(0) as u64;
                s.newest = Some(Instant::now());
                s.batches += 1;
            }
            Some(Body::Heartbeat(_)) | None => {}
        }
        Ok(())
    }
}

/// `tcp://HOST:PORT`, `ipc://PATH` or `inproc://NAME`.
fn connectable(endpoint: &str) -> bool {
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        return rest
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    }
    ["ipc://", "inproc://"]
        .iter()
        .any(|p| endpoint.strip_prefix(p).is_some_and(|r| !r.is_empty()))
}

fn stored(b: &pb::Block) -> KeyChange<'_> {
    KeyChange::Stored {
        key: b.key,
        tokens: b.tokens,
        tier: if b.tier == pb::Tier::T2 as i32 {
            Tier::T2
        } else {
            Tier::T1
        },
        adapter: &b.adapter,
    }
}

// --- engines ------------------------------------------------------------------------------------

enum Command {
    Add {
        name: String,
        sources: Vec<kvevent_zmq::Source>,
        engine: kvevent_wire::Engine,
        status: Shared,
    },
    Remove {
        status: Shared,
    },
}

/// The engine thread's inbox.
struct Engines {
    commands: Mutex<Vec<Command>>,
    stop: AtomicBool,
    context: zmq::Context,
}

/// One engine source (a DP rank) as the engine thread follows it.
struct Rank {
    name: String,
    id: SourceId,
    status: Shared,
}

/// Most updates applied under one write lock.
const APPLY_MAX: usize = 64;

/// How often the engine thread sets each replica's state from its sockets.
const STATUS_EVERY: Duration = Duration::from_millis(100);

impl Engines {
    fn run(&self, index: &Index, drop_after: Duration) {
        let mut subscriber: Option<Subscriber> = None;
        let mut last_pass = Instant::now();
        // By subscriber source number.
        let mut ranks: Vec<Option<Rank>> = Vec::new();
        while !self.stop.load(Relaxed) {
            let commands = std::mem::take(&mut *lock(&self.commands));
            for command in commands {
                match command {
                    Command::Add {
                        name,
                        sources,
                        engine,
                        status,
                    } => {
                        for source in sources {
                            let added = match subscriber.as_mut() {
                                Some(s) => s.add_source_of(source.clone(), engine),
                                None => Subscriber::start(&self.context, {
                                    let mut c = kvevent_source::Config::new(vec![source.clone()]);
                                    c.engine = engine;
                                    c
                                })
                                .map(|s| {
                                    subscriber = Some(s);
                                    0
                                }),
                            };
                            match added {
                                Ok(i) => {
                                    if ranks.len() <= i {
                                        ranks.resize_with(i + 1, || None);
                                    }
                                    ranks[i] = Some(Rank {
                                        name: name.clone(),
                                        id: index.add_source(&name),
                                        status: status.clone(),
                                    });
                                }
                                Err(e) => {
                                    tracing::error!(replica = %name, endpoint = %source.endpoint, error = %e, "cannot follow this engine source");
                                }
                            }
                        }
                    }
                    Command::Remove { status } => {
                        for (i, slot) in ranks.iter_mut().enumerate() {
                            if slot
                                .as_ref()
                                .is_some_and(|r| Arc::ptr_eq(&r.status, &status))
                            {
                                *slot = None;
                                if let Some(s) = subscriber.as_mut() {
                                    s.remove_source(i);
                                }
                            }
                        }
                    }
                }
            }
            let Some(sub) = subscriber.as_mut() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let mut block_sizes: Vec<(usize, u32)> = Vec::new();
            let applied = sub.next_many(Duration::from_millis(50), APPLY_MAX, |views| {
                let mut run = Vec::with_capacity(views.len());
                let mut touched = Vec::new();
                for view in views {
                    match view {
                        View::Batch { source, batch, .. } => {
                            if let Some(Some(r)) = ranks.get(*source) {
                                run.push((r.id, *batch));
                                touched.push(*source);
                                if let Some(b) = batch.events.iter().find_map(|e| match e {
                                    kvevent_wire::Event::BlockStored(s) => Some(s.block_size),
                                    _ => None,
                                }) {
                                    block_sizes.push((*source, b));
                                }
                            }
                        }
                        View::Reset { source, .. } => {
                            if let Some(Some(r)) = ranks.get(*source) {
                                index.apply_many(&run);
                                run.clear();
                                index.reset(r.id);
                                touched.push(*source);
                            }
                        }
                    }
                }
                index.apply_many(&run);
                touched
            });
            for (source, size) in block_sizes {
                if let Some(Some(r)) = ranks.get(source)
                    && size > 0
                {
                    lock(&r.status).block_size = size;
                }
            }
            let now = Instant::now();
            if let Some(mut touched) = applied {
                touched.dedup();
                for source in touched {
                    if let Some(Some(r)) = ranks.get(source) {
                        lock(&r.status).newest = Some(now);
                    }
                }
            }
            if now.duration_since(last_pass) < STATUS_EVERY {
                continue;
            }
            last_pass = now;
            // Each replica's status from its ranks: lost when any rank's socket is, degraded
            // when any is.
            let mut by_status: HashMap<*const Mutex<Status>, (Shared, bool, bool, u64, u64)> =
                HashMap::new();
            for (i, slot) in ranks.iter().enumerate() {
                let Some(r) = slot else { continue };
                let m = &sub.metrics()[i];
                let e = by_status
                    .entry(Arc::as_ptr(&r.status))
                    .or_insert_with(|| (r.status.clone(), true, false, 0, 0));
                e.1 &= m.connected.load(Relaxed);
                e.2 |= m.degraded.load(Relaxed);
                e.3 += index.source_blocks(r.id) as u64;
                e.4 += m.batches.load(Relaxed);
                index.set_fresh(r.id, !m.degraded.load(Relaxed));
            }
            let mut expired = Vec::new();
            for (_, (status, connected, degraded, blocks, batches)) in by_status {
                let mut s = lock(&status);
                s.blocks = blocks;
                s.batches = batches;
                s.degraded = degraded.then_some(Degraded::Replaying);
                if connected {
                    s.lost_since = None;
                    s.dropped = false;
                } else {
                    let since = *s.lost_since.get_or_insert(now);
                    if since.elapsed() >= drop_after && !s.dropped {
                        s.dropped = true;
                        expired.push(status.clone());
                    }
                }
            }
            // Lost too long: the replica's entries stop counting; its sources start over
            // empty (what its engine's replay holds comes back when it does).
            for status in expired {
                for slot in ranks.iter_mut().flatten() {
                    if Arc::ptr_eq(&slot.status, &status) {
                        index.remove_source(slot.id);
                        slot.id = index.add_source(&slot.name);
                    }
                }
                lock(&status).blocks = 0;
            }
        }
        if let Some(s) = subscriber {
            s.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    //! The follower's rules for one stream's messages, without a network: snapshots load
    //! beside the state they replace and count only when whole; a stream cut short or
    //! malformed leaves the previous state counting.

    use super::*;

    fn follower(index: &Arc<Index>) -> FeedFollower {
        FeedFollower {
            index: index.clone(),
            name: "a".into(),
            feed: SidecarFeed::new("http://unused"),
            status: Arc::new(Mutex::new(Status::default())),
            config: FleetConfig::default(),
            source: None,
            at: None,
        }
    }

    fn message(epoch: u64, seq: u64, body: pb::feed_message::Body) -> pb::FeedMessage {
        pb::FeedMessage {
            epoch,
            seq,
            body: Some(body),
        }
    }

    fn blocks(keys: &[u64]) -> pb::feed_message::Body {
        pb::feed_message::Body::Snapshot(pb::Blocks {
            blocks: keys
                .iter()
                .map(|k| pb::Block {
                    key: *k,
                    tokens: 16,
                    tier: pb::Tier::T1 as i32,
                    ..Default::default()
                })
                .collect(),
        })
    }

    fn end(n: u64) -> pb::feed_message::Body {
        pb::feed_message::Body::SnapshotEnd(pb::SnapshotEnd { blocks: n })
    }

    fn holds(index: &Index, key: u64) -> bool {
        !index
            .score(&Query {
                adapter: "",
                keys: QueryKeys::Keys(&[key]),
            })
            .is_empty()
    }

    #[test]
    fn a_new_snapshot_replaces_the_old_state_only_when_whole() {
        let index = Arc::new(Index::new(kvevent_index::Config::default()));
        let mut f = follower(&index);
        let mut loading = None;
        let mut silent = Duration::from_secs(3);
        let mut take = |f: &mut FeedFollower, m, loading: &mut Option<Loading>| {
            f.take(m, loading, &mut silent)
        };
        take(&mut f, message(1, 5, blocks(&[1, 2])), &mut loading).expect("chunk");
        assert!(!holds(&index, 1), "a snapshot counts only when whole");
        take(&mut f, message(1, 5, end(2)), &mut loading).expect("end");
        assert!(holds(&index, 1) && holds(&index, 2));
        assert_eq!(f.at, Some((1, 5)));
        // A new epoch's snapshot loads beside it; the old state counts meanwhile.
        take(&mut f, message(2, 0, blocks(&[3])), &mut loading).expect("chunk");
        assert!(holds(&index, 1) && !holds(&index, 3));
        // The sidecar dies mid-snapshot: the old state goes on counting.
        f.stream_ended(&mut loading);
        assert!(holds(&index, 1) && !holds(&index, 3));
        assert!(lock(&f.status).lost_since.is_some());
        // The next stream's whole snapshot replaces it at once.
        take(&mut f, message(2, 0, blocks(&[3])), &mut loading).expect("chunk");
        take(&mut f, message(2, 0, end(1)), &mut loading).expect("end");
        assert!(!holds(&index, 1) && holds(&index, 3));
        // Changes go on from its position.
        let removed = pb::Change {
            kind: Some(pb::change::Kind::Removed(pb::Removed {
                key: 3,
                ..Default::default()
            })),
        };
        let changes = pb::feed_message::Body::Changes(pb::Changes {
            changes: vec![removed],
        });
        take(&mut f, message(2, 1, changes), &mut loading).expect("changes");
        assert!(!holds(&index, 3));
        assert_eq!(f.at, Some((2, 1)));
    }

    #[test]
    fn a_malformed_stream_is_an_error_and_the_state_before_it_stays() {
        let index = Arc::new(Index::new(kvevent_index::Config::default()));
        let mut f = follower(&index);
        let mut loading = None;
        let mut silent = Duration::from_secs(3);
        // Changes before any snapshot.
        let changes = || pb::feed_message::Body::Changes(pb::Changes::default());
        assert!(
            f.take(message(1, 1, changes()), &mut loading, &mut silent)
                .is_err()
        );
        f.take(message(1, 0, blocks(&[7])), &mut loading, &mut silent)
            .expect("chunk");
        f.take(message(1, 0, end(1)), &mut loading, &mut silent)
            .expect("end");
        // Chunks that do not add up.
        f.take(message(2, 0, blocks(&[8])), &mut loading, &mut silent)
            .expect("chunk");
        assert!(
            f.take(message(2, 0, end(5)), &mut loading, &mut silent)
                .is_err()
        );
        f.stream_ended(&mut loading);
        assert!(holds(&index, 7) && !holds(&index, 8));
        // Changes of another epoch than the follower's.
        assert!(
            f.take(message(9, 3, changes()), &mut loading, &mut silent)
                .is_err()
        );
        // A hello naming another replica than asked for.
        f.feed.replica = "a".into();
        let hello = pb::feed_message::Body::Hello(pb::Hello {
            replica: "b".into(),
            ..Default::default()
        });
        let err = f
            .take(message(1, 0, hello), &mut loading, &mut silent)
            .expect_err("another replica");
        assert!(err.to_string().contains("`b`"), "{err}");
        assert!(holds(&index, 7));
    }
}
