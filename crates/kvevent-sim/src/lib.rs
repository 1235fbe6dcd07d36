#![doc = include_str!("../README.md")]

mod engine;
mod pool;
pub mod workload;

pub use engine::{Config, Engine, Lora, Progress, Request, Step, TimeModel, generated_tokens};
pub use pool::Event;
