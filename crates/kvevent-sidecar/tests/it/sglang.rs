//! SGLang engines end to end: a publisher built as SGLang's is (msgspec + pyzmq, each
//! release's structs) drives the real sidecar: the array era with salted stores, the map era
//! with EAGLE pairs, and a restart.

use std::time::Duration;

use kvevent_proto as pb;
use kvevent_sidecar::{Settings, start};
use kvevent_test_support::{
    HeldPort, PythonPublisher, Received, RecordingServer, eventually, when,
};

const WAIT: Duration = Duration::from_secs(20);

fn settings(engine: &PythonPublisher, server: &RecordingServer) -> Settings {
    Settings::load(
        None,
        serde_json::json!({
            "engine": "sglang",
            "engine_endpoint": engine.endpoint,
            "replay_endpoint": engine.replay_endpoint,
            "server": server.addr().to_string(),
            "replica_id": "r1",
            "model_id": "m",
            "metrics_address": "",
            "engine_metrics_url": "",
            "window": "20ms",
        }),
    )
    .expect("settings")
}

/// (key, adapter) of every prefix the server received.
fn prefixes(received: &[Received]) -> Vec<(Vec<u8>, String)> {
    received
        .iter()
        .filter_map(|r| match r {
            Received::Update(u) => Some(
                u.prefixes
                    .iter()
                    .map(|p| (p.prefix_hash.clone(), p.adapter_id.clone()))
                    .collect::<Vec<_>>(),
            ),
            Received::Event(_) => None,
        })
        .flatten()
        .collect()
}

fn clears(received: &[Received]) -> usize {
    received
        .iter()
        .filter(|r| matches!(r, Received::Event(e) if e.r#type == pb::cache_event::Type::AllCleared as i32))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_0_5_18_salted_stores_are_their_own_namespace() {
    let engine = PythonPublisher::spawn_sglang("0.5.18", &["--count", "6", "--salt", "tenant-a"]);
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let running = start(&settings(&engine, &server), &ctx)
        .await
        .expect("start");
    let salted = kvevent_mapper::salted_adapter("", "tenant-a");
    // Batches 1, 3, 5 are salted (two blocks each, never removed); batches 0, 2, 4 unsalted,
    // each one's first block removed by the next batch (so netted away when both arrive in
    // one window): at least their second blocks.
    server
        .wait_for(WAIT, |r| {
            let p = prefixes(r);
            p.iter().filter(|(_, a)| a.is_empty()).count() >= 3
                && p.iter().filter(|(_, a)| *a == salted).count() >= 6
        })
        .await;
    running.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_0_5_23_eagle_pairs_are_keyed_as_their_tokens_and_a_restart_clears() {
    let port = |p: &str| p.rsplit(':').next().expect("port").to_owned();
    let engine = PythonPublisher::spawn_sglang("0.5.23", &["--count", "4", "--eagle"]);
    let (pub_port, replay_port) = (port(&engine.endpoint), port(&engine.replay_endpoint));
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let running = start(&settings(&engine, &server), &ctx)
        .await
        .expect("start");
    // Batch 0's tokens 0..32 as pairs [t, t+1]: keyed as the chain of 0..32, blocks of 16
    // (its first block is evicted by batch 1, in the same window: netted, never sent).
    let tokens: Vec<u32> = (0..32).collect();
    let want: Vec<Vec<u8>> = kvevent_fingerprint::chain(&tokens, 16, None)
        .iter()
        .skip(1)
        .map(|b| kvevent_fingerprint::wire_key(b.prefix).to_vec())
        .collect();
    server
        .wait_for(WAIT, |r| {
            let got = prefixes(r);
            want.iter().all(|k| got.iter().any(|(g, _)| g == k))
        })
        .await;
    assert_eq!(clears(&server.received()), 1, "the start's clear only");
    // The engine process dies; a new one takes its ports: the sidecar clears and rebuilds.
    engine.kill();
    let engine = PythonPublisher::spawn_sglang(
        "0.5.23",
        &[
            "--count",
            "4",
            "--eagle",
            "--hash-base",
            "1000",
            "--port",
            &pub_port,
            "--replay-port",
            &replay_port,
        ],
    );
    server.wait_for(WAIT, |r| clears(r) >= 2).await;
    drop(engine);
    running.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_dp_ranks_publish_on_the_port_base_plus_rank() {
    // SGLang places rank r on base + r: two pairs of consecutive ports, held until the end.
    let (pub_ports, replay_ports) = (HeldPort::consecutive(2), HeldPort::consecutive(2));
    let (pub_base, replay_base) = (pub_ports[0].port(), replay_ports[0].port());
    let ranks: Vec<PythonPublisher> = (0..2u16)
        .map(|r| {
            PythonPublisher::spawn_sglang(
                "0.5.23",
                &[
                    "--count",
                    "4",
                    "--rank",
                    &r.to_string(),
                    "--hash-base",
                    &(1000 * r).to_string(),
                    "--port",
                    &(pub_base + r).to_string(),
                    "--replay-port",
                    &(replay_base + r).to_string(),
                ],
            )
        })
        .collect();
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let s = Settings {
        dp_size: 2,
        ..settings(&ranks[0], &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let metrics = running.telemetry().sources.metrics.clone();
    eventually("both ranks' batches", WAIT, || async {
        let batches: Vec<u64> = metrics
            .iter()
            .map(|m| m.batches.load(std::sync::atomic::Ordering::Relaxed))
            .collect();
        when(batches, |b| b.iter().all(|n| *n >= 4))
    })
    .await;
    assert_eq!(running.telemetry().sources.labels.len(), 2);
    running.shutdown(Duration::from_secs(2)).await;
    drop(ranks);
}
