//! A server hung, down, slow or refusing: nothing blocks the input side, work within the bound
//! is kept, past it the oldest (or the newest) is dropped and counted, and shutdown drains.

#[allow(
    clippy::wildcard_imports,
    reason = "the helpers and imports of main.rs"
)]
use super::*;

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
