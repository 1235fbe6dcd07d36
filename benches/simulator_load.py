"""kvevent-simulator's own cost (#63): N engines in one process followed by the example router
(a Fleet following every engine's KV events and /metrics), idle, then under R requests a second
sent through the router (token-id prompts of 1-4 k tokens over 64 shared system prompts, 16
tokens out, whole answers). Prints the simulator's and the router's CPU (% of one core) and RSS.

    cargo build --release -p kvevent-simulator -p kvevent-examples --example router
    python3 benches/simulator_load.py [--engines 256] [--rate 100] [--seconds 20]
"""
import argparse
import json
import os
import random
import re
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ap = argparse.ArgumentParser()
ap.add_argument("--simulator", default="target/release/kvevent-simulator")
ap.add_argument("--router", default="target/release/examples/router")
ap.add_argument("--engines", type=int, default=256)
ap.add_argument("--rate", type=float, default=100)
ap.add_argument("--seconds", type=float, default=20)
args = ap.parse_args()
TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid):
    return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{pid}/status").read()).group(1)) / 1024


def measure(label, procs, seconds):
    before = {name: cpu(p.pid) for name, p in procs.items()}
    time.sleep(seconds)
    for name, p in procs.items():
        print(f"{label:<10} {name:<10} CPU {100 * (cpu(p.pid) - before[name]) / seconds:5.1f} % of a core, "
              f"RSS {rss_mb(p.pid):6.1f} MB")


sim = subprocess.Popen([args.simulator, "--engines", str(args.engines)],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
engines = [sim.stdout.readline().strip() for _ in range(args.engines)]
router_args = [args.router, "--listen", "127.0.0.1:0", "--model", "sim", "--block-size", "16"]
for line in engines:
    name, sockets = line.split("=", 1)
    router_args += ["--engine", line, "--upstream", f"{name}={sockets.rsplit('http=', 1)[1]}"]
router = subprocess.Popen(router_args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
for line in router.stderr:
    if "scoring on http://" in line:
        base = "http://" + line.split("scoring on http://")[1].split("/")[0]
        break
threading.Thread(target=lambda: [None for _ in router.stderr], daemon=True).start()
try:
    deadline = time.time() + 60
    while time.time() < deadline:
        replicas = json.load(urllib.request.urlopen(base + "/replicas", timeout=10))["replicas"]
        if sum(r["state"] == "exact" for r in replicas) == args.engines:
            break
        time.sleep(0.5)
    else:
        raise SystemExit("the router's replicas are not all exact within 60 s")
    procs = {"simulator": sim, "router": router}
    print(f"{args.engines} engines, RSS {rss_mb(sim.pid) / args.engines * 1024:.0f} KB an engine")
    measure("idle", procs, 10)
    rng = random.Random(7)
    systems = [[rng.randrange(10, 32000) for _ in range(rng.randrange(1024, 4096))] for _ in range(64)]
    sent, failed = [0], [0]

    def one():
        prompt = rng.choice(systems) + [rng.randrange(10, 32000) for _ in range(100)]
        body = json.dumps({"model": "sim", "prompt": prompt, "max_tokens": 16}).encode()
        try:
            urllib.request.urlopen(urllib.request.Request(
                base + "/v1/completions", body, {"content-type": "application/json"}), timeout=30).read()
            sent[0] += 1
        except OSError:
            failed[0] += 1

    stop = time.time() + args.seconds + 2
    with ThreadPoolExecutor(64) as pool:
        def pace():
            while time.time() < stop:
                pool.submit(one)
                time.sleep(1 / args.rate)
        threading.Thread(target=pace, daemon=True).start()
        time.sleep(2)  # into the steady state
        measure(f"{args.rate:.0f} req/s", procs, args.seconds)
    print(f"answered {sent[0]}, failed {failed[0]}")
finally:
    router.terminate()
    sim.terminate()
