//! Payload encoding: the exact bytes a given release's msgspec structs produce.

use crate::decode::{REMOVED_FIELDS, STORED_FIELDS};
use crate::error::{Error, ErrorKind, Result};
use crate::model::{BlockHash, BlockRemoved, BlockStored, Event, EventBatch, TokenIds, Value};
use crate::msgpack::Writer;
use crate::release::{REMOVED_FIRST_DEFAULTED, Release, STORED_FIRST_DEFAULTED, SglangRelease};

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
                    if e.cache_salt.take().is_some() {
                        dropped += 1;
                    }
                    if e.token_ids.is_pairs() {
                        e.token_ids = TokenIds::from(e.token_ids.to_vec());
                        dropped += 1;
                    }
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
        // SGLang's alone: no vLLM release has either.
        if e.cache_salt.is_some() {
            return Err(self.not_in_release("cache_salt"));
        }
        if e.token_ids.is_pairs() {
            return Err(self.not_in_release("token_ids as EAGLE pairs"));
        }
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

/// Encodes a batch as SGLang `release` would send it (`../spec/sglang-kv-events.md`): the
/// batch an array (`[ts, events]` in 0.4.6.post5, then `[ts, events, attn_dp_rank]`); events
/// tagged arrays until 0.5.19 (a store 6 elements, 7 with `medium` from 0.5.9, and on a salted
/// store an 8th, `{"cache_salt": s}`, in 0.5.18–0.5.19), tagged maps from 0.5.20 (`lora_id`
/// always written, `medium`, `cache_salt`, `session_id` and, from 0.5.22, `lora_name` only
/// when set); EAGLE pairs as 2-element arrays. A field the release does not have must be
/// `None` ([`ErrorKind::FieldNotInSglangRelease`] otherwise).
///
/// ```
/// use kvevent_wire::{Engine, Limits, SglangRelease};
/// let payload = b"\x93\xcb\x3f\xf0\0\0\0\0\0\0\x91\x98\xabBlockStored\x91\xfb\xc0\x92\x01\x02\x02\xc0\xa3GPU\x81\xaacache_salt\xa1s\x00";
/// let batch = kvevent_wire::decode_engine(payload, Engine::Sglang, &Limits::DEFAULT)?;
/// let release: SglangRelease = "0.5.18".parse()?;
/// assert_eq!(kvevent_wire::encode_sglang(&batch, release)?, payload);
/// # Ok::<(), kvevent_wire::Error>(())
/// ```
pub fn encode_sglang(batch: &EventBatch<'_>, release: SglangRelease) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(64 + 32 * batch.events.len());
    let mut w = Writer { out: &mut out };
    let not = |field| Error::new(ErrorKind::FieldNotInSglangRelease { field, release }, 0);
    if release.has_dp_rank() {
        w.array_len(3);
    } else if batch.data_parallel_rank.is_some() {
        return Err(not("attn_dp_rank"));
    } else {
        w.array_len(2);
    }
    w.f64(batch.ts);
    w.array_len(batch.events.len());
    let maps = release.map_events();
    for event in &batch.events {
        match event {
            Event::BlockStored(e) => sglang_stored(&mut w, e, release, &not)?,
            Event::BlockRemoved(e) => {
                for (set, field) in [
                    (e.group_idx.is_some(), "group_idx"),
                    (e.locality.is_some(), "locality"),
                    (e.ownership.is_some(), "ownership"),
                    (e.medium.is_some() && !release.has_medium(), "medium"),
                ] {
                    if set {
                        return Err(not(field));
                    }
                }
                let medium = release.has_medium() && (!maps || e.medium.is_some());
                if maps {
                    w.map_len(2 + usize::from(medium), 3);
                    w.str("type");
                } else {
                    w.array_len(2 + usize::from(medium));
                }
                w.str("BlockRemoved");
                if maps {
                    w.str("block_hashes");
                }
                hashes(&mut w, &e.block_hashes);
                if medium {
                    if maps {
                        w.str("medium");
                    }
                    opt(&mut w, e.medium.as_ref(), |w, m| w.str(&m.0));
                }
            }
            Event::AllBlocksCleared(e) => {
                if e.medium.is_some() {
                    return Err(not("medium"));
                }
                if maps {
                    w.map_len(1, 1);
                    w.str("type");
                } else {
                    w.array_len(1);
                }
                w.str("AllBlocksCleared");
            }
        }
    }
    if release.has_dp_rank() {
        match batch.data_parallel_rank {
            Some(rank) => w.sint(rank),
            None => w.nil(),
        }
    }
    Ok(out)
}

fn sglang_stored(
    w: &mut Writer<'_>,
    e: &BlockStored<'_>,
    release: SglangRelease,
    not: &impl Fn(&'static str) -> Error,
) -> Result<()> {
    let maps = release.map_events();
    for (set, field) in [
        (e.extra_keys.is_some(), "extra_keys"),
        (e.group_idx.is_some(), "group_idx"),
        (e.kv_cache_spec_kind.is_some(), "kv_cache_spec_kind"),
        (
            e.kv_cache_spec_sliding_window.is_some(),
            "kv_cache_spec_sliding_window",
        ),
        (e.locality.is_some(), "locality"),
        (e.ownership.is_some(), "ownership"),
        (e.lookahead_token_ids.is_some(), "lookahead_token_ids"),
        (e.medium.is_some() && !release.has_medium(), "medium"),
        (
            e.cache_salt.is_some() && !release.has_cache_salt(),
            "cache_salt",
        ),
        (e.session_id.is_some() && !maps, "session_id"),
        (
            e.lora_name.is_some() && !release.has_lora_name(),
            "lora_name",
        ),
    ] {
        if set {
            return Err(not(field));
        }
    }
    let tokens = |w: &mut Writer<'_>| match e.token_ids.pairs() {
        Some(pairs) => {
            w.array_len(pairs.len());
            for [a, b] in pairs {
                w.array_len(2);
                w.uint(u64::from(a));
                w.uint(u64::from(b));
            }
        }
        None => tokens(w, &e.token_ids),
    };
    if !maps {
        let medium = release.has_medium();
        let salt = e.cache_salt.as_deref();
        w.array_len(6 + usize::from(medium) + usize::from(salt.is_some()));
        w.str("BlockStored");
        hashes(w, &e.block_hashes);
        opt(w, e.parent_block_hash.as_ref(), hash);
        tokens(w);
        w.uint(u64::from(e.block_size));
        opt(w, e.lora_id, |w, v| w.sint(v));
        if medium {
            opt(w, e.medium.as_ref(), |w, m| w.str(&m.0));
        }
        if let Some(salt) = salt {
            w.map_len(1, 1);
            w.str("cache_salt");
            w.str(salt);
        }
        return Ok(());
    }
    let optional = [
        ("medium", e.medium.as_ref().map(|m| &*m.0)),
        ("cache_salt", e.cache_salt.as_deref()),
        ("session_id", e.session_id.as_deref()),
        ("lora_name", e.lora_name.as_deref()),
    ];
    let set = optional.iter().filter(|(_, v)| v.is_some()).count();
    w.map_len(6 + set, 10);
    w.str("type");
    w.str("BlockStored");
    w.str("block_hashes");
    hashes(w, &e.block_hashes);
    w.str("parent_block_hash");
    opt(w, e.parent_block_hash.as_ref(), hash);
    w.str("token_ids");
    tokens(w);
    w.str("block_size");
    w.uint(u64::from(e.block_size));
    w.str("lora_id");
    opt(w, e.lora_id, |w, v| w.sint(v));
    for (key, value) in optional {
        if let Some(v) = value {
            w.str(key);
            w.str(v);
        }
    }
    Ok(())
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
