//! The index's unit tests: its private rules, beside the property test against a naive model
//! (`tests/it`).

use super::*;

/// Engine block hashes as keys: a test names its keys.
fn engine_keys() -> Config {
    Config {
        mapping: mapper::Options {
            key_mode: KeyMode::Engine,
            ..mapper::Options::default()
        },
        ..Config::default()
    }
}

fn stored(hash: u64) -> wire::EventBatch<'static> {
    wire::EventBatch::new(
        0.0,
        vec![wire::Event::BlockStored(wire::BlockStored {
            block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(hash))],
            token_ids: wire::TokenIds::from(vec![0u32; 4]),
            block_size: 4,
            ..Default::default()
        })],
    )
}

fn holders(index: &Index, key: u64) -> Vec<String> {
    let answer = index.score(&Query {
        adapter: "",
        keys: QueryKeys::Keys(&[key]),
    });
    answer.iter().map(|s| s.replica.to_owned()).collect()
}

#[test]
fn a_holder_is_one_word_and_up_to_three_are_inline() {
    let e = Holder::EPOCHS;
    let h = Holder::new(MAX_SOURCES - 1, e, 1);
    assert_eq!((h.source(), h.epoch(), h.tier()), (MAX_SOURCES - 1, e, 1));
    assert_ne!(h, LIST, "no holder is the list mark");
    assert_ne!(Holder::new(0, 1, 0).0, 0, "no holder is an unused word");
    // Words sort by source first, and by tier last.
    assert!(Holder::new(1, e, 1) < Holder::new(2, 1, 0));
    assert!(Holder::new(2, 5, 0) < Holder::new(2, 5, 1));
    assert!(Holder::new(2, 5, 0).same_id(Holder::new(2, 5, 1)));
    assert!(!Holder::new(2, 5, 0).same_id(Holder::new(2, 6, 0)));

    let mut lists = Lists::default();
    let all = |n: u32| -> Vec<Holder> { (0..n).map(|s| Holder::new(s * 7, 3, 0)).collect() };
    let mut held = Holders::NONE;
    // Stored in an order of their own, read back sorted; the fourth takes a list.
    for &s in &[14, 0, 21, 7] {
        held = held.upsert(&mut lists, Holder::new(s, 3, 0));
    }
    assert_eq!(held.view(&lists), all(4));
    assert_eq!(lists.lists.iter().filter(|l| !l.is_empty()).count(), 1);
    // A holder of the same source replaces its word.
    held = held.upsert(&mut lists, Holder::new(7, 3, 1));
    assert_eq!(held.len(&lists), 4);
    assert_eq!(held.view(&lists)[1].tier(), 1);
    // Back to three: inline again, the list given back.
    held = held.remove(&mut lists, 7);
    assert_eq!(
        held.view(&lists),
        [
            Holder::new(0, 3, 0),
            Holder::new(14, 3, 0),
            Holder::new(21, 3, 0)
        ]
    );
    assert_eq!(lists.free.len(), 1);
    held = held.retain(&mut lists, |h| h.source() != 0);
    assert_eq!(
        held.view(&lists),
        [Holder::new(14, 3, 0), Holder::new(21, 3, 0)]
    );
    held = held.remove(&mut lists, 21).remove(&mut lists, 14);
    assert_eq!(held, Holders::NONE);
    assert_eq!(entry_bytes(3), 0);
}

#[test]
fn an_epoch_wraps_to_1_and_a_removed_slot_that_wrapped_is_not_reused() {
    let index = Index::new(engine_keys());
    let a = index.add_source("a").expect("a source");
    index.apply(a, &stored(1));
    // A live source wrapping: its older holders are dropped at once.
    for _ in 0..Holder::EPOCHS {
        index.reset(a);
    }
    assert_eq!(index.read().inner.sources[0].epoch, 1);
    assert!(holders(&index, 1).is_empty());
    index.apply(a, &stored(1));
    assert_eq!(holders(&index, 1), ["a"]);
    // Lapsed to the last epoch, then removed: the wrap retires its slot for good.
    for _ in 0..Holder::EPOCHS - 1 {
        index.reset(a);
    }
    index.apply(a, &stored(2));
    index.remove_source(a);
    let b = index.add_source("b").expect("a source");
    assert_ne!(
        b.slot, a.slot,
        "a slot whose epoch wrapped is not used again"
    );
    assert!(holders(&index, 2).is_empty());
}

/// The scan the counters replace: every key's holders, as stored.
fn scanned(index: &Index) -> (usize, u64, u64) {
    let state = index.read();
    let inner = &state.inner;
    let lens: Vec<usize> = inner
        .young
        .values()
        .chain(inner.old.values())
        .map(|e| {
            let h = e.holders;
            h.len(&inner.lists)
        })
        .collect();
    let held = lens.iter().sum::<usize>() as u64;
    let shared = lens
        .iter()
        .map(|h| (h * h.saturating_sub(1) / 2) as u64)
        .sum();
    (lens.len(), held, shared)
}

/// The duplication figures, kept as changes apply, equal a full scan after every change:
/// stores, evictions, resets (lapses the sweep then drops), removals, a budget that drops
/// the old generation, sources added back into freed slots.
#[test]
fn the_sharing_counters_equal_a_scan_after_every_change() {
    let config = Config {
        byte_budget: 16 << 10,
        ..engine_keys()
    };
    let index = Index::new(config);
    let mut sources: Vec<SourceId> = ["a", "b", "c", "d"]
        .iter()
        .map(|r| index.add_source(r).expect("source"))
        .collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for step in 0..20_000u64 {
        let r = next();
        let s = sources[(r % sources.len() as u64) as usize];
        let key = (r >> 8) % 3_000 + 1;
        match (r >> 40) % 1000 {
            0..=1 => index.reset(s),
            2..=3 if sources.len() > 2 => {
                index.remove_source(s);
                sources.retain(|x| *x != s);
            }
            4..=5 if sources.len() < 6 => {
                sources.push(index.add_source(&format!("r{step}")).expect("source"));
            }
            6..=200 => index.apply(
                s,
                &wire::EventBatch::new(
                    0.0,
                    vec![wire::Event::BlockRemoved(wire::BlockRemoved {
                        block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(key))],
                        ..Default::default()
                    })],
                ),
            ),
            _ => index.apply(s, &stored(key)),
        }
        let stats = index.stats();
        let (keys, held, shared) = scanned(&index);
        assert_eq!(
            (stats.keys, stats.pairs as u64, stats.shared_pairs),
            (keys, held, shared),
            "step {step}"
        );
        let d = stats.duplication();
        assert!((0.0..1.0).contains(&d) || stats.pairs == 0, "{d}");
    }
    assert!(
        index.stats().evicted_keys > 0,
        "the budget dropped a generation: {:?}",
        index.stats()
    );
}

/// Should an epoch ever wrap, the source's older holders go at once: none of them can
/// count again when the epoch comes back round.
#[test]
fn an_epoch_that_wraps_drops_the_holders_of_its_source() {
    let keys = engine_keys();
    let index = Index::new(keys);
    let [a, b] = ["a", "b"].map(|r| index.add_source(r).expect("a source"));
    index.apply(b, &stored(1));
    // `a` stores key 1 at epoch 1, then its epoch is taken to the last before the wrap.
    index.apply(a, &stored(1));
    {
        let inner = &mut index.write().inner;
        inner.sources[a.slot as usize].epoch = Holder::EPOCHS;
        inner.rescore(a.slot);
    }
    assert_eq!(holders(&index, 1), ["b"]);
    index.reset(a); // EPOCHS -> 1: the epoch `a`'s holder was stored at.
    assert_eq!(index.read().inner.sources[a.slot as usize].epoch, 1);
    assert_eq!(holders(&index, 1), ["b"]);
    assert_eq!(index.stats().pairs, 1, "a's holder is gone, not lapsed");
}

/// Two replicas joining at once, each announcing 10,000 blocks, the same 5,000 keys in fact:
/// the room is taken before the blocks come (no growth while they load), what went unused goes
/// back once both are promoted, and the answers are those of an index that grew step by step.
#[test]
fn room_reserved_for_a_join_is_taken_at_once_and_given_back_when_unused() {
    let keys: Vec<u64> = (1..=5_000u64)
        .map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let changes: Vec<KeyChange<'_>> = keys
        .iter()
        .map(|&key| KeyChange::Stored {
            key,
            tokens: 16,
            tier: Tier::T1,
            adapter: "",
        })
        .collect();
    let load = |reserve: bool| {
        let index = Index::new(Config::default());
        let sources = ["a", "b"].map(|r| index.add_loading_source(r).expect("a source"));
        if reserve {
            for _ in sources {
                index.reserve(10_000);
            }
        }
        let buckets = index.read().inner.young.bytes();
        for s in sources {
            index.apply_keys(s, &changes);
        }
        let grew = index.read().inner.young.bytes() != buckets;
        index.promote(sources[0], None);
        assert_eq!(
            index.read().inner.room != 0,
            reserve,
            "b still loads: the room stays"
        );
        index.promote(sources[1], None);
        (index, grew)
    };
    let (reserved, grew) = load(true);
    assert!(!grew, "the tables did not grow while the snapshots loaded");
    assert_eq!(reserved.read().inner.room, 0);
    let (grown, _) = load(false);
    let (r, g) = (reserved.stats(), grown.stats());
    assert_eq!((r.keys, r.pairs), (g.keys, g.pairs));
    assert!(
        r.bytes <= g.bytes * 5 / 4,
        "the unused room went back: {} bytes against {} grown step by step",
        r.bytes,
        g.bytes
    );
    for &key in keys.iter().step_by(97) {
        let q = [key];
        let query = Query {
            adapter: "",
            keys: QueryKeys::Keys(&q),
        };
        let names = |i: &Index| -> Vec<String> {
            i.score(&query)
                .iter()
                .map(|s| s.replica.to_owned())
                .collect()
        };
        assert_eq!(names(&reserved), ["a", "b"]);
        assert_eq!(names(&reserved), names(&grown));
    }
}

/// `key` stored as a feed carries it: 16 tokens, on the GPU, the base model.
fn stored_key(&key: &u64) -> KeyChange<'static> {
    KeyChange::Stored {
        key,
        tokens: 16,
        tier: Tier::T1,
        adapter: "",
    }
}

/// 64 replicas whose announcements trickle in while the first snapshots load (fleet-join): the
/// table grows a handful of times, each at least doubling it, not once an announcement (each
/// growth moves every key held), and the unused room goes back after.
#[test]
fn announcements_trickling_in_grow_the_table_a_bounded_number_of_times() {
    const REPLICAS: u64 = 64;
    const BLOCKS: u64 = 2_000;
    let index = Index::new(Config::default());
    let mut sizes = vec![0];
    let mut sources = Vec::new();
    for r in 0..REPLICAS {
        let s = index
            .add_loading_source(&format!("r{r}"))
            .expect("a source");
        index.reserve(BLOCKS as usize);
        // Half its snapshot is in before the next replica announces its own.
        let keys: Vec<u64> = (0..BLOCKS)
            .map(|b| (r * BLOCKS + b + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let changes: Vec<KeyChange<'_>> = keys.iter().map(stored_key).collect();
        index.apply_keys(s, &changes[..BLOCKS as usize / 2]);
        sources.push((s, keys));
        let bytes = index.read().inner.young.bytes();
        if sizes.last() != Some(&bytes) {
            sizes.push(bytes);
        }
    }
    assert!(
        sizes.len() <= 10,
        "the table grew {} times for 64 announcements: {sizes:?}",
        sizes.len() - 1
    );
    for (s, keys) in &sources {
        let changes: Vec<KeyChange<'_>> =
            keys[BLOCKS as usize / 2..].iter().map(stored_key).collect();
        index.apply_keys(*s, &changes);
    }
    for (s, _) in &sources {
        index.promote(*s, None);
    }
    let stats = index.stats();
    assert_eq!(stats.pairs as u64, REPLICAS * BLOCKS);
    let inner = &index.read().inner;
    assert_eq!(inner.room, 0);
    assert!(
        inner.young.len() * 2 >= inner.young.capacity(),
        "the unused room went back: {} keys in room for {}",
        inner.young.len(),
        inner.young.capacity()
    );
}

/// Room is never taken past the byte budget: the index grows step by step within it instead.
#[test]
fn no_room_is_reserved_past_the_byte_budget() {
    let index = Index::new(Config {
        byte_budget: 1 << 20,
        ..Config::default()
    });
    let _a = index.add_loading_source("a").expect("a source");
    index.reserve(10_000_000);
    assert_eq!(index.read().inner.young.bytes(), 0, "no room taken");
    assert!(index.stats().bytes <= 1 << 20);
}

/// A snapshot given up (its stream lost mid-load) takes what it announced with it: a replica
/// reconnecting again and again never makes the room grow.
#[test]
fn a_snapshot_given_up_takes_its_room_with_it() {
    let index = Index::new(Config::default());
    for _ in 0..5 {
        let s = index.add_loading_source("a").expect("a source");
        index.reserve(10_000);
        index.remove_source(s);
    }
    let _s = index.add_loading_source("a").expect("a source");
    index.reserve(10_000);
    assert_eq!(
        index.read().inner.room,
        10_000,
        "the last announcement only"
    );
}

#[test]
fn an_answer_made_past_a_followers_lease_is_not_exact() {
    let index = Index::new(engine_keys());
    let a = index.add_source("a").expect("a source");
    index.apply(a, &stored(7));
    for i in 0..40 {
        // Replicas added later grow the lease table: a's lease is kept.
        index.set_replica_state(&format!("r{i}"), ReplicaState::Exact);
    }
    let state = |index: &Index| {
        let answer = index.score(&Query {
            adapter: "",
            keys: QueryKeys::Keys(&[7]),
        });
        answer.first().map(|s| s.state)
    };
    // No lease: as its follower said.
    assert_eq!(state(&index), Some(ReplicaState::Exact));
    let now = std::time::Instant::now();
    index.renew_lease("a", Some(now + std::time::Duration::from_secs(60)));
    index.set_replica_state("r39", ReplicaState::Exact);
    assert_eq!(state(&index), Some(ReplicaState::Exact));
    // Run out: every answer made from now on says so, until it is renewed.
    index.renew_lease("a", Some(now));
    let held = index.score(&Query {
        adapter: "",
        keys: QueryKeys::Keys(&[7]),
    });
    assert_eq!(
        state(&index),
        Some(ReplicaState::Degraded(Degraded::LeaseExpired))
    );
    index.renew_lease("a", Some(now + std::time::Duration::from_secs(60)));
    assert_eq!(state(&index), Some(ReplicaState::Exact));
    // An answer judged its leases when it was made.
    assert_eq!(
        held.first().map(|s| s.state),
        Some(ReplicaState::Degraded(Degraded::LeaseExpired))
    );
    // A state other than exact is as said; a lease cleared holds for good.
    index.renew_lease("a", Some(now));
    index.set_replica_state("a", ReplicaState::Degraded(Degraded::Silent));
    assert_eq!(
        state(&index),
        Some(ReplicaState::Degraded(Degraded::Silent))
    );
    index.set_replica_state("a", ReplicaState::Exact);
    index.renew_lease("a", None);
    assert_eq!(state(&index), Some(ReplicaState::Exact));
    // A name the index does not know: nothing.
    index.renew_lease("nobody", Some(now));
}
