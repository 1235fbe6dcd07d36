#![doc = include_str!("../README.md")]

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
