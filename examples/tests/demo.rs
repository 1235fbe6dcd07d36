//! The routing demo's parts: its workload, its runs through the real sidecar and router to
//! simulated engines, and its verdict.

use std::sync::Arc;
use std::time::Duration;

// The example itself, its `main` unused here.
#[allow(dead_code, unreachable_pub)]
#[path = "../routing_demo.rs"]
mod demo;

use demo::{Report, Spec};
use kvevent_fleet::route::Policy;

#[test]
fn the_workload_mixes_shared_system_prompts_and_the_hot_prefix() {
    let spec = Spec::default();
    let requests = demo::requests(&spec);
    assert_eq!(requests.len(), spec.workload.requests);
    assert!(requests.windows(2).all(|w| w[0].at_s <= w[1].at_s));
    let hot = &requests
        .iter()
        .find(|r| r.at_s == 0.0)
        .expect("the hot prefix first, alone")
        .prompt[..2048];
    let with_hot = requests
        .iter()
        .filter(|r| r.prompt.starts_with(hot))
        .count();
    assert_eq!(with_hot, 75, "a quarter");
    // About the rate asked for: 300 at 12 a second.
    let last = requests.last().expect("requests").at_s;
    assert!((15.0..35.0).contains(&last), "{last}");
}

/// The demo at a small scale: each policy through two engines' sidecars and the router, the
/// hit rates from the engines' own counters. The rule keeps each system prompt on one engine;
/// round-robin sends it to both, whose caches (a third of the prompts each) thrash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rule_and_round_robin_through_sidecars_and_the_router() {
    let spec = Spec {
        engines: 2,
        blocks: 384,
        workload: kvevent_sim::workload::Spec {
            requests: 60,
            rate: 20.0,
            prompts: 6,
            zipf: 0.5,
            max_tokens: 4,
            seed: 3,
        },
        hot_share: 0.2,
        // Prompts computed 10x faster than the GPU profile: 20 requests a second of 1-4 k
        // tokens do not overload two engines, whose queues would outweigh their caches.
        time: kvevent_sim::TimeModel {
            prefill_us_per_token: kvevent_sim::TimeModel::GPU_8B.prefill_us_per_token / 10.0,
            ..kvevent_sim::TimeModel::GPU_8B
        },
    };
    let requests = Arc::new(demo::requests(&spec));
    let cost = demo::run(&spec, Policy::default(), &requests)
        .await
        .expect("cost");
    let rr = demo::run(&spec, Policy::RoundRobin, &requests)
        .await
        .expect("round-robin");
    for r in [&cost, &rr] {
        assert_eq!(r.failed, 0, "{r:?}");
        assert_eq!(r.shares.len(), 2, "{r:?}");
        assert!((r.shares.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{r:?}");
        assert!(r.hit_rate > 0.0 && r.hit_rate < 1.0, "{r:?}");
        assert!(
            r.ttft_p50 > Duration::ZERO && r.ttft_p50 <= r.ttft_p99,
            "{r:?}"
        );
    }
    assert_eq!(rr.shares, vec![0.5, 0.5], "round-robin alternates");
    assert!(
        cost.hit_rate > rr.hit_rate + 0.05,
        "cost {cost:?}\nround-robin {rr:?}"
    );
}

fn report(policy: Policy, hit_rate: f64, p50_ms: u64, failed: usize) -> Report {
    Report {
        policy,
        hit_rate,
        ttft_p50: Duration::from_millis(p50_ms),
        ttft_p99: Duration::from_millis(p50_ms * 4),
        shares: vec![0.5, 0.5],
        failed,
    }
}

#[test]
fn the_verdict_fails_loudly_unless_the_rule_is_ahead() {
    let rr = report(Policy::RoundRobin, 0.5, 40, 0);
    let ok = demo::verdict(&report(Policy::default(), 0.8, 30, 0), &rr).expect("ahead");
    assert!(
        ok.contains("1.6x round-robin's hit rate, 0.75x its TTFT p50"),
        "{ok}"
    );
    let behind = demo::verdict(&report(Policy::default(), 0.5, 50, 0), &rr).expect_err("behind");
    assert!(
        behind.contains("hit rate 50.0 % is not above")
            && behind.contains("TTFT p50 50ms is not below"),
        "{behind}"
    );
    let failed = demo::verdict(&report(Policy::default(), 0.8, 30, 2), &rr).expect_err("failed");
    assert!(failed.contains("2 requests failed"), "{failed}");
    assert!(
        demo::line(&rr).starts_with("round-robin    50.0 %"),
        "{}",
        demo::line(&rr)
    );
}
