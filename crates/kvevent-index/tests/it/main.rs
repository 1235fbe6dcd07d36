//! The index against a naive model (here), and its queries, bounds and sources (by module).

use std::collections::{BTreeMap, BTreeSet};

use kvevent_index::{
    Config, Degraded, Index, IndexStats, KeyMode, Query, QueryKeys, ReplicaState, Tier,
};
use kvevent_mapper as mapper;
use kvevent_wire as wire;
use proptest::prelude::*;

mod memory;
mod queries;
mod sources;

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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// Six sources (two ranks of three replicas), random stores, removals, resets, freshness
    /// changes and replaced replicas: every score equals the naive model's (per source each
    /// held block's copies, and whether it is fresh).
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
        // Per source, each block's copies: an engine caches one hash in two blocks and removes
        // it once per block (a block stored again is a copy, as vLLM sends it).
        let mut model: Vec<BTreeMap<u64, u32>> = vec![BTreeMap::new(); 6];
        let add = |m: &mut BTreeMap<u64, u32>, h: u64| *m.entry(h).or_default() += 1;
        let take = |m: &mut BTreeMap<u64, u32>, h: u64| {
            if let Some(n) = m.get_mut(&h) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&h);
                }
            }
        };
        let mut fresh = [true; 6];
        for op in &ops {
            match *op {
                Op::Store { source, first, len } => {
                    let hashes: Vec<u64> = (first..first + len).collect();
                    index.apply(sources[source], &batch(vec![stored(&hashes, "GPU")]));
                    small.apply(small_sources[source], &batch(vec![stored(&hashes, "GPU")]));
                    held.push((many_sources[source], batch(vec![stored(&hashes, "GPU")])));
                    hashes.iter().for_each(|&h| add(&mut model[source], h));
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
                    hashes.iter().for_each(|&h| add(&mut model[source], h));
                    middle.iter().for_each(|&h| take(&mut model[source], h));
                }
                Op::Remove { source, h } => {
                    index.apply(sources[source], &batch(vec![removed(h)]));
                    small.apply(small_sources[source], &batch(vec![removed(h)]));
                    held.push((many_sources[source], batch(vec![removed(h)])));
                    take(&mut model[source], h);
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
                    add(&mut model[source], after);
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
                let n = query.iter().take_while(|k| held.contains_key(k)).count() as u32;
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
