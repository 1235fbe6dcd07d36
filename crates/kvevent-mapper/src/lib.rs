//! Maps decoded vLLM (and SGLang) KV events onto the InferenceCache contract.
//!
//! One [`Mapper`] per engine source (endpoint and DP rank) turns each
//! [`EventBatch`](wire::EventBatch) into [`Report`](pb::Report)s:
//!
//! | engine event | report |
//! |---|---|
//! | BlockStored | one `CacheStateUpdate`, one `PrefixEntry` per block (cumulative `token_count`, tier from the medium) |
//! | BlockRemoved | one `PREFIX_EVICTED` per hash, or a T2 re-report when the engine has an offload tier |
//! | AllBlocksCleared, [`Mapper::reset`] | one `ALL_CLEARED` |
//! | AllBlocksCleared with a medium (one tier cleared) | what a removal of each block held there gives: `PREFIX_EVICTED`, or a re-report at the tier still holding it; the other tier's prefixes stay |
//!
//! The key of a prefix depends on the [`KeyMode`]: the engine's block hash (an int as 8 bytes
//! big-endian, bytes as they are) or the content fingerprint of its token ids
//! (`kvevent-fingerprint`). Both modes share one bounded per-source map, engine block hash →
//! (key, cumulative token count, adapter, tiers), which continues counts and chains across
//! events, resolves removals to the key they were reported under, and is emptied by clears.
//!
//! The first report of a block goes as [`Report::New`](pb::Report::New) (the server cannot hold
//! it yet), a re-report as `Report::Update`; [`Mapper::refresh`] re-reports every resident block
//! within one interval of its last report, spread evenly, so the server's TTL never expires what
//! the engine holds. [`Mapper::save`] / [`Mapper::restore`] carry the tracked blocks across a
//! restart of the process (versioned bytes; other options or a damaged copy are refused).
//!
//! SGLang's stores (decoded with `kvevent_wire::decode_engine`): EAGLE token pairs are keyed as
//! the tokens they stand for, a salted store under the adapter [`salted_adapter`], a page
//! shorter than the source's page size over its own tokens (counted).
//!
//! [`Mapper::map_batch_into`] hands the same keys, counts, tiers and adapters to any [`Sink`]
//! with no message made (the router's index writes them straight in); `map_batch` is its
//! report sink.
//!
//! Pure: no IO, no async runtime, no gRPC (only the prost messages). What the mapper drops or
//! cannot key is counted in [`MapperStats`], never guessed.
//!
//! ```
//! use kvevent_mapper::{Identity, KeyMode, Mapper, Options};
//! use kvevent_proto as pb;
//! use kvevent_wire as wire;
//!
//! let identity = Identity::new("pod-a", "llama", "", "vllm")?;
//! let mut mapper = Mapper::new(identity, Options { key_mode: KeyMode::Fingerprint, ..Options::default() });
//! // Two blocks of 16 tokens stored on the GPU, as the engine reports them.
//! let batch = wire::EventBatch {
//!     ts: 1_700_000_000.0,
//!     events: vec![wire::Event::BlockStored(wire::BlockStored {
//!         block_hashes: vec![wire::BlockHash::Int(wire::Int::U64(11)), wire::BlockHash::Int(wire::Int::U64(12))],
//!         token_ids: (0..32u32).collect::<Vec<_>>().into(),
//!         block_size: 16,
//!         medium: Some("GPU".into()),
//!         ..Default::default()
//!     })],
//!     data_parallel_rank: None,
//!     unknown_events: 0,
//! };
//! let mut reports = Vec::new();
//! mapper.map_batch(&batch, &mut reports);
//! // One update: two prefixes, keyed by their content fingerprints, with cumulative counts.
//! let update = reports[0].as_update().expect("an update");
//! let counts: Vec<i32> = update.prefixes.iter().map(|p| p.token_count).collect();
//! assert_eq!(counts, [16, 32]);
//! assert_eq!(update.prefixes[0].tier, pb::CacheTier::T1 as i32);
//! assert_eq!(mapper.tracked_blocks(), 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

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
