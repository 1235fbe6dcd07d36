//! The feed's gRPC server, written by hand over tonic's server machinery so that a sealed
//! message of changes (already encoded by the hub) goes to every follower as the same bytes.
//!
//! Each stream is one task: it sends a `Hello`, then a snapshot or the changes after the
//! follower's position, then whatever the hub seals, with heartbeats in between. It only reads
//! the hub (a lock held to copy), so a follower never slows the events thread. A follower
//! whose position leaves the ring while it is slow to read is cut off (counted, logged at a
//! bounded rate); it comes back with its position and gets a snapshot.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes};
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::codegen::{BoxFuture, StdError, http};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use crate::hub::{Hub, Next};
use crate::pb;

/// The path of `Follow`.
pub const FOLLOW: &str = "/kvevent.feed.v1.Feed/Follow";

/// Supplies the bearer token a follower must send, read fresh for each stream (so a rotated
/// secret applies); `None` asks for none.
pub type TokenSource = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// How the server is reached.
#[derive(Clone, Default)]
pub struct ServeOptions {
    /// Serve TLS with this identity.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// Ask every follower for this bearer token (`authorization: Bearer …`).
    pub token: Option<TokenSource>,
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("tls", &self.tls.is_some())
            .field("token", &self.token.is_some())
            .finish()
    }
}

/// The feed could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The TLS identity is not usable.
    #[error("the feed's TLS settings: {0}")]
    Tls(#[source] tonic::transport::Error),
    /// The address could not be bound.
    #[error("cannot listen for the feed on {address}: {source}")]
    Bind {
        /// The address asked for.
        address: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Serves the feed of `hub` on `address` until `shutdown` completes: the bound address and the
/// server's task.
pub async fn serve(
    address: &str,
    hub: Arc<Hub>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), ServeError> {
    let bind = |source| ServeError::Bind {
        address: address.to_owned(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(address).await.map_err(bind)?;
    let bound = listener.local_addr().map_err(bind)?;
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .tcp_nodelay(true);
    if let Some(tls) = options.tls.clone() {
        builder = builder.tls_config(tls).map_err(ServeError::Tls)?;
    }
    // A stream lasts as long as its follower: at shutdown each is ended, or the server's
    // graceful shutdown would wait for them for good.
    let (closing, closed) = tokio::sync::watch::channel(false);
    let service = FeedServer {
        hub,
        token: options.token,
        log: Arc::default(),
        refusals: Arc::default(),
        closed,
    };
    let router = builder.add_service(service);
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let shutdown = async move {
        shutdown.await;
        closing.send_replace(true);
    };
    let task = tokio::spawn(async move {
        if let Err(e) = router
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
        {
            tracing::error!(error = %e, "the feed server stopped");
        }
    });
    Ok((bound, task))
}

/// The `kvevent.feed.v1.Feed` service.
#[derive(Clone)]
struct FeedServer {
    hub: Arc<Hub>,
    token: Option<TokenSource>,
    /// Followers cut off, logged at a bounded rate.
    log: Arc<Mutex<Throttle>>,
    /// Followers refused, logged at a bounded rate.
    refusals: Arc<Mutex<Throttle>>,
    /// True once the server shuts down.
    closed: tokio::sync::watch::Receiver<bool>,
}

impl tonic::server::NamedService for FeedServer {
    const NAME: &'static str = "kvevent.feed.v1.Feed";
}

impl<B> tonic::codegen::Service<http::Request<B>> for FeedServer
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != FOLLOW {
            return Box::pin(async move {
                let mut response = http::Response::new(tonic::body::Body::default());
                let headers = response.headers_mut();
                headers.insert(
                    Status::GRPC_STATUS,
                    (tonic::Code::Unimplemented as i32).into(),
                );
                headers.insert(
                    http::header::CONTENT_TYPE,
                    tonic::metadata::GRPC_CONTENT_TYPE,
                );
                Ok(response)
            });
        }
        let service = self.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(FeedCodec)
                // A follow request is a few names and a position.
                .max_decoding_message_size(64 << 10);
            Ok(grpc.server_streaming(service, req).await)
        })
    }
}

impl tonic::server::ServerStreamingService<pb::FollowRequest> for FeedServer {
    type Response = Bytes;
    type ResponseStream = ReceiverStream<Result<Bytes, Status>>;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<pb::FollowRequest>) -> Self::Future {
        let server = self.clone();
        Box::pin(async move {
            let refuse = |status: Status| {
                server.hub.metrics().refused.fetch_add(1, Relaxed);
                let mut log = lock(&server.refusals);
                if let Some(since) = log.due() {
                    tracing::warn!(refused = since, why = %status.message(), "a router's feed follower refused (kvevent_feed_refused_total counts them)");
                }
                Err(status)
            };
            if let Some(token) = server.token.as_ref().and_then(|t| t()) {
                let sent = request
                    .metadata()
                    .get("authorization")
                    .and_then(|v| v.to_str().ok());
                if sent != Some(format!("Bearer {token}").as_str()) {
                    return refuse(Status::unauthenticated(
                        "the sidecar's feed asks for a bearer token (authorization: Bearer …), and the one sent is missing or wrong",
                    ));
                }
            }
            let ask = request.into_inner();
            let config = server.hub.config();
            if !ask.replica.is_empty() && ask.replica != config.replica {
                return refuse(Status::failed_precondition(format!(
                    "the sidecar serves replica `{}`, not `{}`",
                    config.replica, ask.replica
                )));
            }
            if !ask.model.is_empty() && ask.model != config.model {
                return refuse(Status::failed_precondition(format!(
                    "the sidecar serves model `{}`, not `{}`",
                    config.model, ask.model
                )));
            }
            let (tx, rx) = mpsc::channel(config.follower_queue.max(1));
            let at = ask.resume.map(|p| (p.epoch, p.seq));
            tokio::spawn(follow(
                server.hub.clone(),
                server.log.clone(),
                server.closed.clone(),
                at,
                tx,
            ));
            Ok(Response::new(ReceiverStream::new(rx)))
        })
    }
}

/// Counts a follower while its stream lasts.
struct Connected(Arc<Hub>);

impl Drop for Connected {
    fn drop(&mut self) {
        self.0.metrics().followers.fetch_sub(1, Relaxed);
    }
}

/// The stream ended on our side: the follower is gone, or was cut off.
struct Ended;

/// A message stamped with the hub's clock now.
fn encode(hub: &Hub, epoch: u64, seq: u64, body: pb::feed_message::Body) -> Bytes {
    encode_with(hub, epoch, seq, body, None)
}

/// A message with the engine's health (hello and heartbeats).
fn encode_with(
    hub: &Hub,
    epoch: u64,
    seq: u64,
    body: pb::feed_message::Body,
    engine: Option<pb::EngineHealth>,
) -> Bytes {
    Bytes::from(
        pb::FeedMessage {
            epoch,
            seq,
            body: Some(body),
            engine,
            sent_ms: hub.now_ms(),
        }
        .encode_to_vec(),
    )
}

/// Feeds one follower from position `at` until it goes or is cut off.
async fn follow(
    hub: Arc<Hub>,
    log: Arc<Mutex<Throttle>>,
    mut closed: tokio::sync::watch::Receiver<bool>,
    mut at: Option<(u64, u64)>,
    tx: mpsc::Sender<Result<Bytes, Status>>,
) {
    hub.metrics().followers.fetch_add(1, Relaxed);
    let _connected = Connected(hub.clone());
    let config = hub.config().clone();
    // A follower that takes nothing for ten heartbeats (at least 10 s) is not reading: it is cut
    // off.
    let stuck_after = (config.heartbeat * 10).max(Duration::from_secs(10));
    let send = |item: Result<Bytes, Status>| {
        let tx = tx.clone();
        async move {
            match tokio::time::timeout(stuck_after, tx.send(item)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) | Err(_) => Err(Ended),
            }
        }
    };
    let mut changed = hub.subscribe();
    let mut health = hub.subscribe_health();
    // A change of health seen while changes were waiting: sent after them.
    let mut health_owed = false;
    let mut first = true;
    loop {
        if *closed.borrow_and_update() {
            return;
        }
        changed.borrow_and_update();
        // The health is marked seen where it is sent (with a hello, a snapshot's end, after
        // changes, in a heartbeat), never here: a change of health that came with changes is
        // sent after them.
        let next = match hub.next(at) {
            // A follower coming back from too far behind starts over.
            Next::Behind if first => hub.next(None),
            next => next,
        };
        let step = match next {
            Next::Snapshot(snapshot) => {
                hub.metrics().snapshots.fetch_add(1, Relaxed);
                let (epoch, seq) = (snapshot.epoch, snapshot.seq);
                let hello = first.then(|| hub.hello(false, snapshot.len()));
                async {
                    if let Some(hello) = hello {
                        send(Ok(encode_with(
                            &hub,
                            epoch,
                            seq,
                            pb::feed_message::Body::Hello(hello),
                            hub.engine_health(),
                        )))
                        .await?;
                    }
                    let size = config.snapshot_chunk.max(1);
                    for from in (0..snapshot.len()).step_by(size) {
                        let chunk = snapshot.chunk(from, size);
                        send(Ok(encode(
                            &hub,
                            epoch,
                            seq,
                            pb::feed_message::Body::Snapshot(chunk),
                        )))
                        .await?;
                    }
                    let end = pb::SnapshotEnd {
                        blocks: snapshot.len() as u64,
                    };
                    health.borrow_and_update();
                    // With the engine's health as of now: a follower promotes the snapshot
                    // and learns what the sidecar thinks of the engine in one step.
                    send(Ok(encode_with(
                        &hub,
                        epoch,
                        seq,
                        pb::feed_message::Body::SnapshotEnd(end),
                        hub.engine_health(),
                    )))
                    .await
                }
                .await
                .map(|()| Some((epoch, seq)))
            }
            Next::Changes(messages, position) => {
                if first {
                    hub.metrics().resumes.fetch_add(1, Relaxed);
                }
                let hello = first.then(|| hub.hello(true, 0));
                async {
                    if let Some(hello) = hello {
                        // Stamped with where the changes that follow end: a follower is not
                        // exact again until it is there.
                        let (e, s) = position;
                        send(Ok(encode_with(
                            &hub,
                            e,
                            s,
                            pb::feed_message::Body::Hello(hello),
                            hub.engine_health(),
                        )))
                        .await?;
                    }
                    for m in merged(messages) {
                        send(Ok(m)).await?;
                    }
                    if health_owed || health.has_changed().unwrap_or(false) {
                        health_owed = false;
                        health.borrow_and_update();
                        let (e, s) = position;
                        let beat = pb::feed_message::Body::Heartbeat(pb::Heartbeat {});
                        send(Ok(encode_with(&hub, e, s, beat, hub.engine_health()))).await?;
                    }
                    Ok(())
                }
                .await
                .map(|()| Some(position))
            }
            Next::Nothing(position) => {
                let hello = first.then(|| {
                    hub.metrics().resumes.fetch_add(1, Relaxed);
                    hub.hello(true, 0)
                });
                async {
                    if let Some(hello) = hello {
                        let (e, s) = position;
                        send(Ok(encode_with(
                            &hub,
                            e,
                            s,
                            pb::feed_message::Body::Hello(hello),
                            hub.engine_health(),
                        )))
                        .await?;
                    }
                    tokio::select! {
                        // Changes first: a health that went good after a new epoch must not
                        // reach a follower before that epoch's snapshot.
                        biased;
                        r = changed.changed() => {
                            if r.is_err() {
                                return Err(Ended);
                            }
                            // Let more come: they go together.
                            tokio::select! {
                                () = tokio::time::sleep(config.linger) => {}
                                () = tx.closed() => return Err(Ended),
                                _ = closed.changed() => {}
                            }
                        }
                        () = tokio::time::sleep(config.heartbeat) => {
                            let (e, s) = position;
                            let beat = pb::feed_message::Body::Heartbeat(pb::Heartbeat {});
                            send(Ok(encode_with(&hub, e, s, beat, hub.engine_health()))).await?;
                        }
                        // The engine's health changed: said at once, in a heartbeat, unless
                        // changes came too (the loop sends them first, then the health).
                        r = health.changed() => {
                            if r.is_err() {
                                return Err(Ended);
                            }
                            if changed.has_changed().unwrap_or(false) {
                                health_owed = true;
                                return Ok(());
                            }
                            let (e, s) = position;
                            let beat = pb::feed_message::Body::Heartbeat(pb::Heartbeat {});
                            send(Ok(encode_with(&hub, e, s, beat, hub.engine_health()))).await?;
                        }
                        () = tx.closed() => return Err(Ended),
                        _ = closed.changed() => {}
                    }
                    Ok(())
                }
                .await
                .map(|()| Some(position))
            }
            Next::Behind => {
                cut_off(&hub, &log);
                let _ = tx
                    .send(Err(Status::resource_exhausted(
                        "this follower fell behind the sidecar's ring of changes: follow again with your position to get a snapshot",
                    )))
                    .await;
                return;
            }
        };
        match step {
            Ok(position) => at = position,
            Err(Ended) => {
                if !tx.is_closed() {
                    // It stopped reading with messages queued: not gone, stuck.
                    cut_off(&hub, &log);
                }
                return;
            }
        }
        first = false;
    }
}

/// Most bytes of changes merged into one message.
const MERGE_MAX: usize = 1 << 20;

/// Consecutive sealed messages of changes as fewer messages: protobuf merges concatenated
/// messages (a repeated field's items append, a scalar's last value wins), so the bytes of
/// several `FeedMessage`s of one epoch, back to back, are one `FeedMessage` with all their
/// changes in order and the last one's seq. No message is decoded or encoded again.
pub(crate) fn merged(messages: Vec<Bytes>) -> Vec<Bytes> {
    if messages.len() < 2 {
        return messages;
    }
    let mut out = Vec::new();
    let mut run = bytes::BytesMut::new();
    for m in messages {
        if !run.is_empty() && run.len() + m.len() > MERGE_MAX {
            out.push(run.split().freeze());
        }
        run.extend_from_slice(&m);
    }
    if !run.is_empty() {
        out.push(run.freeze());
    }
    out
}

/// Counts a follower cut off and logs it, at most once every 10 s with the count since.
fn cut_off(hub: &Hub, log: &Mutex<Throttle>) {
    hub.metrics().cut_off.fetch_add(1, Relaxed);
    if let Some(followers) = lock(log).due() {
        tracing::warn!(
            followers,
            "feed followers cut off for not keeping up: they come back with a snapshot"
        );
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A log line at most every 10 s, with how many times it happened since the last.
#[derive(Debug, Default)]
struct Throttle {
    logged: Option<Instant>,
    since: u64,
}

impl Throttle {
    /// Counts one; the count to log when a line is due.
    fn due(&mut self) -> Option<u64> {
        self.since += 1;
        if self
            .logged
            .is_some_and(|t| t.elapsed() < Duration::from_secs(10))
        {
            return None;
        }
        self.logged = Some(Instant::now());
        Some(std::mem::take(&mut self.since))
    }
}

/// Sends [`Bytes`] as they are (messages the hub already encoded) and decodes follow requests
/// with prost.
struct FeedCodec;

struct RawEncoder;

impl Encoder for RawEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Codec for FeedCodec {
    type Encode = Bytes;
    type Decode = pb::FollowRequest;
    type Encoder = RawEncoder;
    type Decoder = <ProstCodec<pb::FollowRequest, pb::FollowRequest> as Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        RawEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<pb::FollowRequest, pb::FollowRequest>::default().decoder()
    }
}
