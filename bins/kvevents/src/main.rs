#![doc = include_str!("../README.md")]

#[cfg(feature = "doctor")]
mod doctor;
mod record;
mod stats;

use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvevent_wire::{self as wire, json};

#[derive(Parser)]
#[command(name = "kvevents", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Decode payload files (the third ZMQ frame; `-` for stdin) to one JSON line each, or a
    /// recording (`kvevents record`) to one line a batch with its rank, seq and time. Offline.
    ///
    /// Exits 0 when every file decodes; otherwise reports each bad file or record on stderr
    /// (file, byte offset, reason), goes on with the rest and exits 1.
    Decode {
        /// Whose wire the payloads are: vllm or sglang.
        #[arg(long, default_value = "vllm")]
        engine: wire::Engine,
        /// Payload files; `-` reads stdin.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Encode one normalized JSON batch as the payload bytes a vLLM (or SGLang) release sends.
    /// Offline.
    Encode {
        /// Whose release: vllm or sglang.
        #[arg(long, default_value = "vllm")]
        engine: wire::Engine,
        /// The release to speak, e.g. 0.26.0 (vLLM 0.9.0 or later; newer than 0.33 is written
        /// as 0.33) or, with --engine sglang, 0.5.18 (0.4.6.post5 or later).
        #[arg(long)]
        release: String,
        /// Drop fields the release does not have instead of failing (vLLM releases).
        #[arg(long)]
        lenient: bool,
        /// The JSON batch file; `-` reads stdin.
        file: PathBuf,
        /// Write here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Record an engine's KV-event stream to a file: each batch's payload byte for byte, with
    /// its rank, topic, seq and receive time, kept as a sidecar keeps its sources: a gap is
    /// filled from the replay endpoint when there is one, an engine restart (or a gap nothing
    /// could fill) is kept and marked where it happened. Stops at --duration, --max-bytes or
    /// Ctrl-C; the file is valid up to its last whole batch. Uses the network.
    Record(record::RecordArgs),
    /// What the cache of each replica, and of the fleet, did over recordings (one per
    /// replica): blocks stored and removed a second, resident blocks, how long evicted blocks
    /// stayed, re-stores of evicted prefixes, prefix depth; across the fleet, distinct
    /// prefixes, the share held twice or more, and the replicas that most share. A table, JSON
    /// (--json) or an SVG plot (--svg). Offline.
    Stats(stats::StatsArgs),
    /// Act as a vLLM engine: publish batches on ZMQ and serve replays, as that release does.
    /// Binds network sockets.
    ///
    /// Publishes the JSON batches given (one per file, in order, repeating until --count
    /// batches or forever; --once publishes each file once), a recording (--recording: its
    /// ranks, topics, seqs and payloads at the recorded timing scaled by --speed), or a
    /// scripted workload.
    Publish(PublishArgs),
    /// Check an engine's KV-event setup over the network: endpoints (discovered or given),
    /// exposure beyond loopback, block size and hash algorithm, whether anything listens,
    /// replay round trip, a live batch. One line per check; exits 1 when one failed.
    #[cfg(feature = "doctor")]
    Doctor(doctor::DoctorArgs),
    /// Print the fingerprint chain of token ids (XXH3-64, seed 1337). Offline.
    Fingerprint {
        /// Tokens per block.
        #[arg(long)]
        block_size: usize,
        /// Prefix fingerprint of the block before the first (decimal), if any.
        #[arg(long)]
        parent: Option<u64>,
        /// A JSON file holding an array of token ids, instead of TOKENS.
        #[arg(long, conflicts_with = "tokens")]
        file: Option<PathBuf>,
        /// Token ids.
        tokens: Vec<u32>,
    },
}

#[derive(clap::Args)]
struct PublishArgs {
    /// The release to speak.
    #[arg(long, default_value = "0.33.0")]
    release: wire::Release,
    /// PUB endpoint (binds when it has `*`, as vLLM does; otherwise connects).
    #[arg(long, default_value = "tcp://*:5557", value_parser = endpoint)]
    endpoint: String,
    /// Replay ROUTER endpoint; empty for none.
    #[arg(long, default_value = "tcp://*:5558", value_parser = endpoint_or_none)]
    replay_endpoint: String,
    /// Topic frame.
    #[arg(long, default_value = "kv-events")]
    topic: String,
    /// Time between batches, in milliseconds.
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// Stop after this many batches (0: run until interrupted).
    #[arg(long, default_value_t = 0, conflicts_with = "once")]
    count: u64,
    /// Publish each FILE once, in order, then stop (without it, the files repeat in a cycle).
    #[arg(long, requires = "files")]
    once: bool,
    /// A recording (`kvevents record`) to publish as the engine did: each rank on its own port
    /// (vLLM's offset from --endpoint and --replay-endpoint), its seqs and payload bytes as
    /// recorded.
    #[arg(long, conflicts_with_all = ["files", "count", "once", "interval_ms"])]
    recording: Option<PathBuf>,
    /// With --recording: the recorded timing scaled by this factor (10: ten times as fast), or
    /// `max`: as fast as possible.
    #[arg(long, default_value = "1", value_parser = record::speed, requires = "recording")]
    speed: record::Speed,
    /// With --recording: wait for this many subscribers on every rank before the first batch.
    #[arg(long, default_value_t = 0, requires = "recording")]
    wait_for: usize,
    /// With --recording: a damaged recording is published up to its damage (else it is an
    /// error naming the file and the byte).
    #[arg(long, requires = "recording")]
    skip_damaged: bool,
    // The help names a JSON batch: written as an attribute, not a doc comment, so that
    // rustdoc does not read its brackets as links.
    #[arg(
        help = r#"JSON batch files to publish instead of the scripted workload, in order, repeated until --count batches (or forever) unless --once. A file holds one batch, e.g. {"ts": 0, "events": [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": null, "token_ids": [1, 2, 3, 4], "block_size": 4}]} (docs/operating.md, "Test your router")"#
    )]
    files: Vec<PathBuf>,
}

/// Lines a person reads while `publish` runs: every publish of the first round, then a summary
/// at most every few seconds, and a last line with the total.
struct Progress {
    published: u64,
    last_summary: std::time::Instant,
}

impl Progress {
    const SUMMARY_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

    fn published(&mut self, seq: u64, what: &str, first_round: bool) {
        self.published += 1;
        if first_round {
            eprintln!("kvevents: published seq {seq}: {what}");
        } else if self.last_summary.elapsed() >= Self::SUMMARY_EVERY {
            eprintln!(
                "kvevents: {} batches published, up to seq {seq} (repeating; --count or --once to stop)",
                self.published
            );
        } else {
            return;
        }
        self.last_summary = std::time::Instant::now();
    }
}

/// What a batch holds, in a few words.
fn summary(batch: &wire::EventBatch<'_>) -> String {
    let (mut stored, mut removed, mut cleared) = (0usize, 0usize, 0usize);
    for event in &batch.events {
        match event {
            wire::Event::BlockStored(e) => stored += e.block_hashes.len(),
            wire::Event::BlockRemoved(e) => removed += e.block_hashes.len(),
            wire::Event::AllBlocksCleared(_) => cleared += 1,
        }
    }
    let mut words = vec![
        format!("{stored} block(s) stored"),
        format!("{removed} removed"),
    ];
    if cleared > 0 {
        words.push(format!("{cleared} clear(s)"));
    }
    words.join(", ")
}

fn publish(args: PublishArgs) -> anyhow::Result<()> {
    let PublishArgs {
        release,
        endpoint,
        replay_endpoint,
        topic,
        interval_ms,
        count,
        once,
        recording,
        speed,
        wait_for,
        skip_damaged,
        files,
    } = args;
    if let Some(recording) = recording {
        return record::publish_recording(record::Replay {
            recording,
            endpoint,
            replay_endpoint,
            release,
            speed,
            wait_for,
            skip_damaged,
        });
    }
    let files = files.as_slice();
    use anyhow::Context as _;
    use kvevent_zmq::publisher::{Publisher, PublisherConfig, scripted_batch};
    let texts = files
        .iter()
        .map(|f| std::fs::read(f).with_context(|| format!("cannot read {}", f.display())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let values = texts
        .iter()
        .zip(files)
        .map(|(t, f)| {
            serde_json::from_slice(t).with_context(|| format!("{}: not JSON", f.display()))
        })
        .collect::<anyhow::Result<Vec<serde_json::Value>>>()?;
    let batches = values
        .iter()
        .zip(files)
        .map(|(v, f)| json::from_json(v).with_context(|| f.display().to_string()))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let count = if once { batches.len() as u64 } else { count };
    let ctx = zmq::Context::new();
    let config = PublisherConfig {
        endpoint,
        replay_endpoint: (!replay_endpoint.is_empty()).then_some(replay_endpoint),
        topic: topic.into_bytes(),
        release,
        ..PublisherConfig::loopback(release)
    };
    let engine = Publisher::start(&ctx, config)?;
    let what = match (files.len(), count) {
        (0, _) => "a scripted workload".to_string(),
        (n, c) if c == n as u64 => format!("{n} file(s) once"),
        (n, _) => format!("{n} file(s), repeated in order"),
    };
    let until = match count {
        0 => "until interrupted".to_string(),
        c => format!("{c} batch(es)"),
    };
    eprintln!(
        "kvevents: publishing {what} as vLLM {release} on {} (replay: {}), one batch every {interval_ms} ms, {until}",
        engine.endpoint(),
        engine.replay_endpoint().unwrap_or("none")
    );
    let mut progress = Progress {
        published: 0,
        last_summary: std::time::Instant::now(),
    };
    let mut step = 0u64;
    while count == 0 || step < count {
        let (seq, what) = if batches.is_empty() {
            let batch = scripted_batch(step);
            (engine.publish(&batch)?, summary(&batch))
        } else {
            let i = (step as usize) % batches.len();
            let batch = &batches[i];
            let what = format!("{} ({})", files[i].display(), summary(batch));
            (engine.publish(batch)?, what)
        };
        let first_round = step < batches.len().max(1) as u64;
        progress.published(seq, &what, first_round);
        step += 1;
        if count == 0 || step < count {
            std::thread::sleep(std::time::Duration::from_millis(interval_ms));
        }
    }
    eprintln!("kvevents: published {step} batch(es); closing in 0.5 s");
    // Let subscribers replay the tail before the sockets close.
    std::thread::sleep(std::time::Duration::from_millis(500));
    Ok(())
}

/// A ZeroMQ endpoint flag's value: clap names the flag with what is wrong.
pub(crate) fn endpoint(text: &str) -> Result<String, String> {
    kvevent_zmq::check_endpoint(text).map(|()| text.to_owned())
}

/// As [`endpoint`], or empty for none.
pub(crate) fn endpoint_or_none(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Ok(String::new());
    }
    endpoint(text)
}

/// How to reach an engine, as `record` and `doctor` take it: the sidecar's flags by the same
/// names, read into the one spec every tool builds its sockets from
/// ([`kvevent_zmq::EngineSockets`]).
#[derive(clap::Args)]
pub(crate) struct EngineArgs {
    /// The engine's KV-event PUB endpoint, rank 0's with --dp-size; a `*` binds, for engines
    /// that connect (record: tcp://127.0.0.1:5557 when not given).
    #[arg(long, value_parser = endpoint)]
    pub(crate) endpoint: Option<String>,
    /// Its replay ROUTER endpoint (rank 0's); empty: none.
    #[arg(long, default_value = "", value_parser = endpoint_or_none)]
    replay_endpoint: String,
    /// Data-parallel ranks 0..N-1, endpoints by vLLM's port offset from the two above.
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    /// Topic prefix to subscribe to (empty: every topic; vLLM's default is `kv-events`,
    /// SGLang's empty).
    #[arg(long, default_value = "")]
    topic: String,
    /// Whose wire the payloads are: vllm or sglang.
    #[arg(long, default_value = "vllm")]
    pub(crate) engine: wire::Engine,
}

impl EngineArgs {
    /// The spec, with `endpoint` as the PUB endpoint (the one given, or a command's default).
    pub(crate) fn sockets(&self, endpoint: &str) -> kvevent_zmq::EngineSockets {
        kvevent_zmq::EngineSockets {
            endpoint: endpoint.to_owned(),
            replay: (!self.replay_endpoint.is_empty()).then(|| self.replay_endpoint.clone()),
            dp: self.dp_size,
            topic: self.topic.as_bytes().to_vec(),
            engine: self.engine,
            http: None,
            bind: kvevent_zmq::publisher::binds(endpoint),
        }
    }
}

/// `bytes` in the unit a person reads: 812 B, 35.0 KB, 1.2 MB, 3.40 GB (powers of 1,000).
pub(crate) fn human_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_000 => format!("{bytes} B"),
        1_000..1_000_000 => format!("{:.1} KB", b / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.2} GB", b / 1e9),
    }
}

fn fingerprint(
    block_size: usize,
    parent: Option<u64>,
    file: Option<&PathBuf>,
    tokens: Vec<u32>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    anyhow::ensure!(block_size > 0, "--block-size must be at least 1");
    let tokens = match file {
        Some(f) => serde_json::from_slice::<Vec<u32>>(
            &std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?,
        )
        .with_context(|| format!("{}: expected a JSON array of token ids", f.display()))?,
        None => tokens,
    };
    let chain = kvevent_fingerprint::chain(&tokens, block_size, parent);
    let mut out = io::BufWriter::new(io::stdout().lock());
    for (i, block) in chain.iter().enumerate() {
        let hex: String = kvevent_fingerprint::wire_key(block.prefix)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        writeln!(
            out,
            "{}",
            serde_json::json!({
                "block": i,
                "token_count": (i + 1) * block_size,
                "content": block.content.to_string(),
                "prefix": block.prefix.to_string(),
                "prefix_be_hex": hex,
            })
        )?;
    }
    out.flush()?;
    let tail = tokens.len() % block_size;
    if tail > 0 {
        eprintln!("kvevents: {tail} token(s) after the last full block are not fingerprinted");
    }
    Ok(())
}

fn read_input(path: &PathBuf) -> io::Result<Vec<u8>> {
    if path.as_os_str() == "-" {
        let mut buf = Vec::new();
        io::stdin().read_to_end(&mut buf)?;
        Ok(buf)
    } else {
        std::fs::read(path)
    }
}

/// What to say of a payload that does not decode but reads as JSON text: decode takes the
/// msgpack bytes an engine sends, and `encode` makes them from a batch's JSON.
fn json_hint(payload: &[u8]) -> &'static str {
    let text = payload.trim_ascii_start();
    if std::str::from_utf8(text).is_ok() && matches!(text.first(), Some(b'{' | b'[')) {
        " (this is JSON text: decode reads the msgpack payload an engine sends; \
         `kvevents encode --release R FILE` makes one from a batch's JSON)"
    } else {
        ""
    }
}

fn decode(engine: wire::Engine, files: &[PathBuf]) -> ExitCode {
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let mut failed = false;
    for path in files {
        let name = path.display();
        let payload = match read_input(path) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("kvevents: {name}: cannot read: {e}");
                failed = true;
                continue;
            }
        };
        if record::is_recording(&payload) {
            match record::decode_recording(&name.to_string(), &payload, &mut out) {
                Ok(true) => {}
                Ok(false) => failed = true,
                Err(e) if closed_pipe(&e) => return ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("kvevents: {e:#}");
                    failed = true;
                }
            }
            continue;
        }
        match wire::decode_engine(&payload, engine, &wire::Limits::DEFAULT) {
            Ok(batch) => {
                if batch.unknown_events > 0 {
                    eprintln!(
                        "kvevents: {name}: skipped {} event(s) of unknown type",
                        batch.unknown_events
                    );
                }
                let line = json::to_json_engine(&batch, engine);
                match writeln!(out, "{line}") {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("kvevents: cannot write to stdout: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            Err(e) => {
                eprintln!(
                    "kvevents: {name}: byte {}: {}{}",
                    e.offset(),
                    e.kind(),
                    json_hint(&payload)
                );
                failed = true;
            }
        }
    }
    if out.flush().is_err() || failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// A release of one engine, as `encode --release` names it.
enum Target {
    Vllm(wire::Release),
    Sglang(wire::SglangRelease),
}

/// `--release` for `engine`, or clap's usage error (exit 2), as for any bad flag value.
fn target(engine: wire::Engine, release: &str, lenient: bool) -> Target {
    use clap::CommandFactory as _;
    let usage = |message: String| -> ! {
        Cli::command()
            .error(clap::error::ErrorKind::ValueValidation, message)
            .exit()
    };
    match engine {
        wire::Engine::Vllm => match release.parse() {
            Ok(r) => Target::Vllm(r),
            Err(e) => usage(format!("invalid value '{release}' for '--release': {e}")),
        },
        wire::Engine::Sglang if lenient => usage("--lenient is for vLLM releases".into()),
        wire::Engine::Sglang => match release.parse() {
            Ok(r) => Target::Sglang(r),
            Err(e) => usage(format!("invalid value '{release}' for '--release': {e}")),
        },
    }
}

fn encode(
    target: Target,
    lenient: bool,
    file: &PathBuf,
    out: Option<&PathBuf>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let text = read_input(file).with_context(|| format!("cannot read {}", file.display()))?;
    let value: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("{}: not JSON", file.display()))?;
    let mut batch = json::from_json(&value).with_context(|| file.display().to_string())?;
    let bytes = match target {
        Target::Vllm(release) => {
            if lenient {
                batch.retain_fields_of(release);
            }
            wire::encode(&batch, release)
        }
        Target::Sglang(release) => wire::encode_sglang(&batch, release),
    }
    .with_context(|| file.display().to_string())?;
    match out {
        Some(path) => {
            std::fs::write(path, &bytes).with_context(|| format!("cannot write {}", path.display()))
        }
        None => io::stdout()
            .write_all(&bytes)
            .context("cannot write to stdout"),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Decode { engine, files } => decode(engine, &files),
        Command::Encode {
            engine,
            release,
            lenient,
            file,
            out,
        } => report(encode(
            target(engine, &release, lenient),
            lenient,
            &file,
            out.as_ref(),
        )),
        Command::Publish(args) => report(publish(args)),
        Command::Record(args) => report(record::record(args)),
        Command::Stats(args) => report(stats::stats(args)),
        #[cfg(feature = "doctor")]
        Command::Doctor(args) => match doctor::run(&args) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("kvevents: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Fingerprint {
            block_size,
            parent,
            file,
            tokens,
        } => report(fingerprint(block_size, parent, file.as_ref(), tokens)),
    }
}

/// The reader of our output went away (`kvevents decode x | head`): not an error of ours.
fn closed_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    })
}

/// Exit 0, or the error on stderr and exit 1; a closed pipe ends quietly.
fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if closed_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvevents: {e:#}");
            ExitCode::FAILURE
        }
    }
}
