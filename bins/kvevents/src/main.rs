//! `kvevents`: tooling for vLLM (and SGLang) KV events.
//!
//! Offline:
//! - `decode`: payloads to normalized JSON lines (`--engine sglang` for SGLang's);
//! - `encode`: JSON back to the exact bytes a given vLLM (or SGLang) release sends;
//! - `fingerprint`: the content-fingerprint chain of token ids, to check that a gateway and the
//!   subscriber agree.
//!
//! Over the network:
//! - `publish`: a fake engine speaking any release (PUB + replay ROUTER);
//! - `doctor` (feature `doctor`, on by default): checks an engine's KV-event setup, one line
//!   per check.

#[cfg(feature = "doctor")]
mod doctor;

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
    /// Decode payload files (the third ZMQ frame; `-` for stdin) to one JSON line each. Offline.
    ///
    /// Exits 0 when every file decodes; otherwise reports each bad file on stderr (file,
    /// byte offset, reason), goes on with the rest and exits 1.
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
    /// Act as a vLLM engine: publish batches on ZMQ and serve replays, as that release does.
    /// Binds network sockets.
    ///
    /// Publishes the JSON batches given (one per file, in order), or a scripted workload.
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
    #[arg(long, default_value = "tcp://*:5557")]
    endpoint: String,
    /// Replay ROUTER endpoint; empty for none.
    #[arg(long, default_value = "tcp://*:5558")]
    replay_endpoint: String,
    /// Topic frame.
    #[arg(long, default_value = "kv-events")]
    topic: String,
    /// Time between batches, in milliseconds.
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// Stop after this many batches (0: run until interrupted).
    #[arg(long, default_value_t = 0)]
    count: u64,
    /// JSON batch files to publish instead of the scripted workload.
    files: Vec<PathBuf>,
}

fn publish(args: PublishArgs) -> anyhow::Result<()> {
    let PublishArgs {
        release,
        endpoint,
        replay_endpoint,
        topic,
        interval_ms,
        count,
        files,
    } = args;
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
    let ctx = zmq::Context::new();
    let config = PublisherConfig {
        endpoint,
        replay_endpoint: (!replay_endpoint.is_empty()).then_some(replay_endpoint),
        topic: topic.into_bytes(),
        release,
        ..PublisherConfig::loopback(release)
    };
    let engine = Publisher::start(&ctx, config)?;
    eprintln!(
        "kvevents: publishing as vLLM {release} on {} (replay: {})",
        engine.endpoint(),
        engine.replay_endpoint().unwrap_or("none")
    );
    let mut step = 0u64;
    while count == 0 || step < count {
        let seq = if batches.is_empty() {
            engine.publish(&scripted_batch(step))?
        } else {
            engine.publish(&batches[(step as usize) % batches.len()])?
        };
        if seq % 100 == 0 {
            eprintln!("kvevents: published seq {seq}");
        }
        step += 1;
        std::thread::sleep(std::time::Duration::from_millis(interval_ms));
    }
    // Let subscribers replay the tail before the sockets close.
    std::thread::sleep(std::time::Duration::from_millis(500));
    Ok(())
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
    for (i, block) in chain.iter().enumerate() {
        let hex: String = kvevent_fingerprint::wire_key(block.prefix)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "block": i,
                "token_count": (i + 1) * block_size,
                "content": block.content.to_string(),
                "prefix": block.prefix.to_string(),
                "prefix_be_hex": hex,
            })
        );
    }
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
        match wire::decode_engine(&payload, engine, &wire::Limits::DEFAULT) {
            Ok(batch) => {
                if batch.unknown_events > 0 {
                    eprintln!(
                        "kvevents: {name}: skipped {} event(s) of unknown type",
                        batch.unknown_events
                    );
                }
                let line = json::to_json_engine(&batch, engine);
                if writeln!(out, "{line}").is_err() {
                    return ExitCode::FAILURE;
                }
            }
            Err(e) => {
                eprintln!("kvevents: {name}: byte {}: {}", e.offset(), e.kind());
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

fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvevents: {e:#}");
            ExitCode::FAILURE
        }
    }
}
