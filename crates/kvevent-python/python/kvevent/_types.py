"""The package's type aliases, at run time as for type checkers."""

import array
from typing import Literal, Sequence, Union

# Unions of one-value Literals: what a checker reads as Literal["exact", ...], and a Union at run
# time too (stubtest compares the two).
State = Union[Literal["exact"], Literal["degraded"], Literal["stale"]]
"""How far an answer about a replica can be trusted: route on ``exact``."""

Reason = Union[
    Literal["connecting"],
    Literal["snapshot_loading"],
    Literal["replaying_or_gap"],
    Literal["engine_lost"],
    Literal["unverified"],
    Literal["silent"],
    Literal["lagging"],
    Literal["server_down"],
    Literal["not_ready"],
    Literal["source_lost"],
    Literal["lease_expired"],
]
"""Why a replica is not exact."""

TokenIds = Union[Sequence[int], bytes, bytearray, memoryview, "array.array[int]"]
"""Token ids: a list (or other sequence) of ints; bytes of native-endian u32; or any buffer of
integers (``array.array``, ``memoryview``, a NumPy array of any integer dtype), read at bytes
speed."""

Keys = Union[Sequence[int], bytes, bytearray, memoryview, "array.array[int]"]
"""Prefix keys, block 0 first: as ``TokenIds``, of u64."""
