//! Queries and their answers: token queries chained into fingerprints, lookups across chunks,
//! the order of answers, candidates and the states and loads they carry.

#[allow(
    clippy::wildcard_imports,
    reason = "the helpers and imports of main.rs"
)]
use super::*;

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
