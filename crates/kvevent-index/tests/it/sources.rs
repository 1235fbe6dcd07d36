//! Sources coming and going: a loading source promoted, replicas forgotten and their slots
//! reused, a snapshot loading beside others.

#[allow(
    clippy::wildcard_imports,
    reason = "the helpers and imports of main.rs"
)]
use super::*;

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
