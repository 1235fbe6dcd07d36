//! Replicas from Kubernetes (feature `discover-kube`): the pods a label selector picks in a
//! namespace, through `kube`'s client and watcher.
//!
//! - **A pod is one replica by its UID**, named by the pod (a pod with several engines, each
//!   a sidecar behind a port named `kvevent-feed-X`, is a replica `POD-X` each): a new pod on
//!   an old IP, or under an old name, is a new replica, never the old one's blocks.
//! - **Its feed** at the container port named `kvevent-feed` (the setting `feed_port`), or the
//!   port the pod's annotation `kvevent.io/feed-port` gives; a pod with neither is skipped,
//!   logged once. **Its upstream** at the container port named `http` (`upstream_port`), if
//!   any. A pod without an IP yet is not a replica; one not Ready is followed but not routed
//!   to ([`Fleet::set_ready`](crate::Fleet::set_ready)); one with a deletion timestamp leaves
//!   at once.
//! - **A watch is never the only source of truth.** Every list (the first, after a watch
//!   error or a `410 Gone`, and every `resync`, 60 s by default) replaces what is known: a pod
//!   deleted while the watch was down is gone by the next list. The watch itself is asked to
//!   end after `watch_timeout` (50 s) and started again, so a watch that stays open and silent
//!   is cut too.
//! - **Errors are loud and retried**: a list or watch that fails (the API server away, RBAC
//!   forbidden: named by verb and resource) keeps the last good set, is logged once per
//!   distinct error, and is tried again with a backoff; a selector that matches nothing is
//!   warned about, naming it.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use tokio::sync::watch;

use super::{DiscoverError, Member, Members, follow};
use crate::{Fleet, ReplicaSource, SidecarFeed};

/// The annotation naming a pod's feed port when no container port is named for it.
pub const FEED_PORT_ANNOTATION: &str = "kvevent.io/feed-port";

/// The pods a label selector picks, as a fleet's replicas ([module docs](self)).
#[derive(Clone)]
pub struct KubeSource {
    /// `None`: the environment's, made when following starts (and again until it can be).
    client: Option<kube::Client>,
    namespace: String,
    selector: String,
    model: String,
    /// The feed's container port name (each `NAME-X` too: one replica each).
    pub feed_port: String,
    /// The upstream's container port name (each `NAME-X` too, with the feed's `X`).
    pub upstream_port: String,
    /// Every this long, the pods are listed again and the watch started again.
    pub resync: Duration,
    /// The API server is asked to end each watch after this long.
    pub watch_timeout: Duration,
}

impl std::fmt::Debug for KubeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSource")
            .field("namespace", &self.namespace)
            .field("selector", &self.selector)
            .finish()
    }
}

impl KubeSource {
    /// The pods `selector` picks in `namespace`, through `client`; sidecars asked for
    /// `model`'s feed.
    pub fn new(
        client: kube::Client,
        namespace: impl Into<String>,
        selector: impl Into<String>,
        model: impl Into<String>,
    ) -> Self {
        Self::with_client(Some(client), namespace, selector, model)
    }

    fn with_client(
        client: Option<kube::Client>,
        namespace: impl Into<String>,
        selector: impl Into<String>,
        model: impl Into<String>,
    ) -> Self {
        Self {
            client,
            namespace: namespace.into(),
            selector: selector.into(),
            model: model.into(),
            feed_port: "kvevent-feed".into(),
            upstream_port: "http".into(),
            resync: Duration::from_secs(60),
            watch_timeout: Duration::from_secs(50),
        }
    }

    /// The client from the environment (in a pod: its ServiceAccount; else the kubeconfig),
    /// for [`KubeSource::new`].
    pub async fn client() -> Result<kube::Client, DiscoverError> {
        kube::Client::try_default()
            .await
            .map_err(|e| DiscoverError::Read {
                what: "Kubernetes".into(),
                why: format!(
                    "no client from the environment (in-cluster ServiceAccount or kubeconfig): {e}"
                ),
            })
    }

    /// The client given, or the environment's: tried until there is one, each new error
    /// logged.
    async fn connect(&self) -> kube::Client {
        if let Some(c) = &self.client {
            return c.clone();
        }
        let mut last: Option<String> = None;
        loop {
            match Self::client().await {
                Ok(c) => return c,
                Err(e) => {
                    let said = e.to_string();
                    if last.as_ref() != Some(&said) {
                        tracing::error!(source = %self.what(), "{said}; trying again every 10 s");
                    }
                    last = Some(said);
                    tokio::time::sleep(Duration::from_secs(10)).await;
                }
            }
        }
    }

    fn what(&self) -> String {
        format!("pods {} in namespace {}", self.selector, self.namespace)
    }

    /// Follows the pods on the fleet's runtime: lists them, watches them, lists them again
    /// every `resync`, and reconciles the fleet with what is known after each change.
    pub fn follow(self, fleet: Arc<Fleet>) -> watch::Receiver<Members> {
        let (tx, rx) = watch::channel(Members::default());
        let what = self.what();
        fleet.runtime.spawn(self.run(tx));
        follow(fleet, rx, what)
    }

    async fn run(self, tx: watch::Sender<Members>) {
        let api: kube::Api<Pod> = kube::Api::namespaced(self.connect().await, &self.namespace);
        let config = watcher::Config::default()
            .labels(&self.selector)
            .timeout(self.watch_timeout.as_secs().max(1) as u32);
        let mut pods: BTreeMap<String, Pod> = BTreeMap::new();
        let mut skipped: HashSet<String> = HashSet::new();
        let mut last_error: Option<String> = None;
        let mut warned_empty = false;
        let mut backoff = Duration::from_millis(250);
        loop {
            // One watcher a resync: its first list replaces what is known.
            let mut stream = watcher(api.clone(), config.clone()).boxed();
            let resync = tokio::time::sleep(self.resync);
            tokio::pin!(resync);
            let mut listing: Option<BTreeMap<String, Pod>> = None;
            // Events already there are taken before the set is made again: a burst of changes
            // makes one set, not one each.
            let mut dirty = false;
            loop {
                let event = match dirty.then(|| stream.next().now_or_never()).flatten() {
                    Some(e) => e,
                    None if dirty => {
                        dirty = false;
                        let members = self.members(&pods, &mut skipped);
                        tx.send_if_modified(|m| {
                            let changed = **m != members;
                            if changed {
                                *m = Arc::new(members);
                            }
                            changed
                        });
                        continue;
                    }
                    None => tokio::select! {
                        _ = &mut resync => break,
                        e = stream.next() => e,
                    },
                };
                let Some(event) = event else { break };
                let changed = match event {
                    Ok(watcher::Event::Init) => {
                        listing = Some(BTreeMap::new());
                        false
                    }
                    Ok(watcher::Event::InitApply(pod)) => {
                        if let (Some(l), Some(uid)) = (listing.as_mut(), uid(&pod)) {
                            l.insert(uid, pod);
                        }
                        false
                    }
                    Ok(watcher::Event::InitDone) => {
                        pods = listing.take().unwrap_or_default();
                        if pods.is_empty() && !warned_empty {
                            tracing::warn!(source = %self.what(), "the selector matches no pod");
                        }
                        warned_empty = pods.is_empty();
                        true
                    }
                    Ok(watcher::Event::Apply(pod)) => {
                        uid(&pod).map(|uid| pods.insert(uid, pod)).is_some()
                    }
                    Ok(watcher::Event::Delete(pod)) => {
                        uid(&pod).and_then(|uid| pods.remove(&uid)).is_some()
                    }
                    Err(e) => {
                        let said = self.error(&e);
                        if last_error.as_ref() != Some(&said) {
                            tracing::error!(source = %self.what(), "{said}; the last good set kept, trying again");
                        }
                        last_error = Some(said);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(10));
                        continue;
                    }
                };
                if changed {
                    if last_error.take().is_some() {
                        tracing::info!(source = %self.what(), "the API server answers again");
                    }
                    backoff = Duration::from_millis(250);
                    dirty = true;
                }
            }
            if tx.is_closed() {
                return;
            }
        }
    }

    /// A watcher's error in our words: the verb and resource a refusal names.
    fn error(&self, e: &watcher::Error) -> String {
        let (verb, inner) = match e {
            watcher::Error::InitialListFailed(e) => ("list", Some(e)),
            watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => {
                ("watch", Some(e))
            }
            watcher::Error::WatchError(status) if status.code == 410 => {
                return "the watch's resource version is gone (410): listing again".into();
            }
            watcher::Error::WatchError(status) => {
                return format!("the watch failed: {} {}", status.code, status.message);
            }
            watcher::Error::NoResourceVersion => ("watch", None),
        };
        match inner {
            Some(kube::Error::Api(status)) if status.code == 403 => format!(
                "forbidden to {verb} pods in namespace {} ({}): give the router's ServiceAccount a Role with pods get, list and watch",
                self.namespace, status.message
            ),
            Some(e) => format!("{verb} pods: {e}"),
            None => format!("{verb} pods: {e}"),
        }
    }

    /// The replicas the pods known are, sorted by name.
    fn members(&self, pods: &BTreeMap<String, Pod>, skipped: &mut HashSet<String>) -> Vec<Member> {
        let mut members = Vec::new();
        for (uid, pod) in pods {
            let name = pod.metadata.name.clone().unwrap_or_default();
            if pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let status = pod.status.as_ref();
            let Some(ip) = status
                .and_then(|s| s.pod_ip.as_deref())
                .filter(|ip| !ip.is_empty())
            else {
                continue;
            };
            let ready = status
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let feeds = self.feeds(pod);
            if feeds.is_empty() {
                if skipped.insert(uid.clone()) {
                    tracing::warn!(source = %self.what(), pod = %name, "pod skipped: no container port named {} and no {FEED_PORT_ANNOTATION} annotation", self.feed_port);
                }
                continue;
            }
            let host = if ip.contains(':') {
                format!("[{ip}]")
            } else {
                ip.to_owned()
            };
            for (suffix, port, upstream) in feeds {
                let replica = match &suffix {
                    Some(s) => format!("{name}-{s}"),
                    None => name.clone(),
                };
                members.push(Member {
                    identity: format!("{uid}/{}", suffix.as_deref().unwrap_or_default()),
                    name: replica,
                    source: ReplicaSource::Sidecar(SidecarFeed {
                        model: self.model.clone(),
                        ..SidecarFeed::new(format!("http://{host}:{port}"))
                    }),
                    upstream: upstream.map(|p| format!("http://{host}:{p}")),
                    ready,
                });
            }
        }
        members.sort_by(|a, b| a.name.cmp(&b.name));
        members
    }

    /// A pod's feeds: (suffix, feed port, upstream port) for each container port named the
    /// feed's name (or `NAME-X`), else the annotation's port.
    fn feeds(&self, pod: &Pod) -> Vec<(Option<String>, i32, Option<i32>)> {
        let ports: Vec<(&str, i32)> = pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|p| Some((p.name.as_deref()?, p.container_port)))
            .collect();
        let named = |base: &str, suffix: Option<&str>| {
            ports.iter().find_map(|(n, p)| {
                let rest = n.strip_prefix(base)?;
                let matches = match suffix {
                    None => rest.is_empty(),
                    Some(s) => rest.strip_prefix('-') == Some(s),
                };
                matches.then_some(*p)
            })
        };
        let mut feeds: Vec<(Option<String>, i32, Option<i32>)> = ports
            .iter()
            .filter_map(|(n, p)| {
                let rest = n.strip_prefix(self.feed_port.as_str())?;
                let suffix = match rest {
                    "" => None,
                    r => Some(r.strip_prefix('-')?.to_owned()),
                };
                let upstream = named(&self.upstream_port, suffix.as_deref());
                Some((suffix, *p, upstream))
            })
            .collect();
        if feeds.is_empty()
            && let Some(port) = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(FEED_PORT_ANNOTATION))
                .and_then(|p| p.parse::<i32>().ok())
                .filter(|p| (1..=65535).contains(p))
        {
            feeds.push((None, port, named(&self.upstream_port, None)));
        }
        feeds.sort();
        feeds
    }
}

fn uid(pod: &Pod) -> Option<String> {
    pod.metadata.uid.clone()
}

/// `kube:`'s text form ([`super::Spec`]): `NAMESPACE/SELECTOR`, with `,feed-port=NAME`,
/// `,upstream-port=NAME`, `,resync=SECONDS` after the namespace. The client is the
/// environment's (in a pod, its ServiceAccount's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeSpec {
    /// The pods' namespace.
    pub namespace: String,
    /// Their label selector.
    pub selector: String,
    /// The feed's container port name.
    pub feed_port: Option<String>,
    /// The upstream's container port name.
    pub upstream_port: Option<String>,
    /// How often the pods are listed again.
    pub resync: Option<Duration>,
}

impl std::str::FromStr for KubeSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (head, selector) = s
            .split_once('/')
            .filter(|(_, sel)| !sel.is_empty())
            .ok_or("kube:NAMESPACE/SELECTOR (a label selector: app=vllm)")?;
        let (mut feed_port, mut upstream_port, mut resync) = (None, None, None);
        let namespace = super::options(head, |k, v| {
            match k {
                "feed-port" => feed_port = Some(v.to_owned()),
                "upstream-port" => upstream_port = Some(v.to_owned()),
                "resync" => resync = Some(super::seconds(v)?).filter(|d| !d.is_zero()),
                _ => return Err("kube: takes feed-port=, upstream-port= and resync=".into()),
            }
            Ok(())
        })?;
        if namespace.is_empty() {
            return Err("kube:NAMESPACE/SELECTOR: the namespace is empty".into());
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            selector: selector.to_owned(),
            feed_port,
            upstream_port,
            resync,
        })
    }
}

impl KubeSpec {
    /// The source it says, with the environment's client; sidecars asked for `model`'s feed.
    pub fn source(&self, model: &str) -> KubeSource {
        let mut source = KubeSource {
            client: None,
            ..KubeSource::with_client(None, &self.namespace, &self.selector, model)
        };
        if let Some(p) = &self.feed_port {
            source.feed_port.clone_from(p);
        }
        if let Some(p) = &self.upstream_port {
            source.upstream_port.clone_from(p);
        }
        if let Some(r) = self.resync {
            source.resync = r;
        }
        source
    }
}
