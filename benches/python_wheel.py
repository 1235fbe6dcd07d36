#!/usr/bin/env python3
"""The `kvevent` wheel from Python (#50): decode throughput against msgspec decoding vLLM's own
structs on the same payloads (every vLLM release's vectors), alternated in one run;
fingerprint keys of a 4,096-token prompt, tokens a second (token ids as a list, and as
native-endian u32 bytes); and, with --stub, a score from Python against a Rust Fleet's on the
same 256 sidecars' feeds (`feed-stub`), alternated.

Usage: python3 benches/python_wheel.py [--seconds 2] [--runs 3] [--stub target/release/feed-stub]
Needs the wheel installed (pip install ./crates/kvevent-python) and msgspec.
"""
import argparse
import array
import json
import os
import random
import statistics
import subprocess
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


def keys_run(seconds, packed):
    tokens = [random.randrange(150_000) for _ in range(4096)]
    ids = array.array("I", tokens).tobytes() if packed else tokens
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        kvevent.fingerprint_keys(ids, 16)
        n += 1
    return n * len(tokens) / (time.perf_counter() - start)


def score_runs(stub, seconds, runs):
    """Python's score against the Rust Fleet's on the stub's feeds, alternated: ns a score."""
    peer = subprocess.Popen([stub], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    setup = json.loads(peer.stdout.readline())
    fleet = kvevent.Fleet()
    for r, url in enumerate(setup["urls"]):
        fleet.follow(f"r{r}", url)
    fleet.ready_blocking(300)
    forms = {
        "list": setup["queries"],
        "bytes": [array.array("I", q).tobytes() for q in setup["queries"]],
    }
    out = {"rust": [], "list": [], "bytes": []}
    for _ in range(runs):
        for form, queries in forms.items():
            score = fleet.score
            n = 0
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                for q in queries:
                    score(q).best
                    n += 1
            out[form].append((time.perf_counter() - start) / n * 1e9)
        peer.stdin.write(f"measure {seconds}\n")
        peer.stdin.flush()
        out["rust"].append(json.loads(peer.stdout.readline())["ns_per_score"])
    peer.stdin.close()
    peer.wait()
    fleet.close()
    return len(setup["urls"]), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stub", help="feed-stub binary: also measure a score against Rust's")
    args = ap.parse_args()
    groups = msgspec_compare.load()
    if not groups:
        sys.exit("no vectors found: set KVEVENT_SHARED_DIR")
    wheel, py, keys, packed = [], [], [], []
    for _ in range(args.runs):
        wheel.append(wheel_run(groups, args.seconds))
        py.append(msgspec_compare.python_run(groups, args.seconds))
        keys.append(keys_run(args.seconds, False))
        packed.append(keys_run(args.seconds, True))
    for name, runs in (("kvevent.decode", wheel), ("msgspec, vLLM's structs", py)):
        mb = [r["mb_per_s"] for r in runs]
        ev = [r["events_per_s"] for r in runs]
        print(
            f"{name:24} {statistics.median(mb):8.1f} MB/s  {statistics.median(ev) / 1e6:6.2f} M events/s"
            f"  (runs: {', '.join(f'{m:.1f}' for m in mb)} MB/s)"
        )
    ratios = [w["mb_per_s"] / p["mb_per_s"] for w, p in zip(wheel, py)]
    print(f"kvevent.decode / msgspec: {', '.join(f'{r:.2f}x' for r in ratios)}")
    for form, runs in (("a list", keys), ("u32 bytes", packed)):
        print(
            f"fingerprint_keys, 4,096 tokens as {form}: "
            + ", ".join(f"{k / 1e6:.1f}" for k in runs)
            + " M tokens/s"
        )
    if args.stub:
        replicas, out = score_runs(args.stub, args.seconds, args.runs)
        print(f"score at {replicas} replicas (ns a score, runs alternated):")
        for form in ("rust", "bytes", "list"):
            print(f"  {form:6} " + ", ".join(f"{v:7.0f}" for v in out[form]))
        for form in ("bytes", "list"):
            extra = [p - r for p, r in zip(out[form], out["rust"])]
            print(
                f"  python ({form}) - rust: median {statistics.median(extra):+.0f} ns (runs: "
                + ", ".join(f"{e:+.0f}" for e in extra) + ")"
            )


if __name__ == "__main__":
    main()
