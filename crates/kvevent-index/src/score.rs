//! Scoring: a query's blocks looked up a chunk at a time (their cache misses overlapped), the
//! sources still matching intersected block by block, the best source per replica, the answer
//! sorted ([`Scores`]).
//!
//! Invariants: a replica's match runs from block 0 on and stops at its first miss; only holders
//! that count are matched; the answer is best first (most tokens, most blocks, T1 before T2,
//! then by name) and shares the index's list of names.

use super::*;

/// One replica's match, as `LookupRouteResponse.replica_scores` means it.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// What its engine was doing when last read, as its follower said ([`LoadReading`]; judge its
    /// age), if anything.
    pub load: Option<&'a LoadReading>,
}

/// The answer to a query: a [`Score`] per replica holding block 0 of the query (with
/// [`Index::score_among`], per candidate the index knows, matching or not), best first (most
/// tokens, most blocks, T1 before T2, then by name). It shares the index's list of names: one
/// reference taken per answer, not one per replica.
#[derive(Debug, Clone, Default)]
pub struct Scores {
    names: Arc<Vec<Arc<str>>>,
    states: Arc<Vec<ReplicaState>>,
    loads: Arc<Vec<Option<Arc<LoadReading>>>>,
    /// The replicas in it whose follower's lease had run out when it was made (mostly none).
    expired: Vec<u32>,
    /// ([`rank`], replica), best first.
    entries: Vec<(u64, u32)>,
    /// With [`Index::score_among`]: the positions of the candidates the index does not know.
    unknown: Vec<usize>,
    /// With [`Index::score_among`]: per candidate asked about, its place in `entries`
    /// (`u32::MAX`: unknown).
    by_candidate: Vec<u32>,
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

    /// With [`Index::score_among`]: the score of the `i`-th candidate asked about (`None`:
    /// unknown, or an answer of [`Index::score`]), without a search.
    pub fn of_candidate(&self, i: usize) -> Option<Score<'_>> {
        let slot = *self.by_candidate.get(i)?;
        self.entries.get(slot as usize).map(|e| self.score(e))
    }

    pub(crate) fn score(&self, &(order, replica): &(u64, u32)) -> Score<'_> {
        let (blocks, tokens, tier) = unrank(order);
        Score {
            replica: &self.names[replica as usize],
            matched_blocks: blocks,
            matched_tokens: tokens,
            tier,
            state: match self.states[replica as usize] {
                s if s.is_exact()
                    && !self.expired.is_empty()
                    && self.expired.contains(&replica) =>
                {
                    ReplicaState::Degraded(Degraded::LeaseExpired)
                }
                s => s,
            },
            load: self.loads[replica as usize].as_deref(),
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
    entries: std::slice::Iter<'a, (u64, u32)>,
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
    /// Per replica, its best source's match as a [`code`] (0: none).
    pub(crate) best: Vec<u32>,
    /// Per block of the query, as far as any source matched, the tokens up to its end.
    pub(crate) tokens: Vec<u32>,
    /// Per [`code`], how many replicas have it, then where its entries go next.
    pub(crate) at: Vec<usize>,
    /// Per [`code`], its [`rank`].
    pub(crate) ranks: Vec<u64>,
    /// The codes in the answer, best first.
    pub(crate) codes: Vec<(u64, usize)>,
    /// Per replica, whether it is among the candidates asked about.
    pub(crate) asked: Vec<bool>,
    /// Per replica, its place in the answer (`u32::MAX`: not in it).
    pub(crate) slot_of: Vec<u32>,
}

/// A source's match while a query is matched, as a small number, the better the larger: a
/// match of `blocks` at T1 is `2 × blocks + 2`, at T2 one less. Never 0 (no match). Within one
/// query it orders matches as [`rank`] does (the same blocks cover the same tokens), and the
/// answer is sorted by counting replicas under their codes.
fn code(blocks: u32, tier: u8) -> u32 {
    2 * blocks.min(u32::MAX >> 2) + 2 - u32::from(tier & 1)
}

/// A source's match as one number, the better the larger: most blocks, then most tokens, then
/// T1 over T2 (a replica's best source). Never 0 (a match of no block at T1, a candidate's, is
/// 1), so 0 is no match. A query of 2^31 blocks or more is not a real one: its count is taken
/// as 2^31 − 1.
pub(crate) fn rank(blocks: u32, tokens: u32, tier: u8) -> u64 {
    (u64::from(blocks.min(u32::MAX >> 1)) << 33) | (u64::from(tokens) << 1) | u64::from(tier == 0)
}

/// A [`rank`] in the answer's order, the better the larger: most tokens, then most blocks, then
/// T1 over T2.
fn answer_order(rank: u64) -> u64 {
    ((rank >> 1) << 32) | ((rank >> 33) << 1) | (rank & 1)
}

/// (blocks, tokens, tier) of a [`rank`].
fn unrank(r: u64) -> (u32, u32, Tier) {
    let tier = if r & 1 == 1 { Tier::T1 } else { Tier::T2 };
    ((r >> 33) as u32, (r >> 1) as u32, tier)
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
            scratch.best.resize(self.replicas.len(), 0);
            scratch.tokens.clear();
            let adapter = self.adapters.get(adapter);
            if let Some(&adapter) = adapter
                && !matches!(query, QueryKeys::Tokens { block_size: 0, .. })
            {
                self.match_blocks(query, adapter, scratch);
            }
            self.answer(candidates, scratch)
        })
    }

    /// Per replica in `scratch.best`, its best source's match of the query (a [`code`]), and
    /// in `scratch.tokens` the tokens each number of blocks matched covers.
    pub(crate) fn match_blocks(&self, query: &QueryKeys<'_>, adapter: u32, scratch: &mut Scratch) {
        let Scratch {
            keys,
            alive,
            best,
            tokens,
            ..
        } = scratch;
        // Sources still matching, sorted by source, each with its worst tier so far. They all
        // matched the same blocks so far (`matched`); one that drops out counts for its
        // replica with them. Validity is checked at block 0; later blocks need the same epoch.
        alive.clear();
        let mut matched = 0u32;
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
            let holders = entry.holders.view(&self.lists);
            if i == 0 {
                // Every holder written, the next one over it unless it counts: no branch.
                alive.resize(holders.len(), Holder(0));
                let (out, scoring) = (&mut alive[..], &self.scoring[..]);
                let mut n = 0;
                for &h in holders {
                    out[n] = h;
                    n += usize::from(counts(scoring, h));
                }
                alive.truncate(n);
            } else {
                self.intersect(alive, holders, best, code(matched, 0));
            }
            if alive.is_empty() {
                break;
            }
            matched += 1;
            tokens.push(entry.tokens);
        }
        for &a in alive.iter() {
            self.ended(a, code(matched, 0), best);
        }
    }

    /// Source `a`'s match ended at `so_far` (a [`code`] at T1; its tier takes one off): its
    /// replica's best is the better of the two.
    #[inline]
    fn ended(&self, a: Holder, so_far: u32, best: &mut [u32]) {
        let replica = self
            .scoring
            .get(a.source() as usize)
            .map_or(0, |s| s.replica);
        if let Some(b) = best.get_mut(replica as usize) {
            *b = (*b).max(so_far - u32::from(a.tier()));
        }
    }

    /// Keeps in `alive` the sources that hold this block too (`holders`), each with the worse
    /// tier (the larger word: same source and epoch); the others' match ends at `so_far` (a
    /// [`code`] at T1). Both lists are sorted by source. The blocks of a
    /// shared prompt mostly have the same holders, tiers included, so runs of eight equal
    /// words are taken whole (compared with no branch but one a run of eight) and only the
    /// words around a difference are merged one by one.
    fn intersect(
        &self,
        alive: &mut Vec<Holder>,
        holders: &[Holder],
        best: &mut [u32],
        so_far: u32,
    ) {
        if holders.len() * 8 < alive.len() {
            // Few go on (the block after a shared prefix): each holder is searched for, and
            // the sources passed over end here.
            let (mut r, mut kept) = (0, 0);
            for &h in holders {
                let skip = alive[r..].partition_point(|a| a.source() < h.source());
                for &a in &alive[r..r + skip] {
                    self.ended(a, so_far, best);
                }
                r += skip;
                if let Some(&a) = alive.get(r).filter(|a| a.source() == h.source()) {
                    if a.same_id(h) {
                        alive[kept] = a.max(h);
                        kept += 1;
                    } else {
                        self.ended(a, so_far, best);
                    }
                    r += 1;
                }
            }
            for &a in &alive[r..] {
                self.ended(a, so_far, best);
            }
            alive.truncate(kept);
            return;
        }
        let (mut r, mut j, mut kept) = (0, 0, 0);
        while r < alive.len() {
            if alive.len() - r >= 8 && holders.len() - j >= 8 {
                let run = alive[r..]
                    .chunks_exact(8)
                    .zip(holders[j..].chunks_exact(8))
                    .take_while(|(a, h)| a.iter().zip(*h).fold(0, |d, (a, h)| d | (a.0 ^ h.0)) == 0)
                    .count()
                    * 8;
                if kept != r {
                    alive.copy_within(r..r + run, kept);
                }
                (r, j, kept) = (r + run, j + run, kept + run);
                if r == alive.len() {
                    break;
                }
            }
            let a = alive[r];
            while j < holders.len() && holders[j].source() < a.source() {
                j += 1;
            }
            if j < holders.len() && holders[j].same_id(a) {
                alive[kept] = a.max(holders[j]);
                kept += 1;
                j += 1;
            } else {
                self.ended(a, so_far, best);
            }
            r += 1;
        }
        alive.truncate(kept);
    }

    /// The answer from `scratch.best`: the replicas matching block 0, or every candidate
    /// known (matching or not) and the positions of those unknown.
    pub(crate) fn answer(&self, candidates: Option<&[&str]>, scratch: &mut Scratch) -> Scores {
        let Scratch {
            best,
            tokens,
            at,
            ranks,
            codes,
            asked,
            slot_of,
            ..
        } = scratch;
        let mut unknown = Vec::new();
        // Per candidate, its replica (u32::MAX: unknown), then its place in the answer.
        let mut by_candidate = Vec::new();
        if let Some(candidates) = candidates {
            asked.clear();
            asked.resize(self.replicas.len(), false);
            by_candidate.reserve_exact(candidates.len());
            for (i, name) in candidates.iter().enumerate() {
                match self.replica_ids.get(*name) {
                    Some(&id) => {
                        asked[id as usize] = true;
                        best[id as usize] = best[id as usize].max(code(0, 0));
                        by_candidate.push(id);
                    }
                    None => {
                        unknown.push(i);
                        by_candidate.push(u32::MAX);
                    }
                }
            }
            for (b, &asked) in best.iter_mut().zip(asked.iter()) {
                *b *= u32::from(asked);
            }
        }
        // Best first: most tokens, most blocks, T1 before T2, then by name. A counting sort
        // over the replicas in name order, two passes: how many have each code, then each put
        // in place. An answer is mostly a few long runs of one code (every replica ties on a
        // shared prefix), so a run's count and place stay in a register.
        let blocks = tokens.len() as u32;
        at.clear();
        at.resize(code(blocks, 0) as usize + 1, 0);
        let best: &[u32] = best;
        let code_of = |replica: u32| best.get(replica as usize).map_or(0, |&c| c as usize);
        let (mut last, mut run) = (0, 0);
        for &replica in &self.by_name {
            let c = code_of(replica);
            if c != last {
                at[last] += run;
                (last, run) = (c, 0);
            }
            run += 1;
        }
        at[last] += run;
        // The codes present, best first; where each one's entries begin (those not in the
        // answer, code 0, after them).
        codes.clear();
        ranks.clear();
        ranks.resize(at.len(), 0);
        for c in (1..at.len()).filter(|&c| at[c] > 0) {
            let blocks = (c as u32 - 1) / 2;
            let tier = u8::from(c % 2 == 1);
            ranks[c] = rank(blocks, tokens_of(tokens, blocks), tier);
            codes.push((answer_order(ranks[c]), c));
        }
        codes.sort_unstable_by_key(|&(order, _)| std::cmp::Reverse(order));
        let mut len = 0;
        for &(_, c) in codes.iter() {
            (at[c], len) = (len, len + at[c]);
        }
        // Each put in place in the answer itself (a copy of 4 kB costs as much as the pass).
        let mut entries = vec![(0, 0); len];
        let (mut last, mut next, mut r) = (0, len, 0);
        for &replica in &self.by_name {
            let c = code_of(replica);
            if c != last {
                at[last] = next;
                (last, next, r) = (c, at[c], ranks[c]);
            }
            // Those not in the answer (code 0) are placed past its end: nowhere.
            if let Some(slot) = entries.get_mut(next) {
                *slot = (r, replica);
            }
            next += 1;
        }
        if !by_candidate.is_empty() {
            slot_of.clear();
            slot_of.resize(self.replicas.len(), u32::MAX);
            for (k, &(_, replica)) in entries.iter().enumerate() {
                slot_of[replica as usize] = k as u32;
            }
            for c in &mut by_candidate {
                *c = slot_of.get(*c as usize).copied().unwrap_or(u32::MAX);
            }
        }
        Scores {
            names: self.replicas.clone(),
            states: self.states.clone(),
            loads: self.loads.clone(),
            expired: self.leases.expired_among(entries.iter().map(|&(_, r)| r)),
            entries,
            unknown,
            by_candidate,
        }
    }
}

/// Tokens the first `blocks` blocks of a query cover ([`Scratch::tokens`]).
fn tokens_of(tokens: &[u32], blocks: u32) -> u32 {
    blocks
        .checked_sub(1)
        .and_then(|m| tokens.get(m as usize))
        .copied()
        .unwrap_or(0)
}
