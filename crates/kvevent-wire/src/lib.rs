#![doc = include_str!("../README.md")]

mod decode;
mod encode;
mod error;
pub mod frames;
#[cfg(feature = "json")]
pub mod json;
mod model;
mod msgpack;
mod release;

pub use decode::{Limits, decode, decode_engine, decode_with};
pub use encode::{encode, encode_into, encode_sglang};
pub use error::{Error, ErrorKind, Result};
pub use model::{
    AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, EventBatch, Int, Medium,
    MediumKind, TokenIds, TokenIter, Value,
};
pub use release::{Engine, Release, SglangRelease};
