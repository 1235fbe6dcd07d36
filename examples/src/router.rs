//! A router's scoring service: follows replicas through their sidecars' feeds or their engines
//! (with replay and DP ranks) into a [`kvevent_fleet::Fleet`] and answers `POST /score`,
//! `GET /replicas` and `GET /metrics` over HTTP.
//!
//! `examples/router.rs` is its command line; tests start it in-process.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::proxy::{Body, Proxy, Upstream};
use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvevent_fleet::{
    EngineSockets, Fleet, FleetConfig, Query, QueryKeys, ReplicaSource, ReplicaState, ScoreError,
    SidecarFeed, Tier, route,
};

/// One `--engine NAME=SOCKETS`: a replica followed through its engine's sockets, SOCKETS in
/// [`EngineSockets`]' text form (`tcp://host:port[,replay=tcp://host:port][,dp=N][,topic=T]
/// [,engine=sglang][,http=http://host:port]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Engine {
    /// The replica's name in the scores.
    pub name: String,
    /// Its engine's sockets.
    pub sockets: EngineSockets,
}

impl std::str::FromStr for Engine {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let (name, sockets) = s
            .split_once('=')
            .filter(|(name, _)| !name.is_empty())
            .with_context(|| format!("`{s}`: an engine is NAME=tcp://host:port[,replay=...]"))?;
        Ok(Engine {
            name: name.to_owned(),
            sockets: sockets
                .parse()
                .map_err(|e: String| anyhow::anyhow!("`{s}`: {e}"))?,
        })
    }
}

/// One `--sidecar NAME=http://host:port`: a replica followed through its sidecar's feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sidecar {
    /// The replica's name in the scores.
    pub name: String,
    /// The sidecar's `--feed-address`, as `http://host:port`.
    pub url: String,
}

impl std::str::FromStr for Sidecar {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let (name, url) = s
            .split_once('=')
            .context("a sidecar is NAME=http://host:port (its --feed-address)")?;
        if name.is_empty() || !(url.starts_with("http://") || url.starts_with("https://")) {
            bail!("`{s}`: a sidecar is NAME=http://host:port (its --feed-address)");
        }
        Ok(Sidecar {
            name: name.to_owned(),
            url: url.to_owned(),
        })
    }
}

/// What the service is set up with.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// The model it routes; a query for another is refused.
    pub model: String,
    /// The model's block size, for queries that do not say (else the one the events use).
    pub block_size: Option<usize>,
    /// The engines followed directly.
    pub engines: Vec<Engine>,
    /// The replicas followed through their sidecars' feeds.
    pub sidecars: Vec<Sidecar>,
    /// Replicas discovered, followed as they come and go (their upstreams are candidates).
    pub discover: Option<kvevent_fleet::discover::Spec>,
    /// Where the replicas serve completions: `POST /v1/completions` is routed among these.
    pub upstreams: Vec<Upstream>,
    /// Deadline of a routed request's response (and of each frame of a streamed one).
    pub upstream_timeout: std::time::Duration,
    /// The engine's `tokenizer.json`, for text prompts (token ids need none).
    pub tokenizer: Option<std::path::PathBuf>,
    /// How `POST /v1/completions` is routed ([`kvevent_fleet::route::Policy`]).
    pub policy: kvevent_fleet::route::Policy,
    /// The cost policy's weights learned from the router's flights, starting from the
    /// policy's ([`route::Router::learning`]); false: kept as given.
    pub learn_weights: bool,
}

impl RouterConfig {
    /// A router for `model` following nothing yet: replicas, upstreams and discovery to add;
    /// a routed response waited for 60 s; the default policy.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            block_size: None,
            engines: Vec::new(),
            sidecars: Vec::new(),
            discover: None,
            upstreams: Vec::new(),
            upstream_timeout: std::time::Duration::from_secs(60),
            tokenizer: None,
            policy: kvevent_fleet::route::Policy::default(),
            learn_weights: true,
        }
    }
}

/// Why a request is refused, as its HTTP status says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// The body is not what the endpoint takes (400).
    BadRequest(String),
    /// It asks about another model than the one served (404).
    OtherModel {
        /// The model served.
        served: String,
        /// The model asked about.
        asked: String,
    },
    /// Nothing can be answered yet (no replica said its block size): route as if nothing
    /// matched (503).
    NotYet(String),
}

impl RequestError {
    /// The HTTP status.
    pub fn status(&self) -> u16 {
        match self {
            Self::BadRequest(_) => 400,
            Self::OtherModel { .. } => 404,
            Self::NotYet(_) => 503,
        }
    }
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadRequest(m) | Self::NotYet(m) => f.write_str(m),
            Self::OtherModel { served, asked } => {
                write!(f, "this router serves `{served}`, not `{asked}`")
            }
        }
    }
}

impl std::error::Error for RequestError {}

/// The running service: a [`Fleet`] of the replicas.
pub struct Router {
    fleet: Arc<Fleet>,
    config: RouterConfig,
    proxy: Proxy,
    /// `/metrics`: the fleet's collector and the proxy's own families.
    registry: prometheus_client::registry::Registry,
}

impl Router {
    /// Follows every engine and sidecar, on the tokio runtime it is called in.
    pub fn start(config: RouterConfig) -> anyhow::Result<Self> {
        let fleet = Arc::new(Fleet::new(FleetConfig::default())?);
        for e in &config.engines {
            fleet.ensure_replica(&e.name, ReplicaSource::Engine(e.sockets.clone()))?;
        }
        for s in &config.sidecars {
            fleet.ensure_replica(
                &s.name,
                ReplicaSource::Sidecar(SidecarFeed {
                    model: config.model.clone(),
                    ..SidecarFeed::new(s.url.clone())
                }),
            )?;
        }
        let followed = |name: &str| {
            config.engines.iter().any(|e| e.name == name)
                || config.sidecars.iter().any(|s| s.name == name)
        };
        if let Some(u) = config.upstreams.iter().find(|u| !followed(&u.name)) {
            bail!(
                "--upstream {}={}: no --engine or --sidecar follows a replica named `{}`",
                u.name,
                u.url,
                u.name
            );
        }
        let tokenizer = match &config.tokenizer {
            Some(path) => Some(tokenizers::Tokenizer::from_file(path).map_err(|e| {
                anyhow::anyhow!("--tokenizer {}: not a tokenizer.json: {e}", path.display())
            })?),
            None => None,
        };
        let discovered = match &config.discover {
            Some(spec) => Some(
                spec.follow(fleet.clone(), &config.model)
                    .context("--discover")?,
            ),
            None => None,
        };
        let mut router = route::Router::new(fleet.clone(), route::Rule::new(config.policy));
        if config.learn_weights {
            router = router.learning();
        }
        let router = Arc::new(router);
        let proxy = Proxy::new(
            config.upstreams.clone(),
            config.upstream_timeout,
            tokenizer,
            config.model.clone(),
            router.clone(),
            discovered,
        );
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(kvevent_fleet::metrics::FleetCollector::new(
            fleet.clone(),
        )));
        registry.register_collector(Box::new(kvevent_fleet::metrics::RouterCollector::new(
            router,
        )));
        proxy.register(&mut registry);
        Ok(Self {
            fleet,
            config,
            proxy,
            registry,
        })
    }

    /// The fleet, for embedding.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// Answers one `/score` body.
    pub fn score(&self, body: &[u8]) -> Result<serde_json::Value, RequestError> {
        let bad = RequestError::BadRequest;
        let v: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| bad(format!("not JSON: {e}")))?;
        let model = v["model"].as_str().unwrap_or_default();
        if model != self.config.model {
            return Err(RequestError::OtherModel {
                served: self.config.model.clone(),
                asked: model.to_owned(),
            });
        }
        let adapter = v["adapter"].as_str().unwrap_or_default();
        let block_size = v["block_size"]
            .as_u64()
            .map(|b| b as usize)
            .or(self.config.block_size)
            .or(self.fleet.block_size().map(|b| b as usize))
            .filter(|b| *b > 0)
            .ok_or_else(|| {
                bad("`block_size` is needed: none is configured and no replica has stored a block yet".into())
            })?;
        let tokens: Vec<u32> = v["token_ids"]
            .as_array()
            .ok_or_else(|| bad("`token_ids` must be an array of token ids".into()))?
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("`token_ids` must hold unsigned 32-bit integers".into()))?;
        let query = Query {
            adapter,
            keys: QueryKeys::Tokens {
                ids: &tokens,
                block_size,
            },
        };
        let candidates: Option<Vec<&str>> = v["candidates"]
            .as_array()
            .map(|c| c.iter().filter_map(|n| n.as_str()).collect());
        let scores = match &candidates {
            Some(c) => self.fleet.score_among(&query, c),
            None => self.fleet.score(&query),
        }
        .map_err(|e| match e {
            // Nothing can be known yet: the caller routes as if nothing matched.
            ScoreError::BlockSizeUnknown => RequestError::NotYet(e.to_string()),
            ScoreError::BlockSize { .. } => bad(e.to_string()),
        })?;
        let not_followed: Vec<&str> = candidates
            .as_deref()
            .map(|c| scores.unknown().iter().map(|i| c[*i]).collect())
            .unwrap_or_default();
        Ok(serde_json::json!({
            "scores": scores.iter().map(|s| serde_json::json!({
                "replica": s.replica,
                "matched_tokens": s.matched_tokens,
                "matched_blocks": s.matched_blocks,
                "tier": match s.tier { Tier::T1 => "T1", Tier::T2 => "T2" },
                "state": s.state.as_str(),
                "reason": s.state.reason(),
                "exact": s.state == ReplicaState::Exact,
            })).collect::<Vec<_>>(),
            "not_followed": not_followed,
        }))
    }

    /// Every replica: where it is followed from, its state and why (degraded or stale, and
    /// what was lost), the last error, its engine's ranks, blocks held, age of its newest
    /// change, its engine's load (with its age, and whether it is too old to route on).
    pub fn replicas(&self) -> serde_json::Value {
        serde_json::json!({
            "replicas": self.fleet.replicas().iter().map(|r| serde_json::json!({
                "name": r.name,
                "source": r.source,
                "state": r.state.as_str(),
                "reason": r.state.reason(),
                "stale_for_ms": match r.state {
                    ReplicaState::Stale { since, .. } => Some(since.elapsed().as_millis() as u64),
                    _ => None,
                },
                "error": r.error,
                "ranks": r.ranks.iter().map(|k| serde_json::json!({
                    "rank": k.rank,
                    "connected": k.connected,
                    "for_ms": k.since.map(|d| d.as_millis() as u64),
                    "degraded": k.degraded,
                })).collect::<Vec<_>>(),
                "blocks": r.blocks,
                "newest_change_ms": r.newest_change.map(|d| d.as_millis() as u64),
                "block_size": r.block_size,
                "load": r.load.as_ref().map(|l| {
                    let age = l.age(std::time::Instant::now());
                    serde_json::json!({
                        "running": l.load.running(),
                        "waiting": l.load.waiting(),
                        "kv_usage": l.load.kv_usage(),
                        "ranks": l.load.ranks.iter().map(figures).collect::<Vec<_>>(),
                        "age_ms": age.as_millis() as u64,
                        "old": age > self.proxy.router().rule().load_old_after(),
                        "error": r.load_error,
                    })
                }),
            })).collect::<Vec<_>>(),
            "policy": self.proxy.router().rule().policy().as_str(),
            "weights": self.proxy.router().weights().map(|w| serde_json::json!({
                "prefill_us_per_token": w.weights.prefill_us_per_token,
                "queue_us_per_request": w.weights.queue_us_per_request,
                "learned": w.learned,
                "flights": w.flights,
            })),
        })
    }

    /// The index's and replicas' counters, the predictions' accounting and the proxy's own
    /// latency, in the Prometheus text format.
    pub fn metrics(&self) -> String {
        let mut text = String::with_capacity(16 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        prometheus_text(&text)
    }
}

/// prometheus-client writes OpenMetrics; `/metrics` is served as Prometheus text 0.0.4 (what
/// `promtool check metrics` and every scraper read): a counter's HELP and TYPE name its samples
/// (`x_total`), and OpenMetrics' `# UNIT` and `# EOF` lines go.
fn prometheus_text(open_metrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in open_metrics.lines() {
        if let Some(name) = line
            .strip_prefix("# TYPE ")
            .and_then(|l| l.strip_suffix(" counter"))
        {
            counters.insert(name.to_owned());
        }
    }
    let mut out = String::with_capacity(open_metrics.len() + 64 * counters.len());
    for line in open_metrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

fn respond(status: u16, content_type: &str, body: String) -> hyper::Response<Body> {
    let mut r = hyper::Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// Serves `/v1/completions`, `/score`, `/replicas` and `/metrics` on `listener` until the task
/// is dropped.
pub async fn serve(listener: tokio::net::TcpListener, router: Arc<Router>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let router = router.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let router = router.clone();
                async move {
                    let path = req.uri().path().to_owned();
                    let post = req.method() == hyper::Method::POST;
                    Ok::<_, Infallible>(match (post, path.as_str()) {
                        (true, "/v1/completions") => router.proxy.complete(req).await,
                        (true, "/score") => {
                            // Prompts are bounded: 8 MiB of JSON is ~1M token ids.
                            match Limited::new(req.into_body(), 8 << 20).collect().await {
                                Ok(body) => match router.score(&body.to_bytes()) {
                                    Ok(v) => respond(200, "application/json", v.to_string()),
                                    Err(e) => respond(
                                        e.status(),
                                        "application/json",
                                        serde_json::json!({ "error": e.to_string() }).to_string(),
                                    ),
                                },
                                Err(e) => respond(413, "text/plain", format!("body: {e}\n")),
                            }
                        }
                        (false, "/metrics") => {
                            respond(200, "text/plain; version=0.0.4", router.metrics())
                        }
                        (false, "/replicas") => {
                            respond(200, "application/json", router.replicas().to_string())
                        }
                        _ => respond(
                            404,
                            "text/plain",
                            "POST /v1/completions, POST /score, GET /replicas, GET /metrics\n"
                                .into(),
                        ),
                    })
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Binds `listen` and serves; returns the address bound.
pub async fn bind(
    listen: &str,
    router: Arc<Router>,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("bind --listen {listen}"))?;
    let addr = listener.local_addr()?;
    Ok((addr, tokio::spawn(serve(listener, router))))
}

/// A rank's load as `/replicas` shows it: each figure by its name.
fn figures(rank: &kvevent_fleet::RankLoad) -> serde_json::Value {
    rank.figures()
        .into_iter()
        .map(|(name, figure)| {
            let value = match figure {
                kvevent_fleet::Figure::Count(n) => serde_json::json!(n),
                kvevent_fleet::Figure::Fraction(f) => serde_json::json!(f),
            };
            (name.to_owned(), value)
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}
