//! Decodes every shared vector repeatedly for a fixed time and prints one JSON line with the
//! throughput. `benches/msgspec_compare.py` runs it beside msgspec and prints the ratio.
//!
//! Usage: `decode-throughput [SECONDS] [--read-tokens]`

use std::time::{Duration, Instant};

use kvevent_wire as wire;

fn main() -> anyhow::Result<()> {
    let mut seconds = 2.0f64;
    let mut read_tokens = false;
    for arg in std::env::args().skip(1) {
        if arg == "--read-tokens" {
            read_tokens = true;
        } else {
            seconds = arg.parse()?;
        }
    }
    let vectors = kvevent_benches::vector_payloads()?;
    let bytes_per_round: usize = vectors.iter().map(|(_, p)| p.len()).sum();
    let mut rounds = 0u64;
    let mut events = 0u64;
    let mut sink = 0u64;
    let budget = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    while start.elapsed() < budget {
        for (_, payload) in &vectors {
            let batch = wire::decode(std::hint::black_box(payload))?;
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
        "{{\"impl\":\"kvevent-wire{}\",\"files\":{},\"rounds\":{rounds},\"mb_per_s\":{:.1},\"events_per_s\":{:.0},\"sink\":{sink}}}",
        if read_tokens { "+tokens" } else { "" },
        vectors.len(),
        (bytes_per_round as f64 * rounds as f64) / secs / 1e6,
        events as f64 / secs,
    );
    Ok(())
}
