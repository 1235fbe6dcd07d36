//! Simulated vLLM engines, many in one process, each serving what a router talks to: vLLM's
//! HTTP API (`/v1/completions` and `/v1/chat/completions`, token ids or text, streamed or whole,
//! with the engine's own `cached_tokens`; `/v1/models`; `/health`), its `/metrics` and its KV events on vLLM 0.33's wire with replay.
//! The scheduler, prefix cache and time model are [`kvevent_sim`]'s (checked block for block
//! against vLLM); this crate hosts them ([`host::SimEngine`]) and is the `kvevent-simulator`
//! program. `route-bench` and the routing demo run their fleets on it, with [`client`] sending
//! [`kvevent_sim::workload`]'s requests.
//!
//! Invariants: an engine's events are published after the step that made them, in order, each
//! batch once (replay serves what a late subscriber missed); a request's `cached_tokens` is
//! what the engine found cached when it was scheduled; every request gets an answer or an
//! error status, never a hang past the engine's own work.

pub mod client;
pub mod host;

pub use host::{Serving, SimEngine};
