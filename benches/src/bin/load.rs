//! Load benchmark: an engine stand-in at a set rate → a sidecar process → a counting gRPC sink.
//!
//! For each rate it runs the release `kvevent-subscriber` and the plain Python sidecar
//! (`benches/python_sidecar.py`: pyzmq, msgspec with vLLM's structs, grpcio) alternately, and
//! prints per run: loss, the sidecar's CPU (% of a core, CPU-seconds per million blocks) and
//! peak RSS from `/proc`, block→server latency p50/p99, and the CPU of the engine stand-in and
//! the sink (they share the machine with the sidecar).
//!
//! The engine stand-in speaks vLLM 0.33's wire (kvevent-wire's encoder, byte-exact with vLLM's
//! msgspec structs on every shared vector), one batch per 10 ms scheduler step, block size 16
//! with token ids, and a bounded resident set: once full, every stored block evicts the oldest
//! one (one `BlockRemoved` per block, as vLLM's GPU pool sends them), so removals ≈ stores.
//! Store-only runs have no bound. Block hashes encode their step, so the sink knows when each
//! block was published; removals are timed from the event's `timestamp_us`.
//!
//! Run with `bash benches/load.sh` (builds the release binaries, installs the Python peer's
//! packages into `.venv`), or `target/release/load --help`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use kvevent_proto as pb;
use kvevent_test_support::EngineSide;
use kvevent_wire as wire;
use kvevent_zmq::publisher::{Publisher, PublisherConfig};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

const STEP: Duration = Duration::from_millis(10);
const BLOCK_SIZE: u32 = 16;
const BLOCKS_PER_EVENT: usize = 8;
/// Low bits of a block hash: its index within the step.
const INDEX_BITS: u32 = 24;

#[derive(Debug, Clone)]
struct Args {
    rates: Vec<u64>,
    store_only: Vec<u64>,
    duration: Duration,
    warmup: Duration,
    repeat: usize,
    sidecars: Vec<String>,
    python: PathBuf,
    window: String,
    extra: Vec<String>,
    /// Blocks stored (and never evicted) before the run: a large resident set.
    prefill: u64,
}

fn usage() -> &'static str {
    "usage: load [--rates 1000,10000,25000] [--store-only 500000] [--duration 10] [--warmup 2]\n\
     \x20           [--repeat 1] [--sidecars rust,python] [--python .venv/bin/python] [--window 100ms]\n\
     \x20           [-- extra kvevent-subscriber flags]\n\
     sidecars: rust, python, or rust@PATH (another build of the sidecar, run side by side);\n\
     \x20         rust+N (or rust@PATH+N): with its router feed on and N routers following it\n\
     --prefill N: N blocks stored before the run and never evicted; feed followers then join\n\
     \x20           halfway through the run, so each is sent a snapshot of them under load\n\
     rates are stored blocks/s; steady-state runs remove as many (resident set = 1 s of stores)"
}

fn list(v: &str) -> anyhow::Result<Vec<u64>> {
    v.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            s.trim()
                .parse()
                .with_context(|| format!("bad number `{s}`"))
        })
        .collect()
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        rates: vec![1_000, 10_000, 25_000],
        store_only: vec![500_000],
        duration: Duration::from_secs(10),
        warmup: Duration::from_secs(2),
        repeat: 1,
        sidecars: vec!["rust".into(), "python".into()],
        python: PathBuf::from(".venv/bin/python"),
        window: "100ms".into(),
        extra: Vec::new(),
        prefill: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--" {
            a.extra = it.by_ref().collect();
            break;
        }
        if flag == "--help" || flag == "-h" {
            println!("{}", usage());
            std::process::exit(0);
        }
        let value = it
            .next()
            .with_context(|| format!("{flag} needs a value\n{}", usage()))?;
        let bad = || format!("{flag}: `{value}` is not valid\n{}", usage());
        match flag.as_str() {
            "--rates" => a.rates = list(&value).with_context(bad)?,
            "--store-only" => a.store_only = list(&value).with_context(bad)?,
            "--duration" => a.duration = Duration::from_secs_f64(value.parse().with_context(bad)?),
            "--warmup" => a.warmup = Duration::from_secs_f64(value.parse().with_context(bad)?),
            "--repeat" => a.repeat = value.parse().with_context(bad)?,
            "--sidecars" => a.sidecars = value.split(',').map(str::to_owned).collect(),
            "--python" => a.python = PathBuf::from(value),
            "--window" => a.window = value,
            "--prefill" => a.prefill = value.parse().with_context(bad)?,
            _ => bail!("unknown flag {flag}\n{}", usage()),
        }
    }
    Ok(a)
}

// ---------------------------------------------------------------------------------------------
// /proc readings

use kvevent_benches::procfs::cpu_seconds;

fn peak_rss_mb(pid: u32) -> f64 {
    kvevent_benches::procfs::status_kb(&format!("/proc/{pid}/status"), "VmHWM:") / 1024.0
}

/// CPU seconds of this process's threads whose name starts with one of `prefixes`.
fn own_threads_cpu(prefixes: &[&str]) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    dir.filter_map(Result::ok)
        .filter(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            prefixes.iter().any(|p| comm.starts_with(p))
        })
        .map(|t| cpu_seconds(&t.path().join("stat").to_string_lossy()))
        .sum()
}

fn unix_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

// ---------------------------------------------------------------------------------------------
// The sink

/// Bits set once per key: which blocks arrived.
struct Bitmap(Vec<u64>);

impl Bitmap {
    fn new(bits: usize) -> Self {
        Self(vec![0; bits.div_ceil(64)])
    }
    /// Sets bit `i`; true when it was not set yet.
    fn set(&mut self, i: usize) -> bool {
        let Some(w) = self.0.get_mut(i / 64) else {
            return false;
        };
        let fresh = *w & (1 << (i % 64)) == 0;
        *w |= 1 << (i % 64);
        fresh
    }
    fn count(&self) -> u64 {
        self.0.iter().map(|w| u64::from(w.count_ones())).sum()
    }
}

struct Received {
    adds: Bitmap,
    evicts: Bitmap,
    add_latency_us: Vec<u32>,
    evict_latency_us: Vec<u32>,
    add_entries: u64,
    evict_events: u64,
    clears: u64,
    foreign: u64,
}

#[derive(Clone)]
struct Sink {
    /// Unix µs at which each step was published (0 until it is).
    published: Arc<Vec<AtomicU64>>,
    per_step: usize,
    state: Arc<Mutex<Received>>,
    last_arrival: Arc<AtomicU64>,
}

impl Sink {
    fn new(steps: usize, per_step: usize) -> Self {
        Self {
            published: Arc::new((0..steps).map(|_| AtomicU64::new(0)).collect()),
            per_step,
            state: Arc::new(Mutex::new(Received {
                adds: Bitmap::new(steps * per_step),
                evicts: Bitmap::new(steps * per_step),
                add_latency_us: Vec::new(),
                evict_latency_us: Vec::new(),
                add_entries: 0,
                evict_events: 0,
                clears: 0,
                foreign: 0,
            })),
            last_arrival: Arc::new(AtomicU64::new(0)),
        }
    }

    fn slot(&self, key: &[u8]) -> Option<(usize, usize)> {
        let h = u64::from_be_bytes(key.try_into().ok()?);
        let step = (h >> INDEX_BITS) as usize;
        let index = (h & ((1 << INDEX_BITS) - 1)) as usize;
        (step < self.published.len() && index < self.per_step).then_some((step, index))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Received> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[tonic::async_trait]
impl EngineSide for Sink {
    async fn report(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        let mut stream = request.into_inner();
        while let Some(update) = stream.next().await {
            let update = update?;
            let now = unix_us() as u64;
            let mut r = self.lock();
            for p in &update.prefixes {
                r.add_entries += 1;
                let Some((step, index)) = self.slot(&p.prefix_hash) else {
                    r.foreign += 1;
                    continue;
                };
                if r.adds.set(step * self.per_step + index) {
                    let at = self.published[step].load(Relaxed);
                    r.add_latency_us
                        .push(now.saturating_sub(at).min(u64::from(u32::MAX)) as u32);
                }
            }
            self.last_arrival.store(now, Relaxed);
        }
        Ok(kvevent_test_support::accepted())
    }

    async fn publish(&self, request: Request<pb::CacheEvent>) -> Result<Response<pb::Ack>, Status> {
        let e = request.into_inner();
        let now = unix_us();
        let mut r = self.lock();
        if e.r#type == pb::cache_event::Type::AllCleared as i32 {
            r.clears += 1;
        } else {
            r.evict_events += 1;
            if let Some((step, index)) = self.slot(&e.prefix_hash) {
                if r.evicts.set(step * self.per_step + index) {
                    let lat = (now - e.timestamp_us).clamp(0, i64::from(u32::MAX));
                    r.evict_latency_us.push(lat as u32);
                }
            } else {
                r.foreign += 1;
            }
        }
        self.last_arrival.store(now as u64, Relaxed);
        Ok(kvevent_test_support::accepted())
    }
}

/// Serves `sink` on a loopback port until `stop`; returns the address.
fn serve(sink: Sink, stop: Arc<AtomicBool>) -> anyhow::Result<std::net::SocketAddr> {
    Ok(kvevent_test_support::serve_on_thread(sink, stop)?)
}

// ---------------------------------------------------------------------------------------------
// The engine stand-in

struct Workload {
    rate: u64,
    store_only: bool,
}

struct Published {
    stored: u64,
    removed: u64,
    late_steps: u64,
}

/// Publishes `steps` scheduler steps at the workload's rate; returns what was published.
fn run_engine(
    publisher: &Publisher,
    w: &Workload,
    sink: &Sink,
    first_step: usize,
    steps: usize,
    resident: &mut std::collections::VecDeque<u64>,
) -> Published {
    let capacity = if w.store_only {
        usize::MAX
    } else {
        (w.rate as usize).max(1_000)
    };
    let mut out = Published {
        stored: 0,
        removed: 0,
        late_steps: 0,
    };
    let per_step = w.rate as f64 * STEP.as_secs_f64();
    let mut carry = 0.0;
    let start = Instant::now();
    let mut token = 0u32;
    for s in 0..steps {
        let step = first_step + s;
        let due = start + STEP * s as u32;
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        } else if now - due > STEP {
            out.late_steps += 1;
        }
        carry += per_step;
        let n = carry as usize;
        carry -= n as f64;
        let mut events = Vec::new();
        let mut i = 0;
        let mut event_no = 0;
        let mut last: Option<u64> = None;
        while i < n {
            let k = BLOCKS_PER_EVENT.min(n - i);
            let hashes: Vec<u64> = (i..i + k)
                .map(|j| ((step as u64) << INDEX_BITS) | j as u64)
                .collect();
            let tokens: Vec<u32> = (0..k as u32 * BLOCK_SIZE)
                .map(|_| {
                    token = token.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    token % 128_000
                })
                .collect();
            // Every other request extends the previous one's prefix.
            let parent = if event_no % 2 == 1 { last } else { None };
            last = hashes.last().copied();
            events.push(wire::Event::BlockStored(wire::BlockStored {
                block_hashes: hashes
                    .iter()
                    .map(|h| wire::BlockHash::Int(wire::Int::U64(*h)))
                    .collect(),
                parent_block_hash: parent.map(|p| wire::BlockHash::Int(wire::Int::U64(p))),
                token_ids: wire::TokenIds::from(tokens),
                block_size: BLOCK_SIZE,
                medium: Some(wire::Medium("GPU".into())),
                ..Default::default()
            }));
            resident.extend(&hashes);
            i += k;
            event_no += 1;
        }
        out.stored += n as u64;
        while resident.len() > capacity {
            let Some(h) = resident.pop_front() else {
                break;
            };
            events.push(wire::Event::BlockRemoved(wire::BlockRemoved {
                block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(h))],
                medium: Some(wire::Medium("GPU".into())),
                ..Default::default()
            }));
            out.removed += 1;
        }
        let batch = wire::EventBatch {
            ts: unix_us() as f64 / 1e6,
            events,
            data_parallel_rank: Some(0),
            unknown_events: 0,
        };
        let payload = wire::encode(&batch, wire::Release::new(0, 33, 0)).expect("encodable");
        sink.published[step].store(unix_us() as u64, Relaxed);
        publisher.publish_payload(payload);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// One run

struct Outcome {
    stored: u64,
    removed: u64,
    lost_adds: u64,
    lost_evicts: u64,
    cpu_pct: f64,
    cpu_s_per_m: f64,
    rss_mb: f64,
    add_p50: f64,
    add_p99: f64,
    evict_p50: f64,
    evict_p99: f64,
    engine_pct: f64,
    sink_pct: f64,
    late_steps: u64,
}

fn percentile(v: &mut [u32], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable();
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    f64::from(v[i]) / 1000.0
}

/// `rust+N`: the sidecar `rust` with its feed on and N followers (`rust+0`: on, none).
fn split_followers(kind: &str) -> anyhow::Result<(&str, Option<usize>)> {
    match kind.rsplit_once('+') {
        Some((base, n)) if base.starts_with("rust") => Ok((
            base,
            Some(
                n.parse()
                    .with_context(|| format!("`{kind}`: rust+N takes a number of followers"))?,
            ),
        )),
        _ => Ok((kind, None)),
    }
}

/// Follows the sidecar's feed at `url` with `n` streams from a thread of their own, reading
/// and dropping every message, until `stop`: (messages read, streams that ended early).
fn follow_feed(
    url: String,
    n: usize,
    join_after: Duration,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, u64)> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("followers' runtime");
        rt.block_on(async move {
            let read = Arc::new(AtomicU64::new(0));
            let ended = Arc::new(AtomicU64::new(0));
            let mut tasks = Vec::new();
            for _ in 0..n {
                let (url, stop, read, ended) =
                    (url.clone(), stop.clone(), read.clone(), ended.clone());
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep(join_after).await;
                    let asked = Instant::now();
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let mut client = loop {
                        let endpoint =
                            tonic::transport::Endpoint::from_shared(url.clone()).expect("url");
                        match endpoint.connect().await {
                            Ok(c) => {
                                break kvevent_feed::pb::feed_client::FeedClient::new(c)
                                    .max_decoding_message_size(64 << 20);
                            }
                            Err(_) if Instant::now() < deadline => {
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            Err(e) => panic!("the feed at {url}: {e}"),
                        }
                    };
                    let mut stream = client
                        .follow(kvevent_feed::pb::FollowRequest::default())
                        .await
                        .expect("follow")
                        .into_inner();
                    while !stop.load(Relaxed) {
                        match tokio::time::timeout(Duration::from_millis(200), stream.message())
                            .await
                        {
                            Ok(Ok(Some(m))) => {
                                read.fetch_add(1, Relaxed);
                                if let Some(kvevent_feed::pb::feed_message::Body::SnapshotEnd(end)) = m.body
                                    && end.blocks > 1_000
                                {
                                    eprintln!(
                                        "  a follower had its snapshot of {} blocks {} ms after asking",
                                        end.blocks,
                                        asked.elapsed().as_millis()
                                    );
                                }
                            }
                            Ok(Ok(None) | Err(_)) => {
                                ended.fetch_add(1, Relaxed);
                                return;
                            }
                            Err(_) => {}
                        }
                    }
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
            (read.load(Relaxed), ended.load(Relaxed))
        })
    })
}

/// Stores `n` blocks (hashes the sink takes for foreign) as fast as the sidecar takes them,
/// and waits until it has reported them all.
fn prefill(publisher: &Publisher, sink: &Sink, n: u64) -> anyhow::Result<()> {
    const PER_BATCH: u64 = 512;
    let started = Instant::now();
    let mut token = 7u32;
    for first in (0..n).step_by(PER_BATCH as usize) {
        let k = PER_BATCH.min(n - first);
        let tokens: Vec<u32> = (0..k as u32 * BLOCK_SIZE)
            .map(|_| {
                token = token.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                token % 128_000
            })
            .collect();
        let batch = wire::EventBatch::new(
            unix_us() as f64 / 1e6,
            vec![wire::Event::BlockStored(wire::BlockStored {
                block_hashes: (first..first + k)
                    .map(|i| wire::BlockHash::Int(wire::Int::U64((1 << 63) | i)))
                    .collect(),
                token_ids: wire::TokenIds::from(tokens),
                block_size: BLOCK_SIZE,
                medium: Some(wire::Medium("GPU".into())),
                ..Default::default()
            })],
        );
        publisher.publish(&batch)?;
        std::thread::sleep(Duration::from_millis(1));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while sink.lock().foreign < n {
        if Instant::now() > deadline {
            bail!(
                "the sidecar reported {} of {n} prefilled blocks in 60 s",
                sink.lock().foreign
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "  prefilled {n} blocks in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn sidecar_command(
    args: &Args,
    kind: &str,
    engine: &str,
    replay: &str,
    server: std::net::SocketAddr,
    feed: Option<&str>,
) -> anyhow::Result<Command> {
    let mut c = match kind {
        _ if kind == "rust" || kind.starts_with("rust@") => {
            // `rust@PATH` runs another build of the sidecar (the code before a change, say).
            let bin = match kind.strip_prefix("rust@") {
                Some(path) => PathBuf::from(path),
                None => std::env::current_exe()?
                    .parent()
                    .context("exe dir")?
                    .join("kvevent-subscriber"),
            };
            if !bin.exists() {
                bail!(
                    "{} not found: cargo build --release -p kvevent-subscriber",
                    bin.display()
                );
            }
            let mut c = Command::new(bin);
            c.args([
                "--engine-endpoint",
                engine,
                "--replay-endpoint",
                replay,
                "--server",
                &server.to_string(),
                "--replica-id",
                "bench",
                "--model-id",
                "bench-model",
                "--key-mode",
                "engine",
                "--window",
                &args.window,
                "--stats-interval",
                "0s",
                // The stand-in engines serve no HTTP: no stats, and no server to health-check
                // (else every replica reads stale, `server_down`).
                "--engine-metrics-url",
                "",
                "--metrics-address=127.0.0.1:0",
                "--log-level",
                "warn",
            ]);
            if let Some(feed) = feed {
                c.args(["--feed-address", feed]);
            }
            c.args(&args.extra);
            c
        }
        "python" => {
            let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python_sidecar.py");
            let mut c = Command::new(&args.python);
            c.arg(script).args([
                "--endpoint",
                engine,
                "--server",
                &server.to_string(),
                "--window",
                &args.window,
            ]);
            c
        }
        other => bail!("unknown sidecar `{other}` (rust, python)"),
    };
    c.stdin(Stdio::null()).stdout(Stdio::null());
    Ok(c)
}

fn stop_child(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn run_once(args: &Args, kind: &str, w: &Workload) -> anyhow::Result<Outcome> {
    let warm_steps = (args.warmup.as_secs_f64() / STEP.as_secs_f64()) as usize;
    let steps = (args.duration.as_secs_f64() / STEP.as_secs_f64()) as usize;
    let per_step = (w.rate as f64 * STEP.as_secs_f64()).ceil() as usize + 1;
    let sink = Sink::new(warm_steps + steps + 1, per_step);
    let stop = Arc::new(AtomicBool::new(false));
    let server = serve(sink.clone(), stop.clone())?;
    let ctx = zmq::Context::new();
    let publisher = Publisher::start(
        &ctx,
        PublisherConfig {
            buffer_steps: 200,
            ..PublisherConfig::loopback(wire::Release::new(0, 33, 0))
        },
    )?;
    let replay = publisher.replay_endpoint().unwrap_or_default().to_owned();
    let (base, followers) = split_followers(kind)?;
    // The feed's port, held until the run ends (the sidecar binds it over the hold).
    let feed_port = followers.map(|_| kvevent_test_support::HeldPort::new());
    let feed = feed_port.as_ref().map(|p| p.addr().to_string());
    let mut child = sidecar_command(
        args,
        base,
        publisher.endpoint(),
        &replay,
        server,
        feed.as_deref(),
    )?
    .spawn()
    .with_context(|| format!("start the {kind} sidecar"))?;
    let pid = child.id();
    if !publisher.wait_for_subscribers(1, Duration::from_secs(20)) {
        let _ = child.kill();
        bail!("the {kind} sidecar never subscribed");
    }
    // Let the startup replay and the first RPC settle before the clock starts.
    std::thread::sleep(Duration::from_millis(500));
    if args.prefill > 0 {
        prefill(&publisher, &sink, args.prefill)?;
    }
    let stop_followers = Arc::new(AtomicBool::new(false));
    // With a prefill, the followers join halfway through the run: a snapshot under load.
    let join_after = if args.prefill > 0 {
        args.warmup + args.duration / 2
    } else {
        Duration::ZERO
    };
    let following = feed.as_ref().map(|f| {
        follow_feed(
            format!("http://{f}"),
            followers.unwrap_or(0),
            join_after,
            stop_followers.clone(),
        )
    });
    let mut resident = std::collections::VecDeque::new();
    let warm = run_engine(&publisher, w, &sink, 0, warm_steps, &mut resident);
    let cpu0 = cpu_seconds(&format!("/proc/{pid}/stat"));
    let own0 = (
        own_threads_cpu(&["kvevent-fake"]),
        own_threads_cpu(&["sink"]),
    );
    let started = Instant::now();
    let main = run_engine(&publisher, w, &sink, warm_steps, steps, &mut resident);
    let elapsed = started.elapsed().as_secs_f64();
    // Drain: until nothing arrived for 1 s (at most 20 s).
    let drain_deadline = Instant::now() + Duration::from_secs(20);
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let last = sink.last_arrival.load(Relaxed) as i64;
        if unix_us() - last > 1_000_000 || Instant::now() > drain_deadline {
            break;
        }
    }
    // CPU % over the time the sidecar had work: publishing, then its drain (the last second
    // of the drain is the silence that ends it).
    let busy = (started.elapsed().as_secs_f64() - 1.0).max(elapsed);
    let cpu1 = cpu_seconds(&format!("/proc/{pid}/stat"));
    let own1 = (
        own_threads_cpu(&["kvevent-fake"]),
        own_threads_cpu(&["sink"]),
    );
    let rss = peak_rss_mb(pid);
    if let Ok(Some(status)) = child.try_wait() {
        bail!("the {kind} sidecar exited early: {status}");
    }
    stop_followers.store(true, Relaxed);
    if let Some(f) = following {
        let (read, ended) = f.join().unwrap_or_default();
        if ended > 0 {
            eprintln!(
                "  {kind}: {ended} of {} feed streams ended early ({read} messages read)",
                followers.unwrap_or(0)
            );
        }
    }
    stop_child(child);
    publisher.shutdown();
    stop.store(true, Relaxed);

    let mut r = sink.lock();
    let stored = warm.stored + main.stored;
    let removed = warm.removed + main.removed;
    let blocks = (main.stored + main.removed).max(1) as f64;
    let cpu = cpu1 - cpu0;
    let mut add_lat = std::mem::take(&mut r.add_latency_us);
    let mut evict_lat = std::mem::take(&mut r.evict_latency_us);
    Ok(Outcome {
        stored,
        removed,
        lost_adds: stored.saturating_sub(r.adds.count()),
        lost_evicts: removed.saturating_sub(r.evicts.count()),
        cpu_pct: 100.0 * cpu / busy,
        cpu_s_per_m: cpu / blocks * 1e6,
        rss_mb: rss,
        add_p50: percentile(&mut add_lat, 0.5),
        add_p99: percentile(&mut add_lat, 0.99),
        evict_p50: percentile(&mut evict_lat, 0.5),
        evict_p99: percentile(&mut evict_lat, 0.99),
        engine_pct: 100.0 * (own1.0 - own0.0) / busy,
        sink_pct: 100.0 * (own1.1 - own0.1) / busy,
        late_steps: main.late_steps + warm.late_steps,
    })
}

fn median(v: &mut [f64]) -> f64 {
    let v: &mut Vec<f64> = &mut v.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let mut workloads: Vec<Workload> = args
        .rates
        .iter()
        .map(|&rate| Workload {
            rate,
            store_only: false,
        })
        .collect();
    workloads.extend(args.store_only.iter().map(|&rate| Workload {
        rate,
        store_only: true,
    }));
    println!(
        "load: {} s per run after {} s warm-up, window {}, {} repeat(s), sidecars {}",
        args.duration.as_secs_f64(),
        args.warmup.as_secs_f64(),
        args.window,
        args.repeat,
        args.sidecars.join(",")
    );
    let mut table: BTreeMap<(usize, usize), Vec<Outcome>> = BTreeMap::new();
    for (wi, w) in workloads.iter().enumerate() {
        for round in 0..args.repeat {
            for (si, kind) in args.sidecars.iter().enumerate() {
                match run_once(&args, kind, w) {
                    Ok(o) => {
                        eprintln!(
                            "  {} {}/s{} round {}: cpu {:.1}% lost {}+{} p99 {:.0} ms",
                            kind,
                            w.rate,
                            if w.store_only { " store-only" } else { "" },
                            round + 1,
                            o.cpu_pct,
                            o.lost_adds,
                            o.lost_evicts,
                            o.add_p99
                        );
                        table.entry((wi, si)).or_default().push(o);
                    }
                    Err(e) => eprintln!("  {kind} {}/s: failed: {e:#}", w.rate),
                }
            }
        }
    }
    println!(
        "\n| workload (blocks/s) | sidecar | lost adds | lost evictions | CPU % of a core | CPU-s per M blocks | peak RSS MB | add p50 / p99 ms | eviction p50 / p99 ms | engine + sink CPU % |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for ((wi, si), runs) in &mut table {
        let w = &workloads[*wi];
        let name = if w.store_only {
            format!("store only {}", w.rate)
        } else {
            format!("{} + {}", w.rate, w.rate)
        };
        let m = |f: &dyn Fn(&Outcome) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
        let stored = m(&|o| o.stored as f64);
        let removed = m(&|o| o.removed as f64);
        println!(
            "| {} | {} | {:.0} of {:.0} | {:.0} of {:.0} | {:.1} | {:.2} | {:.1} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} + {:.0} |",
            name,
            args.sidecars[*si],
            m(&|o| o.lost_adds as f64),
            stored,
            m(&|o| o.lost_evicts as f64),
            removed,
            m(&|o| o.cpu_pct),
            m(&|o| o.cpu_s_per_m),
            m(&|o| o.rss_mb),
            m(&|o| o.add_p50),
            m(&|o| o.add_p99),
            m(&|o| o.evict_p50),
            m(&|o| o.evict_p99),
            m(&|o| o.engine_pct),
            m(&|o| o.sink_pct),
        );
        let late = m(&|o| o.late_steps as f64);
        if late > 0.0 {
            println!(
                "|  | ({late:.0} engine steps published late: the stand-in could not keep its own pace) |||||||||"
            );
        }
    }
    Ok(())
}
