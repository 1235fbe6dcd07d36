//! The transport over real sockets: both topologies and the replay protocol, frames untouched.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvevent_test_support::{HeldPort, eventually_blocking};
use kvevent_wire::{Release, frames};
use kvevent_zmq::publisher::{Publisher, PublisherConfig, binds};
use kvevent_zmq::{Delivery, Frames, ReplayOutcome, Source, SourceOptions, Transport};

const WAIT: Duration = Duration::from_secs(10);

/// The next delivery that is not a `Connected` (checked on its own below), read by polling.
fn recv(transport: &mut Transport, got: &mut VecDeque<Frames>) -> Frames {
    eventually_blocking("a delivery", WAIT, || {
        while let Some(f) = got.pop_front() {
            if f.delivery != Delivery::Connected {
                return Ok(f);
            }
        }
        transport.poll(Duration::from_millis(100), got);
        Err("nothing but Connected".into())
    })
}

/// Polls until `engine` has `n` subscribers: libzmq sends a subscription as the socket is used.
fn subscribed(transport: &mut Transport, got: &mut VecDeque<Frames>, engine: &Publisher, n: usize) {
    eventually_blocking("the subscriptions", WAIT, || {
        if engine.wait_for_subscribers(n, Duration::ZERO) {
            return Ok(());
        }
        transport.poll(Duration::from_millis(20), got);
        Err(format!("fewer than {n}"))
    });
}

/// A source that connects to `endpoint`: no replay, every topic, rank 0.
fn connect_to(endpoint: impl Into<String>) -> Source {
    Source {
        endpoint: endpoint.into(),
        replay_endpoint: None,
        topic: Vec::new(),
        bind: false,
        dp_rank: 0,
    }
}

#[test]
fn reverse_topology_the_engine_connects_and_we_bind() {
    let ctx = zmq::Context::new();
    // The port is held until the end: we bind it, and nothing else can.
    let port = HeldPort::new();
    let endpoint = port.tcp();
    assert!(!binds(&endpoint), "no wildcard: vLLM's publisher connects");
    let source = Source {
        endpoint: endpoint.clone(),
        replay_endpoint: None,
        topic: Vec::new(),
        bind: true,
        dp_rank: 0,
    };
    let mut transport =
        Transport::start(&ctx, &[source], &SourceOptions::default()).expect("start");
    let config = PublisherConfig {
        endpoint,
        replay_endpoint: None,
        ..PublisherConfig::loopback(Release::NEWEST_KNOWN)
    };
    let engine = Publisher::start(&ctx, config).expect("engine");
    let mut got = VecDeque::new();
    subscribed(&mut transport, &mut got, &engine, 1);
    engine.publish_payload(b"\x90".to_vec());
    let got = recv(&mut transport, &mut got);
    assert_eq!(got.source, 0);
    let Delivery::Live(msg) = got.delivery else {
        panic!("{got:?}")
    };
    let live = frames::parse_live(&msg).expect("live");
    assert_eq!(
        (live.topic, live.seq, live.payload),
        (&b"kv-events"[..], 0, &b"\x90"[..])
    );
    transport.shutdown();
}

#[test]
fn a_replay_hands_out_raw_replies_then_done() {
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::new(0, 26, 0))).expect("engine");
    for i in 0..3u8 {
        engine.publish_payload(vec![i]);
    }
    let source = Source {
        endpoint: engine.endpoint().to_owned(),
        replay_endpoint: engine.replay_endpoint().map(str::to_owned),
        topic: b"kv-events".to_vec(),
        bind: false,
        dp_rank: 0,
    };
    let mut transport =
        Transport::start(&ctx, &[source], &SourceOptions::default()).expect("start");
    assert!(transport.request_replay(0, 1));
    let mut seqs = Vec::new();
    let mut got = VecDeque::new();
    loop {
        match recv(&mut transport, &mut got).delivery {
            Delivery::Replay(msg) => match frames::parse_replay(&msg).expect("reply") {
                frames::ReplayReply::Batch {
                    topic,
                    seq,
                    payload,
                } => {
                    assert_eq!(topic, Some(&b"kv-events"[..]));
                    assert_eq!(payload, [seq as u8]);
                    seqs.push(seq);
                }
                frames::ReplayReply::End => panic!("the end marker is not handed out"),
            },
            Delivery::ReplayDone(outcome) => {
                assert_eq!(outcome, ReplayOutcome::Complete);
                break;
            }
            Delivery::Live(_) | Delivery::Disconnected | Delivery::Connected => {}
        }
    }
    assert_eq!(seqs, [1, 2]);
    transport.shutdown();
}

#[test]
fn a_replay_with_no_answer_times_out() {
    let ctx = zmq::Context::new();
    // A ROUTER that never answers.
    let router = ctx.socket(zmq::ROUTER).expect("router");
    router.bind("tcp://127.0.0.1:*").expect("bind");
    let replay = router.get_last_endpoint().expect("ep").expect("utf8");
    let nothing = HeldPort::new();
    let source = Source {
        endpoint: nothing.tcp(),
        replay_endpoint: Some(replay),
        topic: Vec::new(),
        bind: false,
        dp_rank: 0,
    };
    let opts = SourceOptions {
        replay_idle_timeout: Duration::from_millis(200),
        ..SourceOptions::default()
    };
    let mut transport = Transport::start(&ctx, &[source], &opts).expect("start");
    let started = Instant::now();
    assert!(transport.request_replay(0, 0));
    assert_eq!(
        recv(&mut transport, &mut VecDeque::new()).delivery,
        Delivery::ReplayDone(ReplayOutcome::TimedOut)
    );
    assert!(started.elapsed() >= Duration::from_millis(200));
    // The request reached the ROUTER in vLLM's shape: [identity, "", start].
    let request = router.recv_multipart(zmq::DONTWAIT).expect("request");
    assert_eq!(request.len(), 3);
    assert!(request[1].is_empty());
    assert_eq!(request[2], 0u64.to_be_bytes());
    transport.shutdown();
}

/// The next deliveries that are not `Connected`, read by the caller's thread.
fn poll_until(transport: &mut Transport, n: usize) -> Vec<Frames> {
    let mut got = VecDeque::new();
    eventually_blocking("the deliveries", WAIT, || {
        let delivered = got
            .iter()
            .filter(|f: &&Frames| f.delivery != Delivery::Connected)
            .count();
        if delivered >= n {
            return Ok(());
        }
        transport.poll(Duration::from_millis(100), &mut got);
        Err(format!("{got:?}"))
    });
    got.into_iter()
        .filter(|f| f.delivery != Delivery::Connected)
        .collect()
}

#[test]
fn live_replay_and_timeout_read_in_the_caller_with_no_thread() {
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let silent = ctx.socket(zmq::ROUTER).expect("router");
    silent.bind("tcp://127.0.0.1:*").expect("bind");
    let nothing = HeldPort::new();
    let sources = [
        Source {
            endpoint: engine.endpoint().to_owned(),
            replay_endpoint: engine.replay_endpoint().map(str::to_owned),
            topic: b"kv-events".to_vec(),
            bind: false,
            dp_rank: 0,
        },
        // A second source whose replay endpoint never answers.
        Source {
            endpoint: nothing.tcp(),
            replay_endpoint: Some(silent.get_last_endpoint().expect("ep").expect("utf8")),
            topic: Vec::new(),
            bind: false,
            dp_rank: 1,
        },
    ];
    let opts = SourceOptions {
        replay_idle_timeout: Duration::from_millis(200),
        ..SourceOptions::default()
    };
    let threads = std::fs::read_dir("/proc/self/task").map(|d| d.count()).ok();
    let mut transport = Transport::start(&ctx, &sources, &opts).expect("start");
    subscribed(&mut transport, &mut VecDeque::new(), &engine, 1);
    engine.publish_payload(b"\x90".to_vec());
    let got = poll_until(&mut transport, 1);
    let Delivery::Live(msg) = &got[0].delivery else {
        panic!("{got:?}")
    };
    assert_eq!(got[0].source, 0);
    assert_eq!(frames::parse_live(msg).expect("live").seq, 0);

    // Both replays at once: one completes, the other times out, each tagged with its source.
    assert!(transport.request_replay(0, 0));
    assert!(transport.request_replay(1, 0));
    let got = poll_until(&mut transport, 3);
    let mut seen: Vec<(usize, String)> = got
        .iter()
        .map(|f| {
            (
                f.source,
                format!("{:?}", f.delivery).chars().take(24).collect(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(got.iter().filter(|f| f.source == 0).count(), 2, "{seen:?}");
    assert!(
        got.iter()
            .any(|f| f.source == 0 && f.delivery == Delivery::ReplayDone(ReplayOutcome::Complete))
    );
    assert!(
        got.iter()
            .any(|f| f.source == 1 && f.delivery == Delivery::ReplayDone(ReplayOutcome::TimedOut))
    );
    // No thread of its own was started (libzmq's context threads existed before).
    assert_eq!(
        std::fs::read_dir("/proc/self/task").map(|d| d.count()).ok(),
        threads
    );
    // A removed source is not read any more: a source added after it, on the same engine,
    // gets the message it would have had.
    assert!(transport.remove(0));
    let again = transport.add(&sources[0]).expect("add");
    assert_eq!(again, 2, "an index is never reused");
    // Published until it arrives (the new subscription takes its time to reach the engine).
    let mut rest: VecDeque<Frames> = VecDeque::new();
    eventually_blocking("a live batch on the new source", WAIT, || {
        if rest.iter().any(|f| matches!(f.delivery, Delivery::Live(_))) {
            return Ok(());
        }
        engine.publish_payload(b"\x90".to_vec());
        transport.poll(Duration::from_millis(100), &mut rest);
        Err(format!("{rest:?}"))
    });
    assert!(rest.iter().all(|f| f.source != 0), "{rest:?}");
    transport.shutdown();
}

/// A socket is read when its descriptor signals (libzmq's edge-triggered
/// way): a burst longer than one read is finished on the next calls, and a socket read to
/// its end signals again for what comes later, as does the monitor for a disconnect.
#[test]
fn a_burst_is_finished_and_later_messages_still_wake_the_poll() {
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let source = connect_to(engine.endpoint().to_owned());
    let mut transport =
        Transport::start(&ctx, &[source], &SourceOptions::default()).expect("start");
    subscribed(&mut transport, &mut VecDeque::new(), &engine, 1);
    // More than two reads' worth (256 messages a socket a call), queued before any read.
    for _ in 0..600 {
        engine.publish_payload(b"\x90".to_vec());
    }
    let seqs = |got: &[Frames]| -> Vec<u64> {
        got.iter()
            .map(|f| match &f.delivery {
                Delivery::Live(msg) => frames::parse_live(msg).expect("live").seq,
                other => panic!("{other:?}"),
            })
            .collect()
    };
    assert_eq!(
        seqs(&poll_until(&mut transport, 600)),
        (0..600).collect::<Vec<_>>()
    );
    // Drained and idle: nothing more.
    let mut idle = VecDeque::new();
    transport.poll(Duration::from_millis(200), &mut idle);
    assert!(
        idle.iter().all(|f| f.delivery == Delivery::Connected),
        "{idle:?}"
    );
    // A message after the socket went quiet wakes the next poll.
    for round in 0..3u64 {
        engine.publish_payload(b"\x90".to_vec());
        assert_eq!(seqs(&poll_until(&mut transport, 1)), [600 + round]);
    }
    engine.shutdown();
    let got = poll_until(&mut transport, 1);
    assert_eq!(got[0].delivery, Delivery::Disconnected);
    transport.shutdown();
}

#[test]
fn a_bad_endpoint_fails_at_start_with_its_name() {
    let ctx = zmq::Context::new();
    let source = Source {
        endpoint: "tcp://nowhere-valid".into(),
        replay_endpoint: None,
        topic: Vec::new(),
        bind: true,
        dp_rank: 0,
    };
    let err = Transport::start(&ctx, &[source], &SourceOptions::default()).expect_err("bad");
    assert!(err.to_string().contains("tcp://nowhere-valid"), "{err}");
}

#[test]
fn shutdown_is_prompt() {
    let ctx = zmq::Context::new();
    let nothing = HeldPort::new();
    let source = connect_to(nothing.tcp());
    let transport = Transport::start(&ctx, &[source], &SourceOptions::default()).expect("start");
    let started = Instant::now();
    transport.shutdown();
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[test]
fn losing_the_engine_is_reported_as_a_disconnect() {
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let source = connect_to(engine.endpoint().to_owned());
    let mut transport =
        Transport::start(&ctx, &[source], &SourceOptions::default()).expect("start");
    let mut got = VecDeque::new();
    subscribed(&mut transport, &mut got, &engine, 1);
    eventually_blocking("a delivery", WAIT, || {
        if !got.is_empty() {
            return Ok(());
        }
        transport.poll(Duration::from_millis(100), &mut got);
        Err("none".into())
    });
    assert_eq!(got[0].delivery, Delivery::Connected);
    engine.shutdown();
    assert_eq!(
        recv(&mut transport, &mut got).delivery,
        Delivery::Disconnected
    );
    transport.shutdown();
}
