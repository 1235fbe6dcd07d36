//! The feed end to end on loopback: a hub served by the real server, followed by a real
//! `Fleet` into its index.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kvevent_feed::{Hub, HubConfig, ServeOptions};
use kvevent_fleet::{
    Fleet, FleetConfig, Query, QueryKeys, ReplicaSource, ReplicaState, SidecarFeed,
};
use kvevent_mapper::{Identity, KeyMode, Mapper, Options};
use kvevent_test_support::{eventually_blocking, when};
use kvevent_wire as wire;

pub(crate) const WAIT: Duration = Duration::from_secs(20);
pub(crate) const BLOCK: usize = 16;

pub(crate) fn mapper() -> Mapper {
    Mapper::new(
        Identity::new("r", "m", "", "test").expect("identity"),
        Options {
            key_mode: KeyMode::Fingerprint,
            ..Options::default()
        },
    )
}

/// A prompt of `blocks` blocks, distinct per `seed`.
pub(crate) fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32)
        .map(|t| seed * 100_000 + t)
        .collect()
}

pub(crate) fn stored(seed: u32, blocks: usize) -> wire::EventBatch<'static> {
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

pub(crate) fn removed(seed: u32, block: u64) -> wire::EventBatch<'static> {
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
pub(crate) fn publish(hub: &Hub, mapper: &mut Mapper, batch: &wire::EventBatch<'_>) {
    let mut reports = Vec::new();
    mapper.map_batch(batch, &mut reports);
    for r in &reports {
        hub.apply(0, r);
    }
    hub.note_block_size(BLOCK as u32);
    hub.commit();
}

pub(crate) fn matched(fleet: &Fleet, seed: u32, blocks: usize) -> Option<(u32, ReplicaState)> {
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

pub(crate) fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    eventually_blocking(what, WAIT, || when(f(), |held| *held).map(|_| ()));
}

pub(crate) fn state_of(fleet: &Fleet, name: &str) -> Option<ReplicaState> {
    fleet
        .replicas()
        .into_iter()
        .find(|r| r.name == name)
        .map(|r| r.state)
}

pub(crate) struct Served {
    pub(crate) url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

pub(crate) async fn serve_on(hub: &Arc<Hub>, address: &str) -> Served {
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
    /// A Fleet of `config` following this sidecar as replica `a`.
    pub(crate) fn followed(&self, config: FleetConfig) -> Fleet {
        let fleet = Fleet::new(config).expect("fleet");
        fleet
            .ensure_replica(
                "a",
                ReplicaSource::Sidecar(SidecarFeed::new(self.url.clone())),
            )
            .expect("ensure");
        fleet
    }

    pub(crate) async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), self.task).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn a_late_router_gets_everything_then_changes_then_a_new_epoch() {
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
pub(crate) async fn a_follower_resumes_from_its_position_and_a_lost_sidecar_turns_stale_then_stops_counting()
 {
    let hub = Hub::new(HubConfig {
        heartbeat: Duration::from_millis(100),
        ..HubConfig::new("replica-a", "m")
    });
    let mut m = mapper();
    publish(&hub, &mut m, &stored(1, 2));
    let served = serve_on(&hub, "127.0.0.1:0").await;
    let address = served.url.trim_start_matches("http://").to_owned();
    let fleet = served.followed(FleetConfig {
        dead_after: Duration::from_millis(300),
        drop_after: Duration::from_secs(2),
        ..FleetConfig::default()
    });
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
pub(crate) async fn a_stream_naming_another_replica_is_refused_and_a_slow_follower_is_cut_off() {
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
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
pub(crate) fn bad_replicas_are_refused_and_lose_nothing() {
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
