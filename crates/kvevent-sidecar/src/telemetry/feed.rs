//! The router feed, when served: followers, snapshots, changes. Counted by `kvevent-feed`'s hub.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::encode;

/// The feed's hub, once the feed is served.
#[derive(Debug, Default)]
pub struct Feed(OnceLock<Arc<kvevent_feed::Hub>>);

impl Feed {
    /// The hub, when the feed is served.
    pub fn hub(&self) -> Option<&Arc<kvevent_feed::Hub>> {
        self.0.get()
    }

    /// Shows this hub's counters (the first one set).
    pub fn set(&self, hub: Arc<kvevent_feed::Hub>) {
        let _ = self.0.set(hub);
    }
}

/// Writes the hub's counters (nothing without a feed).
#[derive(Debug)]
pub(crate) struct FeedCollector(pub(crate) Arc<Feed>);

impl Collector for FeedCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let Some(hub) = self.0.hub() else {
            return Ok(());
        };
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
            encode::single(&mut enc, counter, name, help, value.load(Relaxed))?;
        }
        Ok(())
    }
}
