//! The task's rules against a model, under tokio's paused time, with a fake server behind
//! [`Deliver`]: whatever the windows, latencies and retryable failures, the server ends in the
//! state the reports describe, and every entry is sent or counted.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;

use crate::handle::spawn_with;
use crate::task::Deliver;
use crate::{Config, DrainReport, DropReason, Metrics, pb};

/// A prefix held by the server: (replica, adapter, prefix) → tier.
type Held = BTreeMap<(String, String, Vec<u8>), i32>;

#[derive(Debug, Default)]
struct Server {
    held: Held,
    /// Per call, in order: fail it (retryable), and whether it was applied first.
    faults: VecDeque<(bool, bool)>,
    latencies: VecDeque<u64>,
}

/// The fake server: applies each call when it completes (after its latency), as the real one
/// would in the order calls arrive.
#[derive(Debug, Clone, Default)]
struct Fake(Arc<Mutex<Server>>);

impl Fake {
    fn call(
        &self,
        apply: impl FnOnce(&mut Held) + Send + 'static,
    ) -> impl Future<Output = Result<pb::Ack, tonic::Status>> + Send + 'static {
        let server = self.0.clone();
        let (latency, (fail, applied)) = {
            let mut s = server.lock().expect("lock");
            let latency = s.latencies.pop_front().unwrap_or(1);
            (latency, s.faults.pop_front().unwrap_or((false, false)))
        };
        async move {
            tokio::time::sleep(Duration::from_millis(latency)).await;
            let mut s = server.lock().expect("lock");
            if fail && !applied {
                return Err(tonic::Status::unavailable("injected"));
            }
            apply(&mut s.held);
            if fail {
                // Applied, then the answer was lost: the retry applies it again.
                return Err(tonic::Status::unavailable("injected after applying"));
            }
            Ok(pb::Ack {
                accepted: true,
                ..Default::default()
            })
        }
    }
}

impl Deliver for Fake {
    fn report(
        &self,
        updates: Vec<pb::CacheStateUpdate>,
    ) -> impl Future<Output = Result<pb::Ack, tonic::Status>> + Send + 'static {
        self.call(move |held| {
            for u in updates {
                for p in u.prefixes {
                    let adapter = if p.adapter_id.is_empty() {
                        u.adapter_id.clone()
                    } else {
                        p.adapter_id
                    };
                    held.insert((u.replica_id.clone(), adapter, p.prefix_hash), p.tier);
                }
            }
        })
    }

    fn publish(
        &self,
        event: pb::CacheEvent,
    ) -> impl Future<Output = Result<pb::Ack, tonic::Status>> + Send + 'static {
        self.call(move |held| {
            if event.r#type == pb::cache_event::Type::AllCleared as i32 {
                held.retain(|(replica, _, _), _| *replica != event.replica_id);
            } else {
                held.remove(&(event.replica_id, event.adapter_id, event.prefix_hash));
            }
        })
    }

    fn address(&self) -> String {
        "fake".into()
    }
}

#[derive(Debug, Clone)]
enum Step {
    Store {
        replica: u8,
        adapter: u8,
        prefix: u8,
        tier: i32,
    },
    Evict {
        replica: u8,
        adapter: u8,
        prefix: u8,
    },
    Clear {
        replica: u8,
    },
    Wait(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..2u8, 0..2u8, 0..6u8, 0..3i32).prop_map(|(replica, adapter, prefix, tier)| {
            Step::Store { replica, adapter, prefix, tier }
        }),
        4 => (0..2u8, 0..2u8, 0..6u8)
            .prop_map(|(replica, adapter, prefix)| Step::Evict { replica, adapter, prefix }),
        1 => (0..2u8).prop_map(|replica| Step::Clear { replica }),
        3 => (0..150u64).prop_map(Step::Wait),
    ]
}

fn names(replica: u8, adapter: u8) -> (String, String) {
    (
        format!("r{replica}"),
        if adapter == 0 {
            String::new()
        } else {
            format!("lora{adapter}")
        },
    )
}

/// The report a mapper would make for `step` given what the server holds after everything
/// before it (`model`), applying it to the model.
fn report(step: &Step, model: &mut Held, ts: i64) -> Option<pb::Report> {
    match *step {
        Step::Store {
            replica,
            adapter,
            prefix,
            tier,
        } => {
            let (replica, adapter) = names(replica, adapter);
            let key = (replica.clone(), adapter.clone(), vec![prefix]);
            // The first report of a block the server does not hold is `New`.
            let new = !model.contains_key(&key);
            model.insert(key, tier);
            let update = pb::CacheStateUpdate {
                replica_id: replica,
                model_id: "m".into(),
                adapter_id: adapter,
                hash_scheme: "vllm".into(),
                timestamp_us: ts,
                prefixes: vec![pb::PrefixEntry {
                    prefix_hash: vec![prefix],
                    token_count: 16,
                    tier,
                    ..Default::default()
                }],
                ..Default::default()
            };
            Some(if new {
                pb::Report::New(update)
            } else {
                pb::Report::Update(update)
            })
        }
        Step::Evict {
            replica,
            adapter,
            prefix,
        } => {
            let (replica, adapter) = names(replica, adapter);
            model.remove(&(replica.clone(), adapter.clone(), vec![prefix]));
            Some(pb::Report::Event(pb::CacheEvent {
                r#type: pb::cache_event::Type::PrefixEvicted as i32,
                replica_id: replica,
                model_id: "m".into(),
                adapter_id: adapter,
                prefix_hash: vec![prefix],
                timestamp_us: ts,
                ..Default::default()
            }))
        }
        Step::Clear { replica } => {
            let (replica, _) = names(replica, 0);
            model.retain(|(r, _, _), _| *r != replica);
            Some(pb::Report::Event(pb::CacheEvent {
                r#type: pb::cache_event::Type::AllCleared as i32,
                replica_id: replica,
                model_id: "m".into(),
                timestamp_us: ts,
                ..Default::default()
            }))
        }
        Step::Wait(_) => None,
    }
}

/// Everything the forwarder was given, by where it ended: sent, netted away or dropped.
fn accounted(m: &Metrics) -> u64 {
    let dropped: u64 = DropReason::ALL
        .iter()
        .map(|r| m.dropped_prefixes(*r) + m.dropped_events(*r))
        .sum();
    let r = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    r(&m.prefixes_sent)
        + r(&m.evictions_sent)
        + r(&m.clears_sent)
        + r(&m.cancelled)
        + r(&m.coalesced)
        + r(&m.superseded_by_clear)
        + dropped
}

/// Runs `steps` through a forwarder delivering to a fake server; returns the model's final
/// state, the server's, the drain report, and (given, accounted) entry counts.
fn run(
    steps: &[Step],
    faults: Vec<(bool, bool)>,
    latencies: Vec<u64>,
    max_pending: usize,
) -> (Held, Held, DrainReport, u64, u64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    rt.block_on(async {
        let fake = Fake::default();
        {
            let mut s = fake.0.lock().expect("lock");
            s.faults = faults.into();
            s.latencies = latencies.into();
        }
        let config = Config {
            window: Duration::from_millis(100),
            max_pending,
            max_in_flight: 4,
            backoff_initial: Duration::from_millis(10),
            backoff_max: Duration::from_millis(200),
            ..Config::default()
        };
        let (handle, forwarder) = spawn_with(fake.clone(), config);
        let mut model = Held::new();
        let mut given = 0;
        for (i, step) in steps.iter().enumerate() {
            if let Step::Wait(ms) = step {
                tokio::time::sleep(Duration::from_millis(*ms)).await;
            }
            if let Some(r) = report(step, &mut model, 1_000 + i as i64) {
                given += 1;
                handle.submit(r).await.expect("open");
            }
        }
        let left = forwarder.shutdown(Duration::from_secs(3600)).await;
        let held = fake.0.lock().expect("lock").held.clone();
        let accounted = accounted(handle.metrics());
        (model, held, left, given, accounted)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Nothing shed: the server ends holding exactly what the reports describe, whatever the
    /// windows, the latencies and the retryable failures (before or after applying).
    #[test]
    fn the_server_ends_in_the_state_the_reports_describe(
        steps in prop::collection::vec(step(), 1..60),
        faults in prop::collection::vec((prop::bool::weighted(0.2), any::<bool>()), 0..40),
        latencies in prop::collection::vec(0..300u64, 0..60),
    ) {
        let (model, held, left, given, accounted) = run(&steps, faults, latencies, 100_000);
        prop_assert_eq!(left, DrainReport::default());
        prop_assert_eq!(given, accounted, "every entry sent or netted away");
        prop_assert_eq!(held, model);
    }

    /// A small bound: what is shed is counted, and everything given is sent, netted or
    /// counted as dropped.
    #[test]
    fn under_a_small_bound_every_entry_is_sent_netted_or_counted(
        steps in prop::collection::vec(step(), 1..80),
        faults in prop::collection::vec((prop::bool::weighted(0.3), any::<bool>()), 0..40),
        latencies in prop::collection::vec(0..300u64, 0..60),
    ) {
        let (_, _, left, given, accounted) = run(&steps, faults, latencies, 3);
        prop_assert_eq!(left, DrainReport::default());
        prop_assert_eq!(given, accounted);
    }
}

/// A window whose only work nets away (a block stored and evicted within it) has no call to
/// make: it must be settled at once, not wait for an answer that never comes with everything
/// after it queued behind (the forwarder stopped delivering for good before this was found).
#[test]
fn a_window_that_nets_to_nothing_does_not_hold_up_the_next() {
    let steps = [
        Step::Store {
            replica: 0,
            adapter: 0,
            prefix: 1,
            tier: 0,
        },
        Step::Evict {
            replica: 0,
            adapter: 0,
            prefix: 1,
        },
        Step::Wait(150),
        Step::Store {
            replica: 0,
            adapter: 0,
            prefix: 2,
            tier: 0,
        },
    ];
    let (model, held, left, given, accounted) = run(&steps, vec![], vec![], 100_000);
    assert_eq!(left, DrainReport::default());
    assert_eq!((given, accounted), (3, 3));
    assert_eq!(held, model);
    assert_eq!(held.len(), 1);
}
