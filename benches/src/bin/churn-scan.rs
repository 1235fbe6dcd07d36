//! The index's key tables under an engine's steady churn, across sizes: N blocks resident,
//! then 10 × N stored, each evicting the oldest; prints the table bytes before and after.
//! (Found that hashbrown's tables doubled at many sizes; see `kvevent-table`.)
//!
//! `cargo run --release -p kvevent-benches --bin churn-scan`

use kvevent_index::{Config, Index, KeyMode};
use kvevent_wire as wire;

fn hash(x: u64) -> wire::BlockHash<'static> {
    wire::BlockHash::Int(wire::Int::U64(x))
}

fn stored(hashes: &[u64]) -> wire::Event<'static> {
    wire::Event::BlockStored(wire::BlockStored {
        block_hashes: hashes.iter().copied().map(hash).collect(),
        token_ids: wire::TokenIds::from(vec![0u32; hashes.len() * 4]),
        block_size: 4,
        medium: Some(wire::Medium("GPU".into())),
        ..Default::default()
    })
}

fn removed(x: u64) -> wire::Event<'static> {
    wire::Event::BlockRemoved(wire::BlockRemoved {
        block_hashes: vec![hash(x)],
        medium: Some(wire::Medium("GPU".into())),
        ..Default::default()
    })
}

fn batch(events: Vec<wire::Event<'static>>) -> wire::EventBatch<'static> {
    wire::EventBatch::new(1.0, events)
}

const USAGE: &str = "usage: churn-scan
The index's key tables under steady churn, across sizes: table bytes before and after.";

fn main() -> anyhow::Result<()> {
    kvevent_benches::Cli::new(USAGE).done()?;
    println!("| resident blocks | table bytes after the fill | after 10x churn |");
    println!("|---|---|---|");
    for n in (8_000u64..60_000).step_by(4_000) {
        let mut config = Config::default();
        config.mapping.key_mode = KeyMode::Engine;
        let index = Index::new(config);
        let a = index.add_source("a")?;
        index.apply(a, &batch(vec![stored(&(0..n).collect::<Vec<_>>())]));
        let before = index.stats().table_bytes;
        for x in n..n * 11 {
            index.apply(a, &batch(vec![stored(&[x]), removed(x - n)]));
        }
        let after = index.stats().table_bytes;
        println!(
            "| {n} | {before} | {after} ({:+.1} %) |",
            100.0 * (after as f64 / before as f64 - 1.0)
        );
    }
    Ok(())
}
