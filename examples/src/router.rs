//! A router's scoring service: follows engines (with their replay and DP ranks) into a
//! [`kvevent_index::Index`] and answers `POST /score` and `GET /metrics` over HTTP.
//!
//! `examples/router.rs` is its command line; tests start it in-process.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvevent_index::{Index, Query, QueryKeys, Tier};
use kvevent_source::{Config, Subscriber, View};
use kvevent_zmq as transport;

/// One `--engine NAME=tcp://host:port[,replay=tcp://host:port][,dp=N]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Engine {
    /// The replica's name in the scores.
    pub name: String,
    /// Its PUB endpoint (rank 0's).
    pub endpoint: String,
    /// Its replay endpoint (rank 0's), if any.
    pub replay: Option<String>,
    /// Its DP ranks (ports offset by rank, vLLM's rule).
    pub dp: u32,
}

impl std::str::FromStr for Engine {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let (name, rest) = s
            .split_once('=')
            .context("an engine is NAME=tcp://host:port[,replay=tcp://host:port][,dp=N]")?;
        let mut parts = rest.split(',');
        let endpoint = parts.next().unwrap_or_default().to_owned();
        if name.is_empty() || endpoint.is_empty() {
            bail!("`{s}`: an engine is NAME=tcp://host:port[,replay=...][,dp=N]");
        }
        let mut engine = Engine {
            name: name.to_owned(),
            endpoint,
            replay: None,
            dp: 1,
        };
        for part in parts {
            match part.split_once('=') {
                Some(("replay", r)) => engine.replay = Some(r.to_owned()),
                Some(("dp", n)) => engine.dp = n.parse().context("dp=N takes a number")?,
                _ => bail!("`{part}` in `{s}`: expected replay=... or dp=N"),
            }
        }
        Ok(engine)
    }
}

/// What the service is set up with.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// The model it routes; a query for another is refused.
    pub model: String,
    /// The model's block size, for queries that do not say.
    pub block_size: Option<usize>,
    /// The engines followed.
    pub engines: Vec<Engine>,
    /// Each engine source read by a thread of its own (true), or all of them by the thread
    /// applying events ([`kvevent_source::Config::threads`]).
    pub source_threads: bool,
}

/// Most updates the feeding thread takes from the subscriber at once: batches applied together
/// take the index's write lock once (`Index::apply_many`).
const FEED_MAX: usize = 64;

/// The running service: its index and the thread feeding it.
pub struct Router {
    index: Arc<Index>,
    /// Per source: its label and counters.
    sources: Vec<(String, Arc<kvevent_source::SourceMetrics>)>,
    config: RouterConfig,
    stop: Arc<AtomicBool>,
    /// Calls of the feeding thread that took updates, and the updates they took.
    feeds: Arc<[AtomicU64; 2]>,
    feeder: Option<std::thread::JoinHandle<()>>,
}

impl Router {
    /// Subscribes to every engine and starts the thread applying their events to the index.
    pub fn start(ctx: &zmq::Context, config: RouterConfig) -> anyhow::Result<Self> {
        let index = Arc::new(Index::new(kvevent_index::Config::default()));
        let mut sources = Vec::new();
        let mut ids = Vec::new();
        for e in &config.engines {
            for s in transport::dp_sources(&e.endpoint, e.replay.as_deref(), e.dp, b"", false)? {
                ids.push(index.add_source(&e.name));
                sources.push(s);
            }
        }
        let labels: Vec<String> = sources.iter().map(transport::Source::label).collect();
        let mut sub_config = Config::new(sources);
        sub_config.threads = config.source_threads;
        let mut subscriber = Subscriber::start(ctx, sub_config)?;
        let source_metrics = labels
            .into_iter()
            .zip(subscriber.metrics().iter().cloned())
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let feeds = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let feeder = {
            let (index, stop, feeds) = (index.clone(), stop.clone(), feeds.clone());
            std::thread::Builder::new()
                .name("router-events".into())
                .spawn(move || {
                    // Per call: the sources whose updates were applied (kept for capacity).
                    let mut touched: Vec<usize> = Vec::new();
                    while !stop.load(Relaxed) {
                        let applied =
                            subscriber.next_many(Duration::from_millis(100), FEED_MAX, |views| {
                                // Runs of batches go in together (their memory prefetched
                                // ahead); a reset applies between them, in order.
                                let mut run = Vec::with_capacity(views.len());
                                touched.clear();
                                for view in views {
                                    match view {
                                        View::Batch { source, batch, .. } => {
                                            run.push((ids[*source], *batch));
                                            touched.push(*source);
                                        }
                                        View::Reset { source, .. } => {
                                            index.apply_many(&run);
                                            run.clear();
                                            index.reset(ids[*source]);
                                            touched.push(*source);
                                        }
                                    }
                                }
                                index.apply_many(&run);
                                feeds[0].fetch_add(1, Relaxed);
                                feeds[1].fetch_add(views.len() as u64, Relaxed);
                            });
                        if applied.is_some() {
                            touched.sort_unstable();
                            touched.dedup();
                            for &source in &touched {
                                let degraded = subscriber.metrics()[source].degraded.load(Relaxed);
                                index.set_fresh(ids[source], !degraded);
                            }
                        }
                    }
                    subscriber.shutdown();
                })?
        };
        Ok(Self {
            index,
            sources: source_metrics,
            config,
            stop,
            feeds,
            feeder: Some(feeder),
        })
    }

    /// The index, for embedding.
    pub fn index(&self) -> &Arc<Index> {
        &self.index
    }

    /// Answers one `/score` body.
    pub fn score(&self, body: &[u8]) -> Result<serde_json::Value, (u16, String)> {
        let bad = |m: String| (400, m);
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
            .filter(|b| *b > 0)
            .ok_or_else(|| bad("`block_size` is needed: the model's is not configured".into()))?;
        let tokens: Vec<u32> = v["token_ids"]
            .as_array()
            .ok_or_else(|| bad("`token_ids` must be an array of token ids".into()))?
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("`token_ids` must hold unsigned 32-bit integers".into()))?;
        let scores = self.index.score(&Query {
            adapter,
            keys: QueryKeys::Tokens {
                ids: &tokens,
                block_size,
            },
        });
        Ok(serde_json::json!({
            "scores": scores.iter().map(|s| serde_json::json!({
                "replica": s.replica,
                "matched_tokens": s.matched_tokens,
                "matched_blocks": s.matched_blocks,
                "tier": match s.tier { Tier::T1 => "T1", Tier::T2 => "T2" },
                "fresh": s.fresh,
            })).collect::<Vec<_>>()
        }))
    }

    /// The index's counters in the Prometheus text format.
    pub fn metrics(&self) -> String {
        let s = self.index.stats();
        let mut per_source = String::from("# TYPE kvevent_batches_received_total counter\n");
        for (label, m) in &self.sources {
            per_source.push_str(&format!(
                "kvevent_batches_received_total{{source=\"{label}\"}} {}\nkvevent_source_degraded{{source=\"{label}\"}} {}\n",
                m.batches.load(Relaxed),
                u8::from(m.degraded.load(Relaxed))
            ));
        }
        per_source
            + &format!(
                "# TYPE kvevent_index_keys gauge\nkvevent_index_keys {}\n\
             # TYPE kvevent_index_pairs gauge\nkvevent_index_pairs {}\n\
             # TYPE kvevent_index_bytes gauge\nkvevent_index_bytes {}\n\
             # TYPE kvevent_index_evicted_keys_total counter\nkvevent_index_evicted_keys_total {}\n\
             # TYPE kvevent_index_stashed gauge\nkvevent_index_stashed {}\n\
             # TYPE kvevent_index_applied_total counter\nkvevent_index_applied_total {}\n\
             # TYPE kvevent_router_feeds_total counter\nkvevent_router_feeds_total {}\n\
             # TYPE kvevent_router_fed_updates_total counter\nkvevent_router_fed_updates_total {}\n",
                s.keys,
                s.pairs,
                s.bytes,
                s.evicted_keys,
                s.stashed,
                s.applied,
                self.feeds[0].load(Relaxed),
                self.feeds[1].load(Relaxed),
            )
    }

    /// Stops the feeding thread and closes the engine sockets.
    pub fn shutdown(mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.feeder.take() {
            let _ = t.join();
        }
    }
}

fn respond(status: u16, content_type: &str, body: String) -> hyper::Response<Full<Bytes>> {
    let mut r = hyper::Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// Serves `/score` and `/metrics` on `listener` until the task is dropped.
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
                        (true, "/score") => {
                            // Prompts are bounded: 8 MiB of JSON is ~1M token ids.
                            match Limited::new(req.into_body(), 8 << 20).collect().await {
                                Ok(body) => match router.score(&body.to_bytes()) {
                                    Ok(v) => respond(200, "application/json", v.to_string()),
                                    Err((code, m)) => respond(
                                        code,
                                        "application/json",
                                        serde_json::json!({ "error": m }).to_string(),
                                    ),
                                },
                                Err(e) => respond(413, "text/plain", format!("body: {e}\n")),
                            }
                        }
                        (false, "/metrics") => {
                            respond(200, "text/plain; version=0.0.4", router.metrics())
                        }
                        _ => respond(404, "text/plain", "POST /score, GET /metrics\n".into()),
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
