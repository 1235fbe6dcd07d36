//! Every shared vector decodes to its JSON and re-encodes byte for byte.

use kvevent_wire::{Release, decode, encode, json};

/// One engine's wire, as the vectors check it.
struct Wire {
    prefix: &'static str,
    decode: fn(&[u8]) -> kvevent_wire::Result<kvevent_wire::EventBatch<'_>>,
    to_json: fn(&kvevent_wire::EventBatch<'_>) -> serde_json::Value,
    encode: fn(&kvevent_wire::EventBatch<'_>, &str) -> Result<Vec<u8>, String>,
}

/// Every vector of `wire` decodes to its JSON and re-encodes byte for byte, from the payload
/// and from the JSON.
fn every_vector_round_trips(wire: &Wire) {
    let mut failures = Vec::new();
    let cases = crate::vectors_of(wire.prefix);
    assert!(!cases.is_empty(), "no {} vectors in testdata", wire.prefix);
    for (release, case, payload, expected) in &cases {
        let label = format!("{}{release}/{case}", wire.prefix);
        let outcome = (|| -> Result<(), String> {
            let batch = (wire.decode)(payload).map_err(|e| format!("decode: {e}"))?;
            let got = (wire.to_json)(&batch);
            if &got != expected {
                return Err(format!("json differs:\n got {got}\nwant {expected}"));
            }
            let bytes = (wire.encode)(&batch, release).map_err(|e| format!("encode: {e}"))?;
            if &bytes != payload {
                return Err(format!(
                    "re-encoding differs: {} bytes vs {}",
                    bytes.len(),
                    payload.len()
                ));
            }
            // The JSON side goes back to the same bytes too.
            let from_json = json::from_json(expected).map_err(|e| format!("from_json: {e}"))?;
            let bytes =
                (wire.encode)(&from_json, release).map_err(|e| format!("encode json: {e}"))?;
            if &bytes != payload {
                return Err("encoding the JSON differs from the payload".into());
            }
            Ok(())
        })();
        match outcome {
            Ok(()) => println!("ok   {label}"),
            Err(why) => {
                println!("FAIL {label}: {why}");
                failures.push(label);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} failed: {failures:?}",
        failures.len(),
        cases.len()
    );
}

#[test]
fn every_vector_decodes_to_its_json_and_reencodes_exactly() {
    every_vector_round_trips(&Wire {
        prefix: "vllm-",
        decode,
        to_json: json::to_json,
        encode: |batch, release| {
            let rel: Release = release.parse().map_err(|e| format!("{e}"))?;
            encode(batch, rel).map_err(|e| e.to_string())
        },
    });
}

#[test]
fn a_newer_release_encodes_like_the_newest_known() {
    for (release, case, payload, _) in crate::vectors() {
        if release != "0.33.0" {
            continue;
        }
        let batch = decode(&payload).expect("decode");
        let bytes = encode(&batch, "0.40.1".parse().expect("release")).expect(&case);
        assert_eq!(bytes, payload, "{case}");
    }
}

#[test]
fn every_release_between_vectors_encodes_and_decodes_back() {
    // Take the newest vector of each case, drop what an older release lacks, and check that
    // the result decodes back to the same batch for every release in between.
    let newest: Vec<_> = crate::vectors()
        .into_iter()
        .filter(|v| v.0 == "0.33.0")
        .collect();
    for minor in 9..=34 {
        for patch in [0, 1, 2] {
            let rel = Release {
                major: 0,
                minor,
                patch,
            };
            for (_, case, payload, _) in &newest {
                let mut batch = decode(payload).expect("decode");
                batch.retain_fields_of(rel);
                let bytes = encode(&batch, rel).unwrap_or_else(|e| panic!("{rel} {case}: {e}"));
                let back = decode(&bytes).unwrap_or_else(|e| panic!("{rel} {case}: {e}"));
                assert_eq!(back, batch, "{rel} {case}");
                assert_eq!(
                    back.data_parallel_rank.is_some(),
                    rel.has_dp_rank() && batch.data_parallel_rank.is_some()
                );
            }
        }
    }
}

#[test]
fn encoding_a_field_the_release_lacks_is_an_error() {
    let payload =
        std::fs::read(crate::shared_dir().join("vectors/vllm-0.33.0/newest_fields.msgpack"))
            .expect("read");
    let batch = decode(&payload).expect("decode");
    let err = encode(&batch, "0.24.0".parse().expect("release")).expect_err("locality");
    assert_eq!(err.to_string(), "vLLM 0.24.0 has no field `locality`");
}

#[test]
fn json_timestamps_are_read_to_the_exact_float() {
    // Each of these is read 1 ulp off by serde_json's default (not correctly rounded) parser.
    for ts in [
        "1711006055.9184287",
        "1700099488.8444285",
        "1710280103.1124287",
        "1710642516.6375713",
    ] {
        let text = format!(r#"{{"ts": {ts}, "events": [], "data_parallel_rank": null}}"#);
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        let batch = kvevent_wire::json::from_json(&json).expect("batch");
        let want: f64 = ts.parse().expect("std parses correctly rounded");
        assert_eq!(batch.ts.to_bits(), want.to_bits(), "{ts}");
    }
}

/// Every file under `dir`, relative to it, sorted.
fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read dir").flatten() {
            let p = entry.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(rel) = p.strip_prefix(dir) {
                out.push(rel.to_path_buf());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn testdata_equals_the_shared_copy() {
    // Only the shared data beside this checkout, never one found further up.
    let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared");
    if !shared.join("vectors").is_dir() {
        eprintln!("no ../shared beside the checkout: testdata is all there is");
        return;
    }
    let testdata = crate::shared_dir();
    for (here, there) in [
        ("vectors", "vectors"),
        ("fixtures/metrics", "fixtures/metrics"),
        ("fingerprint", "fingerprint"),
    ] {
        let (a, b) = (testdata.join(here), shared.join(there));
        assert_eq!(files_under(&a), files_under(&b), "{here}: the same files");
        for f in files_under(&a) {
            assert!(
                std::fs::read(a.join(&f)).expect("ours")
                    == std::fs::read(b.join(&f)).expect("theirs"),
                "testdata/{here}/{} differs from shared/{there}: refresh it (testdata/README.md)",
                f.display()
            );
        }
    }
}

#[test]
fn token_ids_extend_into_appends_what_iter_yields() {
    let mut checked = 0;
    for (release, case, payload, _) in crate::vectors() {
        let batch = decode(&payload).expect("decode");
        for event in &batch.events {
            let kvevent_wire::Event::BlockStored(s) = event else {
                continue;
            };
            let want: Vec<u32> = [7].into_iter().chain(s.token_ids.iter()).collect();
            // From the wire, and owned.
            for ids in [s.token_ids.clone(), s.token_ids.to_vec().into()] {
                let mut got = vec![7];
                ids.extend_into(&mut got);
                assert_eq!(got, want, "vllm-{release}/{case}");
            }
            checked += s.token_ids.len();
        }
    }
    assert!(checked > 1000, "only {checked} token ids in the vectors");
}

#[test]
fn every_sglang_vector_decodes_to_its_json_and_reencodes_exactly() {
    use kvevent_wire::{Engine, Limits, SglangRelease, decode_engine, encode_sglang};
    assert!(
        crate::vectors_of("sglang-").len() >= 100,
        "the SGLang vectors are in testdata"
    );
    every_vector_round_trips(&Wire {
        prefix: "sglang-",
        decode: |p| decode_engine(p, Engine::Sglang, &Limits::DEFAULT),
        to_json: |b| json::to_json_engine(b, Engine::Sglang),
        encode: |batch, release| {
            let rel: SglangRelease = release.parse().map_err(|e| format!("{e}"))?;
            encode_sglang(batch, rel).map_err(|e| e.to_string())
        },
    });
}
