//! Delivers InferenceCache reports to the server without ever stalling the caller.
//!
//! The caller hands [`Report`](pb::Report)s to a [`Handle`] over a bounded channel and never
//! waits on the network. A single task owns the pending work:
//!
//! - **Coalescing.** Adds are merged by (identity, adapter, key, tier) over a window (default
//!   100 ms) and sent as one `ReportCacheState` client-streaming call per flush (one
//!   `CacheStateUpdate` per identity and adapter). Removals and clears go by unary
//!   `PublishEvent`.
//! - **Order.** Work is sent strictly in arrival order, one RPC at a time: pending adds are
//!   flushed before a removal is published; a clear discards the work buffered before it for
//!   that replica (never what is in flight), then is published.
//! - **Deadlines.** Every RPC has its own deadline (default 5 s). A hung or absent server never
//!   blocks the input side.
//! - **Outages.** Retryable failures ([`classify`]) keep the work and retry with exponential
//!   backoff; the contract's additive semantics make a re-send harmless. Pending work is bounded
//!   ([`Config::max_pending`], counting prefix entries and events); past it the oldest work is
//!   dropped and counted by [`DropReason`].
//! - **Drain.** [`Forwarder::shutdown`] stops intake, flushes everything within a deadline and
//!   returns what could not be sent ([`DrainReport`]).
//!
//! [`Client`] is the thin deadline-bounded gRPC client, shared with the stats path. It knows
//! proto messages, never msgpack. Counters live in [`Metrics`] for the caller to export.

mod client;
mod forwarder;
mod metrics;

pub use client::{Client, ClientConfig, Credentials, Retry, classify, connect};
pub use forwarder::{
    Closed, Config, DrainReport, Forwarder, Handle, MAX_ENTRIES_PER_UPDATE, Submit, spawn,
};
pub use metrics::{DropReason, Metrics};

use kvevent_proto as pb;

/// What went wrong setting up the forwarder.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server address is not a valid URI.
    #[error("invalid server address `{address}`")]
    InvalidAddress {
        /// The address as given.
        address: String,
        /// Why it is invalid.
        #[source]
        source: tonic::transport::Error,
    },
    /// TLS settings could not be applied.
    #[error("tls configuration")]
    Tls(#[source] tonic::transport::Error),
}
