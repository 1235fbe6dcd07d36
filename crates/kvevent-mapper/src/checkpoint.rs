//! A mapper's tracked blocks as bytes, and back: what a restarted sidecar restores instead of
//! rebuilding from the engine's replay ring (which covers only its last 10,000 batches).
//!
//! Layout (all integers little-endian), version [`FORMAT`]:
//!
//! ```text
//! "KVMAP" u16 version | key mode u8 | offload u8 | all groups u8
//! groups:   u32 n, n × (u8 has + i64)          interned KV-cache groups, in order
//! adapters: u32 n, n × (u32 len + UTF-8)       interned adapter names, in order
//! skipped:  u32 n, n × (u8 has + i64)          groups whose blocks are not reported
//! blocks:   u64 n, n × (u8 hash len + hash + u16 group + u64 prefix + u32 tokens
//!                        + u16 adapter + u8 flags)
//! ```
//!
//! 26 bytes a block for an 8-byte hash. The bytes carry no checksum: the file that holds them
//! does (the sidecar's state file). Counters are not saved: they restart with the process, as
//! Prometheus counters do.

use crate::blocks::Tracked;
use crate::{KeyMode, Mapper, Options};

/// The version of the layout written.
pub const FORMAT: u16 = 1;

const MAGIC: &[u8; 5] = b"KVMAP";

/// Why saved bytes cannot be restored.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RestoreError {
    /// Not a mapper checkpoint.
    #[error("not a mapper checkpoint")]
    Magic,
    /// Written by another layout version.
    #[error("mapper checkpoint version {0}, this build reads {FORMAT}")]
    Version(u16),
    /// Saved under other mapping options (key mode, offload tier, groups reported).
    #[error("saved with other mapping options ({0})")]
    Options(&'static str),
    /// More blocks than `max_tracked_blocks` allows now.
    #[error("{saved} blocks saved, more than the {max} now allowed")]
    TooMany {
        /// Blocks in the checkpoint.
        saved: u64,
        /// The configured bound.
        max: usize,
    },
    /// Truncated or inconsistent bytes.
    #[error("corrupt mapper checkpoint at byte {0}")]
    Corrupt(usize),
}

fn mode_byte(mode: KeyMode) -> u8 {
    match mode {
        KeyMode::Engine => 0,
        KeyMode::Fingerprint => 1,
    }
}

fn put_group(out: &mut Vec<u8>, group: Option<i64>) {
    out.push(u8::from(group.is_some()));
    out.extend_from_slice(&group.unwrap_or(0).to_le_bytes());
}

impl Mapper {
    /// Appends the tracked blocks, with what they need to be read back, to `out`.
    pub fn save(&self, out: &mut Vec<u8>) {
        out.reserve(32 + self.blocks.len() * 27);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT.to_le_bytes());
        out.push(mode_byte(self.options.key_mode));
        out.push(u8::from(self.options.engine_has_offload_tier));
        out.push(u8::from(self.options.all_kv_groups));
        let (groups, adapters) = self.blocks.interned();
        out.extend_from_slice(&(groups.len() as u32).to_le_bytes());
        for g in groups {
            put_group(out, *g);
        }
        out.extend_from_slice(&(adapters.len() as u32).to_le_bytes());
        for a in adapters {
            out.extend_from_slice(&(a.len() as u32).to_le_bytes());
            out.extend_from_slice(a.as_bytes());
        }
        out.extend_from_slice(&(self.skipped_groups.len() as u32).to_le_bytes());
        for g in &self.skipped_groups {
            put_group(out, *g);
        }
        out.extend_from_slice(&(self.blocks.len() as u64).to_le_bytes());
        self.blocks.for_each(|hash, group, t| {
            out.push(hash.len() as u8);
            out.extend_from_slice(hash);
            out.extend_from_slice(&group.to_le_bytes());
            let (prefix, tokens, adapter, flags) = t.raw();
            out.extend_from_slice(&prefix.to_le_bytes());
            out.extend_from_slice(&tokens.to_le_bytes());
            out.extend_from_slice(&adapter.to_le_bytes());
            out.push(flags);
        });
    }

    /// A mapper holding what [`Mapper::save`] wrote, for `identity` and `options`. The options
    /// that change what a block is (key mode, offload tier, groups reported) must be those it
    /// was saved with; the bound must hold every saved block.
    pub fn restore(
        identity: crate::Identity,
        options: Options,
        bytes: &[u8],
    ) -> Result<Self, RestoreError> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(MAGIC.len())? != MAGIC {
            return Err(RestoreError::Magic);
        }
        let version = r.u16()?;
        if version != FORMAT {
            return Err(RestoreError::Version(version));
        }
        if r.u8()? != mode_byte(options.key_mode) {
            return Err(RestoreError::Options("key mode"));
        }
        if r.u8()? != u8::from(options.engine_has_offload_tier) {
            return Err(RestoreError::Options("offload tier"));
        }
        if r.u8()? != u8::from(options.all_kv_groups) {
            return Err(RestoreError::Options("all KV groups"));
        }
        let mut mapper = Mapper::new(identity, options);
        let groups = r.count(9)?;
        let groups: Vec<Option<i64>> = (0..groups).map(|_| r.group()).collect::<Result<_, _>>()?;
        let adapters = r.count(4)?;
        let mut names = Vec::with_capacity(adapters);
        for _ in 0..adapters {
            let len = r.u32()? as usize;
            let at = r.at;
            let name = std::str::from_utf8(r.take(len)?).map_err(|_| RestoreError::Corrupt(at))?;
            names.push(std::sync::Arc::<str>::from(name));
        }
        let at = r.at;
        if !mapper.blocks.set_interned(groups, names) {
            return Err(RestoreError::Corrupt(at));
        }
        let skipped = r.count(9)?;
        mapper.skipped_groups = (0..skipped).map(|_| r.group()).collect::<Result<_, _>>()?;
        let n = r.u64()?;
        if n > mapper.options.max_tracked_blocks as u64 {
            return Err(RestoreError::TooMany {
                saved: n,
                max: mapper.options.max_tracked_blocks,
            });
        }
        if n > (r.bytes.len() - r.at) as u64 / 18 {
            return Err(RestoreError::Corrupt(r.at));
        }
        mapper.blocks.reserve(n as usize);
        for _ in 0..n {
            let at = r.at;
            let len = usize::from(r.u8()?);
            let hash = r.take(len)?;
            let group = u16::from_le_bytes(r.array()?);
            let prefix = r.u64()?;
            let tokens = r.u32()?;
            let adapter = u16::from_le_bytes(r.array()?);
            let flags = r.u8()?;
            let t = Tracked::from_raw(prefix, tokens, adapter, flags);
            if len == 0 || !mapper.blocks.restore_one(hash, group, t) {
                return Err(RestoreError::Corrupt(at));
            }
        }
        if r.at != bytes.len() {
            return Err(RestoreError::Corrupt(r.at));
        }
        Ok(mapper)
    }
}

struct Reader<'b> {
    bytes: &'b [u8],
    at: usize,
}

impl<'b> Reader<'b> {
    fn take(&mut self, n: usize) -> Result<&'b [u8], RestoreError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.bytes.len())
            .ok_or(RestoreError::Corrupt(self.at))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], RestoreError> {
        let at = self.at;
        self.take(N)?
            .try_into()
            .map_err(|_| RestoreError::Corrupt(at))
    }

    fn u8(&mut self) -> Result<u8, RestoreError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, RestoreError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, RestoreError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, RestoreError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items at least `min_size` bytes each, checked against what is left.
    fn count(&mut self, min_size: usize) -> Result<usize, RestoreError> {
        let at = self.at;
        let n = self.u32()? as usize;
        if n > u16::MAX as usize || n * min_size > self.bytes.len() - self.at {
            return Err(RestoreError::Corrupt(at));
        }
        Ok(n)
    }

    fn group(&mut self) -> Result<Option<i64>, RestoreError> {
        let at = self.at;
        let has = self.u8()?;
        let g = i64::from_le_bytes(self.array()?);
        match has {
            0 => Ok(None),
            1 => Ok(Some(g)),
            _ => Err(RestoreError::Corrupt(at)),
        }
    }
}
