//! Client CPU per eviction RPC: the forwarder (and the bare client) on a one-thread runtime of
//! its own, against a recording tonic server on another thread; prints CPU µs per call from
//! `/proc/thread-self/stat`.
//!
//! `cargo run --release -p kvevent-benches --bin rpc-cost [-- CALLS]` (default 50,000).

use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use kvevent_forwarder as fwd;
use kvevent_proto as pb;
use kvevent_test_support::RecordingServer;

fn evict(i: u64) -> pb::CacheEvent {
    pb::CacheEvent {
        r#type: pb::cache_event::Type::PrefixEvicted as i32,
        replica_id: "replica-1".into(),
        model_id: "meta-llama/Llama-3.1-8B-Instruct".into(),
        prefix_hash: i.to_be_bytes().to_vec(),
        timestamp_us: 1,
        ..Default::default()
    }
}

const USAGE: &str = "usage: rpc-cost [CALLS]   (default 50000)
Client CPU per eviction RPC (the forwarder's, and the bare tonic client's) over CALLS calls.";

fn main() -> anyhow::Result<()> {
    let mut args = kvevent_benches::Cli::new(USAGE);
    let calls: u64 = args.positional("CALLS", 50_000)?;
    args.done()?;
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("sink")
        .enable_all()
        .build()?;
    let server = server_rt.block_on(RecordingServer::start());
    let addr = server.addr().to_string();
    let client_thread = std::thread::Builder::new().name("client".into()).spawn(
        move || -> anyhow::Result<(f64, f64, f64)> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let client = fwd::connect(&fwd::ClientConfig::new(addr))?;
                client.publish(evict(u64::MAX)).await?;

                // The bare client, 256 calls at once.
                let t0 = kvevent_benches::procfs::cpu_seconds("/proc/thread-self/stat");
                let wall = Instant::now();
                let mut running = FuturesUnordered::new();
                for i in 0..calls {
                    if running.len() >= 256 {
                        running.next().await;
                    }
                    let c = client.clone();
                    running.push(async move { c.publish(evict(i)).await });
                }
                while running.next().await.is_some() {}
                let bare = (kvevent_benches::procfs::cpu_seconds("/proc/thread-self/stat") - t0)
                    / calls as f64
                    * 1e6;
                let bare_wall = wall.elapsed().as_secs_f64();

                // The forwarder, fed 1,000 evictions every 10 ms (a busy engine's steps).
                let (h, f) = fwd::spawn(client, fwd::Config::default());
                let t0 = kvevent_benches::procfs::cpu_seconds("/proc/thread-self/stat");
                for i in 0..calls {
                    h.submit(pb::Report::Event(evict(calls + i))).await?;
                    if i % 1_000 == 999 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                let left = f.shutdown(Duration::from_secs(120)).await;
                anyhow::ensure!(left == fwd::DrainReport::default(), "unsent: {left:?}");
                let forwarded = (kvevent_benches::procfs::cpu_seconds("/proc/thread-self/stat")
                    - t0)
                    / calls as f64
                    * 1e6;
                Ok((bare, bare_wall, forwarded))
            })
        },
    )?;
    let (bare, bare_wall, forwarded) = client_thread
        .join()
        .map_err(|_| anyhow::anyhow!("client thread panicked"))??;
    println!("{calls} PublishEvent calls, client thread CPU per call:");
    println!(
        "  bare client, 256 in flight: {bare:.1} µs ({:.0} calls/s)",
        calls as f64 / bare_wall
    );
    println!("  forwarder (default config): {forwarded:.1} µs");
    Ok(())
}
