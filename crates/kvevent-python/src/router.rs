//! `kvevent.Router`: `kvevent_fleet::route`'s rule over a `Fleet`, for Python routers (the
//! Rust rule itself, not a copy): which replica a request goes to, by a policy, with what this
//! router has in flight to each; `Load`, an engine's load as its sidecar read it.
//!
//! Invariants: the GIL is released while Rust scores and chooses; a request is in flight from
//! `start` until its `Flight` ends (`with`, or `end()`), at most once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvevent_fleet::route::{self, Candidate, Flights, LoadSeen, Policy, Rule, Weights};
use kvevent_fleet::{Query, QueryKeys, ReplicaState};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::convert::token_ids;
use crate::fleet::PyFleet;

/// What an engine was doing when its sidecar last read it.
#[pyclass(
    frozen,
    get_all,
    skip_from_py_object,
    module = "kvevent",
    name = "Load"
)]
#[derive(Clone)]
pub(crate) struct PyLoad {
    /// Requests in its running batches (all DP ranks).
    running: u32,
    /// Requests queued (all DP ranks).
    waiting: u32,
    /// KV-cache usage, 0-1 (the mean over DP ranks), or None when the engine does not say.
    kv_usage: Option<f32>,
    /// Seconds since it was read, when this object was made.
    age: f64,
    /// The sidecar's reads since this one fail: it only ages.
    failing: bool,
}

impl PyLoad {
    pub(crate) fn of(l: &kvevent_fleet::Load) -> Self {
        Self {
            running: l.running,
            waiting: l.waiting,
            kv_usage: l.kv_usage,
            age: l.age(Instant::now()).as_secs_f64(),
            failing: l.failing,
        }
    }
}

#[pymethods]
impl PyLoad {
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
    replica: String,
    matched_tokens: u32,
    prompt_tokens: u32,
    compute_tokens: u32,
    queued: u32,
    failed_open: bool,
    load: &'static str,
    cost_us: f64,
    state: ReplicaState,
}

impl PyChoice {
    /// The replica, what it was said to hold, and its state: what `Fleet.record` counts.
    pub(crate) fn prediction(&self) -> (&str, u32, ReplicaState) {
        (&self.replica, self.matched_tokens, self.state)
    }
}

#[pymethods]
impl PyChoice {
    /// The replica chosen.
    #[getter]
    fn replica(&self) -> &str {
        &self.replica
    }
    /// Tokens of the prompt the fleet says it holds (0 when it said nothing of it).
    #[getter]
    fn matched_tokens(&self) -> u32 {
        self.matched_tokens
    }
    /// The prompt's length in tokens.
    #[getter]
    fn prompt_tokens(&self) -> u32 {
        self.prompt_tokens
    }
    /// Prompt tokens it will compute there: the prompt less what the replica holds exactly.
    /// Until its first token (`Flight.first_token()`), they count ahead of the next request
    /// there.
    #[getter]
    fn compute_tokens(&self) -> u32 {
        self.compute_tokens
    }
    /// Requests estimated queued ahead of this one there.
    #[getter]
    fn queued(&self) -> u32 {
        self.queued
    }
    /// The choice does not rest on an exact match.
    #[getter]
    fn failed_open(&self) -> bool {
        self.failed_open
    }
    /// How its load was known: "fresh", "old" (not used) or "none".
    #[getter]
    fn load(&self) -> &'static str {
        self.load
    }
    /// What the cost policy estimated the request costs there, in microseconds (0 for the
    /// other policies).
    #[getter]
    fn cost_us(&self) -> f64 {
        self.cost_us
    }
    /// `exact`, `degraded` or `stale`, when chosen.
    #[getter]
    fn state(&self) -> &'static str {
        self.state.as_str()
    }
    /// Why it was not exact, or None.
    #[getter]
    fn reason(&self) -> Option<&'static str> {
        self.state.reason()
    }
    /// It was exact when chosen.
    #[getter]
    fn exact(&self) -> bool {
        self.state.is_exact()
    }

    fn __repr__(&self) -> String {
        format!(
            "Choice({:?}, matched_tokens={}, queued={}, {}, load {})",
            self.replica,
            self.matched_tokens,
            self.queued,
            self.state.as_str(),
            self.load
        )
    }
}

/// A request in flight to a replica, from `Router.start` until `end()` (or the end of its
/// `with` block).
#[pyclass(frozen, module = "kvevent", name = "Flight")]
pub(crate) struct PyFlight {
    flight: Mutex<Option<route::Flight>>,
}

#[pymethods]
impl PyFlight {
    /// Its first token came: its prompt is computed (streamed responses; an answer whole
    /// marks it when it ends).
    fn first_token(&self) {
        if let Some(f) = lock(&self.flight).as_mut() {
            f.first_token();
        }
    }

    /// The request is over (answered, failed or abandoned). Ending it again does nothing.
    fn end(&self) {
        lock(&self.flight).take();
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

/// The routing rule over a fleet: `choose` where a request goes, `start` it there.
#[pyclass(frozen, module = "kvevent", name = "Router")]
pub(crate) struct PyRouter {
    fleet: Py<PyFleet>,
    rule: Rule,
    flights: Mutex<HashMap<String, Arc<Flights>>>,
}

impl PyRouter {
    fn flights(&self, name: &str) -> Arc<Flights> {
        lock(&self.flights)
            .entry(name.to_owned())
            .or_default()
            .clone()
    }
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
        let mut policy: Policy = policy
            .parse()
            .map_err(|e: route::UnknownPolicy| PyValueError::new_err(e.to_string()))?;
        match &mut policy {
            Policy::Cost(w) => {
                let d = Weights::default();
                w.prefill_us_per_token = prefill_us_per_token.unwrap_or(d.prefill_us_per_token);
                w.queue_us_per_request = queue_us_per_request.unwrap_or(d.queue_us_per_request);
                if ![w.prefill_us_per_token, w.queue_us_per_request]
                    .iter()
                    .all(|v| v.is_finite() && *v >= 0.0)
                {
                    return Err(PyValueError::new_err(
                        "prefill_us_per_token and queue_us_per_request are microseconds, 0 or more",
                    ));
                }
            }
            other if prefill_us_per_token.is_some() || queue_us_per_request.is_some() => {
                return Err(PyValueError::new_err(format!(
                    "prefill_us_per_token and queue_us_per_request weigh the cost policy, not {other}"
                )));
            }
            _ => {}
        }
        let bound = Duration::try_from_secs_f64(load_old_after).map_err(|_| {
            PyValueError::new_err(format!(
                "load_old_after must be a finite number of seconds ≥ 0, not {load_old_after}"
            ))
        })?;
        Ok(Self {
            fleet,
            rule: Rule::new(policy).with_load_old_after(bound),
            flights: Mutex::default(),
        })
    }

    /// The policy's name.
    #[getter]
    fn policy(&self) -> &'static str {
        self.rule.policy().as_str()
    }

    /// Where a request of `tokens` (token ids, as `Fleet.score` takes them) for `adapter`
    /// ("" for the base model) goes among `candidates`. Before any replica said its block
    /// size, by load alone. None only when there is no candidate.
    #[pyo3(signature = (candidates, tokens, *, adapter=""))]
    fn choose(
        &self,
        py: Python<'_>,
        candidates: Vec<String>,
        tokens: &Bound<'_, PyAny>,
        adapter: &str,
    ) -> PyResult<Option<PyChoice>> {
        let tokens = token_ids(tokens)?;
        let flights: Vec<Arc<Flights>> = candidates.iter().map(|c| self.flights(c)).collect();
        let fleet = self.fleet.get().fleet();
        let choice = py.detach(|| {
            let block = fleet.block_size();
            let names: Vec<&str> = candidates.iter().map(String::as_str).collect();
            let scores = block.and_then(|b| {
                let query = Query {
                    adapter,
                    keys: QueryKeys::Tokens {
                        ids: &tokens,
                        block_size: b as usize,
                    },
                };
                fleet.score_among(&query, &names).ok()
            });
            let cs: Vec<Candidate<'_>> = names
                .iter()
                .zip(&flights)
                .map(|(name, f)| Candidate { name, flights: f })
                .collect();
            let request = route::Request {
                prompt_tokens: tokens.len() as u32,
                affinity: route::affinity(&tokens, block.unwrap_or(16) as usize),
            };
            self.rule
                .choose(scores.as_ref(), &request, &cs, Instant::now())
                .map(|c| PyChoice {
                    replica: c.replica.to_owned(),
                    matched_tokens: c.matched_tokens,
                    prompt_tokens: request.prompt_tokens,
                    compute_tokens: c.compute_tokens,
                    queued: c.queued,
                    failed_open: c.failed_open,
                    load: match c.load {
                        LoadSeen::Fresh => "fresh",
                        LoadSeen::Old => "old",
                        LoadSeen::None => "none",
                    },
                    cost_us: c.cost_us,
                    state: c.state,
                })
        });
        Ok(choice)
    }

    /// A request sent to `replica` (a name, or the Choice acted on): in flight until the
    /// Flight ends (`with router.start(choice): ...`, or `flight.end()`). The cost and
    /// least-loaded policies count it ahead of the next request there.
    fn start(&self, replica: &Bound<'_, PyAny>) -> PyResult<PyFlight> {
        let (name, compute) = match replica.cast::<PyChoice>() {
            Ok(c) => (c.get().replica.clone(), c.get().compute_tokens),
            Err(_) => (
                replica.extract::<String>().map_err(|_| {
                    PyValueError::new_err("start: a Choice, or the name of the replica sent to")
                })?,
                0,
            ),
        };
        Ok(PyFlight {
            flight: Mutex::new(Some(self.flights(&name).start_prefill(compute))),
        })
    }

    /// Requests this router has in flight to `replica`.
    fn in_flight(&self, replica: &str) -> u32 {
        lock(&self.flights)
            .get(replica)
            .map_or(0, |f| f.in_flight())
    }

    fn __repr__(&self) -> String {
        format!("Router(policy={:?})", self.rule.policy().as_str())
    }
}
