//! `kvevents record` and `decode` over real sockets: recordings cut short or damaged; gaps,
//! restarts and stops while recording live. (Recordings published into the sidecar: replay.rs.)

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use common::{WAIT, kvevents, publish, scratch, stop, wait_recorded};
use kvevent_recording::{Header, Record, Writer, read_all};
use kvevent_test_support::{batches, eventually_blocking, when};
use kvevent_wire as wire;

#[test]
fn a_recorder_killed_while_writing_leaves_a_file_that_reads_to_its_last_whole_batch() {
    // The context lives as long as its engine: bound, not dropped with the rest.
    let Setup {
        dir,
        path,
        engine,
        ctx: _ctx,
        ..
    } = setup("kill");
    let mut recorder = kvevents()
        .args(["record", "--endpoint", engine.endpoint(), "-o"])
        .arg(&path)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    // A batch of 40 blocks of 16 tokens: about 2 kB.
    let payload = wire::encode(
        &wire::EventBatch::new(
            1.0,
            vec![wire::Event::BlockStored(wire::BlockStored {
                block_hashes: (1..=40)
                    .map(|h| wire::BlockHash::Int(wire::Int::U64(h)))
                    .collect(),
                token_ids: (0..640u32).collect::<Vec<_>>().into(),
                block_size: 16,
                ..Default::default()
            })],
        ),
        wire::Release::NEWEST_KNOWN,
    )
    .expect("encode");
    let stop_flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publishing = std::thread::spawn({
        let stop = stop_flag.clone();
        let payload = payload.clone();
        move || {
            while !stop.load(Relaxed) {
                engine.publish_payload(payload.clone());
            }
        }
    });
    eventually_blocking("the recorder wrote 500 kB", WAIT, || {
        when(std::fs::metadata(&path).map_or(0, |m| m.len()), |n| {
            *n >= 500_000
        })
    });
    recorder.kill().expect("SIGKILL");
    recorder.wait().expect("wait");
    stop_flag.store(true, Relaxed);
    publishing.join().expect("publisher");
    let bytes = std::fs::read(&path).expect("read");
    let (_, records, _cut) = read_all(&bytes).expect("a killed recording reads");
    assert!(records.len() > 100, "{} records", records.len());
    assert!(records.iter().all(|r| r.payload == payload));
    // `decode` reads it to its last whole batch and exits 0 (every payload decodes).
    let out = kvevents()
        .arg("decode")
        .arg(&path)
        .output()
        .expect("decode");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        records.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_damaged_or_foreign_recording_is_an_error_naming_the_byte() {
    let dir = scratch("damaged");
    let good = dir.join("good.kvrec");
    let payload = wire::encode(
        &wire::EventBatch::new(1.0, vec![]),
        wire::Release::NEWEST_KNOWN,
    )
    .expect("encode");
    let mut w = Writer::new(Vec::new(), &Header::new("vllm", 0)).expect("header");
    for seq in 0..3 {
        w.write(&Record {
            rank: 0,
            seq,
            at_us: seq * 1000,
            topic: b"kv-events".to_vec(),
            replay: false,
            reset: None,
            payload: payload.clone(),
        })
        .expect("write");
    }
    let mut bytes = w.finish().expect("finish");
    std::fs::write(&good, &bytes).expect("write");
    assert!(
        kvevents()
            .arg("decode")
            .arg(&good)
            .status()
            .expect("decode")
            .success()
    );
    // A byte of the last record's payload flipped: its checksum no longer matches.
    let n = bytes.len();
    bytes[n - 6] ^= 0xff;
    let damaged = dir.join("damaged.kvrec");
    std::fs::write(&damaged, &bytes).expect("write");
    for command in [&["decode"][..], &["stats"], &["publish", "--recording"]] {
        let out = kvevents()
            .args(command)
            .arg(&damaged)
            .output()
            .expect("run");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{command:?}");
        assert!(
            text.contains("byte ") && text.contains("checksum"),
            "{command:?}: {text}"
        );
        // Named with its file; stats and publish offer a way past it.
        if command != ["decode"] {
            assert!(
                text.contains("damaged.kvrec is damaged (--skip-damaged"),
                "{command:?}: {text}"
            );
        }
    }
    // --skip-damaged: stats gives the figures of what came before the damage.
    let out = kvevents()
        .args(["stats", "--json", "--skip-damaged"])
        .arg(&damaged)
        .output()
        .expect("stats");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("the rest of the file is skipped"), "{said}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    // Three records, the last damaged: the first two count.
    assert_eq!(v["replicas"][0]["batches"], 2, "{v}");
    // A damaged magic: still a damaged recording, not a payload.
    let mut bad_magic = bytes.clone();
    bad_magic[5] ^= 0xff;
    let bad = dir.join("bad-magic.kvrec");
    std::fs::write(&bad, &bad_magic).expect("write");
    let out = kvevents().arg("decode").arg(&bad).output().expect("decode");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(said.contains("not a kvevent recording"), "{said}");
    let foreign = dir.join("foreign.kvrec");
    std::fs::write(&foreign, b"{\"not\": \"a recording\"}").expect("write");
    for command in [&["stats"][..], &["publish", "--recording"]] {
        let out = kvevents()
            .args(command)
            .arg(&foreign)
            .output()
            .expect("run");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            text.contains("byte 0: not a kvevent recording"),
            "{command:?}: {text}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An empty batch whose `ts` is `i`: its bytes differ from every other `i`'s.
fn empty_payload(i: u32) -> Vec<u8> {
    wire::encode(
        &batches::batch(f64::from(i), Vec::new()),
        wire::Release::NEWEST_KNOWN,
    )
    .expect("encode")
}

/// A recorder of `engine` (not --replay-first) writing to `path`, its stderr to `log`.
fn record_live(endpoint: &str, replay: &str, path: &Path, log: &Path, more: &[&str]) -> Child {
    kvevents()
        .args([
            "record",
            "--endpoint",
            endpoint,
            "--replay-endpoint",
            replay,
        ])
        .args(more)
        .arg("-o")
        .arg(path)
        .stderr(std::fs::File::create(log).expect("log"))
        .spawn()
        .expect("spawn record")
}

/// What a recorder test starts from: a scratch folder with the recording's and the log's
/// paths, and an engine stand-in on loopback (its context beside it, dropped after it).
struct Setup {
    dir: PathBuf,
    path: PathBuf,
    log: PathBuf,
    engine: kvevent_test_support::Publisher,
    ctx: zmq::Context,
}

fn setup(name: &str) -> Setup {
    use kvevent_test_support::{Publisher, PublisherConfig};
    let dir = scratch(name);
    let ctx = zmq::Context::new();
    let engine = Publisher::start(&ctx, PublisherConfig::loopback(wire::Release::NEWEST_KNOWN))
        .expect("engine");
    Setup {
        path: dir.join(format!("{name}.kvrec")),
        log: dir.join("record.log"),
        dir,
        engine,
        ctx,
    }
}

/// Publishes seq 0 (`payload`) until the recorder has it: it may join late. A repeat is the
/// same bytes at seq 0 after a restart of the stand-in: a duplicate, not recorded twice.
fn first_recorded(engine: &kvevent_test_support::Publisher, path: &Path) {
    let deadline = Instant::now() + WAIT;
    loop {
        engine.restart();
        engine.publish_payload(empty_payload(0));
        std::thread::sleep(Duration::from_millis(100));
        if std::fs::read(path).is_ok_and(|b| read_all(&b).is_ok_and(|(_, r, _)| !r.is_empty())) {
            return;
        }
        assert!(Instant::now() < deadline, "seq 0 never recorded");
    }
}

/// Batches lost on the way (an HWM, a blip) are asked of the replay endpoint, as the sidecar
/// does, and the file keeps every seq in order.
#[test]
fn a_gap_in_the_live_stream_is_filled_from_the_replay_endpoint() {
    let Setup {
        dir,
        path,
        log,
        engine,
        ctx: _ctx,
    } = setup("gap");
    // Not --replay-first: whatever comes from the replay endpoint comes for the gap.
    let replay = engine.replay_endpoint().expect("replay");
    let recorder = record_live(engine.endpoint(), replay, &path, &log, &[]);
    first_recorded(&engine, &path);
    // Seqs 1 to 4 are lost on the way (kept for replay only), 5 to 7 arrive live.
    for i in 1..=4 {
        engine.publish_lost(empty_payload(i));
    }
    for i in 5..=7 {
        engine.publish_payload(empty_payload(i));
    }
    let records = wait_recorded(&path, 8);
    stop(recorder);
    // Every seq, in order; 1 to 4 can only have come from the replay endpoint (5 to 7 may
    // too: its answer runs up to what it holds, and the live copies held meanwhile are dropped
    // as duplicates).
    let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (0..=7).collect::<Vec<u64>>());
    assert!(records[1..=4].iter().all(|r| r.replay), "{records:?}");
    assert!(!records[0].replay);
    assert!(records.iter().all(|r| r.reset.is_none()), "{records:?}");
    let said = std::fs::read_to_string(&log).expect("log");
    assert!(
        said.contains("the replay endpoint answers from seq 1")
            && said.contains("gaps: 1 seen (4 seqs), 0 left unfilled"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// An engine restarted under the recorder (seqs back to 0, another process's batches): kept,
/// as `kvevent-source` keeps them, with the restart marked at the new process's first batch,
/// not dropped until the new seqs pass the old.
#[test]
fn an_engine_restart_under_record_is_kept_and_marked() {
    let Setup {
        dir,
        path,
        log,
        engine,
        ctx: _ctx,
    } = setup("restart");
    let replay = engine.replay_endpoint().expect("replay");
    let recorder = record_live(engine.endpoint(), replay, &path, &log, &[]);
    first_recorded(&engine, &path);
    for i in 1..=5 {
        engine.publish_payload(empty_payload(i));
    }
    wait_recorded(&path, 6);
    // A new process: seqs from 0 again, other batches.
    engine.restart();
    for i in 100..103 {
        engine.publish_payload(empty_payload(i));
    }
    let records = wait_recorded(&path, 9);
    stop(recorder);
    let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, vec![0, 1, 2, 3, 4, 5, 0, 1, 2], "{records:?}");
    let resets: Vec<Option<&str>> = records.iter().map(|r| r.reset.as_deref()).collect();
    assert_eq!(resets[6], Some("restart"), "{records:?}");
    assert!(
        resets.iter().filter(|r| r.is_some()).count() == 1,
        "{resets:?}"
    );
    assert_eq!(records[7].payload, empty_payload(101));
    let said = std::fs::read_to_string(&log).expect("log");
    assert!(said.contains("engine restarts: 1"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Stopped while a replay is under way (the replay endpoint never answers), the recorder
/// writes the live batches it held for it: the file marks the gap the replay was for.
#[test]
fn a_stop_during_a_replay_writes_the_live_batches_held_for_it() {
    let Setup {
        dir,
        path,
        log,
        engine,
        ctx,
    } = setup("stop-mid-replay");
    // A replay endpoint that takes requests and never answers.
    let silent = ctx.socket(zmq::ROUTER).expect("router");
    silent.bind("tcp://127.0.0.1:*").expect("bind");
    let replay = silent
        .get_last_endpoint()
        .expect("endpoint")
        .expect("utf-8");
    let recorder = record_live(engine.endpoint(), &replay, &path, &log, &[]);
    first_recorded(&engine, &path);
    for i in 1..=3 {
        engine.publish_lost(empty_payload(i));
    }
    for i in 4..=6 {
        engine.publish_payload(empty_payload(i));
    }
    // The recorder asks for 1..3 and holds 4 to 6 meanwhile (its replay times out after 3 s).
    eventually_blocking("a replay asked from seq 1", WAIT, || {
        when(std::fs::read_to_string(&log).unwrap_or_default(), |l| {
            l.contains("from seq 1")
        })
    });
    std::thread::sleep(Duration::from_millis(300));
    stop(recorder);
    let (_, records, cut) = read_all(&std::fs::read(&path).expect("file")).expect("reads");
    assert_eq!(cut, None);
    let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, vec![0, 4, 5, 6], "{records:?}");
    assert_eq!(records[1].reset.as_deref(), Some("gap"), "{records:?}");
    assert!(records[1..].iter().all(|r| !r.replay));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--max-bytes`: the file ends with the batch that reached the limit, even when more came
/// in the same read (a replay answers in a burst).
#[test]
fn max_bytes_ends_the_file_with_the_batch_that_reached_it() {
    let Setup {
        dir,
        path,
        log,
        engine,
        ctx: _ctx,
    } = setup("max-bytes");
    // 200 batches in the replay buffer, asked for at once.
    for i in 0..200 {
        engine.publish_lost(empty_payload(i));
    }
    let replay = engine.replay_endpoint().expect("replay");
    let max = 1_000u64;
    let max_text = max.to_string();
    let mut recorder = record_live(
        engine.endpoint(),
        replay,
        &path,
        &log,
        &["--replay-first", "--max-bytes", &max_text],
    );
    let status = eventually_blocking("record stopped at --max-bytes", WAIT, || {
        recorder
            .try_wait()
            .expect("wait")
            .ok_or_else(|| "still running".to_owned())
    });
    assert!(status.success(), "record exited {status}");
    let bytes = std::fs::read(&path).expect("file");
    let (header, records, cut) = read_all(&bytes).expect("reads");
    assert_eq!(cut, None);
    assert!(
        records.len() > 1 && records.len() < 200,
        "{} records",
        records.len()
    );
    // The same records written again: the last one, and only it, crossed the limit.
    let size = |records: &[Record]| {
        let mut w = Writer::new(Vec::new(), &header).expect("header");
        for r in records {
            w.write(r).expect("record");
        }
        w.finish().expect("finish").len() as u64
    };
    assert_eq!(size(&records), bytes.len() as u64);
    assert!(
        size(&records[..records.len() - 1]) < max,
        "{} bytes",
        bytes.len()
    );
    assert!(bytes.len() as u64 >= max);
    let said = std::fs::read_to_string(&log).expect("log");
    assert!(said.contains("it reached --max-bytes"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A recording with an engine restart in it is published as that engine was: after the
/// restart, a replay from seq 0 answers the new process's batches only, not the old one's
/// (which a follower would take for a gap it cannot repair, or for stale state).
#[test]
fn a_recorded_restart_starts_the_replay_buffer_over() {
    let dir = scratch("restart-replayed");
    let path = dir.join("restart.kvrec");
    let mut w = Writer::new(Vec::new(), &Header::new("vllm", 0)).expect("header");
    let record = |seq: u64, at_us: u64, reset: Option<&str>| Record {
        rank: 0,
        seq,
        at_us,
        topic: b"kv-events".to_vec(),
        replay: false,
        reset: reset.map(str::to_owned),
        payload: empty_payload(seq as u32),
    };
    // The old process's 0..5, the new one's 0 and 1 at once, then its 2 three seconds later:
    // the replay is asked for meanwhile.
    for seq in 0..5 {
        w.write(&record(seq, 0, None)).expect("record");
    }
    w.write(&record(0, 0, Some("restart"))).expect("record");
    w.write(&record(1, 0, None)).expect("record");
    w.write(&record(2, 3_000_000, None)).expect("record");
    std::fs::write(&path, w.finish().expect("finish")).expect("write");
    let (publisher, endpoint, replay) = publish(&path, "1", 1);
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("sub");
    sub.set_subscribe(b"").expect("subscribe");
    sub.connect(&endpoint).expect("connect");
    // The new process's seq 1 arrives live once the publisher saw the subscription.
    eventually_blocking("seq 1 of the new process, live", WAIT, || {
        let frames = sub.recv_multipart(zmq::DONTWAIT).unwrap_or_default();
        let seq = frames
            .get(1)
            .and_then(|f| <[u8; 8]>::try_from(f.as_slice()).ok())
            .map(u64::from_be_bytes);
        if seq.is_none() {
            std::thread::sleep(Duration::from_millis(10));
        }
        when(seq, |s| *s == Some(1))
    });
    let dealer = ctx.socket(zmq::DEALER).expect("dealer");
    dealer.set_rcvtimeo(5_000).expect("timeout");
    dealer.connect(&replay).expect("connect");
    dealer
        .send_multipart([&b""[..], &0u64.to_be_bytes()], 0)
        .expect("ask");
    let mut seqs = Vec::new();
    loop {
        let frames = dealer.recv_multipart(0).expect("a reply in time");
        match wire::frames::parse_replay(&frames).expect("a reply") {
            wire::frames::ReplayReply::Batch { seq, .. } => seqs.push(seq),
            wire::frames::ReplayReply::End => break,
        }
    }
    assert_eq!(seqs, [0, 1], "the new process's batches only");
    let _ = publisher.wait_with_output();
    let _ = std::fs::remove_dir_all(&dir);
}
