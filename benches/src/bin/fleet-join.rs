//! A router joining a fleet late: S engine stand-ins (vLLM 0.33's wire, replay buffers of BUF
//! batches) have each stored B blocks (prompts of 16 blocks of 16 tokens) through S release
//! sidecars (`kvevent-subscriber --feed-address`, reporting to a sink in this process). Then
//! the release example router starts twice, one after the other in the same run: following the
//! sidecars' feeds (`--sidecar`), and following the engines directly (`--engine`, with
//! replay). For each: the time from its start until it has every replica with what it can
//! learn (following feeds: every replica exact with every resident block; following engines:
//! every replica connected and its replay in, its blocks steady for 500 ms), the share of resident prompts it scores whole (recall), its peak RSS and its index's
//! bytes per (key, replica) pair.
//!
//! ```text
//! cargo build --release -p kvevent-subscriber -p kvevent-examples --example router -p kvevent-benches --bin fleet-join
//! target/release/fleet-join [SIDECARS BLOCKS [BUFFER [RATE]]]       # 8 16384 1000 0
//! ```
//!
//! With RATE > 0 every engine goes on storing RATE prompts a second (new ones) while the
//! routers join: what a router restarting under load sees. A resident prompt scored short
//! once the router is in is a blind score.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kvevent_benches::http::{self, Guard, sum};
use kvevent_proto as pb;
use kvevent_test_support::EngineSide;
use kvevent_wire as wire;
use kvevent_zmq::publisher::{Publisher, PublisherConfig};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use tonic::{Request, Response, Status, Streaming};

const BLOCK: u32 = 16;
/// Blocks a prompt (and a batch) stores.
const PROMPT_BLOCKS: u32 = 16;
const RELEASE: wire::Release = wire::Release::new(0, 33, 0);
/// Prompts per replica scored for recall.
const SAMPLE: u64 = 64;

/// Token ids of prompt `p` of replica `r`: distinct across the fleet.
fn prompt(r: u64, p: u64) -> Vec<u32> {
    let base = ((r << 20) | p) as u32 * 1000;
    (0..BLOCK * PROMPT_BLOCKS)
        .map(|t| base.wrapping_add(t))
        .collect()
}

fn batch(r: u64, p: u64) -> wire::EventBatch<'static> {
    wire::EventBatch::new(
        1.0,
        vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: (0..u64::from(PROMPT_BLOCKS))
                .map(|b| wire::BlockHash::Int(wire::Int::U64((r << 40) | (p << 8) | b)))
                .collect(),
            token_ids: prompt(r, p).into(),
            block_size: BLOCK,
            medium: Some("GPU".into()),
            ..Default::default()
        })],
    )
}

/// A server that takes everything and keeps nothing.
struct Sink;

#[tonic::async_trait]
impl EngineSide for Sink {
    async fn report(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        let mut updates = request.into_inner();
        while updates.message().await?.is_some() {}
        Ok(kvevent_test_support::accepted())
    }
    async fn publish(&self, _: Request<pb::CacheEvent>) -> Result<Response<pb::Ack>, Status> {
        Ok(kvevent_test_support::accepted())
    }
}

/// The sidecar's feed and `/metrics` addresses, from its log (both bound to port 0); the rest
/// of its log is read and dropped by a thread.
fn bound_addresses(child: &mut std::process::Child) -> anyhow::Result<(String, String)> {
    use std::io::BufRead;
    let stderr = child.stderr.take().context("stderr")?;
    let mut lines = std::io::BufReader::new(stderr).lines();
    let (mut feed, mut metrics) = (None, None);
    let address = |line: &str| {
        line.split("address=")
            .nth(1)
            .and_then(|a| a.split_whitespace().next())
            .map(str::to_owned)
    };
    while feed.is_none() || metrics.is_none() {
        let line = lines.next().context("the sidecar ended")??;
        if line.contains("serving the router feed") {
            feed = address(&line);
        } else if line.contains("serving /metrics") {
            metrics = address(&line);
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Ok((feed.unwrap_or_default(), metrics.unwrap_or_default()))
}

fn release_bin(name: &str) -> anyhow::Result<String> {
    let dir = std::env::current_exe()?
        .parent()
        .context("exe dir")?
        .to_owned();
    let path = [dir.join(name), dir.join("examples").join(name)]
        .into_iter()
        .find(|p| p.exists())
        .with_context(|| {
            format!(
                "{name} not found beside {}: build it with --release",
                dir.display()
            )
        })?;
    Ok(path.display().to_string())
}

struct Replica {
    engine: Publisher,
    feed: String,
    metrics: String,
    _sidecar: Guard,
}

/// What one router learned, and how fast.
struct Joined {
    how: &'static str,
    join: Duration,
    /// Replicas exact at the end (the others degraded: their replay began late).
    exact: usize,
    recall: f64,
    scored_short: u64,
    blocks: u64,
    rss_mb: f64,
    bytes_per_pair: f64,
}

/// Starts the router with `args`, waits until every replica is exact and its blocks stop
/// growing, then scores a sample of every replica's prompts.
fn join(
    router_bin: &str,
    how: &'static str,
    args: &[String],
    replicas: usize,
    prompts: u64,
    want_blocks: Option<u64>,
    need_exact: bool,
) -> anyhow::Result<Joined> {
    // The router takes no port 0: one held until it ends (it binds over the hold).
    let port = kvevent_test_support::HeldPort::new();
    let addr = port.addr().to_string();
    let started = Instant::now();
    let child = Command::new(router_bin)
        .args(["--listen", &addr, "--model", "m", "--block-size", "16"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let pid = child.id();
    let router = Guard(child);
    let deadline = started
        + Duration::from_secs(
            std::env::var("FLEET_JOIN_WAIT")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(300),
        );
    // Exact, and (without a target) no more blocks for 500 ms: the replays are in.
    let (mut last, mut steady_since) = (0u64, Instant::now());
    let states;
    // The replicas' states and reasons last seen, for a join that does not come.
    let mut seen = String::new();
    // When every block was known (exact or not yet): the rest of the join is the states.
    let mut all_blocks_at = None;
    let joined_at = loop {
        if Instant::now() > deadline {
            bail!("{how}: the replicas were not all exact within 300 s; last seen: {seen}");
        }
        let Ok(text) = http::get(&addr, "/replicas") else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let list = v["replicas"].as_array().cloned().unwrap_or_default();
        let exact = list.len() == replicas && list.iter().all(|r| r["state"] == "exact");
        // Following engines whose replay buffers lost the start, a replica is rightly never
        // exact (degraded): it is in once connected and replayed.
        let connected = list.len() == replicas
            && list
                .iter()
                .all(|r| r["state"] != "stale" && r["reason"] != "connecting");
        let blocks: u64 = list.iter().filter_map(|r| r["blocks"].as_u64()).sum();
        let mut tally = std::collections::BTreeMap::<String, usize>::new();
        for r in &list {
            let what = format!("{} {}", r["state"], r["reason"]).replace('"', "");
            *tally.entry(what).or_default() += 1;
        }
        seen = format!("{} replicas, {blocks} blocks: {tally:?}", list.len());
        let now = Instant::now();
        if blocks != last {
            (last, steady_since) = (blocks, now);
        }
        if want_blocks.is_some_and(|w| blocks >= w) && all_blocks_at.is_none() {
            all_blocks_at = Some(now - started);
        }
        match want_blocks {
            Some(want) if (exact || !need_exact) && connected && blocks >= want => {
                states = list.iter().filter(|r| r["state"] == "exact").count();
                break now;
            }
            None if connected && blocks > 0 && now - steady_since >= Duration::from_millis(500) => {
                states = list.iter().filter(|r| r["state"] == "exact").count();
                break steady_since;
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let join = joined_at - started;
    if let Some(at) = all_blocks_at {
        println!(
            "  {how}: every block known after {:.2} s, every replica exact after {:.2} s",
            at.as_secs_f64(),
            join.as_secs_f64()
        );
    }
    let (mut whole, mut short) = (0u64, 0u64);
    for r in 0..replicas as u64 {
        for i in 0..SAMPLE.min(prompts) {
            let p = i * prompts / SAMPLE.min(prompts);
            let body = serde_json::json!({
                "model": "m", "token_ids": prompt(r, p), "candidates": [format!("r{r}")],
            })
            .to_string();
            let v: serde_json::Value =
                serde_json::from_str(&http::call(&addr, "POST", "/score", &body)?)?;
            let matched = v["scores"][0]["matched_blocks"].as_u64().unwrap_or(0);
            if matched == u64::from(PROMPT_BLOCKS) {
                whole += 1;
            } else {
                short += 1;
            }
        }
    }
    let text = http::get(&addr, "/metrics")?;
    let rss_mb =
        kvevent_benches::procfs::status_kb(&format!("/proc/{pid}/status"), "VmHWM:") / 1024.0;
    drop(router);
    Ok(Joined {
        how,
        join,
        exact: states,
        recall: whole as f64 / (whole + short).max(1) as f64,
        scored_short: short,
        blocks: last,
        rss_mb,
        bytes_per_pair: sum(&text, "kvevent_index_bytes")
            / sum(&text, "kvevent_index_pairs").max(1.0),
    })
}

const USAGE: &str = "usage: fleet-join [SIDECARS BLOCKS [BUFFER [RATE]]]   (default 8 16384 1000 0)
A router joining a fleet late: SIDECARS engines with BLOCKS resident blocks each (replay
buffers of BUFFER batches, RATE new prompts a second each while the router joins), followed
through the sidecars' feeds, then through the engines directly. Needs the release sidecar and
router: cargo build --release -p kvevent-subscriber -p kvevent-examples --example router";

fn main() -> anyhow::Result<()> {
    let mut args = kvevent_benches::Cli::new(USAGE);
    let sidecars: usize = args.positional("SIDECARS", 8)?;
    let blocks: u64 = args.positional("BLOCKS", 16_384)?;
    let buffer: usize = args.positional("BUFFER", 1_000)?;
    let rate: u64 = args.positional("RATE", 0)?;
    args.done()?;
    let prompts = blocks / u64::from(PROMPT_BLOCKS);
    let sidecar_bin = release_bin("kvevent-subscriber")?;
    let router_bin = release_bin("router")?;
    let sink = kvevent_test_support::serve_on_thread(Sink, Arc::new(AtomicBool::new(false)))?;
    let ctx = zmq::Context::new();
    println!(
        "{sidecars} sidecars x {blocks} resident blocks ({prompts} prompts of {PROMPT_BLOCKS} blocks), engine replay buffers of {buffer} batches"
    );
    let mut fleet = Vec::with_capacity(sidecars);
    for r in 0..sidecars {
        let engine = Publisher::start(
            &ctx,
            PublisherConfig {
                buffer_steps: buffer,
                ..PublisherConfig::loopback(RELEASE)
            },
        )?;
        let mut child = Command::new(&sidecar_bin)
            .args([
                "--engine-endpoint",
                engine.endpoint(),
                "--replay-endpoint",
                engine.replay_endpoint().unwrap_or_default(),
                "--server",
                &sink.to_string(),
                "--replica-id",
                &format!("r{r}"),
                "--model-id",
                "m",
                "--stats-interval",
                "0s",
                // The stand-in engines serve no HTTP: no stats, and no server to health-check
                // (else every replica reads stale, `server_down`).
                "--engine-metrics-url",
                "",
                "--refresh-interval",
                "0s",
                "--feed-address",
                "127.0.0.1:0",
                "--metrics-address",
                "127.0.0.1:0",
                "--log-level",
                "info",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let (feed, metrics) = bound_addresses(&mut child)
            .with_context(|| format!("sidecar r{r} did not say where it listens"))?;
        fleet.push(Replica {
            engine,
            feed,
            metrics,
            _sidecar: Guard(child),
        });
    }
    let t = Instant::now();
    for (r, replica) in fleet.iter().enumerate() {
        if !replica
            .engine
            .wait_for_subscribers(1, Duration::from_secs(60))
        {
            bail!("sidecar r{r} did not subscribe within 60 s");
        }
        for p in 0..prompts {
            replica.engine.publish(&batch(r as u64, p))?;
            if p % 256 == 255 {
                // Within the sidecar's socket buffers.
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
    let resident = blocks * sidecars as u64;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let held: f64 = fleet
            .iter()
            .map(|r| {
                http::get(&r.metrics, "/metrics").map_or(0.0, |t| sum(&t, "kvevent_feed_blocks"))
            })
            .sum();
        if held as u64 >= resident {
            break;
        }
        if Instant::now() > deadline {
            bail!("the sidecars hold {held} of {resident} blocks after 600 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "  the engines stored {resident} blocks through the sidecars in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let via_feeds: Vec<String> = fleet
        .iter()
        .enumerate()
        .flat_map(|(r, x)| ["--sidecar".to_owned(), format!("r{r}=http://{}", x.feed)])
        .collect();
    let direct: Vec<String> = fleet
        .iter()
        .enumerate()
        .flat_map(|(r, x)| {
            [
                "--engine".to_owned(),
                format!(
                    "r{r}={},replay={}",
                    x.engine.endpoint(),
                    x.engine.replay_endpoint().unwrap_or_default()
                ),
            ]
        })
        .collect();
    // Under load: every engine stores new prompts while the routers join.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let results = std::thread::scope(|scope| {
        if rate > 0 {
            let (fleet, stop) = (&fleet, stop.clone());
            scope.spawn(move || {
                let started = Instant::now();
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let due = started + Duration::from_secs_f64(n as f64 / rate as f64);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    for (r, replica) in fleet.iter().enumerate() {
                        let _ = replica.engine.publish(&batch(r as u64, prompts + n));
                    }
                    n += 1;
                }
            });
        }
        let feeds = join(
            &router_bin,
            "sidecar feeds",
            &via_feeds,
            sidecars,
            prompts,
            Some(resident),
            true,
        );
        // Under load the blocks never stop growing: the replay buffers' share is the mark.
        let replayed = (rate > 0).then(|| {
            buffer.min(prompts as usize) as u64 * u64::from(PROMPT_BLOCKS) * sidecars as u64
        });
        let engines = join(
            &router_bin,
            "engines directly",
            &direct,
            sidecars,
            prompts,
            replayed,
            false,
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        [feeds, engines]
    });
    let results = results.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    if rate > 0 {
        println!(
            "  while the routers joined, every engine stored {rate} new prompts a second ({} blocks/s each)",
            rate * u64::from(PROMPT_BLOCKS)
        );
    }
    println!(
        "| router follows | join: start to all in | replicas exact | recall (prompts scored whole) | scored short | blocks known | peak RSS | index bytes a pair |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for j in &results {
        println!(
            "| {} | {:.2} s | {} of {sidecars} | {:.1} % | {} | {} of {resident} | {:.1} MB | {:.1} |",
            j.how,
            j.join.as_secs_f64(),
            j.exact,
            100.0 * j.recall,
            j.scored_short,
            j.blocks,
            j.rss_mb,
            j.bytes_per_pair,
        );
    }
    Ok(())
}
