//! What recordings cost (#43): `kvevents record` against an engine stand-in publishing at a
//! set rate (what it kept, what it missed, its CPU and memory, bytes a batch beyond the
//! payloads), then `kvevents stats` over a recording of that many blocks (blocks a second).
//!
//! `cargo build --release -p kvevents -p kvevent-benches --bin recording`
//! `target/release/recording [RATE [SECONDS]]` (default 500000 blocks/s for 10 s;
//! `KVEVENTS=path` for another build of the tool).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvevent_wire as wire;
use kvevent_zmq::publisher::{Publisher, PublisherConfig};

const USAGE: &str = "usage: recording [RATE [SECONDS]]   (default 500000 10)
kvevents record against an engine stand-in storing RATE blocks a second (one batch per 10 ms
step, 8 blocks an event, 16 tokens a block) for SECONDS, then kvevents stats over what it wrote.";

/// Step `step`'s batch: `blocks` new blocks of 16 tokens, 8 an event, each event a new prompt.
fn batch(step: u64, blocks: u64) -> Vec<u8> {
    let events = (0..blocks.div_ceil(8))
        .map(|e| {
            let first = (step * blocks + e * 8) * 16;
            let n = (blocks - e * 8).min(8);
            wire::Event::BlockStored(wire::BlockStored {
                block_hashes: (0..n)
                    .map(|b| wire::BlockHash::Int(wire::Int::U64(step * blocks + e * 8 + b + 1)))
                    .collect(),
                token_ids: (first..first + n * 16)
                    .map(|t| (t % 50_000) as u32)
                    .collect::<Vec<_>>()
                    .into(),
                block_size: 16,
                ..Default::default()
            })
        })
        .collect();
    wire::encode(
        &wire::EventBatch {
            ts: 1.7e9 + step as f64 * 0.01,
            events,
            data_parallel_rank: Some(0),
            unknown_events: 0,
        },
        wire::Release::NEWEST_KNOWN,
    )
    .expect("encode")
}

fn main() -> anyhow::Result<()> {
    let mut args = kvevent_benches::Cli::new(USAGE);
    let rate: u64 = args.positional("RATE", 500_000)?;
    let seconds: u64 = args.positional("SECONDS", 10)?;
    args.done()?;
    let kvevents = std::env::var("KVEVENTS").unwrap_or_else(|_| "target/release/kvevents".into());
    let dir = std::env::temp_dir().join(format!("kvevent-recording-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("engine.kvrec");
    let ctx = zmq::Context::new();
    let engine = Publisher::start(&ctx, PublisherConfig::loopback(wire::Release::NEWEST_KNOWN))?;
    let mut recorder = Command::new(&kvevents)
        .args(["record", "--endpoint", engine.endpoint(), "-o"])
        .arg(&path)
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot run {kvevents}"))?;
    anyhow::ensure!(
        engine.wait_for_subscribers(1, Duration::from_secs(30)),
        "the recorder never subscribed"
    );
    let per_step = rate / 100;
    let steps = seconds * 100;
    // The payloads are made before the clock starts: the stand-in must not be what limits.
    let payloads: Vec<Vec<u8>> = (0..steps).map(|s| batch(s, per_step)).collect();
    let payload_bytes: u64 = payloads.iter().map(|p| p.len() as u64).sum();
    let stat = format!("/proc/{}/stat", recorder.id());
    let status = format!("/proc/{}/status", recorder.id());
    let cpu0 = kvevent_benches::procfs::cpu_seconds(&stat);
    let start = Instant::now();
    for (step, payload) in payloads.into_iter().enumerate() {
        let due = Duration::from_millis(step as u64 * 10);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        engine.publish_payload(payload);
    }
    let published_in = start.elapsed().as_secs_f64();
    // Until the file stops growing: the recorder has written what it received.
    let mut size = 0;
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = std::fs::metadata(&path).map_or(0, |m| m.len());
        if now == size {
            break;
        }
        size = now;
    }
    let cpu = kvevent_benches::procfs::cpu_seconds(&stat) - cpu0;
    let rss = kvevent_benches::procfs::status_kb(&status, "VmHWM:") / 1024.0;
    let _ = Command::new("kill")
        .args(["-TERM", &recorder.id().to_string()])
        .status();
    recorder.wait()?;
    let bytes = std::fs::read(&path)?;
    let (_, records, cut) = kvevent_recording::read_all(&bytes)?;
    let kept = records.len() as u64;
    let missing = steps - kept;
    let header = kvevent_recording::Reader::new(&bytes[..])?.offset();
    let overhead =
        (bytes.len() as u64 - header - payload_bytes * kept / steps) as f64 / kept.max(1) as f64;
    println!(
        "record at {rate} blocks/s for {seconds} s ({published_in:.1} s to publish): {kept} of {steps} batches kept ({missing} missed{}), recorder CPU {:.1} % of a core, peak RSS {rss:.1} MB, {overhead:.1} bytes a batch beyond its payload, {:.1} MB/s written",
        if cut.is_some() { ", file cut" } else { "" },
        100.0 * cpu / published_in,
        bytes.len() as f64 / published_in / 1e6
    );
    // stats over it: blocks stored (no evictions here) through the mapper.
    let started = Instant::now();
    let out = Command::new(&kvevents)
        .args(["stats", "--json"])
        .arg(&path)
        .output()?;
    let took = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        out.status.success(),
        "stats failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let blocks = kept * per_step;
    println!(
        "stats over {blocks} blocks: {took:.2} s, {:.2} M blocks a second (the process, start to end)",
        blocks as f64 / took / 1e6
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
