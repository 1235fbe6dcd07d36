//! What a routing decision costs beside the score it rests on (#56: within 2 µs of a score):
//! an index of `R` replicas (8, 64, 256), each holding its own prompts and, every one, a shared
//! system prefix, each with a load; a query is answered among all `R` (`score_among`, what a
//! router asks), then `kvevent_fleet::route::Rule::choose` decides, for each policy. Printed per
//! fleet size: the score's median and p99, and each policy's decision median and p99 on top of
//! it, in microseconds, alternated query by query.
//!
//! Then the routing loop's own cost (`kvevent_fleet::route::Router` over a fleet that holds no
//! blocks, so that no score is in it): a request chosen among `R` candidates, sent, its first
//! token, finished; the cost policy with its weights given, and learning them (each first
//! token one observation), alternated request by request.
//!
//! `cargo run --release -p kvevent-benches --bin route-cost [-- --queries N]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvevent_fleet::route::{Candidate, Flights, Policy, Request, Rule, affinity};
use kvevent_index::{
    Config, Index, KeyChange, Load, LoadReading, Query, QueryKeys, RankLoad, Tier,
};

const BLOCK: usize = 16;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn prompt(replica: usize, n: usize) -> Vec<u32> {
    // 4 blocks of system prompt, then 8 of the replica's own.
    (0..4 * BLOCK as u32)
        .chain((0..8 * BLOCK as u32).map(|t| 1_000_000 + (replica * 1000 + n) as u32 * 256 + t))
        .collect()
}

fn main() {
    let mut queries = 100_000usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--queries", Some(n)) => queries = n.parse().expect("--queries N"),
            _ => {
                eprintln!("usage: route-cost [--queries N]");
                std::process::exit(64);
            }
        }
    }
    println!(
        "fleet  score p50/p99 µs   decision on top, p50/p99 µs: cost | prefix-only | least-loaded | round-robin"
    );
    for replicas in [8usize, 64, 256] {
        let index = Index::new(Config::default());
        let names: Vec<String> = (0..replicas).map(|r| format!("replica-{r}")).collect();
        let now = Instant::now();
        for (r, name) in names.iter().enumerate() {
            let source = index.add_source(name).expect("a source");
            for n in 0..16 {
                let p = prompt(r, n);
                let keys = kvevent_fingerprint::chain(&p, BLOCK, None);
                let changes: Vec<KeyChange<'_>> = keys
                    .iter()
                    .enumerate()
                    .map(|(i, b)| KeyChange::Stored {
                        key: b.prefix,
                        tokens: (BLOCK * (i + 1)) as u32,
                        tier: Tier::T1,
                        adapter: "",
                    })
                    .collect();
                index.apply_keys(source, &changes);
            }
            index.set_replica_load(
                name,
                Some(LoadReading {
                    load: Load {
                        ranks: vec![RankLoad {
                            running: (r % 7) as u32,
                            waiting: (r % 3) as u32,
                            kv_usage: Some(0.5),
                            ..RankLoad::idle(0)
                        }],
                    },
                    read_at: now,
                    failing: false,
                }),
            );
        }
        let flights: Vec<Arc<Flights>> = (0..replicas).map(|_| Arc::default()).collect();
        let asked: Vec<&str> = names.iter().map(String::as_str).collect();
        let candidates: Vec<Candidate<'_>> = asked
            .iter()
            .zip(&flights)
            .map(|(name, f)| Candidate { name, flights: f })
            .collect();
        let rules: Vec<Rule> = Policy::NAMES
            .iter()
            .map(|n| Rule::new(n.parse().expect("a policy")))
            .collect();
        let mut score_us = Vec::with_capacity(queries);
        let mut decide_us: Vec<Vec<f64>> = vec![Vec::with_capacity(queries); rules.len()];
        let mut chosen = 0usize;
        for q in 0..queries {
            let p = prompt(q % replicas, q % 16);
            let query = Query {
                adapter: "",
                keys: QueryKeys::Tokens {
                    ids: &p,
                    block_size: BLOCK,
                },
            };
            let t = Instant::now();
            let scores = index.score_among(&query, &asked);
            score_us.push(t.elapsed().as_secs_f64() * 1e6);
            let request = Request {
                prompt_tokens: p.len() as u32,
                affinity: affinity(&p, BLOCK),
            };
            // Alternated: each query is decided by every policy in turn.
            for (i, rule) in rules.iter().enumerate() {
                let t = Instant::now();
                let choice = rule.choose(Some(&scores), &request, &candidates, Instant::now());
                decide_us[i].push(t.elapsed().as_secs_f64() * 1e6);
                chosen += choice.map_or(0, |c| c.replica.len());
            }
        }
        score_us.sort_by(f64::total_cmp);
        let mut line = format!(
            "{replicas:>5}  {:>6.2} / {:>6.2}     ",
            percentile(&score_us, 0.5),
            percentile(&score_us, 0.99)
        );
        for d in &mut decide_us {
            d.sort_by(f64::total_cmp);
            line += &format!(
                " {:>5.2} / {:>5.2} |",
                percentile(d, 0.5),
                percentile(d, 0.99)
            );
        }
        println!("{}", line.trim_end_matches('|'));
        std::hint::black_box(chosen);
        std::thread::sleep(Duration::from_millis(10));
    }
    the_loop(queries / 10);
}

/// The routing loop's own cost per request, weights given against learned.
fn the_loop(requests: usize) {
    use kvevent_fleet::route::Router;
    use kvevent_fleet::{Fleet, FleetConfig};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let _entered = rt.enter();
    println!(
        "fleet  the loop (choose, send, first token, finish) p50/p99 µs: weights given | learned"
    );
    for replicas in [8usize, 64, 256] {
        let fleet = Arc::new(Fleet::new(FleetConfig::default()).expect("a fleet"));
        let routers = [
            Router::new(fleet.clone(), Rule::default()),
            Router::new(fleet, Rule::default()).learning(),
        ];
        let names: Vec<String> = (0..replicas).map(|r| format!("replica-{r}")).collect();
        let asked: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut took: Vec<Vec<f64>> = vec![Vec::with_capacity(requests); routers.len()];
        let mut chosen = 0usize;
        for q in 0..requests {
            let p = prompt(q % replicas, q % 16);
            for (i, router) in routers.iter().enumerate() {
                let t = Instant::now();
                let decision = router.choose(&asked, &p, "").expect("a candidate");
                let mut sent = router.send(&decision);
                sent.first_token();
                sent.finish(Some(0));
                took[i].push(t.elapsed().as_secs_f64() * 1e6);
                chosen += decision.replica.len();
            }
        }
        let mut line = format!("{replicas:>5} ");
        for t in &mut took {
            t.sort_by(f64::total_cmp);
            line += &format!(
                " {:>5.2} / {:>5.2} |",
                percentile(t, 0.5),
                percentile(t, 0.99)
            );
        }
        println!("{}", line.trim_end_matches('|'));
        std::hint::black_box(chosen);
    }
}
