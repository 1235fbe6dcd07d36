//! The subscriber against the Rust fake engine over real ZMQ sockets on loopback.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kvevent_source::{Config, ResetReason, Subscriber, Update};
use kvevent_test_support::{Publisher, PublisherConfig, eventually_blocking, when};
use kvevent_wire::{self as wire, Release};
use kvevent_zmq as transport;

const WAIT: Duration = Duration::from_secs(10);

fn batch(i: u64) -> wire::EventBatch<'static> {
    wire::EventBatch {
        ts: 1.0 + i as f64,
        events: vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(100 + i))],
            token_ids: vec![1, 2, 3, 4].into(),
            block_size: 4,
            medium: Some("GPU".into()),
            ..Default::default()
        })],
        data_parallel_rank: Some(0),
        unknown_events: 0,
    }
}

fn payload(release: Release, i: u64) -> Vec<u8> {
    wire::encode(&batch(i), release).expect("encode")
}

fn source_of(p: &Publisher, replay: bool) -> transport::Source {
    transport::Source {
        endpoint: p.endpoint().to_owned(),
        replay_endpoint: if replay {
            p.replay_endpoint().map(str::to_owned)
        } else {
            None
        },
        topic: b"kv-events".to_vec(),
        bind: false,
        dp_rank: 0,
    }
}

fn subscriber(ctx: &zmq::Context, sources: Vec<transport::Source>) -> Subscriber {
    let mut config = Config::new(sources);
    config.socket.replay_idle_timeout = Duration::from_millis(300);
    config.state.replay_backoff_initial = Duration::from_millis(100);
    Subscriber::start(ctx, config).expect("subscriber")
}

/// Collects updates as `B<source>:<seq>` / `R<source>:<reason>` until `done` holds.
fn collect(sub: &mut Subscriber, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    // A driving loop, not a wait: each step reads for up to 100 ms (eventually's pause between
    // looks would slow a long collection).
    let deadline = Instant::now() + WAIT;
    let mut seen = Vec::new();
    while !done(&seen) {
        assert!(Instant::now() < deadline, "timed out; saw {seen:?}");
        step(sub, &mut seen, Duration::from_millis(100));
    }
    seen
}

/// Waits up to `wait` for one update and notes it in `seen`.
fn step(sub: &mut Subscriber, seen: &mut Vec<String>, wait: Duration) {
    match sub.next(wait) {
        Some(Update::Batch(b)) => {
            b.decode().expect("a delivered batch decodes");
            seen.push(format!("B{}:{}", b.source, b.seq));
        }
        Some(Update::Reset { source, reason }) => {
            seen.push(format!("R{source}:{}", reason.as_str()))
        }
        None => {}
    }
}

fn has(s: &str) -> impl Fn(&[String]) -> bool + '_ {
    move |seen| seen.iter().any(|x| x == s)
}

fn engine(release: Release) -> (zmq::Context, Publisher) {
    let ctx = zmq::Context::new();
    let publisher = Publisher::start(&ctx, PublisherConfig::loopback(release)).expect("publisher");
    (ctx, publisher)
}

#[test]
fn live_batches_flow_in_order() {
    let release = Release::NEWEST_KNOWN;
    let (ctx, engine) = engine(release);
    let mut sub = subscriber(&ctx, vec![source_of(&engine, true)]);
    // Synchronise on the subscription instead of sleeping (slow joiner).
    assert!(engine.wait_for_subscribers(1, WAIT));
    for i in 0..5 {
        engine.publish(&batch(i)).expect("publish");
    }
    let seen = collect(&mut sub, has("B0:4"));
    assert_eq!(seen, ["R0:startup", "B0:0", "B0:1", "B0:2", "B0:3", "B0:4"]);
    let m = &sub.metrics()[0];
    assert_eq!(
        (m.events.stored.load(Relaxed), m.last_seq.load(Relaxed)),
        (5, 4)
    );
    assert!(!sub.health().any(|h| h.degraded()));
}

#[test]
fn a_late_joiner_bootstraps_from_replay() {
    for release in [Release::new(0, 20, 0), Release::new(0, 33, 0)] {
        // Both replay reply formats: [seq, payload] before 0.26, [topic, seq, payload] after.
        let (ctx, engine) = engine(release);
        for i in 0..6 {
            engine.publish(&batch(i)).expect("publish");
        }
        let mut sub = subscriber(&ctx, vec![source_of(&engine, true)]);
        assert!(engine.wait_for_subscribers(1, WAIT));
        engine.publish(&batch(6)).expect("publish");
        let seen = collect(&mut sub, has("B0:6"));
        let want: Vec<String> = std::iter::once("R0:startup".to_owned())
            .chain((0..=6).map(|i| format!("B0:{i}")))
            .collect();
        assert_eq!(seen, want, "{release}");
        // The end marker follows the last replayed batch.
        let m = sub.metrics()[0].clone();
        eventually_blocking(&format!("{release}: the replay complete"), WAIT, || {
            sub.next(Duration::from_millis(50));
            when(m.replays_complete.load(Relaxed), |n| *n > 0)
        });
        assert!(!sub.health().any(|h| h.degraded()), "{release}");
    }
}

#[test]
fn a_gap_is_repaired_by_replay() {
    let release = Release::NEWEST_KNOWN;
    let (ctx, engine) = engine(release);
    let mut sub = subscriber(&ctx, vec![source_of(&engine, true)]);
    assert!(engine.wait_for_subscribers(1, WAIT));
    engine.publish(&batch(0)).expect("publish");
    engine.publish_lost(payload(release, 1));
    engine.publish_lost(payload(release, 2));
    engine.publish(&batch(3)).expect("publish");
    // Each batch says how it came: 1 and 2 from the replay endpoint, all on the engine's topic.
    let mut came = Vec::new();
    let deadline = Instant::now() + WAIT;
    while came.len() < 4 {
        assert!(Instant::now() < deadline, "timed out; saw {came:?}");
        if let Some(Update::Batch(b)) = sub.next(Duration::from_millis(100)) {
            assert_eq!(&*b.topic, b"kv-events");
            assert!(b.arrived <= Instant::now());
            came.push((b.seq, b.replayed));
        }
    }
    assert_eq!(&came[..3], [(0, false), (1, true), (2, true)]);
    assert_eq!(came[3].0, 3, "live, or replayed and its live copy dropped");
    let m = &sub.metrics()[0];
    assert_eq!((m.gaps.load(Relaxed), m.missing_seqs.load(Relaxed)), (1, 2));
}

#[test]
fn a_truncated_replay_clears_the_source() {
    let release = Release::NEWEST_KNOWN;
    let ctx = zmq::Context::new();
    let config = PublisherConfig {
        buffer_steps: 2,
        ..PublisherConfig::loopback(release)
    };
    let engine = Publisher::start(&ctx, config).expect("publisher");
    let mut sub = subscriber(&ctx, vec![source_of(&engine, true)]);
    assert!(engine.wait_for_subscribers(1, WAIT));
    engine.publish(&batch(0)).expect("publish");
    for i in 1..=4 {
        engine.publish_lost(payload(release, i));
    }
    engine.publish(&batch(5)).expect("publish");
    // The buffer holds only 4 and 5: 1..=3 are gone for good.
    let seen = collect(&mut sub, has("B0:5"));
    assert_eq!(
        seen,
        ["R0:startup", "B0:0", "R0:truncated_replay", "B0:4", "B0:5"]
    );
    assert!(sub.health().all(|h| h.degraded()));
}

#[test]
fn a_restarted_engine_clears_then_rebuilds() {
    let release = Release::NEWEST_KNOWN;
    let (ctx, engine) = engine(release);
    let mut sub = subscriber(&ctx, vec![source_of(&engine, true)]);
    assert!(engine.wait_for_subscribers(1, WAIT));
    for i in 0..3 {
        engine.publish(&batch(i)).expect("publish");
    }
    collect(&mut sub, has("B0:2"));
    engine.restart();
    engine.publish_lost(payload(release, 10));
    engine.publish(&batch(11)).expect("publish");
    let seen = collect(&mut sub, has("B0:1"));
    assert_eq!(seen, ["R0:restart", "B0:0", "B0:1"]);
    assert_eq!(sub.metrics()[0].restarts.load(Relaxed), 1);
}

#[test]
fn a_lost_end_marker_times_out_and_live_batches_go_on() {
    let release = Release::new(0, 26, 0);
    let ctx = zmq::Context::new();
    let config = PublisherConfig {
        lose_end_marker: true,
        ..PublisherConfig::loopback(release)
    };
    let engine = Publisher::start(&ctx, config).expect("publisher");
    let mut sub = subscriber(&ctx, vec![source_of(&engine, true)]);
    assert!(engine.wait_for_subscribers(1, WAIT));
    // The bootstrap replay asked for at start never ends either: its idle timeout closes it,
    // and the replay backoff (100 ms here) passes before the engine publishes.
    let m = sub.metrics()[0].clone();
    let mut startup = false;
    eventually_blocking("the startup replay timed out", WAIT, || {
        if let Some(Update::Reset { reason, .. }) = sub.next(Duration::from_millis(50)) {
            startup |= reason.as_str() == "startup";
        }
        when(m.replays_timed_out.load(Relaxed), |n| *n > 0)
    });
    assert!(startup, "the source was reset at start");
    std::thread::sleep(Duration::from_millis(200));
    engine.publish(&batch(0)).expect("publish");
    engine.publish_lost(payload(release, 1));
    engine.publish(&batch(2)).expect("publish");
    let seen = collect(&mut sub, has("B0:2"));
    // The gap replay delivered 1 and 2, then never ended: the idle timeout closes it.
    assert_eq!(seen, ["B0:0", "B0:1", "B0:2"]);
    eventually_blocking("a second replay timed out", WAIT, || {
        sub.next(Duration::from_millis(50));
        when(m.replays_timed_out.load(Relaxed), |n| *n >= 2)
    });
    engine.publish(&batch(3)).expect("publish");
    assert_eq!(collect(&mut sub, has("B0:3")), ["B0:3"]);
}

#[test]
fn without_a_replay_endpoint_a_lost_batch_clears_the_source() {
    let release = Release::NEWEST_KNOWN;
    let (ctx, engine) = engine(release);
    let mut sub = subscriber(&ctx, vec![source_of(&engine, false)]);
    assert!(engine.wait_for_subscribers(1, WAIT));
    engine.publish(&batch(0)).expect("publish");
    engine.skip_seq();
    engine.publish(&batch(2)).expect("publish");
    let seen = collect(&mut sub, has("B0:2"));
    assert_eq!(seen, ["R0:startup", "B0:0", "R0:gap", "B0:2"]);
}

#[test]
fn two_dp_ranks_are_kept_apart() {
    // Endpoints derived by vLLM's rule from one base (inproc: `x` → `x_dp1`).
    let ctx = zmq::Context::new();
    let release = Release::NEWEST_KNOWN;
    let sources = transport::dp_sources(
        "inproc://kv",
        Some("inproc://kv-replay"),
        2,
        b"kv-events",
        false,
    )
    .expect("sources");
    let engines: Vec<Publisher> = sources
        .iter()
        .map(|s| {
            let config = PublisherConfig {
                endpoint: s.endpoint.clone(),
                replay_endpoint: s.replay_endpoint.clone(),
                ..PublisherConfig::loopback(release)
            };
            Publisher::start(&ctx, config).expect("publisher")
        })
        .collect();
    assert_eq!(engines[1].endpoint(), "inproc://kv_dp1");
    let mut sub = subscriber(&ctx, sources);
    for e in &engines {
        assert!(e.wait_for_subscribers(1, WAIT));
    }
    engines[0].publish(&batch(0)).expect("publish");
    engines[1].publish(&batch(0)).expect("publish");
    engines[1].publish(&batch(1)).expect("publish");
    engines[0].publish(&batch(1)).expect("publish");
    let seen = collect(&mut sub, |s| has("B0:1")(s) && has("B1:1")(s));
    let rank = |r: &str| {
        seen.iter()
            .filter(|x| x.starts_with(r))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(rank("B0"), ["B0:0", "B0:1"]);
    assert_eq!(rank("B1"), ["B1:0", "B1:1"]);
    assert_eq!(rank("R0"), ["R0:startup"]);
    assert_eq!(rank("R1"), ["R1:startup"]);
}

#[test]
fn malformed_frames_and_payloads_are_counted_and_skipped() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::XPUB).expect("socket");
    publisher.bind("tcp://127.0.0.1:*").expect("bind");
    let endpoint = publisher
        .get_last_endpoint()
        .expect("endpoint")
        .expect("utf8");
    let source = transport::Source {
        endpoint,
        replay_endpoint: None,
        topic: Vec::new(),
        bind: false,
        dp_rank: 0,
    };
    let mut sub = subscriber(&ctx, vec![source]);
    publisher.recv_bytes(0).expect("subscription");
    let good = payload(Release::NEWEST_KNOWN, 0);
    let seq = |s: u64| s.to_be_bytes().to_vec();
    publisher
        .send_multipart([b"t".to_vec(), b"bad-seq".to_vec(), good.clone()], 0)
        .expect("send");
    publisher
        .send_multipart([b"t".to_vec(), good.clone()], 0)
        .expect("send");
    publisher
        .send_multipart([b"t".to_vec(), seq(0), good.clone()], 0)
        .expect("send");
    publisher
        .send_multipart([b"t".to_vec(), seq(1), good[..good.len() - 1].to_vec()], 0)
        .expect("send");
    publisher
        .send_multipart([b"t".to_vec(), seq(2), good.clone()], 0)
        .expect("send");
    let seen = collect(&mut sub, has("B0:2"));
    assert_eq!(seen, ["R0:startup", "B0:0", "R0:corrupt", "B0:2"]);
    let m = &sub.metrics()[0];
    assert_eq!(m.malformed_frames.load(Relaxed), 2);
    assert_eq!(m.decode_failures[0].load(Relaxed), 1, "truncated");
    assert_eq!(m.resets(ResetReason::Corrupt), 1);
}

#[test]
fn a_gap_across_a_reconnect_is_rebuilt_from_the_new_process() {
    // Seq 6 is above our last (2): without the check it would pass for a gap of 3..=5.
    restarted_across_a_reconnect(6);
}

#[test]
fn a_restart_whose_seqs_continue_ours_is_caught_at_the_reconnect() {
    // The new process's seq 3 continues our last (2): only its payload digest at seq 2 tells.
    restarted_across_a_reconnect(3);
}

/// The engine process dies after seqs 0..=2; a new one on the same ports publishes `lost`
/// batches (seqs 0..lost) before we are back, then one more live.
fn restarted_across_a_reconnect(lost: u64) {
    let release = Release::NEWEST_KNOWN;
    let (ctx, first) = engine(release);
    let endpoint = first.endpoint().to_owned();
    let replay = first.replay_endpoint().map(str::to_owned);
    let mut sub = subscriber(&ctx, vec![source_of(&first, true)]);
    assert!(first.wait_for_subscribers(1, WAIT));
    for i in 0..3 {
        first.publish(&batch(i)).expect("publish");
    }
    collect(&mut sub, has("B0:2"));
    first.shutdown();
    // libzmq closes the old listeners asynchronously: retry the bind for a bounded time.
    let second = eventually_blocking("the second engine bound", WAIT, || {
        let config = PublisherConfig {
            endpoint: endpoint.clone(),
            bind: Some(true),
            replay_endpoint: replay.clone(),
            ..PublisherConfig::loopback(release)
        };
        Publisher::start(&ctx, config).map_err(|e| e.to_string())
    });
    for i in 10..10 + lost {
        second.publish_lost(payload(release, i));
    }
    // Read meanwhile: a socket read by the caller's thread attaches its new connection only
    // when that thread uses it.
    let mut early = Vec::new();
    eventually_blocking("the resubscription", WAIT, || {
        if second.wait_for_subscribers(1, Duration::from_millis(10)) {
            return Ok(());
        }
        step(&mut sub, &mut early, Duration::from_millis(10));
        Err(format!("{early:?}"))
    });
    second.publish(&batch(10 + lost)).expect("publish");
    let mut seen = early;
    seen.extend(collect(&mut sub, has(&format!("B0:{lost}"))));
    let want: Vec<String> = std::iter::once("R0:restart".to_owned())
        .chain((0..=lost).map(|i| format!("B0:{i}")))
        .collect();
    assert_eq!(seen, want);
    assert_eq!(sub.metrics()[0].disconnects.load(Relaxed), 1);
    assert_eq!(sub.metrics()[0].restarts.load(Relaxed), 1);
}

#[test]
fn next_with_hands_over_the_decoded_batch_and_corrupt_ones_as_resets() {
    let release = Release::NEWEST_KNOWN;
    let (ctx, engine) = engine(release);
    let mut sub = subscriber(&ctx, vec![source_of(&engine, true)]);
    assert!(engine.wait_for_subscribers(1, WAIT));
    engine.publish(&batch(0)).expect("publish");
    engine.publish_payload(b"\x93\xcb".to_vec());
    engine.publish(&batch(2)).expect("publish");
    let mut seen = Vec::new();
    eventually_blocking("four updates", WAIT, || {
        if seen.len() >= 4 {
            return Ok(());
        }
        let view = sub.next_with(Duration::from_millis(100), |view| match view {
            kvevent_source::View::Batch { seq, batch, .. } => {
                let wire::Event::BlockStored(s) = &batch.events[0] else {
                    panic!("not a store")
                };
                format!("B{seq}:{:?}", s.block_hashes[0])
            }
            kvevent_source::View::Reset { reason, .. } => format!("R:{}", reason.as_str()),
        });
        seen.extend(view);
        Err(format!("{seen:?}"))
    });
    assert_eq!(
        seen,
        [
            "R:startup",
            "B0:Int(U64(100))",
            "R:corrupt",
            "B2:Int(U64(102))"
        ]
    );
}

#[test]
fn next_many_hands_over_what_is_ready_in_order_and_at_most_max() {
    let release = Release::NEWEST_KNOWN;
    let (ctx, engine) = engine(release);
    let mut sub = subscriber(&ctx, vec![source_of(&engine, true)]);
    assert!(engine.wait_for_subscribers(1, WAIT));
    let take = |sub: &mut Subscriber| {
        sub.next_many(Duration::from_millis(100), 4, |views| {
            views
                .iter()
                .map(|view| match view {
                    kvevent_source::View::Batch { seq, batch, .. } => {
                        let wire::Event::BlockStored(s) = &batch.events[0] else {
                            panic!("not a store")
                        };
                        format!("B{seq}:{:?}", s.block_hashes[0])
                    }
                    kvevent_source::View::Reset { reason, .. } => {
                        format!("R:{}", reason.as_str())
                    }
                })
                .collect::<Vec<_>>()
        })
    };
    // Rounds of ten batches published at once, each taken whole, until a call has handed over
    // several (what was ready together): no wait for them to arrive is assumed.
    let deadline = Instant::now() + WAIT;
    let (mut seen, mut sizes, mut want) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0u64.. {
        let first = round * 10;
        if round == 0 {
            engine.publish(&batch(0)).expect("publish");
            engine.publish_payload(b"\x93\xcb".to_vec());
            want.extend(["R:startup", "B0:Int(U64(100))", "R:corrupt"].map(str::to_owned));
        } else {
            for i in first..first + 2 {
                engine.publish(&batch(i)).expect("publish");
                want.push(format!("B{i}:Int(U64({}))", 100 + i));
            }
        }
        for i in first + 2..first + 10 {
            engine.publish(&batch(i)).expect("publish");
            want.push(format!("B{i}:Int(U64({}))", 100 + i));
        }
        while seen.len() < want.len() {
            assert!(Instant::now() < deadline, "saw {seen:?}");
            if let Some(got) = take(&mut sub) {
                sizes.push(got.len());
                seen.extend(got);
            }
        }
        if sizes.iter().any(|n| *n > 1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never more than one at once: {sizes:?}"
        );
    }
    assert_eq!(seen, want);
    assert!(sizes.iter().all(|n| (1..=4).contains(n)), "{sizes:?}");
    assert_eq!(
        sub.next_many(Duration::from_millis(50), 4, |v| v.len()),
        None
    );
}

#[test]
fn sources_come_and_go_at_run_time_without_disturbing_the_others() {
    let release = Release::NEWEST_KNOWN;
    let ctx = zmq::Context::new();
    let engines: Vec<Publisher> = (0..3)
        .map(|_| Publisher::start(&ctx, PublisherConfig::loopback(release)).expect("engine"))
        .collect();
    let mut sub = subscriber(&ctx, vec![source_of(&engines[0], true)]);
    assert!(engines[0].wait_for_subscribers(1, WAIT));
    engines[0].publish(&batch(0)).expect("publish");
    collect(&mut sub, has("B0:0"));
    // Two pods come up.
    let b = sub.add_source(source_of(&engines[1], true)).expect("add");
    let c = sub.add_source(source_of(&engines[2], true)).expect("add");
    assert_eq!((b, c, sub.active_sources()), (1, 2, 3));
    for e in &engines[1..] {
        assert!(e.wait_for_subscribers(1, WAIT));
    }
    engines[1].publish(&batch(0)).expect("publish");
    engines[2].publish(&batch(0)).expect("publish");
    engines[0].publish(&batch(1)).expect("publish");
    let seen = collect(&mut sub, |s| {
        has("B1:0")(s) && has("B2:0")(s) && has("B0:1")(s)
    });
    assert!(seen.contains(&"R1:startup".to_owned()) && seen.contains(&"R2:startup".to_owned()));
    // One goes away: its sockets go, the others keep flowing.
    assert!(sub.remove_source(1));
    assert!(!sub.remove_source(1), "removed once");
    assert_eq!(sub.active_sources(), 2);
    engines[1].publish(&batch(1)).expect("publish");
    engines[2].publish(&batch(1)).expect("publish");
    engines[0].publish(&batch(2)).expect("publish");
    let seen = collect(&mut sub, |s| has("B2:1")(s) && has("B0:2")(s));
    assert!(
        !seen
            .iter()
            .any(|x| x.starts_with("B1:") || x.starts_with("R1:")),
        "{seen:?}"
    );
    sub.shutdown();
}

#[test]
fn three_hundred_sources_in_one_process() {
    let release = Release::NEWEST_KNOWN;
    let (ctx, engine) = engine(release);
    // Every source follows the same engine: 300 SUB sockets in this process, more
    // than one libzmq context holds (the transport opens a second one).
    let mut sub = subscriber(&ctx, Vec::new());
    for _ in 0..300 {
        sub.add_source(source_of(&engine, false)).expect("add");
    }
    assert!(engine.wait_for_subscribers(300, WAIT));
    engine.publish(&batch(0)).expect("publish");
    let seen = collect(&mut sub, |s| {
        s.iter()
            .filter(|x| x.ends_with(":0") && x.starts_with('B'))
            .count()
            == 300
    });
    assert_eq!(seen.iter().filter(|x| x.starts_with('B')).count(), 300);
    for i in (0..300).step_by(2) {
        assert!(sub.remove_source(i));
    }
    assert_eq!(sub.active_sources(), 150);
    sub.shutdown();
}

#[test]
fn a_subscriber_joining_an_idle_engine_learns_what_it_published() {
    let release = Release::NEWEST_KNOWN;
    let (ctx, engine) = engine(release);
    // Published before anyone listened, and nothing after: only the replay buffer has them.
    for i in 0..3 {
        engine.publish_lost(payload(release, i));
    }
    let mut sub = subscriber(&ctx, vec![source_of(&engine, true)]);
    let seen = collect(&mut sub, has("B0:2"));
    assert_eq!(seen, ["R0:startup", "B0:0", "B0:1", "B0:2"]);
    assert!(!sub.health().any(|h| h.degraded()), "complete from seq 0");
}
