//! The events thread: subscriber → mapper → forwarder, on a named std thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use kvevent_forwarder as fwd;
use kvevent_mapper::Mapper;
use kvevent_proto as pb;
use kvevent_source::{ResetReason, Subscriber, View};

use crate::state_file;
use crate::telemetry::Telemetry;

pub(crate) struct EventsLoop {
    pub(crate) subscriber: Subscriber,
    /// One mapper per source.
    pub(crate) mappers: Vec<Mapper>,
    /// None for a feed-only sidecar: reports only feed the hub.
    pub(crate) forwarder: Option<fwd::Handle>,
    /// Resident blocks are re-reported once per this interval (0: off).
    pub(crate) refresh_interval: Duration,
    /// A source silent this long is warned about, once per silence.
    pub(crate) silence_grace: Duration,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) telemetry: Arc<Telemetry>,
    /// Saves the state file, when there is one.
    pub(crate) saver: Option<Saver>,
    /// The mappers were restored from a state file: the replica is not cleared at start.
    pub(crate) restored: bool,
    /// The router feed, when served.
    pub(crate) feed: Option<Feed>,
}

/// The router feed's side of the events thread: every mapped change goes to the hub (refreshes
/// do not: they change nothing), one sealed message a turn.
pub(crate) struct Feed {
    pub(crate) hub: Arc<kvevent_feed::Hub>,
    /// The server is sent engine keys: the mappers make the feed's fingerprint-keyed reports
    /// in the same pass (the feed always carries the fingerprints a router computes from token
    /// ids). Otherwise the feed takes the server's reports as they are.
    pub(crate) two_keys: bool,
    /// Each source's DP rank.
    pub(crate) ranks: Vec<u32>,
    /// This turn's fingerprint-keyed reports, with `two_keys` (kept for capacity).
    pub(crate) reports: Vec<kvevent_proto::Report>,
    /// What the sockets say of the engine, this turn (kept for capacity).
    pub(crate) health: Vec<kvevent_feed::EngineRank>,
}

impl Feed {
    /// Tells the hub what the sockets say of the engine (the hub sends it to followers only
    /// when it changed).
    fn engine_health(&mut self, subscriber: &Subscriber) {
        self.health.clear();
        self.health
            .extend(
                subscriber
                    .health()
                    .enumerate()
                    .map(|(source, h)| kvevent_feed::EngineRank {
                        rank: self.ranks.get(source).copied().unwrap_or(0),
                        health: h.get(),
                    }),
            );
        self.hub.set_engine(&self.health);
    }

    /// Hands `reports` (the turn's, of `source`) to the hub.
    fn take(&self, source: usize, reports: &[kvevent_proto::Report]) {
        let rank = self.ranks.get(source).copied().unwrap_or(0);
        for r in reports {
            self.hub.apply(rank, r);
        }
    }
}

/// The longest the thread waits for the engine before it looks at its timers (refresh,
/// silence, saving) and at the stop flag.
const POLL_WAIT: Duration = Duration::from_millis(100);

/// Writes the state file: images are made on the events thread (a copy of the mappers'
/// tables, milliseconds for 500k blocks) and written by a thread of its own, so a slow disk
/// never holds up the events.
pub(crate) struct Saver {
    pub(crate) path: std::path::PathBuf,
    /// 0: only at shutdown.
    pub(crate) interval: Duration,
    /// The header's identity part (times and sources are filled per write).
    pub(crate) header: state_file::Header,
}

/// Hands file images (and when they were made) to the writer thread.
type ImageSender = std::sync::mpsc::SyncSender<(Vec<u8>, Instant)>;

/// The last batch applied to each mapper: (seq, payload digest).
type Applied = Vec<Option<(u64, u64)>>;

impl Saver {
    fn image(
        &self,
        mappers: &[Mapper],
        applied: &Applied,
        subscriber: &Subscriber,
        at_shutdown: bool,
        feed: Option<&Feed>,
    ) -> Vec<u8> {
        let mut header = self.header.clone();
        header.written_unix_ms = crate::telemetry::unix_ms();
        header.at_shutdown = at_shutdown;
        // The feed's position goes with the blocks when the feed holds exactly what the saved
        // mappers hold (fingerprint keys: no mappers of its own).
        header.feed = feed.filter(|f| !f.two_keys).map(|f| {
            let (epoch, seq) = f.hub.position();
            state_file::FeedPosition { epoch, seq }
        });
        header.sources = subscriber
            .sources()
            .iter()
            .zip(subscriber.health())
            .zip(mappers.iter().zip(applied))
            .map(
                |((source, health), (mapper, applied))| state_file::SourceHeader {
                    label: source.label(),
                    last_seq: applied.map(|a| a.0),
                    digest: applied.map_or(0, |a| a.1),
                    degraded: health.degraded(),
                    blocks: mapper.tracked_blocks() as u64,
                },
            )
            .collect();
        state_file::encode(&header, mappers)
    }

    /// Starts the writer thread; images sent to it are written in turn.
    fn spawn_writer(
        &self,
        telemetry: Arc<Telemetry>,
    ) -> std::io::Result<(ImageSender, std::thread::JoinHandle<()>)> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<(Vec<u8>, Instant)>(1);
        let path = self.path.clone();
        let thread = std::thread::Builder::new()
            .name("kvevent-state".into())
            .spawn(move || {
                let mut failing = false;
                for (image, started) in rx {
                    match state_file::write(&path, &image) {
                        Ok(_) => {
                            telemetry.state_file.writes.written.fetch_add(1, Relaxed);
                            telemetry.state_file.bytes.store(image.len() as u64, Relaxed);
                            telemetry
                                .state_file.write_us
                                .store(started.elapsed().as_micros() as u64, Relaxed);
                            if std::mem::take(&mut failing) {
                                tracing::info!(path = %path.display(), "state file written again");
                            }
                        }
                        Err(e) => {
                            telemetry.state_file.writes.failed.fetch_add(1, Relaxed);
                            if !std::mem::replace(&mut failing, true) {
                                tracing::warn!(path = %path.display(), error = %e, "cannot write the state file: a restart will clear the replica and rebuild (kvevent_state_file_writes_total counts the failures)");
                            }
                        }
                    }
                }
            })?;
        Ok((tx, thread))
    }
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

impl EventsLoop {
    /// Runs until `stop` is set: each turn polls the engine, maps what came, refreshes what is
    /// due, submits the reports and saves the state file when due; then saves it one last time.
    pub(crate) fn run(self) {
        let writer = match self
            .saver
            .as_ref()
            .map(|s| s.spawn_writer(self.telemetry.clone()))
        {
            Some(Ok(w)) => Some(w),
            Some(Err(e)) => {
                tracing::error!(error = %e, "cannot start the state file writer: state is not saved");
                None
            }
            None => None,
        };
        let sources = self.mappers.len();
        let mut turn = Turn {
            labels: self
                .subscriber
                .sources()
                .iter()
                .map(|s| s.label())
                .collect(),
            applied: vec![None; sources],
            track_applied: writer.is_some(),
            // The replica's server state is cleared once, at the first contact with any source.
            cleared_at_start: self.restored,
            warned: vec![false; sources],
            reports: Vec::new(),
            last_save: Instant::now(),
        };
        let mut lp = self;
        while !lp.stop.load(Relaxed) {
            let mapped = lp.poll_and_map(&mut turn);
            if let Some(feed) = &mut lp.feed {
                feed.hub.commit();
                feed.engine_health(&lp.subscriber);
            }
            lp.warn_silent(&mut turn);
            // Refreshes keep a server's TTL from expiring prefixes: a feed-only sidecar has none.
            let refreshed = lp.forwarder.is_some() && lp.refresh(&mut turn);
            lp.publish_mapper_stats(&turn, mapped, refreshed);
            lp.submit(&mut turn);
            if let Some((tx, _)) = &writer {
                lp.save_if_due(&mut turn, tx);
            }
        }
        lp.finish(&turn, writer);
    }

    /// Waits up to [`POLL_WAIT`] for the next batch or reset of any source and maps it into
    /// `turn.reports`: the source it concerned, if any.
    fn poll_and_map(&mut self, turn: &mut Turn) -> Option<usize> {
        let several = self.mappers.len() > 1;
        let (mappers, telemetry, feed) = (&mut self.mappers, &self.telemetry, &mut self.feed);
        let before = turn.reports.len();
        let mapped = self.subscriber.next_with(POLL_WAIT, |view| match view {
            View::Batch {
                source,
                seq,
                batch,
                payload,
            } => {
                if let Some(last) = telemetry.sources.last_batch_unix_ms.get(source) {
                    last.store(crate::telemetry::unix_ms(), Relaxed);
                }
                if turn.track_applied
                    && let Some(a) = turn.applied.get_mut(source)
                {
                    *a = Some((seq, kvevent_source::payload_digest(payload)));
                }
                let mapper = mappers.get_mut(source)?;
                match feed.as_mut() {
                    Some(feed) => {
                        if let Some(size) = batch.events.iter().find_map(|e| match e {
                            kvevent_wire::Event::BlockStored(s) => Some(s.block_size),
                            _ => None,
                        }) {
                            feed.hub.note_block_size(size);
                        }
                        if feed.two_keys {
                            let mut reports = std::mem::take(&mut feed.reports);
                            mapper.map_batch_with_fingerprints(
                                batch,
                                &mut turn.reports,
                                &mut reports,
                            );
                            feed.take(source, &reports);
                            reports.clear();
                            feed.reports = reports;
                        } else {
                            mapper.map_batch(batch, &mut turn.reports);
                            feed.take(source, &turn.reports[before..]);
                        }
                    }
                    None => mapper.map_batch(batch, &mut turn.reports),
                }
                Some(source)
            }
            View::Reset { source, reason } => {
                if let Some(a) = turn.applied.get_mut(source) {
                    *a = None;
                }
                let mapper = mappers.get_mut(source)?;
                let ts = now_us();
                let startup_kept = matches!(reason, ResetReason::Startup) && turn.cleared_at_start;
                let two_keys = feed.as_ref().is_some_and(|f| f.two_keys);
                let mut fingerprints = Vec::new();
                match reason {
                    ResetReason::Startup if turn.cleared_at_start => {}
                    ResetReason::Startup => {
                        turn.cleared_at_start = true;
                        turn.reports.push(mapper.reset(ts));
                    }
                    // Other ranks of the replica are still valid: evict only this one's.
                    _ if several && two_keys => {
                        let (reports, fps) = mapper.evict_all_with_fingerprints(ts);
                        turn.reports.extend(reports);
                        fingerprints = fps;
                    }
                    _ if several => turn.reports.extend(mapper.evict_all(ts)),
                    _ => turn.reports.push(mapper.reset(ts)),
                }
                if let Some(feed) = feed.as_mut()
                    && !startup_kept
                {
                    // A clear has no key: the same report serves both.
                    if several && two_keys {
                        feed.take(source, &fingerprints);
                    } else {
                        feed.take(source, &turn.reports[before..]);
                    }
                }
                Some(source)
            }
        });
        mapped.flatten()
    }

    /// A source that never sent anything within the grace is most likely misconfigured (an
    /// idle engine that did send stays quiet, and that is fine): said once per silence.
    fn warn_silent(&self, turn: &mut Turn) {
        for (source, warned) in turn.warned.iter_mut().enumerate() {
            let never = self.telemetry.sources.last_batch_unix_ms[source].load(Relaxed) == 0;
            let silent = never
                && self.telemetry.sources.silence_seconds(source)
                    >= self.silence_grace.as_secs_f64();
            if silent && !*warned {
                tracing::warn!(
                    source = %turn.labels[source],
                    silent_for = ?self.silence_grace,
                    "no KV events from this engine source yet: is vLLM started with --kv-events-config (publisher zmq), and does --engine-endpoint name its PUB socket (host, port, DP rank)?"
                );
                *warned = true;
            }
            if !never && *warned {
                tracing::info!(source = %turn.labels[source], "KV events arriving");
                *warned = false;
            }
        }
    }

    /// Re-reports the share of each mapper's refresh cycle due by now, after the batch (never
    /// before an eviction it follows: a mapper refreshes only blocks it still tracks). True
    /// when anything was re-reported.
    fn refresh(&mut self, turn: &mut Turn) -> bool {
        let now = Instant::now();
        let mut refreshed = false;
        for mapper in &mut self.mappers {
            refreshed |=
                mapper.refresh(now, self.refresh_interval, now_us(), &mut turn.reports) > 0;
        }
        refreshed
    }

    /// Copies the counters of the mappers that changed for `/metrics`, and warns (once a
    /// source) when block hashes collide.
    fn publish_mapper_stats(&self, turn: &Turn, mapped: Option<usize>, refreshed: bool) {
        let touched = match mapped {
            _ if refreshed => 0..self.mappers.len(),
            Some(source) => source..source + 1,
            None => return,
        };
        let mut stats = self
            .telemetry
            .mappers
            .views
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for source in touched {
            if let (Some(slot), Some(mapper)) = (stats.get_mut(source), self.mappers.get(source)) {
                let stashed = mapper.stashed_blocks();
                if stashed > 0 && slot.stashed == 0 {
                    tracing::warn!(
                        source = %turn.labels[source],
                        blocks = stashed,
                        "block hashes collide: blocks kept aside, looked up more slowly (crafted or broken hashes?)"
                    );
                }
                *slot = crate::telemetry::MapperView {
                    stats: mapper.stats().clone(),
                    tracked: mapper.tracked_blocks(),
                    stashed,
                };
            }
        }
    }

    /// Hands this turn's reports to the forwarder, never waiting for it with adds and
    /// evictions: a full channel means the forwarder cannot keep up, and waiting would move
    /// the backlog into the engine's socket (bounded in batches, not bytes) until the engine
    /// dropped whole batches. Such a report is dropped and counted (`input_full`; the
    /// forwarder logs it at a bounded rate). A clear waits for room: losing it would leave
    /// the server holding what the engine dropped.
    fn submit(&self, turn: &mut Turn) {
        let Some(forwarder) = &self.forwarder else {
            turn.reports.clear();
            return;
        };
        for report in turn.reports.drain(..) {
            let closed = if report.is_barrier() {
                forwarder.blocking_submit(report).is_err()
            } else {
                forwarder.try_submit(report) == fwd::Submit::Closed
            };
            if closed {
                self.telemetry
                    .delivery
                    .reports_after_shutdown
                    .fetch_add(1, Relaxed);
            }
        }
    }

    /// Hands an image of the mappers to the writer thread when the save interval has passed
    /// (a writer still busy with the last one skips this one, counted).
    fn save_if_due(&self, turn: &mut Turn, tx: &ImageSender) {
        let Some(saver) = &self.saver else { return };
        if saver.interval.is_zero() || turn.last_save.elapsed() < saver.interval {
            return;
        }
        turn.last_save = Instant::now();
        let image = saver.image(
            &self.mappers,
            &turn.applied,
            &self.subscriber,
            false,
            self.feed.as_ref(),
        );
        if tx.try_send((image, turn.last_save)).is_err() {
            self.telemetry
                .state_file
                .writes
                .skipped
                .fetch_add(1, Relaxed);
        }
    }

    /// The last word: everything applied so far is written before the process exits; then
    /// the sockets close.
    fn finish(self, turn: &Turn, writer: Option<(ImageSender, std::thread::JoinHandle<()>)>) {
        if let (Some(saver), Some((tx, thread))) = (&self.saver, writer) {
            let started = Instant::now();
            let image = saver.image(
                &self.mappers,
                &turn.applied,
                &self.subscriber,
                true,
                self.feed.as_ref(),
            );
            let _ = tx.send((image, started));
            drop(tx);
            let _ = thread.join();
            tracing::info!(
                path = %saver.path.display(),
                blocks = self.mappers.iter().map(Mapper::tracked_blocks).sum::<usize>(),
                "state saved"
            );
        }
        self.subscriber.shutdown();
        tracing::info!("engine subscription closed");
    }
}

/// What the events thread keeps from turn to turn.
struct Turn {
    labels: Vec<String>,
    /// The last batch applied to each mapper, kept only when there is a state file to save.
    applied: Applied,
    track_applied: bool,
    cleared_at_start: bool,
    /// Per source: warned that it never sent anything.
    warned: Vec<bool>,
    /// The reports of the turn, kept for its capacity.
    reports: Vec<pb::Report>,
    last_save: Instant,
}
