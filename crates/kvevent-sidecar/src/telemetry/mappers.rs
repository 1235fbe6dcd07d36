//! The mappers: what they skipped, refreshed and track. Copied by the events thread after each
//! batch from each source's mapper.

use std::sync::{Arc, Mutex};

use kvevent_mapper::MapperStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::{encode, lock};

/// The mappers' counters and sizes, by source.
#[derive(Debug)]
pub struct Mappers {
    /// Source labels, in index order.
    labels: Vec<String>,
    /// Per source, as the events thread last copied it.
    pub views: Mutex<Vec<MapperView>>,
}

impl Mappers {
    /// One view per source, empty.
    pub fn new(labels: Vec<String>) -> Self {
        let n = labels.len();
        Self {
            labels,
            views: Mutex::new(vec![MapperView::default(); n]),
        }
    }
}

/// A mapper's counters and sizes, as `/metrics` shows them.
#[derive(Debug, Clone, Default)]
pub struct MapperView {
    /// What it skipped, by reason.
    pub stats: MapperStats,
    /// Engine blocks it tracks.
    pub tracked: usize,
    /// Tracked blocks kept aside because their hashes collide.
    pub stashed: usize,
}

/// Writes [`Mappers`].
#[derive(Debug)]
pub(crate) struct MappersCollector(pub(crate) Arc<Mappers>);

impl Collector for MappersCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let views = lock(&self.0.views);
        let each = || self.0.labels.iter().map(String::as_str).zip(views.iter());
        {
            let mut f = encode::counter(
                &mut enc,
                "kvevent_mapper_skipped_total",
                "Blocks or events the mapper did not report, by reason.",
            )?;
            for (label, MapperView { stats: s, .. }) in each() {
                for (reason, v) in [
                    ("placeholder_store", s.placeholder_stores),
                    ("unknown_adapter", s.unknown_adapter_drops),
                    ("unknown_parent", s.unknown_parents),
                    ("unknown_removal", s.unknown_removals),
                    ("unkeyable_block", s.unkeyable_blocks),
                    ("map_full", s.map_refusals),
                    ("empty_hash", s.empty_hashes),
                ] {
                    encode::count(&mut f, &[("source", label), ("reason", reason)], v)?;
                }
            }
        }
        {
            let mut f = encode::counter(
                &mut enc,
                "kvevent_mapper_short_blocks_total",
                "Blocks stored with fewer tokens than the source's page size (an SGLang node's last page), reported as they come.",
            )?;
            for (label, MapperView { stats: s, .. }) in each() {
                encode::count(&mut f, &[("source", label)], s.short_blocks)?;
            }
        }
        {
            let mut f = encode::counter(
                &mut enc,
                "kvevent_mapper_non_prefix_blocks_total",
                "Blocks of hybrid-model KV-cache groups that are not full attention, not reported, by kind.",
            )?;
            for (label, MapperView { stats: s, .. }) in each() {
                for (kind, v) in &s.non_prefix_groups {
                    encode::count(&mut f, &[("source", label), ("kind", kind)], *v)?;
                }
            }
        }
        {
            let mut f = encode::counter(
                &mut enc,
                "kvevent_refreshed_prefixes_total",
                "Prefix entries re-reported so the server's TTL never expires a resident block.",
            )?;
            for (label, MapperView { stats: s, .. }) in each() {
                encode::count(&mut f, &[("source", label)], s.refreshed)?;
            }
        }
        {
            let mut f = encode::gauge(
                &mut enc,
                "kvevent_mapper_tracked_blocks",
                "Engine blocks tracked by the mapper.",
            )?;
            for (label, MapperView { tracked, .. }) in each() {
                encode::level(&mut f, &[("source", label)], *tracked)?;
            }
        }
        let mut f = encode::gauge(
            &mut enc,
            "kvevent_mapper_stashed_blocks",
            "Tracked blocks kept aside because their hashes collide with many others' (0 unless the engine's hashes are crafted or broken).",
        )?;
        for (label, MapperView { stashed, .. }) in each() {
            encode::level(&mut f, &[("source", label)], *stashed)?;
        }
        Ok(())
    }
}
