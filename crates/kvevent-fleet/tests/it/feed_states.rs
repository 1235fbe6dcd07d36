//! Engines' and feeds' states as a Fleet tells them: vLLM and SGLang engines side by side, an
//! engine lost behind a live sidecar against a sidecar lost, a block size not yet known, a feed
//! that cannot be reached, a starved follower's lease.

use std::time::{Duration, Instant};

use kvevent_feed::{EngineRank, Hub, HubConfig};
use kvevent_fleet::{
    Degraded, Fleet, FleetConfig, Lost, Query, QueryKeys, ReplicaSource, ReplicaState, ScoreError,
    SidecarFeed,
};
use kvevent_test_support::eventually_blocking;
use kvevent_wire as wire;

#[allow(clippy::wildcard_imports, reason = "the feed tests' helpers")]
use crate::feed::*;

#[test]
fn a_fleet_follows_vllm_and_sglang_engines_side_by_side() {
    use kvevent_zmq::publisher::{Publisher, PublisherConfig};
    let ctx = zmq::Context::new();
    let vllm = Publisher::start(&ctx, PublisherConfig::loopback(wire::Release::NEWEST_KNOWN))
        .expect("vllm engine");
    let sglang = Publisher::start(&ctx, PublisherConfig::loopback(wire::Release::NEWEST_KNOWN))
        .expect("sglang engine");
    // Both stored tokens 0..32 in blocks of 16: vLLM's wire, and SGLang 0.5.18's own bytes (an
    // unsalted store of them beside a salted one).
    vllm.publish(&stored(0, 2)).expect("publish");
    let payload = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../testdata/vectors/sglang-0.5.18/cache_salt.msgpack"),
    )
    .expect("vector");
    sglang.publish_payload(payload);
    let rt = runtime();
    let fleet = Fleet::with_runtime(FleetConfig::default(), rt.handle().clone());
    let sockets = |p: &Publisher, engine| {
        ReplicaSource::Engine(kvevent_fleet::EngineSockets {
            replay: p.replay_endpoint().map(str::to_owned),
            engine,
            ..kvevent_fleet::EngineSockets::new(p.endpoint())
        })
    };
    fleet
        .ensure_replica("v", sockets(&vllm, kvevent_wire::Engine::Vllm))
        .expect("vllm");
    fleet
        .ensure_replica("s", sockets(&sglang, kvevent_wire::Engine::Sglang))
        .expect("sglang");
    let ids: Vec<u32> = (0..32).collect();
    let query = Query {
        adapter: "",
        keys: QueryKeys::Tokens {
            ids: &ids,
            block_size: BLOCK,
        },
    };
    // The SGLang engine stored 0..16 unsalted and 0..32 salted: unsalted, it matches one block;
    // under the salt's adapter, two, and the vLLM engine none.
    let salted_adapter = kvevent_mapper::salted_adapter("", "tenant-a");
    let salted = Query {
        adapter: &salted_adapter,
        keys: query.keys.clone(),
    };
    let blocks = |q: &Query<'_>| -> Vec<(String, u32)> {
        // Until a store said the block size, a token query cannot be chained.
        match fleet.score(q) {
            Ok(scores) => scores
                .iter()
                .map(|s| (s.replica.to_owned(), s.matched_blocks))
                .collect(),
            Err(e) => {
                assert_eq!(e, ScoreError::BlockSizeUnknown);
                Vec::new()
            }
        }
    };
    eventually_blocking("both replicas", WAIT, || {
        if blocks(&query) == [("v".to_owned(), 2), ("s".to_owned(), 1)]
            && blocks(&salted) == [("s".to_owned(), 2)]
        {
            return Ok(());
        }
        Err(format!("{:?} {:?}", fleet.score(&query), fleet.replicas()))
    });
}
/// The sidecar loses its engine: the replica, followed through the live sidecar, is degraded
/// at once and stale after `dead_after`, saying the engine was lost; its engine back, it is
/// exact again. Then the sidecar itself goes: stale, saying the source was lost. Each within
/// `dead_after` + 0.5 s, watched through `changes`, not polled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_lost_behind_a_live_sidecar_and_a_lost_sidecar_are_told_apart() {
    let hub = Hub::new(HubConfig {
        heartbeat: Duration::from_millis(200),
        ..HubConfig::new("replica-a", "m")
    });
    let up = |connected| {
        [EngineRank {
            rank: 0,
            health: if connected {
                kvevent_source::RankHealth::Trusted
            } else {
                kvevent_source::RankHealth::Disconnected
            },
        }]
    };
    hub.set_engine(&up(true));
    let mut m = mapper();
    publish(&hub, &mut m, &stored(1, 2));
    let served = serve_on(&hub, "127.0.0.1:0").await;
    let dead_after = Duration::from_millis(600);
    let fleet = served.followed(FleetConfig {
        dead_after,
        ..FleetConfig::default()
    });
    fleet.ready(WAIT).await.expect("ready");
    let status = &fleet.replicas()[0];
    assert_eq!(status.ranks.len(), 1);
    assert!(
        status.ranks[0].connected && status.error.is_none(),
        "{status:?}"
    );
    let state = || fleet.replicas()[0].state;
    let until = |want: fn(ReplicaState) -> bool, within: Duration| {
        let mut changes = fleet.changes();
        let state = &state;
        async move {
            let started = Instant::now();
            tokio::time::timeout(within, async {
                while !want(state()) {
                    changes.changed().await.expect("fleet alive");
                }
            })
            .await
            .unwrap_or_else(|_| panic!("not reached in {within:?}: {:?}", state()));
            started.elapsed()
        }
    };
    // The engine goes: degraded at once (well before a heartbeat), then stale.
    hub.set_engine(&up(false));
    until(
        |s| s == ReplicaState::Degraded(Degraded::EngineLost),
        Duration::from_millis(500),
    )
    .await;
    assert!(!fleet.replicas()[0].ranks[0].connected);
    let waited = until(
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
    assert!(
        waited + Duration::from_millis(50) >= dead_after / 2,
        "{waited:?}"
    );
    // Its entries still count, stale, until drop_after.
    assert!(matches!(
        matched(&fleet, 1, 2),
        Some((
            2,
            ReplicaState::Stale {
                lost: Lost::Engine,
                ..
            }
        ))
    ));
    // It comes back.
    hub.set_engine(&up(true));
    until(|s| s == ReplicaState::Exact, Duration::from_millis(500)).await;
    // The sidecar goes: degraded (connecting), then stale, the source lost.
    served.stop().await;
    until(
        |s| {
            matches!(
                s,
                ReplicaState::Stale {
                    lost: Lost::Source,
                    ..
                }
            )
        },
        dead_after + Duration::from_millis(500) + HubConfig::new("", "").heartbeat * 3,
    )
    .await;
    assert!(fleet.replicas()[0].error.is_some());
}
/// A sidecar's feed served before its events thread's first turn (the hub knows its ranks,
/// not their health): a follower is told the ranks are not connected, never that the empty
/// state is exact; the first turn's health makes it exact. (A real engine's test once saw the
/// empty state called exact in that window.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_before_the_sidecar_s_first_turn_is_not_told_exact() {
    let hub = Hub::new(HubConfig {
        ranks: vec![0, 1],
        ..HubConfig::new("replica-a", "m")
    });
    hub.commit();
    let served = serve_on(&hub, "127.0.0.1:0").await;
    // Degraded, not yet stale, however slow the machine: the state asserted is one.
    let fleet = served.followed(FleetConfig {
        dead_after: Duration::from_secs(60),
        ..FleetConfig::default()
    });
    let err = fleet
        .ready(Duration::from_millis(1500))
        .await
        .expect_err("never exact before the engine is seen");
    let status = &fleet.replicas()[0];
    assert_eq!(
        status
            .ranks
            .iter()
            .map(|r| (r.rank, r.connected))
            .collect::<Vec<_>>(),
        [(0, false), (1, false)],
        "{status:?} ({err})"
    );
    assert!(
        matches!(status.state, ReplicaState::Degraded(Degraded::EngineLost)),
        "{status:?}"
    );
    let trusted = |rank| EngineRank {
        rank,
        health: kvevent_source::RankHealth::Trusted,
    };
    hub.set_engine(&[trusted(0), trusted(1)]);
    fleet.ready(WAIT).await.expect("exact once the ranks are");
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_any_block_size_is_known_a_token_query_says_so() {
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    let ids = prompt(0, 1);
    let query = Query {
        adapter: "",
        keys: QueryKeys::Tokens {
            ids: &ids,
            block_size: BLOCK,
        },
    };
    assert_eq!(
        fleet.score(&query).expect_err("unknown"),
        ScoreError::BlockSizeUnknown
    );
    // Keys need no block size; a replica not followed is named as such.
    let keys = Query {
        adapter: "",
        keys: QueryKeys::Keys(&[1]),
    };
    let answer = fleet.score_among(&keys, &["nobody"]).expect("keys");
    assert_eq!((answer.len(), answer.unknown()), (0, &[0usize][..]));
    // Waiting for a replica that is not followed fails at once, naming it: waiting cannot
    // help.
    let asked = std::time::Instant::now();
    let err = fleet
        .ready_among(&["nobody"], Duration::from_secs(30))
        .await
        .expect_err("not followed");
    assert!(err.to_string().contains("nobody (not followed)"), "{err}");
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "{:?}",
        asked.elapsed()
    );
}
/// A sidecar nobody listens for: the replica's error names the address and the cause, in our
/// words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_that_cannot_be_reached_says_where_and_why() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        listener.local_addr().expect("address").port()
    };
    let url = format!("http://127.0.0.1:{port}");
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    fleet
        .ensure_replica("a", ReplicaSource::Sidecar(SidecarFeed::new(url.clone())))
        .expect("ensure");
    let want = format!("cannot connect to {url}: ");
    tokio::task::block_in_place(|| {
        wait_until("the error", || {
            fleet.replicas()[0]
                .error
                .as_deref()
                .is_some_and(|e| e.starts_with(&want))
        });
    });
    let error = fleet.replicas()[0].error.clone().unwrap_or_default();
    assert!(error.to_lowercase().contains("refused"), "{error}");
    assert_eq!(
        state_of(&fleet, "a"),
        Some(ReplicaState::Degraded(kvevent_fleet::Degraded::Connecting)),
        "an address that does not answer may be an outage: degraded, then stale"
    );
}
/// The lease on `exact`: a Fleet whose runtime is starved (a task blocking its only thread:
/// the follower cannot run, nothing marks the replica silent) answers, from another thread,
/// `lease_expired` two heartbeats after it last heard from the sidecar, never `exact`; the
/// sidecar and its feed keep running meanwhile. Once the runtime runs again, `exact`.
#[test]
fn a_starved_follower_never_answers_exact_past_its_lease() {
    let sidecar_rt = runtime();
    let hub = Hub::new(HubConfig {
        heartbeat: Duration::from_millis(100),
        ..HubConfig::new("replica-a", "model-m")
    });
    let mut m = mapper();
    publish(&hub, &mut m, &stored(1, 3));
    let served = sidecar_rt.block_on(serve_on(&hub, "127.0.0.1:0"));
    // The fleet on a runtime of one thread of its own, driven by a thread of its own.
    let fleet_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let handle = fleet_rt.handle().clone();
    let fleet = {
        let _in = fleet_rt.enter();
        Fleet::new(FleetConfig::default()).expect("fleet")
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let driver = std::thread::spawn(move || {
        fleet_rt.block_on(async {
            let _ = stopped.await;
        });
    });
    let feed = SidecarFeed {
        replica: "replica-a".into(),
        model: "model-m".into(),
        ..SidecarFeed::new(served.url.clone())
    };
    {
        let _in = handle.enter();
        fleet
            .ensure_replica("a", ReplicaSource::Sidecar(feed))
            .expect("ensure");
    }
    wait_until("exact", || {
        state_of(&fleet, "a") == Some(ReplicaState::Exact)
    });
    assert_eq!(matched(&fleet, 1, 3), Some((3, ReplicaState::Exact)));
    // Starve it: the runtime's one thread blocked for 2 s.
    handle.spawn(async { std::thread::sleep(Duration::from_secs(2)) });
    let starved_at = Instant::now();
    std::thread::sleep(Duration::from_millis(600));
    let expired = ReplicaState::Degraded(Degraded::LeaseExpired);
    // Two heartbeats (200 ms) and more since it last heard: every answer says so.
    let mut answers = 0;
    while starved_at.elapsed() < Duration::from_millis(1_700) {
        assert_eq!(matched(&fleet, 1, 3), Some((3, expired)));
        assert_eq!(state_of(&fleet, "a"), Some(expired));
        answers += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(answers > 10, "{answers} answers while starved");
    // It runs again: it hears the sidecar, and its word holds again.
    wait_until("exact again", || {
        matched(&fleet, 1, 3) == Some((3, ReplicaState::Exact))
    });
    let _ = stop.send(());
    driver.join().expect("the driver");
    drop(fleet);
    sidecar_rt.block_on(served.stop());
}
