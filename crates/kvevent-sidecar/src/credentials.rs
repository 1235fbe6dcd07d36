//! TLS settings and the bearer token file.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::SystemTime;

use kvevent_forwarder as fwd;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

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
#[error("cannot read {}", path.display())]
pub struct TlsFileError {
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

pub(crate) fn read(path: &std::path::Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|source| TlsFileError {
        path: path.to_owned(),
        source,
    })
}

/// The TLS files and name the settings give for the server connection
/// ([`crate::Settings::tls_files`]): what this module reads, and all it knows of the settings.
#[derive(Debug, Clone, Copy)]
pub struct TlsFiles<'a> {
    /// TLS is asked for (an `https://` server, or any of the below).
    pub enabled: bool,
    /// The CA bundle; none: the system's roots.
    pub ca: Option<&'a std::path::Path>,
    /// The client certificate and its key, for mutual TLS.
    pub cert: Option<&'a std::path::Path>,
    /// The client key.
    pub key: Option<&'a std::path::Path>,
    /// The name the server's certificate must carry (empty: the address's host).
    pub server_name: &'a str,
}

/// What is wrong with the TLS files the settings name, found at start rather than at the first
/// call: a CA file without a PEM certificate, a certificate file without one, a key file
/// without a private key, or a key that does not belong to its certificate. Files that cannot
/// be read are left to the existence check. One `(option, message)` per problem.
pub fn check_tls_files(files: TlsFiles<'_>) -> Vec<(&'static str, String)> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let mut problems = Vec::new();
    let certs = |path: &std::path::Path| -> Option<Vec<CertificateDer<'static>>> {
        let bytes = std::fs::read(path).ok()?;
        Some(
            CertificateDer::pem_slice_iter(&bytes)
                .filter_map(Result::ok)
                .collect(),
        )
    };
    if let Some(ca_file) = files.ca
        && let Some(ca) = certs(ca_file)
        && ca.is_empty()
    {
        problems.push((
            "tls_ca_file",
            format!("{} holds no PEM certificate", ca_file.display()),
        ));
    }
    let (Some(cert_file), Some(key_file)) = (files.cert, files.key) else {
        return problems;
    };
    let chain = certs(cert_file);
    if chain.as_ref().is_some_and(Vec::is_empty) {
        problems.push((
            "tls_cert_file",
            format!("{} holds no PEM certificate", cert_file.display()),
        ));
    }
    let Ok(key_bytes) = std::fs::read(key_file) else {
        return problems;
    };
    let key = match PrivateKeyDer::from_pem_slice(&key_bytes) {
        Ok(key) => key,
        Err(e) => {
            problems.push((
                "tls_key_file",
                format!(
                    "{} holds no usable PEM private key ({e})",
                    key_file.display()
                ),
            ));
            return problems;
        }
    };
    let signing = match rustls::crypto::ring::sign::any_supported_type(&key) {
        Ok(k) => k,
        Err(e) => {
            problems.push((
                "tls_key_file",
                format!("{}: unsupported private key ({e})", key_file.display()),
            ));
            return problems;
        }
    };
    if let Some(chain) = chain.filter(|c| !c.is_empty())
        && let Err(e) = rustls::sign::CertifiedKey::new(chain, signing).keys_match()
    {
        problems.push((
            "tls_key_file",
            format!(
                "{} does not belong to the certificate in {} ({e})",
                key_file.display(),
                cert_file.display()
            ),
        ));
    }
    problems
}

/// The client TLS config the settings ask for, if any.
pub fn tls_config(files: TlsFiles<'_>) -> Result<Option<ClientTlsConfig>, TlsFileError> {
    if !files.enabled {
        return Ok(None);
    }
    let mut tls = ClientTlsConfig::new();
    match files.ca {
        None => tls = tls.with_native_roots(),
        Some(ca_file) => tls = tls.ca_certificate(Certificate::from_pem(read(ca_file)?)),
    }
    if let (Some(cert_file), Some(key_file)) = (files.cert, files.key) {
        tls = tls.identity(Identity::from_pem(read(cert_file)?, read(key_file)?));
    }
    if !files.server_name.is_empty() {
        tls = tls.domain_name(files.server_name.to_owned());
    }
    Ok(Some(tls))
}
