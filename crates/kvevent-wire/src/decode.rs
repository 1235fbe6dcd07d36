//! Payload decoding: one `EventBatch` from the third ZMQ frame, any release.

use std::borrow::Cow;

use crate::error::{ErrorKind, Result};
use crate::model::{
    AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, EventBatch, Medium, TokenIds,
    Value,
};
use crate::msgpack::Reader;
use crate::release::Engine;

/// Explicit bounds on what one payload may hold. Input over a limit is rejected with
/// [`ErrorKind::LimitExceeded`]; no allocation is ever larger than the payload itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Events in one batch. Default 262,144.
    pub max_events: usize,
    /// Block hashes in one event (and `extra_keys` entries). Default 262,144.
    pub max_hashes: usize,
    /// Token ids in one event (and lookahead ids per block). Default 4,194,304.
    pub max_token_ids: usize,
    /// Nesting of values inside `extra_keys` and of skipped unknown values. Default 32.
    pub max_depth: usize,
}

impl Limits {
    /// The defaults: generous for any real engine, finite for hostile input.
    pub const DEFAULT: Limits = Limits {
        max_events: 1 << 18,
        max_hashes: 1 << 18,
        max_token_ids: 1 << 22,
        max_depth: 32,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Most bytes reserved up front for a declared length. A length header is only a claim (an
/// element can be one byte of payload and decode to dozens, an event to hundreds): beyond
/// this, vectors grow as elements actually decode, so the heap a payload can take stays a
/// small multiple of its size (the `decode` fuzz target checks it).
const PREALLOC_BYTES: usize = 16 << 10;

/// A vector for `n` declared elements, reserving at most [`PREALLOC_BYTES`].
fn vec_for<T>(n: usize) -> Vec<T> {
    Vec::with_capacity(n.min(PREALLOC_BYTES / std::mem::size_of::<T>().max(1)))
}

/// Decodes one payload with the default [`Limits`].
///
/// ```
/// // A 0.9.0 batch: [ts, [["AllBlocksCleared"]]]
/// let payload = b"\x92\xcb\x3f\xf8\0\0\0\0\0\0\x91\x91\xb0AllBlocksCleared";
/// let batch = kvevent_wire::decode(payload)?;
/// assert_eq!(batch.ts, 1.5);
/// assert_eq!(batch.events, vec![kvevent_wire::Event::AllBlocksCleared(Default::default())]);
/// assert_eq!(batch.data_parallel_rank, None);
/// # Ok::<(), kvevent_wire::Error>(())
/// ```
pub fn decode(payload: &[u8]) -> Result<EventBatch<'_>> {
    decode_with(payload, &Limits::DEFAULT)
}

/// Decodes one payload within the given limits.
///
/// Accepts the batch as an array (2 or more elements; extra ones ignored) or as a map, events
/// as tagged positional arrays (≤ 0.23) or tagged maps (≥ 0.24). Unknown event tags are
/// skipped and counted in [`EventBatch::unknown_events`]; unknown map keys and extra array
/// elements are ignored. Bytes after the batch are an error.
pub fn decode_with<'a>(payload: &'a [u8], limits: &Limits) -> Result<EventBatch<'a>> {
    decode_engine(payload, Engine::Vllm, limits)
}

/// Decodes one payload of `engine`'s wire within the given limits. SGLang's differs from
/// vLLM's in two places a vLLM payload never has: a salted store's 8th element is a map
/// `{"cache_salt": s}` (0.5.18–0.5.19; from 0.5.20 a `cache_salt` key), and under EAGLE
/// speculative decoding `token_ids` is a list of `[t_i, t_i+1]` pairs (0.5.3+). Everything
/// else is read as for vLLM.
///
/// ```
/// use kvevent_wire::{Engine, Event, Limits};
/// // SGLang 0.5.18: [1.0, [a salted store of one block (hash -5) of two tokens], 0]
/// let payload = b"\x93\xcb\x3f\xf0\0\0\0\0\0\0\x91\x98\xabBlockStored\x91\xfb\xc0\x92\x01\x02\x02\xc0\xa3GPU\x81\xaacache_salt\xa1s\x00";
/// let batch = kvevent_wire::decode_engine(payload, Engine::Sglang, &Limits::DEFAULT)?;
/// let Event::BlockStored(e) = &batch.events[0] else { unreachable!() };
/// assert_eq!(e.cache_salt.as_deref(), Some("s"));
/// // vLLM has a string (lora_name) there: as vLLM's, the payload is an error.
/// assert!(kvevent_wire::decode(payload).is_err());
/// # Ok::<(), kvevent_wire::Error>(())
/// ```
pub fn decode_engine<'a>(
    payload: &'a [u8],
    engine: Engine,
    limits: &Limits,
) -> Result<EventBatch<'a>> {
    let mut d = Decoder {
        r: Reader::new(payload),
        limits,
        engine,
    };
    d.r.max_depth = limits.max_depth;
    let batch = d.batch()?;
    if d.r.remaining() != 0 {
        return Err(d.r.err(ErrorKind::TrailingBytes));
    }
    Ok(batch)
}

struct Decoder<'a, 'l> {
    r: Reader<'a>,
    limits: &'l Limits,
    engine: Engine,
}

impl<'a> Decoder<'a, '_> {
    fn batch(&mut self) -> Result<EventBatch<'a>> {
        let start = self.r.pos();
        let mut batch = EventBatch::default();
        if self.r.peek()? & 0xf0 == 0x80 || matches!(self.r.peek()?, 0xde | 0xdf) {
            let (mut ts, mut events) = (false, false);
            for _ in 0..self.r.map_len()? {
                match self.r.str()? {
                    "ts" => {
                        batch.ts = self.r.f64()?;
                        ts = true;
                    }
                    "events" => {
                        self.events(&mut batch)?;
                        events = true;
                    }
                    "data_parallel_rank" => {
                        batch.data_parallel_rank = self.r.opt_i64("data_parallel_rank")?;
                    }
                    _ => self.r.skip(self.limits.max_depth)?,
                }
            }
            missing(self, start, ts, "ts")?;
            missing(self, start, events, "events")?;
            return Ok(batch);
        }
        let n = self.r.array_len().map_err(|e| match e.kind() {
            ErrorKind::UnexpectedType { found, .. } => self.r.err(ErrorKind::UnexpectedType {
                expected: "batch (array or map)",
                found,
            }),
            _ => e,
        })?;
        missing(self, start, n >= 1, "ts")?;
        batch.ts = self.r.f64()?;
        missing(self, start, n >= 2, "events")?;
        self.events(&mut batch)?;
        if n >= 3 {
            batch.data_parallel_rank = self.r.opt_i64("data_parallel_rank")?;
        }
        for _ in 3..n {
            self.r.skip(self.limits.max_depth)?;
        }
        Ok(batch)
    }

    fn events(&mut self, batch: &mut EventBatch<'a>) -> Result<()> {
        let n = self.r.array_len()?;
        let n = self.limited(n, "events per batch", self.limits.max_events)?;
        batch
            .events
            .reserve_exact(n.min(PREALLOC_BYTES / std::mem::size_of::<Event<'_>>()));
        for _ in 0..n {
            let m = self.r.peek()?;
            let event = if m & 0xf0 == 0x90 || matches!(m, 0xdc | 0xdd) {
                self.positional()?
            } else if m & 0xf0 == 0x80 || matches!(m, 0xde | 0xdf) {
                self.keyed()?
            } else {
                return Err(self.r.err(ErrorKind::UnexpectedType {
                    expected: "event (array or map)",
                    found: crate::msgpack::type_name(m),
                }));
            };
            match event {
                Some(e) => batch.events.push(e),
                None => batch.unknown_events += 1,
            }
        }
        Ok(())
    }

    fn limited(&self, n: usize, what: &'static str, limit: usize) -> Result<usize> {
        if n > limit {
            return Err(self.r.err(ErrorKind::LimitExceeded { what, limit }));
        }
        Ok(n)
    }

    /// `["Tag", field1, field2, ...]`, fields in declaration order.
    fn positional(&mut self) -> Result<Option<Event<'a>>> {
        let start = self.r.pos();
        let n = self.r.array_len()?;
        missing(self, start, n >= 1, "type")?;
        let tag = self.r.str()?;
        let (event, read) = match tag {
            "BlockStored" => {
                missing(self, start, n >= 5, "block_size")?;
                let mut e = BlockStored::default();
                // SGLang's arrays end at medium, or, on a salted store, at its metadata map.
                let read = if self.engine == Engine::Sglang {
                    n.min(8)
                } else {
                    n.min(12)
                };
                for idx in 1..read {
                    if idx == 7 && self.engine == Engine::Sglang {
                        self.sglang_metadata(&mut e)?;
                    } else {
                        self.stored_field(&mut e, STORED_FIELDS[idx - 1])?;
                    }
                }
                (Some(Event::BlockStored(e)), read)
            }
            "BlockRemoved" => {
                missing(self, start, n >= 2, "block_hashes")?;
                let mut e = BlockRemoved::default();
                let read = n.min(4);
                for idx in 1..read {
                    self.removed_field(&mut e, REMOVED_FIELDS[idx - 1])?;
                }
                (Some(Event::BlockRemoved(e)), read)
            }
            "AllBlocksCleared" => {
                // Index 1, when present: the tier cleared (Dynamo's shape).
                let mut e = AllBlocksCleared::default();
                if n >= 2 {
                    e.medium = self.r.opt_str()?.map(Medium::from);
                }
                (Some(Event::AllBlocksCleared(e)), n.min(2))
            }
            _ => (None, 1),
        };
        for _ in read..n {
            self.r.skip(self.limits.max_depth)?;
        }
        Ok(event)
    }

    /// `{"type": "Tag", "field": value, ...}`, keys in any order.
    fn keyed(&mut self) -> Result<Option<Event<'a>>> {
        let start = self.r.pos();
        let n = self.r.map_len()?;
        let fields_at = self.r.pos();
        // msgspec writes the tag first; look further only when it did not.
        let mut tag = None;
        for _ in 0..n {
            let key = self.r.str()?;
            if key == "type" {
                tag = Some(self.r.str()?);
                break;
            }
            self.r.skip(self.limits.max_depth)?;
        }
        let Some(tag) = tag else {
            return Err(self
                .r
                .err_at(ErrorKind::MissingField { field: "type" }, start));
        };
        self.r.set_pos(fields_at);
        let event = match tag {
            "BlockStored" => {
                let mut e = BlockStored::default();
                let mut seen = [false; STORED_FIELDS.len()];
                for _ in 0..n {
                    let key = self.r.str()?;
                    match STORED_FIELDS.iter().position(|f| *f == key) {
                        Some(i) => {
                            self.stored_field(&mut e, STORED_FIELDS[i])?;
                            seen[i] = true;
                        }
                        None if key == "cache_salt" && self.engine == Engine::Sglang => {
                            e.cache_salt = self.opt_cow()?;
                        }
                        None => self.r.skip(self.limits.max_depth)?,
                    }
                }
                for i in [0, 2, 3] {
                    missing(self, start, seen[i], STORED_FIELDS[i])?;
                }
                Some(Event::BlockStored(e))
            }
            "BlockRemoved" => {
                let mut e = BlockRemoved::default();
                let mut hashes = false;
                for _ in 0..n {
                    let key = self.r.str()?;
                    match REMOVED_FIELDS.iter().find(|f| **f == key) {
                        Some(f) => {
                            self.removed_field(&mut e, f)?;
                            hashes |= *f == "block_hashes";
                        }
                        None => self.r.skip(self.limits.max_depth)?,
                    }
                }
                missing(self, start, hashes, "block_hashes")?;
                Some(Event::BlockRemoved(e))
            }
            "AllBlocksCleared" => {
                let mut e = AllBlocksCleared::default();
                for _ in 0..n {
                    let key = self.r.str()?;
                    if key == "medium" {
                        e.medium = self.r.opt_str()?.map(Medium::from);
                    } else {
                        self.r.skip(self.limits.max_depth)?;
                    }
                }
                Some(Event::AllBlocksCleared(e))
            }
            _ => {
                for _ in 0..n {
                    self.r.skip(self.limits.max_depth)?;
                    self.r.skip(self.limits.max_depth)?;
                }
                None
            }
        };
        Ok(event)
    }

    fn stored_field(&mut self, e: &mut BlockStored<'a>, field: &'static str) -> Result<()> {
        match field {
            "block_hashes" => e.block_hashes = self.hashes()?,
            "parent_block_hash" => {
                e.parent_block_hash = if self.r.try_nil()? {
                    None
                } else {
                    Some(self.hash()?)
                }
            }
            "token_ids" => e.token_ids = self.token_ids("token_ids")?,
            "block_size" => e.block_size = self.r.u32("block_size")?,
            "lora_id" => e.lora_id = self.r.opt_i64("lora_id")?,
            "medium" => e.medium = self.r.opt_str()?.map(Medium::from),
            "lora_name" => e.lora_name = self.opt_cow()?,
            "extra_keys" => e.extra_keys = self.extra_keys()?,
            "group_idx" => e.group_idx = self.r.opt_i64("group_idx")?,
            "kv_cache_spec_kind" => e.kv_cache_spec_kind = self.opt_cow()?,
            "kv_cache_spec_sliding_window" => {
                e.kv_cache_spec_sliding_window = self.r.opt_i64("kv_cache_spec_sliding_window")?
            }
            "locality" => e.locality = self.opt_cow()?,
            "ownership" => e.ownership = self.opt_cow()?,
            "session_id" => e.session_id = self.opt_cow()?,
            "lookahead_token_ids" => {
                e.lookahead_token_ids = if self.r.try_nil()? {
                    None
                } else {
                    let n = self.r.array_len()?;
                    let n = self.limited(n, "lookahead blocks", self.limits.max_hashes)?;
                    let mut v = vec_for(n);
                    for _ in 0..n {
                        v.push(self.token_ids("lookahead_token_ids")?);
                    }
                    Some(v)
                }
            }
            _ => self.r.skip(self.limits.max_depth)?,
        }
        Ok(())
    }

    fn removed_field(&mut self, e: &mut BlockRemoved<'a>, field: &'static str) -> Result<()> {
        match field {
            "block_hashes" => e.block_hashes = self.hashes()?,
            "medium" => e.medium = self.r.opt_str()?.map(Medium::from),
            "group_idx" => e.group_idx = self.r.opt_i64("group_idx")?,
            "locality" => e.locality = self.opt_cow()?,
            "ownership" => e.ownership = self.opt_cow()?,
            _ => self.r.skip(self.limits.max_depth)?,
        }
        Ok(())
    }

    fn opt_cow(&mut self) -> Result<Option<Cow<'a, str>>> {
        Ok(self.r.opt_str()?.map(Cow::Borrowed))
    }

    fn hash(&mut self) -> Result<BlockHash<'a>> {
        if self.r.at_int()? {
            Ok(BlockHash::Int(self.r.int()?))
        } else if matches!(self.r.peek()?, 0xc4..=0xc6) {
            Ok(BlockHash::Bytes(Cow::Borrowed(self.r.bin()?)))
        } else {
            Err(self.r.err(ErrorKind::UnexpectedType {
                expected: "block hash (int or bin)",
                found: crate::msgpack::type_name(self.r.peek()?),
            }))
        }
    }

    fn hashes(&mut self) -> Result<Vec<BlockHash<'a>>> {
        let n = self.r.array_len()?;
        let n = self.limited(n, "block hashes per event", self.limits.max_hashes)?;
        let mut v = vec_for(n);
        for _ in 0..n {
            v.push(self.hash()?);
        }
        Ok(v)
    }

    /// SGLang 0.5.18–0.5.19's 8th element of a salted store: `{"cache_salt": s}` (nil or
    /// absent on an unsalted one); other keys are ignored.
    fn sglang_metadata(&mut self, e: &mut BlockStored<'a>) -> Result<()> {
        if self.r.try_nil()? {
            return Ok(());
        }
        for _ in 0..self.r.map_len()? {
            if self.r.str()? == "cache_salt" {
                e.cache_salt = self.opt_cow()?;
            } else {
                self.r.skip(self.limits.max_depth)?;
            }
        }
        Ok(())
    }

    /// SGLang's EAGLE pairs: `n` arrays `[t_i, t_i+1]`, each checked and kept as bytes.
    fn token_pairs(&mut self, n: usize, field: &'static str) -> Result<TokenIds<'a>> {
        let start = self.r.pos();
        for _ in 0..n {
            // msgspec writes a 2-tuple as a fixarray (0x92); the iterator relies on it.
            if self.r.peek()? != 0x92 {
                return Err(self.r.err(ErrorKind::UnexpectedType {
                    expected: "EAGLE token pair (2-element array)",
                    found: crate::msgpack::type_name(self.r.peek()?),
                }));
            }
            self.r.array_len()?;
            self.r.u32(field)?;
            self.r.u32(field)?;
        }
        Ok(TokenIds::from_wire_pairs(self.r.slice_from(start), n))
    }

    /// Checks the array's elements and keeps them as bytes, to be read when iterated.
    fn token_ids(&mut self, field: &'static str) -> Result<TokenIds<'a>> {
        let n = self.r.array_len()?;
        let n = self.limited(n, "token ids per event", self.limits.max_token_ids)?;
        if self.engine == Engine::Sglang && n > 0 && self.r.peek()? & 0xf0 == 0x90 {
            return self.token_pairs(n, field);
        }
        let start = self.r.pos();
        let common = self.r.skip_u32s(n);
        for _ in common..n {
            self.r.u32(field)?;
        }
        Ok(TokenIds::from_wire(self.r.slice_from(start), n))
    }

    fn extra_keys(&mut self) -> Result<Option<Vec<Option<Vec<Value<'a>>>>>> {
        if self.r.try_nil()? {
            return Ok(None);
        }
        let n = self.r.array_len()?;
        let n = self.limited(n, "extra_keys entries", self.limits.max_hashes)?;
        let mut out = vec_for(n);
        for _ in 0..n {
            if self.r.try_nil()? {
                out.push(None);
                continue;
            }
            let k = self.r.array_len()?;
            let mut keys = vec_for(k);
            for _ in 0..k {
                keys.push(self.value(self.limits.max_depth)?);
            }
            out.push(Some(keys));
        }
        Ok(Some(out))
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>> {
        if depth == 0 {
            return Err(self.r.err(ErrorKind::LimitExceeded {
                what: "nesting depth",
                limit: self.limits.max_depth,
            }));
        }
        let m = self.r.peek()?;
        Ok(match crate::msgpack::type_name(m) {
            "nil" => {
                self.r.try_nil()?;
                Value::Nil
            }
            "bool" => {
                self.r.skip(1)?;
                Value::Bool(m == 0xc3)
            }
            "int" => Value::Int(self.r.int()?),
            "float" => Value::Float(self.r.f64()?),
            "str" => Value::Str(Cow::Borrowed(self.r.str()?)),
            "bin" => Value::Bytes(Cow::Borrowed(self.r.bin()?)),
            "array" => {
                let n = self.r.array_len()?;
                let mut v = vec_for(n);
                for _ in 0..n {
                    v.push(self.value(depth - 1)?);
                }
                Value::Array(v)
            }
            "map" => {
                let n = self.r.map_len()?;
                let mut v = vec_for(n);
                for _ in 0..n {
                    v.push((self.value(depth - 1)?, self.value(depth - 1)?));
                }
                Value::Map(v)
            }
            found => {
                return Err(self.r.err(if m == 0xc1 {
                    ErrorKind::ReservedMarker
                } else {
                    ErrorKind::UnexpectedType {
                        expected: "plain value (no ext)",
                        found,
                    }
                }));
            }
        })
    }
}

fn missing(d: &Decoder<'_, '_>, at: usize, present: bool, field: &'static str) -> Result<()> {
    if present {
        Ok(())
    } else {
        Err(d.r.err_at(ErrorKind::MissingField { field }, at))
    }
}

/// BlockStored's fields in declaration order (positional index = position here + 1).
pub(crate) const STORED_FIELDS: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];

/// BlockRemoved's fields in declaration order.
pub(crate) const REMOVED_FIELDS: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];
