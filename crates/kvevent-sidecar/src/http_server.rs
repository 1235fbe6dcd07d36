//! Our own HTTP endpoint: `/metrics`, `/healthz`, `/readyz`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use crate::telemetry::Telemetry;

/// What `/readyz` requires.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Readiness {
    /// The last accepted report must be at most this old.
    pub(crate) max_silence: Duration,
    /// With no batch from any source for this long since the start, say so.
    pub(crate) silence_grace: Duration,
    /// No server (a sidecar serving routers only): ready once the engine's sockets are
    /// connected.
    pub(crate) feed_only: bool,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn respond(status: u16, content_type: &str, body: String) -> hyper::Response<Full<Bytes>> {
    let mut r = hyper::Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// The sources whose state the sidecar cannot vouch for, and since when, as a suffix of a
/// ready answer ("" when there are none): the sidecar still serves, but a router following it
/// sees those ranks degraded.
fn untrusted(telemetry: &Telemetry) -> String {
    let mut out = String::new();
    for (label, health) in telemetry
        .sources
        .labels
        .iter()
        .zip(&telemetry.sources.health)
    {
        let Some(for_) = health.untrusted_for() else {
            continue;
        };
        let why = if health.unverified() {
            "unverified: the engine's connection was made again (or the sidecar started) and it is not yet proven the same process"
        } else {
            "degraded: batches were lost that the engine could not replay; what is held may be incomplete until the engine clears its cache"
        };
        out.push_str(&format!("; {label} {why}, for {:.1} s", for_.as_secs_f64()));
    }
    out
}

fn route(path: &str, telemetry: &Telemetry, readiness: Readiness) -> hyper::Response<Full<Bytes>> {
    match path {
        "/metrics" => respond(
            200,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            telemetry.render(),
        ),
        "/healthz" => respond(200, "text/plain", "ok\n".into()),
        "/readyz" => {
            let subscribed = telemetry.subscribed.load(Relaxed);
            let last = telemetry.delivery.last_success_unix_ms();
            let recent = last > 0
                && now_ms().saturating_sub(last) <= readiness.max_silence.as_millis() as u64;
            let engine_silent = !telemetry.sources.any_batch()
                && now_ms().saturating_sub(telemetry.sources.started_unix_ms)
                    >= readiness.silence_grace.as_millis() as u64;
            let unconnected: Vec<&str> = telemetry
                .sources
                .labels
                .iter()
                .zip(&telemetry.sources.health)
                .filter(|(_, h)| !h.get().is_connected())
                .map(|(label, _)| label.as_str())
                .collect();
            if !subscribed {
                return respond(
                    503,
                    "text/plain",
                    "not ready: engine subscription is not up\n".into(),
                );
            }
            let no_connection = || {
                format!(
                    "no connection to the engine socket(s) {}: nothing listens there or the host cannot be reached",
                    unconnected.join(", ")
                )
            };
            if readiness.feed_only {
                return if unconnected.is_empty() {
                    respond(
                        200,
                        "text/plain",
                        format!("ready (feed only: no server){}\n", untrusted(telemetry)),
                    )
                } else {
                    respond(
                        503,
                        "text/plain",
                        format!("not ready: {}\n", no_connection()),
                    )
                };
            }
            let unreachable = telemetry
                .delivery
                .server_unreachable
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            if (engine_silent || !recent) && (!unconnected.is_empty() || unreachable.is_some()) {
                let mut why = String::from("not ready:");
                if !unconnected.is_empty() {
                    why.push_str(&format!(" {};", no_connection()));
                }
                if let Some(e) = unreachable {
                    why.push_str(&format!(" the server cannot be reached ({e});"));
                }
                why.pop();
                why.push('\n');
                return respond(503, "text/plain", why);
            }
            if engine_silent {
                return respond(
                    503,
                    "text/plain",
                    format!(
                        "not ready: no KV events from any engine source since the start ({}s): is vLLM started with --kv-events-config, and does --engine-endpoint name its PUB socket?\n",
                        now_ms().saturating_sub(telemetry.sources.started_unix_ms) / 1000
                    ),
                );
            }
            if recent {
                respond(
                    200,
                    "text/plain",
                    format!("ready{}\n", untrusted(telemetry)),
                )
            } else {
                respond(
                    503,
                    "text/plain",
                    format!(
                        "not ready: no report accepted by the server in the last {:?}\n",
                        readiness.max_silence
                    ),
                )
            }
        }
        _ => respond(
            404,
            "text/plain",
            "not found: try /metrics, /healthz, /readyz\n".into(),
        ),
    }
}

/// Binds `addr` and serves until the returned task is aborted.
pub(crate) async fn serve(
    addr: SocketAddr,
    telemetry: Arc<Telemetry>,
    readiness: Readiness,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let telemetry = telemetry.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let response = route(req.uri().path(), &telemetry, readiness);
                    async move { Ok::<_, Infallible>(response) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .serve_connection(TokioIo::new(stream), service);
                let _ = tokio::time::timeout(Duration::from_secs(60), conn).await;
            });
        }
    });
    Ok((bound, task))
}
