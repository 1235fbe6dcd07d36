//! Every option of the subscriber: defaults, TOML file, environment, flags; validated at once.

use std::fmt;
use std::path::PathBuf;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use kvevent_mapper::KeyMode;
use kvevent_scrape::{CacheTier, Profile};
use serde::{Deserialize, Serialize};

mod value;

use value::lenient_string;
pub use value::{GoDuration, LogFormat, Words, parse_duration};

/// Prefix of every environment variable (`KVEVENT_REPLICA_ID`, ...).
pub const ENV_PREFIX: &str = "KVEVENT_";

/// The InferenceCache server when `--server` is empty and no `--feed-address` is given (the
/// Go sidecar's default).
pub const DEFAULT_SERVER: &str = "127.0.0.1:9090";

/// Every option, with the Go sidecar's names and defaults where it has them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// The engine's KV-event PUB endpoint.
    #[serde(deserialize_with = "lenient_string")]
    pub engine_endpoint: String,
    /// vLLM 0.31+'s endpoint listing (`http://host:8000/kv_event_sources`); when set, the
    /// ranks' PUB and replay endpoints come from it instead of `engine_endpoint`,
    /// `replay_endpoint` and `dp_size`.
    #[serde(deserialize_with = "lenient_string")]
    pub engine_discovery_url: String,
    /// How long to wait at start for the discovery listing to answer.
    pub engine_discovery_timeout: GoDuration,
    /// A rank disconnected with no batch this long is lost for good: the listing is read again.
    pub engine_discovery_recheck: GoDuration,
    /// Bind the SUB socket instead of connecting (for engines with a non-wildcard endpoint).
    #[serde(with = "value::switch")]
    pub engine_bind: bool,
    /// The engine's replay ROUTER endpoint; empty: no replay.
    #[serde(deserialize_with = "lenient_string")]
    pub replay_endpoint: String,
    /// Topic prefix.
    #[serde(deserialize_with = "lenient_string")]
    pub topic: String,
    /// Data-parallel ranks to subscribe to (endpoints by vLLM's port-offset rule).
    #[serde(with = "value::number")]
    pub dp_size: u32,
    /// The InferenceCache server: `host:port`, `http://…` or `https://…`; empty:
    /// [`DEFAULT_SERVER`], or none with `feed_address` (see [`Settings::server`]).
    #[serde(deserialize_with = "lenient_string")]
    pub server: String,
    /// This replica's id (required).
    #[serde(deserialize_with = "lenient_string")]
    pub replica_id: String,
    /// The model's id (required).
    #[serde(deserialize_with = "lenient_string")]
    pub model_id: String,
    /// Tenant id (optional).
    #[serde(deserialize_with = "lenient_string")]
    pub tenant_id: String,
    /// Hash scheme reported with every prefix (the server's comparison domain).
    #[serde(deserialize_with = "lenient_string")]
    pub hash_scheme: String,
    /// Whose KV-event wire the engine speaks: `vllm` or `sglang` (`hash_scheme` `sglang`
    /// implies it, as the Go sidecar's flag picks SGLang there).
    #[serde(with = "value::words")]
    pub engine: kvevent_wire::Engine,
    /// Key mode: `engine` (engine block hashes) or `fingerprint` (content fingerprints).
    #[serde(with = "value::words")]
    pub key_mode: KeyMode,
    /// Window over which adds and evictions are collected, netted and sent. `0` means the
    /// default, as in the Go sidecar (with a warning, see [`Settings::adjustments`]).
    pub window: GoDuration,
    /// Changes [`Settings::load`] made to the configuration given, to be logged once logging is
    /// set up (a zero `--window` becomes the default). Not an option.
    #[serde(skip)]
    pub adjustments: Vec<String>,
    /// The engine's Prometheus endpoint; empty: no stats.
    #[serde(deserialize_with = "lenient_string")]
    pub engine_metrics_url: String,
    /// Interval of stats reports; 0: no stats.
    pub stats_interval: GoDuration,
    /// The engine's KV cache size in bytes (0: unknown).
    #[serde(with = "value::number")]
    pub engine_cache_size_bytes: u64,
    /// Running + waiting requests that count as full pressure.
    #[serde(with = "value::number")]
    pub max_concurrency_ceiling: u32,
    /// Which usage gauge: auto, kv, gpu, cpu.
    #[serde(with = "value::words")]
    pub cache_tier: CacheTier,
    /// Keep only metric series with this `model_name` label.
    #[serde(deserialize_with = "lenient_string")]
    pub engine_model_name: String,
    /// Engine metrics profile: auto, vllm, vllm-legacy, sglang.
    #[serde(with = "value::words")]
    pub engine_profile: Option<Profile>,
    /// The engine has an offload tier: GPU removals are re-reported at T2.
    #[serde(with = "value::switch")]
    pub ignore_block_removed: bool,
    /// Report blocks of every KV-cache group of a hybrid model, not only full-attention ones.
    #[serde(with = "value::switch")]
    pub all_kv_groups: bool,
    /// A source that sent no batch this long after the start is reported (a warning naming it;
    /// `/readyz` says so while no source has sent anything).
    pub engine_silence_grace: GoDuration,
    /// Every resident block is re-reported at least once per this interval, spread evenly, so
    /// the server's TTL never expires it (0: off).
    pub refresh_interval: GoDuration,
    /// Where the per-source state is saved (periodically and at shutdown) and resumed from at
    /// start; empty: not saved (a restart clears the replica and rebuilds from the replay).
    #[serde(with = "value::path")]
    pub state_file: Option<PathBuf>,
    /// How often the state file is written (0: only at shutdown).
    pub state_interval: GoDuration,
    /// Adapter names for LoRA ids: `1=a,2=b`.
    #[serde(deserialize_with = "lenient_string")]
    pub lora_adapter_names: String,
    /// Our own HTTP endpoint (`/metrics`, `/healthz`, `/readyz`); empty: none.
    #[serde(deserialize_with = "lenient_string")]
    pub metrics_address: String,
    /// Where routers follow this replica's feed (`kvevent.feed.v1`: a snapshot of every resident
    /// prefix, then its changes); empty: off.
    #[serde(deserialize_with = "lenient_string")]
    pub feed_address: String,
    /// Most bytes of encoded changes kept for feed followers to resume from.
    #[serde(with = "value::number")]
    pub feed_ring_bytes: usize,
    /// Serve the feed over TLS with this certificate (PEM) and `feed_tls_key_file`.
    #[serde(with = "value::path")]
    pub feed_tls_cert_file: Option<PathBuf>,
    /// The feed's TLS key (PEM).
    #[serde(with = "value::path")]
    pub feed_tls_key_file: Option<PathBuf>,
    /// File holding the bearer token a feed follower must send; re-read for each stream.
    #[serde(with = "value::path")]
    pub feed_token_file: Option<PathBuf>,
    /// Deadline to flush pending reports on shutdown.
    pub drain_timeout: GoDuration,
    /// Log format: text or json.
    #[serde(with = "value::words")]
    pub log_format: LogFormat,
    /// Log level or filter (`info`, `kvevent=debug`).
    #[serde(deserialize_with = "lenient_string")]
    pub log_level: String,
    /// Deadline of every RPC.
    pub rpc_timeout: GoDuration,
    /// Deadline of a connection attempt to the server.
    pub connect_timeout: GoDuration,
    /// Most prefix entries plus events waiting behind the work in flight; beyond, the oldest
    /// queued work is dropped.
    #[serde(with = "value::number")]
    pub max_pending: usize,
    /// Most RPCs in flight at once on the server connection.
    #[serde(with = "value::number")]
    pub max_in_flight: usize,
    /// Longest delay between retries to the server.
    pub max_backoff: GoDuration,
    /// Engine blocks tracked per source (cumulative counts, fingerprint chains).
    #[serde(with = "value::number")]
    pub max_tracked_blocks: usize,
    /// A replay with no reply for this long is over.
    pub replay_timeout: GoDuration,
    /// SUB receive high-water mark, in batches.
    #[serde(with = "value::number")]
    pub engine_rcvhwm: i32,
    /// ZMTP heartbeat interval to the engine (0: none).
    pub engine_heartbeat_interval: GoDuration,
    /// An engine silent this long after a heartbeat is reconnected.
    pub engine_heartbeat_timeout: GoDuration,
    /// Longest delay between reconnection attempts to the engine.
    pub engine_reconnect_max: GoDuration,
    /// Deadline of a metrics scrape.
    pub scrape_timeout: GoDuration,
    /// CA bundle (PEM) to verify the server with; empty: system roots.
    #[serde(with = "value::path")]
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for mTLS.
    #[serde(with = "value::path")]
    pub tls_cert_file: Option<PathBuf>,
    /// Client key (PEM) for mTLS.
    #[serde(with = "value::path")]
    pub tls_key_file: Option<PathBuf>,
    /// Name to verify the server's certificate against, if not the host in `server`.
    #[serde(deserialize_with = "lenient_string")]
    pub tls_server_name: String,
    /// File holding a bearer token sent as `authorization`; re-read when it changes.
    #[serde(with = "value::path")]
    pub token_file: Option<PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            engine_endpoint: "tcp://127.0.0.1:5557".into(),
            engine_discovery_url: String::new(),
            engine_discovery_timeout: GoDuration::secs(300),
            engine_discovery_recheck: GoDuration::secs(30),
            engine_bind: false,
            replay_endpoint: String::new(),
            topic: "kv-events".into(),
            dp_size: 1,
            server: String::new(),
            replica_id: String::new(),
            model_id: String::new(),
            tenant_id: String::new(),
            hash_scheme: "vllm".into(),
            engine: kvevent_wire::Engine::Vllm,
            key_mode: KeyMode::Fingerprint,
            window: GoDuration::ms(100),
            adjustments: Vec::new(),
            engine_metrics_url: "http://127.0.0.1:8000/metrics".into(),
            stats_interval: GoDuration::secs(10),
            engine_cache_size_bytes: 0,
            max_concurrency_ceiling: 256,
            cache_tier: CacheTier::Auto,
            engine_model_name: String::new(),
            engine_profile: None,
            ignore_block_removed: false,
            all_kv_groups: false,
            refresh_interval: GoDuration::secs(600),
            state_file: None,
            state_interval: GoDuration::secs(30),
            engine_silence_grace: GoDuration::secs(60),
            lora_adapter_names: String::new(),
            metrics_address: "0.0.0.0:9095".into(),
            feed_address: String::new(),
            feed_ring_bytes: 64 << 20,
            feed_tls_cert_file: None,
            feed_tls_key_file: None,
            feed_token_file: None,
            drain_timeout: GoDuration::secs(5),
            log_format: LogFormat::Text,
            log_level: "info".into(),
            rpc_timeout: GoDuration::secs(5),
            connect_timeout: GoDuration::secs(5),
            max_pending: 100_000,
            max_in_flight: 256,
            max_backoff: GoDuration::secs(10),
            max_tracked_blocks: kvevent_mapper::DEFAULT_MAX_TRACKED_BLOCKS,
            replay_timeout: GoDuration::secs(3),
            engine_rcvhwm: 100_000,
            engine_heartbeat_interval: GoDuration::secs(5),
            engine_heartbeat_timeout: GoDuration::secs(15),
            engine_reconnect_max: GoDuration::secs(5),
            scrape_timeout: GoDuration::secs(5),
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_server_name: String::new(),
            token_file: None,
        }
    }
}

/// Every option with its default as text (`""` for an empty one), as in the TOML file: the one
/// source of the defaults that `--help` and the docs show.
pub fn defaults() -> Vec<(String, String)> {
    let Some(dict) = figment::value::Value::serialize(Settings::default())
        .ok()
        .and_then(|v| v.into_dict())
    else {
        return Vec::new();
    };
    dict.into_iter()
        .map(|(k, v)| {
            let text = match v {
                figment::value::Value::String(_, s) => s,
                figment::value::Value::Bool(_, b) => b.to_string(),
                figment::value::Value::Num(_, n) => n
                    .to_u128()
                    .map(|n| n.to_string())
                    .or_else(|| n.to_i128().map(|n| n.to_string()))
                    .unwrap_or_default(),
                other => format!("{other:?}"),
            };
            (k, text)
        })
        .collect()
}

/// The names of every option, as in the TOML file.
pub fn known_options() -> Vec<String> {
    figment::value::Value::serialize(Settings::default())
        .ok()
        .and_then(|v| v.into_dict())
        .map(|d| d.into_keys().collect())
        .unwrap_or_default()
}

/// The TOML file's layer: its known keys, with the file named as their source (so a bad value
/// is reported as the file's key, not as a flag). Unknown keys are problems of their own, with
/// the option meant when it is close (`replica-id` → `replica_id`).
struct FileLayer {
    path: PathBuf,
    dict: figment::value::Dict,
}

impl FileLayer {
    fn read(path: &PathBuf) -> Result<(Self, Vec<Problem>), Problem> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| Problem {
            option: "config".into(),
            message: format!("cannot read {shown}: {e}"),
            file: None,
        })?;
        let data = figment::Provider::data(&Toml::string(&text)).map_err(|e| Problem {
            option: "config".into(),
            message: format!("{shown} is not valid TOML: {}", e.kind),
            file: None,
        })?;
        let known = known_options();
        let mut dict = figment::value::Dict::new();
        let mut unknown = Vec::new();
        for (key, value) in data.into_values().flatten() {
            if known.contains(&key) {
                dict.insert(key, value);
            } else {
                let message = match suggest(&key, &known) {
                    Some(meant) => format!("unknown key: did you mean `{meant}`?"),
                    None => "unknown key (docs/operating.md lists the keys: a flag's name with `_` for `-`)".to_owned(),
                };
                unknown.push(Problem {
                    // TOML allows an empty quoted key: show it as written.
                    option: if key.is_empty() { "\"\"".into() } else { key },
                    message,
                    file: Some(shown.clone()),
                });
            }
        }
        Ok((
            Self {
                path: path.clone(),
                dict,
            },
            unknown,
        ))
    }
}

impl figment::Provider for FileLayer {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::from("TOML file", figment::Source::File(self.path.clone()))
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        Ok(figment::Profile::Default.collect(self.dict.clone()))
    }
}

/// The option a mistyped key most likely meant: the same with `_` for `-` and in lower case,
/// else the closest name (Jaro-Winkler ≥ 0.85).
fn suggest(key: &str, known: &[String]) -> Option<String> {
    let normal = key.replace('-', "_").to_ascii_lowercase();
    if known.contains(&normal) {
        return Some(normal);
    }
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(&normal, k), k))
        .filter(|(score, _)| *score >= 0.85)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.clone())
}

/// One configuration problem, naming the option as a flag and as an environment variable, or
/// as a key of the TOML file when the value came from there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The option (`replica_id`), or the file's key as written.
    pub option: String,
    /// What is wrong.
    pub message: String,
    /// The TOML file the value came from, if it did.
    pub file: Option<String>,
}

impl Problem {
    fn new(option: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            option: option.into(),
            message: message.into(),
            file: None,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            return write!(f, "{file}: key `{}`: {}", self.option, self.message);
        }
        write!(
            f,
            "--{} ({}{}): {}",
            self.option.replace('_', "-"),
            ENV_PREFIX,
            self.option.to_uppercase(),
            self.message
        )
    }
}

/// Every problem found, reported together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:{}", .0.iter().map(|p| format!("\n  {p}")).collect::<String>())]
pub struct ConfigError(pub Vec<Problem>);

impl Settings {
    /// Layers, lowest first: defaults, the TOML file (if any), `KVEVENT_*` environment, then
    /// `overrides` (the flags actually given). Then validates everything.
    pub fn load(file: Option<&PathBuf>, overrides: impl Serialize) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Settings::default()));
        let mut file_problems = Vec::new();
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError(vec![Problem::new(
                    "config",
                    format!("no such file {}", path.display()),
                )]));
            }
            match FileLayer::read(path) {
                Ok((layer, unknown)) => {
                    file_problems = unknown;
                    figment = figment.merge(layer);
                }
                Err(problem) => return Err(ConfigError(vec![problem])),
            }
        }
        // Only our options: other KVEVENT_* variables (a test harness's, say) are not ours.
        let known = known_options();
        let figment = figment
            .merge(
                Env::prefixed(ENV_PREFIX)
                    .filter(move |k| known.iter().any(|o| k.as_str().eq_ignore_ascii_case(o))),
            )
            .merge(Serialized::defaults(overrides));
        // Deserialization stops at the first bad value: note it, put the default in its place
        // and go on, so every bad value is reported at once (with the checks below).
        let mut figment = figment;
        let mut problems = file_problems;
        let defaults = Figment::from(Serialized::defaults(Settings::default()));
        let mut settings: Settings = loop {
            match figment.extract::<Settings>() {
                Ok(s) => break s,
                Err(e) => {
                    let mut fixed = false;
                    for e in e {
                        let option = e.path.last().cloned().unwrap_or_else(|| "config".into());
                        let file = e.metadata.as_ref().and_then(|m| match &m.source {
                            Some(figment::Source::File(p)) => Some(p.display().to_string()),
                            _ => None,
                        });
                        problems.push(Problem {
                            option: option.clone(),
                            message: e.kind.to_string(),
                            file,
                        });
                        if let Ok(default) = defaults.find_value(&option) {
                            figment = figment.merge(Serialized::default(&option, default));
                            fixed = true;
                        }
                    }
                    if !fixed || problems.len() > 256 {
                        return Err(ConfigError(problems));
                    }
                }
            }
        };
        if settings.window.0.is_zero() {
            // The Go sidecar clamps a zero window to its default; manifests that set it exist.
            settings.window = Settings::default().window;
            settings.adjustments.push(format!(
                "--window 0 is not a window: using the default {} (as the Go sidecar does)",
                settings.window
            ));
        }
        if settings.hash_scheme.eq_ignore_ascii_case("sglang")
            && settings.engine == kvevent_wire::Engine::Vllm
        {
            settings.engine = kvevent_wire::Engine::Sglang;
            settings.adjustments.push(
                "--hash-scheme sglang: reading SGLang's KV-event wire (--engine sglang)".into(),
            );
        }
        if let Err(ConfigError(more)) = settings.validate() {
            problems.extend(more);
        }
        if !problems.is_empty() {
            return Err(ConfigError(problems));
        }
        Ok(settings)
    }

    /// Where `/metrics` listens: `host:port` with an IP address, or Go's listen-address forms
    /// `:port` (every address) and `localhost:port`. `None` when off or not an address.
    pub fn metrics_socket_addr(&self) -> Option<std::net::SocketAddr> {
        listen_addr(&self.metrics_address)
    }

    /// Where the router feed listens, in the forms of [`Settings::metrics_socket_addr`].
    pub fn feed_socket_addr(&self) -> Option<std::net::SocketAddr> {
        listen_addr(&self.feed_address)
    }

    /// Checks every option; reports every problem at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let mut bad = |option: &str, message: String| problems.push(Problem::new(option, message));
        for (option, value) in [
            ("replica_id", &self.replica_id),
            ("model_id", &self.model_id),
            ("hash_scheme", &self.hash_scheme),
        ] {
            if value.trim().is_empty() {
                bad(option, "is required".into());
            }
        }
        for (option, value, allowed) in [
            ("engine_endpoint", &self.engine_endpoint, true),
            (
                "replay_endpoint",
                &self.replay_endpoint,
                !self.replay_endpoint.is_empty(),
            ),
        ] {
            if allowed
                && !["tcp://", "ipc://", "inproc://"]
                    .iter()
                    .any(|p| value.starts_with(p))
            {
                bad(
                    option,
                    format!("`{value}` is not a tcp://, ipc:// or inproc:// endpoint"),
                );
            }
        }
        if self.dp_size == 0 || self.dp_size > 256 {
            bad("dp_size", format!("must be 1 to 256, not {}", self.dp_size));
        } else if self.dp_size > 1 {
            let mut derived = Vec::new();
            for (option, value) in [
                ("engine_endpoint", &self.engine_endpoint),
                ("replay_endpoint", &self.replay_endpoint),
            ] {
                if value.is_empty() {
                    continue;
                }
                for rank in 0..self.dp_size {
                    match kvevent_zmq::dp_endpoint(value, rank) {
                        Ok(e) => derived.push((e, rank, option)),
                        Err(e) => {
                            bad(option, e.to_string());
                            break;
                        }
                    }
                }
            }
            // Adjacent base ports collide once offset by rank (5557/5558: rank 1's PUB is
            // rank 0's replay): vLLM deployments space the bases apart.
            for (i, (endpoint, rank, option)) in derived.iter().enumerate() {
                if let Some((_, other_rank, other_option)) =
                    derived[..i].iter().find(|(e, _, _)| e == endpoint)
                {
                    bad(
                        option,
                        format!(
                            "rank {rank}'s endpoint {endpoint} is also rank {other_rank}'s {} with --dp-size {}: space the base ports at least {} apart",
                            other_option.replace('_', "-"),
                            self.dp_size,
                            self.dp_size
                        ),
                    );
                }
            }
        }
        let server = self.server().unwrap_or_default();
        let host_port = server
            .strip_prefix("http://")
            .or_else(|| server.strip_prefix("https://"))
            .unwrap_or(&server);
        if self.server().is_none() {
            // A feed-only sidecar: no server, and nothing to check.
        } else if host_port.is_empty()
            || !host_port.contains(':')
            || host_port.contains('/')
            || format!("http://{host_port}").parse::<http::Uri>().is_err()
        {
            bad(
                "server",
                format!("`{server}` is not host:port or an http(s):// URI"),
            );
        }
        if let Err(why) = check_log_filter(&self.log_level) {
            bad("log_level", why);
        }
        if let Err(e) = kvevent_mapper::parse_lora_adapters(&self.lora_adapter_names) {
            bad("lora_adapter_names", e.to_string());
        }
        if !self.engine_metrics_url.is_empty() && !self.stats_interval.0.is_zero() {
            let ok = self
                .engine_metrics_url
                .parse::<http::Uri>()
                .is_ok_and(|u| u.scheme_str() == Some("http") && u.host().is_some());
            if !ok {
                bad(
                    "engine_metrics_url",
                    format!("`{}` is not an http:// URL", self.engine_metrics_url),
                );
            }
        }
        if !self.engine_discovery_url.is_empty() {
            let ok = self
                .engine_discovery_url
                .parse::<http::Uri>()
                .is_ok_and(|u| u.scheme_str() == Some("http") && u.host().is_some());
            if !ok {
                bad(
                    "engine_discovery_url",
                    format!(
                        "`{}` is not an http:// URL (e.g. http://127.0.0.1:8000/kv_event_sources)",
                        self.engine_discovery_url
                    ),
                );
            }
        }
        if !self.metrics_address.is_empty() && self.metrics_socket_addr().is_none() {
            bad(
                "metrics_address",
                format!(
                    "`{}` is not host:port (an IP address or localhost, and a port; `:9095` listens on every address)",
                    self.metrics_address
                ),
            );
        }
        if !self.feed_address.is_empty() && self.feed_socket_addr().is_none() {
            bad(
                "feed_address",
                format!(
                    "`{}` is not host:port (an IP address or localhost, and a port; `:7070` listens on every address)",
                    self.feed_address
                ),
            );
        }
        if self.feed_ring_bytes == 0 {
            bad("feed_ring_bytes", "must be at least 1".into());
        }
        if self.feed_tls_cert_file.is_some() != self.feed_tls_key_file.is_some() {
            bad(
                "feed_tls_key_file",
                "the feed's certificate and its key go together: set both or neither".into(),
            );
        }
        for (option, d) in [
            ("window", self.window),
            ("engine_discovery_timeout", self.engine_discovery_timeout),
            ("engine_discovery_recheck", self.engine_discovery_recheck),
            ("engine_silence_grace", self.engine_silence_grace),
            ("rpc_timeout", self.rpc_timeout),
            ("connect_timeout", self.connect_timeout),
            ("max_backoff", self.max_backoff),
            ("replay_timeout", self.replay_timeout),
            ("scrape_timeout", self.scrape_timeout),
        ] {
            if d.0.is_zero() {
                bad(option, "must be more than 0".into());
            }
        }
        if self.engine_rcvhwm < 0 {
            bad("engine_rcvhwm", "must be 0 (no limit) or more".into());
        }
        if self.engine_reconnect_max.0.is_zero() {
            bad("engine_reconnect_max", "must be more than 0".into());
        }
        if self.max_pending == 0 {
            bad("max_pending", "must be at least 1".into());
        }
        if self.max_in_flight == 0 || self.max_in_flight > 1024 {
            bad("max_in_flight", "must be 1 to 1024".into());
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            bad(
                "tls_key_file",
                "a client certificate and its key go together: set both or neither".into(),
            );
        }
        for (option, path) in [
            ("tls_ca_file", &self.tls_ca_file),
            ("tls_cert_file", &self.tls_cert_file),
            ("tls_key_file", &self.tls_key_file),
            ("token_file", &self.token_file),
            ("feed_tls_cert_file", &self.feed_tls_cert_file),
            ("feed_tls_key_file", &self.feed_tls_key_file),
            ("feed_token_file", &self.feed_token_file),
        ] {
            if let Some(path) = path
                && !path.is_file()
            {
                bad(option, format!("no such file {}", path.display()));
            }
        }
        for (option, message) in crate::credentials::check_tls_files(self) {
            bad(option, message);
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError(problems))
        }
    }

    /// The InferenceCache server reports go to: `--server`, or when it is empty,
    /// [`DEFAULT_SERVER`] — unless `--feed-address` is given: then an empty `--server` means
    /// none, a sidecar that serves routers only.
    pub fn server(&self) -> Option<String> {
        match self.server.trim() {
            "" if self.feed_address.trim().is_empty() => Some(DEFAULT_SERVER.to_owned()),
            "" => None,
            server => Some(server.to_owned()),
        }
    }

    /// True when the server is reached over TLS.
    pub fn uses_tls(&self) -> bool {
        self.server.trim().starts_with("https://")
            || self.tls_ca_file.is_some()
            || self.tls_cert_file.is_some()
            || !self.tls_server_name.is_empty()
    }
}

/// A log level (`trace` … `error`, `off`) or filter directives `target=level`, comma-separated.
/// A bare word that is not a level would be read as a target and silence every log line.
fn check_log_filter(filter: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    let is_level = |l: &str| LEVELS.iter().any(|v| v.eq_ignore_ascii_case(l.trim()));
    if filter.trim().is_empty() {
        return Err("is empty: give a level (trace, debug, info, warn, error, off)".into());
    }
    for directive in filter.split(',') {
        let ok = match directive.rsplit_once('=') {
            Some((target, level)) => !target.trim().is_empty() && is_level(level),
            None => is_level(directive),
        };
        if !ok {
            return Err(format!(
                "`{directive}` is neither a level (trace, debug, info, warn, error, off) nor target=level"
            ));
        }
    }
    Ok(())
}

/// A listen address: `host:port` with an IP address, or Go's forms `:port` (every address) and
/// `localhost:port`. `None` when empty or not an address.
fn listen_addr(address: &str) -> Option<std::net::SocketAddr> {
    let a = address.trim();
    if a.is_empty() {
        return None;
    }
    if let Some(port) = a.strip_prefix(':') {
        return port.parse::<u16>().ok().map(|p| ([0, 0, 0, 0], p).into());
    }
    if let Some(port) = a.strip_prefix("localhost:") {
        return port.parse::<u16>().ok().map(|p| ([127, 0, 0, 1], p).into());
    }
    a.parse().ok()
}
