//! Sidecars' feeds for the Python wheel's score figure (`benches/python_wheel.py`): REPLICAS
//! hubs, each served on a loopback port as a sidecar serves its feed, every one holding a
//! shared 32-block system prompt and PROMPTS prompts of its own of 32 blocks; and a Rust
//! `Fleet` following them, the figure's reference.
//!
//! Prints one JSON line: `urls` (one per replica, `r0`, `r1`, ...), `block_size`, `queries`
//! (token ids: the system prompt then 32 blocks no replica holds, answered by every replica;
//! or one replica's own prompt, answered by one). Then, per `measure SECONDS` line on stdin,
//! scores the queries round-robin on the Rust Fleet for that long and prints
//! `{"ns_per_score": ...}`. Ends when stdin closes.
//!
//! `cargo run --release -p kvevent-benches --bin feed-stub -- [REPLICAS] [PROMPTS]` (256, 8)

use std::io::BufRead;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvevent_benches::Cli;
use kvevent_feed::{Hub, HubConfig, ServeOptions};
use kvevent_fleet::{Fleet, FleetConfig, Query, QueryKeys, ReplicaSource, SidecarFeed};
use kvevent_mapper::{Identity, KeyMode, Mapper, Options};
use kvevent_test_support::batches;
use kvevent_wire as wire;

const BLOCK: usize = 16;
const BLOCKS: usize = 32;
const USAGE: &str = "usage: feed-stub [REPLICAS] [PROMPTS]
Serves REPLICAS sidecars' feeds (default 256), each holding a shared system prompt and PROMPTS
prompts of its own (default 8), for benches/python_wheel.py; see the source's header.";

/// Prompt `seed`'s token ids: `BLOCKS` blocks, distinct per seed.
fn prompt(seed: u32) -> Vec<u32> {
    (0..(BLOCKS * BLOCK) as u32)
        .map(|t| seed * 100_000 + t)
        .collect()
}

fn stored(seed: u32) -> wire::EventBatch<'static> {
    let hashes: Vec<u64> = (0..BLOCKS as u64)
        .map(|h| u64::from(seed) * 1000 + h + 1)
        .collect();
    batches::batch(
        1.0,
        vec![batches::stored(&hashes, None, prompt(seed), BLOCK as u32)],
    )
}

fn main() -> anyhow::Result<()> {
    let mut args = Cli::new(USAGE);
    let replicas: u32 = args.positional("REPLICAS", 256)?;
    let prompts: u32 = args.positional("PROMPTS", 8)?;
    args.done()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut urls = Vec::new();
    let mut served = Vec::new();
    for r in 0..replicas {
        let name = format!("r{r}");
        let hub = Hub::new(HubConfig::new(name.clone(), "m"));
        let mut mapper = Mapper::new(
            Identity::new(&name, "m", "", "bench").context("identity")?,
            Options {
                key_mode: KeyMode::Fingerprint,
                ..Options::default()
            },
        );
        let mut reports = Vec::new();
        for seed in std::iter::once(0).chain((0..prompts).map(|p| 1 + r * prompts + p)) {
            mapper.map_batch(&stored(seed), &mut reports);
        }
        for report in &reports {
            hub.apply(0, report);
        }
        hub.note_block_size(BLOCK as u32);
        hub.commit();
        let (addr, task) = rt.block_on(kvevent_feed::serve(
            "127.0.0.1:0",
            Arc::clone(&hub),
            ServeOptions::default(),
            std::future::pending(),
        ))?;
        urls.push(format!("http://{addr}"));
        served.push((hub, task));
    }
    // Half the queries are answered by every replica (the system prompt, then blocks nobody
    // holds), half by one (a replica's own prompt).
    let queries: Vec<Vec<u32>> = (0..16u32)
        .map(|q| {
            if q % 2 == 0 {
                let mut ids = prompt(0);
                ids.extend(prompt(40_000 + q));
                ids
            } else {
                prompt(1 + (q * 7919 % replicas) * prompts + q % prompts.max(1))
            }
        })
        .collect();
    let fleet = Fleet::with_runtime(FleetConfig::default(), rt.handle().clone());
    for (r, url) in urls.iter().enumerate() {
        fleet.ensure_replica(
            &format!("r{r}"),
            ReplicaSource::Sidecar(SidecarFeed::new(url.clone())),
        )?;
    }
    rt.block_on(fleet.ready(Duration::from_secs(120)))?;
    println!(
        "{}",
        serde_json::json!({"urls": urls, "block_size": BLOCK, "queries": queries})
    );
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let Some(seconds) = line.strip_prefix("measure ") else {
            anyhow::bail!("`{line}`: expected `measure SECONDS`");
        };
        let seconds: f64 = seconds.trim().parse().context("seconds")?;
        let started = Instant::now();
        let mut n = 0u64;
        let mut matched = 0u64;
        while started.elapsed().as_secs_f64() < seconds {
            for ids in &queries {
                let query = Query {
                    adapter: "",
                    keys: QueryKeys::Tokens {
                        ids,
                        block_size: BLOCK,
                    },
                };
                let scores = fleet.score(&query)?;
                matched += u64::from(scores.first().map_or(0, |s| s.matched_blocks));
                n += 1;
            }
        }
        let ns = started.elapsed().as_nanos() as f64 / n as f64;
        println!(
            "{}",
            serde_json::json!({"ns_per_score": ns, "scores": n, "matched_blocks": matched})
        );
    }
    Ok(())
}
