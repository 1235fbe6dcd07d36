//! `kvevents stats` on recordings made by hand, whose figures are worked out by hand: rates,
//! residency, restores, duplication across replicas and DP ranks (as the router's index counts
//! them), replayed history at its engine's time, engines with a clock of their own.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::{kvevents, scratch};
use kvevent_recording::{Header, Record, Writer};
use kvevent_test_support::batches;
use kvevent_wire as wire;

/// Two replicas by hand, every figure worked out by hand (at milliseconds from the start):
///
/// replica a: t 0 s stores P (2 blocks: k1, k2), 1 s stores Q (kq), 2 s removes k2, 4 s stores
/// k2 again (under k1), 5 s removes kq. replica b: t 0.5 s stores P (k1, k2), 3 s clears.
fn hand_made_fleet() -> [(&'static str, Vec<(u64, wire::Event<'static>)>); 2] {
    let stored = |hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>| {
        batches::stored(hashes, parent, tokens, 16)
    };
    let removed = batches::removed;
    [
        (
            "a",
            vec![
                (0, stored(&[1, 2], None, 0..32)),
                (1_000, stored(&[7], None, 100..116)),
                (2_000, removed(&[2])),
                (4_000, stored(&[2], Some(1), 16..32)),
                (5_000, removed(&[7])),
            ],
        ),
        (
            "b",
            vec![
                (500, stored(&[11, 12], None, 0..32)),
                (3_000, wire::Event::AllBlocksCleared(Default::default())),
            ],
        ),
    ]
}

/// `dir/NAME.kvrec`, recorded from `started_unix_ms` on: each of `events` a batch of its own,
/// rank 0, its engine time, arrival (µs after the start) and whether the replay buffer gave it
/// as `seen(seq, at_ms)` says.
fn write(
    dir: &std::path::Path,
    name: &str,
    started_unix_ms: u64,
    events: Vec<(u64, wire::Event<'static>)>,
    seen: impl Fn(u64, u64) -> (f64, u64, bool),
) -> PathBuf {
    let path = dir.join(format!("{name}.kvrec"));
    let mut w = Writer::new(Vec::new(), &Header::new("vllm", started_unix_ms)).expect("header");
    for (seq, (at_ms, event)) in events.into_iter().enumerate() {
        let (ts, at_us, replay) = seen(seq as u64, at_ms);
        w.write(&Record {
            rank: 0,
            seq: seq as u64,
            at_us,
            topic: b"kv-events".to_vec(),
            replay,
            reset: None,
            payload: wire::encode(
                &batches::batch(ts, vec![event]),
                wire::Release::NEWEST_KNOWN,
            )
            .expect("encode"),
        })
        .expect("write");
    }
    std::fs::write(&path, w.finish().expect("finish")).expect("write");
    path
}

#[test]
fn stats_on_a_hand_made_fleet_give_the_figures_worked_out_by_hand() {
    let dir = scratch("stats");
    let live = |_, at_ms| (1.0, at_ms * 1000, false);
    let [(_, a), (_, b)] = hand_made_fleet();
    let (a, b) = (
        write(&dir, "a", 1_000_000, a, live),
        write(&dir, "b", 1_000_000, b, live),
    );
    let out = kvevents()
        .args(["stats", "--json", "--svg"])
        .arg(dir.join("plot.svg"))
        .arg(&a)
        .arg(&b)
        .output()
        .expect("stats");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let close = |got: &serde_json::Value, want: f64| {
        let got = got.as_f64().unwrap_or(f64::NAN);
        assert!((got - want).abs() < 1e-9, "{got} against {want}");
    };
    let ra = &v["replicas"][0];
    assert_eq!(ra["name"], "a");
    close(&ra["duration_s"], 5.0);
    assert_eq!(ra["batches"], 5);
    close(&ra["stored_per_s"], 4.0 / 5.0);
    close(&ra["removed_per_s"], 2.0 / 5.0);
    close(&ra["cleared_per_s"], 0.0);
    assert_eq!(ra["resident_peak"], 3);
    // 2 blocks for 1 s, 3 for 1 s, 2 for 2 s, 3 for 1 s: 12 block-seconds over 5 s.
    close(&ra["resident_mean"], 12.0 / 5.0);
    // k2 stayed 2 s, kq 4 s.
    assert_eq!(ra["residency_s"], serde_json::json!([2.0, 4.0, 4.0]));
    // 1 of 4 stores was of a prefix evicted before, 2 s after its eviction.
    close(&ra["restore_share"], 0.25);
    close(&ra["restore_gap_p50_s"], 2.0);
    // Depths 1, 2, 1, 2 blocks.
    assert_eq!(ra["depth_blocks"], serde_json::json!([1, 2, 2]));
    let rb = &v["replicas"][1];
    close(&rb["duration_s"], 2.5);
    close(&rb["cleared_per_s"], 1.0 / 2.5);
    assert_eq!(rb["resident_peak"], 2);
    close(&rb["resident_mean"], 2.0);
    assert_eq!(rb["residency_s"], serde_json::Value::Null);
    let f = &v["fleet"];
    assert_eq!(f["replicas"], 2);
    assert_eq!(f["distinct_prefixes"], 3);
    // Shares: 0 until 0.5 s, 1/2 until 1 s, 2/5 until 2 s, 1/4 until 3 s, then 0: 0.9 over 5 s.
    close(&f["duplication_peak"], 0.5);
    close(&f["duplication_mean"], 0.9 / 5.0);
    close(&f["duplication_end"], 0.0);
    assert_eq!(f["shared_pairs"], serde_json::json!([["a", "b", 2]]));
    let svg = std::fs::read_to_string(dir.join("plot.svg")).expect("svg");
    assert!(
        svg.starts_with("<svg") && svg.matches("<polyline").count() == 3,
        "{svg}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two DP ranks of one replica and a second replica: `stats` counts (prefix, rank) pairs as the
/// router's index does on the same batches (a clear of one rank leaves the other's blocks, an
/// eviction on one rank leaves the other's copy); one resident set a replica did not.
#[test]
fn stats_count_dp_ranks_as_the_routers_index_does() {
    let dir = scratch("stats-ranks");
    let stored =
        |hashes: &[u64], tokens: std::ops::Range<u32>| batches::stored(hashes, None, tokens, 16);
    let (removed, cleared) = (batches::removed, batches::cleared);
    // (replica, rank, ms, event): each rank its own engine hashes, the same prompts' tokens.
    let batches = vec![
        (0, 0, 0, stored(&[1, 2], 0..32)),
        (0, 1, 100, stored(&[11, 12], 0..32)),
        (1, 0, 200, stored(&[21, 22], 0..32)),
        (0, 1, 300, stored(&[13], 100..116)),
        (0, 0, 400, removed(&[2])),
        (0, 1, 500, cleared()),
        (0, 0, 600, stored(&[3], 100..116)),
    ];
    let batch = |e: &wire::Event<'static>| batches::batch(1.0, vec![e.clone()]);
    let paths: Vec<PathBuf> = ["a", "b"]
        .iter()
        .enumerate()
        .map(|(replica, name)| {
            let path = dir.join(format!("{name}.kvrec"));
            let mut w = Writer::new(Vec::new(), &Header::new("vllm", 1_000_000)).expect("header");
            let mut seqs = [0u64; 2];
            for (_, rank, at_ms, e) in batches.iter().filter(|b| b.0 == replica) {
                let seq = &mut seqs[*rank as usize];
                w.write(&Record {
                    rank: *rank,
                    seq: *seq,
                    at_us: at_ms * 1000,
                    topic: b"kv-events".to_vec(),
                    replay: false,
                    reset: None,
                    payload: wire::encode(&batch(e), wire::Release::NEWEST_KNOWN).expect("encode"),
                })
                .expect("write");
                *seq += 1;
            }
            std::fs::write(&path, w.finish().expect("finish")).expect("write");
            path
        })
        .collect();
    // The router's index, a source a rank, the same batches in the same order.
    let index = kvevent_index::Index::new(kvevent_index::Config::default());
    let mut sources = BTreeMap::new();
    for (replica, rank, _, e) in &batches {
        let source = *sources
            .entry((*replica, *rank))
            .or_insert_with(|| index.add_source(["a", "b"][*replica]).expect("a source"));
        index.apply(source, &batch(e));
    }
    let want = index.stats();
    let out = kvevents()
        .args(["stats", "--json"])
        .args(&paths)
        .output()
        .expect("stats");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let fleet = &v["fleet"];
    assert_eq!(fleet["sources"], 3, "{v}");
    // a#0 holds P's first block and Q, b both of P's: 4 pairs of 3 prefixes.
    assert_eq!((want.pairs, want.keys), (4, 3));
    assert_eq!(fleet["pairs_end"], want.pairs as u64, "{v}");
    let got = fleet["duplication_end"].as_f64().expect("a share");
    assert!(
        (got - want.duplication()).abs() < 1e-9,
        "{got} against {}",
        want.duplication()
    );
    assert_eq!(v["replicas"][0]["ranks"], serde_json::json!([0, 1]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `--replay-first` recording: the history the replay buffer answered arrives in a burst at
/// the start, but counts at the engine's own times (each batch's `ts`), so its rates are the
/// engine's, not a burst's.
#[test]
fn stats_put_replayed_history_at_its_engine_time() {
    let dir = scratch("stats-replayed");
    let path = dir.join("r.kvrec");
    let start_unix_s = 1_764_000_000u64;
    // The recorder started at start_unix_s + 10; the engine stored one block a second from
    // start_unix_s on: ten replayed (all arriving within 10 ms), then two live.
    let mut w =
        Writer::new(Vec::new(), &Header::new("vllm", (start_unix_s + 10) * 1000)).expect("header");
    for i in 0..12u64 {
        let batch = wire::EventBatch::new(
            (start_unix_s + i) as f64,
            vec![wire::Event::BlockStored(wire::BlockStored {
                block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(i + 1))],
                token_ids: ((i as u32 * 16)..(i as u32 * 16 + 16))
                    .collect::<Vec<u32>>()
                    .into(),
                block_size: 16,
                ..Default::default()
            })],
        );
        let replay = i < 10;
        w.write(&Record {
            rank: 0,
            seq: i,
            at_us: if replay {
                i * 1000
            } else {
                (i - 10) * 1_000_000
            },
            topic: b"kv-events".to_vec(),
            replay,
            reset: None,
            payload: wire::encode(&batch, wire::Release::NEWEST_KNOWN).expect("encode"),
        })
        .expect("write");
    }
    std::fs::write(&path, w.finish().expect("finish")).expect("write");
    let out = kvevents()
        .args(["stats", "--json"])
        .arg(&path)
        .output()
        .expect("stats");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let r = &v["replicas"][0];
    // From the first replayed store (start) to the last live one (start + 11 s).
    let duration = r["duration_s"].as_f64().expect("seconds");
    assert!((duration - 11.0).abs() < 1e-6, "{v}");
    let rate = r["stored_per_s"].as_f64().expect("a rate");
    assert!((rate - 12.0 / 11.0).abs() < 1e-6, "{v}");
    assert_eq!(r["replayed_at_arrival"], 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The hand-made fleet above, recorded replay-first by recorders that started late (a at 3 s,
/// b at 1 s: what came before was replayed), from engines whose clock is 60 s ahead of the
/// recorders' (another machine): every figure is the hand count's, as on one clock.
#[test]
fn stats_on_engines_with_a_clock_of_their_own_give_the_hand_counts() {
    let dir = scratch("stats-skew");
    let t0_ms = 1_764_000_000_000u64;
    let skew_ms = 60_000;
    // The recorder started `started_ms` after t0: what came before was replayed, in a burst
    // at the start; live batches arrive 2 ms after they happen. The engine stamps its own clock.
    let seen = |started_ms: u64| {
        move |seq: u64, at_ms: u64| {
            let ts = (t0_ms + at_ms + skew_ms) as f64 / 1000.0;
            if at_ms < started_ms {
                (ts, seq * 100, true)
            } else {
                (ts, (at_ms - started_ms + 2) * 1000, false)
            }
        }
    };
    let [(_, a), (_, b)] = hand_made_fleet();
    let (a, b) = (
        write(&dir, "a", t0_ms + 3_000, a, seen(3_000)),
        write(&dir, "b", t0_ms + 1_000, b, seen(1_000)),
    );
    let out = kvevents()
        .args(["stats", "--json"])
        .arg(&a)
        .arg(&b)
        .output()
        .expect("stats");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let close = |got: &serde_json::Value, want: f64| {
        let got = got.as_f64().unwrap_or(f64::NAN);
        assert!((got - want).abs() < 1e-3, "{got} against {want}: {v}");
    };
    let ra = &v["replicas"][0];
    close(&ra["duration_s"], 5.0);
    close(&ra["resident_mean"], 12.0 / 5.0);
    close(&ra["restore_share"], 0.25);
    close(&ra["restore_gap_p50_s"], 2.0);
    assert_eq!(ra["replayed_at_arrival"], 0);
    let f = &v["fleet"];
    close(&f["duplication_peak"], 0.5);
    close(&f["duplication_mean"], 0.9 / 5.0);
    assert_eq!(f["shared_pairs"], serde_json::json!([["a", "b", 2]]), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}
