//! The simulator against vLLM on CPU, as a client sees them (#63): one seeded workload with
//! shared prefixes sent streamed to a real vLLM engine (the tiny Llama of `.ci/real-engine`)
//! and to a simulated one (`kvevent-simulator`'s host: the `vllm-cpu` time model, the same
//! block size, cache and model length), N requests at once (a closed loop: each of N clients
//! sends its next request when its last one ended) for N = 1, 4, 8, with prefix caching on and
//! off. Per request, the time to the first token's chunk and to the end; printed: their medians
//! on each, and the simulator's mean absolute percentage error against vLLM, request by request
//! (the same requests in the same order), and the requests whose `cached_tokens` agree.
//!
//! ```text
//! KVEVENT_VLLM_VENV=$(bash .ci/real-engine/install) \
//!   cargo run --release -p kvevent-benches --bin sim-fidelity [-- --requests N]
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvevent_sim::workload::{Planned, Rng, tokens};
use kvevent_sim::{Config, TimeModel};
use kvevent_simulator::client::{self, Streamed};
use kvevent_simulator::{Serving, SimEngine};
use kvevent_test_support::{HeldPort, VLLM_BLOCK, VLLM_CACHE_BLOCKS, Vllm, vllm_venv};

const LEVELS: [usize; 3] = [1, 4, 8];

/// `n` requests over 4 system prompts of 128–352 tokens (the level's own: no level finds
/// another's), each with a user turn of 16–64 tokens, 16 tokens out; ids within the tiny
/// model's vocabulary.
fn workload(level: usize, n: usize) -> Vec<Planned> {
    let mut rng = Rng(level as u64 * 2 + 1);
    let vocab = |t: u32| 3 + t % 1000;
    let systems: Vec<Vec<u32>> = (0..4)
        .map(|s| {
            tokens((level * 16 + s) as u64, rng.range(128, 353) as usize)
                .map(vocab)
                .collect()
        })
        .collect();
    (0..n)
        .map(|i| {
            let mut prompt = systems[rng.below(4) as usize].clone();
            prompt.extend(
                tokens(
                    (1 << 20) + (level * 1000 + i) as u64,
                    rng.range(16, 65) as usize,
                )
                .map(vocab),
            );
            Planned {
                at_s: 0.0,
                prompt,
                max_tokens: 16,
            }
        })
        .collect()
}

/// Sends `requests` to `base`, `at_once` at a time; each one's outcome, in order.
async fn closed_loop(
    base: &str,
    model: &str,
    requests: &Arc<Vec<Planned>>,
    at_once: usize,
) -> anyhow::Result<Vec<Streamed>> {
    let next = Arc::new(AtomicUsize::new(0));
    let http = client::client();
    let mut workers = Vec::new();
    for _ in 0..at_once {
        let (next, requests, http) = (next.clone(), requests.clone(), http.clone());
        let (base, model) = (base.to_owned(), model.to_owned());
        workers.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(planned) = requests.get(i) else {
                    return anyhow::Ok(done);
                };
                let s =
                    client::stream(&http, &base, &model, planned, Duration::from_secs(120)).await?;
                done.push((i, s));
            }
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await??);
    }
    all.sort_by_key(|(i, _)| *i);
    Ok(all.into_iter().map(|(_, s)| s).collect())
}

fn median(mut v: Vec<f64>) -> f64 {
    client::percentile(&mut v, 0.5)
}

/// Mean absolute percentage error of `sim` against `real`, pairwise.
fn mape(real: &[f64], sim: &[f64]) -> f64 {
    let errors: Vec<f64> = real
        .iter()
        .zip(sim)
        .map(|(r, s)| (s - r).abs() / r)
        .collect();
    100.0 * errors.iter().sum::<f64>() / errors.len().max(1) as f64
}

fn main() -> anyhow::Result<()> {
    let mut requests = 48usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--requests" => requests = args.next().unwrap_or_default().parse()?,
            other => anyhow::bail!("unknown argument {other:?}: sim-fidelity [--requests N]"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let venv = vllm_venv();
    println!(
        "{:<8} {:>3}  {:>21}  {:>10}  {:>21}  {:>10}  {:>13}",
        "caching",
        "N",
        "TTFT p50 vLLM / sim",
        "TTFT MAPE",
        "e2e p50 vLLM / sim",
        "e2e MAPE",
        "cached equal"
    );
    for caching in [true, false] {
        rt.block_on(async {
            let log = std::env::temp_dir().join(format!("sim-fidelity-{}.log", std::process::id()));
            let (http, events, replay) = (HeldPort::new(), HeldPort::new(), HeldPort::new());
            let flags: &[&str] = if caching {
                &[]
            } else {
                &["--no-enable-prefix-caching"]
            };
            let mut engine =
                Vllm::start_with(&venv, http.port(), events.port(), replay.port(), log, flags);
            engine.up().await;
            let ctx = zmq::Context::new();
            let sim = SimEngine::start(
                &ctx,
                "sim",
                Config {
                    block_size: VLLM_BLOCK as usize,
                    num_blocks: VLLM_CACHE_BLOCKS as usize,
                    max_num_seqs: 128,
                    max_num_batched_tokens: 2048,
                    time: TimeModel::VLLM_CPU_TINY,
                    prefix_caching: caching,
                },
                &Serving {
                    max_model_len: 1024,
                    ..Serving::new("tiny")
                },
            )
            .await?;
            let (real_base, sim_base) = (
                format!("http://{}", engine.http),
                format!("http://{}", sim.http),
            );
            // Warm-up: vLLM's first requests are slow (allocations, lazy imports).
            let warm = Arc::new(workload(99, 6));
            closed_loop(&real_base, "tiny", &warm, 1).await?;
            for level in LEVELS {
                let work = Arc::new(workload(level, requests));
                let real = closed_loop(&real_base, "tiny", &work, level).await?;
                let simulated = closed_loop(&sim_base, "tiny", &work, level).await?;
                let ms = |v: &[Streamed], f: fn(&Streamed) -> Duration| -> Vec<f64> {
                    v.iter().map(|s| f(s).as_secs_f64() * 1e3).collect()
                };
                let (rt, st) = (ms(&real, |s| s.ttft), ms(&simulated, |s| s.ttft));
                let (re, se) = (ms(&real, |s| s.e2e), ms(&simulated, |s| s.e2e));
                let equal = real
                    .iter()
                    .zip(&simulated)
                    .filter(|(r, s)| r.cached_tokens == s.cached_tokens)
                    .count();
                println!(
                    "{:<8} {:>3}  {:>9.1} / {:>6.1} ms  {:>8.0} %  {:>9.1} / {:>6.1} ms  {:>8.0} %  {:>6} of {:>3}",
                    if caching { "on" } else { "off" },
                    level,
                    median(rt.clone()),
                    median(st.clone()),
                    mape(&rt, &st),
                    median(re.clone()),
                    median(se.clone()),
                    mape(&re, &se),
                    equal,
                    real.len()
                );
            }
            engine.stop();
            anyhow::Ok(())
        })?;
    }
    Ok(())
}
