//! What `/metrics` shows, assembled from the areas that keep it. Each area ([`sources`],
//! [`state_file`], [`mappers`], [`delivery`], [`scrapes`], [`feed`], and the build) owns its
//! counters and writes them itself, names, help and labels included, as a prometheus-client
//! collector; this module holds the areas for the sidecar and `/readyz`, and registers their
//! collectors once, in the order `/metrics` shows them.

mod build;
pub mod delivery;
mod encode;
pub mod feed;
pub mod mappers;
pub mod scrapes;
pub mod sources;
pub mod state_file;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use kvevent_forwarder as fwd;
use kvevent_source::{Health, SourceMetrics};
use prometheus_client::registry::Registry;

pub use delivery::Delivery;
pub use feed::Feed;
pub use mappers::{MapperView, Mappers};
pub use scrapes::Scrapes;
pub use sources::Sources;
pub use state_file::{StateFile, StateWrites};

/// The areas' counters, shared by the threads that count and the endpoint that shows them.
#[derive(Debug)]
pub struct Telemetry {
    /// The engine sources.
    pub sources: Arc<Sources>,
    /// The mappers, by source.
    pub mappers: Arc<Mappers>,
    /// Delivery to the server: the forwarder and the server probe.
    pub delivery: Arc<Delivery>,
    /// Engine `/metrics` scrapes and stats reports.
    pub scrapes: Arc<Scrapes>,
    /// The state file.
    pub state_file: Arc<StateFile>,
    /// The router feed, when served.
    pub feed: Arc<Feed>,
    /// The engine sockets are open.
    pub subscribed: AtomicBool,
    /// Every area's collector, registered once.
    registry: Registry,
}

impl Telemetry {
    /// Empty telemetry for these sources.
    pub fn new(
        labels: Vec<String>,
        source_metrics: Vec<Arc<SourceMetrics>>,
        source_health: Vec<Arc<Health>>,
        forwarder: Arc<fwd::Metrics>,
    ) -> Self {
        let sources = Arc::new(Sources::new(labels.clone(), source_metrics, source_health));
        let mappers = Arc::new(Mappers::new(labels));
        let delivery = Arc::new(Delivery::new(forwarder));
        let scrapes = Arc::new(Scrapes::default());
        let state_file = Arc::new(StateFile::default());
        let feed = Arc::new(Feed::default());
        let mut registry = Registry::default();
        registry.register_collector(Box::new(build::Build));
        registry.register_collector(Box::new(sources::SourcesCollector(sources.clone())));
        registry.register_collector(Box::new(state_file::StateFileCollector(state_file.clone())));
        registry.register_collector(Box::new(mappers::MappersCollector(mappers.clone())));
        registry.register_collector(Box::new(delivery::DeliveryCollector(delivery.clone())));
        registry.register_collector(Box::new(scrapes::ScrapesCollector(scrapes.clone())));
        registry.register_collector(Box::new(feed::FeedCollector(feed.clone())));
        Self {
            sources,
            mappers,
            delivery,
            scrapes,
            state_file,
            feed,
            subscribed: AtomicBool::new(false),
            registry,
        }
    }

    /// Exports the router feed's counters.
    pub fn set_feed(&self, hub: Arc<kvevent_feed::Hub>) {
        self.feed.set(hub);
    }

    /// The Prometheus text exposition of every area.
    pub fn render(&self) -> String {
        let mut text = String::with_capacity(32 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Now, in Unix milliseconds.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
