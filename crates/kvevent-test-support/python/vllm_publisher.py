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
import argparse
import json
import sys
import threading
import time
from typing import Any, Optional, Union

import msgspec
import zmq


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
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", default="0.33.0")
    ap.add_argument("--topic", default="kv-events")
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help="PUB port (0: any free one)")
    ap.add_argument("--replay-port", type=int, default=0, help="replay port (0: any free one)")
    ap.add_argument("--hash-base", type=int, default=0, help="added to every block hash")
    a = ap.parse_args()
    release = tuple(int(x) for x in a.release.split("."))
    Batch, BlockStored, BlockRemoved = structs(release)
    medium = {"medium": "GPU"} if release >= (0, 10, 2) else {}
    lora = {"lora_name": None} if release >= (0, 14, 0) else {}

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    def bind(sock, port):
        if port == 0:
            return sock.bind_to_random_port("tcp://127.0.0.1")
        # A restarted engine takes its ports back (the previous process may have just died).
        deadline = time.monotonic() + 10
        while True:
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
                return port
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    pub_port = bind(pub, a.port)
    router = ctx.socket(zmq.ROUTER)
    router_port = bind(router, a.replay_port)
    print(json.dumps({"endpoint": f"tcp://127.0.0.1:{pub_port}",
                      "replay_endpoint": f"tcp://127.0.0.1:{router_port}"}), flush=True)

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    encoder = msgspec.msgpack.Encoder()
    topic = a.topic.encode()
    buffer = []
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    end = (2**64 - 1).to_bytes(8, "big")

    def serve_replay():
        frames = router.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            return
        start = int.from_bytes(frames[2], "big")
        for s, p in buffer:
            if int.from_bytes(s, "big") >= start:
                if release >= (0, 26, 0):
                    router.send_multipart([frames[0], b"", topic, s, p])
                else:
                    router.send_multipart([frames[0], b"", s, p])
        if release >= (0, 26, 0):
            router.send_multipart([frames[0], b"", b"", end, b""])
        else:
            router.send_multipart([frames[0], b"", end, b""])

    for i in range(a.count):
        if stop.is_set():
            break
        b = a.hash_base
        events = [BlockStored(block_hashes=[b + 2 * i + 1, b + 2 * i + 2],
                              parent_block_hash=b + 2 * i if i else None,
                              token_ids=list(range(32 * i, 32 * i + 32)), block_size=16,
                              lora_id=None, **medium, **lora)]
        if i % 2 == 1:
            events.append(BlockRemoved(block_hashes=[b + 2 * i - 1], **medium))
        kwargs = {"data_parallel_rank": a.rank} if release >= (0, 9, 1) else {}
        payload = encoder.encode(Batch(ts=time.time(), events=events, **kwargs))
        seq = i.to_bytes(8, "big")
        pub.send_multipart([topic, seq, payload])
        buffer.append((seq, payload))
        deadline = time.monotonic() + a.interval
        while (left := deadline - time.monotonic()) > 0:
            if poller.poll(int(left * 1000) + 1):
                serve_replay()
    # Like an engine that stays up: replays are still answered until stdin closes.
    while not stop.is_set():
        if poller.poll(100):
            serve_replay()


if __name__ == "__main__":
    main()
