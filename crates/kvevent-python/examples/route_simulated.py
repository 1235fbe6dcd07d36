"""Routing in Python on a simulated fleet: `kvevent-simulator` engines (vLLM's HTTP API, /metrics
and KV events), a feed-only `kvevent-subscriber` beside each, and a `kvevent.Router` choosing
where each request goes; shared system prompts sent under the cost rule, then under round-robin
on fresh engines. Prints each policy's prefix-cache hit rate (the engines' own counters) and
each engine's share; exits 1 unless the rule's hit rate is ahead. Standard library only.

    python route_simulated.py [--simulator target/release/kvevent-simulator]
        [--subscriber target/release/kvevent-subscriber] [--engines 3] [--requests 150]
"""
import argparse
import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import kvevent

ap = argparse.ArgumentParser()
ap.add_argument("--simulator", default="target/release/kvevent-simulator")
ap.add_argument("--subscriber", default="target/release/kvevent-subscriber")
ap.add_argument("--engines", type=int, default=3)
ap.add_argument("--requests", type=int, default=150)
args = ap.parse_args()


def drain(stream):
    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()


def start_fleet(n):
    """Simulated engines (512 blocks of 16 tokens each, 10x the GPU profile's speed) and a
    sidecar beside each: the processes, each engine's server and each sidecar's feed."""
    sim = subprocess.Popen(
        [args.simulator, "--engines", str(n), "--blocks", "512", "--speed", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs, servers, feeds = [sim], {}, {}
    for _ in range(n):  # e000=tcp://127.0.0.1:P,replay=tcp://127.0.0.1:P,http=http://127.0.0.1:P
        name, rest = sim.stdout.readline().strip().split("=", 1)
        events, replay, http = rest.split(",")
        servers[name] = http.removeprefix("http=")
        sidecar = subprocess.Popen(
            [args.subscriber, "--engine-endpoint", events,
             "--replay-endpoint", replay.removeprefix("replay="), "--replica-id", name,
             "--model-id", "sim", "--engine-metrics-url", servers[name] + "/metrics",
             "--feed-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(sidecar)
        for line in sidecar.stderr:  # its log says where it serves the feed
            if "serving the router feed" in line:
                feeds[name] = "http://" + re.search(r"address=(\S+)", line).group(1)
                break
        else:
            sys.exit(f"the sidecar of {name} exited before serving its feed")
        drain(sidecar.stderr)
    return procs, servers, feeds


def counter(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if re.match(re.escape(name) + r"[{ ]", line))


# 12 system prompts of 600-1,400 tokens (about 12 k tokens: more than an engine holds, fewer
# than the fleet does), each request one of them and a user turn of its own.
rng = random.Random(7)
systems = [[rng.randrange(10, 32000) for _ in range(rng.randrange(600, 1400))] for _ in range(12)]
prompts = [rng.choice(systems) + [rng.randrange(10, 32000) for _ in range(50)]
           for _ in range(args.requests)]
hit_rates = {}
for policy in ["cost", "round-robin"]:
    procs, servers, feeds = start_fleet(args.engines)
    try:
        with kvevent.Fleet() as fleet:
            for name, url in feeds.items():
                fleet.follow(name, url, replica=name, model="sim")
            fleet.ready_blocking(30)
            router = kvevent.Router(fleet, policy)
            names = list(servers)

            def send(prompt):
                choice = router.choose(names, prompt)
                flight = router.start(choice)
                body = json.dumps({"model": "sim", "prompt": prompt, "max_tokens": 4}).encode()
                request = urllib.request.Request(servers[choice.replica] + "/v1/completions", body,
                                                 {"content-type": "application/json"})
                usage = json.load(urllib.request.urlopen(request, timeout=30))["usage"]
                flight.finish(usage["prompt_tokens_details"]["cached_tokens"])
                return choice.replica

            with ThreadPoolExecutor(8) as pool:
                futures = []
                for prompt in prompts:  # 50 a second
                    futures.append(pool.submit(send, prompt))
                    time.sleep(0.02)
                chosen = [f.result() for f in futures]
            # Each sidecar reads its engine's load (rank by rank) and the fleet carries it.
            loads = [r.load for r in fleet.replicas()]
            if not all(load and [rank["rank"] for rank in load.ranks] == [0] for load in loads):
                sys.exit(f"FAILED: the engines' loads are not all followed: {loads}")
        queries = sum(counter(url, "vllm:prefix_cache_queries_total") for url in servers.values())
        hits = sum(counter(url, "vllm:prefix_cache_hits_total") for url in servers.values())
        hit_rates[policy] = hits / max(queries, 1)
        shares = " / ".join(f"{100 * chosen.count(n) / len(chosen):.0f}" for n in names)
        print(f"{policy:<12} hit rate {100 * hit_rates[policy]:5.1f} %   share by engine, %: {shares}")
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
if hit_rates["cost"] <= hit_rates["round-robin"]:
    sys.exit("FAILED: the cost rule's hit rate is not ahead of round-robin's")
