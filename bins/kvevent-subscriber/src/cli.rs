//! The command line: the Go sidecar's flags (same names, meanings and defaults) and ours.
//!
//! Flags are the top layer over defaults, the `--config` TOML file and `KVEVENT_*` variables:
//! only the flags actually given are passed on, so an absent flag never hides a lower layer.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use kvevent_pipeline as pipeline;
use serde::Serialize;

/// `--version`: the version, the commit it was built from, the vLLM releases it decodes.
const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("KVEVENT_GIT_COMMIT"),
    ")\nvLLM KV-event wire: releases 0.9.0 to 0.33.0 decoded and encoded as each writes it; newer ones decoded (unknown fields and event types skipped and counted)",
);

#[derive(Debug, Parser)]
#[command(
    name = "kvevent-subscriber",
    version,
    long_version = LONG_VERSION,
    about = "Sidecar next to a vLLM replica: reports its KV-cache events and stats to the InferenceCache server.",
    long_about = "Sidecar next to a vLLM replica: subscribes to the engine's KV-cache events (with replay of missed batches), maps them onto the InferenceCache contract and reports them to the server; scrapes the engine's /metrics for replica stats.\n\nEvery option can also be set in the --config TOML file (same name with underscores) or as an environment variable KVEVENT_<NAME>. Precedence, lowest first: defaults, file, environment, flags. Durations are written Go's way (50ms, 10s, 1m30s). Go-style single-dash flags (-replica-id=x) are accepted.",
    args_conflicts_with_subcommands = true,
    // Go's flag package takes a flag given twice, the last one winning; manifests that append
    // override args rely on it.
    args_override_self = true
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    /// TOML file with options.
    #[arg(long, env = "KVEVENT_CONFIG", value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) options: Options,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run a self-contained demo: an in-process engine, the real pipeline over loopback
    /// sockets, a recording InferenceCache server and a served /metrics fixture.
    Demo {
        /// Engine steps to publish.
        #[arg(long, default_value_t = 200)]
        batches: u64,
    },
}

/// Every option; `None` when the flag was not given.
#[derive(Debug, Default, clap::Args, Serialize)]
pub(crate) struct Options {
    /// Engine KV-event PUB endpoint
    #[arg(long, value_name = "ENDPOINT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_endpoint: Option<String>,
    /// The engine's own list of its KV-event endpoints: vLLM 0.31+'s /kv_event_sources (e.g. http://127.0.0.1:8000/kv_event_sources) or SGLang 0.5.13+'s /server_info (e.g. http://127.0.0.1:30000/server_info): every DP rank's PUB and replay endpoints are read from it (replacing --engine-endpoint, --replay-endpoint and --dp-size), and read again when a rank's connection is lost for good
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_discovery_url: Option<String>,
    /// How long to wait at start for the discovery listing to answer
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_discovery_timeout: Option<String>,
    /// With discovery: a rank disconnected with no batch this long is lost for good and the listing is read again; if it names other endpoints the sidecar drains and exits 75 to start again on them
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_discovery_recheck: Option<String>,
    /// Bind the SUB socket; for engines whose endpoint has no wildcard (they connect)
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_bind: Option<String>,
    /// Engine replay ROUTER endpoint; empty: no replay
    #[arg(long, value_name = "ENDPOINT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    topic: Option<String>,
    /// Data-parallel ranks 0..N-1, endpoints by vLLM's port offset from the two base endpoints
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    dp_size: Option<String>,
    /// InferenceCache server: host:port, http://… or https://…; empty: 127.0.0.1:9090, or none with --feed-address (a sidecar serving routers only: no reports, no stats)
    #[arg(long, value_name = "ADDRESS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    server: Option<String>,
    /// This replica's id (required)
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    replica_id: Option<String>,
    /// The served model's id (required)
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    model_id: Option<String>,
    /// Tenant id
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    tenant_id: Option<String>,
    /// Hash scheme reported with every prefix (the server's comparison domain)
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    hash_scheme: Option<String>,
    /// Whose KV-event wire the engine speaks: vllm or sglang (--hash-scheme sglang implies sglang)
    #[arg(long, value_name = "ENGINE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine: Option<String>,
    /// Prefix keys: fingerprint (content fingerprints of token ids, what the inference-cache server matches LookupRoute token_ids against, as the Go sidecar sends) or engine (the engine's block hashes, for gateways that send those)
    #[arg(long, value_name = "MODE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    key_mode: Option<String>,
    /// Window over which adds and evictions are collected, netted and sent
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    window: Option<String>,
    /// Engine Prometheus endpoint; empty: no stats
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_metrics_url: Option<String>,
    /// Interval of stats reports; 0: none
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    stats_interval: Option<String>,
    /// Engine KV cache size in bytes, for cache_memory_bytes; 0: unknown
    #[arg(long, value_name = "BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_cache_size_bytes: Option<String>,
    /// Running + waiting requests that count as full pressure
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_concurrency_ceiling: Option<String>,
    /// Cache usage gauge: auto (kv → gpu → cpu), kv, gpu, cpu
    #[arg(long, value_name = "TIER")]
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_tier: Option<String>,
    /// Keep only metric series with this model_name label
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_model_name: Option<String>,
    /// Engine metrics profile: auto, vllm, vllm-legacy, sglang
    #[arg(long, value_name = "PROFILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_profile: Option<String>,
    /// The engine has an offload tier: GPU removals re-report the prefix at T2
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    ignore_block_removed: Option<String>,
    /// Hybrid models: report blocks of every KV-cache group, not only full-attention ones (sliding-window, chunked-local and mamba groups are not reusable prefixes on their own)
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    all_kv_groups: Option<String>,
    /// Every resident block is re-reported at least once per this interval, spread evenly, so the server's TTL (30m by default) never expires a prefix the engine still holds; a restarted server gets our state back within one interval (0: off)
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    refresh_interval: Option<String>,
    /// Save the per-source state here (tracked blocks, last seq; periodically and at shutdown, atomically) and resume from it at start: a restarted sidecar keeps every block the engine still holds instead of clearing the replica and rebuilding from the engine's replay buffer. A file of another replica, model or layout, corrupt, or older than the engine's buffer is discarded with a warning. Put it on a volume that outlives the container (an emptyDir)
    #[arg(long, value_name = "PATH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    state_file: Option<String>,
    /// How often the state file is written (0: only at shutdown)
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    state_interval: Option<String>,
    /// A source that sent no batch this long after the start is reported: a warning naming its endpoint and the usual causes, and /readyz says so while no source has sent anything
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_silence_grace: Option<String>,
    /// Adapter names for LoRA ids, for engines without lora_name: 1=a,2=b
    #[arg(long, value_name = "MAP")]
    #[serde(skip_serializing_if = "Option::is_none")]
    lora_adapter_names: Option<String>,
    /// Our HTTP endpoint for /metrics, /healthz, /readyz; empty: none
    #[arg(long, value_name = "HOST:PORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    metrics_address: Option<String>,
    /// Serve the router feed (a snapshot of every resident prefix, then changes) here; empty: off
    #[arg(long, value_name = "HOST:PORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    feed_address: Option<String>,
    /// Bytes of changes kept for feed followers to resume from
    #[arg(long, value_name = "BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    feed_ring_bytes: Option<String>,
    /// Serve the feed over TLS with this certificate (PEM)
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    feed_tls_cert_file: Option<String>,
    /// The feed's TLS key (PEM)
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    feed_tls_key_file: Option<String>,
    /// File holding the bearer token feed followers must send
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    feed_token_file: Option<String>,
    /// Deadline to flush pending reports on SIGTERM/SIGINT
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    drain_timeout: Option<String>,
    /// Log format: text or json
    #[arg(long, value_name = "FORMAT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    log_format: Option<String>,
    /// Log level or filter, e.g. info, debug, kvevent_source=debug
    #[arg(long, value_name = "LEVEL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    log_level: Option<String>,
    /// Deadline of every RPC to the server
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    rpc_timeout: Option<String>,
    /// Deadline of a connection attempt to the server
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    connect_timeout: Option<String>,
    /// Most prefix entries plus events waiting behind the work in flight (a server outage, overload); beyond, work is dropped and counted: new adds and evictions while the server answers, the oldest queued while calls fail; never a clear
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_pending: Option<String>,
    /// Most RPCs in flight at once on the server connection (evictions go as concurrent PublishEvent calls; the forwarder adapts its own limit from 64 up to this one as the rate needs)
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_in_flight: Option<String>,
    /// Longest delay between retries to the server
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_backoff: Option<String>,
    /// Engine blocks tracked per source for cumulative counts and fingerprint chains (about 30 bytes a block)
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tracked_blocks: Option<String>,
    /// A replay with no reply for this long is over
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    replay_timeout: Option<String>,
    /// SUB receive high-water mark, in batches; past it the engine's PUB drops (and we replay)
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_rcvhwm: Option<String>,
    /// ZMTP heartbeat interval to the engine; 0: none
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_heartbeat_interval: Option<String>,
    /// An engine silent this long after a heartbeat is reconnected
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_heartbeat_timeout: Option<String>,
    /// Longest delay between reconnection attempts to the engine
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_reconnect_max: Option<String>,
    /// Deadline of an engine metrics scrape
    #[arg(long, value_name = "DURATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    scrape_timeout: Option<String>,
    /// CA bundle (PEM) to verify the server; empty: system roots (implies TLS)
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_ca_file: Option<String>,
    /// Client certificate (PEM) for mTLS
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_cert_file: Option<String>,
    /// Client key (PEM) for mTLS
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_key_file: Option<String>,
    /// Name to verify the server certificate against; empty: the host of --server
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_server_name: Option<String>,
    /// File with a bearer token sent as authorization metadata; re-read when it changes
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    token_file: Option<String>,
}

/// The command line with each option's default and environment variable in its help, taken
/// from [`pipeline::Settings::default`] (the one place defaults are written).
pub(crate) fn command() -> clap::Command {
    use clap::CommandFactory;
    let defaults = pipeline::settings::defaults();
    let mut command = Cli::command();
    for (option, default) in defaults {
        let id = option.as_str();
        if command.get_arguments().all(|a| a.get_id() != id) {
            continue;
        }
        let env = format!(
            "{}{}",
            pipeline::settings::ENV_PREFIX,
            option.to_uppercase()
        );
        let default = match default.as_str() {
            "" if matches!(id, "replica_id" | "model_id") => None,
            "" => Some("\"\"".to_owned()),
            _ => Some(default),
        };
        command = command.mut_arg(id, |a| {
            let help = a.get_help().map(ToString::to_string).unwrap_or_default();
            let help = match default {
                Some(d) => format!("{help} [default: {d}] [env: {env}]"),
                None => format!("{help} [env: {env}]"),
            };
            // `--max-pending -3` is a bad value to report, not an unknown flag.
            a.help(help).allow_negative_numbers(true)
        });
    }
    command
}

/// Parses the command line (Go-style single-dash flags accepted).
pub(crate) fn parse(args: impl IntoIterator<Item = String>) -> Result<Cli, clap::Error> {
    use clap::FromArgMatches;
    let matches = command().try_get_matches_from(go_style(args))?;
    Cli::from_arg_matches(&matches)
}

/// Rewrites Go-style single-dash long flags (`-replica-id=x`, `-window 50ms`) to `--`.
pub(crate) fn go_style(args: impl IntoIterator<Item = String>) -> Vec<String> {
    use clap::CommandFactory;
    let command = Cli::command();
    let longs: Vec<String> = command
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_owned))
        .chain(["help".to_owned(), "version".to_owned()])
        .collect();
    let mut out = Vec::new();
    let mut rest_literal = false;
    for (i, arg) in args.into_iter().enumerate() {
        if i == 0 || rest_literal {
            out.push(arg);
            continue;
        }
        if arg == "--" {
            rest_literal = true;
            out.push(arg);
            continue;
        }
        let single = arg.starts_with('-') && !arg.starts_with("--") && arg.len() > 2;
        // `arg` starts with the one-byte '-' here, so byte 1 is a character boundary.
        let name = if single {
            arg[1..].split('=').next().unwrap_or_default()
        } else {
            ""
        };
        if single && longs.iter().any(|l| l == name) {
            out.push(format!("-{arg}"));
        } else {
            out.push(arg);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::Cli;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let argv = std::iter::once("kvevent-subscriber")
            .chain(args.iter().copied())
            .map(str::to_owned);
        super::parse(argv)
    }

    /// Every option's `--help` names its default as `Settings::default()` has it, and its
    /// environment variable.
    #[test]
    fn every_help_default_is_the_settings_default() {
        let command = super::command();
        for (option, default) in kvevent_pipeline::settings::defaults() {
            let arg = command
                .get_arguments()
                .find(|a| a.get_long() == Some(&option.replace('_', "-")))
                .unwrap_or_else(|| panic!("no flag for the option {option}"));
            let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
            let env = format!("[env: KVEVENT_{}]", option.to_uppercase());
            assert!(help.ends_with(&env), "{option}: {help}");
            if !matches!(option.as_str(), "replica_id" | "model_id") {
                let shown = if default.is_empty() {
                    "\"\"".to_owned()
                } else {
                    default
                };
                assert!(
                    help.contains(&format!(" [default: {shown}] ")),
                    "{option} shows another default: {help}"
                );
            }
        }
        // Every flag but --config is an option of the settings.
        let options = kvevent_pipeline::settings::known_options();
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            assert!(
                options.iter().any(|o| o == id) || matches!(id, "config" | "help" | "version"),
                "--{id} is not an option of the settings"
            );
        }
    }

    #[test]
    fn an_empty_value_is_a_value() {
        let cli = parse(&["--engine-metrics-url", "", "-replica-id", ""]).expect("parses");
        assert_eq!(cli.options.engine_metrics_url.as_deref(), Some(""));
        assert!(
            parse(&[""]).is_err(),
            "an empty positional is an error, not a panic"
        );
    }

    #[test]
    fn a_flag_given_twice_takes_the_last_value() {
        let cli = parse(&[
            "--window=50ms",
            "-window",
            "2s",
            "--dp-size",
            "2",
            "--dp-size=3",
        ])
        .expect("parses");
        assert_eq!(cli.options.window.as_deref(), Some("2s"));
        assert_eq!(cli.options.dp_size.as_deref(), Some("3"));
    }

    /// A negative number is a value to report, not a flag.
    #[test]
    fn a_negative_number_is_a_value() {
        let cli = parse(&["--max-pending", "-3"]).expect("parses");
        assert_eq!(cli.options.max_pending.as_deref(), Some("-3"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// No argument vector makes the command line panic: each is parsed or refused.
        #[test]
        fn no_argv_panics(args in proptest::collection::vec(
            prop_oneof![
                Just(String::new()),
                Just("-".to_owned()),
                Just("--".to_owned()),
                Just("-window".to_owned()),
                Just("--engine-metrics-url".to_owned()),
                Just("-replica-id=".to_owned()),
                "-{1,2}[a-z-]{0,20}(=.{0,8})?",
                ".{0,12}",
            ],
            0..8,
        )) {
            let argv = std::iter::once("kvevent-subscriber".to_owned()).chain(args);
            let _ = super::parse(argv);
        }
    }
}
