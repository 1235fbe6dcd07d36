//! `Mapper::save` / `Mapper::restore`: a restored mapper is the mapper that was saved.

use std::time::{Duration, Instant};

use kvevent_mapper::{KeyMode, Mapper, Options, RestoreError, parse_lora_adapters};
use kvevent_wire as wire;

use crate::{entries, events, identity, mapper, removed, run, stored, tokens};

fn options(key_mode: KeyMode) -> Options {
    Options {
        key_mode,
        lora_adapters: parse_lora_adapters("7=sql-lora").expect("map"),
        ..Options::default()
    }
}

/// Everything the mapper would report of its blocks, order-free: a full refresh, then an
/// eviction of each. Two mappers with the same state give the same.
type Observable = (
    Vec<(Vec<u8>, i32, i32, String)>,
    Vec<(i32, Vec<u8>, String)>,
);

fn observable(m: &mut Mapper) -> Observable {
    let mut out = Vec::new();
    let t0 = Instant::now();
    m.refresh(t0, Duration::from_secs(1), 1, &mut out);
    m.refresh(
        t0 + Duration::from_secs(2),
        Duration::from_secs(1),
        1,
        &mut out,
    );
    let mut refreshed = entries(&out);
    refreshed.sort();
    let mut evicted = events(&m.evict_all(1));
    evicted.sort();
    (refreshed, evicted)
}

fn roundtrip(m: &Mapper, options: Options) -> Mapper {
    let mut bytes = Vec::new();
    m.save(&mut bytes);
    Mapper::restore(identity(), options, &bytes).expect("restore")
}

#[test]
fn every_vector_survives_a_save_and_restore_in_both_key_modes() {
    let mut checked = 0;
    for (path, payload) in crate::vector_payloads() {
        let batch = wire::decode(&payload).expect("decode");
        for mode in [KeyMode::Engine, KeyMode::Fingerprint] {
            let mut original = mapper(options(mode));
            original.map_batch(&batch, &mut Vec::new());
            let mut restored = roundtrip(&original, options(mode));
            assert_eq!(
                restored.tracked_blocks(),
                original.tracked_blocks(),
                "{}",
                path.display()
            );
            assert_eq!(
                observable(&mut restored),
                observable(&mut original),
                "{} {mode:?}",
                path.display()
            );
            checked += 1;
        }
    }
    assert!(checked >= 150, "only {checked} vector runs");
}

#[test]
fn a_restored_mapper_continues_chains_token_counts_and_adapters() {
    for mode in [KeyMode::Engine, KeyMode::Fingerprint] {
        let first = vec![stored(&[1, 2], None, tokens(0..32), 16)];
        let next = vec![
            stored(&[3], Some(2), tokens(32..48), 16),
            removed(&[1], "GPU"),
        ];
        let mut straight = mapper(options(mode));
        run(&mut straight, first.clone());
        let mut restored = roundtrip(&straight, options(mode));
        let a = run(&mut straight, next.clone());
        let b = run(&mut restored, next);
        assert_eq!(entries(&a), entries(&b), "{mode:?}");
        assert_eq!(events(&a), events(&b), "{mode:?}");
        assert_eq!(
            entries(&b)[0].1,
            48,
            "the count continues from the saved parent"
        );
        assert_eq!(restored.stats().unknown_parents, 0);
        assert_eq!(observable(&mut restored), observable(&mut straight));
    }
}

#[test]
fn an_empty_mapper_round_trips() {
    let m = mapper(Options::default());
    let mut r = roundtrip(&m, Options::default());
    assert_eq!(r.tracked_blocks(), 0);
    assert_eq!(observable(&mut r), (Vec::new(), Vec::new()));
}

#[test]
fn other_options_or_a_smaller_bound_refuse_the_bytes() {
    let mut m = mapper(options(KeyMode::Engine));
    run(&mut m, vec![stored(&[1, 2, 3], None, tokens(0..48), 16)]);
    let mut bytes = Vec::new();
    m.save(&mut bytes);
    let err = |o: Options| Mapper::restore(identity(), o, &bytes).expect_err("refused");
    assert_eq!(
        err(options(KeyMode::Fingerprint)),
        RestoreError::Options("key mode")
    );
    assert_eq!(
        err(Options {
            engine_has_offload_tier: true,
            ..Options::default()
        }),
        RestoreError::Options("offload tier")
    );
    assert_eq!(
        err(Options {
            max_tracked_blocks: 2,
            ..Options::default()
        }),
        RestoreError::TooMany { saved: 3, max: 2 }
    );
    let mut other_version = bytes.clone();
    other_version[5] = 9;
    assert!(matches!(
        Mapper::restore(identity(), Options::default(), &other_version),
        Err(RestoreError::Version(9))
    ));
}

#[test]
fn truncated_or_damaged_bytes_are_an_error_never_a_panic() {
    let mut m = mapper(options(KeyMode::Fingerprint));
    run(
        &mut m,
        vec![
            stored(&[1, 2, 3], None, tokens(0..48), 16),
            stored(&[4], Some(3), tokens(48..64), 16),
        ],
    );
    let mut bytes = Vec::new();
    m.save(&mut bytes);
    for len in 0..bytes.len() {
        assert!(
            Mapper::restore(identity(), options(KeyMode::Fingerprint), &bytes[..len]).is_err(),
            "a prefix of {len} bytes was accepted"
        );
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(Mapper::restore(identity(), options(KeyMode::Fingerprint), &longer).is_err());
    // Every single-byte change either fails or restores something (it must not panic).
    for i in 0..bytes.len() {
        for delta in [1u8, 0x80, 0xff] {
            let mut damaged = bytes.clone();
            damaged[i] = damaged[i].wrapping_add(delta);
            let _ = Mapper::restore(identity(), options(KeyMode::Fingerprint), &damaged);
        }
    }
}
