//! ZeroMQ transport for vLLM KV events.
//!
//! - [`Transport`] subscribes to one or more engine sources (an endpoint and DP rank each):
//!   a SUB socket per source — connecting to the engine's PUB, or binding for engines
//!   configured with a non-wildcard endpoint ([`Source::bind`]) — and, when the engine has a
//!   replay endpoint, a DEALER speaking vLLM's ROUTER replay protocol. It hands out raw frames
//!   with the source's index ([`Frames`]) and never decodes payloads. The sockets are read
//!   by the caller's thread ([`Transport::poll`]: one `zmq_poll` over every source's
//!   descriptors, no thread and no handoff between threads; a source thread each was measured
//!   and dropped, `docs/decisions/0002-reading-the-engine.md`). Sources are added and removed
//!   while the others run ([`Transport::add`], [`Transport::remove`]). TCP sources beyond 200
//!   a context get contexts of their own (a libzmq context holds 1,023 sockets).
//! - [`EngineSockets`] is how to reach an engine (endpoints, ranks, topic, wire, HTTP server),
//!   with a text form; [`EngineSockets::sources`] makes every rank's source by vLLM's
//!   data-parallel port-offset rule ([`dp_endpoint`], [`dp_sources`]), refusing ranks whose
//!   endpoints collide.
//! - [`publisher::Publisher`] is the other side: a publisher that behaves as vLLM's does (PUB
//!   `[topic, seq, payload]`, a bounded ROUTER replay buffer, either reply format, restarts,
//!   injected gaps), for tests, demos and `kvevents publish`.
//!
//! libzmq is blocking: sockets are read by a thread of the caller's, never inside an async
//! runtime.
//! **Invariant:** no tokio, tonic, hyper or prost here.
//!
//! libzmq 4.3 is built from source by `zmq-sys` and linked statically (LGPL-3.0 with a
//! static-linking exception).
//!
//! ```
//! use std::time::Duration;
//! use kvevent_zmq::{publisher::{Publisher, PublisherConfig}, Delivery, Source, SourceOptions, Transport};
//!
//! let ctx = zmq::Context::new();
//! let engine = Publisher::start(&ctx, PublisherConfig::loopback(kvevent_wire::Release::NEWEST_KNOWN))?;
//! let source = Source {
//!     endpoint: engine.endpoint().to_owned(),
//!     replay_endpoint: None,
//!     topic: b"kv-events".to_vec(),
//!     bind: false,
//!     dp_rank: 0,
//! };
//! // Raw frames from every source, read by this thread while it polls.
//! let mut transport = Transport::start(&ctx, &[source], &SourceOptions::default())?;
//! let mut got = std::collections::VecDeque::new();
//! let deadline = std::time::Instant::now() + Duration::from_secs(10);
//! let mut published = false;
//! let frames = loop {
//!     assert!(std::time::Instant::now() < deadline, "nothing arrived");
//!     transport.poll(Duration::from_millis(100), &mut got);
//!     // The subscription reaches the engine once this thread has used the socket.
//!     if !published && engine.wait_for_subscribers(1, Duration::ZERO) {
//!         engine.publish_payload(b"\x90".to_vec());
//!         published = true;
//!     }
//!     if let Some(Delivery::Live(frames)) = got.pop_front().map(|f| f.delivery) {
//!         break frames;
//!     }
//! };
//! let live = kvevent_wire::frames::parse_live(&frames)?;
//! assert_eq!((live.seq, live.payload), (0, &b"\x90"[..]));
//! transport.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod options;
pub mod publisher;
mod spec;
mod transport;

pub use options::{Source, SourceOptions, check_endpoint, dp_endpoint, dp_sources};
pub use spec::EngineSockets;
pub use transport::{Delivery, Frames, ReplayOutcome, Transport, Waker};

/// What went wrong setting up sockets.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A socket could not be created, configured, bound or connected.
    #[error("{action} {endpoint}")]
    Socket {
        /// What was being done (`connect`, `bind`, `configure`).
        action: &'static str,
        /// The endpoint involved.
        endpoint: String,
        /// libzmq's error.
        #[source]
        source: zmq::Error,
    },
    /// Not an endpoint ([`check_endpoint`]).
    #[error("{why}")]
    Endpoint {
        /// The endpoint given.
        endpoint: String,
        /// What is wrong with it.
        why: String,
    },
    /// An endpoint that vLLM's port-offset rule cannot derive a DP rank's endpoint from.
    #[error("cannot derive the endpoint of DP rank {rank} from `{endpoint}`: {why}")]
    DpEndpoint {
        /// The base endpoint.
        endpoint: String,
        /// The rank asked for.
        rank: u32,
        /// Why not.
        why: &'static str,
    },
    /// Two DP ranks' endpoints derived from the base endpoints are the same (adjacent base
    /// ports: rank 1's events port is rank 0's replay port).
    #[error(
        "{}",
        options::collision(.endpoint, *.rank, *.replay, *.other_rank, *.other_replay, *.dp_size)
    )]
    DpCollision {
        /// The endpoint both are.
        endpoint: String,
        /// The later one's rank (events endpoints come before replay endpoints).
        rank: u32,
        /// The later one is a replay endpoint.
        replay: bool,
        /// The earlier one's rank.
        other_rank: u32,
        /// The earlier one is a replay endpoint.
        other_replay: bool,
        /// The ranks asked for.
        dp_size: u32,
    },
    /// A thread could not be started.
    #[error("spawn thread")]
    Spawn(#[source] std::io::Error),
    /// The pipe that wakes a poll could not be made.
    #[error("cannot make the poll's waker")]
    Waker(#[source] std::io::Error),
    /// The transport has shut down: no source can be added.
    #[error("the transport has shut down")]
    Stopped,
}
