//! The composed sidecar: configuration, end to end over loopback, stats, TLS, tokens.

mod config;
mod deploy;
mod discovery;
mod docs;
mod e2e;
mod endpoints;
mod feed;
mod feed_engine;
#[cfg(feature = "real-engine")]
mod real_engine;
mod sglang;
mod state_file;
mod tls;

use std::time::Duration;

use kvevent_sidecar::Settings;
use kvevent_sidecar::settings::GoDuration;
use kvevent_test_support::{Publisher, PublisherConfig, RecordingServer};

/// The sidecar between `engine` and `server` on loopback: replica `r1` of `llama`, a 20 ms
/// window, no `/metrics` listener, no scrape.
pub(crate) fn loopback(engine: &Publisher, server: &RecordingServer) -> Settings {
    Settings {
        engine_endpoint: engine.endpoint().into(),
        replay_endpoint: engine.replay_endpoint().unwrap_or_default().into(),
        server: server.addr().to_string().into(),
        replica_id: "r1".into(),
        model_id: "llama".into(),
        metrics_address: Default::default(),
        engine_metrics_url: Default::default(),
        window: GoDuration::ms(20),
        ..Settings::default()
    }
}

/// A recording server and an engine stand-in speaking vLLM's newest wire, on loopback.
pub(crate) async fn ends() -> (RecordingServer, zmq::Context, Publisher) {
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let engine = Publisher::start(
        &ctx,
        PublisherConfig::loopback(kvevent_wire::Release::NEWEST_KNOWN),
    )
    .expect("engine");
    (server, ctx, engine)
}

/// `GET path` over plain HTTP/1.0; returns (status, body).
pub(crate) async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .expect("write");
        let mut text = String::new();
        stream.read_to_string(&mut text).await.expect("read");
        text
    };
    let text = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .expect("http within 5 s");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}
