//! One simulated engine behind vLLM's interfaces ([`SimEngine`]): a [`kvevent_sim::Engine`]
//! stepped on the caller's tokio runtime (its steps slept, divided by a speed-up), its KV
//! events published on vLLM 0.33's wire with replay (`kvevent_zmq::publisher::Publisher`), and
//! an HTTP server with vLLM's `POST /v1/completions` (token ids, or text through
//! [`tokenize`]) and `POST /v1/chat/completions` (messages, [`tokenize`]d after their roles),
//! streamed with a usage chunk whose `prompt_tokens_details.cached_tokens` is the engine's, or
//! whole; `GET /v1/models`, `GET /metrics` (vLLM's names: requests running and waiting, KV-cache usage,
//! prefix-cache queries and hits) and `GET /health`. Requests vLLM refuses are refused as it
//! refuses them: a body that is not a completion request (400), another model or adapter (404), a prompt
//! and completion longer than the model (400, vLLM's message).
//!
//! A benchmark reads each engine's state in process too ([`SimEngine::cached_prefix`], the
//! arrival-time oracle).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use kvevent_sim::{Config, Engine, Event, Progress, Request};
use kvevent_wire as wire;
use kvevent_zmq::publisher::{Publisher, PublisherConfig};
use tokio::sync::{Notify, mpsc};

type Body = BoxBody<Bytes, Infallible>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How an engine serves, beside its [`Config`].
#[derive(Debug, Clone)]
pub struct Serving {
    /// The model's name: what requests name and `/v1/models` lists.
    pub model: String,
    /// The longest prompt and completion together, in tokens (vLLM's `--max-model-len`).
    pub max_model_len: u32,
    /// How many times faster than its time model it steps.
    pub speed: f64,
    /// The LoRA adapters it serves, by name (vLLM's `--lora-modules`): a request naming one in
    /// `model` runs with it (ids from 1, in this order).
    pub lora_modules: Vec<String>,
    /// Whose wire its KV events speak and whose names its `/metrics` use: vLLM 0.33's, or
    /// SGLang 0.5.23's (signed block hashes; the same framing and replay).
    pub engine: wire::Engine,
    /// Its data-parallel ranks (vLLM's `--data-parallel-size`): each an engine of its own, rank
    /// `r` publishing on the events and replay ports + `r`, its batches carrying its rank; a
    /// request goes to the least loaded (waiting × 4 + running, as vLLM's API server picks).
    pub data_parallel_size: usize,
    /// Its events, replay and HTTP ports (rank `r`'s events and replay + `r`), as a restarted
    /// engine keeps its own; `None`: ports the system picks.
    pub ports: Option<[u16; 3]>,
}

impl Serving {
    /// `model`, 8,192 tokens long, at the time model's speed.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            max_model_len: 8_192,
            speed: 1.0,
            lora_modules: Vec::new(),
            engine: wire::Engine::Vllm,
            data_parallel_size: 1,
            ports: None,
        }
    }
}

struct State {
    /// One a data-parallel rank.
    engines: Vec<Engine>,
    /// Each request's listener: its progress as the steps make it.
    waiters: HashMap<u64, mpsc::UnboundedSender<Progress>>,
    next_id: u64,
    faults: Faults,
}

/// What the admin endpoint has set ([`admin`]).
#[derive(Debug, Default)]
struct Faults {
    /// Restarts so far: each a new process as a subscriber sees it.
    incarnation: u64,
    /// Batches are held, not published, until resumed.
    paused: bool,
    /// Each held batch with its rank.
    held: Vec<(usize, wire::EventBatch<'static>)>,
    /// The next batches lost on the way (kept for replay).
    drop_next: u64,
    /// Requests other than the admin's get no answer (their connection is closed).
    http_down: bool,
    /// Answers to requests other than the admin's wait this long first.
    delay: Duration,
}

/// One simulated engine, running until dropped.
pub struct SimEngine {
    /// Its name.
    pub name: String,
    /// Its OpenAI-compatible server.
    pub http: SocketAddr,
    /// Its KV-event PUB endpoint (rank 0's: rank `r` on its port + `r`).
    pub events: String,
    /// Its replay endpoint (rank 0's likewise).
    pub replay: String,
    /// Its data-parallel ranks.
    pub dp: usize,
    state: Arc<Mutex<State>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for SimEngine {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl SimEngine {
    /// Starts an engine of `config` on loopback, serving as `serving` says.
    pub async fn start(
        ctx: &zmq::Context,
        name: &str,
        config: Config,
        serving: &Serving,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            serving.speed.is_finite() && serving.speed > 0.0,
            "the speed is a number above 0, not {}",
            serving.speed
        );
        let dp = serving.data_parallel_size;
        anyhow::ensure!(
            (1..=256).contains(&dp),
            "the data-parallel size is 1 to 256, not {dp}"
        );
        let block_size = config.block_size as u32;
        let publishers = Arc::new(match serving.ports {
            Some([events, replay, _]) => fixed_publishers(ctx, dp, events, replay)?,
            None => publishers(ctx, dp)?,
        });
        let events = publishers[0].endpoint().to_owned();
        let replay = publishers[0]
            .replay_endpoint()
            .unwrap_or_default()
            .to_owned();
        let state = Arc::new(Mutex::new(State {
            engines: (0..dp).map(|_| Engine::new(config.clone())).collect(),
            waiters: HashMap::new(),
            next_id: 0,
            faults: Faults::default(),
        }));
        let work: Work = (0..dp).map(|_| Notify::new()).collect();
        let mut tasks: Vec<_> = (0..dp)
            .map(|rank| {
                tokio::spawn(run(
                    state.clone(),
                    work.clone(),
                    rank,
                    publishers.clone(),
                    block_size,
                    serving.clone(),
                ))
            })
            .collect();
        let http_port = serving.ports.map_or(0, |[_, _, http]| http);
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", http_port))
            .await
            .with_context(|| format!("the HTTP port {http_port}"))?;
        let http = listener.local_addr()?;
        tasks.push(tokio::spawn(serve(
            listener,
            state.clone(),
            work,
            Arc::new(Host {
                name: name.to_owned(),
                serving: serving.clone(),
                publishers,
            }),
        )));
        Ok(Self {
            name: name.to_owned(),
            http,
            events,
            replay,
            dp,
            state,
            tasks,
        })
    }

    /// The prompt tokens `prompt` (under `lora`, if any) would find cached here now.
    pub fn cached_prefix(&self, prompt: &[u32], lora: Option<&kvevent_sim::Lora>) -> u32 {
        let s = lock(&self.state);
        s.engines
            .iter()
            .map(|e| e.cached_prefix(prompt, lora))
            .max()
            .unwrap_or(0)
    }

    /// Prompt tokens looked up and found in its prefix cache so far.
    pub fn prefix_cache(&self) -> (u64, u64) {
        lock(&self.state)
            .engines
            .iter()
            .map(Engine::prefix_cache)
            .fold((0, 0), |(q, h), (eq, eh)| (q + eq, h + eh))
    }
}

/// Each rank's wake-up: work was added there.
type Work = Arc<[Notify]>;

/// A rank's publisher, bound on its events and replay endpoints, speaking vLLM 0.33's wire.
fn config(events: String, replay: String) -> PublisherConfig {
    PublisherConfig {
        endpoint: events,
        bind: Some(true),
        replay_endpoint: Some(replay),
        ..PublisherConfig::loopback(wire::Release::new(0, 33, 0))
    }
}

/// One publisher a rank, rank `r` on rank 0's events and replay ports + `r`, as vLLM lays them
/// out (ports taken elsewhere: tried again on others).
fn publishers(ctx: &zmq::Context, dp: usize) -> anyhow::Result<Vec<Arc<Publisher>>> {
    let port = |endpoint: &str| {
        endpoint
            .rsplit(':')
            .next()
            .and_then(|p| p.parse::<u16>().ok())
    };
    let mut last = None;
    for _ in 0..20 {
        let first = Publisher::start(
            ctx,
            config("tcp://127.0.0.1:*".into(), "tcp://127.0.0.1:*".into()),
        )?;
        let (Some(events), Some(replay)) = (
            port(first.endpoint()),
            first.replay_endpoint().and_then(port),
        ) else {
            anyhow::bail!("no port in {:?}", first.endpoint());
        };
        let mut all = vec![Arc::new(first)];
        for r in 1..dp as u16 {
            let (Some(e), Some(p)) = (events.checked_add(r), replay.checked_add(r)) else {
                break;
            };
            match Publisher::start(
                ctx,
                config(
                    format!("tcp://127.0.0.1:{e}"),
                    format!("tcp://127.0.0.1:{p}"),
                ),
            ) {
                Ok(publisher) => all.push(Arc::new(publisher)),
                Err(error) => {
                    last = Some(error);
                    break;
                }
            }
        }
        if all.len() == dp {
            return Ok(all);
        }
    }
    Err(anyhow::anyhow!(
        "no {dp} consecutive ports free for the ranks' publishers after 20 tries: {last:?}"
    ))
}

/// One publisher a rank on the ports given (rank `r` on `events + r` and `replay + r`).
fn fixed_publishers(
    ctx: &zmq::Context,
    dp: usize,
    events: u16,
    replay: u16,
) -> anyhow::Result<Vec<Arc<Publisher>>> {
    (0..dp as u16)
        .map(|r| {
            let (e, p) = (events.saturating_add(r), replay.saturating_add(r));
            let config = config(
                format!("tcp://127.0.0.1:{e}"),
                format!("tcp://127.0.0.1:{p}"),
            );
            Publisher::start(ctx, config)
                .map(Arc::new)
                .with_context(|| format!("rank {r}'s events and replay ports {e} and {p}"))
        })
        .collect()
}

/// Publishes `batches` in order (`lost`: kept for replay, not sent live), on a blocking thread:
/// the publisher's call waits on its own thread, not on a runtime worker.
async fn send(
    publisher: &Arc<Publisher>,
    batches: Vec<wire::EventBatch<'static>>,
    lost: bool,
    engine: wire::Engine,
) {
    let publisher = publisher.clone();
    let _ = tokio::task::spawn_blocking(move || {
        for b in &batches {
            let payload = match engine {
                wire::Engine::Vllm => wire::encode(b, publisher.release()),
                wire::Engine::Sglang => wire::encode_sglang(b, wire::SglangRelease::NEWEST_KNOWN),
            };
            let Ok(payload) = payload else { continue };
            if lost {
                publisher.publish_lost(payload);
            } else {
                publisher.publish_payload(payload);
            }
        }
    })
    .await;
}

/// A block's hash as the engine's wire carries it: vLLM's unsigned, SGLang's signed (Python's
/// `hash`, 64 bits).
fn block_hash(h: u64, engine: wire::Engine) -> wire::BlockHash<'static> {
    let int = match engine {
        wire::Engine::Sglang if (h as i64) < 0 => wire::Int::I64(h as i64),
        _ => wire::Int::U64(h),
    };
    wire::BlockHash::Int(int)
}

/// Steps the engine while it has work, each step slept for its duration (sped up), then its
/// events published and its progress handed to the requests' listeners.
async fn run(
    state: Arc<Mutex<State>>,
    work: Work,
    rank: usize,
    publishers: Arc<Vec<Arc<Publisher>>>,
    block_size: u32,
    serving: Serving,
) {
    let (publisher, engine, speed) = (&publishers[rank], serving.engine, serving.speed);
    // vLLM's batches say their rank when it runs more than one.
    let data_parallel_rank = (serving.data_parallel_size > 1).then_some(rank as i64);
    // The engine's own clock, in wall time: each step ends its duration after the last one
    // was due to end (or after it started, from idle), so the timer's rounding (a sleep ends
    // on the next millisecond) never adds up.
    let mut clock = tokio::time::Instant::now();
    loop {
        let step = lock(&state).engines[rank].step();
        let Some(step) = step else {
            work[rank].notified().await;
            clock = tokio::time::Instant::now();
            continue;
        };
        clock += Duration::from_secs_f64(step.duration_us / 1e6 / speed);
        tokio::time::sleep_until(clock).await;
        if !step.events.is_empty() {
            let batch = wire::EventBatch {
                ts: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64()),
                events: step
                    .events
                    .iter()
                    .map(|e| match e {
                        Event::Stored {
                            hashes,
                            parent,
                            tokens,
                            lora,
                        } => wire::Event::BlockStored(wire::BlockStored {
                            lora_id: lora.as_ref().map(|l| l.id),
                            lora_name: lora.as_ref().map(|l| l.name.clone().into()),
                            block_hashes: hashes.iter().map(|h| block_hash(*h, engine)).collect(),
                            parent_block_hash: parent.map(|p| block_hash(p, engine)),
                            token_ids: tokens.clone().into(),
                            block_size,
                            medium: Some(wire::Medium::from("GPU")),
                            ..Default::default()
                        }),
                        Event::Removed { hash } => wire::Event::BlockRemoved(wire::BlockRemoved {
                            block_hashes: vec![block_hash(*hash, engine)],
                            medium: Some(wire::Medium::from("GPU")),
                            ..Default::default()
                        }),
                    })
                    .collect(),
                data_parallel_rank,
                unknown_events: 0,
            };
            // Held while paused (in order), lost on the way while dropping, else published.
            let (out, lost) = {
                let mut s = lock(&state);
                let f = &mut s.faults;
                if f.paused {
                    f.held.push((rank, batch));
                    (Vec::new(), false)
                } else if f.drop_next > 0 {
                    f.drop_next -= 1;
                    (vec![batch], true)
                } else {
                    (vec![batch], false)
                }
            };
            if !out.is_empty() {
                send(publisher, out, lost, engine).await;
            }
        }
        let mut s = lock(&state);
        for p in step.progress {
            let id = match p {
                Progress::FirstToken { id, .. }
                | Progress::Token { id, .. }
                | Progress::Finished { id } => id,
            };
            if let Some(w) = s.waiters.get(&id) {
                let _ = w.send(p);
            }
            if matches!(p, Progress::Finished { .. }) {
                s.waiters.remove(&id);
            }
        }
    }
}

/// The engine's name, how it serves, and its ranks' publishers (for the admin's faults).
struct Host {
    name: String,
    serving: Serving,
    publishers: Arc<Vec<Arc<Publisher>>>,
}

type Named = Arc<Host>;

async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<Mutex<State>>,
    work: Work,
    name: Named,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (state, work, name) = (state.clone(), work.clone(), name.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                handle(req, state.clone(), work.clone(), name.clone())
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

fn full(status: u16, body: String) -> hyper::Response<Body> {
    let mut r = hyper::Response::new(Full::new(Bytes::from(body)).boxed());
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// An error as vLLM's OpenAI server writes one.
fn refused(status: u16, kind: &str, message: &str) -> hyper::Response<Body> {
    full(
        status,
        serde_json::json!({
            "error": {"message": message, "type": kind, "param": null, "code": status},
        })
        .to_string(),
    )
}

fn usage(prompt: usize, completion: u32, cached: u32) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt as u32 + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

async fn handle(
    req: hyper::Request<hyper::body::Incoming>,
    state: Arc<Mutex<State>>,
    work: Work,
    named: Named,
) -> Result<hyper::Response<Body>, Down> {
    let (name, serving) = (&named.name, &named.serving);
    let model = serving.model.as_str();
    if let Some(fault) = req.uri().path().strip_prefix("/admin/") {
        let query = req.uri().query().unwrap_or_default().to_owned();
        let method = req.method().clone();
        return Ok(admin(&method, fault, &query, &state, &work, &named).await);
    }
    let (down, delay) = {
        let f = &lock(&state).faults;
        (f.http_down, f.delay)
    };
    if down {
        // No answer: the connection is closed.
        return Err(Down);
    }
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    match (req.method().as_str(), req.uri().path()) {
        ("GET", "/health") => Ok(full(200, String::new())),
        ("GET", "/v1/models") => Ok(full(
            200,
            serde_json::json!({
                "object": "list",
                "data": std::iter::once(serde_json::json!({
                    "id": model, "object": "model", "owned_by": "vllm", "root": model,
                    "max_model_len": serving.max_model_len,
                }))
                .chain(serving.lora_modules.iter().map(|a| serde_json::json!({
                    "id": a, "object": "model", "owned_by": "vllm", "root": a, "parent": model,
                    "max_model_len": serving.max_model_len,
                })))
                .collect::<Vec<_>>(),
            })
            .to_string(),
        )),
        ("GET", "/metrics") => {
            let s = lock(&state);
            let mut text = String::new();
            for (rank, e) in s.engines.iter().enumerate() {
                let (queries, hits) = e.prefix_cache();
                text += &if serving.engine == wire::Engine::Sglang {
                    // SGLang's names: requests running and queued, KV usage, the hit rate.
                    let labels = format!("model_name=\"{model}\",dp_rank=\"{rank}\"");
                    format!(
                        "sglang:num_running_reqs{{{labels}}} {}\n\
                         sglang:num_queue_reqs{{{labels}}} {}\n\
                         sglang:token_usage{{{labels}}} {}\n\
                         sglang:cache_hit_rate{{{labels}}} {}\n",
                        e.running(),
                        e.waiting(),
                        e.kv_usage(),
                        hits as f64 / queries.max(1) as f64
                    )
                } else {
                    let labels =
                        format!("engine=\"{rank}\",model_name=\"{model}\",replica=\"{name}\"");
                    format!(
                        "vllm:num_requests_running{{{labels}}} {}\n\
                         vllm:num_requests_waiting{{{labels}}} {}\n\
                         vllm:kv_cache_usage_perc{{{labels}}} {}\n\
                         vllm:prefix_cache_queries_total{{{labels}}} {queries}\n\
                         vllm:prefix_cache_hits_total{{{labels}}} {hits}\n",
                        e.running(),
                        e.waiting(),
                        e.kv_usage()
                    )
                };
            }
            Ok(full(200, text))
        }
        ("POST", path @ ("/v1/completions" | "/v1/chat/completions")) => {
            let chat = path == "/v1/chat/completions";
            let body = match req.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return Ok(bad(&format!("the body could not be read: {e}"))),
            };
            Ok(complete(&body, chat, state, work, serving).await)
        }
        _ => Ok(full(404, String::new())),
    }
}

fn bad(message: &str) -> hyper::Response<Body> {
    refused(400, "BadRequestError", message)
}

/// Text as this simulator's model reads it: words (split at whitespace), each the token
/// `10 + FNV-1a(word) mod 32,000`. Deterministic, so the same text is the same tokens and
/// shares a prefix with text that starts the same way; not any real model's tokenizer.
///
/// ```
/// use kvevent_simulator::host::tokenize;
/// assert_eq!(tokenize("You are helpful. Hi"), tokenize(" You are\nhelpful.  Hi"));
/// assert_eq!(tokenize("You are helpful. Hi")[..3], tokenize("You are helpful. Bye")[..3]);
/// ```
pub fn tokenize(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| {
            let mut h: u32 = 0x811c_9dc5;
            for b in w.bytes() {
                h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
            }
            10 + h % 32_000
        })
        .collect()
}

/// A token as text: `t` and its id, after a space.
fn detokenize(tokens: &[u32]) -> String {
    tokens.iter().map(|t| format!(" t{t}")).collect()
}

/// A chat's messages as one prompt: each `<|ROLE|> CONTENT`, then `<|assistant|>`.
fn chat_prompt(messages: &serde_json::Value) -> Option<Vec<u32>> {
    let mut text = String::new();
    for m in messages.as_array()? {
        let role = m["role"].as_str()?;
        let content = match &m["content"] {
            serde_json::Value::String(c) => c.clone(),
            // Parts: their text, in order.
            serde_json::Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join(" "),
            _ => return None,
        };
        text += &format!("<|{role}|> {content} ");
    }
    text += "<|assistant|>";
    Some(tokenize(&text))
}

/// `POST /v1/completions` (a prompt of token ids or text) or `/v1/chat/completions` (messages):
/// checked as vLLM checks it, run on the engine, answered whole or streamed.
async fn complete(
    body: &[u8],
    chat: bool,
    state: Arc<Mutex<State>>,
    work: Work,
    serving: &Serving,
) -> hyper::Response<Body> {
    let model = serving.model.as_str();
    let v: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return bad(&format!("the body is not JSON: {e}")),
    };
    let asked = v["model"].as_str().unwrap_or(model);
    // The base model, or one of its adapters; anything else is refused as vLLM refuses it.
    let lora = match serving.lora_modules.iter().position(|a| a == asked) {
        Some(i) => Some(kvevent_sim::Lora {
            id: i as i64 + 1,
            name: asked.to_owned(),
        }),
        None if asked == model => None,
        None => {
            return refused(
                404,
                "NotFoundError",
                &format!("The model `{asked}` does not exist."),
            );
        }
    };
    let prompt = if chat {
        match chat_prompt(&v["messages"]) {
            Some(p) => p,
            None => return bad("messages: a list of {\"role\", \"content\"}"),
        }
    } else {
        match &v["prompt"] {
            serde_json::Value::String(text) => tokenize(text),
            serde_json::Value::Array(ids) => match ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
            {
                Some(p) => p,
                None => return bad("prompt: text, or a list of token ids"),
            },
            _ => return bad("prompt: text, or a list of token ids"),
        }
    };
    if prompt.is_empty() {
        return bad("prompt: at least one token");
    }
    let limit = if chat && !v["max_completion_tokens"].is_null() {
        &v["max_completion_tokens"]
    } else {
        &v["max_tokens"]
    };
    let max_tokens = match limit {
        serde_json::Value::Null => 16,
        m => match m.as_u64().and_then(|m| u32::try_from(m).ok()) {
            Some(m) if m >= 1 => m,
            _ => return bad("max_tokens: a number of tokens, 1 or more"),
        },
    };
    let wanted = prompt.len() as u64 + u64::from(max_tokens);
    if wanted > u64::from(serving.max_model_len) {
        return bad(&format!(
            "This model's maximum context length is {} tokens. However, you requested {wanted} tokens ({} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
            serving.max_model_len,
            prompt.len()
        ));
    }
    let stream = v["stream"].as_bool().unwrap_or(false);
    // What the API server adds before the engine core sees a request.
    let request_us = lock(&state).engines[0].config().time.request_us;
    if request_us > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(request_us / 1e6 / serving.speed)).await;
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    let rank = {
        let mut s = lock(&state);
        let id = s.next_id;
        s.next_id += 1;
        s.waiters.insert(id, tx);
        // The least loaded rank, as vLLM's API server scores them.
        let (rank, engine) = s
            .engines
            .iter_mut()
            .enumerate()
            .min_by_key(|(_, e)| e.waiting() * 4 + e.running())
            .expect("one rank at least");
        engine.add(Request {
            id,
            prompt: prompt.clone(),
            max_tokens,
            output: Vec::new(),
            lora,
        });
        rank
    };
    work[rank].notify_one();
    let n = prompt.len();
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    if !stream {
        let (mut cached, mut out) = (0, Vec::new());
        while let Some(p) = rx.recv().await {
            match p {
                Progress::FirstToken { cached_tokens, .. } => cached = cached_tokens,
                Progress::Token { token, .. } => out.push(token),
                Progress::Finished { .. } => break,
            }
        }
        let choice = if chat {
            serde_json::json!({"index": 0, "finish_reason": "length",
                "message": {"role": "assistant", "content": detokenize(&out)}})
        } else {
            serde_json::json!({"index": 0, "text": detokenize(&out), "token_ids": out,
                "finish_reason": "length"})
        };
        let body = serde_json::json!({
            "object": object, "model": model, "choices": [choice],
            "usage": usage(n, out.len() as u32, cached),
        });
        return full(200, body.to_string());
    }
    let with_usage = v["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    let chunk = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let model: Arc<str> = Arc::from(model);
    let frames = futures_util::stream::unfold(
        (rx, 0u32, 0u32, false),
        move |(mut rx, mut cached, mut made, done)| {
            let model = model.clone();
            async move {
                if done {
                    return None;
                }
                loop {
                    let text = match rx.recv().await {
                        Some(Progress::FirstToken { cached_tokens, .. }) => {
                            cached = cached_tokens;
                            continue;
                        }
                        Some(Progress::Token { token, .. }) => {
                            made += 1;
                            let choice = if chat {
                                serde_json::json!({"index": 0,
                                    "delta": {"role": "assistant", "content": detokenize(&[token])}})
                            } else {
                                serde_json::json!({"index": 0, "text": detokenize(&[token]),
                                    "token_ids": [token]})
                            };
                            let c = serde_json::json!({"object": chunk, "model": &*model,
                                "choices": [choice]});
                            format!("data: {c}\n\n")
                        }
                        Some(Progress::Finished { .. }) | None => {
                            let mut t = String::new();
                            if with_usage {
                                let c = serde_json::json!({"object": chunk, "model": &*model,
                                    "choices": [], "usage": usage(n, made, cached)});
                                t += &format!("data: {c}\n\n");
                            }
                            t += "data: [DONE]\n\n";
                            return Some((
                                Ok::<_, Infallible>(Frame::data(Bytes::from(t))),
                                (rx, cached, made, true),
                            ));
                        }
                    };
                    return Some((
                        Ok(Frame::data(Bytes::from(text))),
                        (rx, cached, made, false),
                    ));
                }
            }
        },
    );
    let mut r = hyper::Response::new(StreamBody::new(frames).boxed());
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    r
}

/// An engine whose HTTP is down: the connection is closed without an answer.
#[derive(Debug)]
pub struct Down;

impl std::fmt::Display for Down {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the engine's HTTP is down (a fault set at /admin/http/down)")
    }
}

impl std::error::Error for Down {}

/// The fault hooks and the truth, at `/admin/…` (always answered, whatever the faults):
///
/// - `GET truth`: what the engine holds: `{"incarnation", "block_size", "blocks": [hash, …]}`
///   (sorted; the hashes its events carry).
/// - `POST publisher/pause`, `POST publisher/resume`: batches held, then published in order.
/// - `POST publisher/drop?batches=N`: the next N batches lost on the way (kept for replay, so a
///   subscriber that sees the gap can ask for them).
/// - `POST restart`: a new incarnation: cache and replay buffer empty, sequence from 0, the
///   requests in flight ended.
/// - `POST http/down`, `POST http/up`: other requests get no answer (connection closed), then
///   are served again.
/// - `POST http/delay?ms=N`: other answers wait N ms first (0: none).
async fn admin(
    method: &hyper::Method,
    fault: &str,
    query: &str,
    state: &Arc<Mutex<State>>,
    work: &Work,
    host: &Host,
) -> hyper::Response<Body> {
    const KNOWN: &str = "GET truth; POST publisher/pause, publisher/resume, publisher/drop?batches=N, restart, http/down, http/up, http/delay?ms=N";
    let number = |key: &str| {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let ok = |what: serde_json::Value| full(200, what.to_string());
    let get = method == hyper::Method::GET;
    match (get, fault) {
        (true, "truth") => {
            let s = lock(state);
            let mut all: Vec<u64> = s.engines.iter().flat_map(Engine::cached_hashes).collect();
            all.sort_unstable();
            all.dedup();
            ok(serde_json::json!({
                "incarnation": s.faults.incarnation,
                "block_size": s.engines[0].config().block_size,
                "blocks": all,
                "ranks": s.engines.iter().map(Engine::cached_hashes).collect::<Vec<_>>(),
            }))
        }
        (false, "publisher/pause") => {
            lock(state).faults.paused = true;
            ok(serde_json::json!({"paused": true}))
        }
        (false, "publisher/resume") => {
            let held = {
                let mut s = lock(state);
                s.faults.paused = false;
                std::mem::take(&mut s.faults.held)
            };
            let n = held.len();
            for (rank, publisher) in host.publishers.iter().enumerate() {
                let batches = held
                    .iter()
                    .filter(|(r, _)| *r == rank)
                    .map(|(_, b)| b.clone());
                send(publisher, batches.collect(), false, host.serving.engine).await;
            }
            ok(serde_json::json!({"paused": false, "published": n}))
        }
        (false, "publisher/drop") => match number("batches") {
            Some(n) => {
                lock(state).faults.drop_next = n;
                ok(serde_json::json!({"drop_next": n}))
            }
            None => bad("publisher/drop: ?batches=N, a number of batches"),
        },
        (false, "restart") => {
            let incarnation = {
                let mut s = lock(state);
                for e in &mut s.engines {
                    *e = Engine::new(e.config().clone());
                }
                // The requests in flight end with the process they were in.
                s.waiters.clear();
                s.faults.held.clear();
                s.faults.incarnation += 1;
                s.faults.incarnation
            };
            let publishers = host.publishers.clone();
            let _ =
                tokio::task::spawn_blocking(move || publishers.iter().for_each(|p| p.restart()))
                    .await;
            work.iter().for_each(Notify::notify_one);
            ok(serde_json::json!({"incarnation": incarnation}))
        }
        (false, "http/down" | "http/up") => {
            let down = fault == "http/down";
            lock(state).faults.http_down = down;
            ok(serde_json::json!({"http_down": down}))
        }
        (false, "http/delay") => match number("ms") {
            Some(ms) => {
                lock(state).faults.delay = Duration::from_millis(ms);
                ok(serde_json::json!({"delay_ms": ms}))
            }
            None => bad("http/delay: ?ms=N, a number of milliseconds"),
        },
        _ => refused(
            404,
            "NotFoundError",
            &format!("`{method} /admin/{fault}` is not a fault hook; known: {KNOWN}"),
        ),
    }
}
