//! The router feed, when served: followers, snapshots, changes. Counted by `kvevent-feed`'s hub.

use std::sync::{Arc, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

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

/// Writes the hub's families, as `kvevent-feed` names them (nothing without a feed).
#[derive(Debug)]
pub(crate) struct FeedCollector(pub(crate) Arc<Feed>);

impl Collector for FeedCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let Some(hub) = self.0.hub() else {
            return Ok(());
        };
        kvevent_feed::metrics::encode(hub, &mut enc)
    }
}
