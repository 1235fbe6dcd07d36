//! Predicted against realized: per routing decision, the tokens the index said the chosen
//! replica holds against the tokens its engine then reused, so that a stale index or a broken
//! event stream is found in minutes, not by users.
//!
//! **The last-block rule.** An engine computes at least the last token of a prompt, so a
//! prompt of `n` tokens reuses at most `⌊(n − 1) / block⌋ × block` tokens: vLLM recomputes the
//! last block of a prompt that is cached whole. A prediction is compared with what it says the
//! engine can reuse, [`Prediction::expected_cached`], never with the raw match.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvevent_index::{ReplicaState, Score};

/// What a router acted on for one request: the replica it chose, the tokens the index said
/// that replica holds, and how far that was to be trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prediction {
    /// The replica the request went to.
    pub replica: String,
    /// Tokens of the prompt the index matched on it (0 when it matched nothing).
    pub predicted_tokens: u32,
    /// The prompt's length in tokens.
    pub prompt_tokens: u32,
    /// The block size the match was made with.
    pub block_size: u32,
    /// The replica's state when the decision was made.
    pub state: ReplicaState,
}

impl Prediction {
    /// The prediction a router makes when it sends a prompt of `prompt_tokens` to `score`'s
    /// replica.
    pub fn of(score: &Score<'_>, prompt_tokens: u32, block_size: u32) -> Self {
        Self {
            replica: score.replica.to_owned(),
            predicted_tokens: score.matched_tokens,
            prompt_tokens,
            block_size,
            state: score.state,
        }
    }

    /// The tokens the engine should report cached: the match, but never the prompt's last
    /// token's block (the last-block rule of this module).
    pub fn expected_cached(&self) -> u32 {
        let block = self.block_size.max(1);
        let reusable = self.prompt_tokens.saturating_sub(1) / block * block;
        self.predicted_tokens.min(reusable)
    }
}

/// How a prediction compared with what the engine reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The engine reused what was expected.
    Exact,
    /// The index promised more than the engine reused: it holds blocks the engine no longer
    /// has (a stale index, lost evictions).
    Optimistic,
    /// The engine reused more than the index knew of (lost stores, a late join).
    Pessimistic,
}

impl Outcome {
    /// `exact`, `optimistic` or `pessimistic`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Optimistic => "optimistic",
            Self::Pessimistic => "pessimistic",
        }
    }
}

/// Upper bounds of the error histogram's buckets, in blocks (expected − realized): negative
/// is pessimistic, positive optimistic; the last bucket takes the rest.
pub const ERROR_BUCKETS: [i64; 9] = [-8, -4, -2, -1, 0, 1, 2, 4, 8];

/// One replica's predictions so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaAccounting {
    /// Decisions recorded.
    pub decisions: u64,
    /// Of them, exact.
    pub exact: u64,
    /// Of them, optimistic.
    pub optimistic: u64,
    /// Of them, pessimistic.
    pub pessimistic: u64,
    /// Decisions made while the replica was not [`ReplicaState::Exact`].
    pub not_exact_state: u64,
    /// Decisions per error bucket ([`ERROR_BUCKETS`], then the rest), not cumulative.
    pub error_blocks: [u64; ERROR_BUCKETS.len() + 1],
    /// Sum of the errors in blocks (for a histogram's `_sum`).
    pub error_sum: i64,
}

/// Decisions a drift is judged over, and the share of them that makes one.
const DRIFT_WINDOW: usize = 32;
const DRIFT_MIN: usize = 8;
const DRIFT_SHARE: f64 = 0.25;
/// A drift warning about one replica at most this often.
const DRIFT_LOG_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
struct Replica {
    totals: ReplicaAccounting,
    /// The outcomes of its latest decisions made while exact.
    recent: VecDeque<Outcome>,
    warned: Option<Instant>,
}

/// Every replica's predictions; [`crate::Fleet::record`] fills it.
#[derive(Debug, Default)]
pub(crate) struct Accounting {
    replicas: HashMap<String, Replica>,
}

impl Accounting {
    pub(crate) fn record(&mut self, prediction: &Prediction, realized: u32) -> Outcome {
        let expected = prediction.expected_cached();
        let block = i64::from(prediction.block_size.max(1));
        let error = (i64::from(expected) - i64::from(realized)) / block;
        let outcome = match expected.cmp(&realized) {
            std::cmp::Ordering::Equal => Outcome::Exact,
            std::cmp::Ordering::Greater => Outcome::Optimistic,
            std::cmp::Ordering::Less => Outcome::Pessimistic,
        };
        let r = self.replicas.entry(prediction.replica.clone()).or_default();
        let t = &mut r.totals;
        t.decisions += 1;
        match outcome {
            Outcome::Exact => t.exact += 1,
            Outcome::Optimistic => t.optimistic += 1,
            Outcome::Pessimistic => t.pessimistic += 1,
        }
        let bucket = ERROR_BUCKETS
            .iter()
            .position(|le| error <= *le)
            .unwrap_or(ERROR_BUCKETS.len());
        t.error_blocks[bucket] += 1;
        t.error_sum += error;
        if prediction.state != ReplicaState::Exact {
            // A degraded or stale replica is expected to differ: not a drift.
            t.not_exact_state += 1;
            return outcome;
        }
        if r.recent.len() == DRIFT_WINDOW {
            r.recent.pop_front();
        }
        r.recent.push_back(outcome);
        let count = |o: Outcome| r.recent.iter().filter(|x| **x == o).count();
        let (optimistic, pessimistic) = (count(Outcome::Optimistic), count(Outcome::Pessimistic));
        let n = r.recent.len();
        let drifting =
            n >= DRIFT_MIN && (optimistic.max(pessimistic) as f64) > DRIFT_SHARE * n as f64;
        if drifting && r.warned.is_none_or(|t| t.elapsed() >= DRIFT_LOG_EVERY) {
            r.warned = Some(Instant::now());
            if optimistic >= pessimistic {
                tracing::warn!(
                    replica = %prediction.replica,
                    optimistic, decisions = n,
                    "predictions drift: the index says this replica holds blocks its engine did not reuse (a stale index or lost evictions: check its event stream)"
                );
            } else {
                tracing::warn!(
                    replica = %prediction.replica,
                    pessimistic, decisions = n,
                    "predictions drift: this replica's engine reused blocks the index did not know of (lost stores or a late join: check its event stream)"
                );
            }
        }
        outcome
    }

    pub(crate) fn snapshot(&self) -> Vec<(String, ReplicaAccounting)> {
        let mut out: Vec<_> = self
            .replicas
            .iter()
            .map(|(name, r)| (name.clone(), r.totals.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    pub(crate) fn forget(&mut self, replica: &str) {
        self.replicas.remove(replica);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prediction(predicted: u32, prompt: u32, state: ReplicaState) -> Prediction {
        Prediction {
            replica: "a".into(),
            predicted_tokens: predicted,
            prompt_tokens: prompt,
            block_size: 32,
            state,
        }
    }

    #[test]
    fn the_last_block_is_never_expected_back() {
        // A 128-token prompt cached whole: the engine computes its last block again.
        assert_eq!(
            prediction(128, 128, ReplicaState::Exact).expected_cached(),
            96
        );
        // A prompt one token longer than its cached blocks reuses them all.
        assert_eq!(
            prediction(128, 129, ReplicaState::Exact).expected_cached(),
            128
        );
        assert_eq!(
            prediction(64, 128, ReplicaState::Exact).expected_cached(),
            64
        );
        assert_eq!(prediction(0, 1, ReplicaState::Exact).expected_cached(), 0);
    }

    #[test]
    fn outcomes_are_counted_and_bucketed_by_their_error_in_blocks() {
        let mut a = Accounting::default();
        let exact = ReplicaState::Exact;
        assert_eq!(a.record(&prediction(128, 128, exact), 96), Outcome::Exact);
        assert_eq!(
            a.record(&prediction(128, 200, exact), 64),
            Outcome::Optimistic
        );
        assert_eq!(
            a.record(&prediction(0, 200, exact), 32),
            Outcome::Pessimistic
        );
        let stale = ReplicaState::Degraded(kvevent_index::Degraded::Connecting);
        assert_eq!(
            a.record(&prediction(64, 200, stale), 0),
            Outcome::Optimistic
        );
        let (name, t) = &a.snapshot()[0];
        assert_eq!(name, "a");
        assert_eq!(
            (
                t.decisions,
                t.exact,
                t.optimistic,
                t.pessimistic,
                t.not_exact_state
            ),
            (4, 1, 2, 1, 1)
        );
        // Errors 0, +2, -1, +2 blocks.
        let at = |le: i64| t.error_blocks[ERROR_BUCKETS.iter().position(|b| *b == le).unwrap_or(0)];
        assert_eq!((at(-1), at(0), at(2)), (1, 1, 2));
        assert_eq!(t.error_sum, 3);
        a.forget("a");
        assert!(a.snapshot().is_empty());
    }
}
