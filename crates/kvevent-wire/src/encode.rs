//! Payload encoding: the exact bytes a given release's msgspec structs produce.

use crate::decode::{REMOVED_FIELDS, STORED_FIELDS};
use crate::error::{Error, ErrorKind, Result};
use crate::model::{BlockHash, BlockRemoved, BlockStored, Event, EventBatch, TokenIds, Value};
use crate::msgpack::Writer;
use crate::release::{REMOVED_FIRST_DEFAULTED, Release, STORED_FIRST_DEFAULTED};

/// Encodes a batch as `release` would send it.
///
/// Positional releases (≤ 0.23) write every field of the release, `nil` for `None`; map
/// releases (≥ 0.24) write the fields without a default always and omit defaulted fields that
/// are `None`, with the map header msgspec picks from the struct's possible entry count.
/// A field the release does not have must be `None`
/// ([`ErrorKind::FieldNotInRelease`] otherwise; see [`EventBatch::retain_fields_of`]).
///
/// ```
/// use kvevent_wire::{Event, EventBatch, Release};
/// let batch = EventBatch {
///     ts: 1.5,
///     events: vec![Event::AllBlocksCleared(Default::default())],
///     ..Default::default()
/// };
/// let bytes = kvevent_wire::encode(&batch, "0.9.0".parse()?)?;
/// assert_eq!(bytes, b"\x92\xcb\x3f\xf8\0\0\0\0\0\0\x91\x91\xb0AllBlocksCleared");
/// assert_eq!(kvevent_wire::decode(&bytes)?, batch);
/// # Ok::<(), kvevent_wire::Error>(())
/// ```
pub fn encode(batch: &EventBatch<'_>, release: Release) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(64 + 32 * batch.events.len());
    encode_into(batch, release, &mut out)?;
    Ok(out)
}

/// Like [`encode`], appending to `out` (which is left as it was on error).
pub fn encode_into(batch: &EventBatch<'_>, release: Release, out: &mut Vec<u8>) -> Result<()> {
    let mark = out.len();
    let result = Encoder {
        w: Writer { out: &mut *out },
        release,
    }
    .batch(batch);
    if result.is_err() {
        out.truncate(mark);
    }
    result
}

impl EventBatch<'_> {
    /// Sets to `None` every field `release` does not have, so that the batch can be encoded
    /// for it. Returns how many values were dropped.
    pub fn retain_fields_of(&mut self, release: Release) -> usize {
        let mut dropped = 0;
        if !release.has_dp_rank() && self.data_parallel_rank.take().is_some() {
            dropped += 1;
        }
        for event in &mut self.events {
            match event {
                Event::BlockStored(e) => {
                    for idx in 0..STORED_FIELDS.len() {
                        if !release.has_stored_field(idx) && stored_is_set(e, idx) {
                            clear_stored(e, idx);
                            dropped += 1;
                        }
                    }
                }
                Event::BlockRemoved(e) => {
                    for idx in 0..REMOVED_FIELDS.len() {
                        if !release.has_removed_field(idx) && removed_is_set(e, idx) {
                            clear_removed(e, idx);
                            dropped += 1;
                        }
                    }
                }
                Event::AllBlocksCleared(e) => {
                    // No vLLM release writes a medium on a clear.
                    if e.medium.take().is_some() {
                        dropped += 1;
                    }
                }
            }
        }
        dropped
    }
}

struct Encoder<'b> {
    w: Writer<'b>,
    release: Release,
}

impl Encoder<'_> {
    fn not_in_release(&self, field: &'static str) -> Error {
        Error::new(
            ErrorKind::FieldNotInRelease {
                field,
                release: self.release,
            },
            0,
        )
    }

    fn batch(&mut self, batch: &EventBatch<'_>) -> Result<()> {
        if self.release.has_dp_rank() {
            self.w.array_len(3);
        } else if batch.data_parallel_rank.is_some() {
            return Err(self.not_in_release("data_parallel_rank"));
        } else {
            self.w.array_len(2);
        }
        self.w.f64(batch.ts);
        self.w.array_len(batch.events.len());
        for event in &batch.events {
            match event {
                Event::BlockStored(e) => self.stored(e)?,
                Event::BlockRemoved(e) => self.removed(e)?,
                Event::AllBlocksCleared(e) => {
                    if e.medium.is_some() {
                        return Err(self.not_in_release("medium"));
                    }
                    self.tagged_header("AllBlocksCleared", 0, 0)
                }
            }
        }
        if self.release.has_dp_rank() {
            match batch.data_parallel_rank {
                Some(rank) => self.w.sint(rank),
                None => self.w.nil(),
            }
        }
        Ok(())
    }

    /// The event's header and tag: `[tag, …` with `written` fields or `{"type": tag, …`.
    fn tagged_header(&mut self, tag: &str, written: usize, possible: usize) {
        if self.release.map_events() {
            self.w.map_len(written + 1, possible + 1);
            self.w.str("type");
        } else {
            self.w.array_len(written + 1);
        }
        self.w.str(tag);
    }

    /// Which fields are written, given what the release has and what is set.
    fn plan(
        &self,
        first_defaulted: usize,
        has: impl Fn(usize) -> bool,
        is_set: impl Fn(usize) -> bool,
        names: &[&'static str],
    ) -> Result<(Vec<usize>, usize)> {
        let mut write = Vec::with_capacity(names.len());
        let mut possible = 0;
        for (idx, name) in names.iter().enumerate() {
            if !has(idx) {
                if is_set(idx) {
                    return Err(self.not_in_release(name));
                }
                continue;
            }
            possible += 1;
            if !self.release.map_events() || idx < first_defaulted || is_set(idx) {
                write.push(idx);
            }
        }
        Ok((write, possible))
    }

    fn key(&mut self, name: &str) {
        if self.release.map_events() {
            self.w.str(name);
        }
    }

    fn stored(&mut self, e: &BlockStored<'_>) -> Result<()> {
        let rel = self.release;
        let (write, possible) = self.plan(
            STORED_FIRST_DEFAULTED,
            |i| rel.has_stored_field(i),
            |i| stored_is_set(e, i),
            &STORED_FIELDS,
        )?;
        self.tagged_header("BlockStored", write.len(), possible);
        for idx in write {
            self.key(STORED_FIELDS[idx]);
            let w = &mut self.w;
            match idx {
                0 => hashes(w, &e.block_hashes),
                1 => opt(w, e.parent_block_hash.as_ref(), hash),
                2 => tokens(w, &e.token_ids),
                3 => w.uint(u64::from(e.block_size)),
                4 => opt(w, e.lora_id, |w, v| w.sint(v)),
                5 => opt(w, e.medium.as_ref(), |w, m| w.str(&m.0)),
                6 => opt(w, e.lora_name.as_deref(), |w, s| w.str(s)),
                7 => opt(w, e.extra_keys.as_ref(), |w, keys| {
                    w.array_len(keys.len());
                    for entry in keys {
                        opt(w, entry.as_ref(), |w, vals| {
                            w.array_len(vals.len());
                            vals.iter().for_each(|v| value(w, v));
                        });
                    }
                }),
                8 => opt(w, e.group_idx, |w, v| w.sint(v)),
                9 => opt(w, e.kv_cache_spec_kind.as_deref(), |w, s| w.str(s)),
                10 => opt(w, e.kv_cache_spec_sliding_window, |w, v| w.sint(v)),
                11 => opt(w, e.locality.as_deref(), |w, s| w.str(s)),
                12 => opt(w, e.ownership.as_deref(), |w, s| w.str(s)),
                13 => opt(w, e.session_id.as_deref(), |w, s| w.str(s)),
                _ => opt(w, e.lookahead_token_ids.as_ref(), |w, blocks| {
                    w.array_len(blocks.len());
                    blocks.iter().for_each(|t| tokens(w, t));
                }),
            }
        }
        Ok(())
    }

    fn removed(&mut self, e: &BlockRemoved<'_>) -> Result<()> {
        let rel = self.release;
        let (write, possible) = self.plan(
            REMOVED_FIRST_DEFAULTED,
            |i| rel.has_removed_field(i),
            |i| removed_is_set(e, i),
            &REMOVED_FIELDS,
        )?;
        self.tagged_header("BlockRemoved", write.len(), possible);
        for idx in write {
            self.key(REMOVED_FIELDS[idx]);
            let w = &mut self.w;
            match idx {
                0 => hashes(w, &e.block_hashes),
                1 => opt(w, e.medium.as_ref(), |w, m| w.str(&m.0)),
                2 => opt(w, e.group_idx, |w, v| w.sint(v)),
                3 => opt(w, e.locality.as_deref(), |w, s| w.str(s)),
                _ => opt(w, e.ownership.as_deref(), |w, s| w.str(s)),
            }
        }
        Ok(())
    }
}

fn opt<T>(w: &mut Writer<'_>, v: Option<T>, f: impl FnOnce(&mut Writer<'_>, T)) {
    match v {
        Some(v) => f(w, v),
        None => w.nil(),
    }
}

fn hash(w: &mut Writer<'_>, h: &BlockHash<'_>) {
    match h {
        BlockHash::Int(i) => w.int(*i),
        BlockHash::Bytes(b) => w.bin(b),
    }
}

fn hashes(w: &mut Writer<'_>, hs: &[BlockHash<'_>]) {
    w.array_len(hs.len());
    hs.iter().for_each(|h| hash(w, h));
}

fn tokens(w: &mut Writer<'_>, t: &TokenIds<'_>) {
    w.array_len(t.len());
    t.iter().for_each(|id| w.uint(u64::from(id)));
}

fn value(w: &mut Writer<'_>, v: &Value<'_>) {
    match v {
        Value::Nil => w.nil(),
        Value::Bool(b) => w.bool(*b),
        Value::Int(i) => w.int(*i),
        Value::Float(f) => w.f64(*f),
        Value::Str(s) => w.str(s),
        Value::Bytes(b) => w.bin(b),
        Value::Array(items) => {
            w.array_len(items.len());
            items.iter().for_each(|i| value(w, i));
        }
        Value::Map(entries) => {
            w.map_len(entries.len(), entries.len());
            for (k, v) in entries {
                value(w, k);
                value(w, v);
            }
        }
    }
}

/// Whether a BlockStored field (by declaration index) holds a value. The four mandatory
/// fields always do.
fn stored_is_set(e: &BlockStored<'_>, idx: usize) -> bool {
    match idx {
        0..=3 => true,
        4 => e.lora_id.is_some(),
        5 => e.medium.is_some(),
        6 => e.lora_name.is_some(),
        7 => e.extra_keys.is_some(),
        8 => e.group_idx.is_some(),
        9 => e.kv_cache_spec_kind.is_some(),
        10 => e.kv_cache_spec_sliding_window.is_some(),
        11 => e.locality.is_some(),
        12 => e.ownership.is_some(),
        13 => e.session_id.is_some(),
        _ => e.lookahead_token_ids.is_some(),
    }
}

fn clear_stored(e: &mut BlockStored<'_>, idx: usize) {
    match idx {
        4 => e.lora_id = None,
        5 => e.medium = None,
        6 => e.lora_name = None,
        7 => e.extra_keys = None,
        8 => e.group_idx = None,
        9 => e.kv_cache_spec_kind = None,
        10 => e.kv_cache_spec_sliding_window = None,
        11 => e.locality = None,
        12 => e.ownership = None,
        13 => e.session_id = None,
        14 => e.lookahead_token_ids = None,
        _ => {}
    }
}

fn removed_is_set(e: &BlockRemoved<'_>, idx: usize) -> bool {
    match idx {
        0 => true,
        1 => e.medium.is_some(),
        2 => e.group_idx.is_some(),
        3 => e.locality.is_some(),
        _ => e.ownership.is_some(),
    }
}

fn clear_removed(e: &mut BlockRemoved<'_>, idx: usize) {
    match idx {
        1 => e.medium = None,
        2 => e.group_idx = None,
        3 => e.locality = None,
        4 => e.ownership = None,
        _ => {}
    }
}
