//! The routing demo: simulated vLLM engines, a sidecar beside each, the example router on
//! their feeds, and a workload of shared system prompts and a hot prefix sent through the cost
//! rule and through round-robin; prints each policy's hit rate (the engines' own counters),
//! TTFT p50 / p99 and each engine's share, and fails (exit 1) unless the rule is ahead.
//!
//! ```text
//! cargo run --release -p kvevent-examples --example routing-demo
//! ```
//!
//! All in one process, over loopback sockets, each part the real one: the engines
//! (`kvevent_simulator`), a feed-only sidecar each (`kvevent_sidecar::start`), the example
//! router (`kvevent_examples::router`) following the sidecars' feeds and routing to the
//! engines' servers. Hit rates are the engines' own counters (their `/metrics`), TTFT the
//! client's, shares the router's `/metrics`. `tests/demo.rs` runs it small.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvevent_fleet::route::Policy;
use kvevent_sim::workload::{self, Planned};
use kvevent_sim::{Config, TimeModel};
use kvevent_simulator::client::{self, percentile};
use kvevent_simulator::{Serving, SimEngine};

use kvevent_examples::router::{self, Router, RouterConfig};
use kvevent_fleet::discover::Listed;

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Simulated engines, each with a sidecar.
    pub engines: usize,
    /// Each engine's KV cache, in blocks of 16 tokens.
    pub blocks: usize,
    /// The requests: shared system prompts ([`workload::shared`]) with a hot prefix
    /// ([`workload::hot`]) in `hot_share` of them.
    pub workload: workload::Spec,
    /// The share of requests with the hot prefix.
    pub hot_share: f64,
    /// The engines' speed.
    pub time: TimeModel,
}

impl Default for Spec {
    /// 4 engines of 1,536 blocks (about 60 % of the system prompts each), 300 requests at 12 a
    /// second over 16 system prompts, a quarter of them with the hot prefix, 32 tokens out,
    /// the GPU 8B time model: about 25 s a policy.
    fn default() -> Self {
        Self {
            engines: 4,
            blocks: 1536,
            workload: workload::Spec {
                requests: 300,
                rate: 12.0,
                prompts: 16,
                zipf: 1.0,
                max_tokens: 32,
                seed: 7,
            },
            hot_share: 0.25,
            time: TimeModel::GPU_8B,
        }
    }
}

/// The requests of `spec`: shared system prompts and the hot prefix, merged in time.
pub fn requests(spec: &Spec) -> Vec<Planned> {
    let w = &spec.workload;
    let hot = (w.requests as f64 * spec.hot_share).round() as usize;
    let mut all = workload::shared(&workload::Spec {
        requests: w.requests - hot,
        rate: w.rate * (1.0 - spec.hot_share),
        ..w.clone()
    });
    if hot > 0 {
        all.extend(workload::hot(&workload::Spec {
            requests: hot,
            rate: w.rate * spec.hot_share,
            seed: w.seed ^ 0x5eed,
            ..w.clone()
        }));
    }
    all.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    all
}

/// What one policy did.
#[derive(Debug, Clone)]
pub struct Report {
    /// The policy.
    pub policy: Policy,
    /// Prompt tokens the engines found cached over those they looked up (their counters).
    pub hit_rate: f64,
    /// Time to the first token, p50 and p99, as the client saw it.
    pub ttft_p50: Duration,
    /// See `ttft_p50`.
    pub ttft_p99: Duration,
    /// Each engine's share of the requests, by the router's count of responses.
    pub shares: Vec<f64>,
    /// Requests that failed (each one's error is printed).
    pub failed: usize,
}

/// Runs the workload through the router under `policy`, on fresh engines and sidecars.
pub async fn run(
    spec: &Spec,
    policy: Policy,
    requests: &Arc<Vec<Planned>>,
) -> anyhow::Result<Report> {
    let ctx = zmq::Context::new();
    let config = Config {
        block_size: 16,
        num_blocks: spec.blocks,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        time: spec.time,
        prefix_caching: true,
    };
    let serving = Serving::new("sim");
    let mut engines = Vec::new();
    let mut sidecars = Vec::new();
    let mut router_config = RouterConfig::new("sim");
    router_config.policy = policy;
    for i in 0..spec.engines {
        let engine = SimEngine::start(&ctx, &format!("e{i}"), config.clone(), &serving).await?;
        let settings = kvevent_sidecar::Settings {
            engine_endpoint: engine.events.as_str().into(),
            replay_endpoint: engine.replay.as_str().into(),
            feed_address: "127.0.0.1:0".into(),
            replica_id: engine.name.clone(),
            model_id: "sim".into(),
            engine_metrics_url: format!("http://{}/metrics", engine.http).as_str().into(),
            metrics_address: "127.0.0.1:0".into(),
            feed_ring_bytes: 4 << 20,
            ..kvevent_sidecar::Settings::default()
        };
        let sidecar = kvevent_sidecar::start(&settings, &ctx)
            .await
            .with_context(|| format!("the sidecar of {}", engine.name))?;
        let feed = sidecar.feed_addr().context("the sidecar's feed")?;
        router_config.replicas.extend([
            Listed::sidecar(&format!("{}=http://{feed}", engine.name))
                .map_err(anyhow::Error::msg)?,
            Listed::upstream(&format!("{}=http://{}", engine.name, engine.http))
                .map_err(anyhow::Error::msg)?,
        ]);
        engines.push(engine);
        sidecars.push(sidecar);
    }
    let router = Arc::new(Router::start(router_config)?);
    let (addr, server) = router::bind("127.0.0.1:0", router.clone()).await?;
    // Ready: every replica exact, through its sidecar's feed.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let replicas = router.replicas();
        let exact = replicas["replicas"]
            .as_array()
            .map_or(0, |r| r.iter().filter(|r| r["state"] == "exact").count());
        if exact == spec.engines {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the router's replicas are not all exact within 30 s: {replicas}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let http = client::client();
    let base = format!("http://{addr}");
    let started = tokio::time::Instant::now();
    let tasks: Vec<_> = (0..requests.len())
        .map(|i| {
            let (http, base, requests) = (http.clone(), base.clone(), requests.clone());
            tokio::spawn(async move {
                let planned = &requests[i];
                tokio::time::sleep_until(started + Duration::from_secs_f64(planned.at_s)).await;
                client::stream(&http, &base, "sim", planned, Duration::from_secs(60)).await
            })
        })
        .collect();
    let mut ttft = Vec::new();
    let mut failed = 0;
    for t in tasks {
        match t.await? {
            Ok(s) => ttft.push(s.ttft.as_secs_f64()),
            Err(e) => {
                failed += 1;
                eprintln!("a request failed: {e:#}");
            }
        }
    }
    let (mut queries, mut hits) = (0.0, 0.0);
    for e in &engines {
        let text = get(&http, &format!("http://{}/metrics", e.http)).await?;
        queries += sample(&text, "vllm:prefix_cache_queries_total", "");
        hits += sample(&text, "vllm:prefix_cache_hits_total", "");
    }
    let metrics = router.metrics();
    let served: Vec<f64> = engines
        .iter()
        .map(|e| {
            sample(
                &metrics,
                "kvevent_router_responses_total",
                &format!("replica=\"{}\"", e.name),
            )
        })
        .collect();
    let total = served.iter().sum::<f64>().max(1.0);
    server.abort();
    for s in sidecars {
        s.shutdown(Duration::from_secs(1)).await;
    }
    Ok(Report {
        policy,
        hit_rate: hits / f64::max(queries, 1.0),
        ttft_p50: Duration::from_secs_f64(percentile(&mut ttft, 0.5)),
        ttft_p99: Duration::from_secs_f64(percentile(&mut ttft, 0.99)),
        shares: served.iter().map(|s| s / total).collect(),
        failed,
    })
}

/// `GET url`'s body, within 5 s.
async fn get(http: &client::Client, url: &str) -> anyhow::Result<String> {
    use http_body_util::BodyExt as _;
    let request = hyper::Request::get(url).body(Default::default())?;
    let body = tokio::time::timeout(Duration::from_secs(5), async {
        let response = http.request(request).await?;
        anyhow::Ok(response.into_body().collect().await?.to_bytes())
    })
    .await
    .with_context(|| format!("GET {url}: no answer within 5 s"))??;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The sum of `name`'s samples whose labels contain `labels`, in a Prometheus exposition.
fn sample(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
                && l.contains(labels)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The table's header, over the lines of `line`.
pub const HEADER: &str =
    "policy       hit rate     TTFT p50     TTFT p99   share of requests by engine, %";

/// One line of the table.
pub fn line(r: &Report) -> String {
    format!(
        "{:<12} {:>6.1} %  {:>8.0} ms  {:>8.0} ms   {}{}",
        r.policy.as_str(),
        r.hit_rate * 100.0,
        r.ttft_p50.as_secs_f64() * 1000.0,
        r.ttft_p99.as_secs_f64() * 1000.0,
        r.shares
            .iter()
            .map(|s| format!("{:.0}", s * 100.0))
            .collect::<Vec<_>>()
            .join(" / "),
        if r.failed > 0 {
            format!("   {} FAILED", r.failed)
        } else {
            String::new()
        }
    )
}

/// The demo's claim: the rule ahead of round-robin on hit rate and TTFT p50, every request
/// answered. Else why not, loud.
pub fn verdict(cost: &Report, round_robin: &Report) -> Result<String, String> {
    let mut wrong = Vec::new();
    if cost.failed + round_robin.failed > 0 {
        wrong.push(format!(
            "{} requests failed (their errors are above)",
            cost.failed + round_robin.failed
        ));
    }
    if cost.hit_rate <= round_robin.hit_rate {
        wrong.push(format!(
            "the cost rule's hit rate {:.1} % is not above round-robin's {:.1} %",
            cost.hit_rate * 100.0,
            round_robin.hit_rate * 100.0
        ));
    }
    if cost.ttft_p50 >= round_robin.ttft_p50 {
        wrong.push(format!(
            "the cost rule's TTFT p50 {:?} is not below round-robin's {:?}",
            cost.ttft_p50, round_robin.ttft_p50
        ));
    }
    if !wrong.is_empty() {
        return Err(wrong.join("; "));
    }
    Ok(format!(
        "the cost rule: {:.1}x round-robin's hit rate, {:.2}x its TTFT p50, {:.2}x its p99",
        cost.hit_rate / round_robin.hit_rate.max(f64::MIN_POSITIVE),
        cost.ttft_p50.as_secs_f64() / round_robin.ttft_p50.as_secs_f64(),
        cost.ttft_p99.as_secs_f64() / round_robin.ttft_p99.as_secs_f64().max(f64::MIN_POSITIVE),
    ))
}

fn main() -> anyhow::Result<()> {
    let spec = Spec::default();
    if std::env::args().len() > 1 {
        anyhow::bail!("routing-demo takes no arguments (what it runs is printed as it starts)");
    }
    let requests = Arc::new(requests(&spec));
    let w = &spec.workload;
    println!(
        "{} simulated vLLM engines (GPU 8B time model, {} KV blocks of 16 tokens each), a \
         feed-only sidecar beside each, the example router following their feeds;\n{} requests \
         at {} a second, streamed: {} system prompts of 1-4 k tokens (Zipf) with a user turn, \
         {:.0} % of them led by one hot 2 k-token prefix; {} tokens out. Each policy on fresh \
         engines.\n",
        spec.engines,
        spec.blocks,
        requests.len(),
        w.rate,
        w.prompts,
        spec.hot_share * 100.0,
        w.max_tokens
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!("{}", HEADER);
    let mut reports = Vec::new();
    for policy in [Policy::default(), Policy::RoundRobin] {
        let report = rt.block_on(run(&spec, policy, &requests))?;
        println!("{}", line(&report));
        reports.push(report);
    }
    match verdict(&reports[0], &reports[1]) {
        Ok(line) => {
            println!("\n{line}");
            Ok(())
        }
        Err(why) => {
            eprintln!("\nTHE DEMO FAILED: {why}");
            std::process::exit(1)
        }
    }
}
