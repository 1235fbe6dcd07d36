//! Following one sidecar's feed: a task on the fleet's runtime for as long as the replica is
//! in the fleet.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvevent_feed::pb;
use kvevent_index::{KeyChange, LoadReading, SourceId, Tier};
use tonic::transport::Endpoint;

use crate::status::{self, Event, Shared};
use crate::{Core, SidecarFeed, lock};

/// `http://HOST:PORT` or `https://HOST:PORT`, as the feed's client connects to it.
pub(crate) fn valid_url(url: &str) -> bool {
    let Some(rest) = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
    else {
        return false;
    };
    let authority = rest.trim_end_matches('/');
    let port = authority.rsplit_once(':');
    matches!(port, Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok())
        && Endpoint::from_shared(url.to_owned()).is_ok()
}

/// Follows one sidecar's feed.
pub(crate) struct FeedFollower {
    core: Arc<Core>,
    name: String,
    feed: SidecarFeed,
    status: Shared,
    /// The source counting for the replica now.
    source: Option<SourceId>,
    /// The (epoch, seq) of the last change applied.
    at: Option<(u64, u64)>,
    /// Resumed behind the sidecar: the position its hello named, which the changes that
    /// follow it bring us to. Until then what counts is the state before the outage, so the
    /// replica is not exact (`Replaying`).
    catch_up: Option<(u64, u64)>,
}

/// The snapshot loading.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Loading {
    source: SourceId,
    epoch: u64,
    seq: u64,
    blocks: u64,
}

/// Why a feed's stream ended, in our words ([`ReplicaStatus::error`](crate::ReplicaStatus)).
#[derive(Debug, thiserror::Error)]
pub(crate) enum FeedError {
    #[error("cannot connect to {url}: {cause}")]
    Connect { url: String, cause: String },
    #[error("the address is not valid: {0}")]
    Address(String),
    #[error("refused: {0}")]
    Refused(String),
    #[error("the feed at {url} failed: {what}")]
    Status { url: String, what: String },
    #[error("nothing heard from {0} for {1:?}")]
    Silent(String, Duration),
    #[error("refused: the sidecar serves {what} `{served}`, not `{asked}`")]
    Mismatch {
        what: &'static str,
        served: String,
        asked: String,
    },
    #[error("a malformed feed: {0}")]
    Malformed(&'static str),
    #[error("the index follows too many sources")]
    Full,
    #[error("the stream ended")]
    Ended,
}

impl FeedError {
    fn of(url: &str, status: tonic::Status) -> Self {
        match status.code() {
            tonic::Code::FailedPrecondition
            | tonic::Code::Unauthenticated
            | tonic::Code::PermissionDenied => Self::Refused(status.message().to_owned()),
            _ => {
                // tonic's words ("Unknown error", "transport error") say little: the cause
                // chain says what happened.
                let what = match status.message() {
                    "" => format!("{:?}", status.code()),
                    message => message.to_owned(),
                };
                Self::Status {
                    url: url.to_owned(),
                    what: kvevent_scrape::with_causes(what, &status),
                }
            }
        }
    }

    fn connect(url: &str, e: &tonic::transport::Error) -> Self {
        // tonic's own words ("transport error") only where nothing says more.
        let cause = match std::error::Error::source(e) {
            Some(first) => kvevent_scrape::error_chain(first),
            None => e.to_string(),
        };
        Self::Connect {
            url: url.to_owned(),
            cause,
        }
    }
}

impl FeedFollower {
    pub(crate) fn new(core: Arc<Core>, name: &str, feed: SidecarFeed, status: Shared) -> Self {
        Self {
            core,
            name: name.to_owned(),
            feed,
            status,
            source: None,
            at: None,
            catch_up: None,
        }
    }

    pub(crate) async fn run(mut self) {
        let (initial, max) = (
            self.core.config.reconnect_initial,
            self.core
                .config
                .reconnect_max
                .max(self.core.config.reconnect_initial),
        );
        let mut backoff = initial;
        loop {
            let result = self.follow_once().await;
            let now = Instant::now();
            let event = match result {
                Ok(()) => {
                    backoff = initial;
                    Event::Lost {
                        since: now,
                        error: None,
                    }
                }
                // A refusal is not an outage: waiting will not change it.
                Err(e @ (FeedError::Refused(_) | FeedError::Mismatch { .. })) => Event::Refused {
                    error: e.to_string(),
                },
                Err(e) => Event::Lost {
                    since: now,
                    error: Some(e.to_string()),
                },
            };
            lock(&self.status).on(&self.name, event, now);
            self.publish();
            // Back off, waking for the state's deadlines (stale, dropped) on the way.
            let until = tokio::time::Instant::now() + backoff;
            loop {
                let deadline = lock(&self.status).next_deadline(&self.core);
                let wake = deadline.map_or(until, |d| until.min(d.into()));
                tokio::time::sleep_until(wake).await;
                self.publish();
                if wake >= until {
                    break;
                }
            }
            backoff = (backoff * 2).min(max);
        }
    }

    /// Publishes the replica's state; past `drop_after` without its source, its entries stop
    /// counting.
    fn publish(&mut self) {
        status::publish(&self.core, &self.name, &self.status);
        let expired = lock(&self.status).expire(self.core.config.drop_after, Instant::now());
        if expired && let Some(source) = self.source.take() {
            self.core.index.remove_source(source);
            self.at = None;
        }
    }

    async fn follow_once(&mut self) -> Result<(), FeedError> {
        let config = &self.core.config;
        let endpoint = Endpoint::from_shared(self.feed.url.clone())
            .map_err(|e| FeedError::Address(e.to_string()))?
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5));
        let endpoint = match &self.feed.tls {
            Some(tls) => endpoint
                .tls_config(tls.clone())
                .map_err(|e| FeedError::connect(&self.feed.url, &e))?,
            None => endpoint,
        };
        let channel = tokio::time::timeout(config.connect_timeout, endpoint.connect())
            .await
            .map_err(|_| FeedError::Silent(self.feed.url.clone(), config.connect_timeout))?
            .map_err(|e| FeedError::connect(&self.feed.url, &e))?;
        let mut client = pb::feed_client::FeedClient::new(channel)
            .max_decoding_message_size(config.max_message_bytes);
        let mut request = tonic::Request::new(pb::FollowRequest {
            replica: self.feed.replica.clone(),
            model: self.feed.model.clone(),
            resume: self.at.map(|(epoch, seq)| pb::Position { epoch, seq }),
        });
        if let Some(token) = &self.feed.token {
            let value = format!("Bearer {token}")
                .parse()
                .map_err(|_| FeedError::Address("the token is not a valid header value".into()))?;
            request.metadata_mut().insert("authorization", value);
        }
        let mut stream = tokio::time::timeout(config.connect_timeout, client.follow(request))
            .await
            .map_err(|_| FeedError::Silent(self.feed.url.clone(), config.connect_timeout))?
            .map_err(|s| FeedError::of(&self.feed.url, s))?
            .into_inner();
        // Until the Hello says otherwise.
        let mut silent_after = config.dead_after;
        let mut loading: Option<Loading> = None;
        // A sidecar sends something at least every heartbeat: two missed, and the replica is
        // degraded (a link cut without a word, blackholed, or a sidecar frozen says nothing);
        // five, and the stream is given up and followed again. The two are counted from when
        // the last message was made, not when it came: what came late is that much older.
        let mut heard = tokio::time::Instant::now();
        let mut renewed: Option<tokio::time::Instant> = None;
        let opened = Instant::now();
        let mut lag = Lag::default();
        let mut behind = Duration::ZERO;
        let lag_after = config.lag_after;
        let result = loop {
            let quiet_at = heard + (silent_after * 2 / 5).saturating_sub(behind);
            let silent = lock(&self.status).silent;
            let deadline = lock(&self.status)
                .next_deadline(&self.core)
                .map(tokio::time::Instant::from_std);
            let wake = [deadline, (!silent).then_some(quiet_at)]
                .into_iter()
                .flatten()
                .min();
            let message = tokio::select! {
                m = tokio::time::timeout_at(heard + silent_after, stream.message()) => m,
                () = sleep_until(wake.map(tokio::time::Instant::into_std)) => {
                    if tokio::time::Instant::now() >= quiet_at {
                        lock(&self.status).on(&self.name, Event::Silent(true), Instant::now());
                    }
                    self.publish();
                    continue;
                }
            };
            let message = match message {
                Err(_) => break Err(FeedError::Silent(self.feed.url.clone(), silent_after)),
                Ok(Err(status)) => break Err(FeedError::of(&self.feed.url, status)),
                Ok(Ok(None)) => break Err(FeedError::Ended),
                Ok(Ok(Some(m))) => m,
            };
            heard = tokio::time::Instant::now();
            if silent {
                lock(&self.status).on(&self.name, Event::Silent(false), Instant::now());
            }
            let sent_ms = message.sent_ms;
            if let Err(e) = self.take(message, &mut loading, &mut silent_after) {
                break Err(e);
            }
            // The word holds two heartbeats from now (as the Hello said, or a fifth of
            // `dead_after` before it), renewed at most twice a heartbeat: answers read later
            // than that, with this task not running to hear more, are not exact.
            let heartbeat = silent_after / 5;
            if renewed.is_none_or(|t| heard >= t + heartbeat / 2) {
                renewed = Some(heard);
                self.core
                    .index
                    .renew_lease(&self.name, Some(heard.into_std() + 2 * heartbeat));
            }
            if let Some(late) = lag.behind(sent_ms, opened.elapsed().as_millis() as u64) {
                behind = late;
                let lagging = late > lag_after;
                let mut s = lock(&self.status);
                if s.lagging != lagging {
                    s.on(&self.name, Event::Lagging(lagging), Instant::now());
                }
            }
            self.publish();
        };
        self.stream_ended(&mut loading);
        result
    }

    /// A stream ended (or failed): a snapshot cut short never counts, and the state before it
    /// goes on counting (degraded, then stale) until a whole snapshot arrives.
    pub(crate) fn stream_ended(&mut self, loading: &mut Option<Loading>) {
        if let Some(l) = loading.take() {
            self.core.index.remove_source(l.source);
        }
        // Its state says what was lost from now on; the next stream renews a lease.
        self.core.index.renew_lease(&self.name, None);
        let now = Instant::now();
        lock(&self.status).on(
            &self.name,
            Event::Lost {
                since: now,
                error: None,
            },
            now,
        );
    }

    /// The sidecar's view of its engine, from a Hello or a Heartbeat.
    fn engine_health(&mut self, health: &pb::EngineHealth) {
        let now = Instant::now();
        self.core.note_block_size(health.block_size);
        let mut s = lock(&self.status);
        if health.block_size > 0 {
            s.block_size = health.block_size;
        }
        let lost = health
            .ranks
            .iter()
            .filter(|r| r.health() == kvevent_feed::RankState::Disconnected);
        // The engine is lost while any rank is: since the rank lost longest ago.
        let lost_since = lost
            .map(|r| {
                now.checked_sub(Duration::from_millis(r.since_ms))
                    .unwrap_or(now)
            })
            .min();
        let ranks = health
            .ranks
            .iter()
            .map(|r| {
                let since = Some(Duration::from_millis(r.since_ms));
                (status::rank_status(r.rank, r.health(), since), Some(now))
            })
            .collect();
        let view = status::rank_view(health.ranks.iter().map(pb::RankHealth::health));
        let server_down = health.server_down.then(|| {
            let since = now
                .checked_sub(Duration::from_millis(health.server_down_ms))
                .unwrap_or(now);
            (since, health.server_error.clone())
        });
        s.on(
            &self.name,
            Event::Engine {
                lost_since,
                view,
                ranks,
            },
            now,
        );
        s.on(&self.name, Event::Server(server_down), now);
        let load = health.load.as_ref().map(|l| LoadReading {
            load: l.load(),
            read_at: now
                .checked_sub(Duration::from_millis(l.age_ms))
                .unwrap_or(now),
            failing: !l.error.is_empty(),
        });
        let error = health
            .load
            .as_ref()
            .map(|l| l.error.clone())
            .filter(|e| !e.is_empty());
        s.set_load(&self.core, &self.name, load, error);
    }

    pub(crate) fn take(
        &mut self,
        message: pb::FeedMessage,
        loading: &mut Option<Loading>,
        silent_after: &mut Duration,
    ) -> Result<(), FeedError> {
        use pb::feed_message::Body;
        let (epoch, seq) = (message.epoch, message.seq);
        match message.body {
            Some(Body::Hello(hello)) => {
                for (what, asked, served) in [
                    ("replica", &self.feed.replica, &hello.replica),
                    ("model", &self.feed.model, &hello.model),
                ] {
                    if !asked.is_empty() && asked != served {
                        return Err(FeedError::Mismatch {
                            what,
                            served: served.clone(),
                            asked: asked.clone(),
                        });
                    }
                }
                // Five heartbeats missed (at least 1 s): the stream is lost.
                if hello.heartbeat_ms > 0 {
                    *silent_after = Duration::from_millis(u64::from(hello.heartbeat_ms) * 5)
                        .max(Duration::from_secs(1));
                }
                self.core.note_block_size(hello.block_size);
                // The snapshot that follows: the index makes room for it at once (a fleet
                // joining from empty grows its tables once, not step by step).
                if !hello.resumed && hello.snapshot_blocks > 0 {
                    let blocks = usize::try_from(hello.snapshot_blocks).unwrap_or(usize::MAX);
                    self.core.index.reserve(blocks);
                }
                // A resumed stream's hello names where the changes that follow it end (a
                // sidecar before this rule names our own position: nothing to wait for).
                self.catch_up = match self.at {
                    Some((e, q)) if hello.resumed && e == epoch && q < seq => Some((epoch, seq)),
                    _ => None,
                };
                let mut s = lock(&self.status);
                if hello.block_size > 0 {
                    s.block_size = hello.block_size;
                }
                let now = Instant::now();
                s.on(
                    &self.name,
                    Event::Connected {
                        resumed: hello.resumed,
                    },
                    now,
                );
                if self.catch_up.is_some() {
                    s.on(&self.name, Event::CatchingUp(true), now);
                }
            }
            Some(Body::Snapshot(chunk)) => {
                let fresh = !loading.is_some_and(|l| l.epoch == epoch && l.seq == seq);
                if fresh {
                    if let Some(old) = loading.take() {
                        self.core.index.remove_source(old.source);
                    }
                    let source = self.add_loading_source()?;
                    *loading = Some(Loading {
                        source,
                        epoch,
                        seq,
                        blocks: 0,
                    });
                    lock(&self.status).on(&self.name, Event::SnapshotStarted, Instant::now());
                }
                let Some(l) = loading.as_mut() else {
                    return Err(FeedError::Malformed("no snapshot loading"));
                };
                let changes: Vec<KeyChange<'_>> = chunk.blocks.iter().map(stored).collect();
                self.core.index.apply_keys(l.source, &changes);
                l.blocks += chunk.blocks.len() as u64;
            }
            Some(Body::SnapshotEnd(end)) => {
                let (source, count) = match loading.take() {
                    Some(l) if l.epoch == epoch && l.seq == seq => (l.source, l.blocks),
                    Some(_) => return Err(FeedError::Malformed("a snapshot's end of another")),
                    // An empty snapshot has no chunk.
                    None => (self.add_loading_source()?, 0),
                };
                if count != end.blocks {
                    self.core.index.remove_source(source);
                    return Err(FeedError::Malformed("a snapshot's chunks do not add up"));
                }
                self.core.index.promote(source, self.source);
                self.source = Some(source);
                self.at = Some((epoch, seq));
                self.catch_up = None;
                lock(&self.status).on(
                    &self.name,
                    Event::SnapshotWhole { blocks: count },
                    Instant::now(),
                );
            }
            Some(Body::Changes(changes)) => {
                let (Some((at_epoch, _)), Some(source)) = (self.at, self.source) else {
                    return Err(FeedError::Malformed("changes before any snapshot"));
                };
                if at_epoch != epoch {
                    return Err(FeedError::Malformed("changes of another epoch"));
                }
                let mut applied = Vec::with_capacity(changes.changes.len());
                let mut blocks = lock(&self.status).blocks as i64;
                for c in &changes.changes {
                    match &c.kind {
                        Some(pb::change::Kind::Stored(b)) => {
                            blocks += 1;
                            applied.push(stored(b));
                        }
                        Some(pb::change::Kind::Moved(b)) => applied.push(stored(b)),
                        Some(pb::change::Kind::Removed(r)) => {
                            blocks -= 1;
                            applied.push(KeyChange::Evicted {
                                key: r.key,
                                adapter: &r.adapter,
                            });
                        }
                        None => {}
                    }
                }
                self.core.index.apply_keys(source, &applied);
                self.at = Some((epoch, seq));
                let caught_up = self
                    .catch_up
                    .take_if(|(e, q)| *e != epoch || *q <= seq)
                    .is_some();
                let mut s = lock(&self.status);
                let now = Instant::now();
                s.on(
                    &self.name,
                    Event::Changed {
                        blocks: blocks.max(0) as u64,
                    },
                    now,
                );
                if caught_up {
                    s.on(&self.name, Event::CatchingUp(false), now);
                }
            }
            Some(Body::Heartbeat(_)) | None => {}
        }
        if let Some(health) = &message.engine {
            self.engine_health(health);
        }
        Ok(())
    }

    /// A loading source for the replica, unless it left the fleet (then its name is not
    /// brought back).
    fn add_loading_source(&self) -> Result<SourceId, FeedError> {
        let s = lock(&self.status);
        if s.removed {
            return Err(FeedError::Ended);
        }
        self.core
            .index
            .add_loading_source(&self.name)
            .map_err(|_| FeedError::Full)
    }
}

/// Sleeps until `deadline`, or forever.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

fn stored(b: &pb::Block) -> KeyChange<'_> {
    KeyChange::Stored {
        key: b.key,
        tokens: b.tokens,
        tier: if b.tier == pb::Tier::T2 as i32 {
            Tier::T2
        } else {
            Tier::T1
        },
        adapter: &b.adapter,
    }
}
/// How far behind a stream's messages arrive. Each is stamped with the sidecar's clock; the
/// smallest difference between its arrival (on the follower's clock) and its stamp seen on the
/// stream is the link at its fastest (plus the clocks' offset, whatever it is), and how much
/// later than that a message arrives is how far behind the follower reads.
#[derive(Debug, Default)]
pub(crate) struct Lag {
    /// The stamp of the stream's first message: a message stamped before it was sealed before
    /// the stream began (a change a resuming follower missed) and says nothing of the link.
    first: Option<u64>,
    fastest: Option<i64>,
}

impl Lag {
    /// How far behind a message stamped `sent_ms` arrived, at `at_ms` on the follower's clock;
    /// `None` for a message not stamped (an older sidecar) or sealed before the stream began.
    pub(crate) fn behind(&mut self, sent_ms: u64, at_ms: u64) -> Option<Duration> {
        if sent_ms == 0 || sent_ms < *self.first.get_or_insert(sent_ms) {
            return None;
        }
        let offset = at_ms as i64 - sent_ms as i64;
        let fastest = self.fastest.map_or(offset, |f| f.min(offset));
        self.fastest = Some(fastest);
        Some(Duration::from_millis((offset - fastest) as u64))
    }
}

#[cfg(test)]
mod tests {
    //! The follower's rules for one stream's messages, without a network: snapshots load
    //! beside the state they replace and count only when whole; a stream cut short or
    //! malformed leaves the previous state counting.

    use super::*;
    use kvevent_index::{Query, QueryKeys, ReplicaState};

    fn follower(index: &Arc<kvevent_index::Index>) -> FeedFollower {
        let core = Arc::new(Core {
            index: index.clone(),
            config: crate::FleetConfig::default(),
            block_size: std::sync::atomic::AtomicU32::new(0),
            changes: tokio::sync::watch::channel(0).0,
        });
        let status = Arc::new(std::sync::Mutex::new(crate::status::Status::new(
            "http://unused:1",
        )));
        FeedFollower::new(core, "a", SidecarFeed::new("http://unused:1"), status)
    }

    fn message(epoch: u64, seq: u64, body: pb::feed_message::Body) -> pb::FeedMessage {
        pb::FeedMessage {
            epoch,
            seq,
            body: Some(body),
            engine: None,
            sent_ms: 0,
        }
    }

    #[test]
    fn lag_is_how_much_later_than_the_fastest_a_message_arrives() {
        let mut lag = Lag::default();
        // The clocks differ by 5,000 ms; the link takes 2 ms at its fastest.
        assert_eq!(lag.behind(1_000, 6_002), Some(Duration::ZERO));
        assert_eq!(lag.behind(1_200, 6_203), Some(Duration::from_millis(1)));
        // Queued on a congested link: 700 ms behind, then caught up.
        assert_eq!(lag.behind(1_400, 7_102), Some(Duration::from_millis(700)));
        assert_eq!(lag.behind(1_600, 6_602), Some(Duration::ZERO));
        // Faster than ever: the new floor.
        assert_eq!(lag.behind(1_800, 6_801), Some(Duration::ZERO));
        assert_eq!(lag.behind(2_000, 7_002), Some(Duration::from_millis(1)));
    }

    #[test]
    fn lag_ignores_unstamped_messages_and_those_sealed_before_the_stream() {
        let mut lag = Lag::default();
        assert_eq!(lag.behind(0, 10), None, "an older sidecar stamps nothing");
        // The hello, then the changes a resuming follower missed, sealed seconds before.
        assert_eq!(lag.behind(9_000, 20), Some(Duration::ZERO));
        assert_eq!(lag.behind(3_000, 21), None);
        assert_eq!(lag.behind(9_200, 221), Some(Duration::from_millis(1)));
    }

    fn blocks(keys: &[u64]) -> pb::feed_message::Body {
        pb::feed_message::Body::Snapshot(pb::Blocks {
            blocks: keys
                .iter()
                .map(|k| pb::Block {
                    key: *k,
                    tokens: 16,
                    tier: pb::Tier::T1 as i32,
                    ..Default::default()
                })
                .collect(),
        })
    }

    fn end(n: u64) -> pb::feed_message::Body {
        pb::feed_message::Body::SnapshotEnd(pb::SnapshotEnd { blocks: n })
    }

    fn holds(index: &kvevent_index::Index, key: u64) -> bool {
        !index
            .score(&Query {
                adapter: "",
                keys: QueryKeys::Keys(&[key]),
            })
            .is_empty()
    }

    /// A follower back from an outage (its feed resumed) is not exact while the changes it
    /// missed are on their way: the state from before the outage counts until they are in.
    /// (A sidecar's hello names where they end; the fifth fault soak caught a router saying
    /// `exact` in between, with blocks its engine had evicted while the feed was blackholed.)
    #[test]
    fn a_resumed_follower_is_not_exact_until_it_caught_up() {
        let index = Arc::new(kvevent_index::Index::new(kvevent_index::Config::default()));
        let mut f = follower(&index);
        let mut loading = None;
        let mut silent = Duration::from_secs(3);
        let state =
            |f: &FeedFollower| lock(&f.status).state(f.core.config.dead_after, Instant::now());
        let hello = |resumed| {
            pb::feed_message::Body::Hello(pb::Hello {
                resumed,
                ..Default::default()
            })
        };
        let removed = |key| {
            pb::feed_message::Body::Changes(pb::Changes {
                changes: vec![pb::Change {
                    kind: Some(pb::change::Kind::Removed(pb::Removed {
                        key,
                        ..Default::default()
                    })),
                }],
            })
        };
        for m in [
            message(1, 0, hello(false)),
            message(1, 5, blocks(&[1, 2])),
            message(1, 5, end(2)),
        ] {
            f.take(m, &mut loading, &mut silent).expect("a message");
        }
        assert_eq!(state(&f), ReplicaState::Exact);
        // Away, then back: the hello names seq 7, two changes on.
        f.stream_ended(&mut loading);
        f.take(message(1, 7, hello(true)), &mut loading, &mut silent)
            .expect("hello");
        assert_eq!(
            state(&f),
            ReplicaState::Degraded(kvevent_index::Degraded::Replaying)
        );
        assert!(holds(&index, 1), "the state from before still counts");
        f.take(message(1, 6, removed(1)), &mut loading, &mut silent)
            .expect("change");
        assert!(!state(&f).is_exact(), "one change of two in");
        f.take(message(1, 7, removed(2)), &mut loading, &mut silent)
            .expect("change");
        assert_eq!(state(&f), ReplicaState::Exact);
        assert!(!holds(&index, 1) && !holds(&index, 2));
        // Back with nothing missed (the hello names our own position): exact at once.
        f.stream_ended(&mut loading);
        f.take(message(1, 7, hello(true)), &mut loading, &mut silent)
            .expect("hello");
        assert_eq!(state(&f), ReplicaState::Exact);
    }

    #[test]
    fn a_new_snapshot_replaces_the_old_state_only_when_whole() {
        let index = Arc::new(kvevent_index::Index::new(kvevent_index::Config::default()));
        let mut f = follower(&index);
        let mut loading = None;
        let mut silent = Duration::from_secs(3);
        let mut take = |f: &mut FeedFollower, m, loading: &mut Option<Loading>| {
            f.take(m, loading, &mut silent)
        };
        take(&mut f, message(1, 5, blocks(&[1, 2])), &mut loading).expect("chunk");
        assert!(!holds(&index, 1), "a snapshot counts only when whole");
        take(&mut f, message(1, 5, end(2)), &mut loading).expect("end");
        assert!(holds(&index, 1) && holds(&index, 2));
        assert_eq!(f.at, Some((1, 5)));
        // A new epoch's snapshot loads beside it; the old state counts meanwhile.
        take(&mut f, message(2, 0, blocks(&[3])), &mut loading).expect("chunk");
        assert!(holds(&index, 1) && !holds(&index, 3));
        // The sidecar dies mid-snapshot: the old state goes on counting.
        f.stream_ended(&mut loading);
        assert!(holds(&index, 1) && !holds(&index, 3));
        assert!(lock(&f.status).source_lost.is_some());
        // The next stream's whole snapshot replaces it at once.
        take(&mut f, message(2, 0, blocks(&[3])), &mut loading).expect("chunk");
        take(&mut f, message(2, 0, end(1)), &mut loading).expect("end");
        assert!(!holds(&index, 1) && holds(&index, 3));
        // Changes go on from its position.
        let removed = pb::Change {
            kind: Some(pb::change::Kind::Removed(pb::Removed {
                key: 3,
                ..Default::default()
            })),
        };
        let changes = pb::feed_message::Body::Changes(pb::Changes {
            changes: vec![removed],
        });
        take(&mut f, message(2, 1, changes), &mut loading).expect("changes");
        assert!(!holds(&index, 3));
        assert_eq!(f.at, Some((2, 1)));
    }

    #[test]
    fn a_malformed_stream_is_an_error_and_the_state_before_it_stays() {
        let index = Arc::new(kvevent_index::Index::new(kvevent_index::Config::default()));
        let mut f = follower(&index);
        let mut loading = None;
        let mut silent = Duration::from_secs(3);
        // Changes before any snapshot.
        let changes = || pb::feed_message::Body::Changes(pb::Changes::default());
        assert!(
            f.take(message(1, 1, changes()), &mut loading, &mut silent)
                .is_err()
        );
        f.take(message(1, 0, blocks(&[7])), &mut loading, &mut silent)
            .expect("chunk");
        f.take(message(1, 0, end(1)), &mut loading, &mut silent)
            .expect("end");
        // Chunks that do not add up.
        f.take(message(2, 0, blocks(&[8])), &mut loading, &mut silent)
            .expect("chunk");
        assert!(
            f.take(message(2, 0, end(5)), &mut loading, &mut silent)
                .is_err()
        );
        f.stream_ended(&mut loading);
        assert!(holds(&index, 7) && !holds(&index, 8));
        // Changes of another epoch than the follower's.
        assert!(
            f.take(message(9, 3, changes()), &mut loading, &mut silent)
                .is_err()
        );
        // A hello naming another replica than asked for.
        f.feed.replica = "a".into();
        let hello = pb::feed_message::Body::Hello(pb::Hello {
            replica: "b".into(),
            ..Default::default()
        });
        let err = f
            .take(message(1, 0, hello), &mut loading, &mut silent)
            .expect_err("another replica");
        assert!(err.to_string().contains("`b`"), "{err}");
        assert!(holds(&index, 7));
    }
}
