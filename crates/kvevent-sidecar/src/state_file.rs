//! `--state-file`: the sidecar's per-source state, saved periodically and at shutdown, and
//! loaded at start so that a restarted sidecar resumes where it stopped instead of clearing the
//! replica and rebuilding from the engine's replay ring (which covers only its newest 10,000
//! batches, about 100 s of a busy engine).
//!
//! File layout (integers little-endian):
//!
//! ```text
//! "KVEVENT-STATE\n"  u32 format  u32 header length  header (JSON, see `Header`)
//! per source, in header order: u64 length + the mapper's saved blocks (`Mapper::save`)
//! u64 XXH3-64 of every byte before it
//! ```
//!
//! Written to `PATH.tmp`, fsynced, renamed over `PATH`, and the directory fsynced: a crash
//! leaves the old file or the new one, never a torn one. On load, a file that is corrupt, of
//! another format, another replica, model, tenant, hash scheme, key mode or source layout is
//! refused with the reason, and the sidecar starts as without one (clear + rebuild). Whether
//! the engine still continues the saved state is decided per source by the replay
//! (`SourceState::on_resume`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvevent_mapper::{Identity, Mapper, Options};
use kvevent_source::Resume;
use serde::{Deserialize, Serialize};

/// The file format written.
pub const FORMAT: u32 = 1;

const MAGIC: &[u8; 14] = b"KVEVENT-STATE\n";

/// What the file says of the sidecar that wrote it, readable with `head -c 2000`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// Unix time of the write, in milliseconds.
    pub written_unix_ms: u64,
    /// Written at shutdown, after the last batch (not a periodic save).
    pub at_shutdown: bool,
    /// `--replica-id`.
    pub replica_id: String,
    /// `--model-id`.
    pub model_id: String,
    /// `--tenant-id`.
    pub tenant_id: String,
    /// `--hash-scheme`.
    pub hash_scheme: String,
    /// `--key-mode`.
    pub key_mode: String,
    /// Per source, in subscription order.
    pub sources: Vec<SourceHeader>,
    /// Where the router feed was when the blocks were saved: a sidecar that resumes from this
    /// file goes on in the same epoch, so a follower at this position misses nothing. Absent
    /// without a feed (and in files before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feed: Option<FeedPosition>,
}

/// A router feed's `(epoch, seq)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeedPosition {
    /// The feed's epoch.
    pub epoch: u64,
    /// The seq of its last change.
    pub seq: u64,
}

/// One source in the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceHeader {
    /// The source's label (endpoint and rank).
    pub label: String,
    /// The last batch applied to the saved blocks: seq and payload digest (none yet: `None`).
    pub last_seq: Option<u64>,
    /// XXH3-64 of that batch's payload.
    pub digest: u64,
    /// The state was known to be incomplete.
    pub degraded: bool,
    /// Blocks saved.
    pub blocks: u64,
}

/// Why a state file was not used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read it: {0}")]
    Read(#[source] std::io::Error),
    /// Not a state file, or damaged.
    #[error("corrupt ({0})")]
    Corrupt(String),
    /// Another format version.
    #[error("format {0}, this build reads {FORMAT}")]
    Format(u32),
    /// Written for another replica, model, key mode or source layout.
    #[error("written for another {what}: {saved:?}, now {now:?}")]
    Other {
        /// Which setting differs.
        what: &'static str,
        /// The file's.
        saved: String,
        /// Ours.
        now: String,
    },
    /// A mapper section cannot be restored.
    #[error("source {0}: {1}")]
    Mapper(String, #[source] kvevent_mapper::RestoreError),
}

/// What a loaded file gives back: a mapper and a resume point per source.
#[derive(Debug)]
pub struct Loaded {
    /// The header read.
    pub header: Header,
    /// Mappers holding the saved blocks, in source order.
    pub mappers: Vec<Mapper>,
    /// Where each source resumes (`None`: it had no batch yet).
    pub resume: Vec<Option<Resume>>,
}

/// Serializes the header and every mapper into one file image, checksummed.
pub fn encode(header: &Header, mappers: &[Mapper]) -> Vec<u8> {
    let json = serde_json::to_vec(header).unwrap_or_default();
    let mut out = Vec::with_capacity(64 + json.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    let mut section = Vec::new();
    for m in mappers {
        section.clear();
        m.save(&mut section);
        out.extend_from_slice(&(section.len() as u64).to_le_bytes());
        out.extend_from_slice(&section);
    }
    let sum = checksum(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// The file's checksum of the bytes before it: XXH3-64 (catches torn and damaged files; not a
/// signature).
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

fn corrupt(what: &str) -> LoadError {
    LoadError::Corrupt(what.to_owned())
}

fn take<'b>(bytes: &mut &'b [u8], n: usize, what: &str) -> Result<&'b [u8], LoadError> {
    if bytes.len() < n {
        return Err(corrupt(what));
    }
    let (head, rest) = bytes.split_at(n);
    *bytes = rest;
    Ok(head)
}

fn u32_at(bytes: &mut &[u8], what: &str) -> Result<u32, LoadError> {
    let b = take(bytes, 4, what)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn u64_at(bytes: &mut &[u8], what: &str) -> Result<u64, LoadError> {
    let b = take(bytes, 8, what)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    Ok(u64::from_le_bytes(a))
}

/// What the running sidecar expects of a file it may use.
#[derive(Debug, Clone)]
pub struct Expected<'a> {
    /// The identity stamped on reports.
    pub identity: &'a Identity,
    /// `--key-mode`.
    pub key_mode: &'a str,
    /// The sources' labels, in order.
    pub sources: &'a [String],
    /// The mapping options.
    pub options: &'a Options,
}

/// Reads a file image back, checking it belongs to this sidecar.
pub fn decode(bytes: &[u8], expected: &Expected<'_>) -> Result<Loaded, LoadError> {
    if bytes.len() < MAGIC.len() + 16 || &bytes[..MAGIC.len()] != MAGIC {
        return Err(corrupt("not a kvevent state file"));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    let mut s = [0u8; 8];
    s.copy_from_slice(sum);
    if checksum(body) != u64::from_le_bytes(s) {
        return Err(corrupt("checksum mismatch"));
    }
    let mut rest = &body[MAGIC.len()..];
    let format = u32_at(&mut rest, "format")?;
    if format != FORMAT {
        return Err(LoadError::Format(format));
    }
    let len = u32_at(&mut rest, "header length")? as usize;
    let header: Header = serde_json::from_slice(take(&mut rest, len, "header")?)
        .map_err(|e| LoadError::Corrupt(format!("header: {e}")))?;
    let id = expected.identity;
    for (what, saved, now) in [
        ("replica", &header.replica_id, id.replica_id()),
        ("model", &header.model_id, id.model_id()),
        ("tenant", &header.tenant_id, id.tenant_id()),
        ("hash scheme", &header.hash_scheme, id.hash_scheme()),
        ("key mode", &header.key_mode, expected.key_mode),
    ] {
        if saved != now {
            return Err(LoadError::Other {
                what,
                saved: saved.clone(),
                now: now.to_owned(),
            });
        }
    }
    let labels: Vec<&str> = header.sources.iter().map(|s| s.label.as_str()).collect();
    if labels
        != expected
            .sources
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
    {
        return Err(LoadError::Other {
            what: "source layout",
            saved: labels.join(" "),
            now: expected.sources.join(" "),
        });
    }
    let mut mappers = Vec::with_capacity(header.sources.len());
    let mut resume = Vec::with_capacity(header.sources.len());
    for source in &header.sources {
        let len = u64_at(&mut rest, "section length")?;
        let section = take(
            &mut rest,
            usize::try_from(len).unwrap_or(usize::MAX),
            "section",
        )?;
        let mapper = Mapper::restore(id.clone(), expected.options.clone(), section)
            .map_err(|e| LoadError::Mapper(source.label.clone(), e))?;
        mappers.push(mapper);
        resume.push(source.last_seq.map(|last_seq| Resume {
            last_seq,
            digest: source.digest,
            degraded: source.degraded,
        }));
    }
    if !rest.is_empty() {
        return Err(corrupt("trailing bytes"));
    }
    Ok(Loaded {
        header,
        mappers,
        resume,
    })
}

/// Reads and checks the file at `path`; `Ok(None)` when there is none.
pub fn load(path: &Path, expected: &Expected<'_>) -> Result<Option<Loaded>, LoadError> {
    match std::fs::read(path) {
        Ok(bytes) => decode(&bytes, expected).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(LoadError::Read(e)),
    }
}

/// Writes `image` to `path` atomically: a temporary file beside it, fsynced, renamed over it,
/// and the directory fsynced. Returns how long it took.
pub fn write(path: &Path, image: &[u8]) -> std::io::Result<Duration> {
    let started = std::time::Instant::now();
    let tmp = tmp_path(path);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(image)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map(|()| started.elapsed())
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Checks at start that the state file's directory takes a file (so a wrong path fails
/// loudly at start, not at the first save minutes later).
pub fn check_writable(path: &Path) -> std::io::Result<()> {
    let tmp = tmp_path(path);
    std::fs::File::create(&tmp)?;
    std::fs::remove_file(&tmp)
}
