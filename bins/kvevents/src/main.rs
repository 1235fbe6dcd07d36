//! `kvevents`: decode vLLM KV-event payloads to normalized JSON lines, and encode JSON back to
//! the exact bytes a given vLLM release sends.

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
    /// Decode payload files (the third ZMQ frame; `-` for stdin) to one JSON line each.
    ///
    /// Exits 0 when every file decodes; otherwise reports each bad file on stderr (file,
    /// byte offset, reason), goes on with the rest and exits 1.
    Decode {
        /// Payload files; `-` reads stdin.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Encode one normalized JSON batch as the payload bytes a vLLM release sends.
    Encode {
        /// The vLLM release to speak, e.g. 0.26.0 (0.9.0 or later; newer than 0.33 is
        /// written as 0.33).
        #[arg(long)]
        release: wire::Release,
        /// Drop fields the release does not have instead of failing.
        #[arg(long)]
        lenient: bool,
        /// The JSON batch file; `-` reads stdin.
        file: PathBuf,
        /// Write here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
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

fn decode(files: &[PathBuf]) -> ExitCode {
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
        match wire::decode(&payload) {
            Ok(batch) => {
                if batch.unknown_events > 0 {
                    eprintln!(
                        "kvevents: {name}: skipped {} event(s) of unknown type",
                        batch.unknown_events
                    );
                }
                let line = json::to_json(&batch);
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

fn encode(
    release: wire::Release,
    lenient: bool,
    file: &PathBuf,
    out: Option<&PathBuf>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let text = read_input(file).with_context(|| format!("cannot read {}", file.display()))?;
    let value: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("{}: not JSON", file.display()))?;
    let mut batch = json::from_json(&value).with_context(|| file.display().to_string())?;
    if lenient {
        batch.retain_fields_of(release);
    }
    let bytes = wire::encode(&batch, release).with_context(|| file.display().to_string())?;
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
        Command::Decode { files } => decode(&files),
        Command::Encode {
            release,
            lenient,
            file,
            out,
        } => match encode(release, lenient, &file, out.as_ref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvevents: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}
