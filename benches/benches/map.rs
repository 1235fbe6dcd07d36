//! Mapping cost per block (decode → reports → protobuf bytes), in both key modes, and
//! fingerprinting throughput in tokens per second.
#![allow(missing_docs, reason = "criterion_group! generates undocumented items")]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvevent_mapper::{Identity, KeyMode, Mapper, Options};
use kvevent_proto as pb;
use kvevent_wire as wire;
use prost::Message;

fn blocks_in(batch: &wire::EventBatch<'_>) -> u64 {
    batch
        .events
        .iter()
        .map(|e| match e {
            wire::Event::BlockStored(s) => s.block_hashes.len() as u64,
            wire::Event::BlockRemoved(r) => r.block_hashes.len() as u64,
            wire::Event::AllBlocksCleared(_) => 1,
        })
        .sum()
}

fn map(c: &mut Criterion) {
    let payload =
        std::fs::read(kvevent_benches::shared_dir().join("vectors/vllm-0.33.0/large.msgpack"))
            .expect("large vector");
    let batch = wire::decode(&payload).expect("decode");
    let identity = Identity::new("replica-1", "llama", "", "vllm").expect("identity");
    let mut group = c.benchmark_group("map");
    group.throughput(Throughput::Elements(blocks_in(&batch)));
    for (name, mode) in [
        ("engine_keys", KeyMode::Engine),
        ("fingerprint_keys", KeyMode::Fingerprint),
    ] {
        let options = Options {
            key_mode: mode,
            ..Options::default()
        };
        let mut mapper = Mapper::new(identity.clone(), options);
        let mut out = Vec::new();
        let mut bytes = Vec::new();
        group.bench_function(format!("decode_map_encode_per_block/{name}"), |b| {
            b.iter(|| {
                let batch = wire::decode(std::hint::black_box(&payload)).expect("decode");
                out.clear();
                mapper.map_batch(&batch, &mut out);
                bytes.clear();
                for report in &out {
                    match report {
                        pb::Report::Update(u) | pb::Report::New(u) => {
                            u.encode(&mut bytes).expect("encode")
                        }
                        pb::Report::Event(e) => e.encode(&mut bytes).expect("encode"),
                    }
                }
                bytes.len()
            })
        });
    }
    group.finish();

    let tokens: Vec<u32> = (0..16_384u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 152_064)
        .collect();
    let mut group = c.benchmark_group("fingerprint");
    group.throughput(Throughput::Elements(tokens.len() as u64));
    for block_size in [16usize, 64] {
        group.bench_function(format!("chain_tokens/block_size_{block_size}"), |b| {
            b.iter(|| {
                kvevent_fingerprint::chain(std::hint::black_box(&tokens), block_size, None).len()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, map);
criterion_main!(benches);
