//! Replicas from DNS (feature `discover-dns`): a headless Service's records, re-resolved as
//! their TTL says (at least every second, at most every `interval`).
//!
//! - `NAME:PORT`: every A/AAAA record of NAME is a replica, its sidecar's feed at that port.
//! - `_SERVICE._PROTO.NAME` (a name starting with `_`): every SRV record is a replica, its
//!   feed at the record's port on its target's A/AAAA addresses.
//!
//! Each replica is named by its address (`10.0.0.1:7070`; an SRV target's address is named by
//! the target, `pod-0.vllm.ns.svc.cluster.local:7070`, when it has one address), its identity
//! the address; its upstream, when given a port, `http://ADDRESS:PORT`. An answer with no
//! records is a set of none (the Service has no ready pods); a failed lookup keeps the last
//! good set, logged once per distinct error.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use tokio::sync::watch;

use super::{DiscoverError, Member, Members, follow};
use crate::{Fleet, ReplicaSource, SidecarFeed};

/// What is asked of DNS.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ask {
    /// A/AAAA of the name, each address with this port.
    Addresses { name: String, port: u16 },
    /// SRV records of the name.
    Srv { name: String },
}

/// A headless Service's DNS records as a fleet's replicas ([module docs](self)).
#[derive(Debug, Clone)]
pub struct DnsSource {
    ask: Ask,
    model: String,
    upstream_port: Option<u16>,
    server: Option<SocketAddr>,
    interval: Duration,
}

impl DnsSource {
    /// `NAME:PORT` (addresses) or `_SERVICE._PROTO.NAME` (SRV records), resolved with the
    /// system's resolver; sidecars asked for `model`'s feed.
    pub fn new(target: &str, model: impl Into<String>) -> Result<Self, DiscoverError> {
        let bad = |why: &str| DiscoverError::Read {
            what: format!("dns:{target}"),
            why: why.to_owned(),
        };
        let ask = if target.starts_with('_') {
            Ask::Srv {
                name: target.to_owned(),
            }
        } else {
            let (name, port) = target.rsplit_once(':').ok_or_else(|| {
                bad("NAME:PORT (the feed's port), or an SRV name _SERVICE._PROTO.NAME")
            })?;
            let port = port
                .parse()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| bad("the port is a number from 1 to 65535"))?;
            if name.is_empty() {
                return Err(bad("the name is empty"));
            }
            Ask::Addresses {
                name: name.to_owned(),
                port,
            }
        };
        Ok(Self {
            ask,
            model: model.into(),
            upstream_port: None,
            server: None,
            interval: Duration::from_secs(30),
        })
    }

    /// Each replica's upstream is `http://ADDRESS:port`.
    pub fn with_upstream_port(mut self, port: u16) -> Self {
        self.upstream_port = Some(port);
        self
    }

    /// Asks this DNS server (UDP and TCP) instead of the system's.
    pub fn with_server(mut self, server: SocketAddr) -> Self {
        self.server = Some(server);
        self
    }

    /// Re-resolves at least this often, whatever the TTL (default 30 s; never more often than
    /// every second).
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_secs(1));
        self
    }

    fn what(&self) -> String {
        match &self.ask {
            Ask::Addresses { name, port } => format!("dns:{name}:{port}"),
            Ask::Srv { name } => format!("dns:{name}"),
        }
    }

    fn resolver(&self) -> Result<TokioResolver, DiscoverError> {
        let provider = TokioRuntimeProvider::default();
        let failed = |e: &dyn std::fmt::Display| DiscoverError::Read {
            what: self.what(),
            why: format!("the resolver: {e}"),
        };
        let mut builder = match self.server {
            Some(server) => {
                let connection = |mut c: ConnectionConfig| {
                    c.port = server.port();
                    c
                };
                let ns = NameServerConfig::new(
                    server.ip(),
                    true,
                    vec![
                        connection(ConnectionConfig::udp()),
                        connection(ConnectionConfig::tcp()),
                    ],
                );
                TokioResolver::builder_with_config(
                    ResolverConfig::from_parts(None, Vec::new(), vec![ns]),
                    provider,
                )
            }
            None => TokioResolver::builder(provider).map_err(|e| failed(&e))?,
        };
        let options = builder.options_mut();
        // Each round asks again: the records' own TTL decides when.
        options.cache_size = 0;
        options.timeout = Duration::from_secs(2);
        options.attempts = 2;
        builder.build().map_err(|e| failed(&e))
    }

    /// One round: the members DNS says now, and how long that answer holds.
    async fn resolve(
        &self,
        resolver: &TokioResolver,
    ) -> Result<(Vec<Member>, Duration), DiscoverError> {
        let failed = |e: &dyn std::fmt::Display| DiscoverError::Read {
            what: self.what(),
            why: e.to_string(),
        };
        let mut found: Vec<(String, SocketAddr)> = Vec::new();
        let mut ttl = self.interval;
        match &self.ask {
            Ask::Addresses { name, port } => {
                for ip in addresses(resolver, name, &mut ttl)
                    .await
                    .map_err(|e| failed(&e))?
                {
                    let at = SocketAddr::new(ip, *port);
                    found.push((at.to_string(), at));
                }
            }
            Ask::Srv { name } => {
                let lookup = match resolver.srv_lookup(name.as_str()).await {
                    Ok(l) => Some(l),
                    Err(e) if e.is_no_records_found() => None,
                    Err(e) => return Err(failed(&e)),
                };
                for record in lookup.iter().flat_map(|l| l.answers()) {
                    ttl = ttl.min(Duration::from_secs(u64::from(record.ttl)));
                    let RData::SRV(srv) = &record.data else {
                        continue;
                    };
                    let target = srv.target.to_utf8();
                    let target = target.trim_end_matches('.');
                    let ips = addresses(resolver, target, &mut ttl)
                        .await
                        .map_err(|e| failed(&format!("{target}: {e}")))?;
                    let one = ips.len() == 1;
                    for ip in ips {
                        let at = SocketAddr::new(ip, srv.port);
                        let name = if one {
                            format!("{target}:{}", srv.port)
                        } else {
                            at.to_string()
                        };
                        found.push((name, at));
                    }
                }
            }
        }
        found.sort();
        found.dedup_by(|a, b| a.0 == b.0);
        let members = found
            .into_iter()
            .map(|(name, at)| Member {
                name,
                identity: at.to_string(),
                source: ReplicaSource::Sidecar(SidecarFeed {
                    model: self.model.clone(),
                    ..SidecarFeed::new(format!("http://{at}"))
                }),
                upstream: self
                    .upstream_port
                    .map(|p| format!("http://{}", SocketAddr::new(at.ip(), p))),
                ready: true,
            })
            .collect();
        Ok((members, ttl))
    }

    /// Follows the records: resolves now and again as their TTL says, on the fleet's runtime,
    /// and reconciles the fleet with each answer. A failed lookup keeps the last good set
    /// (logged once per distinct error) and is asked again within a second, then less often.
    /// The resolver's own configuration failing is returned, and nothing is started.
    pub fn follow(self, fleet: Arc<Fleet>) -> Result<watch::Receiver<Members>, DiscoverError> {
        let resolver = self.resolver()?;
        let (tx, rx) = watch::channel(Members::default());
        let what = self.what();
        fleet.runtime.spawn(async move {
            let mut last_error: Option<DiscoverError> = None;
            let mut backoff = Duration::from_secs(1);
            loop {
                let wait = match self.resolve(&resolver).await {
                    Ok((members, ttl)) => {
                        if last_error.take().is_some() {
                            tracing::info!(source = %self.what(), "DNS answers again");
                        }
                        backoff = Duration::from_secs(1);
                        tx.send_if_modified(|m| {
                            let changed = **m != members;
                            if changed {
                                *m = Arc::new(members);
                            }
                            changed
                        });
                        ttl.clamp(Duration::from_secs(1), self.interval)
                    }
                    Err(e) => {
                        if last_error.as_ref() != Some(&e) {
                            tracing::error!(source = %self.what(), "DNS lookup failed, the last good set kept: {e}");
                        }
                        last_error = Some(e);
                        let wait = backoff;
                        backoff = (backoff * 2).min(self.interval);
                        wait
                    }
                };
                if tx.is_closed() {
                    return;
                }
                tokio::time::sleep(wait).await;
            }
        });
        Ok(follow(fleet, rx, what))
    }
}

/// `name`'s A and AAAA addresses (none when it has no records), lowering `ttl` to theirs.
async fn addresses(
    resolver: &TokioResolver,
    name: &str,
    ttl: &mut Duration,
) -> Result<Vec<IpAddr>, hickory_resolver::net::NetError> {
    let lookup = match resolver.lookup_ip(name).await {
        Ok(l) => l,
        Err(e) if e.is_no_records_found() => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    for record in lookup.as_lookup().answers() {
        *ttl = (*ttl).min(Duration::from_secs(u64::from(record.ttl)));
    }
    let mut ips: Vec<IpAddr> = lookup.iter().collect();
    ips.sort();
    ips.dedup();
    Ok(ips)
}

/// `dns:`'s text form ([`super::Spec`]): `NAME:PORT` or `_SERVICE._PROTO.NAME`, then
/// `,upstream=PORT`, `,server=IP:PORT`, `,interval=SECONDS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsSpec {
    /// What is resolved.
    pub target: String,
    /// Each replica's upstream port.
    pub upstream: Option<u16>,
    /// The DNS server asked (else the system's).
    pub server: Option<SocketAddr>,
    /// The longest time between lookups.
    pub interval: Option<Duration>,
}

impl std::str::FromStr for DnsSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (mut upstream, mut server, mut interval) = (None, None, None);
        let target = super::options(s, |k, v| {
            match k {
                "upstream" => upstream = Some(v.parse().map_err(|_| "a port")?),
                "server" => server = Some(v.parse().map_err(|_| "IP:PORT")?),
                "interval" => interval = Some(super::seconds(v)?),
                _ => return Err("dns: takes upstream=, server= and interval=".into()),
            }
            Ok(())
        })?;
        // The target is checked as a source is made of it.
        DnsSource::new(target, "").map_err(|e| e.to_string())?;
        Ok(Self {
            target: target.to_owned(),
            upstream,
            server,
            interval,
        })
    }
}

impl DnsSpec {
    /// The source it says, sidecars asked for `model`'s feed.
    pub fn source(&self, model: &str) -> Result<DnsSource, DiscoverError> {
        let mut dns = DnsSource::new(&self.target, model)?;
        if let Some(p) = self.upstream {
            dns = dns.with_upstream_port(p);
        }
        if let Some(s) = self.server {
            dns = dns.with_server(s);
        }
        if let Some(i) = self.interval {
            dns = dns.with_interval(i);
        }
        Ok(dns)
    }
}
