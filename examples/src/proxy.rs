//! `POST /v1/completions` routed: the prompt's token ids (a text prompt's, with the engine's
//! own `tokenizer.json`) go to `kvevent_fleet::route::Router`, which chooses among the replicas
//! with an upstream by the policy given; the request goes there, and the response comes back
//! as it came (streamed when it streams), its usage's cached tokens recorded against the
//! prediction the choice acted on.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use kvevent_fleet::route;

use crate::router::Router;

pub(crate) type Body = BoxBody<Bytes, std::io::Error>;

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

pub(crate) fn respond(
    status: u16,
    content_type: &'static str,
    body: String,
) -> hyper::Response<Body> {
    let mut r = hyper::Response::new(full(body));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::BAD_GATEWAY);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

/// `{"error": message}`.
pub(crate) fn error(status: u16, message: String) -> hyper::Response<Body> {
    respond(
        status,
        "application/json",
        serde_json::json!({ "error": message }).to_string(),
    )
}

impl Router {
    fn note_overhead(&self, d: Duration) {
        self.overhead.observe(d.as_secs_f64());
    }

    fn note_response(&self, replica: &str, code: String) {
        self.responses
            .get_or_create(&vec![("replica", replica.to_owned()), ("code", code)])
            .inc();
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
            let response = match tokio::time::timeout(
                self.config.upstream_timeout,
                self.client.request(request),
            )
            .await
            {
                Err(_) => {
                    return failed(format!(
                        "no response within {:?}",
                        self.config.upstream_timeout
                    ));
                }
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
            let bytes =
                match tokio::time::timeout(self.config.upstream_timeout, upstream_body.collect())
                    .await
                {
                    Ok(Ok(b)) => b.to_bytes(),
                    Ok(Err(e)) => return failed(format!("its body: {e}")),
                    Err(_) => {
                        return failed(format!(
                            "no whole body within {:?}",
                            self.config.upstream_timeout
                        ));
                    }
                };
            let after = Instant::now();
            let cached = status
                .is_success()
                .then(|| route::cached_tokens(&bytes))
                .flatten();
            sent.finish(cached);
            let r = hyper::Response::from_parts(parts, full(bytes));
            self.note_overhead(before + after.elapsed());
            return r;
        }
        // Streamed: each frame goes on as it comes; the usage chunk is read on the way.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(16);
        let timeout = self.config.upstream_timeout;
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
        self.note_overhead(before);
        r
    }
}
