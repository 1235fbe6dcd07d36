"""What a router's code looks like to a type checker: `.ci/run` runs `mypy --strict` on this
file and the package (its stubs), so a stub that lies about a signature fails CI. Not a test
pytest collects; test_fleet.py runs the same calls against real peers."""

import asyncio
from typing import Any, Dict, List, Optional

import kvevent


def best_replica(fleet: kvevent.Fleet, token_ids: List[int], candidates: List[str]) -> Optional[str]:
    try:
        scores: kvevent.Scores = fleet.score_among(candidates, token_ids, adapter="")
    except kvevent.BlockSizeUnknown:
        return None
    exact: List[kvevent.Score] = [s for s in scores if s.exact]
    if scores.not_followed:
        print("not followed:", ", ".join(scores.not_followed))
    return exact[0].replica if exact else None


def states(fleet: kvevent.Fleet) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for r in fleet.replicas():
        ranks: List[kvevent.RankStatus] = r.ranks
        out[r.name] = f"{r.state} {r.reason or ''} ({len(ranks)} ranks, {r.blocks} blocks)"
    stats: kvevent.IndexStats = fleet.stats()
    out[""] = f"{stats.keys} keys, duplication {stats.duplication:.2f}"
    return out


async def follow(urls: Dict[str, str]) -> None:
    async with kvevent.Fleet(dead_after=3.0) as fleet:
        for name, url in urls.items():
            fleet.follow(name, url, replica=name)
        try:
            await fleet.ready(5.0)
        except kvevent.NotReady as e:
            waiting: Dict[str, str] = e.replicas
            print(f"after {e.waited:.1f}s:", waiting)
        async for change in fleet.changes():
            for r in change.changed:
                print(r.name, r.state, r.error)
            gone: List[str] = change.removed
            if gone:
                break
        s = fleet.score(kvevent.fingerprint_keys(list(range(64)), 16)).best
        if s is not None:
            outcome: str = fleet.record(s, 64, 48)
            acc: kvevent.Accounting = fleet.accounting()[s.replica]
            print(outcome, acc.decisions, kvevent.ERROR_BUCKETS)


def threads(fleet: kvevent.Fleet) -> None:
    fleet.ready_blocking(5.0, ["a"])
    for change in fleet.changes():
        print(len(change.replicas))
    batch = kvevent.decode(b"", "vllm")
    for record in kvevent.Recording("a.kvrec"):
        print(record.seq, record.decode()["events"], batch["ts"])


if __name__ == "__main__":
    asyncio.run(follow({}))


def route(fleet: kvevent.Fleet, token_ids: List[int]) -> Optional[str]:
    router = kvevent.Router(fleet, "cost", prefill_us_per_token=100.0, queue_us_per_request=20_000.0)
    choice: Optional[kvevent.Choice] = router.choose(["a", "b"], token_ids, adapter="")
    if choice is None:
        return None
    with router.start(choice) as flight:
        flight.first_token()
        compute: int = choice.compute_tokens
        queued: int = choice.queued
        print(choice.replica, choice.load, choice.cost_us, compute, queued, router.in_flight(choice.replica))
    weights: Optional[Dict[str, Any]] = router.weights()
    print(weights)
    fleet.record(choice, len(token_ids), 16)
    again: Optional[kvevent.Choice] = router.retry(choice, ["a", "b"], token_ids, reason="503")
    if again is not None and not again.none_serving and again.attempt == 1:
        outcome: Optional[str] = router.start(again).finish(16)
        print(outcome, router.counters()["retries"])
    for r in fleet.replicas():
        load: Optional[kvevent.Load] = r.load
        if load is not None and load.age < 1.0:
            print(load.running, load.waiting, load.kv_usage, r.load_error)
    return choice.replica
