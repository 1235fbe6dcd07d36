//! One bounded HTTP GET of the engine's `/metrics`.

use std::io::Read;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Why a fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The URL is not an engine's ([`crate::url`]'s rule).
    #[error(transparent)]
    InvalidUrl(#[from] crate::url::UrlError),
    /// No full answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection or the exchange failed.
    #[error("request failed")]
    Request(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The server answered with a non-success status.
    #[error("http status {0}")]
    Status(u16),
    /// The body (after decompression) is larger than allowed.
    #[error("body larger than {0} bytes")]
    TooLarge(usize),
    /// A gzip body that does not decompress.
    #[error("bad gzip body")]
    Gzip(#[source] std::io::Error),
    /// The body is not UTF-8 text.
    #[error("body is not UTF-8")]
    NotUtf8,
}

impl FetchError {
    /// A short label for metrics (`timeout`, `status`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidUrl(_) => "invalid_url",
            Self::Timeout(_) => "timeout",
            Self::Request(_) => "request",
            Self::Status(_) => "status",
            Self::TooLarge(_) => "too_large",
            Self::Gzip(_) => "gzip",
            Self::NotUtf8 => "not_utf8",
        }
    }
}

/// Fetches one URL, bounded in time and size, asking for the classic text format.
#[derive(Debug, Clone)]
pub struct Fetcher {
    client: Client<HttpConnector, Empty<Bytes>>,
    uri: http::Uri,
    timeout: Duration,
    max_body: usize,
}

impl Fetcher {
    /// The URL it fetches.
    pub fn uri(&self) -> &http::Uri {
        &self.uri
    }

    /// A fetcher for `url` (plain `http://`, [`crate::url::engine_url`]).
    pub fn new(url: &str, timeout: Duration, max_body: usize) -> Result<Self, FetchError> {
        let url = crate::url::engine_url(url)?;
        let uri: http::Uri = url
            .parse()
            .map_err(|_| FetchError::InvalidUrl(crate::url::UrlError::NoHost(url.to_owned())))?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            client,
            uri,
            timeout,
            max_body,
        })
    }

    /// The exposition text, or why not.
    pub async fn fetch(&self) -> Result<String, FetchError> {
        match tokio::time::timeout(self.timeout, self.exchange()).await {
            Ok(result) => result,
            Err(_) => Err(FetchError::Timeout(self.timeout)),
        }
    }

    async fn exchange(&self) -> Result<String, FetchError> {
        let request = http::Request::get(self.uri.clone())
            .header(
                http::header::ACCEPT,
                "text/plain;version=0.0.4;q=1,*/*;q=0.1",
            )
            .header(http::header::ACCEPT_ENCODING, "gzip, identity;q=0.5")
            .header(
                http::header::USER_AGENT,
                concat!("kvevent/", env!("CARGO_PKG_VERSION")),
            )
            .body(Empty::<Bytes>::new())
            .map_err(|e| FetchError::Request(e.into()))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| FetchError::Request(e.into()))?;
        if !response.status().is_success() {
            return Err(FetchError::Status(response.status().as_u16()));
        }
        let gzip = response
            .headers()
            .get(http::header::CONTENT_ENCODING)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"gzip"));
        let body = Limited::new(response.into_body(), self.max_body)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    FetchError::TooLarge(self.max_body)
                } else {
                    FetchError::Request(e)
                }
            })?
            .to_bytes();
        let bytes = if gzip {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(&body[..])
                .take(self.max_body as u64 + 1)
                .read_to_end(&mut out)
                .map_err(FetchError::Gzip)?;
            if out.len() > self.max_body {
                return Err(FetchError::TooLarge(self.max_body));
            }
            out
        } else {
            body.to_vec()
        };
        String::from_utf8(bytes).map_err(|_| FetchError::NotUtf8)
    }
}
