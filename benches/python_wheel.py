#!/usr/bin/env python3
"""The `kvevent` wheel from Python (#50): decode throughput against msgspec decoding vLLM's own
structs on the same payloads (every vLLM release's vectors), alternated in one run; and
fingerprint keys of a 4,096-token prompt, tokens a second.

Usage: python3 benches/python_wheel.py [--seconds 2] [--runs 3]
Needs the wheel installed (pip install ./crates/kvevent-python) and msgspec.
"""
import argparse
import os
import random
import statistics
import sys
import time

import kvevent

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msgspec_compare  # noqa: E402  (vLLM's struct layouts, release by release)


def wheel_run(groups, seconds):
    total = sum(len(p) for _, ps in groups for p in ps)
    rounds = events = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _, payloads in groups:
            for p in payloads:
                events += len(kvevent.decode(p)["events"])
        rounds += 1
    secs = time.perf_counter() - start
    return {"mb_per_s": total * rounds / secs / 1e6, "events_per_s": events / secs}


def keys_run(seconds):
    tokens = [random.randrange(150_000) for _ in range(4096)]
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        kvevent.fingerprint_keys(tokens, 16)
        n += 1
    return n * len(tokens) / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    groups = msgspec_compare.load()
    if not groups:
        sys.exit("no vectors found: set KVEVENT_SHARED_DIR")
    wheel, py, keys = [], [], []
    for _ in range(args.runs):
        wheel.append(wheel_run(groups, args.seconds))
        py.append(msgspec_compare.python_run(groups, args.seconds))
        keys.append(keys_run(args.seconds))
    for name, runs in (("kvevent.decode", wheel), ("msgspec, vLLM's structs", py)):
        mb = [r["mb_per_s"] for r in runs]
        ev = [r["events_per_s"] for r in runs]
        print(
            f"{name:24} {statistics.median(mb):8.1f} MB/s  {statistics.median(ev) / 1e6:6.2f} M events/s"
            f"  (runs: {', '.join(f'{m:.1f}' for m in mb)} MB/s)"
        )
    ratios = [w["mb_per_s"] / p["mb_per_s"] for w, p in zip(wheel, py)]
    print(f"kvevent.decode / msgspec: {', '.join(f'{r:.2f}x' for r in ratios)}")
    print(
        "fingerprint_keys, 4,096 tokens: "
        + ", ".join(f"{k / 1e6:.1f}" for k in keys)
        + " M tokens/s"
    )


if __name__ == "__main__":
    main()
