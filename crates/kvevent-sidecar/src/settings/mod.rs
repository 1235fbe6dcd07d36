//! Every option of the subscriber: defaults, TOML file, environment, flags; validated at once.

use std::fmt;
use std::path::PathBuf;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::Serialize;

mod value;

pub use value::{
    Endpoint, GoDuration, HttpUrl, ListenAddress, LogFormat, LoraAdapters, Parsed, Server, Words,
    parse_duration,
};

/// Prefix of every environment variable (`KVEVENT_REPLICA_ID`, ...).
pub const ENV_PREFIX: &str = "KVEVENT_";

/// The InferenceCache server when `--server` is empty and no `--feed-address` is given (the
/// Go sidecar's default).
pub const DEFAULT_SERVER: &str = "127.0.0.1:9090";

/// Defines [`Settings`] (each option a field, and the adjustments `load` made), its `Default`,
/// and [`OPTIONS`], from the entries in `options.rs`.
macro_rules! define_options {
    ($(
        $(#[doc = $doc:literal])+
        $name:ident: $ty:ty = $default:expr, $value:literal $(check($check:expr))?
            $(, #[$attr:meta])?;
    )*) => {
        /// Every option, with the Go sidecar's names and defaults where it has them.
        #[derive(Debug, Clone, PartialEq, ::serde::Serialize, ::serde::Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct Settings {
            $(
                $(#[doc = $doc])+
                $(#[$attr])?
                pub $name: $ty,
            )*
            /// Changes [`Settings::load`] made to the configuration given, to be logged once
            /// logging is set up (a zero `--window` becomes the default). Not an option.
            #[serde(skip)]
            pub adjustments: Vec<String>,
        }

        impl Default for Settings {
            fn default() -> Self {
                Self {
                    $($name: $default,)*
                    adjustments: Vec::new(),
                }
            }
        }

        impl Settings {
            /// What each option must be on its own (the `check` of its entry), in `--help`
            /// order.
            pub(super) fn own_problems(&self) -> Vec<$crate::settings::Problem> {
                #[allow(unused_mut)]
                let mut problems = Vec::new();
                $($(
                    if let Err(why) = ($check)(&self.$name) {
                        problems.push($crate::settings::Problem::new(stringify!($name), why));
                    }
                )?)*
                problems
            }
        }

        /// Every option's name, placeholder and help, in `--help` order.
        pub const OPTIONS: &[$crate::settings::OptionSpec] = &[
            $($crate::settings::OptionSpec {
                name: stringify!($name),
                value: $value,
                doc: concat!($($doc, "\n"),+),
            },)*
        ];
    };
}
pub(crate) use define_options;

mod check;
mod options;

pub use options::{OPTIONS, Settings};

/// One option as the command line shows it.
#[derive(Debug, Clone, Copy)]
pub struct OptionSpec {
    /// Its name: the TOML key; the flag and the environment variable are made from it.
    pub name: &'static str,
    /// The placeholder for its value in `--help` (empty: the name in capitals; `BOOL`: a
    /// switch).
    pub value: &'static str,
    /// Its doc comment, as written.
    doc: &'static str,
}

impl OptionSpec {
    /// Its `--help`: the doc comment on one line, without its last full stop.
    pub fn help(&self) -> String {
        let text = self
            .doc
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        text.strip_suffix('.').map_or(text.clone(), str::to_owned)
    }

    /// A switch: `--flag` alone is `true`; a value must be given as `--flag=false`.
    pub fn is_switch(&self) -> bool {
        self.value == "BOOL"
    }

    /// The flag, `--` and the name with `-` for `_`.
    pub fn flag(&self) -> String {
        self.name.replace('_', "-")
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
    OPTIONS.iter().map(|o| o.name.to_owned()).collect()
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

    /// Checks every option; reports every problem at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = self.own_problems();
        // Between options, from here on. The ranks' endpoints, when the base ones and the
        // rank count are good on their own (else that is the problem said).
        if self.engine_discovery_url.is_empty()
            && (1..=256).contains(&self.dp_size)
            && self.engine_endpoint.problem().is_none()
            && self.replay_endpoint.problem().is_none()
            && let Err(more) = self.engine_sources()
        {
            problems.extend(more);
        }
        let mut bad = |option: &str, message: String| problems.push(Problem::new(option, message));
        if self.feed_tls_cert_file.is_some() != self.feed_tls_key_file.is_some() {
            bad(
                "feed_tls_key_file",
                "the feed's certificate and its key go together: set both or neither".into(),
            );
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            bad(
                "tls_key_file",
                "a client certificate and its key go together: set both or neither".into(),
            );
        }
        for (option, message) in crate::credentials::check_tls_files(self.tls_files()) {
            bad(option, message);
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError(problems))
        }
    }

    /// The InferenceCache server reports go to, as a URI (`https://` when TLS is on):
    /// `--server`, or when it is empty, [`DEFAULT_SERVER`] — unless `--feed-address` is given:
    /// then an empty `--server` means none, a sidecar that serves routers only.
    pub fn server(&self) -> Option<String> {
        let default;
        let server = if !self.server.is_empty() {
            &self.server
        } else if self.feed_address.is_empty() {
            default = Server::from(DEFAULT_SERVER);
            &default
        } else {
            return None;
        };
        Some(server.uri(self.uses_tls()))
    }

    /// True when the server is reached over TLS.
    pub fn uses_tls(&self) -> bool {
        self.server.is_https()
            || self.tls_ca_file.is_some()
            || self.tls_cert_file.is_some()
            || !self.tls_server_name.is_empty()
    }

    /// How to reach the engine, as these options say it (`--engine-endpoint`,
    /// `--replay-endpoint`, `--dp-size`, `--topic`, `--engine`, `--engine-bind`, and the
    /// engine's HTTP server on `--engine-metrics-url`'s host): the spec every tool takes.
    pub fn engine_sockets(&self) -> kvevent_zmq::EngineSockets {
        kvevent_zmq::EngineSockets {
            endpoint: self.engine_endpoint.get().unwrap_or_default().to_owned(),
            replay: self.replay_endpoint.get().map(str::to_owned),
            dp: self.dp_size,
            topic: self.topic.as_bytes().to_vec(),
            engine: self.engine,
            http: self.engine_metrics_url.server(),
            bind: self.engine_bind,
        }
    }

    /// Every DP rank's source, its endpoints derived from the base endpoints by vLLM's port
    /// offset ([`Settings::engine_sockets`], with `--dp-size`; not used with
    /// `--engine-discovery-url`, whose listing names them): what `validate` checks is what
    /// `start` subscribes to. Refused, under the option whose endpoint is at fault, when a base
    /// cannot be offset or two ranks' endpoints would be the same.
    pub fn engine_sources(&self) -> Result<Vec<kvevent_zmq::Source>, Vec<Problem>> {
        use kvevent_zmq::Error;
        let spec = self.engine_sockets();
        let (endpoint, replay) = (spec.endpoint.as_str(), spec.replay.as_deref());
        let e = match spec.sources() {
            Ok(sources) => return Ok(sources),
            Err(e) => e,
        };
        let of_replay = match &e {
            Error::DpEndpoint { endpoint: base, .. } => base != endpoint,
            Error::DpCollision { replay, .. } => *replay,
            _ => false,
        };
        let option = if of_replay {
            "replay_endpoint"
        } else {
            "engine_endpoint"
        };
        let mut problems = vec![Problem::new(option, e.to_string())];
        // The engine endpoint's problem came first: the replay endpoint's own, if any, too.
        let replay_alone = |replay: &str| kvevent_zmq::EngineSockets {
            endpoint: replay.to_owned(),
            replay: None,
            ..spec.clone()
        };
        if let (false, Some(replay)) = (of_replay, replay)
            && let Err(e) = replay_alone(replay).sources()
        {
            problems.push(Problem::new("replay_endpoint", e.to_string()));
        }
        Err(problems)
    }

    /// The TLS files and name for the server connection, as `credentials` reads them.
    pub fn tls_files(&self) -> crate::credentials::TlsFiles<'_> {
        crate::credentials::TlsFiles {
            enabled: self.uses_tls(),
            ca: self.tls_ca_file.as_deref(),
            cert: self.tls_cert_file.as_deref(),
            key: self.tls_key_file.as_deref(),
            server_name: &self.tls_server_name,
        }
    }
}
