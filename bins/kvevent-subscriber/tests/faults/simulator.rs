//! `kvevent-simulator` as the engine under test: one engine a process on the replica's ports
//! (so a process killed and started again is found where it was), a workload of the harness's
//! prompts sent to its HTTP API, and its truth read from `/admin/truth` (the block hashes it
//! holds, mapped back to prompts and blocks by the fingerprint chain its events carry).
//! Faults: SIGKILL and SIGSTOP as for the stand-in, batches lost through
//! `/admin/publisher/drop`, the API server gone through `/admin/http/down`.

#[allow(clippy::wildcard_imports, reason = "the harness's own parts")]
use super::*;

/// How often the truth is read: a change is seen this late at most (well within the window).
const TRUTH_EVERY: Duration = Duration::from_millis(20);
/// A request every this often while busy: with 40 blocks of cache, prompts come and go.
const REQUEST_EVERY: Duration = Duration::from_millis(15);

/// The simulator binary: `KVEVENT_SIMULATOR`, or the one built beside this test.
fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("KVEVENT_SIMULATOR") {
        return path.into();
    }
    let exe = std::env::current_exe().expect("the test's path");
    let dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("target/debug");
    let path = dir.join("kvevent-simulator");
    assert!(
        path.exists(),
        "{} is not built: cargo build -p kvevent-simulator (or set KVEVENT_SIMULATOR)",
        path.display()
    );
    path
}

/// What the harness keeps of a simulator engine.
pub(crate) struct SimSide {
    base: String,
    runtime: tokio::runtime::Handle,
    /// The workload runs (an engine started idle waits for `busy`).
    busy: Arc<std::sync::atomic::AtomicBool>,
    /// The workload's and the truth's threads end.
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl SimSide {
    /// Starts the simulator on `ports`, its workload (unless `idle`) and its truth reader;
    /// returns its process once it serves.
    pub(crate) fn spawn(
        runtime: &tokio::runtime::Handle,
        ports: Ports,
        seed: u64,
        idle: bool,
        truth: &Shared<Truth>,
        incarnation: u64,
    ) -> (Child, Self) {
        let mut child = Command::new(binary())
            .args(["--engines", "1", "--model", "llama", "--blocks", "41"])
            .args(["--time-model", "gpu-8b", "--speed", "10"])
            .arg(format!(
                "--ports={},{},{}",
                ports.events, ports.replay, ports.http
            ))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start kvevent-simulator");
        // Its line on stdout says it serves; the rest is drained so it never blocks.
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let line = lines.next().and_then(Result::ok).unwrap_or_default();
        assert!(
            line.starts_with("e000="),
            "the simulator did not start: {line:?}"
        );
        std::thread::spawn(move || lines.for_each(drop));
        let side = Self {
            base: format!("http://127.0.0.1:{}", ports.http),
            runtime: runtime.clone(),
            busy: Arc::new((!idle).into()),
            stop: Arc::new(false.into()),
        };
        side.workload(seed);
        side.read_truth(truth.clone(), incarnation);
        (child, side)
    }

    /// `METHOD path` to the engine, within 2 s: its status, or none.
    fn call(
        client: &kvevent_simulator::client::Client,
        runtime: &tokio::runtime::Handle,
        base: &str,
        method: &str,
        path: &str,
        body: &str,
    ) -> Option<(u16, String)> {
        runtime
            .block_on(kvevent_simulator::client::call(
                client,
                base,
                method,
                path,
                body,
                Duration::from_secs(2),
            ))
            .ok()
    }

    /// A fault hook (`/admin/...`), answered 200.
    pub(crate) fn admin(&self, path: &str) {
        let client = kvevent_simulator::client::client();
        let answer = Self::call(&client, &self.runtime, &self.base, "POST", path, "");
        assert!(
            matches!(answer, Some((200, _))),
            "POST {}{path}: {answer:?}",
            self.base
        );
    }

    pub(crate) fn set_busy(&self) {
        self.busy.store(true, Relaxed);
    }

    /// The harness's prompts, drawn by `seed`, one request every [`REQUEST_EVERY`] (each in
    /// a thread of its own: a slow answer never stops the next).
    fn workload(&self, seed: u64) {
        let (base, runtime) = (self.base.clone(), self.runtime.clone());
        let (busy, stop) = (self.busy.clone(), self.stop.clone());
        std::thread::spawn(move || {
            let client = kvevent_simulator::client::client();
            let mut rng = Rng::new(seed | 1);
            while !stop.load(Relaxed) {
                std::thread::sleep(REQUEST_EVERY);
                if !busy.load(Relaxed) {
                    continue;
                }
                let body = serde_json::json!({
                    "model": "llama",
                    "prompt": prompt_tokens(rng.below(u64::from(PROMPTS)) as u32),
                    "max_tokens": 1,
                })
                .to_string();
                let (client, runtime, base) = (client.clone(), runtime.clone(), base.clone());
                std::thread::spawn(move || {
                    Self::call(&client, &runtime, &base, "POST", "/v1/completions", &body)
                });
            }
        });
    }

    /// Reads `/admin/truth` every [`TRUTH_EVERY`] into `truth` while its incarnation is this
    /// process's: each block of a prompt that came or went is a change of that prompt.
    fn read_truth(&self, truth: Shared<Truth>, incarnation: u64) {
        let (base, runtime, stop) = (self.base.clone(), self.runtime.clone(), self.stop.clone());
        let blocks: std::collections::HashMap<u64, (u32, u32)> = (0..PROMPTS)
            .flat_map(|p| {
                kvevent_fingerprint::chain(&prompt_tokens(p), BLOCK_SIZE, None)
                    .into_iter()
                    .enumerate()
                    .map(move |(b, k)| (k.prefix, (p, b as u32)))
            })
            .collect();
        std::thread::spawn(move || {
            let client = kvevent_simulator::client::client();
            while !stop.load(Relaxed) {
                std::thread::sleep(TRUTH_EVERY);
                let asked = Instant::now();
                let Some((200, body)) =
                    Self::call(&client, &runtime, &base, "GET", "/admin/truth", "")
                else {
                    continue;
                };
                let said: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let held: HashSet<(u32, u32)> = said["blocks"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|h| blocks.get(&h.as_u64()?).copied())
                    .collect();
                let mut t = lock(&truth);
                if t.incarnation != incarnation || stop.load(Relaxed) {
                    return;
                }
                let now = Instant::now();
                let came: Vec<(u32, u32)> = held.difference(&t.held).copied().collect();
                let went: Vec<(u32, u32)> = t.held.difference(&held).copied().collect();
                for (sign, (p, b)) in came
                    .iter()
                    .map(|k| ('+', k))
                    .chain(went.iter().map(|k| ('-', k)))
                {
                    t.changed[*p as usize] = now;
                    t.note(format!("{sign} {p} {b}"));
                }
                t.held = held;
                t.polled = Some(asked);
            }
        });
    }

    /// Its threads end (the process is killed by its owner).
    pub(crate) fn end(&self) {
        self.stop.store(true, Relaxed);
    }
}
