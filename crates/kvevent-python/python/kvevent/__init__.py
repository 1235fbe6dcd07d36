"""vLLM and SGLang KV-cache events for Python, on kvevent's Rust crates.

- ``Fleet()``: a router's replicas in one prefix index, each followed through its sidecar's
  feed; ``score`` / ``score_among`` say which replicas hold the longest prefix of a request and
  how far to trust each answer (route on ``exact``); ``await ready()`` / ``ready_blocking()``,
  ``changes()`` for ``async for`` and ``for``; ``record`` / ``accounting`` for predicted against
  realized.
- ``Router(fleet, policy="cost")``: the routing rule (the Rust crate's): ``choose`` where a
  request goes, weighing what each replica holds against its engine's load (``Load``) and what
  this router has in flight (``start`` a ``Flight``); ``prefix-only``, ``least-loaded`` and
  ``round-robin`` to compare.
- ``fingerprint_keys(token_ids, block_size, parent=None)``: the prefix keys a gateway computes
  (XXH3-64 fingerprint chain), the keys a sidecar's feed carries.
- ``decode(payload, engine="vllm")``: one ZMQ payload of any vLLM (0.9.0 on) or SGLang (0.4.6
  on) release as a dict, in the normalized form of ``testdata/vectors/README.md``.
- ``Recording(path)``: a ``kvevents record`` file, iterated record by record.

Errors carry the library's own words: ``ValueError`` for a bad argument (``DecodeError`` and
``RecordingError`` are ones); ``NotReady`` (and ``BlockSizeUnknown``) for replicas not exact
in time; ``NotFollowed`` (a ``KeyError``) for a name the fleet does not follow.
"""

from ._fleet import Changes, Fleet
from ._kvevent import (
    ENGINES,
    ERROR_BUCKETS,
    Accounting,
    BlockSizeUnknown,
    Change,
    Choice,
    DecodeError,
    Flight,
    IndexStats,
    Load,
    NotFollowed,
    NotReady,
    RankStatus,
    Record,
    Recording,
    RecordingError,
    ReplicaStatus,
    Router,
    Score,
    Scores,
    __version__,
    decode,
    fingerprint_keys,
)

__all__ = [
    "ENGINES",
    "ERROR_BUCKETS",
    "Accounting",
    "BlockSizeUnknown",
    "Change",
    "Choice",
    "Changes",
    "DecodeError",
    "Flight",
    "Fleet",
    "IndexStats",
    "Load",
    "NotFollowed",
    "NotReady",
    "RankStatus",
    "Record",
    "Recording",
    "RecordingError",
    "ReplicaStatus",
    "Router",
    "Score",
    "Scores",
    "__version__",
    "decode",
    "fingerprint_keys",
]
