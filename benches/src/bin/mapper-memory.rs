//! Memory per tracked block in the mapper: feeds N stored blocks (block size 16, token ids
//! present, chained 8 to an event) to one `Mapper` and prints the growth of the resident set
//! per block, its peak while the map grew (`VmHWM`), and what the map itself says it holds, in
//! both key modes and for 32-byte digests.
//!
//! `cargo run --release -p kvevent-benches --bin mapper-memory [-- N]` (default 917,504, the
//! default `--max-tracked-blocks`).

use kvevent_mapper::{Identity, KeyMode, Mapper, Options};
use kvevent_wire as wire;

fn status_bytes(field: &str) -> u64 {
    (kvevent_benches::procfs::status_kb("/proc/self/status", field) * 1024.0) as u64
}

fn rss_bytes() -> u64 {
    status_bytes("VmRSS:")
}

fn hash(i: u64, digest: bool) -> wire::BlockHash<'static> {
    if digest {
        let mut d = [0u8; 32];
        d[..8].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes());
        d[24..].copy_from_slice(&i.to_be_bytes());
        wire::BlockHash::Bytes(d.to_vec().into())
    } else {
        wire::BlockHash::Int(wire::Int::U64(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
    }
}

/// Per block: resident-set growth, peak resident-set growth (while the map grew), and the
/// map's own count.
fn measure(n: u64, mode: KeyMode, digest: bool) -> (f64, f64, f64) {
    let identity = Identity::new("r", "m", "", "vllm").expect("identity");
    let options = Options {
        key_mode: mode,
        max_tracked_blocks: n as usize,
        ..Options::default()
    };
    let before = rss_bytes();
    let mut mapper = Mapper::new(identity, options);
    let mut out = Vec::new();
    let per_event = 8u64;
    let mut i = 0;
    while i < n {
        let k = per_event.min(n - i);
        let event = wire::Event::BlockStored(wire::BlockStored {
            block_hashes: (i..i + k).map(|j| hash(j, digest)).collect(),
            parent_block_hash: (i % 64 != 0).then(|| hash(i - 1, digest)),
            token_ids: wire::TokenIds::from((0..k as u32 * 16).collect::<Vec<u32>>()),
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        });
        let batch = wire::EventBatch::new(1.0, vec![event]);
        mapper.map_batch(&batch, &mut out);
        out.clear();
        i += k;
    }
    let grown = rss_bytes().saturating_sub(before);
    let peak = status_bytes("VmHWM:").saturating_sub(before);
    assert_eq!(mapper.tracked_blocks() as u64, n);
    (
        grown as f64 / n as f64,
        peak as f64 / n as f64,
        mapper.tracked_bytes() as f64 / n as f64,
    )
}

const USAGE: &str = "usage: mapper-memory [N]   (default 917504, the default --max-tracked-blocks)
Memory per tracked block in the mapper, N blocks, both key modes, int and 32-byte hashes (each
measured in a process of its own: mapper-memory N engine|fingerprint int|bin32).";

fn main() -> anyhow::Result<()> {
    let mut args = kvevent_benches::Cli::new(USAGE);
    let n: u64 = args.positional("N", kvevent_mapper::DEFAULT_MAX_TRACKED_BLOCKS as u64)?;
    // One configuration per process, so no run reuses memory another one freed.
    if let Some(mode) = args.arg() {
        let mode = match mode.as_str() {
            "engine" => KeyMode::Engine,
            "fingerprint" => KeyMode::Fingerprint,
            other => return Err(args.error(&format!("`{other}` is not a key mode"))),
        };
        let bin32 = match args.arg().as_deref() {
            Some("int") => false,
            Some("bin32") => true,
            _ => return Err(args.error("a key mode is followed by int or bin32")),
        };
        args.done()?;
        let (rss, peak, own) = measure(n, mode, bin32);
        println!("{rss:.1} {peak:.1} {own:.1}");
        return Ok(());
    }
    let exe = std::env::current_exe().expect("own path");
    println!("tracked blocks: {n}");
    println!(
        "| hashes | key mode | RSS growth per block | peak RSS growth per block | map's own count per block |"
    );
    println!("|---|---|---|---|---|");
    for (hashes, label) in [("int", "int (u64)"), ("bin32", "32-byte bin")] {
        for mode in ["engine", "fingerprint"] {
            let out = std::process::Command::new(&exe)
                .args([&n.to_string(), mode, hashes])
                .output()
                .expect("run a measurement");
            let text = String::from_utf8_lossy(&out.stdout);
            let mut f = text.split_whitespace();
            let mut next = || f.next().unwrap_or("?");
            let (rss, peak, own) = (next(), next(), next());
            println!("| {label} | {mode} | {rss} B | {peak} B | {own} B |");
        }
    }
    Ok(())
}
