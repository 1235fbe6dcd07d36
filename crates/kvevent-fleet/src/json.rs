//! What a router answers over HTTP, in one JSON shape for every router built on a [`Fleet`]:
//! `POST /score`'s request ([`ScoreRequest`]) and answer ([`scores`]), and `GET /replicas`
//! ([`replicas`]). The example router serves them; a gateway that asks several routers reads
//! one shape.
//!
//! ```
//! use kvevent_fleet::json::ScoreRequest;
//! let r = ScoreRequest::parse(br#"{"model": "m", "token_ids": [1, 2, 3], "candidates": ["a"]}"#)?;
//! assert_eq!((r.token_ids.len(), r.candidates.as_deref()), (3, Some(&["a".to_owned()][..])));
//! assert!(ScoreRequest::parse(br#"{"model": "m", "token_ids": [-1]}"#).is_err());
//! # Ok::<(), String>(())
//! ```

use std::time::Instant;

use serde_json::{Value, json};

use crate::{Fleet, ReplicaState, Scores, Tier, route};

/// `POST /score`'s body: `{"model", "adapter"?, "token_ids", "block_size"?, "candidates"?}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScoreRequest {
    /// The model asked about ("" when not given).
    pub model: String,
    /// The LoRA adapter ("" for the base model).
    pub adapter: String,
    /// The prompt's token ids.
    pub token_ids: Vec<u32>,
    /// Tokens per block, when the caller says.
    pub block_size: Option<usize>,
    /// The replicas to score, when not all.
    pub candidates: Option<Vec<String>>,
}

impl ScoreRequest {
    /// The body parsed; else why it is a bad request (400).
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
        let token_ids = match &v["token_ids"] {
            Value::Array(ids) => token_ids(ids)
                .ok_or_else(|| "`token_ids` must hold unsigned 32-bit integers".to_owned())?,
            _ => return Err("`token_ids` must be an array of token ids".into()),
        };
        let text = |key: &str| v[key].as_str().unwrap_or_default().to_owned();
        Ok(Self {
            model: text("model"),
            adapter: text("adapter"),
            token_ids,
            block_size: v["block_size"].as_u64().map(|b| b as usize),
            candidates: v["candidates"].as_array().map(|c| {
                c.iter()
                    .filter_map(|n| Some(n.as_str()?.to_owned()))
                    .collect()
            }),
        })
    }
}

/// An array of token ids, each an unsigned 32-bit integer; `None` if one is not.
pub fn token_ids(ids: &[Value]) -> Option<Vec<u32>> {
    ids.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

/// `POST /score`'s answer: each score best first, with its replica's state and why (`exact`
/// true only when the index vouches for it), and the candidates asked about that no replica
/// of that name is followed (`not_followed`).
pub fn scores(scores: &Scores, candidates: Option<&[&str]>) -> Value {
    let not_followed: Vec<&str> = candidates
        .map(|c| scores.unknown().iter().map(|i| c[*i]).collect())
        .unwrap_or_default();
    json!({
        "scores": scores.iter().map(|s| json!({
            "replica": s.replica,
            "matched_tokens": s.matched_tokens,
            "matched_blocks": s.matched_blocks,
            "tier": match s.tier { Tier::T1 => "T1", Tier::T2 => "T2" },
            "state": s.state.as_str(),
            "reason": s.state.reason(),
            "exact": s.state == ReplicaState::Exact,
        })).collect::<Vec<_>>(),
        "not_followed": not_followed,
    })
}

/// `GET /replicas`: every replica of the router's fleet (where it is followed from, its state
/// and why, the last error, its engine's ranks, blocks held, the age of its newest change, its
/// engine's load with its age and whether it is too old to route on), and the router's policy
/// and weights.
pub fn replicas(router: &route::Router) -> Value {
    let fleet: &Fleet = router.fleet();
    let now = Instant::now();
    json!({
        "replicas": fleet.replicas().iter().map(|r| json!({
            "name": r.name,
            "source": r.source,
            "state": r.state.as_str(),
            "reason": r.state.reason(),
            "stale_for_ms": match r.state {
                ReplicaState::Stale { since, .. } => Some(since.elapsed().as_millis() as u64),
                _ => None,
            },
            "error": r.error,
            "ranks": r.ranks.iter().map(|k| json!({
                "rank": k.rank,
                "connected": k.connected,
                "for_ms": k.since.map(|d| d.as_millis() as u64),
                "degraded": k.degraded,
            })).collect::<Vec<_>>(),
            "blocks": r.blocks,
            "newest_change_ms": r.newest_change.map(|d| d.as_millis() as u64),
            "block_size": r.block_size,
            "load": r.load.as_ref().map(|l| {
                let age = l.age(now);
                json!({
                    "running": l.load.running(),
                    "waiting": l.load.waiting(),
                    "kv_usage": l.load.kv_usage(),
                    "ranks": l.load.ranks.iter().map(|rank| rank
                        .figures()
                        .into_iter()
                        .map(|(name, figure)| (name.to_owned(), match figure {
                            crate::Figure::Count(n) => json!(n),
                            crate::Figure::Fraction(f) => json!(f),
                        }))
                        .collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
                    "age_ms": age.as_millis() as u64,
                    "old": age > router.rule().load_old_after(),
                    "error": r.load_error,
                })
            }),
        })).collect::<Vec<_>>(),
        "policy": router.rule().policy().as_str(),
        "weights": router.weights().map(|w| json!({
            "prefill_us_per_token": w.weights.prefill_us_per_token,
            "queue_us_per_request": w.weights.queue_us_per_request,
            "learned": w.learned,
            "flights": w.flights,
        })),
    })
}
