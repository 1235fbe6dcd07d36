//! What the recording tests share: the program, a scratch directory of their own, and a
//! recorder run, waited for and stopped.

#![allow(dead_code, reason = "each test file uses some of these")]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvevent_recording::{Record, read_all};
use kvevent_test_support::eventually_blocking;

/// How long a recording test waits for what it expects.
pub(crate) const WAIT: Duration = Duration::from_secs(30);

/// The `kvevents` binary under test.
pub(crate) fn kvevents() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvevents"))
}

/// An empty directory for `name`, this process's own.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvevents-rec-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

/// Records `endpoint` (with its replay buffer first) to `out` until stopped.
pub(crate) fn record(endpoint: &str, replay: &str, engine: &str, out: &Path) -> Child {
    kvevents()
        .args([
            "record",
            "--endpoint",
            endpoint,
            "--replay-endpoint",
            replay,
        ])
        .args(["--replay-first", "--engine", engine, "-o"])
        .arg(out)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn record")
}
/// Waits until the recording at `path` holds `n` records.
pub(crate) fn wait_recorded(path: &Path, n: usize) -> Vec<Record> {
    eventually_blocking(&format!("{n} records in {}", path.display()), WAIT, || {
        let records = std::fs::read(path)
            .ok()
            .and_then(|bytes| read_all(&bytes).ok())
            .map(|(_, records, _)| records)
            .unwrap_or_default();
        if records.len() >= n {
            Ok(records)
        } else {
            Err(format!("{} records", records.len()))
        }
    })
}
/// Stops a recorder as Ctrl-C would; it must exit 0 and leave a whole file.
pub(crate) fn stop(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().expect("wait");
    assert!(status.success(), "record exited {status}");
}

/// Publishes a recording on loopback ports the OS picks; returns the child and its rank 0's
/// PUB and replay endpoints, read from what it prints.
pub(crate) fn publish(recording: &Path, speed: &str, wait_for: usize) -> (Child, String, String) {
    let mut child = kvevents()
        .args(["publish", "--recording"])
        .arg(recording)
        .args([
            "--endpoint",
            "tcp://127.0.0.1:*",
            "--replay-endpoint",
            "tcp://127.0.0.1:*",
        ])
        .args(["--speed", speed, "--wait-for", &wait_for.to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn publish");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let line = loop {
        let line = lines
            .next()
            .expect("publish printed its endpoints")
            .expect("utf-8");
        if line.contains("rank 0 on ") {
            break line;
        }
    };
    std::thread::spawn(move || for _ in lines {});
    // "kvevents: rank 0 on tcp://127.0.0.1:P (replay: tcp://127.0.0.1:Q)"
    let endpoint = line
        .split("rank 0 on ")
        .nth(1)
        .and_then(|r| r.split(' ').next());
    let replay = line
        .split("(replay: ")
        .nth(1)
        .map(|r| r.trim_end_matches(')'));
    (
        child,
        endpoint.expect("endpoint").to_owned(),
        replay.expect("replay").to_owned(),
    )
}
