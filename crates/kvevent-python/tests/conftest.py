"""Real peers for the wheel's Fleet tests: the Python publishers built like vLLM's and SGLang's
(msgspec + pyzmq, from kvevent-test-support), the sidecar binary (`kvevent-subscriber
--feed-address`) in front of each, and the example router (a Rust `Fleet`) to compare with.

The binaries are the workspace's own (`target/debug`, as `.ci/run`'s test step leaves them);
missing ones are built with cargo first. KVEVENT_SUBSCRIBER, KVEVENT_SIMULATOR
and KVEVENT_ROUTER name others."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
PUBLISHERS = ROOT / "crates" / "kvevent-test-support" / "python"
TARGET = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))


def _binary(env, path, cargo_args):
    if os.environ.get(env):
        return os.environ[env]
    if not path.exists():
        subprocess.run(["cargo", "build", "--locked", "--quiet", *cargo_args], cwd=ROOT, check=True)
    return str(path)


@pytest.fixture(scope="session")
def subscriber_bin():
    return _binary(
        "KVEVENT_SUBSCRIBER",
        TARGET / "debug" / "kvevent-subscriber",
        ["-p", "kvevent-subscriber", "--bin", "kvevent-subscriber"],
    )


@pytest.fixture(scope="session")
def simulator_bin():
    return _binary(
        "KVEVENT_SIMULATOR",
        TARGET / "debug" / "kvevent-simulator",
        ["-p", "kvevent-simulator", "--bin", "kvevent-simulator"],
    )


@pytest.fixture(scope="session")
def router_bin():
    return _binary(
        "KVEVENT_ROUTER",
        TARGET / "debug" / "examples" / "router",
        ["-p", "kvevent-examples", "--example", "router"],
    )


class Process:
    """A child process, its stderr read on a thread (kept for failures), killed at the end."""

    def __init__(self, args, name):
        self.name = name
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = []
        self.ended = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for_line(self, pattern, timeout=30):
        """The first stderr line matching `pattern`, waiting at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if re.search(pattern, line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.ended:
                    raise AssertionError(
                        f"{self.name}: no line matching {pattern!r}:\n{''.join(self.lines)}"
                    )
                self._changed.wait(left)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stderr(self):
        return "".join(self.lines)


class Publisher(Process):
    """A Python publisher built like the engine's: its PUB and replay endpoints."""

    def __init__(self, engine, release, *args):
        script = PUBLISHERS / f"{engine}_publisher.py"
        super().__init__(
            [sys.executable, str(script), "--release", release, *args], f"{engine} {release}"
        )
        first = self.proc.stdout.readline()
        if not first:
            raise AssertionError(f"{self.name} did not start:\n{self.proc.stderr.read()}")
        endpoints = json.loads(first)
        self.engine = engine
        self.endpoint = endpoints["endpoint"]
        self.replay_endpoint = endpoints["replay_endpoint"]


class Sidecar(Process):
    """`kvevent-subscriber` serving a feed (no InferenceCache server) for one engine."""

    def __init__(self, binary, publisher, replica):
        super().__init__(
            [
                binary,
                "--engine-endpoint", publisher.endpoint,
                "--replay-endpoint", publisher.replay_endpoint,
                "--engine", publisher.engine,
                "--replica-id", replica,
                "--model-id", "m",
                # The stand-in engines serve no HTTP: nothing to scrape or health-check.
                "--engine-metrics-url", "",
                "--feed-address", "127.0.0.1:0",
                "--metrics-address", "127.0.0.1:0",
                "--log-level", "info",
            ],
            f"sidecar {replica}",
        )
        line = self.wait_for_line(r"serving the router feed")
        self.url = "http://" + re.search(r"address=(\S+)", line).group(1)


class Router(Process):
    """The example router: a Rust `Fleet` behind POST /score."""

    def __init__(self, binary, sidecars):
        args = [binary, "--listen", "127.0.0.1:0", "--model", "m"]
        for name, url in sidecars.items():
            args += ["--sidecar", f"{name}={url}"]
        super().__init__(args, "router")
        line = self.wait_for_line(r"scoring on http://")
        self.base = re.search(r"scoring on (http://[^/]+)/score", line).group(1)

    def post(self, path, body):
        import urllib.error
        import urllib.request

        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


class PythonRouter(Router):
    """The wheel's example router (examples/router.py): a Python `Fleet` behind POST /score."""

    def __init__(self, sidecars):
        args = [sys.executable, str(ROOT / "crates" / "kvevent-python" / "examples" / "router.py")]
        args += ["--listen", "127.0.0.1:0"]
        for name, url in sidecars.items():
            args += ["--sidecar", f"{name}={url}"]
        Process.__init__(self, args, "python router")
        line = self.proc.stdout.readline()
        found = re.search(r"scoring on (http://[^/]+)/score", line)
        if not found:
            raise AssertionError(f"python router did not start: {line}\n{self.stderr()}")
        self.base = found.group(1)


@pytest.fixture
def processes():
    """Starts processes (`start(cls, *args)`) and kills them all at the end."""
    started = []

    def start(cls, *args):
        p = cls(*args)
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.kill()
