//! Every counter the crates keep, in one place, rendered in the Prometheus text format.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kvevent_forwarder as fwd;
use kvevent_mapper::MapperStats;
use kvevent_source::{DECODE_FAILURE_KINDS, ResetReason, SourceMetrics};

/// Shared handles to every counter, read by `/metrics` and `/readyz`.
#[derive(Debug)]
pub struct Telemetry {
    /// Source labels, in index order.
    pub sources: Vec<String>,
    /// Per-source transport and state counters.
    pub source_metrics: Vec<Arc<SourceMetrics>>,
    /// Per-source mapper counters and sizes (copied by the events thread after each batch).
    pub mappers: Mutex<Vec<MapperView>>,
    /// The forwarder's counters.
    pub forwarder: Arc<fwd::Metrics>,
    /// Scrapes by outcome (`ok` or the error kind).
    pub scrapes: Mutex<BTreeMap<&'static str, u64>>,
    /// Stats reports by outcome (`ok`, `rejected`, `rpc_error`).
    pub stats_reports: Mutex<BTreeMap<&'static str, u64>>,
    /// Scrapes that lacked a series the stats use (reported as 0), by series.
    pub scrape_absent: Mutex<BTreeMap<&'static str, u64>>,
    /// Samples skipped because they were NaN or ±Inf.
    pub scrape_non_finite: AtomicU64,
    /// Unix time (ms) of the last stats report the server accepted.
    pub stats_last_success_unix_ms: AtomicU64,
    /// The engine sockets are open and their threads running.
    pub subscribed: AtomicBool,
    /// Reports not handed to the forwarder because it had shut down.
    pub reports_after_shutdown: AtomicU64,
    /// Per source: Unix ms of its last batch (0: none yet).
    pub last_batch_unix_ms: Vec<AtomicU64>,
    /// Unix ms the pipeline started.
    pub started_unix_ms: u64,
    /// State file writes by outcome.
    pub state_writes: StateWrites,
    /// Size of the last state file written, in bytes.
    pub state_bytes: AtomicU64,
    /// Time the last state file write took (encode, write, fsync, rename), in microseconds.
    pub state_write_us: AtomicU64,
    /// Engine `/metrics` scrape durations.
    pub scrape_seconds: fwd::Histogram,
    /// Why the server could not be reached at the last probe (`None`: reached, or not probed
    /// yet).
    pub server_unreachable: Mutex<Option<String>>,
    /// The server was probed at least once.
    pub server_probed: AtomicBool,
    /// The router feed's hub, when the feed is served.
    pub feed: std::sync::OnceLock<Arc<kvevent_feed::Hub>>,
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

/// State file writes by outcome.
#[derive(Debug, Default)]
pub struct StateWrites {
    /// Written.
    pub written: AtomicU64,
    /// Failed (the disk, the path).
    pub failed: AtomicU64,
    /// Skipped: the previous write was still running.
    pub skipped: AtomicU64,
}

impl StateWrites {
    /// Each outcome's label, as `/metrics` names it, with its count.
    pub fn by_outcome(&self) -> [(&'static str, &AtomicU64); 3] {
        [
            ("written", &self.written),
            ("failed", &self.failed),
            ("skipped", &self.skipped),
        ]
    }
}

/// Bounds of the scrape duration histogram, in seconds.
const SCRAPE_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Metric names, one scheme: `kvevent_<what>_<unit>_total`.
pub mod names {
    /// Blocks shorter than the source's page size.
    pub const SHORT_BLOCKS: &str = "kvevent_mapper_short_blocks";
    /// Routers following the feed now.
    pub const FEED_FOLLOWERS: &str = "kvevent_feed_followers";
    /// Snapshots sent.
    pub const FEED_SNAPSHOTS: &str = "kvevent_feed_snapshots";
    /// Streams resumed without a snapshot.
    pub const FEED_RESUMES: &str = "kvevent_feed_resumes";
    /// Followers cut off.
    pub const FEED_CUT_OFF: &str = "kvevent_feed_followers_cut_off";
    /// Streams refused.
    pub const FEED_REFUSED: &str = "kvevent_feed_streams_refused";
    /// Changes published.
    pub const FEED_CHANGES: &str = "kvevent_feed_changes";
    /// New epochs.
    pub const FEED_EPOCHS: &str = "kvevent_feed_epochs";
    /// Entries not published (not fingerprint keys).
    pub const FEED_UNKEYED: &str = "kvevent_feed_unkeyed_entries";
    /// Ring bytes.
    pub const FEED_RING_BYTES: &str = "kvevent_feed_ring_bytes";
    /// Prefixes held.
    pub const FEED_BLOCKS: &str = "kvevent_feed_blocks";
    /// Build information (gauge, 1).
    pub const BUILD_INFO: &str = "kvevent_build_info";
    /// Events received, by source and type.
    pub const EVENTS: &str = "kvevent_events_received_total";
    /// Batches delivered, by source.
    pub const BATCHES: &str = "kvevent_batches_received_total";
    /// Payloads that failed to decode, by source and kind.
    pub const DECODE_FAILURES: &str = "kvevent_decode_failures_total";
    /// Gaps in the seq, by source.
    pub const GAPS: &str = "kvevent_seq_gaps_total";
    /// Seqs missing, by source.
    pub const MISSING: &str = "kvevent_seq_missing_total";
    /// Replays by source and outcome.
    pub const REPLAYS: &str = "kvevent_replays_total";
    /// Engine restarts (seq regressions), by source.
    pub const RESTARTS: &str = "kvevent_engine_restarts_total";
    /// Saved states resumed or refused at start, by source and outcome.
    pub const RESUMES: &str = "kvevent_state_resumes_total";
    /// State file writes by outcome (written, failed, skipped).
    pub const STATE_WRITES: &str = "kvevent_state_file_writes_total";
    /// Size of the last state file written.
    pub const STATE_BYTES: &str = "kvevent_state_file_bytes";
    /// Duration of the last state file write.
    pub const STATE_WRITE_SECONDS: &str = "kvevent_state_file_write_seconds";
    /// Seconds since a source's last batch (since the start when none came), by source.
    pub const SILENCE: &str = "kvevent_source_last_batch_age_seconds";
    /// Connection drops to the engine, by source.
    pub const DISCONNECTS: &str = "kvevent_engine_disconnects_total";
    /// Duplicate batches dropped, by source.
    pub const DUPLICATES: &str = "kvevent_duplicate_batches_total";
    /// Malformed ZMQ messages skipped, by source.
    pub const MALFORMED: &str = "kvevent_malformed_messages_total";
    /// Source resets (clears sent), by source and reason.
    pub const RESETS: &str = "kvevent_source_resets_total";
    /// Last seq delivered, by source.
    pub const LAST_SEQ: &str = "kvevent_source_last_seq";
    /// 1 while a source's state is known to be incomplete.
    pub const DEGRADED: &str = "kvevent_source_degraded";
    /// 1 while a source's SUB socket has a connection to the engine.
    pub const CONNECTED: &str = "kvevent_source_connected";
    /// Live batches dropped from the hold buffer during replays, by source.
    pub const HOLD_OVERFLOWS: &str = "kvevent_hold_buffer_overflows_total";
    /// What the mapper dropped or could not key, by source and reason.
    pub const MAPPER_SKIPPED: &str = "kvevent_mapper_skipped_total";
    /// Engine blocks tracked by the mapper, by source.
    pub const TRACKED: &str = "kvevent_mapper_tracked_blocks";
    /// Tracked blocks kept aside because their hashes collide, by source.
    pub const STASHED: &str = "kvevent_mapper_stashed_blocks";
    /// Prefix entries delivered to the server.
    pub const PREFIXES_SENT: &str = "kvevent_prefixes_sent_total";
    /// CacheStateUpdates delivered.
    pub const UPDATES_SENT: &str = "kvevent_updates_sent_total";
    /// CacheEvents delivered, by type.
    pub const EVENTS_SENT: &str = "kvevent_events_sent_total";
    /// Failed RPCs by gRPC code.
    pub const RPC_ERRORS: &str = "kvevent_rpc_errors_total";
    /// Work dropped by kind (prefix, event) and reason.
    pub const DROPPED: &str = "kvevent_dropped_total";
    /// Pending prefix entries plus events.
    pub const QUEUE_DEPTH: &str = "kvevent_queue_depth";
    /// 1 when the last probe reached the server, 0 when it did not.
    pub const SERVER_REACHABLE: &str = "kvevent_server_reachable";
    /// RPCs the forwarder lets be in flight now (adapted up to `--max-in-flight`).
    pub const IN_FLIGHT_LIMIT: &str = "kvevent_in_flight_limit";
    /// Time a window took to send, first call to last answer.
    pub const WINDOW_SEND: &str = "kvevent_window_send_seconds";
    /// Prefix entries merged into a pending identical one.
    pub const COALESCED: &str = "kvevent_coalesced_prefixes_total";
    /// Prefix entries re-reported by the refresh.
    pub const REFRESHED: &str = "kvevent_refreshed_prefixes_total";
    /// Blocks of non-full-attention KV-cache groups, by kind.
    pub const NON_PREFIX_BLOCKS: &str = "kvevent_mapper_non_prefix_blocks_total";
    /// Adds and evictions of one prefix that cancelled out while queued.
    pub const CANCELLED: &str = "kvevent_cancelled_total";
    /// Pending work discarded by a later clear.
    pub const SUPERSEDED: &str = "kvevent_superseded_by_clear_total";
    /// Unix time of the last successful report.
    pub const LAST_SUCCESS: &str = "kvevent_last_success_timestamp_seconds";
    /// Engine metrics scrapes by outcome.
    pub const SCRAPES: &str = "kvevent_scrapes_total";
    /// Scrapes that lacked a series the stats use, by series.
    pub const SCRAPE_ABSENT: &str = "kvevent_scrape_series_absent_total";
    /// Scraped samples skipped for being NaN or ±Inf.
    pub const SCRAPE_NON_FINITE: &str = "kvevent_scrape_non_finite_samples_total";
    /// RPC durations by method (histogram).
    pub const RPC_SECONDS: &str = "kvevent_rpc_duration_seconds";
    /// Engine batch time → server acknowledgement (histogram).
    pub const AGE: &str = "kvevent_report_age_seconds";
    /// Prefix entries per CacheStateUpdate sent (histogram).
    pub const UPDATE_ENTRIES: &str = "kvevent_update_entries";
    /// Engine /metrics scrape durations (histogram).
    pub const SCRAPE_SECONDS: &str = "kvevent_scrape_duration_seconds";
    /// Stats reports by outcome.
    pub const STATS_REPORTS: &str = "kvevent_stats_reports_total";
}

/// A sample value as read from our counters and gauges.
#[derive(Debug, Clone, Copy)]
enum Num {
    Int(u64),
    Float(f64),
}

trait IntoNum {
    fn num(self) -> Num;
}

impl IntoNum for u64 {
    fn num(self) -> Num {
        Num::Int(self)
    }
}

impl IntoNum for &u64 {
    fn num(self) -> Num {
        Num::Int(*self)
    }
}

impl IntoNum for i32 {
    fn num(self) -> Num {
        Num::Int(u64::try_from(self).unwrap_or_default())
    }
}

impl IntoNum for usize {
    fn num(self) -> Num {
        Num::Int(self as u64)
    }
}

impl IntoNum for f64 {
    fn num(self) -> Num {
        Num::Float(self)
    }
}

type Labels = Vec<(String, String)>;

#[derive(Debug)]
enum Sample {
    Value(Labels, Num),
    /// Upper bounds with per-bucket (not cumulative) counts, the sum, the count.
    Histogram(Labels, Vec<(f64, u64)>, f64, u64),
}

/// A family's metric type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

#[derive(Debug)]
struct Family {
    name: &'static str,
    kind: Kind,
    help: &'static str,
    samples: Vec<Sample>,
}

/// What one scrape reads, family by family, in order; encoded by prometheus-client.
#[derive(Debug, Default)]
struct Out(Vec<Family>);

fn labels(l: &[(&str, &str)]) -> Labels {
    l.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

impl Out {
    fn family(&mut self, name: &'static str, kind: Kind, help: &'static str) {
        self.0.push(Family {
            name,
            kind,
            help,
            samples: Vec::new(),
        });
    }

    fn sample(&mut self, name: &str, l: &[(&str, &str)], value: impl IntoNum) {
        if let Some(f) = self.0.last_mut() {
            debug_assert_eq!(f.name, name, "a sample outside its family");
            f.samples.push(Sample::Value(labels(l), value.num()));
        }
    }

    /// A histogram's buckets, sum and count.
    fn histogram(&mut self, name: &str, l: &[(&str, &str)], h: &fwd::Histogram) {
        let (cumulative, sum, count) = h.snapshot();
        let mut before = 0;
        let buckets = cumulative
            .into_iter()
            .map(|(le, n)| {
                let own = n - before;
                before = n;
                // prometheus-client writes the bound f64::MAX as `+Inf`.
                (if le.is_infinite() { f64::MAX } else { le }, own)
            })
            .collect();
        if let Some(f) = self.0.last_mut() {
            debug_assert_eq!(f.name, name, "a sample outside its family");
            f.samples
                .push(Sample::Histogram(labels(l), buckets, sum, count));
        }
    }
}

fn write_sample(
    m: &mut prometheus_client::encoding::MetricEncoder<'_>,
    s: &Sample,
    counter: bool,
) -> Result<(), std::fmt::Error> {
    use prometheus_client::encoding::NoLabelSet;
    match s {
        Sample::Histogram(_, buckets, sum, count) => {
            m.encode_histogram::<NoLabelSet>(*sum, *count, buckets, None)
        }
        Sample::Value(_, Num::Int(n)) if counter => {
            m.encode_counter::<NoLabelSet, u64, f64>(n, None)
        }
        Sample::Value(_, Num::Float(x)) if counter => {
            m.encode_counter::<NoLabelSet, f64, f64>(x, None)
        }
        Sample::Value(_, Num::Int(n)) => m.encode_gauge(n),
        Sample::Value(_, Num::Float(x)) => m.encode_gauge(x),
    }
}

impl prometheus_client::collector::Collector for Out {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::metrics::MetricType;
        for f in &self.0 {
            let (kind, name) = match f.kind {
                // The encoder writes a counter's samples as `<name>_total`.
                Kind::Counter => (MetricType::Counter, f.name.trim_end_matches("_total")),
                Kind::Histogram => (MetricType::Histogram, f.name),
                Kind::Gauge => (MetricType::Gauge, f.name),
            };
            let counter = matches!(kind, MetricType::Counter);
            let mut family = encoder.encode_descriptor(name, f.help, None, kind)?;
            for s in &f.samples {
                let l = match s {
                    Sample::Value(l, _) | Sample::Histogram(l, ..) => l,
                };
                // A sample without labels is written without `{}`.
                if l.is_empty() {
                    write_sample(&mut family, s, counter)?;
                } else {
                    write_sample(&mut family.encode_family(l)?, s, counter)?;
                }
            }
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Telemetry {
    /// Empty telemetry for these sources.
    pub fn new(
        sources: Vec<String>,
        source_metrics: Vec<Arc<SourceMetrics>>,
        forwarder: Arc<fwd::Metrics>,
    ) -> Self {
        let n = sources.len();
        Self {
            sources,
            source_metrics,
            mappers: Mutex::new(vec![MapperView::default(); n]),
            forwarder,
            scrapes: Mutex::new(BTreeMap::new()),
            stats_reports: Mutex::new(BTreeMap::new()),
            scrape_absent: Mutex::new(BTreeMap::new()),
            scrape_non_finite: AtomicU64::new(0),
            stats_last_success_unix_ms: AtomicU64::new(0),
            subscribed: AtomicBool::new(false),
            reports_after_shutdown: AtomicU64::new(0),
            last_batch_unix_ms: (0..n).map(|_| AtomicU64::new(0)).collect(),
            started_unix_ms: unix_ms(),
            state_writes: Default::default(),
            state_bytes: AtomicU64::new(0),
            state_write_us: AtomicU64::new(0),
            scrape_seconds: fwd::Histogram::new(SCRAPE_SECONDS),
            server_unreachable: Mutex::new(None),
            server_probed: AtomicBool::new(false),
            feed: std::sync::OnceLock::new(),
        }
    }

    /// Exports the router feed's counters.
    pub fn set_feed(&self, hub: Arc<kvevent_feed::Hub>) {
        let _ = self.feed.set(hub);
    }

    /// Seconds since `source`'s last batch, or since the start when it sent none.
    pub fn silence_seconds(&self, source: usize) -> f64 {
        let last = self
            .last_batch_unix_ms
            .get(source)
            .map_or(0, |l| l.load(Relaxed));
        let since = if last == 0 {
            self.started_unix_ms
        } else {
            last
        };
        unix_ms().saturating_sub(since) as f64 / 1000.0
    }

    /// True once any source delivered a batch.
    pub fn any_batch(&self) -> bool {
        self.last_batch_unix_ms.iter().any(|l| l.load(Relaxed) > 0)
    }

    /// Counts one scrape outcome.
    pub fn scrape(&self, outcome: &'static str) {
        *lock(&self.scrapes).entry(outcome).or_default() += 1;
    }

    /// Counts one stats report outcome.
    pub fn stats_report(&self, outcome: &'static str) {
        *lock(&self.stats_reports).entry(outcome).or_default() += 1;
    }

    /// Unix time (ms) of the last report the server accepted, events or stats.
    pub fn last_success_unix_ms(&self) -> u64 {
        self.forwarder
            .last_success_unix_ms
            .load(Relaxed)
            .max(self.stats_last_success_unix_ms.load(Relaxed))
    }

    /// The Prometheus text exposition of everything: one collector per area, each writing its
    /// families with named counters.
    pub fn render(&self) -> String {
        let areas: [fn(&Self, &mut Out); 7] = [
            Self::render_build,
            Self::render_sources,
            Self::render_state_file,
            Self::render_mappers,
            Self::render_forwarder,
            Self::render_scrapes,
            Self::render_feed,
        ];
        let mut registry = prometheus_client::registry::Registry::default();
        for area in areas {
            let mut o = Out::default();
            area(self, &mut o);
            registry.register_collector(Box::new(o));
        }
        let mut text = String::with_capacity(32 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
        text
    }

    /// The build.
    fn render_build(&self, o: &mut Out) {
        use names::*;
        o.family(BUILD_INFO, Kind::Gauge, "Build information.");
        o.sample(BUILD_INFO, &[("version", env!("CARGO_PKG_VERSION"))], 1);
    }

    /// The engine sources: events, batches, sequence state, replays, connections.
    fn render_sources(&self, o: &mut Out) {
        use names::*;
        let per_source = |o: &mut Out,
                          name: &'static str,
                          kind: Kind,
                          help: &'static str,
                          f: &dyn Fn(&SourceMetrics) -> u64| {
            o.family(name, kind, help);
            for (label, m) in self.sources.iter().zip(&self.source_metrics) {
                o.sample(name, &[("source", label)], f(m));
            }
        };
        o.family(
            EVENTS,
            Kind::Counter,
            "Events received from the engine, by type.",
        );
        for (label, m) in self.sources.iter().zip(&self.source_metrics) {
            for (t, count) in m.events.by_type() {
                o.sample(
                    EVENTS,
                    &[("source", label), ("type", t)],
                    count.load(Relaxed),
                );
            }
        }
        per_source(
            o,
            BATCHES,
            Kind::Counter,
            "Batches received and applied.",
            &|m| m.batches.load(Relaxed),
        );
        o.family(
            DECODE_FAILURES,
            Kind::Counter,
            "Payloads that failed to decode, by kind.",
        );
        for (label, m) in self.sources.iter().zip(&self.source_metrics) {
            for (i, kind) in DECODE_FAILURE_KINDS.iter().enumerate() {
                o.sample(
                    DECODE_FAILURES,
                    &[("source", label), ("kind", kind)],
                    m.decode_failures[i].load(Relaxed),
                );
            }
        }
        per_source(
            o,
            GAPS,
            Kind::Counter,
            "Gaps in the sequence numbers.",
            &|m| m.gaps.load(Relaxed),
        );
        per_source(
            o,
            MISSING,
            Kind::Counter,
            "Sequence numbers missing across gaps.",
            &|m| m.missing_seqs.load(Relaxed),
        );
        o.family(REPLAYS, Kind::Counter, "Replays by outcome.");
        for (label, m) in self.sources.iter().zip(&self.source_metrics) {
            for (outcome, c) in [
                ("requested", &m.replays_requested),
                ("complete", &m.replays_complete),
                ("truncated", &m.replays_truncated),
                ("timed_out", &m.replays_timed_out),
                ("failed", &m.replays_failed),
                ("unavailable", &m.replays_unavailable),
            ] {
                o.sample(
                    REPLAYS,
                    &[("source", label), ("outcome", outcome)],
                    c.load(Relaxed),
                );
            }
        }
        o.family(
            RESUMES,
            Kind::Counter,
            "Saved states (--state-file) resumed or refused at start, by outcome.",
        );
        for (label, m) in self.sources.iter().zip(&self.source_metrics) {
            for (outcome, c) in [
                ("verified", &m.resumes_verified),
                ("refused", &m.resumes_refused),
            ] {
                o.sample(
                    RESUMES,
                    &[("source", label), ("outcome", outcome)],
                    c.load(Relaxed),
                );
            }
        }
        per_source(
            o,
            RESTARTS,
            Kind::Counter,
            "Engine restarts detected (sequence regressions).",
            &|m| m.restarts.load(Relaxed),
        );
        o.family(
            SILENCE,
            Kind::Gauge,
            "Seconds since the source's last batch (since the start when none came).",
        );
        for (i, label) in self.sources.iter().enumerate() {
            o.sample(
                SILENCE,
                &[("source", label)],
                (self.silence_seconds(i) * 1000.0).round() / 1000.0,
            );
        }
        per_source(
            o,
            DISCONNECTS,
            Kind::Counter,
            "Connection drops to the engine (libzmq reconnects by itself).",
            &|m| m.disconnects.load(Relaxed),
        );
        per_source(
            o,
            DUPLICATES,
            Kind::Counter,
            "Duplicate batches dropped.",
            &|m| m.duplicates.load(Relaxed),
        );
        per_source(
            o,
            MALFORMED,
            Kind::Counter,
            "Malformed ZMQ messages skipped.",
            &|m| m.malformed_frames.load(Relaxed),
        );
        o.family(
            RESETS,
            Kind::Counter,
            "Source resets (the replica's state cleared), by reason.",
        );
        for (label, m) in self.sources.iter().zip(&self.source_metrics) {
            for reason in ResetReason::ALL {
                o.sample(
                    RESETS,
                    &[("source", label), ("reason", reason.as_str())],
                    m.resets(reason),
                );
            }
        }
        per_source(
            o,
            LAST_SEQ,
            Kind::Gauge,
            "Last sequence number applied.",
            &|m| m.last_seq.load(Relaxed),
        );
        per_source(
            o,
            DEGRADED,
            Kind::Gauge,
            "1 while the source's state is known to be incomplete.",
            &|m| u64::from(m.degraded.load(Relaxed)),
        );
        per_source(
            o,
            CONNECTED,
            Kind::Gauge,
            "1 while the source's socket has a connection to the engine (not proof it publishes: see kvevent_source_last_batch_age_seconds).",
            &|m| u64::from(m.connected.load(Relaxed)),
        );
        per_source(
            o,
            HOLD_OVERFLOWS,
            Kind::Counter,
            "Live batches dropped from the hold buffer during replays.",
            &|m| m.buffer_overflows.load(Relaxed),
        );
    }

    /// The state file: writes, size, time.
    fn render_state_file(&self, o: &mut Out) {
        use names::*;
        o.family(
            STATE_WRITES,
            Kind::Counter,
            "State file writes by outcome (skipped: the previous write was still running).",
        );
        for (outcome, c) in self.state_writes.by_outcome() {
            o.sample(STATE_WRITES, &[("outcome", outcome)], c.load(Relaxed));
        }
        o.family(
            STATE_BYTES,
            Kind::Gauge,
            "Size of the last state file written.",
        );
        o.sample(STATE_BYTES, &[], self.state_bytes.load(Relaxed));
        o.family(
            STATE_WRITE_SECONDS,
            Kind::Gauge,
            "Duration of the last state file write (encode, write, fsync, rename).",
        );
        o.sample(
            STATE_WRITE_SECONDS,
            &[],
            self.state_write_us.load(Relaxed) as f64 / 1e6,
        );
    }

    /// The router feed, when served.
    fn render_feed(&self, o: &mut Out) {
        use names::*;
        let Some(hub) = self.feed.get() else {
            return;
        };
        let m = hub.metrics();
        for (name, kind, help, value) in [
            (
                FEED_FOLLOWERS,
                Kind::Gauge,
                "Routers following the feed now.",
                &m.followers,
            ),
            (
                FEED_SNAPSHOTS,
                Kind::Counter,
                "Snapshots sent to feed followers.",
                &m.snapshots,
            ),
            (
                FEED_RESUMES,
                Kind::Counter,
                "Feed streams that went on from the follower's position (no snapshot).",
                &m.resumes,
            ),
            (
                FEED_CUT_OFF,
                Kind::Counter,
                "Feed followers cut off for not keeping up (they come back with a snapshot).",
                &m.cut_off,
            ),
            (
                FEED_REFUSED,
                Kind::Counter,
                "Feed streams refused: another replica or model asked for, or a wrong token.",
                &m.refused,
            ),
            (
                FEED_CHANGES,
                Kind::Counter,
                "Changes published to the feed.",
                &m.changes,
            ),
            (
                FEED_EPOCHS,
                Kind::Counter,
                "New feed epochs after the first (engine clears and restarts, gaps not repaired).",
                &m.new_epochs,
            ),
            (
                FEED_UNKEYED,
                Kind::Counter,
                "Prefix entries not published to the feed: their key is not a fingerprint.",
                &m.unkeyed,
            ),
            (
                FEED_RING_BYTES,
                Kind::Gauge,
                "Bytes of changes kept for followers to resume from.",
                &m.ring_bytes,
            ),
            (
                FEED_BLOCKS,
                Kind::Gauge,
                "Prefixes the feed holds (what a snapshot sends).",
                &m.blocks,
            ),
        ] {
            o.family(name, kind, help);
            o.sample(name, &[], value.load(Relaxed));
        }
    }

    /// The mappers: what they skipped, refreshed and track.
    fn render_mappers(&self, o: &mut Out) {
        use names::*;
        {
            let mappers = lock(&self.mappers);
            o.family(
                MAPPER_SKIPPED,
                Kind::Counter,
                "Blocks or events the mapper did not report, by reason.",
            );
            for (label, MapperView { stats: s, .. }) in self.sources.iter().zip(mappers.iter()) {
                for (reason, v) in [
                    ("placeholder_store", s.placeholder_stores),
                    ("unknown_adapter", s.unknown_adapter_drops),
                    ("unknown_parent", s.unknown_parents),
                    ("unknown_removal", s.unknown_removals),
                    ("unkeyable_block", s.unkeyable_blocks),
                    ("map_full", s.map_refusals),
                    ("empty_hash", s.empty_hashes),
                ] {
                    o.sample(MAPPER_SKIPPED, &[("source", label), ("reason", reason)], v);
                }
            }
            o.family(
                SHORT_BLOCKS,
                Kind::Counter,
                "Blocks stored with fewer tokens than the source's page size (an SGLang node's last page), reported as they come.",
            );
            for (label, MapperView { stats: s, .. }) in self.sources.iter().zip(mappers.iter()) {
                o.sample(SHORT_BLOCKS, &[("source", label)], s.short_blocks);
            }
            o.family(
                NON_PREFIX_BLOCKS,
                Kind::Counter,
                "Blocks of hybrid-model KV-cache groups that are not full attention, not reported, by kind.",
            );
            for (label, MapperView { stats: s, .. }) in self.sources.iter().zip(mappers.iter()) {
                for (kind, v) in &s.non_prefix_groups {
                    o.sample(NON_PREFIX_BLOCKS, &[("source", label), ("kind", kind)], v);
                }
            }
            o.family(
                REFRESHED,
                Kind::Counter,
                "Prefix entries re-reported so the server's TTL never expires a resident block.",
            );
            for (label, MapperView { stats: s, .. }) in self.sources.iter().zip(mappers.iter()) {
                o.sample(REFRESHED, &[("source", label)], s.refreshed);
            }
            o.family(TRACKED, Kind::Gauge, "Engine blocks tracked by the mapper.");
            for (label, MapperView { tracked, .. }) in self.sources.iter().zip(mappers.iter()) {
                o.sample(TRACKED, &[("source", label)], *tracked);
            }
            o.family(
                STASHED,
                Kind::Gauge,
                "Tracked blocks kept aside because their hashes collide with many others' (0 unless the engine's hashes are crafted or broken).",
            );
            for (label, MapperView { stashed, .. }) in self.sources.iter().zip(mappers.iter()) {
                o.sample(STASHED, &[("source", label)], *stashed);
            }
        }
    }

    /// The forwarder: what was sent, dropped, failed; its queue, limit and timings; and
    /// whether the server can be reached.
    fn render_forwarder(&self, o: &mut Out) {
        use names::*;
        let f = &self.forwarder;
        o.family(
            PREFIXES_SENT,
            Kind::Counter,
            "Prefix entries delivered to the server.",
        );
        o.sample(PREFIXES_SENT, &[], f.prefixes_sent.load(Relaxed));
        o.family(
            UPDATES_SENT,
            Kind::Counter,
            "CacheStateUpdates delivered to the server.",
        );
        o.sample(UPDATES_SENT, &[], f.updates_sent.load(Relaxed));
        o.family(
            EVENTS_SENT,
            Kind::Counter,
            "CacheEvents delivered to the server, by type.",
        );
        o.sample(
            EVENTS_SENT,
            &[("type", "prefix_evicted")],
            f.evictions_sent.load(Relaxed),
        );
        o.sample(
            EVENTS_SENT,
            &[("type", "all_cleared")],
            f.clears_sent.load(Relaxed),
        );
        o.family(
            RPC_ERRORS,
            Kind::Counter,
            "Failed RPCs to the server, by gRPC code.",
        );
        for (i, c) in f.rpc_errors.iter().enumerate() {
            let v = c.load(Relaxed);
            if v > 0 {
                let code = format!("{:?}", tonic::Code::from_i32(i as i32));
                o.sample(RPC_ERRORS, &[("code", &code)], v);
            }
        }
        o.family(
            DROPPED,
            Kind::Counter,
            "Reports dropped instead of delivered, by kind and reason.",
        );
        for reason in fwd::DropReason::ALL {
            o.sample(
                DROPPED,
                &[("kind", "prefix"), ("reason", reason.as_str())],
                f.dropped_prefixes(reason),
            );
            o.sample(
                DROPPED,
                &[("kind", "event"), ("reason", reason.as_str())],
                f.dropped_events(reason),
            );
        }
        o.sample(
            DROPPED,
            &[("kind", "report"), ("reason", "after_shutdown")],
            self.reports_after_shutdown.load(Relaxed),
        );
        o.family(
            QUEUE_DEPTH,
            Kind::Gauge,
            "Pending prefix entries plus events.",
        );
        o.sample(QUEUE_DEPTH, &[], f.queue_depth.load(Relaxed));
        o.family(
            SERVER_REACHABLE,
            Kind::Gauge,
            "1 when the last probe (a gRPC health check; any answer counts) reached the server, 0 when it did not.",
        );
        let unreachable = self
            .server_unreachable
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        o.sample(
            SERVER_REACHABLE,
            &[],
            u64::from(self.server_probed.load(Relaxed) && !unreachable),
        );
        o.family(
            IN_FLIGHT_LIMIT,
            Kind::Gauge,
            "RPCs the forwarder lets be in flight now (adapted up to --max-in-flight).",
        );
        o.sample(IN_FLIGHT_LIMIT, &[], f.in_flight_limit.load(Relaxed));
        o.family(
            COALESCED,
            Kind::Counter,
            "Prefix entries merged into a pending identical one.",
        );
        o.sample(COALESCED, &[], f.coalesced.load(Relaxed));
        o.family(
            CANCELLED,
            Kind::Counter,
            "Adds and evictions not sent: a prefix stored and evicted again before either was sent.",
        );
        o.sample(CANCELLED, &[], f.cancelled.load(Relaxed));
        o.family(
            SUPERSEDED,
            Kind::Counter,
            "Pending reports discarded by a later clear.",
        );
        o.sample(SUPERSEDED, &[], f.superseded_by_clear.load(Relaxed));
        o.family(
            LAST_SUCCESS,
            Kind::Gauge,
            "Unix time of the last report the server accepted.",
        );
        o.sample(
            LAST_SUCCESS,
            &[],
            self.last_success_unix_ms() as f64 / 1000.0,
        );
        let h = &f.histograms;
        o.family(
            RPC_SECONDS,
            Kind::Histogram,
            "Durations of RPCs to the server (retries are separate calls), by method.",
        );
        o.histogram(
            RPC_SECONDS,
            &[("method", "ReportCacheState")],
            &h.report_seconds,
        );
        o.histogram(
            RPC_SECONDS,
            &[("method", "PublishEvent")],
            &h.publish_seconds,
        );
        o.family(
            AGE,
            Kind::Histogram,
            "Engine batch time to server acknowledgement, per update and event delivered (includes the window and any outage).",
        );
        o.histogram(AGE, &[], &h.age_seconds);
        o.family(
            UPDATE_ENTRIES,
            Kind::Histogram,
            "Prefix entries per CacheStateUpdate sent, after coalescing.",
        );
        o.histogram(UPDATE_ENTRIES, &[], &h.update_entries);
        o.family(
            WINDOW_SEND,
            Kind::Histogram,
            "Time a window took to send, first call to last answer (over the window: falling behind).",
        );
        o.histogram(WINDOW_SEND, &[], &h.window_send_seconds);
    }

    /// Engine `/metrics` scrapes and the stats reports made from them.
    fn render_scrapes(&self, o: &mut Out) {
        use names::*;
        o.family(
            SCRAPE_SECONDS,
            Kind::Histogram,
            "Durations of engine /metrics scrapes (fetch and parse).",
        );
        o.histogram(SCRAPE_SECONDS, &[], &self.scrape_seconds);
        o.family(
            SCRAPES,
            Kind::Counter,
            "Engine metrics scrapes, by outcome.",
        );
        for (outcome, v) in lock(&self.scrapes).iter() {
            o.sample(SCRAPES, &[("outcome", outcome)], v);
        }
        o.family(
            SCRAPE_ABSENT,
            Kind::Counter,
            "Scrapes that lacked a series the stats use (reported as 0, unknown), by series.",
        );
        for (series, v) in lock(&self.scrape_absent).iter() {
            o.sample(SCRAPE_ABSENT, &[("series", series)], v);
        }
        o.family(
            SCRAPE_NON_FINITE,
            Kind::Counter,
            "Scraped samples skipped because they were NaN or +-Inf.",
        );
        o.sample(SCRAPE_NON_FINITE, &[], self.scrape_non_finite.load(Relaxed));
        o.family(STATS_REPORTS, Kind::Counter, "Stats reports, by outcome.");
        for (outcome, v) in lock(&self.stats_reports).iter() {
            o.sample(STATS_REPORTS, &[("outcome", outcome)], v);
        }
    }
}

/// Now, in Unix milliseconds.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
