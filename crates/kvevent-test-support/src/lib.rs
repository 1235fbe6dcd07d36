//! Fakes for kvevent's tests, speaking the real protocols on loopback.
//!
//! - [`RecordingServer`]: a real tonic InferenceCache server on `127.0.0.1:0` that records every
//!   `CacheStateUpdate` and `CacheEvent` in arrival order, and can be told to refuse, delay or
//!   hang, or be stopped and started again on the same port.
//! - [`serve_on_thread`]: the same service over a benchmark's own [`EngineSide`] handler (one
//!   that counts and keeps nothing), on a thread and runtime of its own.
//! - [`HeldPort`]: a loopback port held (bound, not listening) for a test's life, to connect to
//!   where nothing listens, or to hand to an engine before it binds.
//!
//! With feature `engine` (on by default; it builds libzmq):
//! - [`Publisher`]: the Rust fake engine (re-exported from `kvevent-zmq`).
//! - [`PythonPublisher`]: a publisher built on msgspec + pyzmq exactly as vLLM's is, run as a
//!   child process, so both sides' libzmq really talk.
//! - [`Vllm`]: a real vLLM engine on CPU, for the real-engine checks (`.ci/real-engine`).
//!
//! With feature `stand-ins`: `stand_ins`, what the README's embedding snippet follows.
//!
//! And the plumbing of tests: [`eventually`] (a bounded wait whose failure says what it waited
//! for and the last value seen) and [`batches`] (`EventBatch` builders).
//!
//! Used by tests and benchmarks, never by what ships. Every wait is bounded by a timeout.

pub mod batches;
mod ports;
#[cfg(feature = "engine")]
mod python;
mod server;
#[cfg(feature = "stand-ins")]
pub mod stand_ins;
#[cfg(feature = "engine")]
mod vllm;
mod wait;

#[cfg(feature = "engine")]
pub use kvevent_zmq::publisher::{Publisher, PublisherConfig};
pub use ports::HeldPort;
#[cfg(feature = "engine")]
pub use python::{PythonPublisher, python};
pub use server::{
    Behaviour, EngineSide, Received, RecordingServer, accepted, distinct_prefixes, serve_on_thread,
};
#[cfg(feature = "engine")]
pub use vllm::{Timed, VLLM_BLOCK, VLLM_CACHE_BLOCKS, Vllm, vllm_venv};
pub use wait::{eventually, eventually_blocking, when};

/// The repository's `testdata/` (vectors, metrics fixtures, golden fingerprints; see its
/// README for where each comes from).
pub fn shared_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}
