//! How option values are read and written: Go durations, words, numbers, switches, paths,
//! listen addresses, engine endpoints, the server, http:// URLs and LoRA names, each from a
//! string (a flag, the environment) or the TOML file's own type, each refused in our words
//! (`` `5x` is not a duration ``), never serde's.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A duration written Go's way: `100ms`, `10s`, `1m30s`, `1h`, `250us`; `0` is zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct GoDuration(pub Duration);

impl GoDuration {
    /// From milliseconds.
    pub const fn ms(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    /// From seconds.
    pub const fn secs(s: u64) -> Self {
        Self(Duration::from_secs(s))
    }
}

/// Parses a Go-style duration.
///
/// ```
/// use kvevent_sidecar::settings::parse_duration;
/// use std::time::Duration;
/// assert_eq!(parse_duration("1m30s")?, Duration::from_secs(90));
/// assert_eq!(parse_duration("50ms")?, Duration::from_millis(50));
/// assert_eq!(parse_duration("1.5s")?, Duration::from_millis(1500));
/// assert!(parse_duration("10").is_err());
/// # Ok::<(), String>(())
/// ```
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let bad = || format!("`{s}` is not a duration (use e.g. 100ms, 10s, 1m30s)");
    if s.is_empty() {
        return Err(bad());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let value: f64 = rest[..num_end].parse().map_err(|_| bad())?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    Duration::try_from_secs_f64(total).map_err(|_| bad())
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.is_zero() {
            f.write_str("0s")
        } else if d.subsec_nanos() == 0 && d.as_secs().is_multiple_of(3600) {
            write!(f, "{}h", d.as_secs() / 3600)
        } else if d.subsec_nanos() == 0 && d.as_secs().is_multiple_of(60) {
            write!(f, "{}m", d.as_secs() / 60)
        } else if d.subsec_nanos() == 0 {
            write!(f, "{}s", d.as_secs())
        } else if d.as_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", d.as_millis())
        } else {
            write!(f, "{}us", d.as_micros())
        }
    }
}

impl Serialize for GoDuration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s)
            .map(GoDuration)
            .map_err(serde::de::Error::custom)
    }
}

/// A string option that the environment layer may have parsed as a number or a bool
/// (`KVEVENT_REPLICA_ID=7`): taken back as the text it was.
pub(crate) fn lenient_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    struct Lenient;
    impl serde::de::Visitor<'_> for Lenient {
        type Value = String;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E>(self, v: &str) -> Result<String, E> {
            Ok(v.to_owned())
        }
        fn visit_u64<E>(self, v: u64) -> Result<String, E> {
            Ok(v.to_string())
        }
        fn visit_i64<E>(self, v: i64) -> Result<String, E> {
            Ok(v.to_string())
        }
        fn visit_f64<E>(self, v: f64) -> Result<String, E> {
            Ok(v.to_string())
        }
        fn visit_bool<E>(self, v: bool) -> Result<String, E> {
            Ok(v.to_string())
        }
    }
    d.deserialize_any(Lenient)
}

/// An option whose values are a few words (`--key-mode engine`).
pub trait Words: Sized + Copy + PartialEq + 'static {
    /// Every value, with its word.
    const WORDS: &'static [(Self, &'static str)];

    /// The value's word.
    fn word(self) -> &'static str {
        Self::WORDS
            .iter()
            .find(|(v, _)| *v == self)
            .map_or("", |(_, w)| w)
    }

    /// The value a word names, or why it names none. Words are exact, as the Go sidecar's
    /// are (`AUTO` is not `auto`); a word that differs only in case is pointed out.
    fn from_word(word: &str) -> Result<Self, String> {
        let word = word.trim();
        if let Some((v, _)) = Self::WORDS.iter().find(|(_, w)| *w == word) {
            return Ok(*v);
        }
        let hint = Self::WORDS
            .iter()
            .find(|(_, w)| w.eq_ignore_ascii_case(word))
            .map(|(_, w)| format!(" (did you mean `{w}`? words are exact)"))
            .unwrap_or_default();
        Err(format!(
            "`{word}` is not {}{hint}",
            one_of(Self::WORDS.iter().map(|(_, w)| *w))
        ))
    }
}

/// `a`, `a or b`, `a, b or c`.
fn one_of<'a>(words: impl Iterator<Item = &'a str>) -> String {
    let words: Vec<&str> = words.collect();
    match words.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

impl Words for LogFormat {
    const WORDS: &'static [(Self, &'static str)] = &[(Self::Text, "text"), (Self::Json, "json")];
}

impl Words for kvevent_wire::Engine {
    const WORDS: &'static [(Self, &'static str)] =
        &[(Self::Vllm, "vllm"), (Self::Sglang, "sglang")];
}

impl Words for kvevent_mapper::KeyMode {
    const WORDS: &'static [(Self, &'static str)] =
        &[(Self::Engine, "engine"), (Self::Fingerprint, "fingerprint")];
}

impl Words for kvevent_scrape::CacheTier {
    const WORDS: &'static [(Self, &'static str)] = &[
        (Self::Auto, "auto"),
        (Self::Kv, "kv"),
        (Self::Gpu, "gpu"),
        (Self::Cpu, "cpu"),
    ];
}

/// The engine metrics profile; `None` is `auto` (read off the metric names).
impl Words for Option<kvevent_scrape::Profile> {
    const WORDS: &'static [(Self, &'static str)] = &[
        (None, "auto"),
        (Some(kvevent_scrape::Profile::Vllm), "vllm"),
        (Some(kvevent_scrape::Profile::VllmLegacy), "vllm-legacy"),
        (Some(kvevent_scrape::Profile::Sglang), "sglang"),
    ];
}

/// Serde for a [`Words`] option (`#[serde(with = "value::words")]`).
pub(crate) mod words {
    use super::Words;

    pub(crate) fn serialize<T: Words, S: serde::Serializer>(
        v: &T,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.word())
    }

    pub(crate) fn deserialize<'de, T: Words, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<T, D::Error> {
        let text = super::lenient_string(d)?;
        T::from_word(&text).map_err(serde::de::Error::custom)
    }
}

/// A whole number type an option can have, with its range.
pub(crate) trait Whole: Sized + TryFrom<i128> + serde::Serialize {
    const LO: i128;
    const HI: i128;
}

macro_rules! whole {
    ($($t:ty),*) => {$(
        impl Whole for $t {
            const LO: i128 = <$t>::MIN as i128;
            const HI: i128 = <$t>::MAX as i128;
        }
    )*};
}
whole!(u32, u64, usize, i32);

/// Serde for a whole number option, from a number or its text (`KVEVENT_DP_SIZE=2`), refused
/// in our words.
pub(crate) mod number {
    use super::Whole;

    pub(crate) fn serialize<T: Whole, S: serde::Serializer>(
        v: &T,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        v.serialize(s)
    }

    pub(crate) fn deserialize<'de, T: Whole, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<T, D::Error> {
        let text = super::lenient_string(d)?;
        let text = text.trim();
        let n: i128 = text
            .parse()
            .map_err(|_| serde::de::Error::custom(format!("`{text}` is not a whole number")))?;
        T::try_from(n).map_err(|_| {
            serde::de::Error::custom(format!("`{text}` is out of range ({} to {})", T::LO, T::HI))
        })
    }
}

/// Serde for a switch: `true` or `false` (a flag given alone is `true`).
pub(crate) mod switch {
    pub(crate) fn serialize<S: serde::Serializer>(v: &bool, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bool(*v)
    }

    pub(crate) fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        let text = super::lenient_string(d)?;
        match text.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(true),
            "false" | "0" | "no" | "off" => Ok(false),
            other => Err(serde::de::Error::custom(format!(
                "`{other}` is not true or false"
            ))),
        }
    }
}

/// Serde for a file option: empty (or unset) is none, as the Go sidecar's flags have it.
pub(crate) mod path {
    use std::path::PathBuf;

    pub(crate) fn serialize<S: serde::Serializer>(
        v: &Option<PathBuf>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_str(
            &v.as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        )
    }

    pub(crate) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<PathBuf>, D::Error> {
        let text = super::lenient_string(d)?;
        Ok((!text.trim().is_empty()).then(|| PathBuf::from(text)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_exact_and_refused_naming_the_choices() {
        assert_eq!(LogFormat::from_word(" json "), Ok(LogFormat::Json));
        // As the Go sidecar's: another case is another word, pointed out.
        assert_eq!(
            LogFormat::from_word("JSON"),
            Err("`JSON` is not text or json (did you mean `json`? words are exact)".to_owned())
        );
        assert_eq!(
            kvevent_mapper::KeyMode::from_word("magic"),
            Err("`magic` is not engine or fingerprint".to_owned())
        );
        assert_eq!(
            <Option<kvevent_scrape::Profile>>::from_word("x"),
            Err("`x` is not auto, vllm, vllm-legacy or sglang".to_owned())
        );
        for (v, w) in kvevent_scrape::CacheTier::WORDS {
            assert_eq!(v.word(), *w);
        }
    }

    #[test]
    fn the_health_check_is_on_the_urls_host() {
        let health = |url: &str| HttpUrl::from(url).server();
        assert_eq!(
            health("http://10.0.0.7:8000/metrics").as_deref(),
            Some("http://10.0.0.7:8000")
        );
        assert_eq!(
            health("http://engine:30000").as_deref(),
            Some("http://engine:30000")
        );
        assert_eq!(health("https://engine/metrics"), None);
        assert_eq!(health("http:///metrics"), None);
        assert_eq!(health(""), None);
    }

    #[test]
    fn urls_endpoints_and_servers_are_read_once_and_refused_in_our_words() {
        assert_eq!(
            HttpUrl::parse("127.0.0.1:8000/metrics"),
            Err(
                "`127.0.0.1:8000/metrics` is not an http:// URL (http://127.0.0.1:8000/metrics?)"
                    .into()
            )
        );
        assert!(HttpUrl::parse("").is_ok_and(|u| u.is_empty() && u.get().is_none()));
        assert_eq!(
            Endpoint::parse("127.0.0.1:5557"),
            Err("`127.0.0.1:5557` is not a tcp://, ipc:// or inproc:// endpoint (tcp://127.0.0.1:5557?)".into())
        );
        assert_eq!(Endpoint::from(" tcp://a:1 ").get(), Some("tcp://a:1"));
        assert_eq!(Endpoint::from("").get(), None);
        let server = |text: &str| Server::parse(text).map(|s| s.uri(false));
        assert_eq!(server("cache:9090").as_deref(), Ok("http://cache:9090"));
        assert_eq!(
            server("http://cache:9090/").as_deref(),
            Ok("http://cache:9090")
        );
        assert_eq!(
            server("https://cache:9090").as_deref(),
            Ok("https://cache:9090")
        );
        assert_eq!(Server::from("cache:9090").uri(true), "https://cache:9090");
        for bad in [
            "cache",
            "http://cache",
            "cache:9090/x",
            ":9090",
            "not an address",
        ] {
            assert!(Server::parse(bad).is_err(), "{bad}");
        }
        assert!(Server::parse(" ").is_ok_and(|s| s.is_empty()));
    }
}

/// An option's value read once from its text: built in code from text that is not one, it holds
/// why (`check::parsed` says so).
pub trait Parsed {
    /// Why the text is not one, when it is not.
    fn problem(&self) -> Option<&str>;
}

/// For an option's type read once from its text (`From<&str>`, keeping the text and, when the
/// text is not one, why in `bad`): `parse`, [`Parsed`], `From<String>`, `Display` and serde as
/// the text.
macro_rules! read_once {
    ($ty:ident) => {
        impl $ty {
            /// Reads `text`, or says why it is not one, in our words.
            pub fn parse(text: &str) -> Result<Self, String> {
                let value = Self::from(text);
                match value.bad {
                    Some(why) => Err(why),
                    None => Ok(value),
                }
            }
        }

        impl Parsed for $ty {
            fn problem(&self) -> Option<&str> {
                self.bad.as_deref()
            }
        }

        impl From<String> for $ty {
            fn from(text: String) -> Self {
                Self::from(text.as_str())
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.text)
            }
        }

        impl Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.text)
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                Self::parse(&lenient_string(d)?).map_err(serde::de::Error::custom)
            }
        }
    };
}

/// Where we listen: `host:port` with an IP address, or Go's forms `:port` (every address) and
/// `localhost:port`; empty: not at all. Read once, as the option is; `start` binds what it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListenAddress {
    text: String,
    addr: Option<std::net::SocketAddr>,
}

impl ListenAddress {
    /// The address, `None` when empty (or, built in code from bad text, not an address).
    pub fn addr(&self) -> Option<std::net::SocketAddr> {
        self.addr
    }

    /// Empty: do not listen.
    pub fn is_empty(&self) -> bool {
        self.text.trim().is_empty()
    }

    /// As written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Parses `text`, or says why it is not an address.
    pub fn parse(text: &str) -> Result<Self, String> {
        let address = Self::from(text);
        if address.is_empty() || address.addr.is_some() {
            Ok(address)
        } else {
            Err(format!(
                "`{text}` is not host:port (an IP address or localhost, and a port; `:PORT` listens on every address)"
            ))
        }
    }
}

/// Reads `text` as it is; one that is not an address holds none (`Settings::validate` says so).
impl From<&str> for ListenAddress {
    fn from(text: &str) -> Self {
        let a = text.trim();
        let addr = if a.is_empty() {
            None
        } else if let Some(port) = a.strip_prefix(':') {
            port.parse::<u16>().ok().map(|p| ([0, 0, 0, 0], p).into())
        } else if let Some(port) = a.strip_prefix("localhost:") {
            port.parse::<u16>().ok().map(|p| ([127, 0, 0, 1], p).into())
        } else {
            a.parse().ok()
        };
        Self {
            text: text.to_owned(),
            addr,
        }
    }
}

impl fmt::Display for ListenAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Serialize for ListenAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for ListenAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::parse(&lenient_string(d)?).map_err(serde::de::Error::custom)
    }
}

/// Adapter names for LoRA ids (`1=a,2=b`), for engines whose events carry no `lora_name`. Read
/// once, as the option is; the mapper takes the map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraAdapters {
    text: String,
    map: std::collections::HashMap<i64, std::sync::Arc<str>>,
    /// Why the text, built in code, is not a map (`Settings::validate` says so).
    bad: Option<String>,
}

impl LoraAdapters {
    /// The names by id.
    pub fn map(&self) -> &std::collections::HashMap<i64, std::sync::Arc<str>> {
        &self.map
    }
}

/// Reads `text`; one that is not a map holds none and says why ([`Parsed::problem`]).
impl From<&str> for LoraAdapters {
    fn from(text: &str) -> Self {
        let (map, bad) = match kvevent_mapper::parse_lora_adapters(text) {
            Ok(map) => (map, None),
            Err(e) => (Default::default(), Some(e.to_string())),
        };
        Self {
            text: text.to_owned(),
            map,
            bad,
        }
    }
}

read_once!(LoraAdapters);

/// A ZeroMQ endpoint of the engine's: `tcp://host:port`, `ipc://path` or `inproc://name`;
/// empty: none. Read once, as the option is; the sources are made from what it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoint {
    text: String,
    /// Why the text, built in code, is not an endpoint (`Settings::validate` says so).
    bad: Option<String>,
}

impl Endpoint {
    /// The endpoint, `None` when empty.
    pub fn get(&self) -> Option<&str> {
        (!self.text.is_empty()).then_some(self.text.as_str())
    }

    /// Empty: none.
    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }
}

/// Reads `text` (trimmed); one that is not an endpoint says why ([`Parsed::problem`]).
impl From<&str> for Endpoint {
    fn from(text: &str) -> Self {
        let text = text.trim().to_owned();
        let bad = if text.is_empty() {
            None
        } else {
            kvevent_zmq::check_endpoint(&text).err()
        };
        Self { text, bad }
    }
}

read_once!(Endpoint);

/// The InferenceCache server: `host:port`, or an `http://` or `https://` URI of one; empty: the
/// default (none with a feed, `Settings::server`). Read once, as the option is; the forwarder
/// connects to [`Server::uri`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Server {
    text: String,
    /// `https://` was written.
    https: bool,
    /// `host:port`; empty when the text is.
    authority: String,
    /// Why the text, built in code, is not a server (`Settings::validate` says so).
    bad: Option<String>,
}

impl Server {
    /// Empty: the default, or none with a feed.
    pub fn is_empty(&self) -> bool {
        self.authority.is_empty() && self.bad.is_none()
    }

    /// `https://` was written.
    pub fn is_https(&self) -> bool {
        self.https
    }

    /// The URI to connect to: `https://` with `tls`, else as written (`http://` for bare
    /// `host:port`).
    pub fn uri(&self, tls: bool) -> String {
        let scheme = if tls || self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.authority)
    }
}

/// Reads `text`; one that is not a server says why ([`Parsed::problem`]).
impl From<&str> for Server {
    fn from(text: &str) -> Self {
        let written = text.trim();
        let (https, authority) = match written.strip_prefix("https://") {
            Some(rest) => (true, rest),
            None => (false, written.strip_prefix("http://").unwrap_or(written)),
        };
        let authority = authority.strip_suffix('/').unwrap_or(authority);
        let valid = authority.contains(':')
            && !authority.contains('/')
            && authority
                .parse::<http::uri::Authority>()
                .is_ok_and(|a| a.port_u16().is_some() && !a.host().is_empty());
        let bad = (!written.is_empty() && !valid)
            .then(|| format!("`{written}` is not host:port or an http(s):// URI of one"));
        Self {
            text: text.to_owned(),
            https,
            authority: if bad.is_none() {
                authority.to_owned()
            } else {
                String::new()
            },
            bad,
        }
    }
}

read_once!(Server);

/// An `http://` URL of the engine's (its `/metrics`, its list of endpoints); empty: none. Read
/// once, as the option is; the scraper, discovery and the health check use what it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpUrl {
    text: String,
    uri: Option<http::Uri>,
    /// Why the text, built in code, is not an http:// URL (`Settings::validate` says so).
    bad: Option<String>,
}

impl HttpUrl {
    /// The URL, `None` when empty.
    pub fn get(&self) -> Option<&str> {
        self.uri.is_some().then_some(self.text.as_str())
    }

    /// Empty: none.
    pub fn is_empty(&self) -> bool {
        self.uri.is_none() && self.bad.is_none()
    }

    /// `http://host:port`: the URL's server, the engine's HTTP server (its `/health` is asked,
    /// `kvevent_scrape::EngineHealth`).
    pub fn server(&self) -> Option<String> {
        let authority = self.uri.as_ref()?.authority()?;
        Some(format!("http://{authority}"))
    }
}

/// Reads `text` (trimmed); one that is not an http:// URL with a host says why
/// ([`Parsed::problem`]).
impl From<&str> for HttpUrl {
    fn from(text: &str) -> Self {
        let text = text.trim().to_owned();
        if text.is_empty() {
            return Self::default();
        }
        match text.parse::<http::Uri>() {
            Ok(uri) if uri.scheme_str() == Some("http") && uri.host().is_some() => Self {
                text,
                uri: Some(uri),
                bad: None,
            },
            _ => Self {
                bad: Some(if text.contains("://") {
                    format!("`{text}` is not an http:// URL")
                } else {
                    format!("`{text}` is not an http:// URL (http://{text}?)")
                }),
                text,
                uri: None,
            },
        }
    }
}

read_once!(HttpUrl);
