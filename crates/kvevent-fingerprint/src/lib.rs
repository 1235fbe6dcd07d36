#![doc = include_str!("../README.md")]

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed every party uses.
pub const SEED: u64 = 1337;

/// The fingerprints of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Block {
    /// XXH3 of the block's own tokens.
    pub content: u64,
    /// The fingerprint of the whole prefix up to and including this block.
    pub prefix: u64,
}

/// The fingerprint of one block's tokens.
pub fn content(tokens: &[u32]) -> u64 {
    // Blocks are small (16–256 tokens): a stack buffer avoids allocating per block, and one
    // sized to the common block of 16 is not cleared a kilobyte at a time.
    fn hash<const N: usize>(tokens: &[u32]) -> u64 {
        let mut buf = [0u8; N];
        for (dst, t) in buf.chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..4 * tokens.len()], SEED)
    }
    if tokens.len() <= 16 {
        hash::<{ 4 * 16 }>(tokens)
    } else if tokens.len() <= 256 {
        hash::<{ 4 * 256 }>(tokens)
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, SEED)
    }
}

/// The prefix fingerprint of a block whose content is `content`, after `parent` (if any).
pub fn extend(parent: Option<u64>, content: u64) -> u64 {
    match parent {
        None => content,
        Some(p) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&p.to_le_bytes());
            buf[8..].copy_from_slice(&content.to_le_bytes());
            xxh3_64_with_seed(&buf, SEED)
        }
    }
}

/// The chain of full blocks in `tokens`, continuing from `parent` (the prefix fingerprint of
/// the block before the first one), or starting at position 0 when `parent` is `None`.
/// Tokens after the last full block are ignored; `block_size` 0 yields no blocks.
pub fn chain(tokens: &[u32], block_size: usize, parent: Option<u64>) -> Vec<Block> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut prev = parent;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let content = content(block);
            let prefix = extend(prev, content);
            prev = Some(prefix);
            Block { content, prefix }
        })
        .collect()
}

/// [`chain`]'s prefix fingerprints only, appended to `out` (which keeps its capacity from call
/// to call: no allocation per batch).
pub fn prefixes_into(tokens: &[u32], block_size: usize, parent: Option<u64>, out: &mut Vec<u64>) {
    if block_size == 0 {
        return;
    }
    let mut prev = parent;
    out.extend(tokens.chunks_exact(block_size).map(|block| {
        let prefix = extend(prev, content(block));
        prev = Some(prefix);
        prefix
    }));
}

/// A prefix fingerprint as the contract carries it: 8 bytes big-endian.
pub fn wire_key(prefix: u64) -> [u8; 8] {
    prefix.to_be_bytes()
}
