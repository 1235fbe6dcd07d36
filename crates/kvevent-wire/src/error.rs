//! The one error type of this crate.

use std::fmt;

/// Why a payload or a set of frames could not be decoded, and where.
///
/// `offset` is the byte offset into the payload at which decoding failed (for frame errors,
/// the index of the offending frame).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    offset: usize,
}

/// What went wrong; match on it to decide what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The input ended before the value did.
    Truncated,
    /// A msgpack value of another type than the schema allows.
    UnexpectedType {
        /// What the schema allows at this place.
        expected: &'static str,
        /// The msgpack type found instead.
        found: &'static str,
    },
    /// The byte 0xc1, which msgpack never uses.
    ReservedMarker,
    /// An integer that does not fit the field (token ids are `u32`, sizes are non-negative).
    IntOutOfRange {
        /// The field being read.
        field: &'static str,
    },
    /// A string that is not UTF-8.
    InvalidUtf8,
    /// A mandatory field is absent from a map-encoded struct or a short positional array.
    MissingField {
        /// The field's name.
        field: &'static str,
    },
    /// One of the explicit [`Limits`](crate::Limits) was exceeded.
    LimitExceeded {
        /// Which limit.
        what: &'static str,
        /// Its value.
        limit: usize,
    },
    /// Bytes remain after the batch.
    TrailingBytes,
    /// ZMQ frames that are neither a live message nor a replay reply.
    BadFrames {
        /// What was wrong with them.
        reason: &'static str,
    },
    /// A release number that cannot be parsed or is older than the engine's first with KV
    /// events (vLLM 0.9.0, SGLang 0.4.6.post5).
    BadRelease,
    /// An engine name other than `vllm` or `sglang`.
    BadEngine,
    /// JSON that is not a normalized batch (feature `json`).
    BadJson {
        /// What is wrong, with the path to it.
        message: String,
    },
    /// Encoding: a field holds a value the target release has no field for.
    FieldNotInRelease {
        /// The field's name.
        field: &'static str,
        /// The target release.
        release: crate::Release,
    },
    /// Encoding for SGLang: a field holds a value the target release has no field for.
    FieldNotInSglangRelease {
        /// The field's name.
        field: &'static str,
        /// The target release.
        release: crate::SglangRelease,
    },
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, offset: usize) -> Self {
        Self { kind, offset }
    }

    /// What went wrong.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// Byte offset into the payload (frame index for frame errors) where it went wrong.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated => f.write_str("input ends in the middle of a value"),
            Self::UnexpectedType { expected, found } => {
                write!(f, "expected {expected}, found {found}")
            }
            Self::ReservedMarker => f.write_str("reserved msgpack marker 0xc1"),
            Self::IntOutOfRange { field } => write!(f, "integer out of range for `{field}`"),
            Self::InvalidUtf8 => f.write_str("string is not valid UTF-8"),
            Self::MissingField { field } => write!(f, "missing field `{field}`"),
            Self::LimitExceeded { what, limit } => write!(f, "{what} exceeds the limit of {limit}"),
            Self::TrailingBytes => f.write_str("trailing bytes after the batch"),
            Self::BadFrames { reason } => write!(f, "bad frames: {reason}"),
            Self::BadRelease => f.write_str(
                "not a release number with KV events (vLLM 0.9.0 or later, SGLang 0.4.6.post5 or later)",
            ),
            Self::BadEngine => f.write_str("not an engine: vllm or sglang"),
            Self::BadJson { message } => write!(f, "bad batch JSON: {message}"),
            Self::FieldNotInSglangRelease { field, release } => {
                write!(f, "SGLang {release} has no field `{field}`")
            }
            Self::FieldNotInRelease { field, release } => {
                write!(f, "vLLM {release} has no field `{field}`")
            }
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            ErrorKind::BadFrames { .. } => write!(f, "{} (frame {})", self.kind, self.offset),
            ErrorKind::BadRelease
            | ErrorKind::BadEngine
            | ErrorKind::FieldNotInSglangRelease { .. }
            | ErrorKind::FieldNotInRelease { .. }
            | ErrorKind::BadJson { .. } => {
                write!(f, "{}", self.kind)
            }
            _ => write!(f, "{} at byte {}", self.kind, self.offset),
        }
    }
}

impl std::error::Error for Error {}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
