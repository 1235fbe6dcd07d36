//! Decoding and encoding throughput over every shared vector.
#![allow(missing_docs, reason = "criterion_group! generates undocumented items")]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvevent_wire as wire;

fn decode_all(c: &mut Criterion) {
    let vectors = kvevent_benches::vector_payloads().expect("shared vectors");
    let total: usize = vectors.iter().map(|(_, p)| p.len()).sum();
    let mut group = c.benchmark_group("wire");
    group.throughput(Throughput::Bytes(total as u64));
    group.bench_function("decode_all_vectors", |b| {
        b.iter(|| {
            let mut events = 0;
            for (_, payload) in &vectors {
                events += wire::decode(std::hint::black_box(payload))
                    .expect("decode")
                    .events
                    .len();
            }
            events
        })
    });
    group.bench_function("decode_all_vectors_and_read_tokens", |b| {
        b.iter(|| {
            let mut sum = 0u64;
            for (_, payload) in &vectors {
                for e in wire::decode(std::hint::black_box(payload))
                    .expect("decode")
                    .events
                {
                    if let wire::Event::BlockStored(s) = e {
                        sum += s.token_ids.iter().map(u64::from).sum::<u64>();
                    }
                }
            }
            sum
        })
    });
    let decoded: Vec<_> = vectors
        .iter()
        .map(|(name, p)| {
            let release: wire::Release = name
                .split('/')
                .next()
                .and_then(|r| r.strip_prefix("vllm-"))
                .and_then(|r| r.parse().ok())
                .expect("release dir");
            (release, wire::decode(p).expect("decode"))
        })
        .collect();
    group.bench_function("encode_all_vectors", |b| {
        let mut out = Vec::with_capacity(total);
        b.iter(|| {
            out.clear();
            for (release, batch) in &decoded {
                wire::encode_into(batch, *release, &mut out).expect("encode");
            }
            out.len()
        })
    });
    group.finish();

    let large: Vec<_> = vectors
        .iter()
        .filter(|(n, _)| n.ends_with("/large"))
        .collect();
    let mut group = c.benchmark_group("wire_large");
    for (name, payload) in large {
        group.throughput(Throughput::Bytes(payload.len() as u64));
        group.bench_function(name.as_str(), |b| {
            b.iter(|| {
                wire::decode(std::hint::black_box(payload))
                    .expect("decode")
                    .events
                    .len()
            })
        });
    }
    // SGLang's large vectors beside vLLM's, read as SGLang's wire.
    let sglang = kvevent_benches::vector_payloads_of("sglang-").expect("sglang vectors");
    for (name, payload) in sglang.iter().filter(|(n, _)| n.ends_with("/large")) {
        group.throughput(Throughput::Bytes(payload.len() as u64));
        group.bench_function(name.as_str(), |b| {
            b.iter(|| {
                wire::decode_engine(
                    std::hint::black_box(payload),
                    wire::Engine::Sglang,
                    &wire::Limits::DEFAULT,
                )
                .expect("decode")
                .events
                .len()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decode_all);
criterion_main!(benches);
