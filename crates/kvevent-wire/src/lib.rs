//! Decoder and encoder for vLLM's (and SGLang's) KV-cache event wire format.
//!
//! vLLM engines publish KV-cache events over ZeroMQ: three frames `[topic, seq, payload]`,
//! the payload one msgpack `EventBatch`. This crate reads and writes those payloads for every
//! release from 0.9.0 on — batches as arrays (2 or 3 elements) or maps, events as tagged
//! positional arrays (≤ 0.23) or tagged maps (≥ 0.24), block hashes as signed or unsigned
//! integers of any width or raw digests — and parses the ZMQ framing of live messages and
//! replay replies ([`frames`]).
//!
//! - [`decode`] borrows from the payload: block-hash digests and strings are slices of it, and
//!   token ids stay msgpack bytes until iterated ([`TokenIds::iter`]).
//! - [`encode`] writes the exact bytes a given [`Release`] sends, so tests, tools and a fake
//!   engine can speak any release.
//! - SGLang's wire (0.4.6.post5 to 0.5.23) by [`Engine`]: [`decode_engine`] reads what only
//!   SGLang sends (a salted store's `cache_salt`, EAGLE token pairs), [`encode_sglang`] writes
//!   each [`SglangRelease`]'s bytes.
//! - A newer vLLM must never break decoding: unknown event tags are skipped and counted
//!   ([`EventBatch::unknown_events`]), unknown map keys and extra array elements ignored.
//! - Hostile input returns an [`Error`] with an [`ErrorKind`] and the byte offset; it never
//!   panics, and [`Limits`] bound the work one payload can ask for.
//!
//! ```
//! use kvevent_wire::{Event, Release};
//!
//! // What vLLM 0.26 sends for one stored block (hash 7, 2 tokens of block size 2).
//! let payload = b"\x93\xcb\x40\x24\0\0\0\0\0\0\x91\x88\xa4type\xabBlockStored\
//!     \xacblock_hashes\x91\x07\xb1parent_block_hash\xc0\xa9token_ids\x92\x01\x02\
//!     \xaablock_size\x02\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\x00";
//! let batch = kvevent_wire::decode(payload)?;
//! let Event::BlockStored(stored) = &batch.events[0] else { unreachable!() };
//! assert_eq!(stored.token_ids.iter().collect::<Vec<_>>(), [1, 2]);
//! assert_eq!(batch.data_parallel_rank, Some(0));
//! assert_eq!(kvevent_wire::encode(&batch, "0.26.0".parse::<Release>()?)?, payload);
//! # Ok::<(), kvevent_wire::Error>(())
//! ```
//!
//! **Invariant:** no IO, no async runtime, no protobuf, no ZMQ. This crate must stay usable
//! from a plain synchronous offline tool; CI checks its dependency tree.
//!
//! Feature `json`: the normalized JSON form of a batch ([`json::to_json`],
//! [`json::from_json`]), as written in `testdata/vectors/README.md`.

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
