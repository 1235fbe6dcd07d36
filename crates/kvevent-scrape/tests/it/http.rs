//! Fetching from a real hyper server on 127.0.0.1: fixtures, gzip, slow, 500, oversized, garbage.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvevent_scrape::{FetchError, ScrapeError, Scraper, StatsConfig};

use crate::fixtures::fixture;

/// Serves `/ok`, `/gzip`, `/slow`, `/500`, `/big` and `/garbage`.
async fn serve() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let body = fixture("vllm-0.33-tick1.txt");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let body = body.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let body = body.clone();
                    async move {
                        let mut resp = hyper::Response::new(Full::new(Bytes::new()));
                        match req.uri().path() {
                            "/ok" => *resp.body_mut() = Full::new(Bytes::from(body)),
                            "/gzip" => {
                                use std::io::Write;
                                let mut gz = flate2::write::GzEncoder::new(
                                    Vec::new(),
                                    flate2::Compression::default(),
                                );
                                gz.write_all(body.as_bytes()).expect("gzip");
                                *resp.body_mut() =
                                    Full::new(Bytes::from(gz.finish().expect("gzip")));
                                resp.headers_mut()
                                    .insert("content-encoding", "gzip".parse().expect("hv"));
                            }
                            "/slow" => {
                                tokio::time::sleep(Duration::from_secs(5)).await;
                                *resp.body_mut() = Full::new(Bytes::from(body));
                            }
                            "/500" => *resp.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR,
                            "/big" => {
                                *resp.body_mut() = Full::new(Bytes::from(vec![b'#'; 2 << 20]))
                            }
                            _ => {
                                *resp.body_mut() =
                                    Full::new(Bytes::from_static(b"<html>not metrics{</html>"))
                            }
                        }
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

fn scraper(addr: SocketAddr, path: &str) -> Scraper {
    let config = StatsConfig {
        cache_size_bytes: 1_000_000,
        concurrency_ceiling: 10,
        ..StatsConfig::default()
    };
    Scraper::new(
        &format!("http://{addr}{path}"),
        Duration::from_millis(500),
        1 << 20,
        config,
    )
    .expect("scraper")
}

#[tokio::test]
async fn fixtures_plain_and_gzip() {
    let addr = serve().await;
    for path in ["/ok", "/gzip"] {
        let stats = scraper(addr, path).scrape().await.expect(path);
        assert_eq!(stats.cache_memory_bytes, 42_100, "{path}");
    }
}

#[tokio::test]
async fn failures_are_errors_of_their_kind() {
    let addr = serve().await;
    let started = std::time::Instant::now();
    let err = scraper(addr, "/slow").scrape().await.expect_err("slow");
    assert!(
        matches!(err, ScrapeError::Fetch(FetchError::Timeout(_))),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    let err = scraper(addr, "/500").scrape().await.expect_err("500");
    assert!(
        matches!(err, ScrapeError::Fetch(FetchError::Status(500))),
        "{err:?}"
    );
    let err = scraper(addr, "/big").scrape().await.expect_err("big");
    assert!(
        matches!(err, ScrapeError::Fetch(FetchError::TooLarge(_))),
        "{err:?}"
    );
    let err = scraper(addr, "/garbage")
        .scrape()
        .await
        .expect_err("garbage");
    assert_eq!(err.kind(), "parse");
    // Nothing listening.
    let closed = kvevent_test_support::HeldPort::new();
    let err = scraper(closed.addr(), "/metrics")
        .scrape()
        .await
        .expect_err("refused");
    assert_eq!(err.kind(), "request");
    assert!(
        Scraper::new(
            "ftp://x/metrics",
            Duration::from_secs(1),
            1,
            StatsConfig::default()
        )
        .is_err()
    );
}
