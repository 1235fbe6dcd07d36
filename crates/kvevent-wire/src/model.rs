//! The decoded form of a batch: every field of the newest release, typed.
//!
//! Everything borrows from the payload it was decoded from (`'a`); token ids are not even
//! copied out until iterated. Values built by hand (or from JSON) use the owned variants.

use std::borrow::Cow;

/// A msgpack integer of any width: `U64` for values ≥ 0, `I64` for negative ones.
///
/// [`Int::from_i64`] keeps that normal form, so two equal numbers compare equal whatever
/// width they arrived in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Int {
    /// A non-negative value.
    U64(u64),
    /// A negative value.
    I64(i64),
}

impl Int {
    /// The normal form of a signed value.
    pub fn from_i64(v: i64) -> Self {
        if v >= 0 {
            Self::U64(v as u64)
        } else {
            Self::I64(v)
        }
    }

    /// The value as `i64`, when it fits.
    pub fn as_i64(self) -> Option<i64> {
        match self {
            Self::U64(v) => i64::try_from(v).ok(),
            Self::I64(v) => Some(v),
        }
    }

    /// The value as `f64` (rounded for magnitudes beyond 2^53).
    pub fn as_f64(self) -> f64 {
        match self {
            Self::U64(v) => v as f64,
            Self::I64(v) => v as f64,
        }
    }

    /// The 64 bits of the value, big-endian, two's complement for a negative value.
    pub fn to_be_bytes(self) -> [u8; 8] {
        match self {
            Self::U64(v) => v.to_be_bytes(),
            Self::I64(v) => v.to_be_bytes(),
        }
    }
}

/// One block hash, as opaque as the engine made it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash<'a> {
    /// An integer hash: signed (0.9.x builtin hashing) or unsigned (0.10.2+).
    Int(Int),
    /// A raw digest (`bin`), 16 or 32 bytes in practice.
    Bytes(Cow<'a, [u8]>),
}

impl BlockHash<'_> {
    /// The hash as bytes: an integer as its 8 bytes big-endian (two's complement when
    /// negative), a digest as it is.
    ///
    /// ```
    /// use kvevent_wire::{BlockHash, Int};
    /// assert_eq!(&*BlockHash::Int(Int::I64(-1)).to_bytes(), &[0xff; 8]);
    /// assert_eq!(&*BlockHash::Int(Int::U64(1)).to_bytes(), &[0, 0, 0, 0, 0, 0, 0, 1]);
    /// ```
    pub fn to_bytes(&self) -> Cow<'_, [u8]> {
        match self {
            Self::Int(i) => Cow::Owned(i.to_be_bytes().to_vec()),
            Self::Bytes(b) => Cow::Borrowed(b),
        }
    }

    /// A copy that owns its bytes.
    pub fn into_owned(self) -> BlockHash<'static> {
        match self {
            Self::Int(i) => BlockHash::Int(i),
            Self::Bytes(b) => BlockHash::Bytes(Cow::Owned(b.into_owned())),
        }
    }
}

/// Token ids of an event: still msgpack on the wire side (read while iterating), or owned.
#[derive(Debug, Clone)]
pub struct TokenIds<'a>(TokenRepr<'a>);

#[derive(Debug, Clone)]
enum TokenRepr<'a> {
    /// The bytes of the array's elements, already checked to be `len` integers in `u32` range.
    Wire {
        raw: &'a [u8],
        len: usize,
    },
    Owned(Vec<u32>),
    /// SGLang under EAGLE speculative decoding (0.5.3+): `len` pairs `[t_i, t_i+1]`, each a
    /// 2-element array of integers in `u32` range, already checked.
    WirePairs {
        raw: &'a [u8],
        len: usize,
    },
    OwnedPairs(Vec<[u32; 2]>),
}

impl Default for TokenIds<'_> {
    fn default() -> Self {
        Self(TokenRepr::Owned(Vec::new()))
    }
}

impl PartialEq for TokenIds<'_> {
    fn eq(&self, other: &Self) -> bool {
        match (self.pairs(), other.pairs()) {
            (None, None) => self.len() == other.len() && self.iter().eq(other.iter()),
            (a, b) => a == b,
        }
    }
}

impl From<Vec<[u32; 2]>> for TokenIds<'_> {
    fn from(v: Vec<[u32; 2]>) -> Self {
        Self(TokenRepr::OwnedPairs(v))
    }
}

impl From<Vec<u32>> for TokenIds<'_> {
    fn from(v: Vec<u32>) -> Self {
        Self(TokenRepr::Owned(v))
    }
}

impl<'a> TokenIds<'a> {
    /// Wraps array elements the decoder has checked: `len` msgpack ints, each in `u32` range.
    pub(crate) fn from_wire(raw: &'a [u8], len: usize) -> Self {
        Self(TokenRepr::Wire { raw, len })
    }

    /// Wraps checked pairs: `len` 2-element arrays of msgpack ints in `u32` range.
    pub(crate) fn from_wire_pairs(raw: &'a [u8], len: usize) -> Self {
        Self(TokenRepr::WirePairs { raw, len })
    }

    /// How many token ids (for EAGLE pairs: how many pairs, the tokens they stand for).
    pub fn len(&self) -> usize {
        match &self.0 {
            TokenRepr::Wire { len, .. } | TokenRepr::WirePairs { len, .. } => *len,
            TokenRepr::Owned(v) => v.len(),
            TokenRepr::OwnedPairs(v) => v.len(),
        }
    }

    /// True when the ids came as SGLang's EAGLE pairs `[t_i, t_i+1]`.
    pub fn is_pairs(&self) -> bool {
        matches!(
            self.0,
            TokenRepr::WirePairs { .. } | TokenRepr::OwnedPairs(_)
        )
    }

    /// The pairs as sent, when the ids came as EAGLE pairs.
    pub fn pairs(&self) -> Option<Vec<[u32; 2]>> {
        match &self.0 {
            TokenRepr::OwnedPairs(v) => Some(v.clone()),
            TokenRepr::WirePairs { raw, len } => {
                let mut raw: &[u8] = raw;
                let mut out = Vec::with_capacity(*len);
                for _ in 0..*len {
                    // Each pair is a fixarray of 2 (0x92), checked by the decoder.
                    raw = raw.get(1..)?;
                    let a = wire_token(&mut raw)?;
                    let b = wire_token(&mut raw)?;
                    out.push([a, b]);
                }
                Some(out)
            }
            TokenRepr::Wire { .. } | TokenRepr::Owned(_) => None,
        }
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token ids in order.
    ///
    /// EAGLE pairs stand for their first tokens: pair `i` is `[t_i, t_i+1]`, so a block of
    /// `block_size` pairs covers tokens `t_i … t_i+block_size-1`, and its second elements
    /// repeat the next pair's first (the last one's belongs to the next block).
    pub fn iter(&self) -> TokenIter<'_> {
        match &self.0 {
            TokenRepr::Wire { raw, len } => TokenIter::Wire { raw, left: *len },
            TokenRepr::Owned(v) => TokenIter::Owned(v.iter()),
            TokenRepr::WirePairs { raw, len } => TokenIter::Pairs { raw, left: *len },
            TokenRepr::OwnedPairs(v) => TokenIter::OwnedPairs(v.iter()),
        }
    }

    /// Appends the token ids to `out`: one copy when they are owned, one tight loop over the
    /// wire's bytes otherwise (the iterator's per-element dispatch and growth checks cost
    /// about ten instructions a token).
    pub fn extend_into(&self, out: &mut Vec<u32>) {
        match &self.0 {
            TokenRepr::WirePairs { .. } | TokenRepr::OwnedPairs(_) => out.extend(self.iter()),
            TokenRepr::Owned(v) => out.extend_from_slice(v),
            TokenRepr::Wire { raw, len } => {
                out.reserve(*len);
                let mut raw: &[u8] = raw;
                for _ in 0..*len {
                    match wire_token(&mut raw) {
                        Some(v) => out.push(v),
                        None => break,
                    }
                }
            }
        }
    }

    /// The token ids copied into a vector.
    pub fn to_vec(&self) -> Vec<u32> {
        match &self.0 {
            TokenRepr::Owned(v) => v.clone(),
            _ => self.iter().collect(),
        }
    }
}

/// The next token id of checked wire bytes, and `raw` moved past it. The decoder checked every
/// element: an int marker, its bytes present, and a value in u32 range. Non-negative values
/// may still come in a signed form.
#[inline]
fn wire_token(raw: &mut &[u8]) -> Option<u32> {
    let (&m, rest) = raw.split_first()?;
    let (v, used) = match m {
        0x00..=0x7f => (u32::from(m), 0),
        0xcc | 0xd0 => (u32::from(*rest.first()?), 1),
        0xcd | 0xd1 => (u32::from(u16::from_be_bytes(be(rest)?)), 2),
        0xce | 0xd2 => (u32::from_be_bytes(be(rest)?), 4),
        _ => (u64::from_be_bytes(be(rest)?) as u32, 8),
    };
    *raw = &rest[used..];
    Some(v)
}

/// Iterator over [`TokenIds`].
#[derive(Debug, Clone)]
pub enum TokenIter<'t> {
    #[doc(hidden)]
    Wire { raw: &'t [u8], left: usize },
    #[doc(hidden)]
    Owned(std::slice::Iter<'t, u32>),
    #[doc(hidden)]
    Pairs { raw: &'t [u8], left: usize },
    #[doc(hidden)]
    OwnedPairs(std::slice::Iter<'t, [u32; 2]>),
}

impl Iterator for TokenIter<'_> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        match self {
            Self::Owned(it) => it.next().copied(),
            Self::Wire { raw, left } => {
                if *left == 0 {
                    return None;
                }
                *left -= 1;
                wire_token(raw)
            }
            Self::Pairs { raw, left } => {
                if *left == 0 {
                    return None;
                }
                *left -= 1;
                // The pair's header (0x92), its first token, then its second, skipped.
                *raw = raw.get(1..)?;
                let first = wire_token(raw)?;
                wire_token(raw)?;
                Some(first)
            }
            Self::OwnedPairs(it) => it.next().map(|p| p[0]),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = match self {
            Self::Owned(it) => it.len(),
            Self::OwnedPairs(it) => it.len(),
            Self::Wire { left, .. } | Self::Pairs { left, .. } => *left,
        };
        (n, Some(n))
    }
}

impl ExactSizeIterator for TokenIter<'_> {}

fn be<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    s.get(..N)?.try_into().ok()
}

/// Where a block lives, as the engine spelled it (`"GPU"`, `"cpu"`, …).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Medium<'a>(pub Cow<'a, str>);

impl<'a> From<&'a str> for Medium<'a> {
    fn from(s: &'a str) -> Self {
        Self(Cow::Borrowed(s))
    }
}

/// The known media, compared case-insensitively.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MediumKind {
    /// GPU memory: the engine's own KV cache.
    Gpu,
    /// CPU memory (offloading connectors, LMCache, Mooncake).
    Cpu,
    /// Local storage tier.
    Storage,
    /// File-system tier (0.26).
    Fs,
    /// Object-store tier (0.26).
    Obj,
    /// CXL-attached memory.
    Cxl,
    /// Anything else: kept as spelled in [`Medium`].
    Other,
}

impl Medium<'_> {
    /// The medium's kind, ignoring case.
    pub fn kind(&self) -> MediumKind {
        let s = &*self.0;
        // Nearly every event says GPU, as vLLM spells it.
        if s == "GPU" {
            return MediumKind::Gpu;
        }
        [
            ("GPU", MediumKind::Gpu),
            ("CPU", MediumKind::Cpu),
            ("STORAGE", MediumKind::Storage),
            ("FS", MediumKind::Fs),
            ("OBJ", MediumKind::Obj),
            ("CXL", MediumKind::Cxl),
        ]
        .into_iter()
        .find(|(name, _)| s.eq_ignore_ascii_case(name))
        .map_or(MediumKind::Other, |(_, k)| k)
    }
}

/// A small msgpack value tree (the elements of `extra_keys`).
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    /// nil
    Nil,
    /// true or false
    Bool(bool),
    /// An integer of any width.
    Int(Int),
    /// A float.
    Float(f64),
    /// A string (a LoRA name, a cache salt, a multimodal identifier).
    Str(Cow<'a, str>),
    /// Binary (a prompt-embeds digest).
    Bytes(Cow<'a, [u8]>),
    /// An array (a `[identifier, offset]` multimodal item).
    Array(Vec<Value<'a>>),
    /// A map, in wire order.
    Map(Vec<(Value<'a>, Value<'a>)>),
}

/// Blocks newly held by the engine.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockStored<'a> {
    /// Chained prefix hashes, one per full block.
    pub block_hashes: Vec<BlockHash<'a>>,
    /// Hash of the block before the first one here; `None` when the prefix starts at token 0.
    pub parent_block_hash: Option<BlockHash<'a>>,
    /// The blocks' tokens, concatenated.
    pub token_ids: TokenIds<'a>,
    /// Tokens per block; 0 for an offloading placeholder.
    pub block_size: u32,
    /// The engine's load-order number for the LoRA adapter (replica-local).
    pub lora_id: Option<i64>,
    /// Where the blocks are (0.10.2+).
    pub medium: Option<Medium<'a>>,
    /// The LoRA adapter's name (0.14+; SGLang 0.5.22+).
    pub lora_name: Option<Cow<'a, str>>,
    /// SGLang's cache salt (0.5.18+): a salted prefix is its own namespace.
    pub cache_salt: Option<Cow<'a, str>>,
    /// Per block: nil or the extra hash inputs (0.17+).
    pub extra_keys: Option<Vec<Option<Vec<Value<'a>>>>>,
    /// KV-cache group of a hybrid model (0.20+).
    pub group_idx: Option<i64>,
    /// KV-cache spec of the group, e.g. `full_attention` (0.22+).
    pub kv_cache_spec_kind: Option<Cow<'a, str>>,
    /// Sliding window of the group's spec (0.22+).
    pub kv_cache_spec_sliding_window: Option<i64>,
    /// `LOCAL` or `REMOTE` (0.26+).
    pub locality: Option<Cow<'a, str>>,
    /// Ownership tag (0.29+).
    pub ownership: Option<Cow<'a, str>>,
    /// Session id (0.30+).
    pub session_id: Option<Cow<'a, str>>,
    /// Speculative lookahead token ids per block (0.33+).
    pub lookahead_token_ids: Option<Vec<TokenIds<'a>>>,
}

/// Blocks the engine no longer holds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockRemoved<'a> {
    /// The removed blocks' hashes.
    pub block_hashes: Vec<BlockHash<'a>>,
    /// Where they were removed from (0.10.2+).
    pub medium: Option<Medium<'a>>,
    /// KV-cache group (0.20+).
    pub group_idx: Option<i64>,
    /// `LOCAL` or `REMOTE` (0.26+).
    pub locality: Option<Cow<'a, str>>,
    /// Ownership tag (0.29+).
    pub ownership: Option<Cow<'a, str>>,
}

/// The engine's prefix cache was cleared.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllBlocksCleared<'a> {
    /// The tier cleared, when only one was (a shape Dynamo's wire types accept and engines are
    /// moving to; vLLM up to 0.33 never sends it). `None`: everything was cleared.
    pub medium: Option<Medium<'a>>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
#[allow(
    clippy::large_enum_variant,
    reason = "events live in one Vec per batch; boxing would allocate once per event"
)]
pub enum Event<'a> {
    /// `BlockStored`
    BlockStored(BlockStored<'a>),
    /// `BlockRemoved`
    BlockRemoved(BlockRemoved<'a>),
    /// `AllBlocksCleared`: the engine reset its prefix cache (or, with a medium, one tier).
    AllBlocksCleared(AllBlocksCleared<'a>),
}

impl Event<'_> {
    /// The event's tag as vLLM writes it.
    pub fn tag(&self) -> &'static str {
        match self {
            Self::BlockStored(_) => "BlockStored",
            Self::BlockRemoved(_) => "BlockRemoved",
            Self::AllBlocksCleared(_) => "AllBlocksCleared",
        }
    }
}

/// One payload: the events of one scheduler step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EventBatch<'a> {
    /// Engine wall-clock time, seconds since the epoch.
    pub ts: f64,
    /// The events in the order the engine produced them.
    pub events: Vec<Event<'a>>,
    /// Data-parallel rank of the publishing engine (absent in 0.9.0).
    pub data_parallel_rank: Option<i64>,
    /// Events with a tag this crate does not know, skipped while decoding.
    pub unknown_events: usize,
}

impl<'a> EventBatch<'a> {
    /// A batch of `events` at `ts`, with no DP rank (set `data_parallel_rank` for one).
    ///
    /// ```
    /// use kvevent_wire::{AllBlocksCleared, Event, EventBatch};
    /// let batch = EventBatch::new(1.5, vec![Event::AllBlocksCleared(AllBlocksCleared::default())]);
    /// assert_eq!((batch.ts, batch.events.len(), batch.data_parallel_rank), (1.5, 1, None));
    /// ```
    pub fn new(ts: f64, events: Vec<Event<'a>>) -> Self {
        Self {
            ts,
            events,
            data_parallel_rank: None,
            unknown_events: 0,
        }
    }
}
