//! `kvevents record`: an engine's KV-event stream to a recording (`kvevent-recording`), and
//! `kvevents publish --recording`: a recording back onto the wire as the engine sent it.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvevent_recording::{Header, Reader, Record, SourceInfo, Writer};
use kvevent_source::{ResetReason, SourceMetrics, Subscriber, Update};
use kvevent_wire as wire;

#[derive(clap::Args)]
pub(crate) struct RecordArgs {
    #[command(flatten)]
    engine: crate::EngineArgs,
    /// First ask the replay endpoint for everything it still holds, then record live. Without
    /// it, the replay endpoint is asked for what came before once the first live batch shows
    /// something did (past seq 0), as a sidecar asks.
    #[arg(long)]
    replay_first: bool,
    /// Stop after this long: 90s, 10m, 1h (0: until interrupted).
    #[arg(long, default_value = "0", value_parser = seconds)]
    duration: f64,
    /// Stop once the file reaches this many bytes: it ends with the batch that reached it (0: no
    /// limit).
    #[arg(long, default_value_t = 0)]
    max_bytes: u64,
    /// The recording to write (replaced if it exists).
    #[arg(long, short)]
    out: PathBuf,
}

/// `90`, `90s`, `10m`, `1h`, `1.5s`: seconds.
fn seconds(text: &str) -> Result<f64, String> {
    let t = text.trim();
    let (number, scale) = match t.char_indices().last() {
        Some((i, 's')) => (&t[..i], 1.0),
        Some((i, 'm')) => (&t[..i], 60.0),
        Some((i, 'h')) => (&t[..i], 3600.0),
        _ => (t, 1.0),
    };
    number
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| s * scale)
        .ok_or_else(|| format!("`{text}` is not a duration (e.g. 90s, 10m, 1h)"))
}

/// One rank being recorded: what the recording says of it. Its continuity is the subscriber's
/// (`kvevent-source`, the state machine a sidecar keeps): a gap is filled from the replay
/// endpoint or named, a restart (seqs back, or a new process across a reconnect) starts the
/// rank over, and the recording says so at the record where it happened ([`Record::reset`]).
struct Rank {
    no: u32,
    /// The reset the next record carries (none before the rank's first: nothing is stale).
    reset: Option<ResetReason>,
    /// A record of it was written.
    written: bool,
    /// Resets for a gap nothing filled.
    unfilled: u64,
    connected: bool,
    /// Its last record came from the replay endpoint.
    replayed: bool,
    /// Its replays that failed or timed out, as last said.
    failed: u64,
    /// Its replays asked, as last said.
    asked: u64,
}

/// The recording being written, and what went into it.
struct Out<W: std::io::Write> {
    writer: Writer<W>,
    batches: u64,
    payload_bytes: u64,
    /// `--max-bytes` (0: none).
    max_bytes: u64,
    /// The recording's time origin.
    start: Instant,
}

impl<W: std::io::Write> Out<W> {
    /// Reached `--max-bytes`: nothing more is written.
    fn full(&self) -> bool {
        self.max_bytes > 0 && self.writer.bytes_written() >= self.max_bytes
    }

    /// Writes what the subscriber hands out, in order: a batch as a record (at its arrival),
    /// a reset as a mark on the rank's next record.
    fn apply(&mut self, ranks: &mut [Rank], update: Update) -> anyhow::Result<()> {
        match update {
            Update::Batch(b) => {
                let rank = &mut ranks[b.source];
                if b.replayed && !rank.replayed {
                    eprintln!(
                        "kvevents: rank {}: the replay endpoint answers from seq {}",
                        rank.no, b.seq
                    );
                }
                rank.replayed = b.replayed;
                self.payload_bytes += b.payload.len() as u64;
                self.writer.write(&Record {
                    rank: rank.no,
                    seq: b.seq,
                    at_us: b.arrived.saturating_duration_since(self.start).as_micros() as u64,
                    topic: b.topic.to_vec(),
                    replay: b.replayed,
                    reset: rank
                        .reset
                        .take()
                        .filter(|_| rank.written)
                        .map(|r| r.as_str().to_owned()),
                    payload: b.payload,
                })?;
                rank.written = true;
                self.batches += 1;
            }
            Update::Reset { source, reason } => {
                let rank = &mut ranks[source];
                if rank.written {
                    eprintln!(
                        "kvevents: rank {}: starts over ({}): the recording marks it at the next batch",
                        rank.no,
                        reason.as_str()
                    );
                    if matches!(
                        reason,
                        ResetReason::Gap | ResetReason::TruncatedReplay | ResetReason::Reconnect
                    ) {
                        rank.unfilled += 1;
                    }
                }
                rank.reset = Some(reason);
            }
        }
        Ok(())
    }
}

/// Says what changed on each rank's socket and replays since the last look.
fn say_changes(subscriber: &Subscriber, ranks: &mut [Rank]) {
    let health = subscriber.health();
    for (i, (((rank, health), metrics), source)) in ranks
        .iter_mut()
        .zip(health)
        .zip(subscriber.metrics())
        .zip(subscriber.sources())
        .enumerate()
    {
        let asked = metrics.replays_requested.load(Relaxed);
        if asked > rank.asked
            && let Some(from) = subscriber.replaying_from(i)
        {
            eprintln!(
                "kvevents: rank {}: asking the replay endpoint from seq {from}",
                rank.no
            );
        }
        rank.asked = asked;
        let connected = health.get().is_connected();
        if connected && !rank.connected {
            eprintln!(
                "kvevents: rank {}: connected to {}",
                rank.no, source.endpoint
            );
        } else if !connected && rank.connected {
            eprintln!(
                "kvevents: rank {}: connection lost (libzmq reconnects)",
                rank.no
            );
        }
        rank.connected = connected;
        let failed = metrics.replays_failed.load(Relaxed) + metrics.replays_timed_out.load(Relaxed);
        if failed > rank.failed {
            eprintln!(
                "kvevents: rank {}: a replay failed or timed out (asked again after a backoff)",
                rank.no
            );
        }
        rank.failed = failed;
    }
}

/// Turns SIGINT and SIGTERM into a flag the loop looks at.
fn stop_flag() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone()).context("cannot handle signals")?;
    }
    Ok(stop)
}

/// Updates taken in one turn of the loop at most (a busy engine still lets it flush and stop).
const TURN: usize = 4096;

pub(crate) fn record(args: RecordArgs) -> anyhow::Result<()> {
    let stop = stop_flag()?;
    let endpoint = args
        .engine
        .endpoint
        .as_deref()
        .unwrap_or("tcp://127.0.0.1:5557");
    let spec = args.engine.sockets(endpoint);
    anyhow::ensure!(
        !args.replay_first || spec.replay.is_some(),
        "--replay-first needs --replay-endpoint"
    );
    let sources = spec.sources()?;
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let header = Header {
        sources: sources
            .iter()
            .map(|s| SourceInfo {
                rank: s.dp_rank,
                endpoint: s.endpoint.clone(),
                replay_endpoint: s.replay_endpoint.clone(),
            })
            .collect(),
        replay_first: args.replay_first,
        tool: concat!("kvevents ", env!("CARGO_PKG_VERSION")).to_owned(),
        command: std::env::args().collect(),
        ..Header::new(spec.engine.as_str(), started_unix_ms)
    };
    let file = std::fs::File::create(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let mut ranks: Vec<Rank> = sources
        .iter()
        .map(|s| Rank {
            no: s.dp_rank,
            reset: None,
            written: false,
            unfilled: 0,
            connected: false,
            replayed: false,
            failed: 0,
            asked: 0,
        })
        .collect();
    eprintln!(
        "kvevents: recording {} rank(s) from {}{} to {}{}; Ctrl-C stops it",
        sources.len(),
        spec.endpoint,
        if args.replay_first {
            " (what the replay endpoint holds first)"
        } else {
            ""
        },
        args.out.display(),
        match args.duration {
            0.0 => String::new(),
            d => format!(" for {d} s"),
        }
    );
    let start = Instant::now();
    let mut out = Out {
        writer: Writer::new(std::io::BufWriter::with_capacity(1 << 20, file), &header)?,
        batches: 0,
        payload_bytes: 0,
        max_bytes: args.max_bytes,
        start,
    };
    // Without --replay-first the stream is taken from now: the first live batch decides, as a
    // sidecar's does (past seq 0, the replay endpoint is asked for what came before).
    let ctx = zmq::Context::new();
    let mut subscriber = Subscriber::start(
        &ctx,
        kvevent_source::Config {
            engine: spec.engine,
            bootstrap: args.replay_first,
            ..kvevent_source::Config::new(sources)
        },
    )?;
    let mut last_flush = Instant::now();
    let mut last_said = Instant::now();
    let why = loop {
        if stop.load(Relaxed) {
            break "interrupted";
        }
        if args.duration > 0.0 && start.elapsed().as_secs_f64() >= args.duration {
            break "its duration passed";
        }
        if out.full() {
            break "it reached --max-bytes";
        }
        // What is ready, the first waited for up to 50 ms.
        let mut wait = Duration::from_millis(50);
        for _ in 0..TURN {
            let Some(update) = subscriber.next_unchecked(wait) else {
                break;
            };
            out.apply(&mut ranks, update)?;
            if out.full() {
                break;
            }
            wait = Duration::ZERO;
        }
        say_changes(&subscriber, &mut ranks);
        if last_flush.elapsed() >= Duration::from_millis(100) {
            out.writer.flush()?;
            last_flush = Instant::now();
        }
        if last_said.elapsed() >= Duration::from_secs(10) {
            eprintln!(
                "kvevents: {} batches recorded ({}) in {:.0} s",
                out.batches,
                crate::human_bytes(out.writer.bytes_written()),
                start.elapsed().as_secs_f64()
            );
            last_said = Instant::now();
        }
        if ranks.iter().all(|r| !r.connected)
            && start.elapsed() >= Duration::from_secs(3)
            && out.batches == 0
            && last_said.elapsed() >= Duration::from_secs(5)
        {
            eprintln!(
                "kvevents: nothing connected to {} after {:.0} s: is the engine up with KV events on that endpoint?",
                spec.endpoint,
                start.elapsed().as_secs_f64()
            );
            last_said = Instant::now();
        }
    };
    // Live batches held back by a replay still under way are written as they are: the
    // replay is given up (a gap it would have filled is marked where it is).
    subscriber.end_replays();
    while subscriber.has_pending() && !out.full() {
        match subscriber.next_unchecked(Duration::ZERO) {
            Some(update) => out.apply(&mut ranks, update)?,
            None => break,
        }
    }
    let size = out.writer.bytes_written();
    out.writer.finish()?.flush()?;
    let (batches, payload_bytes) = (out.batches, out.payload_bytes);
    let count = |f: fn(&SourceMetrics) -> &std::sync::atomic::AtomicU64| {
        subscriber
            .metrics()
            .iter()
            .map(|m| f(m).load(Relaxed))
            .sum::<u64>()
    };
    eprintln!(
        "kvevents: stopped ({why}): {batches} batches, {} of payloads, {} written to {}; gaps: {} seen ({} seqs), {} left unfilled (marked in the file); engine restarts: {}",
        crate::human_bytes(payload_bytes),
        crate::human_bytes(size),
        args.out.display(),
        count(|m| &m.gaps),
        count(|m| &m.missing_seqs),
        ranks.iter().map(|r| r.unfilled).sum::<u64>(),
        count(|m| &m.restarts),
    );
    subscriber.shutdown();
    Ok(())
}

/// The engine a recording's header names.
pub(crate) fn engine_of(header: &Header) -> anyhow::Result<wire::Engine> {
    header
        .engine
        .parse()
        .map_err(|_| anyhow::anyhow!("the recording names an unknown engine `{}`", header.engine))
}

/// Whether `bytes` are a recording's: its magic, or enough of it (`KVEV`) that a damaged one
/// is reported as a damaged recording, not decoded as a payload.
pub(crate) fn is_recording(bytes: &[u8]) -> bool {
    bytes.starts_with(&kvevent_recording::MAGIC[..4])
}

/// The next record of `reader` (the recording at `path`). Damage is an error naming the file
/// and the byte, unless `skip_damaged`: then it is said on stderr and the file ends there (a
/// record's seq and time count from the one before it, so nothing after damage can be read
/// back as it was).
pub(crate) fn next_whole<R: std::io::Read>(
    reader: &mut Reader<R>,
    path: &std::path::Path,
    skip_damaged: bool,
) -> anyhow::Result<Option<Record>> {
    match reader.next_record() {
        Ok(r) => Ok(r),
        Err(e) if skip_damaged => {
            eprintln!(
                "kvevents: {}: {e}: the rest of the file is skipped (--skip-damaged)",
                path.display()
            );
            Ok(None)
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!(
            "{} is damaged (--skip-damaged reads it up to the damage)",
            path.display()
        ))),
    }
}

/// `decode` of a recording: one JSON line a record (rank, seq, time, whether replayed, the
/// batch); a bad payload is reported and the rest decoded. False when any record failed.
pub(crate) fn decode_recording(
    name: &str,
    bytes: &[u8],
    out: &mut impl std::io::Write,
) -> anyhow::Result<bool> {
    let mut reader = Reader::new(bytes).with_context(|| name.to_owned())?;
    let engine = engine_of(reader.header())?;
    let mut ok = true;
    loop {
        let at = reader.offset();
        let Some(r) = reader.next_record().with_context(|| name.to_owned())? else {
            break;
        };
        match wire::decode_engine(&r.payload, engine, &wire::Limits::DEFAULT) {
            Ok(batch) => {
                let line = serde_json::json!({
                    "rank": r.rank,
                    "seq": r.seq,
                    "at_us": r.at_us,
                    "replay": r.replay,
                    "topic": String::from_utf8_lossy(&r.topic),
                    "batch": wire::json::to_json_engine(&batch, engine),
                });
                writeln!(out, "{line}")?;
            }
            Err(e) => {
                eprintln!(
                    "kvevents: {name}: record at byte {at} (rank {}, seq {}): payload byte {}: {}",
                    r.rank,
                    r.seq,
                    e.offset(),
                    e.kind()
                );
                ok = false;
            }
        }
    }
    if let Some(cut) = reader.truncated() {
        eprintln!(
            "kvevents: {name}: cut at byte {cut} inside a record (a recorder stopped while writing): read up to the last whole batch"
        );
    }
    Ok(ok)
}

/// How fast `publish --recording` goes: the recorded timing scaled, or as fast as it can.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Speed {
    Scaled(f64),
    Max,
}

pub(crate) fn speed(text: &str) -> Result<Speed, String> {
    if text == "max" {
        return Ok(Speed::Max);
    }
    text.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Speed::Scaled)
        .ok_or_else(|| format!("`{text}` is not a speed: a factor above 0 (1, 10, 0.5) or `max`"))
}

/// What `publish --recording` needs besides the recording.
pub(crate) struct Replay {
    pub(crate) recording: PathBuf,
    pub(crate) endpoint: String,
    pub(crate) replay_endpoint: String,
    pub(crate) release: wire::Release,
    pub(crate) speed: Speed,
    pub(crate) wait_for: usize,
    /// Publish a damaged recording up to its damage.
    pub(crate) skip_damaged: bool,
}

/// Publishes a recording as the engine did: each rank on its endpoint (vLLM's port offset from
/// `--endpoint`), with its recorded topic, seqs and payload bytes, at the recorded timing
/// scaled by `--speed`; each rank's replay endpoint serves what was published so far.
pub(crate) fn publish_recording(r: Replay) -> anyhow::Result<()> {
    use kvevent_zmq::publisher::{Publisher, PublisherConfig};
    let stop = stop_flag()?;
    let open = || -> anyhow::Result<Reader<std::io::BufReader<std::fs::File>>> {
        let file = std::fs::File::open(&r.recording)
            .with_context(|| format!("cannot read {}", r.recording.display()))?;
        Reader::new(std::io::BufReader::with_capacity(1 << 20, file))
            .with_context(|| r.recording.display().to_string())
    };
    // A first pass: every rank and its first topic, so each has its sockets before the first
    // batch goes out.
    let mut ranks: std::collections::BTreeMap<u32, Vec<u8>> = Default::default();
    let mut scan = open()?;
    let mut records = 0u64;
    while let Some(rec) = next_whole(&mut scan, &r.recording, r.skip_damaged)? {
        ranks.entry(rec.rank).or_insert(rec.topic);
        records += 1;
    }
    anyhow::ensure!(records > 0, "{}: no batch recorded", r.recording.display());
    let ctx = zmq::Context::new();
    let mut publishers = std::collections::BTreeMap::new();
    for (rank, topic) in &ranks {
        let endpoint = kvevent_zmq::dp_endpoint(&r.endpoint, *rank)?;
        let replay_endpoint = (!r.replay_endpoint.is_empty())
            .then(|| kvevent_zmq::dp_endpoint(&r.replay_endpoint, *rank))
            .transpose()?;
        let p = Publisher::start(
            &ctx,
            PublisherConfig {
                endpoint,
                replay_endpoint,
                topic: topic.clone(),
                ..PublisherConfig::loopback(r.release)
            },
        )?;
        eprintln!(
            "kvevents: rank {rank} on {} (replay: {})",
            p.endpoint(),
            p.replay_endpoint().unwrap_or("none")
        );
        publishers.insert(*rank, p);
    }
    if r.wait_for > 0 {
        for (rank, p) in &publishers {
            anyhow::ensure!(
                p.wait_for_subscribers(r.wait_for, Duration::from_secs(60)),
                "rank {rank}: fewer than {} subscriber(s) within 60 s",
                r.wait_for
            );
        }
    }
    eprintln!(
        "kvevents: replaying {records} batches of {} at {}",
        r.recording.display(),
        match r.speed {
            Speed::Max => "full speed".to_owned(),
            Speed::Scaled(s) => format!("{s}x the recorded timing"),
        }
    );
    let mut reader = open()?;
    let start = Instant::now();
    let mut sent = 0u64;
    let mut first_at = None;
    while let Some(rec) = next_whole(&mut reader, &r.recording, r.skip_damaged)? {
        if stop.load(Relaxed) {
            eprintln!("kvevents: interrupted after {sent} batches");
            break;
        }
        let first = *first_at.get_or_insert(rec.at_us);
        if let Speed::Scaled(s) = r.speed {
            let due = Duration::from_secs_f64((rec.at_us - first) as f64 / 1e6 / s);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        if let Some(p) = publishers.get(&rec.rank) {
            // An engine restarted here: a new process starts its seqs and its replay buffer
            // over, so a follower's replay never gets the old process's batches mixed in.
            if rec.reset.as_deref() == Some(ResetReason::Restart.as_str()) {
                p.restart();
            }
            p.publish_payload_at(rec.seq, rec.payload);
            sent += 1;
        }
    }
    if let Some(cut) = reader.truncated() {
        eprintln!(
            "kvevents: {}: cut at byte {cut} inside a record: replayed up to the last whole batch",
            r.recording.display()
        );
    }
    eprintln!(
        "kvevents: replayed {sent} batches in {:.1} s; closing in 0.5 s",
        start.elapsed().as_secs_f64()
    );
    std::thread::sleep(Duration::from_millis(500));
    Ok(())
}
