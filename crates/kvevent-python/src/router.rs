//! `kvevent.Router`: `kvevent_fleet::route::Router`, the routing loop over a `Fleet`, for
//! Python routers (the Rust loop itself, not a copy): which replica a request goes to, by a
//! policy, with what this router has in flight to each, a retry after a replica failed, and
//! the engine's cached tokens recorded; `Load`, an engine's load as its sidecar read it.
//!
//! Invariants: the GIL is released while Rust scores and chooses; a request is in flight from
//! `start` until its `Flight` ends (`with`, or `end()`), at most once.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvevent_fleet::ReplicaState;
use kvevent_fleet::route::{self, Decision, LoadSeen, Policy, Retry, Rule};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::convert::token_ids;
use crate::fleet::PyFleet;

/// What an engine was doing when its sidecar last read it.
#[pyclass(frozen, skip_from_py_object, module = "kvevent", name = "Load")]
#[derive(Clone)]
pub(crate) struct PyLoad {
    /// Requests in its running batches (all DP ranks).
    #[pyo3(get)]
    running: u32,
    /// Requests queued (all DP ranks).
    #[pyo3(get)]
    waiting: u32,
    /// KV-cache usage, 0-1 (the mean over DP ranks), or None when the engine does not say.
    #[pyo3(get)]
    kv_usage: Option<f32>,
    /// Seconds since it was read, when this object was made.
    #[pyo3(get)]
    age: f64,
    /// The sidecar's reads since this one fail: it only ages.
    #[pyo3(get)]
    failing: bool,
    /// Each DP rank's load.
    ranks: Vec<kvevent_fleet::RankLoad>,
}

impl PyLoad {
    pub(crate) fn of(l: &kvevent_fleet::LoadReading) -> Self {
        Self {
            running: l.load.running(),
            waiting: l.load.waiting(),
            kv_usage: l.load.kv_usage(),
            age: l.age(Instant::now()).as_secs_f64(),
            failing: l.failing,
            ranks: l.load.ranks.clone(),
        }
    }
}

#[pymethods]
impl PyLoad {
    /// Each DP rank's load, a dict of its figures by name (`rank`, `running`, `waiting`,
    /// `kv_usage`, and any the engine's load gains).
    #[getter]
    fn ranks<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, pyo3::types::PyDict>>> {
        self.ranks
            .iter()
            .map(|r| {
                let dict = pyo3::types::PyDict::new(py);
                for (name, figure) in r.figures() {
                    match figure {
                        kvevent_fleet::Figure::Count(n) => dict.set_item(name, n)?,
                        kvevent_fleet::Figure::Fraction(f) => dict.set_item(name, f)?,
                    }
                }
                Ok(dict)
            })
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "Load(running={}, waiting={}, kv_usage={}, age={:.3}s{})",
            self.running,
            self.waiting,
            self.kv_usage
                .map_or_else(|| "None".to_owned(), |u| format!("{u:.3}")),
            self.age,
            if self.failing { ", failing" } else { "" }
        )
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where a request goes, and what the decision rests on.
#[pyclass(frozen, module = "kvevent", name = "Choice")]
pub(crate) struct PyChoice {
    decision: Decision,
}

impl PyChoice {
    /// The replica, what it was said to hold, and its state: what `Fleet.record` counts.
    pub(crate) fn prediction(&self) -> (&str, u32, ReplicaState) {
        let p = &self.decision.prediction;
        (&p.replica, p.predicted_tokens, p.state)
    }
}

#[pymethods]
impl PyChoice {
    /// The replica chosen.
    #[getter]
    fn replica(&self) -> &str {
        &self.decision.replica
    }
    /// Tokens of the prompt the fleet says it holds (0 when it said nothing of it).
    #[getter]
    fn matched_tokens(&self) -> u32 {
        self.decision.prediction.predicted_tokens
    }
    /// The prompt's length in tokens.
    #[getter]
    fn prompt_tokens(&self) -> u32 {
        self.decision.prediction.prompt_tokens
    }
    /// Prompt tokens it will compute there: the prompt less what the replica holds exactly.
    /// Until its first token (`Flight.first_token()`), they count ahead of the next request
    /// there.
    #[getter]
    fn compute_tokens(&self) -> u32 {
        self.decision.compute_tokens
    }
    /// Requests estimated queued ahead of this one there.
    #[getter]
    fn queued(&self) -> u32 {
        self.decision.queued
    }
    /// The choice does not rest on an exact match.
    #[getter]
    fn failed_open(&self) -> bool {
        self.decision.failed_open
    }
    /// No candidate could serve (each was known down): chosen among all of them.
    #[getter]
    fn none_serving(&self) -> bool {
        self.decision.none_serving
    }
    /// 0 for a first choice, 1 for a retry (`Router.retry`).
    #[getter]
    fn attempt(&self) -> u8 {
        self.decision.attempt
    }
    /// How its load was known: "fresh", "old" (not used) or "none".
    #[getter]
    fn load(&self) -> &'static str {
        match self.decision.load {
            LoadSeen::Fresh => "fresh",
            LoadSeen::Old => "old",
            LoadSeen::None => "none",
        }
    }
    /// What the cost policy estimated the request costs there, in microseconds (0 for the
    /// other policies).
    #[getter]
    fn cost_us(&self) -> f64 {
        self.decision.cost_us
    }
    /// `exact`, `degraded` or `stale`, when chosen.
    #[getter]
    fn state(&self) -> &'static str {
        self.decision.state().as_str()
    }
    /// Why it was not exact, or None.
    #[getter]
    fn reason(&self) -> Option<&'static str> {
        self.decision.state().reason()
    }
    /// It was exact when chosen.
    #[getter]
    fn exact(&self) -> bool {
        self.decision.state().is_exact()
    }

    fn __repr__(&self) -> String {
        format!(
            "Choice({:?}, matched_tokens={}, queued={}, {}, load {})",
            self.decision.replica,
            self.decision.prediction.predicted_tokens,
            self.decision.queued,
            self.decision.state().as_str(),
            self.load()
        )
    }
}

/// What a flight holds: a request sent on a choice (its prediction recorded when it
/// finishes), or to a replica by name.
enum InFlight {
    Sent(route::Sent),
    Named(route::Flight),
}

/// A request in flight to a replica, from `Router.start` until `end()` (or `finish()`, or the
/// end of its `with` block).
#[pyclass(frozen, module = "kvevent", name = "Flight")]
pub(crate) struct PyFlight {
    flight: Mutex<Option<InFlight>>,
}

#[pymethods]
impl PyFlight {
    /// Its first token came: its prompt is computed (streamed responses; an answer whole
    /// marks it when it ends).
    fn first_token(&self) {
        match lock(&self.flight).as_mut() {
            Some(InFlight::Sent(s)) => s.first_token(),
            Some(InFlight::Named(f)) => f.first_token(),
            None => {}
        }
    }

    /// The request is over (answered, failed or abandoned). Ending it again does nothing.
    fn end(&self) {
        lock(&self.flight).take();
    }

    /// The request is over and its usage reported `cached_tokens` (None: it reported none):
    /// recorded against the choice's prediction (as `Fleet.record`), and the flight ends.
    /// The outcome ("exact", "optimistic", "pessimistic"), or None when nothing was recorded
    /// (no cached tokens, a flight started by name, or one that already ended).
    #[pyo3(signature = (cached_tokens=None))]
    fn finish(&self, cached_tokens: Option<u32>) -> Option<&'static str> {
        match lock(&self.flight).take() {
            Some(InFlight::Sent(s)) => s.finish(cached_tokens).map(|o| o.as_str()),
            _ => None,
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.end();
        false
    }
}

/// The routing loop over a fleet (`kvevent_fleet::route::Router`): `choose` where a request
/// goes, `start` it there, `retry` after a replica failed it.
#[pyclass(frozen, module = "kvevent", name = "Router")]
pub(crate) struct PyRouter {
    router: route::Router,
}

#[pymethods]
impl PyRouter {
    /// A router over `fleet` by `policy` ("cost", "prefix-only", "least-loaded" or
    /// "round-robin"); the cost policy's weights in microseconds (see the docs); a load read
    /// longer than `load_old_after` seconds ago is old, not used.
    #[new]
    #[pyo3(signature = (fleet, policy="cost", *, prefill_us_per_token=None, queue_us_per_request=None, load_old_after=1.0))]
    fn new(
        fleet: Py<PyFleet>,
        policy: &str,
        prefill_us_per_token: Option<f64>,
        queue_us_per_request: Option<f64>,
        load_old_after: f64,
    ) -> PyResult<Self> {
        let policy: Policy = policy
            .parse()
            .map_err(|e: route::UnknownPolicy| PyValueError::new_err(e.to_string()))?;
        let policy = policy
            .with_weights(prefill_us_per_token, queue_us_per_request)
            .map_err(|e| {
                PyValueError::new_err(format!(
                    "prefill_us_per_token and queue_us_per_request: {e}"
                ))
            })?;
        let bound = Duration::try_from_secs_f64(load_old_after).map_err(|_| {
            PyValueError::new_err(format!(
                "load_old_after must be a finite number of seconds ≥ 0, not {load_old_after}"
            ))
        })?;
        let router = route::Router::new(
            fleet.get().fleet().clone(),
            Rule::new(policy).with_load_old_after(bound),
        );
        // Weights given are kept; without, they are learned from the flights.
        let learn = prefill_us_per_token.is_none() && queue_us_per_request.is_none();
        Ok(Self {
            router: if learn { router.learning() } else { router },
        })
    }

    /// The cost policy's weights as the next choice uses them: `{"prefill_us_per_token",
    /// "queue_us_per_request", "learned", "flights"}` (learned from each flight's
    /// `first_token()` unless weights were given); None for another policy.
    fn weights<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, pyo3::types::PyDict>>> {
        let Some(w) = self.router.weights() else {
            return Ok(None);
        };
        let d = pyo3::types::PyDict::new(py);
        d.set_item("prefill_us_per_token", w.weights.prefill_us_per_token)?;
        d.set_item("queue_us_per_request", w.weights.queue_us_per_request)?;
        d.set_item("learned", w.learned)?;
        d.set_item("flights", w.flights)?;
        Ok(Some(d))
    }

    /// The policy's name.
    #[getter]
    fn policy(&self) -> &'static str {
        self.router.rule().policy().as_str()
    }

    /// Where a request of `tokens` (token ids, as `Fleet.score` takes them) for `adapter`
    /// ("" for the base model) goes among `candidates`; a replica known down (server down,
    /// engine lost, not ready, stale) is passed over while another can serve. Before any
    /// replica said its block size, by load alone. None only when there is no candidate.
    #[pyo3(signature = (candidates, tokens, *, adapter=""))]
    fn choose(
        &self,
        py: Python<'_>,
        candidates: Vec<String>,
        tokens: &Bound<'_, PyAny>,
        adapter: &str,
    ) -> PyResult<Option<PyChoice>> {
        let tokens = token_ids(tokens)?;
        Ok(py.detach(|| {
            let names: Vec<&str> = candidates.iter().map(String::as_str).collect();
            self.router
                .choose(&names, &tokens, adapter)
                .map(|decision| PyChoice { decision })
        }))
    }

    /// Where a request goes again after `failed` (the Choice it was sent on) failed before
    /// any byte of its answer reached the client, for `reason` ("refused": its connection was
    /// refused; "502", "503": what it answered): the next choice among `candidates` without
    /// that replica, counted. None when no other candidate is left, or when `failed` was
    /// itself a retry (a request is sent again once).
    #[pyo3(signature = (failed, candidates, tokens, *, reason="refused", adapter=""))]
    fn retry(
        &self,
        py: Python<'_>,
        failed: &Bound<'_, PyChoice>,
        candidates: Vec<String>,
        tokens: &Bound<'_, PyAny>,
        reason: &str,
        adapter: &str,
    ) -> PyResult<Option<PyChoice>> {
        let why = match reason {
            "refused" => Retry::Refused,
            "502" => Retry::BadGateway,
            "503" => Retry::Unavailable,
            other => {
                return Err(PyValueError::new_err(format!(
                    "`{other}` is not a reason to send a request again: refused, 502 or 503"
                )));
            }
        };
        let tokens = token_ids(tokens)?;
        let failed = &failed.get().decision;
        Ok(py.detach(|| {
            let names: Vec<&str> = candidates.iter().map(String::as_str).collect();
            self.router
                .retry(failed, why, &names, &tokens, adapter)
                .map(|decision| PyChoice { decision })
        }))
    }

    /// A request sent to `replica` (a name, or the Choice acted on): in flight until the
    /// Flight ends (`with router.start(choice): ...`, `flight.finish(cached_tokens)` or
    /// `flight.end()`). The cost and least-loaded policies count it ahead of the next request
    /// there.
    fn start(&self, replica: &Bound<'_, PyAny>) -> PyResult<PyFlight> {
        let flight = match replica.cast::<PyChoice>() {
            Ok(c) => InFlight::Sent(self.router.send(&c.get().decision)),
            Err(_) => {
                let name = replica.extract::<String>().map_err(|_| {
                    PyValueError::new_err("start: a Choice, or the name of the replica sent to")
                })?;
                InFlight::Named(self.router.flights(&name).start())
            }
        };
        Ok(PyFlight {
            flight: Mutex::new(Some(flight)),
        })
    }

    /// Requests this router has in flight to `replica`.
    fn in_flight(&self, replica: &str) -> u32 {
        self.router.in_flight(replica)
    }

    /// What the loop counted: `{"retries": {(replica, reason): n}, "none_serving": n}`.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let c = self.router.counters();
        let retries = pyo3::types::PyDict::new(py);
        for (replica, why, n) in &c.retries {
            retries.set_item((replica, why.as_str()), n)?;
        }
        let out = pyo3::types::PyDict::new(py);
        out.set_item("retries", retries)?;
        out.set_item("none_serving", c.none_serving)?;
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!("Router(policy={:?})", self.policy())
    }
}
