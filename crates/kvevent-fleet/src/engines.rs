//! Following engines' sockets directly: one thread (`kvevent-engines`, started with the first
//! engine replica) blocks in one `poll(2)` over every engine's sockets and a waker, applies
//! what comes into the index, and sets each replica's state from its sockets.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvevent_index::SourceId;
use kvevent_source::{Subscriber, View};

use crate::status::{self, Event, Shared};
use crate::{Core, EngineSockets, FleetError, RankStatus, lock};

/// The sockets of `e`'s ranks, checked.
pub(crate) fn sources(
    name: &str,
    e: &EngineSockets,
) -> Result<Vec<kvevent_zmq::Source>, FleetError> {
    e.sources().map_err(|source| match source {
        kvevent_zmq::Error::Endpoint { endpoint, .. } => FleetError::Endpoint {
            replica: name.to_owned(),
            endpoint,
        },
        source => FleetError::Engine {
            replica: name.to_owned(),
            source,
        },
    })
}

enum Command {
    Add {
        name: String,
        sources: Vec<kvevent_zmq::Source>,
        engine: kvevent_wire::Engine,
        status: Shared,
    },
    Remove {
        status: Shared,
    },
}

/// The engine thread, its inbox and its waker.
pub(crate) struct Engines {
    commands: Arc<Mutex<Vec<Command>>>,
    stop: Arc<AtomicBool>,
    waker: kvevent_zmq::Waker,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// One engine rank as the thread follows it.
struct Rank {
    name: String,
    id: SourceId,
    status: Shared,
    rank: u32,
    connected: bool,
    /// When `connected` last changed.
    changed: Instant,
}

/// Most updates applied under one write lock.
const APPLY_MAX: usize = 64;

/// How often, at most, the thread reads every rank's sockets' state while batches flow (an
/// idle poll reads them each time it wakes: a socket's connection or loss wakes it).
const STATUS_EVERY: Duration = Duration::from_millis(100);

/// The longest the thread blocks in its poll with nothing due.
const IDLE_WAIT: Duration = Duration::from_secs(1);

impl Engines {
    pub(crate) fn start(core: Arc<Core>) -> std::io::Result<Self> {
        let context = zmq::Context::new();
        let mut subscriber = Subscriber::start(&context, kvevent_source::Config::new(Vec::new()))
            .map_err(std::io::Error::other)?;
        let waker = subscriber.waker().map_err(std::io::Error::other)?;
        let commands = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (commands, stop) = (commands.clone(), stop.clone());
            std::thread::Builder::new()
                .name("kvevent-engines".into())
                .spawn(move || {
                    Thread {
                        core,
                        subscriber,
                        ranks: Vec::new(),
                        last_pass: Instant::now(),
                    }
                    .run(&commands, &stop);
                    drop(context);
                })?
        };
        Ok(Self {
            commands,
            stop,
            waker,
            thread: Some(thread),
        })
    }

    pub(crate) fn add(
        &self,
        name: &str,
        sources: Vec<kvevent_zmq::Source>,
        engine: kvevent_wire::Engine,
        status: Shared,
    ) {
        lock(&self.commands).push(Command::Add {
            name: name.to_owned(),
            sources,
            engine,
            status,
        });
        self.waker.wake();
    }

    pub(crate) fn remove(&self, status: &Shared) {
        lock(&self.commands).push(Command::Remove {
            status: status.clone(),
        });
        self.waker.wake();
    }

    pub(crate) fn stop(mut self) {
        self.stop.store(true, Relaxed);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Thread {
    core: Arc<Core>,
    subscriber: Subscriber,
    /// By subscriber source number.
    ranks: Vec<Option<Rank>>,
    last_pass: Instant,
}

impl Thread {
    fn run(mut self, commands: &Mutex<Vec<Command>>, stop: &AtomicBool) {
        while !stop.load(Relaxed) {
            let commands = std::mem::take(&mut *lock(commands));
            let commanded = !commands.is_empty();
            for command in commands {
                self.command(command);
            }
            let wait = self.wait();
            let applied = self.apply(wait);
            let now = Instant::now();
            if commanded || !applied || now.duration_since(self.last_pass) >= STATUS_EVERY {
                self.last_pass = now;
                self.pass(now);
            }
        }
        self.subscriber.shutdown();
    }

    fn command(&mut self, command: Command) {
        let index = &self.core.index;
        match command {
            Command::Add {
                name,
                sources,
                engine,
                status,
            } => {
                for (rank, source) in sources.into_iter().enumerate() {
                    let endpoint = source.endpoint.clone();
                    let added = self.subscriber.add_source_of(source, engine);
                    let id = index.add_source(&name);
                    match (added, id) {
                        (Ok(i), Ok(id)) => {
                            if self.ranks.len() <= i {
                                self.ranks.resize_with(i + 1, || None);
                            }
                            lock(&status).sources.push(id);
                            self.ranks[i] = Some(Rank {
                                name: name.clone(),
                                id,
                                status: status.clone(),
                                rank: rank as u32,
                                connected: false,
                                changed: Instant::now(),
                            });
                        }
                        (added, id) => {
                            let error = match (&added, &id) {
                                (Err(e), _) => e.to_string(),
                                (_, Err(e)) => e.to_string(),
                                _ => String::new(),
                            };
                            if let Ok(i) = added {
                                self.subscriber.remove_source(i);
                            }
                            if let Ok(id) = id {
                                index.remove_source(id);
                            }
                            lock(&status)
                                .set_error(&name, format!("cannot follow {endpoint}: {error}"));
                        }
                    }
                }
            }
            Command::Remove { status } => {
                for (i, slot) in self.ranks.iter_mut().enumerate() {
                    if slot
                        .as_ref()
                        .is_some_and(|r| Arc::ptr_eq(&r.status, &status))
                    {
                        *slot = None;
                        self.subscriber.remove_source(i);
                    }
                }
            }
        }
    }

    /// How long to block in the poll: until the next state deadline of a replica lost, else
    /// [`IDLE_WAIT`]; a command wakes it sooner.
    fn wait(&self) -> Duration {
        let now = Instant::now();
        self.ranks
            .iter()
            .flatten()
            .filter_map(|r| lock(&r.status).next_deadline(&self.core))
            .map(|d| d.saturating_duration_since(now))
            .min()
            .map_or(IDLE_WAIT, |d| d.clamp(Duration::from_millis(1), IDLE_WAIT))
    }

    /// Applies what the sockets hold (waiting up to `wait` for it): true if anything came.
    fn apply(&mut self, wait: Duration) -> bool {
        let (index, ranks) = (&self.core.index, &self.ranks);
        let mut block_sizes: Vec<(usize, u32)> = Vec::new();
        let applied = self.subscriber.next_many(wait, APPLY_MAX, |views| {
            let mut run = Vec::with_capacity(views.len());
            let mut touched = Vec::new();
            for view in views {
                match view {
                    View::Batch { source, batch, .. } => {
                        if let Some(Some(r)) = ranks.get(*source) {
                            run.push((r.id, *batch));
                            touched.push(*source);
                            if let Some(b) = batch.events.iter().find_map(|e| match e {
                                kvevent_wire::Event::BlockStored(s) => Some(s.block_size),
                                _ => None,
                            }) {
                                block_sizes.push((*source, b));
                            }
                        }
                    }
                    View::Reset { source, .. } => {
                        if let Some(Some(r)) = ranks.get(*source) {
                            index.apply_many(&run);
                            run.clear();
                            index.reset(r.id);
                            touched.push(*source);
                        }
                    }
                }
            }
            index.apply_many(&run);
            touched
        });
        for (source, size) in block_sizes {
            if let Some(Some(r)) = self.ranks.get(source) {
                self.core.note_block_size(size);
                if size > 0 {
                    lock(&r.status).block_size = size;
                }
            }
        }
        let Some(mut touched) = applied else {
            return false;
        };
        let now = Instant::now();
        touched.dedup();
        for source in touched {
            if let Some(Some(r)) = self.ranks.get(source) {
                lock(&r.status).newest = Some(now);
            }
        }
        true
    }

    /// Each replica's status from its ranks' sockets: lost while any rank's is, degraded
    /// while any is; published when its state changes. Lost for `drop_after`: its entries
    /// stop counting, and its sources start over empty (its engine's replay brings back what
    /// it still holds when it returns).
    fn pass(&mut self, now: Instant) {
        let index = &self.core.index;
        let mut replicas: HashMap<*const Mutex<status::Status>, Seen> = HashMap::new();
        let sources = self
            .subscriber
            .metrics()
            .iter()
            .zip(self.subscriber.health());
        for (slot, (m, health)) in self.ranks.iter_mut().zip(sources) {
            let Some(r) = slot else { continue };
            // The source state machine's one reading of the rank.
            let health = kvevent_feed::RankState::from(health.get());
            let connected = health != kvevent_feed::RankState::Disconnected;
            if connected != r.connected {
                r.connected = connected;
                r.changed = now;
            }
            let seen = replicas
                .entry(Arc::as_ptr(&r.status))
                .or_insert_with(|| Seen {
                    name: r.name.clone(),
                    status: r.status.clone(),
                    batches: 0,
                    ranks: Vec::new(),
                    views: Vec::new(),
                });
            seen.batches += m.batches.load(Relaxed);
            seen.views.push(health);
            seen.ranks
                .push((status::rank_status(r.rank, health, None), Some(r.changed)));
        }
        for seen in replicas.into_values() {
            let lost_since = seen
                .ranks
                .iter()
                .filter(|(r, _)| !r.connected)
                .filter_map(|(_, changed)| *changed)
                .min();
            let mut s = lock(&seen.status);
            s.batches = seen.batches;
            // The engine's sockets are the source: lost while any rank's is.
            let source = match lost_since {
                Some(since) => Event::Lost { since, error: None },
                None => Event::Connected { resumed: true },
            };
            s.on(&seen.name, source, now);
            let view = status::rank_view(seen.views.iter().copied());
            let ranks = seen.ranks;
            s.on(
                &seen.name,
                Event::Engine {
                    lost_since: None,
                    view,
                    ranks,
                },
                now,
            );
            let expired = s.expire(self.core.config.drop_after, now);
            drop(s);
            if expired {
                let mut ids = Vec::new();
                for r in self.ranks.iter_mut().flatten() {
                    if Arc::ptr_eq(&r.status, &seen.status) {
                        index.remove_source(r.id);
                        match index.add_source(&r.name) {
                            Ok(id) => r.id = id,
                            Err(e) => lock(&seen.status).set_error(&seen.name, e.to_string()),
                        }
                        ids.push(r.id);
                    }
                }
                lock(&seen.status).sources = ids;
            }
            // This thread's word holds two of its longest waits: answers read later, with the
            // thread stopped or starved, are not exact.
            index.renew_lease(&seen.name, Some(now + 2 * IDLE_WAIT));
            status::publish(&self.core, &seen.name, &seen.status);
        }
    }
}

/// One replica's ranks as a pass saw them.
struct Seen {
    name: String,
    status: Shared,
    batches: u64,
    ranks: Vec<(RankStatus, Option<Instant>)>,
    /// Each rank's health.
    views: Vec<kvevent_feed::RankState>,
}

/// An engine's HTTP server, asked at `/health` every second, and its load read from its
/// `/metrics` every [`LOAD_EVERY`] ([`EngineSockets::http`]).
pub(crate) struct Server {
    check: kvevent_scrape::EngineHealth,
    load: kvevent_scrape::LoadReader,
}

/// How often an engine followed directly has its load read (a sidecar's default).
const LOAD_EVERY: Duration = Duration::from_millis(250);

/// The engine's HTTP server at `url` (`http://HOST:PORT`), checked.
pub(crate) fn server(name: &str, url: &str) -> Result<Server, FleetError> {
    let invalid = |_| FleetError::EngineHttp {
        replica: name.to_owned(),
        url: url.to_owned(),
    };
    let check = kvevent_scrape::EngineHealth::new(url, Duration::from_secs(1)).map_err(invalid)?;
    let metrics_url = format!("{}/metrics", url.trim_end_matches('/'));
    let load = kvevent_scrape::LoadReader::new(
        &metrics_url,
        Duration::from_secs(1),
        8 << 20,
        Default::default(),
    )
    .map_err(invalid)?;
    Ok(Server { check, load })
}

impl Server {
    /// Asks every second for as long as the replica is followed, telling its status what it
    /// answers; reads its load meanwhile.
    pub(crate) async fn run(self, core: Arc<Core>, name: String, status: Shared) {
        let health = self.check.run(Duration::from_secs(1), |why| {
            let down = why.map(|why| (Instant::now(), why));
            lock(&status).on(&name, Event::Server(down), Instant::now());
            status::publish(&core, &name, &status);
        });
        let load = self.load.run(LOAD_EVERY, |read| {
            let mut s = lock(&status);
            match read {
                Ok(load) => {
                    let read = kvevent_index::LoadReading {
                        load,
                        read_at: Instant::now(),
                        failing: false,
                    };
                    s.set_load(&core, &name, Some(read), None);
                }
                // The last load stays, ageing, and says it is failing.
                Err(f) => {
                    let last = s
                        .load
                        .clone()
                        .map(|l| kvevent_index::LoadReading { failing: true, ..l });
                    s.set_load(&core, &name, last, Some(f.why));
                }
            }
        });
        tokio::join!(health, load);
    }
}
