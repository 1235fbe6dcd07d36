//! The normalized JSON form of a batch (feature `json`), as in `shared/vectors/README.md`:
//! every field of the newest release present (null when absent), int hashes as JSON
//! integers, bytes hashes as lowercase hex, bytes inside `extra_keys` as `{"hex": …}`. A map
//! inside `extra_keys` (no release sends one) is written `{"map": [[key, value], …]}`.

use std::borrow::Cow;

use serde_json::{Map, Number, Value as Json, json};

use crate::decode::{REMOVED_FIELDS, STORED_FIELDS};
use crate::error::{Error, ErrorKind, Result};
use crate::model::{
    AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, EventBatch, Int, Medium,
    TokenIds, Value,
};

/// The normalized JSON value of a batch of `engine`'s wire: vLLM's schema, and for SGLang one
/// more key on BlockStored, `cache_salt` (the vectors' README).
pub fn to_json_engine(batch: &EventBatch<'_>, engine: crate::Engine) -> Json {
    let mut json = to_json(batch);
    if engine == crate::Engine::Sglang
        && let Some(events) = json["events"].as_array_mut()
    {
        for (j, event) in events.iter_mut().zip(&batch.events) {
            if let (Event::BlockStored(e), Some(m)) = (event, j.as_object_mut()) {
                m.insert("cache_salt".into(), str_json(&e.cache_salt));
            }
        }
    }
    json
}

/// The normalized JSON value of a batch (vLLM's schema).
pub fn to_json(batch: &EventBatch<'_>) -> Json {
    // Built in place: `json!` with the events as a value would copy their tree (to_value).
    let mut m = Map::new();
    m.insert(
        "ts".into(),
        Number::from_f64(batch.ts).map_or(Json::Null, Json::Number),
    );
    m.insert("data_parallel_rank".into(), batch.data_parallel_rank.into());
    m.insert(
        "events".into(),
        Json::Array(batch.events.iter().map(event_json).collect()),
    );
    Json::Object(m)
}

fn event_json(event: &Event<'_>) -> Json {
    let mut m = Map::new();
    m.insert("type".into(), event.tag().into());
    match event {
        Event::BlockStored(e) => {
            m.insert("block_hashes".into(), hashes_json(&e.block_hashes));
            m.insert(
                "parent_block_hash".into(),
                e.parent_block_hash.as_ref().map_or(Json::Null, hash_json),
            );
            m.insert("token_ids".into(), tokens_json(&e.token_ids));
            m.insert("block_size".into(), e.block_size.into());
            m.insert("lora_id".into(), e.lora_id.into());
            m.insert("medium".into(), medium_json(e.medium.as_ref()));
            m.insert("lora_name".into(), str_json(&e.lora_name));
            let extra = e.extra_keys.as_ref().map_or(Json::Null, |keys| {
                keys.iter()
                    .map(|k| {
                        k.as_ref()
                            .map_or(Json::Null, |vals| vals.iter().map(value_json).collect())
                    })
                    .collect()
            });
            m.insert("extra_keys".into(), extra);
            m.insert("group_idx".into(), e.group_idx.into());
            m.insert("kv_cache_spec_kind".into(), str_json(&e.kv_cache_spec_kind));
            m.insert(
                "kv_cache_spec_sliding_window".into(),
                e.kv_cache_spec_sliding_window.into(),
            );
            m.insert("locality".into(), str_json(&e.locality));
            m.insert("ownership".into(), str_json(&e.ownership));
            m.insert("session_id".into(), str_json(&e.session_id));
            let lookahead = e
                .lookahead_token_ids
                .as_ref()
                .map_or(Json::Null, |b| b.iter().map(tokens_json).collect());
            m.insert("lookahead_token_ids".into(), lookahead);
        }
        Event::BlockRemoved(e) => {
            m.insert("block_hashes".into(), hashes_json(&e.block_hashes));
            m.insert("medium".into(), medium_json(e.medium.as_ref()));
            m.insert("group_idx".into(), e.group_idx.into());
            m.insert("locality".into(), str_json(&e.locality));
            m.insert("ownership".into(), str_json(&e.ownership));
        }
        Event::AllBlocksCleared(e) => {
            // Only when set: no vLLM release has the field (its JSON has `type` alone).
            if let Some(medium) = &e.medium {
                m.insert("medium".into(), medium_json(Some(medium)));
            }
        }
    }
    Json::Object(m)
}

fn int_json(i: Int) -> Json {
    match i {
        Int::U64(v) => v.into(),
        Int::I64(v) => v.into(),
    }
}

fn hash_json(h: &BlockHash<'_>) -> Json {
    match h {
        BlockHash::Int(i) => int_json(*i),
        BlockHash::Bytes(b) => hex(b).into(),
    }
}

fn hashes_json(hs: &[BlockHash<'_>]) -> Json {
    hs.iter().map(hash_json).collect()
}

fn tokens_json(t: &TokenIds<'_>) -> Json {
    match t.pairs() {
        Some(pairs) => pairs.iter().map(|[a, b]| json!([a, b])).collect(),
        None => t.iter().map(Json::from).collect(),
    }
}

fn medium_json(m: Option<&Medium<'_>>) -> Json {
    m.map_or(Json::Null, |m| Json::from(&*m.0))
}

fn str_json(s: &Option<Cow<'_, str>>) -> Json {
    s.as_deref().map_or(Json::Null, Json::from)
}

fn value_json(v: &Value<'_>) -> Json {
    match v {
        Value::Nil => Json::Null,
        Value::Bool(b) => (*b).into(),
        Value::Int(i) => int_json(*i),
        Value::Float(f) => Number::from_f64(*f).map_or(Json::Null, Json::Number),
        Value::Str(s) => Json::from(&**s),
        Value::Bytes(b) => json!({ "hex": hex(b) }),
        Value::Array(items) => items.iter().map(value_json).collect(),
        Value::Map(entries) => {
            let pairs = entries
                .iter()
                .map(|(k, v)| Json::Array(vec![value_json(k), value_json(v)]))
                .collect();
            Json::Object(Map::from_iter([("map".to_owned(), Json::Array(pairs))]))
        }
    }
}

fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(DIGITS[usize::from(x >> 4)] as char);
        s.push(DIGITS[usize::from(x & 0xf)] as char);
    }
    s
}

/// Builds a batch from its normalized JSON value, borrowing its strings.
///
/// Absent keys count as null; keys unknown for an event type are an error (a typo must not
/// silently drop a field).
pub fn from_json(v: &Json) -> Result<EventBatch<'_>> {
    let obj = object(v, "batch")?;
    known_keys(obj, &["ts", "data_parallel_rank", "events"], "batch")?;
    let ts = obj
        .get("ts")
        .and_then(Json::as_f64)
        .ok_or_else(|| bad("batch: `ts` must be a number".into()))?;
    let data_parallel_rank = opt(obj, "data_parallel_rank", |j| j.as_i64())?;
    let events = obj
        .get("events")
        .and_then(Json::as_array)
        .ok_or_else(|| bad("batch: `events` must be an array".into()))?
        .iter()
        .enumerate()
        .map(|(i, e)| event_from(e).map_err(|err| prefix(err, &format!("events[{i}]"))))
        .collect::<Result<_>>()?;
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
        unknown_events: 0,
    })
}

fn bad(message: String) -> Error {
    Error::new(ErrorKind::BadJson { message }, 0)
}

fn prefix(err: Error, at: &str) -> Error {
    match err.kind() {
        ErrorKind::BadJson { message } => bad(format!("{at}: {message}")),
        _ => err,
    }
}

fn object<'j>(v: &'j Json, what: &str) -> Result<&'j Map<String, Json>> {
    v.as_object()
        .ok_or_else(|| bad(format!("{what} must be an object")))
}

fn known_keys(obj: &Map<String, Json>, known: &[&str], what: &str) -> Result<()> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(bad(format!("{what}: unknown key `{k}`"))),
        None => Ok(()),
    }
}

/// A nullable field: absent or null → None; otherwise `f` must accept it.
fn opt<'j, T>(
    obj: &'j Map<String, Json>,
    key: &str,
    f: impl FnOnce(&'j Json) -> Option<T>,
) -> Result<Option<T>> {
    match obj.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(v) => f(v)
            .map(Some)
            .ok_or_else(|| bad(format!("`{key}` has the wrong type"))),
    }
}

fn req<'j, T>(
    obj: &'j Map<String, Json>,
    key: &str,
    f: impl FnOnce(&'j Json) -> Option<T>,
) -> Result<T> {
    opt(obj, key, f)?.ok_or_else(|| bad(format!("`{key}` is required")))
}

fn event_from(v: &Json) -> Result<Event<'_>> {
    let obj = object(v, "event")?;
    let tag = req(obj, "type", Json::as_str)?;
    let cow = |k: &str| opt(obj, k, |j| j.as_str().map(Cow::Borrowed));
    match tag {
        "BlockStored" => {
            let mut keys = vec!["type", "cache_salt"];
            keys.extend(STORED_FIELDS);
            known_keys(obj, &keys, "BlockStored")?;
            Ok(Event::BlockStored(BlockStored {
                block_hashes: req(obj, "block_hashes", hashes_from)?,
                parent_block_hash: opt(obj, "parent_block_hash", hash_from)?,
                token_ids: req(obj, "token_ids", tokens_from)?,
                block_size: req(obj, "block_size", |j| {
                    j.as_u64().and_then(|v| u32::try_from(v).ok())
                })?,
                lora_id: opt(obj, "lora_id", Json::as_i64)?,
                medium: opt(obj, "medium", |j| j.as_str().map(Medium::from))?,
                lora_name: cow("lora_name")?,
                cache_salt: cow("cache_salt")?,
                extra_keys: opt(obj, "extra_keys", extra_keys_from)?,
                group_idx: opt(obj, "group_idx", Json::as_i64)?,
                kv_cache_spec_kind: cow("kv_cache_spec_kind")?,
                kv_cache_spec_sliding_window: opt(
                    obj,
                    "kv_cache_spec_sliding_window",
                    Json::as_i64,
                )?,
                locality: cow("locality")?,
                ownership: cow("ownership")?,
                session_id: cow("session_id")?,
                lookahead_token_ids: opt(obj, "lookahead_token_ids", |j| {
                    j.as_array()?.iter().map(tokens_from).collect()
                })?,
            }))
        }
        "BlockRemoved" => {
            let mut keys = vec!["type"];
            keys.extend(REMOVED_FIELDS);
            known_keys(obj, &keys, "BlockRemoved")?;
            Ok(Event::BlockRemoved(BlockRemoved {
                block_hashes: req(obj, "block_hashes", hashes_from)?,
                medium: opt(obj, "medium", |j| j.as_str().map(Medium::from))?,
                group_idx: opt(obj, "group_idx", Json::as_i64)?,
                locality: cow("locality")?,
                ownership: cow("ownership")?,
            }))
        }
        "AllBlocksCleared" => {
            known_keys(obj, &["type", "medium"], "AllBlocksCleared")?;
            Ok(Event::AllBlocksCleared(AllBlocksCleared {
                medium: opt(obj, "medium", |j| j.as_str().map(Medium::from))?,
            }))
        }
        other => Err(bad(format!("unknown event type `{other}`"))),
    }
}

fn int_from(j: &Json) -> Option<Int> {
    j.as_u64()
        .map(Int::U64)
        .or_else(|| j.as_i64().map(Int::from_i64))
}

fn hash_from(j: &Json) -> Option<BlockHash<'static>> {
    match j {
        Json::String(s) => unhex(s).map(|b| BlockHash::Bytes(Cow::Owned(b))),
        _ => int_from(j).map(BlockHash::Int),
    }
}

fn hashes_from(j: &Json) -> Option<Vec<BlockHash<'static>>> {
    j.as_array()?.iter().map(hash_from).collect()
}

fn tokens_from(j: &Json) -> Option<TokenIds<'static>> {
    let items = j.as_array()?;
    // SGLang's EAGLE pairs: `[[t_i, t_i+1], …]`.
    if items.first().is_some_and(Json::is_array) {
        let u32_of = |t: &Json| t.as_u64().and_then(|v| u32::try_from(v).ok());
        let pairs: Option<Vec<[u32; 2]>> = items
            .iter()
            .map(|p| match p.as_array()?.as_slice() {
                [a, b] => Some([u32_of(a)?, u32_of(b)?]),
                _ => None,
            })
            .collect();
        return pairs.map(TokenIds::from);
    }
    let ids: Option<Vec<u32>> = j
        .as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|v| u32::try_from(v).ok()))
        .collect();
    ids.map(TokenIds::from)
}

fn extra_keys_from(j: &Json) -> Option<Vec<Option<Vec<Value<'_>>>>> {
    j.as_array()?
        .iter()
        .map(|entry| match entry {
            Json::Null => Some(None),
            Json::Array(vals) => vals.iter().map(value_from).collect::<Option<_>>().map(Some),
            _ => None,
        })
        .collect()
}

fn value_from(j: &Json) -> Option<Value<'_>> {
    Some(match j {
        Json::Null => Value::Nil,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) if n.is_f64() => Value::Float(n.as_f64()?),
        Json::Number(_) => Value::Int(int_from(j)?),
        Json::String(s) => Value::Str(Cow::Borrowed(s)),
        Json::Array(items) => Value::Array(items.iter().map(value_from).collect::<Option<_>>()?),
        Json::Object(o) => match (o.get("hex"), o.get("map"), o.len()) {
            (Some(Json::String(h)), None, 1) => Value::Bytes(Cow::Owned(unhex(h)?)),
            (None, Some(Json::Array(entries)), 1) => Value::Map(
                entries
                    .iter()
                    .map(|e| match e.as_array()?.as_slice() {
                        [k, v] => Some((value_from(k)?, value_from(v)?)),
                        _ => None,
                    })
                    .collect::<Option<_>>()?,
            ),
            _ => return None,
        },
    })
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes()
        .chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}
