#![doc = include_str!("../README.md")]

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
