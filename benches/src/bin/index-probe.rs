//! The prefix index on a synthetic fleet trace: apply rate (one writer), score latency of
//! 1,024-token prompts (fingerprint chain included), bytes per resident (block, replica) pair,
//! and memory across a churn run.
//!
//! The trace, reproducible from a seed: 16 shared system prompts of 16 blocks (popularity
//! skewed); per replica, conversations that extend their own prefix by 2–8 blocks a turn; per
//! replica an LRU of `capacity` blocks evicting the least recently stored. Block size 16,
//! fingerprint keys (the index's default).
//!
//! `cargo run --release -p kvevent-benches --bin index-probe [-- REPLICAS... ]` (default 64 256
//! 1024), `--capacity N` blocks per replica (default 4,096), `--seed S`, `--queries Q` scored
//! (default 5,000), `--turn K` batches of a source applied in a row (default 1: one batch a
//! source, round-robin, so each source's block map is cold at every batch, the worst case; a
//! router reading whatever each socket holds applies several in a row when it is busy),
//! `--group N` batches a call of `Index::apply_many` (default 1).
//!
//! Run with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc 2.35 or later; transparent huge
//! pages set to `madvise` or `always`) to have the tables in huge pages: each row says how much
//! of the process was.
//!
//! Last, how this machine answers random loads over 4, 16 and 64 MB, alone and overlapped:
//! at fleet scale the tables are in memory, not in cache, and an apply is bounded by those
//! loads.

use std::collections::VecDeque;
use std::time::Instant;

use kvevent_benches::random::Rng;
use kvevent_index::{Config, Index, Query, QueryKeys};
use kvevent_wire as wire;

const BLOCK: usize = 16;

/// One replica's engine: conversations, an LRU of blocks, engine hashes.
struct Replica {
    /// System prompts resident now (their blocks are cached: a new conversation reuses them).
    resident_system: std::collections::HashSet<usize>,
    /// Conversations: their tokens so far and the engine hash of their last block.
    conversations: Vec<(Vec<u32>, Option<u64>)>,
    /// Stored blocks, least recent first (engine hashes).
    lru: VecDeque<u64>,
    next_hash: u64,
}

struct Trace {
    rng: Rng,
    system: Vec<Vec<u32>>,
    capacity: usize,
}

impl Trace {
    /// The events of one step of `r`: a turn of a conversation (new or continued), stores and
    /// the evictions the LRU makes.
    fn step(&mut self, r: &mut Replica, id: u64) -> Vec<wire::Event<'static>> {
        let mut events = Vec::new();
        let c = if r.conversations.len() < 8 || self.rng.below(4) == 0 {
            // A new conversation on a system prompt (skewed: low numbers are popular). The
            // prompt's blocks have the same engine hashes every time (prefix caching): stored
            // when not resident, reused (nothing stored) when they are.
            let s = (self.rng.below(16) * self.rng.below(16) / 16) as usize;
            let system_hash = |b: u64| (id << 40) | (1 << 39) | ((s as u64) << 8) | b;
            if r.resident_system.insert(s) {
                let hashes: Vec<u64> = (0..16).map(system_hash).collect();
                events.push(wire::Event::BlockStored(wire::BlockStored {
                    block_hashes: hashes
                        .iter()
                        .map(|h| wire::BlockHash::Int(wire::Int::U64(*h)))
                        .collect(),
                    token_ids: wire::TokenIds::from(self.system[s].clone()),
                    block_size: BLOCK as u32,
                    medium: Some(wire::Medium("GPU".into())),
                    ..Default::default()
                }));
                r.lru.extend(&hashes);
            }
            r.conversations
                .push((self.system[s].clone(), Some(system_hash(15))));
            if r.conversations.len() > 64 {
                r.conversations.remove(0);
            }
            r.conversations.len() - 1
        } else {
            self.rng.below(r.conversations.len() as u64) as usize
        };
        // A turn: 2–8 new blocks extending the conversation's own prefix.
        let (tokens, last) = &mut r.conversations[c];
        let start = tokens.len();
        let new_blocks = 2 + self.rng.below(7) as usize;
        for _ in 0..new_blocks * BLOCK {
            tokens.push(self.rng.below(128_000) as u32);
        }
        let hashes: Vec<u64> = (0..new_blocks)
            .map(|_| {
                r.next_hash += 1;
                (id << 40) | r.next_hash
            })
            .collect();
        events.push(wire::Event::BlockStored(wire::BlockStored {
            block_hashes: hashes
                .iter()
                .map(|h| wire::BlockHash::Int(wire::Int::U64(*h)))
                .collect(),
            parent_block_hash: last.map(|p| wire::BlockHash::Int(wire::Int::U64(p))),
            token_ids: wire::TokenIds::from(tokens[start..start + new_blocks * BLOCK].to_vec()),
            block_size: BLOCK as u32,
            medium: Some(wire::Medium("GPU".into())),
            ..Default::default()
        }));
        *last = hashes.last().copied();
        r.lru.extend(&hashes);
        while r.lru.len() > self.capacity {
            let Some(h) = r.lru.pop_front() else { break };
            if h & (1 << 39) != 0 {
                // A system prompt block left: the prompt is no longer resident whole.
                r.resident_system.remove(&(((h >> 8) & 0xff) as usize));
            }
            events.push(wire::Event::BlockRemoved(wire::BlockRemoved {
                block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(h))],
                medium: Some(wire::Medium("GPU".into())),
                ..Default::default()
            }));
        }
        events
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn run(
    replicas: usize,
    capacity: usize,
    seed: u64,
    queries: usize,
    turn: usize,
    batch_group: usize,
) -> anyhow::Result<()> {
    let mut rng = Rng(seed | 1);
    let system: Vec<Vec<u32>> = (0..16)
        .map(|_| (0..16 * BLOCK).map(|_| rng.below(128_000) as u32).collect())
        .collect();
    let mut trace = Trace {
        rng,
        system,
        capacity,
    };
    let rss = || kvevent_benches::procfs::status_kb("/proc/self/status", "VmRSS:") * 1024.0;
    let index = Index::new(Config::default());
    let sources: Vec<_> = (0..replicas)
        .map(|i| index.add_source(&format!("replica-{i}")))
        .collect::<Result<_, _>>()?;
    let mut state: Vec<Replica> = (0..replicas)
        .map(|_| Replica {
            resident_system: std::collections::HashSet::new(),
            conversations: Vec::new(),
            lru: VecDeque::new(),
            next_hash: 0,
        })
        .collect();
    // Fill: until every replica's LRU is full, then the same again (evictions ≈ stores).
    let mut applied_blocks = 0u64;
    let mut apply_secs = 0.0;
    let mut fill = |rounds: usize, state: &mut Vec<Replica>, trace: &mut Trace| {
        let mut group: Vec<(kvevent_index::SourceId, wire::EventBatch<'static>)> = Vec::new();
        let mut apply = |group: &mut Vec<(kvevent_index::SourceId, wire::EventBatch<'static>)>| {
            let batches: Vec<_> = group.iter().map(|(s, b)| (*s, b)).collect();
            let t = Instant::now();
            index.apply_many(&batches);
            apply_secs += t.elapsed().as_secs_f64();
            drop(batches);
            group.clear();
        };
        for _ in 0..rounds.div_ceil(turn) {
            for (i, r) in state.iter_mut().enumerate() {
                for _ in 0..turn {
                    let events = trace.step(r, i as u64);
                    applied_blocks += events
                        .iter()
                        .map(|e| match e {
                            wire::Event::BlockStored(s) => s.block_hashes.len() as u64,
                            _ => 1,
                        })
                        .sum::<u64>();
                    group.push((sources[i], wire::EventBatch::new(1.0, events)));
                    if group.len() >= batch_group {
                        apply(&mut group);
                    }
                }
            }
        }
        if !group.is_empty() {
            apply(&mut group);
        }
    };
    let rounds = capacity / 4;
    fill(rounds, &mut state, &mut trace);
    let stats = index.stats();
    let pairs = stats.pairs.max(1);
    // Score: 1,024-token prompts made of a system prompt and a conversation's own tokens.
    let mut lat = Vec::new();
    let mut matched = 0u64;
    for q in 0..queries {
        let r = &state[q % replicas];
        let Some((tokens, _)) = r.conversations.get(q % r.conversations.len().max(1)) else {
            continue;
        };
        let mut prompt = tokens.clone();
        prompt.resize(1024, 7);
        let t = Instant::now();
        let scores = index.score(&Query {
            adapter: "",
            keys: QueryKeys::Tokens {
                ids: &prompt,
                block_size: BLOCK,
            },
        });
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        matched += scores.first().map_or(0, |s| u64::from(s.matched_blocks));
    }
    // Churn: ten times the capacity stored and evicted again.
    let before = index.stats();
    fill(rounds * 10, &mut state, &mut trace);
    let after = index.stats();
    eprintln!("applied block events {applied_blocks}");
    // The index's resident memory: what the process gives back when the index is dropped
    // (its tables are large allocations, returned to the system when freed), per pair.
    let rss_before_drop = rss();
    // How much of it huge pages back (transparent huge pages, where the process asked for them:
    // `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`), so a figure says which it was measured with.
    let huge = kvevent_benches::procfs::status_kb("/proc/self/smaps_rollup", "AnonHugePages:")
        * 1024.0
        / rss_before_drop.max(1.0);
    let after_pairs = after.pairs.max(1);
    drop(index);
    let rss_per_pair = (rss_before_drop - rss()) / after_pairs as f64;
    println!(
        "| {replicas} | {:.2} M/s | {:.1} / {:.1} µs | {:.3} | {:.1} B (tables {:.1} B) + mappers {:.1} B; RSS {:.1} B, {:.0} % in huge pages | {:.1} → {:.1} MB ({:+.1} %) | {:.1} |",
        applied_blocks as f64 / apply_secs / 1e6,
        percentile(&mut lat, 0.5),
        percentile(&mut lat, 0.99),
        pairs as f64 / 1e6,
        stats.bytes as f64 / pairs as f64,
        stats.table_bytes as f64 / pairs as f64,
        stats.mapper_bytes as f64 / pairs as f64,
        rss_per_pair,
        100.0 * huge,
        before.bytes as f64 / 1048576.0,
        after.bytes as f64 / 1048576.0,
        100.0 * (after.bytes as f64 / before.bytes.max(1) as f64 - 1.0),
        matched as f64 / lat.len().max(1) as f64,
    );
    Ok(())
}

const USAGE: &str = "usage: index-probe [REPLICAS...] [--capacity N] [--seed S] [--queries Q] [--turn K] [--group N]
The prefix index on a synthetic fleet trace, for each REPLICAS count (default 64 256 1024):
apply rate, score latency, bytes per pair, memory across churn. --capacity: blocks per replica
(default 4096); --queries: prompts scored (default 5000); --turn: batches of a source applied
in a row (default 1); --group: batches a call of Index::apply_many (default 1).";

fn main() -> anyhow::Result<()> {
    let mut replicas = Vec::new();
    let mut capacity = 4_096;
    let mut seed = 42;
    let mut queries = 5_000;
    let mut turn = 1;
    let mut group = 1;
    let mut args = kvevent_benches::Cli::new(USAGE);
    while let Some(a) = args.arg() {
        match a.as_str() {
            "--capacity" => capacity = args.value("--capacity")?,
            "--seed" => seed = args.value("--seed")?,
            "--queries" => queries = args.value("--queries")?,
            "--group" => group = args.value::<usize>("--group")?.max(1),
            "--turn" => turn = args.value::<usize>("--turn")?.max(1),
            n => replicas.push(args.parse::<usize>("REPLICAS count", n)?),
        }
    }
    if replicas.is_empty() {
        replicas = vec![64, 256, 1024];
    }
    println!(
        "capacity {capacity} blocks per replica, seed {seed}, {turn} batch(es) of a source in a row, {group} batch(es) a call"
    );
    println!(
        "| replicas | apply (block events/s, one writer) | score p50 / p99 (1,024 tokens) | resident pairs (M) | bytes per pair: what the byte budget counts (key tables and holder lists) + per-source block maps; RSS given back when the index is dropped, and the share of the process's RSS in huge pages | index bytes before → after 10× churn | blocks matched per query |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in replicas {
        run(r, capacity, seed, queries, turn, group)?;
    }
    // The floor under the apply rate once the tables outgrow the cache (about 64 MB of them
    // at 256 replicas): every block event looks up two tables at random. Measured last:
    // freeing its 64 MB raises glibc's mmap threshold, and tables made after that are not
    // given back when dropped (the RSS column would read 0).
    for mb in [4, 16, 64] {
        println!(
            "this machine, random loads over {mb} MB: {:.0} ns alone, {:.1} ns each with 16 in flight",
            kvevent_benches::memory::random_load_ns(mb << 20, 1),
            kvevent_benches::memory::random_load_ns(mb << 20, 16),
        );
    }
    Ok(())
}
