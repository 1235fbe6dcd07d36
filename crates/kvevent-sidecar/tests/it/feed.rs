//! The router feed end to end: an engine stand-in, the sidecar serving its feed, and
//! a `Fleet` following it beside a router following the engine directly.

use std::time::{Duration, Instant};

use kvevent_fleet::{
    Degraded, EngineSockets, Fleet, FleetConfig, Lost, Query, QueryKeys, ReplicaSource,
    ReplicaState, ScoreError, SidecarFeed,
};
use kvevent_sidecar::{Settings, start};
use kvevent_test_support::{Received, RecordingServer, eventually_blocking, when};
use kvevent_wire::{self as wire, Release};
use kvevent_zmq::publisher::{Publisher, PublisherConfig};

pub(crate) const WAIT: Duration = Duration::from_secs(20);
pub(crate) const BLOCK: usize = 16;

pub(crate) fn prompt(seed: u64) -> Vec<u32> {
    (0..(2 * BLOCK) as u32)
        .map(|t| seed as u32 * 1000 + t)
        .collect()
}

/// One prompt of two blocks stored.
pub(crate) fn stored(seed: u64) -> wire::EventBatch<'static> {
    wire::EventBatch::new(
        1.0,
        vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: (0..2)
                .map(|h| wire::BlockHash::Int(wire::Int::U64(seed * 10 + h + 1)))
                .collect(),
            token_ids: prompt(seed).into(),
            block_size: BLOCK as u32,
            ..Default::default()
        })],
    )
}

/// Blocks of prompt `seed` the fleet finds on `replica`; none while it does not know the block
/// size yet (a feed's hello before the engine's first block says 0; the health after the
/// first change says it).
pub(crate) fn blocks_matched(fleet: &Fleet, replica: &str, seed: u64) -> u32 {
    let ids = prompt(seed);
    let query = Query {
        adapter: "",
        keys: QueryKeys::Tokens {
            ids: &ids,
            block_size: BLOCK,
        },
    };
    match fleet.score_among(&query, &[replica]) {
        Ok(scores) => scores.first().map_or(0, |s| s.matched_blocks),
        Err(ScoreError::BlockSizeUnknown) => 0,
        Err(e) => panic!("score: {e:?}"),
    }
}

pub(crate) fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    eventually_blocking(what, WAIT, || when(f(), |held| *held).map(|_| ()));
}

/// Follows the sidecar at `feed_url` (replica `r1` of `llama`) as `name`.
pub(crate) fn follow_sidecar(fleet: &Fleet, name: &str, feed_url: &str) {
    fleet
        .ensure_replica(
            name,
            ReplicaSource::Sidecar(SidecarFeed {
                replica: "r1".into(),
                model: "llama".into(),
                ..SidecarFeed::new(feed_url)
            }),
        )
        .expect("sidecar");
}

/// Waits until `name` is exact: its snapshot is whole.
pub(crate) fn wait_exact(fleet: &Fleet, name: &str) {
    wait_until("the snapshot", || {
        fleet
            .replicas()
            .iter()
            .any(|r| r.name == name && r.state == ReplicaState::Exact)
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_router_following_the_sidecar_knows_every_resident_prefix() {
    let server = RecordingServer::start().await;
    let ctx = zmq::Context::new();
    // A replay buffer of 10 batches: a router joining late learns only those from the engine.
    let engine = Publisher::start(
        &ctx,
        PublisherConfig {
            buffer_steps: 10,
            ..PublisherConfig::loopback(Release::NEWEST_KNOWN)
        },
    )
    .expect("engine");
    let s = Settings {
        feed_address: "127.0.0.1:0".into(),
        ..crate::loopback(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let feed_url = format!("http://{}", running.feed_addr().expect("feed address"));
    tokio::task::block_in_place(|| {
        assert!(engine.wait_for_subscribers(1, WAIT));
        for seed in 0..50 {
            engine.publish(&stored(seed)).expect("publish");
        }
        let hub = running.telemetry().feed.hub().expect("hub").clone();
        wait_until("the sidecar holds them", || hub.blocks() == 100);

        let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
        follow_sidecar(&fleet, "via-sidecar", &feed_url);
        fleet
            .ensure_replica(
                "direct",
                ReplicaSource::Engine(EngineSockets {
                    replay: engine.replay_endpoint().map(str::to_owned),
                    ..EngineSockets::new(engine.endpoint())
                }),
            )
            .expect("engine");
        wait_exact(&fleet, "via-sidecar");
        // Every resident prefix through the sidecar.
        let via_sidecar = (0..50)
            .filter(|s| blocks_matched(&fleet, "via-sidecar", *s) == 2)
            .count();
        assert_eq!(via_sidecar, 50);
        // The engine's replay buffer held the last 10 batches only.
        wait_until("the direct replay", || {
            blocks_matched(&fleet, "direct", 49) == 2
        });
        let direct = (0..50)
            .filter(|s| blocks_matched(&fleet, "direct", *s) == 2)
            .count();
        assert_eq!(direct, 10);

        // Live changes reach both.
        engine.publish(&stored(77)).expect("publish");
        wait_until("a live change", || {
            blocks_matched(&fleet, "via-sidecar", 77) == 2
                && blocks_matched(&fleet, "direct", 77) == 2
        });

        // The engine restarts: the sidecar clears (a new epoch) and the follower drops the old
        // process's prefixes with the new snapshot.
        engine.restart();
        engine.publish(&stored(200)).expect("publish");
        wait_until("the new epoch", || {
            blocks_matched(&fleet, "via-sidecar", 200) == 2
                && blocks_matched(&fleet, "via-sidecar", 3) == 0
        });
        assert!(
            hub.metrics()
                .new_epochs
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 1
        );
    });
    running.shutdown(Duration::from_secs(2)).await;
}

/// Kill the engine behind a live sidecar, then the sidecar: a router's `Fleet` following the
/// sidecar shows each as what it is (the engine lost, then the source lost) within
/// `dead_after` + 0.5 s, as a router following the engine directly sees the engine go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_following_a_sidecar_sees_its_engine_die_then_the_sidecar() {
    let (server, ctx, engine) = crate::ends().await;
    let s = Settings {
        feed_address: "127.0.0.1:0".into(),
        ..crate::loopback(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let feed_url = format!("http://{}", running.feed_addr().expect("feed address"));
    let dead_after = Duration::from_millis(800);
    let fleet = Fleet::new(FleetConfig {
        dead_after,
        ..FleetConfig::default()
    })
    .expect("fleet");
    fleet
        .ensure_replica(
            "via-sidecar",
            ReplicaSource::Sidecar(SidecarFeed::new(feed_url)),
        )
        .expect("sidecar");
    fleet
        .ensure_replica(
            "direct",
            ReplicaSource::Engine(EngineSockets::new(engine.endpoint())),
        )
        .expect("engine");
    tokio::task::block_in_place(|| assert!(engine.wait_for_subscribers(2, WAIT)));
    engine.publish(&stored(1)).expect("publish");
    fleet.ready(WAIT).await.expect("both exact");
    let via = fleet
        .replicas()
        .into_iter()
        .find(|r| r.name == "via-sidecar")
        .expect("via");
    assert_eq!(via.ranks.len(), 1, "{via:?}");
    assert!(via.ranks[0].connected, "{via:?}");
    let state = |name: &str| {
        fleet
            .replicas()
            .into_iter()
            .find(|r| r.name == name)
            .map(|r| r.state)
    };
    let until = |name: &'static str, want: fn(ReplicaState) -> bool, within: Duration| {
        let mut changes = fleet.changes();
        let state = &state;
        async move {
            tokio::time::timeout(within, async {
                while !state(name).is_some_and(want) {
                    changes.changed().await.expect("fleet alive");
                }
            })
            .await
            .unwrap_or_else(|_| panic!("{name}: not reached in {within:?}: {:?}", state(name)));
        }
    };
    // The engine dies.
    drop(engine);
    until(
        "via-sidecar",
        |s| s == ReplicaState::Degraded(Degraded::EngineLost),
        Duration::from_millis(500),
    )
    .await;
    until(
        "via-sidecar",
        |s| {
            matches!(
                s,
                ReplicaState::Stale {
                    lost: Lost::Engine,
                    ..
                }
            )
        },
        dead_after + Duration::from_millis(500),
    )
    .await;
    until(
        "direct",
        |s| {
            matches!(
                s,
                ReplicaState::Stale {
                    lost: Lost::Source,
                    ..
                }
            )
        },
        dead_after + Duration::from_millis(500),
    )
    .await;
    // Then the sidecar: its feed is lost.
    running.shutdown(Duration::from_secs(2)).await;
    until(
        "via-sidecar",
        |s| {
            matches!(
                s,
                ReplicaState::Stale {
                    lost: Lost::Source,
                    ..
                }
            )
        },
        dead_after + Duration::from_millis(500),
    )
    .await;
}

/// `--key-mode engine` with a feed: the server gets the engine's block hashes, the feed the
/// fingerprints a router computes from token ids, both from one pass of the mappers; an
/// eviction reaches both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_engine_key_mode_the_feed_carries_fingerprints_from_the_same_pass() {
    let (server, ctx, engine) = crate::ends().await;
    let s = Settings {
        feed_address: "127.0.0.1:0".into(),
        key_mode: kvevent_mapper::KeyMode::Engine,
        ..crate::loopback(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let feed_url = format!("http://{}", running.feed_addr().expect("feed address"));
    tokio::task::block_in_place(|| {
        assert!(engine.wait_for_subscribers(1, WAIT));
        for seed in 0..5 {
            engine.publish(&stored(seed)).expect("publish");
        }
        // Seed 3's second block leaves the engine.
        engine
            .publish(&wire::EventBatch::new(
                2.0,
                vec![wire::Event::BlockRemoved(wire::BlockRemoved {
                    block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(32))],
                    ..Default::default()
                })],
            ))
            .expect("publish");
        let hub = running.telemetry().feed.hub().expect("hub").clone();
        wait_until("the feed holds them", || hub.blocks() == 9);
        let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
        follow_sidecar(&fleet, "r1", &feed_url);
        wait_exact(&fleet, "r1");
        for seed in [0, 1, 2, 4] {
            assert_eq!(blocks_matched(&fleet, "r1", seed), 2, "seed {seed}");
        }
        assert_eq!(
            blocks_matched(&fleet, "r1", 3),
            1,
            "its second block was evicted"
        );
    });
    // The server holds the engine's keys (block 32 evicted, or netted away with its store when
    // both fell in one window).
    let resident = |received: &[Received]| {
        let mut keys = std::collections::BTreeSet::new();
        for r in received {
            match r {
                Received::Update(u) => {
                    keys.extend(u.prefixes.iter().map(|p| p.prefix_hash.clone()))
                }
                Received::Event(e) => {
                    keys.remove(&e.prefix_hash);
                }
            }
        }
        keys.into_iter()
            .map(|k| u64::from_be_bytes(k.try_into().expect("8 bytes")))
            .collect::<Vec<u64>>()
    };
    let want = [1, 2, 11, 12, 21, 22, 31, 41, 42];
    server.wait_for(WAIT, |r| resident(r) == want).await;
    running.shutdown(Duration::from_secs(2)).await;
}

/// The router author's case: the engine behind a live sidecar is killed and comes back as a new
/// process, idle (it publishes nothing) or busy. A router following the sidecar, and one
/// following the engine directly, never call the replica exact while it still holds the old
/// process's blocks, and call it exact, with the new process's content, within 2 s of the new
/// engine's sockets answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_never_exact_with_the_old_process_blocks() {
    let (server, ctx, engine) = crate::ends().await;
    let s = Settings {
        feed_address: "127.0.0.1:0".into(),
        ..crate::loopback(&engine, &server)
    };
    let running = start(&s, &ctx).await.expect("start");
    let feed_url = format!("http://{}", running.feed_addr().expect("feed address"));
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    follow_sidecar(&fleet, "via-sidecar", &feed_url);
    let direct = EngineSockets {
        replay: engine.replay_endpoint().map(str::to_owned),
        ..EngineSockets::new(engine.endpoint())
    };
    fleet
        .ensure_replica("direct", ReplicaSource::Engine(direct))
        .expect("engine");
    let (endpoint, replay) = (
        engine.endpoint().to_owned(),
        engine.replay_endpoint().map(str::to_owned),
    );
    let mut engine = Some(engine);
    tokio::task::block_in_place(|| {
        let names = ["via-sidecar", "direct"];
        let exact_with = |name: &str, seed: u64| {
            fleet
                .replicas()
                .iter()
                .any(|r| r.name == name && r.state == ReplicaState::Exact)
                && blocks_matched(&fleet, name, seed) == 2
        };
        let live = engine.as_ref().expect("engine");
        assert!(live.wait_for_subscribers(2, WAIT));
        live.publish(&stored(1)).expect("publish");
        wait_until("both exact with the first process's blocks", || {
            names.iter().all(|n| exact_with(n, 1))
        });
        // Round 0: a new process whose events socket answers a second before its replay
        // socket does, then idle; round 1: busy, at once.
        for (round, new_seed) in [(0, None), (1, Some(3))] {
            let old_seed = if round == 0 { 1 } else { 2 };
            drop(engine.take());
            wait_until("both see the engine gone", || {
                fleet
                    .replicas()
                    .iter()
                    .all(|r| r.state != ReplicaState::Exact)
            });
            let wrong_exact = |wrong: &mut Vec<String>, seed: u64, since: Instant| {
                for name in names {
                    if exact_with(name, seed) {
                        wrong.push(format!("{name} at {:?}", since.elapsed()));
                    }
                }
            };
            let mut wrong = Vec::new();
            if round == 0 {
                let early = ctx.socket(zmq::PUB).expect("socket");
                early.set_linger(0).expect("linger");
                early.bind(&endpoint).expect("bind the events socket");
                let since = Instant::now();
                while since.elapsed() < Duration::from_secs(1) {
                    wrong_exact(&mut wrong, old_seed, since);
                    std::thread::sleep(Duration::from_millis(2));
                }
                drop(early);
            }
            // libzmq closes a socket's listener on its own thread: bound again once it has.
            let deadline = Instant::now() + WAIT;
            let restarted = loop {
                let config = PublisherConfig {
                    endpoint: endpoint.clone(),
                    replay_endpoint: replay.clone(),
                    bind: Some(true),
                    ..PublisherConfig::loopback(Release::NEWEST_KNOWN)
                };
                match Publisher::start(&ctx, config) {
                    Ok(p) => break p,
                    Err(e) => assert!(Instant::now() < deadline, "the engine again: {e}"),
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let back = Instant::now();
            if let Some(seed) = new_seed {
                restarted.publish(&stored(seed)).expect("publish");
            }
            // Watched every 2 ms until both are exact with the new process's content.
            loop {
                wrong_exact(&mut wrong, old_seed, back);
                let done = names.iter().all(|n| match new_seed {
                    None => fleet
                        .replicas()
                        .iter()
                        .any(|r| r.name == *n && r.state == ReplicaState::Exact && r.blocks == 0),
                    Some(seed) => exact_with(n, seed),
                });
                if done {
                    break;
                }
                assert!(
                    back.elapsed() < Duration::from_secs(2) + Duration::from_millis(500),
                    "round {round}: not exact with the new process within 2 s: {:?}",
                    fleet.replicas()
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            assert!(
                wrong.is_empty(),
                "round {round}: exact with the old process's blocks {} times, first {:?}, last {:?}",
                wrong.len(),
                wrong.first(),
                wrong.last()
            );
            if round == 0 {
                // The idle new process publishes now: it is this engine from here on.
                assert!(restarted.wait_for_subscribers(2, WAIT));
                restarted.publish(&stored(2)).expect("publish");
                wait_until("the new process's blocks", || {
                    names.iter().all(|n| exact_with(n, 2))
                });
            }
            engine = Some(restarted);
        }
    });
    running.shutdown(Duration::from_secs(2)).await;
}
