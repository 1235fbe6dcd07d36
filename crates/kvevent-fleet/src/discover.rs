//! Replicas discovered (feature `discover`): a source of the fleet's membership, a set of
//! [`Member`]s, and the one loop that reconciles the [`Fleet`] with each set it reads (adds
//! what is new, keeps what is there, removes what left, marks what is not ready), keeping the
//! last good set whenever the source fails.
//!
//! - **A file** ([`FileSource`]): one replica a line, read again when its bytes change (looked
//!   at every 200 ms); a bad file keeps the last good set, with one clear error naming the line.
//!
//! - **DNS** ([`dns::DnsSource`], feature `discover-dns`): a headless Service's A/AAAA (or SRV)
//!   records, re-resolved as their TTL says; a failed lookup keeps the last good set.
//! - **Kubernetes** ([`kube::KubeSource`], feature `discover-kube`): the pods a label selector
//!   picks, one replica a pod by its UID, listed again every resync beside the watch.
//! - **A router's flags** ([`Listed`]): replicas listed by hand, in the file's words, joined by
//!   name ([`listed`]) and reconciled once; [`Upstreams`] are where requests may go, of these
//!   and of a discovered set.
//!
//! A router that lists its replicas itself builds none of this.
//!
//! Invariants: a member is one replica by its identity (a pod's UID; else its address): the
//! same name with another identity is removed, then followed anew, so a new process never
//! answers with the old one's blocks; only replicas this loop added are ever removed by it; a
//! failed read never removes anything.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::{Fleet, ReplicaSource, SidecarFeed};

#[cfg(feature = "discover-dns")]
pub mod dns;
#[cfg(feature = "discover-kube")]
pub mod kube;
mod listed;

pub use listed::{Listed, Upstream, Upstreams, listed};

/// One replica as discovery sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its name in the fleet.
    pub name: String,
    /// What makes it the same replica: a pod's UID, or its source's address. Another
    /// identity under the same name is a new replica.
    pub identity: String,
    /// How it is followed.
    pub source: ReplicaSource,
    /// Its OpenAI-compatible server (`http://host:port`), where requests routed to it go.
    pub upstream: Option<String>,
    /// It may take requests (a pod that is Ready).
    pub ready: bool,
}

/// A set of members, sorted by name, as one read of a source found it.
pub type Members = Arc<Vec<Member>>;

/// A source that cannot be read, or says something that is not a set of replicas.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiscoverError {
    /// The source could not be read (a file, a DNS server, an API server).
    #[error("{what}: {why}")]
    Read {
        /// What was read.
        what: String,
        /// Why it failed.
        why: String,
    },
    /// What it said is not a set of replicas.
    #[error("{what}, line {line}: {why}")]
    Invalid {
        /// What was read.
        what: String,
        /// The line (1 on).
        line: usize,
        /// What is wrong.
        why: String,
    },
}

/// The replicas a [`reconcile`] added, by name: what identity and source each was added with.
#[derive(Debug, Default)]
pub struct Reconciled {
    added: HashMap<String, (String, ReplicaSource)>,
}

/// What one [`reconcile`] changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    /// Replicas followed anew (new, or a new identity or source under an old name).
    pub added: Vec<String>,
    /// Replicas no longer followed.
    pub removed: Vec<String>,
    /// Members that could not be followed as given, and why (skipped; logged).
    pub skipped: Vec<(String, String)>,
}

/// Makes the fleet follow `members`: each new one followed, one whose identity or source
/// changed removed and followed anew, each one's readiness said, and what this loop added
/// before that is not among them removed. Replicas it did not add are never touched.
pub fn reconcile(fleet: &Fleet, state: &mut Reconciled, members: &[Member]) -> Changes {
    let mut changes = Changes::default();
    let mut seen: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for m in members {
        if !seen.insert(&m.name) {
            changes
                .skipped
                .push((m.name.clone(), "a second member of this name".into()));
            continue;
        }
        let same = state
            .added
            .get(&m.name)
            .is_some_and(|(identity, source)| *identity == m.identity && *source == m.source);
        if !same {
            if state.added.remove(&m.name).is_some() {
                // Another process (or source) under the same name: what the old one held goes.
                fleet.remove_replica(&m.name);
            }
            if let Err(e) = fleet.ensure_replica(&m.name, m.source.clone()) {
                changes.skipped.push((m.name.clone(), e.to_string()));
                continue;
            }
            state
                .added
                .insert(m.name.clone(), (m.identity.clone(), m.source.clone()));
            changes.added.push(m.name.clone());
        }
        fleet.set_ready(&m.name, m.ready);
    }
    let gone: Vec<String> = state
        .added
        .keys()
        .filter(|n| !seen.contains(n.as_str()))
        .cloned()
        .collect();
    for name in gone {
        state.added.remove(&name);
        fleet.remove_replica(&name);
        changes.removed.push(name);
    }
    changes.added.sort();
    changes.removed.sort();
    changes
}

/// Reconciles `fleet` with each set `sets` brings, until it closes (or the fleet's runtime
/// stops): the set in force is published on the returned receiver (what a router routes
/// among), the one there now before this returns. Each change is logged.
pub fn follow(
    fleet: Arc<Fleet>,
    mut sets: watch::Receiver<Members>,
    source: String,
) -> watch::Receiver<Members> {
    // The set there now is in force before this returns (a file's first read).
    let mut state = Reconciled::default();
    let members = sets.borrow_and_update().clone();
    let changes = reconcile(&fleet, &mut state, &members);
    log(&source, &members, &changes);
    let (tx, rx) = watch::channel(members);
    let runtime = fleet.runtime.clone();
    runtime.spawn(async move {
        while sets.changed().await.is_ok() {
            let members = sets.borrow_and_update().clone();
            let changes = reconcile(&fleet, &mut state, &members);
            log(&source, &members, &changes);
            tx.send_replace(members);
        }
    });
    rx
}

fn log(source: &str, members: &[Member], c: &Changes) {
    for (name, why) in &c.skipped {
        tracing::warn!(%source, replica = %name, "discovered replica skipped: {why}");
    }
    if !c.added.is_empty() || !c.removed.is_empty() {
        tracing::info!(
            %source,
            replicas = members.len(),
            ready = members.iter().filter(|m| m.ready).count(),
            added = ?c.added,
            removed = ?c.removed,
            "replicas discovered"
        );
    }
}

/// A file of replicas, one a line (`#` starts a comment):
///
/// ```text
/// # NAME  SOURCE                                              [upstream=URL] [ready=false]
/// a       sidecar=http://10.0.0.1:7070                        upstream=http://10.0.0.1:8000
/// b       engine=tcp://10.0.0.2:5557,replay=tcp://10.0.0.2:5558 upstream=http://10.0.0.2:8000
/// ```
///
/// `engine=` takes [`EngineSockets`](crate::EngineSockets)' text form (feature `engines`).
/// The file is read again when its contents change.
#[derive(Debug, Clone)]
pub struct FileSource {
    path: PathBuf,
    model: String,
    interval: Duration,
}

impl FileSource {
    /// The file at `path`; sidecars are asked for `model`'s feed ("" for whatever they serve).
    pub fn new(path: impl Into<PathBuf>, model: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            model: model.into(),
            interval: Duration::from_millis(200),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and parses the file once.
    pub fn read(&self) -> Result<Vec<Member>, DiscoverError> {
        self.read_bytes().and_then(|bytes| self.parse(&bytes))
    }

    fn read_bytes(&self) -> Result<Vec<u8>, DiscoverError> {
        std::fs::read(&self.path).map_err(|e| DiscoverError::Read {
            what: self.path.display().to_string(),
            why: e.to_string(),
        })
    }

    fn parse(&self, bytes: &[u8]) -> Result<Vec<Member>, DiscoverError> {
        let what = self.path.display().to_string();
        let text = std::str::from_utf8(bytes).map_err(|e| DiscoverError::Read {
            what: what.clone(),
            why: format!("not UTF-8: {e}"),
        })?;
        parse(text, &what, &self.model)
    }

    /// Follows the file: reads it now and whenever it changes, on the fleet's runtime, and
    /// reconciles the fleet with each good read. A bad read keeps the last good set and logs
    /// one error (again only when the error changes). The first read's error is returned, and
    /// nothing is started.
    pub fn follow(self, fleet: Arc<Fleet>) -> Result<watch::Receiver<Members>, DiscoverError> {
        let bytes = self.read_bytes()?;
        let first = self.parse(&bytes)?;
        let (tx, rx) = watch::channel(Arc::new(first));
        let runtime = fleet.runtime.clone();
        let what = format!("file {}", self.path.display());
        runtime.spawn(async move {
            // What the first set was read from: a change made before this task runs is seen.
            let mut seen = Some(bytes);
            let mut last_error: Option<DiscoverError> = None;
            loop {
                tokio::time::sleep(self.interval).await;
                if tx.is_closed() {
                    return;
                }
                // Its bytes, not its metadata: a rename can reuse an inode, and a coarse clock
                // an mtime. A replica file is small.
                let now = std::fs::read(&self.path).ok();
                if now == seen {
                    continue;
                }
                seen.clone_from(&now);
                let read = match now {
                    Some(bytes) => self.parse(&bytes),
                    None => self.read(),
                };
                match read {
                    Ok(members) => {
                        if last_error.take().is_some() {
                            tracing::info!(file = %self.path.display(), "replica file good again");
                        }
                        tx.send_if_modified(|m| {
                            let changed = **m != members;
                            if changed {
                                *m = Arc::new(members);
                            }
                            changed
                        });
                    }
                    Err(e) => {
                        if last_error.as_ref() != Some(&e) {
                            tracing::error!(file = %self.path.display(), "replica file not read, the last good set kept: {e}");
                        }
                        last_error = Some(e);
                    }
                }
            }
        });
        Ok(follow(fleet, rx, what))
    }
}

/// The members a replica file lists ([`FileSource`]'s format), sorted by name.
pub fn parse(text: &str, what: &str, model: &str) -> Result<Vec<Member>, DiscoverError> {
    let mut members: Vec<Member> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let invalid = |why: String| DiscoverError::Invalid {
            what: what.to_owned(),
            line: i + 1,
            why,
        };
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let name = words.next().unwrap_or_default();
        if name.contains('=') {
            return Err(invalid(format!(
                "`{name}`: a line starts with the replica's name, then sidecar=URL or engine=SOCKETS"
            )));
        }
        let (mut source, mut upstream, mut ready) = (None, None, true);
        for word in words {
            let Some((key, value)) = word.split_once('=') else {
                return Err(invalid(format!(
                    "`{word}`: expected sidecar=URL, engine=SOCKETS, upstream=URL or ready=true|false"
                )));
            };
            match Part::parse(key, value, model).map_err(|e| invalid(format!("`{word}`: {e}")))? {
                Part::Source(_) if source.is_some() => {
                    return Err(invalid(format!("`{word}`: a second source for `{name}`")));
                }
                Part::Source(s) => source = Some(s),
                Part::Upstream(url) => upstream = Some(url),
                Part::Ready(r) => ready = r,
            }
        }
        let Some(source) = source else {
            return Err(invalid(format!(
                "`{name}` has no source: give sidecar=URL or engine=SOCKETS"
            )));
        };
        if members.iter().any(|m| m.name == name) {
            return Err(invalid(format!("`{name}` is listed twice")));
        }
        members.push(Member {
            name: name.to_owned(),
            identity: source.address().to_owned(),
            source,
            upstream,
            ready,
        });
    }
    members.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(members)
}

/// One thing said of a replica, by a word of a replica file (`key=value`) or a router's flag
/// ([`Listed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(
    clippy::large_enum_variant,
    reason = "one a flag or a file's word, read once: matched on as is, not boxed"
)]
pub enum Part {
    /// How it is followed: `sidecar=URL` (its sidecar's `--feed-address`) or `engine=SOCKETS`
    /// ([`EngineSockets`](crate::EngineSockets)' text form, feature `engines`).
    Source(ReplicaSource),
    /// Where it serves completions: `upstream=http://HOST:PORT`, its OpenAI-compatible server.
    Upstream(String),
    /// Whether it may take requests: `ready=true|false`.
    Ready(bool),
}

impl Part {
    /// `key=value`, checked; a sidecar's feed is asked for `model` ("" for whatever it serves).
    pub fn parse(key: &str, value: &str, model: &str) -> Result<Self, String> {
        match key {
            "sidecar" if value.starts_with("http://") || value.starts_with("https://") => {
                Ok(Self::Source(ReplicaSource::Sidecar(SidecarFeed {
                    model: model.to_owned(),
                    ..SidecarFeed::new(value)
                })))
            }
            "sidecar" => Err("a sidecar is http://HOST:PORT (its --feed-address)".into()),
            #[cfg(feature = "engines")]
            "engine" => value
                .parse()
                .map(|s| Self::Source(ReplicaSource::Engine(s))),
            #[cfg(not(feature = "engines"))]
            "engine" => Err("engines are followed with kvevent-fleet's feature `engines`".into()),
            "upstream" => kvevent_scrape::url::server_url(value)
                .map(|url| Self::Upstream(url.to_owned()))
                .map_err(|e| {
                    format!("an upstream is http://HOST:PORT (the replica's server): {e}")
                }),
            "ready" => value
                .parse()
                .map(Self::Ready)
                .map_err(|_| "ready is true or false".into()),
            _ => Err(format!(
                "`{key}`: expected sidecar, engine, upstream or ready"
            )),
        }
    }
}

/// Where replicas are discovered, as a router's flag says it (`--discover`): parsed
/// ([`str::parse`]) and started ([`Spec::follow`]) in one place for every router.
///
/// - `file:PATH` ([`FileSource`]);
/// - `dns:NAME:PORT` or `dns:_SERVICE._PROTO.NAME`, then `,upstream=PORT`, `,server=IP:PORT`,
///   `,interval=SECONDS` (feature `discover-dns`);
/// - `kube:NAMESPACE/SELECTOR`, with `,feed-port=NAME`, `,upstream-port=NAME`,
///   `,resync=SECONDS` after the namespace (`kube:ns,resync=30/app=vllm`; the selector is all
///   after the first `/`) (feature `discover-kube`).
///
/// ```
/// use kvevent_fleet::discover::Spec;
/// assert_eq!("file:/etc/replicas".parse::<Spec>(), Ok(Spec::File("/etc/replicas".into())));
/// assert!("consul:x".parse::<Spec>().unwrap_err().contains("file:PATH"));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    /// A file of replicas.
    File(PathBuf),
    /// A headless Service's DNS records.
    #[cfg(feature = "discover-dns")]
    Dns(dns::DnsSpec),
    /// Pods by label selector.
    #[cfg(feature = "discover-kube")]
    Kube(kube::KubeSpec),
}

/// What [`Spec`] takes, for error messages.
pub const SPEC_FORMS: &str = "discovery is file:PATH (a file of replicas, one a line), dns:NAME:PORT or dns:_SERVICE._PROTO.NAME (a headless Service; ,upstream=PORT ,server=IP:PORT ,interval=SECONDS) or kube:NAMESPACE/SELECTOR (pods; ,feed-port=NAME ,upstream-port=NAME ,resync=SECONDS after the namespace)";

/// `,key=value` options after a source's first part, each checked by `take`.
#[cfg(any(feature = "discover-dns", feature = "discover-kube"))]
pub(crate) fn options(
    spec: &str,
    mut take: impl FnMut(&str, &str) -> Result<(), String>,
) -> Result<&str, String> {
    let mut parts = spec.split(',');
    let first = parts.next().unwrap_or_default();
    for part in parts {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}` is not KEY=VALUE"))?;
        take(k, v).map_err(|why| format!("`{part}`: {why}"))?;
    }
    Ok(first)
}

/// A number of seconds ≥ 0.
#[cfg(any(feature = "discover-dns", feature = "discover-kube"))]
pub(crate) fn seconds(v: &str) -> Result<Duration, String> {
    v.parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| "a number of seconds".to_owned())
}

impl std::str::FromStr for Spec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let wrong = |why: String| format!("`{s}`: {why}");
        match s.split_once(':') {
            Some(("file", path)) if !path.is_empty() => Ok(Self::File(path.into())),
            #[cfg(feature = "discover-dns")]
            Some(("dns", spec)) if !spec.is_empty() => spec.parse().map(Self::Dns).map_err(wrong),
            #[cfg(feature = "discover-kube")]
            Some(("kube", spec)) if !spec.is_empty() => spec.parse().map(Self::Kube).map_err(wrong),
            #[cfg(not(feature = "discover-dns"))]
            Some(("dns", _)) => Err(wrong(
                "DNS discovery is kvevent-fleet's feature `discover-dns`".into(),
            )),
            #[cfg(not(feature = "discover-kube"))]
            Some(("kube", _)) => Err(wrong(
                "Kubernetes discovery is kvevent-fleet's feature `discover-kube`".into(),
            )),
            _ => Err(wrong(SPEC_FORMS.into())),
        }
    }
}

impl Spec {
    /// Starts following the source into `fleet` (on its runtime): the set in force on the
    /// receiver. A source that cannot start (a file unreadable, a resolver without a
    /// configuration) is an error, and nothing is started.
    pub fn follow(
        &self,
        fleet: Arc<Fleet>,
        model: &str,
    ) -> Result<watch::Receiver<Members>, DiscoverError> {
        match self {
            Self::File(path) => FileSource::new(path, model).follow(fleet),
            #[cfg(feature = "discover-dns")]
            Self::Dns(spec) => spec.source(model)?.follow(fleet),
            #[cfg(feature = "discover-kube")]
            Self::Kube(spec) => Ok(spec.source(model).follow(fleet)),
        }
    }
}
