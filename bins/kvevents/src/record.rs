//! `kvevents record`: an engine's KV-event stream to a recording (`kvevent-recording`), and
//! `kvevents publish --recording`: a recording back onto the wire as the engine sent it.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use anyhow::Context as _;
use kvevent_recording::{Header, Reader, Record, SourceInfo, Writer};
use kvevent_source::{ReplayEnd, ResetReason, SourceMetrics, SourceState, StateConfig, Step};
use kvevent_wire::{self as wire, frames};
use kvevent_zmq::{Delivery, SourceOptions, Transport, dp_sources};

#[derive(clap::Args)]
pub(crate) struct RecordArgs {
    /// The engine's KV-event PUB endpoint (rank 0's with --dp-size; a `*` binds, for engines
    /// that connect).
    #[arg(long, default_value = "tcp://127.0.0.1:5557", value_parser = crate::endpoint)]
    endpoint: String,
    /// Its replay ROUTER endpoint (rank 0's); empty: none.
    #[arg(long, default_value = "", value_parser = crate::endpoint_or_none)]
    replay_endpoint: String,
    /// Data-parallel ranks 0..N-1, endpoints by vLLM's port offset from the two above.
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    /// Topic prefix to subscribe to (empty: every topic; vLLM's default is `kv-events`,
    /// SGLang's empty).
    #[arg(long, default_value = "")]
    topic: String,
    /// Whose wire the payloads are (kept in the header, for `decode` and `stats`).
    #[arg(long, default_value = "vllm")]
    engine: wire::Engine,
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

/// One rank being recorded. Its continuity is `kvevent-source`'s [`SourceState`], the one a
/// sidecar keeps: a gap is filled from the replay endpoint or named, a restart (seqs back, or
/// a new process across a reconnect) starts the rank over, and the recording says so at the
/// record where it happened ([`Record::reset`]).
struct Rank {
    no: u32,
    state: SourceState,
    metrics: Arc<SourceMetrics>,
    /// The topic of its last message.
    topic: Vec<u8>,
    /// When each live batch the state holds back (during a replay) arrived, µs from the start.
    arrived: BTreeMap<u64, u64>,
    /// The reset the next record carries (none before the rank's first: nothing is stale).
    reset: Option<ResetReason>,
    /// A record of it was written.
    written: bool,
    /// Resets for a gap nothing filled.
    unfilled: u64,
    connected: bool,
}

/// The recording being written, and what went into it.
struct Out<W: std::io::Write> {
    writer: Writer<W>,
    batches: u64,
    payload_bytes: u64,
    /// `--max-bytes` (0: none).
    max_bytes: u64,
}

impl<W: std::io::Write> Out<W> {
    /// Reached `--max-bytes`: nothing more is written.
    fn full(&self) -> bool {
        self.max_bytes > 0 && self.writer.bytes_written() >= self.max_bytes
    }

    /// Does what the rank's state asked, in order: writes the batches it delivers, marks its
    /// resets, asks the replays. `replayed`: the steps answer a replay reply (the batches came
    /// from the replay endpoint). Stops writing once the file is full.
    fn steps(
        &mut self,
        rank: &mut Rank,
        steps: &mut Vec<Step>,
        replayed: bool,
        now_us: u64,
        transport: Option<&mut Transport>,
        source: usize,
    ) -> anyhow::Result<()> {
        let mut transport = transport;
        // By index, each taken as it comes: a replay that cannot be asked ends at once, and the
        // batches it held are appended to `steps` while they are being taken.
        let mut i = 0;
        while i < steps.len() {
            if self.full() {
                steps.clear();
                return Ok(());
            }
            match std::mem::replace(&mut steps[i], Step::Replay { from: 0 }) {
                Step::Deliver { seq, payload } => {
                    let at_us = if replayed {
                        now_us
                    } else {
                        rank.arrived.remove(&seq).unwrap_or(now_us)
                    };
                    // Older arrivals were duplicates the state dropped.
                    rank.arrived = rank.arrived.split_off(&seq);
                    self.payload_bytes += payload.len() as u64;
                    self.writer.write(&Record {
                        rank: rank.no,
                        seq,
                        at_us,
                        topic: rank.topic.clone(),
                        replay: replayed,
                        reset: rank
                            .reset
                            .take()
                            .filter(|_| rank.written)
                            .map(|r| r.as_str().to_owned()),
                        payload,
                    })?;
                    rank.written = true;
                    self.batches += 1;
                }
                Step::Reset(reason) if !rank.written => rank.reset = Some(reason),
                Step::Reset(reason) => {
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
                    rank.reset = Some(reason);
                }
                Step::Replay { from } => {
                    let asked = transport
                        .as_deref_mut()
                        .is_some_and(|t| t.request_replay(source, from));
                    if asked {
                        eprintln!(
                            "kvevents: rank {}: asking the replay endpoint from seq {from}",
                            rank.no
                        );
                    } else {
                        // No replay to be had (or stopping): the batches held go on as they are.
                        rank.state
                            .on_replay_done(ReplayEnd::Failed, Instant::now(), steps);
                    }
                }
            }
            i += 1;
        }
        steps.clear();
        Ok(())
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

pub(crate) fn record(args: RecordArgs) -> anyhow::Result<()> {
    let stop = stop_flag()?;
    let replay = (!args.replay_endpoint.is_empty()).then_some(args.replay_endpoint.as_str());
    anyhow::ensure!(
        !args.replay_first || replay.is_some(),
        "--replay-first needs --replay-endpoint"
    );
    let sources = dp_sources(
        &args.endpoint,
        replay,
        args.dp_size,
        args.topic.as_bytes(),
        kvevent_zmq::publisher::binds(&args.endpoint),
    )?;
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
        ..Header::new(args.engine.as_str(), started_unix_ms)
    };
    let file = std::fs::File::create(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let ctx = zmq::Context::new();
    let mut transport = Transport::start(&ctx, &sources, &SourceOptions::default())?;
    let mut ranks: Vec<Rank> = sources
        .iter()
        .map(|s| {
            let metrics = Arc::new(SourceMetrics::default());
            let config = StateConfig {
                has_replay: s.replay_endpoint.is_some(),
                label: s.label(),
                ..StateConfig::default()
            };
            Rank {
                no: s.dp_rank,
                state: SourceState::new(config, metrics.clone()),
                metrics,
                topic: args.topic.as_bytes().to_vec(),
                arrived: BTreeMap::new(),
                reset: None,
                written: false,
                unfilled: 0,
                connected: false,
            }
        })
        .collect();
    eprintln!(
        "kvevents: recording {} rank(s) from {}{} to {}{}; Ctrl-C stops it",
        sources.len(),
        args.endpoint,
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
    };
    let mut steps = Vec::new();
    if args.replay_first {
        for (source, rank) in ranks.iter_mut().enumerate() {
            rank.state.on_start(Instant::now(), &mut steps);
            out.steps(rank, &mut steps, false, 0, Some(&mut transport), source)?;
        }
    }
    let mut frames = std::collections::VecDeque::new();
    let mut last_flush = Instant::now();
    let mut last_said = Instant::now();
    let mut last_tick = Instant::now();
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
        transport.poll(Duration::from_millis(50), &mut frames);
        let now = Instant::now();
        let now_us = start.elapsed().as_micros() as u64;
        while let Some(f) = frames.pop_front() {
            if out.full() {
                break;
            }
            let source = f.source;
            let rank = &mut ranks[source];
            let mut replayed = false;
            match f.delivery {
                Delivery::Live(mut msg) => {
                    let Ok(live) = frames::parse_live(&msg) else {
                        eprintln!(
                            "kvevents: rank {}: a message that is not [topic, seq, payload]: skipped",
                            rank.no
                        );
                        continue;
                    };
                    let seq = live.seq;
                    if live.topic != rank.topic.as_slice() {
                        rank.topic = live.topic.to_vec();
                    }
                    rank.arrived.insert(seq, now_us);
                    let payload = msg.pop().unwrap_or_default();
                    rank.state.on_live(seq, payload, now, &mut steps);
                }
                Delivery::Replay(mut msg) => match frames::parse_replay(&msg) {
                    Ok(frames::ReplayReply::Batch { topic, seq, .. }) => {
                        if let Some(topic) = topic.filter(|t| *t != rank.topic.as_slice()) {
                            rank.topic = topic.to_vec();
                        }
                        replayed = true;
                        let payload = msg.pop().unwrap_or_default();
                        rank.state.on_replayed(seq, payload, &mut steps);
                    }
                    Ok(frames::ReplayReply::End) => {}
                    Err(e) => eprintln!(
                        "kvevents: rank {}: a replay reply that does not parse: {e}",
                        rank.no
                    ),
                },
                Delivery::ReplayDone(outcome) => {
                    if let kvevent_zmq::ReplayOutcome::Failed(why) = &outcome {
                        eprintln!("kvevents: rank {}: the replay failed: {why}", rank.no);
                    }
                    rank.state
                        .on_replay_done(ReplayEnd::of(&outcome), now, &mut steps);
                }
                Delivery::Connected => {
                    if !std::mem::replace(&mut rank.connected, true) {
                        eprintln!(
                            "kvevents: rank {}: connected to {}",
                            rank.no, sources[source].endpoint
                        );
                    }
                    rank.state.on_connected(now, &mut steps);
                }
                Delivery::Disconnected => {
                    rank.connected = false;
                    rank.state.on_disconnected();
                    eprintln!(
                        "kvevents: rank {}: connection lost (libzmq reconnects)",
                        rank.no
                    );
                }
            }
            out.steps(
                rank,
                &mut steps,
                replayed,
                now_us,
                Some(&mut transport),
                source,
            )?;
        }
        if now.saturating_duration_since(last_tick) >= Duration::from_millis(50) {
            last_tick = now;
            for (source, rank) in ranks.iter_mut().enumerate() {
                rank.state.on_tick(now, &mut steps);
                out.steps(
                    rank,
                    &mut steps,
                    false,
                    now_us,
                    Some(&mut transport),
                    source,
                )?;
            }
        }
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
                args.endpoint,
                start.elapsed().as_secs_f64()
            );
            last_said = Instant::now();
        }
    };
    // Live batches held back by a replay still under way are written as they are: the
    // replay is given up (a gap it would have filled is marked where it is).
    let now_us = start.elapsed().as_micros() as u64;
    for (source, rank) in ranks.iter_mut().enumerate() {
        for _ in 0..3 {
            if !rank.state.replaying() {
                break;
            }
            rank.state
                .on_replay_done(ReplayEnd::Failed, Instant::now(), &mut steps);
            out.steps(rank, &mut steps, false, now_us, None, source)?;
        }
    }
    let size = out.writer.bytes_written();
    out.writer.finish()?.flush()?;
    let (batches, payload_bytes) = (out.batches, out.payload_bytes);
    let count = |f: fn(&SourceMetrics) -> &std::sync::atomic::AtomicU64| {
        ranks
            .iter()
            .map(|r| f(&r.metrics).load(Relaxed))
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
    transport.shutdown();
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
