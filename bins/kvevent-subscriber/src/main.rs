#![doc = include_str!("../README.md")]

mod cli;

use std::process::ExitCode;
use std::time::Duration;

use kvevent_sidecar::{self as sidecar, Settings};

/// Bad configuration (EX_USAGE).
const EXIT_CONFIG: u8 = 64;
/// The sidecar could not start (EX_UNAVAILABLE).
const EXIT_START: u8 = 69;
/// The discovered engine endpoints changed: drained, start again (EX_TEMPFAIL).
const EXIT_TEMPFAIL: u8 = 75;
/// A second signal: stop now.
const EXIT_INTERRUPTED: i32 = 130;

fn init_tracing(format: sidecar::settings::LogFormat, level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a person at a terminal, never into a log file or collector.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        sidecar::settings::LogFormat::Json => builder.json().init(),
        sidecar::settings::LogFormat::Text => builder.init(),
    }
}

/// One thread runs every task (forwarder, its connection, stats, HTTP endpoint): the work per
/// RPC is small, and wakeups between worker threads cost more than the work (the load
/// benchmark measured it).
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

fn main() -> ExitCode {
    let cli = match cli::parse(std::env::args()) {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Some(cli::Command::Demo { batches }) = cli.command {
        init_tracing(sidecar::settings::LogFormat::Text, "warn");
        // The demo also runs the engine stand-in, which blocks: it needs worker threads.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build();
        return match rt.map(|rt| rt.block_on(sidecar::demo::run(batches))) {
            Ok(Ok(_)) => ExitCode::SUCCESS,
            Ok(Err(e)) => {
                eprintln!("demo failed: {e}");
                ExitCode::FAILURE
            }
            Err(e) => {
                eprintln!("cannot start the runtime: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let settings = match Settings::load(cli.config.as_ref(), &cli.options) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvevent-subscriber: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    init_tracing(settings.log_format, &settings.log_level);
    for adjustment in &settings.adjustments {
        tracing::warn!("{adjustment}");
    }
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return ExitCode::from(EXIT_START);
        }
    };
    rt.block_on(run(settings))
}

async fn run(settings: Settings) -> ExitCode {
    let ctx = zmq::Context::new();
    let mut running = match sidecar::start(&settings, &ctx).await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %sidecar::error_chain(&e), "cannot start");
            return ExitCode::from(EXIT_START);
        }
    };
    let mut exit = ExitCode::SUCCESS;
    tokio::select! {
        signal = wait_for_signal() => {
            tracing::info!(signal, drain_timeout = ?settings.drain_timeout.0, "stopping: draining pending reports");
        }
        what = running.layout_changed() => {
            tracing::warn!(change = %what, drain_timeout = ?settings.drain_timeout.0, "stopping to start again on the new endpoint layout: draining pending reports, then exit {EXIT_TEMPFAIL}");
            exit = ExitCode::from(EXIT_TEMPFAIL);
        }
    }
    tokio::spawn(async {
        let second = wait_for_signal().await;
        tracing::warn!(signal = second, "second signal: exiting now");
        std::process::exit(EXIT_INTERRUPTED);
    });
    let left = running.shutdown(settings.drain_timeout.0).await;
    if left.unsent_prefixes + left.unsent_events > 0 {
        tracing::warn!(
            unsent_prefixes = left.unsent_prefixes,
            unsent_events = left.unsent_events,
            "stopped with reports unsent"
        );
    } else {
        tracing::info!("stopped: everything pending was sent");
    }
    // Sockets close with linger 0; give the log a moment to flush.
    tokio::time::sleep(Duration::from_millis(10)).await;
    exit
}

async fn wait_for_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return "none";
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
