//! The routing loop: [`Router`], and what a request is as it goes ([`Decision`], [`Sent`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvevent_index::{Query, QueryKeys, ReplicaState, Scores};

use super::learn::{Learner, Weighing};
use super::{Candidate, Flight, Flights, LoadSeen, Policy, Request, Rule, affinity};
use crate::{Fleet, Outcome, Prediction, lock};

/// The block size a prompt's affinity is taken with before any replica said its own.
const AFFINITY_BLOCK: usize = 16;

/// Where a request goes and what the decision rests on: a [`super::Choice`] that owns its
/// data, with the prediction it acts on.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The replica chosen.
    pub replica: String,
    /// What is recorded against the engine's cached tokens ([`Sent::finish`]).
    pub prediction: Prediction,
    /// Prompt tokens it will compute there (the prompt less what it holds exactly).
    pub compute_tokens: u32,
    /// Requests estimated ahead of this one there.
    pub queued: u32,
    /// Prompt tokens this router's earlier requests there still had to compute when it was
    /// chosen (until their first tokens).
    pub prefilling: u64,
    /// The choice does not rest on an exact match.
    pub failed_open: bool,
    /// How its load was known.
    pub load: LoadSeen,
    /// What the cost policy estimated the request costs there, in microseconds (0 for the
    /// other policies).
    pub cost_us: f64,
    /// No candidate could serve: chosen among all of them (failing open).
    pub none_serving: bool,
    /// 0 for the first choice, 1 for a retry ([`Router::retry`]).
    pub attempt: u8,
}

impl Decision {
    /// The replica's state when chosen.
    pub fn state(&self) -> ReplicaState {
        self.prediction.state
    }
}

/// Why a request is sent again ([`Router::retry`]): its upstream failed before any byte of
/// its answer reached the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Retry {
    /// The connection was refused (or could not be made).
    Refused,
    /// It answered 502 Bad Gateway.
    BadGateway,
    /// It answered 503 Service Unavailable.
    Unavailable,
}

impl Retry {
    /// `refused`, `502` or `503`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Refused => "refused",
            Self::BadGateway => "502",
            Self::Unavailable => "503",
        }
    }

    /// The retry an HTTP status calls for, if any (502 and 503).
    pub fn of_status(status: u16) -> Option<Self> {
        match status {
            502 => Some(Self::BadGateway),
            503 => Some(Self::Unavailable),
            _ => None,
        }
    }
}

/// What the loop has counted ([`Router::counters`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouterCounters {
    /// Requests sent again, by the replica that failed and why, sorted.
    pub retries: Vec<(String, Retry, u64)>,
    /// Choices made with no candidate able to serve (failing open).
    pub none_serving: u64,
}

/// The routing loop, once for every router built on a [`Fleet`]: what happens to a
/// request from its candidates to its realized accounting. The fleet's answer among the
/// candidates, the [`Rule`], what this router has in flight to each replica and the prompt
/// tokens each still computes, the first token, and the engine's cached tokens recorded against
/// the prediction the choice acted on. A router keeps only its transport (HTTP, flags).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use kvevent_fleet::{Fleet, FleetConfig, route::{Router, Rule}};
/// let router = Router::new(Arc::new(Fleet::new(FleetConfig::default())?), Rule::default());
/// let prompt: Vec<u32> = (0..64).collect();
/// let decision = router.choose(&["a", "b"], &prompt, "").expect("a candidate");
/// let mut sent = router.send(&decision); // in flight to decision.replica
/// // ... forward the request; on its first streamed chunk:
/// sent.first_token();
/// // ... its usage says the engine reused 48 tokens:
/// sent.finish(Some(48));
/// # Ok(()) }
/// ```
///
/// Invariants: a request counts in flight from [`Router::send`] until its [`Sent`] is finished
/// or dropped, once; a retry never goes back to the replica that failed; every retry and every
/// choice made with no candidate able to serve is counted.
#[derive(Debug)]
pub struct Router {
    fleet: Arc<Fleet>,
    rule: Rule,
    flights: Mutex<HashMap<String, Arc<Flights>>>,
    retries: Mutex<HashMap<(String, Retry), u64>>,
    none_serving: AtomicU64,
    learner: Option<Arc<Learner>>,
}

impl Router {
    /// The loop over `fleet`, deciding by `rule` as given (its weights fixed).
    pub fn new(fleet: Arc<Fleet>, rule: Rule) -> Self {
        Self {
            fleet,
            rule,
            flights: Mutex::default(),
            retries: Mutex::default(),
            none_serving: AtomicU64::new(0),
            learner: None,
        }
    }

    /// This loop learning the cost policy's weights from its own flights, starting from the
    /// rule's: each streamed request's time to first token ([`Sent::first_token`]) against
    /// the prompt tokens it had to compute and the requests ahead when it was chosen, fitted
    /// by least squares that fade old flights, held near the start until flights say
    /// otherwise and within a bound of it ([`Weighing`]). A router given weights explicitly
    /// keeps them (does not call this); another policy weighs nothing (this changes
    /// nothing).
    pub fn learning(mut self) -> Self {
        if let Policy::Cost(w) = self.rule.policy() {
            self.learner = Some(Arc::new(Learner::new(w)));
        }
        self
    }

    /// The cost policy's weights as the next choice uses them, and whether learned; `None`
    /// for another policy.
    pub fn weights(&self) -> Option<Weighing> {
        let Policy::Cost(given) = self.rule.policy() else {
            return None;
        };
        Some(match &self.learner {
            Some(l) => Weighing {
                weights: l.weights(),
                learned: true,
                flights: l.flights(),
            },
            None => Weighing {
                weights: given,
                learned: false,
                flights: 0,
            },
        })
    }

    /// The fleet it routes on.
    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }

    /// The rule it decides by.
    pub fn rule(&self) -> &Rule {
        &self.rule
    }

    /// What this router sent `replica`.
    pub fn flights(&self, replica: &str) -> Arc<Flights> {
        if let Some(f) = lock(&self.flights).get(replica) {
            return f.clone();
        }
        lock(&self.flights)
            .entry(replica.to_owned())
            .or_default()
            .clone()
    }

    /// Requests this router has in flight to `replica`.
    pub fn in_flight(&self, replica: &str) -> u32 {
        lock(&self.flights)
            .get(replica)
            .map_or(0, |f| f.in_flight())
    }

    /// Forgets what was sent to a replica that left (its requests still in flight end as
    /// they will).
    pub fn forget(&self, replica: &str) {
        lock(&self.flights).remove(replica);
    }

    /// Where a request of `prompt` (token ids) for `adapter` ("" for the base model) goes
    /// among `candidates`, by the rule; before any replica said its block size, by load (and
    /// state) alone. `None` only when there is no candidate.
    pub fn choose(&self, candidates: &[&str], prompt: &[u32], adapter: &str) -> Option<Decision> {
        self.decide(candidates, prompt, adapter, 0)
    }

    /// Where a request goes again after `failed` failed for `why` before any byte of its
    /// answer reached the client: the next choice among `candidates` without the replica that
    /// failed. Counted (by that replica and why). `None` when no other candidate is left, or
    /// when `failed` was itself a retry: a request is sent again once (not counted again).
    pub fn retry(
        &self,
        failed: &Decision,
        why: Retry,
        candidates: &[&str],
        prompt: &[u32],
        adapter: &str,
    ) -> Option<Decision> {
        if failed.attempt > 0 {
            return None;
        }
        *lock(&self.retries)
            .entry((failed.replica.clone(), why))
            .or_default() += 1;
        let others: Vec<&str> = candidates
            .iter()
            .copied()
            .filter(|c| *c != failed.replica)
            .collect();
        self.decide(&others, prompt, adapter, failed.attempt.saturating_add(1))
    }

    fn decide(
        &self,
        candidates: &[&str],
        prompt: &[u32],
        adapter: &str,
        attempt: u8,
    ) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        let block = self.fleet.block_size();
        let scores = self.scores(candidates, prompt, adapter, block);
        let flights: Vec<Arc<Flights>> = candidates.iter().map(|c| self.flights(c)).collect();
        let cs: Vec<Candidate<'_>> = candidates
            .iter()
            .zip(&flights)
            .map(|(name, f)| Candidate { name, flights: f })
            .collect();
        let request = Request {
            prompt_tokens: u32::try_from(prompt.len()).unwrap_or(u32::MAX),
            affinity: affinity(prompt, block.map_or(AFFINITY_BLOCK, |b| b as usize)),
        };
        let policy = match &self.learner {
            Some(l) => Policy::Cost(l.weights()),
            None => self.rule.policy(),
        };
        let c = self
            .rule
            .choose_by(policy, scores.as_ref(), &request, &cs, Instant::now())?;
        let prefilling = candidates
            .iter()
            .position(|n| *n == c.replica)
            .map_or(0, |i| flights[i].prefilling());
        if c.none_serving {
            self.none_serving.fetch_add(1, Relaxed);
        }
        Some(Decision {
            replica: c.replica.to_owned(),
            prediction: Prediction {
                replica: c.replica.to_owned(),
                predicted_tokens: c.matched_tokens,
                prompt_tokens: request.prompt_tokens,
                block_size: block.unwrap_or(0),
                state: c.state,
            },
            compute_tokens: c.compute_tokens,
            queued: c.queued,
            prefilling,
            failed_open: c.failed_open,
            load: c.load,
            cost_us: c.cost_us,
            none_serving: c.none_serving,
            attempt,
        })
    }

    /// The fleet's answer among `candidates`: by the prompt's blocks once a block size is
    /// known; before, an answer of no blocks (each candidate's state and load).
    fn scores(
        &self,
        candidates: &[&str],
        prompt: &[u32],
        adapter: &str,
        block: Option<u32>,
    ) -> Option<Scores> {
        let by_blocks = block.and_then(|b| {
            let query = Query {
                adapter,
                keys: QueryKeys::Tokens {
                    ids: prompt,
                    block_size: b as usize,
                },
            };
            self.fleet.score_among(&query, candidates).ok()
        });
        by_blocks.or_else(|| {
            let query = Query {
                adapter,
                keys: QueryKeys::Keys(&[]),
            };
            self.fleet.score_among(&query, candidates).ok()
        })
    }

    /// The request is sent as `decision` says: in flight to its replica, its prompt tokens to
    /// compute counted there until its first token, until the [`Sent`] is finished or dropped.
    pub fn send(&self, decision: &Decision) -> Sent {
        Sent {
            flight: self
                .flights(&decision.replica)
                .start_prefill(decision.compute_tokens),
            prediction: decision.prediction.clone(),
            fleet: self.fleet.clone(),
            learn: self.learner.clone().map(|l| Lesson {
                learner: l,
                sent_at: Instant::now(),
                tokens: f64::from(decision.compute_tokens) + decision.prefilling as f64,
                queued: f64::from(decision.queued),
            }),
        }
    }

    /// What it has counted.
    pub fn counters(&self) -> RouterCounters {
        let mut retries: Vec<(String, Retry, u64)> = lock(&self.retries)
            .iter()
            .map(|((r, why), n)| (r.clone(), *why, *n))
            .collect();
        retries.sort_by(|a, b| (&a.0, a.1.as_str()).cmp(&(&b.0, b.1.as_str())));
        RouterCounters {
            retries,
            none_serving: self.none_serving.load(Relaxed),
        }
    }
}

/// A request sent ([`Router::send`]): in flight until finished or dropped.
#[derive(Debug)]
pub struct Sent {
    flight: Flight,
    prediction: Prediction,
    fleet: Arc<Fleet>,
    /// What a learning router learns from its first token (taken then).
    learn: Option<Lesson>,
}

/// A flight as a learning router observes it.
#[derive(Debug)]
struct Lesson {
    learner: Arc<Learner>,
    sent_at: Instant,
    tokens: f64,
    queued: f64,
}

impl Sent {
    /// Its first token came (its first streamed chunk): its prompt is computed. A learning
    /// router ([`Router::learning`]) learns from the time it took (the first call only).
    pub fn first_token(&mut self) {
        self.flight.first_token();
        if let Some(l) = self.learn.take() {
            let ttft = l.sent_at.elapsed().as_secs_f64() * 1e6;
            l.learner.observe(l.tokens, l.queued, ttft);
        }
    }

    /// It is over: the cached tokens its usage reported (`None`: it reported none, or it
    /// failed) are recorded against the prediction ([`Fleet::record`]), and it leaves flight.
    pub fn finish(self, cached_tokens: Option<u32>) -> Option<Outcome> {
        let outcome = cached_tokens.map(|c| self.fleet.record(&self.prediction, c));
        drop(self.flight);
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FleetConfig;

    fn router(policy: Policy) -> Router {
        Router::new(
            Arc::new(Fleet::new(FleetConfig::default()).expect("a fleet")),
            Rule::new(policy),
        )
    }

    #[tokio::test(flavor = "current_thread")]
    async fn weights_given_are_kept_and_another_policy_weighs_none() {
        let given = super::super::Weights {
            prefill_us_per_token: 7.0,
            queue_us_per_request: 9.0,
        };
        let r = router(Policy::Cost(given));
        let mut sent = r.send(&r.choose(&["a"], &[1, 2, 3], "").expect("a"));
        sent.first_token();
        let w = r.weights().expect("the cost policy's");
        assert_eq!((w.weights, w.learned, w.flights), (given, false, 0));
        assert_eq!(router(Policy::RoundRobin).learning().weights(), None);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_learning_router_learns_once_from_each_streamed_first_token() {
        let r = router(Policy::default()).learning();
        let start = r.weights().expect("cost");
        assert_eq!(
            (start.weights, start.learned, start.flights),
            (super::super::Weights::default(), true, 0)
        );
        let prompt: Vec<u32> = (0..64).collect();
        let mut streamed = r.send(&r.choose(&["a", "b"], &prompt, "").expect("a"));
        streamed.first_token();
        streamed.first_token();
        streamed.finish(None);
        // Not streamed: it ends without a first token, and teaches nothing.
        r.send(&r.choose(&["a", "b"], &prompt, "").expect("a"))
            .finish(None);
        assert_eq!(r.weights().map(|w| w.flights), Some(1));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn choices_use_the_learned_weights() {
        // `a` has one request in flight with 1,000 prompt tokens still to compute; `b` three
        // with none. By the defaults (100 µs a token, 20 ms a request) `b` is cheaper.
        let prompt: Vec<u32> = (0..64).collect();
        for learn in [false, true] {
            let mut r = router(Policy::default());
            if learn {
                r = r.learning();
            }
            let _a = r.flights("a").start_prefill(1_000);
            let _b: Vec<Flight> = (0..3).map(|_| r.flights("b").start_prefill(0)).collect();
            if let Some(l) = &r.learner {
                // Flights that say a token costs nothing and a request ahead 5 ms.
                for i in 0..1_000 {
                    let (x, q) = (f64::from(i % 20) * 500.0, f64::from(i % 7));
                    l.observe(x, q, 2_000.0 + 5_000.0 * q);
                }
            }
            let d = r.choose(&["a", "b"], &prompt, "").expect("a choice");
            assert_eq!(d.replica, if learn { "a" } else { "b" }, "learning {learn}");
            assert_eq!(d.prefilling, if learn { 1_000 } else { 0 });
        }
    }
}
