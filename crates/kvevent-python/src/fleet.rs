//! `kvevent.Fleet`: a [`kvevent_fleet::Fleet`] on a tokio runtime of its own (one worker
//! thread, `kvevent-fleet`), for asyncio and for plain threads; its answers' classes are in
//! `values`. The package's `Fleet` (in
//! Python) subclasses [`PyFleet`] for what is async: an awaitable is an asyncio future that a
//! callback from the runtime settles with `loop.call_soon_threadsafe`.
//!
//! Invariants: the GIL is released while Rust scores or waits; a blocking wait is sliced so
//! that Ctrl-C interrupts it; once closed, every waiter is answered (ready: an error; changes:
//! the end), and nothing follows a replica any more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvevent_fleet::{
    self as fleet, ClientTlsConfig, IndexConfig, Prediction, Query, QueryKeys, ReplicaSource,
    ScoreError, SidecarFeed,
};
use pyo3::exceptions::{PyException, PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::watch;

use crate::convert::{self, duration, token_ids};
use crate::values::*;

pyo3::create_exception!(
    _kvevent,
    NotReady,
    PyException,
    "Replicas not exact in time (`replicas`: name to its state and why; `waited`: seconds), or \
     a token query before any replica said its block size (BlockSizeUnknown): route as if \
     nothing matched."
);

pyo3::create_exception!(
    _kvevent,
    BlockSizeUnknown,
    NotReady,
    "No replica said its block size yet: token ids cannot be chained into the keys the \
     replicas will hold. Route as if nothing matched."
);

pyo3::create_exception!(
    _kvevent,
    NotFollowed,
    PyKeyError,
    "A replica the fleet does not follow."
);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A wait handed to the runtime: `cancel()` stops it (its callback is then never called).
#[pyclass(frozen, module = "kvevent", name = "_Waiting")]
pub(crate) struct Waiting(tokio::task::AbortHandle);

#[pymethods]
impl Waiting {
    fn cancel(&self) {
        self.0.abort();
    }
}

/// Calls `callback(error)` from the runtime's thread, if Python still runs.
fn call_back(callback: &Py<PyAny>, error: Option<PyErr>) {
    Python::try_attach(|py| {
        // A callback that fails (its loop closed) has nobody left to tell.
        let _ = callback.call1(py, (error.map(|e| e.into_value(py)),));
    });
}

/// What the fleet and its waiters share.
struct Shared {
    fleet: Arc<fleet::Fleet>,
    handle: tokio::runtime::Handle,
    /// The sets each discovery started (`Fleet.discover`) has in force.
    discovered: Mutex<Vec<watch::Receiver<fleet::discover::Members>>>,
    /// True once closed.
    closed: watch::Sender<bool>,
}

impl Shared {
    /// Runs `fut` on the runtime and waits for it with the GIL released, a tenth of a second
    /// at a time (Ctrl-C is seen between).
    fn wait<T: Send + 'static>(
        &self,
        py: Python<'_>,
        fut: impl Future<Output = T> + Send + 'static,
    ) -> PyResult<T> {
        let mut task = self.handle.spawn(fut);
        loop {
            let slice = py.detach(|| {
                self.handle.block_on(async {
                    tokio::time::timeout(Duration::from_millis(100), &mut task).await
                })
            });
            match slice {
                Ok(Ok(out)) => return Ok(out),
                Ok(Err(e)) => return Err(PyRuntimeError::new_err(format!("the wait failed: {e}"))),
                Err(_) => {
                    if let Err(e) = py.check_signals() {
                        task.abort();
                        return Err(e);
                    }
                }
            }
        }
    }

    fn not_followed(&self, names: &[String]) -> PyResult<()> {
        let followed: Vec<String> = self.fleet.replicas().into_iter().map(|r| r.name).collect();
        match names.iter().find(|n| !followed.contains(n)) {
            Some(n) => Err(NotFollowed::new_err(format!("`{n}` is not followed"))),
            None => Ok(()),
        }
    }
}

/// Waits for `names` (all when empty) to be exact, or the fleet closed.
async fn ready(shared: Arc<Shared>, names: Vec<String>, timeout: Duration) -> Option<PyErr> {
    let mut closed = shared.closed.subscribe();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    tokio::select! {
        r = shared.fleet.ready_among(&names, timeout) => r.err().map(|e| {
            Python::attach(|py| not_ready(py, &e))
        }),
        _ = closed.wait_for(|c| *c) => Some(PyRuntimeError::new_err("the fleet was closed")),
    }
}

fn not_ready(py: Python<'_>, e: &fleet::NotReady) -> PyErr {
    let err = NotReady::new_err(e.to_string());
    let value = err.value(py);
    let replicas = PyDict::new(py);
    for (name, why) in &e.replicas {
        let _ = replicas.set_item(name, why);
    }
    let _ = value.setattr("replicas", replicas);
    let _ = value.setattr("waited", e.waited.as_secs_f64());
    err
}

/// The fleet: replicas by name, each followed through its sidecar's feed, in one prefix
/// index. The package's `Fleet` adds what is async.
#[pyclass(subclass, frozen, module = "kvevent", name = "_Fleet")]
pub(crate) struct PyFleet {
    shared: Arc<Shared>,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
}

impl Drop for PyFleet {
    fn drop(&mut self) {
        self.shared.closed.send_replace(true);
        if let Some(runtime) = lock(&self.runtime).take() {
            runtime.shutdown_background();
        }
    }
}

impl PyFleet {
    /// The fleet itself (for the router).
    pub(crate) fn fleet(&self) -> &Arc<fleet::Fleet> {
        &self.shared.fleet
    }
}

#[pymethods]
impl PyFleet {
    #[new]
    #[pyo3(signature = (*, byte_budget=1 << 30, dead_after=3.0, drop_after=60.0, connect_timeout=5.0,
        lag_after=0.3, reconnect_initial=0.1, reconnect_max=2.0, max_message_bytes=16 << 20))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        byte_budget: usize,
        dead_after: f64,
        drop_after: f64,
        connect_timeout: f64,
        lag_after: f64,
        reconnect_initial: f64,
        reconnect_max: f64,
        max_message_bytes: usize,
    ) -> PyResult<Self> {
        let config = fleet::FleetConfig {
            index: IndexConfig {
                byte_budget,
                ..IndexConfig::default()
            },
            dead_after: duration("dead_after", dead_after)?,
            drop_after: duration("drop_after", drop_after)?,
            connect_timeout: duration("connect_timeout", connect_timeout)?,
            max_message_bytes,
            reconnect_initial: duration("reconnect_initial", reconnect_initial)?,
            reconnect_max: duration("reconnect_max", reconnect_max)?,
            lag_after: duration("lag_after", lag_after)?,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvevent-fleet")
            .enable_all()
            .build()
            .map_err(|e| {
                PyRuntimeError::new_err(format!("cannot start the fleet's runtime: {e}"))
            })?;
        let handle = runtime.handle().clone();
        Ok(Self {
            shared: Arc::new(Shared {
                fleet: Arc::new(fleet::Fleet::with_runtime(config, handle.clone())),
                handle,
                discovered: Mutex::default(),
                closed: watch::channel(false).0,
            }),
            runtime: Mutex::new(Some(runtime)),
        })
    }

    /// Follows replica `name` through its sidecar's feed at `url` (`http://HOST:PORT` or
    /// `https://HOST:PORT`); nothing happens if it is already followed from the same feed, and
    /// a replica whose feed changed is followed from the new one. `replica` and `model`: what
    /// the sidecar must serve ("" takes any); `token`: a bearer token; `tls_ca`: a CA bundle
    /// (PEM file) for https (system roots otherwise), `tls_domain`: the name to verify.
    #[pyo3(signature = (name, url, *, replica="", model="", token=None, tls_ca=None, tls_domain=None))]
    #[allow(clippy::too_many_arguments)]
    fn follow(
        &self,
        name: &str,
        url: &str,
        replica: &str,
        model: &str,
        token: Option<String>,
        tls_ca: Option<std::path::PathBuf>,
        tls_domain: Option<String>,
    ) -> PyResult<()> {
        self.open()?;
        let tls = if url.starts_with("https://") || tls_ca.is_some() {
            let mut tls = ClientTlsConfig::new();
            tls = match &tls_ca {
                Some(path) => {
                    let pem = std::fs::read(path).map_err(|e| {
                        PyValueError::new_err(format!("tls_ca {}: {e}", path.display()))
                    })?;
                    tls.ca_certificate(tonic::transport::Certificate::from_pem(pem))
                }
                None => tls.with_native_roots(),
            };
            if let Some(domain) = tls_domain {
                tls = tls.domain_name(domain);
            }
            Some(tls)
        } else {
            None
        };
        let feed = SidecarFeed {
            url: url.to_owned(),
            replica: replica.to_owned(),
            model: model.to_owned(),
            token,
            tls,
        };
        // Entering the runtime: the follower is spawned on it.
        let _runtime = self.shared.handle.enter();
        self.shared
            .fleet
            .ensure_replica(name, ReplicaSource::Sidecar(feed))
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Follows replicas as `spec` discovers them, as they come and go: `file:PATH` (a file of
    /// replicas, one a line, read again when it changes), `dns:NAME:PORT` or
    /// `dns:_SERVICE._PROTO.NAME` (a headless Service's records, by their TTL; `,upstream=PORT`,
    /// `,server=IP:PORT`, `,interval=SECONDS`), `kube:NAMESPACE/SELECTOR` (pods by label
    /// selector, through the environment's Kubernetes client; `,feed-port=NAME`,
    /// `,upstream-port=NAME`, `,resync=SECONDS` after the namespace). Sidecars are asked for
    /// `model`'s feed. A failed read keeps the last good set; replicas followed with `follow`
    /// are never touched. A spec that does not parse, or a file unreadable now, is a
    /// ValueError.
    #[pyo3(signature = (spec, *, model=""))]
    fn discover(&self, spec: &str, model: &str) -> PyResult<()> {
        self.open()?;
        let spec: fleet::discover::Spec = spec.parse().map_err(PyValueError::new_err)?;
        // Entering the runtime: the source's tasks are spawned on it.
        let _runtime = self.shared.handle.enter();
        let members = spec
            .follow(self.shared.fleet.clone(), model)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        lock(&self.shared.discovered).push(members);
        Ok(())
    }

    /// The replicas discovery has in force now, by name: `Member`s (`name`, `source`,
    /// `upstream`: its server's URL or None, `ready`).
    fn discovered(&self) -> Vec<PyMember> {
        let mut out: Vec<PyMember> = lock(&self.shared.discovered)
            .iter()
            .flat_map(|rx| rx.borrow().iter().cloned().collect::<Vec<_>>())
            .map(|m| PyMember {
                source: m.source.address().to_owned(),
                name: m.name,
                upstream: m.upstream,
                ready: m.ready,
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Follows replica `name` through its engine's own sockets (a wheel built with the
    /// `engines` feature): `engine_sockets` is rank 0's PUB (`tcp://HOST:PORT`), or the whole
    /// text form every kvevent tool takes (`tcp://HOST:PORT,replay=tcp://HOST:PORT,dp=N,
    /// topic=T,engine=sglang,http=http://HOST:PORT`); the keywords set (over it) `replay` its
    /// replay endpoint, `dp` the data-parallel ranks (ports offset by rank), `topic` the topic
    /// subscribed to, `engine` `vllm` or `sglang`, `http` the engine's HTTP server (asked at
    /// /health: while it does not answer, the replica is not exact). It knows what the replay
    /// buffer still holds, not every resident block: follow a sidecar's feed for that.
    #[pyo3(signature = (name, engine_sockets, *, replay=None, dp=None, topic=None, engine=None, http=None))]
    #[allow(clippy::too_many_arguments, unused_variables)]
    fn follow_engine(
        &self,
        name: &str,
        engine_sockets: &str,
        replay: Option<String>,
        dp: Option<u32>,
        topic: Option<String>,
        engine: Option<String>,
        http: Option<String>,
    ) -> PyResult<()> {
        self.open()?;
        #[cfg(feature = "engines")]
        {
            let mut text = engine_sockets.to_owned();
            for (key, value) in [
                ("replay", replay),
                ("dp", dp.map(|d| d.to_string())),
                ("topic", topic),
                ("engine", engine),
                ("http", http),
            ] {
                if let Some(v) = value {
                    text.push_str(&format!(",{key}={v}"));
                }
            }
            // The text form's one parser; a key given twice, the later (the keyword) wins.
            let sockets: fleet::EngineSockets = text.parse().map_err(PyValueError::new_err)?;
            let _runtime = self.shared.handle.enter();
            self.shared
                .fleet
                .ensure_replica(name, ReplicaSource::Engine(sockets))
                .map_err(|e| PyValueError::new_err(e.to_string()))
        }
        #[cfg(not(feature = "engines"))]
        Err(PyRuntimeError::new_err(
            "this kvevent wheel was built without engines: build it with `maturin build \
             --features engines` (or pip install ./crates/kvevent-python --config-settings \
             maturin.build-args=--features=engines), or follow the replica's sidecar",
        ))
    }

    /// Stops following `name` and forgets what it held; NotFollowed if it is not followed.
    fn remove(&self, name: &str) -> PyResult<()> {
        self.shared.not_followed(&[name.to_owned()])?;
        self.shared.fleet.remove_replica(name);
        Ok(())
    }

    /// Every replica followed, by name.
    fn replicas(&self) -> Vec<PyReplicaStatus> {
        self.shared
            .fleet
            .replicas()
            .into_iter()
            .map(Into::into)
            .collect()
    }

    /// One replica's status; NotFollowed if it is not followed.
    fn replica(&self, name: &str) -> PyResult<PyReplicaStatus> {
        self.shared
            .fleet
            .replicas()
            .into_iter()
            .find(|r| r.name == name)
            .map(Into::into)
            .ok_or_else(|| NotFollowed::new_err(format!("`{name}` is not followed")))
    }

    /// The block size the replicas' events use, once one said it (None before).
    #[getter]
    fn block_size(&self) -> Option<u32> {
        self.shared.fleet.block_size()
    }

    /// The index's counters.
    fn stats(&self) -> PyIndexStats {
        let s = self.shared.fleet.stats();
        PyIndexStats {
            keys: s.keys,
            pairs: s.pairs,
            bytes: s.bytes,
            table_bytes: s.table_bytes,
            mapper_bytes: s.mapper_bytes,
            evicted_keys: s.evicted_keys,
            stashed: s.stashed,
            applied: s.applied,
            sources: s.sources,
            shared_pairs: s.shared_pairs,
            duplication: s.duplication(),
        }
    }

    /// Every replica holding block 0 of the query, best first. The query is `tokens` (token
    /// ids, chained with `block_size`, by default the one the replicas' events use) or `keys`
    /// (prefix keys, block 0 first), for `adapter` ("" for the base model).
    #[pyo3(signature = (tokens=None, *, keys=None, block_size=None, adapter=""))]
    fn score(
        &self,
        py: Python<'_>,
        tokens: Option<&Bound<'_, PyAny>>,
        keys: Option<&Bound<'_, PyAny>>,
        block_size: Option<usize>,
        adapter: &str,
    ) -> PyResult<PyScores> {
        self.score_query(py, tokens, keys, block_size, adapter, None)
    }

    /// `score` among `candidates` only (the replicas this request may go to): every candidate
    /// followed is in the answer, matching or not; those not followed are in `not_followed`.
    #[pyo3(signature = (candidates, tokens=None, *, keys=None, block_size=None, adapter=""))]
    fn score_among(
        &self,
        py: Python<'_>,
        candidates: Vec<String>,
        tokens: Option<&Bound<'_, PyAny>>,
        keys: Option<&Bound<'_, PyAny>>,
        block_size: Option<usize>,
        adapter: &str,
    ) -> PyResult<PyScores> {
        self.score_query(py, tokens, keys, block_size, adapter, Some(candidates))
    }

    /// Records what the engine reused (`cached_tokens`: the response's
    /// usage.prompt_tokens_details.cached_tokens) for a request of `prompt_tokens` routed on
    /// `chosen` (the Score acted on, or the replica's name when it matched nothing): counted
    /// per replica as `exact`, `optimistic` or `pessimistic`, which it returns.
    #[pyo3(signature = (chosen, prompt_tokens, cached_tokens, *, block_size=None))]
    fn record(
        &self,
        chosen: &Bound<'_, PyAny>,
        prompt_tokens: u32,
        cached_tokens: u32,
        block_size: Option<u32>,
    ) -> PyResult<&'static str> {
        let block_size = block_size
            .or(self.shared.fleet.block_size())
            .ok_or_else(|| {
                BlockSizeUnknown::new_err("no replica said its block size yet: pass block_size")
            })?;
        let prediction = if let Ok(choice) = chosen.cast::<crate::router::PyChoice>() {
            let (replica, predicted_tokens, state) = choice.get().prediction();
            Prediction {
                replica: replica.to_owned(),
                predicted_tokens,
                prompt_tokens,
                block_size,
                state,
            }
        } else if let Ok(score) = chosen.cast::<PyScore>() {
            let s = score.get();
            Prediction {
                replica: s.replica.clone(),
                predicted_tokens: s.matched_tokens,
                prompt_tokens,
                block_size,
                state: s.state,
            }
        } else {
            let name: String = chosen.extract().map_err(|_| {
                PyValueError::new_err(
                    "chosen: a Choice, a Score, or the name of the replica chosen",
                )
            })?;
            let state = self
                .shared
                .fleet
                .replicas()
                .into_iter()
                .find(|r| r.name == name)
                .map(|r| r.state)
                .ok_or_else(|| NotFollowed::new_err(format!("`{name}` is not followed")))?;
            Prediction {
                replica: name,
                predicted_tokens: 0,
                prompt_tokens,
                block_size,
                state,
            }
        };
        Ok(self
            .shared
            .fleet
            .record(&prediction, cached_tokens)
            .as_str())
    }

    /// Every replica's predictions so far, by name.
    fn accounting(&self) -> HashMap<String, PyAccounting> {
        self.shared
            .fleet
            .accounting()
            .into_iter()
            .map(|(name, a)| {
                let a = PyAccounting {
                    decisions: a.decisions,
                    exact: a.exact,
                    optimistic: a.optimistic,
                    pessimistic: a.pessimistic,
                    not_exact_state: a.not_exact_state,
                    error_blocks: a.error_blocks.to_vec(),
                    error_sum: a.error_sum,
                };
                (name, a)
            })
            .collect()
    }

    /// Waits, blocking this thread (the GIL released), until the replicas `names` (every one
    /// followed when None) are exact, for at most `timeout` seconds: NotReady says which are
    /// not and why; NotFollowed names one not followed.
    #[pyo3(signature = (timeout, names=None))]
    fn ready_blocking(
        &self,
        py: Python<'_>,
        timeout: f64,
        names: Option<Vec<String>>,
    ) -> PyResult<()> {
        let (names, timeout) = self.ready_args(timeout, names)?;
        match self
            .shared
            .wait(py, ready(self.shared.clone(), names, timeout))?
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `ready_blocking`'s wait on the runtime: `callback(error)` is called from the runtime's
    /// thread with None or the exception.
    #[pyo3(signature = (timeout, names, callback))]
    fn _ready_then(
        &self,
        timeout: f64,
        names: Option<Vec<String>>,
        callback: Py<PyAny>,
    ) -> PyResult<Waiting> {
        let (names, timeout) = self.ready_args(timeout, names)?;
        let shared = self.shared.clone();
        let task = self.shared.handle.spawn(async move {
            let error = ready(shared, names, timeout).await;
            call_back(&callback, error);
        });
        Ok(Waiting(task.abort_handle()))
    }

    /// The changes from now on (the package's `Fleet.changes` iterates them).
    fn _changes(&self) -> PyChanges {
        let now: HashMap<String, Seen> = self
            .replicas()
            .into_iter()
            .map(|r| (r.name.clone(), r.seen()))
            .collect();
        PyChanges {
            shared: self.shared.clone(),
            rx: Mutex::new(self.shared.fleet.changes()),
            seen: Mutex::new(now),
        }
    }

    /// Stops following every replica and answers every waiter: `ready` fails, `changes` ends.
    /// Scores are empty after; following again is an error.
    fn close(&self) {
        self.shared.closed.send_replace(true);
        for r in self.shared.fleet.replicas() {
            self.shared.fleet.remove_replica(&r.name);
        }
    }

    /// True once closed.
    #[getter]
    fn closed(&self) -> bool {
        *self.shared.closed.borrow()
    }

    fn __repr__(&self) -> String {
        format!(
            "Fleet(replicas={}, closed={})",
            self.shared.fleet.replicas().len(),
            py_bool(self.closed())
        )
    }
}

impl PyFleet {
    fn open(&self) -> PyResult<()> {
        if *self.shared.closed.borrow() {
            return Err(PyRuntimeError::new_err("the fleet is closed"));
        }
        Ok(())
    }

    fn ready_args(
        &self,
        timeout: f64,
        names: Option<Vec<String>>,
    ) -> PyResult<(Vec<String>, Duration)> {
        self.open()?;
        let timeout = duration("timeout", timeout)?;
        let names = names.unwrap_or_default();
        self.shared.not_followed(&names)?;
        Ok((names, timeout))
    }

    fn score_query(
        &self,
        py: Python<'_>,
        tokens: Option<&Bound<'_, PyAny>>,
        keys: Option<&Bound<'_, PyAny>>,
        block_size: Option<usize>,
        adapter: &str,
        candidates: Option<Vec<String>>,
    ) -> PyResult<PyScores> {
        enum Owned {
            Tokens(Vec<u32>, usize),
            Keys(Vec<u64>),
        }
        let fleet = &self.shared.fleet;
        let owned = match (tokens, keys) {
            (Some(t), None) => {
                let ids = token_ids(t)?;
                match (block_size, fleet.block_size()) {
                    (Some(0), _) => {
                        return Err(PyValueError::new_err("block_size must be at least 1"));
                    }
                    // Given, and no replica said one yet: the caller's word chains the keys.
                    (Some(b), None) => {
                        let mut keys = Vec::with_capacity(ids.len() / b);
                        kvevent_fingerprint::prefixes_into(&ids, b, None, &mut keys);
                        Owned::Keys(keys)
                    }
                    (Some(b), Some(_)) => Owned::Tokens(ids, b),
                    (None, Some(b)) => Owned::Tokens(ids, b as usize),
                    (None, None) => {
                        return Err(BlockSizeUnknown::new_err(
                            ScoreError::BlockSizeUnknown.to_string(),
                        ));
                    }
                }
            }
            (None, Some(k)) => Owned::Keys(convert::keys(k)?),
            _ => {
                return Err(PyValueError::new_err(
                    "give the query's tokens or its keys (one of them)",
                ));
            }
        };
        let query = Query {
            adapter,
            keys: match &owned {
                Owned::Tokens(ids, block_size) => QueryKeys::Tokens {
                    ids,
                    block_size: *block_size,
                },
                Owned::Keys(k) => QueryKeys::Keys(k),
            },
        };
        let scores = py.detach(|| match &candidates {
            None => fleet.score(&query),
            Some(c) => {
                let c: Vec<&str> = c.iter().map(String::as_str).collect();
                fleet.score_among(&query, &c)
            }
        });
        let scores = scores.map_err(|e| match e {
            ScoreError::BlockSizeUnknown => BlockSizeUnknown::new_err(e.to_string()),
            ScoreError::BlockSize { .. } => PyValueError::new_err(e.to_string()),
        })?;
        let not_followed = match &candidates {
            Some(c) => scores.unknown().iter().map(|&i| c[i].clone()).collect(),
            None => Vec::new(),
        };
        Ok(PyScores {
            scores,
            not_followed,
        })
    }
}

/// The fleet's changes: `poll` takes one if there is one, `next_blocking` waits for one,
/// `then` calls back when there may be one. The package's `Changes` iterates them, with `for`
/// and `async for`.
#[pyclass(frozen, module = "kvevent", name = "_Changes")]
pub(crate) struct PyChanges {
    shared: Arc<Shared>,
    rx: Mutex<watch::Receiver<u64>>,
    /// Each replica as the previous change left it.
    seen: Mutex<HashMap<String, Seen>>,
}

#[pymethods]
impl PyChanges {
    /// The change since the previous one, if any (None: nothing changed, or only to change
    /// back).
    fn poll(&self) -> Option<PyChange> {
        let mut rx = lock(&self.rx);
        if !rx.has_changed().unwrap_or(false) {
            return None;
        }
        rx.borrow_and_update();
        drop(rx);
        let replicas: Vec<PyReplicaStatus> = self
            .shared
            .fleet
            .replicas()
            .into_iter()
            .map(Into::into)
            .collect();
        let mut seen = lock(&self.seen);
        let changed: Vec<PyReplicaStatus> = replicas
            .iter()
            .filter(|r| seen.get(&r.name) != Some(&r.seen()))
            .cloned()
            .collect();
        let mut removed: Vec<String> = seen
            .keys()
            .filter(|n| !replicas.iter().any(|r| &r.name == *n))
            .cloned()
            .collect();
        removed.sort();
        *seen = replicas
            .iter()
            .map(|r| (r.name.clone(), r.seen()))
            .collect();
        (!changed.is_empty() || !removed.is_empty()).then_some(PyChange {
            replicas,
            changed,
            removed,
        })
    }

    /// Waits for the next change with the GIL released; None once the fleet is closed, or once
    /// the interpreter's main thread has ended (a thread left iterating does not keep the
    /// interpreter from exiting).
    fn next_blocking(&self, py: Python<'_>) -> PyResult<Option<PyChange>> {
        let main = py.import("threading")?.call_method0("main_thread")?;
        loop {
            if let Some(change) = self.poll() {
                return Ok(Some(change));
            }
            if *self.shared.closed.borrow() || !main.call_method0("is_alive")?.is_truthy()? {
                return Ok(None);
            }
            let changed = self.changed();
            self.shared.wait(py, async move {
                let _ = tokio::time::timeout(Duration::from_millis(250), changed).await;
            })?;
        }
    }

    /// True once the fleet is closed: no more changes.
    #[getter]
    fn closed(&self) -> bool {
        *self.shared.closed.borrow()
    }

    /// Calls `callback(None)` from the runtime's thread once there may be a change (or the
    /// fleet closed).
    fn then(&self, callback: Py<PyAny>) -> Waiting {
        let changed = self.changed();
        let task = self.shared.handle.spawn(async move {
            changed.await;
            call_back(&callback, None);
        });
        Waiting(task.abort_handle())
    }
}

impl PyChanges {
    /// Resolves once the fleet changed since the last `poll`, or closed.
    fn changed(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = lock(&self.rx).clone();
        let mut closed = self.shared.closed.subscribe();
        async move {
            tokio::select! {
                _ = rx.changed() => {}
                _ = closed.wait_for(|c| *c) => {}
            }
        }
    }
}

/// The fleet's classes and exceptions, added to the native module.
/// A replica as discovery has it.
#[pyclass(frozen, get_all, module = "kvevent", name = "Member")]
pub(crate) struct PyMember {
    /// Its name in the fleet.
    name: String,
    /// Where it is followed from (its sidecar's feed).
    source: String,
    /// Its server's URL, where requests routed to it go, if discovery says.
    upstream: Option<String>,
    /// It may take requests (a pod that is Ready).
    ready: bool,
}

#[pymethods]
impl PyMember {
    fn __repr__(&self) -> String {
        format!(
            "Member({:?}, source={:?}, upstream={:?}, ready={})",
            self.name,
            self.source,
            self.upstream,
            if self.ready { "True" } else { "False" }
        )
    }
}

pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFleet>()?;
    m.add_class::<PyMember>()?;
    m.add_class::<PyChanges>()?;
    m.add_class::<PyChange>()?;
    m.add_class::<PyScores>()?;
    m.add_class::<PyScore>()?;
    m.add_class::<PyReplicaStatus>()?;
    m.add_class::<PyRankStatus>()?;
    m.add_class::<PyIndexStats>()?;
    m.add_class::<PyAccounting>()?;
    m.add_class::<crate::router::PyRouter>()?;
    m.add_class::<crate::router::PyChoice>()?;
    m.add_class::<crate::router::PyFlight>()?;
    m.add_class::<crate::router::PyLoad>()?;
    m.add_class::<Waiting>()?;
    m.add("NotReady", m.py().get_type::<NotReady>())?;
    m.add("BlockSizeUnknown", m.py().get_type::<BlockSizeUnknown>())?;
    m.add("NotFollowed", m.py().get_type::<NotFollowed>())?;
    m.add("ERROR_BUCKETS", fleet::ERROR_BUCKETS.to_vec())?;
    m.add("ENGINES", cfg!(feature = "engines"))?;
    Ok(())
}
