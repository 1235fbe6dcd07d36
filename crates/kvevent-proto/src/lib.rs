#![doc = include_str!("../README.md")]
#![allow(missing_docs, unreachable_pub, reason = "generated code")]
#![allow(clippy::doc_lazy_continuation, reason = "generated code")]

include!(concat!(env!("OUT_DIR"), "/inferencecache.v1alpha1.rs"));

/// One thing the engine side reports to the server.
#[derive(Clone, PartialEq, Debug)]
pub enum Report {
    /// Prefixes added or refreshed (or, with no prefixes, stats only).
    Update(CacheStateUpdate),
    /// Prefixes the server does not hold: the first report of each since the engine stored
    /// it (since its last eviction or clear). Delivered like [`Report::Update`]; the forwarder
    /// may drop one together with an eviction of the same prefix that finds it still unsent.
    New(CacheStateUpdate),
    /// A removal (`PREFIX_EVICTED`) or a clear (`ALL_CLEARED`).
    Event(CacheEvent),
}

impl Report {
    /// The update of an [`Report::Update`] or [`Report::New`].
    pub fn as_update(&self) -> Option<&CacheStateUpdate> {
        match self {
            Self::Update(u) | Self::New(u) => Some(u),
            Self::Event(_) => None,
        }
    }

    /// A clear or any event other than an eviction: it orders everything around it, and is
    /// never dropped for being over a bound.
    pub fn is_barrier(&self) -> bool {
        matches!(self, Self::Event(e) if e.r#type != cache_event::Type::PrefixEvicted as i32)
    }

    /// (prefix entries, events) the report carries, as drops are counted.
    pub fn entries(&self) -> (u64, u64) {
        match self {
            Self::Update(u) | Self::New(u) => (u.prefixes.len() as u64, 0),
            Self::Event(_) => (0, 1),
        }
    }

    /// The event of an [`Report::Event`].
    pub fn as_event(&self) -> Option<&CacheEvent> {
        match self {
            Self::Event(e) => Some(e),
            _ => None,
        }
    }
}

impl CacheTier {
    /// The tier's short name for logs and metrics (`t1`, `t2`, ...).
    pub fn short_name(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::T1 => "t1",
            Self::T2 => "t2",
            Self::T3 => "t3",
        }
    }
}
