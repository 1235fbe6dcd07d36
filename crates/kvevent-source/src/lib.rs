#![doc = include_str!("../README.md")]

#[cfg(feature = "metrics")]
pub mod collector;
mod counters;
mod health;
mod state;
mod subscriber;

pub use counters::{DECODE_FAILURE_KINDS, EventCounts, SourceMetrics};
pub use health::{Health, RankHealth};
pub use state::{ReplayEnd, ResetReason, Resume, SourceState, StateConfig, Step, payload_digest};
pub use subscriber::{Batch, Config, Subscriber, Update, View};
