//! The example router between three real vLLM engines on CPU (feature `real-engine`, run by
//! `bash .ci/real-engine/run`): token-id prompts go to the engine that holds them, a LoRA
//! adapter's request to the engine holding the prompt for that adapter, `/metrics` shows each
//! prediction against what the engine reused, and on a shared-prefix workload the routing rule
//! reuses at least twice what round-robin does, by vLLM's own counters.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvevent_examples::router::{self, Router, RouterConfig};
use kvevent_fleet::ReplicaSource;
use kvevent_fleet::discover::{Listed, Part};
use kvevent_test_support::{HeldPort, VLLM_BLOCK, Vllm, vllm_venv};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `POST /v1/completions` of `model` (the base model, or a LoRA adapter's name) through the
/// router: status and body.
async fn complete(
    addr: std::net::SocketAddr,
    model: &str,
    prompt: &[u32],
) -> (u16, serde_json::Value) {
    let body =
        serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            .to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_string(&mut text))
        .await
        .expect("in time")
        .expect("read");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status");
    let json = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or_default();
    (status, serde_json::from_str(json).unwrap_or_default())
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..4 * VLLM_BLOCK)
        .map(|t| 3 + (seed * 131 + t * 7) % 1000)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_routes_between_three_real_engines() {
    let venv = vllm_venv();
    let logs = std::env::temp_dir().join(format!("kvevent-real-engines-{}", std::process::id()));
    std::fs::create_dir_all(&logs).expect("log dir");
    // Both serve the LoRA adapter `tiny-lora`: vLLM keeps its blocks apart from the base
    // model's (its events say lora_name), and the router reads it from a request's `model`.
    let lora = logs.join("tiny-lora");
    let made = std::process::Command::new(venv.join("bin/python"))
        .arg(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../.ci/real-engine/make_lora.py"),
        )
        .arg(&lora)
        .status()
        .expect("make the LoRA adapter");
    assert!(made.success(), "make_lora.py failed");
    let lora_module = format!("--lora-modules=tiny-lora={}", lora.display());
    let ports: Vec<[HeldPort; 3]> = (0..3)
        .map(|_| [HeldPort::new(), HeldPort::new(), HeldPort::new()])
        .collect();
    let mut engines: Vec<Vllm> = ports
        .iter()
        .enumerate()
        .map(|(i, [http, events, replay])| {
            Vllm::start_with(
                &venv,
                http.port(),
                events.port(),
                replay.port(),
                logs.join(format!("vllm-{i}.log")),
                &[
                    "--enable-lora",
                    &lora_module,
                    "--max-lora-rank=8",
                    "--max-loras=1",
                ],
            )
        })
        .collect();
    for e in &mut engines {
        e.up().await;
    }
    let names = ["e1", "e2", "e3"];
    let servers: Vec<std::net::SocketAddr> = engines.iter().map(|e| e.http).collect();
    // A router following every engine (their sockets) and sending them requests, by `policy`.
    let router_by = |policy: kvevent_fleet::route::Policy| RouterConfig {
        model: "tiny".into(),
        block_size: None,
        replicas: ports
            .iter()
            .zip(names)
            .map(|([_, events, replay], name)| {
                Listed::engine(&format!("{name}={},replay={}", events.tcp(), replay.tcp()))
                    .expect("engine")
            })
            .chain(servers.iter().zip(names).map(|(http, name)| {
                Listed::upstream(&format!("{name}=http://{http}")).expect("upstream")
            }))
            .collect(),
        discover: None,
        upstream_timeout: Duration::from_secs(60),
        tokenizer: None,
        policy,
        // As a user runs it: the cost policy's weights learned from the flights.
        learn_weights: true,
    };
    // Started, serving, and every engine exact.
    let serve = async |policy| {
        let router = Arc::new(Router::start(router_by(policy)).expect("router"));
        let (addr, server) = router::bind("127.0.0.1:0", router.clone())
            .await
            .expect("bind");
        router
            .fleet()
            .ready(Duration::from_secs(60))
            .await
            .expect("every engine exact");
        (router, addr, server)
    };
    let (router, addr, _server) = serve(Default::default()).await;
    // e2 served p2 before (straight to it); p1 is new to both.
    let (p1, p2) = (prompt(1), prompt(2));
    assert_eq!(engines[1].complete(&p2).await, 0);
    let known = |adapter: &str, ids: &[u32]| {
        router
            .fleet()
            .score(&kvevent_fleet::Query {
                adapter,
                keys: kvevent_fleet::QueryKeys::Tokens {
                    ids,
                    block_size: VLLM_BLOCK as usize,
                },
            })
            .ok()
            .and_then(|s| s.first().map(|s| (s.replica.to_owned(), s.matched_tokens)))
    };
    let settle = |adapter: &'static str, ids: Vec<u32>, on: &'static str| {
        let known = &known;
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while known(adapter, &ids) != Some((on.to_owned(), 4 * VLLM_BLOCK)) {
                assert!(
                    Instant::now() < deadline,
                    "{on} never held it: {:?}",
                    known(adapter, &ids)
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    settle("", p2.clone(), "e2").await;
    // p2 goes to e2, which holds it: 96 of 128 reused (the last block is computed again).
    let (status, v) = complete(addr, "tiny", &p2).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 96,
        "{v}"
    );
    // p1 is new: all tie at 0 (none busy), and it goes where its first block ranks it
    // (never the first name by default); then again to that engine, which reuses 96.
    let (status, v) = complete(addr, "tiny", &p1).await;
    assert_eq!(
        (
            status,
            &v["usage"]["prompt_tokens_details"]["cached_tokens"]
        ),
        (200, &serde_json::json!(0)),
        "{v}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let p1_on = loop {
        if let Some((on, tokens)) = known("", &p1)
            && tokens == 4 * VLLM_BLOCK
        {
            break on;
        }
        assert!(
            Instant::now() < deadline,
            "nobody holds p1: {:?}",
            known("", &p1)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (status, v) = complete(addr, "tiny", &p1).await;
    assert_eq!(
        (
            status,
            &v["usage"]["prompt_tokens_details"]["cached_tokens"]
        ),
        (200, &serde_json::json!(96)),
        "{v}"
    );
    // p3 for the adapter, served by e2 before (straight to it). Nothing of p3 is held for the
    // base model: a router scoring the base model's prefixes would tie at 0 and send it to e1
    // by name. This one reads the adapter from the request's `model`: e2, which reuses 96.
    let p3 = prompt(3);
    assert_eq!(engines[1].complete_as("tiny-lora", &p3).await, 0);
    settle("tiny-lora", p3.clone(), "e2").await;
    assert_eq!(known("", &p3), None, "the base model holds nothing of p3");
    let (status, v) = complete(addr, "tiny-lora", &p3).await;
    assert_eq!(
        (
            status,
            &v["usage"]["prompt_tokens_details"]["cached_tokens"]
        ),
        (200, &serde_json::json!(96)),
        "the adapter's request did not reach its holder: {v}"
    );
    let metrics = router.metrics();
    // e2: p2 and p3; p1 twice where it went.
    let served = |name: &str| 2 * u32::from(name == "e2") + 2 * u32::from(*name == *p1_on);
    for name in names {
        let n = served(name);
        if n == 0 {
            for family in [
                "kvevent_router_predictions_total",
                "kvevent_router_responses_total",
            ] {
                let line = format!("{family}{{replica=\"{name}\"");
                assert!(!metrics.contains(&line), "{name} served nothing: {metrics}");
            }
            continue;
        }
        for needle in [
            format!("kvevent_router_predictions_total{{replica=\"{name}\",outcome=\"exact\"}} {n}"),
            format!("kvevent_router_responses_total{{replica=\"{name}\",code=\"200\"}} {n}"),
        ] {
            assert!(metrics.contains(&needle), "no {needle} in\n{metrics}");
        }
    }
    // The rule against round-robin on a shared-prefix workload: 96 requests one after another
    // over 32 system prompts of four blocks (twice what one engine's cache holds, two thirds of
    // the fleet's), each with a user turn of its own, the prompts in a seeded random order
    // (the same for both policies; their tokens differ). Round-robin sends every prompt to
    // every engine, which computes it once and then evicts it; the rule keeps each prompt on
    // one engine, which keeps it. vLLM's own counters say how much each reused.
    let order: Vec<u32> = {
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        (0..96)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 32) as u32
            })
            .collect()
    };
    let hit_rate = |policy: &'static str, seed: u32| {
        let (engines, order, serve) = (&engines, &order, &serve);
        async move {
            let (router, addr, _server) = serve(policy.parse().expect("a policy")).await;
            // Each engine's (prefix-cache hits, queries) in tokens.
            let counters = || async {
                let mut all = Vec::new();
                for e in engines.iter() {
                    all.push((
                        e.metric("vllm:prefix_cache_hits_total").await,
                        e.metric("vllm:prefix_cache_queries_total").await,
                    ));
                }
                all
            };
            let before = counters().await;
            // Seeds apart (mod 1000) start apart: no prompt shares a first block with another.
            for (request, &system) in (0u32..).zip(order) {
                let mut ids: Vec<u32> = prompt(seed + system);
                ids.extend(prompt(seed + 100 + request).into_iter().take(40));
                let (status, v) = complete(addr, "tiny", &ids).await;
                assert_eq!(status, 200, "{v}");
                // Each request's blocks reach the router before the next (as a router under
                // load would see its earlier requests' effects).
                let deadline = Instant::now() + Duration::from_secs(30);
                while router
                    .fleet()
                    .score(&kvevent_fleet::Query {
                        adapter: "",
                        keys: kvevent_fleet::QueryKeys::Tokens {
                            ids: &ids,
                            block_size: VLLM_BLOCK as usize,
                        },
                    })
                    .ok()
                    .and_then(|s| s.first().map(|s| s.matched_tokens))
                    != Some(5 * VLLM_BLOCK)
                {
                    assert!(
                        Instant::now() < deadline,
                        "the router never knew request {request}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            let after = counters().await;
            let delta: Vec<(f64, f64)> = after
                .iter()
                .zip(&before)
                .map(|(a, b)| (a.0 - b.0, a.1 - b.1))
                .collect();
            let (hits, queries) = delta.iter().fold((0.0, 0.0), |s, d| (s.0 + d.0, s.1 + d.1));
            let shares: Vec<String> = delta
                .iter()
                .map(|d| format!("{:.0} %", 100.0 * d.1 / queries))
                .collect();
            eprintln!(
                "{policy}: hit rate {:.3} ({hits} of {queries} prompt tokens), requests by engine {}",
                hits / queries,
                shares.join(" / ")
            );
            hits / queries
        }
    };
    let round_robin = hit_rate("round-robin", 10).await;
    let cost = hit_rate("cost", 500).await;
    assert!(
        cost >= 2.0 * round_robin,
        "the rule's hit rate {cost:.3} is not twice round-robin's {round_robin:.3}"
    );
    // e1's API server killed, its engine core alive (its KV events still flow): a router
    // asking each engine's /health reads e1 server_down and passes it over under every
    // policy, even for the prompt e1 holds; its requests get 200 from another engine, none
    // sent to e1 first (no retry counted for it).
    let held_by_e1 = prompt(900);
    assert_eq!(engines[0].complete(&held_by_e1).await, 0);
    assert!(engines[0].kill_api_server(), "an API server to kill");
    for policy in kvevent_fleet::route::Policy::NAMES {
        let mut config = router_by(policy.parse().expect("a policy"));
        let engines = config
            .replicas
            .iter_mut()
            .filter_map(|l| match &mut l.part {
                Part::Source(ReplicaSource::Engine(sockets)) => Some(sockets),
                _ => None,
            });
        for (sockets, http) in engines.zip(&servers) {
            sockets.http = Some(format!("http://{http}"));
        }
        let router = Arc::new(Router::start(config).expect("router"));
        let (addr, _server) = router::bind("127.0.0.1:0", router.clone())
            .await
            .expect("bind");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !router
            .fleet()
            .replicas()
            .iter()
            .any(|r| r.name == "e1" && r.state.reason() == Some("server_down"))
        {
            assert!(
                Instant::now() < deadline,
                "{policy}: e1 never read server_down: {:?}",
                router.fleet().replicas()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for i in 0..6u32 {
            let ids = if i % 2 == 0 {
                held_by_e1.clone()
            } else {
                prompt(950 + i)
            };
            let (status, v) = complete(addr, "tiny", &ids).await;
            assert_eq!(status, 200, "{policy}, request {i}: {v}");
        }
        let metrics = router.metrics();
        assert!(
            !metrics.contains("kvevent_router_responses_total{replica=\"e1\"")
                && !metrics.contains("kvevent_router_retries_total{replica=\"e1\""),
            "{policy}: a request went to e1, whose server is down:\n{metrics}"
        );
    }
    for e in &mut engines {
        e.stop();
    }
}
