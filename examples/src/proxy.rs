//! `POST /v1/completions` routed: `kvevent_fleet::route::Router` chooses among the replicas with
//! an upstream by the prompt's token ids (a text prompt's, with the engine's `tokenizer.json`);
//! the response comes back as it came, its usage's cached tokens recorded against the choice.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use kvevent_fleet::{discover::Upstream, route};

use crate::router::Router;

pub(crate) type Body = BoxBody<Bytes, std::io::Error>;
pub(crate) type Response = hyper::Response<Body>;

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

pub(crate) fn respond(status: u16, content_type: &'static str, body: String) -> Response {
    let mut r = hyper::Response::new(full(body));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::BAD_GATEWAY);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

/// A request's body, bounded (8 MiB of JSON is ~1M token ids); else a 413.
pub(crate) async fn body(req: hyper::Request<Incoming>) -> Result<Bytes, Response> {
    match Limited::new(req.into_body(), 8 << 20).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(error(413, format!("body: {e}"))),
    }
}

/// `{"error": message}`.
pub(crate) fn error(status: u16, message: String) -> Response {
    respond(
        status,
        "application/json",
        serde_json::json!({ "error": message }).to_string(),
    )
}

impl Router {
    fn note_response(&self, replica: &str, code: String) {
        self.responses
            .get_or_create(&vec![("replica", replica.to_owned()), ("code", code)])
            .inc();
    }

    /// A 502 naming the replica that failed the request, counted.
    fn failed(&self, upstream: &Upstream, why: String) -> Response {
        let Upstream { name, url } = upstream;
        self.note_response(name, "502".into());
        error(
            502,
            format!("replica `{name}` ({url}) failed the request: {why}"),
        )
    }

    /// The prompt's token ids, from a body's `prompt`; else why it is a bad request.
    fn prompt(&self, v: &serde_json::Value) -> Result<Vec<u32>, String> {
        match &v["prompt"] {
            serde_json::Value::Array(ids) => kvevent_fleet::json::token_ids(ids)
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
    pub(crate) async fn complete(&self, req: hyper::Request<Incoming>) -> Response {
        let (started, timeout) = (Instant::now(), self.config.upstream_timeout);
        let authorization = req.headers().get(hyper::header::AUTHORIZATION).cloned();
        let body = match body(req).await {
            Ok(b) => b,
            Err(r) => return r,
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
        let adapter = route::adapter_of(&model, &self.config.model);
        let upstreams = self.upstreams.now();
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
            let failed = |why: String| self.failed(upstream, why);
            let response = match tokio::time::timeout(timeout, self.client.request(request)).await {
                Err(_) => return failed(format!("no response within {timeout:?}")),
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
                .forward(response, sent, streaming, upstream, before)
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
        upstream: &Upstream,
        before: Duration,
    ) -> Response {
        let (status, timeout) = (response.status(), self.config.upstream_timeout);
        let failed = |why: String| self.failed(upstream, why);
        if status.is_server_error() {
            return failed(format!("it answered {status}"));
        }
        self.note_response(&upstream.name, status.as_u16().to_string());
        let (parts, upstream_body) = response.into_parts();
        if !streaming {
            let bytes = match tokio::time::timeout(timeout, upstream_body.collect()).await {
                Ok(Ok(b)) => b.to_bytes(),
                Ok(Err(e)) => return failed(format!("its body: {e}")),
                Err(_) => return failed(format!("no whole body within {timeout:?}")),
            };
            let after = Instant::now();
            let cached = status
                .is_success()
                .then(|| route::cached_tokens(&bytes))
                .flatten();
            sent.finish(cached);
            let r = hyper::Response::from_parts(parts, full(bytes));
            self.overhead
                .observe((before + after.elapsed()).as_secs_f64());
            return r;
        }
        // Streamed: each frame goes on as it comes; the usage chunk is read on the way.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(16);
        tokio::spawn(async move {
            let mut body = upstream_body;
            let mut usage = route::StreamUsage::default();
            loop {
                let frame = match tokio::time::timeout(timeout, body.frame()).await {
                    Ok(None) => break,
                    Ok(Some(frame)) => frame.map_err(std::io::Error::other),
                    Err(_) => Err(std::io::Error::other("upstream stalled")),
                };
                if let Some(data) = frame.as_ref().ok().and_then(Frame::data_ref) {
                    sent.first_token();
                    usage.feed(data);
                }
                let end = frame.is_err();
                if tx.send(frame).await.is_err() || end {
                    break;
                }
            }
            // In flight until the stream has been handed on whole.
            sent.finish(usage.cached_tokens());
        });
        let r = hyper::Response::from_parts(
            parts,
            BodyExt::boxed(StreamBody::new(futures_util::stream::poll_fn(move |cx| {
                rx.poll_recv(cx)
            }))),
        );
        self.overhead.observe(before.as_secs_f64());
        r
    }
}
