//! What the example router adds to a completion: the same requests sent straight to a
//! replica's server and through the router (`POST /v1/completions`), alternated one by one on
//! loopback, each on a connection of its own. The replica's server is a hyper stand-in that
//! answers at once (with a usage), so the figures are the router's own: choosing (a score of
//! the prompt's 128 token ids against the engine stand-in's blocks), rewriting nothing,
//! forwarding, reading the usage, recording the outcome.
//!
//! `cargo run --release -p kvevent-benches --bin router-proxy [-- REQUESTS]` (default 5,000)

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvevent_examples::router::{self, Router, RouterConfig};
use kvevent_fleet::discover::Listed;
use kvevent_wire as wire;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const USAGE: &str = "usage: router-proxy [REQUESTS]   (default 5000)
Latency of a completion straight to a replica's server and through the example router,
alternated, on loopback: p50, p99 and their difference.";

async fn upstream() -> anyhow::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |req: hyper::Request<hyper::body::Incoming>| async move {
                        use http_body_util::BodyExt;
                        let _ = req.into_body().collect().await;
                        let body = r#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":128,"prompt_tokens_details":{"cached_tokens":96}}}"#;
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from_static(body.as_bytes())),
                        ))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

async fn post(addr: std::net::SocketAddr, body: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut text = String::new();
    s.read_to_string(&mut text).await?;
    anyhow::ensure!(text.starts_with("HTTP/1.1 200"), "{text}");
    Ok(started.elapsed())
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * p) as usize)
        .copied()
        .unwrap_or(0.0)
}

fn main() -> anyhow::Result<()> {
    let mut cli = kvevent_benches::Cli::new(USAGE);
    let requests: usize = cli.positional("REQUESTS", 5000)?;
    cli.done()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let ctx = zmq::Context::new();
        let engine = kvevent_zmq::publisher::Publisher::start(
            &ctx,
            kvevent_zmq::publisher::PublisherConfig::loopback(wire::Release::NEWEST_KNOWN),
        )?;
        let prompt: Vec<u32> = (0..128).collect();
        engine.publish(&wire::EventBatch::new(1.0, vec![wire::Event::BlockStored(wire::BlockStored {
                block_hashes: (1..=4)
                    .map(|h| wire::BlockHash::Int(wire::Int::U64(h)))
                    .collect(),
                token_ids: prompt.clone().into(),
                block_size: 32,
                ..Default::default()
            })]))?;
        let server = upstream().await?;
        let spec = format!(
            "a={},replay={}",
            engine.endpoint(),
            engine.replay_endpoint().unwrap_or_default()
        );
        let router = Arc::new(Router::start(RouterConfig {
            model: "m".into(),
            block_size: None,
            replicas: vec![
                Listed::engine(&spec).map_err(anyhow::Error::msg)?,
                Listed::upstream(&format!("a=http://{server}")).map_err(anyhow::Error::msg)?,
            ],
            discover: None,
            upstream_timeout: Duration::from_secs(10),
            tokenizer: None,
            policy: kvevent_fleet::route::Policy::default(),
            learn_weights: true,
        })?);
        let (addr, _task) = router::bind("127.0.0.1:0", router.clone()).await?;
        router
            .fleet()
            .ready(Duration::from_secs(20))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while router.fleet().block_size().is_none() {
            anyhow::ensure!(Instant::now() < deadline, "the engine stand-in's store never came");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string();
        // Warm both paths.
        for _ in 0..100 {
            post(server, &body).await?;
            post(addr, &body).await?;
        }
        let (mut direct, mut routed) = (Vec::new(), Vec::new());
        for _ in 0..requests {
            direct.push(post(server, &body).await?.as_secs_f64() * 1e3);
            routed.push(post(addr, &body).await?.as_secs_f64() * 1e3);
        }
        let (d50, d99) = (percentile(&mut direct, 0.5), percentile(&mut direct, 0.99));
        let (r50, r99) = (percentile(&mut routed, 0.5), percentile(&mut routed, 0.99));
        println!(
            "{requests} requests each, alternated\n\n| path | p50 ms | p99 ms |\n|---|---|---|\n| straight to the replica | {d50:.3} | {d99:.3} |\n| through the router | {r50:.3} | {r99:.3} |\n| the router's overhead | {:.3} | {:.3} |",
            r50 - d50,
            r99 - d99
        );
        let accounted = router.fleet().accounting();
        println!("\naccounting: {accounted:?}");
        anyhow::Ok(())
    })
}
