//! A Fleet's `/metrics` (feature `metrics`): a `prometheus-client` [`Collector`] a router
//! registers once; each scrape reads the fleet then (no counters kept twice).
//!
//! | family | type | labels | what |
//! |---|---|---|---|
//! | `kvevent_replica_state` | gauge | `replica`, `state`, `reason` | 1 for the replica's state now (`reason` empty when exact) |
//! | `kvevent_replica_exact` | gauge | `replica` | 1 while the replica is exact |
//! | `kvevent_replica_blocks` | gauge | `replica` | blocks it holds, as known |
//! | `kvevent_replica_batches_total` | counter | `replica` | engine batches, or feed messages of changes, applied |
//! | `kvevent_index_keys` | gauge | | distinct prefixes in the index |
//! | `kvevent_index_pairs` | gauge | | (prefix, engine rank) pairs |
//! | `kvevent_index_shared_pairs` | gauge | | pairs of ranks holding the same prefix |
//! | `kvevent_index_duplication_ratio` | gauge | | 1 − keys ÷ pairs |
//! | `kvevent_index_bytes` | gauge | | bytes the index's tables and holder lists hold |
//! | `kvevent_index_stashed` | gauge | | keys kept aside for colliding hashes (0 unless crafted) |
//! | `kvevent_index_evicted_keys_total` | counter | | keys dropped by the byte budget |
//! | `kvevent_index_applied_total` | counter | | block events applied |
//! | `kvevent_router_predictions_total` | counter | `replica`, `outcome` | decisions recorded ([`Fleet::record`](crate::Fleet::record)): `exact`, `optimistic`, `pessimistic` |
//! | `kvevent_router_prediction_error_blocks` | histogram | `replica` | expected − reused blocks (positive: optimistic) |
//!
//! And [`RouterCollector`], the routing loop's ([`route::Router`](crate::route::Router)):
//!
//! | family | type | labels | what |
//! |---|---|---|---|
//! | `kvevent_router_retries_total` | counter | `replica`, `reason` | requests sent again because this replica failed them before any byte reached the client (`refused`, `502`, `503`) |
//! | `kvevent_router_none_serving_total` | counter | | choices made when no candidate could serve (failing open) |
//! | `kvevent_router_prefill_seconds_per_token` | gauge | `source` | the cost policy's weight of a prompt token (its `prefill_us_per_token`, in seconds), as the next choice uses it: `learned` ([`Router::learning`](crate::route::Router::learning)) or `given` |
//! | `kvevent_router_queue_seconds_per_request` | gauge | `source` | the cost policy's weight of a request ahead (`queue_us_per_request`, in seconds), likewise |
//! | `kvevent_router_weight_flights_total` | counter | | flights the weights were learned from |
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use kvevent_fleet::{Fleet, FleetConfig};
//! let fleet = Arc::new(Fleet::new(FleetConfig::default())?);
//! let mut registry = prometheus_client::registry::Registry::default();
//! registry.register_collector(Box::new(kvevent_fleet::metrics::FleetCollector::new(fleet)));
//! let mut text = String::new();
//! prometheus_client::encoding::text::encode(&mut text, &registry)?;
//! assert!(text.contains("# TYPE kvevent_index_keys gauge"));
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Arc;

use kvevent_metrics as m;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use crate::{ERROR_BUCKETS, Fleet};

/// The fleet's families ([module docs](self)).
#[derive(Debug)]
pub struct FleetCollector(Arc<Fleet>);

impl FleetCollector {
    /// A collector of `fleet`.
    pub fn new(fleet: Arc<Fleet>) -> Self {
        Self(fleet)
    }
}

impl Collector for FleetCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let fleet = &self.0;
        let replicas = fleet.replicas();
        let mut f = m::gauge(
            &mut enc,
            "kvevent_replica_state",
            "1 for each replica's state now (exact, degraded, stale) and its reason",
        )?;
        for r in &replicas {
            let labels = [
                ("replica", r.name.as_str()),
                ("state", r.state.as_str()),
                ("reason", r.state.reason().unwrap_or("")),
            ];
            m::level(&mut f, &labels, 1i64)?;
        }
        let per_replica = |enc: &mut DescriptorEncoder<'_>,
                           name: &'static str,
                           help: &str,
                           value: &dyn Fn(&crate::ReplicaStatus) -> i64|
         -> fmt::Result {
            let mut f = m::gauge(enc, name, help)?;
            for r in &replicas {
                m::level(&mut f, &[("replica", r.name.as_str())], value(r))?;
            }
            Ok(())
        };
        per_replica(
            &mut enc,
            "kvevent_replica_exact",
            "1 while the replica is exact: the only state to route on",
            &|r| i64::from(r.state.is_exact()),
        )?;
        per_replica(
            &mut enc,
            "kvevent_replica_blocks",
            "Blocks the replica holds, as the fleet knows",
            &|r| r.blocks as i64,
        )?;
        let mut f = m::counter(
            &mut enc,
            "kvevent_replica_batches_total",
            "Engine batches, or feed messages of changes, applied for the replica",
        )?;
        for r in &replicas {
            m::count(&mut f, &[("replica", r.name.as_str())], r.batches)?;
        }
        let s = fleet.stats();
        for (name, help, value) in [
            (
                "kvevent_index_keys",
                "Distinct prefixes in the index.",
                s.keys,
            ),
            (
                "kvevent_index_pairs",
                "(prefix, engine rank) pairs in the index",
                s.pairs,
            ),
            (
                "kvevent_index_shared_pairs",
                "Pairs of engine ranks holding the same prefix",
                s.shared_pairs as usize,
            ),
            (
                "kvevent_index_bytes",
                "Bytes of the index's key tables and holder lists",
                s.bytes,
            ),
            (
                "kvevent_index_stashed",
                "Keys and blocks kept aside for hashes that collide with many others' (0 unless crafted or broken)",
                s.stashed,
            ),
        ] {
            m::single(&mut enc, false, name, help, value as u64)?;
        }
        m::level(
            &mut m::gauge(
                &mut enc,
                "kvevent_index_duplication_ratio",
                "1 - keys / pairs: the share of pairs whose prefix another rank also holds",
            )?,
            &[],
            s.duplication(),
        )?;
        m::single(
            &mut enc,
            true,
            "kvevent_index_evicted_keys_total",
            "Keys the index's byte budget dropped",
            s.evicted_keys,
        )?;
        m::single(
            &mut enc,
            true,
            "kvevent_index_applied_total",
            "Block events the index applied",
            s.applied,
        )?;
        let accounting = fleet.accounting();
        let mut f = m::counter(
            &mut enc,
            "kvevent_router_predictions_total",
            "Routing decisions recorded, by how the prediction compared with what the engine reused",
        )?;
        for (replica, a) in &accounting {
            for (outcome, n) in [
                ("exact", a.exact),
                ("optimistic", a.optimistic),
                ("pessimistic", a.pessimistic),
            ] {
                m::count(
                    &mut f,
                    &[("replica", replica.as_str()), ("outcome", outcome)],
                    n,
                )?;
            }
        }
        let mut f = m::histogram(
            &mut enc,
            "kvevent_router_prediction_error_blocks",
            "Expected minus reused blocks per decision (positive: the index promised more)",
        )?;
        for (replica, a) in &accounting {
            let mut total = 0;
            let cumulative: Vec<(f64, u64)> = ERROR_BUCKETS
                .iter()
                .map(|le| *le as f64)
                .chain(std::iter::once(f64::INFINITY))
                .zip(a.error_blocks)
                .map(|(le, n)| {
                    total += n;
                    (le, total)
                })
                .collect();
            m::buckets(
                &mut f,
                &[("replica", replica.as_str())],
                &cumulative,
                a.error_sum as f64,
                a.decisions,
            )?;
        }
        Ok(())
    }
}

/// The routing loop's families ([module docs](self)).
#[derive(Debug)]
pub struct RouterCollector(Arc<crate::route::Router>);

impl RouterCollector {
    /// A collector of `router`.
    pub fn new(router: Arc<crate::route::Router>) -> Self {
        Self(router)
    }
}

impl Collector for RouterCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let c = self.0.counters();
        let mut f = m::counter(
            &mut enc,
            "kvevent_router_retries_total",
            "Requests sent again because this replica failed them before any byte reached the client, by why",
        )?;
        for (replica, why, n) in &c.retries {
            m::count(
                &mut f,
                &[("replica", replica.as_str()), ("reason", why.as_str())],
                *n,
            )?;
        }
        m::single(
            &mut enc,
            true,
            "kvevent_router_none_serving_total",
            "Choices made when no candidate could serve (each was known down): failing open",
            c.none_serving,
        )?;
        let Some(w) = self.0.weights() else {
            return Ok(());
        };
        let source = [("source", if w.learned { "learned" } else { "given" })];
        m::level(
            &mut m::gauge(
                &mut enc,
                "kvevent_router_prefill_seconds_per_token",
                "The cost policy's weight of a prompt token to compute, in seconds, as the next choice uses it",
            )?,
            &source,
            w.weights.prefill_us_per_token / 1e6,
        )?;
        m::level(
            &mut m::gauge(
                &mut enc,
                "kvevent_router_queue_seconds_per_request",
                "The cost policy's weight of a request ahead, in seconds, as the next choice uses it",
            )?,
            &source,
            w.weights.queue_us_per_request / 1e6,
        )?;
        m::single(
            &mut enc,
            true,
            "kvevent_router_weight_flights_total",
            "Flights the cost policy's weights were learned from (their time to first token)",
            w.flights,
        )
    }
}
