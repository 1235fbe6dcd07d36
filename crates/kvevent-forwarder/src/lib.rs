//! Delivers InferenceCache reports to the server without ever stalling the caller. With
//! feature `metrics`, `collector` writes its counters as `/metrics` families.
//!
//! The caller hands [`Report`](pb::Report)s to a [`Handle`] over a bounded channel and never
//! waits on the network. A single task owns the pending work:
//!
//! - **Intake.** While a window is open, reports wait in the channel until it is due: the
//!   task wakes once a window, not once a report (a handle rings a bell when the channel is
//!   half full, so a burst never fills it unseen).
//! - **Windows.** Adds and evictions are collected over a window (default 100 ms). Work on one
//!   prefix is netted as it arrives: a repeated add replaces the queued one; an eviction drops
//!   the queued adds of its prefix, and is dropped itself when the first of them was a
//!   [`Report::New`](pb::Report::New) (the server never held the prefix), so a block stored
//!   and evicted before anything was sent costs no RPC ([`Metrics::cancelled`]).
//! - **Concurrency.** A window is sent as one `ReportCacheState` client stream (one
//!   `CacheStateUpdate` per identity, adapter and batch time, at most
//!   [`MAX_ENTRIES_PER_UPDATE`] entries each) and one unary `PublishEvent` per eviction, up to
//!   [`Config::max_in_flight`] calls at once on the one HTTP/2 connection.
//! - **Order.** Per prefix, the server sees work in the order it was made: an eviction never
//!   overtakes an earlier add, an add never overtakes an earlier eviction (adds that follow an
//!   eviction of their prefix in a window are sent once its evictions are acknowledged), and
//!   windows are sent one after the other. A clear (`ALL_CLEARED`) discards the queued, unsent
//!   work of its replica and waits for everything before it; everything after waits for it.
//!   A failed call is retried before its window completes, so later work cannot overtake it.
//! - **Deadlines.** Every RPC has its own deadline (default 5 s). A hung or absent server never
//!   blocks the input side.
//! - **Outages and overload.** Retryable failures ([`classify`]) keep the work and retry with
//!   exponential backoff; the contract's additive semantics make a re-send harmless. The work
//!   waiting behind the window in flight is bounded ([`Config::max_pending`], counting prefix
//!   entries and events). Past it, while the server answers, new adds and evictions are
//!   dropped as they arrive (the task is what falls behind, and the queue goes out in order);
//!   while calls fail, the oldest queued work is shed, so the newest goes first when the
//!   server is back. Clears are never dropped. Drops are counted by [`DropReason`] and logged
//!   at most once per
//!   [`Config::log_interval`], as are failing RPCs (recovery is logged once).
//! - **Drain.** [`Forwarder::shutdown`] stops intake, flushes everything within a deadline and
//!   returns what could not be sent ([`DrainReport`]).
//!
//! Memory: at most `max_pending` queued entries plus the window in flight (itself at most
//! `max_pending` when it was queued): a queued entry is one op and one index entry (the bytes
//! are measured in `docs/performance.md`); a window in flight drops its index, and builds its
//! messages per attempt.
//!
//! [`Client`] is the thin deadline-bounded gRPC client, shared with the stats path. It knows
//! proto messages, never msgpack. Counters live in [`Metrics`] for the caller to export.
//!
//! ```
//! use std::time::Duration;
//! use kvevent_forwarder::{connect, spawn, ClientConfig, Config};
//! use kvevent_proto as pb;
//! use kvevent_test_support::RecordingServer;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = RecordingServer::start().await; // a real tonic server, recording
//! let client = connect(&ClientConfig::new(server.uri()))?;
//! let (handle, forwarder) = spawn(client, Config { window: Duration::from_millis(10), ..Config::default() });
//! let update = pb::CacheStateUpdate {
//!     replica_id: "pod-a".into(),
//!     model_id: "llama".into(),
//!     prefixes: vec![pb::PrefixEntry { prefix_hash: vec![1; 8], token_count: 16, ..Default::default() }],
//!     ..Default::default()
//! };
//! handle.try_submit(pb::Report::New(update)); // never waits for the network
//! // Shutdown flushes what is pending within the deadline and says what was left.
//! let left = forwarder.shutdown(Duration::from_secs(5)).await;
//! assert_eq!((left.unsent_prefixes, left.unsent_events), (0, 0));
//! assert_eq!(server.prefixes().len(), 1);
//! # Ok(())
//! # }
//! ```

mod client;
#[cfg(feature = "metrics")]
pub mod collector;
mod counters;
mod handle;
mod pending;
mod task;
#[cfg(test)]
mod tests;

pub use client::{Client, ClientConfig, Credentials, Retry, classify, connect};
pub use counters::{DropReason, Histogram, Histograms, Metrics};
pub use handle::{
    Closed, Config, DrainReport, Forwarder, Handle, MAX_ENTRIES_PER_UPDATE, Submit, spawn,
};
pub use task::INITIAL_IN_FLIGHT;

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
