//! Soak and chaos, bounded in time: the real binary against a server that hangs, an engine
//! killed and restarted on its ports, a server that restarts. `KVEVENT_SOAK_SECONDS` lengthens
//! the hang (default 20 s in CI; minutes here).

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvevent_proto as pb;
use kvevent_test_support::{
    HeldPort, Publisher, PublisherConfig, Received, RecordingServer, eventually, when,
};
use kvevent_wire::{self as wire, Release};

const BIN: &str = env!("CARGO_BIN_EXE_kvevent-subscriber");
const WAIT: Duration = Duration::from_secs(30);

/// The sidecar as a child process; killed when dropped.
struct Sidecar {
    child: Child,
    metrics_port: u16,
}

impl Sidecar {
    fn start(engine: &str, replay: &str, server: &RecordingServer, extra: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args([
                &format!("--engine-endpoint={engine}"),
                &format!("--replay-endpoint={replay}"),
                &format!("--server=http://{}", server.addr()),
                "--replica-id=soak",
                "--model-id=llama",
                "--key-mode=engine",
                "--stats-interval=0",
                // The sidecar's info lines name the port /metrics took.
                "--log-level=warn,kvevent_sidecar=info",
                "--metrics-address=127.0.0.1:0",
            ])
            .args(extra)
            .env_remove("KVEVENT_REPLICA_ID")
            .env_remove("KVEVENT_MODEL_ID")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the sidecar");
        // Its log goes on to ours; the line naming /metrics' address gives the port.
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let pipe = child.stderr.take().expect("stderr piped");
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                eprintln!("{line}");
                if line.contains("serving /metrics")
                    && let Some(at) = line.find("127.0.0.1:")
                {
                    let digits: String = line[at + "127.0.0.1:".len()..]
                        .chars()
                        .take_while(char::is_ascii_digit)
                        .collect();
                    let _ = port_tx.send(digits.parse::<u16>().expect("a port"));
                }
            }
        });
        let metrics_port = port_rx
            .recv_timeout(WAIT)
            .expect("the sidecar said where /metrics is");
        Self {
            child,
            metrics_port,
        }
    }

    fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    /// Sum of every sample of `name` whose labels contain `filter`.
    async fn metric(&self, name: &str, filter: &str) -> f64 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", self.metrics_port)).await
        else {
            return f64::NAN;
        };
        let _ = stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await;
        let mut text = String::new();
        let _ = stream.read_to_string(&mut text).await;
        text.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with([' ', '{']) && rest.contains(filter))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn soak_seconds() -> u64 {
    std::env::var("KVEVENT_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20)
}

/// A batch storing blocks `from..from + n` (fresh hashes, no parents: each a prefix).
fn stores(from: u64, n: u64) -> wire::EventBatch<'static> {
    wire::EventBatch {
        ts: 1_700_000_000.0,
        events: vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: (from..from + n)
                .map(|h| wire::BlockHash::Int(wire::Int::U64(h)))
                .collect(),
            token_ids: (0..(n * 16) as u32).collect::<Vec<_>>().into(),
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        })],
        data_parallel_rank: Some(0),
        unknown_events: 0,
    }
}

/// The prefixes a server holds after applying what it received, in order.
fn applied(received: &[Received]) -> BTreeSet<Vec<u8>> {
    let mut held = BTreeSet::new();
    for r in received {
        match r {
            Received::Update(u) => held.extend(u.prefixes.iter().map(|p| p.prefix_hash.clone())),
            Received::Event(e) if e.r#type == pb::cache_event::Type::AllCleared as i32 => {
                held.clear()
            }
            Received::Event(e) => {
                held.remove(&e.prefix_hash);
            }
        }
    }
    held
}

/// Heap a pending prefix entry may cost the sidecar, as documented in the README
/// (`--max-pending`): the entry, its key and adapter, and the forwarder's index of it.
const BYTES_PER_PENDING: u64 = 512;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_server_keeps_memory_within_the_pending_bound_and_every_block_is_sent_or_counted() {
    let max_pending: u64 = std::env::var("KVEVENT_SOAK_MAX_PENDING")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let rate = 5_000u64; // blocks a second
    let seconds = soak_seconds();
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let sidecar = Sidecar::start(
        engine.endpoint(),
        engine.replay_endpoint().expect("replay"),
        &server,
        &[
            &format!("--max-pending={max_pending}"),
            "--rpc-timeout=1s",
            "--max-backoff=1s",
            "--window=100ms",
        ],
    );
    assert!(tokio::task::block_in_place(
        || engine.wait_for_subscribers(1, WAIT)
    ));
    // Warm up with the server answering, then measure from there.
    let mut next = 1u64;
    engine.publish(&stores(next, 500)).expect("publish");
    next += 500;
    server.wait_for(WAIT, |r| applied(r).len() >= 500).await;
    let baseline = sidecar.rss_bytes();
    server.set_behaviour(kvevent_test_support::Behaviour::Hang);
    let start = Instant::now();
    let per_tick = rate / 100; // every 10 ms
    let mut peak = baseline;
    let mut tick = 0u64;
    while start.elapsed() < Duration::from_secs(seconds) {
        engine.publish(&stores(next, per_tick)).expect("publish");
        next += per_tick;
        tick += 1;
        if tick.is_multiple_of(50) {
            peak = peak.max(sidecar.rss_bytes());
        }
        let due = start + Duration::from_millis(tick * 10);
        tokio::time::sleep(due.saturating_duration_since(Instant::now())).await;
    }
    let published = next - 1;
    // The mapper tracks every stored block (31–62 bytes each in its table).
    let bound = baseline + max_pending * BYTES_PER_PENDING + published * 64 + (16 << 20);
    eprintln!(
        "hang of {seconds}s at {rate} blocks/s, --max-pending {max_pending}: RSS {:.1} MB → peak {:.1} MB (bound {:.1} MB), {published} blocks",
        baseline as f64 / 1e6,
        peak as f64 / 1e6,
        bound as f64 / 1e6
    );
    assert!(peak <= bound, "RSS {peak} over the bound {bound}");
    // Drops are counted, by reason.
    let dropped = sidecar
        .metric("kvevent_dropped_total", "kind=\"prefix\"")
        .await;
    assert!(dropped > 0.0, "a hang this long must shed");
    let overflow = sidecar
        .metric("kvevent_dropped_total", "reason=\"overflow\"")
        .await;
    assert!(overflow > 0.0, "shed as overflow (oldest first)");
    // The server answers again: what was kept arrives, and every block is sent or counted.
    server.set_behaviour(kvevent_test_support::Behaviour::Accept);
    let deadline = Instant::now() + WAIT;
    loop {
        let depth = sidecar.metric("kvevent_queue_depth", "").await;
        let received: BTreeSet<Vec<u8>> = server
            .prefixes()
            .into_iter()
            .map(|p| p.prefix_hash)
            .collect();
        let dropped = sidecar
            .metric("kvevent_dropped_total", "kind=\"prefix\"")
            .await;
        if depth == 0.0 && received.len() as f64 + dropped >= published as f64 {
            assert_eq!(received.len() as f64 + dropped, published as f64);
            // The newest were kept.
            assert!(received.contains(published.to_be_bytes().as_slice()));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not drained: depth {depth}, received {}, dropped {dropped}, published {published}",
            received.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(sidecar);
    engine.shutdown();
}

/// What the Python publisher's engine holds after `count` batches (see its docstring).
fn python_held(base: u64, count: u64) -> BTreeSet<Vec<u8>> {
    let mut held = BTreeSet::new();
    for i in 0..count {
        held.insert((base + 2 * i + 1).to_be_bytes().to_vec());
        held.insert((base + 2 * i + 2).to_be_bytes().to_vec());
        if i % 2 == 1 {
            held.remove((base + 2 * i - 1).to_be_bytes().as_slice());
        }
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_and_restarted_on_its_ports_is_cleared_each_time_and_nothing_old_returns()
{
    use kvevent_test_support::PythonPublisher;
    // The engine is killed and started again on the same ports, so they are chosen here and
    // held until the end (each engine binds them over the hold; nothing else can take them).
    let (held, held_replay) = (HeldPort::new(), HeldPort::new());
    let (port, replay_port) = (held.port(), held_replay.port());
    let server = RecordingServer::start().await;
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let replay = format!("tcp://127.0.0.1:{replay_port}");
    let sidecar = Sidecar::start(&endpoint, &replay, &server, &["--window=20ms"]);
    let lives = 4u64;
    let base = |life: u64| (life + 1) * 1_000_000;
    let count = 150u64;
    for life in 0..lives {
        let engine = PythonPublisher::spawn(
            "0.33.0",
            &[
                "--port",
                &port.to_string(),
                "--replay-port",
                &replay_port.to_string(),
                "--hash-base",
                &base(life).to_string(),
                "--interval",
                "0.005",
                "--count",
                &count.to_string(),
            ],
        );
        if life + 1 < lives {
            // Mid-stream: some of its batches reached the server.
            server
                .wait_for(WAIT, |r| {
                    applied(r)
                        .iter()
                        .any(|k| u64::from_be_bytes(k[..].try_into().unwrap()) > base(life))
                })
                .await;
            tokio::time::sleep(Duration::from_millis(150 + 100 * life)).await;
            engine.kill();
        } else {
            // The last life runs to the end and stays up; the server ends up with exactly its
            // blocks.
            let want = python_held(base(life), count);
            server.wait_for(WAIT, |r| applied(r) == want).await;
            let received = server.received();
            assert_eq!(applied(&received), want);
            // After the last clear, nothing of an earlier process arrived.
            let last_clear = received
                .iter()
                .rposition(|r| matches!(r, Received::Event(e) if e.r#type == pb::cache_event::Type::AllCleared as i32))
                .expect("cleared");
            for r in &received[last_clear..] {
                let keys: Vec<Vec<u8>> = match r {
                    Received::Update(u) => {
                        u.prefixes.iter().map(|p| p.prefix_hash.clone()).collect()
                    }
                    Received::Event(e) => vec![e.prefix_hash.clone()],
                };
                for k in keys.iter().filter(|k| k.len() == 8) {
                    let h = u64::from_be_bytes(k[..].try_into().unwrap());
                    assert!(
                        h > base(life),
                        "block {h} of an earlier process after the last clear"
                    );
                }
            }
            let clears = received
                .iter()
                .filter(|r| matches!(r, Received::Event(e) if e.r#type == pb::cache_event::Type::AllCleared as i32))
                .count() as u64;
            assert!(
                clears >= lives,
                "a clear at start and per restart: {clears}"
            );
            let restarts = sidecar
                .metric("kvevent_source_resets_total", "reason=\"restart\"")
                .await
                + sidecar
                    .metric("kvevent_source_resets_total", "reason=\"reconnect\"")
                    .await;
            assert!(
                restarts >= (lives - 1) as f64,
                "every restart detected: {restarts}"
            );
            drop(engine);
        }
    }
    drop(sidecar);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_gets_the_same_prefixes_back_within_one_refresh_interval() {
    let mut server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let interval = Duration::from_secs(3);
    let sidecar = Sidecar::start(
        engine.endpoint(),
        engine.replay_endpoint().expect("replay"),
        &server,
        &[
            "--window=20ms",
            "--refresh-interval=3s",
            "--rpc-timeout=1s",
            "--max-backoff=500ms",
        ],
    );
    assert!(tokio::task::block_in_place(
        || engine.wait_for_subscribers(1, WAIT)
    ));
    for step in 0..12 {
        engine
            .publish(&kvevent_zmq::publisher::scripted_batch(step))
            .expect("publish");
    }
    // The engine's scripted workload: once every batch is read and nothing is left to send,
    // the server holds what the engine holds.
    eventually("the 12 batches all sent", WAIT, || async {
        let received = sidecar.metric("kvevent_batches_received_total", "").await;
        let depth = sidecar.metric("kvevent_queue_depth", "").await;
        when((received, depth), |(r, d)| *r >= 12.0 && *d == 0.0)
    })
    .await;
    let before = applied(&server.received());
    assert!(before.len() >= 10, "{}", before.len());
    // The server restarts with an empty memory.
    server.stop().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart().await;
    let restarted = Instant::now();
    let from = server.received().len();
    server
        .wait_for(WAIT, |r| applied(&r[from.min(r.len())..]) == before)
        .await;

    let took = restarted.elapsed();
    eprintln!("the restarted server converged in {took:?} (refresh interval {interval:?})");
    // One interval, plus the forwarder's window and reconnect.
    assert!(
        took <= interval + Duration::from_secs(1),
        "converged in {took:?}, interval {interval:?}"
    );
    drop(sidecar);
    engine.shutdown();
}
