#!/usr/bin/env python3
"""An engine stand-in that knows its ground truth, for the fault harness: it publishes KV events
the way vLLM does (msgspec structs, a pyzmq PUB, a ROUTER replay buffer) from a random but
well-formed cache, and prints every change of what its process holds.

The cache: --prompts prompts of --blocks blocks each; prompt p's token ids are
p * 1000 + j for j in 0 .. blocks * block_size, so a router chains the same fingerprints. A
block's hash is fixed within the process and differs between processes (a restarted engine is
a new process). A store carries the chain from a prompt's first missing block to its next held
one; a removal takes any held block (mid-chain too); now and then everything is cleared.

Prints one JSON line with its endpoints, then, for each batch (published or lost), one line per
change: `+ P B` stored, `- P B` removed, `C` cleared, then `. SEQ`. Commands on stdin, one a
line: `busy`, `idle`, `lose N` (the next N batches go to the replay buffer only), `lose N forget`
(they do not, and the buffer is emptied: as if it had wrapped), `clear`, `http down` / `http up`
(its HTTP server, answering /health on --http-port, goes away and comes back).
"""
import argparse
import collections
import http.server
import json
import random
import sys
import threading
import time

import msgspec
import zmq

import publisher_common
import vllm_publisher


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", default="0.33.0")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--replay-port", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=120, help="most blocks held")
    ap.add_argument("--buffer-steps", type=int, default=400, help="batches kept for replay")
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--idle", action="store_true", help="start without publishing")
    ap.add_argument("--http-port", type=int, default=0, help="/health here (0: no HTTP server)")
    ap.add_argument("--replay-delay", type=float, default=0.0,
                    help="answer no replay request for this long after starting")
    a = ap.parse_args()
    release = tuple(int(x) for x in a.release.split("."))
    Batch, BlockStored, BlockRemoved = vllm_publisher.structs(release)
    AllCleared = msgspec.defstruct("AllBlocksCleared", [], tag=True, omit_defaults=True,
                                   array_like=release < (0, 24, 0))
    Batch = msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list[BlockStored | BlockRemoved | AllCleared]),
         ("data_parallel_rank", int | None, None)],
        array_like=True, omit_defaults=True, gc=False)
    encoder = msgspec.msgpack.Encoder()
    rng = random.Random(a.seed)
    nonce = random.SystemRandom().getrandbits(40)

    def block_hash(p, b):
        return (nonce * 1_000_003 + p * 64 + b) & (2**63 - 1)

    def tokens(p, b):
        base = p * 1000 + b * a.block_size
        return list(range(base, base + a.block_size))

    held = set()
    lines = []

    def store():
        p = rng.randrange(a.prompts)
        first = next((b for b in range(a.blocks) if (p, b) not in held), None)
        if first is None:
            return None
        end = next((b for b in range(first, a.blocks) if (p, b) in held), a.blocks)
        chain = list(range(first, end))
        for b in chain:
            held.add((p, b))
            lines.append(f"+ {p} {b}")
        return BlockStored(
            block_hashes=[block_hash(p, b) for b in chain],
            parent_block_hash=block_hash(p, first - 1) if first else None,
            token_ids=[t for b in chain for t in tokens(p, b)],
            block_size=a.block_size, lora_id=None, medium="GPU", lora_name=None)

    def remove(n):
        gone = rng.sample(sorted(held), min(n, len(held)))
        for p, b in gone:
            held.discard((p, b))
            lines.append(f"- {p} {b}")
        return BlockRemoved(block_hashes=[block_hash(p, b) for p, b in gone], medium="GPU")

    def clear():
        held.clear()
        lines.append("C")
        return AllCleared()

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.setsockopt(zmq.LINGER, 0)
    pub_port = publisher_common.bind(pub, a.port)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router_port = publisher_common.bind(router, a.replay_port)
    print(json.dumps({"endpoint": f"tcp://127.0.0.1:{pub_port}",
                      "replay_endpoint": f"tcp://127.0.0.1:{router_port}"}), flush=True)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = [None]

    def http_up():
        if a.http_port and server[0] is None:
            deadline = time.monotonic() + 10
            while True:
                try:
                    s = http.server.ThreadingHTTPServer(("127.0.0.1", a.http_port), Health)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            threading.Thread(target=s.serve_forever, daemon=True).start()
            server[0] = s

    def http_down():
        if server[0] is not None:
            server[0].shutdown()
            server[0].server_close()
            server[0] = None

    http_up()
    commands = collections.deque()
    stop = threading.Event()

    def read_commands():
        for line in sys.stdin:
            commands.append(line.split())
        stop.set()

    threading.Thread(target=read_commands, daemon=True).start()
    topic = b"kv-events"
    buffer = collections.deque(maxlen=a.buffer_steps)
    end = (2**64 - 1).to_bytes(8, "big")
    replay_from = time.monotonic() + a.replay_delay
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)

    def serve_replay():
        frames = router.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            return
        start = int.from_bytes(frames[2], "big")
        for s, p in list(buffer):
            if int.from_bytes(s, "big") >= start:
                router.send_multipart([frames[0], b"", topic, s, p])
        router.send_multipart([frames[0], b"", b"", end, b""])

    busy, lose, seq, force_clear, forget = not a.idle, 0, 0, False, False
    while not stop.is_set():
        while commands:
            c = commands.popleft()
            if c == ["busy"]:
                busy = True
            elif c == ["idle"]:
                busy = False
            elif len(c) in (2, 3) and c[0] == "lose":
                lose += int(c[1])
                forget = len(c) == 3
            elif c == ["clear"]:
                force_clear = True
            elif c == ["http", "down"]:
                http_down()
            elif c == ["http", "up"]:
                http_up()
        events = []
        if force_clear:
            force_clear = False
            events.append(clear())
        elif busy:
            r = rng.random()
            if r < 0.004:
                events.append(clear())
            elif len(held) > a.capacity or (r > 0.65 and held):
                events.append(remove(rng.randint(1, 3)))
            else:
                stored = store()
                if stored is not None:
                    events.append(stored)
        if events:
            payload = encoder.encode(Batch(ts=time.time(), events=events, data_parallel_rank=None))
            s = seq.to_bytes(8, "big")
            if lose > 0:
                lose -= 1
                if forget:
                    buffer.clear()
                else:
                    buffer.append((s, payload))
            else:
                pub.send_multipart([topic, s, payload])
                buffer.append((s, payload))
            lines.append(f". {seq}")
            print("\n".join(lines), flush=True)
            lines.clear()
            seq += 1
        deadline = time.monotonic() + a.interval
        while (left := deadline - time.monotonic()) > 0:
            if time.monotonic() < replay_from:
                time.sleep(min(left, replay_from - time.monotonic()))
                continue
            if poller.poll(int(left * 1000) + 1):
                serve_replay()


if __name__ == "__main__":
    main()
