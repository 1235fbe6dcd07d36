//! The scraper on the shared fixtures and against a real hyper server on loopback.

mod fixtures;
mod http;
