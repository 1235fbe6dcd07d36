//! The example router's service: replicas listed or discovered, followed into a
//! [`kvevent_fleet::Fleet`]; `POST /v1/completions` routed, `POST /score`, `GET /replicas` and
//! `GET /metrics` answered. `examples/router.rs` is its command line.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::proxy::{Response, body, error, respond};
use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvevent_fleet::discover::{self, Listed};
use kvevent_fleet::metrics::{FleetCollector, RouterCollector};
use kvevent_fleet::{Fleet, FleetConfig, Query, QueryKeys, ScoreError, json, route};
use prometheus_client::metrics::{counter::Counter, family::Family, histogram::Histogram};

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

/// The running service: a [`Fleet`] of the replicas, and the routing loop on it
/// (`kvevent_fleet::route::Router`) with HTTP around it.
pub struct Router {
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
        let tokenizer = (config.tokenizer.as_ref())
            .map(|path| {
                tokenizers::Tokenizer::from_file(path).map_err(|e| {
                    anyhow::anyhow!("--tokenizer {}: not a tokenizer.json: {e}", path.display())
                })
            })
            .transpose()?;
        let discovered = (config.discover.as_ref())
            .map(|spec| spec.follow(fleet.clone(), &config.model))
            .transpose()
            .context("--discover")?;
        let router = route::Router::new(fleet.clone(), route::Rule::new(config.policy));
        let router = Arc::new(match config.learn_weights {
            true => router.learning(),
            false => router,
        });
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.upstream_timeout));
        // The overhead's buckets, in seconds: 100 µs to 50 ms.
        let buckets = [
            0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
        ];
        let (overhead, responses) = (Histogram::new(buckets), Family::default());
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
        self.router.fleet()
    }

    /// Answers one `/score` body ([`kvevent_fleet::json`]); else the HTTP status and why: 400
    /// for a body that is not what it takes, 404 for another model than the one served, 503
    /// when nothing can be answered yet (no replica said its block size: route as if nothing
    /// matched).
    pub fn score(&self, body: &[u8]) -> Result<serde_json::Value, (u16, String)> {
        let r = json::ScoreRequest::parse(body).map_err(|why| (400, why))?;
        if r.model != self.config.model {
            let served = &self.config.model;
            return Err((
                404,
                format!("this router serves `{served}`, not `{}`", r.model),
            ));
        }
        let block_size = (r.block_size.or(self.config.block_size))
            .or(self.fleet().block_size().map(|b| b as usize))
            .filter(|b| *b > 0)
            .ok_or((
                400,
                "`block_size` is needed: none is configured and no replica has stored a block yet"
                    .into(),
            ))?;
        let query = Query {
            adapter: &r.adapter,
            keys: QueryKeys::Tokens {
                ids: &r.token_ids,
                block_size,
            },
        };
        let candidates: Option<Vec<&str>> =
            (r.candidates.as_ref()).map(|c| c.iter().map(String::as_str).collect());
        let scores = match &candidates {
            Some(c) => self.fleet().score_among(&query, c),
            None => self.fleet().score(&query),
        };
        scores
            .map(|s| json::scores(&s, candidates.as_deref()))
            .map_err(|e| match e {
                // Nothing can be known yet: the caller routes as if nothing matched.
                ScoreError::BlockSizeUnknown => (503, e.to_string()),
                ScoreError::BlockSize { .. } => (400, e.to_string()),
            })
    }

    /// Every replica and the routing loop's policy and weights ([`json::replicas`]).
    pub fn replicas(&self) -> serde_json::Value {
        json::replicas(&self.router)
    }

    /// The index's and replicas' counters, the predictions' accounting and the proxy's own
    /// latency, in the Prometheus text format.
    pub fn metrics(&self) -> String {
        kvevent_metrics::prometheus_text(&self.registry)
    }

    async fn handle(&self, req: hyper::Request<Incoming>) -> Response {
        let post = req.method() == hyper::Method::POST;
        match (post, req.uri().path()) {
            (true, "/v1/completions") => self.complete(req).await,
            (true, "/score") => match body(req).await.map(|b| self.score(&b)) {
                Ok(Ok(v)) => respond(200, "application/json", v.to_string()),
                Ok(Err((status, why))) => error(status, why),
                Err(r) => r,
            },
            (false, "/metrics") => respond(200, "text/plain; version=0.0.4", self.metrics()),
            (false, "/replicas") => respond(200, "application/json", self.replicas().to_string()),
            _ => error(
                404,
                "POST /v1/completions, POST /score, GET /replicas, GET /metrics".into(),
            ),
        }
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
            let service = service_fn(move |req| {
                let router = router.clone();
                async move { Ok::<_, Infallible>(router.handle(req).await) }
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
