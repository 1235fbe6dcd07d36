//! Engine key mode: counts across events, tiers, adapters, offload, placeholders, bounds.

use std::borrow::Cow;

use kvevent_mapper::{Identity, Options, parse_lora_adapters};
use kvevent_proto as pb;
use kvevent_wire as wire;

use crate::{be, entries, events, mapper, removed, run, stored, tokens};

const T1: i32 = pb::CacheTier::T1 as i32;
const T2: i32 = pb::CacheTier::T2 as i32;
const EVICTED: i32 = pb::cache_event::Type::PrefixEvicted as i32;
const CLEARED: i32 = pb::cache_event::Type::AllCleared as i32;

#[test]
fn token_counts_continue_across_events_through_a_known_parent() {
    let mut m = mapper(Options::default());
    let first = run(&mut m, vec![stored(&[1, 2], None, tokens(0..32), 16)]);
    assert_eq!(
        entries(&first),
        vec![(be(1), 16, T1, "".into()), (be(2), 32, T1, "".into())]
    );
    let ext = run(&mut m, vec![stored(&[3], Some(2), tokens(32..48), 16)]);
    assert_eq!(entries(&ext), vec![(be(3), 48, T1, "".into())]);
    // An unknown parent restarts the count at 0 and is counted.
    let orphan = run(&mut m, vec![stored(&[9], Some(77), tokens(0..16), 16)]);
    assert_eq!(entries(&orphan), vec![(be(9), 16, T1, "".into())]);
    assert_eq!(m.stats().unknown_parents, 1);
    // A removal prunes the map: a later extension of 2 no longer continues.
    run(&mut m, vec![removed(&[2], "GPU")]);
    let after = run(&mut m, vec![stored(&[4], Some(2), tokens(0..16), 16)]);
    assert_eq!(entries(&after)[0].1, 16);
    // A clear empties it.
    run(
        &mut m,
        vec![wire::Event::AllBlocksCleared(Default::default())],
    );
    assert_eq!(m.tracked_blocks(), 0);
}

#[test]
fn removals_and_clears_become_events_in_order() {
    let mut m = mapper(Options::default());
    let out = run(
        &mut m,
        vec![
            stored(&[1], None, tokens(0..16), 16),
            removed(&[1, 5], "GPU"),
            wire::Event::AllBlocksCleared(Default::default()),
        ],
    );
    assert!(matches!(out[0], pb::Report::New(_)));
    assert_eq!(
        events(&out),
        vec![
            (EVICTED, be(1), "".into()),
            (EVICTED, be(5), "".into()),
            (CLEARED, vec![], "".into())
        ]
    );
    assert_eq!(m.stats().unknown_removals, 1);
}

#[test]
fn negative_int_hashes_are_twos_complement() {
    let mut m = mapper(Options::default());
    let event = wire::Event::BlockStored(wire::BlockStored {
        block_hashes: vec![wire::BlockHash::Int(wire::Int::I64(-2))],
        token_ids: tokens(0..4).into(),
        block_size: 4,
        ..Default::default()
    });
    let out = run(&mut m, vec![event]);
    assert_eq!(
        entries(&out)[0].0,
        vec![0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]
    );
}

#[test]
fn media_map_to_tiers_case_insensitively() {
    let mut m = mapper(Options::default());
    for (medium, tier) in [
        ("GPU", T1),
        ("gpu", T1),
        ("CPU", T2),
        ("cpu", T2),
        ("STORAGE", T2),
        ("FS", T2),
        ("OBJ", T2),
        ("CXL", T2),
        ("something-new", T2),
    ] {
        let mut e = stored(&[1], None, tokens(0..4), 4);
        if let wire::Event::BlockStored(s) = &mut e {
            s.medium = Some(wire::Medium(Cow::Owned(medium.into())));
        }
        assert_eq!(entries(&run(&mut m, vec![e]))[0].2, tier, "{medium}");
    }
}

#[test]
fn adapters_come_from_lora_name_then_the_configured_map() {
    let options = Options {
        lora_adapters: parse_lora_adapters("1=sql").expect("map"),
        ..Options::default()
    };
    let mut m = mapper(options);
    let with = |name: Option<&'static str>, id: Option<i64>| {
        let mut e = stored(&[1], None, tokens(0..4), 4);
        if let wire::Event::BlockStored(s) = &mut e {
            s.lora_name = name.map(Cow::Borrowed);
            s.lora_id = id;
        }
        e
    };
    assert_eq!(
        entries(&run(&mut m, vec![with(Some("chat"), Some(1))]))[0].3,
        "chat"
    );
    assert_eq!(entries(&run(&mut m, vec![with(None, Some(1))]))[0].3, "sql");
    assert!(
        run(&mut m, vec![with(None, Some(2))]).is_empty(),
        "unnamed lora_id is dropped"
    );
    assert_eq!(m.stats().unknown_adapter_drops, 1);
    assert_eq!(entries(&run(&mut m, vec![with(None, None)]))[0].3, "");
    // A removal carries the adapter the block was stored under. Block 1 was stored four
    // times (each a copy, as the engine says): the last copy's removal evicts it.
    let mut batch = vec![with(Some("chat"), None)];
    batch.extend((0..4).map(|_| removed(&[1], "GPU")));
    assert_eq!(
        events(&run(&mut m, batch)),
        vec![(EVICTED, be(1), "chat".into())]
    );
}

/// vLLM caches one hash in two blocks (two requests computing the same prefix at once, or a
/// prompt cached whole sent again: its last block computed anew) and removes it once per
/// block: the prefix stays until the last copy goes.
#[test]
fn a_block_cached_twice_is_evicted_with_its_last_copy() {
    let mut m = mapper(Options::default());
    let store = || stored(&[7], None, tokens(0..4), 4);
    assert_eq!(entries(&run(&mut m, vec![store()])).len(), 1);
    assert_eq!(entries(&run(&mut m, vec![store()])).len(), 1, "re-reported");
    assert!(
        events(&run(&mut m, vec![removed(&[7], "GPU")])).is_empty(),
        "one copy left: nothing evicted"
    );
    assert_eq!(
        events(&run(&mut m, vec![removed(&[7], "GPU")])),
        vec![(EVICTED, be(7), String::new())]
    );
    assert_eq!(m.stats().unknown_removals, 0);
    // A store on another tier is not a copy: the GPU's removal leaves the CPU's.
    let mut cpu = store();
    if let wire::Event::BlockStored(s) = &mut cpu {
        s.medium = Some(wire::Medium(Cow::Borrowed("CPU")));
    }
    run(&mut m, vec![store(), cpu]);
    let out = run(&mut m, vec![removed(&[7], "GPU")]);
    assert!(events(&out).is_empty(), "still held on the CPU: {out:?}");
}

#[test]
fn removals_name_the_adapter_their_block_was_stored_under_across_forgotten_names() {
    // Stores alternate named adapters (each name interned once, the last one remembered by
    // address); emptying the map forgets the names, and names seen afterwards must not be
    // taken for the forgotten ones.
    let mut m = mapper(Options::default());
    let named = |hash: u64, name: &'static str| {
        let mut e = stored(&[hash], None, tokens(0..4), 4);
        if let wire::Event::BlockStored(s) = &mut e {
            s.lora_name = Some(Cow::Borrowed(name));
        }
        e
    };
    for round in 0..3u64 {
        let (a, b) = if round % 2 == 0 {
            ("x", "y")
        } else {
            ("y", "x")
        };
        let base = round * 10;
        let out = run(
            &mut m,
            vec![
                named(base + 1, a),
                named(base + 2, b),
                named(base + 3, a),
                stored(&[base + 4], None, tokens(0..4), 4),
            ],
        );
        let names: Vec<String> = entries(&out).into_iter().map(|e| e.3).collect();
        assert_eq!(names, [a, b, a, ""], "round {round}");
        // Every block removed: the map is empty and its names forgotten.
        let out = run(
            &mut m,
            vec![removed(&[base + 3, base + 1, base + 4, base + 2], "GPU")],
        );
        let evicted: Vec<String> = events(&out).into_iter().map(|e| e.2).collect();
        assert_eq!(evicted, [a, a, "", b], "round {round}");
        assert_eq!(m.tracked_blocks(), 0);
    }
}

#[test]
fn offload_tier_turns_gpu_removals_into_t2_reports() {
    let options = Options {
        engine_has_offload_tier: true,
        ..Options::default()
    };
    let mut m = mapper(options);
    run(&mut m, vec![stored(&[1, 2], None, tokens(0..8), 4)]);
    let out = run(&mut m, vec![removed(&[2], "GPU")]);
    assert_eq!(entries(&out), vec![(be(2), 8, T2, "".into())]);
    assert!(events(&out).is_empty());
    // The map forgets a block that left the GPU: it never grows with the offload tier.
    assert_eq!(m.tracked_blocks(), 1);
    // A removal from the offload tier itself is a real eviction.
    let out = run(&mut m, vec![removed(&[2], "CPU")]);
    assert_eq!(events(&out), vec![(EVICTED, be(2), "".into())]);
    assert_eq!(m.stats().offload_rereports, 1);
}

#[test]
fn with_an_offload_tier_a_block_stored_again_is_re_reported_at_t1_never_as_new() {
    let options = Options {
        engine_has_offload_tier: true,
        ..Options::default()
    };
    let mut m = mapper(options);
    let batch = |ts: f64, events| wire::EventBatch::new(ts, events);
    let mut out = Vec::new();
    m.map_batch(
        &batch(1.0, vec![stored(&[1], None, tokens(0..4), 4)]),
        &mut out,
    );
    m.map_batch(&batch(2.0, vec![removed(&[1], "GPU")]), &mut out);
    m.map_batch(
        &batch(3.0, vec![stored(&[1], None, tokens(0..4), 4)]),
        &mut out,
    );
    let seen: Vec<(i64, i32, bool)> = out
        .iter()
        .filter_map(|r| match r {
            pb::Report::New(u) => Some((u, true)),
            pb::Report::Update(u) => Some((u, false)),
            pb::Report::Event(_) => None,
        })
        .flat_map(|(u, new)| {
            u.prefixes
                .iter()
                .map(move |p| (u.timestamp_us, p.tier, new))
        })
        .collect();
    // Each in an update of its own, with its batch's time: T1, T2 at the removal's time, T1.
    // The server may hold a forgotten block at T2, so no report here is `New`.
    assert_eq!(
        seen,
        [
            (1_000_000, T1, false),
            (2_000_000, T2, false),
            (3_000_000, T1, false)
        ]
    );
}

#[test]
fn placeholders_are_counted_not_forwarded() {
    let mut m = mapper(Options::default());
    assert!(run(&mut m, vec![stored(&[1], None, vec![], 0)]).is_empty());
    assert_eq!(m.stats().placeholder_stores, 1);
}

#[test]
fn the_per_source_map_is_bounded() {
    let options = Options {
        max_tracked_blocks: 2,
        ..Options::default()
    };
    let mut m = mapper(options);
    let out = run(&mut m, vec![stored(&[1, 2, 3], None, tokens(0..12), 4)]);
    assert_eq!(entries(&out).len(), 3, "still reported");
    assert_eq!((m.tracked_blocks(), m.stats().map_refusals), (2, 1));
}

#[test]
fn identity_is_validated() {
    assert!(Identity::new("", "m", "", "vllm").is_err());
    assert!(Identity::new("r", "", "", "vllm").is_err());
    let err = Identity::new("r", "m", "", "").expect_err("scheme");
    assert_eq!(
        err.to_string(),
        "hash scheme is required and must not be empty"
    );
    assert!(parse_lora_adapters("1=a,1=b").is_err());
    assert!(parse_lora_adapters("1=").is_err());
}

#[test]
fn a_block_still_held_by_another_medium_is_re_reported_not_evicted() {
    let mut m = mapper(Options::default());
    run(&mut m, vec![stored(&[1], None, tokens(0..4), 4)]);
    // The connector offloads block 1 to CPU: now in both tiers.
    let mut cpu = stored(&[1], None, tokens(0..4), 4);
    if let wire::Event::BlockStored(s) = &mut cpu {
        s.medium = Some("CPU".into());
    }
    run(&mut m, vec![cpu]);
    // The GPU drops it: still in CPU, so the server keeps it at T2.
    let out = run(&mut m, vec![removed(&[1], "GPU")]);
    assert_eq!(entries(&out), vec![(be(1), 4, T2, "".into())]);
    assert!(events(&out).is_empty());
    // The CPU drops it too: now it is gone.
    let out = run(&mut m, vec![removed(&[1], "CPU")]);
    assert_eq!(events(&out), vec![(EVICTED, be(1), "".into())]);
    assert_eq!(m.tracked_blocks(), 0);
}

/// The keys of the reports of one kind: `New` or `Update`.
fn keys_of(out: &[pb::Report], new: bool) -> Vec<Vec<u8>> {
    out.iter()
        .filter_map(|r| match (r, new) {
            (pb::Report::New(u), true) | (pb::Report::Update(u), false) => Some(u),
            _ => None,
        })
        .flat_map(|u| u.prefixes.iter().map(|p| p.prefix_hash.clone()))
        .collect()
}

#[test]
fn first_reports_are_new_and_re_reports_or_untracked_blocks_are_not() {
    let options = Options {
        max_tracked_blocks: 3,
        ..Options::default()
    };
    let mut m = mapper(options);
    let key = |h: u64| h.to_be_bytes().to_vec();
    let out = run(&mut m, vec![stored(&[1, 2], None, tokens(0..8), 4)]);
    assert_eq!(keys_of(&out, true), [key(1), key(2)]);
    // Stored again (0.26+ re-announces), plus one new block and one over the cap: the server
    // may hold the re-announced ones, and nothing tracks the refused one.
    let out = run(&mut m, vec![stored(&[1, 2, 3, 4], None, tokens(0..16), 4)]);
    assert_eq!(keys_of(&out, true), [key(3)]);
    assert_eq!(keys_of(&out, false), [key(1), key(2), key(4)]);
    // Evicted, then stored again: new again.
    run(&mut m, vec![removed(&[3], "GPU")]);
    let out = run(&mut m, vec![stored(&[3], Some(2), tokens(0..4), 4)]);
    assert_eq!(keys_of(&out, true), [key(3)]);
}

#[test]
fn entries_carry_their_adapter_and_the_update_level_adapter_stays_empty() {
    let mut m = mapper(Options::default());
    let mut event = stored(&[1], None, tokens(0..4), 4);
    if let wire::Event::BlockStored(s) = &mut event {
        s.lora_name = Some(Cow::Borrowed("chat"));
    }
    let out = run(&mut m, vec![event]);
    let update = out[0].as_update().expect("an update");
    assert_eq!(update.adapter_id, "");
    assert_eq!(update.prefixes[0].adapter_id, "chat");
}

#[test]
fn an_empty_bytes_hash_is_not_a_key() {
    let mut m = mapper(Options::default());
    let mut event = stored(&[1, 2], None, tokens(0..8), 4);
    if let wire::Event::BlockStored(s) = &mut event {
        s.block_hashes[0] = wire::BlockHash::Bytes(Cow::Borrowed(&[]));
    }
    let out = run(&mut m, vec![event]);
    assert_eq!(entries(&out), vec![(be(2), 8, T1, "".into())]);
    let mut gone = removed(&[], "GPU");
    if let wire::Event::BlockRemoved(r) = &mut gone {
        r.block_hashes
            .push(wire::BlockHash::Bytes(Cow::Borrowed(&[])));
    }
    assert!(run(&mut m, vec![gone]).is_empty());
    assert_eq!(m.stats().empty_hashes, 2);
    assert_eq!(m.tracked_blocks(), 1);
}

#[test]
fn hybrid_models_report_full_attention_groups_only_unless_asked() {
    let in_group = |hash: u64, group: i64, kind: &'static str| {
        let mut e = stored(&[hash], None, tokens(0..4), 4);
        if let wire::Event::BlockStored(s) = &mut e {
            s.group_idx = Some(group);
            s.kv_cache_spec_kind = Some(Cow::Borrowed(kind));
        }
        e
    };
    let removed_from = |hash: u64, group: i64| {
        let mut e = removed(&[hash], "GPU");
        if let wire::Event::BlockRemoved(r) = &mut e {
            r.group_idx = Some(group);
        }
        e
    };
    let mut m = mapper(Options::default());
    let out = run(
        &mut m,
        vec![
            in_group(1, 0, "full_attention"),
            in_group(2, 1, "sliding_window"),
            in_group(3, 2, "mamba"),
            in_group(4, 3, "mla_attention"),
            stored(&[5], None, tokens(0..4), 4),
        ],
    );
    let keys: Vec<Vec<u8>> = entries(&out).into_iter().map(|e| e.0).collect();
    assert_eq!(keys, [be(1), be(4), be(5)]);
    assert_eq!(m.stats().non_prefix_groups.get("sliding_window"), Some(&1));
    assert_eq!(m.stats().non_prefix_groups.get("mamba"), Some(&1));
    // Removals from a group that is not reported evict nothing; the others still do.
    let out = run(&mut m, vec![removed_from(2, 1), removed_from(1, 0)]);
    assert_eq!(events(&out), vec![(EVICTED, be(1), "".into())]);
    assert_eq!(m.stats().unknown_removals, 0);

    let mut all = mapper(Options {
        all_kv_groups: true,
        ..Options::default()
    });
    let out = run(&mut all, vec![in_group(2, 1, "sliding_window")]);
    assert_eq!(entries(&out).len(), 1);
}

#[test]
fn a_clear_of_the_offload_tier_keeps_the_gpu_prefixes() {
    let mut m = mapper(Options::default());
    let mut cpu = stored(&[2], None, tokens(0..4), 4);
    if let wire::Event::BlockStored(s) = &mut cpu {
        s.medium = Some(wire::Medium(Cow::Borrowed("CPU")));
    }
    // 1 on the GPU, 2 on the CPU, 3 on both.
    run(&mut m, vec![stored(&[1, 3], None, tokens(0..8), 4), cpu]);
    let mut both = stored(&[3], Some(1), tokens(0..4), 4);
    if let wire::Event::BlockStored(s) = &mut both {
        s.medium = Some(wire::Medium(Cow::Borrowed("CPU")));
    }
    run(&mut m, vec![both]);
    let clear = |medium: &'static str| {
        wire::Event::AllBlocksCleared(wire::AllBlocksCleared {
            medium: Some(wire::Medium(Cow::Borrowed(medium))),
        })
    };
    let out = run(&mut m, vec![clear("cpu")]);
    // 2 is gone; 3 is re-reported where it still is; 1 is untouched; no ALL_CLEARED.
    assert_eq!(events(&out), vec![(EVICTED, be(2), "".into())]);
    assert_eq!(entries(&out), vec![(be(3), 8, T1, "".into())]);
    assert_eq!(m.tracked_blocks(), 2);
    // Without a medium a clear is still a clear of everything.
    let out = run(
        &mut m,
        vec![wire::Event::AllBlocksCleared(Default::default())],
    );
    assert_eq!(events(&out), vec![(CLEARED, Vec::new(), "".into())]);
    assert_eq!(m.tracked_blocks(), 0);
}

#[test]
fn refresh_re_reports_every_resident_block_once_per_interval_spread_evenly() {
    use std::time::{Duration, Instant};
    let mut m = mapper(Options::default());
    let hashes: Vec<u64> = (1..=100).collect();
    run(&mut m, vec![stored(&hashes, None, tokens(0..400), 4)]);
    // A cycle walks every block in half the interval: 10 s.
    let interval = Duration::from_secs(20);
    let t0 = Instant::now();
    let mut out = Vec::new();
    // A cycle starts: nothing is due yet.
    assert_eq!(m.refresh(t0, interval, 7, &mut out), 0);
    // A tenth of the cycle: a tenth of the blocks, as an Update stamped with the time given.
    assert_eq!(
        m.refresh(t0 + Duration::from_secs(1), interval, 7, &mut out),
        10
    );
    assert!(matches!(&out[0], pb::Report::Update(u) if u.timestamp_us == 7));
    // A block evicted meanwhile, and not refreshed yet, is skipped.
    let done: Vec<Vec<u8>> = entries(&out).into_iter().map(|e| e.0).collect();
    let gone = hashes
        .iter()
        .copied()
        .find(|h| !done.contains(&be(*h)))
        .expect("a block not refreshed yet");
    run(&mut m, vec![removed(&[gone], "GPU")]);
    let mut refreshed = 10;
    for s in 2..=10 {
        refreshed += m.refresh(t0 + Duration::from_secs(s), interval, 7, &mut out);
    }
    assert_eq!(refreshed, 99, "each resident block once");
    let keys: std::collections::BTreeSet<Vec<u8>> =
        entries(&out).into_iter().map(|e| e.0).collect();
    assert_eq!(keys.len(), 99);
    assert!(!keys.contains(&be(gone)));
    assert_eq!(m.stats().refreshed, 99);
    // The next cycle refreshes them again, in the same (sorted) order: each block about one
    // cycle after its last refresh.
    let mut again = Vec::new();
    assert_eq!(
        m.refresh(t0 + Duration::from_secs(10), interval, 7, &mut again),
        0
    );
    assert_eq!(
        m.refresh(t0 + Duration::from_secs(20), interval, 7, &mut again),
        99
    );
    let order = |reports: &[pb::Report]| -> Vec<Vec<u8>> {
        entries(reports)
            .into_iter()
            .map(|e| e.0)
            .filter(|k| *k != be(gone))
            .collect()
    };
    let first = order(&out);
    assert!(first.windows(2).all(|w| w[0] < w[1]), "sorted");
    assert_eq!(order(&again), first);
    // Off: nothing.
    assert_eq!(
        m.refresh(t0 + Duration::from_secs(30), Duration::ZERO, 7, &mut again),
        0
    );
}

#[test]
fn sglang_signed_hashes_are_keyed_as_their_twos_complement_big_endian() {
    let payload = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../testdata/vectors/sglang-0.5.23/i64_extremes.msgpack"),
    )
    .expect("vector");
    let batch = wire::decode_engine(&payload, wire::Engine::Sglang, &wire::Limits::DEFAULT)
        .expect("decode");
    let mut m = mapper(Options::default());
    let mut out = Vec::new();
    m.map_batch(&batch, &mut out);
    let keys: Vec<Vec<u8>> = entries(&out).into_iter().map(|e| e.0).collect();
    let want: Vec<Vec<u8>> = [i64::MIN, -1, 0, 1, i64::MAX]
        .iter()
        .map(|h| h.to_be_bytes().to_vec())
        .collect();
    assert_eq!(
        keys, want,
        "as the Go sidecar keys them (vLLM 0.9's signed hashes alike)"
    );
}
