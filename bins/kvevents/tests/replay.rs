//! `kvevents publish --recording` into the real sidecar: streams from the Python publishers
//! built as vLLM's and SGLang's are, recorded, published again and applied, leave the state the
//! live stream left; replayed at speed its order, seqs and bytes hold.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use common::{WAIT, publish, record, scratch, stop, wait_recorded};
use kvevent_recording::Record;
use kvevent_sidecar::settings::GoDuration;
use kvevent_sidecar::{Settings, start};
use kvevent_test_support::{PythonPublisher, Received, RecordingServer, eventually, when};
use kvevent_wire as wire;
fn sidecar(
    endpoint: &str,
    replay: &str,
    engine: wire::Engine,
    server: &RecordingServer,
) -> Settings {
    Settings {
        engine_endpoint: endpoint.into(),
        replay_endpoint: replay.into(),
        engine,
        server: server.addr().to_string().into(),
        replica_id: "r1".into(),
        model_id: "m".into(),
        metrics_address: Default::default(),
        engine_metrics_url: Default::default(),
        window: GoDuration::ms(20),
        ..Settings::default()
    }
}
/// What the server holds at the end: every prefix added and not evicted or cleared since, with
/// its token count, tier and adapter.
fn resident(received: &[Received]) -> BTreeMap<Vec<u8>, (i32, i32, String)> {
    let mut held = BTreeMap::new();
    for r in received {
        match r {
            Received::Update(u) => {
                for p in &u.prefixes {
                    held.insert(
                        p.prefix_hash.clone(),
                        (p.token_count, p.tier, p.adapter_id.clone()),
                    );
                }
            }
            Received::Event(e) if e.prefix_hash.is_empty() => held.clear(),
            Received::Event(e) => {
                held.remove(&e.prefix_hash);
            }
        }
    }
    held
}
/// Runs the sidecar against `endpoint` until it applied seq `last`, drains it; the server's
/// resident state.
async fn sidecar_state(
    endpoint: &str,
    replay: &str,
    engine: wire::Engine,
    last: u64,
) -> BTreeMap<Vec<u8>, (i32, i32, String)> {
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    let running = start(&sidecar(endpoint, replay, engine, &server), &ctx)
        .await
        .expect("the sidecar starts");
    eventually(&format!("the sidecar applied seq {last}"), WAIT, || async {
        let m = &running.telemetry().sources.metrics[0];
        let seen = (m.batches.load(Relaxed), m.last_seq.load(Relaxed));
        when(seen, |(batches, seq)| *batches > 0 && *seq >= last)
    })
    .await;
    let left = running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(left.unsent_prefixes + left.unsent_events, 0);
    resident(&server.received())
}
/// An engine's stream recorded, then replayed into a second sidecar: the server holds the same.
async fn recorded_and_replayed_into_the_sidecar_leaves_the_same_state(
    python: PythonPublisher,
    engine: wire::Engine,
    word: &str,
    count: usize,
) {
    let dir = scratch(word);
    let path = dir.join("live.kvrec");
    let recorder = record(&python.endpoint, &python.replay_endpoint, word, &path);
    // Live: the sidecar follows the engine as the recorder does.
    let live = sidecar_state(
        &python.endpoint,
        &python.replay_endpoint,
        engine,
        count as u64 - 1,
    )
    .await;
    let records = wait_recorded(&path, count);
    stop(recorder);
    drop(python);
    assert!(!live.is_empty());
    let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        (0..count as u64).collect::<Vec<_>>(),
        "every batch, in order"
    );
    // Replayed, ten times as fast, into a fresh sidecar.
    let (publisher, endpoint, replay) = publish(&path, "10", 1);
    let replayed = sidecar_state(&endpoint, &replay, engine, count as u64 - 1).await;
    let _ = publisher.wait_with_output();
    assert_eq!(replayed, live, "the same server state as live");
    let _ = std::fs::remove_dir_all(&dir);
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_stream_recorded_and_replayed_into_the_sidecar_leaves_the_same_state() {
    let python = PythonPublisher::spawn("0.33.0", &["--count", "30", "--interval", "0.01"]);
    recorded_and_replayed_into_the_sidecar_leaves_the_same_state(
        python,
        wire::Engine::Vllm,
        "vllm",
        30,
    )
    .await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_stream_recorded_and_replayed_into_the_sidecar_leaves_the_same_state() {
    let python = PythonPublisher::spawn_sglang(
        "0.5.23",
        &[
            "--count",
            "20",
            "--interval",
            "0.01",
            "--topic",
            "kv-events",
        ],
    );
    recorded_and_replayed_into_the_sidecar_leaves_the_same_state(
        python,
        wire::Engine::Sglang,
        "sglang",
        20,
    )
    .await;
}
#[test]
fn replayed_at_speed_10_it_keeps_its_order_seqs_and_bytes() {
    let dir = scratch("speed");
    let python = PythonPublisher::spawn("0.33.0", &["--count", "40", "--interval", "0.025"]);
    let first = dir.join("first.kvrec");
    let recorder = record(&python.endpoint, &python.replay_endpoint, "vllm", &first);
    let original = wait_recorded(&first, 40);
    stop(recorder);
    drop(python);
    // The replay waits for the second recorder's subscription, then goes at ten times the pace.
    let (publisher, endpoint, replay) = publish(&first, "10", 1);
    let second = dir.join("second.kvrec");
    let recorder = record(&endpoint, &replay, "vllm", &second);
    let again = wait_recorded(&second, 40);
    stop(recorder);
    let _ = publisher.wait_with_output();
    let key = |r: &Record| (r.rank, r.seq, r.topic.clone(), r.payload.clone());
    assert_eq!(
        again.iter().map(key).collect::<Vec<_>>(),
        original.iter().map(key).collect::<Vec<_>>()
    );
    let span = |r: &[Record]| r.last().expect("records").at_us - r[0].at_us;
    assert!(
        span(&again) * 3 < span(&original),
        "not faster: {} µs against {} µs",
        span(&again),
        span(&original)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
