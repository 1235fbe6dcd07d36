//! Calibrates the simulator's time model against a real vLLM engine on CPU (the tiny Llama of
//! `.ci/real-engine`, block size 32): times streamed completions as a router sees them
//! (prompts nobody holds, of two lengths; decoding alone and four at once), fits
//! [`kvevent_sim::TimeModel`]'s four figures, and sets the simulator's CPU profile
//! ([`kvevent_sim::TimeModel::VLLM_CPU_TINY`]) beside what it measured, probe by probe.
//!
//! ```text
//! KVEVENT_VLLM_VENV=$(bash .ci/real-engine/install) \
//!   cargo run --release -p kvevent-benches --bin sim-calibrate [-- --samples N]
//! ```

use std::time::Duration;

use kvevent_sim::{Config, Engine, Progress, Request, TimeModel};
use kvevent_test_support::{HeldPort, VLLM_BLOCK, VLLM_CACHE_BLOCKS, Vllm, vllm_venv};

/// `len` token ids, distinct per `seed` (no two seeds share a first block), in the tiny
/// model's vocabulary.
fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|t| 3 + (seed * 131 + t * 7) % 1000).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

const SHORT: u32 = 64;
const LONG: u32 = 960;
const DECODE: u32 = 48;

/// What one profile says (or the engine measured), in milliseconds: time to first token of
/// a short and a long prompt nobody holds, a decode step alone and with four decoding.
#[derive(Debug, Clone, Copy)]
struct Probes {
    ttft_short: f64,
    ttft_long: f64,
    step_alone: f64,
    step_four: f64,
}

/// The simulator's answer to the same probes under `time`.
fn simulated(time: TimeModel) -> Probes {
    let config = Config {
        block_size: VLLM_BLOCK as usize,
        num_blocks: VLLM_CACHE_BLOCKS as usize,
        max_num_seqs: 128,
        max_num_batched_tokens: 2048,
        time,
        prefix_caching: true,
    };
    // Milliseconds from each request's arrival (all at 0) to its first token and its last.
    let run = |prompts: Vec<Vec<u32>>, max_tokens: u32| {
        let mut e = Engine::new(config.clone());
        for (id, p) in prompts.into_iter().enumerate() {
            e.add(Request {
                id: id as u64,
                prompt: p,
                max_tokens,
                output: Vec::new(),
                lora: None,
            });
        }
        let (mut now, mut first, mut last) = (0.0, None, 0.0);
        while let Some(step) = e.step() {
            now += step.duration_us / 1e3;
            for p in &step.progress {
                if matches!(p, Progress::FirstToken { .. }) {
                    first.get_or_insert(now);
                }
            }
            last = now;
        }
        // The host admits each request `request_us` late.
        let late = time.request_us / 1e3;
        (first.unwrap_or(0.0) + late, last + late)
    };
    let (ttft_short, _) = run(vec![prompt(1, SHORT)], 1);
    let (ttft_long, _) = run(vec![prompt(2, LONG)], 1);
    let (f1, l1) = run(vec![prompt(3, SHORT)], DECODE);
    let (f4, l4) = run((4..8).map(|s| prompt(s, SHORT)).collect(), DECODE);
    Probes {
        ttft_short,
        ttft_long,
        step_alone: (l1 - f1) / f64::from(DECODE - 1),
        step_four: (l4 - f4) / f64::from(DECODE - 1),
    }
}

fn main() -> anyhow::Result<()> {
    let mut samples = 7u32;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--samples" => samples = args.next().unwrap_or_default().parse()?,
            other => anyhow::bail!("unknown argument {other:?}: sim-calibrate [--samples N]"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let measured = rt.block_on(async {
        let venv = vllm_venv();
        let log = std::env::temp_dir().join(format!("sim-calibrate-{}.log", std::process::id()));
        let (http, events, replay) = (HeldPort::new(), HeldPort::new(), HeldPort::new());
        let mut engine = Vllm::start(&venv, http.port(), events.port(), replay.port(), log);
        let up = engine.up().await;
        println!("vLLM on CPU up in {:.0} s", up.as_secs_f64());
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut seed = 100;
        let mut next = || {
            seed += 1;
            seed
        };
        for _ in 0..3 {
            engine.timed(&prompt(next(), LONG), 4).await;
        }
        let (mut short, mut long, mut alone, mut four) = (vec![], vec![], vec![], vec![]);
        for _ in 0..samples {
            let t = engine.timed(&prompt(next(), SHORT), 1).await;
            assert_eq!(t.cached_tokens, 0, "a prompt nobody holds");
            short.push(ms(t.first_token));
            let t = engine.timed(&prompt(next(), LONG), 1).await;
            assert_eq!(t.cached_tokens, 0, "a prompt nobody holds");
            long.push(ms(t.first_token));
            let t = engine.timed(&prompt(next(), SHORT), DECODE).await;
            alone.push(ms(t.last_token - t.first_token) / f64::from(DECODE - 1));
            let ps: Vec<Vec<u32>> = (0..4).map(|_| prompt(next(), SHORT)).collect();
            let ts =
                futures_util::future::join_all(ps.iter().map(|p| engine.timed(p, DECODE))).await;
            // Four decoding at once: the slowest one's steps.
            let steps = ts
                .iter()
                .map(|t| ms(t.last_token - t.first_token))
                .fold(0.0, f64::max)
                / f64::from(DECODE - 1);
            four.push(steps);
        }
        engine.stop();
        Probes {
            ttft_short: median(short),
            ttft_long: median(long),
            step_alone: median(alone),
            step_four: median(four),
        }
    });
    // The fit: prefill from the two lengths; a step's fixed cost and each sequence's from
    // decoding alone and four at once.
    let prefill_us_per_token =
        (measured.ttft_long - measured.ttft_short) * 1e3 / f64::from(LONG - SHORT);
    let decode_us_per_seq = (measured.step_four - measured.step_alone) * 1e3 / 3.0;
    let step_us = measured.step_alone * 1e3 - decode_us_per_seq;
    // What serving adds: the short prompt's first token as measured, beyond the engine's step.
    let engine_only = simulated(TimeModel {
        step_us,
        prefill_us_per_token,
        decode_us_per_seq,
        request_us: 0.0,
    });
    let request_us = ((measured.ttft_short - engine_only.ttft_short) * 1e3).max(0.0);
    println!(
        "fit: TimeModel {{ step_us: {step_us:.0}, prefill_us_per_token: {prefill_us_per_token:.1}, decode_us_per_seq: {decode_us_per_seq:.0}, request_us: {request_us:.0} }}"
    );
    let profile = simulated(TimeModel::VLLM_CPU_TINY);
    println!(
        "{:<28} {:>10} {:>14} {:>6}",
        "probe (ms)", "measured", "VLLM_CPU_TINY", "ratio"
    );
    for (name, m, p) in [
        ("TTFT, 64 tokens", measured.ttft_short, profile.ttft_short),
        ("TTFT, 960 tokens", measured.ttft_long, profile.ttft_long),
        (
            "decode step, alone",
            measured.step_alone,
            profile.step_alone,
        ),
        ("decode step, four", measured.step_four, profile.step_four),
    ] {
        println!("{name:<28} {m:>10.1} {p:>14.1} {:>6.2}", p / m);
    }
    Ok(())
}
