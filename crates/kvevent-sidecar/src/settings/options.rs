//! Every option, written once: its doc comment is its `--help` and its rustdoc; its name the
//! TOML key, the flag (`_` for `-`) and the environment variable (`KVEVENT_` and upper case);
//! then its type (what the code uses, parsed once as the value is read), its default, the
//! placeholder `--help` shows for its value (empty: the name; `BOOL`: a switch, `--flag` alone
//! is `true`), what the value must be on its own (`check(...)`, from `check.rs`: `required`
//! marks the required ones) and how the value is read when its type does not say. Constraints
//! between options are in `Settings::validate`. Adding an option is adding an entry here (and
//! its row in `docs/operating.md`, which a test checks).

use std::path::PathBuf;

use kvevent_mapper::KeyMode;
use kvevent_scrape::{CacheTier, Profile};

use super::check;
use super::value::{self, Endpoint, GoDuration, HttpUrl, LogFormat, Server, lenient_string};
use super::{ListenAddress, LoraAdapters};

super::define_options! {
    /// Engine KV-event PUB endpoint.
    engine_endpoint: Endpoint = "tcp://127.0.0.1:5557".into(), "ENDPOINT" check(check::endpoint);
    /// The engine's own list of its KV-event endpoints: vLLM 0.31+'s /kv_event_sources (e.g.
    /// http://127.0.0.1:8000/kv_event_sources) or SGLang 0.5.13+'s /server_info (e.g.
    /// http://127.0.0.1:30000/server_info): every DP rank's PUB and replay endpoints are read from
    /// it (replacing --engine-endpoint, --replay-endpoint and --dp-size), and read again when a
    /// rank's connection is lost for good.
    engine_discovery_url: HttpUrl = HttpUrl::default(), "URL" check(check::parsed);
    /// How long to wait at start for the discovery listing to answer.
    engine_discovery_timeout: GoDuration = GoDuration::secs(300), "DURATION" check(check::positive);
    /// With discovery: a rank disconnected with no batch this long is lost for good and the listing
    /// is read again; if it names other endpoints the sidecar drains and exits 75 to start again on
    /// them.
    engine_discovery_recheck: GoDuration = GoDuration::secs(30), "DURATION" check(check::positive);
    /// Bind the SUB socket; for engines whose endpoint has no wildcard (they connect).
    engine_bind: bool = false, "BOOL", #[serde(with = "value::switch")];
    /// Engine replay ROUTER endpoint; empty: no replay.
    replay_endpoint: Endpoint = Endpoint::default(), "ENDPOINT" check(check::parsed);
    /// Topic prefix to subscribe to.
    topic: String = "kv-events".into(), "", #[serde(deserialize_with = "lenient_string")];
    /// Data-parallel ranks 0..N-1, endpoints by vLLM's port offset from the two base endpoints.
    dp_size: u32 = 1, "N" check(check::within(1, 256)), #[serde(with = "value::number")];
    /// InferenceCache server: host:port, http://… or https://…; empty: 127.0.0.1:9090, or none with
    /// --feed-address (a sidecar serving routers only: no reports, no stats).
    server: Server = Server::default(), "ADDRESS" check(check::parsed);
    /// This replica's id (required).
    replica_id: String = String::new(), "" check(check::required),
        #[serde(deserialize_with = "lenient_string")];
    /// The served model's id (required).
    model_id: String = String::new(), "" check(check::required),
        #[serde(deserialize_with = "lenient_string")];
    /// Tenant id.
    tenant_id: String = String::new(), "", #[serde(deserialize_with = "lenient_string")];
    /// Hash scheme reported with every prefix (the server's comparison domain).
    hash_scheme: String = "vllm".into(), "" check(check::required),
        #[serde(deserialize_with = "lenient_string")];
    /// Whose KV-event wire the engine speaks: vllm or sglang (--hash-scheme sglang implies sglang).
    engine: kvevent_wire::Engine = kvevent_wire::Engine::Vllm, "ENGINE",
        #[serde(with = "value::words")];
    /// Prefix keys: fingerprint (content fingerprints of token ids, what the inference-cache server
    /// matches LookupRoute token_ids against, as the Go sidecar sends) or engine (the engine's
    /// block hashes, for gateways that send those).
    key_mode: KeyMode = KeyMode::Fingerprint, "MODE", #[serde(with = "value::words")];
    /// Window over which adds and evictions are collected, netted and sent.
    window: GoDuration = GoDuration::ms(100), "DURATION" check(check::positive);
    /// Engine Prometheus endpoint; empty: no stats.
    engine_metrics_url: HttpUrl = "http://127.0.0.1:8000/metrics".into(), "URL"
        check(check::parsed);
    /// Interval of stats reports; 0: none.
    stats_interval: GoDuration = GoDuration::secs(10), "DURATION";
    /// Engine KV cache size in bytes, for cache_memory_bytes; 0: unknown.
    engine_cache_size_bytes: u64 = 0, "BYTES", #[serde(with = "value::number")];
    /// Running + waiting requests that count as full pressure.
    max_concurrency_ceiling: u32 = 256, "N", #[serde(with = "value::number")];
    /// Cache usage gauge: auto (kv → gpu → cpu), kv, gpu, cpu.
    cache_tier: CacheTier = CacheTier::Auto, "TIER", #[serde(with = "value::words")];
    /// Keep only metric series with this model_name label.
    engine_model_name: String = String::new(), "NAME",
        #[serde(deserialize_with = "lenient_string")];
    /// Engine metrics profile: auto, vllm, vllm-legacy, sglang.
    engine_profile: Option<Profile> = None, "PROFILE", #[serde(with = "value::words")];
    /// The engine has an offload tier: GPU removals re-report the prefix at T2.
    ignore_block_removed: bool = false, "BOOL", #[serde(with = "value::switch")];
    /// Hybrid models: report blocks of every KV-cache group, not only full-attention ones
    /// (sliding-window, chunked-local and mamba groups are not reusable prefixes on their own).
    all_kv_groups: bool = false, "BOOL", #[serde(with = "value::switch")];
    /// Every resident block is re-reported at least once per this interval, spread evenly, so the
    /// server's TTL (30m by default) never expires a prefix the engine still holds; a restarted
    /// server gets our state back within one interval (0: off).
    refresh_interval: GoDuration = GoDuration::secs(600), "DURATION";
    /// Save the per-source state here (tracked blocks, last seq; periodically and at shutdown,
    /// atomically) and resume from it at start: a restarted sidecar keeps every block the engine
    /// still holds instead of clearing the replica and rebuilding from the engine's replay buffer.
    /// A file of another replica, model or layout, corrupt, or older than the engine's buffer is
    /// discarded with a warning. Put it on a volume that outlives the container (an emptyDir).
    state_file: Option<PathBuf> = None, "PATH", #[serde(with = "value::path")];
    /// How often the state file is written (0: only at shutdown).
    state_interval: GoDuration = GoDuration::secs(30), "DURATION";
    /// A source that sent no batch this long after the start is reported: a warning naming its
    /// endpoint and the usual causes, and /readyz says so while no source has sent anything.
    engine_silence_grace: GoDuration = GoDuration::secs(60), "DURATION" check(check::positive);
    /// Adapter names for LoRA ids, for engines without lora_name: 1=a,2=b.
    lora_adapter_names: LoraAdapters = LoraAdapters::default(), "MAP" check(check::parsed);
    /// Our HTTP endpoint for /metrics, /healthz, /readyz; empty: none.
    metrics_address: ListenAddress = "0.0.0.0:9095".into(), "HOST:PORT"
        check(check::listen_address);
    /// Serve the router feed (a snapshot of every resident prefix, then changes) here; empty: off.
    feed_address: ListenAddress = ListenAddress::default(), "HOST:PORT"
        check(check::listen_address);
    /// With a feed: how often the engine's HTTP server (the host of --engine-discovery-url, else
    /// of --engine-metrics-url, at /health) is asked whether it answers; routers then know a
    /// replica whose server is gone while its cache is known. 0: never.
    engine_health_interval: GoDuration = GoDuration::secs(1), "DURATION";
    /// With a feed: how often the engine's load (requests running and waiting, KV-cache usage, from
    /// --engine-metrics-url) is read; routers are sent it as it changes, with its age. One read at a
    /// time, each within this interval's deadline (at least 1 s), never in the way of events. 0: never.
    engine_load_interval: GoDuration = GoDuration::ms(250), "DURATION";
    /// Bytes of changes kept for feed followers to resume from.
    feed_ring_bytes: usize = 64 << 20, "BYTES" check(check::at_least_one),
        #[serde(with = "value::number")];
    /// Serve the feed over TLS with this certificate (PEM).
    feed_tls_cert_file: Option<PathBuf> = None, "FILE" check(check::existing_file),
        #[serde(with = "value::path")];
    /// The feed's TLS key (PEM).
    feed_tls_key_file: Option<PathBuf> = None, "FILE" check(check::existing_file),
        #[serde(with = "value::path")];
    /// File holding the bearer token feed followers must send.
    feed_token_file: Option<PathBuf> = None, "FILE" check(check::existing_file),
        #[serde(with = "value::path")];
    /// Deadline to flush pending reports on SIGTERM/SIGINT.
    drain_timeout: GoDuration = GoDuration::secs(5), "DURATION";
    /// Log format: text or json.
    log_format: LogFormat = LogFormat::Text, "FORMAT", #[serde(with = "value::words")];
    /// Log level or filter, e.g. info, debug, kvevent_source=debug.
    log_level: String = "info".into(), "LEVEL" check(check::log_filter),
        #[serde(deserialize_with = "lenient_string")];
    /// Deadline of every RPC to the server.
    rpc_timeout: GoDuration = GoDuration::secs(5), "DURATION" check(check::positive);
    /// Deadline of a connection attempt to the server.
    connect_timeout: GoDuration = GoDuration::secs(5), "DURATION" check(check::positive);
    /// Most prefix entries plus events waiting behind the work in flight (a server outage,
    /// overload); beyond, work is dropped and counted: new adds and evictions while the server
    /// answers, the oldest queued while calls fail; never a clear.
    max_pending: usize = 100_000, "N" check(check::at_least_one), #[serde(with = "value::number")];
    /// Most RPCs in flight at once on the server connection (evictions go as concurrent
    /// PublishEvent calls; the forwarder adapts its own limit from 64 up to this one as the rate
    /// needs).
    max_in_flight: usize = 256, "N" check(check::within(1, 1024)), #[serde(with = "value::number")];
    /// Longest delay between retries to the server.
    max_backoff: GoDuration = GoDuration::secs(10), "DURATION" check(check::positive);
    /// Engine blocks tracked per source for cumulative counts and fingerprint chains (about 30
    /// bytes a block).
    max_tracked_blocks: usize = kvevent_mapper::DEFAULT_MAX_TRACKED_BLOCKS, "N",
        #[serde(with = "value::number")];
    /// A replay with no reply for this long is over.
    replay_timeout: GoDuration = GoDuration::secs(3), "DURATION" check(check::positive);
    /// SUB receive high-water mark, in batches; past it the engine's PUB drops (and we replay).
    engine_rcvhwm: i32 = 100_000, "N" check(check::not_negative), #[serde(with = "value::number")];
    /// ZMTP heartbeat interval to the engine; 0: none.
    engine_heartbeat_interval: GoDuration = GoDuration::secs(5), "DURATION";
    /// An engine silent this long after a heartbeat is reconnected.
    engine_heartbeat_timeout: GoDuration = GoDuration::secs(15), "DURATION";
    /// Longest delay between reconnection attempts to the engine (a restarted engine is
    /// proven new, or the same, only once reconnected).
    engine_reconnect_max: GoDuration = GoDuration::secs(1), "DURATION" check(check::positive);
    /// Deadline of an engine metrics scrape.
    scrape_timeout: GoDuration = GoDuration::secs(5), "DURATION" check(check::positive);
    /// Largest engine /metrics body read, in bytes; a larger one fails the scrape
    /// (kvevent_scrapes_total{outcome="too_large"}) and no stats are reported from it. An engine
    /// serving many LoRA adapters or models can pass the default.
    scrape_max_bytes: usize = 8 << 20, "BYTES" check(check::at_least_one),
        #[serde(with = "value::number")];
    /// CA bundle (PEM) to verify the server; empty: system roots (implies TLS).
    tls_ca_file: Option<PathBuf> = None, "FILE" check(check::existing_file),
        #[serde(with = "value::path")];
    /// Client certificate (PEM) for mTLS.
    tls_cert_file: Option<PathBuf> = None, "FILE" check(check::existing_file),
        #[serde(with = "value::path")];
    /// Client key (PEM) for mTLS.
    tls_key_file: Option<PathBuf> = None, "FILE" check(check::existing_file),
        #[serde(with = "value::path")];
    /// Name to verify the server certificate against; empty: the host of --server.
    tls_server_name: String = String::new(), "NAME", #[serde(deserialize_with = "lenient_string")];
    /// File with a bearer token sent as authorization metadata; re-read when it changes.
    token_file: Option<PathBuf> = None, "FILE" check(check::existing_file),
        #[serde(with = "value::path")];
}
