//! The InferenceCache server of the tests and benchmarks: one tonic service over an
//! [`EngineSide`] handler (what is done with the sidecar's two engine-side calls), run either
//! as a [`RecordingServer`] on the caller's runtime (records everything; can refuse, nack,
//! delay, hang, stop and start again on the same port) or by [`serve_on_thread`] on a runtime
//! of its own (a benchmark's sink, counting and keeping nothing).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvevent_proto as pb;
use kvevent_proto::inference_cache_server::{InferenceCache, InferenceCacheServer};
use tokio::sync::{Notify, oneshot};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

/// What the server does with the next engine-side RPCs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Behaviour {
    /// Record and acknowledge.
    Accept,
    /// Answer with this status code, recording nothing.
    Refuse(tonic::Code),
    /// Acknowledge with `accepted: false`, recording nothing.
    Nack,
    /// Wait this long, then record and acknowledge.
    Delay(Duration),
    /// Never answer.
    Hang,
}

/// One thing the server received, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    /// A `CacheStateUpdate` from a `ReportCacheState` stream.
    Update(pb::CacheStateUpdate),
    /// A `PublishEvent` call.
    Event(pb::CacheEvent),
}

#[derive(Default)]
struct State {
    received: Vec<Received>,
    /// `authorization` metadata of every call.
    auth: Vec<Option<String>>,
    behaviour: Option<Behaviour>,
    calls: u64,
    /// Calls being handled now, and the most seen at once.
    running: u64,
    max_running: u64,
}

#[derive(Clone, Default)]
struct Shared {
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies the behaviour; `Ok(true)` means record and acknowledge.
    async fn gate<T>(&self, request: &Request<T>) -> Result<bool, Status> {
        let behaviour = {
            let mut state = self.lock();
            state.calls += 1;
            let auth = request
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            state.auth.push(auth);
            state.behaviour.clone().unwrap_or(Behaviour::Accept)
        };
        self.changed.notify_waiters();
        match behaviour {
            Behaviour::Accept => Ok(true),
            Behaviour::Refuse(code) => Err(Status::new(code, "refused by the test")),
            Behaviour::Nack => Ok(false),
            Behaviour::Delay(d) => {
                {
                    let mut state = self.lock();
                    state.running += 1;
                    state.max_running = state.max_running.max(state.running);
                }
                tokio::time::sleep(d).await;
                self.lock().running -= 1;
                Ok(true)
            }
            Behaviour::Hang => std::future::pending().await,
        }
    }

    fn record(&self, items: impl IntoIterator<Item = Received>) {
        self.lock().received.extend(items);
        self.changed.notify_waiters();
    }
}

fn ack(accepted: bool) -> Response<pb::Ack> {
    Response::new(pb::Ack {
        accepted,
        reason_code: if accepted { "" } else { "nack_by_test" }.into(),
    })
}

/// What a server does with the sidecar's engine-side calls; the others answer `unimplemented`.
#[tonic::async_trait]
pub trait EngineSide: Send + Sync + 'static {
    /// One `ReportCacheState` stream.
    async fn report(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status>;
    /// One `PublishEvent`.
    async fn publish(&self, request: Request<pb::CacheEvent>) -> Result<Response<pb::Ack>, Status>;
}

/// The service: the handler's answers, and messages up to 64 MiB (a sidecar's largest update).
struct Service<H>(Arc<H>);

#[tonic::async_trait]
impl<H: EngineSide> InferenceCache for Service<H> {
    async fn report_cache_state(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        self.0.report(request).await
    }

    async fn publish_event(
        &self,
        request: Request<pb::CacheEvent>,
    ) -> Result<Response<pb::Ack>, Status> {
        self.0.publish(request).await
    }
}

fn service<H: EngineSide>(handler: Arc<H>) -> InferenceCacheServer<Service<H>> {
    InferenceCacheServer::new(Service(handler)).max_decoding_message_size(64 << 20)
}

/// Serves `handler` on a loopback port from a thread named `sink`, on a runtime of its own,
/// until `stop`; the address. For benchmarks, whose sink must not share the measured
/// process's runtime.
pub fn serve_on_thread<H: EngineSide>(
    handler: H,
    stop: Arc<AtomicBool>,
) -> std::io::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let service = service(Arc::new(handler));
    std::thread::Builder::new()
        .name("sink".into())
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                let shutdown = async move {
                    while !stop.load(Relaxed) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                };
                let _ = tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await;
            });
        })?;
    Ok(addr)
}

/// An accepted `Ack`.
pub fn accepted() -> Response<pb::Ack> {
    ack(true)
}

#[tonic::async_trait]
impl EngineSide for Shared {
    async fn report(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        let accept = self.gate(&request).await?;
        let mut stream = request.into_inner();
        let mut updates = Vec::new();
        while let Some(update) = stream.next().await {
            updates.push(update?);
        }
        if accept {
            self.record(updates.into_iter().map(Received::Update));
        }
        Ok(ack(accept))
    }

    async fn publish(&self, request: Request<pb::CacheEvent>) -> Result<Response<pb::Ack>, Status> {
        let accept = self.gate(&request).await?;
        if accept {
            self.record([Received::Event(request.into_inner())]);
        }
        Ok(ack(accept))
    }
}

/// How many distinct prefix keys the received updates carry.
pub fn distinct_prefixes(received: &[Received]) -> usize {
    let mut keys: Vec<&[u8]> = received
        .iter()
        .filter_map(|r| match r {
            Received::Update(u) => Some(u.prefixes.iter().map(|p| p.prefix_hash.as_slice())),
            Received::Event(_) => None,
        })
        .flatten()
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys.len()
}

/// A real tonic InferenceCache server on loopback that records what it receives.
pub struct RecordingServer {
    addr: SocketAddr,
    shared: Shared,
    tls: Option<tonic::transport::ServerTlsConfig>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl RecordingServer {
    /// Starts on `127.0.0.1:0`.
    ///
    /// # Panics
    /// When no loopback port can be bound (a test or demo cannot go on without one).
    pub async fn start() -> Self {
        Self::start_with_tls(None).await
    }

    /// Starts on `127.0.0.1:0` serving TLS (and mTLS when the config names a client CA).
    ///
    /// # Panics
    /// When no loopback port can be bound.
    pub async fn start_with_tls(tls: Option<tonic::transport::ServerTlsConfig>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let mut server = Self {
            addr,
            shared: Shared::default(),
            tls,
            stop: None,
            task: None,
        };
        server.serve(listener);
        server
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let service = service(Arc::new(self.shared.clone()));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        self.stop = Some(stop_tx);
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = self.tls.clone() {
            match builder.tls_config(tls) {
                Ok(b) => builder = b,
                Err(e) => panic!("server tls config: {e}"),
            }
        }
        self.task = Some(tokio::spawn(async move {
            let _ = builder
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stop_rx.await;
                })
                .await;
        }));
    }

    /// The server's address (`127.0.0.1:port`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:port`.
    pub fn uri(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving: connections are refused until [`Self::restart`].
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }

    /// Serves again on the same port, keeping what was recorded.
    ///
    /// # Panics
    /// When the port cannot be bound again within 5 s.
    pub async fn restart(&mut self) {
        self.stop().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match tokio::net::TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e) if tokio::time::Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("rebind {}: {e}", self.addr),
            }
        };
        self.serve(listener);
    }

    /// Sets what the server does with the next engine-side calls.
    pub fn set_behaviour(&self, behaviour: Behaviour) {
        self.shared.lock().behaviour = Some(behaviour);
    }

    /// Everything recorded so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.shared.lock().received.clone()
    }

    /// The most calls the server held at once while delaying them ([`Behaviour::Delay`]).
    pub fn max_concurrent_calls(&self) -> u64 {
        self.shared.lock().max_running
    }

    /// Engine-side calls that reached the server (recorded or not).
    pub fn calls(&self) -> u64 {
        self.shared.lock().calls
    }

    /// The `authorization` header of every call, in order.
    pub fn auth_headers(&self) -> Vec<Option<String>> {
        self.shared.lock().auth.clone()
    }

    /// Every recorded prefix entry, flattened in arrival order.
    pub fn prefixes(&self) -> Vec<pb::PrefixEntry> {
        self.received()
            .into_iter()
            .filter_map(|r| match r {
                Received::Update(u) => Some(u.prefixes),
                Received::Event(_) => None,
            })
            .flatten()
            .collect()
    }

    /// Every recorded event, in arrival order.
    pub fn events(&self) -> Vec<pb::CacheEvent> {
        self.received()
            .into_iter()
            .filter_map(|r| match r {
                Received::Event(e) => Some(e),
                Received::Update(_) => None,
            })
            .collect()
    }

    /// Waits until `done` holds for what was received. `done` runs
    /// under the server's lock: it must not call back into the server.
    ///
    /// # Panics
    /// After `timeout`, with what was received.
    pub async fn wait_for(&self, timeout: Duration, done: impl Fn(&[Received]) -> bool) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.changed.notified();
            if done(&self.shared.lock().received) {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let got = self.received();
                panic!(
                    "condition not met within {timeout:?}; received {} items: {got:?}",
                    got.len()
                );
            }
        }
    }

    /// Waits until at least `n` calls reached the server.
    ///
    /// # Panics
    /// After `timeout`.
    pub async fn wait_for_calls(&self, n: u64, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.changed.notified();
            if self.calls() >= n {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("{} calls within {timeout:?}, wanted {n}", self.calls());
            }
        }
    }
}

impl Drop for RecordingServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
