//! What following many engines costs while they are idle: N sources read by the subscriber's
//! thread, CPU and resident memory of this process from `/proc`.
//!
//! `cargo run --release -p kvevent-benches --bin fleet-idle [-- N SECONDS]` (default 256, 5).

use std::time::{Duration, Instant};

use kvevent_source::{Config, Subscriber};
use kvevent_zmq as transport;
use kvevent_zmq::publisher::{Publisher, PublisherConfig};

const USAGE: &str = "usage: fleet-idle [N [SECONDS]]   (default 256 5)
What following N idle engines costs over SECONDS: CPU and resident memory of the sources, every
one read by the subscriber's thread.";

fn main() -> anyhow::Result<()> {
    let mut args = kvevent_benches::Cli::new(USAGE);
    let n: usize = args.positional("N", 256)?;
    let secs: f64 = args.positional("SECONDS", 5.0)?;
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
    let mut sub = Subscriber::start(&ctx, Config::new(Vec::new()))?;
    for _ in 0..n {
        sub.add_source(transport::Source {
            endpoint: engine.endpoint().to_owned(),
            replay_endpoint: None,
            topic: b"kv-events".to_vec(),
            bind: false,
            dp_rank: 0,
        })?;
    }
    // The subscriptions go out as the subscriber's thread uses the sockets.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !engine.wait_for_subscribers(n, Duration::ZERO) {
        anyhow::ensure!(Instant::now() < deadline, "sources did not subscribe");
        let _ = sub.next(Duration::from_millis(50));
    }
    let cpu0 = kvevent_benches::procfs::cpu_seconds("/proc/self/stat");
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < secs {
        let _ = sub.next(Duration::from_millis(100));
    }
    let cpu = kvevent_benches::procfs::cpu_seconds("/proc/self/stat") - cpu0;
    println!(
        "{n} idle sources: {:.2} % of a core, {:.1} MB resident for the sources ({:.0} kB each)",
        100.0 * cpu / started.elapsed().as_secs_f64(),
        (kvevent_benches::procfs::status_kb("/proc/self/status", "VmRSS:") - rss0) / 1024.0,
        (kvevent_benches::procfs::status_kb("/proc/self/status", "VmRSS:") - rss0) / n as f64
    );
    sub.shutdown();
    engine.shutdown();
    Ok(())
}
