//! A Kubernetes API server on loopback for pods, speaking the real list/watch protocol:
//! `GET /api/v1/namespaces/NS/pods` lists (a `PodList` at a resourceVersion, by
//! `labelSelector`) or, with `watch=true`, streams events after a resourceVersion as chunked
//! JSON lines (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK` when asked, an `ERROR` of `410 Gone`
//! for a version compacted away), ending after `timeoutSeconds`. The test drives its faults:
//! RBAC forbidden, watches that stay open and silent, watches cut, history compacted. `/api`,
//! `/apis` and `/api/v1` answer discovery, so `kubectl --server` reads it as it reads a real
//! one.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

type Body = BoxBody<Bytes, Infallible>;

#[derive(Default)]
struct State {
    rv: u64,
    pods: BTreeMap<String, Value>,
    /// Every change: (resourceVersion, type, the pod after it).
    history: Vec<(u64, &'static str, Value)>,
    /// A watch from a version below this is `410 Gone`.
    compacted_below: u64,
    forbidden: bool,
    silent: bool,
    uids: u64,
    lists: u64,
}

/// The server, and the handle a test drives it by.
#[derive(Clone)]
pub(crate) struct KubeApi {
    state: Arc<Mutex<State>>,
    /// Bumped on every change (watches wake), and on `cut_watches` (watches end).
    changed: watch::Sender<u64>,
    cut: watch::Sender<u64>,
    pub(crate) addr: std::net::SocketAddr,
}

fn lock(s: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    s.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn full(status: u16, v: &Value) -> hyper::Response<Body> {
    let mut r = hyper::Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = hyper::StatusCode::from_u16(status).expect("a status");
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// `labelSelector` of `k=v` terms, all of which a pod's labels hold.
fn selects(selector: &str, pod: &Value) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (k, v) = term.split_once('=').unwrap_or((term, ""));
        pod["metadata"]["labels"][k.trim_end_matches('=')] == v.trim_start_matches('=')
    })
}

fn query(uri: &hyper::Uri) -> BTreeMap<String, String> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.replace("%3D", "=").replace("%2C", ",")))
        .collect()
}

impl KubeApi {
    pub(crate) async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let api = Self {
            state: Arc::default(),
            changed: watch::channel(0).0,
            cut: watch::channel(0).0,
            addr: listener.local_addr().expect("addr"),
        };
        let served = api.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let api = served.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let api = api.clone();
                        async move { Ok::<_, Infallible>(api.answer(req)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        api
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn answer(&self, req: hyper::Request<hyper::body::Incoming>) -> hyper::Response<Body> {
        let path = req.uri().path().to_owned();
        let q = query(req.uri());
        match path.as_str() {
            "/api" => {
                return full(
                    200,
                    &json!({"kind": "APIVersions", "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.addr.to_string()}]}),
                );
            }
            "/apis" => {
                return full(
                    200,
                    &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": []}),
                );
            }
            "/api/v1" => {
                return full(
                    200,
                    &json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                    {"name": "pods", "singularName": "pod", "namespaced": true, "kind": "Pod",
                     "verbs": ["get", "list", "watch"], "shortNames": ["po"]}]}),
                );
            }
            _ => {}
        }
        let Some(ns) = path
            .strip_prefix("/api/v1/namespaces/")
            .and_then(|p| p.strip_suffix("/pods"))
            .map(str::to_owned)
        else {
            return full(
                404,
                &status(
                    404,
                    "NotFound",
                    "the server could not find the requested resource",
                ),
            );
        };
        let selector = q.get("labelSelector").cloned().unwrap_or_default();
        let watching = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
        let verb = if watching { "watch" } else { "list" };
        let mut s = lock(&self.state);
        if s.forbidden {
            return full(
                403,
                &status(
                    403,
                    "Forbidden",
                    &format!(
                        "pods is forbidden: User \"system:serviceaccount:{ns}:router\" cannot {verb} resource \"pods\" in API group \"\" in the namespace \"{ns}\""
                    ),
                ),
            );
        }
        if !watching {
            s.lists += 1;
            let items: Vec<&Value> = s.pods.values().filter(|p| selects(&selector, p)).collect();
            return full(
                200,
                &json!({"kind": "PodList", "apiVersion": "v1",
                "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}),
            );
        }
        let from: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(s.rv);
        let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
        let timeout = Duration::from_secs(
            q.get("timeoutSeconds")
                .and_then(|t| t.parse().ok())
                .unwrap_or(300),
        );
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(64);
        if from < s.compacted_below {
            let gone = json!({"type": "ERROR", "object": status(410, "Expired",
                &format!("too old resource version: {from} ({})", s.compacted_below))});
            let _ = tx.try_send(Ok(Frame::data(Bytes::from(format!("{gone}\n")))));
            drop(tx);
        } else if s.silent {
            // Open and silent, whatever the timeout: only a client's own bound ends it.
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                drop(tx);
            });
        } else {
            let api = self.clone();
            tokio::spawn(async move { api.stream(tx, from, selector, bookmarks, timeout).await });
        }
        drop(s);
        let mut r = hyper::Response::new(BodyExt::boxed(StreamBody::new(
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|f| (f, rx)) },
            ),
        )));
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        r
    }

    async fn stream(
        &self,
        tx: mpsc::Sender<Result<Frame<Bytes>, Infallible>>,
        mut from: u64,
        selector: String,
        bookmarks: bool,
        timeout: Duration,
    ) {
        let mut changed = self.changed.subscribe();
        let mut cut = self.cut.subscribe();
        cut.borrow_and_update();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            changed.borrow_and_update();
            let behind = {
                let s = lock(&self.state);
                (from + 1 < s.compacted_below).then_some(s.compacted_below)
            };
            if let Some(oldest) = behind {
                // Fallen behind the history kept: the server ends the watch, as a real one
                // ends a watcher too slow for its cache.
                let gone = json!({"type": "ERROR", "object": status(410, "Expired",
                    &format!("too old resource version: {from} ({oldest})"))});
                let _ = tx
                    .send(Ok(Frame::data(Bytes::from(format!("{gone}\n")))))
                    .await;
                return;
            }
            let events: Vec<(u64, &'static str, Value)> = {
                let s = lock(&self.state);
                let after = s.history.partition_point(|(rv, _, _)| *rv <= from);
                s.history[after..]
                    .iter()
                    .filter(|(_, _, pod)| selects(&selector, pod))
                    .cloned()
                    .collect()
            };
            for (rv, kind, pod) in events {
                from = rv;
                let line = json!({"type": kind, "object": pod});
                if tx
                    .send(Ok(Frame::data(Bytes::from(format!("{line}\n")))))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            tokio::select! {
                _ = changed.changed() => {}
                _ = cut.changed() => return,
                _ = tokio::time::sleep_until(deadline) => return,
                _ = tokio::time::sleep(Duration::from_millis(500)), if bookmarks => {
                    let rv = lock(&self.state).rv;
                    from = from.max(rv);
                    let mark = json!({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                        "metadata": {"resourceVersion": rv.to_string()}}});
                    if tx.send(Ok(Frame::data(Bytes::from(format!("{mark}\n"))))).await.is_err() {
                        return;
                    }
                }
            }
        }
    }

    fn change(
        &self,
        name: &str,
        edit: impl FnOnce(&mut State, &mut Option<Value>) -> &'static str,
    ) {
        let mut s = lock(&self.state);
        let mut pod = s.pods.get(name).cloned();
        let kind = edit(&mut s, &mut pod);
        s.rv += 1;
        let rv = s.rv;
        if let Some(mut pod) = pod {
            pod["metadata"]["resourceVersion"] = json!(rv.to_string());
            if kind == "DELETED" {
                s.pods.remove(name);
            } else {
                s.pods.insert(name.to_owned(), pod.clone());
            }
            s.history.push((rv, kind, pod));
            // etcd's compaction: the oldest history goes, and a watch from before it is
            // `410 Gone`.
            if s.history.len() > 2048 {
                s.history.drain(..1024);
                s.compacted_below = s.history[0].0;
            }
        }
        drop(s);
        self.changed.send_modify(|n| *n += 1);
    }

    /// A pod of the selected kind (`app=vllm`), not Ready yet, with an IP and `ports`
    /// (name, port).
    pub(crate) fn create(&self, name: &str, ip: &str, ports: &[(&str, u16)]) -> String {
        let mut uid = String::new();
        self.change(name, |s, pod| {
            s.uids += 1;
            uid = format!("uid-{}", s.uids);
            *pod = Some(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "ns", "uid": uid, "labels": {"app": "vllm"}},
                "spec": {"containers": [{"name": "engine", "image": "vllm",
                    "ports": ports.iter().map(|(n, p)| json!({"name": n, "containerPort": p})).collect::<Vec<_>>()}]},
                "status": {"phase": "Running", "podIP": ip,
                    "conditions": [{"type": "Ready", "status": "False"}]}}));
            "ADDED"
        });
        uid
    }

    pub(crate) fn set_ready(&self, name: &str, ready: bool) {
        self.change(name, |_, pod| {
            if let Some(p) = pod {
                p["status"]["conditions"][0]["status"] =
                    json!(if ready { "True" } else { "False" });
            }
            "MODIFIED"
        });
    }

    /// A deletion timestamp: the pod is terminating.
    pub(crate) fn terminate(&self, name: &str) {
        self.change(name, |_, pod| {
            if let Some(p) = pod {
                p["metadata"]["deletionTimestamp"] = json!("2026-12-06T00:00:00Z");
            }
            "MODIFIED"
        });
    }

    pub(crate) fn delete(&self, name: &str) {
        self.change(name, |_, _| "DELETED");
    }

    /// Deleted without a word to any watch: as if it happened while the watch was down.
    pub(crate) fn delete_quietly(&self, name: &str) {
        let mut s = lock(&self.state);
        s.pods.remove(name);
        s.rv += 1;
        // Compacted: no watch can be told; a list is the only way to learn it.
        s.compacted_below = s.rv;
    }

    pub(crate) fn set_forbidden(&self, forbidden: bool) {
        lock(&self.state).forbidden = forbidden;
    }

    /// Watches from now stay open and send nothing.
    pub(crate) fn set_silent(&self, silent: bool) {
        lock(&self.state).silent = silent;
    }

    /// Every open watch ends.
    pub(crate) fn cut_watches(&self) {
        self.cut.send_modify(|n| *n += 1);
    }

    /// Watches from any version so far are `410 Gone`.
    pub(crate) fn compact(&self) {
        let mut s = lock(&self.state);
        s.compacted_below = s.rv + 1;
        s.history.clear();
    }

    pub(crate) fn lists(&self) -> u64 {
        lock(&self.state).lists
    }
}
