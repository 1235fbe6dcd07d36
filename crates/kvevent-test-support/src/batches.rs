//! `EventBatch` builders: a test says what an engine stored, removed or cleared, not the
//! struct's every field.

use kvevent_wire as wire;

/// An engine block hash.
pub fn hash(h: u64) -> wire::BlockHash<'static> {
    wire::BlockHash::Int(wire::Int::U64(h))
}

/// Blocks `hashes` stored, of `tokens` (`block_size` each), after `parent` (none: from the
/// prompt's start), on the GPU.
pub fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: impl IntoIterator<Item = u32>,
    block_size: u32,
) -> wire::Event<'static> {
    wire::Event::BlockStored(wire::BlockStored {
        block_hashes: hashes.iter().map(|h| hash(*h)).collect(),
        parent_block_hash: parent.map(hash),
        token_ids: tokens.into_iter().collect::<Vec<u32>>().into(),
        block_size,
        medium: Some("GPU".into()),
        ..Default::default()
    })
}

/// Blocks `hashes` removed.
pub fn removed(hashes: &[u64]) -> wire::Event<'static> {
    wire::Event::BlockRemoved(wire::BlockRemoved {
        block_hashes: hashes.iter().map(|h| hash(*h)).collect(),
        ..Default::default()
    })
}

/// Every block cleared.
pub fn cleared() -> wire::Event<'static> {
    wire::Event::AllBlocksCleared(Default::default())
}

/// A batch of `events` at time `ts`, no DP rank.
pub fn batch(ts: f64, events: Vec<wire::Event<'static>>) -> wire::EventBatch<'static> {
    wire::EventBatch::new(ts, events)
}
