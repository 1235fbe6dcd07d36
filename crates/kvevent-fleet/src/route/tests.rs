use std::sync::Arc;
use std::time::{Duration, Instant};

use kvevent_index::{
    Config, Degraded, Index, Load, LoadReading, Query, QueryKeys, RankLoad, ReplicaState, Scores,
};

use super::*;

const EXACT: ReplicaState = ReplicaState::Exact;
const DEGRADED: ReplicaState = ReplicaState::Degraded(Degraded::Unverified);

/// The prompt 0..64 (block size 16) and an index where each of `holders` holds its first `n`
/// blocks, with the state and load given; answered among `asked`.
fn scores(holders: &[(&str, usize, ReplicaState, Option<LoadReading>)], asked: &[&str]) -> Scores {
    let index = Index::new(Config::default());
    let prompt: Vec<u32> = (0..64).collect();
    for &(name, blocks, state, ref load) in holders {
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
        index.set_replica_load(name, load.clone());
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

fn load(queued: u32, read_at: Instant) -> Option<LoadReading> {
    Some(LoadReading {
        load: Load {
            ranks: vec![RankLoad {
                running: queued,
                kv_usage: Some(0.5),
                ..RankLoad::idle(0)
            }],
        },
        read_at,
        failing: false,
    })
}

fn candidates<'a>(names: &[&'a str], flights: &'a [Arc<Flights>]) -> Vec<Candidate<'a>> {
    names
        .iter()
        .zip(flights)
        .map(|(name, flights)| Candidate {
            name,
            flights: flights.as_ref(),
        })
        .collect()
}

fn flights(n: usize) -> Vec<Arc<Flights>> {
    (0..n).map(|_| Arc::default()).collect()
}

const PROMPT: Request = Request {
    prompt_tokens: 64,
    affinity: 42,
};

/// Weights where a held block (16 tokens) is worth 1.6 ms and a request ahead 1 ms.
const W: Weights = Weights {
    prefill_us_per_token: 100.0,
    queue_us_per_request: 1_000.0,
};

#[test]
fn cost_prefers_the_holder_while_its_queue_costs_less_than_the_prefix() {
    let now = Instant::now();
    let f = flights(2);
    let c = candidates(&["a", "b"], &f);
    let rule = Rule::new(Policy::Cost(W));
    // a holds all 64 tokens (6.4 ms of prefill) with 5 ahead (5 ms): a.
    let s = scores(
        &[("a", 4, EXACT, load(5, now)), ("b", 0, EXACT, load(0, now))],
        &["a", "b"],
    );
    let choice = rule.choose(Some(&s), &PROMPT, &c, now).expect("a choice");
    assert_eq!((choice.replica, choice.matched_tokens), ("a", 64));
    assert_eq!((choice.queued, choice.load), (5, LoadSeen::Fresh));
    assert!(!choice.failed_open);
    assert!(
        (choice.cost_us - 5_000.0).abs() < 1e-6,
        "{}",
        choice.cost_us
    );
    // With 7 ahead (7 ms > 6.4 ms) the prefix is cheaper to compute again on b: the hot
    // prefix spreads.
    let s = scores(
        &[("a", 4, EXACT, load(7, now)), ("b", 0, EXACT, load(0, now))],
        &["a", "b"],
    );
    let choice = rule.choose(Some(&s), &PROMPT, &c, now).expect("a choice");
    assert_eq!((choice.replica, choice.matched_tokens), ("b", 0));
    assert!(choice.failed_open);
}

#[test]
fn what_this_router_sent_since_the_load_was_read_counts_as_queued() {
    let read = Instant::now();
    let f = flights(2);
    let c = candidates(&["a", "b"], &f);
    let rule = Rule::new(Policy::Cost(W));
    let s = scores(
        &[
            ("a", 4, EXACT, load(0, read)),
            ("b", 0, EXACT, load(0, read)),
        ],
        &["a", "b"],
    );
    // A burst after the read: each request sent to a is one more ahead of the next, until
    // the prefix is cheaper elsewhere (7 > 6.4 ms), although the load still says 0.
    let mut held = Vec::new();
    let mut to_a = 0;
    for _ in 0..10 {
        let choice = rule
            .choose(Some(&s), &PROMPT, &c, Instant::now())
            .expect("a choice");
        if choice.replica == "a" {
            to_a += 1;
            held.push(f[0].start());
        } else {
            break;
        }
    }
    assert_eq!(to_a, 7, "sent to the holder before spreading");
    assert_eq!(f[0].sent_since(read), 7);
    assert_eq!(f[0].ended_since(read), 0);
    // Requests that ended since the read no longer count: the holder is free again.
    held.clear();
    assert_eq!((f[0].in_flight(), f[0].ended_since(read)), (0, 7));
    assert_eq!(
        rule.choose(Some(&s), &PROMPT, &c, Instant::now())
            .expect("a choice")
            .replica,
        "a"
    );
}

#[test]
fn this_routers_requests_that_ended_since_the_load_was_read_no_longer_count() {
    let f = flights(2);
    let c = candidates(&["a", "b"], &f);
    let rule = Rule::new(Policy::Cost(W));
    // Seven of this router's requests were running on the holder when its load was read.
    let held: Vec<_> = (0..7).map(|_| f[0].start()).collect();
    let read = Instant::now();
    let s = scores(
        &[
            ("a", 4, EXACT, load(7, read)),
            ("b", 0, EXACT, load(0, read)),
        ],
        &["a", "b"],
    );
    let choose = || {
        rule.choose(Some(&s), &PROMPT, &c, Instant::now())
            .expect("a choice")
    };
    assert_eq!((choose().replica, choose().queued), ("b", 0));
    // They end before the next read: the holder is free, whatever the load last said.
    drop(held);
    let choice = choose();
    assert_eq!((choice.replica, choice.queued), ("a", 0));
}

#[test]
fn an_old_load_is_not_used_and_the_router_s_own_requests_stand_in() {
    let now = Instant::now();
    let long_ago = now - Duration::from_secs(5);
    let f = flights(2);
    let c = candidates(&["a", "b"], &f);
    let rule = Rule::new(Policy::Cost(W));
    // An old load of 50 ahead on the holder: not believed.
    let s = scores(
        &[("a", 4, EXACT, load(50, long_ago)), ("b", 0, EXACT, None)],
        &["a", "b"],
    );
    let choice = rule.choose(Some(&s), &PROMPT, &c, now).expect("a choice");
    assert_eq!(
        (choice.replica, choice.load, choice.queued),
        ("a", LoadSeen::Old, 0)
    );
    let _busy: Vec<_> = (0..8).map(|_| f[0].start()).collect();
    let choice = rule.choose(Some(&s), &PROMPT, &c, now).expect("a choice");
    assert_eq!((choice.replica, choice.load), ("b", LoadSeen::None));
    // A fresh load of fewer than this router has in flight counts what is in flight.
    let read = Instant::now();
    let s = scores(&[("a", 4, EXACT, load(1, read))], &["a"]);
    let choice = rule
        .choose(Some(&s), &PROMPT, &c[..1], read)
        .expect("a choice");
    assert_eq!(choice.queued, 8);
}

#[test]
fn a_replica_not_exact_is_never_preferred_for_what_it_claims() {
    let now = Instant::now();
    let f = flights(2);
    let c = candidates(&["a", "b"], &f);
    let s = scores(
        &[
            ("a", 4, DEGRADED, load(0, now)),
            ("b", 1, EXACT, load(1, now)),
        ],
        &["a", "b"],
    );
    // b: 48 tokens to compute (4.8 ms) + 1 ms; a, counted as holding nothing: 6.4 ms.
    let choice = Rule::new(Policy::Cost(W))
        .choose(Some(&s), &PROMPT, &c, now)
        .expect("a choice");
    assert_eq!((choice.replica, choice.matched_tokens), ("b", 16));
    let choice = Rule::new(Policy::PrefixOnly)
        .choose(Some(&s), &PROMPT, &c, now)
        .expect("a choice");
    assert_eq!(choice.replica, "b");
}

#[test]
fn a_prompt_nobody_holds_spreads_by_its_own_affinity_and_its_next_turn_follows() {
    let now = Instant::now();
    let names = ["r0", "r1", "r2", "r3"];
    let f = flights(4);
    let c = candidates(&names, &f);
    let rule = Rule::default();
    let mut per = [0; 4];
    for prompt in 0..400u32 {
        let tokens: Vec<u32> = (0..64).map(|t| t + prompt * 1000).collect();
        let request = Request {
            prompt_tokens: 64,
            affinity: affinity(&tokens, 16),
        };
        let first = rule.choose(None, &request, &c, now).expect("a choice");
        assert!(first.failed_open);
        // The next turn (same first block, longer) goes to the same replica.
        let mut longer = tokens.clone();
        longer.extend(0..100);
        let next = Request {
            prompt_tokens: longer.len() as u32,
            affinity: affinity(&longer, 16),
        };
        let again = rule.choose(None, &next, &c, now).expect("a choice");
        assert_eq!(first.replica, again.replica);
        per[names
            .iter()
            .position(|n| *n == first.replica)
            .expect("a name")] += 1;
    }
    // Spread over all four, none near the whole fleet's traffic.
    assert!(per.iter().all(|n| (60..=140).contains(n)), "{per:?}");
}

#[test]
fn prefix_only_is_the_rule_before_loads() {
    let now = Instant::now();
    let f = flights(3);
    let c = candidates(&["a", "b", "c"], &f);
    let rule = Rule::new(Policy::PrefixOnly);
    // The holder of most wins whatever its load.
    let s = scores(
        &[
            ("a", 2, EXACT, load(0, now)),
            ("b", 3, EXACT, load(90, now)),
        ],
        &["a", "b", "c"],
    );
    let choice = rule.choose(Some(&s), &PROMPT, &c, now).expect("a choice");
    assert_eq!((choice.replica, choice.matched_tokens), ("b", 48));
    // A miss in an idle fleet: the first name (what #56 found piling everything on r0).
    let choice = rule.choose(None, &PROMPT, &c, now).expect("a choice");
    assert_eq!((choice.replica, choice.failed_open), ("a", true));
    let _busy = f[0].start();
    let choice = rule.choose(None, &PROMPT, &c, now).expect("a choice");
    assert_eq!(choice.replica, "b");
}

#[test]
fn round_robin_takes_each_in_turn_and_least_loaded_the_fewest_ahead() {
    let now = Instant::now();
    let f = flights(3);
    let c = candidates(&["a", "b", "c"], &f);
    let rr = Rule::new(Policy::RoundRobin);
    let order: Vec<&str> = (0..6)
        .map(|_| rr.choose(None, &PROMPT, &c, now).expect("a choice").replica)
        .collect();
    assert_eq!(order, ["a", "b", "c", "a", "b", "c"]);
    let s = scores(
        &[
            ("a", 4, EXACT, load(3, now)),
            ("b", 0, EXACT, load(1, now)),
            ("c", 0, EXACT, load(1, now)),
        ],
        &["a", "b", "c"],
    );
    let ll = Rule::new(Policy::LeastLoaded);
    let picks: Vec<&str> = (0..4)
        .map(|_| {
            ll.choose(Some(&s), &PROMPT, &c, now)
                .expect("a choice")
                .replica
        })
        .collect();
    assert_eq!(
        picks,
        ["b", "c", "b", "c"],
        "ties in turn, never the busier holder"
    );
    assert_eq!(rr.choose(None, &PROMPT, &[], now), None);
}

#[test]
fn policies_are_named_and_parsed() {
    for name in Policy::NAMES {
        let p: Policy = name.parse().expect("a policy");
        assert_eq!(p.as_str(), name);
    }
    let e = "fastest".parse::<Policy>().expect_err("not a policy");
    assert!(e.to_string().contains("cost, prefix-only"), "{e}");
}

#[test]
fn sends_are_counted_since_an_instant() {
    let f = Arc::new(Flights::default());
    let before = Instant::now();
    assert_eq!(f.sent_since(before), 0);
    let held: Vec<_> = (0..300).map(|_| f.start()).collect();
    assert_eq!(f.in_flight(), 300);
    // Only the last 256 sends are remembered.
    assert_eq!(f.sent_since(before), 256);
    let mid = Instant::now();
    let _more = f.start();
    assert_eq!(f.sent_since(mid), 1);
    drop(held);
    assert_eq!(f.in_flight(), 1);
}

#[test]
fn prompt_tokens_in_flight_count_ahead_until_their_first_token() {
    let now = Instant::now();
    let f = flights(2);
    let c = candidates(&["a", "b"], &f);
    let rule = Rule::new(Policy::Cost(W));
    // a holds the prompt (6.4 ms saved), b nothing; neither has anything queued.
    let s = scores(
        &[("a", 4, EXACT, load(0, now)), ("b", 0, EXACT, load(0, now))],
        &["a", "b"],
    );
    let choice = rule.choose(Some(&s), &PROMPT, &c, now).expect("a choice");
    assert_eq!((choice.replica, choice.compute_tokens), ("a", 0));
    // b's compute: the whole prompt.
    let on_b = rule
        .choose(Some(&s), &PROMPT, &c[1..], now)
        .expect("a choice");
    assert_eq!(on_b.compute_tokens, 64);
    // A long prompt being computed on a (10,000 tokens: 1 s) outweighs the prefix...
    let mut long = f[0].start_prefill(10_000);
    assert_eq!(f[0].prefilling(), 10_000);
    let choice = rule.choose(Some(&s), &PROMPT, &c, now).expect("a choice");
    assert_eq!(choice.replica, "b");
    assert!(
        (choice.cost_us - 6_400.0).abs() < 1e-6,
        "{}",
        choice.cost_us
    );
    // ...until its first token: then it is one request ahead (1 ms < 6.4 ms).
    long.first_token();
    assert_eq!(f[0].prefilling(), 0);
    let choice = rule.choose(Some(&s), &PROMPT, &c, now).expect("a choice");
    assert_eq!((choice.replica, choice.queued), ("a", 1));
    // Ending a request whose first token never came ends its prefill too.
    let short = f[0].start_prefill(500);
    assert_eq!(f[0].prefilling(), 500);
    drop((short, long));
    assert_eq!((f[0].prefilling(), f[0].in_flight()), (0, 0));
}

/// Every state a replica is known down in, as its follower says it.
fn down_states() -> [ReplicaState; 4] {
    [
        ReplicaState::Degraded(Degraded::ServerDown),
        ReplicaState::Degraded(Degraded::EngineLost),
        ReplicaState::Degraded(Degraded::NotReady),
        ReplicaState::Stale {
            since: Instant::now(),
            lost: kvevent_index::Lost::Source,
        },
    ]
}

#[test]
fn a_replica_known_down_is_passed_over_under_every_policy() {
    // `a` holds the whole prompt and is idle, `b` holds nothing and is busy: every policy that
    // looks would pick `a`, round-robin would pick it every other time. Down, it never is.
    let now = Instant::now();
    for down in down_states() {
        for policy in [
            Policy::Cost(W),
            Policy::PrefixOnly,
            Policy::LeastLoaded,
            Policy::RoundRobin,
        ] {
            let s = scores(
                &[("a", 4, down, load(0, now)), ("b", 0, EXACT, load(5, now))],
                &["a", "b"],
            );
            let f = flights(2);
            let cs = candidates(&["a", "b"], &f);
            let rule = Rule::new(policy);
            for _ in 0..4 {
                let c = rule.choose(Some(&s), &PROMPT, &cs, now).expect("a choice");
                assert_eq!(
                    c.replica,
                    "b",
                    "{policy} chose a replica {}",
                    down.reason().unwrap_or_default()
                );
                assert!(!c.none_serving);
            }
        }
    }
}

#[test]
fn when_no_replica_can_serve_the_rule_fails_open_and_says_so() {
    let now = Instant::now();
    let [server_down, engine_lost, ..] = down_states();
    for policy in [
        Policy::Cost(W),
        Policy::PrefixOnly,
        Policy::LeastLoaded,
        Policy::RoundRobin,
    ] {
        let s = scores(
            &[
                ("a", 4, server_down, load(0, now)),
                ("b", 0, engine_lost, load(5, now)),
            ],
            &["a", "b"],
        );
        let f = flights(2);
        let cs = candidates(&["a", "b"], &f);
        let c = Rule::new(policy)
            .choose(Some(&s), &PROMPT, &cs, now)
            .expect("a choice, failing open");
        assert!(c.none_serving, "{policy}");
    }
}

#[test]
fn degraded_replicas_that_can_serve_are_still_candidates() {
    // Unverified, replaying, silent: the cache is in doubt, the server is not.
    let now = Instant::now();
    let s = scores(
        &[
            ("a", 4, DEGRADED, load(0, now)),
            ("b", 0, EXACT, load(5, now)),
        ],
        &["a", "b"],
    );
    let f = flights(2);
    let cs = candidates(&["a", "b"], &f);
    let c = Rule::new(Policy::LeastLoaded)
        .choose(Some(&s), &PROMPT, &cs, now)
        .expect("a choice");
    assert_eq!((c.replica, c.none_serving), ("a", false));
}
