//! The prefix index at fleet scale (#48): bytes a (block, replica) pair, score latency steady
//! and with blocks evicted from the middle of chains, apply rates, load time. Through
//! `kvevent_index::Index`'s public API, keys as a sidecar's feed gives them (`apply_keys`).
//!
//! The workload: `--replicas R` (default 256) each hold a 4-block system prefix and two groups
//! of prompts of 8 blocks after it: replica r holds groups r and r + 1 (mod R), so neighbours
//! overlap by half and every prompt block has two holders. The groups' size follows from
//! `--pairs` (default 10 M; `--pairs 100M` is the fleet scale, 2–4 GB). A query is the system
//! prefix and one prompt: it matches all R replicas on its first 4 blocks and two on all 12.
//!
//! Printed: bytes a pair by RSS (the process's growth while the index loads: the workload's
//! keys are computed, never stored) and by `IndexStats::bytes`; load time and rate; score
//! median / p99 / p99.9 over `--queries` (default 200,000), steady, then with 2 % of the
//! resident pairs evicted from the middle of their chains (blocks 1–6 of a prompt); the churn
//! apply rate (a replica evicting a prompt and storing it again, in batches of 512 changes).
//! Before anything is timed it waits (up to `--quiet-wait` seconds, default 120) for the
//! machine to be quiet, and says whether it was.
//!
//! `cargo run --release -p kvevent-benches --bin index-scale [-- --pairs 100M --replicas 256
//! --queries N --quiet-wait S]`

use std::time::{Duration, Instant};

use kvevent_benches::random::mix;
use kvevent_index::{Config, Index, KeyChange, Query, QueryKeys, SourceId, Tier};

const USAGE: &str =
    "usage: index-scale [--pairs N[M]] [--replicas R] [--queries Q] [--quiet-wait S]";
const SYSTEM: u32 = 4;
const PROMPT: u32 = 8;
const BLOCK: u32 = 16;
const BATCH: usize = 512;

struct Workload {
    replicas: u32,
    /// Prompts in a group.
    prompts: u32,
}

impl Workload {
    fn system_key(b: u32) -> u64 {
        mix(0xFFFF_0000_0000 | u64::from(b))
    }

    fn prompt_key(group: u32, prompt: u32, b: u32) -> u64 {
        mix((u64::from(group) << 40) | (u64::from(prompt) << 8) | u64::from(b))
    }

    /// The groups replica `r` holds.
    fn groups(&self, r: u32) -> [u32; 2] {
        [r, (r + 1) % self.replicas]
    }

    fn stored(key: u64, tokens: u32) -> KeyChange<'static> {
        KeyChange::Stored {
            key,
            tokens,
            tier: Tier::T1,
            adapter: "",
        }
    }

    /// Everything replica `r` holds, in batches.
    fn load(&self, index: &Index, source: SourceId, r: u32) {
        let mut batch = Vec::with_capacity(BATCH);
        for b in 0..SYSTEM {
            batch.push(Self::stored(Self::system_key(b), (b + 1) * BLOCK));
        }
        for g in self.groups(r) {
            for p in 0..self.prompts {
                for b in 0..PROMPT {
                    batch.push(Self::stored(
                        Self::prompt_key(g, p, b),
                        (SYSTEM + b + 1) * BLOCK,
                    ));
                }
                if batch.len() >= BATCH {
                    index.apply_keys(source, &batch);
                    batch.clear();
                }
            }
        }
        index.apply_keys(source, &batch);
    }

    fn query(&self, group: u32, prompt: u32, out: &mut Vec<u64>) {
        out.clear();
        out.extend((0..SYSTEM).map(Self::system_key));
        out.extend((0..PROMPT).map(|b| Self::prompt_key(group, prompt, b)));
    }
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = mix(self.0);
        self.0 % n.max(1)
    }
}

fn rss_bytes() -> f64 {
    kvevent_benches::procfs::status_kb("/proc/self/status", "VmRSS:") * 1024.0
}

/// Cores busy over one second, from `/proc/stat` (this process idle meanwhile).
fn busy_cores() -> f64 {
    let read = || -> (f64, f64) {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let cpu: Vec<f64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        let idle = cpu.get(3).copied().unwrap_or(0.0) + cpu.get(4).copied().unwrap_or(0.0);
        (cpu.iter().sum(), idle)
    };
    let (t0, i0) = read();
    std::thread::sleep(Duration::from_secs(1));
    let (t1, i1) = read();
    let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    if t1 <= t0 {
        return 0.0;
    }
    (1.0 - (i1 - i0) / (t1 - t0)) * cores
}

/// Waits up to `wait` for fewer than 0.2 cores busy; says what it found.
fn wait_quiet(wait: Duration) -> String {
    let deadline = Instant::now() + wait;
    loop {
        let busy = busy_cores();
        if busy < 0.2 {
            return format!("quiet ({busy:.2} cores busy)");
        }
        if Instant::now() >= deadline {
            return format!("NOT QUIET ({busy:.2} cores busy after waiting {wait:?})");
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Times `n` queries of random prompts, each alone; (median, p99, p99.9) in µs.
fn score(index: &Index, w: &Workload, n: usize, seed: u64) -> (f64, f64, f64) {
    let mut rng = Rng(seed);
    let mut keys = Vec::new();
    let mut times = Vec::with_capacity(n);
    let mut matched = 0usize;
    for _ in 0..n {
        let g = rng.below(u64::from(w.replicas)) as u32;
        let p = rng.below(u64::from(w.prompts)) as u32;
        w.query(g, p, &mut keys);
        let query = Query {
            adapter: "",
            keys: QueryKeys::Keys(&keys),
        };
        let t = Instant::now();
        let scores = index.score(&query);
        times.push(t.elapsed().as_nanos() as f64 / 1000.0);
        matched += scores.len();
    }
    assert!(
        matched >= n * w.replicas as usize,
        "every query matches every replica on the system prefix"
    );
    times.sort_by(f64::total_cmp);
    (
        percentile(&times, 0.5),
        percentile(&times, 0.99),
        percentile(&times, 0.999),
    )
}

fn parse_count(cli: &kvevent_benches::Cli, v: &str) -> anyhow::Result<u64> {
    let (digits, scale) = match v.strip_suffix(['M', 'm']) {
        Some(d) => (d, 1_000_000.0),
        None => (v, 1.0),
    };
    let n: f64 = cli.parse("count", digits)?;
    Ok((n * scale) as u64)
}

fn main() -> anyhow::Result<()> {
    let mut cli = kvevent_benches::Cli::new(USAGE);
    let (mut pairs, mut replicas, mut queries, mut quiet) = (10_000_000u64, 256u32, 200_000, 120);
    while let Some(flag) = cli.arg() {
        match flag.as_str() {
            "--pairs" => {
                let v: String = cli.value("--pairs")?;
                pairs = parse_count(&cli, &v)?;
            }
            "--replicas" => replicas = cli.value("--replicas")?,
            "--queries" => queries = cli.value("--queries")?,
            "--quiet-wait" => quiet = cli.value("--quiet-wait")?,
            other => return Err(cli.error(&format!("unexpected argument `{other}`"))),
        }
    }
    cli.done()?;
    anyhow::ensure!(replicas >= 2, "--replicas must be 2 or more");
    let per_replica = pairs / u64::from(replicas);
    let prompts = (per_replica.saturating_sub(u64::from(SYSTEM)) / u64::from(2 * PROMPT)).max(1);
    let w = Workload {
        replicas,
        prompts: prompts as u32,
    };
    let pairs = u64::from(replicas) * (u64::from(SYSTEM) + 2 * prompts * u64::from(PROMPT));
    let keys = u64::from(SYSTEM) + u64::from(replicas) * prompts * u64::from(PROMPT);
    println!(
        "index-scale: {replicas} replicas, {pairs} pairs, {keys} keys ({} prompts a group)",
        w.prompts
    );

    let index = Index::new(Config {
        byte_budget: usize::MAX,
        ..Config::default()
    });
    let sources: Vec<SourceId> = (0..replicas)
        .map(|r| index.add_source(&format!("replica-{r:04}")))
        .collect::<Result<_, _>>()?;
    println!("load: {}", wait_quiet(Duration::from_secs(quiet)));
    let rss0 = rss_bytes();
    let t = Instant::now();
    for (r, source) in sources.iter().enumerate() {
        w.load(&index, *source, r as u32);
    }
    let load = t.elapsed();
    let rss = rss_bytes() - rss0;
    let stats = index.stats();
    anyhow::ensure!(
        stats.pairs as u64 == pairs && stats.keys as u64 == keys,
        "the index holds {} pairs of {} keys, not {pairs} of {keys}",
        stats.pairs,
        stats.keys
    );
    println!(
        "  {:.1} s, {:.2} M pairs/s; bytes a pair: {:.1} RSS, {:.1} IndexStats ({:.0} MB RSS)",
        load.as_secs_f64(),
        pairs as f64 / load.as_secs_f64() / 1e6,
        rss / pairs as f64,
        stats.bytes as f64 / pairs as f64,
        rss / 1e6
    );

    println!("score: {}", wait_quiet(Duration::from_secs(quiet)));
    let (p50, p99, p999) = score(&index, &w, queries, 1);
    println!("  steady: median {p50:.2} µs, p99 {p99:.2} µs, p99.9 {p999:.2} µs");

    // 2 % of the pairs evicted from the middle of their chains.
    let mut rng = Rng(2);
    let evict = pairs / 50;
    let mut batch = Vec::with_capacity(BATCH);
    let mut by_source: Vec<Vec<u64>> = vec![Vec::new(); replicas as usize];
    for _ in 0..evict {
        let r = rng.below(u64::from(replicas)) as u32;
        let g = w.groups(r)[rng.below(2) as usize];
        let p = rng.below(u64::from(w.prompts)) as u32;
        let b = 1 + rng.below(u64::from(PROMPT - 2)) as u32;
        by_source[r as usize].push(Workload::prompt_key(g, p, b));
    }
    for (r, keys) in by_source.iter().enumerate() {
        for chunk in keys.chunks(BATCH) {
            batch.clear();
            batch.extend(
                chunk
                    .iter()
                    .map(|&key| KeyChange::Evicted { key, adapter: "" }),
            );
            index.apply_keys(sources[r], &batch);
        }
    }
    println!(
        "score, 2 % evicted mid-chain: {}",
        wait_quiet(Duration::from_secs(quiet))
    );
    let (e50, e99, e999) = score(&index, &w, queries, 3);
    println!(
        "  median {e50:.2} µs, p99 {e99:.2} µs ({:.2}x steady), p99.9 {e999:.2} µs",
        e99 / p99
    );

    // Churn: a replica evicts one of its prompts and stores it again.
    println!("churn apply: {}", wait_quiet(Duration::from_secs(quiet)));
    let rounds = (pairs / 10).clamp(1_000_000, 10_000_000) / u64::from(2 * PROMPT);
    let mut rng = Rng(4);
    let mut events = 0u64;
    let t = Instant::now();
    for _ in 0..rounds / 32 {
        let r = rng.below(u64::from(replicas)) as u32;
        batch.clear();
        for _ in 0..32 {
            let g = w.groups(r)[rng.below(2) as usize];
            let p = rng.below(u64::from(w.prompts)) as u32;
            for b in 0..PROMPT {
                batch.push(KeyChange::Evicted {
                    key: Workload::prompt_key(g, p, b),
                    adapter: "",
                });
            }
            for b in 0..PROMPT {
                batch.push(Workload::stored(
                    Workload::prompt_key(g, p, b),
                    (SYSTEM + b + 1) * BLOCK,
                ));
            }
        }
        events += batch.len() as u64;
        index.apply_keys(sources[r as usize], &batch);
    }
    let churn = t.elapsed();
    println!(
        "  {:.2} M events/s ({events} events in {:.1} s)",
        events as f64 / churn.as_secs_f64() / 1e6,
        churn.as_secs_f64()
    );
    Ok(())
}
