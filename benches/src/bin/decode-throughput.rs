//! Decodes every shared vector repeatedly for a fixed time and prints one JSON line with the
//! throughput. `benches/msgspec_compare.py` runs it beside msgspec and prints the ratio.
//!
//! Usage: `decode-throughput [SECONDS] [--read-tokens] [--engine sglang] [--large]`
//! (`--engine sglang`: SGLang's vectors, read as its wire; `--large`: the `large` cases only).

use std::time::{Duration, Instant};

use kvevent_wire as wire;

const USAGE: &str =
    "usage: decode-throughput [SECONDS] [--read-tokens] [--engine vllm|sglang] [--large]
Decodes every vector for SECONDS (default 2) and prints one JSON line with the throughput
(--engine sglang: SGLang's vectors; --large: the `large` cases only).";

fn main() -> anyhow::Result<()> {
    let mut seconds = 2.0f64;
    let mut read_tokens = false;
    let mut engine = wire::Engine::Vllm;
    let mut large = false;
    let mut args = kvevent_benches::Cli::new(USAGE);
    while let Some(arg) = args.arg() {
        match arg.as_str() {
            "--read-tokens" => read_tokens = true,
            "--large" => large = true,
            "--engine" => engine = args.value("--engine")?,
            _ => seconds = args.parse("SECONDS", &arg)?,
        }
    }
    let mut vectors = kvevent_benches::vector_payloads_of(&format!("{engine}-"))?;
    if large {
        vectors.retain(|(name, _)| name.ends_with("/large"));
    }
    let blocks_per_round: usize = vectors
        .iter()
        .map(|(_, p)| {
            wire::decode_engine(p, engine, &wire::Limits::DEFAULT).map_or(0, |b| {
                b.events
                    .iter()
                    .map(|e| match e {
                        wire::Event::BlockStored(s) => s.block_hashes.len(),
                        wire::Event::BlockRemoved(r) => r.block_hashes.len(),
                        wire::Event::AllBlocksCleared(_) => 0,
                    })
                    .sum()
            })
        })
        .sum();
    let bytes_per_round: usize = vectors.iter().map(|(_, p)| p.len()).sum();
    let mut rounds = 0u64;
    let mut events = 0u64;
    let mut sink = 0u64;
    let budget = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    while start.elapsed() < budget {
        for (_, payload) in &vectors {
            let batch = wire::decode_engine(
                std::hint::black_box(payload),
                engine,
                &wire::Limits::DEFAULT,
            )?;
            events += batch.events.len() as u64;
            if read_tokens {
                for e in &batch.events {
                    if let wire::Event::BlockStored(s) = e {
                        sink = sink.wrapping_add(s.token_ids.iter().map(u64::from).sum::<u64>());
                    }
                }
            }
        }
        rounds += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"impl\":\"kvevent-wire{}\",\"engine\":\"{engine}\",\"files\":{},\"rounds\":{rounds},\"mb_per_s\":{:.1},\"events_per_s\":{:.0},\"blocks_per_s\":{:.0},\"sink\":{sink}}}",
        if read_tokens { "+tokens" } else { "" },
        vectors.len(),
        (bytes_per_round as f64 * rounds as f64) / secs / 1e6,
        events as f64 / secs,
        (blocks_per_round as f64 * rounds as f64) / secs,
    );
    Ok(())
}
