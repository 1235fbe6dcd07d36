//! One run: the fleet following the sidecars, the faults applied one after another, and the
//! check every 100 ms of each answer against the engines' truth.

#[allow(clippy::wildcard_imports, reason = "the harness's own parts")]
use super::*;

/// What one run saw.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub(crate) faults: usize,
    pub(crate) wrong: Vec<String>,
    pub(crate) convergence: Vec<Duration>,
    pub(crate) not_converged: Vec<String>,
    pub(crate) answers_during: (u64, u64),
    pub(crate) answers_after: (u64, u64),
    pub(crate) sidecar_rss_max: u64,
    /// This process: the router's Fleet, the proxies and the checks.
    pub(crate) router_rss_max: u64,
    pub(crate) exits: Vec<String>,
}

pub(crate) struct Replica {
    pub(crate) name: String,
    pub(crate) engine_ports: Ports,
    pub(crate) feed_port: u16,
    pub(crate) engine: Option<Engine>,
    pub(crate) sidecar: Option<Sidecar>,
    pub(crate) proxy: Proxy,
    pub(crate) truth: Shared<Truth>,
    pub(crate) state_file: PathBuf,
}

pub(crate) struct Run {
    pub(crate) kind: EngineKind,
    pub(crate) rng: Rng,
    pub(crate) replicas: Vec<Replica>,
    pub(crate) fleet: Fleet,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) dir: PathBuf,
    pub(crate) report: Report,
    pub(crate) schedule: Vec<String>,
    pub(crate) started: Instant,
}

pub(crate) fn prompt_tokens(p: u32) -> Vec<u32> {
    (0..BLOCKS * BLOCK_SIZE as u32)
        .map(|j| p * 1000 + j)
        .collect()
}

impl Run {
    pub(crate) fn follow(fleet: &Fleet, r: &Replica) {
        fleet
            .ensure_replica(
                &r.name,
                ReplicaSource::Sidecar(SidecarFeed {
                    replica: r.name.clone(),
                    ..SidecarFeed::new(format!("http://127.0.0.1:{}", r.proxy.port))
                }),
            )
            .expect("follow");
    }

    pub(crate) fn new_fleet(runtime: &tokio::runtime::Handle) -> Fleet {
        Fleet::with_runtime(FleetConfig::default(), runtime.clone())
    }

    /// Looks at every answer once: counts them, and records each wrong exact one.
    pub(crate) fn check(&mut self, during: bool) {
        let states: Vec<(String, ReplicaState)> = self
            .fleet
            .replicas()
            .into_iter()
            .map(|r| (r.name, r.state))
            .collect();
        let now = Instant::now();
        for r in &self.replicas {
            let state = states.iter().find(|(n, _)| *n == r.name).map(|(_, s)| *s);
            let answers: Vec<(u32, bool)> = (0..PROMPTS).map(|p| self.answer(&r.name, p)).collect();
            // A truth read by polling is judged as read after the answers (or not this turn).
            let answered = Instant::now();
            let deadline = answered + Duration::from_secs(1);
            let truth = loop {
                let truth = lock(&r.truth);
                if truth.polled.is_none_or(|at| at >= answered) || Instant::now() > deadline {
                    break truth;
                }
                drop(truth);
                std::thread::sleep(Duration::from_millis(5));
            };
            let fresh = truth.polled.is_none_or(|at| at >= answered);
            for (p, &(matched, exact)) in (0..PROMPTS).zip(&answers) {
                let counter = if during {
                    &mut self.report.answers_during
                } else {
                    &mut self.report.answers_after
                };
                counter.0 += 1;
                counter.1 += u64::from(!exact);
                let settled = fresh && truth.settled(p, now);
                let (up, since) = truth.server;
                if exact && !up && now.saturating_duration_since(since) > WINDOW {
                    self.report.wrong.push(format!(
                        "{:.1}s {} prompt {p}: exact while the engine's HTTP server is gone ({:?})",
                        self.started.elapsed().as_secs_f64(),
                        r.name,
                        state
                    ));
                } else if exact && settled && matched != truth.matched(p) {
                    self.report.wrong.push(format!(
                        "{:.1}s {} prompt {p}: exact with {matched} blocks, the engine holds {} ({:?}); its story: {}",
                        self.started.elapsed().as_secs_f64(),
                        r.name,
                        truth.matched(p),
                        state,
                        truth.story(
                            p,
                            now.checked_sub(Duration::from_secs(15)).unwrap_or(self.started),
                            self.started
                        )
                    ));
                }
            }
        }
    }

    /// The router's answer for prompt `p` on `replica`: blocks matched, and whether exact
    /// ((0, false) when it has none).
    fn answer(&self, replica: &str, p: u32) -> (u32, bool) {
        let tokens = prompt_tokens(p);
        let query = Query {
            adapter: "",
            keys: QueryKeys::Tokens {
                ids: &tokens,
                block_size: BLOCK_SIZE,
            },
        };
        match self.fleet.score_among(&query, &[replica]) {
            Ok(scores) => scores
                .first()
                .map_or((0, false), |s| (s.matched_blocks, s.state.is_exact())),
            Err(_) => (0, false),
        }
    }

    /// Every replica exact and equal to its engine (what changed within the propagation
    /// window aside: on a busy engine some change is always on its way).
    pub(crate) fn converged(&self) -> bool {
        let now = Instant::now();
        self.replicas.iter().all(|r| {
            let truth = lock(&r.truth);
            (0..PROMPTS).all(|p| {
                let (matched, exact) = self.answer(&r.name, p);
                exact && (matched == truth.matched(p) || !truth.settled(p, now))
            })
        })
    }

    /// Checks every 100 ms for `d`.
    pub(crate) fn hold(&mut self, d: Duration, during: bool) {
        let until = Instant::now() + d;
        while Instant::now() < until {
            self.check(during);
            for r in &self.replicas {
                if let Some(s) = &r.sidecar {
                    self.report.sidecar_rss_max = self.report.sidecar_rss_max.max(s.rss_bytes());
                }
            }
            self.report.router_rss_max = self.report.router_rss_max.max(rss_of("self"));
            std::thread::sleep(CHECK_EVERY.min(until.saturating_duration_since(Instant::now())));
        }
    }

    /// After a fault heals: checks until every replica is exact and equal to its engine.
    pub(crate) fn converge(&mut self, what: &str) {
        let healed = Instant::now();
        loop {
            self.check(false);
            if self.converged() {
                self.report.convergence.push(healed.elapsed());
                return;
            }
            if healed.elapsed() > CONVERGE {
                let states: Vec<_> = self
                    .fleet
                    .replicas()
                    .into_iter()
                    .map(|r| {
                        format!(
                            "{} {} {} ({})",
                            r.name,
                            r.state.as_str(),
                            r.state.reason().unwrap_or_default(),
                            r.error.unwrap_or_default()
                        )
                    })
                    .collect();
                let logs: Vec<String> = self
                    .replicas
                    .iter()
                    .filter_map(|r| r.sidecar.as_ref())
                    .map(|s| {
                        let log = std::fs::read_to_string(&s.log).unwrap_or_default();
                        let tail: Vec<&str> = log.lines().rev().take(8).collect();
                        format!("{}: {tail:?}", s.log.display())
                    })
                    .collect();
                self.report.not_converged.push(format!(
                    "{what}: {states:?}; sidecar logs (last lines first): {logs:#?}"
                ));
                return;
            }
            std::thread::sleep(CHECK_EVERY);
        }
    }

    pub(crate) fn engine_seed(&mut self) -> u64 {
        self.rng.next() >> 16
    }

    pub(crate) fn apply(&mut self, fault: &Fault) {
        let dir = self.dir.clone();
        match *fault {
            Fault::EngineKilled {
                replica,
                down,
                idle,
                replay_delay,
            } => {
                let seed = self.engine_seed();
                let r = &mut self.replicas[replica];
                if let Some(e) = r.engine.take() {
                    e.kill(&r.truth);
                }
                self.hold(down, true);
                let r = &mut self.replicas[replica];
                r.engine = Some(Engine::spawn(
                    self.kind,
                    &self.runtime,
                    r.engine_ports,
                    seed,
                    idle,
                    replay_delay,
                    &r.truth,
                ));
                if idle {
                    self.converge(&format!("{fault:?} (idle)"));
                    if let Some(e) = self.replicas[replica].engine.as_mut() {
                        e.command("busy");
                    }
                }
            }
            Fault::EnginePaused { replica, for_ } => {
                let r = &self.replicas[replica];
                if let Some(e) = &r.engine {
                    lock(&r.truth).paused = true;
                    e.signal("-STOP");
                }
                self.hold(for_, true);
                let r = &self.replicas[replica];
                if let Some(e) = &r.engine {
                    e.signal("-CONT");
                    let mut t = lock(&r.truth);
                    t.paused = false;
                    t.all_changed();
                }
            }
            Fault::BatchesLost { replica, batches } => {
                if let Some(e) = self.replicas[replica].engine.as_mut() {
                    e.command(&format!("lose {batches}"));
                }
                self.hold(Duration::from_millis(20 * u64::from(batches) + 200), true);
            }
            Fault::LostBeyondReplay { replica } => {
                // Lost, and gone from the replay buffer too: the sidecar cannot repair the
                // gap, and is degraded until the engine clears its cache.
                if let Some(e) = self.replicas[replica].engine.as_mut() {
                    e.command("lose 5 forget");
                }
                self.hold(Duration::from_millis(1500), true);
                if let Some(e) = self.replicas[replica].engine.as_mut() {
                    e.command("clear");
                }
            }
            Fault::ServerGone { replica, for_ } => {
                let r = &mut self.replicas[replica];
                if let Some(e) = r.engine.as_mut() {
                    lock(&r.truth).server = (false, Instant::now());
                    e.command("http down");
                }
                self.hold(for_, true);
                let r = &mut self.replicas[replica];
                if let Some(e) = r.engine.as_mut() {
                    e.command("http up");
                    lock(&r.truth).server = (true, Instant::now());
                }
            }
            Fault::SidecarKilled {
                replica,
                down,
                state_file,
            } => {
                let r = &mut self.replicas[replica];
                if let Some(s) = r.sidecar.take() {
                    s.kill();
                }
                if !state_file {
                    let _ = std::fs::remove_file(&r.state_file);
                }
                self.hold(down, true);
                let r = &mut self.replicas[replica];
                r.sidecar = Some(Sidecar::start(
                    r.engine_ports,
                    r.feed_port,
                    &r.name,
                    state_file.then_some(&r.state_file),
                    &dir,
                ));
            }
            Fault::RouterRestarted => {
                let fleet = Self::new_fleet(&self.runtime);
                for r in &self.replicas {
                    Self::follow(&fleet, r);
                }
                // The old router goes; answers come from the new one from now on.
                self.fleet = fleet;
            }
            Fault::FeedCut { replica, for_ } => self.link(replica, Link::Cut, for_),
            Fault::FeedBlackholed { replica, for_ } => self.link(replica, Link::Blackhole, for_),
            Fault::FeedDelayed { replica, for_ } => self.link(replica, Link::Delay, for_),
            Fault::FeedCongested { replica, for_ } => self.link(replica, Link::Congested, for_),
            Fault::FeedDelayedThenBlackholed {
                replica,
                delayed,
                blackholed,
            } => {
                self.replicas[replica].proxy.set(Link::Delay);
                self.hold(delayed, true);
                self.link(replica, Link::Blackhole, blackholed);
            }
        }
    }

    pub(crate) fn link(&mut self, replica: usize, link: Link, for_: Duration) {
        self.replicas[replica].proxy.set(link);
        self.hold(for_, true);
        self.replicas[replica].proxy.set(Link::Pass);
    }
}
