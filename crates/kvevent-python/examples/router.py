"""A router's /score in Python, the Rust example router's twin: follows replicas through their
sidecars' feeds and answers POST /score ({"token_ids", "adapter"?, "candidates"?}) with the
replicas holding the longest prefix, best first, each with its state; and POST /route
({"token_ids", "adapter"?, "candidates"}) with where --policy sends the request (the Rust rule).
Standard library only.

    python router.py --listen 127.0.0.1:8080 --policy cost --sidecar a=http://10.0.0.1:7070 ...
"""
import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kvevent

ap = argparse.ArgumentParser()
ap.add_argument("--listen", default="127.0.0.1:8080")
ap.add_argument("--sidecar", action="append", default=[], metavar="NAME=URL")
ap.add_argument("--policy", default="cost", choices=["cost", "prefix-only", "least-loaded", "round-robin"])
args = ap.parse_args()
fleet = kvevent.Fleet()
for spec in args.sidecar:
    name, url = spec.split("=", 1)
    fleet.follow(name, url)
router = kvevent.Router(fleet, args.policy)


class Score(BaseHTTPRequestHandler):
    def do_POST(self):
        q = json.loads(self.rfile.read(int(self.headers["content-length"])))
        try:
            ids, adapter = q["token_ids"], q.get("adapter", "")
            if self.path == "/route":
                c = router.choose(q["candidates"], ids, adapter=adapter)
                status, body = (503, {"error": "no candidate"}) if c is None else (200, {
                    "replica": c.replica, "matched_tokens": c.matched_tokens, "state": c.state,
                    "queued": c.queued, "load": c.load, "failed_open": c.failed_open})
            else:
                if "candidates" in q:
                    scores = fleet.score_among(q["candidates"], ids, adapter=adapter)
                else:
                    scores = fleet.score(ids, adapter=adapter)
                status, body = 200, {
                    "scores": [{"replica": s.replica, "matched_tokens": s.matched_tokens,
                                "matched_blocks": s.matched_blocks, "tier": s.tier,
                                "state": s.state, "reason": s.reason, "exact": s.exact}
                               for s in scores],
                    "not_followed": scores.not_followed}
        except kvevent.NotReady as e:  # no replica said its block size yet: route on nothing
            status, body = 503, {"error": str(e)}
        except (ValueError, KeyError, TypeError) as e:
            status, body = 400, {"error": str(e)}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


host, port = args.listen.rsplit(":", 1)
server = ThreadingHTTPServer((host, int(port)), Score)
print(f"scoring on http://{host}:{server.server_port}/score", flush=True)
server.serve_forever()
