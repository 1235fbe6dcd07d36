//! Per-source state for vLLM (and SGLang) KV events, and the stream a router consumes. With
//! feature `metrics`, `collector` writes each source's counters as `/metrics` families.
//!
//! ZMQ PUB/SUB is at-most-once: batches are lost to slow joiners, HWM overflow and
//! reconnects, and a seq going backwards means a new engine process. This crate turns the raw
//! frames of [`kvevent_zmq`] into a trustworthy stream per source (endpoint and DP rank):
//!
//! - [`SourceState`] — a pure state machine: tracks the last seq, drops duplicates, replays
//!   from 0 at start (with a replay endpoint) or on a late join and from `last + 1` on a gap (holding live batches meanwhile and
//!   applying them after), and answers with a [`ResetReason`] whenever what is known became
//!   stale: first contact, engine restart (then rebuilds from the replay buffer), a gap or a
//!   truncated replay it cannot repair, a corrupt payload. Failed replays back off; live
//!   batches keep flowing.
//! - [`Subscriber`] — runs the transport and one state per source and yields [`Update`]s:
//!   batches in seq order (checked to decode; a corrupt one becomes a reset) and resets, or,
//!   through [`Subscriber::next_with`], the decoded batch itself so that it is decoded once.
//!   Sources are added and removed while the others run ([`Subscriber::add_source`],
//!   [`Subscriber::remove_source`]). It is the in-process API for a Rust router, independent of
//!   any gRPC forwarding. The thread calling `next` reads every source's sockets itself (no
//!   thread handoff a message).
//!
//! A consumer that saved its state resumes a source where it stopped ([`Resume`],
//! [`Config::resume`]): the replay starts at the saved last batch, which must come back with
//! the saved [`payload_digest`], else the source is reset and rebuilt. A reconnect is checked
//! the same way ([`SourceState::on_connected`]). Each source reads its engine's wire
//! ([`Config::engine`], [`Subscriber::add_source_of`]).
//!
//! Every decision is counted in [`SourceMetrics`]; a rank's health ([`RankHealth`]) is a
//! [`Health`] handle only its state machine writes ([`Subscriber::health`]). No tokio, tonic,
//! hyper or prost here.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvevent_source::{Config, Subscriber, Update};
//! use kvevent_zmq::publisher::{scripted_batch, Publisher, PublisherConfig};
//!
//! // An engine stand-in on loopback (PUB + replay ROUTER), as vLLM publishes.
//! let ctx = zmq::Context::new();
//! let engine = Publisher::start(&ctx, PublisherConfig::loopback(kvevent_wire::Release::NEWEST_KNOWN))?;
//! let source = kvevent_zmq::Source {
//!     endpoint: engine.endpoint().to_owned(),
//!     replay_endpoint: engine.replay_endpoint().map(str::to_owned),
//!     topic: b"kv-events".to_vec(),
//!     bind: false,
//!     dp_rank: 0,
//! };
//! let mut subscriber = Subscriber::start(&ctx, Config::new(vec![source]))?;
//! engine.wait_for_subscribers(1, Duration::from_secs(10));
//! engine.publish(&scripted_batch(0))?;
//!
//! // First a reset (forget whatever was known of this source), then its batches in order.
//! let deadline = Instant::now() + Duration::from_secs(10);
//! let batch = loop {
//!     match subscriber.next(Duration::from_millis(100)) {
//!         Some(Update::Batch(b)) => break b,
//!         Some(Update::Reset { source, reason }) => println!("reset {source}: {}", reason.as_str()),
//!         None => assert!(Instant::now() < deadline, "no batch"),
//!     }
//! };
//! assert_eq!(batch.seq, 0);
//! assert_eq!(batch.decode()?.events.len(), 1);
//! subscriber.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

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
