//! The router feed: what a sidecar knows of its replica's KV cache, served to routers as a
//! snapshot then live changes, with its engine's health.
//!
//! - **The protocol** ([`pb`], always): `kvevent.feed.v1` (`proto/kvevent/feed/v1`), its
//!   messages and client. A router follows feeds with `kvevent-fleet`, which builds this crate
//!   without its `server` feature: no hub, no gRPC server.
//! - **Metrics** (feature `metrics`, with `server`): `metrics`, the hub's families for a
//!   `/metrics`, written where they are counted.
//! - **The sidecar's side** (feature `server`, default). A [`Hub`] holds every prefix the
//!   replica holds (fingerprint keys, token counts, tiers, adapters, DP ranks), the epoch, a
//!   bounded ring of encoded changes, and what the sidecar sees of its engine ([`RankHealth`],
//!   its load as [`RankLoad`]s); [`serve`] serves `Follow`. A follower gets a `Hello`, a snapshot (or, resuming from a
//!   position the ring still holds, only what it missed), then live changes and heartbeats,
//!   each heartbeat (and one sent at once when it changes) with the engine's health. A change
//!   is encoded once for all followers. A new epoch (an engine restart or clear, a gap not
//!   repaired, a sidecar restart) sends every follower a new snapshot.

#[cfg(feature = "server")]
pub mod hub;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(feature = "server")]
pub mod server;

/// The `kvevent.feed.v1` messages and client.
#[allow(missing_docs, unreachable_pub, reason = "generated code")]
#[allow(clippy::doc_lazy_continuation, reason = "generated code")]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/kvevent.feed.v1.rs"));
}

#[cfg(feature = "server")]
pub use hub::{Hub, HubConfig, HubMetrics, RankHealth, RankLoad};
#[cfg(feature = "server")]
pub use server::{ServeError, ServeOptions, TokenSource, serve};
