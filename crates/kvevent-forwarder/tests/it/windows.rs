//! What a window sends, and in what order: adds coalesced, work on one prefix netted,
//! evictions before later adds, clears, tiers and retries kept in order, large events whole.

#[allow(
    clippy::wildcard_imports,
    reason = "the helpers and imports of main.rs"
)]
use super::*;

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
