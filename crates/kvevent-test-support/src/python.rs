//! The Python publishers (msgspec + pyzmq, as vLLM and SGLang build theirs) as child
//! processes.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};

/// A running `python/vllm_publisher.py` or `python/sglang_publisher.py`. Dropping it closes
/// its stdin and kills it.
pub struct PythonPublisher {
    child: Child,
    stdin: Option<ChildStdin>,
    /// Its PUB endpoint.
    pub endpoint: String,
    /// Its replay ROUTER endpoint.
    pub replay_endpoint: String,
}

/// The interpreter with msgspec and pyzmq: `KVEVENT_PYTHON`, else the workspace's `.venv`.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVEVENT_PYTHON") {
        return p.into();
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    if venv.exists() {
        venv
    } else {
        "python3".into()
    }
}

impl PythonPublisher {
    /// Starts the vLLM publisher speaking `release`; `args` are extra flags (`--interval 0.01`).
    pub fn spawn(release: &str, args: &[&str]) -> Self {
        Self::spawn_script("vllm_publisher.py", release, args)
    }

    /// Starts the SGLang publisher speaking `release` (`0.5.18`, `0.4.6.post5`); `args` are
    /// extra flags (`--eagle`, `--salt S`, `--rank N`).
    pub fn spawn_sglang(release: &str, args: &[&str]) -> Self {
        Self::spawn_script("sglang_publisher.py", release, args)
    }

    fn spawn_script(script: &str, release: &str, args: &[&str]) -> Self {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("python")
            .join(script);
        let mut child = Command::new(python())
            .arg(script)
            .args(["--release", release])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect(
                "start the Python publisher (bash .ci/run installs msgspec and pyzmq in .venv)",
            );
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the publisher's endpoints");
        let v: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("publisher printed {line:?}: {e}"));
        Self {
            stdin: child.stdin.take(),
            endpoint: v["endpoint"].as_str().expect("endpoint").to_owned(),
            replay_endpoint: v["replay_endpoint"].as_str().expect("replay").to_owned(),
            child,
        }
    }
}

impl PythonPublisher {
    /// Kills the process with SIGKILL, as an OOM kill or a node failure would: no goodbye.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PythonPublisher {
    fn drop(&mut self) {
        self.stdin.take();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
