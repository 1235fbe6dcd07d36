//! A second decoder, written with serde (`rmp_serde`) apart from the hand-written one, as a
//! cross-check: it reads a payload of every release (positional events up to 0.23, tagged
//! maps from 0.24, with or without the DP rank) with the meaning `kvevent_wire::decode` gives
//! it (unknown event types skipped and counted, unknown fields and trailing elements ignored,
//! a missing required field an error), into owned types of its own. Test code only: the
//! product has one decoder.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

use kvevent_wire::Int;

/// A block hash: an int (as the engine's Python int) or bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Hash {
    /// An int hash.
    Int(Int),
    /// A bytes hash (a digest).
    Bytes(Vec<u8>),
}

/// Any msgpack value (`extra_keys` entries).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    /// nil.
    Nil,
    /// A bool.
    Bool(bool),
    /// An int.
    Int(Int),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// A bin.
    Bytes(Vec<u8>),
    /// An array.
    Array(Vec<Value>),
    /// A map, in written order.
    Map(Vec<(Value, Value)>),
}

/// `BlockStored`, every field of the newest release (absent ones `None` / empty).
#[derive(Debug, Clone, Default, PartialEq)]
#[allow(
    missing_docs,
    reason = "the fields are those of kvevent_wire::BlockStored"
)]
pub(crate) struct BlockStored {
    pub block_hashes: Vec<Hash>,
    pub parent_block_hash: Option<Hash>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    pub extra_keys: Option<Vec<Option<Vec<Value>>>>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    pub session_id: Option<String>,
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, Default, PartialEq)]
#[allow(
    missing_docs,
    reason = "the fields are those of kvevent_wire::BlockRemoved"
)]
pub(crate) struct BlockRemoved {
    pub block_hashes: Vec<Hash>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

/// `AllBlocksCleared` (with the tier cleared, when one is named).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct AllBlocksCleared {
    /// The tier cleared; `None`: everything.
    pub medium: Option<String>,
}

/// One event.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs, reason = "one variant per event type")]
#[allow(
    clippy::large_enum_variant,
    reason = "as kvevent_wire::Event: events live in one Vec per batch"
)]
pub(crate) enum Event {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared(AllBlocksCleared),
}

/// One batch, owned.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Batch {
    /// The engine's batch time, seconds since the epoch.
    pub ts: f64,
    /// The events of known types, in order.
    pub events: Vec<Event>,
    /// The DP rank (0.9.1+).
    pub data_parallel_rank: Option<i64>,
    /// Events of unknown types, skipped.
    pub unknown_events: usize,
}

// ---- Deserialize: everything is read as a `Value`, then given its meaning. ----

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a msgpack value")
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Nil)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Nil)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Int(Int::U64(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(Int::from_i64(v)))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }

    fn visit_f32<E>(self, v: f32) -> Result<Value, E> {
        Ok(Value::Float(f64::from(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }

    fn visit_bytes<E>(self, v: &[u8]) -> Result<Value, E> {
        Ok(Value::Bytes(v.to_vec()))
    }

    fn visit_byte_buf<E>(self, v: Vec<u8>) -> Result<Value, E> {
        Ok(Value::Bytes(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(x) = seq.next_element()? {
            v.push(x);
        }
        Ok(Value::Array(v))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut v = Vec::with_capacity(map.size_hint().unwrap_or(0).min(1024));
        while let Some(kv) = map.next_entry()? {
            v.push(kv);
        }
        Ok(Value::Map(v))
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

impl<'de> Deserialize<'de> for Batch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        batch(v).map_err(de::Error::custom)
    }
}

type Meaning<T> = Result<T, String>;

fn batch(v: Value) -> Meaning<Batch> {
    let mut out = Batch::default();
    let (ts, events, rank) = match v {
        Value::Array(items) => {
            let mut it = items.into_iter();
            (it.next(), it.next(), it.next())
        }
        Value::Map(entries) => {
            let (mut ts, mut events, mut rank) = (None, None, None);
            for (k, v) in entries {
                match k {
                    Value::Str(k) if k == "ts" => ts = Some(v),
                    Value::Str(k) if k == "events" => events = Some(v),
                    Value::Str(k) if k == "data_parallel_rank" => rank = Some(v),
                    _ => {}
                }
            }
            (ts, events, rank)
        }
        other => return Err(format!("a batch is an array or a map, not {other:?}")),
    };
    out.ts = match ts.ok_or("missing field ts")? {
        Value::Float(f) => f,
        Value::Int(i) => i.as_f64(),
        other => return Err(format!("ts: not a number: {other:?}")),
    };
    let Value::Array(events) = events.ok_or("missing field events")? else {
        return Err("events: not an array".into());
    };
    for e in events {
        match event(e)? {
            Some(e) => out.events.push(e),
            None => out.unknown_events += 1,
        }
    }
    out.data_parallel_rank = opt_i64(rank, "data_parallel_rank")?;
    Ok(out)
}

/// The event's fields by name, from the positional form (`[tag, f1, f2, …]`, field names in
/// `order`) or the tagged map.
fn fields(v: Value) -> Meaning<(String, Vec<(String, Value)>)> {
    match v {
        Value::Array(items) => {
            let mut it = items.into_iter();
            let Some(Value::Str(tag)) = it.next() else {
                return Err("an event's first element is its type".into());
            };
            let order: &[&str] = match tag.as_str() {
                "BlockStored" => &[
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
                ],
                "BlockRemoved" => &["block_hashes", "medium", "group_idx"],
                "AllBlocksCleared" => &["medium"],
                _ => &[],
            };
            let named = order.iter().map(|f| (*f).to_owned()).zip(it).collect();
            Ok((tag, named))
        }
        Value::Map(entries) => {
            let mut tag = None;
            let mut named = Vec::with_capacity(entries.len());
            for (k, v) in entries {
                let Value::Str(k) = k else {
                    return Err("an event's keys are strings".into());
                };
                if k == "type" {
                    let Value::Str(t) = v else {
                        return Err("an event's type is a string".into());
                    };
                    tag = Some(t);
                } else {
                    named.push((k, v));
                }
            }
            Ok((tag.ok_or("missing field type")?, named))
        }
        other => Err(format!("an event is an array or a map, not {other:?}")),
    }
}

fn event(v: Value) -> Meaning<Option<Event>> {
    let (tag, named) = fields(v)?;
    Ok(Some(match tag.as_str() {
        "BlockStored" => {
            let mut e = BlockStored::default();
            let mut seen = (false, false, false);
            for (k, v) in named {
                match k.as_str() {
                    "block_hashes" => {
                        e.block_hashes = hashes(v)?;
                        seen.0 = true;
                    }
                    "parent_block_hash" => e.parent_block_hash = opt(v).map(hash).transpose()?,
                    "token_ids" => {
                        e.token_ids = tokens(v, "token_ids")?;
                        seen.1 = true;
                    }
                    "block_size" => {
                        e.block_size = u32::try_from(int(&v, "block_size")?)
                            .map_err(|_| "block_size out of range")?;
                        seen.2 = true;
                    }
                    "lora_id" => e.lora_id = opt_i64(Some(v), "lora_id")?,
                    "medium" => e.medium = opt_str(v, "medium")?,
                    "lora_name" => e.lora_name = opt_str(v, "lora_name")?,
                    "extra_keys" => {
                        e.extra_keys = match opt(v) {
                            None => None,
                            Some(Value::Array(items)) => Some(
                                items
                                    .into_iter()
                                    .map(|i| match i {
                                        Value::Nil => Ok(None),
                                        Value::Array(keys) => Ok(Some(keys)),
                                        other => Err(format!("extra_keys entry: {other:?}")),
                                    })
                                    .collect::<Meaning<_>>()?,
                            ),
                            Some(other) => return Err(format!("extra_keys: {other:?}")),
                        }
                    }
                    "group_idx" => e.group_idx = opt_i64(Some(v), "group_idx")?,
                    "kv_cache_spec_kind" => e.kv_cache_spec_kind = opt_str(v, &k)?,
                    "kv_cache_spec_sliding_window" => {
                        e.kv_cache_spec_sliding_window = opt_i64(Some(v), &k)?
                    }
                    "locality" => e.locality = opt_str(v, &k)?,
                    "ownership" => e.ownership = opt_str(v, &k)?,
                    "session_id" => e.session_id = opt_str(v, &k)?,
                    "lookahead_token_ids" => {
                        e.lookahead_token_ids = match opt(v) {
                            None => None,
                            Some(Value::Array(blocks)) => Some(
                                blocks
                                    .into_iter()
                                    .map(|b| tokens(b, "lookahead_token_ids"))
                                    .collect::<Meaning<_>>()?,
                            ),
                            Some(other) => return Err(format!("lookahead_token_ids: {other:?}")),
                        }
                    }
                    _ => {}
                }
            }
            match seen {
                (false, _, _) => return Err("missing field block_hashes".into()),
                (_, false, _) => return Err("missing field token_ids".into()),
                (_, _, false) => return Err("missing field block_size".into()),
                _ => Event::BlockStored(e),
            }
        }
        "BlockRemoved" => {
            let mut e = BlockRemoved::default();
            let mut seen = false;
            for (k, v) in named {
                match k.as_str() {
                    "block_hashes" => {
                        e.block_hashes = hashes(v)?;
                        seen = true;
                    }
                    "medium" => e.medium = opt_str(v, "medium")?,
                    "group_idx" => e.group_idx = opt_i64(Some(v), "group_idx")?,
                    "locality" => e.locality = opt_str(v, &k)?,
                    "ownership" => e.ownership = opt_str(v, &k)?,
                    _ => {}
                }
            }
            if !seen {
                return Err("missing field block_hashes".into());
            }
            Event::BlockRemoved(e)
        }
        "AllBlocksCleared" => {
            let mut e = AllBlocksCleared::default();
            for (k, v) in named {
                if k == "medium" {
                    e.medium = opt_str(v, "medium")?;
                }
            }
            Event::AllBlocksCleared(e)
        }
        _ => return Ok(None),
    }))
}

fn opt(v: Value) -> Option<Value> {
    match v {
        Value::Nil => None,
        v => Some(v),
    }
}

fn int(v: &Value, field: &str) -> Meaning<i64> {
    match v {
        Value::Int(i) => i.as_i64().ok_or_else(|| format!("{field}: out of range")),
        other => Err(format!("{field}: not an int: {other:?}")),
    }
}

fn opt_i64(v: Option<Value>, field: &str) -> Meaning<Option<i64>> {
    v.and_then(opt).map(|v| int(&v, field)).transpose()
}

fn opt_str(v: Value, field: &str) -> Meaning<Option<String>> {
    match opt(v) {
        None => Ok(None),
        Some(Value::Str(s)) => Ok(Some(s)),
        Some(other) => Err(format!("{field}: not a string: {other:?}")),
    }
}

fn hash(v: Value) -> Meaning<Hash> {
    match v {
        Value::Int(i) => Ok(Hash::Int(i)),
        Value::Bytes(b) => Ok(Hash::Bytes(b)),
        other => Err(format!("a block hash is an int or bytes, not {other:?}")),
    }
}

fn hashes(v: Value) -> Meaning<Vec<Hash>> {
    match v {
        Value::Array(items) => items.into_iter().map(hash).collect(),
        other => Err(format!("block_hashes: not an array: {other:?}")),
    }
}

fn tokens(v: Value, field: &str) -> Meaning<Vec<u32>> {
    match v {
        Value::Array(items) => items
            .iter()
            .map(|t| {
                int(t, field).and_then(|i| {
                    u32::try_from(i).map_err(|_| format!("{field}: {i} is not a token id"))
                })
            })
            .collect(),
        other => Err(format!("{field}: not an array: {other:?}")),
    }
}

// ---- From the borrowing form. ----

impl From<&kvevent_wire::BlockHash<'_>> for Hash {
    fn from(h: &kvevent_wire::BlockHash<'_>) -> Self {
        match h {
            kvevent_wire::BlockHash::Int(i) => Hash::Int(*i),
            kvevent_wire::BlockHash::Bytes(b) => Hash::Bytes(b.to_vec()),
        }
    }
}

impl From<&kvevent_wire::Value<'_>> for Value {
    fn from(v: &kvevent_wire::Value<'_>) -> Self {
        match v {
            kvevent_wire::Value::Nil => Value::Nil,
            kvevent_wire::Value::Bool(b) => Value::Bool(*b),
            kvevent_wire::Value::Int(i) => Value::Int(*i),
            kvevent_wire::Value::Float(f) => Value::Float(*f),
            kvevent_wire::Value::Str(s) => Value::Str(s.to_string()),
            kvevent_wire::Value::Bytes(b) => Value::Bytes(b.to_vec()),
            kvevent_wire::Value::Array(a) => Value::Array(a.iter().map(Value::from).collect()),
            kvevent_wire::Value::Map(m) => Value::Map(
                m.iter()
                    .map(|(k, v)| (Value::from(k), Value::from(v)))
                    .collect(),
            ),
        }
    }
}

fn s(c: &Option<std::borrow::Cow<'_, str>>) -> Option<String> {
    c.as_ref().map(|c| c.to_string())
}

fn m(c: &Option<kvevent_wire::Medium<'_>>) -> Option<String> {
    c.as_ref().map(|c| c.0.to_string())
}

impl From<&kvevent_wire::Event<'_>> for Event {
    fn from(e: &kvevent_wire::Event<'_>) -> Self {
        match e {
            kvevent_wire::Event::BlockStored(e) => Event::BlockStored(BlockStored {
                block_hashes: e.block_hashes.iter().map(Hash::from).collect(),
                parent_block_hash: e.parent_block_hash.as_ref().map(Hash::from),
                token_ids: e.token_ids.to_vec(),
                block_size: e.block_size,
                lora_id: e.lora_id,
                medium: m(&e.medium),
                lora_name: s(&e.lora_name),
                extra_keys: e.extra_keys.as_ref().map(|k| {
                    k.iter()
                        .map(|o| o.as_ref().map(|v| v.iter().map(Value::from).collect()))
                        .collect()
                }),
                group_idx: e.group_idx,
                kv_cache_spec_kind: s(&e.kv_cache_spec_kind),
                kv_cache_spec_sliding_window: e.kv_cache_spec_sliding_window,
                locality: s(&e.locality),
                ownership: s(&e.ownership),
                session_id: s(&e.session_id),
                lookahead_token_ids: e
                    .lookahead_token_ids
                    .as_ref()
                    .map(|l| l.iter().map(kvevent_wire::TokenIds::to_vec).collect()),
            }),
            kvevent_wire::Event::BlockRemoved(e) => Event::BlockRemoved(BlockRemoved {
                block_hashes: e.block_hashes.iter().map(Hash::from).collect(),
                medium: m(&e.medium),
                group_idx: e.group_idx,
                locality: s(&e.locality),
                ownership: s(&e.ownership),
            }),
            kvevent_wire::Event::AllBlocksCleared(e) => Event::AllBlocksCleared(AllBlocksCleared {
                medium: m(&e.medium),
            }),
        }
    }
}

impl From<&kvevent_wire::EventBatch<'_>> for Batch {
    fn from(b: &kvevent_wire::EventBatch<'_>) -> Self {
        Batch {
            ts: b.ts,
            events: b.events.iter().map(Event::from).collect(),
            data_parallel_rank: b.data_parallel_rank,
            unknown_events: b.unknown_events,
        }
    }
}
