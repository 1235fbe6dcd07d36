"""kvevent.Fleet as a Python router uses it, against real peers: Python publishers built like
vLLM's and SGLang's, the sidecar binary in front of each, and the example router (a Rust
Fleet) following the same sidecars for the same queries."""

import array
import asyncio
import re
import subprocess
import sys
import threading
import time

import pytest

import kvevent
from conftest import ROOT, Publisher, PythonRouter, Router, Sidecar

# Each publisher's batch i stores two blocks of 16 tokens, range(32i, 32i + 32), chained to
# batch i-1's; odd batches remove batch i-1's first block. One batch: tokens 0..32 held.
PROMPT = list(range(40))


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture
def three_sidecars(processes, subscriber_bin):
    """a (vLLM 0.33) and b (SGLang) hold tokens 0..32; c (vLLM 0.20, three batches) has lost
    its first block and matches no prompt from token 0."""
    engines = {
        "a": processes(Publisher, "vllm", "0.33.0", "--count", "1"),
        "b": processes(Publisher, "sglang", "0.5.23", "--count", "1"),
        "c": processes(Publisher, "vllm", "0.20.0", "--count", "3"),
    }
    sidecars = {name: processes(Sidecar, subscriber_bin, e, name) for name, e in engines.items()}
    return engines, sidecars


def follow(fleet, sidecars):
    for name, s in sidecars.items():
        fleet.follow(name, s.url, replica=name, model="m")


def wait_until(what, predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not {what} within {timeout}s"
        time.sleep(0.05)


def wait_equal(what, get, expected, timeout=30.0):
    """Polls `get` until it returns `expected`; at the deadline the assertion shows the last
    difference."""
    deadline = time.monotonic() + timeout
    while (got := get()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == expected, f"not {what} within {timeout}s"


def as_router_json(scores):
    return [
        {
            "replica": s.replica,
            "matched_tokens": s.matched_tokens,
            "matched_blocks": s.matched_blocks,
            "tier": s.tier,
            "state": s.state,
            "reason": s.reason,
            "exact": s.exact,
        }
        for s in scores
    ]


def test_scores_equal_the_rust_fleets_for_the_same_sidecars(processes, router_bin, three_sidecars):
    engines, sidecars = three_sidecars
    urls = {n: s.url for n, s in sidecars.items()}
    router = processes(Router, router_bin, urls)
    python_router = processes(PythonRouter, urls)
    with kvevent.Fleet() as fleet:
        follow(fleet, sidecars)
        fleet.ready_blocking(30)
        # c's three batches are in once it holds its five blocks.
        wait_until("c whole", lambda: fleet.replica("c").blocks == 5)
        assert [r.name for r in fleet.replicas()] == ["a", "b", "c"]
        assert all(r.exact and r.block_size == 16 for r in fleet.replicas())
        assert fleet.block_size == 16
        stats = fleet.stats()
        # Six prefixes; a and b hold two, c five; k0 is held twice, k1 three times (h holders
        # make h(h-1)/2 shared pairs).
        assert (stats.keys, stats.pairs, stats.shared_pairs) == (6, 9, 1 + 3)
        assert stats.duplication == pytest.approx(3 / 9)
        queries = [
            {"token_ids": PROMPT},
            {"token_ids": list(range(16))},
            {"token_ids": [9] * 16},
            {"token_ids": PROMPT, "candidates": ["c", "d", "a"]},
            {"token_ids": list(range(96)), "candidates": ["a", "b", "c"]},
        ]
        for q in queries:
            if "candidates" in q:
                ours = fleet.score_among(q["candidates"], q["token_ids"])
            else:
                ours = fleet.score(q["token_ids"])
            expected = (200, {"scores": as_router_json(ours), "not_followed": ours.not_followed})
            # The routers follow the sidecars on their own: each answers as this fleet does once
            # it has what this fleet has (every replica exact is not enough: one whose snapshot
            # is not in yet is in no answer).
            wait_equal(f"the Rust router's answer to {q}", lambda: router.post("/score", {"model": "m", **q}), expected)
            # The docs' Python router (examples/router.py) answers as the Rust one does.
            wait_equal(f"the Python router's answer to {q}", lambda: python_router.post("/score", q), expected)
        # What the answers are, not only that they agree.
        best = fleet.score(PROMPT)
        assert [(s.replica, s.matched_tokens, s.state) for s in best] == [
            ("a", 32, "exact"),
            ("b", 32, "exact"),
        ]
        among = fleet.score_among(["c", "d", "a"], PROMPT)
        assert [(s.replica, s.matched_blocks) for s in among] == [("a", 2), ("c", 0)]
        assert among.not_followed == ["d"]
        # Keys, and token ids as bytes, answer the same as the token list.
        keys = kvevent.fingerprint_keys(PROMPT, 16)
        assert as_router_json(fleet.score(keys=keys)) == as_router_json(best)
        packed = array.array("I", PROMPT).tobytes()
        assert as_router_json(fleet.score(packed)) == as_router_json(best)
        assert as_router_json(fleet.score(keys=array.array("Q", keys).tobytes())) == as_router_json(best)
        assert fleet.score(PROMPT, adapter="lora-x").best is None


def test_changes_see_an_engine_killed_behind_its_sidecar(processes, subscriber_bin, three_sidecars):
    engines, sidecars = three_sidecars
    seen = []

    async def main():
        async with kvevent.Fleet(dead_after=1.0) as fleet:
            follow(fleet, sidecars)
            await fleet.ready(30)
            changes = fleet.changes()
            engines["a"].kill()
            async def until_stale():
                async for change in changes:
                    a = [r for r in change.changed if r.name == "a"]
                    seen.extend((r.state, r.reason) for r in a)
                    if a and a[0].state == "stale":
                        return a[0]
            stale = await asyncio.wait_for(until_stale(), 30)
            assert stale.reason == "engine_lost"
            # The others stay exact; a's entries still count (fail open), marked stale.
            assert [r.name for r in fleet.replicas() if r.exact] == ["b", "c"]
            states = {s.replica: s.state for s in fleet.score(PROMPT)}
            assert states == {"a": "stale", "b": "exact"}
            with pytest.raises(kvevent.NotReady) as e:
                await fleet.ready(0.2)
            assert list(e.value.replicas) == ["a"]
            assert "engine_lost" in e.value.replicas["a"]

    asyncio.run(main())
    # Degraded at once, stale after dead_after.
    assert seen[0] == ("degraded", "engine_lost"), seen
    assert seen[-1] == ("stale", "engine_lost"), seen


def test_blocking_calls_from_a_thread(processes, three_sidecars):
    engines, sidecars = three_sidecars
    fleet = kvevent.Fleet(dead_after=1.0)
    follow(fleet, {"b": sidecars["b"]})
    changes = fleet.changes()
    got = []

    def watch():
        for change in changes:  # blocks, the GIL released; ends when the fleet closes
            got.append(change)

    watcher = threading.Thread(target=watch)
    watcher.start()
    fleet.ready_blocking(30, ["b"])
    # Changes made while the watcher is not looking fold into one: wait for it to see b exact.
    wait_until("b exact seen", lambda: any(any(r.name == "b" and r.exact for r in c.changed) for c in got))
    fleet.follow("c", sidecars["c"].url)
    fleet.remove("b")
    wait_until("changes seen", lambda: any("b" in c.removed for c in got))
    fleet.close()
    watcher.join(10)
    assert not watcher.is_alive(), "changes did not end when the fleet closed"
    assert fleet.closed and fleet.replicas() == [] and fleet.score(keys=[1]).best is None
    with pytest.raises(RuntimeError, match="closed"):
        fleet.follow("b", sidecars["b"].url)
    assert any(any(r.name == "c" for r in c.changed) for c in got), got


def test_errors_are_typed_and_in_our_words(processes, three_sidecars):
    engines, sidecars = three_sidecars
    with kvevent.Fleet() as fleet:
        with pytest.raises(kvevent.BlockSizeUnknown, match="no replica said its block size yet"):
            fleet.score(PROMPT)
        # The caller's block size stands where no replica said one: nothing is held yet.
        assert list(fleet.score(PROMPT, block_size=16)) == []
        for url in ["10.0.0.1:7070", "tcp://127.0.0.1:5557", "http://"]:
            with pytest.raises(ValueError, match="is not http://HOST:PORT or https://HOST:PORT"):
                fleet.follow("x", url)
        assert fleet.replicas() == [], "a bad URL changes nothing"
        with pytest.raises(kvevent.NotFollowed, match="`x` is not followed"):
            fleet.replica("x")
        with pytest.raises(kvevent.NotFollowed):
            fleet.remove("x")
        with pytest.raises(kvevent.NotFollowed):
            fleet.ready_blocking(1, ["x"])
        with pytest.raises(KeyError):  # NotFollowed is a KeyError
            fleet.record("x", 32, 0, block_size=16)
        # A sidecar that serves another replica refuses, and says so.
        fleet.follow("a", sidecars["a"].url, replica="not-a")
        with pytest.raises(kvevent.NotReady) as e:
            fleet.ready_blocking(5)
        assert "refused" in e.value.replicas["a"], e.value.replicas
        assert "refused" in fleet.replica("a").error
        fleet.follow("a", sidecars["a"].url, replica="a")
        fleet.ready_blocking(30)
        with pytest.raises(ValueError, match="the query's block size is 32, the replicas' events use 16"):
            fleet.score(PROMPT, block_size=32)
        with pytest.raises(ValueError, match="one of them"):
            fleet.score()
        with pytest.raises(ValueError, match=r"token_ids\[1\]"):
            fleet.score([1, -1])
        with pytest.raises(ValueError, match="whole number of 4-byte words"):
            fleet.score(b"\x00\x01\x02")
        with pytest.raises(ValueError, match="timeout"):
            fleet.ready_blocking(-1)


def test_predicted_against_realized(processes, three_sidecars):
    engines, sidecars = three_sidecars
    with kvevent.Fleet() as fleet:
        follow(fleet, sidecars)
        fleet.ready_blocking(30)
        best = fleet.score(PROMPT).best
        # 40 tokens, 32 matched: the engine reuses 32 (the last block rule leaves 39 // 16).
        assert fleet.record(best, len(PROMPT), 32) == "exact"
        assert fleet.record(best, len(PROMPT), 16) == "optimistic"
        assert fleet.record("c", len(PROMPT), 16) == "pessimistic"
        acc = fleet.accounting()
        assert (acc["a"].decisions, acc["a"].exact, acc["a"].optimistic) == (2, 1, 1)
        assert acc["c"].pessimistic == 1
        assert len(acc["a"].error_blocks) == len(kvevent.ERROR_BUCKETS) + 1


def test_a_million_scores_leave_rss_flat(processes, three_sidecars):
    engines, sidecars = three_sidecars
    with kvevent.Fleet() as fleet:
        follow(fleet, sidecars)
        fleet.ready_blocking(30)
        packed = array.array("I", PROMPT).tobytes()
        score = fleet.score
        for _ in range(100_000):  # warm: allocator pools, interned strings
            score(PROMPT)
        before = rss_bytes()
        for i in range(1_000_000):
            s = score(packed if i % 2 else PROMPT)
            if i % 1000 == 0:
                assert s.best.matched_tokens == 32
        grown = rss_bytes() - before
        assert grown < 2 << 20, f"RSS grew {grown} bytes over a million scores"


@pytest.mark.skipif(kvevent.ENGINES, reason="this wheel follows engines")
def test_following_an_engine_without_the_feature_says_how_to_get_it():
    with kvevent.Fleet() as fleet:
        with pytest.raises(RuntimeError, match="--features engines"):
            fleet.follow_engine("a", "tcp://127.0.0.1:5557")
        assert fleet.replicas() == []


@pytest.mark.skipif(
    not kvevent.ENGINES,
    reason="a wheel built with `--features engines` (.ci/run builds the default one)",
)
def test_an_engine_followed_directly_beside_a_sidecar(processes, subscriber_bin):
    """A wheel built with engines: one replica through its engine's sockets (what the replay
    buffer holds), one through its sidecar; both exact, the same blocks."""
    direct = processes(Publisher, "vllm", "0.33.0", "--count", "1")
    behind = processes(Publisher, "vllm", "0.33.0", "--count", "1")
    sidecar = processes(Sidecar, subscriber_bin, behind, "s")
    with kvevent.Fleet() as fleet:
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            fleet.follow_engine("e", "127.0.0.1:1")
        # The text form every kvevent tool takes; the keywords say the same.
        fleet.follow_engine("e", f"{direct.endpoint},replay={direct.replay_endpoint}")
        fleet.follow("s", sidecar.url)
        fleet.ready_blocking(30)
        wait_until("both hold the prompt", lambda: len(fleet.score(PROMPT)) == 2)
        assert [(s.replica, s.matched_tokens, s.state) for s in fleet.score(PROMPT)] == [
            ("e", 32, "exact"),
            ("s", 32, "exact"),
        ]
        assert fleet.replica("e").source == direct.endpoint
        direct.kill()
        wait_until("e not exact", lambda: not fleet.replica("e").exact)
        assert fleet.replica("e").reason in ("connecting", "source_lost")


def test_router_chooses_by_the_rust_rule_and_best_names_no_miss(processes, three_sidecars):
    engines, sidecars = three_sidecars
    with kvevent.Fleet() as fleet:
        follow(fleet, sidecars)
        fleet.ready_blocking(30)
        miss = list(range(5000, 5040))
        # A miss among candidates answers 0-token scores: none of them is the best.
        among = fleet.score_among(["a", "b", "c"], miss)
        assert [s.matched_tokens for s in among] == [0, 0, 0]
        assert among.best is None
        assert fleet.score_among(["a", "b", "c"], PROMPT).best.replica in ("a", "b")

        router = kvevent.Router(fleet)
        assert router.policy == "cost"
        choice = router.choose(["a", "b", "c"], PROMPT)
        assert choice.replica in ("a", "b") and choice.matched_tokens == 32, choice
        assert (choice.exact, choice.failed_open, choice.load) == (True, False, "none")
        other = {"a": "b", "b": "a"}[choice.replica]
        # A request in flight there is queued ahead of the next one: the other holder is
        # cheaper; once it ends, the first is chosen again.
        with router.start(choice):
            assert router.in_flight(choice.replica) == 1
            assert router.choose(["a", "b", "c"], PROMPT).replica == other
        assert router.in_flight(choice.replica) == 0
        assert fleet.record(choice, len(PROMPT), 32) == "exact"
        # What a request will compute there counts ahead of the next one until its first token.
        assert choice.compute_tokens == len(PROMPT) - 32
        new = list(range(7000, 7040))
        first = router.choose(["a", "b", "c"], new)
        assert (first.compute_tokens, first.failed_open) == (40, True)
        with router.start(first) as flight:
            flight.first_token()
            flight.first_token()                  # once is enough
        assert router.in_flight(first.replica) == 0
        # Given no weights, the router learns them from its flights' first tokens (one so far);
        # weights given are kept; another policy weighs none.
        w = router.weights()
        assert w is not None and (w["learned"], w["flights"]) == (True, 1), w
        assert w["prefill_us_per_token"] > 0 and w["queue_us_per_request"] > 0, w
        given = kvevent.Router(fleet, prefill_us_per_token=50.0).weights()
        assert given == {"prefill_us_per_token": 50.0, "queue_us_per_request": 20_000.0,
                         "learned": False, "flights": 0}, given
        assert kvevent.Router(fleet, "least-loaded").weights() is None
        # Prompts nobody holds spread by their first block, never all to the first name.
        firsts = {router.choose(["a", "b", "c"], list(range(i * 100, i * 100 + 40))).replica
                  for i in range(100, 130)}
        assert len(firsts) >= 2, firsts
        # Token ids as bytes choose the same.
        assert router.choose(["a", "b", "c"], array.array("I", PROMPT).tobytes()).replica == choice.replica

        rr = kvevent.Router(fleet, "round-robin")
        assert [rr.choose(["a", "b", "c"], PROMPT).replica for _ in range(4)] == ["a", "b", "c", "a"]
        assert kvevent.Router(fleet, "prefix-only").choose(["c", "a"], PROMPT).replica == "a"
        assert router.choose([], PROMPT) is None
        with pytest.raises(ValueError, match="not a routing policy"):
            kvevent.Router(fleet, "fastest")
        with pytest.raises(ValueError, match="weigh the cost policy"):
            kvevent.Router(fleet, "round-robin", queue_us_per_request=1.0)
        # The sidecars read no load (their stand-in engines serve no /metrics).
        assert all(r.load is None and r.load_error is None for r in fleet.replicas())

        # The loop records what the engine reused when a flight finishes; a retry goes to the
        # next choice, never back to the replica that failed, once, counted.
        sent = router.choose(["a", "b", "c"], PROMPT)
        assert (sent.none_serving, sent.attempt) == (False, 0)
        before = dict(fleet.accounting())[sent.replica].decisions
        assert router.start(sent).finish(32) == "exact"
        assert dict(fleet.accounting())[sent.replica].decisions == before + 1
        flight = router.start(sent)
        flight.end()
        assert flight.finish(32) is None          # already over: nothing recorded
        again = router.retry(sent, ["a", "b", "c"], PROMPT, reason="503")
        assert again is not None and again.replica != sent.replica and again.attempt == 1
        assert router.retry(again, ["a", "b", "c"], PROMPT) is None   # once
        assert router.retry(sent, [sent.replica], PROMPT) is None     # nobody else
        assert router.counters()["retries"] == {(sent.replica, "503"): 1, (sent.replica, "refused"): 1}
        with pytest.raises(ValueError, match="not a reason"):
            router.retry(sent, ["a", "b"], PROMPT, reason="404")


def test_a_thread_left_iterating_changes_does_not_keep_the_interpreter_alive():
    # No close(): the main thread ends with a (non-daemon) thread still in `for change in ...`.
    script = (
        "import threading, kvevent\n"
        "fleet = kvevent.Fleet()\n"
        "threading.Thread(target=lambda: [c for c in fleet.changes()]).start()\n"
        "print('started', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, "started\n"), done.stderr


def test_replicas_discovered_from_a_file_come_and_go(tmp_path):
    replicas = tmp_path / "replicas"
    replicas.write_text("a sidecar=http://127.0.0.1:9 upstream=http://127.0.0.1:8000\nb sidecar=http://127.0.0.1:10\n")
    with kvevent.Fleet() as fleet:
        fleet.follow("own", "http://127.0.0.1:11")
        fleet.discover(f"file:{replicas}", model="m")
        assert [(m.name, m.upstream, m.ready) for m in fleet.discovered()] == [
            ("a", "http://127.0.0.1:8000", True),
            ("b", None, True),
        ]
        wait_until("a, b and own followed", lambda: [r.name for r in fleet.replicas()] == ["a", "b", "own"])
        # b leaves, c comes not ready; the replica followed by hand stays.
        tmp = tmp_path / "replicas.tmp"
        tmp.write_text("a sidecar=http://127.0.0.1:9\nc sidecar=http://127.0.0.1:12 ready=false\n")
        tmp.rename(replicas)
        wait_until("c instead of b", lambda: [r.name for r in fleet.replicas()] == ["a", "c", "own"])
        assert fleet.replica("c").reason == "not_ready"
        # A router passes over a replica that is not ready while another can serve.
        router = kvevent.Router(fleet, "round-robin")
        assert {router.choose(["a", "c"], PROMPT).replica for _ in range(4)} == {"a"}
        with pytest.raises(ValueError, match="file:PATH"):
            fleet.discover("consul:x")
        with pytest.raises(ValueError, match="nowhere"):
            fleet.discover(f"file:{tmp_path / 'nowhere'}")


def test_the_docs_try_it_routes_a_simulated_fleet_with_the_rule_ahead(subscriber_bin, simulator_bin):
    # docs/python.md's "Try it": the wheel's Router over simulated engines behind sidecars.
    script = ROOT / "crates" / "kvevent-python" / "examples" / "route_simulated.py"
    run = subprocess.run(
        [sys.executable, str(script), "--simulator", simulator_bin, "--subscriber", subscriber_bin,
         "--requests", "90"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["cost", "round-robin"], run.stdout
    cost, round_robin = (float(re.search(r"hit rate\s+([\d.]+) %", line).group(1)) for line in lines)
    assert cost > round_robin + 10, run.stdout
    assert lines[1].endswith("33 / 33 / 33"), "round-robin alternates"
