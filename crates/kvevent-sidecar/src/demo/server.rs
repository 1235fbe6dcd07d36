//! The demo's InferenceCache server: a real tonic server on loopback that records what it
//! receives and acknowledges everything. (Tests use `kvevent-test-support`'s, which can also
//! refuse, delay or hang.)

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use kvevent_proto as pb;
use kvevent_proto::inference_cache_server::{InferenceCache, InferenceCacheServer};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

/// One thing the server received, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    /// A `CacheStateUpdate` from a `ReportCacheState` stream.
    Update(pb::CacheStateUpdate),
    /// A `PublishEvent` call.
    Event(pb::CacheEvent),
}

#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<Received>>>);

impl Shared {
    fn record(&self, items: impl IntoIterator<Item = Received>) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(items);
    }
}

fn ack() -> Response<pb::Ack> {
    Response::new(pb::Ack {
        accepted: true,
        reason_code: String::new(),
    })
}

#[tonic::async_trait]
impl InferenceCache for Shared {
    async fn report_cache_state(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        let mut stream = request.into_inner();
        let mut updates = Vec::new();
        while let Some(update) = stream.next().await {
            updates.push(update?);
        }
        self.record(updates.into_iter().map(Received::Update));
        Ok(ack())
    }

    async fn publish_event(
        &self,
        request: Request<pb::CacheEvent>,
    ) -> Result<Response<pb::Ack>, Status> {
        self.record([Received::Event(request.into_inner())]);
        Ok(ack())
    }
}

/// The demo's recording server, serving until dropped.
pub struct RecordingServer {
    addr: SocketAddr,
    shared: Shared,
    task: tokio::task::JoinHandle<()>,
}

impl RecordingServer {
    /// Starts on `127.0.0.1:0`.
    pub async fn start() -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Shared::default();
        let service = InferenceCacheServer::new(shared.clone());
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        Ok(Self { addr, shared, task })
    }

    /// The server's address (`127.0.0.1:port`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Everything received so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.shared
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for RecordingServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
