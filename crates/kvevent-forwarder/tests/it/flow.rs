//! Under load: random streams through concurrent calls, retries and clears reach the
//! server's state; the channel, blocking submits and the adaptive in-flight limit.

#[allow(
    clippy::wildcard_imports,
    reason = "the helpers and imports of main.rs"
)]
use super::*;

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
