//! The front stage on the wire: the calls it takes, the in-flight limit, and what each call's
//! outcome settles.
//!
//! A window goes as concurrent `PublishEvent` calls, one an eviction, together with one
//! `ReportCacheState` stream of its plain adds; its adds after an eviction go in a second
//! stream once every eviction is settled. A barrier is one `PublishEvent`. A retryable failure
//! puts its call back in its stage, so nothing later on its prefix can overtake it. Calls in
//! flight are bounded by a limit the task adapts ([`Task::adapt_in_flight`]).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use tokio::time::Instant;

use super::{Deliver, Task};
use crate::pending::{Adds, Group, Interner, Map, Op, Pending, Scope, Stage, Window};
use crate::{Config, DropReason, MAX_ENTRIES_PER_UPDATE, Metrics, Retry, classify, pb};

/// A call on the wire: what it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallId {
    /// An eviction: the op's sequence number.
    Evict(u64),
    /// One of the window's add streams.
    Adds(Adds),
    Barrier,
}

/// One add stream of the window in flight.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct AddStream {
    /// Not started (or failed and to be retried).
    ready: bool,
    /// Not settled.
    left: bool,
    /// Updates it carries, counted when they are built.
    updates: u64,
}

impl AddStream {
    fn new(has_adds: bool) -> Self {
        Self {
            ready: has_adds,
            left: has_adds,
            updates: 0,
        }
    }
}

/// The front stage on the wire: what is started, what is settled.
#[derive(Debug, Default)]
pub(crate) struct Flight {
    /// Evictions not started yet (sequence numbers), oldest first; retries go to the front.
    evicts: VecDeque<u64>,
    /// Calls started and not finished.
    running: usize,
    /// Evictions not yet settled (acknowledged, refused or given up).
    evicts_left: usize,
    plain: AddStream,
    after_evict: AddStream,
    barrier_ready: bool,
    barrier_left: bool,
    /// When the stage went on the wire, and how many evictions it had: a window of more
    /// evictions than the in-flight limit that took long to send raises the limit.
    started: Option<Instant>,
    evictions: usize,
}

impl Flight {
    fn stream(&mut self, kind: Adds) -> &mut AddStream {
        match kind {
            Adds::Plain => &mut self.plain,
            Adds::AfterEvict => &mut self.after_evict,
        }
    }

    fn done(&self) -> bool {
        self.running == 0
            && self.evicts_left == 0
            && !self.plain.left
            && !self.after_evict.left
            && !self.barrier_left
    }
}

/// Now, in microseconds since the epoch.
pub(crate) fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// The age of a report the server just acknowledged: now − its batch time. A report without
/// a time (0: "server now") or from the future (clock skew) is not observed.
fn observe_age(metrics: &Metrics, now_us: i64, timestamp_us: i64) {
    if timestamp_us > 0 && now_us >= timestamp_us {
        metrics
            .histograms
            .age_seconds
            .observe((now_us - timestamp_us) as f64 / 1e6);
    }
}

/// Where the forwarder's own in-flight limit starts, and its floor (see
/// [`Config::max_in_flight`]): about where the load benchmark's sweep found a call cheapest.
pub const INITIAL_IN_FLIGHT: usize = 64;

/// The forwarder's in-flight limit at the start, and the least it adapts down to.
pub(crate) fn in_flight_floor(config: &Config) -> usize {
    INITIAL_IN_FLIGHT.min(config.max_in_flight).max(1)
}

pub(crate) type Call =
    Pin<Box<dyn Future<Output = (CallId, Result<pb::Ack, tonic::Status>, Duration)> + Send>>;

impl<D: Deliver> Task<D> {
    /// Starts what the front stage may start now. A window whose work all netted away (a
    /// block stored and evicted within it, say) has nothing to send: it is settled at once and
    /// the stage behind it may go, else it would wait for a call that never comes.
    pub(crate) fn dispatch(
        &mut self,
        now: Instant,
        draining: bool,
        calls: &mut FuturesUnordered<Call>,
    ) {
        loop {
            self.start(now, draining, calls);
            if !self.flight.as_ref().is_some_and(Flight::done) {
                return;
            }
            self.flight = None;
            self.pending.stages.pop_front();
        }
    }

    /// Puts the front stage on the wire if it may go, and starts what it may start now.
    fn start(&mut self, now: Instant, draining: bool, calls: &mut FuturesUnordered<Call>) {
        if self.flight.is_none() {
            let window = self.config.window;
            let Some(front) = self.pending.stages.front_mut() else {
                return;
            };
            let flight = match front {
                Stage::Window(w) => {
                    if !(w.sealed || draining || now >= w.opened + window) {
                        return;
                    }
                    w.sealed = true;
                    // Nothing merges into it any more: the index is not needed.
                    w.keys = Map::default();
                    let mut f = Flight::default();
                    let (mut plain, mut after_evict) = (!w.stats.is_empty(), false);
                    for (i, op) in w.ops.iter().enumerate() {
                        match op {
                            Op::Evict { .. } => f.evicts.push_back(w.first_seq + i as u64),
                            Op::Add {
                                stream: Adds::Plain,
                                ..
                            } => plain = true,
                            Op::Add {
                                stream: Adds::AfterEvict,
                                ..
                            } => after_evict = true,
                            Op::Gone => {}
                        }
                    }
                    f.evicts_left = f.evicts.len();
                    f.evictions = f.evicts.len();
                    f.started = Some(now);
                    f.plain = AddStream::new(plain);
                    f.after_evict = AddStream::new(after_evict);
                    f
                }
                Stage::Barrier(_) => Flight {
                    barrier_ready: true,
                    barrier_left: true,
                    ..Flight::default()
                },
            };
            self.flight = Some(flight);
        }
        let Some(flight) = self.flight.as_mut() else {
            return;
        };
        let Some(stage) = self.pending.stages.front() else {
            return;
        };
        let max = self.in_flight;
        match stage {
            Stage::Barrier(event) => {
                if flight.barrier_ready {
                    flight.barrier_ready = false;
                    flight.running += 1;
                    let call = self.deliver.publish(event.clone());
                    calls.push(Box::pin(async move {
                        let t = Instant::now();
                        (CallId::Barrier, call.await, t.elapsed())
                    }));
                }
            }
            Stage::Window(w) => {
                // The plain adds go with the evictions; the adds after an eviction once every
                // eviction is settled.
                if flight.running < max {
                    start_adds(
                        w,
                        Adds::Plain,
                        flight,
                        &self.pending,
                        &self.deliver,
                        &self.metrics,
                        calls,
                    );
                }
                while flight.running < max {
                    let Some(seq) = flight.evicts.pop_front() else {
                        break;
                    };
                    let i = (seq - w.first_seq) as usize;
                    let Some(Op::Evict { key, timestamp_us }) = w.ops.get(i) else {
                        continue;
                    };
                    let p = &self.pending;
                    let (replica_id, model_id, tenant_id) = p.scopes.get(key.scope).clone();
                    let event = pb::CacheEvent {
                        r#type: pb::cache_event::Type::PrefixEvicted as i32,
                        replica_id,
                        model_id,
                        tenant_id,
                        prefix_hash: key.prefix.to_vec(),
                        timestamp_us: *timestamp_us,
                        adapter_id: p.adapters.get(key.adapter).clone(),
                    };
                    flight.running += 1;
                    let call = self.deliver.publish(event);
                    calls.push(Box::pin(async move {
                        let t = Instant::now();
                        (CallId::Evict(seq), call.await, t.elapsed())
                    }));
                }
                if flight.evicts_left == 0 && flight.running < max {
                    start_adds(
                        w,
                        Adds::AfterEvict,
                        flight,
                        &self.pending,
                        &self.deliver,
                        &self.metrics,
                        calls,
                    );
                }
            }
        }
    }

    /// Settles one call. True when it failed in a way worth retrying (it was put back).
    pub(crate) fn finish(
        &mut self,
        id: CallId,
        outcome: Result<pb::Ack, tonic::Status>,
        took: Duration,
    ) -> bool {
        let h = &self.metrics.histograms;
        match id {
            CallId::Adds(_) => h.report_seconds.observe(took.as_secs_f64()),
            CallId::Evict(_) | CallId::Barrier => h.publish_seconds.observe(took.as_secs_f64()),
        }
        let now_us = unix_us();
        let Some(flight) = self.flight.as_mut() else {
            return false;
        };
        flight.running -= 1;
        let result = match outcome {
            Ok(ack) if ack.accepted => Ok(()),
            Ok(ack) => {
                self.log.last_failure = Some((
                    tonic::Code::Ok,
                    format!("not accepted: {}", ack.reason_code),
                ));
                Err(DropReason::Rejected)
            }
            Err(status) => {
                self.metrics.rpc_error(status.code());
                self.log.rpc_failures += 1;
                self.log.last_failure = Some((status.code(), status.message().to_owned()));
                match classify(&status) {
                    Retry::Retry => {
                        match id {
                            CallId::Evict(seq) => flight.evicts.push_front(seq),
                            CallId::Adds(kind) => flight.stream(kind).ready = true,
                            CallId::Barrier => flight.barrier_ready = true,
                        }
                        if !self.log.failing {
                            self.log.failing = true;
                            self.log.outage = Some((Instant::now(), 0));
                            self.log_now(Instant::now(), true);
                        }
                        return true;
                    }
                    Retry::GiveUp => Err(DropReason::GaveUp),
                }
            }
        };
        if result.is_ok() && self.log.failing {
            self.log.failing = false;
            let (since, total) = self.log.outage.take().unwrap_or((Instant::now(), 0));
            tracing::info!(
                failed_calls = total + std::mem::take(&mut self.log.rpc_failures),
                failing_for = %format_args!("{}s", since.elapsed().as_secs()),
                "server accepting reports again"
            );
        }
        let Some(stage) = self.pending.stages.front_mut() else {
            return false;
        };
        let mut settled = 0;
        match (id, stage) {
            (CallId::Evict(seq), Stage::Window(w)) => {
                flight.evicts_left -= 1;
                if let (Ok(()), Some(Op::Evict { timestamp_us, .. })) =
                    (&result, w.ops.get((seq - w.first_seq) as usize))
                {
                    observe_age(&self.metrics, now_us, *timestamp_us);
                }
                settled += usize::from(w.cancel(seq));
                match result {
                    Ok(()) => {
                        self.metrics.success_now();
                        self.metrics.evictions_sent.fetch_add(1, Relaxed);
                    }
                    Err(reason) => self.dropped(reason, 0, 1),
                }
            }
            (CallId::Adds(kind), Stage::Window(w)) => {
                let stream = flight.stream(kind);
                stream.left = false;
                let updates = stream.updates;
                let mut entries = 0;
                // One observation per batch time (an update), not per entry; a window's adds
                // come in runs of one batch time, so only a change of time is looked up.
                let mut ages = std::collections::BTreeSet::new();
                let mut last_ts = None;
                for op in w.ops.iter_mut() {
                    if let Op::Add {
                        stream,
                        timestamp_us,
                        ..
                    } = op
                        && *stream == kind
                    {
                        if last_ts != Some(*timestamp_us) {
                            last_ts = Some(*timestamp_us);
                            ages.insert(*timestamp_us);
                        }
                        *op = Op::Gone;
                        entries += 1;
                    }
                }
                if result.is_ok() {
                    for ts in ages {
                        observe_age(&self.metrics, now_us, ts);
                    }
                }
                w.live -= entries;
                settled += entries;
                if kind == Adds::Plain {
                    w.stats.clear();
                }
                match result {
                    Ok(()) => {
                        self.metrics.success_now();
                        self.metrics.report_calls.fetch_add(1, Relaxed);
                        self.metrics.updates_sent.fetch_add(updates, Relaxed);
                        self.metrics
                            .prefixes_sent
                            .fetch_add(entries as u64, Relaxed);
                    }
                    Err(reason) => self.dropped(reason, entries as u64, 0),
                }
            }
            (CallId::Barrier, Stage::Barrier(e)) => {
                flight.barrier_left = false;
                settled += 1;
                if result.is_ok() {
                    observe_age(&self.metrics, now_us, e.timestamp_us);
                }
                let clear = e.r#type == pb::cache_event::Type::AllCleared as i32;
                match result {
                    Ok(()) => {
                        self.metrics.success_now();
                        if clear {
                            self.metrics.clears_sent.fetch_add(1, Relaxed);
                        } else {
                            self.metrics.evictions_sent.fetch_add(1, Relaxed);
                        }
                    }
                    Err(reason) => self.dropped(reason, 0, 1),
                }
            }
            _ => {}
        }
        self.pending.count -= settled;
        if let Some(flight) = self.flight.take_if(|f| f.done()) {
            self.pending.stages.pop_front();
            if let Some(started) = flight.started {
                let took = started.elapsed();
                self.metrics
                    .histograms
                    .window_send_seconds
                    .observe(took.as_secs_f64());
                self.adapt_in_flight(flight.evictions, took);
            }
        }
        self.metrics
            .queue_depth
            .store(self.pending.count as u64, Relaxed);
        false
    }

    /// After a window's stage is settled: more calls in flight when its evictions outnumbered
    /// the limit and took over three quarters of a window to send (close to falling behind),
    /// fewer when they took under three eighths (each call in flight costs CPU). Between the
    /// two the limit stays: when the round trip bounds the sends, halving the limit at most
    /// doubles their time, which stays under the raising mark; when the CPU bounds them, a
    /// higher limit does not make them faster, so a window half sent never raises it.
    fn adapt_in_flight(&mut self, evictions: usize, took: Duration) {
        let floor = in_flight_floor(&self.config);
        let window = self.config.window;
        let limit = if evictions > self.in_flight && took > window * 3 / 4 {
            (self.in_flight * 2).min(self.config.max_in_flight.max(1))
        } else if took < window * 3 / 8 {
            (self.in_flight / 2).max(floor)
        } else {
            self.in_flight
        };
        if limit != self.in_flight {
            self.in_flight = limit;
            self.metrics.in_flight_limit.store(limit as u64, Relaxed);
        }
    }
}

/// Starts `kind`'s stream of the window `w` when it is ready: its updates built, observed and
/// sent as one `ReportCacheState` call.
fn start_adds<D: Deliver>(
    w: &Window,
    kind: Adds,
    flight: &mut Flight,
    pending: &Pending,
    deliver: &D,
    metrics: &Metrics,
    calls: &mut FuturesUnordered<Call>,
) {
    let stream = flight.stream(kind);
    if !stream.ready {
        return;
    }
    stream.ready = false;
    let updates = build_updates(w, kind, &pending.scopes, &pending.groups, &pending.adapters);
    stream.updates = updates.len() as u64;
    for u in &updates {
        metrics
            .histograms
            .update_entries
            .observe(u.prefixes.len() as f64);
    }
    flight.running += 1;
    let call = deliver.report(updates);
    calls.push(Box::pin(async move {
        let t = Instant::now();
        (CallId::Adds(kind), call.await, t.elapsed())
    }));
}

/// The `CacheStateUpdate`s of a window's adds of one stream, one per (group, timestamp), at most [`MAX_ENTRIES_PER_UPDATE`] entries each, in the
/// order their first entry arrived; the stats-only updates go with the first stream.
pub(crate) fn build_updates(
    w: &Window,
    stream: Adds,
    scopes: &Interner<Scope>,
    groups: &Interner<Group>,
    adapters: &Interner<String>,
) -> Vec<pb::CacheStateUpdate> {
    let mut out: Vec<pb::CacheStateUpdate> = Vec::new();
    let mut open: Map<(u32, i64), usize> = Map::default();
    let header = |group: u32, ts: i64| {
        let (scope, scheme, adapter) = groups.get(group);
        let (replica, model, tenant) = scopes.get(*scope);
        pb::CacheStateUpdate {
            replica_id: replica.clone(),
            model_id: model.clone(),
            tenant_id: tenant.clone(),
            hash_scheme: scheme.clone(),
            timestamp_us: ts,
            adapter_id: adapter.clone(),
            ..Default::default()
        }
    };
    for op in &w.ops {
        let Op::Add {
            key,
            group,
            entry_adapter,
            tier,
            token_count,
            timestamp_us,
            stream: of,
            extra,
        } = op
        else {
            continue;
        };
        if *of != stream {
            continue;
        }
        let slot = match open.get(&(*group, *timestamp_us)) {
            Some(&i) if out[i].prefixes.len() < MAX_ENTRIES_PER_UPDATE => i,
            _ => {
                out.push(header(*group, *timestamp_us));
                open.insert((*group, *timestamp_us), out.len() - 1);
                out.len() - 1
            }
        };
        let (block_hashes, block_token_counts) = match extra {
            Some(x) => (x.block_hashes.clone(), x.block_token_counts.clone()),
            None => (Vec::new(), Vec::new()),
        };
        out[slot].prefixes.push(pb::PrefixEntry {
            prefix_hash: key.prefix.to_vec(),
            token_count: *token_count,
            block_hashes,
            block_token_counts,
            tier: *tier,
            adapter_id: adapters.get(*entry_adapter).clone(),
        });
    }
    if stream == Adds::Plain {
        for (group, stats, ts) in &w.stats {
            let mut u = header(*group, *ts);
            u.stats = stats.clone();
            out.push(u);
        }
    }
    out
}
