//! Sources and socket options.

use std::time::Duration;

use crate::Error;

/// One engine publisher to subscribe to: an endpoint and its DP rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The engine's PUB endpoint, e.g. `tcp://10.0.0.7:5557`.
    pub endpoint: String,
    /// The engine's replay ROUTER endpoint, if it has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (vLLM's default topic is empty).
    pub topic: Vec<u8>,
    /// Bind instead of connect: for engines whose endpoint has no wildcard (they connect).
    pub bind: bool,
    /// The DP rank this source is.
    pub dp_rank: u32,
}

impl Source {
    /// A short label for logs and metrics: `endpoint` (plus `#rank` when not rank 0).
    pub fn label(&self) -> String {
        if self.dp_rank == 0 {
            self.endpoint.clone()
        } else {
            format!("{}#{}", self.endpoint, self.dp_rank)
        }
    }
}

/// Socket options that matter in production.
#[derive(Debug, Clone)]
pub struct SourceOptions {
    /// SUB receive high-water mark, in messages. Default 100,000 (the engine's own default).
    pub rcvhwm: i32,
    /// ZMTP heartbeat interval. Default 5 s (0 disables).
    pub heartbeat_interval: Duration,
    /// A peer silent this long after a heartbeat is dropped and reconnected. Default 15 s.
    pub heartbeat_timeout: Duration,
    /// First reconnect delay. Default 100 ms.
    pub reconnect_interval: Duration,
    /// Longest reconnect delay (exponential backoff up to it). Default 1 s: a restarted engine
    /// is known (new or the same) only once reconnected, within this of its sockets answering.
    pub reconnect_interval_max: Duration,
    /// TCP keepalive idle time (0 leaves the OS default). Default 60 s.
    pub tcp_keepalive_idle: Duration,
    /// A replay with no reply for this long is over (the end marker can be lost before 0.33).
    /// Default 3 s.
    pub replay_idle_timeout: Duration,
}

impl Default for SourceOptions {
    fn default() -> Self {
        Self {
            rcvhwm: 100_000,
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_timeout: Duration::from_secs(15),
            reconnect_interval: Duration::from_millis(100),
            reconnect_interval_max: Duration::from_secs(1),
            tcp_keepalive_idle: Duration::from_secs(60),
            replay_idle_timeout: Duration::from_secs(3),
        }
    }
}

pub(crate) fn ms(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
}

/// Whether `endpoint` is one ZeroMQ can open (`tcp://HOST:PORT`, `ipc://PATH`,
/// `inproc://NAME`): the workspace's one endpoint rule. If not, what is wrong, with the form it
/// likely meant.
///
/// ```
/// use kvevent_zmq::check_endpoint;
/// assert!(check_endpoint("tcp://127.0.0.1:5557").is_ok());
/// assert!(check_endpoint("tcp://*:5557").is_ok());
/// assert!(check_endpoint("tcp://127.0.0.1:*").is_ok());
/// assert!(check_endpoint("tcp://127.0.0.1").is_err());
/// assert!(check_endpoint("ipc://").is_err());
/// assert_eq!(
///     check_endpoint("127.0.0.1:5557").unwrap_err(),
///     "`127.0.0.1:5557` is not a tcp://, ipc:// or inproc:// endpoint (tcp://127.0.0.1:5557?)"
/// );
/// ```
pub fn check_endpoint(endpoint: &str) -> Result<(), String> {
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        return match rest.rsplit_once(':') {
            // A port, or (to bind) ZeroMQ's any-free-port `*` or `*[FIRST-LAST]`.
            Some((host, port))
                if !host.is_empty() && (port.parse::<u16>().is_ok() || port.starts_with('*')) =>
            {
                Ok(())
            }
            _ => Err(format!(
                "`{endpoint}` is not tcp://HOST:PORT (a host, or * to bind, and a port, or * for any)"
            )),
        };
    }
    for scheme in ["ipc://", "inproc://"] {
        if let Some(rest) = endpoint.strip_prefix(scheme) {
            return if rest.is_empty() {
                Err(format!("`{endpoint}` names no path"))
            } else {
                Ok(())
            };
        }
    }
    let meant = match endpoint.split_once("://") {
        Some((_, rest)) => format!("tcp://{rest}"),
        None if endpoint.starts_with('/') => format!("ipc://{endpoint}"),
        None => format!("tcp://{endpoint}"),
    };
    Err(format!(
        "`{endpoint}` is not a tcp://, ipc:// or inproc:// endpoint ({meant}?)"
    ))
}

/// The endpoint DP rank `rank` uses, by vLLM's rule: a `tcp://` port is offset by the rank,
/// an `inproc://x` becomes `inproc://x_dp{rank}`. Rank 0 is the base endpoint unchanged.
///
/// ```
/// use kvevent_zmq::dp_endpoint;
/// assert_eq!(dp_endpoint("tcp://10.0.0.7:5557", 2)?, "tcp://10.0.0.7:5559");
/// assert_eq!(dp_endpoint("tcp://*:5557", 0)?, "tcp://*:5557");
/// assert_eq!(dp_endpoint("inproc://kv", 1)?, "inproc://kv_dp1");
/// assert!(dp_endpoint("ipc:///tmp/kv", 1).is_err());
/// # Ok::<(), kvevent_zmq::Error>(())
/// ```
pub fn dp_endpoint(base: &str, rank: u32) -> Result<String, Error> {
    if rank == 0 {
        return Ok(base.to_owned());
    }
    let err = |why| Error::DpEndpoint {
        endpoint: base.to_owned(),
        rank,
        why,
    };
    if base.starts_with("inproc://") {
        return Ok(format!("{base}_dp{rank}"));
    }
    if !base.starts_with("tcp://") {
        return Err(err("vLLM offsets only tcp:// and inproc:// endpoints"));
    }
    let (addr, port) = base.rsplit_once(':').ok_or_else(|| err("no port"))?;
    let port: u32 = port.parse().map_err(|_| err("the port is not a number"))?;
    let port = port + rank;
    if port > 65_535 {
        return Err(err("the offset port is above 65535"));
    }
    Ok(format!("{addr}:{port}"))
}

/// One source per rank `0..dp_size`, endpoints derived from the two base endpoints; refused
/// when a base cannot be offset ([`Error::DpEndpoint`]) or two derived endpoints are the same
/// ([`Error::DpCollision`]: adjacent bases, or a replay endpoint that is the events endpoint).
///
/// ```
/// use kvevent_zmq::dp_sources;
/// let ranks = dp_sources("tcp://e:5557", Some("tcp://e:5657"), 2, b"kv-events", false)?;
/// assert_eq!(ranks[1].endpoint, "tcp://e:5558");
/// assert_eq!(ranks[1].replay_endpoint.as_deref(), Some("tcp://e:5658"));
/// let adjacent = dp_sources("tcp://e:5557", Some("tcp://e:5558"), 2, b"kv-events", false);
/// assert_eq!(
///     adjacent.unwrap_err().to_string(),
///     "rank 0's replay endpoint tcp://e:5558 is also rank 1's endpoint with 2 ranks: space the base ports at least 2 apart"
/// );
/// # Ok::<(), kvevent_zmq::Error>(())
/// ```
pub fn dp_sources(
    endpoint: &str,
    replay_endpoint: Option<&str>,
    dp_size: u32,
    topic: &[u8],
    bind: bool,
) -> Result<Vec<Source>, Error> {
    let sources = (0..dp_size.max(1))
        .map(|rank| {
            Ok(Source {
                endpoint: dp_endpoint(endpoint, rank)?,
                replay_endpoint: replay_endpoint.map(|r| dp_endpoint(r, rank)).transpose()?,
                topic: topic.to_vec(),
                bind,
                dp_rank: rank,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    // Every events endpoint, then every replay endpoint: (endpoint, rank, is a replay one).
    let derived: Vec<(&str, u32, bool)> = (sources.iter())
        .map(|s| (s.endpoint.as_str(), s.dp_rank, false))
        .chain(
            sources
                .iter()
                .filter_map(|s| Some((s.replay_endpoint.as_deref()?, s.dp_rank, true))),
        )
        .collect();
    for (i, &(endpoint, rank, replay)) in derived.iter().enumerate() {
        if let Some(&(_, other_rank, other_replay)) = derived[..i].iter().find(|d| d.0 == endpoint)
        {
            return Err(Error::DpCollision {
                endpoint: endpoint.to_owned(),
                rank,
                replay,
                other_rank,
                other_replay,
                dp_size: dp_size.max(1),
            });
        }
    }
    Ok(sources)
}

/// [`Error::DpCollision`]'s message.
pub(crate) fn collision(
    endpoint: &str,
    rank: u32,
    replay: bool,
    other_rank: u32,
    other_replay: bool,
    dp_size: u32,
) -> String {
    let kind = |replay: bool| {
        if replay {
            "replay endpoint"
        } else {
            "endpoint"
        }
    };
    let (kind, other_kind) = (kind(replay), kind(other_replay));
    if rank == other_rank {
        format!(
            "rank {rank}'s {kind} {endpoint} is also its {other_kind}: they are two sockets, on two ports"
        )
    } else {
        format!(
            "rank {rank}'s {kind} {endpoint} is also rank {other_rank}'s {other_kind} with {dp_size} ranks: space the base ports at least {dp_size} apart"
        )
    }
}
