//! A router following a busy fleet: N engine stand-ins in this process (vLLM 0.33's wire, a
//! batch per 10 ms step, block size 16, token ids; once each engine's resident set of 1 s of
//! stores is full every stored block evicts its oldest) publish R blocks/s each into the
//! release example router (`target/release/examples/router`, a process of its own). Prints the
//! router's CPU (utime + stime from `/proc`) and peak RSS, and what it applied against what was
//! published (from its `/metrics`): block events lost, batches lost, degraded sources.
//!
//! ```text
//! cargo build --release -p kvevent-examples --example router
//! cargo run --release -p kvevent-benches --bin fleet-load [-- ENGINES RATE SECONDS]   # 256 1000 10
//! ```
//!
//! `ROUTER_BIN` names another router binary. The engines have no replay endpoint: a lost
//! batch shows as a reset (a replica not exact), not a repair.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::bail;
use kvevent_benches::http::{self, Guard, sum};
use kvevent_wire as wire;

const STEP: Duration = Duration::from_millis(10);
const BLOCK_SIZE: u32 = 16;
const RELEASE: wire::Release = wire::Release::new(0, 33, 0);

/// One engine: an XPUB socket sending vLLM's live frames (no replay endpoint: a lost batch
/// shows as a reset of its source), and its stream: stores `per_step` blocks a step in requests that extend their
/// predecessor's prefix every other time, and evicts the oldest past `capacity`.
struct Engine {
    socket: zmq::Socket,
    endpoint: String,
    seq: u64,
    resident: std::collections::VecDeque<u64>,
    next_hash: u64,
    token: u32,
    carry: f64,
}

impl Engine {
    fn step(&mut self, per_step: f64, capacity: usize, counts: &Counts) {
        self.carry += per_step;
        let n = self.carry as usize;
        self.carry -= n as f64;
        let mut events = Vec::new();
        let mut last: Option<u64> = None;
        let mut i = 0;
        let mut request = 0;
        while i < n {
            let k = 8.min(n - i);
            let hashes: Vec<u64> = (0..k)
                .map(|_| {
                    self.next_hash += 1;
                    self.next_hash
                })
                .collect();
            let tokens: Vec<u32> = (0..k as u32 * BLOCK_SIZE)
                .map(|_| {
                    self.token = self.token.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    self.token % 128_000
                })
                .collect();
            let parent = if request % 2 == 1 { last } else { None };
            last = hashes.last().copied();
            self.resident.extend(&hashes);
            events.push(wire::Event::BlockStored(wire::BlockStored {
                block_hashes: hashes
                    .into_iter()
                    .map(|h| wire::BlockHash::Int(wire::Int::U64(h)))
                    .collect(),
                parent_block_hash: parent.map(|p| wire::BlockHash::Int(wire::Int::U64(p))),
                token_ids: wire::TokenIds::from(tokens),
                block_size: BLOCK_SIZE,
                medium: Some(wire::Medium("GPU".into())),
                ..Default::default()
            }));
            i += k;
            request += 1;
        }
        let mut removed = 0;
        while self.resident.len() > capacity {
            let Some(h) = self.resident.pop_front() else {
                break;
            };
            events.push(wire::Event::BlockRemoved(wire::BlockRemoved {
                block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(h))],
                medium: Some(wire::Medium("GPU".into())),
                ..Default::default()
            }));
            removed += 1;
        }
        let batch = wire::EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
            unknown_events: 0,
        };
        let payload = wire::encode(&batch, RELEASE).expect("encodable");
        let frames = wire::frames::live_frames(b"kv-events", self.seq, &payload);
        self.seq += 1;
        if self.socket.send_multipart(frames, 0).is_err() {
            counts.send_errors.fetch_add(1, Relaxed);
        }
        counts.stored.fetch_add(n as u64, Relaxed);
        counts.removed.fetch_add(removed, Relaxed);
        counts.batches.fetch_add(1, Relaxed);
    }
}

#[derive(Default)]
struct Counts {
    stored: AtomicU64,
    removed: AtomicU64,
    batches: AtomicU64,
    late_steps: AtomicU64,
    send_errors: AtomicU64,
}

/// The router's `/metrics`.
fn metrics(addr: &str) -> anyhow::Result<String> {
    Ok(http::get(addr, "/metrics")?)
}

const USAGE: &str = "usage: fleet-load [ENGINES [RATE [SECONDS]]]   (default 256 1000 10)
ENGINES engine stand-ins, each storing RATE blocks/s (and evicting as many) for SECONDS, into
the release example router (ROUTER_BIN, default target/release/examples/router): its CPU, RSS,
what it applied and lost.";

fn main() -> anyhow::Result<()> {
    let mut args = kvevent_benches::Cli::new(USAGE);
    let engines: usize = args.positional("ENGINES", 256)?;
    let rate: f64 = args.positional("RATE", 1000.0)?;
    let secs: f64 = args.positional("SECONDS", 10.0)?;
    args.done()?;
    let router_bin =
        std::env::var("ROUTER_BIN").unwrap_or_else(|_| "target/release/examples/router".to_owned());
    if !std::path::Path::new(&router_bin).exists() {
        bail!("{router_bin} not found: cargo build --release -p kvevent-examples --example router");
    }
    let ctx = zmq::Context::new();
    let mut fleet = Vec::with_capacity(engines);
    for _ in 0..engines {
        let socket = ctx.socket(zmq::XPUB)?;
        socket.set_sndhwm(1_000_000)?;
        socket.set_linger(0)?;
        socket.bind("tcp://127.0.0.1:*")?;
        let endpoint = socket
            .get_last_endpoint()?
            .map_err(|_| anyhow::anyhow!("endpoint is not UTF-8"))?;
        fleet.push(Engine {
            socket,
            endpoint,
            seq: 0,
            resident: Default::default(),
            next_hash: 0,
            token: fleet.len() as u32,
            carry: 0.0,
        });
    }
    // The router's port, held until the run ends (the router binds it over the hold).
    let port = kvevent_test_support::HeldPort::new();
    let addr = port.addr().to_string();
    let mut cmd = Command::new(&router_bin);
    cmd.args(["--listen", &addr, "--model", "m", "--block-size", "16"]);
    for (i, e) in fleet.iter().enumerate() {
        cmd.arg("--engine").arg(format!("e{i}={}", e.endpoint));
    }
    let router = Guard(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?);
    let pid = router.0.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    for e in &fleet {
        // The XPUB hands out the router's subscription message.
        let left = deadline.saturating_duration_since(Instant::now());
        let mut item = [e.socket.as_poll_item(zmq::POLLIN)];
        if zmq::poll(&mut item, left.as_millis() as i64)? == 0 {
            bail!("the router did not subscribe to every engine within 60 s");
        }
        e.socket.recv_bytes(0)?;
    }
    while metrics(&addr).is_err() {
        if Instant::now() > deadline {
            bail!("the router's /metrics did not answer");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let stat = format!("/proc/{pid}/stat");
    let status = format!("/proc/{pid}/status");
    let counts = Arc::new(Counts::default());
    let per_step = rate * STEP.as_secs_f64();
    let capacity = rate as usize;
    let steps = (secs / STEP.as_secs_f64()) as usize;
    // Two publishing threads, half the fleet each.
    let half = fleet.len().div_ceil(2);
    let cpu0 = kvevent_benches::procfs::cpu_seconds(&stat);
    let own0 = kvevent_benches::procfs::cpu_seconds("/proc/self/stat");
    let started = Instant::now();
    std::thread::scope(|scope| {
        for part in fleet.chunks_mut(half) {
            let counts = counts.clone();
            scope.spawn(move || {
                for s in 0..steps {
                    let due = started + STEP * s as u32;
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    } else if now - due > STEP {
                        counts.late_steps.fetch_add(1, Relaxed);
                    }
                    for e in part.iter_mut() {
                        e.step(per_step, capacity, &counts);
                    }
                }
            });
        }
    });
    let published_in = started.elapsed();
    // Let the router finish what is in flight, then read what it applied.
    let expected = counts.stored.load(Relaxed) + counts.removed.load(Relaxed);
    let batches = counts.batches.load(Relaxed);
    let settle = Instant::now() + Duration::from_secs(30);
    let text = loop {
        let text = metrics(&addr)?;
        let done = sum(&text, "kvevent_index_applied_total") as u64 >= expected
            && sum(&text, "kvevent_batches_received_total") as u64 >= batches;
        if done || Instant::now() > settle {
            break text;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let drained_in = started.elapsed();
    let cpu = kvevent_benches::procfs::cpu_seconds(&stat) - cpu0;
    let own = kvevent_benches::procfs::cpu_seconds("/proc/self/stat") - own0;
    let applied = sum(&text, "kvevent_index_applied_total") as u64;
    let received = sum(&text, "kvevent_batches_received_total") as u64;
    let degraded = (engines as u64).saturating_sub(sum(&text, "kvevent_replica_exact") as u64);
    let rss = kvevent_benches::procfs::status_kb(&status, "VmHWM:") / 1024.0;
    println!(
        "{engines} engines x {rate} blocks/s stored (+ as many evicted) for {:.1} s, router pid {pid}:",
        published_in.as_secs_f64()
    );
    println!(
        "  published {} block events in {batches} batches ({} late steps, {} send errors)",
        expected,
        counts.late_steps.load(Relaxed),
        counts.send_errors.load(Relaxed)
    );
    println!(
        "  router applied {applied} block events ({} lost), received {received} batches ({} lost), {degraded} replicas not exact",
        expected.saturating_sub(applied),
        batches.saturating_sub(received)
    );
    println!(
        "  router CPU {:.1} % of a core ({:.2} CPU-s per M block events), peak RSS {rss:.1} MB, caught up {:.1} s after the last step; publishers {:.1} % of a core",
        100.0 * cpu / drained_in.as_secs_f64(),
        cpu / (expected.max(1) as f64 / 1e6),
        (drained_in - published_in).as_secs_f64(),
        100.0 * own / published_in.as_secs_f64(),
    );
    Ok(())
}
