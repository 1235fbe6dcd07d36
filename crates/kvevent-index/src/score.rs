//! Scoring: a query's blocks looked up a chunk at a time (their cache misses overlapped), the
//! sources still matching intersected block by block, the best source per replica, the answer
//! sorted ([`Scores`]).
//!
//! Invariants: a replica's match runs from block 0 on and stops at its first miss; only holders
//! that count are matched; the answer is best first (most tokens, most blocks, T1 before T2,
//! then by name) and shares the index's list of names.

use super::*;

/// One replica's match, as `LookupRouteResponse.replica_scores` means it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Score<'a> {
    /// The replica's name.
    pub replica: &'a str,
    /// Blocks of the query present from block 0 on (on one of the replica's sources).
    pub matched_blocks: u32,
    /// Tokens those blocks cover (the last matched block's cumulative count).
    pub matched_tokens: u32,
    /// T2 when any matched block is only in the offload tier.
    pub tier: Tier,
    /// How far the replica's entries can be trusted ([`ReplicaState`]): route on
    /// [`ReplicaState::Exact`], fail open otherwise.
    pub state: ReplicaState,
}

/// The answer to a query: a [`Score`] per replica holding block 0 of the query (with
/// [`Index::score_among`], per candidate the index knows, matching or not), best first (most
/// tokens, most blocks, T1 before T2, then by name). It shares the index's list of names: one
/// reference taken per answer, not one per replica.
#[derive(Debug, Clone, Default)]
pub struct Scores {
    names: Arc<Vec<Arc<str>>>,
    entries: Vec<Answer>,
    /// With [`Index::score_among`]: the positions of the candidates the index does not know.
    unknown: Vec<usize>,
}

/// One replica's match, named by number.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Answer {
    pub(crate) replica: u32,
    pub(crate) blocks: u32,
    pub(crate) tokens: u32,
    pub(crate) tier: Tier,
    pub(crate) state: ReplicaState,
}

impl Scores {
    /// Replicas in the answer.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no replica holds block 0 of the query.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `i`-th best.
    pub fn get(&self, i: usize) -> Option<Score<'_>> {
        self.entries.get(i).map(|e| self.score(e))
    }

    /// The best, if any.
    pub fn first(&self) -> Option<Score<'_>> {
        self.get(0)
    }

    /// Best first.
    pub fn iter(&self) -> ScoresIter<'_> {
        ScoresIter {
            scores: self,
            entries: self.entries.iter(),
        }
    }

    /// With [`Index::score_among`]: the positions, in the candidates asked about, of those the
    /// index does not know (no source of theirs is followed, and nobody set their state). They
    /// are in no [`Score`]. Empty for [`Index::score`].
    pub fn unknown(&self) -> &[usize] {
        &self.unknown
    }

    pub(crate) fn score(&self, e: &Answer) -> Score<'_> {
        Score {
            replica: &self.names[e.replica as usize],
            matched_blocks: e.blocks,
            matched_tokens: e.tokens,
            tier: e.tier,
            state: e.state,
        }
    }
}

impl<'a> IntoIterator for &'a Scores {
    type Item = Score<'a>;
    type IntoIter = ScoresIter<'a>;

    fn into_iter(self) -> ScoresIter<'a> {
        self.iter()
    }
}

/// The scores of an answer, best first ([`Scores::iter`]).
#[derive(Debug, Clone)]
pub struct ScoresIter<'a> {
    scores: &'a Scores,
    entries: std::slice::Iter<'a, Answer>,
}

impl<'a> Iterator for ScoresIter<'a> {
    type Item = Score<'a>;

    fn next(&mut self) -> Option<Score<'a>> {
        self.entries.next().map(|e| self.scores.score(e))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.entries.size_hint()
    }
}

impl ExactSizeIterator for ScoresIter<'_> {}

/// Query blocks looked up together: their keys are made (chained from token ids), then their
/// slots loaded at once so the cache misses overlap, then they are matched in order. A query
/// stops at its first miss, so the blocks after it are never hashed.
pub(crate) const SCORE_CHUNK: usize = 16;

/// The buffers a scoring thread reuses from query to query (the answer's own list is the only
/// allocation of a query). Each holds what the largest query and fleet it served needed.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    /// A chunk's prefix keys.
    pub(crate) keys: Vec<u64>,
    /// The sources matching every block so far.
    pub(crate) alive: Vec<Holder>,
    /// (source, blocks, tokens, tier) of the sources whose match ended.
    pub(crate) done: Vec<(u32, u32, u32, u8)>,
    /// Per replica, its best source's (blocks, tokens, tier).
    pub(crate) best: Vec<Option<(u32, u32, u8)>>,
    /// (sort key, replica) of the replicas in the answer.
    pub(crate) order: Vec<(u64, u32)>,
    /// Per replica, whether it is among the candidates asked about.
    pub(crate) asked: Vec<bool>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

impl QueryKeys<'_> {
    /// Replaces `out` with the keys of blocks `from..from + SCORE_CHUNK` (fewer at the end);
    /// `parent` is the prefix key of block `from - 1`.
    pub(crate) fn chunk(&self, from: usize, parent: Option<u64>, out: &mut Vec<u64>) {
        out.clear();
        match *self {
            QueryKeys::Keys(keys) => {
                out.extend(keys.iter().skip(from).take(SCORE_CHUNK));
            }
            QueryKeys::Tokens { ids, block_size } => {
                let start = (from * block_size).min(ids.len());
                let end = ((from + SCORE_CHUNK) * block_size).min(ids.len());
                kvevent_fingerprint::prefixes_into(&ids[start..end], block_size, parent, out);
            }
        }
    }
}

impl Inner {
    pub(crate) fn score(
        &self,
        query: &QueryKeys<'_>,
        adapter: &str,
        candidates: Option<&[&str]>,
    ) -> Scores {
        SCRATCH.with(|scratch| {
            let scratch = &mut *scratch.borrow_mut();
            scratch.best.clear();
            scratch.best.resize(self.replicas.len(), None);
            let adapter = self.adapters.get(adapter);
            if let Some(&adapter) = adapter
                && !matches!(query, QueryKeys::Tokens { block_size: 0, .. })
            {
                self.match_blocks(query, adapter, scratch);
            }
            self.answer(candidates, scratch)
        })
    }

    /// Per replica in `scratch.best`, its best source's match of the query.
    pub(crate) fn match_blocks(&self, query: &QueryKeys<'_>, adapter: u32, scratch: &mut Scratch) {
        let Scratch {
            keys,
            alive,
            done,
            best,
            ..
        } = scratch;
        // Sources still matching, sorted by source, each with its worst tier so far. They all
        // matched the same blocks so far (`matched`, covering `tokens`); one that drops out goes
        // to `done` with them. Validity is checked at block 0; later blocks need the same epoch.
        alive.clear();
        done.clear();
        let (mut matched, mut tokens) = (0u32, 0u32);
        // The blocks are looked up one after another until one misses, `SCORE_CHUNK` at a
        // time: each chunk's slots are loaded first, so their cache misses overlap.
        for i in 0.. {
            if i % SCORE_CHUNK == 0 {
                let parent = if i == 0 { None } else { keys.last().copied() };
                query.chunk(i, parent, keys);
                for k in keys.iter() {
                    let key = KeyId::new(*k, adapter);
                    self.young.prefetch(&key);
                    self.old.prefetch(&key);
                }
                for k in keys.iter() {
                    let key = KeyId::new(*k, adapter);
                    self.young.prefetch_slot(&key);
                    self.old.prefetch_slot(&key);
                }
            }
            let Some(k) = keys.get(i % SCORE_CHUNK) else {
                break;
            };
            let Some(entry) = self.lookup(&KeyId::new(*k, adapter)) else {
                break;
            };
            let view = { entry.holders }.view(&self.lists);
            let holders = view.as_slice();
            if i == 0 {
                alive.extend(holders.iter().filter(|h| counts(&self.sources, h)));
            } else {
                // Merge the two sorted lists in place: who holds block i too goes on, with the
                // worse tier (the larger word: same source and epoch). The blocks of a shared
                // prompt mostly have the same holders, tiers included, so runs of eight equal
                // words are taken whole (compared with no branch but one a run of eight) and
                // only the words around a difference are merged one by one.
                let (mut r, mut j, mut kept) = (0, 0, 0);
                while r < alive.len() {
                    let run = alive[r..]
                        .chunks_exact(8)
                        .zip(holders[j..].chunks_exact(8))
                        .take_while(|(a, h)| {
                            a.iter().zip(*h).fold(0, |d, (a, h)| d | (a.0 ^ h.0)) == 0
                        })
                        .count()
                        * 8;
                    if kept != r {
                        alive.copy_within(r..r + run, kept);
                    }
                    (r, j, kept) = (r + run, j + run, kept + run);
                    let Some(&a) = alive.get(r) else { break };
                    while holders.get(j).is_some_and(|h| h.source() < a.source()) {
                        j += 1;
                    }
                    match holders.get(j) {
                        Some(&h) if h.same_id(a) => {
                            alive[kept] = a.max(h);
                            kept += 1;
                            j += 1;
                        }
                        _ => done.push((a.source(), matched, tokens, a.tier())),
                    }
                    r += 1;
                }
                alive.truncate(kept);
            }
            if alive.is_empty() {
                break;
            }
            matched += 1;
            tokens = entry.tokens;
        }
        done.extend(
            alive
                .iter()
                .map(|a| (a.source(), matched, tokens, a.tier())),
        );
        // Per replica, its best source.
        for &(source, blocks, tokens, tier) in done.iter() {
            let replica = self.sources[source as usize].replica as usize;
            let candidate = (blocks, tokens, tier);
            let better = |b: &(u32, u32, u8)| {
                (blocks, tokens, std::cmp::Reverse(tier)) > (b.0, b.1, std::cmp::Reverse(b.2))
            };
            if best[replica].as_ref().is_none_or(better) {
                best[replica] = Some(candidate);
            }
        }
    }

    /// The answer from `scratch.best`: the replicas matching block 0, or every candidate
    /// known (matching or not) and the positions of those unknown.
    pub(crate) fn answer(&self, candidates: Option<&[&str]>, scratch: &mut Scratch) -> Scores {
        let Scratch {
            best, order, asked, ..
        } = scratch;
        let mut unknown = Vec::new();
        if let Some(candidates) = candidates {
            asked.clear();
            asked.resize(self.replicas.len(), false);
            for (i, name) in candidates.iter().enumerate() {
                match self.replica_ids.get(*name) {
                    Some(&id) => {
                        asked[id as usize] = true;
                        best[id as usize].get_or_insert((0, 0, 0));
                    }
                    None => unknown.push(i),
                }
            }
        }
        // Best first: most tokens, most blocks, T1 before T2, then by name. The replicas are
        // taken in name order and sorted stably by the rest as one number: many tie on a
        // shared prompt, and sorting runs of equal keys is cheap.
        order.clear();
        order.extend(self.by_name.iter().filter_map(|&replica| {
            if candidates.is_some() && !asked[replica as usize] {
                return None;
            }
            let (blocks, tokens, tier) = best[replica as usize]?;
            // A query of 2^31 blocks or more is not a real one: such counts tie.
            let blocks = u64::from(blocks.min(u32::MAX >> 1));
            let key = (u64::from(!tokens) << 32) | ((!blocks & 0x7fff_ffff) << 1) | u64::from(tier);
            Some((key, replica))
        }));
        order.sort_by_key(|&(key, _)| key);
        let mut entries = Vec::with_capacity(order.len());
        entries.extend(order.iter().map(|&(_, replica)| {
            let (blocks, tokens, tier) = best[replica as usize].unwrap_or_default();
            let tier = if tier == 0 { Tier::T1 } else { Tier::T2 };
            let slot = &self.replica_slots[replica as usize];
            Answer {
                replica,
                blocks,
                tokens,
                tier,
                state: slot.state(),
            }
        }));
        Scores {
            names: self.replicas.clone(),
            entries,
            unknown,
        }
    }
}
