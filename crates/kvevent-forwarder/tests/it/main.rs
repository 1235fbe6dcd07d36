//! The forwarder against a real tonic server on loopback.

use std::time::Duration;

use kvevent_forwarder::{self as fwd, DropReason, Submit};
use kvevent_proto as pb;
use kvevent_test_support::{
    Behaviour, Received, RecordingServer, distinct_prefixes, eventually, when,
};

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

/// Adds the server cannot hold yet (their first report).
fn new_adds(keys: &[u8]) -> pb::Report {
    match update(keys, pb::CacheTier::T1) {
        pb::Report::Update(u) => pb::Report::New(u),
        other => other,
    }
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
async fn events_larger_than_the_codec_buffers_arrive_whole() {
    // PublishEvent encodes into a 512-byte buffer that grows: events of every size around and
    // far past it arrive byte for byte, and the answers decode.
    let server = RecordingServer::start().await;
    let c = client(&server, 5000);
    let sizes = [0usize, 400, 511, 512, 513, 4096, 70_000];
    for (i, size) in sizes.iter().enumerate() {
        let ack = c
            .publish(pb::CacheEvent {
                r#type: pb::cache_event::Type::PrefixEvicted as i32,
                replica_id: "r1".into(),
                model_id: "m".repeat(*size),
                prefix_hash: vec![i as u8; 8],
                ..Default::default()
            })
            .await
            .expect("publish");
        assert!(ack.accepted, "{size}");
    }
    let got: Vec<(usize, Vec<u8>)> = server
        .received()
        .into_iter()
        .map(|r| match r {
            Received::Event(e) => {
                assert!(e.model_id.bytes().all(|b| b == b'm'));
                (e.model_id.len(), e.prefix_hash)
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    let want: Vec<(usize, Vec<u8>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, size)| (*size, vec![i as u8; 8]))
        .collect();
    assert_eq!(got, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn within_a_window_work_on_one_prefix_is_netted_and_evictions_go_before_later_adds() {
    let server = RecordingServer::start().await;
    let (h, f) = fwd::spawn(client(&server, 2000), config(100));
    submit(&h, adds(&[1]));
    submit(&h, evict(1));
    submit(&h, adds(&[1, 2]));
    submit(&h, evict(2));
    server.wait_for(WAIT, |r| r.len() >= 3).await;
    // add 1 (maybe on the server already) then its eviction: only the eviction. Add 2 then its
    // eviction: the same. The second add of 1 follows its eviction: sent after it.
    let t = trace(&server);
    assert_eq!(t.len(), 3, "{t:?}");
    assert_eq!(t[2], "U[1]", "{t:?}");
    assert!(t[..2].contains(&"E1".to_owned()) && t[..2].contains(&"E2".to_owned()));
    assert_eq!(
        h.metrics()
            .cancelled
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    f.shutdown(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_stored_and_evicted_while_queued_costs_no_rpc_unless_it_was_sent() {
    let server = RecordingServer::start().await;
    let (h, f) = fwd::spawn(client(&server, 2000), config(100));
    // 1 and 2 are new to the server; 1 is evicted before anything was sent.
    submit(&h, new_adds(&[1, 2]));
    submit(&h, evict(1));
    server.wait_for(WAIT, |r| !r.is_empty()).await;
    // 2 was sent: its eviction goes, after it.
    submit(&h, evict(2));
    server.wait_for(WAIT, |r| r.len() >= 2).await;
    assert_eq!(trace(&server), ["U[2]", "E2"]);
    assert_eq!(server.calls(), 2);
    assert_eq!(
        h.metrics()
            .cancelled
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evictions_are_sent_concurrently_on_one_connection() {
    let server = RecordingServer::start().await;
    server.set_behaviour(Behaviour::Delay(Duration::from_millis(200)));
    let (h, f) = fwd::spawn(client(&server, 5000), config(20));
    for k in 0..40u8 {
        submit(&h, evict(k));
    }
    server.wait_for(WAIT, |r| r.len() >= 40).await;
    let most = server.max_concurrent_calls();
    assert!(most >= 8, "at most {most} calls at once");
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
    assert_eq!(
        h.metrics()
            .evictions_sent
            .load(std::sync::atomic::Ordering::Relaxed),
        40
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_in_flight_over_the_bound_never_blocks_newer_work() {
    let server = RecordingServer::start().await;
    server.set_behaviour(Behaviour::Delay(Duration::from_millis(300)));
    let cfg = fwd::Config {
        max_pending: 60,
        ..config(20)
    };
    let (h, f) = fwd::spawn(client(&server, 5000), cfg);
    // 50 entries in one window, in flight for 300 ms.
    submit(&h, adds(&(0..50).collect::<Vec<u8>>()));
    server.wait_for_calls(1, WAIT).await;
    // While it is on the wire, newer work within the bound queues and is delivered: the work
    // in flight does not count against what may wait behind it.
    for k in 50..100u8 {
        submit(&h, adds(&[k]));
    }
    server.wait_for(WAIT, |r| distinct_prefixes(r) >= 100).await;
    let m = h.metrics();
    assert_eq!(m.dropped_prefixes(DropReason::Overflow), 0);
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
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
    // Both ends enforce the deadline (tonic's server answers CANCELLED when the grpc-timeout
    // passes): whichever is first, the call is bounded and retried. Wait for it, not a time.
    let m = h.metrics().clone();
    let timed_out =
        || m.rpc_errors(tonic::Code::DeadlineExceeded) + m.rpc_errors(tonic::Code::Cancelled);
    let deadline = tokio::time::Instant::now() + WAIT;
    while timed_out() == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let codes: Vec<(usize, u64)> = h
        .metrics()
        .rpc_errors
        .iter()
        .enumerate()
        .map(|(i, c)| (i, c.load(std::sync::atomic::Ordering::Relaxed)))
        .filter(|(_, n)| *n > 0)
        .collect();
    assert!(timed_out() >= 1, "rpc errors by code: {codes:?}");
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
    wait_failing(&h).await; // it tried while down

    server.restart().await;
    server
        .wait_for(
            WAIT,
            |r| matches!(r.last(), Some(Received::Event(e)) if e.prefix_hash == [5]),
        )
        .await;
    // Work queued before the clear was superseded by it while waiting; only the window in
    // flight when the clear arrived may have gone first. After the clear, add 5 then its
    // eviction nets to the eviction.
    let t = trace(&server);
    let clear_at = t.iter().position(|x| x == "C").expect("the clear");
    assert_eq!(&t[clear_at..], ["C", "E5"]);
    assert!(t[..clear_at].len() <= 2, "{t:?}");
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

/// Waits until the forwarder has seen a call fail.
async fn wait_failing(h: &fwd::Handle) {
    eventually("a call failed", WAIT, || async {
        when(h.metrics().rpc_errors(tonic::Code::Unavailable), |n| *n > 0)
    })
    .await;
}

/// While the server is down, past the bound the oldest queued work is shed: when it is back
/// it gets the newest state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_an_outage_past_the_bound_the_oldest_work_is_dropped_and_counted() {
    let mut server = RecordingServer::start().await;
    server.stop().await;
    let cfg = fwd::Config {
        max_pending: 10,
        ..config(20)
    };
    let (h, f) = fwd::spawn(client(&server, 300), cfg);
    // The first window goes on the wire and fails: the server is down.
    submit(&h, adds(&[0]));
    submit(&h, evict(100));
    wait_failing(&h).await;
    for i in 1..25u8 {
        submit(&h, adds(&[i]));
        submit(&h, evict(100 + i));
    }
    let m = h.metrics().clone();
    eventually("38 shed", WAIT, || async {
        when(
            m.dropped_prefixes(DropReason::Overflow) + m.dropped_events(DropReason::Overflow),
            |n| *n >= 38,
        )
    })
    .await;
    assert_eq!(m.dropped_prefixes(DropReason::Overflow), 19);
    assert_eq!(m.dropped_events(DropReason::Overflow), 19);
    server.restart().await;
    server.wait_for(WAIT, |r| r.len() >= 8).await;
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
    // The window on the wire (add 0, eviction 100) is retried, never shed; of the queued work
    // the newest survived: adds 20–24 (one update), evictions 120–124.
    let mut t = trace(&server);
    t.sort();
    assert_eq!(
        t,
        [
            "E100",
            "E120",
            "E121",
            "E122",
            "E123",
            "E124",
            "U[0]",
            "U[20, 21, 22, 23, 24]"
        ]
    );
}

/// While the server answers, past the bound new work is dropped as it arrives (this thread,
/// not the server, is what falls behind): what was queued goes out in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_server_answers_past_the_bound_new_work_is_dropped_as_it_arrives() {
    let server = RecordingServer::start().await;
    let cfg = fwd::Config {
        max_pending: 10,
        ..config(60_000)
    };
    let (h, f) = fwd::spawn(client(&server, 2000), cfg);
    // The window is a minute: everything waits in it, and the bound holds at 10.
    for i in 0..25u8 {
        submit(&h, adds(&[i]));
    }
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
    assert_eq!(h.metrics().dropped_prefixes(DropReason::Overflow), 15);
    assert_eq!(trace(&server), ["U[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"]);
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
    // Add 1 then its eviction nets to the eviction: add 2 and the eviction are left.
    assert_eq!(
        report,
        fwd::DrainReport {
            unsent_prefixes: 1,
            unsent_events: 1
        }
    );
    assert_eq!(h.metrics().dropped_prefixes(DropReason::DrainTimeout), 1);
    assert_eq!(h.metrics().dropped_events(DropReason::DrainTimeout), 1);
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

/// The server's prefix set after applying what it received, in order.
fn server_state(server: &RecordingServer) -> std::collections::BTreeSet<u8> {
    let mut state = std::collections::BTreeSet::new();
    for r in server.received() {
        match r {
            Received::Update(u) => state.extend(u.prefixes.iter().map(|p| p.prefix_hash[0])),
            Received::Event(e) if e.r#type == pb::cache_event::Type::AllCleared as i32 => {
                state.clear()
            }
            Received::Event(e) => {
                state.remove(&e.prefix_hash[0]);
            }
        }
    }
    state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_streams_reach_the_same_state_through_concurrent_calls_retries_and_clears() {
    for seed in [1u64, 7, 42] {
        let server = RecordingServer::start().await;
        server.set_behaviour(Behaviour::Delay(Duration::from_millis(3)));
        let cfg = fwd::Config {
            max_in_flight: 8,
            ..config(15)
        };
        let (h, f) = fwd::spawn(client(&server, 2000), cfg);
        // What the server must hold once everything is delivered.
        let mut expected = std::collections::BTreeSet::new();
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for round in 0..25 {
            for _ in 0..40 {
                let r = next();
                let k = (r % 12) as u8;
                match (r >> 32) % 32 {
                    0 => {
                        submit(&h, clear());
                        expected.clear();
                    }
                    1..=15 => {
                        // The mapper's contract: `New` only for a prefix the server lacks.
                        submit(
                            &h,
                            if expected.contains(&k) {
                                adds(&[k])
                            } else {
                                new_adds(&[k])
                            },
                        );
                        expected.insert(k);
                    }
                    _ => {
                        submit(&h, evict(k));
                        expected.remove(&k);
                    }
                }
            }
            if round % 6 == 3 {
                // Calls fail for a while: they are retried inside their stage, before anything
                // queued after them.
                server.set_behaviour(Behaviour::Refuse(tonic::Code::Unavailable));
                tokio::time::sleep(Duration::from_millis(40)).await;
                server.set_behaviour(Behaviour::Delay(Duration::from_millis(3)));
            }
            tokio::time::sleep(Duration::from_millis(next() % 25)).await;
        }
        assert_eq!(
            f.shutdown(WAIT).await,
            fwd::DrainReport::default(),
            "seed {seed}"
        );
        assert_eq!(server_state(&server), expected, "seed {seed}");
        let m = h.metrics();
        assert!(
            m.rpc_errors(tonic::Code::Unavailable) > 0,
            "seed {seed}: retries happened"
        );
        assert!(
            server.max_concurrent_calls() > 1,
            "seed {seed}: calls overlapped"
        );
        for reason in DropReason::ALL {
            assert_eq!(
                m.dropped_prefixes(reason) + m.dropped_events(reason),
                0,
                "{reason:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_past_the_bound_drops_new_work_and_delivery_keeps_going() {
    // The server takes 100 ms a call and at most 3,000 entries may wait: about 30k entries/s
    // get through. 40k/s are offered for a second.
    let server = RecordingServer::start().await;
    server.set_behaviour(Behaviour::Delay(Duration::from_millis(100)));
    let cfg = fwd::Config {
        max_pending: 3_000,
        ..config(10)
    };
    let (h, f) = fwd::spawn(client(&server, 5000), cfg);
    let mut offered = 0u64;
    for round in 0..40u32 {
        let prefixes = (0..1_000u32)
            .map(|i| pb::PrefixEntry {
                prefix_hash: (round * 1_000 + i).to_be_bytes().to_vec(),
                token_count: 16,
                tier: pb::CacheTier::T1 as i32,
                ..Default::default()
            })
            .collect::<Vec<_>>();
        offered += prefixes.len() as u64;
        h.submit(pb::Report::New(pb::CacheStateUpdate {
            replica_id: "r1".into(),
            model_id: "m".into(),
            hash_scheme: "vllm".into(),
            prefixes,
            ..Default::default()
        }))
        .await
        .expect("open");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
    let m = h.metrics();
    let sent = m.prefixes_sent.load(std::sync::atomic::Ordering::Relaxed);
    let shed = m.dropped_prefixes(DropReason::Overflow);
    assert_eq!(sent + shed, offered, "every entry delivered or counted");
    assert_eq!(distinct_prefixes(&server.received()) as u64, sent);
    assert!(shed > 0, "the offered rate was above what gets through");
    assert!(
        sent * 2 > offered,
        "most still arrives: {sent} of {offered}"
    );
    // The server answers (slowly), so past the bound a report is dropped whole as it arrives;
    // only where one intake crossed the bound is the oldest queued work cut, from its front.
    // Either way what arrives of a round is one unbroken run: nothing is reordered or holed.
    let received: std::collections::BTreeSet<u32> = server
        .prefixes()
        .into_iter()
        .map(|p| {
            let k = &p.prefix_hash;
            u32::from_be_bytes([k[0], k[1], k[2], k[3]])
        })
        .collect();
    for round in 0..40u32 {
        let kept: Vec<u32> = (round * 1_000..(round + 1) * 1_000)
            .filter(|k| received.contains(k))
            .collect();
        if let (Some(first), Some(last)) = (kept.first(), kept.last()) {
            assert_eq!(
                (last - first + 1) as usize,
                kept.len(),
                "round {round}: what arrived has holes"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_call_is_never_overtaken_by_later_work_on_its_prefix() {
    let server = RecordingServer::start().await;
    server.set_behaviour(Behaviour::Refuse(tonic::Code::Unavailable));
    let (h, f) = fwd::spawn(client(&server, 2000), config(20));
    // Window 1: the add of 1 goes out and fails, again and again.
    submit(&h, new_adds(&[1]));
    server.wait_for_calls(2, WAIT).await;
    // Later windows queue its eviction and a new add while it is being retried.
    submit(&h, evict(1));
    tokio::time::sleep(Duration::from_millis(50)).await;
    submit(&h, new_adds(&[1, 2]));
    tokio::time::sleep(Duration::from_millis(50)).await;
    server.set_behaviour(Behaviour::Accept);
    server
        .wait_for(WAIT, |r| distinct_prefixes(r) >= 2 && r.len() >= 4)
        .await;
    // What the server saw of prefix 1, in order: the retried add, its eviction, the new add.
    let of_1: Vec<&str> = server
        .received()
        .iter()
        .filter_map(|r| match r {
            Received::Update(u) if u.prefixes.iter().any(|p| p.prefix_hash == [1]) => Some("add"),
            Received::Event(e) if e.prefix_hash == [1] => Some("evict"),
            _ => None,
        })
        .collect();
    assert_eq!(of_1, ["add", "evict", "add"], "{:?}", trace(&server));
    assert!(h.metrics().rpc_errors(tonic::Code::Unavailable) >= 2);
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_of_one_prefix_at_several_tiers_keep_their_order_and_timestamps() {
    let server = RecordingServer::start().await;
    let (h, f) = fwd::spawn(client(&server, 2000), config(50));
    let at = |tier: pb::CacheTier, ts: i64| match update(&[7], tier) {
        pb::Report::Update(mut u) => {
            u.timestamp_us = ts;
            pb::Report::Update(u)
        }
        other => other,
    };
    // Offloaded (T2) at 10, stored on the GPU again (T1) at 20, offloaded again at 30.
    submit(&h, at(pb::CacheTier::T2, 10));
    submit(&h, at(pb::CacheTier::T1, 20));
    submit(&h, at(pb::CacheTier::T2, 30));
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
    let sent: Vec<(i64, i32)> = server
        .received()
        .iter()
        .filter_map(|r| match r {
            Received::Update(u) => Some(
                u.prefixes
                    .iter()
                    .map(|p| (u.timestamp_us, p.tier))
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        })
        .flatten()
        .collect();
    // Each report keeps its own batch time; the last one the server applies is the T2 at 30.
    assert_eq!(
        sent,
        [
            (20, pb::CacheTier::T1 as i32),
            (30, pb::CacheTier::T2 as i32)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filling_channel_is_emptied_before_the_window_is_due() {
    // While a window is open the task leaves reports in the channel until the window is due,
    // unless the channel fills (the handle rings a bell at half full): a burst of ten times
    // the channel's capacity goes in well within a 5 s window (without the bell each
    // `submit` past the capacity would wait for the window).
    let server = RecordingServer::start().await;
    let config = fwd::Config {
        input_capacity: 64,
        ..config(5_000)
    };
    let (h, f) = fwd::spawn(client(&server, 2000), config);
    let started = std::time::Instant::now();
    for i in 0..640u32 {
        let report = pb::Report::Update(pb::CacheStateUpdate {
            replica_id: "r1".into(),
            model_id: "m".into(),
            prefixes: vec![pb::PrefixEntry {
                prefix_hash: i.to_be_bytes().to_vec(),
                token_count: 16,
                ..Default::default()
            }],
            ..Default::default()
        });
        h.submit(report).await.expect("open");
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the burst waited {:?}",
        started.elapsed()
    );
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
    let received: usize = server
        .received()
        .into_iter()
        .map(|r| match r {
            Received::Update(u) => u.prefixes.len(),
            Received::Event(_) => 0,
        })
        .sum();
    assert_eq!(received, 640);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_submit_waits_for_room_and_fails_once_shut_down() {
    // From a plain thread, ten times the channel's capacity: the submits past the capacity
    // wait for room (none is dropped); after shutdown the handle says so.
    let server = RecordingServer::start().await;
    let config = fwd::Config {
        input_capacity: 8,
        ..config(20)
    };
    let (h, f) = fwd::spawn(client(&server, 2000), config);
    let handle = h.clone();
    let sent = tokio::task::spawn_blocking(move || {
        (0..80u8).all(|k| handle.blocking_submit(evict(k)).is_ok())
    })
    .await
    .expect("thread");
    assert!(sent);
    assert_eq!(h.metrics().dropped_events(DropReason::InputFull), 0);
    server.wait_for(WAIT, |r| r.len() == 80).await;
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
    let late = tokio::task::spawn_blocking(move || h.blocking_submit(evict(0)))
        .await
        .expect("thread");
    assert_eq!(late, Err(fwd::Closed));
}

/// Waits until the forwarder's in-flight limit reads `want`.
async fn wait_for_limit(h: &fwd::Handle, want: usize) {
    eventually(&format!("the in-flight limit at {want}"), WAIT, || async {
        let now = h
            .metrics()
            .in_flight_limit
            .load(std::sync::atomic::Ordering::Relaxed);
        when(now, |n| *n == want as u64)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_flight_limit_grows_while_windows_take_long_and_shrinks_back_after() {
    // A server answering in 40 ms: 1,000 evictions take 640 ms 64 at a time, 320 ms 128 at
    // a time, both over three quarters of the 400 ms window, so the limit doubles after each
    // such window up to max_in_flight (at 256, 160 ms keep it there: over three eighths);
    // windows sent at once (under 150 ms) bring it back down to where it started, never
    // below.
    let server = RecordingServer::start().await;
    server.set_behaviour(Behaviour::Delay(Duration::from_millis(40)));
    let config = fwd::Config {
        max_in_flight: 256,
        ..config(400)
    };
    let (h, f) = fwd::spawn(client(&server, 5000), config);
    wait_for_limit(&h, fwd::INITIAL_IN_FLIGHT).await;
    let mut sent = 0u32;
    let mut burst = |h: &fwd::Handle, n: u32| {
        for _ in 0..n {
            submit(
                h,
                event(pb::cache_event::Type::PrefixEvicted, &sent.to_be_bytes()),
            );
            sent += 1;
        }
        sent as usize
    };
    for want in [128, 256, 256] {
        let total = burst(&h, 1000);
        server.wait_for(WAIT, |r| r.len() == total).await;
        wait_for_limit(&h, want).await;
    }
    let most = server.max_concurrent_calls();
    assert!((129..=256).contains(&most), "{most} calls at once");
    server.set_behaviour(Behaviour::Accept);
    for want in [128, 64, 64] {
        let total = burst(&h, 10);
        server.wait_for(WAIT, |r| r.len() == total).await;
        wait_for_limit(&h, want).await;
    }
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
    let mut evicted: Vec<Vec<u8>> = server.events().into_iter().map(|e| e.prefix_hash).collect();
    evicted.sort_unstable();
    evicted.dedup();
    assert_eq!(evicted.len(), 3_030);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_in_flight_below_the_start_is_the_limit() {
    let server = RecordingServer::start().await;
    server.set_behaviour(Behaviour::Delay(Duration::from_millis(20)));
    let config = fwd::Config {
        max_in_flight: 8,
        ..config(20)
    };
    let (h, f) = fwd::spawn(client(&server, 5000), config);
    wait_for_limit(&h, 8).await;
    for k in 0..100u32 {
        submit(
            &h,
            event(pb::cache_event::Type::PrefixEvicted, &k.to_be_bytes()),
        );
    }
    server.wait_for(WAIT, |r| r.len() == 100).await;
    assert_eq!(f.shutdown(WAIT).await, fwd::DrainReport::default());
    assert!(server.max_concurrent_calls() <= 8);
    wait_for_limit(&h, 8).await;
}
