//! A simulated vLLM engine, for routing benchmarks that need hundreds of engines on one
//! machine: vLLM's prefix-cache block pool (v1, as of 0.32: the LRU free queue, hits capped at
//! `prompt - 1` tokens, the events it makes) and its scheduler's continuous batching (token
//! budget, chunked prefill, preemption), one step at a time with a [`TimeModel`]. Deterministic:
//! the same requests in the same order give the same events, blocks and cached tokens. Its
//! block hashes are the fingerprint chain of the tokens (its own, not vLLM's).
//!
//! No IO and no clock: a host (`kvevent-simulator`) runs engines behind vLLM's HTTP API,
//! `/metrics` and KV-event wire; [`workload`] makes seeded request streams to drive them.
//!
//! ```
//! use kvevent_sim::{Config, Engine, Event, Progress, Request, TimeModel};
//! let mut engine = Engine::new(Config {
//!     block_size: 16,
//!     num_blocks: 64,
//!     max_num_seqs: 8,
//!     max_num_batched_tokens: 2048,
//!     time: TimeModel::GPU_8B,
//!     prefix_caching: true,
//! });
//! let prompt: Vec<u32> = (0..40).collect();
//! for id in 0..2 {
//!     engine.add(Request { id, prompt: prompt.clone(), max_tokens: 1, output: Vec::new(), lora: None });
//!     let step = engine.step().expect("work");
//!     // The first request stores two full blocks; the second finds them.
//!     let cached = step.progress.iter().find_map(|p| match p {
//!         Progress::FirstToken { cached_tokens, .. } => Some(*cached_tokens),
//!         _ => None,
//!     });
//!     assert_eq!(cached, Some(if id == 0 { 0 } else { 32 }));
//!     assert_eq!(matches!(step.events.first(), Some(Event::Stored { .. })), id == 0);
//! }
//! ```

mod engine;
mod pool;
pub mod workload;

pub use engine::{Config, Engine, Lora, Progress, Request, Step, TimeModel, generated_tokens};
pub use pool::Event;
