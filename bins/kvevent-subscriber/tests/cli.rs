//! The `kvevent-subscriber` binary, run as an operator would.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvevent_test_support::{
    HeldPort, Publisher, PublisherConfig, Received, RecordingServer, eventually,
    eventually_blocking, when,
};
use kvevent_wire::Release;

const BIN: &str = env!("CARGO_BIN_EXE_kvevent-subscriber");
const WAIT: Duration = Duration::from_secs(20);

fn run(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env_remove("KVEVENT_REPLICA_ID")
        .env_remove("KVEVENT_MODEL_ID")
        .output()
        .expect("run")
}

#[test]
fn help_documents_every_option_with_its_default_and_env_name() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).expect("utf8");
    for needle in [
        "--engine-endpoint",
        "[default: tcp://127.0.0.1:5557]",
        "[env: KVEVENT_ENGINE_ENDPOINT]",
        "--server",
        "empty: 127.0.0.1:9090, or none with --feed-address",
        "--window",
        "[default: 100ms]",
        "--lora-adapter-names",
        "--replay-endpoint",
        "--dp-size",
        "--metrics-address",
        "--drain-timeout",
        "--key-mode",
        "--token-file",
        "--engine-heartbeat-interval",
        "[env: KVEVENT_ENGINE_RCVHWM]",
        "--tls-ca-file",
        "KVEVENT_CONFIG",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}");
    }
}

#[test]
fn bad_configuration_exits_64_naming_every_problem() {
    let out = run(&["-rpc-timeout=0", "--dp-size", "0", "--cache-tier=warm"]);
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "--replica-id (KVEVENT_REPLICA_ID): is required",
        "--model-id (KVEVENT_MODEL_ID): is required",
        "--rpc-timeout (KVEVENT_RPC_TIMEOUT): must be more than 0",
        "--dp-size (KVEVENT_DP_SIZE)",
        "--cache-tier (KVEVENT_CACHE_TIER)",
    ] {
        assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
    }
    let out = run(&["--no-such-flag"]);
    assert_eq!(out.status.code(), Some(64));
    // Words are exact, as the Go sidecar's (its TestCacheTierIsValid refuses AUTO).
    let out = run(&["--cache-tier=AUTO", "--replica-id=r", "--model-id=m"]);
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did you mean `auto`"), "{err}");
}

/// The binary with `args`, its log piped, once it subscribed to `engine`.
fn spawn_subscribed(engine: &Publisher, args: &[&str]) -> std::process::Child {
    let child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    assert!(
        tokio::task::block_in_place(|| engine.wait_for_subscribers(1, WAIT)),
        "the binary subscribed"
    );
    child
}

async fn metric(port: u16, name: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        .await
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_with_go_style_flags_and_a_sigterm_drain_that_loses_nothing() {
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::new(0, 26, 0))).expect("engine");
    let mut child = spawn_subscribed(
        &engine,
        &[
            &format!("-engine-endpoint={}", engine.endpoint()),
            "-replay-endpoint",
            engine.replay_endpoint().expect("replay"),
            &format!("--server=http://{}", server.addr()),
            "-replica-id=replica-7",
            // The assertions below name engine block hashes.
            "-key-mode=engine",
            "--model-id",
            "llama",
            // Long enough that only the drain can send the adds.
            "-window=1m",
            "-stats-interval=0",
            "--metrics-address=127.0.0.1:0",
            "-log-format=json",
        ],
    );
    let stderr = Stderr::of(&mut child);
    let metrics_port = metrics_port(&stderr);
    let batches = 9u64;
    for step in 0..batches {
        engine
            .publish(&kvevent_zmq::publisher::scripted_batch(step))
            .expect("publish");
    }
    eventually("every batch received", WAIT, || async {
        when(
            metric(metrics_port, "kvevent_batches_received_total").await,
            |n| *n == Some(batches as f64),
        )
    })
    .await;
    let pending = metric(metrics_port, "kvevent_queue_depth")
        .await
        .unwrap_or(0.0);
    assert!(pending > 0.0, "adds are waiting in their window");
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(kill.success());
    let status = tokio::task::block_in_place(|| {
        eventually_blocking("an exit after SIGTERM", WAIT, || {
            child
                .try_wait()
                .expect("wait")
                .ok_or_else(|| "still running".to_owned())
        })
    });
    let log = stderr.wait_for(&["everything pending was sent"]);
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("everything pending was sent"), "{log}");
    assert!(log.lines().all(|l| l.starts_with('{')), "json logs: {log}");
    // Everything the engine still held, as the workload says: steps 0..9 minus evictions.
    let received = server.received();
    let clears = received
        .iter()
        .filter(|r| matches!(r, Received::Event(e) if e.r#type == kvevent_proto::cache_event::Type::AllCleared as i32))
        .count();
    assert_eq!(clears, 1, "the startup clear");
    // What the server holds once it applied everything in order: prompts 0–2 of 4 blocks,
    // prompt 2's extension (the extensions of prompts 0 and 1 were evicted; stores and
    // evictions that met in one window were netted before sending).
    let mut held = std::collections::BTreeSet::new();
    for r in &received {
        match r {
            Received::Update(u) => held.extend(u.prefixes.iter().map(|p| p.prefix_hash.clone())),
            Received::Event(e)
                if e.r#type == kvevent_proto::cache_event::Type::AllCleared as i32 =>
            {
                held.clear()
            }
            Received::Event(e) => {
                held.remove(&e.prefix_hash);
            }
        }
    }
    let key = |prompt: u64, block: u64| (prompt * 1_000 + block + 1).to_be_bytes().to_vec();
    let mut want: std::collections::BTreeSet<Vec<u8>> = (0..3)
        .flat_map(|p| (0..4).map(move |b| key(p, b)))
        .collect();
    want.extend([key(2, 4), key(2, 5)]);
    assert_eq!(held, want);
}

#[test]
fn the_demo_runs_the_real_sidecar_and_exits_0() {
    let out = run(&["demo", "--batches", "60"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "batches published by the engine   60",
        "batches received                  60",
        "left unsent at shutdown           0 prefixes, 0 events",
    ] {
        assert!(
            stdout.contains(needle),
            "demo output lacks {needle:?}:\n{stdout}"
        );
    }
}

#[test]
fn a_start_failure_exits_69_with_a_plain_text_log_line() {
    // The metrics port is taken: the sidecar cannot start.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = busy.local_addr().expect("addr").port();
    let out = run(&[
        "--replica-id=r",
        "--model-id=m",
        "--stats-interval=0",
        &format!("--metrics-address=127.0.0.1:{port}"),
    ]);
    assert_eq!(out.status.code(), Some(69));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot start") && err.contains("--metrics-address"),
        "{err}"
    );
    assert!(
        !err.contains('\u{1b}'),
        "no colour codes when stderr is not a terminal: {err:?}"
    );
}

#[test]
fn version_names_the_commit_and_the_vllm_releases() {
    let out = run(&["--version"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(env!("CARGO_PKG_VERSION")), "{text}");
    assert!(text.contains("(commit "), "{text}");
    let releases = format!(
        "releases {} to {}",
        kvevent_wire::Release::OLDEST,
        kvevent_wire::Release::NEWEST_KNOWN
    );
    assert!(text.contains(&releases), "{text} lacks {releases}");
}

/// A child's stderr, read on a thread as it is written.
struct Stderr(std::sync::Arc<std::sync::Mutex<String>>);

impl Stderr {
    fn of(child: &mut std::process::Child) -> Self {
        use std::io::Read;
        let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("stderr piped");
        let sink = text.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let chunk = String::from_utf8_lossy(&buf[..n]).into_owned();
                sink.lock().expect("lock").push_str(&chunk);
            }
        });
        Self(text)
    }

    fn text(&self) -> String {
        self.0.lock().expect("lock").clone()
    }

    /// Waits until every needle has been written (bounded by `WAIT`).
    fn wait_for(&self, needles: &[&str]) -> String {
        eventually_blocking(&format!("{needles:?} written"), WAIT, || {
            when(self.text(), |text| needles.iter().all(|n| text.contains(n)))
        })
    }
}

/// The port the binary's `/metrics` took (`--metrics-address=127.0.0.1:0`), from its log
/// line, text or JSON.
fn metrics_port(stderr: &Stderr) -> u16 {
    let text = stderr.wait_for(&["serving /metrics"]);
    let line = text
        .lines()
        .find(|l| l.contains("serving /metrics"))
        .expect("the line");
    let at = line.find("127.0.0.1:").expect("an address") + "127.0.0.1:".len();
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().expect("a port")
}

#[test]
fn with_nothing_listening_at_either_end_both_addresses_are_named_within_seconds() {
    // Nothing listens on these ports: a wrong --engine-endpoint and --server, or vLLM and the
    // server not started yet.
    let (nothing, nothing_either, no_metrics) = (HeldPort::new(), HeldPort::new(), HeldPort::new());
    let endpoint = nothing.tcp();
    let server = nothing_either.addr().to_string();
    let metrics_url = format!("http://{}/metrics", no_metrics.addr());
    let mut child = Command::new(BIN)
        .args([
            &format!("--engine-endpoint={endpoint}"),
            &format!("--server={server}"),
            "--replica-id=r",
            "--model-id=m",
            "--stats-interval=1s",
            &format!("--engine-metrics-url={metrics_url}"),
            "--metrics-address=127.0.0.1:0",
            "--engine-silence-grace=200ms",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = Stderr::of(&mut child);
    let metrics = metrics_port(&stderr);
    let started = Instant::now();
    let err = stderr.wait_for(&[
        "no connection to the engine's KV-event socket",
        "the InferenceCache server cannot be reached",
        "no KV events from this engine source yet",
        "engine metrics scrape failed",
    ]);
    let took = started.elapsed();
    // `/readyz` names both.
    let readyz = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", metrics)).expect("connect");
        s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n").expect("write");
        let mut body = String::new();
        s.read_to_string(&mut body).expect("read");
        body
    };
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert!(err.contains(&endpoint), "names the endpoint: {err}");
    assert!(err.contains(&server), "names the server: {err}");
    let scrape = err
        .lines()
        .find(|l| l.contains("engine metrics scrape failed"))
        .expect("the scrape warning");
    assert!(
        scrape.contains(&metrics_url),
        "names the metrics URL: {scrape}"
    );
    assert_eq!(
        err.matches("no KV events from this engine source yet")
            .count(),
        1,
        "the silence is told once: {err}"
    );
    assert!(
        readyz.starts_with("HTTP/1.0 503") || readyz.starts_with("HTTP/1.1 503"),
        "{readyz}"
    );
    assert!(
        readyz.contains(&endpoint) && readyz.contains("server cannot be reached"),
        "{readyz}"
    );
}

#[test]
fn a_mistyped_flag_gets_a_suggestion() {
    let out = run(&["--replica-idd=r", "--model-id=m"]);
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--replica-id"),
        "suggests the flag meant: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colliding_block_hashes_are_counted_and_warned_about_once() {
    use kvevent_wire as wire;
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let mut child = spawn_subscribed(
        &engine,
        &[
            &format!("--engine-endpoint={}", engine.endpoint()),
            &format!("--server=http://{}", server.addr()),
            "--replica-id=r",
            "--model-id=m",
            "--key-mode=engine",
            "--stats-interval=0",
            "--metrics-address=127.0.0.1:0",
        ],
    );
    let stderr = Stderr::of(&mut child);
    let metrics_port = metrics_port(&stderr);
    // 16-byte digests whose two words undo each other in the block map's hash: every one
    // hashes alike (a broken or hostile engine). Two buckets of 15 hold the first 30.
    let digest = |w0: u64| {
        let w1 = w0.rotate_left(29) ^ 0x5EED;
        let mut d = w0.to_le_bytes().to_vec();
        d.extend(w1.to_le_bytes());
        wire::BlockHash::Bytes(d.into())
    };
    let stored = |blocks: std::ops::Range<u64>| wire::EventBatch {
        ts: 1.0,
        events: vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: blocks.clone().map(digest).collect(),
            token_ids: (0..blocks.count() as u32 * 16).collect::<Vec<_>>().into(),
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        })],
        data_parallel_rank: None,
        ..Default::default()
    };
    let stashed = || metric(metrics_port, "kvevent_mapper_stashed_blocks{");
    for (blocks, aside) in [(1..201, 170.0), (201..211, 180.0)] {
        engine.publish(&stored(blocks)).expect("publish");
        eventually(
            &format!("kvevent_mapper_stashed_blocks {aside}"),
            WAIT,
            || async { when(stashed().await, |n| *n == Some(aside)) },
        )
        .await;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    tokio::task::block_in_place(|| child.wait()).expect("wait");
    let err = stderr.wait_for(&["engine subscription closed"]);
    let warning = "block hashes collide";
    assert_eq!(err.matches(warning).count(), 1, "warned once: {err}");
    let line = err
        .lines()
        .find(|l| l.contains(warning))
        .expect("the warning");
    assert!(
        line.contains(engine.endpoint()) && line.contains("170"),
        "names the source and how many blocks: {line}"
    );
}

/// GET `path` from the binary's HTTP endpoint: the whole response.
fn get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .expect("write");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read");
    body
}

/// A sidecar with `--feed-address` and no `--server` (the flag left out, or empty) serves
/// routers only: it starts clean, says nothing of a server, is ready once the engine's socket
/// is connected, and a router following it knows what the engine stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_only_sidecar_runs_clean_beside_an_engine_and_serves_a_router() {
    use kvevent_fleet::{Fleet, FleetConfig, Query, QueryKeys, ReplicaSource, SidecarFeed};
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let mut child = spawn_subscribed(
        &engine,
        &[
            &format!("--engine-endpoint={}", engine.endpoint()),
            "--feed-address=127.0.0.1:0",
            "--replica-id=r",
            "--model-id=m",
            "--metrics-address=127.0.0.1:0",
            // This engine stand-in has no HTTP server to ask.
            "--engine-health-interval=0",
        ],
    );
    let stderr = Stderr::of(&mut child);
    let metrics = metrics_port(&stderr);
    let log = stderr.wait_for(&["serving the router feed", "sidecar started"]);
    assert!(log.contains("none (a feed-only sidecar)"), "{log}");
    let line = log
        .lines()
        .find(|l| l.contains("serving the router feed"))
        .expect("the line");
    let at = line.find("127.0.0.1:").expect("an address");
    let feed: String = line[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
        .collect();
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    fleet
        .ensure_replica(
            "r",
            ReplicaSource::Sidecar(SidecarFeed::new(format!("http://{feed}"))),
        )
        .expect("follow");
    fleet.ready(WAIT).await.expect("the router follows it");
    let batch = kvevent_wire::EventBatch::new(
        1.0,
        vec![kvevent_wire::Event::BlockStored(
            kvevent_wire::BlockStored {
                block_hashes: (1..=2)
                    .map(|h| kvevent_wire::BlockHash::Int(kvevent_wire::Int::U64(h)))
                    .collect(),
                token_ids: (0..32u32).collect::<Vec<_>>().into(),
                block_size: 16,
                ..Default::default()
            },
        )],
    );
    engine.publish(&batch).expect("publish");
    let ids: Vec<u32> = (0..32).collect();
    eventually("the router sees the blocks", WAIT, || async {
        let matched = fleet
            .score(&Query {
                adapter: "",
                keys: QueryKeys::Tokens {
                    ids: &ids,
                    block_size: 16,
                },
            })
            .ok()
            .and_then(|s| s.first().map(|s| s.matched_blocks));
        when(matched, |m| *m == Some(2))
    })
    .await;
    let readyz = get(metrics, "/readyz");
    assert!(
        readyz.contains("200") && readyz.contains("ready (feed only"),
        "{readyz}"
    );
    // No gauge of a server it does not have (one reading 0 for good paged someone).
    let exposition = get(metrics, "/metrics");
    assert!(
        exposition.contains("kvevent_feed_followers")
            && !exposition.contains("kvevent_server_reachable"),
        "{exposition}"
    );
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();

    // `--server=` (empty), and an engine that is not there: the watch's first look warns of
    // the engine socket, and in the same pass says nothing of a server.
    let nothing = HeldPort::new();
    let mut child = Command::new(BIN)
        .args([
            &format!("--engine-endpoint={}", nothing.tcp()),
            "--server=",
            "--feed-address=127.0.0.1:0",
            "--replica-id=r",
            "--model-id=m",
            "--metrics-address=127.0.0.1:0",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = Stderr::of(&mut child);
    let metrics = metrics_port(&stderr);
    let log = stderr.wait_for(&["no connection to the engine's KV-event socket"]);
    let readyz = get(metrics, "/readyz");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    assert!(!log.contains("server cannot be reached"), "{log}");
    assert!(!log.contains("InferenceCache server"), "{log}");
    assert!(
        readyz.contains("503") && readyz.contains(&nothing.tcp()) && !readyz.contains("server"),
        "{readyz}"
    );
}
