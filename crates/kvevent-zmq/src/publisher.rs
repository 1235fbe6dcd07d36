//! A publisher that behaves as vLLM's `ZmqEventPublisher` does, for tests, demos and
//! `kvevents publish`.
//!
//! - `[topic, seq, payload]` on a PUB-compatible socket (XPUB, so that a test can wait for
//!   subscribers instead of sleeping; SUB peers see no difference);
//! - a ROUTER replay socket answering `["", start]` with every buffered batch from `start`
//!   in the release's reply format, then the end marker; the buffer keeps the last
//!   `buffer_steps` batches;
//! - binds or connects by vLLM's rule ([`binds`]);
//! - faults on command: a batch buffered but not sent live (a lost message: a gap replay can
//!   repair), a seq consumed and never sent (a gap it cannot), a restart (seq back to 0, empty
//!   buffer), a lost end marker.

use std::collections::VecDeque;
use std::io::{Read as _, Write as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvevent_wire::{self as wire, Release, frames::END_OF_REPLAY};

use crate::Error;

/// vLLM's rule: the PUB socket binds when the endpoint has `*` or `::`, or is `ipc://` or
/// `inproc://`; otherwise it connects (and the subscriber binds).
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// How the publisher is set up.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Where to publish, e.g. `tcp://127.0.0.1:*` (binds, port picked by the OS).
    pub endpoint: String,
    /// Bind or connect regardless of vLLM's rule ([`binds`]): `None` follows the rule. A test
    /// restarting an engine on a known loopback port binds `tcp://127.0.0.1:PORT` this way.
    pub bind: Option<bool>,
    /// Where to serve replays, if at all (always bound, as vLLM does).
    pub replay_endpoint: Option<String>,
    /// The topic frame.
    pub topic: Vec<u8>,
    /// Batches kept for replay. vLLM's default is 10,000.
    pub buffer_steps: usize,
    /// The release whose payloads and replay reply format to speak.
    pub release: Release,
    /// Never send the replay end marker (as a pre-0.33 ROUTER over its HWM may lose it).
    pub lose_end_marker: bool,
}

impl PublisherConfig {
    /// Loopback defaults for `release`: PUB and replay ROUTER on OS-picked ports.
    pub fn loopback(release: Release) -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:*".into(),
            bind: None,
            replay_endpoint: Some("tcp://127.0.0.1:*".into()),
            topic: b"kv-events".to_vec(),
            buffer_steps: 10_000,
            release,
            lose_end_marker: false,
        }
    }
}

enum Command {
    Publish {
        payload: Vec<u8>,
        live: bool,
        /// The seq to send it with (the next ones follow it); `None`: the next seq.
        seq: Option<u64>,
        reply: Sender<u64>,
    },
    Skip(Sender<u64>),
    Restart(Sender<()>),
    Subscribers(Sender<usize>),
}

/// A running vLLM-like publisher (its sockets live on a thread of their own).
pub struct Publisher {
    release: Release,
    endpoint: String,
    replay_endpoint: Option<String>,
    commands: Option<Sender<Command>>,
    /// A byte written after each command wakes the thread from its poll; closed, it ends it.
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish()
    }
}

fn err(action: &'static str, endpoint: &str) -> impl FnOnce(zmq::Error) -> Error {
    let endpoint = endpoint.to_owned();
    move |source| Error::Socket {
        action,
        endpoint,
        source,
    }
}

fn last_endpoint(socket: &zmq::Socket, asked: &str) -> String {
    match socket.get_last_endpoint() {
        Ok(Ok(e)) => e,
        _ => asked.to_owned(),
    }
}

impl Publisher {
    /// Opens the sockets and starts the publisher thread.
    pub fn start(ctx: &zmq::Context, config: PublisherConfig) -> Result<Self, Error> {
        let e = config.endpoint.as_str();
        let publisher = ctx.socket(zmq::XPUB).map_err(err("create", e))?;
        publisher.set_linger(0).map_err(err("configure", e))?;
        publisher
            .set_xpub_verbose(true)
            .map_err(err("configure", e))?;
        publisher.set_sndhwm(100_000).map_err(err("configure", e))?;
        let endpoint = if config.bind.unwrap_or_else(|| binds(e)) {
            publisher.bind(e).map_err(err("bind", e))?;
            last_endpoint(&publisher, e)
        } else {
            publisher.connect(e).map_err(err("connect", e))?;
            e.to_owned()
        };
        let (router, replay_endpoint) = match &config.replay_endpoint {
            Some(r) => {
                let router = ctx.socket(zmq::ROUTER).map_err(err("create", r))?;
                router.set_linger(0).map_err(err("configure", r))?;
                let hwm = if config.release >= Release::new(0, 33, 0) {
                    100_000
                } else {
                    1_000
                };
                router.set_sndhwm(hwm).map_err(err("configure", r))?;
                router.bind(r).map_err(err("bind", r))?;
                let bound = last_endpoint(&router, r);
                (Some(router), Some(bound))
            }
            None => (None, None),
        };
        let (tx, rx) = mpsc::channel();
        let (wake, woken) = UnixStream::pair().map_err(Error::Waker)?;
        wake.set_nonblocking(true).map_err(Error::Waker)?;
        woken.set_nonblocking(true).map_err(Error::Waker)?;
        let worker = Worker {
            woken,
            config: config.clone(),
            publisher,
            router,
            commands: rx,
            next_seq: 0,
            buffer: VecDeque::new(),
            subscribers: 0,
        };
        let thread = std::thread::Builder::new()
            .name("kvevent-fake-engine".into())
            .spawn(move || worker.run())
            .map_err(Error::Spawn)?;
        Ok(Self {
            release: config.release,
            endpoint,
            replay_endpoint,
            commands: Some(tx),
            wake: Some(wake),
            thread: Some(thread),
        })
    }

    /// The publishing endpoint as bound (a wildcard port resolved), for subscribers to connect.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint as bound.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The release spoken.
    pub fn release(&self) -> Release {
        self.release
    }

    fn call<T>(&self, make: impl FnOnce(Sender<T>) -> Command) -> T
    where
        T: Default,
    {
        let (tx, rx) = mpsc::channel();
        let sent = self
            .commands
            .as_ref()
            .is_some_and(|c| c.send(make(tx)).is_ok());
        if !sent {
            return T::default();
        }
        // Full (the thread has bytes unread): it is awake already.
        if let Some(mut wake) = self.wake.as_ref() {
            let _ = wake.write(&[1]);
        }
        rx.recv_timeout(Duration::from_secs(10)).unwrap_or_default()
    }

    /// Encodes `batch` as the release would (dropping fields it lacks), publishes it and
    /// returns its seq.
    pub fn publish(&self, batch: &wire::EventBatch<'_>) -> Result<u64, wire::Error> {
        let mut batch = batch.clone();
        batch.retain_fields_of(self.release);
        let payload = wire::encode(&batch, self.release)?;
        Ok(self.publish_payload(payload))
    }

    /// Publishes a payload as it is; returns its seq.
    pub fn publish_payload(&self, payload: Vec<u8>) -> u64 {
        self.call(|reply| Command::Publish {
            payload,
            live: true,
            seq: None,
            reply,
        })
    }

    /// Publishes a payload as it is with seq `seq` (the next ones follow it), as a recorded
    /// engine sent it.
    pub fn publish_payload_at(&self, seq: u64, payload: Vec<u8>) -> u64 {
        self.call(|reply| Command::Publish {
            payload,
            live: true,
            seq: Some(seq),
            reply,
        })
    }

    /// Buffers a payload for replay without sending it live (a message lost on the way).
    pub fn publish_lost(&self, payload: Vec<u8>) -> u64 {
        self.call(|reply| Command::Publish {
            payload,
            live: false,
            seq: None,
            reply,
        })
    }

    /// Consumes a seq without sending or buffering anything (a batch lost for good).
    pub fn skip_seq(&self) -> u64 {
        self.call(Command::Skip)
    }

    /// Behaves like a new engine process: seq back to 0, empty replay buffer.
    pub fn restart(&self) {
        self.call(Command::Restart);
    }

    /// Waits until `n` subscriptions arrived (from SUB sockets) or `timeout` passes.
    pub fn wait_for_subscribers(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.call(Command::Subscribers) >= n {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops the thread and closes the sockets.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.commands.take();
        // Closed, the thread's end reads as ready: it finds the commands gone and returns.
        self.wake.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    /// Readable when a command was sent or the publisher closed.
    woken: UnixStream,
    config: PublisherConfig,
    publisher: zmq::Socket,
    router: Option<zmq::Socket>,
    commands: Receiver<Command>,
    next_seq: u64,
    buffer: VecDeque<(u64, Vec<u8>)>,
    subscribers: usize,
}

impl Worker {
    /// Commands, subscriptions and replay requests as they come: asleep in one poll of the
    /// sockets and the wake-up pipe until one does (an idle publisher costs nothing; 256
    /// simulated engines' publishers polling every 20 ms took 28 % of a core).
    fn run(mut self) {
        loop {
            loop {
                match self.commands.try_recv() {
                    Ok(command) => self.handle(command),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
            self.serve();
            let mut items = vec![
                zmq::PollItem::from_fd(self.woken.as_raw_fd(), zmq::POLLIN),
                self.publisher.as_poll_item(zmq::POLLIN),
            ];
            if let Some(router) = &self.router {
                items.push(router.as_poll_item(zmq::POLLIN));
            }
            // A second at most: what the poll might miss waits no longer than that.
            let _ = zmq::poll(&mut items, 1_000);
            let mut drained = [0u8; 64];
            while matches!((&self.woken).read(&mut drained), Ok(n) if n > 0) {}
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Publish {
                payload,
                live,
                seq,
                reply,
            } => {
                let seq = seq.unwrap_or(self.next_seq);
                self.next_seq = seq.wrapping_add(1);
                if live {
                    let frames = wire::frames::live_frames(&self.config.topic, seq, &payload);
                    if let Err(e) = self.publisher.send_multipart(frames, zmq::DONTWAIT) {
                        tracing::warn!(error = %e, seq, "fake engine: publish dropped");
                    }
                }
                self.buffer.push_back((seq, payload));
                while self.buffer.len() > self.config.buffer_steps {
                    self.buffer.pop_front();
                }
                let _ = reply.send(seq);
            }
            Command::Skip(reply) => {
                let _ = reply.send(self.next_seq);
                self.next_seq += 1;
            }
            Command::Restart(reply) => {
                self.next_seq = 0;
                self.buffer.clear();
                let _ = reply.send(());
            }
            Command::Subscribers(reply) => {
                let _ = reply.send(self.subscribers);
            }
        }
    }

    /// Counts new subscriptions and answers replay requests, between publishes as vLLM does.
    fn serve(&mut self) {
        while let Ok(msg) = self.publisher.recv_bytes(zmq::DONTWAIT) {
            if msg.first() == Some(&1) {
                self.subscribers += 1;
            }
        }
        let Some(router) = &self.router else {
            return;
        };
        while let Ok(request) = router.recv_multipart(zmq::DONTWAIT) {
            // [identity, "", start]: anything else is ignored, as the engine does.
            let [identity, empty, start] = request.as_slice() else {
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
                continue;
            };
            if !empty.is_empty() {
                continue;
            }
            let start = u64::from_be_bytes(start);
            let with_topic = self.config.release >= Release::new(0, 26, 0);
            let reply = |seq: u64, payload: &[u8]| {
                let mut frames = vec![identity.clone(), Vec::new()];
                if with_topic {
                    frames.push(if seq == END_OF_REPLAY {
                        Vec::new()
                    } else {
                        self.config.topic.clone()
                    });
                }
                frames.push(seq.to_be_bytes().to_vec());
                frames.push(payload.to_vec());
                let _ = router.send_multipart(frames, zmq::DONTWAIT);
            };
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                reply(*seq, payload);
            }
            if !self.config.lose_end_marker {
                reply(END_OF_REPLAY, b"");
            }
        }
    }
}

/// A deterministic engine workload, step by step: prompts stored as 4 blocks of 16 tokens,
/// extensions of earlier prompts (with their parent), GPU evictions, an offload to CPU, and a
/// prefix-cache reset every 50 steps. Used by `kvevents publish` and the demo.
pub fn scripted_batch(step: u64) -> wire::EventBatch<'static> {
    use wire::{BlockHash, BlockRemoved, BlockStored, Event, Int};
    let hash = |prompt: u64, block: u64| BlockHash::Int(Int::U64(prompt * 1_000 + block + 1));
    let tokens = |prompt: u64, from: u64, blocks: u64| -> wire::TokenIds<'static> {
        (from * 16..(from + blocks) * 16)
            .map(|t| ((prompt * 7_919 + t) % 50_000) as u32)
            .collect::<Vec<_>>()
            .into()
    };
    let prompt = step / 3;
    let events = match step % 3 {
        // A new prompt: 4 blocks from token 0.
        0 => vec![Event::BlockStored(BlockStored {
            block_hashes: (0..4).map(|b| hash(prompt, b)).collect(),
            token_ids: tokens(prompt, 0, 4),
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        })],
        // Its continuation: 2 more blocks after the 4th.
        1 => vec![Event::BlockStored(BlockStored {
            block_hashes: (4..6).map(|b| hash(prompt, b)).collect(),
            parent_block_hash: Some(hash(prompt, 3)),
            token_ids: tokens(prompt, 4, 2),
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        })],
        // Memory pressure: the previous prompt's tail leaves the GPU, its head goes to CPU.
        _ if step % 50 == 47 => vec![Event::AllBlocksCleared(Default::default())],
        _ => {
            let old = prompt.saturating_sub(1);
            vec![
                Event::BlockRemoved(BlockRemoved {
                    block_hashes: (4..6).map(|b| hash(old, b)).collect(),
                    medium: Some("GPU".into()),
                    ..Default::default()
                }),
                Event::BlockStored(BlockStored {
                    block_hashes: vec![hash(old, 0)],
                    token_ids: tokens(old, 0, 1),
                    block_size: 16,
                    medium: Some("CPU".into()),
                    ..Default::default()
                }),
            ]
        }
    };
    wire::EventBatch {
        ts: 1_700_000_000.0 + step as f64 * 0.01,
        events,
        data_parallel_rank: Some(0),
        unknown_events: 0,
    }
}
