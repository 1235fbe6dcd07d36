#!/usr/bin/env python3
"""A KV-event publisher built the way vLLM's is: msgspec structs encoded with
msgspec.msgpack.Encoder, a pyzmq PUB socket sending [topic, seq (8 bytes big-endian), payload],
and a ROUTER replay socket answering [identity, "", start] with the buffered batches in the
release's reply format, then the end marker.

Prints one JSON line with its endpoints, then publishes batch i (i = 0, 1, ...) every
--interval seconds until --count batches or stdin closes. Batch i holds:
  BlockStored(block_hashes=[2*i+1, 2*i+2], parent = 2*i if i else None,
              token_ids=range(32*i, 32*i+32), block_size=16, medium="GPU")
and, for odd i, BlockRemoved(block_hashes=[2*i-1], medium="GPU"); every hash plus --hash-base.
--port / --replay-port bind fixed ports (a restarted engine takes them back).
"""
import time
from typing import Any, Optional, Union

import msgspec

import publisher_common


def structs(release):
    """KVEventBatch for the release: positional events up to 0.23, tagged maps from 0.24."""
    map_era = release >= (0, 24, 0)
    opts = dict(tag=True, omit_defaults=True, gc=False, array_like=not map_era)
    Hash = Union[int, bytes]
    stored = [("block_hashes", list[Hash]), ("parent_block_hash", Optional[Hash]),
              ("token_ids", list[int]), ("block_size", int), ("lora_id", Optional[int])]
    removed = [("block_hashes", list[Hash])]
    if release >= (0, 10, 2):
        stored.append(("medium", Optional[str]))
        removed.append(("medium", Optional[str]))
    if release >= (0, 14, 0):
        stored.append(("lora_name", Optional[str]))
    if map_era:
        stored += [("extra_keys", Optional[list[Optional[list[Any]]]], None),
                   ("group_idx", Optional[int], None)]
        removed.append(("group_idx", Optional[int], None))
    BlockStored = msgspec.defstruct("BlockStored", stored, **opts)
    BlockRemoved = msgspec.defstruct("BlockRemoved", removed, **opts)
    fields = [("ts", float), ("events", list[Union[BlockStored, BlockRemoved]])]
    if release >= (0, 9, 1):
        fields.append(("data_parallel_rank", Optional[int], None))
    Batch = msgspec.defstruct("KVEventBatch", fields, array_like=True, omit_defaults=True, gc=False)
    return Batch, BlockStored, BlockRemoved


def main():
    ap = publisher_common.arguments("0.33.0")
    a = ap.parse_args()
    release = tuple(int(x) for x in a.release.split("."))
    Batch, BlockStored, BlockRemoved = structs(release)
    medium = {"medium": "GPU"} if release >= (0, 10, 2) else {}
    lora = {"lora_name": None} if release >= (0, 14, 0) else {}

    encoder = msgspec.msgpack.Encoder()

    def payload_of(i):
        b = a.hash_base
        events = [BlockStored(block_hashes=[b + 2 * i + 1, b + 2 * i + 2],
                              parent_block_hash=b + 2 * i if i else None,
                              token_ids=list(range(32 * i, 32 * i + 32)), block_size=16,
                              lora_id=None, **medium, **lora)]
        if i % 2 == 1:
            events.append(BlockRemoved(block_hashes=[b + 2 * i - 1], **medium))
        kwargs = {"data_parallel_rank": a.rank} if release >= (0, 9, 1) else {}
        return encoder.encode(Batch(ts=time.time(), events=events, **kwargs))

    publisher_common.run(a, payload_of, topic_in_replies=release >= (0, 26, 0))


if __name__ == "__main__":
    main()
