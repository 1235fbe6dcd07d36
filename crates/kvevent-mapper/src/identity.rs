//! Who is reporting: stamped on every message.

use std::collections::HashMap;
use std::sync::Arc;

use kvevent_proto as pb;

use crate::Error;

/// The replica's identity, validated: replica, model and hash scheme are non-empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    replica_id: String,
    model_id: String,
    tenant_id: String,
    hash_scheme: String,
}

impl Identity {
    /// Validates and builds an identity; `tenant_id` may be empty.
    ///
    /// ```
    /// let id = kvevent_mapper::Identity::new("r1", "llama", "", "vllm")?;
    /// assert_eq!(id.replica_id(), "r1");
    /// assert!(kvevent_mapper::Identity::new("r1", "llama", "", " ").is_err());
    /// # Ok::<(), kvevent_mapper::Error>(())
    /// ```
    pub fn new(
        replica_id: impl Into<String>,
        model_id: impl Into<String>,
        tenant_id: impl Into<String>,
        hash_scheme: impl Into<String>,
    ) -> Result<Self, Error> {
        let id = Self {
            replica_id: replica_id.into(),
            model_id: model_id.into(),
            tenant_id: tenant_id.into(),
            hash_scheme: hash_scheme.into(),
        };
        for (name, value) in [
            ("replica id", &id.replica_id),
            ("model id", &id.model_id),
            ("hash scheme", &id.hash_scheme),
        ] {
            if value.trim().is_empty() {
                return Err(Error::MissingIdentity(name));
            }
        }
        Ok(id)
    }

    /// The replica id.
    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }

    /// The model id.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The tenant id ("" when none).
    pub fn tenant_id(&self) -> &str {
        &self.tenant_id
    }

    /// The hash scheme (the server's comparison domain).
    pub fn hash_scheme(&self) -> &str {
        &self.hash_scheme
    }

    /// An update stamped with this identity and nothing else.
    pub fn update(&self, timestamp_us: i64) -> pb::CacheStateUpdate {
        pb::CacheStateUpdate {
            replica_id: self.replica_id.clone(),
            model_id: self.model_id.clone(),
            tenant_id: self.tenant_id.clone(),
            hash_scheme: self.hash_scheme.clone(),
            timestamp_us,
            ..Default::default()
        }
    }

    /// An event of `kind` stamped with this identity.
    pub fn event(
        &self,
        kind: pb::cache_event::Type,
        prefix_hash: Vec<u8>,
        adapter_id: &str,
        timestamp_us: i64,
    ) -> pb::CacheEvent {
        pb::CacheEvent {
            r#type: kind as i32,
            replica_id: self.replica_id.clone(),
            model_id: self.model_id.clone(),
            tenant_id: self.tenant_id.clone(),
            prefix_hash,
            timestamp_us,
            adapter_id: adapter_id.to_owned(),
        }
    }
}

/// Parses the Go sidecar's `--lora-adapter-names` form: `1=sql-lora,2=chat-lora`.
///
/// ```
/// let m = kvevent_mapper::parse_lora_adapters("1=sql, 2=chat")?;
/// assert_eq!(m.get(&2).map(|s| &**s), Some("chat"));
/// assert!(kvevent_mapper::parse_lora_adapters("x=1").is_err());
/// # Ok::<(), kvevent_mapper::Error>(())
/// ```
pub fn parse_lora_adapters(spec: &str) -> Result<HashMap<i64, Arc<str>>, Error> {
    let mut out = HashMap::new();
    for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = || Error::BadLoraEntry(entry.to_owned());
        let (id, name) = entry.split_once('=').ok_or_else(bad)?;
        let id: i64 = id.trim().parse().map_err(|_| bad())?;
        let name = name.trim();
        if name.is_empty() {
            return Err(bad());
        }
        if out.insert(id, Arc::from(name)).is_some() {
            return Err(Error::DuplicateLoraId(id));
        }
    }
    Ok(out)
}
