//! The hub's families for a sidecar's `/metrics` (feature `metrics`): read from the hub's
//! counters ([`HubMetrics`](crate::HubMetrics)) at each scrape, written where they are counted.
//!
//! | family | type | what |
//! |---|---|---|
//! | `kvevent_feed_followers` | gauge | routers following the feed now |
//! | `kvevent_feed_snapshots_total` | counter | snapshots sent |
//! | `kvevent_feed_resumes_total` | counter | streams that went on from the follower's position |
//! | `kvevent_feed_followers_cut_off_total` | counter | followers cut off for not keeping up |
//! | `kvevent_feed_streams_refused_total` | counter | streams refused (replica, model, token) |
//! | `kvevent_feed_changes_total` | counter | changes published |
//! | `kvevent_feed_epochs_total` | counter | new epochs after the first |
//! | `kvevent_feed_unkeyed_entries_total` | counter | entries not published: no fingerprint key |
//! | `kvevent_feed_ring_bytes` | gauge | bytes of changes kept for resuming followers |
//! | `kvevent_feed_blocks` | gauge | prefixes the feed holds |

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use crate::Hub;

/// Writes `hub`'s families ([module docs](self)).
pub fn encode(hub: &Hub, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
    let m = hub.metrics();
    for (name, counter, help, value) in [
        (
            "kvevent_feed_followers",
            false,
            "Routers following the feed now.",
            &m.followers,
        ),
        (
            "kvevent_feed_snapshots_total",
            true,
            "Snapshots sent to feed followers.",
            &m.snapshots,
        ),
        (
            "kvevent_feed_resumes_total",
            true,
            "Feed streams that went on from the follower's position (no snapshot).",
            &m.resumes,
        ),
        (
            "kvevent_feed_followers_cut_off_total",
            true,
            "Feed followers cut off for not keeping up (they come back with a snapshot).",
            &m.cut_off,
        ),
        (
            "kvevent_feed_streams_refused_total",
            true,
            "Feed streams refused: another replica or model asked for, or a wrong token.",
            &m.refused,
        ),
        (
            "kvevent_feed_changes_total",
            true,
            "Changes published to the feed.",
            &m.changes,
        ),
        (
            "kvevent_feed_epochs_total",
            true,
            "New feed epochs after the first (engine clears and restarts, gaps not repaired).",
            &m.new_epochs,
        ),
        (
            "kvevent_feed_unkeyed_entries_total",
            true,
            "Prefix entries not published to the feed: their key is not a fingerprint.",
            &m.unkeyed,
        ),
        (
            "kvevent_feed_ring_bytes",
            false,
            "Bytes of changes kept for followers to resume from.",
            &m.ring_bytes,
        ),
        (
            "kvevent_feed_blocks",
            false,
            "Prefixes the feed holds (what a snapshot sends).",
            &m.blocks,
        ),
    ] {
        kvevent_metrics::single(enc, counter, name, help, value.load(Relaxed))?;
    }
    Ok(())
}

/// A collector of one hub, to register once.
#[derive(Debug)]
pub struct HubCollector(pub Arc<Hub>);

impl Collector for HubCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        encode(&self.0, &mut enc)
    }
}
