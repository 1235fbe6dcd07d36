//! `kvevents record`: an engine's KV-event stream to a recording (`kvevent-recording`), and
//! `kvevents publish --recording`: a recording back onto the wire as the engine sent it.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvevent_recording::{Header, Reader, Record, SourceInfo, Writer};
use kvevent_wire::{self as wire, frames};
use kvevent_zmq::{Delivery, SourceOptions, Transport, dp_sources};

#[derive(clap::Args)]
pub(crate) struct RecordArgs {
    /// The engine's KV-event PUB endpoint (rank 0's with --dp-size; a `*` binds, for engines
    /// that connect).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    endpoint: String,
    /// Its replay ROUTER endpoint (rank 0's); empty: none.
    #[arg(long, default_value = "")]
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
    /// First ask the replay endpoint for everything it still holds, then record live.
    #[arg(long)]
    replay_first: bool,
    /// Stop after this long: 90s, 10m, 1h (0: until interrupted).
    #[arg(long, default_value = "0", value_parser = seconds)]
    duration: f64,
    /// Stop once the file reaches this many bytes (it ends with the batch that reached it; 0: no
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

/// A batch as it arrived: seq, topic, payload, µs since the start.
type Batch = (u64, Vec<u8>, Vec<u8>, u64);

/// Per rank: the last seq written, and the live batches held while a replay runs.
#[derive(Default)]
struct Rank {
    last: Option<u64>,
    replaying: bool,
    held: Vec<Batch>,
    gaps: u64,
    missing: u64,
}

/// The recording being written, and what went into it.
struct Out<W: std::io::Write> {
    writer: Writer<W>,
    batches: u64,
    payload_bytes: u64,
}

impl<W: std::io::Write> Out<W> {
    /// Writes `batch` of `rank` unless it was written already; a gap before it is counted and
    /// named (the recording has it too).
    fn put(
        &mut self,
        rank: &mut Rank,
        rank_no: u32,
        batch: Batch,
        replay: bool,
    ) -> anyhow::Result<()> {
        let (seq, topic, payload, at_us) = batch;
        if rank.last.is_some_and(|l| seq <= l) {
            return Ok(());
        }
        if let Some(l) = rank.last
            && seq > l + 1
        {
            rank.gaps += 1;
            rank.missing += seq - l - 1;
            eprintln!(
                "kvevents: rank {rank_no}: seqs {}..{} never arrived (the recording has a gap there)",
                l + 1,
                seq - 1
            );
        }
        self.payload_bytes += payload.len() as u64;
        self.writer.write(&Record {
            rank: rank_no,
            seq,
            at_us,
            topic,
            replay,
            payload,
        })?;
        rank.last = Some(seq);
        self.batches += 1;
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
        ..Header::new(engine_word(args.engine), started_unix_ms)
    };
    let file = std::fs::File::create(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let ctx = zmq::Context::new();
    let mut transport = Transport::start(&ctx, &sources, &SourceOptions::default())?;
    let mut ranks: Vec<Rank> = sources.iter().map(|_| Rank::default()).collect();
    if args.replay_first {
        for (i, rank) in ranks.iter_mut().enumerate() {
            rank.replaying = transport.request_replay(i, 0);
        }
    }
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
    let mut frames = std::collections::VecDeque::new();
    let mut out = Out {
        writer: Writer::new(std::io::BufWriter::with_capacity(1 << 20, file), &header)?,
        batches: 0,
        payload_bytes: 0,
    };
    let mut last_flush = Instant::now();
    let mut last_said = Instant::now();
    let mut connected = vec![false; sources.len()];
    let why = loop {
        if stop.load(Relaxed) {
            break "interrupted";
        }
        if args.duration > 0.0 && start.elapsed().as_secs_f64() >= args.duration {
            break "its duration passed";
        }
        transport.poll(Duration::from_millis(50), &mut frames);
        let now_us = start.elapsed().as_micros() as u64;
        let mut full = false;
        for f in frames.drain(..) {
            let rank_no = sources[f.source].dp_rank;
            let rank = &mut ranks[f.source];
            match f.delivery {
                Delivery::Live(msg) => {
                    let Ok(live) = frames::parse_live(&msg) else {
                        eprintln!(
                            "kvevents: rank {rank_no}: a message that is not [topic, seq, payload]: skipped"
                        );
                        continue;
                    };
                    let batch = (live.seq, live.topic.to_vec(), live.payload.to_vec(), now_us);
                    if rank.replaying {
                        rank.held.push(batch);
                        continue;
                    }
                    // A gap: what the replay endpoint still holds fills it, live batches held
                    // meanwhile so the file stays in seq order.
                    if let Some(l) = rank.last
                        && live.seq > l + 1
                        && sources[f.source].replay_endpoint.is_some()
                        && transport.request_replay(f.source, l + 1)
                    {
                        eprintln!(
                            "kvevents: rank {rank_no}: seqs {}..{} missed live: asking the replay endpoint for them",
                            l + 1,
                            live.seq - 1
                        );
                        rank.replaying = true;
                        rank.held.push(batch);
                        continue;
                    }
                    out.put(rank, rank_no, batch, false)?;
                }
                Delivery::Replay(msg) => match frames::parse_replay(&msg) {
                    Ok(frames::ReplayReply::Batch {
                        topic,
                        seq,
                        payload,
                    }) => {
                        let topic = topic.unwrap_or(args.topic.as_bytes()).to_vec();
                        out.put(rank, rank_no, (seq, topic, payload.to_vec(), now_us), true)?;
                    }
                    Ok(frames::ReplayReply::End) => {}
                    Err(e) => eprintln!(
                        "kvevents: rank {rank_no}: a replay reply that does not parse: {e}"
                    ),
                },
                Delivery::ReplayDone(outcome) => {
                    rank.replaying = false;
                    eprintln!(
                        "kvevents: rank {rank_no}: replay over ({outcome:?}); {} live batch(es) held meanwhile follow",
                        rank.held.len()
                    );
                    for batch in std::mem::take(&mut rank.held) {
                        out.put(rank, rank_no, batch, false)?;
                    }
                }
                Delivery::Connected => {
                    if !std::mem::replace(&mut connected[f.source], true) {
                        eprintln!(
                            "kvevents: rank {rank_no}: connected to {}",
                            sources[f.source].endpoint
                        );
                    }
                }
                Delivery::Disconnected => {
                    connected[f.source] = false;
                    eprintln!("kvevents: rank {rank_no}: connection lost (libzmq reconnects)");
                }
            }
            if args.max_bytes > 0 && out.writer.bytes_written() >= args.max_bytes {
                full = true;
            }
        }
        if full {
            break "it reached --max-bytes";
        }
        if last_flush.elapsed() >= Duration::from_millis(100) {
            out.writer.flush()?;
            last_flush = Instant::now();
        }
        if last_said.elapsed() >= Duration::from_secs(10) {
            eprintln!(
                "kvevents: {} batches recorded ({:.1} MB) in {:.0} s",
                out.batches,
                out.writer.bytes_written() as f64 / 1e6,
                start.elapsed().as_secs_f64()
            );
            last_said = Instant::now();
        }
        if connected.iter().all(|c| !c)
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
    let size = out.writer.bytes_written();
    out.writer.finish()?.flush()?;
    let (batches, payload_bytes) = (out.batches, out.payload_bytes);
    let (gaps, missing) = ranks
        .iter()
        .fold((0, 0), |(g, m), r| (g + r.gaps, m + r.missing));
    eprintln!(
        "kvevents: stopped ({why}): {batches} batches, {:.1} MB of payloads, {:.1} MB written to {}; gaps: {gaps} ({missing} seqs never arrived)",
        payload_bytes as f64 / 1e6,
        size as f64 / 1e6,
        args.out.display()
    );
    transport.shutdown();
    Ok(())
}

fn engine_word(engine: wire::Engine) -> &'static str {
    match engine {
        wire::Engine::Vllm => "vllm",
        wire::Engine::Sglang => "sglang",
    }
}

/// The engine a recording's header names.
pub(crate) fn engine_of(header: &Header) -> anyhow::Result<wire::Engine> {
    match header.engine.as_str() {
        "vllm" => Ok(wire::Engine::Vllm),
        "sglang" => Ok(wire::Engine::Sglang),
        other => anyhow::bail!("the recording names an unknown engine `{other}`"),
    }
}

/// Whether `path` starts with a recording's magic.
pub(crate) fn is_recording(bytes: &[u8]) -> bool {
    bytes.starts_with(kvevent_recording::MAGIC)
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
    while let Some(rec) = scan.next_record()? {
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
    while let Some(rec) = reader.next_record()? {
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
