//! Shared helpers for the benchmarks: where the test vectors are, and `/proc` readings.

use std::path::{Path, PathBuf};

/// The repository's `testdata/` (copies of the shared vectors; see its README).
pub fn shared_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

/// Every vLLM vector payload as `(vllm-release/case, bytes)`, sorted by name.
pub fn vector_payloads() -> std::io::Result<Vec<(String, Vec<u8>)>> {
    vector_payloads_of("vllm-")
}

/// The same for the folders named `<prefix><release>` (`vllm-`, `sglang-`).
pub fn vector_payloads_of(prefix: &str) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for release in std::fs::read_dir(shared_dir().join("vectors"))? {
        let release = release?.path();
        let vllm = release
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(prefix));
        if !release.is_dir() || !vllm {
            continue;
        }
        for file in std::fs::read_dir(&release)? {
            let path = file?.path();
            if path.extension().is_some_and(|e| e == "msgpack") {
                let name = format!(
                    "{}/{}",
                    release.file_name().unwrap_or_default().to_string_lossy(),
                    path.file_stem().unwrap_or_default().to_string_lossy()
                );
                out.push((name, std::fs::read(&path)?));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Blocking calls to the example router's and the sidecar's endpoints, through the
/// workspace's client (`kvevent_simulator::client`) on a runtime of their own.
pub mod http {
    use std::time::Duration;

    /// `METHOD path` with `body` to `addr` (`host:port`); the response's body (an error for an
    /// answer that is not 2xx).
    pub fn call(addr: &str, method: &str, path: &str, body: &str) -> std::io::Result<String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let client = kvevent_simulator::client::client();
        let base = format!("http://{addr}");
        let called = runtime.block_on(kvevent_simulator::client::call(
            &client,
            &base,
            method,
            path,
            body,
            Duration::from_secs(30),
        ));
        match called {
            Ok((status, body)) if (200..300).contains(&status) => Ok(body),
            Ok((status, body)) => Err(std::io::Error::other(format!(
                "{method} {base}{path}: {status}: {body}"
            ))),
            Err(e) => Err(std::io::Error::other(format!("{e:#}"))),
        }
    }

    /// `GET path`.
    pub fn get(addr: &str, path: &str) -> std::io::Result<String> {
        call(addr, "GET", path, "")
    }

    /// Sum of a Prometheus family's samples in `text`.
    pub fn sum(text: &str, family: &str) -> f64 {
        text.lines()
            .filter(|l| {
                l.strip_prefix(family)
                    .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Kills and reaps a child process when dropped.
    #[derive(Debug)]
    pub struct Guard(pub std::process::Child);

    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Readings from `/proc` for the probes: CPU time and memory of a process or thread.
pub mod procfs {
    /// utime + stime, in seconds, of the process or thread whose `stat` file is `stat_path`
    /// (`/proc/self/stat`, `/proc/thread-self/stat`, `/proc/PID/stat`); 0 when unreadable.
    pub fn cpu_seconds(stat_path: &str) -> f64 {
        let stat = std::fs::read_to_string(stat_path).unwrap_or_default();
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            return 0.0;
        };
        // After the command: the state (index 0), then utime at 11 and stime at 12, in ticks
        // of USER_HZ (100 on Linux).
        let fields: Vec<&str> = rest.split_whitespace().collect();
        fields.get(11..13).map_or(0.0, |f| {
            f.iter().filter_map(|v| v.parse::<f64>().ok()).sum()
        }) / 100.0
    }

    /// A `kB` field of a `status` file (`VmRSS:`, `VmHWM:`), in kB; 0 when absent.
    pub fn status_kb(status_path: &str, field: &str) -> f64 {
        std::fs::read_to_string(status_path)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    }
}

/// How this machine answers random loads: the floor under anything that looks up large
/// tables (the index's key table and block maps at fleet scale do not fit in cache).
pub mod memory {
    use std::time::Instant;

    /// Nanoseconds a load over `bytes` of memory costs when `chains` independent pointer
    /// chases run side by side (1: a lone load's full latency; 16 or more: how many loads a
    /// core keeps in flight bounds it). Each load is a cache line at random.
    pub fn random_load_ns(bytes: usize, chains: usize) -> f64 {
        const WORDS: usize = 8; // one cache line of `u64`
        let lines = (bytes / 64).max(chains * 2);
        // One random cycle through every line (Sattolo's shuffle): no chase repeats early.
        let mut order: Vec<usize> = (0..lines).collect();
        let mut s = 0x9E37_79B9_7F4A_7C15_u64;
        for i in (1..lines).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            order.swap(i, (s % i as u64) as usize);
        }
        let mut next = vec![0u64; lines * WORDS];
        for k in 0..lines {
            next[order[k] * WORDS] = (order[(k + 1) % lines] * WORDS) as u64;
        }
        let mut at: Vec<usize> = (0..chains)
            .map(|c| order[c * lines / chains] * WORDS)
            .collect();
        let rounds = 2_000_000 / chains;
        let t = Instant::now();
        for _ in 0..rounds {
            for p in &mut at {
                *p = next[*p] as usize;
            }
        }
        let ns = t.elapsed().as_nanos() as f64 / (rounds * chains) as f64;
        std::hint::black_box(&at);
        ns
    }
}

/// A benchmark's command line: `-h` or `--help` prints its usage and exits; a value that does
/// not parse, a flag without its value and an argument left over are errors that name it.
pub struct Cli {
    args: std::vec::IntoIter<String>,
    usage: &'static str,
}

impl Cli {
    /// This process's arguments; exits after printing `usage` when one is `-h` or `--help`.
    pub fn new(usage: &'static str) -> Self {
        let args: Vec<String> = std::env::args().skip(1).collect();
        if args.iter().any(|a| a == "-h" || a == "--help") {
            println!("{usage}");
            std::process::exit(0);
        }
        Self {
            args: args.into_iter(),
            usage,
        }
    }

    /// The next argument as it is.
    pub fn arg(&mut self) -> Option<String> {
        self.args.next()
    }

    /// The next argument parsed as `what`, or `default` when there are no more.
    pub fn positional<T: std::str::FromStr>(
        &mut self,
        what: &str,
        default: T,
    ) -> anyhow::Result<T> {
        match self.args.next() {
            None => Ok(default),
            Some(v) => self.parse(what, &v),
        }
    }

    /// The value after `flag`, parsed.
    pub fn value<T: std::str::FromStr>(&mut self, flag: &str) -> anyhow::Result<T> {
        match self.args.next() {
            None => Err(self.error(&format!("{flag} needs a value"))),
            Some(v) => self.parse(flag, &v),
        }
    }

    /// `v` parsed as `what`.
    pub fn parse<T: std::str::FromStr>(&self, what: &str, v: &str) -> anyhow::Result<T> {
        v.parse()
            .map_err(|_| self.error(&format!("`{v}` is not a valid {what}")))
    }

    /// An error about the command line, with the usage.
    pub fn error(&self, what: &str) -> anyhow::Error {
        anyhow::anyhow!("{what}\n\n{}", self.usage)
    }

    /// An error if any argument is left.
    pub fn done(mut self) -> anyhow::Result<()> {
        match self.args.next() {
            None => Ok(()),
            Some(extra) => Err(self.error(&format!("unexpected argument `{extra}`"))),
        }
    }
}

/// Deterministic numbers for workloads: a xorshift generator and a 64-bit mixer, the
/// simulator's workloads' own (`kvevent_sim::workload`).
pub mod random {
    pub use kvevent_sim::workload::{Rng, mix};
}
