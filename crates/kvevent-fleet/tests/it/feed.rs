//! The feed end to end on loopback: a hub served by the real server, followed by a real
//! `Fleet` into its index.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kvevent_feed::{EngineRank, Hub, HubConfig, ServeOptions};
use kvevent_fleet::{
    Degraded, Fleet, FleetConfig, Lost, Query, QueryKeys, ReplicaSource, ReplicaState, ScoreError,
    SidecarFeed,
};
use kvevent_mapper::{Identity, KeyMode, Mapper, Options};
use kvevent_test_support::{eventually_blocking, when};
use kvevent_wire as wire;

const WAIT: Duration = Duration::from_secs(20);
const BLOCK: usize = 16;

fn mapper() -> Mapper {
    Mapper::new(
        Identity::new("r", "m", "", "test").expect("identity"),
        Options {
            key_mode: KeyMode::Fingerprint,
            ..Options::default()
        },
    )
}

/// A prompt of `blocks` blocks, distinct per `seed`.
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32)
        .map(|t| seed * 100_000 + t)
        .collect()
}

fn stored(seed: u32, blocks: usize) -> wire::EventBatch<'static> {
    wire::EventBatch::new(
        1.0,
        vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: (0..blocks as u64)
                .map(|h| wire::BlockHash::Int(wire::Int::U64(u64::from(seed) * 1000 + h + 1)))
                .collect(),
            token_ids: prompt(seed, blocks).into(),
            block_size: BLOCK as u32,
            ..Default::default()
        })],
    )
}

fn removed(seed: u32, block: u64) -> wire::EventBatch<'static> {
    wire::EventBatch::new(
        1.0,
        vec![wire::Event::BlockRemoved(wire::BlockRemoved {
            block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(
                u64::from(seed) * 1000 + block + 1,
            ))],
            ..Default::default()
        })],
    )
}

/// Maps a batch and hands its reports to the hub, as the sidecar's events thread does.
fn publish(hub: &Hub, mapper: &mut Mapper, batch: &wire::EventBatch<'_>) {
    let mut reports = Vec::new();
    mapper.map_batch(batch, &mut reports);
    for r in &reports {
        hub.apply(0, r);
    }
    hub.note_block_size(BLOCK as u32);
    hub.commit();
}

fn matched(fleet: &Fleet, seed: u32, blocks: usize) -> Option<(u32, ReplicaState)> {
    let ids = prompt(seed, blocks);
    let scores = fleet
        .score(&Query {
            adapter: "",
            keys: QueryKeys::Tokens {
                ids: &ids,
                block_size: BLOCK,
            },
        })
        .expect("score");
    scores.first().map(|s| (s.matched_blocks, s.state))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    eventually_blocking(what, WAIT, || when(f(), |held| *held).map(|_| ()));
}

fn state_of(fleet: &Fleet, name: &str) -> Option<ReplicaState> {
    fleet
        .replicas()
        .into_iter()
        .find(|r| r.name == name)
        .map(|r| r.state)
}

struct Served {
    url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

async fn serve_on(hub: &Arc<Hub>, address: &str) -> Served {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (addr, task) = kvevent_feed::serve(address, hub.clone(), ServeOptions::default(), async {
        let _ = rx.await;
    })
    .await
    .expect("serve");
    Served {
        url: format!("http://{addr}"),
        stop: Some(tx),
        task,
    }
}

impl Served {
    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), self.task).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_router_gets_everything_then_changes_then_a_new_epoch() {
    let hub = Hub::new(HubConfig {
        heartbeat: Duration::from_millis(200),
        snapshot_chunk: 7,
        ..HubConfig::new("replica-a", "model-m")
    });
    let mut m = mapper();
    // Resident before any router exists: 40 prompts of 3 blocks.
    for seed in 0..40 {
        publish(&hub, &mut m, &stored(seed, 3));
    }
    assert_eq!(hub.blocks(), 120);
    let served = serve_on(&hub, "127.0.0.1:0").await;
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    let feed = SidecarFeed {
        replica: "replica-a".into(),
        model: "model-m".into(),
        ..SidecarFeed::new(served.url.clone())
    };
    fleet
        .ensure_replica("a", ReplicaSource::Sidecar(feed.clone()))
        .expect("ensure");
    // Idempotent.
    fleet
        .ensure_replica("a", ReplicaSource::Sidecar(feed.clone()))
        .expect("ensure");
    tokio::task::block_in_place(|| {
        wait_until("exact", || {
            state_of(&fleet, "a") == Some(ReplicaState::Exact)
        });
        // Every resident prompt, not a replay buffer's share.
        for seed in 0..40 {
            assert_eq!(
                matched(&fleet, seed, 3),
                Some((3, ReplicaState::Exact)),
                "prompt {seed}"
            );
        }
        let status = &fleet.replicas()[0];
        assert_eq!(
            (status.blocks, status.block_size),
            (120, Some(BLOCK as u32))
        );
        // A query with another block size is an error, not an empty answer.
        let ids = prompt(0, 3);
        let err = fleet
            .score(&Query {
                adapter: "",
                keys: QueryKeys::Tokens {
                    ids: &ids,
                    block_size: 32,
                },
            })
            .expect_err("block size");
        assert!(err.to_string().contains("16"), "{err}");
        // Live changes.
        publish(&hub, &mut m, &stored(100, 2));
        publish(&hub, &mut m, &removed(0, 2));
        wait_until("live changes", || {
            matched(&fleet, 100, 2).is_some() && matched(&fleet, 0, 3).map(|x| x.0) == Some(2)
        });
        assert_eq!(fleet.replicas()[0].blocks, 120 + 2 - 1);
        // Candidates: only those asked about.
        let ids = prompt(1, 3);
        let q = Query {
            adapter: "",
            keys: QueryKeys::Tokens {
                ids: &ids,
                block_size: BLOCK,
            },
        };
        assert_eq!(fleet.score_among(&q, &["b"]).expect("score").len(), 0);
        assert_eq!(fleet.score_among(&q, &["a", "b"]).expect("score").len(), 1);
        // The engine cleared: a new epoch, and the old prefixes go at once with the snapshot.
        hub.apply(0, &m.reset(0));
        hub.commit();
        publish(&hub, &mut m, &stored(200, 1));
        wait_until("the new epoch", || {
            matched(&fleet, 1, 3).is_none() && matched(&fleet, 200, 1).is_some()
        });
        assert_eq!(hub.metrics().snapshots.load(Relaxed), 2);
    });
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_resumes_from_its_position_and_a_lost_sidecar_turns_stale_then_stops_counting() {
    let hub = Hub::new(HubConfig {
        heartbeat: Duration::from_millis(100),
        ..HubConfig::new("replica-a", "m")
    });
    let mut m = mapper();
    publish(&hub, &mut m, &stored(1, 2));
    let served = serve_on(&hub, "127.0.0.1:0").await;
    let address = served.url.trim_start_matches("http://").to_owned();
    let fleet = Fleet::new(FleetConfig {
        dead_after: Duration::from_millis(300),
        drop_after: Duration::from_secs(2),
        ..FleetConfig::default()
    })
    .expect("fleet");
    fleet
        .ensure_replica(
            "a",
            ReplicaSource::Sidecar(SidecarFeed::new(served.url.clone())),
        )
        .expect("ensure");
    tokio::task::block_in_place(|| {
        wait_until("exact", || {
            state_of(&fleet, "a") == Some(ReplicaState::Exact)
        });
    });
    // The sidecar's server goes away: the replica still counts, degraded, then stale.
    served.stop().await;
    publish(&hub, &mut m, &stored(2, 2));
    tokio::task::block_in_place(|| {
        wait_until("stale", || {
            matches!(state_of(&fleet, "a"), Some(ReplicaState::Stale { .. }))
        });
        assert!(matches!(
            matched(&fleet, 1, 2),
            Some((2, ReplicaState::Stale { .. }))
        ));
    });
    // It comes back at the same address: the follower resumes (no snapshot) and gets what it
    // missed.
    let served = serve_on(&hub, &address).await;
    tokio::task::block_in_place(|| {
        wait_until("resumed", || {
            state_of(&fleet, "a") == Some(ReplicaState::Exact) && matched(&fleet, 2, 2).is_some()
        });
    });
    assert_eq!(hub.metrics().snapshots.load(Relaxed), 1);
    assert!(hub.metrics().resumes.load(Relaxed) >= 1);
    // Gone for longer than drop_after: its entries stop counting.
    served.stop().await;
    tokio::task::block_in_place(|| {
        wait_until("dropped", || matched(&fleet, 1, 2).is_none());
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_naming_another_replica_is_refused_and_a_slow_follower_is_cut_off() {
    let hub = Hub::new(HubConfig::new("replica-a", "m"));
    let served = serve_on(&hub, "127.0.0.1:0").await;
    let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
    let feed = SidecarFeed {
        replica: "replica-b".into(),
        ..SidecarFeed::new(served.url.clone())
    };
    fleet
        .ensure_replica("b", ReplicaSource::Sidecar(feed))
        .expect("ensure");
    tokio::task::block_in_place(|| {
        wait_until("refused", || {
            fleet.replicas()[0].error.as_deref()
                == Some("refused: the sidecar serves replica `replica-a`, not `replica-b`")
        });
    });
    assert!(hub.metrics().refused.load(Relaxed) >= 1);
    // A refusal is a misconfiguration, not an outage: stale at once (dead_after is 3 s).
    assert!(
        matches!(
            state_of(&fleet, "b"),
            Some(ReplicaState::Stale {
                lost: kvevent_fleet::Lost::Source,
                ..
            })
        ),
        "{:?}",
        fleet.replicas()
    );
    let not_ready = fleet
        .ready(Duration::from_millis(50))
        .await
        .expect_err("refused");
    assert!(not_ready.to_string().contains("refused"), "{not_ready}");
    fleet.remove_replica("b");
    assert!(fleet.replicas().is_empty());
    served.stop().await;

    // A follower that does not read while the ring moves past it is cut off.
    let hub = Hub::new(HubConfig {
        ring_bytes: 4096,
        follower_queue: 1,
        heartbeat: Duration::from_millis(100),
        ..HubConfig::new("replica-a", "m")
    });
    let served = serve_on(&hub, "127.0.0.1:0").await;
    let channel = tonic::transport::Endpoint::from_shared(served.url.clone())
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut client = kvevent_feed::pb::feed_client::FeedClient::new(channel);
    let mut stream = client
        .follow(kvevent_feed::pb::FollowRequest::default())
        .await
        .expect("follow")
        .into_inner();
    let mut m = mapper();
    // A driving loop, not a wait: it publishes every millisecond until the follower falls
    // behind (eventually's pause between looks would let it keep up).
    let deadline = Instant::now() + WAIT;
    let mut seed = 0;
    while hub.metrics().cut_off.load(Relaxed) == 0 {
        assert!(Instant::now() < deadline, "never cut off");
        publish(&hub, &mut m, &stored(seed, 64));
        seed += 1;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Its stream ends once it reads again (with the reason, when there was room for it).
    let end = tokio::time::timeout(WAIT, async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => break None,
                Err(status) => break Some(status),
            }
        }
    })
    .await
    .expect("the stream ends");
    if let Some(status) = end {
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    }
    served.stop().await;
}

/// A runtime for the tests that run on a plain thread, as a router without tokio would.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn bad_replicas_are_refused_and_lose_nothing() {
    let rt = runtime();
    let fleet = Fleet::with_runtime(FleetConfig::default(), rt.handle().clone());
    fleet
        .ensure_replica(
            "a",
            ReplicaSource::Engine(kvevent_fleet::EngineSockets::new("tcp://127.0.0.1:1")),
        )
        .expect("engine");
    let err = fleet
        .ensure_replica(
            "a",
            ReplicaSource::Engine(kvevent_fleet::EngineSockets::new("tcp://nowhere-valid")),
        )
        .expect_err("no port");
    assert!(err.to_string().contains("replica `a`"), "{err}");
    assert_eq!(fleet.replicas().len(), 1, "the old source of `a` stays");
    // A sidecar URL without its scheme is refused, as a bad engine endpoint is.
    for url in [
        "127.0.0.1:27101",
        "http://",
        "http://host",
        "grpc://127.0.0.1:1",
    ] {
        let err = fleet
            .ensure_replica("a", ReplicaSource::Sidecar(SidecarFeed::new(url)))
            .expect_err(url);
        assert!(err.to_string().contains("http://HOST:PORT"), "{err}");
    }
    assert_eq!(fleet.replicas()[0].source, "tcp://127.0.0.1:1");
    // Outside a runtime, without a handle: a clear error.
    let err = Fleet::new(FleetConfig::default()).expect_err("no runtime");
    assert!(err.to_string().contains("tokio runtime"), "{err}");
    let engine_keys = Fleet::with_runtime(
        FleetConfig {
            index: kvevent_fleet::IndexConfig {
                mapping: kvevent_mapper::Options {
                    key_mode: KeyMode::Engine,
                    ..kvevent_mapper::Options::default()
                },
                ..kvevent_fleet::IndexConfig::default()
            },
            ..FleetConfig::default()
        },
        rt.handle().clone(),
    );
    let err = engine_keys
        .ensure_replica(
            "b",
            ReplicaSource::Sidecar(SidecarFeed::new("http://127.0.0.1:1")),
        )
        .expect_err("fingerprints into engine keys");
    assert!(err.to_string().contains("fingerprint"), "{err}");
    assert!(engine_keys.replicas().is_empty());
}

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
    let fleet = Fleet::new(FleetConfig {
        dead_after,
        ..FleetConfig::default()
    })
    .expect("fleet");
    fleet
        .ensure_replica(
            "a",
            ReplicaSource::Sidecar(SidecarFeed::new(served.url.clone())),
        )
        .expect("ensure");
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
