#!/usr/bin/env python3
"""The plain Python sidecar the load benchmark compares against: what a team writes first.

pyzmq SUB → msgspec with vLLM 0.33's own struct layouts → the same mapping as
kvevent-subscriber's engine key mode (int hash as 8 bytes big-endian, cumulative token counts
through a dict of parents, GPU → T1) → grpcio. Adds are buffered for --window seconds and sent
as one ReportCacheState stream; removals are sent in arrival order as unary PublishEvent calls
after the adds buffered before them. No replay, no bounds: the simplest correct loop.

Needs: msgspec pyzmq grpcio grpcio-tools (stubs are generated from proto/ at start).
"""
import argparse
import importlib
import os
import sys
import tempfile
import time
from typing import Any, Optional, Union

import grpc
import msgspec
import zmq
from grpc_tools import protoc

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def stubs():
    out = tempfile.mkdtemp(prefix="kvevent-py-sidecar-")
    proto_dir = os.path.join(ROOT, "proto")
    rc = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={out}", f"--grpc_python_out={out}",
                      os.path.join(proto_dir, "inferencecache/v1alpha1/inferencecache.proto")])
    if rc != 0:
        sys.exit("protoc failed")
    sys.path.insert(0, out)
    pb = importlib.import_module("inferencecache.v1alpha1.inferencecache_pb2")
    rpc = importlib.import_module("inferencecache.v1alpha1.inferencecache_pb2_grpc")
    return pb, rpc


# vLLM 0.33's event structs (vllm/distributed/kv_events.py), as msgspec decodes them.
class EventBase(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(EventBase):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[list[Any]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list[list[int]]] = None


class BlockRemoved(EventBase):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(EventBase):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


def key(h):
    return h.to_bytes(8, "big", signed=h < 0) if isinstance(h, int) else h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--topic", default="kv-events")
    ap.add_argument("--window", default="100ms")
    ap.add_argument("--replica-id", default="bench")
    ap.add_argument("--model-id", default="bench-model")
    a = ap.parse_args()
    window = float(a.window[:-2]) / 1000 if a.window.endswith("ms") else float(a.window.rstrip("s"))
    pb, rpc = stubs()
    stub = rpc.InferenceCacheStub(grpc.insecure_channel(a.server))
    ident = dict(replica_id=a.replica_id, model_id=a.model_id, tenant_id="", hash_scheme="vllm")
    stub.PublishEvent(pb.CacheEvent(type=pb.CacheEvent.ALL_CLEARED, replica_id=a.replica_id,
                                    model_id=a.model_id), timeout=5)

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 100_000)
    sub.setsockopt(zmq.SUBSCRIBE, a.topic.encode())
    sub.connect(a.endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    tokens_of = {}  # engine hash → cumulative token count
    adds = []  # pending PrefixEntry
    add_ts = 0
    pending = []  # ("adds", [entries], ts) or ("evict", key, ts), in arrival order
    opened = None

    def flush():
        nonlocal adds, opened
        if adds:
            pending.append(("adds", adds, add_ts))
            adds = []
        for item in pending:
            if item[0] == "adds":
                update = pb.CacheStateUpdate(timestamp_us=item[2], prefixes=item[1], **ident)
                stub.ReportCacheState(iter([update]), timeout=5)
            else:
                stub.PublishEvent(pb.CacheEvent(type=pb.CacheEvent.PREFIX_EVICTED,
                                                replica_id=a.replica_id, model_id=a.model_id,
                                                prefix_hash=item[1], timestamp_us=item[2]),
                                  timeout=5)
        pending.clear()
        opened = None

    while True:
        timeout = 100 if opened is None else max(0, int((opened + window - time.monotonic()) * 1000))
        if sub.poll(timeout):
            _topic, _seq, payload = sub.recv_multipart()
            batch = decoder.decode(payload)
            ts = int(batch.ts * 1e6)
            for e in batch.events:
                if isinstance(e, BlockStored):
                    if e.block_size == 0:
                        continue
                    base = tokens_of.get(e.parent_block_hash, 0) if e.parent_block_hash is not None else 0
                    for i, h in enumerate(e.block_hashes):
                        n = base + (i + 1) * e.block_size
                        tokens_of[h] = n
                        adds.append(pb.PrefixEntry(prefix_hash=key(h), token_count=n,
                                                   tier=pb.CACHE_TIER_T1, adapter_id=e.lora_name or ""))
                    add_ts = ts
                elif isinstance(e, BlockRemoved):
                    if adds:
                        pending.append(("adds", adds, add_ts))
                        adds = []
                    for h in e.block_hashes:
                        tokens_of.pop(h, None)
                        pending.append(("evict", key(h), ts))
                else:
                    tokens_of.clear()
                    adds = []
                    pending.clear()
                    stub.PublishEvent(pb.CacheEvent(type=pb.CacheEvent.ALL_CLEARED,
                                                    replica_id=a.replica_id, model_id=a.model_id,
                                                    timestamp_us=ts), timeout=5)
            if opened is None and (adds or pending):
                opened = time.monotonic()
        if opened is not None and time.monotonic() >= opened + window:
            flush()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
