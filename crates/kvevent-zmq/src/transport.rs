//! The engine sources' sockets (SUB and replay DEALER), read by the caller's thread: raw frames out.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvevent_wire::frames::{self, ReplayReply};

use crate::options::ms;
use crate::{Error, Source, SourceOptions};

/// Most sources whose sockets share one libzmq context. A context holds at most 1,023 sockets
/// (`ZMQ_MAX_SOCKETS`, which the `zmq` crate cannot raise) and a source uses up to four (SUB,
/// the monitor's two PAIRs, the replay DEALER): further TCP sources get contexts of their own,
/// each with its own I/O thread. `inproc://` sources must share the caller's context.
const SOURCES_PER_CONTEXT: usize = 200;
/// Most messages read from one socket before the others are looked at.
const BURST: usize = 256;

/// A source's sockets, in `Reader::fds` and `Reader::unread`.
const SUB: usize = 0;
const MONITOR: usize = 1;
const DEALER: usize = 2;

/// Whether a read stopped because the socket had no more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drained {
    Yes,
    No,
}

/// A socket's `ZMQ_FD` (-1, never ready, should libzmq not give it).
fn fd_of(socket: &zmq::Socket) -> RawFd {
    socket.get_fd().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "no descriptor for a socket");
        -1
    })
}

/// Whether a socket has a message to read, after processing its pending commands.
fn has_input(socket: &zmq::Socket) -> bool {
    socket.get_events().is_ok_and(|e| e.contains(zmq::POLLIN))
}

/// What a source hands out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// A message from the SUB socket, frames as received.
    Live(Vec<Vec<u8>>),
    /// A reply from the replay socket (not the end marker), frames as received.
    Replay(Vec<Vec<u8>>),
    /// The replay asked for is over.
    ReplayDone(ReplayOutcome),
    /// The SUB socket lost its connection to the engine (it died, restarted, or the network
    /// or heartbeats failed). libzmq reconnects by itself; what comes next may be from a new
    /// engine process.
    Disconnected,
    /// The SUB socket has a connection to the engine (it connected to the engine's PUB, or
    /// the engine connected to our bound SUB). Not proof that the engine publishes.
    Connected,
}

/// How a replay ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// The end marker arrived.
    Complete,
    /// No reply for the idle timeout: the end marker (or more) was lost.
    TimedOut,
    /// The request could not be made.
    Failed(String),
}

/// Frames from one source, tagged with the source's index in [`Transport::start`]'s list
/// (or as [`Transport::add`] returned it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frames {
    /// Index of the source.
    pub source: usize,
    /// What arrived.
    pub delivery: Delivery,
}

/// The running sources. Sources can be added and removed while it runs; a source's index is
/// never reused.
pub struct Transport {
    /// The caller's context first, then the ones made for more TCP sources, with how many
    /// running sources each holds.
    contexts: Vec<(zmq::Context, usize)>,
    opts: SourceOptions,
    /// Frames made outside [`Transport::poll`]: a replay that could not be asked.
    early: Vec<Frames>,
    /// By source index; `None` once removed.
    slots: Vec<Option<Slot>>,
    /// The read end of [`Transport::waker`]'s pipe, polled with the sockets, and its waker.
    wake: Option<(UnixStream, Waker)>,
}

/// Wakes the thread blocked in [`Transport::poll`] (or `kvevent_source::Subscriber`'s
/// `next_many`) from another thread: the poll returns at once, with what was ready.
#[derive(Debug, Clone)]
pub struct Waker(Arc<UnixStream>);

impl Waker {
    /// Wakes the poll (now, or the next one if none is under way).
    pub fn wake(&self) {
        // A full pipe already wakes it: the error is nothing to act on.
        let _ = (&*self.0).write(&[1]);
    }
}

/// One source.
struct Slot {
    reader: Box<Reader>,
    /// Index in `Transport::contexts` of the context holding its sockets.
    context: usize,
}

/// A source's sockets, made before it starts.
type Sockets = (zmq::Socket, zmq::Socket, Option<zmq::Socket>);

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("sources", &self.slots.iter().flatten().count())
            .finish()
    }
}

fn socket_err(action: &'static str, endpoint: &str) -> impl FnOnce(zmq::Error) -> Error {
    let endpoint = endpoint.to_owned();
    move |source| Error::Socket {
        action,
        endpoint,
        source,
    }
}

fn sub_socket(
    ctx: &zmq::Context,
    source: &Source,
    opts: &SourceOptions,
) -> Result<zmq::Socket, Error> {
    let e = &source.endpoint;
    let socket = ctx.socket(zmq::SUB).map_err(socket_err("create", e))?;
    let configure = || -> Result<(), zmq::Error> {
        socket.set_linger(0)?;
        socket.set_rcvhwm(opts.rcvhwm)?;
        socket.set_reconnect_ivl(ms(opts.reconnect_interval))?;
        socket.set_reconnect_ivl_max(ms(opts.reconnect_interval_max))?;
        if !opts.heartbeat_interval.is_zero() {
            socket.set_heartbeat_ivl(ms(opts.heartbeat_interval))?;
            socket.set_heartbeat_timeout(ms(opts.heartbeat_timeout))?;
            socket.set_heartbeat_ttl(ms(opts.heartbeat_timeout))?;
        }
        socket.set_tcp_keepalive(1)?;
        if !opts.tcp_keepalive_idle.is_zero() {
            socket.set_tcp_keepalive_idle(
                opts.tcp_keepalive_idle
                    .as_secs()
                    .try_into()
                    .unwrap_or(i32::MAX),
            )?;
        }
        socket.set_subscribe(&source.topic)
    };
    configure().map_err(socket_err("configure", e))?;
    Ok(socket)
}

/// Connects (or binds) a SUB socket made by [`sub_socket`], once its monitor listens (a
/// loopback connection can complete before a monitor attached later would see it).
fn attach(socket: &zmq::Socket, source: &Source) -> Result<(), Error> {
    let e = &source.endpoint;
    if source.bind {
        socket.bind(e).map_err(socket_err("bind", e))
    } else {
        socket.connect(e).map_err(socket_err("connect", e))
    }
}

/// Distinguishes monitor endpoints of every transport sharing a context.
static MONITORS: AtomicUsize = AtomicUsize::new(0);

/// A PAIR socket receiving the SUB socket's connect and disconnect events.
fn monitor_socket(
    ctx: &zmq::Context,
    sub: &zmq::Socket,
    endpoint: &str,
) -> Result<zmq::Socket, Error> {
    let monitor = format!(
        "inproc://kvevent-monitor-{}",
        MONITORS.fetch_add(1, Ordering::Relaxed)
    );
    let events = zmq::SocketEvent::DISCONNECTED as i32
        | zmq::SocketEvent::CONNECTED as i32
        | zmq::SocketEvent::ACCEPTED as i32;
    sub.monitor(&monitor, events)
        .map_err(socket_err("monitor", endpoint))?;
    let pair = ctx
        .socket(zmq::PAIR)
        .map_err(socket_err("monitor", endpoint))?;
    pair.set_linger(0)
        .map_err(socket_err("monitor", endpoint))?;
    pair.connect(&monitor)
        .map_err(socket_err("monitor", endpoint))?;
    Ok(pair)
}

fn dealer_socket(
    ctx: &zmq::Context,
    endpoint: &str,
    opts: &SourceOptions,
) -> Result<zmq::Socket, Error> {
    let socket = ctx
        .socket(zmq::DEALER)
        .map_err(socket_err("create", endpoint))?;
    let configure = || -> Result<(), zmq::Error> {
        socket.set_linger(0)?;
        socket.set_rcvhwm(0)?;
        socket.set_reconnect_ivl(ms(opts.reconnect_interval))?;
        socket.set_reconnect_ivl_max(ms(opts.reconnect_interval_max))?;
        socket.set_tcp_keepalive(1)
    };
    configure().map_err(socket_err("configure", endpoint))?;
    socket
        .connect(endpoint)
        .map_err(socket_err("connect", endpoint))?;
    Ok(socket)
}

impl Transport {
    /// Creates every source's sockets, read by the caller's thread in [`Transport::poll`]: no
    /// thread, no channel, no handoff between threads for a message. A busy source is read
    /// between another's messages, and what waits queues in libzmq up to the HWM (the
    /// engine's PUB drops beyond it: the engine is never slowed down). The caller must keep
    /// polling (every 100 ms or so, idle or not): libzmq attaches a new or re-made connection,
    /// and sends its subscription, only when the socket's thread uses the socket.
    pub fn start(
        ctx: &zmq::Context,
        sources: &[Source],
        opts: &SourceOptions,
    ) -> Result<Self, Error> {
        let mut transport = Self {
            contexts: vec![(ctx.clone(), 0)],
            opts: opts.clone(),
            early: Vec::new(),
            wake: None,
            slots: Vec::with_capacity(sources.len()),
        };
        let prepared = sources
            .iter()
            .map(|s| transport.sockets(s))
            .collect::<Result<Vec<_>, _>>()?;
        for ((sockets, context), source) in prepared.into_iter().zip(sources) {
            transport.spawn(source, sockets, context);
        }
        Ok(transport)
    }

    /// The context for one more source: the caller's for `inproc://` (they must share it),
    /// else the first with room, else a new one.
    fn context_for(&mut self, source: &Source) -> usize {
        if source.endpoint.starts_with("inproc://")
            || source
                .replay_endpoint
                .as_deref()
                .is_some_and(|r| r.starts_with("inproc://"))
        {
            return 0;
        }
        if let Some(i) = self
            .contexts
            .iter()
            .position(|(_, n)| *n < SOURCES_PER_CONTEXT)
        {
            return i;
        }
        self.contexts.push((zmq::Context::new(), 0));
        self.contexts.len() - 1
    }

    fn sockets(&mut self, source: &Source) -> Result<(Sockets, usize), Error> {
        let c = self.context_for(source);
        let ctx = &self.contexts[c].0;
        let sub = sub_socket(ctx, source, &self.opts)?;
        let monitor = monitor_socket(ctx, &sub, &source.endpoint)?;
        attach(&sub, source)?;
        let dealer = source
            .replay_endpoint
            .as_deref()
            .map(|r| dealer_socket(ctx, r, &self.opts))
            .transpose()?;
        self.contexts[c].1 += 1;
        Ok(((sub, monitor, dealer), c))
    }

    fn spawn(&mut self, source: &Source, (sub, monitor, dealer): Sockets, context: usize) -> usize {
        let index = self.slots.len();
        let fds = [
            fd_of(&sub),
            fd_of(&monitor),
            dealer.as_ref().map_or(-1, fd_of),
        ];
        let reader = Reader {
            index,
            ctx: self.contexts[context].0.clone(),
            source: source.clone(),
            opts: self.opts.clone(),
            sub,
            monitor,
            dealer,
            replay_deadline: None,
            lost: false,
            fds,
            unread: [true; 3],
        };
        self.slots.push(Some(Slot {
            reader: Box::new(reader),
            context,
        }));
        index
    }

    /// Starts one more source while the others run; returns its index (never reused).
    pub fn add(&mut self, source: &Source) -> Result<usize, Error> {
        let (sockets, context) = self.sockets(source)?;
        Ok(self.spawn(source, sockets, context))
    }

    /// Stops source `index` and closes its sockets; the others are not touched. False when
    /// there is no such running source.
    pub fn remove(&mut self, index: usize) -> bool {
        let Some(slot) = self.slots.get_mut(index).and_then(Option::take) else {
            return false;
        };
        self.early.retain(|f| f.source != index);
        self.contexts[slot.context].1 -= 1;
        true
    }

    /// Sources running now.
    pub fn running(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Asks source `source` to replay every buffered batch from `from`. The frames come as
    /// [`Delivery::Replay`], then one [`Delivery::ReplayDone`]. Returns false when the source
    /// has no replay endpoint or has stopped.
    pub fn request_replay(&mut self, source: usize, from: u64) -> bool {
        match self.slots.get_mut(source).and_then(Option::as_mut) {
            Some(slot) => {
                let early = &mut self.early;
                slot.reader.start_replay(from, &mut |f| {
                    early.push(f);
                    true
                });
                true
            }
            None => false,
        }
    }

    /// A [`Waker`] for the thread that calls [`Transport::poll`]: one pipe, made at the first
    /// call, shared by every waker.
    pub fn waker(&mut self) -> Result<Waker, Error> {
        if let Some((_, waker)) = &self.wake {
            return Ok(waker.clone());
        }
        let (rx, tx) = UnixStream::pair().map_err(Error::Waker)?;
        rx.set_nonblocking(true).map_err(Error::Waker)?;
        tx.set_nonblocking(true).map_err(Error::Waker)?;
        let waker = Waker(Arc::new(tx));
        self.wake = Some((rx, waker.clone()));
        Ok(waker)
    }

    /// Reads every source's sockets into `out`, waiting up to `timeout` for the first message.
    /// Returns at once when something is ready, or when woken ([`Transport::waker`]); at most
    /// 256 messages a socket per call. True when it returned for something other
    /// than a message: woken, or a connection made or lost (the caller may look at its
    /// sources' state now).
    pub fn poll(&mut self, timeout: Duration, out: &mut VecDeque<Frames>) -> bool {
        let had = out.len();
        out.extend(self.early.drain(..));
        let wake_fd = self.wake.as_ref().map(|(rx, _)| rx.as_raw_fd());
        let readers: Vec<&mut Reader> = self
            .slots
            .iter_mut()
            .flatten()
            .map(|s| &mut *s.reader)
            .collect();
        if readers.is_empty() {
            if out.len() == had {
                match &mut self.wake {
                    Some((wake, _)) => {
                        let mut items = [zmq::PollItem::from_fd(wake.as_raw_fd(), zmq::POLLIN)];
                        let waited = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
                        if zmq::poll(&mut items, waited).is_ok() && items[0].is_readable() {
                            drain(wake);
                            return true;
                        }
                    }
                    None => std::thread::sleep(timeout),
                }
            }
            return false;
        }
        let mut wait = if out.len() > had || readers.iter().any(|r| r.unread.contains(&true)) {
            Duration::ZERO
        } else {
            timeout
        };
        for r in &readers {
            if let Some(d) = r.replay_deadline {
                wait = wait.min(d.saturating_duration_since(Instant::now()));
            }
        }
        // The sockets' descriptors are polled, not the sockets: one system call for them all,
        // where `zmq_poll` on the sockets asks each socket for its events (a system call
        // apiece, 262k a second following 256 busy engines).
        let (ready, woken): (Vec<[bool; 3]>, bool) = {
            let mut items: Vec<_> = readers
                .iter()
                .flat_map(|r| r.fds)
                .chain(wake_fd)
                .map(|fd| zmq::PollItem::from_fd(fd, zmq::POLLIN))
                .collect();
            let waited = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
            // A zero wait that rounds up stays zero; a positive one waits at least 1 ms.
            let waited = if wait.is_zero() { 0 } else { waited.max(1) };
            if let Err(e) = zmq::poll(&mut items, waited) {
                tracing::warn!(error = %e, "poll failed");
                std::thread::sleep(Duration::from_millis(10));
                return false;
            }
            let woken = wake_fd.is_some() && items.last().is_some_and(|i| i.is_readable());
            let monitored = items
                .chunks_exact(3)
                .any(|items| items[MONITOR].is_readable());
            let ready = items
                .chunks_exact(3)
                .zip(&readers)
                .map(|(items, r)| std::array::from_fn(|k| items[k].is_readable() || r.unread[k]))
                .collect();
            (ready, woken || monitored)
        };
        let mut emit = |f: Frames| {
            out.push_back(f);
            true
        };
        for (reader, ready) in readers.into_iter().zip(ready) {
            reader.read_signalled(ready, &mut emit);
        }
        if woken && let Some((wake, _)) = &mut self.wake {
            drain(wake);
        }
        woken
    }

    /// Closes every source's sockets.
    pub fn shutdown(self) {}
}

/// Empties a waker's pipe (it is non-blocking).
fn drain(mut wake: &UnixStream) {
    let mut buf = [0u8; 64];
    while matches!(wake.read(&mut buf), Ok(n) if n > 0) {}
}

/// One source's sockets and replay progress; reads what is ready and emits it, in
/// [`Transport::poll`].
struct Reader {
    index: usize,
    ctx: zmq::Context,
    source: Source,
    opts: SourceOptions,
    sub: zmq::Socket,
    /// The SUB socket's disconnect events.
    monitor: zmq::Socket,
    dealer: Option<zmq::Socket>,
    /// Set while a replay is running: when it is over if nothing more arrives.
    replay_deadline: Option<Instant>,
    /// The SUB lost its connection and has not made one since.
    lost: bool,
    /// The `ZMQ_FD` descriptors of the SUB, monitor
    /// and DEALER sockets (-1: none), and which of them may hold input although their
    /// descriptor did not signal (read up to `BURST` and not to the end, just made, or used
    /// to send). See [`Reader::read_signalled`].
    fds: [RawFd; 3],
    unread: [bool; 3],
}

/// Takes frames out; false: stop reading.
type Emit<'a> = dyn FnMut(Frames) -> bool + 'a;

impl Reader {
    /// Reads the caller's way, libzmq's edge-triggered one: a socket whose descriptor
    /// signalled (or that may hold unread input) first has its commands processed (asking
    /// for its events: connections attach, pipes wake), then is read until it is empty and
    /// its events say so; only then will its descriptor signal for new input. One that had
    /// more than `BURST` stays `unread`, for the next call.
    fn read_signalled(&mut self, [sub, monitor, dealer]: [bool; 3], emit: &mut Emit<'_>) {
        // Before the live messages: what follows a disconnect may be a new engine process.
        if monitor {
            self.unread[MONITOR] = false;
            while has_input(&self.monitor) {
                self.read_monitor(emit);
            }
        }
        if dealer {
            self.unread[DEALER] = false;
            while self.dealer.as_ref().is_some_and(has_input) {
                if self.read_replay(emit) == Drained::No {
                    self.unread[DEALER] = true;
                    break;
                }
            }
        }
        if sub {
            self.unread[SUB] = false;
            while has_input(&self.sub) {
                if self.read_live(emit) == Drained::No {
                    self.unread[SUB] = true;
                    break;
                }
            }
        }
        if self.replay_deadline.is_some_and(|d| Instant::now() >= d) {
            tracing::warn!(source = %self.source.label(), "replay timed out");
            self.end_replay(ReplayOutcome::TimedOut, emit);
        }
    }

    fn emit(&self, delivery: Delivery, emit: &mut Emit<'_>) -> bool {
        emit(Frames {
            source: self.index,
            delivery,
        })
    }

    /// Reads the monitor's events: one `Disconnected` however many arrived together, then
    /// `Connected` when the last event was a connection.
    fn read_monitor(&mut self, emit: &mut Emit<'_>) {
        let mut disconnected = false;
        let mut connected = None;
        while let Ok(event) = self.monitor.recv_multipart(zmq::DONTWAIT) {
            let id = event
                .first()
                .and_then(|f| f.get(..2))
                .map(|b| u16::from_le_bytes([b[0], b[1]]));
            if id == Some(zmq::SocketEvent::DISCONNECTED as u16) {
                disconnected = true;
                connected = Some(false);
            } else if id == Some(zmq::SocketEvent::CONNECTED as u16)
                || id == Some(zmq::SocketEvent::ACCEPTED as u16)
            {
                connected = Some(true);
            }
        }
        if disconnected {
            tracing::info!(source = %self.source.label(), "disconnected from the engine; libzmq reconnects");
            self.lost = true;
            self.emit(Delivery::Disconnected, emit);
        }
        if connected == Some(true) {
            tracing::info!(source = %self.source.label(), "connected to the engine");
            if std::mem::take(&mut self.lost) && self.dealer.is_some() {
                // The engine may be a new process: a replay asked of the old one will not be
                // answered, and the replay socket may still be backing off its reconnects.
                // A fresh one connects now, so the check that follows is answered at once.
                if self.replay_deadline.is_some() {
                    self.end_replay(
                        ReplayOutcome::Failed("the engine's connection was made again".into()),
                        emit,
                    );
                } else {
                    self.renew_dealer();
                }
            }
            self.emit(Delivery::Connected, emit);
        }
    }

    fn read_live(&self, emit: &mut Emit<'_>) -> Drained {
        for _ in 0..BURST {
            match self.sub.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => {
                    if !self.emit(Delivery::Live(frames), emit) {
                        return Drained::No;
                    }
                }
                Err(zmq::Error::EAGAIN) => return Drained::Yes,
                Err(e) => {
                    tracing::warn!(source = %self.source.label(), error = %e, "receive failed");
                    return Drained::Yes;
                }
            }
        }
        Drained::No
    }

    fn start_replay(&mut self, from: u64, emit: &mut Emit<'_>) {
        if self.replay_deadline.is_some() {
            // One replay at a time: the state asks again after this one ends.
            tracing::debug!(source = %self.source.label(), from, "replay already running");
            return;
        }
        let Some(dealer) = &self.dealer else {
            self.emit(
                Delivery::ReplayDone(ReplayOutcome::Failed("no replay endpoint".into())),
                emit,
            );
            return;
        };
        let [empty, seq] = frames::replay_request(from);
        match dealer.send_multipart([empty, seq], zmq::DONTWAIT) {
            Ok(()) => {
                // Sending may have taken the descriptor's signal: look at the socket again.
                self.unread[DEALER] = true;
                tracing::info!(source = %self.source.label(), from, "replay requested");
                self.replay_deadline = Some(Instant::now() + self.opts.replay_idle_timeout);
            }
            Err(e) => {
                self.emit(
                    Delivery::ReplayDone(ReplayOutcome::Failed(format!(
                        "send replay request: {e}"
                    ))),
                    emit,
                );
            }
        }
    }

    fn read_replay(&mut self, emit: &mut Emit<'_>) -> Drained {
        for _ in 0..BURST {
            let Some(dealer) = &self.dealer else {
                return Drained::Yes;
            };
            match dealer.recv_multipart(zmq::DONTWAIT) {
                Ok(msg) => {
                    if self.replay_deadline.is_none() {
                        // A late reply to a replay already given up on: not ours any more.
                        continue;
                    }
                    if matches!(frames::parse_replay(&msg), Ok(ReplayReply::End)) {
                        self.replay_deadline = None;
                        self.emit(Delivery::ReplayDone(ReplayOutcome::Complete), emit);
                        // What may follow the end is read (and dropped) next time.
                        self.unread[DEALER] = true;
                        return Drained::No;
                    }
                    self.replay_deadline = Some(Instant::now() + self.opts.replay_idle_timeout);
                    if !self.emit(Delivery::Replay(msg), emit) {
                        return Drained::No;
                    }
                }
                Err(zmq::Error::EAGAIN) => return Drained::Yes,
                Err(e) => {
                    tracing::warn!(source = %self.source.label(), error = %e, "replay receive failed");
                    return Drained::Yes;
                }
            }
        }
        Drained::No
    }

    /// Ends a replay that will not complete, with a fresh socket so late replies to it cannot
    /// be taken for the next one's.
    fn end_replay(&mut self, outcome: ReplayOutcome, emit: &mut Emit<'_>) {
        self.replay_deadline = None;
        self.renew_dealer();
        self.emit(Delivery::ReplayDone(outcome), emit);
    }

    /// A fresh replay socket, connecting now.
    fn renew_dealer(&mut self) {
        if let Some(endpoint) = self.source.replay_endpoint.clone() {
            match dealer_socket(&self.ctx, &endpoint, &self.opts) {
                Ok(fresh) => {
                    self.fds[DEALER] = fd_of(&fresh);
                    self.unread[DEALER] = true;
                    self.dealer = Some(fresh);
                }
                Err(e) => tracing::warn!(error = %e, "could not renew the replay socket"),
            }
        }
    }
}
