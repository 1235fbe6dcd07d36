#!/usr/bin/env python3
"""A KV-event publisher built the way SGLang's is (sglang/srt/disaggregation/kv_events.py, per
shared/spec/sglang-kv-events.md): msgspec structs encoded with msgspec.msgpack.Encoder(), a pyzmq
PUB socket sending [topic, seq (8 bytes big-endian), payload], and a ROUTER replay socket
answering [identity, "", start] with the buffered batches in the release's reply format
(["", seq, payload] before 0.5.22, ["", topic, seq, payload] from it), then the end marker.

Prints one JSON line with its endpoints, then publishes batch i (i = 0, 1, ...) every
--interval seconds until --count batches or stdin closes. Batch i holds:
  BlockStored(block_hashes=[h(2i+1), h(2i+2)], parent = h(2i) if i else None,
              token_ids=range(32i, 32i+32) (with --eagle: pairs [t, t+1]), block_size=16,
              medium="GPU" from 0.5.9, and for odd i with --salt S its cache_salt S)
and, for odd i, BlockRemoved(block_hashes=[h(2i-1)]); h(n) = -(n + --hash-base): SGLang's
hashes are signed 64-bit. --port / --replay-port bind fixed ports (a restarted engine takes
them back).
"""
import time
from typing import Optional, Union

import msgspec

import publisher_common


def structs(release):
    """The release's structs: tagged arrays up to 0.5.19 (a salted store's 8th element a map in
    0.5.18-0.5.19), tagged maps from 0.5.20; the batch always an array."""
    map_era = release >= (0, 5, 20)
    opts = dict(tag=True, omit_defaults=True, gc=False, array_like=not map_era)
    stored = [("block_hashes", list[int]), ("parent_block_hash", Optional[int]),
              ("token_ids", list), ("block_size", int), ("lora_id", Optional[int])]
    removed = [("block_hashes", list[int])]
    if release >= (0, 5, 9):
        stored.append(("medium", Optional[str], None))
        removed.append(("medium", Optional[str], None))
    if map_era:
        stored += [("cache_salt", Optional[str], None), ("session_id", Optional[str], None)]
        if release >= (0, 5, 22):
            stored.append(("lora_name", Optional[str], None))
    BlockStored = msgspec.defstruct("BlockStored", stored, **opts)
    BlockRemoved = msgspec.defstruct("BlockRemoved", removed, **opts)
    Salted = None
    if (0, 5, 18) <= release < (0, 5, 20):
        Metadata = msgspec.defstruct("BlockStoredMetadata", [("cache_salt", str)],
                                     omit_defaults=True, gc=False)
        Salted = msgspec.defstruct("BlockStoredWithMetadata", [("metadata", Metadata)],
                                   bases=(BlockStored,), tag="BlockStored", kw_only=True)
        Salted.Metadata = Metadata
    fields = [("ts", float), ("events", list)]
    if release >= (0, 4, 7):
        fields.append(("attn_dp_rank", Optional[int], None))
    Batch = msgspec.defstruct("KVEventBatch", fields, array_like=True, omit_defaults=True, gc=False)
    return Batch, BlockStored, BlockRemoved, Salted


def parse_release(s):
    return tuple(int(x) for x in s.split(".post")[0].split("."))


def main():
    ap = publisher_common.arguments("0.5.23")
    ap.add_argument("--eagle", action="store_true", help="token ids as EAGLE pairs")
    ap.add_argument("--salt", default=None, help="odd batches' stores are salted with it")
    a = ap.parse_args()
    release = parse_release(a.release)
    Batch, BlockStored, BlockRemoved, Salted = structs(release)
    medium = {"medium": "GPU"} if release >= (0, 5, 9) else {}

    encoder = msgspec.msgpack.Encoder()

    def h(n):
        return -(n + a.hash_base)

    def payload_of(i):
        tokens = list(range(32 * i, 32 * i + 32))
        if a.eagle:
            tokens = [[t, t + 1] for t in tokens]
        fields = dict(block_hashes=[h(2 * i + 1), h(2 * i + 2)],
                      parent_block_hash=h(2 * i) if i else None,
                      token_ids=tokens, block_size=16, lora_id=None, **medium)
        salted = a.salt is not None and i % 2 == 1
        if salted and Salted is not None:
            store = Salted(metadata=Salted.Metadata(cache_salt=a.salt), **fields)
        elif salted and release >= (0, 5, 20):
            store = BlockStored(cache_salt=a.salt, **fields)
        else:
            store = BlockStored(**fields)
        events = [store]
        if i % 2 == 1:
            events.append(BlockRemoved(block_hashes=[h(2 * i - 1)], **medium))
        kwargs = {"attn_dp_rank": a.rank} if release >= (0, 4, 7) else {}
        return encoder.encode(Batch(ts=time.time(), events=events, **kwargs))

    publisher_common.run(a, payload_of, topic_in_replies=release >= (0, 5, 22))


if __name__ == "__main__":
    main()
