//! Every shared vector maps as the contract says, checked against the vector's JSON.

use kvevent_mapper::{Options, parse_lora_adapters};
use kvevent_proto as pb;
use kvevent_wire as wire;
use serde_json::Value;

fn key_of(h: &Value) -> Vec<u8> {
    match h {
        Value::String(hex) => (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect(),
        _ => match h.as_u64() {
            Some(u) => u.to_be_bytes().to_vec(),
            None => h.as_i64().expect("int hash").to_be_bytes().to_vec(),
        },
    }
}

fn tier_of(medium: &Value) -> i32 {
    match medium.as_str().map(str::to_ascii_uppercase).as_deref() {
        None | Some("GPU") => pb::CacheTier::T1 as i32,
        Some(_) => pb::CacheTier::T2 as i32,
    }
}

#[test]
fn every_vector_maps_as_the_contract_says() {
    let mut count = 0;
    for (path, payload) in crate::vector_payloads() {
        let label = path.display().to_string();
        let json: Value =
            serde_json::from_slice(&std::fs::read(path.with_extension("json")).expect("json"))
                .expect("parse");
        let batch = wire::decode(&payload).expect("decode");
        let options = Options {
            lora_adapters: parse_lora_adapters("7=sql-lora").expect("map"),
            ..Options::default()
        };
        let mut m = crate::mapper(options);
        let mut out = Vec::new();
        m.map_batch(&batch, &mut out);

        // What the contract says, computed from the JSON alone (no parent chaining here:
        // each vector is mapped by a fresh mapper, so a known parent must be in the batch).
        let mut want_entries = Vec::new();
        let mut want_events = Vec::new();
        let mut known = std::collections::HashMap::new();
        // Hybrid models: groups that are not full attention are not reported.
        let mut skipped_groups = std::collections::HashSet::new();
        let ts_us = (json["ts"].as_f64().expect("ts") * 1e6) as i64;
        for e in json["events"].as_array().expect("events") {
            match e["type"].as_str().expect("type") {
                "BlockStored" => {
                    let bs = e["block_size"].as_i64().expect("bs") as i32;
                    if bs == 0 {
                        continue;
                    }
                    if !kvevent_mapper::is_prefix_group(e["kv_cache_spec_kind"].as_str()) {
                        if let Some(g) = e["group_idx"].as_i64() {
                            skipped_groups.insert(g);
                        }
                        continue;
                    }
                    let adapter = match (&e["lora_name"], &e["lora_id"]) {
                        (Value::String(n), _) => n.clone(),
                        (_, Value::Number(id)) if id.as_i64() == Some(7) => "sql-lora".into(),
                        (_, Value::Number(_)) => continue,
                        _ => String::new(),
                    };
                    let base = e["parent_block_hash"].as_null().map_or_else(
                        || {
                            known
                                .get(&key_of(&e["parent_block_hash"]))
                                .copied()
                                .unwrap_or(0)
                        },
                        |_| 0,
                    );
                    for (i, h) in e["block_hashes"]
                        .as_array()
                        .expect("hashes")
                        .iter()
                        .enumerate()
                    {
                        let count = base + (i as i32 + 1) * bs;
                        known.insert(key_of(h), count);
                        want_entries.push((
                            key_of(h),
                            count,
                            tier_of(&e["medium"]),
                            adapter.clone(),
                        ));
                    }
                }
                "BlockRemoved" => {
                    if e["group_idx"]
                        .as_i64()
                        .is_some_and(|g| skipped_groups.contains(&g))
                    {
                        continue;
                    }
                    for h in e["block_hashes"].as_array().expect("hashes") {
                        want_events.push((pb::cache_event::Type::PrefixEvicted as i32, key_of(h)));
                    }
                }
                _ => {
                    known.clear();
                    want_events.push((pb::cache_event::Type::AllCleared as i32, Vec::new()));
                }
            }
        }
        assert_eq!(crate::entries(&out), want_entries, "{label}");
        let got_events: Vec<_> = crate::events(&out)
            .into_iter()
            .map(|(t, k, _)| (t, k))
            .collect();
        assert_eq!(got_events, want_events, "{label}");
        for r in &out {
            let (replica, scheme, ts) = match r {
                pb::Report::Update(u) | pb::Report::New(u) => {
                    (&u.replica_id, &u.hash_scheme, u.timestamp_us)
                }
                pb::Report::Event(e) => (&e.replica_id, &String::from("vllm"), e.timestamp_us),
            };
            assert_eq!(
                (replica.as_str(), scheme.as_str(), ts),
                ("replica-1", "vllm", ts_us),
                "{label}"
            );
        }
        println!(
            "ok {label}: {} prefixes, {} events",
            want_entries.len(),
            want_events.len()
        );
        count += 1;
    }
    assert!(count >= 70);
}
