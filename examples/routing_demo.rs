//! The routing demo: simulated vLLM engines, a sidecar beside each, the example router on
//! their feeds, and a workload of shared system prompts and a hot prefix sent through the cost
//! rule and through round-robin; prints each policy's hit rate (the engines' own counters),
//! TTFT p50 / p99 and each engine's share, and fails (exit 1) unless the rule is ahead.
//!
//! ```text
//! cargo run --release -p kvevent-examples --example routing-demo
//! ```

use std::sync::Arc;

use kvevent_examples::demo::{self, Spec};
use kvevent_fleet::route::Policy;

fn main() -> anyhow::Result<()> {
    let spec = Spec::default();
    if std::env::args().len() > 1 {
        anyhow::bail!("routing-demo takes no arguments (what it runs is printed as it starts)");
    }
    let requests = Arc::new(demo::requests(&spec));
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
    println!("{}", demo::HEADER);
    let mut reports = Vec::new();
    for policy in [Policy::default(), Policy::RoundRobin] {
        let report = rt.block_on(demo::run(&spec, policy, &requests))?;
        println!("{}", demo::line(&report));
        reports.push(report);
    }
    match demo::verdict(&reports[0], &reports[1]) {
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
