#![doc = include_str!("../README.md")]

use std::collections::HashMap;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// The file's first 7 bytes.
pub const MAGIC: &[u8; 7] = b"KVEVREC";
/// The format version this crate writes and reads.
pub const VERSION: u8 = 1;
/// The longest header read (a header is a few hundred bytes).
const MAX_HEADER: u32 = 1 << 20;
/// The longest record read: a payload this long is not a batch any engine sends.
pub const MAX_RECORD: u64 = 256 << 20;

const TOPIC: u8 = 1;
const REPLAY: u8 = 2;
const RESET: u8 = 4;
/// The longest reset reason written (a reason is one word).
const MAX_REASON: usize = 64;

/// What was recorded and how: the first thing in the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// Whose wire the payloads are: `vllm` or `sglang`.
    pub engine: String,
    /// Unix time (ms) of the recording's start: records' times count from it.
    pub started_unix_ms: u64,
    /// The engine's sources, one per DP rank.
    #[serde(default)]
    pub sources: Vec<SourceInfo>,
    /// Whether what the replay endpoint held was asked for first.
    #[serde(default)]
    pub replay_first: bool,
    /// The tool and version that wrote it.
    #[serde(default)]
    pub tool: String,
    /// The command line it was made with.
    #[serde(default)]
    pub command: Vec<String>,
}

impl Header {
    /// A header for `engine` (`vllm`, `sglang`), started at `started_unix_ms`.
    pub fn new(engine: &str, started_unix_ms: u64) -> Self {
        Self {
            engine: engine.to_owned(),
            started_unix_ms,
            sources: Vec::new(),
            replay_first: false,
            tool: String::new(),
            command: Vec::new(),
        }
    }
}

/// One recorded source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceInfo {
    /// Its DP rank.
    pub rank: u32,
    /// Its PUB endpoint.
    pub endpoint: String,
    /// Its replay endpoint, if any.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
}

/// One batch as it arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The DP rank it came from.
    pub rank: u32,
    /// Its seq.
    pub seq: u64,
    /// Microseconds from the header's start to its arrival.
    pub at_us: u64,
    /// Its topic frame.
    pub topic: Vec<u8>,
    /// It came from the replay endpoint, not live.
    pub replay: bool,
    /// The rank starts over at this record, and why (`restart`, `gap`, ...): what its earlier
    /// records built is stale, as a consumer of the live stream would have cleared it.
    pub reset: Option<String>,
    /// The payload, byte for byte.
    pub payload: Vec<u8>,
}

/// What went wrong reading or writing a recording.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing the file failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// Not a recording: no magic.
    #[error("byte 0: not a kvevent recording (no `KVEVREC` at the start)")]
    Foreign,
    /// A version this build does not read.
    #[error("byte 7: recording format version {0}, this build reads version {VERSION}")]
    Version(u8),
    /// The bytes at `offset` are not what the format says.
    #[error("byte {offset}: {what}")]
    Corrupt {
        /// Where the damage starts.
        offset: u64,
        /// What is wrong.
        what: String,
    },
    /// A record to write breaks the format's bounds.
    #[error("cannot record: {0}")]
    Unwritable(&'static str),
}

impl Error {
    fn corrupt(offset: u64, what: impl Into<String>) -> Self {
        Self::Corrupt {
            offset,
            what: what.into(),
        }
    }

    /// The byte offset the error names, if it names one.
    pub fn offset(&self) -> Option<u64> {
        match self {
            Self::Foreign => Some(0),
            Self::Version(_) => Some(7),
            Self::Corrupt { offset, .. } => Some(*offset),
            Self::Io(_) | Self::Unwritable(_) => None,
        }
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Per rank: the previous seq and topic, to write (and read) each record relative to them.
#[derive(Debug, Default)]
struct Context {
    ranks: HashMap<u32, (Option<u64>, Vec<u8>)>,
    last_at_us: u64,
}

/// Writes a recording.
#[derive(Debug)]
pub struct Writer<W: Write> {
    out: W,
    context: Context,
    body: Vec<u8>,
    frame: Vec<u8>,
    written: u64,
}

impl<W: Write> Writer<W> {
    /// Writes the magic and `header` to `out`.
    pub fn new(mut out: W, header: &Header) -> Result<Self, Error> {
        let json = serde_json::to_vec(header).map_err(io::Error::other)?;
        let len = u32::try_from(json.len())
            .ok()
            .filter(|l| *l <= MAX_HEADER)
            .ok_or(Error::Unwritable("the header is over 1 MiB"))?;
        let mut head = Vec::with_capacity(json.len() + 16);
        head.extend_from_slice(MAGIC);
        head.push(VERSION);
        head.extend_from_slice(&len.to_le_bytes());
        head.extend_from_slice(&json);
        head.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
        out.write_all(&head)?;
        Ok(Self {
            out,
            context: Context::default(),
            body: Vec::new(),
            frame: Vec::new(),
            written: head.len() as u64,
        })
    }

    /// Appends one record, in one write (a reader sees it whole or cut, never mixed with the
    /// next). Records must come in order of `at_us`.
    pub fn write(&mut self, r: &Record) -> Result<(), Error> {
        if r.payload.len() as u64 > MAX_RECORD {
            return Err(Error::Unwritable("a payload over 256 MiB"));
        }
        if r.reset.as_ref().is_some_and(|why| why.len() > MAX_REASON) {
            return Err(Error::Unwritable("a reset reason over 64 bytes"));
        }
        let (last_seq, last_topic) = self.context.ranks.entry(r.rank).or_default();
        let new_topic = last_seq.is_none() || *last_topic != r.topic;
        let delta = match *last_seq {
            Some(prev) => r.seq.wrapping_sub(prev).wrapping_sub(1) as i64,
            None => r.seq as i64,
        };
        let body = &mut self.body;
        body.clear();
        body.push(
            (u8::from(new_topic) * TOPIC)
                | (u8::from(r.replay) * REPLAY)
                | (u8::from(r.reset.is_some()) * RESET),
        );
        put_varint(body, u64::from(r.rank));
        put_varint(body, zigzag(delta));
        put_varint(body, r.at_us.saturating_sub(self.context.last_at_us));
        if new_topic {
            put_varint(body, r.topic.len() as u64);
            body.extend_from_slice(&r.topic);
        }
        if let Some(why) = &r.reset {
            put_varint(body, why.len() as u64);
            body.extend_from_slice(why.as_bytes());
        }
        body.extend_from_slice(&r.payload);
        let frame = &mut self.frame;
        frame.clear();
        put_varint(frame, body.len() as u64);
        frame.extend_from_slice(body);
        frame.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
        self.out.write_all(frame)?;
        self.written += frame.len() as u64;
        *last_seq = Some(r.seq);
        if new_topic {
            last_topic.clone_from(&r.topic);
        }
        self.context.last_at_us = self.context.last_at_us.max(r.at_us);
        Ok(())
    }

    /// Bytes written so far, header included.
    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    /// Flushes what was written to the underlying writer.
    pub fn flush(&mut self) -> Result<(), Error> {
        Ok(self.out.flush()?)
    }

    /// Flushes and gives the writer back.
    pub fn finish(mut self) -> Result<W, Error> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Reads a recording, record by record.
#[derive(Debug)]
pub struct Reader<R: Read> {
    input: R,
    header: Header,
    context: Context,
    offset: u64,
    truncated: Option<u64>,
    buf: Vec<u8>,
}

/// Reads exactly `buf.len()` bytes, or as many as there are: how many were read.
fn read_up_to(input: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A varint at the front of `bytes`: its value and length.
fn take_varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, b) in bytes.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

impl<R: Read> Reader<R> {
    /// Reads and checks the magic, the version and the header.
    pub fn new(mut input: R) -> Result<Self, Error> {
        let mut head = [0u8; 12];
        let n = read_up_to(&mut input, &mut head)?;
        if n < MAGIC.len() || &head[..MAGIC.len()] != MAGIC {
            return Err(Error::Foreign);
        }
        if n < 12 {
            return Err(Error::corrupt(n as u64, "the file ends inside its header"));
        }
        if head[7] != VERSION {
            return Err(Error::Version(head[7]));
        }
        let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if len > MAX_HEADER {
            return Err(Error::corrupt(8, format!("a header of {len} bytes")));
        }
        let mut json = vec![0u8; len as usize + 4];
        if read_up_to(&mut input, &mut json)? < json.len() {
            return Err(Error::corrupt(8, "the file ends inside its header"));
        }
        let (json, crc) = json.split_at(len as usize);
        if crc32fast::hash(json).to_le_bytes() != crc {
            return Err(Error::corrupt(8, "the header's checksum does not match"));
        }
        let header: Header = serde_json::from_slice(json)
            .map_err(|e| Error::corrupt(8, format!("the header is not valid: {e}")))?;
        Ok(Self {
            input,
            header,
            context: Context::default(),
            offset: 12 + u64::from(len) + 4,
            truncated: None,
            buf: Vec::new(),
        })
    }

    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Where the next record starts.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Where the file was cut inside a record (it ended before the record did), once the
    /// records before it were read: a recorder killed while writing. `None` when it ended
    /// cleanly.
    pub fn truncated(&self) -> Option<u64> {
        self.truncated
    }

    /// The next record; `None` at the end of the file, or where it was cut
    /// ([`Reader::truncated`]).
    pub fn next_record(&mut self) -> Result<Option<Record>, Error> {
        if self.truncated.is_some() {
            return Ok(None);
        }
        let start = self.offset;
        // The body's length: a varint of up to 10 bytes, read a byte at a time.
        let mut len = 0u64;
        let mut len_bytes = 0usize;
        loop {
            let mut b = [0u8; 1];
            if read_up_to(&mut self.input, &mut b)? == 0 {
                if len_bytes > 0 {
                    self.truncated = Some(start);
                }
                return Ok(None);
            }
            len |= u64::from(b[0] & 0x7f) << (7 * len_bytes);
            len_bytes += 1;
            if b[0] & 0x80 == 0 {
                break;
            }
            if len_bytes == 10 {
                return Err(Error::corrupt(start, "a record length that does not end"));
            }
        }
        if !(4..=MAX_RECORD + 64).contains(&len) {
            return Err(Error::corrupt(start, format!("a record of {len} bytes")));
        }
        // Read as it comes: a damaged length never allocates more than the bytes there are.
        self.buf.clear();
        let want = len + 4;
        (&mut self.input).take(want).read_to_end(&mut self.buf)?;
        if (self.buf.len() as u64) < want {
            self.truncated = Some(start);
            return Ok(None);
        }
        let (body, crc) = self.buf.split_at(len as usize);
        if crc32fast::hash(body).to_le_bytes() != crc {
            return Err(Error::corrupt(
                start,
                "the record's checksum does not match",
            ));
        }
        let body_at = start + len_bytes as u64;
        let record = parse(&mut self.context, body, body_at)?;
        self.offset = body_at + len + 4;
        Ok(Some(record))
    }
}

/// One record's body, read at byte `at`, against what came before it.
fn parse(context: &mut Context, body: &[u8], at: u64) -> Result<Record, Error> {
    let bad = |what: &str| Error::corrupt(at, format!("a record whose {what}"));
    let flags = body[0];
    if flags & !(TOPIC | REPLAY | RESET) != 0 {
        return Err(bad("flags are unknown"));
    }
    let mut rest = &body[1..];
    let mut next = |what: &str| -> Result<u64, Error> {
        let (v, n) = take_varint(rest).ok_or_else(|| bad(what))?;
        rest = &rest[n..];
        Ok(v)
    };
    let rank = u32::try_from(next("rank is cut")?).map_err(|_| bad("rank is too large"))?;
    let delta = unzigzag(next("seq is cut")?);
    let gap = next("time is cut")?;
    let topic = if flags & TOPIC != 0 {
        let len = next("topic is cut")?;
        let len = usize::try_from(len)
            .ok()
            .filter(|l| *l <= rest.len())
            .ok_or_else(|| bad("topic runs past its end"))?;
        let (topic, after) = rest.split_at(len);
        rest = after;
        Some(topic.to_vec())
    } else {
        None
    };
    let reset = if flags & RESET != 0 {
        let (len, n) = take_varint(rest).ok_or_else(|| bad("reset reason is cut"))?;
        rest = &rest[n..];
        let len = usize::try_from(len)
            .ok()
            .filter(|l| *l <= rest.len() && *l <= MAX_REASON)
            .ok_or_else(|| bad("reset reason runs past its end"))?;
        let (why, after) = rest.split_at(len);
        rest = after;
        Some(String::from_utf8_lossy(why).into_owned())
    } else {
        None
    };
    let (last_seq, last_topic) = context.ranks.entry(rank).or_default();
    let seq = match *last_seq {
        Some(prev) => prev.wrapping_add(1).wrapping_add(delta as u64),
        None if topic.is_none() => return Err(bad("rank has no topic yet")),
        None => delta as u64,
    };
    if let Some(t) = topic {
        *last_topic = t;
    }
    *last_seq = Some(seq);
    let at_us = context.last_at_us.saturating_add(gap);
    context.last_at_us = at_us;
    Ok(Record {
        rank,
        seq,
        at_us,
        topic: last_topic.clone(),
        replay: flags & REPLAY != 0,
        reset,
        payload: rest.to_vec(),
    })
}

/// Every record of a recording held in memory, up to where it was cut: the header, the
/// records, and where it was cut if it was.
pub fn read_all(bytes: &[u8]) -> Result<(Header, Vec<Record>, Option<u64>), Error> {
    let mut r = Reader::new(bytes)?;
    let mut records = Vec::new();
    while let Some(record) = r.next_record()? {
        records.push(record);
    }
    let cut = r.truncated();
    Ok((r.header, records, cut))
}
