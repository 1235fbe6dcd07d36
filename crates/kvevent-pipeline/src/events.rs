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
    pub(crate) forwarder: fwd::Handle,
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
    /// The forwarder's window: while one waits for its time, a light engine's batches are
    /// left in the sockets until the window asks for them ([`fwd::Feed`]).
    pub(crate) window: Duration,
}

/// Over this many payload bytes in a window's time the engine is read as its batches arrive:
/// then the wakeups are a small share of the work, and holding would only make bursts
/// (about 15k stored blocks/s with token ids, at the default window).
const HOLD_MAX_BYTES: usize = 128 << 10;

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
    ) -> Vec<u8> {
        let mut header = self.header.clone();
        header.written_unix_ms = crate::telemetry::unix_ms();
        header.at_shutdown = at_shutdown;
        header.sources = subscriber
            .sources()
            .iter()
            .zip(subscriber.metrics())
            .zip(mappers.iter().zip(applied))
            .map(
                |((source, metrics), (mapper, applied))| state_file::SourceHeader {
                    label: source.label(),
                    last_seq: applied.map(|a| a.0),
                    digest: applied.map_or(0, |a| a.1),
                    degraded: metrics.degraded.load(Relaxed),
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
                            telemetry.state_writes[0].fetch_add(1, Relaxed);
                            telemetry.state_bytes.store(image.len() as u64, Relaxed);
                            telemetry
                                .state_write_us
                                .store(started.elapsed().as_micros() as u64, Relaxed);
                            if std::mem::take(&mut failing) {
                                tracing::info!(path = %path.display(), "state file written again");
                            }
                        }
                        Err(e) => {
                            telemetry.state_writes[1].fetch_add(1, Relaxed);
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
    pub(crate) fn run(self) {
        let EventsLoop {
            mut subscriber,
            mut mappers,
            forwarder,
            refresh_interval,
            silence_grace,
            stop,
            telemetry,
            saver,
            restored,
            window,
        } = self;
        // Each read of the sockets costs this thread and libzmq's I/O thread a wakeup and
        // about seven system calls (40-60 us of CPU here) whatever it brings, and an engine
        // publishes a batch every scheduler step: at 1k blocks/s that was a quarter of the
        // sidecar's CPU. While the forwarder has a window waiting for its time, batches are
        // left in the sockets and read when the window is due, in one go; the window waits
        // for them and sends them (the forwarder would have held them until then anyway), so
        // a batch goes out in the same window as before, later by the read's time (under a
        // millisecond at these rates). An engine sending over `HOLD_MAX_BYTES` a window is
        // read as its batches arrive.
        let feed = forwarder.feed();
        let hold_wait = (window * 2).min(Duration::from_millis(250));
        let mut answering: Option<u64> = None;
        feed.set_holding(false);
        let (mut hold, mut light_before) = (false, false);
        // Payload bytes read in the window's time so far (`load.1`) when the last ask came.
        let mut asked_at = 0usize;
        let mut load = (Instant::now(), 0usize);
        let mut applied: Applied = vec![None; mappers.len()];
        let writer = match saver.as_ref().map(|s| s.spawn_writer(telemetry.clone())) {
            Some(Ok(w)) => Some(w),
            Some(Err(e)) => {
                tracing::error!(error = %e, "cannot start the state file writer: state is not saved");
                None
            }
            None => None,
        };
        let mut last_save = Instant::now();
        let mut reports: Vec<pb::Report> = Vec::new();
        // The replica's server state is cleared once, at the first contact with any source.
        let mut cleared_at_start = restored;
        let several = mappers.len() > 1;
        let mut warned = vec![false; mappers.len()];
        let labels: Vec<String> = subscriber.sources().iter().map(|s| s.label()).collect();
        while !stop.load(Relaxed) {
            let mut wait = Duration::from_millis(100);
            if answering.is_some() {
                // Asked: read on without waiting until nothing is left, then answer.
                wait = Duration::ZERO;
            } else if !subscriber.has_pending() {
                let elapsed = load.0.elapsed();
                if elapsed >= window {
                    // Busy and light: some batches, at most HOLD_MAX_BYTES a window (a rate:
                    // a stall that read little over a long time does not count), two windows
                    // in a row to start holding, one outside to stop. An idle engine is not
                    // held: it costs no wakeups, and its first burst could be anything.
                    let light = load.1 > 0
                        && load.1 as f64 * window.as_secs_f64()
                            <= HOLD_MAX_BYTES as f64 * elapsed.as_secs_f64();
                    hold = light && (hold || light_before);
                    light_before = light;
                    feed.set_holding(hold);
                    load = (Instant::now(), 0);
                }
                if hold && feed.armed() {
                    answering = feed.wait_ask(hold_wait);
                    asked_at = load.1;
                    wait = Duration::ZERO;
                }
            }
            let mapped = subscriber.next_with(wait, |view| match view {
                View::Batch {
                    source,
                    seq,
                    batch,
                    payload,
                } => {
                    load.1 += payload.len();
                    if let Some(last) = telemetry.last_batch_unix_ms.get(source) {
                        last.store(crate::telemetry::unix_ms(), Relaxed);
                    }
                    if writer.is_some()
                        && let Some(a) = applied.get_mut(source)
                    {
                        *a = Some((seq, kvevent_source::payload_digest(payload)));
                    }
                    let mapper = mappers.get_mut(source)?;
                    mapper.map_batch(batch, &mut reports);
                    Some(source)
                }
                View::Reset { source, reason } => {
                    if let Some(a) = applied.get_mut(source) {
                        *a = None;
                    }
                    let mapper = mappers.get_mut(source)?;
                    let ts = now_us();
                    match reason {
                        ResetReason::Startup if cleared_at_start => {}
                        ResetReason::Startup => {
                            cleared_at_start = true;
                            reports.push(mapper.reset(ts));
                        }
                        // Other ranks of the replica are still valid: evict only this one's.
                        _ if several => reports.extend(mapper.evict_all(ts)),
                        _ => reports.push(mapper.reset(ts)),
                    }
                    Some(source)
                }
            });
            // A source that never sent anything within the grace is most likely misconfigured
            // (an idle engine that did send stays quiet, and that is fine): say so once.
            for (source, warned) in warned.iter_mut().enumerate() {
                let never = telemetry.last_batch_unix_ms[source].load(Relaxed) == 0;
                let silent =
                    never && telemetry.silence_seconds(source) >= silence_grace.as_secs_f64();
                if silent && !*warned {
                    tracing::warn!(
                        source = %labels[source],
                        silent_for = ?silence_grace,
                        "no KV events from this engine source yet: is vLLM started with --kv-events-config (publisher zmq), and does --engine-endpoint name its PUB socket (host, port, DP rank)?"
                    );
                    *warned = true;
                }
                if !never && *warned {
                    tracing::info!(source = %labels[source], "KV events arriving");
                    *warned = false;
                }
            }
            // The share of the refresh cycle due by now, after the batch (never before an
            // eviction it follows: the mapper refreshes only blocks it still tracks).
            let now = Instant::now();
            let mut refreshed = false;
            for mapper in &mut mappers {
                refreshed |= mapper.refresh(now, refresh_interval, now_us(), &mut reports) > 0;
            }
            let touched: Vec<usize> = match mapped {
                Some(Some(source)) if !refreshed => vec![source],
                _ if refreshed => (0..mappers.len()).collect(),
                _ => Vec::new(),
            };
            if !touched.is_empty() {
                let mut stats = telemetry.mappers.lock().unwrap_or_else(|e| e.into_inner());
                for source in touched {
                    if let (Some(slot), Some(mapper)) = (stats.get_mut(source), mappers.get(source))
                    {
                        let stashed = mapper.stashed_blocks();
                        if stashed > 0 && slot.2 == 0 {
                            tracing::warn!(
                                source = %labels[source],
                                blocks = stashed,
                                "block hashes collide: blocks kept aside, looked up more slowly (crafted or broken hashes?)"
                            );
                        }
                        *slot = (mapper.stats().clone(), mapper.tracked_blocks(), stashed);
                    }
                }
            }
            for report in reports.drain(..) {
                // Waits only for room in the forwarder's channel, never for the network.
                if forwarder.blocking_submit(report).is_err() {
                    telemetry.reports_after_shutdown.fetch_add(1, Relaxed);
                }
            }
            // Asked, and the sockets are empty: everything read since the ask is submitted. A
            // held round that turns out heavy (the engine sped up) answers at once and stops
            // holding: the rest is read as it comes.
            let heavy = load.1.saturating_sub(asked_at) > HOLD_MAX_BYTES;
            if (mapped.is_none() || heavy)
                && let Some(generation) = answering.take()
            {
                feed.answer(generation);
                if heavy {
                    (hold, light_before) = (false, false);
                    feed.set_holding(false);
                }
            }
            if let (Some(saver), Some((tx, _))) = (&saver, &writer)
                && !saver.interval.is_zero()
                && last_save.elapsed() >= saver.interval
            {
                last_save = Instant::now();
                let image = saver.image(&mappers, &applied, &subscriber, false);
                if tx.try_send((image, last_save)).is_err() {
                    telemetry.state_writes[2].fetch_add(1, Relaxed);
                }
            }
        }
        if let (Some(saver), Some((tx, thread))) = (&saver, writer) {
            // The last word: everything applied so far, written before the process exits.
            let started = Instant::now();
            let image = saver.image(&mappers, &applied, &subscriber, true);
            let _ = tx.send((image, started));
            drop(tx);
            let _ = thread.join();
            tracing::info!(path = %saver.path.display(), blocks = mappers.iter().map(Mapper::tracked_blocks).sum::<usize>(), "state saved");
        }
        subscriber.shutdown();
        tracing::info!("engine subscription closed");
    }
}
