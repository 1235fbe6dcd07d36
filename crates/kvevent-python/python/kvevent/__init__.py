"""vLLM and SGLang KV-cache events for Python, on kvevent's Rust crates.

- ``fingerprint_keys(token_ids, block_size, parent=None)``: the prefix keys a gateway computes
  (XXH3-64 fingerprint chain), the keys a sidecar's feed carries.
- ``decode(payload, engine="vllm")``: one ZMQ payload of any vLLM (0.9.0 on) or SGLang (0.4.6
  on) release as a dict, in the normalized form of ``testdata/vectors/README.md``.
- ``Recording(path)``: a ``kvevents record`` file, iterated record by record.

Errors are ``DecodeError`` and ``RecordingError`` (both ``ValueError``), and ``ValueError`` for
a bad argument, with the library's own words.
"""

from ._kvevent import (
    DecodeError,
    Record,
    Recording,
    RecordingError,
    __version__,
    decode,
    fingerprint_keys,
)

__all__ = [
    "DecodeError",
    "Record",
    "Recording",
    "RecordingError",
    "__version__",
    "decode",
    "fingerprint_keys",
]
