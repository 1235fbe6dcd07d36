//! The routing rules a router built on a [`Fleet`](crate::Fleet) applies, as a [`Rule`]: which
//! replica a request goes to, given the fleet's answer among the candidates, each engine's
//! load and what this router has in flight.
//!
//! - **[`Policy::Cost`]** (the default): for each candidate, what the request would cost
//!   there, in microseconds of time to first token: the prompt tokens it would compute (the
//!   prompt less what the candidate holds, counted only when the candidate is
//!   [`ReplicaState::Exact`]: a replica the index cannot vouch for is never preferred for what
//!   it claims) plus the prompt tokens this router's requests there still compute (sent with
//!   [`Flights::start_prefill`], until their first token), times
//!   [`Weights::prefill_us_per_token`], plus the requests queued ahead of it times
//!   [`Weights::queue_us_per_request`]. The cheapest wins. A hot prefix spreads: once its
//!   holder's queue costs more than computing the prefix elsewhere, the next request goes to
//!   another engine, which then holds it too.
//! - **Requests ahead.** The engine's load as last read (running + waiting, [`LoadReading`]), plus
//!   what this router sent it since that read ([`Flights::sent_since`]), less what of this
//!   router's ended since ([`Flights::ended_since`]: each was in the load or sent since);
//!   never fewer than this router has in flight to it. A load older than [`Rule::load_old_after`] (or none) is not
//!   used: the requests this router has in flight stand in.
//! - **Ties** (a prompt nobody holds, in an idle fleet) go to the candidate that the prompt's
//!   own [`affinity`] (its first block) ranks highest, rendezvous-hashed with the names: a
//!   new prompt spreads over the fleet, and its next turn goes where its first turn went.
//!   Never the first name by default.
//! - **[`Policy::PrefixOnly`]**: the exact candidate holding the most tokens, ties by requests
//!   in flight then name; with no exact match, the least busy (the rule before loads).
//! - **[`Policy::LeastLoaded`]** (fewest requests ahead, as above; ties in turn) and
//!   **[`Policy::RoundRobin`]**: what routers without a cache index do, for comparison.
//! - **The adapter.** vLLM serves a LoRA adapter under its own name in a request's `model`
//!   (`--lora-modules NAME=PATH`); its blocks carry that name (`lora_name`). A request naming
//!   the base model (or nothing) is scored as the base model's, any other name as that
//!   adapter's ([`adapter_of`]).
//!
//! Setting the weights from an engine's speed: `prefill_us_per_token` is 10⁶ over the
//! engine's prefill throughput (tokens a second of a long prompt alone: a 10,000 tokens/s
//! engine is 100); `queue_us_per_request` is how much later a request starts for each one
//! ahead of it: about the mean request's time in the engine (its prefill plus its decode
//! steps) over the requests the engine runs at once. The defaults are an 8B model on one
//! datacenter GPU ([`Weights::default`]); `docs/operating.md` says how to measure both. A
//! [`Router`] can learn them from its own flights instead ([`Router::learning`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use kvevent_index::{LoadReading, ReplicaState, Scores};

mod learn;
mod router;
mod usage;
pub use learn::Weighing;
pub use router::{Decision, Retry, Router, RouterCounters, Sent};
pub use usage::{StreamUsage, cached_tokens};

/// What a request would cost on a candidate, as [`Policy::Cost`] weighs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// Microseconds one prompt token not held costs to compute. Default 100 (10,000 tokens/s).
    pub prefill_us_per_token: f64,
    /// Microseconds each request ahead (running or waiting) adds before this one's first token.
    /// Default 20,000 (a 2 s mean request, 100 at once).
    pub queue_us_per_request: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            prefill_us_per_token: 100.0,
            queue_us_per_request: 20_000.0,
        }
    }
}

/// How a [`Rule`] chooses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// The cheapest candidate: prompt tokens to compute against requests ahead.
    Cost(Weights),
    /// The exact candidate holding the most tokens (the rule before loads).
    PrefixOnly,
    /// The candidate with the fewest requests ahead.
    LeastLoaded,
    /// Each candidate in turn.
    RoundRobin,
}

impl Default for Policy {
    fn default() -> Self {
        Self::Cost(Weights::default())
    }
}

impl Policy {
    /// Every policy's name, as [`Policy::as_str`] writes it and [`str::parse`] reads it.
    pub const NAMES: [&'static str; 4] = ["cost", "prefix-only", "least-loaded", "round-robin"];

    /// Its name.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Cost(_) => "cost",
            Self::PrefixOnly => "prefix-only",
            Self::LeastLoaded => "least-loaded",
            Self::RoundRobin => "round-robin",
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Weights a policy cannot take ([`Policy::with_weights`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WeightsError {
    /// A weight is not a finite number of microseconds, 0 or more.
    #[error(
        "the cost policy's weights are microseconds, 0 or more (prefill {prefill_us_per_token}, queue {queue_us_per_request})"
    )]
    Invalid {
        /// As given.
        prefill_us_per_token: f64,
        /// As given.
        queue_us_per_request: f64,
    },
    /// Weights were given to a policy that weighs nothing.
    #[error("the weights weigh the cost policy, not {0}")]
    NotCost(&'static str),
}

impl Policy {
    /// This policy with the cost policy's weights given (`None` keeps each as it is): for a
    /// router's flags. Weights for another policy, or not microseconds ≥ 0, are an error.
    ///
    /// ```
    /// use kvevent_fleet::route::Policy;
    /// let p: Policy = "cost".parse().unwrap();
    /// assert!(matches!(p.with_weights(Some(50.0), None), Ok(Policy::Cost(w)) if w.prefill_us_per_token == 50.0));
    /// assert!(Policy::RoundRobin.with_weights(Some(50.0), None).is_err());
    /// assert!(p.with_weights(Some(-1.0), None).is_err());
    /// ```
    pub fn with_weights(
        self,
        prefill_us_per_token: Option<f64>,
        queue_us_per_request: Option<f64>,
    ) -> Result<Self, WeightsError> {
        match self {
            Self::Cost(mut w) => {
                w.prefill_us_per_token = prefill_us_per_token.unwrap_or(w.prefill_us_per_token);
                w.queue_us_per_request = queue_us_per_request.unwrap_or(w.queue_us_per_request);
                if [w.prefill_us_per_token, w.queue_us_per_request]
                    .iter()
                    .all(|v| v.is_finite() && *v >= 0.0)
                {
                    Ok(Self::Cost(w))
                } else {
                    Err(WeightsError::Invalid {
                        prefill_us_per_token: w.prefill_us_per_token,
                        queue_us_per_request: w.queue_us_per_request,
                    })
                }
            }
            other if prefill_us_per_token.is_some() || queue_us_per_request.is_some() => {
                Err(WeightsError::NotCost(other.as_str()))
            }
            other => Ok(other),
        }
    }
}

/// A policy name that is none of [`Policy::NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a routing policy: cost, prefix-only, least-loaded or round-robin")]
pub struct UnknownPolicy(pub String);

impl std::str::FromStr for Policy {
    type Err = UnknownPolicy;

    /// A name of [`Policy::NAMES`]; `cost` with the default weights.
    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        match s {
            "cost" => Ok(Self::default()),
            "prefix-only" => Ok(Self::PrefixOnly),
            "least-loaded" => Ok(Self::LeastLoaded),
            "round-robin" => Ok(Self::RoundRobin),
            _ => Err(UnknownPolicy(s.to_owned())),
        }
    }
}

/// How many sends (and ends) [`Flights`] remembers: more since a load was read count as this
/// many.
const KEPT: usize = 256;

/// What a router has sent one replica: requests in flight now, and when the last ones were
/// sent and ended (for [`Flights::sent_since`], [`Flights::ended_since`]). Shared between the
/// tasks that send; lock-free.
#[derive(Debug)]
pub struct Flights {
    in_flight: AtomicU32,
    /// Prompt tokens of requests in flight that have not had their first token yet, less
    /// what each was expected to find cached.
    prefilling: AtomicU64,
    sent: Times,
    ended: Times,
    origin: Instant,
}

/// The newest instants something happened, a ring of nanoseconds after `Flights::origin`
/// (0: empty).
#[derive(Debug)]
struct Times {
    at: Box<[AtomicU64]>,
    next: AtomicUsize,
}

impl Times {
    fn new() -> Self {
        Self {
            at: (0..KEPT).map(|_| AtomicU64::new(0)).collect(),
            next: AtomicUsize::new(0),
        }
    }

    fn push(&self, at: u64) {
        let slot = self.next.fetch_add(1, Relaxed) % KEPT;
        self.at[slot].store(at.max(1), Relaxed);
    }

    /// How many are after `after` (None: all remembered are).
    fn since(&self, after: Option<u64>) -> u32 {
        let newest = self.next.load(Relaxed);
        let Some(after) = after else {
            return newest.min(KEPT) as u32;
        };
        let mut n = 0;
        // Newest first, until one at or before `after`.
        for i in 1..=KEPT.min(newest) {
            if self.at[(newest - i) % KEPT].load(Relaxed) <= after {
                break;
            }
            n += 1;
        }
        n
    }
}

impl Default for Flights {
    fn default() -> Self {
        Self {
            in_flight: AtomicU32::new(0),
            prefilling: AtomicU64::new(0),
            sent: Times::new(),
            ended: Times::new(),
            origin: Instant::now(),
        }
    }
}

impl Flights {
    /// A request sent now: in flight until the [`Flight`] is dropped.
    pub fn start(self: &Arc<Self>) -> Flight {
        self.start_prefill(0)
    }

    /// A request sent now that has `tokens` prompt tokens to compute (its prompt less what the
    /// replica was expected to hold: [`Choice::compute_tokens`]) until its first token
    /// ([`Flight::first_token`]); in flight until the [`Flight`] is dropped.
    pub fn start_prefill(self: &Arc<Self>, tokens: u32) -> Flight {
        self.sent.push(self.nanos());
        self.in_flight.fetch_add(1, Relaxed);
        self.prefilling.fetch_add(u64::from(tokens), Relaxed);
        Flight {
            flights: self.clone(),
            prefill: tokens,
        }
    }

    /// Prompt tokens this router's requests in flight still have to compute.
    pub fn prefilling(&self) -> u64 {
        self.prefilling.load(Relaxed)
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    /// Requests sent after `t` (at most the last 256 sends are remembered).
    pub fn sent_since(&self, t: Instant) -> u32 {
        self.sent.since(self.after(t))
    }

    /// Requests that ended after `t` (at most the last 256 are remembered).
    pub fn ended_since(&self, t: Instant) -> u32 {
        self.ended.since(self.after(t))
    }

    fn nanos(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    /// `t` in nanoseconds after the origin; None before it (everything remembered is after).
    fn after(&self, t: Instant) -> Option<u64> {
        t.checked_duration_since(self.origin)
            .map(|d| d.as_nanos() as u64)
    }
}

/// A request in flight ([`Flights::start`]); dropping it ends it.
#[derive(Debug)]
pub struct Flight {
    flights: Arc<Flights>,
    prefill: u32,
}

impl Flight {
    /// Its first token came: its prompt is computed.
    pub fn first_token(&mut self) {
        let t = std::mem::take(&mut self.prefill);
        self.flights.prefilling.fetch_sub(u64::from(t), Relaxed);
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.first_token();
        self.flights.ended.push(self.flights.nanos());
        self.flights.in_flight.fetch_sub(1, Relaxed);
    }
}

/// One replica a request may go to.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// Its name, as the fleet follows it.
    pub name: &'a str,
    /// What this router has sent it.
    pub flights: &'a Flights,
}

/// What the rule knows of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Its prompt's length in tokens.
    pub prompt_tokens: u32,
    /// Something of the prompt's own that its next turn shares ([`affinity`]): ties go where
    /// it ranks highest.
    pub affinity: u64,
}

/// The affinity of a prompt of `tokens` for block size `block_size`: a hash of its first
/// block (all of it when shorter), which every later turn of a conversation, and every prompt
/// sharing its system prompt, starts with.
pub fn affinity(tokens: &[u32], block_size: usize) -> u64 {
    let first = &tokens[..tokens.len().min(block_size.max(1))];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in first {
        h = mix(h ^ u64::from(*t));
    }
    h
}

/// A 64-bit finalizer (splitmix64's).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The rendezvous weight of `name` for `affinity`.
fn rendezvous(affinity: u64, name: &str) -> u64 {
    let mut h = affinity;
    for chunk in name.as_bytes().chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(word));
    }
    h
}

/// How the load a choice rested on was known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadSeen {
    /// Read within [`Rule::load_old_after`].
    Fresh,
    /// Read longer ago: not used (the router's own requests in flight stood in).
    Old,
    /// Never read (a sidecar without a metrics URL, an older sidecar, an engine followed
    /// directly).
    None,
}

/// Where a request goes, and what the decision rests on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice<'a> {
    /// The candidate chosen.
    pub replica: &'a str,
    /// Tokens of the prompt the fleet says it holds (0 when it said nothing of it).
    pub matched_tokens: u32,
    /// Its state when the choice was made.
    pub state: ReplicaState,
    /// The choice does not rest on an exact match (none matched, it is not exact, or the
    /// policy does not look).
    pub failed_open: bool,
    /// Prompt tokens it will compute there: the prompt less what the replica holds exactly
    /// (for [`Flights::start_prefill`]).
    pub compute_tokens: u32,
    /// Requests estimated ahead of this one there.
    pub queued: u32,
    /// How its load was known.
    pub load: LoadSeen,
    /// What [`Policy::Cost`] estimated it costs there, in microseconds (0 for other
    /// policies).
    pub cost_us: f64,
    /// No candidate could serve (each was known down: [`ReplicaState::can_serve`]), so the
    /// choice was made among all of them: failing open.
    pub none_serving: bool,
}

/// A routing policy and what it keeps between choices (round-robin's turn).
#[derive(Debug)]
pub struct Rule {
    policy: Policy,
    load_old_after: Duration,
    turn: AtomicUsize,
}

impl Default for Rule {
    fn default() -> Self {
        Self::new(Policy::default())
    }
}

/// One candidate as a policy weighs it.
struct Seen<'a> {
    c: &'a Candidate<'a>,
    exact_tokens: u32,
    said_tokens: u32,
    state: ReplicaState,
    queued: u32,
    load: LoadSeen,
}

impl Rule {
    /// `policy`, taking loads read within a second.
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            load_old_after: Duration::from_secs(1),
            turn: AtomicUsize::new(0),
        }
    }

    /// Loads read longer ago than `bound` are old: not used. Default 1 s (a sidecar reads
    /// every 250 ms and its heartbeats carry the age every 200 ms).
    pub fn with_load_old_after(mut self, bound: Duration) -> Self {
        self.load_old_after = bound;
        self
    }

    /// Its policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The bound past which a load is old.
    pub fn load_old_after(&self) -> Duration {
        self.load_old_after
    }

    /// The requests ahead of a new one on `c`, and how its load was known: fresh when read at
    /// or after `fresh_since`.
    fn queued(
        c: &Candidate<'_>,
        load: Option<&LoadReading>,
        fresh_since: Option<Instant>,
    ) -> (u32, LoadSeen) {
        let own = c.flights.in_flight();
        match load {
            Some(l) if fresh_since.is_none_or(|t| l.read_at >= t) => {
                let read = (l.queued().saturating_add(c.flights.sent_since(l.read_at)))
                    .saturating_sub(c.flights.ended_since(l.read_at));
                (read.max(own), LoadSeen::Fresh)
            }
            Some(_) => (own, LoadSeen::Old),
            None => (own, LoadSeen::None),
        }
    }

    /// The candidate a request goes to, by the policy, from the fleet's answer among
    /// `candidates` (`None`: the fleet could not answer, e.g. no block size known yet), at
    /// `now`. `None` only when there is no candidate. An answer of `score_among` the same
    /// names in the same order is read without a search (any answer is read right).
    ///
    /// ```
    /// use kvevent_fleet::route::{Candidate, Flights, Request, Rule};
    /// let (a, b) = (std::sync::Arc::new(Flights::default()), std::sync::Arc::new(Flights::default()));
    /// let _busy = [a.start(), a.start()];
    /// let candidates = [Candidate { name: "a", flights: &a }, Candidate { name: "b", flights: &b }];
    /// let request = Request { prompt_tokens: 64, affinity: 7 };
    /// // Nothing known yet: the one with fewer requests ahead.
    /// let choice = Rule::default().choose(None, &request, &candidates, std::time::Instant::now());
    /// assert_eq!(choice.map(|c| c.replica), Some("b"));
    /// ```
    pub fn choose<'a>(
        &self,
        scores: Option<&Scores>,
        request: &Request,
        candidates: &'a [Candidate<'a>],
        now: Instant,
    ) -> Option<Choice<'a>> {
        self.choose_by(self.policy, scores, request, candidates, now)
    }

    /// [`Rule::choose`] by `policy` (a learning router's weights) instead of its own.
    fn choose_by<'a>(
        &self,
        policy: Policy,
        scores: Option<&Scores>,
        request: &Request,
        candidates: &'a [Candidate<'a>],
        now: Instant,
    ) -> Option<Choice<'a>> {
        if candidates.is_empty() {
            return None;
        }
        let fresh_since = now.checked_sub(self.load_old_after);
        // An answer among these candidates, in this order, is read by position; any other by
        // name.
        let said = |i: usize, c: &Candidate<'_>| {
            scores.and_then(|s| {
                s.of_candidate(i)
                    .filter(|s| s.replica == c.name)
                    .or_else(|| s.iter().find(|s| s.replica == c.name))
            })
        };
        let seen = |i: usize, c: &'a Candidate<'a>| {
            let said = said(i, c);
            let state = said.map_or(
                ReplicaState::Degraded(kvevent_index::Degraded::Connecting),
                |s| s.state,
            );
            let said_tokens = said.map_or(0, |s| s.matched_tokens);
            let (queued, load) = Self::queued(c, said.and_then(|s| s.load), fresh_since);
            Seen {
                c,
                exact_tokens: if state.is_exact() { said_tokens } else { 0 },
                said_tokens,
                state,
                queued,
                load,
            }
        };
        // A candidate known down (its engine lost, its server down, its pod not ready, or
        // stale) is passed over while another can serve; if none can, every one is weighed.
        let serves = |i: usize, c: &Candidate<'_>| said(i, c).is_none_or(|s| s.state.can_serve());
        let none_serving = !candidates.iter().enumerate().any(|(i, c)| serves(i, c));
        let eligible = |i: usize, c: &Candidate<'_>| none_serving || serves(i, c);
        let choice = |s: &Seen<'a>, cost_us: f64, by_match: bool| Choice {
            replica: s.c.name,
            matched_tokens: s.said_tokens,
            state: s.state,
            failed_open: !(by_match && s.exact_tokens > 0),
            compute_tokens: request.prompt_tokens.saturating_sub(s.exact_tokens),
            queued: s.queued,
            load: s.load,
            cost_us,
            none_serving,
        };
        match policy {
            Policy::RoundRobin => {
                // Each eligible candidate in turn: the turn's candidate when it is eligible
                // (one look, the usual case); else the turn counted over the eligible ones.
                let turn = self.turn.fetch_add(1, Relaxed);
                let k = turn % candidates.len();
                let i = if eligible(k, &candidates[k]) {
                    k
                } else {
                    let n = candidates
                        .iter()
                        .enumerate()
                        .filter(|(i, c)| eligible(*i, c))
                        .count();
                    candidates
                        .iter()
                        .enumerate()
                        .filter(|(i, c)| eligible(*i, c))
                        .nth(turn % n.max(1))
                        .map_or(0, |(i, _)| i)
                };
                Some(choice(&seen(i, &candidates[i]), 0.0, false))
            }
            Policy::LeastLoaded => {
                // The fewest ahead; ties in turn. Two passes, nothing kept but counts; one look
                // at each candidate's answer a pass (`None`: not eligible).
                let ahead = |i: usize, c: &Candidate<'_>| {
                    let said = said(i, c);
                    (none_serving || said.is_none_or(|s| s.state.can_serve()))
                        .then(|| Self::queued(c, said.and_then(|s| s.load), fresh_since).0)
                };
                let (mut least, mut tied) = (u32::MAX, 0usize);
                for (i, c) in candidates.iter().enumerate() {
                    let Some(q) = ahead(i, c) else {
                        continue;
                    };
                    if q < least {
                        (least, tied) = (q, 1);
                    } else if q == least {
                        tied += 1;
                    }
                }
                let mut pick = self.turn.fetch_add(1, Relaxed) % tied.max(1);
                let i = candidates
                    .iter()
                    .enumerate()
                    .position(|(i, c)| {
                        if ahead(i, c) != Some(least) {
                            return false;
                        }
                        if pick == 0 {
                            return true;
                        }
                        pick -= 1;
                        false
                    })
                    .unwrap_or(0);
                Some(choice(&seen(i, &candidates[i]), 0.0, false))
            }
            Policy::PrefixOnly => {
                // The exact holder of most, ties by fewer in flight then name; else the least
                // busy.
                let busy = |c: &Candidate<'a>| (c.flights.in_flight(), c.name);
                let mut best: Option<(u32, usize)> = None;
                let mut idlest: Option<usize> = None;
                for (i, c) in candidates.iter().enumerate() {
                    let said = said(i, c);
                    if !(none_serving || said.is_none_or(|s| s.state.can_serve())) {
                        continue;
                    }
                    if idlest.is_none_or(|j| busy(c) < busy(&candidates[j])) {
                        idlest = Some(i);
                    }
                    let exact = said
                        .filter(|s| s.state.is_exact())
                        .map_or(0, |s| s.matched_tokens);
                    let better = match best {
                        _ if exact == 0 => false,
                        None => true,
                        Some((t, b)) => exact > t || (exact == t && busy(c) < busy(&candidates[b])),
                    };
                    if better {
                        best = Some((exact, i));
                    }
                }
                let i = best.map_or(idlest.unwrap_or(0), |(_, i)| i);
                Some(choice(&seen(i, &candidates[i]), 0.0, true))
            }
            Policy::Cost(w) => {
                // The cheapest; on a tie, the prompt's own ranking decides (names are hashed
                // only then). Only the winner's view is kept.
                let mut best: Option<(f64, Option<u64>, usize)> = None;
                for (i, c) in candidates.iter().enumerate() {
                    let said = said(i, c);
                    if !(none_serving || said.is_none_or(|s| s.state.can_serve())) {
                        continue;
                    }
                    let exact = said
                        .filter(|s| s.state.is_exact())
                        .map_or(0, |s| s.matched_tokens);
                    let (queued, _) = Self::queued(c, said.and_then(|s| s.load), fresh_since);
                    let compute = request.prompt_tokens.saturating_sub(exact);
                    let cost = w.prefill_us_per_token
                        * (f64::from(compute) + c.flights.prefilling() as f64)
                        + w.queue_us_per_request * f64::from(queued);
                    match &mut best {
                        Some((b, _, _)) if cost > *b => {}
                        Some((b, rank, held)) if cost == *b => {
                            let held_rank = *rank.get_or_insert_with(|| {
                                rendezvous(request.affinity, candidates[*held].name)
                            });
                            let r = rendezvous(request.affinity, c.name);
                            if r > held_rank {
                                best = Some((cost, Some(r), i));
                            }
                        }
                        _ => best = Some((cost, None, i)),
                    }
                }
                let (cost, _, i) = best?;
                Some(choice(&seen(i, &candidates[i]), cost, true))
            }
        }
    }
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
mod tests;
