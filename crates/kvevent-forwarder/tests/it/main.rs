//! The forwarder against a real tonic server on loopback.

use std::time::Duration;

use kvevent_forwarder::{self as fwd, DropReason, Submit};
use kvevent_proto as pb;
use kvevent_test_support::{Behaviour, Received, RecordingServer, distinct_prefixes};

const WAIT: Duration = Duration::from_secs(10);

fn update(keys: &[u8], tier: pb::CacheTier) -> pb::Report {
    pb::Report::Update(pb::CacheStateUpdate {
        replica_id: "r1".into(),
        model_id: "m".into(),
        hash_scheme: "vllm".into(),
        timestamp_us: 1,
        prefixes: keys
            .iter()
            .map(|k| pb::PrefixEntry {
                prefix_hash: vec![*k],
                token_count: 16,
                tier: tier as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    })
}

fn adds(keys: &[u8]) -> pb::Report {
    update(keys, pb::CacheTier::T1)
}

fn event(kind: pb::cache_event::Type, key: &[u8]) -> pb::Report {
    pb::Report::Event(pb::CacheEvent {
        r#type: kind as i32,
        replica_id: "r1".into(),
        model_id: "m".into(),
        prefix_hash: key.to_vec(),
        ..Default::default()
    })
}

fn evict(key: u8) -> pb::Report {
    event(pb::cache_event::Type::PrefixEvicted, &[key])
}

fn clear() -> pb::Report {
    event(pb::cache_event::Type::AllCleared, &[])
}

fn config(window_ms: u64) -> fwd::Config {
    fwd::Config {
        window: Duration::from_millis(window_ms),
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..fwd::Config::default()
    }
}

fn client(server: &RecordingServer, rpc_timeout_ms: u64) -> fwd::Client {
    let mut cfg = fwd::ClientConfig::new(server.addr().to_string());
    cfg.rpc_timeout = Duration::from_millis(rpc_timeout_ms);
    cfg.connect_timeout = Duration::from_millis(500);
    fwd::connect(&cfg).expect("client")
}

/// A compact view of what the server received: `U[keys]`, `E<key>`, `C`.
fn trace(server: &RecordingServer) -> Vec<String> {
    server
        .received()
        .into_iter()
        .map(|r| match r {
            Received::Update(u) => format!(
                "U{:?}",
                u.prefixes
                    .iter()
                    .map(|p| p.prefix_hash[0])
                    .collect::<Vec<_>>()
            ),
            Received::Event(e) if e.r#type == pb::cache_event::Type::AllCleared as i32 => {
                "C".into()
            }
            Received::Event(e) => format!("E{}", e.prefix_hash[0]),
        })
        .collect()
}

fn submit(h: &fwd::Handle, r: pb::Report) {
    assert_eq!(h.try_submit(r), Submit::Queued);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adds_in_a_window_coalesce_into_one_call() {
    let server = RecordingServer::start().await;
    let (h, f) = fwd::spawn(client(&server, 2000), config(200));
    submit(&h, adds(&[1, 2]));
    submit(&h, adds(&[2, 3]));
    submit(&h, update(&[3], pb::CacheTier::T2));
    server.wait_for(WAIT, |r| !r.is_empty()).await;
    assert_eq!(trace(&server), ["U[1, 2, 3, 3]"]);
    assert_eq!(server.calls(), 1);
    let m = h.metrics();
    assert_eq!(m.coalesced.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removals_never_overtake_earlier_adds() {
    let server = RecordingServer::start().await;
    let (h, f) = fwd::spawn(client(&server, 2000), config(5_000));
    submit(&h, adds(&[1]));
    submit(&h, evict(1));
    submit(&h, adds(&[1, 2]));
    submit(&h, evict(2));
    // The 5 s window never elapses here: the removals flush the adds before them.
    server.wait_for(WAIT, |r| r.len() >= 4).await;
    assert_eq!(trace(&server), ["U[1]", "E1", "U[1, 2]", "E2"]);
    f.shutdown(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clear_discards_the_adds_buffered_before_it() {
    let server = RecordingServer::start().await;
    let (h, f) = fwd::spawn(client(&server, 2000), config(5_000));
    submit(&h, adds(&[1, 2, 3]));
    submit(&h, clear());
    submit(&h, adds(&[4]));
    server.wait_for(WAIT, |r| !r.is_empty()).await;
    let report = f.shutdown(WAIT).await;
    assert_eq!(report, fwd::DrainReport::default());
    assert_eq!(trace(&server), ["C", "U[4]"]);
    assert_eq!(
        h.metrics()
            .superseded_by_clear
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_server_never_blocks_the_input_side() {
    let server = RecordingServer::start().await;
    server.set_behaviour(Behaviour::Hang);
    let (h, f) = fwd::spawn(client(&server, 300), config(10));
    for i in 0..200u8 {
        // try_submit never waits: every one is queued while the server hangs.
        submit(&h, adds(&[i]));
        if i % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    server.wait_for_calls(2, WAIT).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let codes: Vec<(usize, u64)> = h
        .metrics()
        .rpc_errors
        .iter()
        .enumerate()
        .map(|(i, c)| (i, c.load(std::sync::atomic::Ordering::Relaxed)))
        .filter(|(_, n)| *n > 0)
        .collect();
    // Both ends enforce the deadline (tonic's server answers CANCELLED when the grpc-timeout
    // passes): whichever is first, the call is bounded and retried.
    let m = h.metrics();
    let timed_out =
        m.rpc_errors(tonic::Code::DeadlineExceeded) + m.rpc_errors(tonic::Code::Cancelled);
    assert!(timed_out >= 1, "rpc errors by code: {codes:?}");
    server.set_behaviour(Behaviour::Accept);
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 200).await;
    assert_eq!(distinct_prefixes(&server.received()), 200, "nothing lost");
    f.shutdown(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_down_then_up_loses_nothing_within_the_bound() {
    let mut server = RecordingServer::start().await;
    server.stop().await;
    let (h, f) = fwd::spawn(client(&server, 500), config(20));
    submit(&h, adds(&[1, 2]));
    submit(&h, evict(1));
    submit(&h, adds(&[3]));
    submit(&h, clear());
    submit(&h, adds(&[5]));
    submit(&h, evict(5));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        h.metrics().rpc_errors(tonic::Code::Unavailable) >= 1,
        "it tried while down"
    );
    server.restart().await;
    server
        .wait_for(
            WAIT,
            |r| matches!(r.last(), Some(Received::Event(e)) if e.prefix_hash == [5]),
        )
        .await;
    // Work queued before the clear was superseded by it while waiting; only the one report
    // in flight when the clear arrived may have gone first.
    let t = trace(&server);
    let clear_at = t.iter().position(|x| x == "C").expect("the clear");
    assert_eq!(&t[clear_at..], ["C", "U[5]", "E5"]);
    assert!(t[..clear_at].len() <= 1, "{t:?}");
    let m = h.metrics();
    for reason in DropReason::ALL {
        assert_eq!(
            m.dropped_prefixes(reason) + m.dropped_events(reason),
            0,
            "{reason:?}"
        );
    }
    f.shutdown(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_bound_the_oldest_work_is_dropped_and_counted() {
    let mut server = RecordingServer::start().await;
    server.stop().await;
    let cfg = fwd::Config {
        max_pending: 10,
        ..config(20)
    };
    let (h, f) = fwd::spawn(client(&server, 300), cfg);
    for i in 0..25u8 {
        submit(&h, adds(&[i]));
        submit(&h, evict(i));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let m = h.metrics().clone();
    let dropped = m.dropped_prefixes(DropReason::Overflow) + m.dropped_events(DropReason::Overflow);
    assert!(dropped >= 38, "dropped {dropped}");
    server.restart().await;
    server
        .wait_for(WAIT, |r| {
            r.iter()
                .any(|x| matches!(x, Received::Event(e) if e.prefix_hash == [24]))
        })
        .await;
    // The newest work survived, in order.
    let t = trace(&server);
    assert_eq!(t.last().map(String::as_str), Some("E24"));
    assert!(t.len() <= 12, "{t:?}");
    f.shutdown(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_what_is_pending() {
    let server = RecordingServer::start().await;
    let (h, f) = fwd::spawn(client(&server, 2000), config(60_000));
    submit(&h, adds(&[1, 2]));
    submit(&h, adds(&[3]));
    // The window is a minute: only the drain sends these.
    let report = f.shutdown(WAIT).await;
    assert_eq!(report, fwd::DrainReport::default());
    assert_eq!(trace(&server), ["U[1, 2, 3]"]);
    assert_eq!(h.try_submit(adds(&[9])), Submit::Closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_cannot_finish_reports_what_is_left() {
    let server = RecordingServer::start().await;
    server.set_behaviour(Behaviour::Hang);
    let (h, f) = fwd::spawn(client(&server, 5_000), config(10));
    submit(&h, adds(&[1, 2]));
    submit(&h, evict(1));
    let started = std::time::Instant::now();
    let report = f.shutdown(Duration::from_millis(300)).await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "bounded by the drain deadline"
    );
    assert_eq!(
        report,
        fwd::DrainReport {
            unsent_prefixes: 2,
            unsent_events: 1
        }
    );
    assert_eq!(h.metrics().dropped_prefixes(DropReason::DrainTimeout), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hopeless_and_refused_reports_are_dropped_and_counted_and_the_rest_flows() {
    let server = RecordingServer::start().await;
    server.set_behaviour(Behaviour::Refuse(tonic::Code::InvalidArgument));
    let (h, f) = fwd::spawn(client(&server, 2000), config(10));
    submit(&h, evict(1));
    server.wait_for_calls(1, WAIT).await;
    server.set_behaviour(Behaviour::Nack);
    submit(&h, evict(2));
    server.wait_for_calls(2, WAIT).await;
    server.set_behaviour(Behaviour::Accept);
    submit(&h, evict(3));
    server.wait_for(WAIT, |r| !r.is_empty()).await;
    assert_eq!(trace(&server), ["E3"]);
    let m = h.metrics();
    assert_eq!(m.dropped_events(DropReason::GaveUp), 1);
    assert_eq!(m.dropped_events(DropReason::Rejected), 1);
    assert_eq!(m.rpc_errors(tonic::Code::InvalidArgument), 1);
    f.shutdown(WAIT).await;
}

#[test]
fn status_codes_are_classified_in_one_place() {
    use fwd::Retry;
    for code in [
        tonic::Code::Unavailable,
        tonic::Code::DeadlineExceeded,
        tonic::Code::ResourceExhausted,
    ] {
        assert_eq!(
            fwd::classify(&tonic::Status::new(code, "")),
            Retry::Retry,
            "{code:?}"
        );
    }
    for code in [
        tonic::Code::InvalidArgument,
        tonic::Code::Unimplemented,
        tonic::Code::NotFound,
    ] {
        assert_eq!(
            fwd::classify(&tonic::Status::new(code, "")),
            Retry::GiveUp,
            "{code:?}"
        );
    }
}
