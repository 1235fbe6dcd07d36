"""What vLLM's and SGLang's KV-event publishers share (they are one design): a PUB socket sending
[topic, seq (8 bytes big-endian), payload], a ROUTER replay socket answering
[identity, "", start] with the buffered batches, then the end marker; the batches published
every interval until the count or stdin closes, replays answered until stdin closes."""
import argparse
import json
import sys
import threading
import time

import zmq


def arguments(default_release):
    """The flags both publishers take; each adds its own."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", default=default_release)
    ap.add_argument("--topic", default="kv-events")
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help="PUB port (0: any free one)")
    ap.add_argument("--replay-port", type=int, default=0, help="replay port (0: any free one)")
    ap.add_argument("--hash-base", type=int, default=0, help="added to every block hash")
    return ap


def bind(sock, port):
    """Binds a loopback port (0: any free one). A restarted engine takes its ports back (the
    previous process may have just died), so a fixed port is retried for a while."""
    if port == 0:
        return sock.bind_to_random_port("tcp://127.0.0.1")
    deadline = time.monotonic() + 10
    while True:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return port
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run(a, payload_of, topic_in_replies):
    """Publishes `payload_of(i)` for i = 0 .. a.count-1 every a.interval seconds on a.port
    (replays on a.replay_port), printing the endpoints first as one JSON line. Replies carry the
    topic when `topic_in_replies` (vLLM 0.26+, SGLang 0.5.22+)."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub_port = bind(pub, a.port)
    router = ctx.socket(zmq.ROUTER)
    router_port = bind(router, a.replay_port)
    print(json.dumps({"endpoint": f"tcp://127.0.0.1:{pub_port}",
                      "replay_endpoint": f"tcp://127.0.0.1:{router_port}"}), flush=True)

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    topic = a.topic.encode()
    buffer = []
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    end = (2**64 - 1).to_bytes(8, "big")
    with_topic = [topic] if topic_in_replies else []

    def serve_replay():
        frames = router.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            return
        start = int.from_bytes(frames[2], "big")
        for s, p in buffer:
            if int.from_bytes(s, "big") >= start:
                router.send_multipart([frames[0], b""] + with_topic + [s, p])
        router.send_multipart([frames[0], b""] + ([b""] if topic_in_replies else []) + [end, b""])

    for i in range(a.count):
        if stop.is_set():
            break
        payload = payload_of(i)
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
