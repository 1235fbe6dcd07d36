//! `POST /v1/completions` routed: the prompt's token ids (a text prompt's, with a tokenizer:
//! the engine's own `tokenizer.json`, special tokens added as vLLM adds them) are scored
//! against the replicas
//! that have an upstream (`--upstream NAME=http://HOST:PORT`, the replica's OpenAI-compatible
//! server), the request goes to the best, and the response comes back as it came (streamed when
//! it streams). The cached tokens its usage reports are recorded against the prediction the
//! choice acted on ([`kvevent_fleet::Fleet::record`]).
//!
//! **The rule.** `kvevent_fleet::route`'s, by the policy given (`--policy`): by default the
//! replica where the request costs least, weighing the prompt tokens it would compute there
//! (what an exact replica holds is not computed again) against the requests queued ahead of it
//! (its engine's load as its sidecar read it, plus what this router sent it since); ties by
//! the prompt's first block. Before any block size is known, by load alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvevent_fleet::{discover, route};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

/// One `--upstream NAME=http://HOST:PORT`: where a replica serves completions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// The replica's name, as followed.
    pub name: String,
    /// Its OpenAI-compatible server, `http://HOST:PORT`.
    pub url: String,
}

impl std::str::FromStr for Upstream {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let Some((name, url)) = s.split_once('=') else {
            anyhow::bail!("`{s}`: an upstream is NAME=http://HOST:PORT (the replica's server)");
        };
        if name.is_empty() {
            anyhow::bail!("`{s}`: an upstream is NAME=http://HOST:PORT (the replica's server)");
        }
        let url = kvevent_scrape::url::server_url(url)
            .map_err(|e| anyhow::anyhow!("`{s}`: an upstream is NAME=http://HOST:PORT: {e}"))?;
        Ok(Self {
            name: name.to_owned(),
            url: url.to_owned(),
        })
    }
}

pub(crate) type Body = BoxBody<Bytes, std::io::Error>;

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// Upper bounds of the proxy overhead histogram, in seconds.
const OVERHEAD_BUCKETS: [f64; 8] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
];

/// The routing half of the example router: HTTP around `kvevent_fleet::route::Router`, which
/// owns the routing loop.
pub(crate) struct Proxy {
    client: Client<HttpConnector, Full<Bytes>>,
    /// Where each replica serves completions, as given: candidates.
    upstreams: Vec<Upstream>,
    /// Replicas discovered: those with an upstream are candidates too.
    discovered: Option<tokio::sync::watch::Receiver<discover::Members>>,
    /// The candidates last made of both, and the discovered set they were made with.
    candidates: std::sync::Mutex<(discover::Members, Arc<Vec<Upstream>>)>,
    router: Arc<route::Router>,
    timeout: Duration,
    /// What the router adds to a request, in seconds.
    overhead: Histogram,
    /// Responses by replica and status ("502" for a replica that failed, "refused" for one
    /// whose connection was refused).
    responses: Family<Vec<(&'static str, String)>, Counter>,
    /// Turns text prompts into the engine's token ids, when given.
    tokenizer: Option<tokenizers::Tokenizer>,
    /// The base model's name: a request naming another is for that LoRA adapter.
    model: String,
}

fn error(status: u16, message: String) -> hyper::Response<Body> {
    let mut r = hyper::Response::new(full(serde_json::json!({ "error": message }).to_string()));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::BAD_GATEWAY);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// The cached tokens an OpenAI-style usage object reports (0 when it reports none).
fn cached_tokens(v: &serde_json::Value) -> Option<u32> {
    let usage = v.get("usage").filter(|u| !u.is_null())?;
    Some(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0) as u32,
    )
}

impl Proxy {
    pub(crate) fn new(
        upstreams: Vec<Upstream>,
        timeout: Duration,
        tokenizer: Option<tokenizers::Tokenizer>,
        model: String,
        router: Arc<route::Router>,
        discovered: Option<tokio::sync::watch::Receiver<discover::Members>>,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            router,
            candidates: std::sync::Mutex::new((
                discover::Members::default(),
                Arc::new(upstreams.clone()),
            )),
            upstreams,
            discovered,
            timeout,
            overhead: Histogram::new(OVERHEAD_BUCKETS),
            responses: Family::default(),
            tokenizer,
            model,
        }
    }

    /// The routing loop.
    pub(crate) fn router(&self) -> &route::Router {
        &self.router
    }

    /// Where requests may go now: the upstreams given, and each discovered replica's.
    pub(crate) fn upstreams(&self) -> Arc<Vec<Upstream>> {
        let mut candidates = self
            .candidates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(discovered) = &self.discovered else {
            return candidates.1.clone();
        };
        let members = discovered.borrow().clone();
        if !Arc::ptr_eq(&members, &candidates.0) {
            let mut all = self.upstreams.clone();
            all.extend(members.iter().filter_map(|m| {
                Some(Upstream {
                    name: m.name.clone(),
                    url: m.upstream.clone()?,
                })
            }));
            *candidates = (members, Arc::new(all));
        }
        candidates.1.clone()
    }

    fn note_overhead(&self, d: Duration) {
        self.overhead.observe(d.as_secs_f64());
    }

    fn note_response(&self, replica: &str, code: String) {
        self.responses
            .get_or_create(&vec![("replica", replica.to_owned()), ("code", code)])
            .inc();
    }

    /// The proxy's families, into the router's registry.
    pub(crate) fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "kvevent_router_responses",
            "Routed responses by replica and HTTP status (502: the replica failed the request; refused: its connection was refused)",
            self.responses.clone(),
        );
        registry.register_with_unit(
            "kvevent_router_proxy_overhead",
            "What the router adds to a request (choosing, forwarding, reading the usage), not the engine's time",
            prometheus_client::registry::Unit::Seconds,
            self.overhead.clone(),
        );
    }

    /// The prompt's token ids, from a body's `prompt`; else why it is a bad request.
    fn prompt(&self, v: &serde_json::Value) -> Result<Vec<u32>, String> {
        match &v["prompt"] {
            serde_json::Value::Array(ids) => ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<_>>()
                .ok_or_else(|| "`prompt` must be token ids (unsigned 32-bit) or a string".into()),
            serde_json::Value::String(text) => match &self.tokenizer {
                // The request goes on as text: the engine tokenizes it the same way.
                Some(t) => t
                    .encode(text.as_str(), true)
                    .map(|encoding| encoding.get_ids().to_vec())
                    .map_err(|e| format!("the prompt cannot be tokenized: {e}")),
                None => Err(
                    "text prompts need a tokenizer (--tokenizer tokenizer.json), and this router has none: send token ids".into(),
                ),
            },
            _ => Err("`prompt` must be an array of token ids".into()),
        }
    }

    /// Routes one `POST /v1/completions`. A replica that refuses the connection, or answers
    /// 502 or 503, before anything reached the client, is passed over once: the request goes
    /// to the next choice (both counted).
    pub(crate) async fn complete(&self, req: hyper::Request<Incoming>) -> hyper::Response<Body> {
        let started = Instant::now();
        let authorization = req.headers().get(hyper::header::AUTHORIZATION).cloned();
        let body = match Limited::new(req.into_body(), 8 << 20).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error(413, format!("body: {e}")),
        };
        let mut v: serde_json::Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return error(400, format!("not JSON: {e}")),
        };
        let prompt = match self.prompt(&v) {
            Ok(p) => p,
            Err(why) => return error(400, why),
        };
        // A LoRA adapter is asked for by its name in `model`, as vLLM serves it.
        let model = v["model"].as_str().unwrap_or_default().to_owned();
        let adapter = route::adapter_of(&model, &self.model);
        let upstreams = self.upstreams();
        let names: Vec<&str> = upstreams.iter().map(|u| u.name.as_str()).collect();
        let Some(mut decision) = self.router.choose(&names, &prompt, adapter) else {
            return error(
                503,
                "no replica to route to: give --upstream NAME=http://HOST:PORT, or discover replicas with an upstream".into(),
            );
        };
        // Streaming: ask for the usage chunk, whose cached tokens are the engine's truth.
        let streaming = v["stream"].as_bool().unwrap_or(false);
        let body = if streaming {
            v["stream_options"]["include_usage"] = serde_json::Value::Bool(true);
            Bytes::from(v.to_string())
        } else {
            body
        };
        loop {
            let Some(upstream) = upstreams.iter().find(|u| u.name == decision.replica) else {
                return error(500, format!("`{}` has no upstream", decision.replica));
            };
            let mut request = hyper::Request::post(format!("{}/v1/completions", upstream.url))
                .header(hyper::header::CONTENT_TYPE, "application/json");
            if let Some(a) = &authorization {
                request = request.header(hyper::header::AUTHORIZATION, a);
            }
            let request = match request.body(Full::new(body.clone())) {
                Ok(r) => r,
                Err(e) => return error(500, format!("request: {e}")),
            };
            let sent = self.router.send(&decision);
            let before = started.elapsed();
            let failed = |why: String| {
                self.note_response(&upstream.name, "502".into());
                error(
                    502,
                    format!(
                        "replica `{}` ({}) failed the request: {why}",
                        upstream.name, upstream.url
                    ),
                )
            };
            let response =
                match tokio::time::timeout(self.timeout, self.client.request(request)).await {
                    Err(_) => return failed(format!("no response within {:?}", self.timeout)),
                    Ok(Err(e)) if e.is_connect() => Err((route::Retry::Refused, e.to_string())),
                    Ok(Err(e)) => return failed(format!("{e}")),
                    Ok(Ok(r)) => match route::Retry::of_status(r.status().as_u16()) {
                        Some(why) => Err((why, format!("it answered {}", r.status()))),
                        None => Ok(r),
                    },
                };
            let response = match response {
                Ok(r) => r,
                Err((why, what)) => {
                    drop(sent);
                    self.note_response(&upstream.name, why.as_str().to_owned());
                    // Nothing reached the client: the next choice, once.
                    if let Some(next) = self.router.retry(&decision, why, &names, &prompt, adapter)
                    {
                        decision = next;
                        continue;
                    }
                    return failed(what);
                }
            };
            return self
                .forward(response, sent, streaming, &upstream.name, before)
                .await;
        }
    }

    /// The upstream's response to the client: whole, or streamed frame by frame; the usage's
    /// cached tokens recorded on the way.
    async fn forward(
        &self,
        response: hyper::Response<Incoming>,
        mut sent: route::Sent,
        streaming: bool,
        replica: &str,
        before: Duration,
    ) -> hyper::Response<Body> {
        let status = response.status();
        let failed = |why: String| {
            self.note_response(replica, "502".into());
            error(
                502,
                format!("replica `{replica}` failed the request: {why}"),
            )
        };
        if status.is_server_error() {
            return failed(format!("it answered {status}"));
        }
        self.note_response(replica, status.as_u16().to_string());
        let (parts, upstream_body) = response.into_parts();
        if !streaming {
            let bytes = match tokio::time::timeout(self.timeout, upstream_body.collect()).await {
                Ok(Ok(b)) => b.to_bytes(),
                Ok(Err(e)) => return failed(format!("its body: {e}")),
                Err(_) => return failed(format!("no whole body within {:?}", self.timeout)),
            };
            let after = Instant::now();
            let cached = status
                .is_success()
                .then(|| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
                .flatten()
                .as_ref()
                .and_then(cached_tokens);
            sent.finish(cached);
            let r = hyper::Response::from_parts(parts, full(bytes));
            self.note_overhead(before + after.elapsed());
            return r;
        }
        // Streamed: each frame goes on as it comes; the usage chunk is read on the way.
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(16);
        let timeout = self.timeout;
        tokio::spawn(async move {
            let mut body = upstream_body;
            let mut line = Vec::new();
            let mut cached = None;
            loop {
                let frame = match tokio::time::timeout(timeout, body.frame()).await {
                    Ok(Some(Ok(f))) => f,
                    Ok(Some(Err(e))) => {
                        let _ = tx.send(Err(std::io::Error::other(e))).await;
                        break;
                    }
                    Ok(None) => break,
                    Err(_) => {
                        let _ = tx
                            .send(Err(std::io::Error::other("upstream stalled")))
                            .await;
                        break;
                    }
                };
                if let Some(data) = frame.data_ref() {
                    sent.first_token();
                    for b in data.iter() {
                        if *b == b'\n' {
                            if let Some(json) = line.strip_prefix(b"data: ")
                                && let Some(c) = serde_json::from_slice(json)
                                    .ok()
                                    .as_ref()
                                    .and_then(cached_tokens)
                            {
                                cached = Some(c);
                            }
                            line.clear();
                        } else if line.len() < 1 << 20 {
                            line.push(*b);
                        }
                    }
                }
                if tx.send(Ok(frame)).await.is_err() {
                    break;
                }
            }
            // In flight until the stream has been handed on whole.
            sent.finish(cached);
        });
        let r = hyper::Response::from_parts(
            parts,
            BodyExt::boxed(StreamBody::new(tokio_stream_from(rx))),
        );
        self.note_overhead(before);
        r
    }
}

/// A receiver as a stream of frames.
fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
