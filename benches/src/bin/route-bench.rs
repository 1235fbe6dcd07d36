//! Routing on our events against what users run today (#56): a workload sent through the example
//! router (the real binary, `--policy P`) to simulated engines (`kvevent-simulator`'s, behind vLLM's HTTP
//! API, `/metrics` and KV-event wire, all in this process); the router's `Fleet` follows each
//! engine's KV events itself (`--engine NAME=tcp://…,replay=…,http=…`: the engine's sockets, its
//! load from its `/metrics`) and decides. Policies are run alternated, each on fresh engines.
//!
//! Workloads (`--workload`):
//! - `shared`: `--prompts` (64) system prompts of 1–4 k tokens under Zipf popularity (`--zipf`,
//!   s = 1), each request one of them and a unique user turn of 100–400 tokens; Poisson
//!   arrivals. The default cache (`--blocks`, 1,536 of 16 tokens) holds about an eighth of the
//!   system prompts: more than one engine holds, less than the fleet of 8 does.
//! - `multiturn`: conversations whose every turn is the whole conversation so far (the
//!   engine's answers included) and a new user turn; a turn comes a think time after the last.
//! - `hot`: one 2 k-token prefix in every request: served once alone (one engine holds it),
//!   then at more than one engine can serve (`--rate`).
//! - `mooncake`: the public Mooncake conversation trace (kvcache-ai/Mooncake,
//!   `FAST25-release/traces/conversation_trace.jsonl`, Apache-2.0; `benches/data`), each
//!   512-token block's `hash_id` made into token ids, its timestamps replayed `--time-scale`
//!   times faster.
//!
//! Printed per run: the prefix-cache hit rate from the engines' own counters and the
//! arrival-time oracle's (the most any engine held of each prompt when it arrived), TTFT p50 /
//! p99, end-to-end p50, throughput, each engine's share of requests, the router's CPU, and the
//! share of its predictions the engines' `cached_tokens` confirmed exactly. Times are the
//! simulated engines' (wall time × `--speed`, 1 by default: faster, and the router's and HTTP's
//! own latency is multiplied too).
//!
//! `cargo build --release -p kvevent-examples --example router &&
//!  cargo run --release -p kvevent-benches --bin route-bench -- [FLAGS]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvevent_sim::workload::{self, Planned, tokens};
use kvevent_sim::{Config, TimeModel};
use kvevent_simulator::client::{self, percentile};
use kvevent_simulator::{Serving, SimEngine};

const USAGE: &str =
    "usage: route-bench [--engines N] [--policies cost,prefix-only,least-loaded,round-robin]
  [--workload shared|multiturn|hot|mooncake] [--requests N] [--rate R] [--speed S] [--rounds K]
  [--prompts P] [--zipf S] [--blocks B] [--block-size T] [--time-scale X] [--max-tokens M] [--seed S]
  [--router PATH] [--prefill-us-per-token US] [--queue-us-per-request US]
  [--time-model gpu-8b|vllm-cpu|STEP_US,PREFILL_US,DECODE_US] [--ratios R,R,...] [--learn]
A workload through the example router to simulated engines, per policy, alternated.
--ratios runs the cost policy once per ratio, its queue weight R times the one given (the
prefill weight kept: only the ratio changes a choice), alternated with the other policies.
--learn adds a run of the cost policy given no weights: the router learns them from its
flights, starting from its defaults (printed with the weights it ended with).";

#[derive(Clone)]
struct Args {
    engines: usize,
    policies: Vec<String>,
    workload: String,
    requests: usize,
    rate: f64,
    speed: f64,
    rounds: usize,
    prompts: usize,
    zipf: f64,
    blocks: usize,
    block_size: usize,
    time_scale: f64,
    max_tokens: u32,
    seed: u64,
    router: std::path::PathBuf,
    /// The cost policy's weights (`None`: the router's defaults).
    prefill_us: Option<f64>,
    queue_us: Option<f64>,
    /// The simulated engines' speed.
    time: TimeModel,
    /// The cost policy's queue weight, times each (1: as given).
    ratios: Vec<f64>,
    /// A run of the cost policy learning its weights.
    learn: bool,
}

fn mooncake(a: &Args) -> anyhow::Result<Vec<Planned>> {
    use std::io::BufRead as _;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/mooncake-conversation-trace.jsonl.gz");
    let file = std::fs::File::open(&path).with_context(|| path.display().to_string())?;
    let lines = std::io::BufReader::new(flate2::read::GzDecoder::new(file)).lines();
    let mut out = Vec::new();
    for line in lines.take(a.requests) {
        let v: serde_json::Value = serde_json::from_str(&line?)?;
        let len = v["input_length"].as_u64().context("input_length")? as usize;
        let mut prompt = Vec::with_capacity(len);
        for h in v["hash_ids"].as_array().context("hash_ids")? {
            let h = h.as_u64().context("a hash id")?;
            let n = (len - prompt.len()).min(512);
            prompt.extend(tokens(7 << 40 | h, n));
        }
        out.push(Planned {
            at_s: v["timestamp"].as_f64().context("timestamp")? / 1000.0 / a.time_scale,
            prompt,
            max_tokens: (v["output_length"].as_u64().unwrap_or(1) as u32).clamp(1, a.max_tokens),
        });
    }
    Ok(out)
}

/// What one request saw.
struct Outcome {
    ttft_s: f64,
    e2e_s: f64,
    prompt: u32,
    oracle: u32,
    output: u32,
}

/// The example router, started as its binary, following `engines`; killed when dropped.
struct RouterProcess {
    guard: kvevent_benches::http::Guard,
    addr: String,
}

fn start_router(
    a: &Args,
    engines: &[SimEngine],
    policy: &str,
    weights: Option<(f64, f64)>,
) -> anyhow::Result<RouterProcess> {
    use std::io::BufRead as _;
    let mut cmd = std::process::Command::new(&a.router);
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--model",
        "sim",
        "--policy",
        policy,
    ]);
    if let Some(weights) = weights {
        cmd.arg("--prefill-us-per-token")
            .arg(weights.0.to_string())
            .arg("--queue-us-per-request")
            .arg(weights.1.to_string());
    }
    for e in engines {
        cmd.arg("--engine").arg(format!(
            "{}={},replay={},http=http://{}",
            e.name, e.events, e.replay, e.http
        ));
        cmd.arg("--upstream")
            .arg(format!("{}=http://{}", e.name, e.http));
    }
    let mut child = cmd
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .with_context(|| {
            format!(
                "{}: build it first (cargo build --release -p kvevent-examples --example router)",
                a.router.display()
            )
        })?;
    let stderr = child.stderr.take().context("stderr")?;
    let mut lines = std::io::BufReader::new(stderr).lines();
    let guard = kvevent_benches::http::Guard(child);
    let addr = loop {
        let line = lines.next().context("the router exited")??;
        if let Some(rest) = line.split("scoring on http://").nth(1) {
            break rest.split('/').next().unwrap_or_default().to_owned();
        }
    };
    // The rest of its log is not read; keep the pipe drained.
    std::thread::spawn(move || for _ in lines {});
    Ok(RouterProcess { guard, addr })
}

struct Report {
    policy: String,
    hit_rate: f64,
    oracle: f64,
    ttft: (f64, f64),
    e2e_p50: f64,
    rps: f64,
    tokens_per_s: f64,
    shares: Vec<f64>,
    router_cpu_s: f64,
    exact_share: f64,
    failed: usize,
    /// The weights the router weighed with at the end, when it learned them.
    learned: Option<(f64, f64)>,
}

async fn run(
    a: &Args,
    policy: &str,
    workload: &Arc<Vec<Planned>>,
    weights: Option<(f64, f64)>,
) -> anyhow::Result<Report> {
    let ctx = zmq::Context::new();
    let config = Config {
        block_size: a.block_size,
        num_blocks: a.blocks,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        time: a.time,
        prefix_caching: true,
    };
    let serving = Serving {
        speed: a.speed,
        // Mooncake's longest prompts, and their outputs.
        max_model_len: 1 << 20,
        ..Serving::new("sim")
    };
    let mut engines = Vec::new();
    for i in 0..a.engines {
        engines.push(SimEngine::start(&ctx, &format!("e{i:03}"), config.clone(), &serving).await?);
    }
    let router = start_router(a, &engines, policy, weights)?;
    let pid = router.guard.0.id();
    // Ready: every engine followed and exact.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let addr = router.addr.clone();
        let replicas = tokio::task::spawn_blocking(move || {
            kvevent_benches::http::get(&addr, "/replicas").unwrap_or_default()
        })
        .await?;
        let v: serde_json::Value = serde_json::from_str(&replicas).unwrap_or_default();
        let exact = v["replicas"]
            .as_array()
            .map_or(0, |r| r.iter().filter(|r| r["state"] == "exact").count());
        if exact == a.engines {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the router's replicas are not exact within 60 s: {replicas}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let cpu_before = kvevent_benches::procfs::cpu_seconds(&format!("/proc/{pid}/stat"));
    let client = client::client();
    let engines = Arc::new(engines);
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(workload.len());
    for i in 0..workload.len() {
        let (client, router, engines, workload) = (
            client.clone(),
            router.addr.clone(),
            engines.clone(),
            workload.clone(),
        );
        let speed = a.speed;
        tasks.push(tokio::spawn(async move {
            let planned = &workload[i];
            tokio::time::sleep_until(
                tokio::time::Instant::from_std(started)
                    + Duration::from_secs_f64(planned.at_s / speed),
            )
            .await;
            let oracle = engines
                .iter()
                .map(|e| e.cached_prefix(&planned.prompt, None))
                .max()
                .unwrap_or(0);
            let base = format!("http://{router}");
            let s =
                client::stream(&client, &base, "sim", planned, Duration::from_secs(3600)).await?;
            anyhow::Ok(Outcome {
                ttft_s: s.ttft.as_secs_f64() * speed,
                e2e_s: s.e2e.as_secs_f64() * speed,
                prompt: planned.prompt.len() as u32,
                oracle,
                output: s.output,
            })
        }));
    }
    let mut outcomes = Vec::new();
    let mut failed = 0;
    for t in tasks {
        match t.await? {
            Ok(o) => outcomes.push(o),
            Err(_) => failed += 1,
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = kvevent_benches::procfs::cpu_seconds(&format!("/proc/{pid}/stat")) - cpu_before;
    let addr = router.addr.clone();
    let (metrics, replicas) = tokio::task::spawn_blocking(move || {
        (
            kvevent_benches::http::get(&addr, "/metrics").unwrap_or_default(),
            kvevent_benches::http::get(&addr, "/replicas").unwrap_or_default(),
        )
    })
    .await?;
    let replicas: serde_json::Value = serde_json::from_str(&replicas).unwrap_or_default();
    let w = &replicas["weights"];
    let learned = (w["learned"] == true).then(|| {
        (
            w["prefill_us_per_token"].as_f64().unwrap_or(f64::NAN),
            w["queue_us_per_request"].as_f64().unwrap_or(f64::NAN),
        )
    });
    drop(router);
    let (queries, hits) = engines.iter().fold((0, 0), |(q, h), e| {
        let (eq, eh) = e.prefix_cache();
        (q + eq, h + eh)
    });
    let prompt_tokens: u64 = outcomes.iter().map(|o| u64::from(o.prompt)).sum();
    let oracle: u64 = outcomes.iter().map(|o| u64::from(o.oracle)).sum();
    let served: Vec<f64> = engines
        .iter()
        .map(|e| {
            metrics
                .lines()
                .filter(|l| {
                    l.starts_with("kvevent_router_responses_total")
                        && l.contains(&format!("replica=\"{}\"", e.name))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .fold(0.0, |a, b| a + b)
        })
        .collect();
    let total: f64 = served.iter().sum::<f64>().max(1.0);
    let predictions = kvevent_benches::http::sum(&metrics, "kvevent_router_predictions_total");
    let exact: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("kvevent_router_predictions_total") && l.contains("outcome=\"exact\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let mut ttft: Vec<f64> = outcomes.iter().map(|o| o.ttft_s).collect();
    let mut e2e: Vec<f64> = outcomes.iter().map(|o| o.e2e_s).collect();
    let sim_s = wall * a.speed;
    Ok(Report {
        policy: policy.to_owned(),
        hit_rate: hits as f64 / (queries as f64).max(1.0),
        oracle: oracle as f64 / (prompt_tokens as f64).max(1.0),
        ttft: (percentile(&mut ttft, 0.5), percentile(&mut ttft, 0.99)),
        e2e_p50: percentile(&mut e2e, 0.5),
        rps: outcomes.len() as f64 / sim_s,
        tokens_per_s: outcomes.iter().map(|o| f64::from(o.output)).sum::<f64>() / sim_s,
        shares: served.iter().map(|s| s / total).collect(),
        router_cpu_s: cpu,
        exact_share: exact / predictions.max(1.0),
        failed,
        learned,
    })
}

fn print(r: &Report) {
    let max_share = r.shares.iter().copied().fold(0.0, f64::max);
    let shares = if r.shares.len() <= 8 {
        r.shares
            .iter()
            .map(|s| format!("{:.0}", s * 100.0))
            .collect::<Vec<_>>()
            .join("/")
    } else {
        format!("max {:.1}", max_share * 100.0)
    };
    println!(
        "{:<13} hit {:>5.1} % (oracle {:>5.1} %)  TTFT p50 {:>7.3} s p99 {:>7.3} s  e2e p50 {:>7.2} s  {:>5.2} req/s {:>7.0} tok/s  share % {shares}  router CPU {:.2} s  exact {:>5.1} %{}",
        r.policy,
        r.hit_rate * 100.0,
        r.oracle * 100.0,
        r.ttft.0,
        r.ttft.1,
        r.e2e_p50,
        r.rps,
        r.tokens_per_s,
        r.router_cpu_s,
        r.exact_share * 100.0,
        if r.failed > 0 {
            format!("  {} FAILED", r.failed)
        } else {
            String::new()
        }
    );
    if let Some((p, q)) = r.learned {
        println!(
            "{:<13} learned --prefill-us-per-token {p:.1} --queue-us-per-request {q:.0}",
            ""
        );
    }
}

fn main() -> anyhow::Result<()> {
    let mut cli = kvevent_benches::Cli::new(USAGE);
    let mut a = Args {
        engines: 8,
        policies: kvevent_fleet::route::Policy::NAMES
            .iter()
            .map(|s| (*s).to_owned())
            .collect(),
        workload: "shared".into(),
        requests: 400,
        rate: 8.0,
        speed: 1.0,
        rounds: 1,
        prompts: 64,
        zipf: 1.0,
        blocks: 1536,
        block_size: 16,
        time_scale: 1.0,
        max_tokens: 64,
        seed: 7,
        router: std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/release/examples/router"),
        prefill_us: None,
        queue_us: None,
        time: TimeModel::GPU_8B,
        ratios: vec![1.0],
        learn: false,
    };
    while let Some(flag) = cli.arg() {
        match flag.as_str() {
            "--engines" => a.engines = cli.value(&flag)?,
            "--policies" => {
                let v: String = cli.value(&flag)?;
                a.policies = v.split(',').map(str::to_owned).collect();
                for p in &a.policies {
                    p.parse::<kvevent_fleet::route::Policy>()
                        .map_err(|e| cli.error(&e.to_string()))?;
                }
            }
            "--workload" => a.workload = cli.value(&flag)?,
            "--requests" => a.requests = cli.value(&flag)?,
            "--rate" => a.rate = cli.value(&flag)?,
            "--speed" => a.speed = cli.value(&flag)?,
            "--rounds" => a.rounds = cli.value(&flag)?,
            "--prompts" => a.prompts = cli.value(&flag)?,
            "--zipf" => a.zipf = cli.value(&flag)?,
            "--blocks" => a.blocks = cli.value(&flag)?,
            "--block-size" => a.block_size = cli.value(&flag)?,
            "--time-scale" => a.time_scale = cli.value(&flag)?,
            "--max-tokens" => a.max_tokens = cli.value(&flag)?,
            "--seed" => a.seed = cli.value(&flag)?,
            "--router" => a.router = cli.value(&flag)?,
            "--prefill-us-per-token" => a.prefill_us = Some(cli.value(&flag)?),
            "--queue-us-per-request" => a.queue_us = Some(cli.value(&flag)?),
            "--time-model" => {
                let v: String = cli.value(&flag)?;
                a.time = v.parse().map_err(|e: String| cli.error(&e))?;
            }
            "--ratios" => {
                let v: String = cli.value(&flag)?;
                a.ratios = v
                    .split(',')
                    .map(|r| r.parse::<f64>().ok().filter(|r| r.is_finite() && *r >= 0.0))
                    .collect::<Option<_>>()
                    .ok_or_else(|| cli.error("--ratios: numbers, 0 or more, comma-separated"))?;
            }
            "--learn" => a.learn = true,
            other => return Err(cli.error(&format!("unknown flag `{other}`"))),
        }
    }
    cli.done()?;
    let spec = workload::Spec {
        requests: a.requests,
        rate: a.rate,
        prompts: a.prompts,
        zipf: a.zipf,
        max_tokens: a.max_tokens,
        seed: a.seed,
    };
    let workload = Arc::new(match a.workload.as_str() {
        "shared" => workload::shared(&spec),
        "hot" => workload::hot(&spec),
        "multiturn" => workload::multiturn(&spec),
        "mooncake" => mooncake(&a)?,
        other => anyhow::bail!("`{other}` is not a workload: shared, multiturn, hot or mooncake"),
    });
    let prompt_tokens: usize = workload.iter().map(|p| p.prompt.len()).sum();
    println!(
        "{} engines ({} blocks of {} tokens each, time model {:.0} us a step, {:.1} us a prompt token, {:.0} us a sequence, {}x speed), workload {}: {} requests, {:.0} prompt tokens on average, over {:.0} s",
        a.engines,
        a.blocks,
        a.block_size,
        a.time.step_us,
        a.time.prefill_us_per_token,
        a.time.decode_us_per_seq,
        a.speed,
        a.workload,
        workload.len(),
        prompt_tokens as f64 / workload.len().max(1) as f64,
        workload.last().map_or(0.0, |p| p.at_s),
    );
    // The cost policy's weights: the router's defaults unless given.
    let defaults = kvevent_fleet::route::Weights::default();
    let weights = (
        a.prefill_us.unwrap_or(defaults.prefill_us_per_token),
        a.queue_us.unwrap_or(defaults.queue_us_per_request),
    );
    println!(
        "cost weights: --prefill-us-per-token {:.0} --queue-us-per-request {:.0}",
        weights.0, weights.1
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // Each run: its label, the policy, and the cost policy's weights (None: learned).
    type Weighed = Option<(f64, f64)>;
    let mut runs: Vec<(String, &str, Weighed)> = Vec::new();
    for policy in &a.policies {
        if policy != "cost" {
            runs.push((policy.clone(), policy, None));
            continue;
        }
        for ratio in &a.ratios {
            let label = if a.ratios.len() > 1 {
                format!("cost x{ratio}")
            } else {
                "cost".to_owned()
            };
            runs.push((label, policy, Some((weights.0, weights.1 * ratio))));
        }
        if a.learn {
            runs.push(("cost learned".to_owned(), policy, None));
        }
    }
    for round in 0..a.rounds {
        for (label, policy, weights) in &runs {
            let mut report = rt.block_on(run(&a, policy, &workload, *weights))?;
            if a.rounds > 1 {
                print!("round {}  ", round + 1);
            }
            report.policy = label.clone();
            print(&report);
        }
    }
    Ok(())
}
