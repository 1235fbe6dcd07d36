//! The demo's InferenceCache server: a real tonic server on loopback that records what it
//! receives and acknowledges everything. (Tests use `kvevent-test-support`'s, which can also
//! refuse, delay or hang.)

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use kvevent_proto as pb;
use kvevent_proto::inference_cache_server::{InferenceCache, InferenceCacheServer};
use tokio_stream::{Stream, StreamExt};
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

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl InferenceCache for Shared {
    async fn render_template(
        &self,
        _: Request<pb::RenderTemplateRequest>,
    ) -> Result<Response<pb::RenderTemplateResponse>, Status> {
        Err(Status::unimplemented("gateway side"))
    }

    async fn lookup_route(
        &self,
        _: Request<pb::LookupRouteRequest>,
    ) -> Result<Response<pb::LookupRouteResponse>, Status> {
        Err(Status::unimplemented("gateway side"))
    }

    async fn lookup_pd_route(
        &self,
        _: Request<pb::LookupPdRouteRequest>,
    ) -> Result<Response<pb::LookupPdRouteResponse>, Status> {
        Err(Status::unimplemented("gateway side"))
    }

    async fn get_cache_state(
        &self,
        _: Request<pb::GetCacheStateRequest>,
    ) -> Result<Response<pb::GetCacheStateResponse>, Status> {
        Err(Status::unimplemented("gateway side"))
    }

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

    type StreamCacheEventsStream = BoxStream<pb::CacheEvent>;

    async fn stream_cache_events(
        &self,
        _: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        Err(Status::unimplemented("observer side"))
    }

    type StreamMetricsStream = BoxStream<pb::Metric>;

    async fn stream_metrics(
        &self,
        _: Request<pb::StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        Err(Status::unimplemented("observer side"))
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
