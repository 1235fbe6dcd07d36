//! Shared helpers for the benchmarks: where the test vectors are, and `/proc` readings.

use std::path::{Path, PathBuf};

/// The repository's `testdata/` (copies of the shared vectors; see its README).
pub fn shared_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

/// Every vector payload as `(release/case, bytes)`, sorted by name.
pub fn vector_payloads() -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for release in std::fs::read_dir(shared_dir().join("vectors"))? {
        let release = release?.path();
        if !release.is_dir() {
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
