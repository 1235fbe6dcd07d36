//! The example router end to end: Python publishers built like vLLM's (msgspec + pyzmq) →
//! the router's index → `POST /score`.

use std::sync::Arc;
use std::time::Duration;

use kvevent_examples::router::{self, Router, RouterConfig};
use kvevent_fleet::discover::Listed;
use kvevent_test_support::{PythonPublisher, eventually, when};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod discovery;
mod proxy;

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
            Listed::engine(&format!(
                "{name}={},replay={}",
                p.endpoint, p.replay_endpoint
            ))
        })
        .collect::<Result<Vec<_>, _>>()
        .expect("engines");
    let router = Arc::new(
        Router::start(RouterConfig {
            block_size: Some(16),
            replicas: engines,
            upstream_timeout: Duration::from_secs(10),
            ..RouterConfig::new("m")
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
    let scores = eventually(
        "both replicas scored, exact",
        Duration::from_secs(20),
        || async {
            let (status, v) = post(addr, "/score", &query).await;
            // 503 until a replica said its block size: nothing can be known before.
            assert!(
                status == 200
                    || (status == 503 && v["error"] == "no replica said its block size yet"),
                "{status} {v}"
            );
            // Both, and each replica's state set from its socket: exact.
            when(v, |v| {
                v["scores"]
                    .as_array()
                    .is_some_and(|s| s.len() == 2 && s.iter().all(|s| s["exact"] == true))
            })
        },
    )
    .await;
    for s in scores["scores"].as_array().expect("scores") {
        assert_eq!(s["matched_blocks"], 2, "{s}");
        assert_eq!(s["matched_tokens"], 32, "{s}");
        assert_eq!(s["tier"], "T1");
        assert_eq!(s["exact"], true);
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
    // Two replicas hold the same two prefixes: 2 keys, 4 pairs, each key shared by one pair of
    // replicas, half the entries duplicated.
    let m = router.metrics();
    for line in [
        "kvevent_index_keys 2\n",
        "kvevent_index_pairs 4\n",
        "kvevent_index_shared_pairs 2\n",
        "kvevent_index_duplication_ratio 0.5\n",
    ] {
        assert!(m.contains(line), "{line}{m}");
    }
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
    let ra = eventually("a stale", Duration::from_secs(20), || async {
        let replicas = router.replicas();
        let ra = replicas["replicas"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["name"] == "a").cloned())
            .expect("a");
        when(ra, |ra| ra["state"] == "stale")
    })
    .await;
    assert_eq!(ra["reason"], "source_lost", "{ra}");
    assert_eq!(ra["ranks"][0]["connected"], false, "{ra}");
    drop(_server);
}

async fn http_server(
    answer: impl Fn(serde_json::Value) -> (u16, String) + Clone + Send + Sync + 'static,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let answer = answer.clone();
                        async move {
                            use http_body_util::BodyExt;
                            let body = req
                                .into_body()
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let (status, text) =
                                answer(serde_json::from_slice(&body).unwrap_or_default());
                            let mut r = hyper::Response::new(http_body_util::Full::new(
                                bytes::Bytes::from(text),
                            ));
                            *r.status_mut() =
                                hyper::StatusCode::from_u16(status).expect("a status");
                            Ok::<_, std::convert::Infallible>(r)
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, task)
}

/// A replica's OpenAI-compatible server, faked: answers `/v1/completions` with `cached`
/// tokens in its usage for a prompt starting at token 0 or the word `w0` (0 for others)
/// (streamed as SSE when asked, the usage chunk only when asked for), naming itself in the
/// text.
async fn fake_upstream(
    name: &'static str,
    cached: u32,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    http_server(move |v| {
        // Only the prompt it holds (token ids from 0) is cached.
        let held =
            v["prompt"][0] == 0 || v["prompt"].as_str().is_some_and(|t| t.starts_with("w0 "));
        let cached = if held { cached } else { 0 };
        let usage = serde_json::json!({"prompt_tokens_details": {"cached_tokens": cached}});
        let text = if v["stream"] == true {
            let mut sse = format!(
                "data: {}\n\n",
                serde_json::json!({"choices": [{"text": name}], "usage": null})
            );
            if v["stream_options"]["include_usage"] == true {
                sse.push_str(&format!(
                    "data: {}\n\n",
                    serde_json::json!({"choices": [], "usage": usage})
                ));
            }
            sse + "data: [DONE]\n\n"
        } else {
            serde_json::json!({"choices": [{"text": name}], "usage": usage}).to_string()
        };
        (200, text)
    })
    .await
}

/// `POST path` over HTTP/1.1: status and the raw body.
async fn post_raw(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_string(&mut text))
        .await
        .expect("a response in time")
        .expect("read");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status");
    (
        status,
        text.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    )
}

fn engine(ctx: &zmq::Context) -> kvevent_zmq::publisher::Publisher {
    kvevent_zmq::publisher::Publisher::start(
        ctx,
        kvevent_zmq::publisher::PublisherConfig::loopback(kvevent_wire::Release::NEWEST_KNOWN),
    )
    .expect("engine")
}

/// `--engine NAME=...` for a stand-in: its events and replay sockets.
fn engine_spec(name: &str, p: &kvevent_zmq::publisher::Publisher) -> Listed {
    Listed::engine(&format!(
        "{name}={},replay={}",
        p.endpoint(),
        p.replay_endpoint().unwrap_or_default()
    ))
    .expect("engine")
}

/// `--upstream NAME=http://ADDR`.
fn upstream(name: &str, addr: impl std::fmt::Display) -> Listed {
    Listed::upstream(&format!("{name}=http://{addr}")).expect("upstream")
}

/// A replica's server that answers every request with `status`.
async fn failing_upstream(status: u16) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    http_server(move |_| (status, "{\"error\": \"overloaded\"}".to_owned())).await
}
