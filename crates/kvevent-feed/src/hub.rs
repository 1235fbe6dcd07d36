//! The sidecar's side of the feed: every prefix its replica holds, the epoch, and a bounded
//! ring of encoded changes that followers resume from.
//!
//! The events thread calls [`Hub::apply`] with each report it makes and [`Hub::commit`] once a
//! turn: the turn's changes are encoded once, into one message that every follower is sent
//! (the same bytes). It never waits on a follower: the hub only takes a lock that followers
//! hold to copy what they need.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use kvevent_proto as ic;
use prost::Message;

use crate::pb;

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// How the hub serves its followers.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// The replica's name, as `Hello` says it and a follower may ask for it.
    pub replica: String,
    /// The served model.
    pub model: String,
    /// Most bytes of encoded changes kept for followers to resume from (the oldest go first).
    /// A follower whose position is older gets a snapshot. Default 64 MiB.
    pub ring_bytes: usize,
    /// A heartbeat goes to each follower after this long without a change: a follower that
    /// hears nothing for two calls the replica degraded, for five follows again. Default 200 ms.
    pub heartbeat: Duration,
    /// Blocks per snapshot message. Default 8,192 (about 200 KB).
    pub snapshot_chunk: usize,
    /// Messages queued for one follower's connection; a follower that stays this far behind
    /// until the ring has moved past it is cut off. Default 64.
    pub follower_queue: usize,
    /// After a change, a follower waits this long for more before it is sent what came, as
    /// one message: fewer wakeups and writes a follower, at this much latency. Default 50 ms.
    pub linger: Duration,
    /// The events thread says what it sees of the engine every turn ([`Hub::set_engine`], at
    /// least every 100 ms while it waits on the engine): this long without a turn, and the
    /// sidecar is behind its engine (starved of CPU, or stuck on a batch), so every rank is
    /// sent as degraded until it turns again: a router must not call the replica exact while
    /// the engine's newest batches wait unread. Default 300 ms.
    pub stalled_after: Duration,
    /// The engine's DP ranks, known before its events are: until the first
    /// [`Hub::set_engine`], followers are told they are not connected, so one that comes
    /// before the events thread's first turn is never told an empty state is exact. Empty (the
    /// default): nothing is said of the engine until then.
    pub ranks: Vec<u32>,
}

impl HubConfig {
    /// Defaults for `replica` serving `model`.
    pub fn new(replica: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            replica: replica.into(),
            model: model.into(),
            ring_bytes: 64 << 20,
            heartbeat: Duration::from_millis(200),
            snapshot_chunk: 8192,
            follower_queue: 64,
            linger: Duration::from_millis(50),
            stalled_after: Duration::from_millis(300),
            ranks: Vec::new(),
        }
    }
}

/// What the hub and its followers did, for `/metrics`.
#[derive(Debug, Default)]
pub struct HubMetrics {
    /// Followers connected now.
    pub followers: AtomicU64,
    /// Snapshots sent.
    pub snapshots: AtomicU64,
    /// Streams that went on from a follower's resume position.
    pub resumes: AtomicU64,
    /// Followers cut off for falling behind (their position left the ring).
    pub cut_off: AtomicU64,
    /// Streams refused: another replica or model asked for, or a missing or wrong token.
    pub refused: AtomicU64,
    /// Changes published.
    pub changes: AtomicU64,
    /// Epochs started after the first.
    pub new_epochs: AtomicU64,
    /// Prefix entries whose key is not an 8-byte fingerprint (not published).
    pub unkeyed: AtomicU64,
    /// Bytes in the ring now.
    pub ring_bytes: AtomicU64,
    /// Blocks held now.
    pub blocks: AtomicU64,
}

/// A resident prefix as the hub keys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct BlockKey {
    key: u64,
    adapter: u32,
    rank: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    tokens: u32,
    tier: pb::Tier,
}

/// One sealed message of changes: seqs `first..=last`.
#[derive(Debug)]
struct Sealed {
    first: u64,
    last: u64,
    bytes: Bytes,
}

#[derive(Debug)]
struct State {
    epoch: u64,
    seq: u64,
    blocks: Map<BlockKey, Held>,
    adapters: Vec<Arc<str>>,
    adapter_ids: Map<Arc<str>, u32>,
    pending: Vec<pb::Change>,
    ring: VecDeque<Sealed>,
    ring_bytes: usize,
    block_size: u32,
}

/// The sidecar's feed state. Share it (`Arc<Hub>`) between the events thread and the server.
#[derive(Debug)]
pub struct Hub {
    config: HubConfig,
    state: Mutex<State>,
    /// The newest (epoch, seq): followers wait on it.
    changed: tokio::sync::watch::Sender<(u64, u64)>,
    /// What the sidecar sees of its engine, rank by rank, each with when its connection last
    /// changed; `None` until the events thread says.
    engine: Mutex<Option<Vec<(EngineRank, std::time::Instant)>>>,
    /// The engine's HTTP server failing its health check: since when, and why.
    server_down: Mutex<Option<(std::time::Instant, String)>>,
    /// The engine's load: the last read, when it was read, and why reads since fail.
    load: Mutex<Option<LastLoad>>,
    /// Bumped when the engine's health changes: followers send it at once.
    health: tokio::sync::watch::Sender<u64>,
    metrics: HubMetrics,
    /// The origin of the messages' `sent_ms`.
    born: std::time::Instant,
    /// [`Hub::now_ms`] of the events thread's last turn ([`Hub::set_engine`]).
    turned: AtomicU64,
    /// [`Hub::now_ms`] of the last log line about a stall.
    stall_logged: AtomicU64,
}

/// One engine rank as the sidecar sees it ([`Hub::set_engine`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineRank {
    /// The DP rank.
    pub rank: u32,
    /// Its health, as its source state machine says it.
    pub health: kvevent_source::RankHealth,
}

#[derive(Debug)]
struct LastLoad {
    load: kvevent_scrape::Load,
    read: std::time::Instant,
    /// Why the reads after it fail.
    error: Option<String>,
}

/// A new epoch: the wall clock in nanoseconds, so a restarted sidecar never reuses one, and
/// always past the last.
fn next_epoch(last: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    now.max(last + 1)
}

/// What a follower at some position is to be sent next.
#[derive(Debug)]
pub(crate) enum Next {
    /// Everything, as of (epoch, seq).
    Snapshot(Snapshot),
    /// The sealed messages after the position, and the position they end at.
    Changes(Vec<Bytes>, (u64, u64)),
    /// The position is the newest.
    Nothing((u64, u64)),
    /// The position is of this epoch but older than the ring: the follower fell behind.
    Behind,
}

/// A copy of what the replica holds, taken under the lock and encoded outside it.
#[derive(Debug)]
pub(crate) struct Snapshot {
    pub(crate) epoch: u64,
    pub(crate) seq: u64,
    blocks: Vec<(BlockKey, Held)>,
    adapters: Vec<Arc<str>>,
}

impl Snapshot {
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// The `chunk`-th message of `size` blocks.
    pub(crate) fn chunk(&self, from: usize, size: usize) -> pb::Blocks {
        let to = (from + size).min(self.blocks.len());
        pb::Blocks {
            blocks: self.blocks[from..to]
                .iter()
                .map(|(k, h)| block(k, h, &self.adapters))
                .collect(),
        }
    }
}

fn block(k: &BlockKey, h: &Held, adapters: &[Arc<str>]) -> pb::Block {
    pb::Block {
        key: k.key,
        tokens: h.tokens,
        tier: h.tier as i32,
        adapter: adapters
            .get(k.adapter as usize)
            .map(|a| a.to_string())
            .unwrap_or_default(),
        dp_rank: k.rank,
    }
}

fn change(kind: pb::change::Kind) -> pb::Change {
    pb::Change { kind: Some(kind) }
}

impl Hub {
    /// An empty hub at a new epoch.
    pub fn new(config: HubConfig) -> Arc<Self> {
        let epoch = next_epoch(0);
        let now = std::time::Instant::now();
        let engine = (!config.ranks.is_empty()).then(|| {
            config
                .ranks
                .iter()
                .map(|&rank| {
                    let health = kvevent_source::RankHealth::Disconnected;
                    (EngineRank { rank, health }, now)
                })
                .collect()
        });
        Arc::new(Self {
            config,
            state: Mutex::new(State {
                epoch,
                seq: 0,
                blocks: Map::default(),
                adapters: vec![Arc::from("")],
                adapter_ids: std::iter::once((Arc::from(""), 0)).collect(),
                pending: Vec::new(),
                ring: VecDeque::new(),
                ring_bytes: 0,
                block_size: 0,
            }),
            changed: tokio::sync::watch::channel((epoch, 0)).0,
            engine: Mutex::new(engine),
            server_down: Mutex::new(None),
            load: Mutex::new(None),
            health: tokio::sync::watch::channel(0).0,
            metrics: HubMetrics::default(),
            // A millisecond before now, so no message is stamped 0 (what older sidecars send).
            born: std::time::Instant::now()
                .checked_sub(Duration::from_millis(1))
                .unwrap_or_else(std::time::Instant::now),
            turned: AtomicU64::new(0),
            stall_logged: AtomicU64::new(0),
        })
    }

    /// The hub's clock, for the messages' `sent_ms`: milliseconds since it was made.
    pub(crate) fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    /// Its configuration.
    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    /// Its counters.
    pub fn metrics(&self) -> &HubMetrics {
        &self.metrics
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The current (epoch, seq).
    pub fn position(&self) -> (u64, u64) {
        let s = self.lock();
        (s.epoch, s.seq)
    }

    /// Blocks held now.
    pub fn blocks(&self) -> usize {
        self.lock().blocks.len()
    }

    /// The engine's block size, from its stored events; said in `Hello`.
    pub fn note_block_size(&self, block_size: u32) {
        if block_size > 0 {
            let before = std::mem::replace(&mut self.lock().block_size, block_size);
            if before != block_size {
                // Followers that connected before the first block learn it at once.
                self.health.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
    }

    /// The block size said in `Hello` (0 until known).
    pub fn block_size(&self) -> u32 {
        self.lock().block_size
    }

    /// Takes one report of DP rank `rank`'s mapper into the turn's changes. Prefix keys must be
    /// fingerprints (8 bytes); others are counted (`unkeyed`) and skipped. A clear of the
    /// replica (`ALL_CLEARED`) starts a new epoch: the changes before it are dropped with the
    /// old one, followers are sent a new snapshot.
    pub fn apply(&self, rank: u32, report: &ic::Report) {
        self.take(rank, report, true);
    }

    /// Takes a report into what the hub holds without publishing it as a change: for the
    /// state a restarted sidecar resumes with, before [`Hub::resume_at`].
    pub fn load(&self, rank: u32, report: &ic::Report) {
        self.take(rank, report, false);
    }

    /// Goes on at `(epoch, seq)`, the position saved with the state the hub was loaded with: a
    /// follower at that position resumes with nothing missed; one elsewhere gets a snapshot.
    pub fn resume_at(&self, epoch: u64, seq: u64) {
        let mut s = self.lock();
        s.epoch = epoch;
        s.seq = seq;
        s.pending.clear();
        s.ring.clear();
        s.ring_bytes = 0;
        self.metrics.blocks.store(s.blocks.len() as u64, Relaxed);
        self.changed.send_replace((epoch, seq));
    }

    fn take(&self, rank: u32, report: &ic::Report, record: bool) {
        let mut guard = self.lock();
        let s = &mut *guard;
        match report {
            ic::Report::Update(u) | ic::Report::New(u) => {
                for p in &u.prefixes {
                    let Ok(key) = <[u8; 8]>::try_from(p.prefix_hash.as_slice()) else {
                        self.metrics.unkeyed.fetch_add(1, Relaxed);
                        continue;
                    };
                    let adapter = if p.adapter_id.is_empty() {
                        &u.adapter_id
                    } else {
                        &p.adapter_id
                    };
                    let adapter = s.adapter(adapter);
                    let k = BlockKey {
                        key: u64::from_be_bytes(key),
                        adapter,
                        rank,
                    };
                    let tier = if p.tier == ic::CacheTier::T1 as i32 {
                        pb::Tier::T1
                    } else {
                        pb::Tier::T2
                    };
                    let h = Held {
                        tokens: u32::try_from(p.token_count).unwrap_or(0),
                        tier,
                    };
                    let kind = match s.blocks.insert(k, h) {
                        None => pb::change::Kind::Stored(block(&k, &h, &s.adapters)),
                        Some(before) if before != h => {
                            pb::change::Kind::Moved(block(&k, &h, &s.adapters))
                        }
                        // A refresh: nothing changed.
                        Some(_) => continue,
                    };
                    if record {
                        s.pending.push(change(kind));
                    }
                }
            }
            ic::Report::Event(e) if e.r#type == ic::cache_event::Type::PrefixEvicted as i32 => {
                let Ok(key) = <[u8; 8]>::try_from(e.prefix_hash.as_slice()) else {
                    self.metrics.unkeyed.fetch_add(1, Relaxed);
                    return;
                };
                let Some(&adapter) = s.adapter_ids.get(e.adapter_id.as_str()) else {
                    return;
                };
                let k = BlockKey {
                    key: u64::from_be_bytes(key),
                    adapter,
                    rank,
                };
                if s.blocks.remove(&k).is_some() && record {
                    s.pending
                        .push(change(pb::change::Kind::Removed(pb::Removed {
                            key: k.key,
                            adapter: e.adapter_id.clone(),
                            dp_rank: rank,
                        })));
                }
            }
            ic::Report::Event(e) if e.r#type == ic::cache_event::Type::AllCleared as i32 => {
                self.new_epoch(s);
            }
            ic::Report::Event(_) => {}
        }
    }

    /// Starts a new epoch with nothing held: for a clear of the replica, and at a rebuild.
    pub fn clear(&self) {
        let mut guard = self.lock();
        self.new_epoch(&mut guard);
    }

    fn new_epoch(&self, s: &mut State) {
        s.epoch = next_epoch(s.epoch);
        s.seq = 0;
        s.blocks.clear();
        s.pending.clear();
        s.ring.clear();
        s.ring_bytes = 0;
        self.metrics.new_epochs.fetch_add(1, Relaxed);
        self.metrics.ring_bytes.store(0, Relaxed);
        self.metrics.blocks.store(0, Relaxed);
        self.changed.send_replace((s.epoch, s.seq));
    }

    /// Seals the turn's changes into one message for every follower and wakes them.
    pub fn commit(&self) {
        let mut guard = self.lock();
        self.seal(&mut guard);
    }

    /// Seals the changes applied since the last seal into one message.
    fn seal(&self, s: &mut State) {
        self.metrics.blocks.store(s.blocks.len() as u64, Relaxed);
        if s.pending.is_empty() {
            return;
        }
        let n = s.pending.len() as u64;
        let first = s.seq + 1;
        s.seq += n;
        let message = pb::FeedMessage {
            epoch: s.epoch,
            seq: s.seq,
            body: Some(pb::feed_message::Body::Changes(pb::Changes {
                changes: std::mem::take(&mut s.pending),
            })),
            engine: None,
            sent_ms: self.now_ms(),
        };
        let bytes = Bytes::from(message.encode_to_vec());
        s.ring_bytes += bytes.len();
        s.ring.push_back(Sealed {
            first,
            last: s.seq,
            bytes,
        });
        while s.ring_bytes > self.config.ring_bytes && s.ring.len() > 1 {
            if let Some(old) = s.ring.pop_front() {
                s.ring_bytes -= old.bytes.len();
            }
        }
        self.metrics.changes.fetch_add(n, Relaxed);
        self.metrics.ring_bytes.store(s.ring_bytes as u64, Relaxed);
        self.changed.send_replace((s.epoch, s.seq));
    }

    /// Waits for a change after (epoch, seq).
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<(u64, u64)> {
        self.changed.subscribe()
    }

    /// What a follower at `at` (epoch, seq of its last change; `None`: nothing yet) needs.
    pub(crate) fn next(&self, at: Option<(u64, u64)>) -> Next {
        let mut guard = self.lock();
        // Changes applied in a turn not yet committed are in the blocks: sealed now, so that
        // a snapshot is exactly the state at its seq.
        self.seal(&mut guard);
        let s = &*guard;
        let Some((epoch, seq)) = at.filter(|(e, q)| *e == s.epoch && *q <= s.seq) else {
            return Next::Snapshot(Snapshot {
                epoch: s.epoch,
                seq: s.seq,
                blocks: s.blocks.iter().map(|(k, h)| (*k, *h)).collect(),
                adapters: s.adapters.clone(),
            });
        };
        if seq == s.seq {
            return Next::Nothing((epoch, seq));
        }
        // The ring holds seqs first..=last of each message, contiguous, ending at s.seq.
        let Some(from) = s.ring.iter().position(|m| m.last > seq) else {
            return Next::Behind;
        };
        // Older than the ring (or, never from this hub, inside a message: positions are
        // message ends).
        if s.ring[from].first != seq + 1 {
            return Next::Behind;
        }
        let out = s.ring.iter().skip(from).map(|m| m.bytes.clone()).collect();
        Next::Changes(out, (s.epoch, s.seq))
    }

    /// The `Hello` for a stream.
    /// What the sidecar sees of its engine now, rank by rank: followers are sent it at once
    /// when it changed, and with every hello and heartbeat. The events thread calls it once a
    /// turn; it costs a compare when nothing changed.
    pub fn set_engine(&self, ranks: &[EngineRank]) {
        // A turn after a stall: the followers hear at once that it is over, and the log says
        // it happened (at most every 10 s).
        let now = self.now_ms();
        let was_stalled = self.stalled();
        let stalled_for = now.saturating_sub(self.turned.swap(now, Relaxed));
        if was_stalled {
            self.health.send_modify(|n| *n = n.wrapping_add(1));
            let logged = self.stall_logged.load(Relaxed);
            if logged == 0 || now.saturating_sub(logged) >= 10_000 {
                self.stall_logged.store(now, Relaxed);
                tracing::warn!(
                    stalled_ms = stalled_for,
                    "the events thread did not turn for {stalled_for} ms (starved of CPU, or stuck on a batch): feed followers were told the engine is degraded meanwhile"
                );
            }
        }
        let mut engine = self.engine.lock().unwrap_or_else(PoisonError::into_inner);
        let now = std::time::Instant::now();
        let same = engine.as_ref().is_some_and(|e| {
            e.len() == ranks.len() && e.iter().zip(ranks).all(|((a, _), b)| a == b)
        });
        if same {
            return;
        }
        let before = engine.take().unwrap_or_default();
        *engine = Some(
            ranks
                .iter()
                .map(|r| {
                    // The instant its connection last changed stays while it does not.
                    let kept = before
                        .iter()
                        .find(|(b, _)| {
                            b.rank == r.rank && b.health.is_connected() == r.health.is_connected()
                        })
                        .map(|(_, since)| *since);
                    (*r, kept.unwrap_or(now))
                })
                .collect(),
        );
        drop(engine);
        self.health.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Tells followers whether the engine's HTTP server answers its health check (`None`) or
    /// not (why, in our words); sent to them when it changes.
    pub fn set_engine_server(&self, failing: Option<String>) {
        let mut down = self
            .server_down
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let changed = match (&*down, &failing) {
            (None, None) => false,
            (Some((_, was)), Some(now)) => was != now,
            _ => true,
        };
        if !changed {
            return;
        }
        *down = failing.map(|why| {
            let since = down
                .as_ref()
                .map_or_else(std::time::Instant::now, |(t, _)| *t);
            (since, why)
        });
        drop(down);
        self.health.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The engine's load, just read: followers are sent it at once when it differs from the
    /// last, and with every hello and heartbeat (with its age).
    pub fn set_load(&self, read: kvevent_scrape::Load) {
        let mut load = self.load.lock().unwrap_or_else(PoisonError::into_inner);
        let changed = load
            .as_ref()
            .is_none_or(|l| l.load != read || l.error.is_some());
        *load = Some(LastLoad {
            load: read,
            read: std::time::Instant::now(),
            error: None,
        });
        drop(load);
        if changed {
            self.health.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// The engine's load could not be read (why, in our words): the last load stays, ageing,
    /// and followers are told why (at once when the reason changes). Nothing before the first
    /// good read.
    pub fn set_load_error(&self, why: String) {
        let mut load = self.load.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(last) = load.as_mut() else {
            return;
        };
        if last.error.as_deref() != Some(why.as_str()) {
            last.error = Some(why);
            drop(load);
            self.health.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// The events thread has not turned for `stalled_after` (after its first turn): the
    /// sidecar is behind its engine.
    fn stalled(&self) -> bool {
        let turned = self.turned.load(Relaxed);
        turned > 0
            && self.now_ms().saturating_sub(turned) > self.config.stalled_after.as_millis() as u64
    }

    /// The engine's health as the feed carries it: its ranks, server, load and the block size
    /// (`None` before any is known).
    pub(crate) fn engine_health(&self) -> Option<pb::EngineHealth> {
        let stalled = self.stalled();
        let block_size = self.block_size();
        let engine = self.engine.lock().unwrap_or_else(PoisonError::into_inner);
        let server = self
            .server_down
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let load = self
            .load
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|l| {
                pb::EngineLoad::new(&l.load, l.read.elapsed(), l.error.as_deref().unwrap_or(""))
            });
        if engine.is_none() && block_size == 0 && server.is_none() && load.is_none() {
            return None;
        }
        Some(pb::EngineHealth {
            load,
            server_down: server.is_some(),
            server_down_ms: server
                .as_ref()
                .map_or(0, |(since, _)| since.elapsed().as_millis() as u64),
            server_error: server.map(|(_, why)| why).unwrap_or_default(),
            block_size,
            ranks: engine
                .iter()
                .flatten()
                .map(|(r, since)| {
                    use kvevent_source::RankHealth::{Degraded, Unverified};
                    pb::RankHealth {
                        rank: r.rank,
                        connected: r.health.is_connected(),
                        since_ms: since.elapsed().as_millis() as u64,
                        // The flags, for followers older than `state`.
                        degraded: matches!(r.health, Degraded | Unverified) || stalled,
                        unverified: r.health == Unverified,
                        state: pb::RankState::from(r.health).into(),
                    }
                })
                .collect(),
        })
    }

    pub(crate) fn subscribe_health(&self) -> tokio::sync::watch::Receiver<u64> {
        self.health.subscribe()
    }

    /// The stream's first message; `snapshot_blocks`: the blocks of the snapshot after it.
    pub(crate) fn hello(&self, resumed: bool, snapshot_blocks: usize) -> pb::Hello {
        pb::Hello {
            replica: self.config.replica.clone(),
            model: self.config.model.clone(),
            block_size: self.block_size(),
            resumed,
            heartbeat_ms: self.config.heartbeat.as_millis() as u32,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            snapshot_blocks: snapshot_blocks as u64,
        }
    }
}

impl State {
    fn adapter(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.adapter_ids.get(name) {
            return id;
        }
        let id = self.adapters.len() as u32;
        let name: Arc<str> = Arc::from(name);
        self.adapters.push(name.clone());
        self.adapter_ids.insert(name, id);
        id
    }
}

#[cfg(test)]
mod tests {
    //! The hub's snapshot, resume and epoch rules against a model: whatever the engine does
    //! and however followers come and go, a follower that catches up holds exactly what the
    //! hub holds.

    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// An events thread that stops turning (starved, or stuck on a batch) leaves the engine's
    /// newest batches unread: past `stalled_after` every rank is sent as degraded, and the
    /// next turn says at once that it is over.
    #[test]
    fn a_stalled_events_thread_makes_every_rank_degraded_until_it_turns() {
        let hub = Hub::new(HubConfig {
            stalled_after: Duration::from_millis(50),
            ..HubConfig::new("r", "m")
        });
        let rank = EngineRank {
            rank: 0,
            health: kvevent_source::RankHealth::Trusted,
        };
        let degraded = |hub: &Hub| {
            hub.engine_health()
                .expect("health")
                .ranks
                .iter()
                .all(|r| r.degraded && r.health() == pb::RankState::Degraded)
        };
        hub.set_engine(&[rank]);
        assert!(!degraded(&hub));
        let mut health = hub.subscribe_health();
        health.borrow_and_update();
        std::thread::sleep(Duration::from_millis(80));
        assert!(degraded(&hub), "no turn for 80 ms");
        hub.set_engine(&[rank]);
        assert!(!degraded(&hub));
        assert!(
            health.has_changed().unwrap_or(false),
            "the end of the stall is sent at once"
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Store {
            key: u64,
            tier2: bool,
            tokens: u32,
        },
        Remove {
            key: u64,
        },
        Clear,
        Commit,
        /// Follower `i` reads everything there is.
        CatchUp(usize),
        /// Follower `i` reads only the next answer (a slow follower).
        ReadOne(usize),
        /// Follower `i` reconnects with its position.
        Reconnect,
        /// Follower `i` restarts: no position.
        Forget(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u64..24, any::<bool>(), 1u32..4).prop_map(|(key, tier2, tokens)| Op::Store { key, tier2, tokens }),
            4 => (0u64..24).prop_map(|key| Op::Remove { key }),
            1 => Just(Op::Clear),
            4 => Just(Op::Commit),
            3 => (0usize..3).prop_map(Op::CatchUp),
            2 => (0usize..3).prop_map(Op::ReadOne),
            1 => Just(Op::Reconnect),
            1 => (0usize..3).prop_map(Op::Forget),
        ]
    }

    /// key → (tokens, tier)
    type Held = BTreeMap<u64, (u32, i32)>;

    #[derive(Debug, Default)]
    struct Follower {
        at: Option<(u64, u64)>,
        held: Held,
    }

    impl Follower {
        /// Takes one answer of the hub; false when there was nothing new.
        fn read(&mut self, hub: &Hub) -> bool {
            match hub.next(self.at) {
                Next::Snapshot(snapshot) => {
                    self.held.clear();
                    for from in (0..snapshot.len()).step_by(3) {
                        for b in snapshot.chunk(from, 3).blocks {
                            self.held.insert(b.key, (b.tokens, b.tier));
                        }
                    }
                    self.at = Some((snapshot.epoch, snapshot.seq));
                    true
                }
                Next::Changes(messages, position) => {
                    let (epoch, mut seq) = self.at.expect("changes follow a position");
                    // As the server sends them: consecutive messages merged.
                    for bytes in crate::server::merged(messages) {
                        let m = pb::FeedMessage::decode(bytes).expect("decodes");
                        assert_eq!(m.epoch, epoch, "changes of the follower's epoch");
                        let Some(pb::feed_message::Body::Changes(c)) = m.body else {
                            panic!("a sealed message holds changes");
                        };
                        assert_eq!(m.seq, seq + c.changes.len() as u64, "seqs are contiguous");
                        seq = m.seq;
                        for change in c.changes {
                            match change.kind.expect("a kind") {
                                pb::change::Kind::Stored(b) => {
                                    let before = self.held.insert(b.key, (b.tokens, b.tier));
                                    assert!(before.is_none(), "stored: not held before");
                                }
                                pb::change::Kind::Moved(b) => {
                                    let before = self.held.insert(b.key, (b.tokens, b.tier));
                                    assert!(before.is_some(), "moved: held before");
                                }
                                pb::change::Kind::Removed(r) => {
                                    assert!(self.held.remove(&r.key).is_some(), "removed: held");
                                }
                            }
                        }
                    }
                    assert_eq!(Some((epoch, seq)), Some(position));
                    self.at = Some(position);
                    true
                }
                Next::Nothing(_) => false,
                // The server cuts it off; it comes back with its position.
                Next::Behind => {
                    self.at = None;
                    true
                }
            }
        }
    }

    fn store(key: u64, tier2: bool, tokens: u32) -> ic::Report {
        ic::Report::New(ic::CacheStateUpdate {
            prefixes: vec![ic::PrefixEntry {
                prefix_hash: key.to_be_bytes().to_vec(),
                token_count: tokens as i32,
                tier: if tier2 {
                    ic::CacheTier::T2
                } else {
                    ic::CacheTier::T1
                } as i32,
                ..Default::default()
            }],
            ..Default::default()
        })
    }

    fn event(kind: ic::cache_event::Type, key: u64) -> ic::Report {
        ic::Report::Event(ic::CacheEvent {
            r#type: kind as i32,
            prefix_hash: key.to_be_bytes().to_vec(),
            ..Default::default()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn a_follower_that_catches_up_holds_what_the_hub_holds(
            ops in proptest::collection::vec(op(), 1..120),
            ring in prop_oneof![Just(64usize), Just(1 << 20)],
        ) {
            let hub = Hub::new(HubConfig { ring_bytes: ring, ..HubConfig::new("r", "m") });
            let mut model = Held::new();
            let mut followers: Vec<Follower> = (0..3).map(|_| Follower::default()).collect();
            for op in ops {
                match op {
                    Op::Store { key, tier2, tokens } => {
                        hub.apply(0, &store(key, tier2, tokens));
                        let tier = if tier2 { pb::Tier::T2 } else { pb::Tier::T1 } as i32;
                        model.insert(key, (tokens, tier));
                    }
                    Op::Remove { key } => {
                        hub.apply(0, &event(ic::cache_event::Type::PrefixEvicted, key));
                        model.remove(&key);
                    }
                    Op::Clear => {
                        hub.apply(0, &event(ic::cache_event::Type::AllCleared, 0));
                        model.clear();
                    }
                    Op::Commit => hub.commit(),
                    Op::CatchUp(i) => {
                        let f = &mut followers[i];
                        let mut reads = 0;
                        while f.read(&hub) {
                            reads += 1;
                            prop_assert!(reads < 10, "catching up ends");
                        }
                        prop_assert_eq!(&f.held, &model);
                        prop_assert_eq!(f.at, Some(hub.position()));
                    }
                    Op::ReadOne(i) => {
                        followers[i].read(&hub);
                    }
                    // A reconnect with its position: the next read decides as any does.
                    Op::Reconnect => {}
                    Op::Forget(i) => followers[i] = Follower::default(),
                }
                prop_assert_eq!(hub.blocks(), model.len());
            }
        }
    }
}
