//! vLLM and SGLang releases and what their wire formats look like.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, ErrorKind};

/// Which engine's wire a payload is: vLLM's, or SGLang's (same framing, its own layouts:
/// `../spec/sglang-kv-events.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Engine {
    /// vLLM.
    #[default]
    Vllm,
    /// SGLang.
    Sglang,
}

impl Engine {
    /// `vllm` or `sglang`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
        }
    }
}

impl FromStr for Engine {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "vllm" => Ok(Self::Vllm),
            "sglang" => Ok(Self::Sglang),
            _ => Err(Error::new(ErrorKind::BadEngine, 0)),
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An SGLang release number. `.postN` suffixes parse and do not change the wire (the layouts
/// change at 0.4.7, 0.5.9, 0.5.18, 0.5.20 and 0.5.22).
///
/// ```
/// use kvevent_wire::SglangRelease;
/// let r: SglangRelease = "0.4.6.post5".parse()?;
/// assert!(!r.has_dp_rank());
/// assert!("0.5.20".parse::<SglangRelease>()?.map_events());
/// # Ok::<(), kvevent_wire::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SglangRelease(pub Release);

impl SglangRelease {
    /// The first release with KV events (0.4.6.post5).
    pub const OLDEST: SglangRelease = SglangRelease(r(0, 4, 6));
    /// The newest release whose format this crate knows; newer ones are written like it.
    pub const NEWEST_KNOWN: SglangRelease = SglangRelease(r(0, 5, 23));

    /// From 0.4.7 the batch carries `attn_dp_rank` as its third element.
    pub fn has_dp_rank(self) -> bool {
        self.0 >= r(0, 4, 7)
    }

    /// From 0.5.9 stores and removals carry `medium`.
    pub fn has_medium(self) -> bool {
        self.0 >= r(0, 5, 9)
    }

    /// From 0.5.18 a salted store carries its `cache_salt` (an 8th-element map until 0.5.19,
    /// a map key from 0.5.20).
    pub fn has_cache_salt(self) -> bool {
        self.0 >= r(0, 5, 18)
    }

    /// From 0.5.20 events are tagged maps (the batch stays an array); `session_id` appears.
    pub fn map_events(self) -> bool {
        self.0 >= r(0, 5, 20)
    }

    /// From 0.5.22 stores carry `lora_name`.
    pub fn has_lora_name(self) -> bool {
        self.0 >= r(0, 5, 22)
    }
}

impl FromStr for SglangRelease {
    type Err = Error;

    /// Parses `0.5.18`, `0.4.6.post5`, `v0.5.9`.
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::new(ErrorKind::BadRelease, 0);
        let s = s.trim().trim_start_matches('v');
        let s = s.split_once(".post").map_or(s, |(base, _)| base);
        let mut parts = s.splitn(3, '.');
        let num = |p: Option<&str>| -> Result<u16, Error> {
            p.ok_or_else(bad)?.parse().map_err(|_| bad())
        };
        let rel = SglangRelease(r(
            num(parts.next())?,
            num(parts.next())?,
            num(parts.next())?,
        ));
        if rel < Self::OLDEST {
            return Err(bad());
        }
        Ok(rel)
    }
}

impl fmt::Display for SglangRelease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A vLLM release number, `major.minor.patch`.
///
/// ```
/// use kvevent_wire::Release;
/// let r: Release = "0.26.0".parse()?;
/// assert!(r.map_events());
/// assert!(!"0.23.1".parse::<Release>()?.map_events());
/// # Ok::<(), kvevent_wire::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Release {
    /// Major number.
    pub major: u16,
    /// Minor number.
    pub minor: u16,
    /// Patch number.
    pub patch: u16,
}

const fn r(major: u16, minor: u16, patch: u16) -> Release {
    Release {
        major,
        minor,
        patch,
    }
}

impl Release {
    /// A release number.
    pub const fn new(major: u16, minor: u16, patch: u16) -> Self {
        r(major, minor, patch)
    }

    /// The oldest release with KV events.
    pub const OLDEST: Release = r(0, 9, 0);
    /// The newest release whose format this crate knows; newer ones are written like it.
    pub const NEWEST_KNOWN: Release = r(0, 33, 0);

    /// True from 0.9.1: the batch carries `data_parallel_rank` as its third element.
    pub fn has_dp_rank(self) -> bool {
        self >= r(0, 9, 1)
    }

    /// True from 0.24.0: events are maps tagged under `"type"`, not positional arrays.
    pub fn map_events(self) -> bool {
        self >= r(0, 24, 0)
    }

    /// True when this release's BlockStored has the field (see `STORED_SINCE`).
    pub(crate) fn has_stored_field(self, idx: usize) -> bool {
        STORED_SINCE.get(idx).is_some_and(|since| self >= *since)
    }

    /// True when this release's BlockRemoved has the field.
    pub(crate) fn has_removed_field(self, idx: usize) -> bool {
        REMOVED_SINCE.get(idx).is_some_and(|since| self >= *since)
    }
}

/// First release of each BlockStored field, in declaration order.
const STORED_SINCE: [Release; 15] = [
    r(0, 9, 0),  // block_hashes
    r(0, 9, 0),  // parent_block_hash
    r(0, 9, 0),  // token_ids
    r(0, 9, 0),  // block_size
    r(0, 9, 0),  // lora_id
    r(0, 10, 2), // medium
    r(0, 14, 0), // lora_name
    r(0, 17, 0), // extra_keys
    r(0, 20, 0), // group_idx
    r(0, 22, 0), // kv_cache_spec_kind
    r(0, 22, 0), // kv_cache_spec_sliding_window
    r(0, 26, 0), // locality
    r(0, 29, 0), // ownership
    r(0, 30, 0), // session_id
    r(0, 33, 0), // lookahead_token_ids
];

/// First release of each BlockRemoved field.
const REMOVED_SINCE: [Release; 5] = [
    r(0, 9, 0),  // block_hashes
    r(0, 10, 2), // medium
    r(0, 20, 0), // group_idx
    r(0, 26, 0), // locality
    r(0, 29, 0), // ownership
];

/// In the map era, BlockStored fields from this index on have a default (None) and are omitted
/// when None; the ones before are always written.
pub(crate) const STORED_FIRST_DEFAULTED: usize = 7;
/// The same for BlockRemoved.
pub(crate) const REMOVED_FIRST_DEFAULTED: usize = 2;

impl FromStr for Release {
    type Err = Error;

    /// Parses `0.26.0`, `0.26`, `v0.26.0`, and ignores a suffix such as `rc1` or `+cu128`.
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::new(ErrorKind::BadRelease, 0);
        let s = s.trim().trim_start_matches('v');
        let mut parts = s.splitn(3, '.');
        let num = |p: Option<&str>| -> Result<u16, Error> {
            let p = p.ok_or_else(bad)?;
            let digits = p.find(|c: char| !c.is_ascii_digit()).unwrap_or(p.len());
            p[..digits].parse().map_err(|_| bad())
        };
        let major = num(parts.next())?;
        let minor = num(parts.next())?;
        let patch = match parts.next() {
            Some(p) => num(Some(p))?,
            None => 0,
        };
        let rel = r(major, minor, patch);
        if rel < Self::OLDEST {
            return Err(bad());
        }
        Ok(rel)
    }
}

impl fmt::Display for Release {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_release_spellings() {
        for (s, want) in [
            ("0.9.0", r(0, 9, 0)),
            ("0.26", r(0, 26, 0)),
            ("v0.10.2", r(0, 10, 2)),
            ("0.11.0rc1", r(0, 11, 0)),
            ("1.0.0+cu128", r(1, 0, 0)),
        ] {
            assert_eq!(s.parse::<Release>().expect(s), want);
        }
        for s in ["", "0", "0.8.5", "x.y.z", "0..1"] {
            assert!(s.parse::<Release>().is_err(), "{s}");
        }
    }

    #[test]
    fn positional_lengths_match_the_spec() {
        // BlockStored arrays are 6/7/8/9/10/12 long (tag included) in these releases.
        for (rel, len) in [
            (r(0, 9, 0), 6),
            (r(0, 10, 2), 7),
            (r(0, 14, 0), 8),
            (r(0, 17, 0), 9),
            (r(0, 20, 0), 10),
            (r(0, 22, 0), 12),
            (r(0, 23, 0), 12),
        ] {
            let fields = (0..15).filter(|&i| rel.has_stored_field(i)).count();
            assert_eq!(fields + 1, len, "{rel}");
        }
    }
}
