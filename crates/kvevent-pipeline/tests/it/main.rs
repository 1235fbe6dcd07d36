//! The composed pipeline: configuration, end to end over loopback, stats, TLS, tokens.

mod config;
mod deploy;
mod discovery;
mod docs;
mod e2e;
mod feed;
mod sglang;
mod state_file;
mod tls;

use std::time::Duration;

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
