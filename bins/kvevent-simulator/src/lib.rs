#![doc = include_str!("../README.md")]

pub mod client;
pub mod host;

pub use host::{Serving, SimEngine};
