//! The sidecar's own HTTP endpoint: `/readyz` saying what it waits for (the server, a silent
//! engine, a degraded source, and for how long), and `/metrics` exporting what the docs list.

use std::time::Duration;

use kvevent_sidecar::settings::GoDuration;
use kvevent_sidecar::{Settings, start};
use kvevent_test_support::HeldPort;
use kvevent_test_support::{distinct_prefixes, eventually, when};
use kvevent_wire::Release;
use kvevent_zmq::publisher::scripted_batch;

#[allow(clippy::wildcard_imports, reason = "the end-to-end tests' helpers")]
use crate::e2e::*;
use crate::{ends, http_get};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_waits_for_the_server_to_accept_something() {
    let (mut server, ctx, engine) = ends().await;
    server.stop().await;
    let s = Settings {
        rpc_timeout: GoDuration::ms(300),
        ..settings(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let addr = running.metrics_addr().expect("addr");
    // The engine socket must be seen connected first, or /readyz rightly
    // names the socket instead of the server.
    wait_subscribed(&engine).await;
    let body = eventually("the engine seen connected", WAIT, || async {
        let (status, body) = http_get(addr, "/readyz").await;
        assert_eq!(status, 503, "{body}");
        when(body, |b| !b.contains("engine socket"))
    })
    .await;
    assert!(
        body.contains("no report accepted") || body.contains("the server cannot be reached"),
        "{body}"
    );
    assert_eq!(
        http_get(addr, "/healthz").await.0,
        200,
        "alive all the same"
    );
    server.restart().await;
    engine.publish(&scripted_batch(0)).expect("publish");
    eventually("ready", WAIT, || async {
        when(http_get(addr, "/readyz").await, |(status, _)| {
            *status == 200
        })
    })
    .await;
    running.shutdown(Duration::from_secs(5)).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_docs_list_is_exported_and_every_exported_one_is_listed() {
    let (server, ctx, engine) = ends().await;
    // With the router feed on, so that its families are exported too.
    let s = Settings {
        feed_address: "127.0.0.1:0".into(),
        ..settings(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let addr = running.metrics_addr().expect("metrics address");
    let (_, body) = http_get(addr, "/metrics").await;
    assert!(
        body.ends_with("# EOF\n"),
        "OpenMetrics text ends with # EOF"
    );
    // Families as queried: a counter family `x` is sampled as `x_total`.
    let exported: std::collections::BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (name, kind) = (w.next()?, w.next()?);
            Some(if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            })
        })
        .collect();
    let listed = crate::docs::listed_metrics();
    let missing: Vec<_> = listed.difference(&exported).collect();
    let unlisted: Vec<_> = exported.difference(&listed).collect();
    assert!(
        missing.is_empty(),
        "listed in docs/operating.md, not exported: {missing:?}"
    );
    assert!(
        unlisted.is_empty(),
        "exported, not in docs/operating.md: {unlisted:?}"
    );
    running.shutdown(Duration::from_secs(2)).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_engine_makes_readyz_say_why_until_it_sends() {
    let (server, ctx, engine) = ends().await;
    let s = Settings {
        engine_silence_grace: GoDuration::ms(300),
        stats_interval: GoDuration::ms(0),
        ..settings(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let addr = running.metrics_addr().expect("metrics address");
    wait_subscribed(&engine).await;
    // Once the grace has passed in silence, /readyz says why.
    eventually("not ready: no KV events", WAIT, || async {
        when(http_get(addr, "/readyz").await, |(status, body)| {
            *status == 503 && body.contains("no KV events from any engine source")
        })
    })
    .await;
    let (_, metrics) = http_get(addr, "/metrics").await;
    assert!(
        metrics.contains("kvevent_source_last_batch_age_seconds{source="),
        "{metrics}"
    );
    engine.publish(&scripted_batch(0)).expect("publish");
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 4).await;
    let (status, body) = http_get(addr, "/readyz").await;
    assert_eq!((status, body.as_str()), (200, "ready\n"));
    running.shutdown(Duration::from_secs(2)).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_shows_whether_its_socket_reaches_the_engine() {
    let (server, ctx, engine) = ends().await;
    // A port nobody listens on never connects: a sidecar on one runs beside the other from
    // the start, and is looked at once the other has connected and seen its engine go.
    let nothing = HeldPort::new();
    let unreachable = Settings {
        engine_endpoint: nothing.tcp().into(),
        replay_endpoint: Default::default(),
        server: server.addr().to_string().into(),
        replica_id: "r2".into(),
        model_id: "llama".into(),
        metrics_address: Default::default(),
        engine_metrics_url: Default::default(),
        ..Settings::default()
    };
    let never = start(&unreachable, &ctx).await.expect("start");
    let running = start(&settings(&engine, &server), &ctx)
        .await
        .expect("start");
    wait_subscribed(&engine).await;
    let connected =
        |r: &kvevent_sidecar::Running| r.telemetry().sources.health[0].get().is_connected();
    eventually("connected", WAIT, || async {
        when(connected(&running), |c| *c)
    })
    .await;
    let addr = running.metrics_addr().expect("metrics");
    let (_, body) = http_get(addr, "/metrics").await;
    assert!(
        body.contains("kvevent_source_connected{source=\""),
        "{body}"
    );
    assert!(
        body.lines()
            .any(|l| l.starts_with("kvevent_source_connected{") && l.ends_with(" 1"))
    );
    // The engine goes away: the gauge drops.
    engine.shutdown();
    eventually("disconnected", WAIT, || async {
        when(connected(&running), |c| !*c)
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    assert!(!connected(&never));
    never.shutdown(Duration::from_secs(2)).await;
}
/// A source degraded by batches the engine cannot replay: the sidecar still serves, and
/// /readyz says which source, why and for how long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_says_which_source_is_degraded_and_for_how_long() {
    let (server, ctx, engine) = ends().await;
    let s = Settings {
        replay_endpoint: Default::default(),
        stats_interval: GoDuration::ms(0),
        ..settings(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let addr = running.metrics_addr().expect("metrics address");
    wait_subscribed(&engine).await;
    engine.publish(&scripted_batch(0)).expect("publish");
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 4).await;
    let (status, body) = http_get(addr, "/readyz").await;
    assert_eq!((status, body.as_str()), (200, "ready\n"));
    // Seq 1 never arrives, and there is no replay endpoint to ask for it.
    engine.publish_lost(
        kvevent_wire::encode(&scripted_batch(1), Release::NEWEST_KNOWN).expect("encode"),
    );
    engine.publish(&scripted_batch(2)).expect("publish");
    let (_, body) = eventually("ready, degraded", WAIT, || async {
        when(http_get(addr, "/readyz").await, |(status, body)| {
            *status == 200 && body.contains("degraded: batches were lost")
        })
    })
    .await;
    assert!(body.starts_with("ready; tcp://"), "{body}");
    assert!(body.contains(" s\n"), "for how long: {body}");
    running.shutdown(Duration::from_secs(2)).await;
}
