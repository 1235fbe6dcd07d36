//! A self-contained demo: an in-process engine speaking vLLM's wire (PUB + replay, a
//! scripted workload), the real sidecar over loopback sockets, a recording InferenceCache
//! server, and a served `/metrics` fixture. [`run`] prints what flowed.

mod server;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvevent_proto as pb;
use kvevent_wire::Release;
use kvevent_zmq::publisher::{Publisher, PublisherConfig, scripted_batch};

pub use server::{Received, RecordingServer};

use crate::Settings;

/// An engine `/metrics` exposition (vLLM 0.33), served by the demo.
pub const METRICS_FIXTURE: &str = include_str!("vllm-metrics.txt");

/// Serves `body` at every path on `127.0.0.1:0`, as an engine's `/metrics`.
pub async fn serve_metrics(
    body: &'static str,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let service = service_fn(
                    move |_req: hyper::Request<hyper::body::Incoming>| async move {
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(
                            body.as_bytes(),
                        ))))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((addr, task))
}

/// What the demo saw arrive at the server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Batches the engine published.
    pub batches_published: u64,
    /// CacheStateUpdates with prefixes.
    pub updates: u64,
    /// Prefix entries added or refreshed.
    pub prefixes: u64,
    /// `PREFIX_EVICTED` events.
    pub evictions: u64,
    /// `ALL_CLEARED` events.
    pub clears: u64,
    /// Stats-only updates.
    pub stats_reports: u64,
}

fn summarize(received: &[Received], batches_published: u64) -> Summary {
    let mut s = Summary {
        batches_published,
        ..Summary::default()
    };
    for r in received {
        match r {
            Received::Update(u) if u.stats.is_some() && u.prefixes.is_empty() => {
                s.stats_reports += 1
            }
            Received::Update(u) => {
                s.updates += 1;
                s.prefixes += u.prefixes.len() as u64;
            }
            Received::Event(e) if e.r#type == pb::cache_event::Type::AllCleared as i32 => {
                s.clears += 1
            }
            Received::Event(_) => s.evictions += 1,
        }
    }
    s
}

/// Runs the demo: `batches` scripted engine steps, then a drain. Prints what flowed.
pub async fn run(batches: u64) -> Result<Summary, Box<dyn std::error::Error + Send + Sync>> {
    let started = Instant::now();
    let server = RecordingServer::start().await?;
    let (metrics_addr, metrics_task) = serve_metrics(METRICS_FIXTURE).await?;
    let ctx = zmq::Context::new();
    let engine = Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN))?;
    let settings = Settings {
        engine_endpoint: engine.endpoint().into(),
        replay_endpoint: engine.replay_endpoint().unwrap_or_default().into(),
        server: server.addr().to_string().into(),
        replica_id: "demo-replica-0".into(),
        model_id: "meta-llama/Llama-3.1-8B-Instruct".into(),
        engine_metrics_url: format!("http://{metrics_addr}/metrics").into(),
        engine_cache_size_bytes: 16 << 30,
        stats_interval: crate::settings::GoDuration::ms(200),
        metrics_address: "127.0.0.1:0".into(),
        window: crate::settings::GoDuration::ms(50),
        ..Settings::default()
    };
    println!("the demo's parts, on loopback until it ends (a second or two):");
    println!(
        "  engine (vLLM {}) publishing on {}",
        engine.release(),
        engine.endpoint()
    );
    println!("  InferenceCache server (recording) on {}", server.addr());
    println!("  engine /metrics fixture on http://{metrics_addr}/metrics");
    let running = crate::start(&settings, &ctx).await?;
    if let Some(addr) = running.metrics_addr() {
        println!("  the sidecar's /metrics, /healthz, /readyz on http://{addr}");
    }
    if !tokio::task::block_in_place(|| engine.wait_for_subscribers(1, Duration::from_secs(10))) {
        return Err("the sidecar did not subscribe within 10 s".into());
    }
    // Part of the workload is lost on the way (a gap the replay repairs).
    for step in 0..batches {
        if step % 17 == 5 {
            engine.publish_lost(kvevent_wire::encode(
                &scripted_batch(step),
                engine.release(),
            )?);
        } else {
            engine.publish(&scripted_batch(step))?;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Let the last batches, a replay and two stats ticks through.
    let deadline = Instant::now() + Duration::from_secs(10);
    while summarize(&server.received(), batches).stats_reports < 2
        || running.telemetry().sources.metrics[0]
            .last_seq
            .load(std::sync::atomic::Ordering::Relaxed)
            + 1
            < batches
    {
        if Instant::now() > deadline {
            return Err("the workload did not flow through within 10 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let telemetry = running.telemetry().clone();
    let left = running.shutdown(Duration::from_secs(5)).await;
    metrics_task.abort();
    let summary = summarize(&server.received(), batches);
    let m = &telemetry.sources.metrics[0];
    use std::sync::atomic::Ordering::Relaxed;
    println!("\nwhat flowed in {:.1} s:", started.elapsed().as_secs_f64());
    println!(
        "  batches published by the engine   {}",
        summary.batches_published
    );
    println!(
        "  batches received                  {} (gaps repaired by replay: {}, replays: {})",
        m.batches.load(Relaxed),
        m.gaps.load(Relaxed),
        m.replays_complete.load(Relaxed)
    );
    println!("  updates sent                      {}", summary.updates);
    println!("  prefixes added                    {}", summary.prefixes);
    println!("  evictions                         {}", summary.evictions);
    println!(
        "  clears                            {} (1 at startup: the sidecar clears its replica's old state on the server; {} the engine sent)",
        summary.clears,
        summary.clears.saturating_sub(1)
    );
    println!(
        "  stats reports                     {}",
        summary.stats_reports
    );
    println!(
        "  left unsent at shutdown           {} prefixes, {} events",
        left.unsent_prefixes, left.unsent_events
    );
    Ok(summary)
}
