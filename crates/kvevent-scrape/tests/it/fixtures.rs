//! Every shared fixture, parsed and read.

use std::path::PathBuf;

use kvevent_scrape::stats::{self, Deltas};
use kvevent_scrape::{CacheTier, Profile, StatsConfig, StatsError, text};

pub(crate) fn fixture(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures/metrics")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn config() -> StatsConfig {
    StatsConfig {
        cache_size_bytes: 1_000_000,
        concurrency_ceiling: 10,
        ..StatsConfig::default()
    }
}

fn read(name: &str, config: &StatsConfig) -> Result<stats::Reading, StatsError> {
    stats::read(&text::parse(&fixture(name)).expect("parse"), config)
}

#[test]
fn every_fixture_parses_and_reads() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/metrics");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).expect("dir") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_owned();
        let e = text::parse(&fixture(&name)).unwrap_or_else(|err| panic!("{name}: {err}"));
        assert!(!e.samples.is_empty(), "{name}");
        let reading = stats::read(&e, &config()).unwrap_or_else(|err| panic!("{name}: {err}"));
        assert!(reading.profile.is_some(), "{name}");
        println!("ok {name}: {reading:?}");
        n += 1;
    }
    assert!(n >= 6);
}

#[test]
fn two_ticks_give_the_hit_rate_of_the_interval() {
    let cfg = config();
    let mut deltas = Deltas::default();
    let first = deltas.next(read("vllm-0.33-tick1.txt", &cfg).expect("tick1"), &cfg);
    assert_eq!(first.hit_rate, 0.0, "no delta on the first scrape");
    assert_eq!(first.cache_memory_bytes, 42_100);
    assert!((first.pressure - 0.4).abs() < 1e-6);
    let second = deltas.next(read("vllm-0.33-tick2.txt", &cfg).expect("tick2"), &cfg);
    // (37976 - 30976) / (58213 - 48213)
    assert!((second.hit_rate - 0.7).abs() < 1e-6, "{}", second.hit_rate);
    assert_eq!(second.cache_memory_bytes, 83_700);
    assert!((second.pressure - 0.7).abs() < 1e-6);
}

#[test]
fn a_counter_reset_gives_zero_not_a_negative_rate() {
    let cfg = config();
    let mut deltas = Deltas::default();
    deltas.next(read("vllm-0.33-tick2.txt", &cfg).expect("tick2"), &cfg);
    let after_restart = deltas.next(read("vllm-0.33-tick1.txt", &cfg).expect("tick1"), &cfg);
    assert_eq!(after_restart.hit_rate, 0.0);
}

/// A partial body (the prefix-cache counters missing) reads 0 and keeps the baseline: the
/// next full scrape gives the rate since the last one that had them.
#[test]
fn a_scrape_without_the_counters_keeps_the_last_baseline() {
    let cfg = config();
    let mut deltas = Deltas::default();
    let tick1 = read("vllm-0.33-tick1.txt", &cfg).expect("tick1");
    let partial = stats::Reading {
        hits: None,
        queries: None,
        ..tick1.clone()
    };
    deltas.next(tick1, &cfg);
    assert_eq!(deltas.next(partial, &cfg).hit_rate, 0.0);
    let second = deltas.next(read("vllm-0.33-tick2.txt", &cfg).expect("tick2"), &cfg);
    // (37976 - 30976) / (58213 - 48213), as if the partial scrape had not been.
    assert!((second.hit_rate - 0.7).abs() < 1e-6, "{}", second.hit_rate);
}

#[test]
fn the_model_filter_keeps_one_model() {
    let cfg = StatsConfig {
        model_name: Some("primary".into()),
        ..config()
    };
    let r = read("vllm-multimodel.txt", &cfg).expect("read");
    assert_eq!(
        (r.running, r.waiting, r.usage),
        (Some(2.0), Some(0.0), Some(0.2))
    );
    assert_eq!((r.hits, r.queries), (Some(10.0), Some(40.0)));
    let cfg = StatsConfig {
        model_name: Some("absent".into()),
        ..config()
    };
    let err = read("vllm-multimodel.txt", &cfg).expect_err("no such model");
    assert_eq!(
        err.to_string(),
        "none of the series of profile vllm is present for model_name=absent"
    );
}

#[test]
fn dp_engines_are_summed_and_usage_averaged() {
    let r = read("vllm-dp2.txt", &config()).expect("read");
    assert_eq!((r.running, r.waiting), (Some(10.0), Some(4.0)));
    assert!((r.usage.expect("usage") - 0.4).abs() < 1e-9);
    assert_eq!((r.hits, r.queries), (Some(1000.0), Some(4000.0)));
}

#[test]
fn openmetrics_names_with_underscores_are_read() {
    let r = read("vllm-openmetrics.txt", &config()).expect("read");
    assert_eq!(r.profile, Some(Profile::Vllm));
    assert_eq!((r.running, r.usage), (Some(1.0), Some(0.1)));
    assert_eq!((r.hits, r.queries), (Some(5.0), Some(10.0)));
}

#[test]
fn the_legacy_profile_and_the_cache_tier_choice() {
    let r = read("vllm-0.10-legacy.txt", &config()).expect("read");
    assert_eq!(r.profile, Some(Profile::VllmLegacy));
    assert_eq!(
        (r.usage, r.hits, r.queries),
        (Some(0.61), Some(800.0), Some(1000.0))
    );
    // A pinned tier whose gauge is absent reads as unknown, named; the load still counts.
    let cfg = StatsConfig {
        cache_tier: CacheTier::Kv,
        ..config()
    };
    let r = read("vllm-0.10-legacy.txt", &cfg).expect("the load gauges are there");
    assert_eq!(r.usage, None);
    assert_eq!(r.absent, ["vllm:kv_cache_usage_perc"]);
    let s = Deltas::default().next(r, &cfg);
    assert_eq!(s.cache_memory_bytes, 0);
    assert!(s.pressure > 0.0);
}

#[test]
fn auto_prefers_a_non_zero_gauge_and_sglang_is_read_directly() {
    let text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n\
                vllm:kv_cache_usage_perc 0\nvllm:gpu_cache_usage_perc 0.3\n";
    let r = stats::read(&text::parse(text).expect("parse"), &config()).expect("read");
    assert_eq!(r.usage, Some(0.3));
    let sglang = "sglang:num_running_reqs{model_name=\"m\"} 4\nsglang:num_queue_reqs{model_name=\"m\"} 2\n\
                  sglang:token_usage{model_name=\"m\"} 0.5\nsglang:cache_hit_rate{model_name=\"m\"} 0.25\n";
    let cfg = config();
    let r = stats::read(&text::parse(sglang).expect("parse"), &cfg).expect("read");
    assert_eq!(r.profile, Some(Profile::Sglang));
    let s = Deltas::default().next(r, &cfg);
    assert_eq!((s.hit_rate, s.cache_memory_bytes), (0.25, 500_000));
    assert!((s.pressure - 0.6).abs() < 1e-6);
}

#[test]
fn offload_tier_counters_are_sent_as_running_totals() {
    let cfg = config();
    let tick = |hits: u32, queries: u32| {
        let text = format!(
            "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n\
             vllm:external_prefix_cache_hits_total {hits}\nvllm:external_prefix_cache_queries_total {queries}\n"
        );
        stats::read(&text::parse(&text).expect("parse"), &cfg).expect("read")
    };
    let mut deltas = Deltas::default();
    let s = deltas.next(tick(10, 100), &cfg);
    assert_eq!((s.t2_hit_tokens, s.t2_query_tokens), (10, 100));
    let s = deltas.next(tick(25, 160), &cfg);
    assert_eq!((s.t2_hit_tokens, s.t2_query_tokens), (25, 160));
    // The engine restarted: its counters start again, a new total, never negative.
    let s = deltas.next(tick(3, 7), &cfg);
    assert_eq!((s.t2_hit_tokens, s.t2_query_tokens), (3, 7));
}

fn parse_read(text: &str, cfg: &StatsConfig) -> Result<stats::Reading, StatsError> {
    stats::read(&text::parse(text).expect("parse"), cfg)
}

#[test]
fn non_finite_samples_are_skipped_counted_and_never_reach_the_stats() {
    let cfg = config();
    // Rank 1's gauges are NaN / +Inf: the aggregate uses rank 0's.
    let text = "vllm:num_requests_running{engine=\"0\"} 2\nvllm:num_requests_running{engine=\"1\"} NaN\n\
                vllm:num_requests_waiting{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"1\"} +Inf\n\
                vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"1\"} NaN\n";
    let r = parse_read(text, &cfg).expect("read");
    assert_eq!(
        (r.running, r.waiting, r.usage),
        (Some(2.0), Some(1.0), Some(0.5))
    );
    assert_eq!(r.non_finite, 3);
    // A stat with no finite input is unknown: 0, never NaN.
    let text = "vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc NaN\n";
    let r = parse_read(text, &cfg).expect("read");
    assert_eq!(
        r.absent,
        ["vllm:num_requests_running", "vllm:kv_cache_usage_perc"]
    );
    let s = Deltas::default().next(r, &cfg);
    assert!(s.pressure.is_finite() && s.hit_rate.is_finite());
    assert_eq!((s.pressure, s.cache_memory_bytes), (0.0, 0));
}

#[test]
fn an_endpoint_with_only_the_load_gauges_gives_stats() {
    let cfg = config();
    let r = parse_read(
        "vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n",
        &cfg,
    )
    .expect("the load gauges are enough");
    assert_eq!(r.profile, Some(Profile::Vllm));
    assert_eq!(r.absent, ["vllm:kv_cache_usage_perc"]);
    let s = Deltas::default().next(r, &cfg);
    assert!((s.pressure - 0.4).abs() < 1e-6);
    assert_eq!(s.cache_memory_bytes, 0);
    // A profile pinned to an engine whose series are all absent is a failed scrape.
    let sglang = StatsConfig {
        profile: Some(Profile::Sglang),
        ..config()
    };
    assert!(matches!(
        parse_read("vllm:num_requests_running 3\n", &sglang),
        Err(StatsError::NoSeries { .. })
    ));
}

#[test]
fn sglang_priority_breakdowns_are_not_added_to_their_total() {
    let cfg = config();
    let text = "sglang:num_running_reqs{dp_rank=\"0\",priority=\"\"} 6\n\
                sglang:num_running_reqs{dp_rank=\"0\",priority=\"0\"} 4\n\
                sglang:num_running_reqs{dp_rank=\"0\",priority=\"1\"} 2\n\
                sglang:num_running_reqs{dp_rank=\"1\"} 3\n\
                sglang:num_queue_reqs{dp_rank=\"0\"} 1\nsglang:num_queue_reqs{dp_rank=\"1\"} 1\n\
                sglang:token_usage{dp_rank=\"0\"} 0.2\nsglang:token_usage{dp_rank=\"1\"} 0.4\n";
    let r = parse_read(text, &cfg).expect("read");
    // Ranks add up (6 + 3), the breakdown is not counted again; usage is the mean.
    assert_eq!((r.running, r.waiting), (Some(9.0), Some(2.0)));
    assert!((r.usage.expect("usage") - 0.3).abs() < 1e-9);
    // Only a breakdown: it is the total.
    let text =
        "sglang:num_running_reqs{priority=\"0\"} 4\nsglang:num_running_reqs{priority=\"1\"} 2\n";
    let r = parse_read(text, &cfg).expect("read");
    assert_eq!(r.running, Some(6.0));
}

#[test]
fn an_unknown_engine_is_an_error() {
    let e = text::parse("process_cpu_seconds_total 1\n").expect("parse");
    assert_eq!(stats::read(&e, &config()), Err(StatsError::UnknownEngine));
}
