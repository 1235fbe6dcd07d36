//! The `kvevent-simulator` program as a user starts it: engines on loopback, each answering
//! vLLM's API, `/metrics` and publishing its KV events; requests vLLM refuses refused likewise.

use std::io::{BufRead as _, Read as _, Write as _};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 exchange on a connection of its own: the status and the body (as sent: a
/// streamed one keeps its chunk lines).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// The program with `flags`, and its first `n` lines (one an engine, in the example router's
/// `--engine` syntax).
fn simulator(flags: &[&str], n: usize) -> (Killed, Vec<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvevent-simulator"))
        .args(flags)
        .args(["--time-model", "vllm-cpu", "--speed", "4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvevent-simulator");
    let stdout = child.stdout.take().expect("stdout");
    let killed = Killed(child);
    let lines: Vec<String> = std::io::BufReader::new(stdout)
        .lines()
        .take(n)
        .map(|l| l.expect("a line"))
        .collect();
    assert_eq!(lines.len(), n, "{lines:?}");
    (killed, lines)
}

/// An engine's line: its HTTP address and its KV-event endpoint.
fn endpoints(line: &str) -> (String, String) {
    let http = line
        .split(',')
        .find_map(|f| f.strip_prefix("http=http://"))
        .unwrap_or_else(|| panic!("no http= in {line}"));
    let events = line
        .split_once('=')
        .and_then(|(_, rest)| rest.split(',').next())
        .unwrap_or_else(|| panic!("no events in {line}"));
    (http.to_owned(), events.to_owned())
}

#[test]
fn engines_answer_as_vllm_does_and_publish_their_events() {
    let (_child, lines) = simulator(
        &[
            "--engines",
            "2",
            "--model",
            "tiny",
            "--max-model-len",
            "100",
        ],
        2,
    );
    assert!(
        lines[0].starts_with("e000=tcp://127.0.0.1:"),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].starts_with("e001=tcp://127.0.0.1:"),
        "{}",
        lines[1]
    );
    let (http_addr, events) = endpoints(&lines[0]);

    let (status, body) = http(&http_addr, "GET", "/health", "");
    assert_eq!(status, 200, "{body}");
    let (status, body) = http(&http_addr, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{body}");
    let models = json(&body);
    assert_eq!(
        (
            &models["data"][0]["id"],
            &models["data"][0]["max_model_len"]
        ),
        (&serde_json::json!("tiny"), &serde_json::json!(100)),
        "{models}"
    );

    // Its KV events: subscribed before the first request, the blocks it stores come out.
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("sub");
    sub.set_subscribe(b"").expect("subscribe");
    sub.set_rcvtimeo(10_000).expect("rcvtimeo");
    sub.connect(&events).expect("connect");
    std::thread::sleep(Duration::from_millis(300));

    let prompt: Vec<u32> = (1..=40).collect();
    let request = |stream: bool| {
        serde_json::json!({
            "model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream,
            "stream_options": {"include_usage": true},
        })
        .to_string()
    };
    let (status, body) = http(&http_addr, "POST", "/v1/completions", &request(false));
    assert_eq!(status, 200, "{body}");
    let first = json(&body);
    assert_eq!(first["usage"]["prompt_tokens"], 40, "{first}");
    assert_eq!(first["usage"]["completion_tokens"], 4, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let frames = sub.recv_multipart(0).expect("a batch of KV events");
    assert_eq!(frames.len(), 3, "topic, sequence, payload");
    let batch = kvevent_wire::decode(&frames[2]).expect("vLLM's wire");
    assert!(
        matches!(
            batch.events.first(),
            Some(kvevent_wire::Event::BlockStored(_))
        ),
        "{batch:?}"
    );

    // The same prompt again, streamed: its two full blocks found cached, said in the usage.
    let (status, body) = http(&http_addr, "POST", "/v1/completions", &request(true));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"cached_tokens\":32"), "{body}");
    assert!(body.contains("data: [DONE]"), "{body}");

    let (status, metrics) = http(&http_addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    for needle in [
        "vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
    ] {
        assert!(metrics.contains(needle), "no {needle} in {metrics}");
    }

    // Refused as vLLM refuses: another model, a body that is not JSON, too long a request.
    let (status, body) = http(
        &http_addr,
        "POST",
        "/v1/completions",
        &serde_json::json!({"model": "other", "prompt": [1, 2]}).to_string(),
    );
    assert_eq!(status, 404, "{body}");
    assert_eq!(
        json(&body)["error"]["message"],
        "The model `other` does not exist."
    );
    let (status, body) = http(&http_addr, "POST", "/v1/completions", "{not json");
    assert_eq!(status, 400, "{body}");
    let long: Vec<u32> = (0..98).collect();
    let (status, body) = http(
        &http_addr,
        "POST",
        "/v1/completions",
        &serde_json::json!({"model": "tiny", "prompt": long, "max_tokens": 4}).to_string(),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        json(&body)["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("This model's maximum context length is 100 tokens. However, you requested 102 tokens (98 in the messages, 4 in the completion).")),
        "{body}"
    );
    // Text, as curl sends it: words made tokens the same way each time, so a shared opening
    // is a shared prefix (40 words: two full blocks found the second time).
    let words: Vec<String> = (0..40).map(|i| format!("w{i}")).collect();
    let text = serde_json::json!({"model": "tiny", "prompt": words.join(" "), "max_tokens": 2})
        .to_string();
    let (status, body) = http(&http_addr, "POST", "/v1/completions", &text);
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["usage"]["prompt_tokens"], 40, "{body}");
    let (_, body) = http(&http_addr, "POST", "/v1/completions", &text);
    let again = json(&body);
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"], 32,
        "{again}"
    );
    assert!(
        again["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| t.starts_with(" t")),
        "{again}"
    );
    // A chat, whole and streamed: the same messages find their prefix the second time.
    let chat = |stream: bool| {
        serde_json::json!({
            "model": "tiny", "stream": stream, "max_completion_tokens": 3,
            "stream_options": {"include_usage": true},
            "messages": [
                {"role": "system", "content": words[..30].join(" ")},
                {"role": "user", "content": [{"type": "text", "text": "hello there"}]},
            ],
        })
        .to_string()
    };
    let (status, body) = http(&http_addr, "POST", "/v1/chat/completions", &chat(false));
    assert_eq!(status, 200, "{body}");
    let answer = json(&body);
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    assert_eq!(
        answer["choices"][0]["message"]["role"], "assistant",
        "{answer}"
    );
    assert_eq!(answer["usage"]["completion_tokens"], 3, "{answer}");
    let (status, body) = http(&http_addr, "POST", "/v1/chat/completions", &chat(true));
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"chat.completion.chunk\"")
            && body.contains("\"delta\"")
            && body.contains("\"cached_tokens\":32")
            && body.contains("data: [DONE]"),
        "{body}"
    );
    let (status, body) = http(
        &http_addr,
        "POST",
        "/v1/chat/completions",
        &serde_json::json!({"model": "tiny", "messages": "hi"}).to_string(),
    );
    assert_eq!(status, 400, "{body}");
    // The engine still serves after them.
    let (status, _) = http(&http_addr, "POST", "/v1/completions", &request(false));
    assert_eq!(status, 200);
}

#[test]
fn bad_flags_are_refused_with_a_clear_error() {
    for (flags, says) in [
        (&["--engines", "0"][..], "--engines: 1 to 4096"),
        (&["--time-model", "fast"][..], "fast"),
        (&["--speed", "0"][..], "speed"),
        (&["--blocks", "1"][..], "--blocks: 2 or more"),
        (
            &["--engines", "2", "--ports", "5557,5558,8000"][..],
            "--ports: one engine's ports",
        ),
        (&["--ports", "5557,5558"][..], "three port numbers"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvevent-simulator"))
            .args(flags)
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
    }
}

/// The next batch's sequence number and stored hashes, if one comes within `ms`.
fn next_batch(sub: &zmq::Socket, ms: i32) -> Option<(u64, Vec<u64>)> {
    sub.set_rcvtimeo(ms).expect("rcvtimeo");
    let frames = sub.recv_multipart(0).ok()?;
    let seq = u64::from_be_bytes(frames[1].as_slice().try_into().expect("8 bytes"));
    let batch = kvevent_wire::decode(&frames[2]).expect("a batch");
    let stored = batch
        .events
        .iter()
        .filter_map(|e| match e {
            kvevent_wire::Event::BlockStored(s) => Some(s.block_hashes.iter()),
            _ => None,
        })
        .flatten()
        .filter_map(|h| match h {
            kvevent_wire::BlockHash::Int(kvevent_wire::Int::U64(h)) => Some(*h),
            _ => None,
        })
        .collect();
    Some((seq, stored))
}

#[test]
fn every_fault_hook_does_what_it_says_and_the_truth_is_what_events_said() {
    let (_child, lines) = simulator(&[], 1);
    let (addr, events) = endpoints(&lines[0]);
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("sub");
    sub.set_subscribe(b"").expect("subscribe");
    sub.connect(&events).expect("connect");
    std::thread::sleep(Duration::from_millis(300));
    let complete = |first: u32| {
        let prompt: Vec<u32> = (first..first + 40).collect();
        let body = serde_json::json!({"prompt": prompt, "max_tokens": 1}).to_string();
        http(&addr, "POST", "/v1/completions", &body)
    };
    let admin = |path: &str| http(&addr, "POST", &format!("/admin/{path}"), "");
    let truth = || json(&http(&addr, "GET", "/admin/truth", "").1);

    // The truth: the blocks its events stored.
    assert_eq!(complete(1000).0, 200);
    let (seq, mut stored) = next_batch(&sub, 5_000).expect("the first batch");
    stored.sort_unstable();
    let t = truth();
    assert_eq!(t["incarnation"], 0);
    assert_eq!(t["blocks"], serde_json::json!(stored), "{t}");
    assert_eq!(stored.len(), 2);

    // Paused: nothing goes out; resumed: what was held, in order.
    assert_eq!(admin("publisher/pause").0, 200);
    assert_eq!(complete(2000).0, 200);
    assert_eq!(next_batch(&sub, 500), None, "published while paused");
    let (status, body) = admin("publisher/resume");
    assert_eq!(
        (status, json(&body)["published"].clone()),
        (200, serde_json::json!(1))
    );
    let (held, _) = next_batch(&sub, 5_000).expect("the held batch");
    assert_eq!(held, seq + 1);

    // Dropped: the next batch is lost on the way (its seq used), the one after comes.
    assert_eq!(admin("publisher/drop?batches=1").0, 200);
    assert_eq!(complete(3000).0, 200);
    assert_eq!(next_batch(&sub, 500), None, "a dropped batch was sent");
    assert_eq!(complete(4000).0, 200);
    let (after, _) = next_batch(&sub, 5_000).expect("the batch after");
    assert_eq!(after, held + 2, "the lost one's seq is a gap");
    assert_eq!(truth()["blocks"].as_array().map(Vec::len), Some(8));

    // Restarted: a new incarnation, nothing held, its sequence from 0.
    let (status, body) = admin("restart");
    assert_eq!(
        (status, json(&body)["incarnation"].clone()),
        (200, serde_json::json!(1))
    );
    let t = truth();
    assert_eq!(
        (&t["incarnation"], &t["blocks"]),
        (&serde_json::json!(1), &serde_json::json!([]))
    );
    assert_eq!(complete(1000).0, 200);
    let (seq, _) = next_batch(&sub, 5_000).expect("the new incarnation's first batch");
    assert_eq!(seq, 0);

    // HTTP down: no answer at all, the admin still answers; up: served again.
    assert_eq!(admin("http/down").0, 200);
    assert_eq!(
        http(&addr, "GET", "/health", "").0,
        0,
        "an answer while down"
    );
    assert_eq!(complete(5000).0, 0);
    assert_eq!(admin("http/up").0, 200);
    assert_eq!(http(&addr, "GET", "/health", "").0, 200);

    // Delayed answers.
    assert_eq!(admin("http/delay?ms=300").0, 200);
    let started = std::time::Instant::now();
    assert_eq!(http(&addr, "GET", "/health", "").0, 200);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(admin("http/delay?ms=0").0, 200);

    // What is not a fault is said so.
    let (status, body) = admin("melt");
    assert_eq!(status, 404);
    assert!(
        body.contains("not a fault hook") && body.contains("publisher/pause"),
        "{body}"
    );
    assert_eq!(admin("publisher/drop").0, 400);
}

#[test]
fn an_adapter_is_served_by_name_its_blocks_are_its_own_and_its_events_name_it() {
    let (_child, lines) = simulator(
        &[
            "--model",
            "tiny",
            "--lora-modules",
            "sql-lora=/adapters/sql",
            "chat",
        ],
        1,
    );
    let (http_addr, events) = endpoints(&lines[0]);
    let (status, body) = http(&http_addr, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{body}");
    let ids: Vec<String> = json(&body)["data"]
        .as_array()
        .expect("models")
        .iter()
        .map(|m| format!("{}<{}", m["id"], m["parent"]))
        .collect();
    assert_eq!(
        ids,
        [
            "\"tiny\"<null",
            "\"sql-lora\"<\"tiny\"",
            "\"chat\"<\"tiny\""
        ]
    );
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("sub");
    sub.set_subscribe(b"").expect("subscribe");
    sub.set_rcvtimeo(10_000).expect("rcvtimeo");
    sub.connect(&events).expect("connect");
    std::thread::sleep(Duration::from_millis(300));
    let prompt: Vec<u32> = (1..=40).collect();
    let complete = |model: &str| {
        let (status, body) = http(
            &http_addr,
            "POST",
            "/v1/completions",
            &serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1}).to_string(),
        );
        assert_eq!(status, 200, "{body}");
        json(&body)["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached tokens")
    };
    // The base model's blocks are not the adapter's, nor one adapter's another's.
    assert_eq!(complete("tiny"), 0);
    assert_eq!(complete("sql-lora"), 0);
    assert_eq!(complete("sql-lora"), 32);
    assert_eq!(complete("chat"), 0);
    let mut named = Vec::new();
    for _ in 0..3 {
        let frames = sub.recv_multipart(0).expect("a batch of KV events");
        let batch = kvevent_wire::decode(&frames[2]).expect("vLLM's wire");
        for e in batch.events {
            if let kvevent_wire::Event::BlockStored(s) = e {
                named.push((s.lora_id, s.lora_name.map(|n| n.into_owned())));
            }
        }
    }
    assert_eq!(
        named,
        [
            (None, None),
            (Some(1), Some("sql-lora".to_owned())),
            (Some(2), Some("chat".to_owned()))
        ]
    );
    let (status, body) = http(
        &http_addr,
        "POST",
        "/v1/completions",
        &serde_json::json!({"model": "nope", "prompt": [1, 2]}).to_string(),
    );
    assert_eq!(status, 404, "{body}");
    assert_eq!(
        json(&body)["error"]["message"],
        "The model `nope` does not exist."
    );
}

#[test]
fn with_engine_sglang_its_events_and_metrics_are_sglangs() {
    let (_child, lines) = simulator(&["--model", "tiny", "--engine", "sglang"], 1);
    assert!(
        lines[0].ends_with(",engine=sglang"),
        "the router's syntax: {}",
        lines[0]
    );
    let (http_addr, events) = endpoints(&lines[0]);
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("sub");
    sub.set_subscribe(b"").expect("subscribe");
    sub.set_rcvtimeo(10_000).expect("rcvtimeo");
    sub.connect(&events).expect("connect");
    std::thread::sleep(Duration::from_millis(300));
    // Enough prompts that some block hash has its top bit set: SGLang's are signed.
    let mut hashes = Vec::new();
    for p in 0..8u32 {
        let prompt: Vec<u32> = (p * 100..p * 100 + 40).collect();
        let body = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 1});
        let (status, body) = http(&http_addr, "POST", "/v1/completions", &body.to_string());
        assert_eq!(status, 200, "{body}");
        let frames = sub.recv_multipart(0).expect("a batch of KV events");
        let batch = kvevent_wire::decode_engine(
            &frames[2],
            kvevent_wire::Engine::Sglang,
            &kvevent_wire::Limits::default(),
        )
        .expect("SGLang's wire");
        for e in batch.events {
            if let kvevent_wire::Event::BlockStored(s) = e {
                hashes.extend(s.block_hashes.into_iter().map(|h| match h {
                    kvevent_wire::BlockHash::Int(i) => i,
                    other => panic!("not an int: {other:?}"),
                }));
            }
        }
    }
    assert_eq!(hashes.len(), 16);
    assert!(
        hashes
            .iter()
            .any(|h| matches!(h, kvevent_wire::Int::I64(_))),
        "signed hashes, some negative: {hashes:?}"
    );
    let (status, metrics) = http(&http_addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    for name in [
        "sglang:num_running_reqs{",
        "sglang:num_queue_reqs{",
        "sglang:token_usage{",
        "sglang:cache_hit_rate{",
    ] {
        assert!(metrics.contains(name), "no {name} in {metrics}");
    }
    assert!(!metrics.contains("vllm:"), "{metrics}");
}

#[test]
fn data_parallel_ranks_are_laid_out_as_vllms_and_share_the_load() {
    let (_child, lines) = simulator(&["--model", "tiny", "--data-parallel-size", "2"], 1);
    assert!(
        lines[0].ends_with(",dp=2"),
        "the router's syntax: {}",
        lines[0]
    );
    let (http_addr, events) = endpoints(&lines[0]);
    // Rank 1 publishes on rank 0's port + 1.
    let (host, port) = events.rsplit_once(':').expect("a port");
    let rank1 = format!("{host}:{}", port.parse::<u16>().expect("a port") + 1);
    let ctx = zmq::Context::new();
    let subscribe = |endpoint: &str| {
        let sub = ctx.socket(zmq::SUB).expect("sub");
        sub.set_subscribe(b"").expect("subscribe");
        sub.set_rcvtimeo(10_000).expect("rcvtimeo");
        sub.connect(endpoint).expect("connect");
        sub
    };
    let (sub0, sub1) = (subscribe(&events), subscribe(&rank1));
    std::thread::sleep(Duration::from_millis(300));
    // Two at once: the second goes to the rank the first left idle.
    let requests: Vec<_> = (0..2u32)
        .map(|p| {
            let addr = http_addr.clone();
            std::thread::spawn(move || {
                let prompt: Vec<u32> = (p * 100..p * 100 + 40).collect();
                let body =
                    serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 200});
                http(&addr, "POST", "/v1/completions", &body.to_string())
            })
        })
        .collect();
    for r in requests {
        let (status, body) = r.join().expect("a request");
        assert_eq!(status, 200, "{body}");
    }
    for (rank, sub) in [(0, &sub0), (1, &sub1)] {
        let frames = sub.recv_multipart(0).expect("a batch of KV events");
        let batch = kvevent_wire::decode(&frames[2]).expect("vLLM's wire");
        assert_eq!(batch.data_parallel_rank, Some(rank), "{batch:?}");
    }
    let (_, metrics) = http(&http_addr, "GET", "/metrics", "");
    assert!(
        metrics.contains("vllm:num_requests_running{engine=\"1\""),
        "{metrics}"
    );
    let (_, truth) = http(&http_addr, "GET", "/admin/truth", "");
    let truth = json(&truth);
    let ranks = truth["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 2, "{truth}");
    assert!(
        ranks
            .iter()
            .all(|r| !r.as_array().expect("blocks").is_empty()),
        "{truth}"
    );
}
