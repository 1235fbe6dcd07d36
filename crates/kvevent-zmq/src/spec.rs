//! How to reach an engine ([`EngineSockets`]), and its text form.

use crate::{Error, Source, dp_sources};

/// How to reach an engine: its sockets, the topic, whose wire, its HTTP server. The one spec
/// the sidecar, `kvevents`, the `Fleet`, the wheel and the example router build their
/// sources from ([`EngineSockets::sources`]); its text form is below.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSockets {
    /// Rank 0's PUB endpoint, `tcp://host:port`.
    pub endpoint: String,
    /// Rank 0's replay endpoint, if any.
    pub replay: Option<String>,
    /// Data-parallel ranks (ports offset by rank, vLLM's rule). Default 1.
    pub dp: u32,
    /// The topic subscribed to; empty for all.
    pub topic: Vec<u8>,
    /// Whose KV-event wire it speaks: vLLM's (the default) or SGLang's.
    pub engine: kvevent_wire::Engine,
    /// The engine's HTTP server, `http://HOST:PORT`, asked at `/health` every second: while it
    /// does not answer, the replica is not exact (`server_down`, then stale); its load is read
    /// from its `/metrics` every 250 ms (as a sidecar's feed would bring it). `None`: its cache
    /// is trusted whether or not it serves, and no load is known.
    pub http: Option<String>,
    /// Bind the events (SUB) socket, for engines that connect to it (an endpoint without a
    /// wildcard on their side).
    pub bind: bool,
}

impl EngineSockets {
    /// One rank at `endpoint`, no replay.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay: None,
            dp: 1,
            topic: Vec::new(),
            engine: kvevent_wire::Engine::Vllm,
            http: None,
            bind: false,
        }
    }

    /// Every rank's source, by vLLM's port-offset rule ([`dp_sources`]): endpoints checked,
    /// ranks whose endpoints collide refused.
    pub fn sources(&self) -> Result<Vec<Source>, Error> {
        for endpoint in std::iter::once(&self.endpoint).chain(&self.replay) {
            crate::check_endpoint(endpoint).map_err(|why| Error::Endpoint {
                endpoint: endpoint.clone(),
                why,
            })?;
        }
        dp_sources(
            &self.endpoint,
            self.replay.as_deref(),
            self.dp,
            &self.topic,
            self.bind,
        )
    }
}

/// The text form of [`EngineSockets`], the one every tool takes after `NAME=`:
/// `tcp://HOST:PORT[,replay=tcp://HOST:PORT][,dp=N][,topic=T][,engine=vllm|sglang][,http=http://HOST:PORT][,bind]`
/// (an endpoint by [`crate::check_endpoint`]'s rule). [`Display`](std::fmt::Display)
/// writes what parses back to the same value, defaults left out.
///
/// ```
/// use kvevent_zmq::EngineSockets;
/// let e: EngineSockets = "tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5558,dp=2,http=http://10.0.0.7:8000"
///     .parse()?;
/// assert_eq!((e.dp, e.replay.as_deref()), (2, Some("tcp://10.0.0.7:5558")));
/// assert_eq!(e.to_string().parse::<EngineSockets>()?, e);
/// assert!("10.0.0.7:5557".parse::<EngineSockets>().unwrap_err().contains("tcp://10.0.0.7:5557?"));
/// # Ok::<(), String>(())
/// ```
impl std::str::FromStr for EngineSockets {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        const FORM: &str = "tcp://HOST:PORT[,replay=tcp://HOST:PORT][,dp=N][,topic=T][,engine=vllm|sglang][,http=http://HOST:PORT][,bind]";
        let mut parts = s.split(',');
        let endpoint = parts.next().unwrap_or_default();
        crate::check_endpoint(endpoint).map_err(|e| format!("{e}: an engine is {FORM}"))?;
        let mut e = EngineSockets::new(endpoint);
        for part in parts {
            if part == "bind" {
                e.bind = true;
                continue;
            }
            match part.split_once('=') {
                Some(("replay", r)) => {
                    crate::check_endpoint(r).map_err(|e| format!("replay={r}: {e}"))?;
                    e.replay = Some(r.to_owned());
                }
                Some(("dp", n)) => {
                    e.dp = n
                        .parse()
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or_else(|| format!("dp={n}: a number of ranks, at least 1"))?;
                }
                Some(("topic", t)) => e.topic = t.as_bytes().to_vec(),
                Some(("engine", w)) => {
                    e.engine = w
                        .parse()
                        .map_err(|_| format!("engine={w}: vllm or sglang"))?;
                }
                Some(("http", h)) => {
                    // The workspace's rule for an engine's server: refused here, not later.
                    let h = kvevent_scrape::url::server_url(h).map_err(|e| format!("http={e}"))?;
                    e.http = Some(h.to_owned());
                }
                _ => return Err(format!("`{part}` in `{s}`: an engine is {FORM}")),
            }
        }
        Ok(e)
    }
}

impl std::fmt::Display for EngineSockets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.endpoint)?;
        if let Some(r) = &self.replay {
            write!(f, ",replay={r}")?;
        }
        if self.dp != 1 {
            write!(f, ",dp={}", self.dp)?;
        }
        if !self.topic.is_empty() {
            write!(f, ",topic={}", String::from_utf8_lossy(&self.topic))?;
        }
        if self.engine != kvevent_wire::Engine::Vllm {
            write!(f, ",engine={}", self.engine.as_str())?;
        }
        if let Some(h) = &self.http {
            write!(f, ",http={h}")?;
        }
        if self.bind {
            f.write_str(",bind")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::EngineSockets;

    #[test]
    fn every_field_round_trips_and_a_bad_one_is_named() {
        let full = EngineSockets {
            endpoint: "tcp://10.0.0.7:5557".into(),
            replay: Some("tcp://10.0.0.7:5558".into()),
            dp: 4,
            topic: b"kv-events".to_vec(),
            engine: kvevent_wire::Engine::Sglang,
            http: Some("http://10.0.0.7:8000".into()),
            bind: true,
        };
        for e in [
            full.clone(),
            EngineSockets::new("ipc:///tmp/kv"),
            EngineSockets::new("inproc://kv"),
        ] {
            let text = e.to_string();
            assert_eq!(text.parse::<EngineSockets>(), Ok(e), "{text}");
        }
        assert_eq!(
            full.to_string(),
            "tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5558,dp=4,topic=kv-events,engine=sglang,http=http://10.0.0.7:8000,bind"
        );
        for (bad, says) in [
            ("10.0.0.7:5557", "tcp://10.0.0.7:5557?"),
            ("tcp://10.0.0.7", "tcp://HOST:PORT"),
            ("tcp://h:1,replay=h:2", "replay=h:2"),
            ("tcp://h:1,dp=0", "dp=0"),
            ("tcp://h:1,engine=tgi", "engine=tgi"),
            (
                "tcp://h:1,http=h:8000",
                "http=`h:8000` is not an http:// URL",
            ),
            ("tcp://h:1,http=https://h:8000", "https is not supported"),
            (
                "tcp://h:1,http=http://h:8000/metrics",
                "is http://HOST:PORT, without a path",
            ),
            ("tcp://h:1,port=2", "`port=2`"),
        ] {
            let e = bad.parse::<EngineSockets>().expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
        // Its sources: two ranks by the port offset, the SUB bound.
        let two: EngineSockets = "tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:6557,dp=2,bind"
            .parse()
            .expect("parses");
        let sources = two.sources().expect("sources");
        assert_eq!(
            sources
                .iter()
                .map(|s| (s.endpoint.as_str(), s.replay_endpoint.as_deref(), s.bind))
                .collect::<Vec<_>>(),
            [
                ("tcp://10.0.0.7:5557", Some("tcp://10.0.0.7:6557"), true),
                ("tcp://10.0.0.7:5558", Some("tcp://10.0.0.7:6558"), true),
            ]
        );
        assert!(
            full.sources().is_err(),
            "rank 1's events port is rank 0's replay port"
        );
    }
}
