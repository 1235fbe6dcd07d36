//! The index against a naive model, and its bounds.

use std::collections::{BTreeMap, BTreeSet};

use kvevent_index::{
    Config, Degraded, Index, IndexStats, KeyMode, Query, QueryKeys, ReplicaState, Tier,
};
use kvevent_mapper as mapper;
use kvevent_wire as wire;
use proptest::prelude::*;

fn engine_keys() -> Config {
    Config {
        mapping: mapper::Options {
            key_mode: KeyMode::Engine,
            ..mapper::Options::default()
        },
        ..Config::default()
    }
}

fn hash(h: u64) -> wire::BlockHash<'static> {
    wire::BlockHash::Int(wire::Int::U64(h))
}

fn batch(events: Vec<wire::Event<'static>>) -> wire::EventBatch<'static> {
    wire::EventBatch::new(1.0, events)
}

fn stored(hashes: &[u64], medium: &'static str) -> wire::Event<'static> {
    wire::Event::BlockStored(wire::BlockStored {
        block_hashes: hashes.iter().copied().map(hash).collect(),
        token_ids: wire::TokenIds::from(vec![0u32; hashes.len() * 4]),
        block_size: 4,
        medium: Some(wire::Medium(medium.into())),
        ..Default::default()
    })
}

fn removed(h: u64) -> wire::Event<'static> {
    wire::Event::BlockRemoved(wire::BlockRemoved {
        block_hashes: vec![hash(h)],
        medium: Some(wire::Medium("GPU".into())),
        ..Default::default()
    })
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        source: usize,
        first: u64,
        len: u64,
    },
    Remove {
        source: usize,
        h: u64,
    },
    Reset {
        source: usize,
    },
    Fresh {
        source: usize,
        fresh: bool,
    },
    /// The replica is removed and comes back under the same name (a pod replaced).
    Replace {
        replica: usize,
    },
    /// A run of blocks stored, then blocks from its middle evicted (an engine's LRU takes
    /// blocks out of the middle of chains): queries stop at the hole.
    EvictMid {
        source: usize,
        first: u64,
        len: u64,
        holes: u64,
    },
    /// The engine stores a block, clears its cache (an `AllBlocksCleared` event) and stores
    /// another, in one batch.
    Clear {
        source: usize,
        before: u64,
        after: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // Runs of up to 20 blocks: queries cross the index's chunks of 16 lookups.
        6 => (0..6usize, 0..12u64, 1..21u64).prop_map(|(source, first, len)| Op::Store { source, first, len }),
        3 => (0..6usize, 0..32u64).prop_map(|(source, h)| Op::Remove { source, h }),
        1 => (0..6usize).prop_map(|source| Op::Reset { source }),
        1 => (0..6usize, any::<bool>()).prop_map(|(source, fresh)| Op::Fresh { source, fresh }),
        1 => (0..3usize).prop_map(|replica| Op::Replace { replica }),
        2 => (0..6usize, 0..12u64, 3..21u64, 1..3u64).prop_map(|(source, first, len, holes)| Op::EvictMid { source, first, len, holes }),
        1 => (0..6usize, 0..32u64, 0..32u64).prop_map(|(source, before, after)| Op::Clear { source, before, after }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// Six sources (two ranks of three replicas), random stores, removals, resets, freshness
    /// changes and replaced replicas: every score equals the naive model's (per source a set
    /// of held blocks and whether it is fresh).
    #[test]
    fn scores_match_a_naive_model(ops in proptest::collection::vec(op(), 1..80)) {
        let index = Index::new(engine_keys());
        // The same stream into an index whose budget keeps dropping generations: it may
        // forget, never invent (shared holder lists are freed and reused as keys go).
        let small = Index::new(Config { byte_budget: 1_200, ..engine_keys() });
        // And into one fed the runs of batches between other changes together
        // (`apply_many`): the same answers.
        let many = Index::new(engine_keys());
        // Added out of name order: ties are broken by name, not by when a replica came.
        let replicas = ["c", "a", "b"];
        let mut sources: Vec<_> = (0..6).map(|i| index.add_source(replicas[i / 2]).expect("a source")).collect();
        let mut small_sources: Vec<_> = (0..6).map(|i| small.add_source(replicas[i / 2]).expect("a source")).collect();
        let mut many_sources: Vec<_> = (0..6).map(|i| many.add_source(replicas[i / 2]).expect("a source")).collect();
        let mut held: Vec<(kvevent_index::SourceId, wire::EventBatch<'static>)> = Vec::new();
        let apply_held = |held: &mut Vec<(kvevent_index::SourceId, wire::EventBatch<'static>)>| {
            let batches: Vec<_> = held.iter().map(|(s, b)| (*s, b)).collect();
            many.apply_many(&batches);
            held.clear();
        };
        let mut model: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); 6];
        let mut fresh = [true; 6];
        for op in &ops {
            match *op {
                Op::Store { source, first, len } => {
                    let hashes: Vec<u64> = (first..first + len).collect();
                    index.apply(sources[source], &batch(vec![stored(&hashes, "GPU")]));
                    small.apply(small_sources[source], &batch(vec![stored(&hashes, "GPU")]));
                    held.push((many_sources[source], batch(vec![stored(&hashes, "GPU")])));
                    model[source].extend(hashes);
                }
                Op::EvictMid { source, first, len, holes } => {
                    let hashes: Vec<u64> = (first..first + len).collect();
                    // Holes spread over the middle: never the run's first or last block.
                    let middle: Vec<u64> = (1..=holes).map(|i| first + i * (len - 1) / (holes + 1)).collect();
                    let events = || {
                        let mut e = vec![stored(&hashes, "GPU")];
                        e.extend(middle.iter().map(|&h| removed(h)));
                        batch(e)
                    };
                    index.apply(sources[source], &events());
                    small.apply(small_sources[source], &events());
                    held.push((many_sources[source], events()));
                    model[source].extend(&hashes);
                    for h in &middle {
                        model[source].remove(h);
                    }
                }
                Op::Remove { source, h } => {
                    index.apply(sources[source], &batch(vec![removed(h)]));
                    small.apply(small_sources[source], &batch(vec![removed(h)]));
                    held.push((many_sources[source], batch(vec![removed(h)])));
                    model[source].remove(&h);
                }
                Op::Clear { source, before, after } => {
                    let clear = || {
                        batch(vec![
                            stored(&[before], "GPU"),
                            wire::Event::AllBlocksCleared(Default::default()),
                            stored(&[after], "GPU"),
                        ])
                    };
                    index.apply(sources[source], &clear());
                    small.apply(small_sources[source], &clear());
                    held.push((many_sources[source], clear()));
                    model[source].clear();
                    model[source].insert(after);
                }
                Op::Reset { source } => {
                    apply_held(&mut held);
                    index.reset(sources[source]);
                    small.reset(small_sources[source]);
                    many.reset(many_sources[source]);
                    model[source].clear();
                }
                Op::Fresh { source, fresh: f } => {
                    apply_held(&mut held);
                    let state = if f { ReplicaState::Exact } else { ReplicaState::Degraded(Degraded::Replaying) };
                    index.set_replica_state(replicas[source / 2], state);
                    many.set_replica_state(replicas[source / 2], state);
                    fresh[source / 2] = f;
                }
                Op::Replace { replica } => {
                    apply_held(&mut held);
                    index.remove_replica(replicas[replica]);
                    small.remove_replica(replicas[replica]);
                    many.remove_replica(replicas[replica]);
                    for source in [2 * replica, 2 * replica + 1] {
                        sources[source] = index.add_source(replicas[replica]).expect("a source");
                        small_sources[source] = small.add_source(replicas[replica]).expect("a source");
                        many_sources[source] = many.add_source(replicas[replica]).expect("a source");
                        model[source].clear();
                    }
                    fresh[replica] = true;
                }
            }
        }
        apply_held(&mut held);
        // The small index stays within its budget, and its counters agree with the big one's
        // at most (it may have forgotten, never invented).
        let (big, little) = (index.stats(), small.stats());
        prop_assert!(little.bytes <= 1_200, "{:?}", little);
        prop_assert!(little.pairs <= big.pairs, "{:?} {:?}", little, big);
        for start in 0..12u64 {
            let query: Vec<u64> = (start..start + 20).collect();
            let answer = index.score(&Query { adapter: "", keys: QueryKeys::Keys(&query) });
            let scores: Vec<_> = answer.iter().collect();
            let many_answer = many.score(&Query { adapter: "", keys: QueryKeys::Keys(&query) });
            prop_assert_eq!(&many_answer.iter().collect::<Vec<_>>(), &scores);
            // Best first: most tokens, most blocks, T1 before T2, then by name.
            let order = |s: &kvevent_index::Score| {
                (std::cmp::Reverse(s.matched_tokens), std::cmp::Reverse(s.matched_blocks), s.tier, s.replica.to_owned())
            };
            prop_assert!(scores.windows(2).all(|w| order(&w[0]) < order(&w[1])), "{:?}", scores);
            // Every answer carries the state its follower last set.
            for s in &scores {
                let r = replicas.iter().position(|r| *r == s.replica).unwrap_or(0);
                prop_assert_eq!(s.state.is_exact(), fresh[r], "{:?}", s);
            }
            let got: BTreeMap<String, u32> = scores
                .into_iter()
                .map(|s| (s.replica.to_string(), s.matched_blocks))
                .collect();
            let mut want = BTreeMap::new();
            for (i, held) in model.iter().enumerate() {
                let n = query.iter().take_while(|k| held.contains(k)).count() as u32;
                if n > 0 {
                    let best = want.entry(replicas[i / 2].to_owned()).or_insert(0);
                    *best = (*best).max(n);
                }
            }
            for s in &small.score(&Query { adapter: "", keys: QueryKeys::Keys(&query) }) {
                let most = want.get(s.replica).copied().unwrap_or(0);
                prop_assert!(s.matched_blocks <= most, "query from {}: {:?} over {}", start, s, most);
            }
            prop_assert_eq!(got, want, "query from {}", start);
        }
    }
}

#[test]
fn a_long_token_query_matches_across_the_lookup_chunks() {
    let index = Index::new(Config::default());
    let a = index.add_source("a").expect("a source");
    let tokens: Vec<u32> = (0..1024).map(|t| t * 7 + 1).collect();
    // 50 blocks of 16 held (three chunks and two blocks of a fourth), stored in two events
    // (the second continues the first's chain).
    let stored = |first: usize, n: usize| {
        wire::Event::BlockStored(wire::BlockStored {
            block_hashes: (first..first + n).map(|h| hash(h as u64 + 100)).collect(),
            parent_block_hash: (first > 0).then(|| hash(first as u64 + 99)),
            token_ids: wire::TokenIds::from(tokens[first * 16..(first + n) * 16].to_vec()),
            block_size: 16,
            ..Default::default()
        })
    };
    index.apply(a, &batch(vec![stored(0, 20), stored(20, 30)]));
    for (len, blocks) in [
        (1024, 50),
        (800, 50),
        (799, 49),
        (256, 16),
        (257, 16),
        (15, 0),
    ] {
        let answer = index.score(&Query {
            adapter: "",
            keys: QueryKeys::Tokens {
                ids: &tokens[..len],
                block_size: 16,
            },
        });
        let scores: Vec<_> = answer.iter().collect();
        let got = scores.first().map(|s| (s.matched_blocks, s.matched_tokens));
        let want = (blocks > 0).then_some((blocks, blocks * 16));
        assert_eq!(got, want, "a query of {len} tokens");
    }
    // A query that differs in block 40 matches the 40 before it.
    let mut other = tokens.clone();
    other[40 * 16 + 3] += 1;
    let answer = index.score(&Query {
        adapter: "",
        keys: QueryKeys::Tokens {
            ids: &other,
            block_size: 16,
        },
    });
    let scores: Vec<_> = answer.iter().collect();
    assert_eq!(scores[0].matched_blocks, 40);
}

#[test]
fn a_token_query_is_chained_into_fingerprints_and_tiers_and_freshness_are_reported() {
    let index = Index::new(Config::default());
    let a = index.add_source("a").expect("a source");
    let b = index.add_source("b").expect("a source");
    let tokens: Vec<u32> = (0..64).collect();
    let event = |n: usize, medium: &'static str| {
        wire::Event::BlockStored(wire::BlockStored {
            block_hashes: (0..n as u64).map(|h| hash(h + 100)).collect(),
            token_ids: wire::TokenIds::from(tokens[..n * 16].to_vec()),
            block_size: 16,
            medium: Some(wire::Medium(medium.into())),
            ..Default::default()
        })
    };
    index.apply(a, &batch(vec![event(4, "GPU")]));
    index.apply(b, &batch(vec![event(2, "CPU")]));
    index.set_replica_state("b", ReplicaState::Degraded(Degraded::Replaying));
    let answer = index.score(&Query {
        adapter: "",
        keys: QueryKeys::Tokens {
            ids: &tokens[..50],
            block_size: 16,
        },
    });
    let scores: Vec<_> = answer.iter().collect();
    assert_eq!(scores.len(), 2);
    assert_eq!(
        (
            scores[0].replica,
            scores[0].matched_blocks,
            scores[0].matched_tokens
        ),
        ("a", 3, 48)
    );
    assert_eq!(
        (scores[0].tier, scores[0].state.is_exact()),
        (Tier::T1, true)
    );
    assert_eq!(
        (
            scores[1].replica,
            scores[1].matched_blocks,
            scores[1].matched_tokens
        ),
        ("b", 2, 32)
    );
    assert_eq!(
        (scores[1].tier, scores[1].state.is_exact()),
        (Tier::T2, false)
    );
    // Another adapter is another partition.
    assert!(
        index
            .score(&Query {
                adapter: "sql-lora",
                keys: QueryKeys::Tokens {
                    ids: &tokens,
                    block_size: 16
                }
            })
            .is_empty()
    );
    // Removing a replica removes all of its entries.
    index.remove_replica("a");
    let answer = index.score(&Query {
        adapter: "",
        keys: QueryKeys::Tokens {
            ids: &tokens,
            block_size: 16,
        },
    });
    let scores: Vec<_> = answer.iter().collect();
    assert_eq!(scores.iter().map(|s| s.replica).collect::<Vec<_>>(), ["b"]);
}

/// Twenty replicas, added in reverse name order, each holding its own prefix of one chain and
/// some of them in the offload tier: many distinct scores, then few (many ties).
#[test]
fn answers_are_best_first_then_by_name_with_many_distinct_scores_or_few() {
    for lengths in [10u64, 3] {
        let index = Index::new(engine_keys());
        let mut want = Vec::new();
        for i in (0..20u64).rev() {
            let name = format!("r{i:02}");
            let source = index.add_source(&name).expect("a source");
            let n = (i * 7) % lengths + 1;
            let medium = if i % 4 == 0 { "CPU" } else { "GPU" };
            let hashes: Vec<u64> = (1..=n).collect();
            index.apply(source, &batch(vec![stored(&hashes, medium)]));
            let tier = if i % 4 == 0 { Tier::T2 } else { Tier::T1 };
            want.push((std::cmp::Reverse(4 * n as u32), tier, name));
        }
        want.sort();
        let query: Vec<u64> = (1..=12).collect();
        let answer = index.score(&Query {
            adapter: "",
            keys: QueryKeys::Keys(&query),
        });
        let got: Vec<_> = answer
            .iter()
            .map(|s| {
                (
                    std::cmp::Reverse(s.matched_tokens),
                    s.tier,
                    s.replica.to_owned(),
                )
            })
            .collect();
        assert_eq!(got, want, "chains of up to {lengths} blocks");
    }
}

#[test]
fn a_block_whose_parent_was_never_seen_still_enters() {
    let index = Index::new(engine_keys());
    let a = index.add_source("a").expect("a source");
    let mut e = stored(&[7, 8], "GPU");
    if let wire::Event::BlockStored(s) = &mut e {
        s.parent_block_hash = Some(hash(6));
    }
    index.apply(a, &batch(vec![e]));
    let answer = index.score(&Query {
        adapter: "",
        keys: QueryKeys::Keys(&[7, 8]),
    });
    let scores: Vec<_> = answer.iter().collect();
    assert_eq!(scores[0].matched_blocks, 2);
}

#[test]
fn memory_stays_within_the_budget_under_churn() {
    let budget = 4 << 20;
    let index = Index::new(Config {
        byte_budget: budget,
        ..engine_keys()
    });
    let a = index.add_source("a").expect("a source");
    for round in 0..200u64 {
        let hashes: Vec<u64> = (round * 1_000..round * 1_000 + 1_000).collect();
        index.apply(a, &batch(vec![stored(&hashes, "GPU")]));
        assert!(
            index.stats().bytes <= budget,
            "round {round}: {:?}",
            index.stats()
        );
    }
    let stats = index.stats();
    assert!(stats.evicted_keys > 0, "{stats:?}");
    // What is counted is what the tables hold, free slots included: at least a 24-byte slot
    // per key, and the budget mostly used.
    assert!(
        stats.table_bytes >= stats.keys * 24 && stats.bytes >= stats.table_bytes,
        "{stats:?}"
    );
    assert!(stats.bytes > budget / 4, "{stats:?}");
    // The newest blocks are still there.
    let answer = index.score(&Query {
        adapter: "",
        keys: QueryKeys::Keys(&[199_000, 199_001]),
    });
    let scores: Vec<_> = answer.iter().collect();
    assert_eq!(scores[0].matched_blocks, 2);
}

#[test]
fn scoring_from_many_threads_while_events_are_applied() {
    let index = std::sync::Arc::new(Index::new(engine_keys()));
    let a = index.add_source("a").expect("a source");
    index.apply(a, &batch(vec![stored(&[1, 2, 3], "GPU")]));
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let index = index.clone();
            std::thread::spawn(move || {
                for _ in 0..2_000 {
                    let answer = index.score(&Query {
                        adapter: "",
                        keys: QueryKeys::Keys(&[1, 2, 3]),
                    });
                    let s: Vec<_> = answer.iter().collect();
                    assert!(s[0].matched_blocks >= 3);
                }
            })
        })
        .collect();
    for i in 0..2_000u64 {
        index.apply(a, &batch(vec![stored(&[10 + i], "GPU")]));
    }
    for r in readers {
        r.join().expect("reader");
    }
}

#[test]
fn lapsed_holders_are_reclaimed_within_the_call_that_made_them_lapse_in_a_small_index() {
    let index = Index::new(engine_keys());
    let [a, b, c] = ["a", "b", "c"].map(|r| index.add_source(r).expect("a source"));
    for s in [a, b, c] {
        index.apply(s, &batch(vec![stored(&[1, 2], "GPU")]));
    }
    let pairs = || index.stats().pairs;
    let holders = |key: u64| -> Vec<String> {
        let answer = index.score(&Query {
            adapter: "",
            keys: QueryKeys::Keys(&[key]),
        });
        answer.iter().map(|s| s.replica.to_owned()).collect()
    };
    assert_eq!(pairs(), 6);
    // A reset: `a`'s holders stop counting, and the sweep (a whole pass, the table is small)
    // drops them.
    index.reset(a);
    assert_eq!(holders(1), ["b", "c"]);
    assert_eq!(pairs(), 4, "a's lapsed holders are swept");
    // Storing a key again changes nothing else.
    index.apply(c, &batch(vec![stored(&[1], "CPU")]));
    assert_eq!(pairs(), 4);
    // A removal finds its source's holder in a list (not only the one holder of a key).
    index.apply(c, &batch(vec![removed(2)]));
    assert_eq!(pairs(), 3);
    assert_eq!(holders(2), ["b"]);
    // Removing a replica: its holders go too, and a key it alone held.
    index.remove_replica("b");
    assert_eq!(holders(1), ["c"]);
    assert!(holders(2).is_empty());
    assert_eq!(pairs(), 1, "{:?}", index.stats());
    assert_eq!(index.stats().keys, 1);
    // A clear is a lapse too.
    index.apply(a, &batch(vec![stored(&[1], "GPU")]));
    index.apply(
        c,
        &batch(vec![wire::Event::AllBlocksCleared(Default::default())]),
    );
    assert_eq!(holders(1), ["a"]);
    assert_eq!(pairs(), 1, "{:?}", index.stats());
}

/// An engine that clears its cache often (RL weight syncs) must never bring back what it held
/// before: 65,536 clears wrapped the 16-bit epoch this index once had, and the oldest holders
/// counted again.
#[test]
fn many_clears_never_bring_back_what_a_source_held_before_them() {
    let index = Index::new(engine_keys());
    let [a, b] = ["a", "b"].map(|r| index.add_source(r).expect("a source"));
    // Both hold key 1; `a` only until its first clear. `b` keeps the list shared, so `a`'s
    // lapsed holder stays in it (dropped only when the key is stored again).
    index.apply(a, &batch(vec![stored(&[1], "GPU")]));
    index.apply(b, &batch(vec![stored(&[1], "GPU")]));
    let clear = batch(vec![wire::Event::AllBlocksCleared(Default::default())]);
    let holders = || -> Vec<String> {
        let answer = index.score(&Query {
            adapter: "",
            keys: QueryKeys::Keys(&[1]),
        });
        answer.iter().map(|s| s.replica.to_owned()).collect()
    };
    for n in 1..=(1u32 << 16) + 1 {
        index.apply(a, &clear);
        if n % 8192 == 0 || n >= 1 << 16 {
            assert_eq!(holders(), ["b"], "after {n} clears");
        }
    }
}

/// Table bytes of an index holding `resident` blocks, after the fill and after ten times as
/// many stored (each evicting the oldest).
fn churned(resident: u64) -> (IndexStats, IndexStats) {
    let index = Index::new(engine_keys());
    let a = index.add_source("a").expect("a source");
    index.apply(
        a,
        &batch(vec![stored(&(0..resident).collect::<Vec<_>>(), "GPU")]),
    );
    let before = index.stats();
    for h in resident..resident * 11 {
        index.apply(a, &batch(vec![stored(&[h], "GPU"), removed(h - resident)]));
    }
    (before, index.stats())
}

#[test]
fn the_key_tables_do_not_grow_under_churn() {
    // With hashbrown's tables (tombstones on delete) both sizes doubled under this churn.
    for resident in [16_000, 20_000, 45_000] {
        let (before, after) = churned(resident);
        assert_eq!(after.keys, before.keys);
        assert!(
            after.table_bytes <= before.table_bytes * 21 / 20,
            "{resident}: {before:?} -> {after:?}"
        );
    }
}

fn keyed(keys: std::ops::Range<u64>) -> Vec<kvevent_index::KeyChange<'static>> {
    keys.map(|k| kvevent_index::KeyChange::Stored {
        key: k,
        tokens: 16 * k as u32,
        tier: Tier::T1,
        adapter: "",
    })
    .collect()
}

fn matched(index: &Index, keys: &[u64]) -> Vec<(String, u32)> {
    index
        .score(&Query {
            adapter: "",
            keys: QueryKeys::Keys(keys),
        })
        .iter()
        .map(|s| (s.replica.to_owned(), s.matched_blocks))
        .collect()
}

#[test]
fn a_loading_source_counts_only_once_promoted_and_replaces_the_old_one_at_once() {
    use kvevent_index::KeyChange;
    let index = Index::new(Config::default());
    let old = index.add_source("a").expect("a source");
    index.apply_keys(old, &keyed(1..5));
    assert_eq!(matched(&index, &[1, 2, 3, 4]), [("a".to_owned(), 4)]);
    // A new snapshot loads: the old state still answers, the half-loaded one does not.
    let new = index.add_loading_source("a").expect("a source");
    index.apply_keys(new, &keyed(1..3));
    assert_eq!(matched(&index, &[1, 2, 3, 4]), [("a".to_owned(), 4)]);
    index.apply_keys(new, &keyed(7..9));
    index.promote(new, Some(old));
    // Only the new snapshot counts now: 1, 2 (and 7, 8), not 3, 4.
    assert_eq!(matched(&index, &[1, 2, 3, 4]), [("a".to_owned(), 2)]);
    assert_eq!(matched(&index, &[7, 8]), [("a".to_owned(), 2)]);
    index.apply_keys(
        new,
        &[
            KeyChange::Evicted {
                key: 2,
                adapter: "",
            },
            KeyChange::Evicted {
                key: 99,
                adapter: "nobody",
            },
        ],
    );
    assert_eq!(matched(&index, &[1, 2]), [("a".to_owned(), 1)]);
    index.apply_keys(new, &[KeyChange::Cleared]);
    assert!(matched(&index, &[1]).is_empty());
    // Changes to a retired source are ignored.
    index.apply_keys(old, &keyed(1..3));
    assert!(matched(&index, &[1]).is_empty());
    index.remove_source(new);
    index.apply_keys(new, &keyed(1..3));
    assert!(matched(&index, &[1]).is_empty());
}

/// A fleet that churns: replicas come and go under new names (a rollout), each loading a
/// snapshot and replacing it. The index's slots, names, pairs and keys follow the live set,
/// not its history, and a handle kept past its source's removal changes nothing.
#[test]
fn an_index_forgets_what_left_and_reuses_its_slots() {
    let index = Index::new(Config::default());
    let live = 8u64;
    let per = 50u64;
    // Replica i holds keys of a shared prompt (0..10) and its own.
    let keys_of = |i: u64| -> Vec<kvevent_index::KeyChange<'static>> {
        let mut k = keyed(0..10);
        k.extend(keyed(1000 + i * per..1000 + (i + 1) * per));
        k
    };
    let mut sources: Vec<(String, kvevent_index::SourceId)> = (0..live)
        .map(|i| {
            let name = format!("r{i}");
            let s = index.add_source(&name).expect("a source");
            index.apply_keys(s, &keys_of(i));
            (name, s)
        })
        .collect();
    let fresh = index.stats();
    let mut retired = Vec::new();
    for round in 0..2_000u64 {
        let i = (round % live) as usize;
        let (name, old) = sources[i].clone();
        if round % 2 == 0 {
            // A new incarnation under a new name.
            index.remove_replica(&name);
            let name = format!("r{i}-{round}");
            let s = index.add_source(&name).expect("a source");
            index.apply_keys(s, &keys_of(i as u64));
            sources[i] = (name, s);
        } else {
            // A re-snapshot of the same replica.
            let s = index.add_loading_source(&name).expect("a source");
            index.apply_keys(s, &keys_of(i as u64));
            index.promote(s, Some(old));
            sources[i].1 = s;
        }
        retired.push(old);
    }
    let after = index.stats();
    assert_eq!(after.sources, live as usize);
    assert!(after.source_slots <= live as usize + 1, "{after:?}");
    assert!(after.replica_slots <= live as usize + 1, "{after:?}");
    assert_eq!(
        (after.pairs, after.keys),
        (fresh.pairs, fresh.keys),
        "{after:?}"
    );
    assert!(
        after.bytes <= fresh.bytes * 12 / 10,
        "{fresh:?} -> {after:?}"
    );
    // Handles of removed sources name nothing, though their slots are reused.
    for old in &retired[retired.len() - 16..] {
        index.apply_keys(*old, &keyed(5000..5001));
        index.remove_source(*old);
        index.reset(*old);
    }
    assert!(matched(&index, &[5000]).is_empty());
    assert_eq!(index.stats().sources, live as usize);
    assert_eq!(matched(&index, &[0, 1]).len(), live as usize);
    // Names gone are unknown; the live ones are known.
    let answer = index.score_among(
        &Query {
            adapter: "",
            keys: QueryKeys::Keys(&[0]),
        },
        &["r0", &sources[0].0],
    );
    assert_eq!(answer.unknown(), [0]);
    assert_eq!(answer.len(), 1);
}

#[test]
fn a_snapshot_loading_beside_other_replicas_keeps_every_key_it_loaded() {
    let index = Index::new(Config::default());
    let b = index.add_source("b").expect("a source");
    let loading = index.add_loading_source("a").expect("a source");
    index.apply_keys(loading, &keyed(1..3));
    // Another replica stores the same keys while the snapshot loads.
    index.apply_keys(b, &keyed(1..3));
    index.promote(loading, None);
    let mut held = matched(&index, &[1, 2]);
    held.sort();
    assert_eq!(held, [("a".to_owned(), 2), ("b".to_owned(), 2)]);
}

#[test]
fn candidates_are_answered_each_known_matching_or_not_and_states_are_carried() {
    let index = Index::new(Config::default());
    let a = index.add_source("a").expect("a source");
    index.apply_keys(a, &keyed(1..3));
    index.add_source("b").expect("a source");
    index.set_replica_state("b", ReplicaState::Degraded(Degraded::Replaying));
    // Known with no source: its follower said so.
    index.set_replica_state("c", ReplicaState::Degraded(Degraded::Connecting));
    let query = Query {
        adapter: "",
        keys: QueryKeys::Keys(&[1, 2]),
    };
    let answer = index.score_among(&query, &["x", "c", "b", "a", "a"]);
    let got: Vec<_> = answer
        .iter()
        .map(|s| (s.replica, s.matched_blocks, s.state))
        .collect();
    assert_eq!(
        got,
        [
            ("a", 2, ReplicaState::Exact),
            ("b", 0, ReplicaState::Degraded(Degraded::Replaying)),
            ("c", 0, ReplicaState::Degraded(Degraded::Connecting)),
        ]
    );
    assert_eq!(answer.unknown(), [0]);
    // Each candidate's score by its place in the question, with no search; loads carried.
    let by_place: Vec<Option<(&str, u32)>> = (0..6)
        .map(|i| {
            answer
                .of_candidate(i)
                .map(|s| (s.replica, s.matched_blocks))
        })
        .collect();
    assert_eq!(
        by_place,
        [
            None,
            Some(("c", 0)),
            Some(("b", 0)),
            Some(("a", 2)),
            Some(("a", 2)),
            None
        ]
    );
    assert!(index.score(&query).of_candidate(0).is_none());
    let read_at = std::time::Instant::now();
    let load = kvevent_index::LoadReading {
        load: kvevent_index::Load {
            ranks: vec![kvevent_index::RankLoad {
                running: 3,
                waiting: 1,
                kv_usage: Some(0.5),
                ..kvevent_index::RankLoad::idle(0)
            }],
        },
        read_at,
        failing: false,
    };
    index.set_replica_load("b", Some(load.clone()));
    let loaded = index.score_among(&query, &["a", "b"]);
    assert_eq!(loaded.of_candidate(1).and_then(|s| s.load), Some(&load));
    assert_eq!(loaded.of_candidate(0).and_then(|s| s.load), None);
    // An adapter nobody stored: the candidates are still answered.
    let other = index.score_among(
        &Query {
            adapter: "lora",
            keys: QueryKeys::Keys(&[1]),
        },
        &["a"],
    );
    assert_eq!(
        other.first().map(|s| (s.replica, s.matched_blocks)),
        Some(("a", 0))
    );
    index.remove_replica("c");
    assert_eq!(index.score_among(&query, &["c"]).unknown(), [0]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]
    /// Many sources on one shared prefix (24 sources, two a replica): each holds a chain of
    /// its own length at its own tier, with holes evicted. The blocks where most sources drop
    /// out are scored by searching the few that go on; every answer equals the model's.
    #[test]
    fn wide_answers_match_a_naive_model(
        chains in proptest::collection::vec((prop_oneof![8 => Just(4u64), 1 => 0..14u64], any::<bool>(), proptest::collection::vec(0..14u64, 0..2)), 24),
    ) {
        let index = Index::new(Config::default());
        let names: Vec<String> = (0..12).map(|r| format!("r{:02}", 11 - r)).collect();
        let mut model: Vec<(usize, BTreeSet<u64>, bool)> = Vec::new();
        for (i, (len, t2, holes)) in chains.iter().enumerate() {
            let replica = i / 2;
            let source = index.add_source(&names[replica]).expect("a source");
            let tier = if *t2 { Tier::T2 } else { Tier::T1 };
            let mut changes: Vec<kvevent_index::KeyChange<'_>> = (0..*len)
                .map(|k| kvevent_index::KeyChange::Stored { key: 1000 + k, tokens: (k as u32 + 1) * 16, tier, adapter: "" })
                .collect();
            changes.extend(holes.iter().map(|&h| kvevent_index::KeyChange::Evicted { key: 1000 + h, adapter: "" }));
            index.apply_keys(source, &changes);
            let held: BTreeSet<u64> = (0..*len).filter(|k| !holes.contains(k)).map(|k| 1000 + k).collect();
            model.push((replica, held, *t2));
        }
        let query: Vec<u64> = (1000..1014).collect();
        let answer = index.score(&Query { adapter: "", keys: QueryKeys::Keys(&query) });
        let got: Vec<(String, u32, Tier)> = answer.iter().map(|s| (s.replica.to_owned(), s.matched_blocks, s.tier)).collect();
        // Per replica its best source: most blocks, then T1 over T2.
        let mut best: BTreeMap<String, (u32, bool)> = BTreeMap::new();
        for (replica, held, t2) in &model {
            let n = query.iter().take_while(|k| held.contains(k)).count() as u32;
            if n == 0 {
                continue;
            }
            let e = best.entry(names[*replica].clone()).or_insert((n, *t2));
            if (n, !*t2) > (e.0, !e.1) {
                *e = (n, *t2);
            }
        }
        let mut want: Vec<(String, u32, Tier)> = best
            .into_iter()
            .map(|(name, (n, t2))| (name, n, if t2 { Tier::T2 } else { Tier::T1 }))
            .collect();
        want.sort_by(|a, b| (std::cmp::Reverse(a.1), a.2, &a.0).cmp(&(std::cmp::Reverse(b.1), b.2, &b.0)));
        prop_assert_eq!(got, want);
    }
}
