//! A router's scoring service: follows replicas through their sidecars' feeds or their engines
//! (with replay and DP ranks) into a [`kvevent_fleet::Fleet`] and answers `POST /score`,
//! `GET /replicas` and `GET /metrics` over HTTP.
//!
//! `examples/router.rs` is its command line; tests start it in-process.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::proxy::{error, respond};
use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use hyper_util::rt::TokioIo;
use kvevent_fleet::discover::{self, Listed};
use kvevent_fleet::metrics::{FleetCollector, RouterCollector};
use kvevent_fleet::{Fleet, FleetConfig, Query, QueryKeys, ReplicaState, ScoreError, Tier, route};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

/// What the service is set up with.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// The model it routes; a query for another is refused.
    pub model: String,
    /// The model's block size, for queries that do not say (else the one the events use).
    pub block_size: Option<usize>,
    /// Replicas listed by hand (`--sidecar`, `--engine`, `--upstream`); those with an
    /// upstream are candidates of `POST /v1/completions`.
    pub replicas: Vec<Listed>,
    /// Replicas discovered, followed as they come and go (their upstreams are candidates too).
    pub discover: Option<discover::Spec>,
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
            replicas: Vec::new(),
            discover: None,
            upstream_timeout: std::time::Duration::from_secs(60),
            tokenizer: None,
            policy: kvevent_fleet::route::Policy::default(),
            learn_weights: true,
        }
    }
}

/// Upper bounds of the proxy overhead histogram, in seconds.
const OVERHEAD_BUCKETS: [f64; 8] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
];

/// The running service: a [`Fleet`] of the replicas, and the routing loop on it
/// (`kvevent_fleet::route::Router`) with HTTP around it.
pub struct Router {
    pub(crate) fleet: Arc<Fleet>,
    pub(crate) config: RouterConfig,
    pub(crate) router: Arc<route::Router>,
    /// Where each replica serves completions, listed or discovered: the candidates.
    pub(crate) upstreams: discover::Upstreams,
    pub(crate) client: Client<HttpConnector, Full<Bytes>>,
    /// Turns text prompts into the engine's token ids, when given.
    pub(crate) tokenizer: Option<tokenizers::Tokenizer>,
    /// What the router adds to a request, in seconds.
    pub(crate) overhead: Histogram,
    /// Responses by replica and status ("502" for a replica that failed, "refused" for one
    /// whose connection was refused).
    pub(crate) responses: Family<Vec<(&'static str, String)>, Counter>,
    /// `/metrics`: the fleet's and the routing loop's collectors, and the families above.
    registry: prometheus_client::registry::Registry,
}

impl Router {
    /// Follows every engine and sidecar, on the tokio runtime it is called in.
    pub fn start(config: RouterConfig) -> anyhow::Result<Self> {
        let fleet = Arc::new(Fleet::new(FleetConfig::default())?);
        let listed =
            discover::listed(&config.replicas, &config.model).map_err(anyhow::Error::msg)?;
        let followed = discover::reconcile(&fleet, &mut Default::default(), &listed);
        if let Some((name, why)) = followed.skipped.first() {
            bail!("`{name}` cannot be followed: {why}");
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
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.upstream_timeout));
        let (overhead, responses) = (Histogram::new(OVERHEAD_BUCKETS), Family::default());
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(FleetCollector::new(fleet.clone())));
        registry.register_collector(Box::new(RouterCollector::new(router.clone())));
        registry.register(
            "kvevent_router_responses",
            "Routed responses by replica and HTTP status (502: the replica failed the request; refused: its connection was refused)",
            responses.clone(),
        );
        registry.register_with_unit(
            "kvevent_router_proxy_overhead",
            "What the router adds to a request (choosing, forwarding, reading the usage), not the engine's time",
            prometheus_client::registry::Unit::Seconds,
            overhead.clone(),
        );
        Ok(Self {
            fleet,
            config,
            router,
            upstreams: discover::Upstreams::new(&listed, discovered),
            client: Client::builder(TokioExecutor::new()).build(connector),
            tokenizer,
            overhead,
            responses,
            registry,
        })
    }

    /// The fleet, for embedding.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// Answers one `/score` body; else the HTTP status and why: 400 for a body that is not what
    /// it takes, 404 for another model than the one served, 503 when nothing can be answered
    /// yet (no replica said its block size: route as if nothing matched).
    pub fn score(&self, body: &[u8]) -> Result<serde_json::Value, (u16, String)> {
        let bad = |why: String| (400, why);
        let v: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| bad(format!("not JSON: {e}")))?;
        let model = v["model"].as_str().unwrap_or_default();
        if model != self.config.model {
            return Err((
                404,
                format!("this router serves `{}`, not `{model}`", self.config.model),
            ));
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
            ScoreError::BlockSizeUnknown => (503, e.to_string()),
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
                        "old": age > self.router.rule().load_old_after(),
                        "error": r.load_error,
                    })
                }),
            })).collect::<Vec<_>>(),
            "policy": self.router.rule().policy().as_str(),
            "weights": self.router.weights().map(|w| serde_json::json!({
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
        kvevent_metrics::prometheus_text(&self.registry)
    }
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
                        (true, "/v1/completions") => router.complete(req).await,
                        (true, "/score") => {
                            // Prompts are bounded: 8 MiB of JSON is ~1M token ids.
                            match Limited::new(req.into_body(), 8 << 20).collect().await {
                                Ok(body) => match router.score(&body.to_bytes()) {
                                    Ok(v) => respond(200, "application/json", v.to_string()),
                                    Err((status, why)) => error(status, why),
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
