//! A deadline-bounded InferenceCache client for the engine-side RPCs.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use kvevent_proto::inference_cache_client::InferenceCacheClient;
use tonic::codec::{BufferSettings, Codec};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, GrpcMethod, Request, Status};
use tonic_prost::ProstCodec;

use crate::{Error, pb};

/// Supplies a bearer token per call (read fresh each time, so rotated secrets apply).
pub trait Credentials: Send + Sync + 'static {
    /// The token to send as `authorization: Bearer …`, if any.
    fn bearer_token(&self) -> Option<String>;
}

/// How to reach the server.
#[derive(Clone)]
pub struct ClientConfig {
    /// `host:port` (plain HTTP/2), or an `http://` / `https://` URI.
    pub address: String,
    /// Deadline of every RPC. Default 5 s.
    pub rpc_timeout: Duration,
    /// Deadline of a connection attempt. Default 5 s.
    pub connect_timeout: Duration,
    /// TLS settings; required for `https://`.
    pub tls: Option<ClientTlsConfig>,
    /// Bearer token source, if the server wants one.
    pub credentials: Option<Arc<dyn Credentials>>,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("address", &self.address)
            .field("rpc_timeout", &self.rpc_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("tls", &self.tls.is_some())
            .field("credentials", &self.credentials.is_some())
            .finish()
    }
}

impl ClientConfig {
    /// Defaults for `address`.
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            rpc_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            tls: None,
            credentials: None,
        }
    }

    /// The address as a URI: `host:port` becomes `http://host:port`.
    pub fn uri(&self) -> String {
        let a = self.address.trim();
        if a.starts_with("http://") || a.starts_with("https://") {
            a.to_owned()
        } else {
            format!("http://{a}")
        }
    }
}

/// The engine-side InferenceCache RPCs, each bounded by the configured deadline. Cheap to clone;
/// clones share one HTTP/2 connection, which reconnects by itself after failures.
#[derive(Clone)]
pub struct Client {
    inner: InferenceCacheClient<Channel>,
    /// The same channel, for `PublishEvent` with [`SmallCodec`].
    grpc: tonic::client::Grpc<Channel>,
    address: Arc<str>,
    /// The last token and its header value: parsed once, not per call.
    header: Arc<std::sync::Mutex<Option<(String, AsciiMetadataValue)>>>,
    rpc_timeout: Duration,
    /// `grpc-timeout` for `rpc_timeout`, formatted once (`Request::set_timeout` formats and
    /// parses it on every call).
    timeout_header: AsciiMetadataValue,
    credentials: Option<Arc<dyn Credentials>>,
}

/// Makes a client. Connects lazily: no IO happens here, so a server that is down at start is
/// not an error.
pub fn connect(config: &ClientConfig) -> Result<Client, Error> {
    let uri = config.uri();
    let invalid = |source| Error::InvalidAddress {
        address: config.address.clone(),
        source,
    };
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(invalid)?
        // The RPC deadline is enforced per call (`Client::bounded`) so that it always surfaces
        // as DEADLINE_EXCEEDED; the server learns it from the grpc-timeout header.
        .connect_timeout(config.connect_timeout)
        .tcp_nodelay(true)
        .tcp_keepalive(Some(Duration::from_secs(30)))
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10));
    if let Some(tls) = &config.tls {
        endpoint = endpoint.tls_config(tls.clone()).map_err(Error::Tls)?;
    }
    let channel = endpoint.connect_lazy();
    Ok(Client {
        inner: InferenceCacheClient::new(channel.clone()),
        grpc: tonic::client::Grpc::new(channel),
        address: Arc::from(config.address.as_str()),
        header: Arc::default(),
        rpc_timeout: config.rpc_timeout,
        timeout_header: grpc_timeout(config.rpc_timeout),
        credentials: config.credentials.clone(),
    })
}

impl Client {
    /// A client over an existing channel (in-memory transports in tests, custom connectors).
    pub fn from_channel(channel: Channel, rpc_timeout: Duration) -> Self {
        Self {
            inner: InferenceCacheClient::new(channel.clone()),
            grpc: tonic::client::Grpc::new(channel),
            address: Arc::from("(custom channel)"),
            header: Arc::default(),
            rpc_timeout,
            timeout_header: grpc_timeout(rpc_timeout),
            credentials: None,
        }
    }

    /// The server address, for log lines.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Whether the server can be reached now: a gRPC health check (`grpc.health.v1.Health/Check`,
    /// no side effects) within `within`, which makes the connection (TCP, TLS, HTTP/2) if it is
    /// not up. Any answer the server gives, even "unimplemented", means it was reached. `Err`
    /// says why it was not.
    pub async fn probe(&self, within: Duration) -> Result<(), String> {
        // An empty `Ack` encodes as an empty message: a `HealthCheckRequest` for the whole
        // server. The answer is not read.
        let mut request = self
            .request(pb::Ack::default())
            .map_err(|s| s.message().to_owned())?;
        request
            .extensions_mut()
            .insert(GrpcMethod::new("grpc.health.v1.Health", "Check"));
        let mut grpc = self.grpc.clone();
        let call = async move {
            grpc.ready()
                .await
                .map_err(|e| Status::unavailable(innermost(&e)))?;
            let path = PathAndQuery::from_static(HEALTH_CHECK);
            grpc.unary::<_, pb::Ack, _>(request, path, SmallCodec::default())
                .await
        };
        match tokio::time::timeout(within, call).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(status)) => match status.code() {
                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal => {
                    Err(match std::error::Error::source(&status) {
                        Some(source) => innermost(source),
                        None => status.message().to_owned(),
                    })
                }
                // The server answered (unimplemented, not found, unauthenticated...).
                _ => Ok(()),
            },
            Err(_) => Err(format!("no answer within {within:?}")),
        }
    }

    fn request<T>(&self, message: T) -> Result<Request<T>, Status> {
        let mut request = Request::new(message);
        request
            .metadata_mut()
            .insert("grpc-timeout", self.timeout_header.clone());
        if let Some(token) = self.credentials.as_ref().and_then(|c| c.bearer_token()) {
            let mut cached = self.header.lock().unwrap_or_else(|e| e.into_inner());
            let value = match cached.as_ref() {
                Some((t, value)) if *t == token => value.clone(),
                _ => {
                    let value: AsciiMetadataValue =
                        format!("Bearer {token}").parse().map_err(|_| {
                            Status::unauthenticated("bearer token is not a valid header value")
                        })?;
                    *cached = Some((token, value.clone()));
                    value
                }
            };
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }

    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Result<T, Status> {
        match tokio::time::timeout(self.rpc_timeout, call).await {
            Ok(result) => result.map(tonic::Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded("rpc deadline passed")),
        }
    }

    /// One `ReportCacheState` call streaming `updates`, then half-closing for the `Ack`.
    pub async fn report(&self, updates: Vec<pb::CacheStateUpdate>) -> Result<pb::Ack, Status> {
        let request = self.request(tokio_stream::iter(updates))?;
        let mut inner = self.inner.clone();
        self.bounded(inner.report_cache_state(request)).await
    }

    /// One `PublishEvent` call.
    pub async fn publish(&self, event: pb::CacheEvent) -> Result<pb::Ack, Status> {
        let mut request = self.request(event)?;
        request
            .extensions_mut()
            .insert(GrpcMethod::new(SERVICE, "PublishEvent"));
        let mut grpc = self.grpc.clone();
        self.bounded(async move {
            grpc.ready()
                .await
                .map_err(|e| Status::unknown(format!("Service was not ready: {e}")))?;
            let path = PathAndQuery::from_static(PUBLISH_EVENT);
            grpc.unary(request, path, SmallCodec::default()).await
        })
        .await
    }
}

const SERVICE: &str = "inferencecache.v1alpha1.InferenceCache";
const PUBLISH_EVENT: &str = "/inferencecache.v1alpha1.InferenceCache/PublishEvent";
const HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";

/// An error's innermost cause, which says it best ("Connection refused").
fn innermost(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// The prost codec with buffers sized for one small message. tonic's default codec allocates
/// 8 KiB to encode each call and 8 KiB to decode its answer, for a ~100-byte `CacheEvent` and
/// an `Ack` of a few bytes: at 10,000 evictions a second that is 160 MB/s through malloc, and
/// with 256 calls in flight 4 MiB of buffers that push the rest out of the cache. A message
/// that does not fit grows the buffer (`BytesMut` reserves), so the size only sets the start.
struct SmallCodec<T, U>(PhantomData<fn(T) -> U>);

/// Starting size of [`SmallCodec`]'s buffers: a `CacheEvent` with a long model id fits.
const SMALL_BUFFER: usize = 512;

impl<T, U> Default for SmallCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SmallCodec<T, U>
where
    T: tonic_prost::prost::Message + Send + 'static,
    U: tonic_prost::prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
    type Decoder = <ProstCodec<T, U> as Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(SMALL_BUFFER, SMALL_BUFFER))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::new(SMALL_BUFFER, SMALL_BUFFER))
    }
}

/// The `grpc-timeout` header value for `deadline`, as `Request::set_timeout` writes it: the
/// most precise unit that keeps it to eight digits.
fn grpc_timeout(deadline: Duration) -> AsciiMetadataValue {
    let units: [(char, u128); 6] = [
        ('n', deadline.as_nanos()),
        ('u', deadline.as_micros()),
        ('m', deadline.as_millis()),
        ('S', u128::from(deadline.as_secs())),
        ('M', u128::from(deadline.as_secs() / 60)),
        ('H', u128::from(deadline.as_secs() / 3600)),
    ];
    let (unit, value) = units
        .into_iter()
        .find(|(_, v)| *v <= 99_999_999)
        .unwrap_or(('H', 99_999_999));
    AsciiMetadataValue::try_from(format!("{value}{unit}"))
        .unwrap_or_else(|_| AsciiMetadataValue::from_static("5S"))
}

/// What to do after a failed RPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// A passing condition (server down, overloaded, deadline): keep the work, retry later.
    Retry,
    /// The request itself is wrong: retrying cannot help; drop it and count.
    GiveUp,
}

/// The one place gRPC status codes are classified.
pub fn classify(status: &Status) -> Retry {
    match status.code() {
        // Transient: the server or the path to it.
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::ResourceExhausted
        | Code::Aborted
        | Code::Cancelled
        | Code::Unknown
        | Code::Internal
        // A rotated token may fix these: keep the work.
        | Code::Unauthenticated
        | Code::PermissionDenied => Retry::Retry,
        Code::Ok
        | Code::InvalidArgument
        | Code::NotFound
        | Code::AlreadyExists
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::Unimplemented
        | Code::DataLoss => Retry::GiveUp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeout_header_is_what_tonic_writes() {
        for ms in [1, 250, 5_000, 99_999, 100_000, 3_600_000, 400_000_000_000] {
            let deadline = Duration::from_millis(ms);
            let mut request = Request::new(());
            request.set_timeout(deadline);
            let tonic = request.metadata().get("grpc-timeout").cloned();
            assert_eq!(tonic, Some(grpc_timeout(deadline)), "{deadline:?}");
        }
    }
}
