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

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, NoLabelSet};
use prometheus_client::metrics::MetricType;

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

type Labels<'a> = Vec<(&'static str, &'a str)>;

fn gauge<V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: &[(Labels<'_>, V)],
) -> fmt::Result {
    let mut family = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        if labels.is_empty() {
            family.encode_gauge(value)?;
        } else {
            family.encode_family(labels)?.encode_gauge(value)?;
        }
    }
    Ok(())
}

/// `name` without `_total`: the encoder adds it to a counter.
fn counter(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: &[(Labels<'_>, u64)],
) -> fmt::Result {
    let mut family = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in samples {
        if labels.is_empty() {
            family.encode_counter::<NoLabelSet, _, f64>(value, None)?;
        } else {
            family
                .encode_family(labels)?
                .encode_counter::<NoLabelSet, _, f64>(value, None)?;
        }
    }
    Ok(())
}

impl Collector for FleetCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let fleet = &self.0;
        let replicas = fleet.replicas();
        let states: Vec<(Labels<'_>, i64)> = replicas
            .iter()
            .map(|r| {
                let labels = vec![
                    ("replica", r.name.as_str()),
                    ("state", r.state.as_str()),
                    ("reason", r.state.reason().unwrap_or("")),
                ];
                (labels, 1i64)
            })
            .collect();
        gauge(
            &mut enc,
            "kvevent_replica_state",
            "1 for each replica's state now (exact, degraded, stale) and its reason",
            &states,
        )?;
        let per = |f: &dyn Fn(&crate::ReplicaStatus) -> i64| -> Vec<(Labels<'_>, i64)> {
            replicas
                .iter()
                .map(|r| (vec![("replica", r.name.as_str())], f(r)))
                .collect()
        };
        gauge(
            &mut enc,
            "kvevent_replica_exact",
            "1 while the replica is exact: the only state to route on",
            &per(&|r| i64::from(r.state.is_exact())),
        )?;
        gauge(
            &mut enc,
            "kvevent_replica_blocks",
            "Blocks the replica holds, as the fleet knows",
            &per(&|r| r.blocks as i64),
        )?;
        let batches: Vec<(Labels<'_>, u64)> = replicas
            .iter()
            .map(|r| (vec![("replica", r.name.as_str())], r.batches))
            .collect();
        counter(
            &mut enc,
            "kvevent_replica_batches",
            "Engine batches, or feed messages of changes, applied for the replica",
            &batches,
        )?;
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
            gauge(&mut enc, name, help, &[(Vec::new(), value as i64)])?;
        }
        gauge(
            &mut enc,
            "kvevent_index_duplication_ratio",
            "1 - keys / pairs: the share of pairs whose prefix another rank also holds",
            &[(Vec::new(), s.duplication())],
        )?;
        counter(
            &mut enc,
            "kvevent_index_evicted_keys",
            "Keys the index's byte budget dropped",
            &[(Vec::new(), s.evicted_keys)],
        )?;
        counter(
            &mut enc,
            "kvevent_index_applied",
            "Block events the index applied",
            &[(Vec::new(), s.applied)],
        )?;
        let accounting = fleet.accounting();
        let predictions: Vec<(Labels<'_>, u64)> = accounting
            .iter()
            .flat_map(|(replica, a)| {
                [
                    ("exact", a.exact),
                    ("optimistic", a.optimistic),
                    ("pessimistic", a.pessimistic),
                ]
                .map(|(outcome, n)| (vec![("replica", replica.as_str()), ("outcome", outcome)], n))
            })
            .collect();
        counter(
            &mut enc,
            "kvevent_router_predictions",
            "Routing decisions recorded, by how the prediction compared with what the engine reused",
            &predictions,
        )?;
        let mut family = enc.encode_descriptor(
            "kvevent_router_prediction_error_blocks",
            "Expected minus reused blocks per decision (positive: the index promised more)",
            None,
            MetricType::Histogram,
        )?;
        for (replica, a) in &accounting {
            // prometheus-client writes the bound f64::MAX as `+Inf`.
            let buckets: Vec<(f64, u64)> = ERROR_BUCKETS
                .iter()
                .map(|le| *le as f64)
                .chain(std::iter::once(f64::MAX))
                .zip(a.error_blocks)
                .collect();
            family
                .encode_family(&[("replica", replica.as_str())])?
                .encode_histogram::<NoLabelSet>(a.error_sum as f64, a.decisions, &buckets, None)?;
        }
        Ok(())
    }
}
