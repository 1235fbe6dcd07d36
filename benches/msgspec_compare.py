#!/usr/bin/env python3
"""Decode every shared vector with msgspec into vLLM-shaped structs and with kvevent-wire,
side by side in one run, and print the throughput of each and their ratio.

The Python side is what a vLLM consumer does: ``msgspec.msgpack.Decoder(type=KVEventBatch)``
with the release's own struct layout (positional ``array_like`` events up to 0.23, tagged maps
with ``omit_defaults`` from 0.24), one decoder per release.

Usage: python3 benches/msgspec_compare.py [--seconds 2] [--runs 3]
Needs msgspec (pip install msgspec) and builds the Rust probe with cargo (release profile).
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Optional, Union

import msgspec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.environ.get("KVEVENT_SHARED_DIR") or os.path.join(os.path.dirname(ROOT), "shared")

Hash = Union[int, bytes]

# (field, type, first release) in declaration order, as in vLLM's kv_events.py.
STORED = [
    ("block_hashes", list[Hash], (0, 9, 0)),
    ("parent_block_hash", Optional[Hash], (0, 9, 0)),
    ("token_ids", list[int], (0, 9, 0)),
    ("block_size", int, (0, 9, 0)),
    ("lora_id", Optional[int], (0, 9, 0)),
    ("medium", Optional[str], (0, 10, 2)),
    ("lora_name", Optional[str], (0, 14, 0)),
    ("extra_keys", Optional[list[Optional[list[Any]]]], (0, 17, 0)),
    ("group_idx", Optional[int], (0, 20, 0)),
    ("kv_cache_spec_kind", Optional[str], (0, 22, 0)),
    ("kv_cache_spec_sliding_window", Optional[int], (0, 22, 0)),
    ("locality", Optional[str], (0, 26, 0)),
    ("ownership", Optional[str], (0, 29, 0)),
    ("session_id", Optional[str], (0, 30, 0)),
    ("lookahead_token_ids", Optional[list[list[int]]], (0, 33, 0)),
]
REMOVED = [
    ("block_hashes", list[Hash], (0, 9, 0)),
    ("medium", Optional[str], (0, 10, 2)),
    ("group_idx", Optional[int], (0, 20, 0)),
    ("locality", Optional[str], (0, 26, 0)),
    ("ownership", Optional[str], (0, 29, 0)),
]


def structs_for(release):
    """The release's KVEventBatch type, built the way vLLM declares it."""
    map_era = release >= (0, 24, 0)
    opts = dict(tag=True, omit_defaults=True, gc=False, array_like=not map_era)

    def fields(table, first_defaulted):
        out = []
        for i, (name, typ, since) in enumerate(table):
            if release >= since:
                # Positional releases declare every field without a default up to 0.23.
                if map_era and i >= first_defaulted:
                    out.append((name, typ, None))
                else:
                    out.append((name, typ))
        return out

    stored = msgspec.defstruct("BlockStored", fields(STORED, 7), **opts)
    removed = msgspec.defstruct("BlockRemoved", fields(REMOVED, 2), **opts)
    cleared = msgspec.defstruct("AllBlocksCleared", [], **opts)
    batch_fields = [("ts", float), ("events", list[Union[stored, removed, cleared]])]
    if release >= (0, 9, 1):
        batch_fields.append(("data_parallel_rank", Optional[int], None))
    return msgspec.defstruct("KVEventBatch", batch_fields, array_like=True, gc=False)


def load():
    groups = []
    for d in sorted(glob.glob(os.path.join(SHARED, "vectors", "vllm-*"))):
        release = tuple(int(x) for x in d.rsplit("-", 1)[1].split("."))
        payloads = [open(f, "rb").read() for f in sorted(glob.glob(os.path.join(d, "*.msgpack")))]
        groups.append((msgspec.msgpack.Decoder(structs_for(release)), payloads))
    return groups


def python_run(groups, seconds):
    total = sum(len(p) for _, ps in groups for p in ps)
    rounds = events = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for dec, payloads in groups:
            for p in payloads:
                events += len(dec.decode(p).events)
        rounds += 1
    secs = time.perf_counter() - start
    return {"mb_per_s": total * rounds / secs / 1e6, "events_per_s": events / secs}


def rust_run(seconds, read_tokens):
    exe = os.path.join(ROOT, "target", "release", "decode-throughput")
    args = [exe, str(seconds)] + (["--read-tokens"] if read_tokens else [])
    return json.loads(subprocess.check_output(args, text=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    subprocess.check_call(
        ["cargo", "build", "--quiet", "--release", "-p", "kvevent-benches", "--bin", "decode-throughput"],
        cwd=ROOT,
    )
    groups = load()
    # Every vector must decode on the Python side too, or the comparison is meaningless.
    files = sum(len(ps) for _, ps in groups)
    py, rs, rst = [], [], []
    for _ in range(a.runs):  # interleaved, so machine noise hits both sides alike
        py.append(python_run(groups, a.seconds))
        rs.append(rust_run(a.seconds, False))
        rst.append(rust_run(a.seconds, True))
    med = lambda runs, k: statistics.median(r[k] for r in runs)
    print(f"{files} vector files, {a.runs} interleaved runs of {a.seconds}s, medians:")
    rows = [("msgspec (vLLM structs)", py), ("kvevent-wire", rs), ("kvevent-wire + read tokens", rst)]
    for name, runs in rows:
        print(f"  {name:28} {med(runs, 'mb_per_s'):8.1f} MB/s {med(runs, 'events_per_s'):12,.0f} events/s")
    base = med(py, "mb_per_s")
    print(f"  ratio kvevent-wire / msgspec:                {med(rs, 'mb_per_s') / base:.2f}x")
    print(f"  ratio kvevent-wire + tokens / msgspec:       {med(rst, 'mb_per_s') / base:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
