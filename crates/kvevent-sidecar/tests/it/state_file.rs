//! `--state-file`: a restarted sidecar resumes where it stopped, or says why it cannot.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use kvevent_proto as pb;
use kvevent_sidecar::settings::GoDuration;
use kvevent_sidecar::{Settings, StartError, start};
use kvevent_source::ResetReason;
use kvevent_test_support::{Publisher, PublisherConfig};
use kvevent_test_support::{Received, RecordingServer, eventually, when};
use kvevent_wire::Release;
use kvevent_zmq::publisher::scripted_batch;

const WAIT: Duration = Duration::from_secs(15);

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvevent-state-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn settings(engine: &Publisher, server: &RecordingServer, state: &std::path::Path) -> Settings {
    Settings {
        state_file: Some(state.to_path_buf()),
        state_interval: GoDuration::ms(100),
        ..crate::loopback(engine, server)
    }
}

fn clears(server: &RecordingServer) -> usize {
    server
        .events()
        .iter()
        .filter(|e| e.r#type == pb::cache_event::Type::AllCleared as i32)
        .count()
}

/// (key, token count) of every prefix the server was sent.
fn added(server: &RecordingServer) -> Vec<(Vec<u8>, i32)> {
    server
        .received()
        .iter()
        .filter_map(|r| match r {
            Received::Update(u) => Some(u.prefixes.clone()),
            Received::Event(_) => None,
        })
        .flatten()
        .map(|p| (p.prefix_hash, p.token_count))
        .collect()
}

fn evicted(server: &RecordingServer) -> Vec<Vec<u8>> {
    let mut keys: Vec<Vec<u8>> = server
        .events()
        .iter()
        .filter(|e| e.r#type == pb::cache_event::Type::PrefixEvicted as i32)
        .map(|e| e.prefix_hash.clone())
        .collect();
    keys.sort();
    keys
}

async fn wait_subscribed(engine: &Publisher, n: usize) {
    assert!(tokio::task::block_in_place(
        || engine.wait_for_subscribers(n, WAIT)
    ));
}

/// The first sidecar: sees steps 0 and 1 (six blocks of prompt 0), then stops, saving.
async fn first_life(
    ctx: &zmq::Context,
    engine: &Publisher,
    state: &std::path::Path,
) -> Vec<(Vec<u8>, i32)> {
    let server = RecordingServer::start().await;
    let running = start(&settings(engine, &server, state), ctx)
        .await
        .expect("start");
    wait_subscribed(engine, 1).await;
    engine.publish(&scripted_batch(0)).expect("publish");
    engine.publish(&scripted_batch(1)).expect("publish");
    server
        .wait_for(WAIT, |r| kvevent_test_support::distinct_prefixes(r) >= 6)
        .await;
    assert_eq!(
        clears(&server),
        1,
        "a sidecar with no state file clears at start"
    );
    running.shutdown(Duration::from_secs(5)).await;
    assert!(state.exists(), "saved at shutdown");
    added(&server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sidecar_resumes_from_its_state_file_without_a_clear() {
    let dir = scratch("resume");
    let state = dir.join("state");
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let first = first_life(&ctx, &engine, &state).await;
    // While no sidecar runs, the engine evicts blocks 5 and 6 of the prompt and offloads its
    // first block.
    engine.publish(&scripted_batch(2)).expect("publish");

    let server = RecordingServer::start().await;
    let running = start(&settings(&engine, &server, &state), &ctx)
        .await
        .expect("restart");
    server
        .wait_for(WAIT, |r| {
            r.iter()
                .filter(|x| matches!(x, Received::Event(e) if e.r#type == pb::cache_event::Type::PrefixEvicted as i32))
                .count()
                >= 2
        })
        .await;
    // The evictions resolve to the fingerprints the first life reported (fingerprint keys
    // need the saved blocks: without them, a removal cannot be keyed), and nothing is cleared.
    let mut tail: Vec<Vec<u8>> = first
        .iter()
        .filter(|(_, tokens)| *tokens > 64)
        .map(|(k, _)| k.clone())
        .collect();
    tail.sort();
    tail.dedup();
    assert_eq!(evicted(&server), tail);
    assert_eq!(clears(&server), 0, "resumed: no clear");
    let metrics = &running.telemetry().sources.metrics[0];
    assert_eq!(metrics.resumes_verified.load(Relaxed), 1);
    assert_eq!(metrics.resumes_refused.load(Relaxed), 0);
    assert!(!running.telemetry().sources.health[0].degraded());
    // The periodic save runs too.
    eventually("a periodic save", WAIT, || async {
        when(
            running.telemetry().state_file.writes.written.load(Relaxed),
            |n| *n > 0,
        )
    })
    .await;
    running.shutdown(Duration::from_secs(5)).await;
    engine.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_a_new_engine_process_cannot_continue_is_refused_and_rebuilt() {
    let dir = scratch("refused");
    let state = dir.join("state");
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    first_life(&ctx, &engine, &state).await;
    // A new engine process on the same ports, which has published one batch so far.
    engine.restart();
    engine.publish(&scripted_batch(3)).expect("publish");

    let server = RecordingServer::start().await;
    let running = start(&settings(&engine, &server, &state), &ctx)
        .await
        .expect("restart");
    server
        .wait_for(WAIT, |r| kvevent_test_support::distinct_prefixes(r) >= 4)
        .await;
    assert_eq!(clears(&server), 1, "the stale state is cleared");
    let metrics = &running.telemetry().sources.metrics[0];
    assert_eq!(metrics.resumes_refused.load(Relaxed), 1);
    assert_eq!(metrics.resets(ResetReason::StaleCheckpoint), 1);
    let tracked = running.telemetry().mappers.views.lock().expect("lock")[0].tracked;
    assert_eq!(tracked, 4, "only the new process's blocks");
    running.shutdown(Duration::from_secs(5)).await;
    engine.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_or_foreign_state_file_is_not_used_and_the_start_goes_on() {
    let dir = scratch("damaged");
    let state = dir.join("state");
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    first_life(&ctx, &engine, &state).await;
    let good = std::fs::read(&state).expect("saved");
    let mut damaged = good.clone();
    let middle = damaged.len() / 2;
    damaged[middle] ^= 0x40;
    for (what, bytes, replica) in [
        ("damaged", damaged, "r1"),
        ("truncated", good[..good.len() - 9].to_vec(), "r1"),
        ("another replica's", good.clone(), "r2"),
    ] {
        std::fs::write(&state, &bytes).expect("write");
        let server = RecordingServer::start().await;
        let s = Settings {
            replica_id: replica.into(),
            ..settings(&engine, &server, &state)
        };
        let running = start(&s, &ctx).await.expect("start goes on");
        server
            .wait_for(WAIT, |r| kvevent_test_support::distinct_prefixes(r) >= 6)
            .await;
        assert_eq!(
            clears(&server),
            1,
            "{what}: cleared and rebuilt from the replay"
        );
        assert_eq!(
            running.telemetry().sources.metrics[0]
                .resumes_verified
                .load(Relaxed),
            0,
            "{what}"
        );
        running.shutdown(Duration::from_secs(5)).await;
    }
    engine.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_path_that_cannot_be_written_fails_the_start() {
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let server = RecordingServer::start().await;
    let nowhere = std::path::Path::new("/nonexistent-kvevent-dir/state");
    let err = start(&settings(&engine, &server, nowhere), &ctx)
        .await
        .expect_err("refused");
    assert!(matches!(err, StartError::StateFile(..)), "{err:?}");
    assert!(err.to_string().contains("/nonexistent-kvevent-dir/state"));
    engine.shutdown();
}

/// The router feed's next message, within `WAIT`.
async fn next_message(
    stream: &mut tonic::Streaming<kvevent_feed::pb::FeedMessage>,
) -> kvevent_feed::pb::FeedMessage {
    tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("a feed message in time")
        .expect("the stream goes on")
        .expect("a message")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_restarted_from_its_state_file_keeps_its_feed_epoch_and_followers_resume() {
    use kvevent_feed::pb;
    let dir = scratch("feed");
    let state = dir.join("state");
    let ctx = zmq::Context::new();
    let engine =
        Publisher::start(&ctx, PublisherConfig::loopback(Release::NEWEST_KNOWN)).expect("engine");
    let server = RecordingServer::start().await;
    let s = Settings {
        feed_address: "127.0.0.1:0".into(),
        ..settings(&engine, &server, &state)
    };
    let first = start(&s, &ctx).await.expect("start");
    wait_subscribed(&engine, 1).await;
    engine.publish(&scripted_batch(0)).expect("publish");
    engine.publish(&scripted_batch(1)).expect("publish");
    let hub = first.telemetry().feed.hub().expect("feed").clone();
    eventually("the feed holding the blocks", WAIT, || async {
        when(hub.blocks(), |n| *n >= 6)
    })
    .await;
    let (epoch, seq) = hub.position();
    first.shutdown(Duration::from_secs(5)).await;

    let second = start(&s, &ctx).await.expect("restart");
    let url = format!("http://{}", second.feed_addr().expect("feed address"));
    let hub = second.telemetry().feed.hub().expect("feed").clone();
    assert_eq!(hub.position(), (epoch, seq), "the same history goes on");
    assert_eq!(hub.blocks(), 6, "what the state file holds");
    // A follower at the saved position resumes: no snapshot, then the new change.
    let channel = tonic::transport::Endpoint::from_shared(url)
        .expect("url")
        .connect()
        .await
        .expect("connect");
    // A follower from nothing: its hello says how many blocks the snapshot after it holds (a
    // router makes room for them at once).
    let mut fresh = pb::feed_client::FeedClient::new(channel.clone())
        .follow(pb::FollowRequest::default())
        .await
        .expect("follow")
        .into_inner();
    let hello = next_message(&mut fresh).await;
    // However early it comes, the hello says the engine's rank: a follower is never told the
    // restored blocks are exact before the sidecar has seen its engine.
    assert_eq!(
        hello.engine.as_ref().map(|e| e.ranks.len()),
        Some(1),
        "{hello:?}"
    );
    let Some(pb::feed_message::Body::Hello(h)) = hello.body else {
        panic!("a hello first: {hello:?}");
    };
    assert_eq!((h.resumed, h.snapshot_blocks), (false, 6), "{h:?}");
    drop(fresh);
    let mut stream = pb::feed_client::FeedClient::new(channel)
        .follow(pb::FollowRequest {
            resume: Some(pb::Position { epoch, seq }),
            ..Default::default()
        })
        .await
        .expect("follow")
        .into_inner();
    let hello = next_message(&mut stream).await;
    let Some(pb::feed_message::Body::Hello(h)) = hello.body else {
        panic!("a hello first: {hello:?}");
    };
    assert!(h.resumed, "{h:?}");
    wait_subscribed(&engine, 1).await;
    // The engine evicts blocks of prompt 0 and offloads one: changes, in the same epoch.
    engine.publish(&scripted_batch(2)).expect("publish");
    let next = loop {
        let m = next_message(&mut stream).await;
        if !matches!(m.body, Some(pb::feed_message::Body::Heartbeat(_))) {
            break m;
        }
    };
    assert!(
        matches!(next.body, Some(pb::feed_message::Body::Changes(_))),
        "changes, not a snapshot: {next:?}"
    );
    assert_eq!(next.epoch, epoch);
    assert!(next.seq > seq);
    assert_eq!(
        second.telemetry().sources.metrics[0]
            .resumes_verified
            .load(Relaxed),
        1
    );
    second.shutdown(Duration::from_secs(5)).await;
    engine.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}
