//! The routing rule a router built on a [`Fleet`](crate::Fleet) applies, as a function: which
//! replica a request goes to, given the fleet's answer among the candidates and how busy each
//! is.
//!
//! - **Best exact replica.** Among the candidates whose state is
//!   [`ReplicaState::Exact`], the one holding the most tokens of the prompt; ties go to the one
//!   with fewer requests in flight, then to the first name in byte order.
//! - **Fail open.** With no exact candidate (none matched, none is exact, or the fleet could not
//!   answer), the least busy candidate (then the first name), with what the fleet said of it: a
//!   replica the index cannot vouch for is never preferred for what it claims to hold.
//! - **The adapter.** vLLM serves a LoRA adapter under its own name in a request's `model`
//!   (`--lora-modules NAME=PATH`); its blocks carry that name (`lora_name`). A request naming
//!   the base model (or nothing) is scored as the base model's, any other name as that
//!   adapter's ([`adapter_of`]).

use kvevent_index::{ReplicaState, Scores};

/// One replica a request may go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<'a> {
    /// Its name, as the fleet follows it.
    pub name: &'a str,
    /// Requests the router has in flight to it now.
    pub in_flight: u32,
}

/// Where a request goes, and what the decision rests on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice<'a> {
    /// The candidate chosen.
    pub replica: &'a str,
    /// Tokens of the prompt the fleet says it holds (0 when it said nothing of it).
    pub matched_tokens: u32,
    /// Its state when the choice was made ([`ReplicaState::Exact`] unless it failed open).
    pub state: ReplicaState,
    /// No candidate was exact with a match: the least busy was taken.
    pub failed_open: bool,
}

/// The candidate a request goes to, by the rule of this module, from the fleet's answer among
/// `candidates` (`None`: the fleet could not answer, e.g. no block size known yet). `None`
/// only when there is no candidate.
///
/// ```
/// use kvevent_fleet::route::{Candidate, choose};
/// let candidates = [Candidate { name: "a", in_flight: 3 }, Candidate { name: "b", in_flight: 1 }];
/// // Nothing known yet: fail open to the least busy.
/// let choice = choose(None, &candidates).expect("a candidate");
/// assert_eq!((choice.replica, choice.failed_open), ("b", true));
/// ```
pub fn choose<'a>(scores: Option<&Scores>, candidates: &[Candidate<'a>]) -> Option<Choice<'a>> {
    fn busy<'x>(c: &Candidate<'x>) -> (u32, &'x str) {
        (c.in_flight, c.name)
    }
    let best = scores.and_then(|scores| {
        scores
            .iter()
            .filter(|s| s.state.is_exact() && s.matched_tokens > 0)
            .filter_map(|s| {
                let c = candidates.iter().find(|c| c.name == s.replica)?;
                Some((s.matched_tokens, c))
            })
            .max_by(|(ta, a), (tb, b)| ta.cmp(tb).then(busy(b).cmp(&busy(a))))
            .map(|(tokens, c)| Choice {
                replica: c.name,
                matched_tokens: tokens,
                state: ReplicaState::Exact,
                failed_open: false,
            })
    });
    best.or_else(|| {
        let c = candidates.iter().min_by_key(|c| busy(c))?;
        let said = scores.and_then(|s| s.iter().find(|s| s.replica == c.name));
        Some(Choice {
            replica: c.name,
            matched_tokens: said.map_or(0, |s| s.matched_tokens),
            state: said.map_or(
                ReplicaState::Degraded(kvevent_index::Degraded::Connecting),
                |s| s.state,
            ),
            failed_open: true,
        })
    })
}

/// The adapter a request is for: `""` (the base model) when its `model` is empty or the base
/// model's name, else the name it gives (a LoRA adapter, as vLLM serves one).
///
/// ```
/// use kvevent_fleet::route::adapter_of;
/// assert_eq!(adapter_of("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B"), "");
/// assert_eq!(adapter_of("", "meta-llama/Llama-3.1-8B"), "");
/// assert_eq!(adapter_of("sql-lora", "meta-llama/Llama-3.1-8B"), "sql-lora");
/// ```
pub fn adapter_of<'a>(model: &'a str, base_model: &str) -> &'a str {
    if model.is_empty() || model == base_model {
        ""
    } else {
        model
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvevent_index::{Config, Degraded, Index, Query, QueryKeys};

    /// An index where `holders` hold the first `n` blocks of the prompt 0..64 (block size 16),
    /// with the states given.
    fn scores(holders: &[(&str, usize, ReplicaState)], asked: &[&str]) -> Scores {
        let index = Index::new(Config::default());
        let prompt: Vec<u32> = (0..64).collect();
        for &(name, blocks, state) in holders {
            let source = index.add_source(name).expect("a source");
            let keys = kvevent_fingerprint::chain(&prompt[..blocks * 16], 16, None);
            let changes: Vec<kvevent_index::KeyChange<'_>> = keys
                .iter()
                .enumerate()
                .map(|(i, b)| kvevent_index::KeyChange::Stored {
                    key: b.prefix,
                    tokens: 16 * (i as u32 + 1),
                    tier: kvevent_index::Tier::T1,
                    adapter: "",
                })
                .collect();
            index.apply_keys(source, &changes);
            index.set_replica_state(name, state);
        }
        index.score_among(
            &Query {
                adapter: "",
                keys: QueryKeys::Tokens {
                    ids: &prompt,
                    block_size: 16,
                },
            },
            asked,
        )
    }

    fn c(name: &str, in_flight: u32) -> Candidate<'_> {
        Candidate { name, in_flight }
    }

    const EXACT: ReplicaState = ReplicaState::Exact;
    const DEGRADED: ReplicaState = ReplicaState::Degraded(Degraded::Unverified);

    #[test]
    fn the_exact_replica_holding_most_wins() {
        let s = scores(&[("a", 2, EXACT), ("b", 3, EXACT)], &["a", "b"]);
        let choice = choose(Some(&s), &[c("a", 0), c("b", 9)]).expect("a choice");
        assert_eq!(choice.replica, "b");
        assert_eq!(choice.matched_tokens, 48);
        assert!(!choice.failed_open);
    }

    #[test]
    fn ties_go_to_fewer_in_flight_then_the_first_name() {
        let s = scores(
            &[("a", 2, EXACT), ("b", 2, EXACT), ("c", 2, EXACT)],
            &["a", "b", "c"],
        );
        let choice = choose(Some(&s), &[c("a", 2), c("b", 1), c("c", 1)]).expect("a choice");
        assert_eq!(choice.replica, "b");
        let choice = choose(Some(&s), &[c("c", 0), c("b", 0), c("a", 0)]).expect("a choice");
        assert_eq!(choice.replica, "a");
    }

    #[test]
    fn a_replica_not_exact_is_never_preferred_for_what_it_claims() {
        let s = scores(&[("a", 4, DEGRADED), ("b", 1, EXACT)], &["a", "b"]);
        let choice = choose(Some(&s), &[c("a", 0), c("b", 5)]).expect("a choice");
        assert_eq!((choice.replica, choice.matched_tokens), ("b", 16));
    }

    #[test]
    fn with_no_exact_match_it_fails_open_to_the_least_busy() {
        let s = scores(&[("a", 4, DEGRADED)], &["a", "b"]);
        let choice = choose(Some(&s), &[c("a", 3), c("b", 1)]).expect("a choice");
        assert_eq!(choice.replica, "b");
        assert!(choice.failed_open);
        // The least busy is the degraded one: taken, with what the fleet said of it.
        let choice = choose(Some(&s), &[c("a", 0), c("b", 1)]).expect("a choice");
        assert_eq!((choice.replica, choice.matched_tokens), ("a", 64));
        assert_eq!(choice.state, DEGRADED);
        assert!(choice.failed_open);
        // A candidate the fleet does not know, and no answer at all.
        let choice = choose(None, &[c("x", 0)]).expect("a choice");
        assert_eq!(choice.state, ReplicaState::Degraded(Degraded::Connecting));
        assert_eq!(choose(None, &[]), None);
    }

    #[test]
    fn a_candidate_the_answer_names_but_the_router_may_not_use_is_skipped() {
        let s = scores(&[("a", 4, EXACT), ("b", 1, EXACT)], &["a", "b"]);
        let choice = choose(Some(&s), &[c("b", 0)]).expect("a choice");
        assert_eq!(choice.replica, "b");
    }
}
