//! The fleet against real peers on loopback: the sidecar's hub behind the real feed server,
//! and engine stand-ins on real ZeroMQ sockets.

mod discover;
mod feed;
mod feed_states;
mod flags;
mod kube;
mod kube_api;
