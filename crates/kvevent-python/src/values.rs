//! The classes of the Fleet's answers (`Score`, `Scores`, `ReplicaStatus`, `RankStatus`,
//! `IndexStats`, `Accounting`, `Change`): frozen, made from the Rust fleet's values, lazy where
//! an answer is large (a `Score` object is made only when indexed or iterated).

use kvevent_fleet::{self as fleet, ReplicaState};
use pyo3::prelude::*;
use pyo3::types::PyList;

/// One engine rank as its follower last saw it.
#[pyclass(
    frozen,
    get_all,
    skip_from_py_object,
    module = "kvevent",
    name = "RankStatus"
)]
#[derive(Clone)]
pub(crate) struct PyRankStatus {
    /// The DP rank.
    pub(crate) rank: u32,
    /// Its events socket has a connection to the engine.
    pub(crate) connected: bool,
    /// Seconds it has been connected, or lost (None: not known).
    pub(crate) since: Option<f64>,
    /// Replaying, or a gap that could not be repaired.
    pub(crate) degraded: bool,
}

#[pymethods]
impl PyRankStatus {
    fn __repr__(&self) -> String {
        format!(
            "RankStatus(rank={}, connected={}, degraded={})",
            self.rank,
            py_bool(self.connected),
            py_bool(self.degraded)
        )
    }
}

pub(crate) fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// One replica as the fleet knows it.
#[pyclass(
    frozen,
    get_all,
    skip_from_py_object,
    module = "kvevent",
    name = "ReplicaStatus"
)]
#[derive(Clone)]
pub(crate) struct PyReplicaStatus {
    /// Its name.
    pub(crate) name: String,
    /// The sidecar's URL (or the engine's endpoint).
    pub(crate) source: String,
    /// `exact`, `degraded` or `stale`.
    pub(crate) state: &'static str,
    /// Why it is not exact (`connecting`, `engine_lost`, `source_lost`, ...), or None.
    pub(crate) reason: Option<&'static str>,
    /// Prefixes (blocks) it holds, as known.
    pub(crate) blocks: u64,
    /// Seconds since its newest change was applied (None: none yet).
    pub(crate) newest_change: Option<f64>,
    /// Tokens per block, from its events (None until its first stored block).
    pub(crate) block_size: Option<u32>,
    /// Feed messages of changes applied (or engine batches received).
    pub(crate) batches: u64,
    /// The last error or refusal, in the library's words, until followed again.
    pub(crate) error: Option<String>,
    /// Each engine rank, where its source reports them.
    pub(crate) ranks: Vec<PyRankStatus>,
    /// What its engine was doing when its sidecar last read it (judge its `age`), or None.
    pub(crate) load: Option<crate::router::PyLoad>,
    /// Why the sidecar's reads of the load fail since then, or None.
    pub(crate) load_error: Option<String>,
}

impl From<fleet::ReplicaStatus> for PyReplicaStatus {
    fn from(r: fleet::ReplicaStatus) -> Self {
        Self {
            state: r.state.as_str(),
            reason: r.state.reason(),
            name: r.name,
            source: r.source,
            blocks: r.blocks,
            newest_change: r.newest_change.map(|d| d.as_secs_f64()),
            block_size: r.block_size,
            batches: r.batches,
            error: r.error,
            load: r.load.as_ref().map(crate::router::PyLoad::of),
            load_error: r.load_error,
            ranks: r
                .ranks
                .into_iter()
                .map(|k| PyRankStatus {
                    rank: k.rank,
                    connected: k.connected,
                    since: k.since.map(|d| d.as_secs_f64()),
                    degraded: k.degraded,
                })
                .collect(),
        }
    }
}

impl PyReplicaStatus {
    /// What a change is judged on: the state, why, the error and the ranks' connections.
    pub(crate) fn seen(&self) -> Seen {
        (
            self.state,
            self.reason,
            self.error.clone(),
            self.ranks
                .iter()
                .map(|k| (k.rank, k.connected, k.degraded))
                .collect(),
        )
    }
}

pub(crate) type Seen = (
    &'static str,
    Option<&'static str>,
    Option<String>,
    Vec<(u32, bool, bool)>,
);

#[pymethods]
impl PyReplicaStatus {
    /// In sync with its source: the only state to route on.
    #[getter]
    fn exact(&self) -> bool {
        self.state == "exact"
    }

    fn __repr__(&self) -> String {
        let why = self.reason.map(|r| format!(" ({r})")).unwrap_or_default();
        format!(
            "ReplicaStatus({:?}, {}{why}, blocks={})",
            self.name, self.state, self.blocks
        )
    }
}

/// The index's counters.
#[pyclass(frozen, get_all, module = "kvevent", name = "IndexStats")]
pub(crate) struct PyIndexStats {
    /// Distinct prefixes held.
    pub(crate) keys: usize,
    /// (prefix, source) pairs.
    pub(crate) pairs: usize,
    /// Bytes the index holds (table and mappers).
    pub(crate) bytes: usize,
    /// Of them, the table's.
    pub(crate) table_bytes: usize,
    /// Of them, the sources' mappers'.
    pub(crate) mapper_bytes: usize,
    /// Prefixes evicted to stay within the byte budget.
    pub(crate) evicted_keys: u64,
    /// Keys kept aside (colliding in the table).
    pub(crate) stashed: usize,
    /// Changes applied.
    pub(crate) applied: u64,
    /// Sources followed.
    pub(crate) sources: usize,
    /// Pairs of sources holding the same prefix (one held by h sources makes h(h-1)/2).
    pub(crate) shared_pairs: u64,
    /// The share of (prefix, source) pairs whose prefix another source also holds: 1 -
    /// keys / pairs.
    pub(crate) duplication: f64,
}

/// One replica's match.
#[pyclass(frozen, module = "kvevent", name = "Score")]
pub(crate) struct PyScore {
    pub(crate) replica: String,
    pub(crate) matched_blocks: u32,
    pub(crate) matched_tokens: u32,
    pub(crate) tier: &'static str,
    pub(crate) state: ReplicaState,
    pub(crate) load: Option<kvevent_fleet::LoadReading>,
}

impl PyScore {
    fn of(s: &fleet::Score<'_>) -> Self {
        Self {
            replica: s.replica.to_owned(),
            matched_blocks: s.matched_blocks,
            matched_tokens: s.matched_tokens,
            tier: match s.tier {
                fleet::Tier::T1 => "T1",
                fleet::Tier::T2 => "T2",
            },
            state: s.state,
            load: s.load.cloned(),
        }
    }
}

#[pymethods]
impl PyScore {
    /// What its engine was doing when its sidecar last read it (judge its `age`), or None.
    #[getter]
    fn load(&self) -> Option<crate::router::PyLoad> {
        self.load.as_ref().map(crate::router::PyLoad::of)
    }
    /// The replica's name.
    #[getter]
    fn replica(&self) -> &str {
        &self.replica
    }
    /// Blocks of the query it holds from block 0 on.
    #[getter]
    fn matched_blocks(&self) -> u32 {
        self.matched_blocks
    }
    /// Tokens those blocks cover.
    #[getter]
    fn matched_tokens(&self) -> u32 {
        self.matched_tokens
    }
    /// `T1` (GPU), or `T2` when any matched block is only in the offload tier.
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier
    }
    /// `exact`, `degraded` or `stale`: route on exact, fail open otherwise.
    #[getter]
    fn state(&self) -> &'static str {
        self.state.as_str()
    }
    /// Why it is not exact, or None.
    #[getter]
    fn reason(&self) -> Option<&'static str> {
        self.state.reason()
    }
    /// The replica is exact.
    #[getter]
    fn exact(&self) -> bool {
        self.state.is_exact()
    }

    fn __repr__(&self) -> String {
        format!(
            "Score({:?}, matched_tokens={}, {}, {})",
            self.replica,
            self.matched_tokens,
            self.tier,
            self.state.as_str()
        )
    }
}

/// The answer to a query: a Score per replica holding block 0 (with `score_among`, per
/// candidate followed, matching or not), best first. Indexing and iterating make the Score
/// objects as they are asked for.
#[pyclass(frozen, module = "kvevent", name = "Scores")]
pub(crate) struct PyScores {
    pub(crate) scores: fleet::Scores,
    pub(crate) not_followed: Vec<String>,
}

#[pymethods]
impl PyScores {
    fn __len__(&self) -> usize {
        self.scores.len()
    }

    fn __bool__(&self) -> bool {
        !self.scores.is_empty()
    }

    fn __getitem__(&self, i: isize) -> PyResult<PyScore> {
        let n = self.scores.len() as isize;
        let at = if i < 0 { i + n } else { i };
        usize::try_from(at)
            .ok()
            .and_then(|at| self.scores.get(at))
            .map(|s| PyScore::of(&s))
            .ok_or_else(|| pyo3::exceptions::PyIndexError::new_err("score index out of range"))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let items = self
            .scores
            .iter()
            .map(|s| Py::new(py, PyScore::of(&s)))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)?.try_iter().map(Bound::into_any)
    }

    /// The exact replica holding the most of the prompt (ties: the answer's order), or None
    /// when no exact replica holds any of it: a replica not exact, or a match of 0 tokens, is
    /// never the best. Routing weighs load too: `Router.choose`.
    #[getter]
    fn best(&self) -> Option<PyScore> {
        self.scores
            .iter()
            .find(|s| s.state.is_exact() && s.matched_tokens > 0)
            .map(|s| PyScore::of(&s))
    }

    /// With `score_among`: the candidates the fleet does not follow, in the order asked.
    #[getter]
    fn not_followed(&self) -> Vec<String> {
        self.not_followed.clone()
    }

    fn __repr__(&self) -> String {
        let items: Vec<String> = self
            .scores
            .iter()
            .map(|s| PyScore::of(&s).__repr__())
            .collect();
        format!("Scores([{}])", items.join(", "))
    }
}

/// One replica's predictions so far (`Fleet.record`).
#[pyclass(frozen, get_all, module = "kvevent", name = "Accounting")]
pub(crate) struct PyAccounting {
    /// Decisions recorded.
    pub(crate) decisions: u64,
    /// Of them, exact.
    pub(crate) exact: u64,
    /// Of them, optimistic (the index promised more than the engine reused).
    pub(crate) optimistic: u64,
    /// Of them, pessimistic (the engine reused more than the index knew of).
    pub(crate) pessimistic: u64,
    /// Decisions made while the replica was not exact.
    pub(crate) not_exact_state: u64,
    /// Decisions per error bucket (ERROR_BUCKETS, then the rest), in blocks.
    pub(crate) error_blocks: Vec<u64>,
    /// Sum of the errors in blocks.
    pub(crate) error_sum: i64,
}

/// What a change tells: every replica now, those whose state, reason, error or ranks changed
/// since the previous change (or were added), and those removed.
#[pyclass(frozen, get_all, module = "kvevent", name = "Change")]
pub(crate) struct PyChange {
    /// Every replica followed, by name.
    pub(crate) replicas: Vec<PyReplicaStatus>,
    /// Those that changed, or were added.
    pub(crate) changed: Vec<PyReplicaStatus>,
    /// The names of those removed.
    pub(crate) removed: Vec<String>,
}

#[pymethods]
impl PyChange {
    fn __repr__(&self) -> String {
        let changed: Vec<String> = self.changed.iter().map(PyReplicaStatus::__repr__).collect();
        format!(
            "Change(changed=[{}], removed={:?})",
            changed.join(", "),
            self.removed
        )
    }
}
