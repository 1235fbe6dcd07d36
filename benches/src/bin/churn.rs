//! A router's index in a fleet that churns: replicas come and go under new names (each
//! rollout gives a pod a new name) and live replicas load new snapshots, while scores are
//! answered. Prints, for the index after each stage against the same index fresh: score
//! latency (median, p99), the process's RSS, pairs, keys and slots; then, at 5 M pairs or
//! more, how long `remove_replica` and a snapshot's `promote` hold the index; then a scoring
//! thread's p99 while a pod is replaced every 10 ms against its steady p99; last, a `Fleet`'s
//! score against the index's own at 256 replicas.
//!
//! Each replica holds `--held` prompts of 8 blocks drawn from a pool of `--prompts`, loaded as
//! a sidecar's snapshot is (keyed changes, in chunks of 8,192). Keys are random 64-bit
//! fingerprints.
//!
//! `cargo run --release -p kvevent-benches --bin churn [-- --incarnations N --resnapshots N]`
//! (`benches/churn.sh BEFORE` runs this build and the build `BEFORE` alternately.)

use std::time::{Duration, Instant};

use kvevent_benches::Cli;
use kvevent_index::{Config, Index, KeyChange, Query, QueryKeys, SourceId, Tier};

const BLOCKS: usize = 8;
const CHUNK: usize = 8192;

const USAGE: &str = "usage: churn [--replicas N] [--prompts N] [--held N] [--incarnations N] [--resnapshots N] [--queries N] [--big-prompts N] [--rollout-ms N] [--fleet-replicas N] [--seed S]
A router's index in a churning fleet (see the source's header). Defaults: 64 replicas, a pool of
500 prompts of 8 blocks, 250 held by each replica, 100000 incarnations, 100000 re-snapshots,
20000 queries a measure, 10000 prompts a replica for the 5 M-pair index, 3000 ms of rollout,
256 replicas for the Fleet's score.";

/// index-probe's generator, kept here: `benches/churn.sh` builds this file on the build before
/// too, whose benches library has no shared one.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The pool's prompts: 8 random keys each.
fn pool(rng: &mut Rng, prompts: usize) -> Vec<[u64; BLOCKS]> {
    (0..prompts)
        .map(|_| std::array::from_fn(|_| rng.next()))
        .collect()
}

/// `held` distinct prompts of the pool.
fn holding(rng: &mut Rng, pool: usize, held: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..pool).collect();
    for i in 0..held.min(pool) {
        let j = i + rng.below(pool - i);
        all.swap(i, j);
    }
    all.truncate(held.min(pool));
    all
}

/// Loads `prompts` into `source` as a snapshot is loaded.
fn load(index: &Index, source: SourceId, pool: &[[u64; BLOCKS]], prompts: &[usize]) {
    let changes: Vec<KeyChange<'static>> = prompts
        .iter()
        .flat_map(|p| {
            pool[*p]
                .iter()
                .enumerate()
                .map(|(i, key)| KeyChange::Stored {
                    key: *key,
                    tokens: 16 * (i as u32 + 1),
                    tier: Tier::T1,
                    adapter: "",
                })
        })
        .collect();
    for chunk in changes.chunks(CHUNK) {
        index.apply_keys(source, chunk);
    }
}

fn rss_mb() -> f64 {
    kvevent_benches::procfs::status_kb("/proc/self/status", "VmRSS:") / 1024.0
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * p) as usize)
        .copied()
        .unwrap_or(0.0)
}

/// Score latency (median, p99, µs) over `queries` random prompts of the pool.
fn scores(index: &Index, pool: &[[u64; BLOCKS]], queries: usize, seed: u64) -> (f64, f64) {
    let mut rng = Rng(seed);
    let mut lat = Vec::with_capacity(queries);
    for _ in 0..queries {
        let keys = &pool[rng.below(pool.len())];
        let t = Instant::now();
        let answer = index.score(&Query {
            adapter: "",
            keys: QueryKeys::Keys(keys),
        });
        std::hint::black_box(answer.len());
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    (percentile(&mut lat, 0.5), percentile(&mut lat, 0.99))
}

struct Replica {
    name: String,
    source: SourceId,
    prompts: Vec<usize>,
}

/// `replicas` replicas, each holding `held` prompts of `pool`, loaded.
fn fleet_of(
    index: &Index,
    rng: &mut Rng,
    pool: &[[u64; BLOCKS]],
    replicas: usize,
    held: usize,
) -> anyhow::Result<Vec<Replica>> {
    (0..replicas)
        .map(|r| {
            let name = format!("r{r}");
            let source = index.add_source(&name)?;
            let prompts = holding(rng, pool.len(), held);
            load(index, source, pool, &prompts);
            Ok(Replica {
                name,
                source,
                prompts,
            })
        })
        .collect()
}

fn row(stage: &str, index: &Index, (p50, p99): (f64, f64), per_op_ms: Option<f64>) {
    let s = index.stats();
    println!(
        "| {stage} | {p50:.2} | {p99:.2} | {:.1} | {} | {} | {} | {} |",
        rss_mb(),
        s.pairs,
        s.keys,
        s.source_slots,
        per_op_ms.map_or_else(|| "".to_owned(), |ms| format!("{ms:.3}")),
    );
}

fn median_ms(mut v: Vec<f64>) -> (f64, f64) {
    let max = v.iter().copied().fold(0.0, f64::max);
    (percentile(&mut v, 0.5), max)
}

fn main() -> anyhow::Result<()> {
    let mut cli = Cli::new(USAGE);
    let (mut replicas, mut prompts, mut held) = (64usize, 500usize, 250usize);
    let (mut incarnations, mut resnapshots, mut queries) =
        (100_000usize, 100_000usize, 20_000usize);
    let (mut big_prompts, mut rollout_ms, mut fleet_replicas, mut seed) =
        (10_000usize, 3_000u64, 256usize, 7u64);
    while let Some(flag) = cli.arg() {
        match flag.as_str() {
            "--replicas" => replicas = cli.value(&flag)?,
            "--prompts" => prompts = cli.value(&flag)?,
            "--held" => held = cli.value(&flag)?,
            "--incarnations" => incarnations = cli.value(&flag)?,
            "--resnapshots" => resnapshots = cli.value(&flag)?,
            "--queries" => queries = cli.value(&flag)?,
            "--big-prompts" => big_prompts = cli.value(&flag)?,
            "--rollout-ms" => rollout_ms = cli.value(&flag)?,
            "--fleet-replicas" => fleet_replicas = cli.value(&flag)?,
            "--seed" => seed = cli.value(&flag)?,
            other => return Err(cli.error(&format!("unknown flag {other}"))),
        }
    }
    cli.done()?;
    let mut rng = Rng(seed | 1);
    let pool = pool(&mut rng, prompts);

    // 1. Incarnations, then re-snapshots, against the same index fresh.
    println!("## {replicas} live replicas, {held} of {prompts} prompts of {BLOCKS} blocks each\n");
    println!(
        "| stage | score p50 µs | score p99 µs | RSS MB | pairs | keys | source slots | ms an operation |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let index = Index::new(Config::default());
    let mut live = fleet_of(&index, &mut rng, &pool, replicas, held)?;
    row("fresh", &index, scores(&index, &pool, queries, seed), None);
    let t = Instant::now();
    for i in 0..incarnations {
        let r = &mut live[i % replicas];
        index.remove_replica(&r.name);
        r.name = format!("r{}-{i}", i % replicas);
        r.source = index.add_source(&r.name)?;
        load(&index, r.source, &pool, &r.prompts);
    }
    let per = t.elapsed().as_secs_f64() * 1e3 / incarnations.max(1) as f64;
    row(
        &format!("after {incarnations} incarnations"),
        &index,
        scores(&index, &pool, queries, seed),
        Some(per),
    );
    let t = Instant::now();
    for i in 0..resnapshots {
        let r = &mut live[i % replicas];
        let new = index.add_loading_source(&r.name)?;
        load(&index, new, &pool, &r.prompts);
        index.promote(new, Some(r.source));
        r.source = new;
    }
    let per = t.elapsed().as_secs_f64() * 1e3 / resnapshots.max(1) as f64;
    row(
        &format!("then {resnapshots} re-snapshots"),
        &index,
        scores(&index, &pool, queries, seed),
        Some(per),
    );
    drop(live);
    drop(index);

    // 2. At 5 M pairs or more: how long a replica's removal and a snapshot's promotion hold
    // the index's lock.
    let big_pool = self::pool(&mut rng, big_prompts * 2);
    let index = Index::new(Config::default());
    let mut live = fleet_of(&index, &mut rng, &big_pool, replicas, big_prompts)?;
    let pairs = index.stats().pairs;
    let (mut removes, mut promotes) = (Vec::new(), Vec::new());
    for i in 0..10 {
        let r = &mut live[i % replicas];
        let t = Instant::now();
        index.remove_replica(&r.name);
        removes.push(t.elapsed().as_secs_f64() * 1e3);
        r.name = format!("big{i}");
        r.source = index.add_source(&r.name)?;
        load(&index, r.source, &big_pool, &r.prompts);
        let new = index.add_loading_source(&r.name)?;
        load(&index, new, &big_pool, &r.prompts);
        let t = Instant::now();
        index.promote(new, Some(r.source));
        promotes.push(t.elapsed().as_secs_f64() * 1e3);
        r.source = new;
    }
    let (remove, remove_max) = median_ms(removes);
    let (promote, promote_max) = median_ms(promotes);
    println!(
        "\n## at {:.1} M pairs\n\nremove_replica: median {remove:.3} ms, max {remove_max:.3} ms; promote: median {promote:.3} ms, max {promote_max:.3} ms",
        pairs as f64 / 1e6
    );
    drop(live);
    drop(index);

    // 3. A scoring thread's latency while a pod is replaced every 10 ms, against its steady
    // latency (the same thread, the same length of time, nothing replaced).
    let index = std::sync::Arc::new(Index::new(Config::default()));
    let mut live = fleet_of(&index, &mut rng, &pool, replicas, held)?;
    let run = |rolling: bool, live: &mut Vec<Replica>| -> anyhow::Result<(f64, f64, usize)> {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let scorer = {
            let (index, pool, stop) = (index.clone(), pool.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(99);
                let mut lat = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let keys = &pool[rng.below(pool.len())];
                    let t = Instant::now();
                    let answer = index.score(&Query {
                        adapter: "",
                        keys: QueryKeys::Keys(keys),
                    });
                    std::hint::black_box(answer.len());
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
                lat
            })
        };
        let end = Instant::now() + Duration::from_millis(rollout_ms);
        let mut replaced = 0;
        while Instant::now() < end {
            if rolling {
                let r = &mut live[replaced % replicas];
                index.remove_replica(&r.name);
                r.name = format!("roll{replaced}");
                r.source = index.add_source(&r.name)?;
                load(&index, r.source, &pool, &r.prompts);
                replaced += 1;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut lat = scorer
            .join()
            .map_err(|_| anyhow::anyhow!("the scorer panicked"))?;
        Ok((
            percentile(&mut lat, 0.5),
            percentile(&mut lat, 0.99),
            replaced,
        ))
    };
    let (steady50, steady99, _) = run(false, &mut live)?;
    let (roll50, roll99, replaced) = run(true, &mut live)?;
    println!(
        "\n## a scoring thread during a rollout ({replaced} pods replaced, one every 10 ms)\n\nsteady: p50 {steady50:.2} µs, p99 {steady99:.2} µs; rollout: p50 {roll50:.2} µs, p99 {roll99:.2} µs ({:.2}×)",
        roll99 / steady99.max(1e-9)
    );
    drop(live);

    // The build before has no Fleet to compare (benches/churn.sh drops what follows).
    let _ = fleet_replicas;
    // fleet: begin
    // 4. A Fleet's score against its index's own, alternated, at `fleet_replicas` replicas.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let fleet = kvevent_fleet::Fleet::with_runtime(
        kvevent_fleet::FleetConfig::default(),
        rt.handle().clone(),
    );
    for r in 0..fleet_replicas {
        let name = format!("f{r}");
        // Followed from a sidecar that is not there: the fleet knows the replica; its blocks
        // are put in the index directly.
        fleet.ensure_replica(
            &name,
            kvevent_fleet::ReplicaSource::Sidecar(kvevent_fleet::SidecarFeed::new(
                "http://127.0.0.1:9",
            )),
        )?;
        let source = fleet.index().add_source(&name)?;
        load(
            fleet.index(),
            source,
            &pool,
            &holding(&mut rng, pool.len(), held),
        );
    }
    let (mut by_fleet, mut by_index) = (Vec::new(), Vec::new());
    for round in 0..6 {
        let mut rng = Rng(1000 + round);
        let t = Instant::now();
        for _ in 0..queries {
            let keys = &pool[rng.below(pool.len())];
            let q = Query {
                adapter: "",
                keys: QueryKeys::Keys(keys),
            };
            if round % 2 == 0 {
                std::hint::black_box(fleet.score(&q)?.len());
            } else {
                std::hint::black_box(fleet.index().score(&q).len());
            }
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / queries as f64;
        if round % 2 == 0 {
            by_fleet.push(us);
        } else {
            by_index.push(us);
        }
    }
    let (fleet_us, index_us) = (median_ms(by_fleet).0, median_ms(by_index).0);
    println!(
        "\n## a Fleet's score at {fleet_replicas} replicas\n\nFleet::score {fleet_us:.2} µs, Index::score {index_us:.2} µs: {:.3}×",
        fleet_us / index_us.max(1e-9)
    );
    // fleet: end
    Ok(())
}
