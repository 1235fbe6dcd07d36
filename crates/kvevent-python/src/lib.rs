//! `kvevent._kvevent`, the native module of the `kvevent` Python package (the package's
//! `python/kvevent` re-exports it, with its type stubs): the `Fleet` (`fleet`) and the routing
//! rule over it (`router`), fingerprint keys from token ids, the decoder of every vLLM and
//! SGLang release's payloads to Python objects (the normalized form of
//! `testdata/vectors/README.md`), and a reader of `kvevents record` files.
//!
//! Invariants: the GIL is released while Rust hashes or decodes; every failure is a Python
//! exception with the library's own words ([`DecodeError`], [`RecordingError`], `ValueError`
//! for a bad argument), never a panic.

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;

use kvevent_recording::Reader;
use kvevent_wire::{Engine, Limits};
use pyo3::IntoPyObjectExt;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use serde_json::Value;

mod convert;
mod fleet;
mod router;
mod values;

pyo3::create_exception!(
    _kvevent,
    DecodeError,
    PyValueError,
    "A payload that is not a batch of the engine's wire: what was wrong and at which byte."
);

pyo3::create_exception!(
    _kvevent,
    RecordingError,
    PyValueError,
    "A file that is not a recording, or a damaged one: the file and what was wrong where."
);

/// The prefix keys of `token_ids`, one per full block of `block_size` tokens (tokens after the
/// last full block are ignored): the XXH3-64 fingerprint chain a gateway computes, starting
/// from `parent` (the key of the block before, if the tokens continue a prefix). The keys a
/// sidecar's feed carries and a `Fleet` scores with.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, parent=None))]
fn fingerprint_keys(
    py: Python<'_>,
    token_ids: &Bound<'_, PyAny>,
    block_size: usize,
    parent: Option<u64>,
) -> PyResult<Vec<u64>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be at least 1"));
    }
    let token_ids = convert::token_ids(token_ids)?;
    Ok(py.detach(|| {
        let mut keys = Vec::with_capacity(token_ids.len() / block_size);
        kvevent_fingerprint::prefixes_into(&token_ids, block_size, parent, &mut keys);
        keys
    }))
}

/// The batch in `payload` (one ZMQ payload frame of the engine's KV events) as a dict: `ts`,
/// `data_parallel_rank` and `events`, every field of the newest release present (None when
/// the engine's release has no such field), int hashes as ints, bytes hashes as lowercase hex.
/// `engine` is `"vllm"` (every release from 0.9.0) or `"sglang"` (0.4.6 on).
#[pyfunction]
#[pyo3(signature = (payload, engine="vllm"))]
fn decode<'py>(py: Python<'py>, payload: &[u8], engine: &str) -> PyResult<Bound<'py, PyAny>> {
    let engine: Engine = engine
        .parse()
        .map_err(|e: kvevent_wire::Error| PyValueError::new_err(format!("`{engine}`: {e}")))?;
    let json = py
        .detach(|| decode_json(payload, engine))
        .map_err(|e| DecodeError::new_err(e.to_string()))?;
    to_python(py, &json)
}

fn decode_json(payload: &[u8], engine: Engine) -> kvevent_wire::Result<Value> {
    let batch = kvevent_wire::decode_engine(payload, engine, &Limits::DEFAULT)?;
    Ok(kvevent_wire::json::to_json_engine(&batch, engine))
}

/// A JSON value as Python objects: dicts keep their keys' order.
fn to_python<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    match v {
        Value::Null => Ok(py.None().into_bound(py)),
        Value::Bool(b) => b.into_bound_py_any(py),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_bound_py_any(py),
            (None, Some(i)) => i.into_bound_py_any(py),
            _ => n.as_f64().unwrap_or(f64::NAN).into_bound_py_any(py),
        },
        Value::String(s) => s.into_bound_py_any(py),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_python(py, item)?)?;
            }
            Ok(list.into_any())
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, item) in map {
                dict.set_item(key(py, k), to_python(py, item)?)?;
            }
            Ok(dict.into_any())
        }
    }
}

/// A dict key of the normalized form as a Python string made once (its hash kept), not one
/// string a key a dict; any other key is made fresh.
fn key<'py>(py: Python<'py>, k: &str) -> Bound<'py, PyString> {
    macro_rules! known {
        ($($name:literal),*) => {
            match k {
                $($name => pyo3::intern!(py, $name).clone(),)*
                _ => PyString::new(py, k),
            }
        };
    }
    known!(
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
        "cache_salt",
        "ts",
        "data_parallel_rank",
        "events"
    )
}

/// One batch as it arrived, from a recording.
#[pyclass(frozen, module = "kvevent", get_all)]
struct Record {
    /// The DP rank it came from.
    rank: u32,
    /// Its sequence number.
    seq: u64,
    /// Microseconds from the recording's start to its arrival.
    at_us: u64,
    /// Its topic frame.
    topic: Py<PyBytes>,
    /// It came from the replay endpoint, not live.
    replay: bool,
    /// Why the rank starts over at this record (`restart`, `gap`, ...), or None: what its
    /// earlier records built is stale.
    reset: Option<String>,
    /// The payload, byte for byte.
    payload: Py<PyBytes>,
    /// Whose wire the payload is (the recording's engine).
    engine: String,
}

#[pymethods]
impl Record {
    /// The payload decoded, as [`decode`] gives it.
    fn decode<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        decode(py, self.payload.as_bytes(py), &self.engine)
    }

    fn __repr__(&self) -> String {
        format!(
            "Record(rank={}, seq={}, at_us={}, replay={}, reset={:?})",
            self.rank, self.seq, self.at_us, self.replay, self.reset
        )
    }
}

/// A `kvevents record` file, read one record at a time: iterate it for its [`Record`]s.
#[pyclass(unsendable, module = "kvevent")]
struct Recording {
    reader: Reader<BufReader<File>>,
    path: String,
    /// Whose wire the payloads are: `vllm` or `sglang`.
    #[pyo3(get)]
    engine: String,
    /// Unix time (ms) of the recording's start.
    #[pyo3(get)]
    started_unix_ms: u64,
    /// The endpoints recorded, one per DP rank: (rank, endpoint, replay endpoint or None).
    #[pyo3(get)]
    sources: Vec<(u32, String, Option<String>)>,
}

#[pymethods]
impl Recording {
    /// Opens the recording at `path` and reads its header.
    #[new]
    fn new(path: PathBuf) -> PyResult<Self> {
        let name = path.display().to_string();
        let file =
            File::open(&path).map_err(|e| RecordingError::new_err(format!("{name}: {e}")))?;
        let reader = Reader::new(BufReader::new(file))
            .map_err(|e| RecordingError::new_err(format!("{name}: {e}")))?;
        let header = reader.header().clone();
        Ok(Self {
            reader,
            path: name,
            engine: header.engine,
            started_unix_ms: header.started_unix_ms,
            sources: header
                .sources
                .into_iter()
                .map(|s| (s.rank, s.endpoint, s.replay_endpoint))
                .collect(),
        })
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Record>> {
        let record = self
            .reader
            .next_record()
            .map_err(|e| RecordingError::new_err(format!("{}: {e}", self.path)))?;
        Ok(record.map(|r| Record {
            rank: r.rank,
            seq: r.seq,
            at_us: r.at_us,
            topic: PyBytes::new(py, &r.topic).unbind(),
            replay: r.replay,
            reset: r.reset,
            payload: PyBytes::new(py, &r.payload).unbind(),
            engine: self.engine.clone(),
        }))
    }

    fn __repr__(&self) -> String {
        format!("Recording({:?}, engine={:?})", self.path, self.engine)
    }
}

/// The native module.
#[pymodule]
fn _kvevent(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fingerprint_keys, m)?)?;
    m.add_function(wrap_pyfunction!(decode, m)?)?;
    m.add_class::<Recording>()?;
    m.add_class::<Record>()?;
    m.add("DecodeError", m.py().get_type::<DecodeError>())?;
    m.add("RecordingError", m.py().get_type::<RecordingError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    fleet::add(m)?;
    Ok(())
}
