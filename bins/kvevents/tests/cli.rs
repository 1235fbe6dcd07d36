//! The `kvevents` binary, run as a user would.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The repository's `testdata/` (the shared vectors and golden fingerprints, copied).
fn shared() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

fn kvevents(args: &[&str], stdin: Option<&[u8]>) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvevents"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kvevents");
    let mut input = child.stdin.take().expect("stdin");
    input
        .write_all(stdin.unwrap_or_default())
        .expect("write stdin");
    drop(input);
    child.wait_with_output().expect("wait")
}

/// What `kvevents args` prints, after checking it succeeded (its stderr if not).
fn stdout_of(args: &[&str]) -> Vec<u8> {
    let out = kvevents(args, None);
    assert!(
        out.status.success(),
        "kvevents {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn decode_prints_the_vectors_json_one_line_each() {
    let dir = shared().join("vectors/vllm-0.26.0");
    let a = dir.join("basic.msgpack");
    let b = dir.join("media.msgpack");
    let stdout = stdout_of(&[
        "decode",
        a.to_str().expect("path"),
        b.to_str().expect("path"),
    ]);
    let text = String::from_utf8(stdout).expect("utf8");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    for (line, path) in lines.iter().zip([a, b]) {
        let want: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path.with_extension("json")).expect("read"))
                .expect("json");
        assert_eq!(line, &want);
    }
    assert_eq!(lines.len(), 2);
}

#[test]
fn a_bad_file_is_reported_and_the_rest_still_decode() {
    let good = shared().join("vectors/vllm-0.9.0/basic.msgpack");
    let payload = std::fs::read(&good).expect("read");
    let dir = std::env::temp_dir().join(format!("kvevents-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let bad = dir.join("cut.msgpack");
    std::fs::write(&bad, &payload[..payload.len() / 2]).expect("write");
    let out = kvevents(
        &[
            "decode",
            bad.to_str().expect("p"),
            "-",
            "/nonexistent/x.msgpack",
        ],
        Some(&payload),
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cut.msgpack: byte"), "{stderr}");
    assert!(
        stderr.contains("input ends in the middle of a value"),
        "{stderr}"
    );
    assert!(
        stderr.contains("/nonexistent/x.msgpack: cannot read"),
        "{stderr}"
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_json_file_given_to_decode_is_told_what_decode_reads() {
    let json = shared().join("vectors/vllm-0.9.0/basic.json");
    let out = kvevents(&["decode", json.to_str().expect("p")], None);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("basic.json: byte 0:"), "{stderr}");
    assert!(
        stderr.contains("this is JSON text") && stderr.contains("kvevents encode"),
        "{stderr}"
    );
    // Bytes that are not JSON get no such hint.
    let out = kvevents(&["decode", "-"], Some(&[0xc1, 0x00]));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("JSON"));
}

#[test]
fn encode_reproduces_the_release_bytes() {
    for release in ["0.9.0", "0.14.0", "0.24.0", "0.33.0"] {
        let dir = shared().join(format!("vectors/vllm-{release}"));
        let json = dir.join("basic.json");
        assert_eq!(
            stdout_of(&["encode", "--release", release, json.to_str().expect("p")]),
            std::fs::read(dir.join("basic.msgpack")).expect("read")
        );
    }
}

#[test]
fn encode_refuses_a_field_the_release_lacks_unless_lenient() {
    let json = shared().join("vectors/vllm-0.33.0/newest_fields.json");
    let path = json.to_str().expect("p");
    let out = kvevents(&["encode", "--release", "0.20.0", path], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("vLLM 0.20.0 has no field"));
    let out = kvevents(&["encode", "--release", "0.20.0", "--lenient", path], None);
    assert!(out.status.success());
    let out = kvevents(&["encode", "--release", "0.8.0", path], None);
    assert_eq!(
        out.status.code(),
        Some(2),
        "clap rejects an unknown release"
    );
}

#[test]
fn fingerprint_prints_the_golden_chain() {
    let golden: serde_json::Value = serde_json::from_slice(
        &std::fs::read(shared().join("fingerprint/golden.json")).expect("read"),
    )
    .expect("json");
    let case = golden["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == "with_parent")
        .expect("with_parent case");
    let mut args = vec![
        "fingerprint".to_owned(),
        "--block-size".to_owned(),
        case["block_size"].to_string(),
        "--parent".to_owned(),
        case["parent_prefix"].as_str().expect("parent").to_owned(),
    ];
    args.extend(
        case["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.to_string()),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let lines: Vec<serde_json::Value> = String::from_utf8(stdout_of(&args))
        .expect("utf8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    let want = case["blocks"].as_array().expect("blocks");
    assert_eq!(lines.len(), want.len());
    for (got, want) in lines.iter().zip(want) {
        assert_eq!(got["prefix"], want["prefix"]);
        assert_eq!(got["prefix_be_hex"], want["prefix_be_hex"]);
    }
}

/// A SUB socket bound on a loopback port, subscribed to everything, reads waiting up to 10 s;
/// and its endpoint, for `kvevents publish --endpoint` to connect to.
fn bound_sub(ctx: &zmq::Context) -> (zmq::Socket, String) {
    let sub = ctx.socket(zmq::SUB).expect("sub");
    sub.set_subscribe(b"").expect("subscribe");
    sub.set_rcvtimeo(10_000).expect("timeout");
    sub.bind("tcp://127.0.0.1:*").expect("bind");
    let endpoint = sub.get_last_endpoint().expect("endpoint").expect("utf-8");
    (sub, endpoint)
}

#[test]
fn publish_speaks_to_a_subscriber() {
    // `kvevents publish` on a loopback port, read back with a plain SUB socket.
    let ctx = zmq::Context::new();
    let (sub, endpoint) = bound_sub(&ctx);
    // The tool's endpoint has no wildcard: it connects, as vLLM's publisher would.
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvevents"))
        .args([
            "publish",
            "--endpoint",
            &endpoint,
            "--replay-endpoint",
            "",
            "--count",
            "40",
        ])
        .args(["--interval-ms", "25"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    // Read while it runs: a peer's unread messages go with its connection.
    let msg = sub.recv_multipart(0);
    let status = child.wait().expect("wait");
    assert!(status.success());
    let msg = msg.expect("a message within 10 s");
    let live = kvevent_wire::frames::parse_live(&msg).expect("frames");
    assert_eq!(live.topic, b"kv-events");
    kvevent_wire::decode(live.payload).expect("a payload vLLM 0.33 would send");
}

#[test]
fn publish_once_sends_each_file_once_in_order_and_says_so() {
    let dir = std::env::temp_dir().join(format!("kvevents-once-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let stored = dir.join("stored.json");
    let removed = dir.join("removed.json");
    std::fs::write(
        &stored,
        r#"{"ts": 0, "events": [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": null, "token_ids": [1, 2, 3, 4], "block_size": 4}]}"#,
    )
    .expect("write");
    std::fs::write(
        &removed,
        r#"{"ts": 1, "events": [{"type": "BlockRemoved", "block_hashes": [1]}]}"#,
    )
    .expect("write");
    let ctx = zmq::Context::new();
    let (sub, endpoint) = bound_sub(&ctx);
    let child = Command::new(env!("CARGO_BIN_EXE_kvevents"))
        .args(["publish", "--endpoint", &endpoint, "--replay-endpoint", ""])
        // The first publish waits out the slow joiner; the interval gives it time.
        .args(["--interval-ms", "300", "--once"])
        .arg(&stored)
        .arg(&removed)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut got = Vec::new();
    while let Ok(msg) = sub.recv_multipart(0) {
        let live = kvevent_wire::frames::parse_live(&msg).expect("frames");
        let batch = kvevent_wire::decode(live.payload).expect("payload");
        got.push((live.seq, batch.events.len()));
        if live.seq == 1 {
            break;
        }
    }
    let out = child.wait_with_output().expect("wait");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    // Each file once, in order: a subscriber may miss the first (slow joiner), never gets more.
    assert!(!got.is_empty(), "nothing arrived; stderr: {text}");
    assert_eq!(got.last().map(|&(seq, _)| seq), Some(1), "{got:?}");
    assert!(text.contains("2 file(s) once"), "{text}");
    assert!(
        text.contains("seq 0: ") && text.contains("stored.json (1 block(s) stored, 0 removed)"),
        "{text}"
    );
    assert!(
        text.contains("seq 1: ") && text.contains("removed.json (0 block(s) stored, 1 removed)"),
        "{text}"
    );
    assert!(text.contains("published 2 batch(es)"), "{text}");
    // It stopped on its own: a third batch never comes.
    sub.set_rcvtimeo(0).expect("timeout");
    assert!(sub.recv_multipart(0).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Serves `/metrics` and `/kv_event_sources` with these bodies on loopback, for a while.
fn engine_http(metrics: String, listing: String) -> u16 {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(16) {
            let Ok(mut stream) = stream else { continue };
            let mut line = String::new();
            let _ = BufReader::new(&stream).read_line(&mut line);
            let body = if line.contains("/metrics") {
                &metrics
            } else if line.contains("/kv_event_sources") {
                &listing
            } else {
                ""
            };
            let status = if body.is_empty() {
                "404 Not Found"
            } else {
                "200 OK"
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    port
}

#[test]
fn doctor_checks_an_engine_found_by_discovery_one_line_each() {
    use kvevent_test_support::{Publisher, PublisherConfig};
    let ctx = zmq::Context::new();
    let engine = Publisher::start(
        &ctx,
        PublisherConfig::loopback(kvevent_wire::Release::NEWEST_KNOWN),
    )
    .expect("engine");
    // Something already published (replay has it), and more while the doctor listens.
    engine
        .publish(&kvevent_zmq::publisher::scripted_batch(0))
        .expect("publish");
    let port = |e: &str| e.rsplit(':').next().expect("port").to_owned();
    // As vLLM lists them: bound on every interface.
    let listing = format!(
        r#"[{{"data_parallel_rank": 0, "endpoint": "tcp://*:{}", "replay_endpoint": "tcp://*:{}", "topic": "kv-events"}}]"#,
        port(engine.endpoint()),
        port(engine.replay_endpoint().expect("replay"))
    );
    let metrics = std::fs::read_to_string(shared().join("fixtures/metrics/vllm-0.10-legacy.txt"))
        .expect("fixture");
    let http = engine_http(metrics, listing);
    let keep_publishing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let publishing = std::thread::spawn({
        let keep = keep_publishing.clone();
        move || {
            let mut step = 1;
            while keep.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = engine.publish(&kvevent_zmq::publisher::scripted_batch(step));
                step += 1;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            engine.shutdown();
        }
    });
    let out = kvevents(
        &[
            "doctor",
            "--engine-url",
            &format!("http://127.0.0.1:{http}"),
            "--timeout",
            "5s",
        ],
        None,
    );
    keep_publishing.store(false, std::sync::atomic::Ordering::Relaxed);
    publishing.join().expect("publisher");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for want in [
        "ok    metrics: block size 16, 20000 GPU blocks, prefix-caching hash sha256",
        "ok    endpoints: discovered 1 rank(s)",
        "warn  exposure: tcp://*:",
        "(with topic frame: vLLM ≥ 0.26)",
        "ok    live tcp://127.0.0.1:",
        "events as maps (vLLM ≥ 0.24); int hashes, block size 16; DP rank 0",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    // Nothing answering: failures, exit 1.
    let out = kvevents(
        &[
            "doctor",
            "--engine-url",
            "http://127.0.0.1:1",
            "--timeout",
            "1s",
        ],
        None,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("FAIL  endpoints: GET http://127.0.0.1:1/kv_event_sources"),
        "{text}"
    );
}

#[test]
fn doctor_tells_nothing_listening_from_an_idle_engine() {
    use kvevent_test_support::{HeldPort, Publisher, PublisherConfig};
    let doctor = |endpoint: &str| {
        let out = kvevents(
            &[
                "doctor",
                "--endpoint",
                endpoint,
                "--replay-endpoint",
                "",
                "--timeout",
                "1s",
            ],
            None,
        );
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // Nothing listens: the socket check fails and says so.
    let nothing = HeldPort::new();
    let (code, text) = doctor(&nothing.tcp());
    assert_eq!(code, Some(1), "{text}");
    let socket_line = format!("FAIL  socket {}: nothing listens there", nothing.tcp());
    assert!(text.contains(&socket_line), "{text}");
    // Nor at its replay endpoint: that line names the replay endpoint, and neither check
    // waits out its timeout for what cannot come.
    let no_replay = HeldPort::new();
    let started = std::time::Instant::now();
    let out = kvevents(
        &[
            "doctor",
            "--endpoint",
            &nothing.tcp(),
            "--replay-endpoint",
            &no_replay.tcp(),
            "--timeout",
            "20s",
        ],
        None,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "{:?}: {text}",
        started.elapsed()
    );
    let replay_line = format!("FAIL  replay {}: nothing listens there", no_replay.tcp());
    assert!(text.contains(&replay_line), "{text}");
    assert!(text.contains("skipped: nothing listens there"), "{text}");
    // An engine that is up but publishes nothing: a warning, not a failure.
    let ctx = zmq::Context::new();
    let idle = Publisher::start(
        &ctx,
        PublisherConfig {
            replay_endpoint: None,
            ..PublisherConfig::loopback(kvevent_wire::Release::NEWEST_KNOWN)
        },
    )
    .expect("engine");
    let (code, text) = doctor(idle.endpoint());
    let socket_line = format!("ok    socket {}: something listens there", idle.endpoint());
    assert!(text.contains(&socket_line), "{text}");
    assert!(text.contains("an idle engine publishes nothing"), "{text}");
    assert!(!text.contains("FAIL"), "{text}");
    assert_eq!(code, Some(0), "{text}");
    idle.shutdown();
}

#[test]
fn sglang_payloads_decode_and_encode_with_engine_sglang() {
    // EAGLE pairs and a salted store: SGLang-only shapes, refused as vLLM's.
    for (release, case) in [
        ("0.5.3", "eagle"),
        ("0.5.18", "cache_salt"),
        ("0.5.23", "all_fields"),
    ] {
        let dir = shared().join(format!("vectors/sglang-{release}"));
        let payload = dir.join(format!("{case}.msgpack"));
        let json = dir.join(format!("{case}.json"));
        let p = payload.to_str().expect("path");
        let got: serde_json::Value =
            serde_json::from_slice(&stdout_of(&["decode", "--engine", "sglang", p]))
                .expect("one json line");
        let want: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).expect("read")).expect("json");
        assert_eq!(got, want, "{release}/{case}");
        let encoded = stdout_of(&[
            "encode",
            "--engine",
            "sglang",
            "--release",
            release,
            json.to_str().expect("path"),
        ]);
        assert_eq!(
            encoded,
            std::fs::read(&payload).expect("read"),
            "{release}/{case}"
        );
    }
    let eagle = shared().join("vectors/sglang-0.5.3/eagle.msgpack");
    let out = kvevents(&["decode", eagle.to_str().expect("path")], None);
    assert_eq!(out.status.code(), Some(1), "pairs are not vLLM's");
    // A salt in a release before salts is refused, naming the field and the release.
    let json = shared().join("vectors/sglang-0.5.18/cache_salt.json");
    let out = kvevents(
        &[
            "encode",
            "--engine",
            "sglang",
            "--release",
            "0.5.9",
            json.to_str().expect("p"),
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("SGLang 0.5.9 has no field `cache_salt`"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An endpoint without its scheme is refused before anything opens, naming the flag and the
/// form meant, for `record` and `publish` alike.
#[test]
fn an_endpoint_without_its_scheme_names_the_flag_and_the_form_meant() {
    for args in [
        &["record", "--endpoint", "127.0.0.1:5557", "-o", "/dev/null"][..],
        &["publish", "--endpoint", "127.0.0.1:5557"][..],
        &[
            "record",
            "--replay-endpoint",
            "127.0.0.1:5558",
            "-o",
            "/dev/null",
        ][..],
    ] {
        let out = kvevents(args, None);
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(
            said.contains("-endpoint")
                && said
                    .contains("is not a tcp://, ipc:// or inproc:// endpoint (tcp://127.0.0.1:555"),
            "{args:?}: {said}"
        );
    }
}

/// DP ranks whose derived endpoints collide (adjacent base ports) are refused before a socket
/// opens, by the rule the sidecar and the Fleet use (`kvevent_zmq::dp_sources`).
#[test]
fn record_refuses_dp_ranks_whose_endpoints_collide() {
    let out = kvevents(
        &[
            "record",
            "--endpoint",
            "tcp://127.0.0.1:5557",
            "--replay-endpoint",
            "tcp://127.0.0.1:5558",
            "--dp-size",
            "2",
            "--duration",
            "1s",
            "-o",
            "/dev/null",
        ],
        None,
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{said}");
    assert!(
        said.contains(
            "rank 0's replay endpoint tcp://127.0.0.1:5558 is also rank 1's endpoint with 2 ranks"
        ),
        "{said}"
    );
}

/// `doctor --engine-url 127.0.0.1:8000` names the flag and the URL meant, not the engine's
/// metrics or its vLLM version.
#[test]
fn doctor_names_an_engine_url_without_its_scheme() {
    let out = kvevents(&["doctor", "--engine-url", "127.0.0.1:8000"], None);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("--engine-url")
            && said.contains("`127.0.0.1:8000` is not an http:// URL (http://127.0.0.1:8000?)"),
        "{said}"
    );
    // https is refused where it is given: the client that reads the engine speaks plain HTTP.
    let out = kvevents(&["doctor", "--engine-url", "https://127.0.0.1:8000"], None);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(said.contains("https is not supported"), "{said}");
}

/// `kvevents decode … | head`: the reader going away ends the tool quietly, exit 0.
#[test]
fn a_closed_pipe_ends_quietly() {
    use std::io::Read as _;
    let vector = shared().join("vectors/vllm-0.26.0/basic.msgpack");
    let path = vector.to_str().expect("utf-8");
    // Enough lines to outlast a pipe's buffer, read one line of, then closed.
    let args: Vec<&str> = std::iter::once("decode")
        .chain(std::iter::repeat_n(path, 5_000))
        .collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvevents"))
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut first = [0u8; 64];
    stdout.read_exact(&mut first).expect("some output");
    drop(stdout);
    let out = child.wait_with_output().expect("wait");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {said}", out.status);
    assert!(said.is_empty(), "{said}");
}
