#![doc = include_str!("../README.md")]

use std::collections::HashMap;
use std::sync::Arc;

use kvevent_fingerprint as fingerprint;
use kvevent_proto as pb;
use kvevent_wire as wire;

mod blocks;
mod checkpoint;
mod identity;
mod mapper;

pub use checkpoint::{FORMAT as CHECKPOINT_FORMAT, RestoreError};
pub use identity::{Identity, parse_lora_adapters};
pub use mapper::{Mapper, MapperStats, Sink, salted_adapter, timestamp_us};

/// What went wrong building a mapper.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A required identity field is empty.
    #[error("{0} is required and must not be empty")]
    MissingIdentity(&'static str),
    /// A `--lora-adapter-names` entry is not `id=name`.
    #[error(
        "bad LoRA adapter entry `{0}`: expected id=name with an integer id and a non-empty name"
    )]
    BadLoraEntry(String),
    /// The same LoRA id is named twice.
    #[error("LoRA id {0} is named twice")]
    DuplicateLoraId(i64),
}

/// Which key a prefix is reported under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyMode {
    /// The engine's block hash (int → 8 bytes big-endian; bytes pass through).
    #[default]
    Engine,
    /// The positional content fingerprint of the block's token ids (XXH3-64, seed 1337).
    Fingerprint,
}

/// The default bound of tracked blocks per source: 917,504 (2^20 × 7/8, the most the
/// power-of-two table of earlier versions held), about 27 MB full (29.7 bytes a block). It is
/// well above the ~500k blocks of an 80 GB GPU serving an 8B model.
pub const DEFAULT_MAX_TRACKED_BLOCKS: usize = (1 << 20) / 8 * 7;

/// How events are mapped.
#[derive(Debug, Clone)]
pub struct Options {
    /// Which key prefixes are reported under.
    pub key_mode: KeyMode,
    /// The engine has an offload tier that keeps blocks evicted from the GPU: a GPU removal
    /// re-reports the prefix at T2 instead of evicting it.
    pub engine_has_offload_tier: bool,
    /// Adapter names for `lora_id`s, for releases before 0.14 (no `lora_name`).
    pub lora_adapters: HashMap<i64, Arc<str>>,
    /// Most engine blocks tracked per source; inserts beyond are refused and counted.
    pub max_tracked_blocks: usize,
    /// Report blocks of every KV-cache group of a hybrid model. By default only full-attention
    /// groups are (`kv_cache_spec_kind` `full_attention`, `mla_attention`, or none given): a
    /// sliding-window, chunked-local or mamba group's block is not a reusable prefix on its own.
    pub all_kv_groups: bool,
    /// In engine key mode, keep each block's fingerprint too (its slot is there in either mode:
    /// the cost is hashing each stored block's tokens), so that
    /// [`Mapper::map_batch_with_fingerprints`] makes both keys' reports in one pass (the
    /// sidecar's router feed beside engine-keyed reports). Fingerprint mode keeps them anyway.
    pub fingerprints_too: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            key_mode: KeyMode::Engine,
            engine_has_offload_tier: false,
            lora_adapters: HashMap::new(),
            max_tracked_blocks: DEFAULT_MAX_TRACKED_BLOCKS,
            all_kv_groups: false,
            fingerprints_too: false,
        }
    }
}

/// Whether blocks of a KV-cache group of this kind are reusable prefixes: full attention
/// (`full_attention`, `mla_attention`) or no kind given (not a hybrid model, or before 0.22).
pub fn is_prefix_group(kind: Option<&str>) -> bool {
    matches!(kind, None | Some("full_attention" | "mla_attention"))
}

/// Where a block (or a matched prefix) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// In the engine's GPU memory.
    T1,
    /// In an offload tier the engine can reload from.
    T2,
}

impl From<Tier> for pb::CacheTier {
    fn from(tier: Tier) -> Self {
        match tier {
            Tier::T1 => pb::CacheTier::T1,
            Tier::T2 => pb::CacheTier::T2,
        }
    }
}

/// The tier a medium maps to: GPU (or no medium, before 0.10.2) → T1, anything else → T2.
pub fn tier_of(medium: Option<&wire::Medium<'_>>) -> Tier {
    match medium.map(wire::Medium::kind) {
        None | Some(wire::MediumKind::Gpu) => Tier::T1,
        Some(_) => Tier::T2,
    }
}

/// The engine-mode key of a block hash.
pub fn engine_key(hash: &wire::BlockHash<'_>) -> Vec<u8> {
    hash.to_bytes().into_owned()
}

/// The fingerprint-mode key of a prefix fingerprint.
pub fn fingerprint_key(prefix: u64) -> Vec<u8> {
    fingerprint::wire_key(prefix).to_vec()
}
