//! What following many engines costs while they are idle: N sources (one thread each, polling
//! its sockets every 50 ms), CPU and resident memory of this process from `/proc`.
//!
//! `cargo run --release -p kvevent-benches --bin fleet-idle [-- N SECONDS [caller]]` (default 256,
//! 5; `caller`: every source read by the subscriber's thread instead of one thread each).

use std::time::{Duration, Instant};

use kvevent_source::{Config, Subscriber};
use kvevent_zmq as transport;
use kvevent_zmq::publisher::{Publisher, PublisherConfig};

const USAGE: &str = "usage: fleet-idle [N [SECONDS [caller]]]   (default 256 5)
What following N idle engines costs over SECONDS: CPU and resident memory of the sources, one
thread each, or with `caller` every source read by the subscriber's thread.";

fn main() -> anyhow::Result<()> {
    let mut args = kvevent_benches::Cli::new(USAGE);
    let n: usize = args.positional("N", 256)?;
    let secs: f64 = args.positional("SECONDS", 5.0)?;
    let threads = match args.arg().as_deref() {
        None => true,
        Some("caller") => false,
        Some(other) => return Err(args.error(&format!("`{other}` is not `caller`"))),
    };
    args.done()?;
    let ctx = zmq::Context::new();
    let engine = Publisher::start(
        &ctx,
        PublisherConfig {
            replay_endpoint: None,
            ..PublisherConfig::loopback(kvevent_wire::Release::new(0, 33, 0))
        },
    )?;
    let rss0 = kvevent_benches::procfs::status_kb("/proc/self/status", "VmRSS:");
    let mut config = Config::new(Vec::new());
    config.threads = threads;
    let mut sub = Subscriber::start(&ctx, config)?;
    for _ in 0..n {
        sub.add_source(transport::Source {
            endpoint: engine.endpoint().to_owned(),
            replay_endpoint: None,
            topic: b"kv-events".to_vec(),
            bind: false,
            dp_rank: 0,
        })?;
    }
    anyhow::ensure!(
        engine.wait_for_subscribers(n, Duration::from_secs(30)),
        "sources did not subscribe"
    );
    let cpu0 = kvevent_benches::procfs::cpu_seconds("/proc/self/stat");
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < secs {
        let _ = sub.next(Duration::from_millis(100));
    }
    let cpu = kvevent_benches::procfs::cpu_seconds("/proc/self/stat") - cpu0;
    println!(
        "{n} idle sources ({}): {:.2} % of a core, {:.1} MB resident for the sources ({:.0} kB each)",
        if threads {
            "a thread each"
        } else {
            "read by the caller"
        },
        100.0 * cpu / started.elapsed().as_secs_f64(),
        (kvevent_benches::procfs::status_kb("/proc/self/status", "VmRSS:") - rss0) / 1024.0,
        (kvevent_benches::procfs::status_kb("/proc/self/status", "VmRSS:") - rss0) / n as f64
    );
    sub.shutdown();
    engine.shutdown();
    Ok(())
}
