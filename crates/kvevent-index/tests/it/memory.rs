//! The index's bounds: memory within its budget under churn, key tables that do not grow,
//! lapsed holders reclaimed, clears, and scoring from many threads while events apply.

#[allow(
    clippy::wildcard_imports,
    reason = "the helpers and imports of main.rs"
)]
use super::*;

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
