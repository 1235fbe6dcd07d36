//! The one rule for an engine's HTTP URLs, wherever one is given (an engine's `http=`, the
//! sidecar's `--engine-metrics-url`, `kvevents doctor --engine-url`, a router's upstream):
//! plain `http://`, because the workspace's client speaks HTTP/1 without TLS to engines on the
//! pod network, so an `https://` URL is refused where it is given, not when it is first read.

/// Why a URL is not one of an engine's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// `https://`.
    #[error(
        "`{0}`: an engine's server is read over plain http:// (https is not supported: engines serve on the pod network)"
    )]
    Https(String),
    /// Another scheme, or none.
    #[error("`{0}` is not an http:// URL (http://{1}?)")]
    NotHttp(String, String),
    /// No host after the scheme.
    #[error("`{0}`: no host after http://")]
    NoHost(String),
    /// A path where the server's base URL was asked for.
    #[error("`{0}`: an engine's server is http://HOST:PORT, without a path")]
    Path(String),
}

/// `url` checked as an engine's URL: `http://HOST[:PORT][/PATH]`; returned as given.
///
/// ```
/// assert!(kvevent_scrape::url::engine_url("http://10.0.0.7:8000/metrics").is_ok());
/// assert!(kvevent_scrape::url::engine_url("https://10.0.0.7:8000/metrics").is_err());
/// ```
pub fn engine_url(url: &str) -> Result<&str, UrlError> {
    split(url).map(|_| url)
}

/// `url` checked as an engine's server: `http://HOST[:PORT]`, a trailing `/` allowed, no path;
/// returned without the trailing `/`.
///
/// ```
/// use kvevent_scrape::url::{UrlError, server_url};
/// assert_eq!(server_url("http://10.0.0.7:8000/"), Ok("http://10.0.0.7:8000"));
/// assert!(matches!(server_url("http://10.0.0.7:8000/v1"), Err(UrlError::Path(_))));
/// assert!(matches!(server_url("tcp://10.0.0.7:8000"), Err(UrlError::NotHttp(..))));
/// ```
pub fn server_url(url: &str) -> Result<&str, UrlError> {
    match split(url)? {
        (_, "" | "/") => Ok(url.strip_suffix('/').unwrap_or(url)),
        _ => Err(UrlError::Path(url.to_owned())),
    }
}

/// The authority and the path (with its `/`) of an `http://` URL.
fn split(url: &str) -> Result<(&str, &str), UrlError> {
    if url.starts_with("https://") {
        return Err(UrlError::Https(url.to_owned()));
    }
    let Some(rest) = url.strip_prefix("http://") else {
        let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
        return Err(UrlError::NotHttp(url.to_owned(), rest.to_owned()));
    };
    let (authority, path) = rest.find('/').map_or((rest, ""), |i| rest.split_at(i));
    if authority.is_empty() || authority.starts_with(':') {
        return Err(UrlError::NoHost(url.to_owned()));
    }
    Ok((authority, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn https_and_other_schemes_are_refused_with_what_was_likely_meant() {
        assert!(matches!(
            engine_url("https://e:8000/metrics"),
            Err(UrlError::Https(_))
        ));
        let e = server_url("e:8000").expect_err("no scheme");
        assert_eq!(
            e.to_string(),
            "`e:8000` is not an http:// URL (http://e:8000?)"
        );
        assert!(matches!(
            server_url("http://:8000"),
            Err(UrlError::NoHost(_))
        ));
        assert!(matches!(server_url("http://"), Err(UrlError::NoHost(_))));
        assert_eq!(server_url("http://e"), Ok("http://e"));
        assert_eq!(engine_url("http://e:1/metrics"), Ok("http://e:1/metrics"));
    }
}
