//! The example router end to end: Python publishers built like vLLM's (msgspec + pyzmq) →
//! the router's index → `POST /score`.

use std::sync::Arc;
use std::time::Duration;

use kvevent_examples::router::{self, Engine, Router, RouterConfig, Sidecar};
use kvevent_test_support::{PythonPublisher, eventually, when};
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
            block_size: Some(16),
            engines,
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
            sockets: kvevent_fleet::EngineSockets {
                replay: Some("tcp://10.0.0.1:5558".into()),
                dp: 2,
                ..kvevent_fleet::EngineSockets::new("tcp://10.0.0.1:5557")
            },
        }
    );
    let e: Engine = "a=tcp://10.0.0.1:5557,http=http://10.0.0.1:8000"
        .parse()
        .expect("engine with its server");
    assert_eq!(e.sockets.http.as_deref(), Some("http://10.0.0.1:8000"));
    let e: Engine = "b=tcp://10.0.0.2:5557,engine=sglang"
        .parse()
        .expect("sglang");
    assert_eq!(e.sockets.engine, kvevent_wire::Engine::Sglang);
    for bad in [
        "b=tcp://x:1,engine=trt",
        "tcp://x:1",
        "a=tcp://x:1,speed=9",
        "a=tcp://x",
        "=tcp://x:1",
    ] {
        let e = bad.parse::<Engine>().expect_err(bad);
        assert!(e.to_string().contains(bad), "names what it was given: {e}");
    }
}

/// An HTTP server on loopback answering each request's JSON body with `answer(body)`:
/// (status, body).
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_go_to_the_replica_holding_the_prompt_and_outcomes_are_accounted() {
    use kvevent_examples::proxy::Upstream;
    use kvevent_wire as wire;
    let ctx = zmq::Context::new();
    let engine = |_: u8| {
        kvevent_zmq::publisher::Publisher::start(
            &ctx,
            kvevent_zmq::publisher::PublisherConfig::loopback(wire::Release::NEWEST_KNOWN),
        )
        .expect("engine")
    };
    let (a, b) = (engine(0), engine(1));
    // Replica a stored the 128-token prompt (4 blocks of 32): the engine will reuse 96 of it.
    let prompt: Vec<u32> = (0..128).collect();
    a.publish(&wire::EventBatch::new(
        1.0,
        vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: (1..=4)
                .map(|h| wire::BlockHash::Int(wire::Int::U64(h)))
                .collect(),
            token_ids: prompt.clone().into(),
            block_size: 32,
            ..Default::default()
        })],
    ))
    .expect("publish");
    // Replica b stored it for the LoRA adapter `sql-lora` (vLLM serves an adapter under its own
    // model name): a request naming that model is the adapter's.
    b.publish(&wire::EventBatch::new(
        1.0,
        vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: (11..=14)
                .map(|h| wire::BlockHash::Int(wire::Int::U64(h)))
                .collect(),
            token_ids: prompt.clone().into(),
            block_size: 32,
            lora_name: Some("sql-lora".into()),
            ..Default::default()
        })],
    ))
    .expect("publish");
    let ((ua, _ta), (ub, _tb)) = (fake_upstream("a", 96).await, fake_upstream("b", 0).await);
    let nothing = kvevent_test_support::HeldPort::new();
    let spec = engine_spec;
    let c = kvevent_zmq::publisher::Publisher::start(
        &ctx,
        kvevent_zmq::publisher::PublisherConfig::loopback(wire::Release::NEWEST_KNOWN),
    )
    .expect("engine");
    // A word-level tokenizer.json: w0..w127 are the ids 0..127.
    let vocab: serde_json::Map<String, serde_json::Value> = (0..128)
        .map(|i| (format!("w{i}"), serde_json::json!(i)))
        .chain(std::iter::once((
            "[UNK]".to_owned(),
            serde_json::json!(1000),
        )))
        .collect();
    let tokenizer = std::env::temp_dir().join(format!(
        "kvevent-router-tokenizer-{}.json",
        std::process::id()
    ));
    std::fs::write(
        &tokenizer,
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        })
        .to_string(),
    )
    .expect("tokenizer.json");
    let router = Arc::new(
        Router::start(RouterConfig {
            engines: vec![spec("a", &a), spec("b", &b), spec("c", &c)],
            upstreams: vec![
                Upstream {
                    name: "a".into(),
                    url: format!("http://{ua}"),
                },
                Upstream {
                    name: "b".into(),
                    url: format!("http://{ub}"),
                },
                // Nothing listens there: a replica that fails.
                Upstream {
                    name: "c".into(),
                    url: format!("http://{}", nothing.addr()),
                },
            ],
            upstream_timeout: Duration::from_secs(5),
            tokenizer: Some(tokenizer.clone()),
            ..RouterConfig::new("m")
        })
        .expect("router"),
    );
    let (addr, _server) = router::bind("127.0.0.1:0", router.clone())
        .await
        .expect("bind");
    router
        .fleet()
        .ready(Duration::from_secs(20))
        .await
        .expect("exact");
    eventually("a's store", Duration::from_secs(20), || async {
        when(router.fleet().block_size(), Option::is_some)
    })
    .await;
    let request = |stream: bool| {
        serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1, "stream": stream})
            .to_string()
    };
    // To a, which holds it, as it answered; its usage recorded: 128 predicted, 96 expected
    // back (the last block), 96 reused.
    let (status, body) = post_raw(addr, "/v1/completions", &request(false)).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["choices"][0]["text"], "a", "{v}");
    // Streamed: passed on as it came, the usage chunk asked for and read.
    let (status, body) = post_raw(addr, "/v1/completions", &request(true)).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"text\":\"a\"")
            && body.contains("cached_tokens")
            && body.contains("[DONE]"),
        "{body}"
    );
    let accounted = eventually(
        "a's two decisions accounted",
        Duration::from_secs(10),
        || async {
            when(router.fleet().accounting(), |a| {
                a.iter().any(|(n, t)| n == "a" && t.decisions == 2)
            })
        },
    )
    .await;
    let (_, t) = accounted.iter().find(|(n, _)| n == "a").expect("a");
    assert_eq!((t.exact, t.optimistic, t.pessimistic), (2, 0, 0), "{t:?}");
    // A new prompt: every replica ties at 0; the first by name among the least loaded.
    let other =
        serde_json::json!({"model": "m", "prompt": [900, 901, 902], "max_tokens": 1}).to_string();
    let (status, body) = post_raw(addr, "/v1/completions", &other).await;
    assert_eq!(status, 200, "{body}");
    // A text prompt, tokenized as the engine would (this router's tokenizer.json maps the words
    // w0..w127 to the ids 0..127): the prompt a holds, so it goes to a.
    let words: Vec<String> = (0..128).map(|i| format!("w{i}")).collect();
    let text =
        serde_json::json!({"model": "m", "prompt": words.join(" "), "max_tokens": 1}).to_string();
    let (status, body) = post_raw(addr, "/v1/completions", &text).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"text\":\"a\""), "{body}");
    // The same prompt for the adapter goes to b, its holder, not to a, the base model's.
    let lora = |adapter: &str| {
        router
            .fleet()
            .score(&kvevent_fleet::Query {
                adapter,
                keys: kvevent_fleet::QueryKeys::Tokens {
                    ids: &prompt,
                    block_size: 32,
                },
            })
            .ok()
            .and_then(|s| s.first().map(|s| (s.replica.to_owned(), s.matched_blocks)))
    };
    eventually("b's adapter store", Duration::from_secs(20), || async {
        when(lora("sql-lora"), |l| *l == Some(("b".to_owned(), 4)))
    })
    .await;
    let adapted =
        serde_json::json!({"model": "sql-lora", "prompt": prompt, "max_tokens": 1}).to_string();
    let (status, body) = post_raw(addr, "/v1/completions", &adapted).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"text\":\"b\""), "{body}");
    // Without a tokenizer, a text prompt is a clear 400.
    let bare = Arc::new(
        Router::start(RouterConfig {
            engines: vec![spec("a", &a)],
            upstreams: vec![Upstream {
                name: "a".into(),
                url: format!("http://{ua}"),
            }],
            upstream_timeout: Duration::from_secs(5),
            ..RouterConfig::new("m")
        })
        .expect("router"),
    );
    let (bare_addr, _bare_server) = router::bind("127.0.0.1:0", bare).await.expect("bind");
    let (status, body) = post_raw(bare_addr, "/v1/completions", &text).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("tokenizer"), "{body}");
    // c holds a prompt now: it goes there, and c fails it: a 502 naming it.
    c.publish(&wire::EventBatch::new(
        1.0,
        vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(77))],
            token_ids: (500..532).collect::<Vec<u32>>().into(),
            block_size: 32,
            ..Default::default()
        })],
    ))
    .expect("publish");
    let held: Vec<u32> = (500..540).collect();
    let _ = eventually("c's store", Duration::from_secs(20), || async {
        let best = router
            .fleet()
            .score(&kvevent_fleet::Query {
                adapter: "",
                keys: kvevent_fleet::QueryKeys::Tokens {
                    ids: &held,
                    block_size: 32,
                },
            })
            .map(|s| s.first().map(|s| s.replica.to_owned()));
        when(best, |b| {
            b.as_ref().is_ok_and(|b| b.as_deref() == Some("c"))
        })
    })
    .await;
    // c holds it, and nothing listens there: the connection is refused before anything
    // reached the client, so the request goes to the next choice (a or b), counted.
    let to_c = serde_json::json!({"model": "m", "prompt": held, "max_tokens": 1}).to_string();
    let (status, body) = post_raw(addr, "/v1/completions", &to_c).await;
    assert_eq!(status, 200, "sent again to another replica: {body}");
    let to_a = body.contains("\"text\":\"a\"");
    assert!(to_a || body.contains("\"text\":\"b\""), "{body}");
    // With no other candidate, c's refusal is a 502 naming it.
    let only_c = Arc::new(
        Router::start(RouterConfig {
            engines: vec![spec("c", &c)],
            upstreams: vec![Upstream {
                name: "c".into(),
                url: format!("http://{}", nothing.addr()),
            }],
            upstream_timeout: Duration::from_secs(5),
            ..RouterConfig::new("m")
        })
        .expect("router"),
    );
    let (only_c_addr, _only_c_server) = router::bind("127.0.0.1:0", only_c.clone())
        .await
        .expect("bind");
    let (status, body) = post_raw(only_c_addr, "/v1/completions", &to_c).await;
    assert_eq!(status, 502, "{body}");
    assert!(
        body.contains("replica `c`") && body.contains(&nothing.addr().to_string()),
        "{body}"
    );
    // /metrics: the accounting and the proxy's own latency.
    let metrics = router.metrics();
    // a's four, and the retried request if it went there (it held nothing of it: exact).
    let on_a = 4 + u32::from(to_a);
    for needle in [
        &format!("kvevent_router_predictions_total{{replica=\"a\",outcome=\"exact\"}} {on_a}"),
        "kvevent_router_predictions_total{replica=\"a\",outcome=\"pessimistic\"} 0",
        &format!(
            "kvevent_router_prediction_error_blocks_bucket{{le=\"0.0\",replica=\"a\"}} {on_a}"
        ),
        "kvevent_router_proxy_overhead_seconds_count 6",
        // Prometheus text: a counter's TYPE names its samples; no OpenMetrics EOF.
        "# TYPE kvevent_router_predictions_total counter\n",
        "kvevent_router_responses_total{replica=\"c\",code=\"refused\"} 1",
        "kvevent_router_retries_total{replica=\"c\",reason=\"refused\"} 1",
        "kvevent_router_none_serving_total 0",
        // The weights learned: from the one streamed request (its first token's time).
        "kvevent_router_weight_flights_total 1",
        "kvevent_router_prefill_seconds_per_token{source=\"learned\"} ",
        "kvevent_router_queue_seconds_per_request{source=\"learned\"} ",
    ] {
        assert!(metrics.contains(needle), "no {needle} in\n{metrics}");
    }
    assert!(!metrics.contains("# EOF"), "{metrics}");
    let weights = &router.replicas()["weights"];
    assert_eq!(
        (&weights["learned"], &weights["flights"]),
        (&serde_json::json!(true), &serde_json::json!(1)),
        "{weights}"
    );
    assert!(
        weights["queue_us_per_request"]
            .as_f64()
            .is_some_and(|q| q > 0.0),
        "{weights}"
    );
}

/// An engine stand-in on loopback, on the newest wire.
fn engine(ctx: &zmq::Context) -> kvevent_zmq::publisher::Publisher {
    kvevent_zmq::publisher::Publisher::start(
        ctx,
        kvevent_zmq::publisher::PublisherConfig::loopback(kvevent_wire::Release::NEWEST_KNOWN),
    )
    .expect("engine")
}

/// `--engine NAME=...` for a stand-in: its events and replay sockets.
fn engine_spec(name: &str, p: &kvevent_zmq::publisher::Publisher) -> Engine {
    format!(
        "{name}={},replay={}",
        p.endpoint(),
        p.replay_endpoint().unwrap_or_default()
    )
    .parse::<Engine>()
    .expect("engine")
}

/// A replica's server that answers every request with `status`.
async fn failing_upstream(status: u16) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    http_server(move |_| (status, "{\"error\": \"overloaded\"}".to_owned())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_answering_503_or_502_is_passed_over_once() {
    use kvevent_examples::proxy::Upstream;
    let ctx = zmq::Context::new();
    let engine = || engine(&ctx);
    let (x, y, z) = (engine(), engine(), engine());
    let spec = engine_spec;
    let ((ux, _tx), (uy, _ty), (uz, _tz)) = (
        failing_upstream(503).await,
        fake_upstream("y", 0).await,
        failing_upstream(502).await,
    );
    let upstream = |name: &str, addr: std::net::SocketAddr| Upstream {
        name: name.into(),
        url: format!("http://{addr}"),
    };
    // Round-robin in the candidates' order: the first request goes to the first.
    let serve = |names: [(
        &str,
        &kvevent_zmq::publisher::Publisher,
        std::net::SocketAddr,
    ); 2]| {
        let router = Arc::new(
            Router::start(RouterConfig {
                engines: names.iter().map(|(n, p, _)| spec(n, p)).collect(),
                upstreams: names.iter().map(|(n, _, a)| upstream(n, *a)).collect(),
                upstream_timeout: Duration::from_secs(5),
                policy: kvevent_fleet::route::Policy::RoundRobin,
                ..RouterConfig::new("m")
            })
            .expect("router"),
        );
        async move {
            let (addr, server) = router::bind("127.0.0.1:0", router.clone())
                .await
                .expect("bind");
            (router, addr, server)
        }
    };
    let request =
        serde_json::json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}).to_string();
    // x answers 503, z 502: each time sent again to the next choice (y), which answers.
    for (name, failing, at, code) in [("x", &x, ux, "503"), ("z", &z, uz, "502")] {
        let (router, addr, _server) = serve([(name, failing, at), ("y", &y, uy)]).await;
        let (status, body) = post_raw(addr, "/v1/completions", &request).await;
        assert_eq!(
            (status, body.contains("\"text\":\"y\"")),
            (200, true),
            "{body}"
        );
        let metrics = router.metrics();
        for needle in [
            format!("kvevent_router_retries_total{{replica=\"{name}\",reason=\"{code}\"}} 1"),
            format!("kvevent_router_responses_total{{replica=\"{name}\",code=\"{code}\"}} 1"),
            "kvevent_router_responses_total{replica=\"y\",code=\"200\"} 1".to_owned(),
        ] {
            assert!(metrics.contains(&needle), "no {needle} in\n{metrics}");
        }
    }
    // A request is sent again only once: x (503), then z (502), and the client gets z's
    // failure, as a 502 naming it.
    let (router, addr, _server) = serve([("x", &x, ux), ("z", &z, uz)]).await;
    let (status, body) = post_raw(addr, "/v1/completions", &request).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("replica `z`"), "{body}");
    let metrics = router.metrics();
    assert!(
        metrics.contains("kvevent_router_retries_total{replica=\"x\",reason=\"503\"} 1")
            && !metrics.contains("kvevent_router_retries_total{replica=\"z\""),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_discovered_from_a_file_are_routed_to_as_they_come_and_go() {
    let ctx = zmq::Context::new();
    let engine = || engine(&ctx);
    let (x, y) = (engine(), engine());
    let ((ux, _tx), (uy, _ty)) = (fake_upstream("x", 0).await, fake_upstream("y", 0).await);
    let line = |name: &str, p: &kvevent_zmq::publisher::Publisher, up: std::net::SocketAddr| {
        format!(
            "{name} engine={},replay={} upstream=http://{up}\n",
            p.endpoint(),
            p.replay_endpoint().unwrap_or_default()
        )
    };
    let dir = std::env::temp_dir().join(format!("kvevent-router-discover-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("replicas");
    let write = |text: String| {
        std::fs::write(dir.join("replicas.tmp"), text).expect("write");
        std::fs::rename(dir.join("replicas.tmp"), &file).expect("rename");
    };
    write(line("x", &x, ux));
    let router = Arc::new(
        Router::start(RouterConfig {
            discover: Some(
                format!("file:{}", file.display())
                    .parse()
                    .expect("discover"),
            ),
            upstream_timeout: Duration::from_secs(5),
            ..RouterConfig::new("m")
        })
        .expect("router"),
    );
    let (addr, _server) = router::bind("127.0.0.1:0", router.clone())
        .await
        .expect("bind");
    let request =
        serde_json::json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}).to_string();
    let (status, body) = post_raw(addr, "/v1/completions", &request).await;
    assert_eq!(
        (status, body.contains("\"text\":\"x\"")),
        (200, true),
        "{body}"
    );
    // x leaves, y comes: within a second, y is the only replica, and requests go there.
    write(line("y", &y, uy));
    let names = || {
        router.replicas()["replicas"]
            .as_array()
            .map(|r| r.iter().map(|r| r["name"].to_string()).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    eventually("only y followed", Duration::from_secs(2), || async {
        when(names(), |n| *n == ["\"y\""])
    })
    .await;
    for _ in 0..3 {
        let (status, body) = post_raw(addr, "/v1/completions", &request).await;
        assert_eq!(
            (status, body.contains("\"text\":\"y\"")),
            (200, true),
            "{body}"
        );
    }
    // A bad file: the last good set is kept.
    write("y engine=nonsense\n".into());
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(names(), ["\"y\""]);
    let (status, body) = post_raw(addr, "/v1/completions", &request).await;
    assert_eq!(
        (status, body.contains("\"text\":\"y\"")),
        (200, true),
        "{body}"
    );
    // A file that cannot be read at the start is a clear error.
    let missing = Router::start(RouterConfig {
        discover: Some("file:/nonexistent/replicas".parse().expect("discover")),
        upstream_timeout: Duration::from_secs(5),
        ..RouterConfig::new("m")
    });
    let error = format!("{:#}", missing.err().expect("an error"));
    assert!(error.contains("/nonexistent/replicas"), "{error}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn discover_flags_parse() {
    use kvevent_fleet::discover::{Spec, dns::DnsSpec, kube::KubeSpec};
    assert_eq!(
        "file:/etc/replicas".parse::<Spec>(),
        Ok(Spec::File("/etc/replicas".into()))
    );
    assert_eq!(
        "dns:vllm.ns.svc:7070,upstream=8000,server=127.0.0.1:53,interval=5".parse::<Spec>(),
        Ok(Spec::Dns(DnsSpec {
            target: "vllm.ns.svc:7070".into(),
            upstream: Some(8000),
            server: Some(([127, 0, 0, 1], 53).into()),
            interval: Some(Duration::from_secs(5)),
        }))
    );
    assert!(matches!(
        "dns:_kvevent-feed._tcp.vllm.ns.svc".parse::<Spec>(),
        Ok(Spec::Dns(DnsSpec { upstream: None, .. }))
    ));
    assert_eq!(
        "kube:inference,resync=30,feed-port=feed/app.kubernetes.io/name=vllm,tier=gpu"
            .parse::<Spec>(),
        Ok(Spec::Kube(KubeSpec {
            namespace: "inference".into(),
            selector: "app.kubernetes.io/name=vllm,tier=gpu".into(),
            feed_port: Some("feed".into()),
            upstream_port: None,
            resync: Some(Duration::from_secs(30)),
        }))
    );
    for bad in [
        "file:",
        "consul:x",
        "dns:vllm",
        "dns:vllm:7070,upstream=http",
        "dns:vllm:7070,colour=blue",
        "dns:vllm:7070,interval=-1",
        "kube:inference",
        "kube:/app=vllm",
        "kube:ns,every=3/app=vllm",
    ] {
        let e = bad.parse::<Spec>().expect_err(bad);
        assert!(e.contains(bad), "{bad}: {e}");
    }
}

#[test]
fn the_kubernetes_router_discovers_pods_with_read_only_rights() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let router = std::fs::read_to_string(root.join("router.yaml")).expect("router.yaml");
    let vllm = std::fs::read_to_string(root.join("vllm-with-kvevent.yaml")).expect("vllm");
    // Its --discover parses (the namespace as Kubernetes fills it in), and selects the vLLM
    // pods, whose sidecar serves its feed at the port discovery looks for.
    let discover = router
        .lines()
        .find_map(|l| l.trim().strip_prefix("- --discover="))
        .expect("--discover")
        .replace("$(POD_NAMESPACE)", "inference");
    let Ok(kvevent_fleet::discover::Spec::Kube(spec)) = discover.parse() else {
        panic!("{discover} is not kube:");
    };
    assert!(
        vllm.contains(&format!("labels: {{{}}}", spec.selector.replace('=', ": "))),
        "{}",
        spec.selector
    );
    assert!(vllm.contains("{name: kvevent-feed, containerPort: 7070}"));
    assert!(vllm.contains("--feed-address=0.0.0.0:7070"));
    assert!(vllm.contains("ports: [{name: http, containerPort: 8000}]"));
    // Pods, read only: get, list, watch and nothing else, in a namespaced Role.
    assert!(router.contains("kind: Role\n") && !router.contains("ClusterRole"));
    let rules = router.split("rules:").nth(1).expect("rules");
    let rules = rules.split("---").next().unwrap_or_default();
    assert_eq!(
        rules.trim(),
        "- apiGroups: [\"\"]\n    resources: [pods]\n    verbs: [get, list, watch]"
    );
    assert!(router.contains("serviceAccountName: kvevent-router"));
}
