//! Examples live in `examples/*.rs`: `cargo run -p kvevent-examples --example router_view`, and
//! `cargo run --release -p kvevent-examples --example router -- --listen 127.0.0.1:8080 --model M
//! --block-size 16 --engine NAME=tcp://host:port[,replay=tcp://host:port][,dp=N]`.
//!
//! [`router`] is the example router's service, a library so tests can start it in-process
//! (`proxy.rs`: its routing of `POST /v1/completions`).

mod proxy;
pub mod router;

/// The README's embedding snippet, compiled and run as a doctest (`cargo test --doc -p
/// kvevent-examples`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
