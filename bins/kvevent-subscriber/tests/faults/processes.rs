//! The processes under test: the engines (the Python stand-ins or `kvevent-simulator`) and the
//! sidecars (this package's binary), as children, with their ports and RSS.

#[allow(clippy::wildcard_imports, reason = "the harness's own parts")]
use super::*;

/// Which engine the harness runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EngineKind {
    /// The Python stand-in (`faulty_engine.py`: msgspec + pyzmq, as vLLM's), which prints
    /// each change as it makes it.
    Python,
    /// `kvevent-simulator` (vLLM's scheduler and prefix cache, simulated), its truth read from
    /// `/admin/truth`.
    Simulator,
}

/// An engine under test, a child process.
pub(crate) struct Engine {
    pub(crate) child: Child,
    /// The stand-in's commands.
    stdin: Option<ChildStdin>,
    /// The simulator's workload, truth reader and fault hooks.
    sim: Option<SimSide>,
}

impl Engine {
    pub(crate) fn spawn(
        kind: EngineKind,
        runtime: &tokio::runtime::Handle,
        ports: Ports,
        seed: u64,
        idle: bool,
        replay_delay: Duration,
        truth: &Shared<Truth>,
    ) -> Self {
        let incarnation = {
            let mut t = lock(truth);
            t.held.clear();
            t.all_changed();
            t.server = (true, Instant::now());
            t.note(format!("started{}", if idle { " idle" } else { "" }));
            t.incarnation
        };
        match kind {
            EngineKind::Python => Self::python(ports, seed, idle, replay_delay, truth, incarnation),
            // The simulator's replay socket answers at once: a kill with a slow replay is a kill.
            EngineKind::Simulator => {
                let (child, sim) = SimSide::spawn(runtime, ports, seed, idle, truth, incarnation);
                Self {
                    child,
                    stdin: None,
                    sim: Some(sim),
                }
            }
        }
    }

    fn python(
        ports: Ports,
        seed: u64,
        idle: bool,
        replay_delay: Duration,
        truth: &Shared<Truth>,
        incarnation: u64,
    ) -> Self {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../crates/kvevent-test-support/python/faulty_engine.py");
        let mut command = Command::new(kvevent_test_support::python());
        command
            .arg(script)
            .args(["--port", &ports.events.to_string()])
            .args(["--replay-port", &ports.replay.to_string()])
            .args(["--http-port", &ports.http.to_string()])
            .args(["--seed", &seed.to_string()])
            .args(["--prompts", &PROMPTS.to_string()])
            .args(["--blocks", &BLOCKS.to_string()])
            .args(["--buffer-steps", &BUFFER.to_string()])
            .args([
                "--replay-delay",
                &format!("{:.3}", replay_delay.as_secs_f64()),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if idle {
            command.arg("--idle");
        }
        let mut child = command
            .spawn()
            .expect("start the engine stand-in (bash .ci/run installs its Python peers)");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let truth = truth.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
            let _endpoints = lines.next();
            for line in lines {
                let mut t = lock(&truth);
                if t.incarnation != incarnation {
                    return;
                }
                let mut words = line.split(' ');
                let (kind, p, b) = (words.next(), words.next(), words.next());
                let block = |p: Option<&str>, b: Option<&str>| {
                    Some((p?.parse::<u32>().ok()?, b?.parse::<u32>().ok()?))
                };
                match (kind, block(p, b)) {
                    (Some("+"), Some(k)) => {
                        t.held.insert(k);
                        t.changed[k.0 as usize] = Instant::now();
                    }
                    (Some("-"), Some(k)) => {
                        t.held.remove(&k);
                        t.changed[k.0 as usize] = Instant::now();
                    }
                    (Some("C"), _) => {
                        t.held.clear();
                        t.all_changed();
                    }
                    _ => {}
                }
                if kind != Some(".") {
                    t.note(line);
                }
            }
        });
        Self {
            child,
            stdin: Some(stdin),
            sim: None,
        }
    }

    /// One of the stand-in's commands (`busy`, `lose N`, `lose N forget`, `clear`, `http
    /// down`, `http up`); the simulator's hooks for those it has.
    pub(crate) fn command(&mut self, line: &str) {
        if let Some(sim) = &self.sim {
            let lose = line
                .strip_prefix("lose ")
                .and_then(|n| n.parse::<u32>().ok());
            match (line, lose) {
                ("busy", _) => sim.set_busy(),
                ("http down", _) => sim.admin("/admin/http/down"),
                ("http up", _) => sim.admin("/admin/http/up"),
                (_, Some(n)) => sim.admin(&format!("/admin/publisher/drop?batches={n}")),
                _ => panic!("the simulator has no `{line}` (its faults are drawn without it)"),
            }
            return;
        }
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{line}");
            let _ = stdin.flush();
        }
    }

    pub(crate) fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status();
    }

    /// SIGKILL: the process and everything it held are gone.
    pub(crate) fn kill(mut self, truth: &Shared<Truth>) {
        {
            let mut t = lock(truth);
            t.note("killed".into());
            t.incarnation += 1;
            t.held.clear();
            t.all_changed();
            t.server = (false, Instant::now());
        }
        if let Some(sim) = &self.sim {
            sim.end();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// VmRSS of process `pid` ("self" for this one), in bytes.
pub(crate) fn rss_of(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// One engine's ports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ports {
    pub(crate) events: u16,
    pub(crate) replay: u16,
    pub(crate) http: u16,
}

/// A sidecar (this package's binary), feed only, as a child process.
pub(crate) struct Sidecar {
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
}

impl Sidecar {
    pub(crate) fn start(
        engine: Ports,
        feed_port: u16,
        name: &str,
        state_file: Option<&PathBuf>,
        dir: &std::path::Path,
    ) -> Self {
        static STARTS: AtomicU64 = AtomicU64::new(0);
        let log = dir.join(format!("{name}-{}.log", STARTS.fetch_add(1, Relaxed)));
        let mut command = Command::new(BIN);
        command
            .args([
                &format!("--engine-endpoint=tcp://127.0.0.1:{}", engine.events),
                &format!("--replay-endpoint=tcp://127.0.0.1:{}", engine.replay),
                &format!(
                    "--engine-metrics-url=http://127.0.0.1:{}/metrics",
                    engine.http
                ),
                "--engine-health-interval=200ms",
                &format!("--feed-address=127.0.0.1:{feed_port}"),
                &format!("--replica-id={name}"),
                "--model-id=llama",
                "--metrics-address=",
                "--stats-interval=0",
                "--log-level=warn",
            ])
            .env_remove("KVEVENT_REPLICA_ID")
            .env_remove("KVEVENT_MODEL_ID")
            .env_remove("KVEVENT_SERVER")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("the sidecar's log"));
        if let Some(path) = state_file {
            command.arg(format!("--state-file={}", path.display()));
            command.arg("--state-interval=200ms");
        }
        Self {
            child: command.spawn().expect("spawn the sidecar"),
            log,
        }
    }

    pub(crate) fn rss_bytes(&self) -> u64 {
        rss_of(&self.child.id().to_string())
    }

    pub(crate) fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM: it must end by itself, with status 0, and no panic in its log.
    pub(crate) fn terminate(mut self) -> Result<(), String> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return Err("did not exit within 10 s of SIGTERM".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        if log.contains("panicked") {
            return Err(format!("panicked: {log}"));
        }
        if !status.success() {
            return Err(format!("exited with {status}"));
        }
        Ok(())
    }
}
