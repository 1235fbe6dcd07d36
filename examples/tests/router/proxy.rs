//! The proxy: completions sent to the replica holding the prompt, outcomes accounted, and a
//! replica answering 502 or 503 passed over once.

#[allow(
    clippy::wildcard_imports,
    reason = "the helpers and imports of main.rs"
)]
use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_go_to_the_replica_holding_the_prompt_and_outcomes_are_accounted() {
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
            replicas: vec![
                spec("a", &a),
                spec("b", &b),
                spec("c", &c),
                upstream("a", ua),
                upstream("b", ub),
                // Nothing listens there: a replica that fails.
                upstream("c", nothing.addr()),
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
            replicas: vec![spec("a", &a), upstream("a", ua)],
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
            replicas: vec![spec("c", &c), upstream("c", nothing.addr())],
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_answering_503_or_502_is_passed_over_once() {
    let ctx = zmq::Context::new();
    let engine = || engine(&ctx);
    let (x, y, z) = (engine(), engine(), engine());
    let spec = engine_spec;
    let ((ux, _tx), (uy, _ty), (uz, _tz)) = (
        failing_upstream(503).await,
        fake_upstream("y", 0).await,
        failing_upstream(502).await,
    );
    // Round-robin in the candidates' order: the first request goes to the first.
    let serve = |names: [(
        &str,
        &kvevent_zmq::publisher::Publisher,
        std::net::SocketAddr,
    ); 2]| {
        let router = Arc::new(
            Router::start(RouterConfig {
                replicas: (names.iter().map(|(n, p, _)| spec(n, p)))
                    .chain(names.iter().map(|(n, _, a)| upstream(n, a)))
                    .collect(),
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
