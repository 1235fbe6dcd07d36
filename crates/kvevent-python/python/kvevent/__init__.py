"""vLLM and SGLang KV-cache events for Python, on kvevent's Rust crates.

- ``Fleet()``: a router's replicas in one prefix index, each followed through its sidecar's
  feed; ``score`` / ``score_among`` say which replicas hold the longest prefix of a request and
  how far to trust each answer (route on ``exact``); ``await ready()`` / ``ready_blocking()``,
  ``changes()`` for ``async for`` and ``for``; ``record`` / ``accounting`` for predicted against
  realized.
- ``Router(fleet, policy="cost")``: the routing loop (the Rust crate's): ``choose`` where a
  request goes, weighing what each replica holds against its engine's load (``Load``) and what
  this router has in flight (``start`` a ``Flight``, ``finish`` it with the engine's cached
  tokens), passing over replicas known down; ``retry`` after a replica failed a request;
  ``prefix-only``, ``least-loaded`` and ``round-robin`` to compare.
- ``fingerprint_keys(token_ids, block_size, parent=None)``: the prefix keys a gateway computes
  (XXH3-64 fingerprint chain), the keys a sidecar's feed carries.
- ``decode(payload, engine="vllm")``: one ZMQ payload of any vLLM (0.9.0 on) or SGLang (0.4.6
  on) release as a dict, in the normalized form of ``testdata/vectors/README.md``.
- ``Recording(path)``: a ``kvevents record`` file, iterated record by record.

Errors carry the library's own words: ``ValueError`` for a bad argument (``DecodeError`` and
``RecordingError`` are ones); ``NotReady`` (and ``BlockSizeUnknown``) for replicas not exact
in time; ``NotFollowed`` (a ``KeyError``) for a name the fleet does not follow.
"""

# The one list of public names: each imported `as` itself (a re-export type checkers honour;
# without `__all__`, `import *` takes the names not starting with `_`: these).
from ._fleet import Changes as Changes, Fleet as Fleet
from ._types import Keys as Keys, Reason as Reason, State as State, TokenIds as TokenIds
from ._kvevent import (
    ENGINES as ENGINES,
    ERROR_BUCKETS as ERROR_BUCKETS,
    Accounting as Accounting,
    BlockSizeUnknown as BlockSizeUnknown,
    Change as Change,
    Choice as Choice,
    DecodeError as DecodeError,
    Flight as Flight,
    IndexStats as IndexStats,
    Load as Load,
    Member as Member,
    NotFollowed as NotFollowed,
    NotReady as NotReady,
    RankStatus as RankStatus,
    Record as Record,
    Recording as Recording,
    RecordingError as RecordingError,
    ReplicaStatus as ReplicaStatus,
    Router as Router,
    Score as Score,
    Scores as Scores,
    __version__ as __version__,
    decode as decode,
    fingerprint_keys as fingerprint_keys,
)
