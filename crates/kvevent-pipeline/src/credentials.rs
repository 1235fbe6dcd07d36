//! TLS settings and the bearer token file.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::SystemTime;

use kvevent_forwarder as fwd;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use crate::settings::Settings;

/// Reads a bearer token from a file, again whenever the file changes (mounted secrets rotate).
/// The file is looked at most once a second, not per call. The token is never logged.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    cached: Mutex<Option<(Option<SystemTime>, u64, String)>>,
    checked: Mutex<Option<std::time::Instant>>,
}

/// How long a token read from the file is used before the file is looked at again.
const TOKEN_RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

impl TokenFile {
    /// A token source reading `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            cached: Mutex::new(None),
            checked: Mutex::new(None),
        }
    }
}

impl fwd::Credentials for TokenFile {
    fn bearer_token(&self) -> Option<String> {
        {
            let mut checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
            let now = std::time::Instant::now();
            if checked.is_some_and(|at| now.duration_since(at) < TOKEN_RECHECK) {
                let cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((_, _, token)) = cached.as_ref() {
                    return Some(token.clone());
                }
            }
            *checked = Some(now);
        }
        let meta = std::fs::metadata(&self.path).ok();
        let stamp = (
            meta.as_ref().and_then(|m| m.modified().ok()),
            meta.as_ref().map_or(0, |m| m.len()),
        );
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((modified, len, token)) = cached.as_ref()
            && (*modified, *len) == stamp
        {
            return Some(token.clone());
        }
        match std::fs::read_to_string(&self.path) {
            Ok(text) => {
                let token = text.trim().to_owned();
                tracing::info!(path = %self.path.display(), "bearer token (re)loaded");
                *cached = Some((stamp.0, stamp.1, token.clone()));
                Some(token)
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot read the token file; keeping the last token");
                cached.as_ref().map(|(_, _, t)| t.clone())
            }
        }
    }
}

/// What went wrong reading TLS material.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {path}")]
pub struct TlsFileError {
    path: String,
    #[source]
    source: std::io::Error,
}

fn read(path: &str) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|source| TlsFileError {
        path: path.to_owned(),
        source,
    })
}

/// The client TLS config the settings ask for, if any.
pub fn tls_config(settings: &Settings) -> Result<Option<ClientTlsConfig>, TlsFileError> {
    if !settings.uses_tls() {
        return Ok(None);
    }
    let mut tls = ClientTlsConfig::new();
    if settings.tls_ca_file.is_empty() {
        tls = tls.with_native_roots();
    } else {
        tls = tls.ca_certificate(Certificate::from_pem(read(&settings.tls_ca_file)?));
    }
    if !settings.tls_cert_file.is_empty() {
        tls = tls.identity(Identity::from_pem(
            read(&settings.tls_cert_file)?,
            read(&settings.tls_key_file)?,
        ));
    }
    if !settings.tls_server_name.is_empty() {
        tls = tls.domain_name(settings.tls_server_name.clone());
    }
    Ok(Some(tls))
}
