//! Engine → sidecar → server over loopback sockets, with stats and our HTTP endpoint.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use kvevent_proto as pb;
use kvevent_sidecar::demo;
use kvevent_sidecar::settings::GoDuration;
use kvevent_sidecar::{Settings, start};
use kvevent_test_support::{HeldPort, Publisher, PublisherConfig};
use kvevent_test_support::{Received, RecordingServer, distinct_prefixes, eventually, when};
use kvevent_wire::Release;
use kvevent_zmq::publisher::scripted_batch;

use crate::{ends, http_get, loopback};

pub(crate) const WAIT: Duration = Duration::from_secs(15);

/// With `/metrics` served on a port of its own.
pub(crate) fn settings(engine: &Publisher, server: &RecordingServer) -> Settings {
    Settings {
        metrics_address: "127.0.0.1:0".into(),
        engine_cache_size_bytes: 1_000_000,
        ..loopback(engine, server)
    }
}

pub(crate) fn stats_of(received: &[Received]) -> Vec<pb::ReplicaStats> {
    received
        .iter()
        .filter_map(|r| match r {
            Received::Update(u) => u.stats.clone(),
            Received::Event(_) => None,
        })
        .collect()
}

pub(crate) async fn wait_subscribed(engine: &Publisher) {
    assert!(tokio::task::block_in_place(
        || engine.wait_for_subscribers(1, WAIT)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_and_stats_flow_end_to_end() {
    let (server, ctx, engine) = ends().await;
    let (metrics_addr, metrics_task) = demo::serve_metrics(demo::METRICS_FIXTURE)
        .await
        .expect("metrics");
    let s = Settings {
        engine_metrics_url: format!("http://{metrics_addr}/metrics").into(),
        stats_interval: GoDuration::ms(100),
        max_concurrency_ceiling: 10,
        ..settings(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    wait_subscribed(&engine).await;
    for step in 0..2 {
        engine.publish(&scripted_batch(step)).expect("publish");
    }
    // Step 0 stores 4 blocks, step 1 extends with 2 (counts 80, 96); once they are on the
    // server, step 2 evicts the two and offloads. (Published together, the forwarder would net
    // the stores and evictions of one window to nothing.)
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 6).await;
    engine.publish(&scripted_batch(2)).expect("publish");
    server
        .wait_for(WAIT, |r| {
            r.iter().filter(|x| matches!(x, Received::Event(_))).count() >= 3
                && stats_of(r).len() >= 2
        })
        .await;
    let events = server.events();
    assert_eq!(
        events[0].r#type,
        pb::cache_event::Type::AllCleared as i32,
        "startup clear first"
    );
    let prefixes = server.prefixes();
    let counts: Vec<i32> = prefixes.iter().map(|p| p.token_count).collect();
    assert!(counts.starts_with(&[16, 32, 48, 64, 80, 96]), "{counts:?}");
    let stats = stats_of(&server.received());
    let last = stats.last().expect("stats");
    assert_eq!(last.replica_id, "r1");
    assert_eq!(last.cache_memory_bytes, 83_700, "usage 0.0837 of 1 MB");
    assert!(
        (last.pressure - 0.7).abs() < 1e-6,
        "(5 running + 2 waiting) / 10"
    );
    assert_eq!(last.client_version, kvevent_sidecar::CLIENT_VERSION);

    let addr = running.metrics_addr().expect("metrics address");
    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200);
    for needle in [
        "kvevent_build_info{version=",
        // OpenMetrics: a counter's family is named without `_total`, its samples with it.
        "# TYPE kvevent_events_received counter",
        "kvevent_events_received_total{source=",
        "kvevent_batches_received_total{source=",
        "kvevent_prefixes_sent_total ",
        "kvevent_scrapes_total{outcome=\"ok\"}",
        "kvevent_stats_reports_total{outcome=\"ok\"}",
        "kvevent_scrape_non_finite_samples_total 0",
        "kvevent_source_resets_total{source=",
        "kvevent_dropped_total{kind=\"prefix\",reason=\"overflow\"} 0",
        "kvevent_dropped_total{kind=\"report\",reason=\"after_shutdown\"} 0",
    ] {
        assert!(
            body.contains(needle),
            "{needle} missing from /metrics:\n{body}"
        );
    }
    // Every exposed line parses back with our own parser.
    let parsed = kvevent_scrape::text::parse(&body).expect("our /metrics parses");
    let stored = parsed
        .series("kvevent_events_received_total")
        .find(|s| s.label("type") == Some("stored"))
        .expect("stored events");
    assert_eq!(stored.value, 3.0, "one BlockStored in each of the 3 steps");
    // The distributions saw the traffic: calls by method, report ages, update sizes, window
    // sends, scrapes.
    let count = |name: &str, label: Option<(&str, &str)>| -> f64 {
        parsed
            .series(name)
            .filter(|s| label.is_none_or(|(k, v)| s.label(k) == Some(v)))
            .map(|s| s.value)
            .sum()
    };
    assert!(
        count(
            "kvevent_rpc_duration_seconds_count",
            Some(("method", "ReportCacheState"))
        ) >= 1.0
    );
    assert!(
        count(
            "kvevent_rpc_duration_seconds_count",
            Some(("method", "PublishEvent"))
        ) >= 1.0
    );
    assert!(count("kvevent_report_age_seconds_count", None) >= 1.0);
    assert!(count("kvevent_update_entries_count", None) >= 1.0);
    // Every window sent is timed, within the histogram's range (a sum of a few seconds at most).
    let windows = count("kvevent_window_send_seconds_count", None);
    assert!(windows >= 1.0);
    assert!((0.0..windows * 30.0).contains(&count("kvevent_window_send_seconds_sum", None)));
    assert!(count("kvevent_scrape_duration_seconds_count", None) >= 1.0);
    let inf = parsed
        .series("kvevent_update_entries_bucket")
        .find(|s| s.label("le") == Some("+Inf"))
        .unwrap_or_else(|| panic!("+Inf bucket:\n{body}"));
    assert_eq!(inf.value, count("kvevent_update_entries_count", None));
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    assert_eq!(http_get(addr, "/readyz").await.0, 200);
    assert_eq!(http_get(addr, "/nope").await.0, 404);
    let left = running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(left.unsent_prefixes + left.unsent_events, 0);
    metrics_task.abort();
}

/// `--scrape-max-bytes`: a body past it fails the scrape, counted as `too_large`, and no stats
/// come from it; with room for the body, stats flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_metrics_body_past_scrape_max_bytes_fails_the_scrape() {
    let (metrics_addr, metrics_task) = demo::serve_metrics(demo::METRICS_FIXTURE)
        .await
        .expect("metrics fixture");
    assert!(demo::METRICS_FIXTURE.len() > 1000);
    for (max, fits) in [(1000, false), (demo::METRICS_FIXTURE.len() + 1, true)] {
        let (server, ctx, engine) = ends().await;
        let s = Settings {
            engine_metrics_url: format!("http://{metrics_addr}/metrics").into(),
            stats_interval: GoDuration::ms(50),
            scrape_max_bytes: max,
            ..settings(&engine, &server)
        };
        let running = start(&s, &ctx).await.expect("start");
        let scrapes = |outcome: &str| {
            running
                .telemetry()
                .scrapes
                .outcomes
                .lock()
                .map(|m| m.get(outcome).copied().unwrap_or(0))
                .unwrap_or(0)
        };
        if fits {
            server.wait_for(WAIT, |r| !stats_of(r).is_empty()).await;
            assert_eq!(scrapes("too_large"), 0);
        } else {
            // The second failed scrape comes after the first one's tick is over.
            eventually("too-large scrapes counted", WAIT, || async {
                when(scrapes("too_large"), |n| *n >= 2)
            })
            .await;
            assert!(stats_of(&server.received()).is_empty());
            assert_eq!(scrapes("ok"), 0);
        }
        running.shutdown(Duration::from_secs(2)).await;
    }
    metrics_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_scrape_never_touches_the_event_path() {
    let (server, ctx, engine) = ends().await;
    let closed = HeldPort::new();
    let s = Settings {
        engine_metrics_url: format!("http://{}/metrics", closed.addr()).into(),
        stats_interval: GoDuration::ms(50),
        scrape_timeout: GoDuration::ms(200),
        ..settings(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    wait_subscribed(&engine).await;
    engine.publish(&scripted_batch(0)).expect("publish");
    server
        .wait_for(WAIT, |r| {
            r.iter()
                .any(|x| matches!(x, Received::Update(u) if !u.prefixes.is_empty()))
        })
        .await;
    eventually("scrape failures counted", WAIT, || async {
        let failed = running
            .telemetry()
            .scrapes
            .outcomes
            .lock()
            .map(|m| m.get("request").copied().unwrap_or(0))
            .unwrap_or(0);
        when(failed, |n| *n >= 2)
    })
    .await;
    assert!(stats_of(&server.received()).is_empty());
    running.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_adds_still_in_their_window() {
    let (server, ctx, engine) = ends().await;
    // Stats reports go to the same server on their own: one that arrives after the forwarder
    // holds the adds is the later event that proves they were not sent.
    let (metrics_addr, metrics_task) = demo::serve_metrics(demo::METRICS_FIXTURE)
        .await
        .expect("metrics fixture");
    let s = Settings {
        window: GoDuration::secs(60),
        engine_metrics_url: format!("http://{metrics_addr}/metrics").into(),
        stats_interval: GoDuration::ms(50),
        ..settings(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    wait_subscribed(&engine).await;
    engine.publish(&scripted_batch(0)).expect("publish");
    engine.publish(&scripted_batch(1)).expect("publish");
    // Both batches read, and the forwarder holds their adds.
    let depth = || {
        running
            .telemetry()
            .delivery
            .forwarder
            .queue_depth
            .load(Relaxed)
    };
    eventually("the adds in the forwarder", WAIT, || async {
        let batches = running.telemetry().sources.metrics[0].batches.load(Relaxed);
        when((batches, depth()), |(b, d)| *b >= 2 && *d > 0)
    })
    .await;
    let stats_before = stats_of(&server.received()).len();
    server
        .wait_for(WAIT, |r| stats_of(r).len() > stats_before)
        .await;
    assert!(
        server.prefixes().is_empty(),
        "still inside the one-minute window"
    );
    assert!(depth() > 0, "still held, not sent");
    let left = running.shutdown(Duration::from_secs(5)).await;
    metrics_task.abort();
    assert_eq!(left.unsent_prefixes + left.unsent_events, 0);
    assert_eq!(
        server.prefixes().len(),
        6,
        "all 6 blocks flushed by the drain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dp_rank_restart_evicts_only_that_rank() {
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let engines: Vec<Publisher> = (0..2)
        .map(|rank| {
            let config = PublisherConfig {
                endpoint: kvevent_zmq::dp_endpoint("inproc://dp-test", rank).expect("ep"),
                replay_endpoint: Some(
                    kvevent_zmq::dp_endpoint("inproc://dp-test-replay", rank).expect("ep"),
                ),
                ..PublisherConfig::loopback(Release::NEWEST_KNOWN)
            };
            Publisher::start(&ctx, config).expect("engine")
        })
        .collect();
    let s = Settings {
        engine_endpoint: "inproc://dp-test".into(),
        replay_endpoint: "inproc://dp-test-replay".into(),
        dp_size: 2,
        // The assertions name engine block hashes.
        key_mode: kvevent_mapper::KeyMode::Engine,
        ..settings(&engines[0], &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    for e in &engines {
        wait_subscribed(e).await;
    }
    engines[0].publish(&scripted_batch(0)).expect("publish");
    engines[1].publish(&scripted_batch(3)).expect("publish");
    engines[1].publish(&scripted_batch(4)).expect("publish");
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 10).await;
    // Rank 1 restarts (its seq goes back below 1): its 6 blocks are evicted one by one;
    // rank 0's stay.
    engines[1].restart();
    engines[1].publish(&scripted_batch(6)).expect("publish");
    server
        .wait_for(WAIT, |r| {
            r.iter().filter(|x| matches!(x, Received::Event(_))).count() >= 7
        })
        .await;
    let events = server.events();
    let clears = events
        .iter()
        .filter(|e| e.r#type == pb::cache_event::Type::AllCleared as i32)
        .count();
    let evicted: Vec<Vec<u8>> = events
        .iter()
        .filter(|e| e.r#type == pb::cache_event::Type::PrefixEvicted as i32)
        .map(|e| e.prefix_hash.clone())
        .collect();
    assert_eq!(clears, 1, "only the startup clear");
    let mut want: Vec<Vec<u8>> = (0..6u64)
        .map(|b| (1_000 + b + 1).to_be_bytes().to_vec())
        .collect();
    let mut got = evicted.clone();
    got.sort();
    want.sort();
    assert_eq!(got, want, "rank 1's prompt 1 blocks");
    assert_eq!(
        running.telemetry().sources.metrics[1]
            .restarts
            .load(Relaxed),
        1
    );
    running.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resident_blocks_are_refreshed_within_the_interval() {
    let (server, ctx, engine) = ends().await;
    let s = Settings {
        refresh_interval: GoDuration::ms(500),
        ..settings(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    wait_subscribed(&engine).await;
    engine.publish(&scripted_batch(0)).expect("publish");
    // Stored once by the engine, the 4 blocks reach the server again and again: each resident
    // block at least once per 500 ms, with no new event.
    server
        .wait_for(WAIT, |r| {
            r.iter()
                .filter_map(|x| match x {
                    Received::Update(u) => Some(u.prefixes.len()),
                    Received::Event(_) => None,
                })
                .sum::<usize>()
                >= 12
        })
        .await;
    assert_eq!(distinct_prefixes(&server.received()), 4);
    let addr = running.metrics_addr().expect("metrics address");
    let (_, body) = http_get(addr, "/metrics").await;
    let refreshed: f64 = body
        .lines()
        .find(|l| l.starts_with("kvevent_refreshed_prefixes_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("refreshed counter");
    assert!(refreshed >= 8.0, "{refreshed}");
    running.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_engine_is_read_with_engine_sglang_salts_and_eagle_pairs_included() {
    let vectors = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/vectors");
    let payload = |case: &str| std::fs::read(vectors.join(case)).expect("vector");
    let (server, ctx, engine) = ends().await;
    // The Go sidecar's flag: --hash-scheme sglang picks SGLang's wire.
    let s = Settings::load(
        None,
        serde_json::json!({
            "engine_endpoint": engine.endpoint(),
            "replay_endpoint": engine.replay_endpoint().unwrap_or_default(),
            "server": server.addr().to_string(),
            "replica_id": "r1",
            "model_id": "m",
            "metrics_address": "127.0.0.1:0",
            "engine_metrics_url": "",
            "window": "20ms",
            "hash_scheme": "sglang",
        }),
    )
    .expect("settings");
    assert_eq!(s.engine, kvevent_wire::Engine::Sglang);
    let running = start(&s, &ctx).await.expect("start");
    wait_subscribed(&engine).await;
    // SGLang's own bytes: a salted store beside an unsalted one (0.5.18), EAGLE pairs (0.5.3),
    // map events with a LoRA name (0.5.23).
    for case in [
        "sglang-0.5.18/cache_salt.msgpack",
        "sglang-0.5.3/eagle.msgpack",
        "sglang-0.5.23/lora.msgpack",
    ] {
        engine.publish_payload(payload(case));
    }
    let metrics = &running.telemetry().sources.metrics[0];
    eventually("the SGLang batches", WAIT, || async {
        when(metrics.batches.load(Relaxed), |n| *n >= 3)
    })
    .await;
    assert_eq!(
        metrics
            .decode_failures
            .iter()
            .map(|c| c.load(Relaxed))
            .sum::<u64>(),
        0,
        "every SGLang batch decodes"
    );
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 4).await;
    running.shutdown(Duration::from_secs(2)).await;
}

/// `--engine-bind`: the engine connects to the sidecar. The sidecar restarts while the engine
/// publishes; the engine's PUB delivers what it queued meanwhile, older than what the startup
/// replay returned. Those are duplicates, not an engine restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_restarted_beside_a_connecting_engine_sees_no_false_restart() {
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let port = HeldPort::new();
    let endpoint = port.tcp();
    drop(port);
    let engine = Publisher::start(
        &ctx,
        PublisherConfig {
            endpoint: endpoint.clone(),
            bind: Some(false),
            ..PublisherConfig::loopback(Release::NEWEST_KNOWN)
        },
    )
    .expect("engine");
    let s = Settings {
        engine_bind: true,
        engine_endpoint: endpoint.as_str().into(),
        stats_interval: GoDuration::ms(0),
        ..settings(&engine, &server)
    };
    let first = start(&s, &ctx).await.expect("start");
    wait_subscribed(&engine).await;
    for step in 0..5 {
        engine.publish(&scripted_batch(step)).expect("publish");
    }
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 4).await;
    first.shutdown(Duration::from_secs(2)).await;
    // Published while the sidecar is away: queued in the engine's PUB.
    for step in 5..10 {
        engine.publish(&scripted_batch(step)).expect("publish");
    }
    // libzmq closes the first sidecar's listener on its own I/O thread, shortly after shutdown
    // returns: bind again until it has.
    let deadline = tokio::time::Instant::now() + WAIT;
    let second = loop {
        match start(&s, &ctx).await {
            Ok(running) => break running,
            Err(e)
                if kvevent_sidecar::error_chain(&e).contains("Address already in use")
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("start again: {}", kvevent_sidecar::error_chain(&e)),
        }
    };
    let addr = second.metrics_addr().expect("metrics address");
    // The second sidecar's own subscription (the first's still counts): published before it
    // arrives, a batch finds no subscriber and is gone.
    assert!(tokio::task::block_in_place(
        || engine.wait_for_subscribers(2, WAIT)
    ));
    for step in 10..15 {
        engine.publish(&scripted_batch(step)).expect("publish");
    }
    let metrics = eventually("last seq 14", WAIT, || async {
        let (_, metrics) = http_get(addr, "/metrics").await;
        when(metrics, |m| {
            m.contains("kvevent_source_last_seq{") && m.contains("} 14\n")
        })
    })
    .await;
    let restarts: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("kvevent_engine_restarts_total{"))
        .collect();
    assert!(
        !restarts.is_empty() && restarts.iter().all(|l| l.ends_with(" 0")),
        "{restarts:?}"
    );
    second.shutdown(Duration::from_secs(2)).await;
}
