//! Every golden case of `testdata/fingerprint/golden.json` (a copy of the shared one).

use std::path::PathBuf;

fn golden() -> serde_json::Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fingerprint/golden.json");
    serde_json::from_slice(&std::fs::read(path).expect("read")).expect("json")
}

#[test]
fn every_golden_case() {
    let golden = golden();
    let cases = golden["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("token") as u32)
            .collect();
        let block_size = case["block_size"].as_u64().expect("block_size") as usize;
        let parent = case["parent_prefix"]
            .as_str()
            .map(|p| p.parse::<u64>().expect("parent"));
        let got = kvevent_fingerprint::chain(&tokens, block_size, parent);
        let want = case["blocks"].as_array().expect("blocks");
        assert_eq!(got.len(), want.len(), "{name}");
        // The allocation-free form appends the same prefixes after what `out` holds.
        let mut out = vec![7];
        kvevent_fingerprint::prefixes_into(&tokens, block_size, parent, &mut out);
        let prefixes: Vec<u64> = std::iter::once(7)
            .chain(got.iter().map(|b| b.prefix))
            .collect();
        assert_eq!(out, prefixes, "{name}");
        for (g, w) in got.iter().zip(want) {
            assert_eq!(
                g.content.to_string(),
                w["content"].as_str().expect("c"),
                "{name}"
            );
            assert_eq!(
                g.prefix.to_string(),
                w["prefix"].as_str().expect("p"),
                "{name}"
            );
            let hex: String = kvevent_fingerprint::wire_key(g.prefix)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(hex, w["prefix_be_hex"].as_str().expect("hex"), "{name}");
        }
        println!("ok {name}");
    }
}

#[test]
fn long_blocks_hash_like_short_ones() {
    // Blocks over the stack buffer take the allocating path: same scheme.
    let tokens: Vec<u32> = (0..600).collect();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(
        kvevent_fingerprint::content(&tokens),
        xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 1337)
    );
    assert!(kvevent_fingerprint::chain(&tokens, 0, None).is_empty());
}
