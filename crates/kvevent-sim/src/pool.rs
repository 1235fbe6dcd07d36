//! vLLM's prefix-cache block pool (v1 `BlockPool`, as of 0.32), for one full-attention group:
//! block 0 is the null block; the free blocks wait in a queue that is also the eviction order
//! (LRU: taken from the front, a freed cached block goes to the back, a freed block that was
//! never cached to the front); a block taken from the queue that still holds a cached prefix is
//! evicted (one [`Event::Removed`] per hash); a hit on a free cached block takes it out of the
//! queue. A hash may be held by several blocks at once (a prompt whose last block was
//! recomputed); a lookup finds the one cached first.
//!
//! Invariants: a block is in the free queue exactly when its reference count is 0; the free
//! count is the queue's length; a block's hash is in the map under that block.

use std::collections::HashMap;

/// What the pool did, in the order it did it: what vLLM's `kv_event_queue` holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Full blocks newly cached: their chained hashes, the hash of the block before the first
    /// (`None` from token 0), and their tokens.
    Stored {
        /// One hash per block.
        hashes: Vec<u64>,
        /// The block before the first one's hash.
        parent: Option<u64>,
        /// The blocks' tokens, concatenated.
        tokens: Vec<u32>,
        /// The LoRA adapter they were computed with.
        lora: Option<crate::Lora>,
    },
    /// A cached block was taken for other tokens.
    Removed {
        /// Its hash.
        hash: u64,
    },
}

const NONE: u32 = u32::MAX;

/// The pool: `blocks` blocks of which block 0 is never handed out.
#[derive(Debug)]
pub(crate) struct Pool {
    refs: Vec<u32>,
    hash: Vec<Option<u64>>,
    /// The free queue: a doubly linked list over block numbers, `head`..`tail`.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    free: usize,
    cached: HashMap<u64, Vec<u32>>,
    pub(crate) events: Vec<Event>,
}

impl Pool {
    pub(crate) fn new(blocks: usize) -> Self {
        assert!(blocks >= 2, "a pool needs the null block and one more");
        let n = blocks as u32;
        let mut pool = Self {
            refs: vec![0; blocks],
            hash: vec![None; blocks],
            prev: vec![NONE; blocks],
            next: vec![NONE; blocks],
            head: NONE,
            tail: NONE,
            free: 0,
            cached: HashMap::new(),
            events: Vec::new(),
        };
        // Block 0 is the null block: never in the queue.
        for b in 1..n {
            pool.push_back(b);
        }
        pool
    }

    /// Blocks a request may still take (free, cached or not).
    pub(crate) fn free(&self) -> usize {
        self.free
    }

    /// Used blocks over all but the null block: vLLM's `kv_cache_usage_perc`.
    pub(crate) fn usage(&self) -> f64 {
        let total = self.refs.len() - 1;
        1.0 - self.free as f64 / total as f64
    }

    pub(crate) fn refs(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }

    fn push_back(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NONE;
        match self.tail {
            NONE => self.head = b,
            t => self.next[t as usize] = b,
        }
        self.tail = b;
        self.free += 1;
    }

    fn push_front(&mut self, b: u32) {
        self.next[b as usize] = self.head;
        self.prev[b as usize] = NONE;
        match self.head {
            NONE => self.tail = b,
            h => self.prev[h as usize] = b,
        }
        self.head = b;
        self.free += 1;
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        match p {
            NONE => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NONE => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.prev[b as usize] = NONE;
        self.next[b as usize] = NONE;
        self.free -= 1;
    }

    /// The hashes cached, sorted, each once.
    pub(crate) fn cached_hashes(&self) -> Vec<u64> {
        let mut h: Vec<u64> = self.cached.keys().copied().collect();
        h.sort_unstable();
        h
    }

    /// The block caching `hash` (the first cached, when several do).
    pub(crate) fn lookup(&self, hash: u64) -> Option<u32> {
        self.cached.get(&hash).and_then(|b| b.first().copied())
    }

    /// A hit: each block is referenced once more, and a free one leaves the queue.
    pub(crate) fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if self.refs[b as usize] == 0 {
                self.unlink(b);
            }
            self.refs[b as usize] += 1;
        }
    }

    /// `n` blocks from the front of the queue, each evicting what it cached. The caller made
    /// sure there are `n`.
    pub(crate) fn take(&mut self, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.head;
            debug_assert_ne!(b, NONE, "the caller checked the free count");
            if b == NONE {
                break;
            }
            self.unlink(b);
            if let Some(h) = self.hash[b as usize].take() {
                if let Some(holders) = self.cached.get_mut(&h) {
                    holders.retain(|&x| x != b);
                    if holders.is_empty() {
                        self.cached.remove(&h);
                    }
                }
                self.events.push(Event::Removed { hash: h });
            }
            self.refs[b as usize] = 1;
            out.push(b);
        }
        out
    }

    /// Caches `blocks[from..to]` under `hashes[from..to]` (their tokens: `tokens`, the
    /// request's, from token 0): one [`Event::Stored`] for them, whether or not another block
    /// already caches a hash.
    pub(crate) fn cache(
        &mut self,
        blocks: &[u32],
        hashes: &[u64],
        tokens: &[u32],
        block_size: usize,
        (from, to): (usize, usize),
        lora: Option<&crate::Lora>,
    ) {
        if from >= to {
            return;
        }
        for i in from..to {
            let (b, h) = (blocks[i], hashes[i]);
            if self.hash[b as usize] == Some(h) {
                continue;
            }
            let holders = self.cached.entry(h).or_default();
            if holders.contains(&b) {
                continue;
            }
            holders.push(b);
            if self.hash[b as usize].is_none() {
                self.hash[b as usize] = Some(h);
            }
        }
        self.events.push(Event::Stored {
            hashes: hashes[from..to].to_vec(),
            parent: from.checked_sub(1).map(|p| hashes[p]),
            tokens: tokens[from * block_size..to * block_size].to_vec(),
            lora: lora.cloned(),
        });
    }

    /// A request's blocks, in its order, given back: the tail's first. A block no longer
    /// referenced goes to the back of the queue when it caches a prefix (evicted last, least
    /// recently used first), to the front when it does not (reused first).
    pub(crate) fn release(&mut self, blocks: &[u32]) {
        let mut first = Vec::new();
        let mut last = Vec::new();
        for &b in blocks.iter().rev() {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                if self.hash[b as usize].is_none() {
                    first.push(b);
                } else {
                    last.push(b);
                }
            }
        }
        for &b in first.iter().rev() {
            self.push_front(b);
        }
        for b in last {
            self.push_back(b);
        }
    }

    /// The free queue, front first (for tests).
    #[cfg(test)]
    pub(crate) fn queue(&self) -> Vec<u32> {
        let mut out = Vec::new();
        let mut b = self.head;
        while b != NONE {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_in_queue_order_and_freed_tail_first() {
        let mut pool = Pool::new(6);
        assert_eq!(pool.queue(), [1, 2, 3, 4, 5]);
        let a = pool.take(3);
        assert_eq!(a, [1, 2, 3]);
        // Blocks 1 and 2 cache a prefix; 3 is partly filled.
        pool.cache(&a, &[11, 12], &(0..8).collect::<Vec<_>>(), 4, (0, 2), None);
        pool.release(&a);
        // The uncached block goes to the front (reused first), the cached ones to the back,
        // the request's tail first.
        assert_eq!(pool.queue(), [3, 4, 5, 2, 1]);
        assert_eq!(pool.free(), 5);
        // A hit takes the cached block out of the queue.
        let hit = pool.lookup(11).expect("cached");
        pool.touch(&[hit]);
        assert_eq!(pool.queue(), [3, 4, 5, 2]);
        // Taking past the uncached blocks evicts the cached ones, front first.
        pool.events.clear();
        assert_eq!(pool.take(4), [3, 4, 5, 2]);
        assert_eq!(pool.events, [Event::Removed { hash: 12 }]);
        assert_eq!(pool.lookup(12), None);
        assert!((pool.usage() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_hash_cached_twice_is_removed_once_per_block() {
        let mut pool = Pool::new(4);
        let a = pool.take(1);
        pool.cache(&a, &[7], &[1, 2], 2, (0, 1), None);
        let b = pool.take(1);
        pool.cache(&b, &[7], &[1, 2], 2, (0, 1), None);
        assert_eq!(pool.lookup(7), Some(a[0]));
        pool.release(&a);
        pool.release(&b);
        pool.events.clear();
        pool.take(3);
        assert_eq!(
            pool.events,
            [Event::Removed { hash: 7 }, Event::Removed { hash: 7 }]
        );
    }
}
