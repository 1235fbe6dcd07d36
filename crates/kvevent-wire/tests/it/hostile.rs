//! Hostile input: truncations, byte flips, random bytes. Errors, never panics.

use kvevent_wire::{ErrorKind, Limits, decode, decode_with};
use proptest::prelude::*;

#[test]
fn every_strict_prefix_of_every_vector_is_an_error() {
    let mut checked = 0;
    for (release, case, payload, _) in crate::vectors() {
        for len in 0..payload.len() {
            let err = decode(&payload[..len]).expect_err(&format!("{release}/{case}[..{len}]"));
            assert!(
                err.offset() <= len,
                "{release}/{case}[..{len}]: offset {}",
                err.offset()
            );
            checked += 1;
        }
    }
    assert!(checked > 10_000);
}

#[test]
fn every_strict_prefix_of_every_sglang_vector_is_an_error() {
    use kvevent_wire::{Engine, Limits, decode_engine};
    let mut checked = 0;
    for (release, case, payload, _) in crate::vectors_of("sglang-") {
        for len in 0..payload.len() {
            let err = decode_engine(&payload[..len], Engine::Sglang, &Limits::DEFAULT)
                .expect_err(&format!("sglang-{release}/{case}[..{len}]"));
            assert!(err.offset() <= len, "sglang-{release}/{case}[..{len}]");
            checked += 1;
        }
    }
    assert!(checked > 10_000);
}

#[test]
fn sglang_pairs_and_salts_are_refused_as_vllm_and_vllm_decoding_is_unchanged() {
    use kvevent_wire::{Engine, Limits, decode_engine};
    // A payload with EAGLE pairs or a salt map is not vLLM's: read as vLLM, it is an error.
    for case in ["sglang-0.5.3/eagle", "sglang-0.5.18/cache_salt"] {
        let payload = std::fs::read(crate::shared_dir().join(format!("vectors/{case}.msgpack")))
            .expect("vector");
        assert!(decode(&payload).is_err(), "{case} as vLLM");
        assert!(
            decode_engine(&payload, Engine::Sglang, &Limits::DEFAULT).is_ok(),
            "{case} as SGLang"
        );
    }
    // Every vLLM vector decodes the same whichever entry point.
    for (release, case, payload, _) in crate::vectors() {
        assert_eq!(
            decode(&payload).expect("vllm"),
            decode_engine(&payload, Engine::Vllm, &Limits::DEFAULT).expect("vllm"),
            "{release}/{case}"
        );
    }
}

/// A tiny deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn fixed_seed_byte_flips_never_panic() {
    let mut rng = Rng(0x5eed_1337);
    let (mut ok, mut err) = (0, 0);
    for (_, _, payload, _) in crate::vectors() {
        for _ in 0..200 {
            let mut bytes = payload.clone();
            for _ in 0..=(rng.next() % 3) {
                let at = (rng.next() as usize) % bytes.len();
                bytes[at] = rng.next() as u8;
            }
            match decode(&bytes) {
                Ok(_) => ok += 1,
                Err(_) => err += 1,
            }
        }
    }
    assert!(ok > 0 && err > 0, "ok {ok}, err {err}");
}

#[test]
fn limits_are_enforced() {
    let payload =
        std::fs::read(crate::shared_dir().join("vectors/vllm-0.33.0/large.msgpack")).expect("read");
    let tight = Limits {
        max_events: 10,
        ..Limits::DEFAULT
    };
    let err = decode_with(&payload, &tight).expect_err("too many events");
    assert_eq!(
        err.kind(),
        &ErrorKind::LimitExceeded {
            what: "events per batch",
            limit: 10
        }
    );
    let tight = Limits {
        max_token_ids: 4,
        ..Limits::DEFAULT
    };
    assert!(matches!(
        decode_with(&payload, &tight)
            .expect_err("too many tokens")
            .kind(),
        ErrorKind::LimitExceeded {
            what: "token ids per event",
            ..
        }
    ));
}

#[test]
fn deep_nesting_is_bounded() {
    // [ts, [], rank, <1000 nested arrays>]: the extra element is skipped, within max_depth.
    let mut payload = vec![0x94, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0x00];
    payload.extend(std::iter::repeat_n(0x91, 1000));
    payload.push(0xc0);
    let err = decode(&payload).expect_err("too deep");
    assert!(matches!(
        err.kind(),
        ErrorKind::LimitExceeded {
            what: "nesting depth",
            ..
        }
    ));
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn random_msgpack_shaped_bytes_never_panic(
        tail in proptest::collection::vec(any::<u8>(), 0..256),
        head in prop::sample::select(vec![0x92u8, 0x93, 0x83, 0xdc, 0xde]),
    ) {
        let mut bytes = vec![head];
        bytes.extend(tail);
        let _ = decode(&bytes);
    }
}
