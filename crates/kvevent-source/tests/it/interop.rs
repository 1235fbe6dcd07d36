//! Interop with a publisher built on msgspec + pyzmq as vLLM's is: both libzmqs really talk.

use std::time::{Duration, Instant};

use kvevent_source::{Config, Subscriber, Update};
use kvevent_test_support::PythonPublisher;
use kvevent_wire as wire;
use kvevent_zmq as transport;

fn run(release: &str) {
    let python = PythonPublisher::spawn(release, &["--interval", "0.02", "--count", "400"]);
    let ctx = zmq::Context::new();
    let source = transport::Source {
        endpoint: python.endpoint.clone(),
        replay_endpoint: Some(python.replay_endpoint.clone()),
        topic: b"kv-events".to_vec(),
        bind: false,
        dp_rank: 0,
    };
    let mut sub = Subscriber::start(&ctx, Config::new(vec![source])).expect("subscriber");
    // The publisher starts before we subscribe (slow joiner): the first live seq is above 0,
    // and the replay from 0 must bring back everything before it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut next = 0u64;
    let mut resets = 0;
    while next < 20 {
        assert!(Instant::now() < deadline, "{release}: only {next} batches");
        match sub.next(Duration::from_millis(100)) {
            Some(Update::Batch(b)) => {
                assert_eq!(b.seq, next, "{release}: in order, none missing");
                let batch = b.decode().expect("decode");
                let i = b.seq;
                let wire::Event::BlockStored(s) = &batch.events[0] else {
                    panic!("{release}: batch {i} starts with {:?}", batch.events[0]);
                };
                assert_eq!(
                    s.block_hashes,
                    [2 * i + 1, 2 * i + 2].map(|h| wire::BlockHash::Int(wire::Int::U64(h)))
                );
                assert_eq!(
                    s.token_ids.to_vec(),
                    (32 * i as u32..32 * i as u32 + 32).collect::<Vec<_>>()
                );
                assert_eq!(batch.events.len(), 1 + (i % 2) as usize);
                next += 1;
            }
            Some(Update::Reset { .. }) => resets += 1,
            None => {}
        }
    }
    assert_eq!(resets, 1, "{release}: only the startup reset");
    sub.shutdown();
}

#[test]
fn python_msgspec_publisher_map_era_with_topic_replies() {
    run("0.33.0");
}

#[test]
fn python_msgspec_publisher_positional_era() {
    run("0.20.0");
}
