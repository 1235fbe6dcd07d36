//! The router feed: what a sidecar knows of its replica's KV cache, served to routers as a
//! snapshot then live changes, and the router's side that follows sidecars (and engines) into
//! one prefix index.
//!
//! - **Sidecar side.** A [`Hub`] holds every prefix the replica holds (fingerprint keys, token
//!   counts, tiers, adapters, DP ranks), the epoch, and a bounded ring of encoded changes;
//!   [`serve`] serves `kvevent.feed.v1.Feed/Follow` (the proto is `proto/kvevent/feed/v1`). A
//!   follower gets a `Hello`, a snapshot (or, resuming from a position the ring still holds,
//!   only what it missed), then live changes and heartbeats. A change is encoded once for all
//!   followers. A new epoch (an engine restart or clear, a gap not repaired, a sidecar restart)
//!   sends every follower a new snapshot.
//! - **Router side.** A [`Fleet`] follows replicas by name, each from a sidecar's feed or from
//!   its engine's sockets, into one [`kvevent_index::Index`]. A replica's snapshot loads beside
//!   its previous state and replaces it in one step. Each replica is [`ReplicaState::Exact`],
//!   [`ReplicaState::Degraded`] or [`ReplicaState::Stale`], set by the library from its source;
//!   a replica lost for `drop_after` stops counting.
//!
//! This crate holds the feed's tokio runtime, gRPC client and server: the index, mapper,
//! source and transport crates stay free of them.

pub mod fleet;
pub mod hub;
pub mod server;

/// The `kvevent.feed.v1` messages and client.
#[allow(missing_docs, unreachable_pub, reason = "generated code")]
#[allow(clippy::doc_lazy_continuation, reason = "generated code")]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/kvevent.feed.v1.rs"));
}

pub use fleet::{
    Degraded, EngineSockets, Fleet, FleetConfig, FleetError, FleetScore, ReplicaSource,
    ReplicaState, ReplicaStatus, ScoreError, SidecarFeed,
};
pub use hub::{Hub, HubConfig, HubMetrics};
pub use kvevent_index::{Config as IndexConfig, IndexStats, KeyMode, Query, QueryKeys, Tier};
pub use kvevent_wire::Engine;
pub use server::{ServeError, ServeOptions, TokenSource, serve};
pub use tonic::transport::ClientTlsConfig;
