//! The transport and the per-source states, joined into one stream of updates.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kvevent_wire::{self as wire, frames};
use kvevent_zmq as transport;

use crate::{Health, ReplayEnd, ResetReason, SourceMetrics, SourceState, StateConfig, Step};

/// How to subscribe.
#[derive(Debug, Clone)]
pub struct Config {
    /// The engine sources (one per endpoint and DP rank).
    pub sources: Vec<transport::Source>,
    /// Socket options.
    pub socket: transport::SourceOptions,
    /// Per-source state settings (`has_replay` is taken from each source).
    pub state: StateConfig,
    /// Limits on what one payload may hold.
    pub limits: wire::Limits,
    /// Whose wire the sources speak: vLLM's (the default) or SGLang's.
    pub engine: wire::Engine,
    /// By source index: where a saved state of the consumer left it ([`SourceState::on_resume`]);
    /// such a source starts with no `Startup` reset. Sources beyond the list start afresh.
    pub resume: Vec<Option<crate::Resume>>,
    /// Ask each new source's replay endpoint for everything it holds at once (default). Off,
    /// the first live batch decides, as [`SourceState::on_live`] says (a recorder that takes
    /// the stream from now).
    pub bootstrap: bool,
}

impl Config {
    /// Defaults for these sources.
    pub fn new(sources: Vec<transport::Source>) -> Self {
        Self {
            sources,
            socket: transport::SourceOptions::default(),
            state: StateConfig::default(),
            limits: wire::Limits::DEFAULT,
            engine: wire::Engine::Vllm,
            resume: Vec::new(),
            bootstrap: true,
        }
    }
}

/// One batch to apply, in seq order for its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Index of the source in [`Config::sources`].
    pub source: usize,
    /// The batch's seq.
    pub seq: u64,
    /// The msgpack payload, checked to decode before [`Subscriber::next`] hands it out.
    pub payload: Vec<u8>,
    /// Whose wire it is ([`Config::engine`]).
    pub engine: wire::Engine,
    /// The topic of the source's last message when it was delivered (shared while it does
    /// not change).
    pub topic: Arc<[u8]>,
    /// When it arrived: a live batch held back during a replay is delivered later.
    pub arrived: Instant,
    /// It came from the replay endpoint (else live).
    pub replayed: bool,
}

impl Batch {
    /// The decoded batch, borrowing the payload.
    pub fn decode(&self) -> wire::Result<wire::EventBatch<'_>> {
        wire::decode_engine(&self.payload, self.engine, &wire::Limits::DEFAULT)
    }
}

/// What [`Subscriber::next_with`] hands over: the decoded batch, borrowed.
#[derive(Debug)]
pub enum View<'a> {
    /// A batch of events.
    Batch {
        /// Index of the source.
        source: usize,
        /// The batch's seq.
        seq: u64,
        /// The decoded batch.
        batch: &'a wire::EventBatch<'a>,
        /// Its msgpack payload (for [`crate::payload_digest`] when saving a [`crate::Resume`]).
        payload: &'a [u8],
    },
    /// Everything known of `source` is stale.
    Reset {
        /// Index of the source.
        source: usize,
        /// Why.
        reason: ResetReason,
    },
}

/// What a consumer applies, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    /// A batch of events.
    Batch(Batch),
    /// Everything known of `source` is stale: forget it (a router clears that replica).
    Reset {
        /// Index of the source.
        source: usize,
        /// Why.
        reason: ResetReason,
    },
}

/// Subscribes to engine sources and yields their updates.
pub struct Subscriber {
    /// Every source's sockets, read by the thread that calls [`Subscriber::next`] (and the
    /// other reads): no thread of its own, no handoff between threads. That thread must read
    /// regularly (libzmq attaches reconnections when the socket is used).
    transport: Option<transport::Transport>,
    /// Frames read, not yet handled.
    inbox: VecDeque<transport::Frames>,
    states: Vec<SourceState>,
    metrics: Vec<Arc<SourceMetrics>>,
    sources: Vec<transport::Source>,
    limits: wire::Limits,
    /// By source index: whose wire it speaks.
    engines: Vec<wire::Engine>,
    /// [`Config::engine`], for sources added later.
    engine: wire::Engine,
    ready: VecDeque<Update>,
    steps: Vec<Step>,
    /// For sources added later.
    state_config: StateConfig,
    /// By source index: removed, its frames are ignored.
    removed: Vec<bool>,
    /// The updates [`Subscriber::next_many`] hands out (kept for its capacity).
    taken: Vec<Update>,
    /// By source index: the topic of its last message.
    topics: Vec<Arc<[u8]>>,
    /// [`Config::bootstrap`].
    bootstrap: bool,
    /// Stopping ([`Subscriber::end_replays`]): no replay is asked any more.
    stopping: bool,
    /// When the states' timers were last looked at.
    last_tick: Instant,
}

/// How often, at most, the states' timers are looked at.
const TICK: Duration = Duration::from_millis(50);

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("sources", &self.sources)
            .finish()
    }
}

impl Subscriber {
    /// Opens every source's sockets.
    pub fn start(ctx: &zmq::Context, config: Config) -> Result<Self, transport::Error> {
        let transport = transport::Transport::start(ctx, &config.sources, &config.socket)?;
        let metrics: Vec<_> = config
            .sources
            .iter()
            .map(|_| Arc::new(SourceMetrics::default()))
            .collect();
        let states = config
            .sources
            .iter()
            .zip(&metrics)
            .map(|(source, m)| {
                let state = StateConfig {
                    has_replay: source.replay_endpoint.is_some(),
                    label: source.label(),
                    ..config.state.clone()
                };
                SourceState::new(state, m.clone())
            })
            .collect();
        let mut subscriber = Self {
            transport: Some(transport),
            inbox: VecDeque::new(),
            states,
            metrics,
            removed: vec![false; config.sources.len()],
            taken: Vec::new(),
            engines: vec![config.engine; config.sources.len()],
            engine: config.engine,
            topics: config
                .sources
                .iter()
                .map(|s| Arc::from(s.topic.as_slice()))
                .collect(),
            bootstrap: config.bootstrap,
            stopping: false,
            sources: config.sources,
            limits: config.limits,
            ready: VecDeque::new(),
            steps: Vec::new(),
            state_config: config.state,
            last_tick: Instant::now(),
        };
        for source in 0..subscriber.states.len() {
            match config.resume.get(source).copied().flatten() {
                Some(resume) => {
                    let mut steps = std::mem::take(&mut subscriber.steps);
                    subscriber.states[source].on_resume(resume, Instant::now(), &mut steps);
                    subscriber.steps = steps;
                    subscriber.apply_steps(source);
                }
                None => subscriber.start_source(source),
            }
        }
        Ok(subscriber)
    }

    /// Bootstraps a new source from its engine's replay buffer at once ([`Config::bootstrap`]).
    fn start_source(&mut self, source: usize) {
        if !self.bootstrap {
            return;
        }
        let mut steps = std::mem::take(&mut self.steps);
        self.states[source].on_start(Instant::now(), &mut steps);
        self.steps = steps;
        self.apply_steps(source);
    }

    /// A waker for the thread reading this subscriber: [`Subscriber::next_many`] (and the
    /// other reads) return at once (with nothing) when it wakes them, so that thread can block
    /// in its poll and still take commands from others. A read also returns early, with
    /// nothing, when a source's connection is made or lost.
    pub fn waker(&mut self) -> Result<transport::Waker, transport::Error> {
        match self.transport.as_mut() {
            Some(t) => t.waker(),
            None => Err(transport::Error::Stopped),
        }
    }

    /// Subscribes to one more source while the others run (a pod came up). Its index, returned,
    /// is never reused; its first update is a `Startup` reset, then its replay and batches.
    pub fn add_source(&mut self, source: transport::Source) -> Result<usize, transport::Error> {
        self.add_source_of(source, self.engine)
    }

    /// [`Subscriber::add_source`] for an engine whose wire is `engine`'s (a fleet of vLLM and
    /// SGLang replicas in one subscriber).
    pub fn add_source_of(
        &mut self,
        source: transport::Source,
        engine: wire::Engine,
    ) -> Result<usize, transport::Error> {
        let Some(transport) = self.transport.as_mut() else {
            return Err(transport::Error::Stopped);
        };
        let index = transport.add(&source)?;
        let metrics = Arc::new(SourceMetrics::default());
        let state = StateConfig {
            has_replay: source.replay_endpoint.is_some(),
            label: source.label(),
            ..self.state_config.clone()
        };
        self.states.push(SourceState::new(state, metrics.clone()));
        self.metrics.push(metrics);
        self.topics.push(Arc::from(source.topic.as_slice()));
        self.sources.push(source);
        self.removed.push(false);
        self.engines.push(engine);
        debug_assert_eq!(self.sources.len(), index + 1);
        self.start_source(index);
        Ok(index)
    }

    /// Stops following source `index` (a pod went away): its sockets close,
    /// the others are not touched, and no update of it is handed out any more (a consumer
    /// forgets what it held). False when there is no such source.
    pub fn remove_source(&mut self, index: usize) -> bool {
        if self.removed.get(index).is_none_or(|r| *r) {
            return false;
        }
        self.removed[index] = true;
        if let Some(t) = self.transport.as_mut() {
            t.remove(index);
        }
        self.inbox.retain(|f| f.source != index);
        self.ready.retain(|u| match u {
            Update::Batch(b) => b.source != index,
            Update::Reset { source, .. } => *source != index,
        });
        true
    }

    /// Sources followed now (added and not removed).
    pub fn active_sources(&self) -> usize {
        self.removed.iter().filter(|r| !**r).count()
    }

    /// The sources, in index order.
    pub fn sources(&self) -> &[transport::Source] {
        &self.sources
    }

    /// Each source's counters, in index order.
    pub fn metrics(&self) -> &[Arc<SourceMetrics>] {
        &self.metrics
    }

    /// Each source's health as its state machine says it, in index order: share the handles
    /// with whoever reads them.
    pub fn health(&self) -> impl ExactSizeIterator<Item = &Arc<Health>> {
        self.states.iter().map(SourceState::health)
    }

    /// The next update, waiting at most `timeout`. `None` on timeout (or once the transport
    /// is gone). A batch is checked to decode before it is handed out (a corrupt one comes out
    /// as a `Reset` instead); the consumer decodes it again with [`Batch::decode`]. To decode
    /// only once, use [`Subscriber::next_with`].
    pub fn next(&mut self, timeout: Duration) -> Option<Update> {
        Some(match self.next_raw(timeout)? {
            Update::Batch(batch) => match self.check(&batch) {
                Ok(_) => Update::Batch(batch),
                Err(reason) => Update::Reset {
                    source: batch.source,
                    reason,
                },
            },
            reset => reset,
        })
    }

    /// Like [`Subscriber::next`], handing `f` the decoded batch: each payload is decoded once.
    pub fn next_with<R>(&mut self, timeout: Duration, f: impl FnOnce(View<'_>) -> R) -> Option<R> {
        Some(match self.next_raw(timeout)? {
            Update::Batch(b) => match self.check(&b) {
                Ok(batch) => f(View::Batch {
                    source: b.source,
                    seq: b.seq,
                    batch: &batch,
                    payload: &b.payload,
                }),
                Err(reason) => f(View::Reset {
                    source: b.source,
                    reason,
                }),
            },
            Update::Reset { source, reason } => f(View::Reset { source, reason }),
        })
    }

    /// Like [`Subscriber::next_with`], handing `f` every update ready now, in order, up to
    /// `max` of them (at least one): the first waits at most `timeout`, the rest are those
    /// already read (and, with nothing left, whatever the sockets hold, without waiting). For
    /// a consumer that applies many batches at once, such as
    /// `kvevent_index::Index::apply_many` (one write lock for them all). `None` on timeout,
    /// as for [`Subscriber::next`].
    pub fn next_many<R>(
        &mut self,
        timeout: Duration,
        max: usize,
        f: impl FnOnce(&[View<'_>]) -> R,
    ) -> Option<R> {
        let mut taken = std::mem::take(&mut self.taken);
        let Some(first) = self.next_raw(timeout) else {
            self.taken = taken;
            return None;
        };
        taken.push(first);
        while taken.len() < max {
            match self.next_raw(Duration::ZERO) {
                Some(update) => taken.push(update),
                None => break,
            }
        }
        // Each batch decoded once, here (a reset's place holds its reason, unread).
        let decoded: Vec<Result<wire::EventBatch<'_>, ResetReason>> = taken
            .iter()
            .map(|u| match u {
                Update::Batch(b) => self.check(b),
                Update::Reset { reason, .. } => Err(*reason),
            })
            .collect();
        let views: Vec<View<'_>> = taken
            .iter()
            .zip(&decoded)
            .map(|(u, d)| match u {
                Update::Reset { source, reason } => View::Reset {
                    source: *source,
                    reason: *reason,
                },
                Update::Batch(b) => match d {
                    Ok(batch) => View::Batch {
                        source: b.source,
                        seq: b.seq,
                        batch,
                        payload: &b.payload,
                    },
                    Err(reason) => View::Reset {
                        source: b.source,
                        reason: *reason,
                    },
                },
            })
            .collect();
        let out = f(&views);
        drop(views);
        drop(decoded);
        taken.clear();
        self.taken = taken;
        Some(out)
    }

    /// Whether updates were read and wait to be handed out: the next [`Subscriber::next_with`]
    /// returns without reading the sockets.
    pub fn has_pending(&mut self) -> bool {
        !self.ready.is_empty() || !self.inbox.is_empty()
    }

    /// The seq a replay running for `source` was asked from, if one runs.
    pub fn replaying_from(&self, source: usize) -> Option<u64> {
        self.states.get(source)?.replaying_from()
    }

    /// The next update as it came, its payload not decoded (a corrupt one is handed out as
    /// it is, not as a reset): for a consumer that keeps the bytes, such as a recorder.
    pub fn next_unchecked(&mut self, timeout: Duration) -> Option<Update> {
        self.next_raw(timeout)
    }

    /// Stops asking for replays, and ends those running as failed: the live batches they held
    /// come out next, as they are (a gap a replay would have filled is a reset where it is).
    /// For a consumer that stops and takes what was read ([`Subscriber::next_unchecked`]
    /// with no wait, until `None`).
    pub fn end_replays(&mut self) {
        self.stopping = true;
        for source in 0..self.states.len() {
            if self.removed[source] || !self.states[source].replaying() {
                continue;
            }
            // A replay this end asks for (a check becomes a rebuild) fails at once, stopping.
            let mut steps = std::mem::take(&mut self.steps);
            self.states[source].on_replay_done(ReplayEnd::Failed, Instant::now(), &mut steps);
            self.steps = steps;
            self.apply_steps(source);
            debug_assert!(!self.states[source].replaying());
        }
    }

    /// The next update in order, its payload not yet checked.
    fn next_raw(&mut self, timeout: Duration) -> Option<Update> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(update) = self.ready.pop_front() {
                return Some(update);
            }
            if let Some(frames) = self.inbox.pop_front() {
                self.handle(frames);
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let transport = self.transport.as_mut()?;
            let woken = transport.poll(left, &mut self.inbox);
            self.tick();
            // Woken, or a connection made or lost: the caller looks at it now.
            if self.inbox.is_empty() && (woken || Instant::now() >= deadline) {
                return None;
            }
        }
    }

    /// Gives every source's state its timers ([`SourceState::on_tick`]), at most every
    /// [`TICK`].
    fn tick(&mut self) {
        let now = Instant::now();
        if now.saturating_duration_since(self.last_tick) < TICK {
            return;
        }
        self.last_tick = now;
        for source in 0..self.states.len() {
            if self.removed[source] {
                continue;
            }
            let mut steps = std::mem::take(&mut self.steps);
            self.states[source].on_tick(now, &mut steps);
            self.steps = steps;
            if !self.steps.is_empty() {
                self.apply_steps(source);
            }
        }
    }

    fn handle(&mut self, incoming: transport::Frames) {
        let source = incoming.source;
        if self.removed.get(source).is_none_or(|r| *r) {
            return;
        }
        let Some(state) = self.states.get_mut(source) else {
            return;
        };
        let metrics = &self.metrics[source];
        let now = Instant::now();
        match incoming.delivery {
            transport::Delivery::Live(mut msg) => match frames::parse_live(&msg) {
                Ok(live) => {
                    let seq = live.seq;
                    if *live.topic != *self.topics[source] {
                        self.topics[source] = Arc::from(live.topic);
                    }
                    let payload = msg.pop().unwrap_or_default();
                    state.on_live(seq, payload, now, &mut self.steps);
                }
                Err(e) => {
                    metrics.malformed_frames.fetch_add(1, Relaxed);
                    tracing::warn!(source = %self.sources[source].label(), error = %e, "malformed live message skipped");
                }
            },
            transport::Delivery::Replay(mut msg) => match frames::parse_replay(&msg) {
                Ok(frames::ReplayReply::Batch { seq, topic, .. }) => {
                    if let Some(topic) = topic.filter(|t| **t != *self.topics[source]) {
                        self.topics[source] = Arc::from(topic);
                    }
                    let payload = msg.pop().unwrap_or_default();
                    state.on_replayed(seq, payload, now, &mut self.steps);
                }
                Ok(frames::ReplayReply::End) => {}
                Err(e) => {
                    metrics.malformed_frames.fetch_add(1, Relaxed);
                    tracing::warn!(source = %self.sources[source].label(), error = %e, "malformed replay reply skipped");
                }
            },
            transport::Delivery::Disconnected => state.on_disconnected(),
            transport::Delivery::Connected => state.on_connected(now, &mut self.steps),
            transport::Delivery::ReplayDone(outcome) => {
                if let transport::ReplayOutcome::Failed(why) = &outcome {
                    tracing::warn!(source = %self.sources[source].label(), %why, "replay failed");
                }
                state.on_replay_done(ReplayEnd::of(&outcome), now, &mut self.steps);
            }
        }
        self.apply_steps(source);
    }

    fn apply_steps(&mut self, source: usize) {
        let mut steps = std::mem::take(&mut self.steps);
        for step in steps.drain(..) {
            match step {
                Step::Deliver {
                    seq,
                    payload,
                    arrived,
                    replayed,
                } => self.deliver(source, seq, payload, arrived, replayed),
                Step::Reset(reason) => {
                    tracing::info!(source = %self.sources[source].label(), reason = reason.as_str(), "source reset");
                    self.ready.push_back(Update::Reset { source, reason });
                }
                Step::Replay { from } => {
                    let asked = !self.stopping
                        && self
                            .transport
                            .as_mut()
                            .is_some_and(|t| t.request_replay(source, from));
                    if !asked {
                        let mut more = Vec::new();
                        self.states[source].on_replay_done(
                            ReplayEnd::Failed,
                            Instant::now(),
                            &mut more,
                        );
                        self.steps = more;
                        self.apply_steps(source);
                    }
                }
            }
        }
        if self.steps.is_empty() {
            self.steps = steps;
        }
    }

    fn deliver(
        &mut self,
        source: usize,
        seq: u64,
        payload: Vec<u8>,
        arrived: Instant,
        replayed: bool,
    ) {
        self.ready.push_back(Update::Batch(Batch {
            source,
            seq,
            payload,
            engine: self.engines.get(source).copied().unwrap_or_default(),
            topic: self.topics[source].clone(),
            arrived,
            replayed,
        }));
    }

    /// Decodes a batch and counts its events; a corrupt one degrades its source, is counted by
    /// kind, and becomes a reset (its events are lost).
    fn check<'p>(&self, b: &'p Batch) -> Result<wire::EventBatch<'p>, ResetReason> {
        let metrics = &self.metrics[b.source];
        match wire::decode_engine(&b.payload, b.engine, &self.limits) {
            Ok(batch) => {
                let mut cleared = false;
                let counts = &metrics.events;
                for e in &batch.events {
                    let count = match e {
                        wire::Event::BlockStored(_) => &counts.stored,
                        wire::Event::BlockRemoved(_) => &counts.removed,
                        wire::Event::AllBlocksCleared(c) => {
                            // Only a clear of everything makes the state known again.
                            cleared |= c.medium.is_none();
                            &counts.cleared
                        }
                    };
                    count.fetch_add(1, Relaxed);
                }
                counts
                    .unknown
                    .fetch_add(batch.unknown_events as u64, Relaxed);
                if cleared {
                    self.states[b.source].mark_whole();
                }
                Ok(batch)
            }
            Err(e) => {
                metrics.decode_failure(e.kind());
                tracing::warn!(source = %self.sources[b.source].label(), seq = b.seq, error = %e, "payload does not decode: its events are lost");
                self.states[b.source].mark_degraded();
                metrics.reset(ResetReason::Corrupt);
                Err(ResetReason::Corrupt)
            }
        }
    }

    /// Closes every source's sockets.
    pub fn shutdown(mut self) {
        if let Some(t) = self.transport.take() {
            t.shutdown();
        }
    }
}
