//! The example router end to end: Python publishers built like vLLM's (msgspec + pyzmq) →
//! the router's index → `POST /score`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvevent_examples::router::{self, Engine, Router, RouterConfig, Sidecar};
use kvevent_test_support::PythonPublisher;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, serde_json::Value) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut text = String::new();
    s.read_to_string(&mut text).await.expect("read");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status");
    let json = text.split("\r\n\r\n").nth(1).unwrap_or_default();
    (
        status,
        serde_json::from_str(json).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_publishers_into_the_router_and_scores_out() {
    // Each publishes one batch: blocks of tokens 0..32 (block size 16), as vLLM 0.33 would.
    let a = PythonPublisher::spawn("0.33.0", &["--count", "1"]);
    let b = PythonPublisher::spawn("0.20.0", &["--count", "1"]);
    let engines = [("a", &a), ("b", &b)]
        .iter()
        .map(|(name, p)| {
            format!("{name}={},replay={}", p.endpoint, p.replay_endpoint).parse::<Engine>()
        })
        .collect::<Result<Vec<_>, _>>()
        .expect("engines");
    let router = Arc::new(
        Router::start(RouterConfig {
            model: "m".into(),
            block_size: Some(16),
            engines,
            sidecars: Vec::new(),
        })
        .expect("router"),
    );
    let (addr, _server) = router::bind("127.0.0.1:0", router.clone())
        .await
        .expect("bind");
    let tokens: Vec<u32> = (0..40).collect();
    let query = serde_json::json!({"model": "m", "adapter": "", "token_ids": tokens}).to_string();
    // The batch reaches the router through the engines' replay (it was published before the
    // router subscribed) or live; wait for both replicas.
    let deadline = Instant::now() + Duration::from_secs(20);
    let scores = loop {
        let (status, v) = post(addr, "/score", &query).await;
        // 503 until a replica said its block size: nothing can be known before.
        assert!(
            status == 200 || (status == 503 && v["error"] == "no replica said its block size yet"),
            "{status} {v}"
        );
        // Both, and each replica's state set from its socket (exact: fresh).
        if v["scores"]
            .as_array()
            .is_some_and(|s| s.len() == 2 && s.iter().all(|s| s["fresh"] == true))
        {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "no scores: {v}\n{}",
            router.metrics()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for s in scores["scores"].as_array().expect("scores") {
        assert_eq!(s["matched_blocks"], 2, "{s}");
        assert_eq!(s["matched_tokens"], 32, "{s}");
        assert_eq!(s["tier"], "T1");
        assert_eq!(s["fresh"], true);
    }
    let names: Vec<&str> = scores["scores"]
        .as_array()
        .expect("scores")
        .iter()
        .filter_map(|s| s["replica"].as_str())
        .collect();
    assert_eq!(names, ["a", "b"], "best first, then by name");
    // Other tokens match nothing; another model is refused; bad input is a clear error.
    let other = serde_json::json!({"model": "m", "token_ids": [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]});
    assert_eq!(
        post(addr, "/score", &other.to_string()).await.1["scores"],
        serde_json::json!([])
    );
    let (status, v) = post(addr, "/score", r#"{"model": "x", "token_ids": []}"#).await;
    assert_eq!(status, 404, "{v}");
    let (status, v) = post(addr, "/score", r#"{"model": "m", "token_ids": [-1]}"#).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        router.metrics().contains("kvevent_index_pairs 4"),
        "{}",
        router.metrics()
    );
    let metrics = router.metrics();
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in {metrics}"))
    };
    // Real engine hashes never collide enough to be kept aside.
    assert_eq!(value("kvevent_index_stashed "), 0, "{metrics}");
    assert_eq!(
        value("kvevent_replica_exact{replica=\"a\"} "),
        1,
        "{metrics}"
    );
    // GET /replicas: both exact, two blocks each, the block size from their events.
    let replicas = router.replicas();
    for r in replicas["replicas"].as_array().expect("replicas") {
        assert_eq!(r["state"], "exact", "{r}");
        assert_eq!(r["reason"], serde_json::Value::Null, "{r}");
        assert_eq!(r["error"], serde_json::Value::Null, "{r}");
        assert!(
            r["source"]
                .as_str()
                .is_some_and(|s| s.starts_with("tcp://")),
            "{r}"
        );
        assert_eq!(r["ranks"][0]["connected"], true, "{r}");
        assert_eq!(r["blocks"], 2, "{r}");
        assert_eq!(r["block_size"], 16, "{r}");
    }
    // A query with another block size than the events use is an error, not an empty answer.
    let (status, v) = post(
        addr,
        "/score",
        &serde_json::json!({"model": "m", "token_ids": tokens, "block_size": 32}).to_string(),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    // Candidates: only the replicas asked about.
    let only_b = serde_json::json!({"model": "m", "token_ids": tokens, "candidates": ["b"]});
    let (_, v) = post(addr, "/score", &only_b.to_string()).await;
    assert_eq!(v["scores"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["scores"][0]["replica"], "b", "{v}");
    // A candidate the router does not follow is named, not dropped without a word.
    let with_c = serde_json::json!({"model": "m", "token_ids": tokens, "candidates": ["b", "c"]});
    let (_, v) = post(addr, "/score", &with_c.to_string()).await;
    assert_eq!(v["not_followed"], serde_json::json!(["c"]), "{v}");
    // An engine gone: its replica is degraded at once, then stale, and says why.
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let replicas = router.replicas();
        let ra = replicas["replicas"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["name"] == "a").cloned())
            .expect("a");
        if ra["state"] == "stale" {
            assert_eq!(ra["reason"], "source_lost", "{ra}");
            assert_eq!(ra["ranks"][0]["connected"], false, "{ra}");
            break;
        }
        assert!(Instant::now() < deadline, "{ra}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(_server);
}

#[test]
fn sidecar_flags_parse() {
    let s: Sidecar = "a=http://10.0.0.1:7070".parse().expect("sidecar");
    assert_eq!(
        s,
        Sidecar {
            name: "a".into(),
            url: "http://10.0.0.1:7070".into()
        }
    );
    assert!("a=10.0.0.1:7070".parse::<Sidecar>().is_err());
    assert!("http://10.0.0.1:7070".parse::<Sidecar>().is_err());
}

#[test]
fn engine_flags_parse() {
    let e: Engine = "a=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558,dp=2"
        .parse()
        .expect("engine");
    assert_eq!(
        e,
        Engine {
            name: "a".into(),
            endpoint: "tcp://10.0.0.1:5557".into(),
            replay: Some("tcp://10.0.0.1:5558".into()),
            dp: 2,
            engine: kvevent_wire::Engine::Vllm,
        }
    );
    let e: Engine = "b=tcp://10.0.0.2:5557,engine=sglang"
        .parse()
        .expect("sglang");
    assert_eq!(e.engine, kvevent_wire::Engine::Sglang);
    assert!("b=tcp://x:1,engine=trt".parse::<Engine>().is_err());
    assert!("tcp://x:1".parse::<Engine>().is_err());
    assert!("a=tcp://x:1,speed=9".parse::<Engine>().is_err());
}
