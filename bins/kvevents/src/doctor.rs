//! `kvevents doctor`: checks, one line each, what an operator bringing up a node needs to know
//! about an engine's KV events: where they are published (discovery or flags), whether the
//! PUB socket is exposed beyond loopback, the engine's block size and hash algorithm (from
//! `/metrics`), whether replay answers (a round trip), and what a live batch looks like
//! (wire era, hash kind, DP rank). Exit 0 when nothing failed, 1 otherwise.

use std::time::{Duration, Instant};

use anyhow::Context;
use kvevent_wire::{self as wire, frames};
use kvevent_zmq::Source;

/// What `doctor` was given.
#[derive(clap::Args)]
pub(crate) struct DoctorArgs {
    /// The engine's HTTP base URL (`http://host:8000`): `/metrics` and, on vLLM 0.31+,
    /// `/kv_event_sources` are read from it.
    #[arg(long, value_parser = http_url)]
    engine_url: Option<String>,
    /// The engine's sockets, when they are not discovered from `--engine-url`.
    #[command(flatten)]
    engine: crate::EngineArgs,
    /// How long to wait for the engine at each step (HTTP, replay, a live batch).
    #[arg(long, default_value = "10s", value_parser = parse_secs)]
    timeout: Duration,
}

/// `--engine-url`: an HTTP base URL, or what is wrong with the form it likely meant.
fn http_url(text: &str) -> Result<String, String> {
    kvevent_scrape::url::server_url(text)
        .map(str::to_owned)
        .map_err(|e| e.to_string())
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let n = s.strip_suffix('s').unwrap_or(s);
    n.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("`{s}` is not a number of seconds (e.g. 10s)"))
}

#[derive(Default)]
struct Report {
    failed: bool,
}

impl Report {
    fn ok(&mut self, check: &str, detail: impl std::fmt::Display) {
        println!("ok    {check}: {detail}");
    }

    fn warn(&mut self, check: &str, detail: impl std::fmt::Display) {
        println!("warn  {check}: {detail}");
    }

    fn fail(&mut self, check: &str, detail: impl std::fmt::Display) {
        println!("FAIL  {check}: {detail}");
        self.failed = true;
    }
}

/// Runs every check; true when none failed.
pub(crate) fn run(args: &DoctorArgs) -> anyhow::Result<bool> {
    let mut r = Report::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let base = args
        .engine_url
        .as_deref()
        .map(|u| u.trim_end_matches('/').to_owned());

    // 1. The engine's /metrics: block size and hash algorithm.
    match &base {
        None => r.warn("metrics", "skipped (no --engine-url)"),
        Some(base) => {
            let url = format!("{base}/metrics");
            match runtime.block_on(fetch(&url, args.timeout)) {
                Ok(text) => metrics(&mut r, &text),
                Err(e) => r.fail("metrics", format!("GET {url}: {e:#}")),
            }
        }
    }

    // 2. Where events are published: discovery (0.31+), else the flags.
    let spec = args
        .engine
        .sockets(args.engine.endpoint.as_deref().unwrap_or_default());
    let topic = spec.topic.as_slice();
    let mut bound_as: Vec<String> = Vec::new();
    let sources: Vec<Source> = match (&base, &args.engine.endpoint) {
        (_, Some(_)) => match spec.sources() {
            Ok(s) => {
                r.ok("endpoints", format!("from the flags: {}", labels(&s)));
                bound_as = s.iter().map(|s| s.endpoint.clone()).collect();
                s
            }
            Err(e) => {
                r.fail("endpoints", format!("{e:#}"));
                Vec::new()
            }
        },
        (Some(base), None) => {
            let url = format!("{base}/kv_event_sources");
            match runtime.block_on(fetch(&url, args.timeout)) {
                Ok(body) => {
                    bound_as = listed_endpoints(&body);
                    match kvevent_discovery::parse(body.as_bytes(), &url, topic) {
                        Ok(s) => {
                            r.ok(
                                "endpoints",
                                format!("discovered {} rank(s): {}", s.len(), labels(&s)),
                            );
                            s
                        }
                        Err(e) => {
                            r.fail("endpoints", format!("{e:#}"));
                            Vec::new()
                        }
                    }
                }
                Err(e) => {
                    r.fail(
                        "endpoints",
                        format!("GET {url}: {e:#} (vLLM before 0.31 has no discovery: pass --endpoint and --replay-endpoint as in its --kv-events-config)"),
                    );
                    Vec::new()
                }
            }
        }
        (None, None) => {
            r.fail("endpoints", "give --engine-url (vLLM 0.31+) or --endpoint");
            Vec::new()
        }
    };

    // 3. Exposure: events carry token ids; a PUB bound beyond loopback publishes them.
    for endpoint in &bound_as {
        match exposure(endpoint) {
            Some(host) => r.warn(
                "exposure",
                format!("{endpoint} binds {host}: token ids of every request are published to the network; bind tcp://127.0.0.1 when the subscriber runs beside the engine"),
            ),
            None => r.ok("exposure", format!("{endpoint} is loopback or local")),
        }
    }

    // 4. Per rank: replay round trip, then a live batch.
    let ctx = zmq::Context::new();
    for source in &sources {
        let label = source.label();
        let mut seen: Option<Vec<u8>> = None;
        // Nothing listening is a different fault from an idle engine: say which.
        let listening = match listens(&source.endpoint, args.timeout) {
            Some(Ok(())) => {
                r.ok(&format!("socket {label}"), "something listens there");
                true
            }
            Some(Err(e)) => {
                r.fail(
                    &format!("socket {label}"),
                    format!("nothing listens there ({e}): is vLLM started with --kv-events-config, on this host and port?"),
                );
                false
            }
            None => true,
        };
        match &source.replay_endpoint {
            None => r.warn(
                &format!("replay {label}"),
                "no replay endpoint: gaps and restarts cannot be repaired (set replay_endpoint in --kv-events-config)",
            ),
            // Labelled by its own endpoint; nothing listening fails at once, not after a wait.
            Some(replay) => match listens(replay, args.timeout) {
                Some(Err(e)) => r.fail(
                    &format!("replay {replay}"),
                    format!("nothing listens there ({e}): is it the replay_endpoint of --kv-events-config?"),
                ),
                _ => match replay_round_trip(&ctx, replay, args.timeout) {
                    Ok((n, newest, with_topic, elapsed)) => {
                        let format = if with_topic { "with topic frame: vLLM ≥ 0.26" } else { "without topic frame: before 0.26" };
                        r.ok(
                            &format!("replay {replay}"),
                            format!("{n} buffered batch(es) in {elapsed:?} ({format})"),
                        );
                        seen = newest;
                    }
                    Err(e) => r.fail(&format!("replay {replay}"), format!("{e:#}")),
                },
            },
        }
        if !listening {
            // No batch can come from where nothing listens: no wait for one.
            r.fail(&format!("live {label}"), "skipped: nothing listens there");
            continue;
        }
        match live_batch(&ctx, source, args.timeout) {
            Ok(Some(payload)) => {
                r.ok(&format!("live {label}"), "a batch arrived");
                seen = Some(payload);
            }
            Ok(None) => r.warn(
                &format!("live {label}"),
                format!(
                    "the socket is up but no batch came within {:?}: an idle engine publishes nothing (send a request)",
                    args.timeout
                ),
            ),
            Err(e) => r.fail(&format!("live {label}"), format!("{e:#}")),
        }
        match seen {
            Some(payload) => describe(&mut r, &label, &payload, spec.engine),
            None => r.warn(&format!("batch {label}"), "no batch seen to describe"),
        }
    }
    Ok(!r.failed)
}

async fn fetch(url: &str, timeout: Duration) -> anyhow::Result<String> {
    let fetcher = kvevent_scrape::Fetcher::new(url, timeout, 8 << 20)?;
    Ok(fetcher.fetch().await?)
}

fn labels(sources: &[Source]) -> String {
    sources
        .iter()
        .map(|s| match &s.replay_endpoint {
            Some(r) => format!("{} (replay {r})", s.label()),
            None => s.label(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The PUB endpoints as the engine wrote them in its listing (before wildcards are resolved).
fn listed_endpoints(body: &str) -> Vec<String> {
    serde_json::from_str::<Vec<serde_json::Value>>(body)
        .unwrap_or_default()
        .iter()
        .filter_map(|v| v["endpoint"].as_str().map(str::to_owned))
        .collect()
}

/// The host an endpoint exposes beyond this machine, if it does.
fn exposure(endpoint: &str) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, _) = rest.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let local = matches!(host, "127.0.0.1" | "localhost" | "::1")
        || host.starts_with("127.")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://");
    (!local).then(|| match host {
        "*" | "0.0.0.0" | "::" | "" => format!("{host} (every interface)"),
        h => h.to_owned(),
    })
}

fn metrics(r: &mut Report, text: &str) {
    let exposition = match kvevent_scrape::text::parse(text) {
        Ok(e) => e,
        Err(e) => {
            r.fail("metrics", format!("not Prometheus text: {e}"));
            return;
        }
    };
    match exposition.series("vllm:cache_config_info").next() {
        Some(info) => {
            let get = |k: &str| info.label(k).unwrap_or("?");
            r.ok(
                "metrics",
                format!(
                    "block size {}, {} GPU blocks, prefix-caching hash {}",
                    get("block_size"),
                    get("num_gpu_blocks"),
                    get("prefix_caching_hash_algo"),
                ),
            );
            if info.label("enable_prefix_caching") == Some("False") {
                r.warn(
                    "metrics",
                    "enable_prefix_caching is False: the engine reuses no prefix",
                );
            }
        }
        None => r.warn(
            "metrics",
            "no vllm:cache_config_info: not a vLLM engine, or a release without it",
        ),
    }
}

/// Asks for everything buffered; (batches, the newest payload, topic frame present, time).
fn replay_round_trip(
    ctx: &zmq::Context,
    endpoint: &str,
    timeout: Duration,
) -> anyhow::Result<(u64, Option<Vec<u8>>, bool, Duration)> {
    let dealer = ctx.socket(zmq::DEALER)?;
    dealer.set_linger(0)?;
    dealer
        .connect(endpoint)
        .with_context(|| format!("connect {endpoint}"))?;
    let started = Instant::now();
    dealer.send_multipart(frames::replay_request(0), 0)?;
    let (mut n, mut newest, mut with_topic) = (0u64, None, false);
    loop {
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() || dealer.poll(zmq::POLLIN, left.as_millis() as i64)? == 0 {
            anyhow::bail!(
                "no end marker within {timeout:?} ({n} batch(es) before that): is {endpoint} the engine's replay_endpoint?"
            );
        }
        let msg = dealer.recv_multipart(0)?;
        match frames::parse_replay(&msg)? {
            frames::ReplayReply::Batch { topic, payload, .. } => {
                n += 1;
                with_topic = topic.is_some();
                newest = Some(payload.to_vec());
            }
            frames::ReplayReply::End => return Ok((n, newest, with_topic, started.elapsed())),
        }
    }
}

/// Whether a TCP endpoint accepts a connection (`None`: not a TCP endpoint one can dial, such
/// as `ipc://` or a wildcard host).
fn listens(endpoint: &str, timeout: Duration) -> Option<std::io::Result<()>> {
    use std::net::ToSocketAddrs;
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host == "*" {
        return None;
    }
    let port: u16 = port.parse().ok()?;
    let addrs = match (host, port).to_socket_addrs() {
        Ok(a) => a.collect::<Vec<_>>(),
        Err(e) => return Some(Err(e)),
    };
    let mut last = std::io::Error::other("no address");
    for addr in addrs {
        match std::net::TcpStream::connect_timeout(&addr, timeout) {
            Ok(_) => return Some(Ok(())),
            Err(e) => last = e,
        }
    }
    Some(Err(last))
}

/// Waits for one live batch; `None` when none came in time.
fn live_batch(
    ctx: &zmq::Context,
    source: &Source,
    timeout: Duration,
) -> anyhow::Result<Option<Vec<u8>>> {
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_linger(0)?;
    sub.set_subscribe(&source.topic)?;
    sub.connect(&source.endpoint)
        .with_context(|| format!("connect {}", source.endpoint))?;
    if sub.poll(zmq::POLLIN, timeout.as_millis() as i64)? == 0 {
        return Ok(None);
    }
    let msg = sub.recv_multipart(0)?;
    let live = frames::parse_live(&msg)?;
    Ok(Some(live.payload.to_vec()))
}

fn describe(r: &mut Report, label: &str, payload: &[u8], engine: wire::Engine) {
    let check = format!("batch {label}");
    let batch = match wire::decode_engine(payload, engine, &wire::Limits::DEFAULT) {
        Ok(b) => b,
        Err(e) => {
            r.fail(&check, format!("does not decode: {e}"));
            return;
        }
    };
    let era = match event_form(payload) {
        Some(true) => "events as maps (vLLM ≥ 0.24)",
        Some(false) => "events as positional arrays (vLLM ≤ 0.23)",
        None if batch.events.is_empty() => "no events",
        None => "an unusual layout (decoded all the same)",
    };
    let mut hash = "no stores in it".to_owned();
    let mut block_size = None;
    for e in &batch.events {
        if let wire::Event::BlockStored(s) = e {
            block_size = Some(s.block_size);
            hash = match s.block_hashes.first() {
                Some(wire::BlockHash::Int(_)) => "int hashes".into(),
                Some(wire::BlockHash::Bytes(b)) => format!("{}-byte hashes", b.len()),
                None => hash,
            };
            break;
        }
    }
    let rank = batch
        .data_parallel_rank
        .map_or("no DP rank field (before 0.9.1)".into(), |r| {
            format!("DP rank {r}")
        });
    r.ok(
        &check,
        format!(
            "{} event(s); {era}; {hash}{}; {rank}",
            batch.events.len(),
            block_size.map_or(String::new(), |b| format!(", block size {b}")),
        ),
    );
}

/// Whether the first event is a map (true) or an array (false), read from the msgpack header:
/// `[ts, [event, …], …]`.
fn event_form(payload: &[u8]) -> Option<bool> {
    let mut at = match *payload.first()? {
        0x90..=0x9f => 1,
        0xdc => 3,
        0xdd => 5,
        _ => return None,
    };
    at += match *payload.get(at)? {
        0xcb => 9,
        0xca => 5,
        0x00..=0x7f => 1,
        _ => return None,
    };
    at += match *payload.get(at)? {
        0x91..=0x9f => 1,
        0xdc => 3,
        0xdd => 5,
        _ => return None,
    };
    match *payload.get(at)? {
        0x80..=0x8f | 0xde | 0xdf => Some(true),
        0x90..=0x9f | 0xdc | 0xdd => Some(false),
        _ => None,
    }
}
