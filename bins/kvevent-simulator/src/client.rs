//! A client that sends a [`kvevent_sim::workload`] request to an OpenAI-compatible server (a
//! router, an engine) streamed, and times it as a user sees it: to the first token's chunk,
//! and to the end.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvevent_sim::workload::Planned;

/// An HTTP/1 client over plain TCP.
pub type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

/// A client with no pool limit: one connection per request in flight.
pub fn client() -> Client {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// What one streamed request saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Streamed {
    /// To the first chunk with a token (a choice).
    pub ttft: Duration,
    /// To the end of the stream.
    pub e2e: Duration,
    /// Chunks with a token.
    pub output: u32,
    /// The usage chunk's `prompt_tokens_details.cached_tokens`, when it came.
    pub cached_tokens: Option<u32>,
}

/// Sends `planned` to `base` (`http://HOST:PORT`) as `POST /v1/completions` for `model`,
/// streamed with its usage, within `timeout`; an answer that is not 2xx is an error naming
/// its status and body.
pub async fn stream(
    client: &Client,
    base: &str,
    model: &str,
    planned: &Planned,
    timeout: Duration,
) -> anyhow::Result<Streamed> {
    tokio::time::timeout(timeout, send(client, base, model, planned))
        .await
        .with_context(|| format!("{base}: no whole answer within {timeout:?}"))?
}

async fn send(
    client: &Client,
    base: &str,
    model: &str,
    planned: &Planned,
) -> anyhow::Result<Streamed> {
    let body = serde_json::json!({
        "model": model, "prompt": planned.prompt, "max_tokens": planned.max_tokens,
        "stream": true, "stream_options": {"include_usage": true},
        // vLLM's: as many tokens as asked (the simulator always makes them).
        "ignore_eos": true,
    })
    .to_string();
    let started = Instant::now();
    let request = hyper::Request::post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let response = client
        .request(request)
        .await
        .with_context(|| format!("POST {base}/v1/completions"))?;
    let status = response.status();
    if !status.is_success() {
        let body = response.into_body().collect().await?.to_bytes();
        anyhow::bail!(
            "POST {base}/v1/completions: {status}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    let mut body = response.into_body();
    let (mut first, mut output, mut cached_tokens) = (None, 0, None);
    let mut buffer = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        buffer.extend_from_slice(&data);
        while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            let Some(json) = event.strip_prefix(b"data: ") else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(json) else {
                continue;
            };
            // A chunk with a choice carries a token (the usage chunk has none).
            if v["choices"][0].is_object() {
                output += 1;
                first.get_or_insert_with(|| started.elapsed());
            }
            if let Some(c) = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
                cached_tokens = Some(c as u32);
            }
        }
    }
    let e2e = started.elapsed();
    Ok(Streamed {
        ttft: first.unwrap_or(e2e),
        e2e,
        output,
        cached_tokens,
    })
}

/// `METHOD base+path` with a JSON `body` (empty: none), within `timeout`: the answer's status
/// and body. For the small calls around a benchmark (a router's `/replicas`, `/score`,
/// `/metrics`, an engine's admin hooks).
pub async fn call(
    client: &Client,
    base: &str,
    method: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> anyhow::Result<(u16, String)> {
    let what = format!("{method} {base}{path}");
    let exchange = async {
        let request = hyper::Request::builder()
            .method(method)
            .uri(format!("{base}{path}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))?;
        let response = client.request(request).await?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        anyhow::Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .with_context(|| format!("{what}: no whole answer within {timeout:?}"))?
        .with_context(|| what.clone())
}

/// The `p` quantile (0 to 1) of `v`, nearest rank; 0 when empty. Sorts `v`.
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(0.0)
}
