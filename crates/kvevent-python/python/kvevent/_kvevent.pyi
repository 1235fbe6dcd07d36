"""Type stubs of the native module (see the package's docstring)."""

from os import PathLike
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, TypeVar, Union, final

from ._types import Keys, Reason, State, TokenIds


__version__: str

class DecodeError(ValueError):
    """A payload that is not a batch of the engine's wire: what was wrong and at which byte."""

class RecordingError(ValueError):
    """A file that is not a recording, or a damaged one: the file and what was wrong where."""

def fingerprint_keys(token_ids: TokenIds, block_size: int, parent: Optional[int] = None) -> List[int]:
    """The prefix keys of ``token_ids``, one per full block of ``block_size`` tokens."""

def decode(payload: bytes, engine: str = "vllm") -> Dict[str, Any]:
    """The batch in ``payload`` as a dict: ``ts``, ``data_parallel_rank``, ``events``."""

@final
class Record:
    """One batch as it arrived, from a recording."""

    @property
    def rank(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def at_us(self) -> int: ...
    @property
    def topic(self) -> bytes: ...
    @property
    def replay(self) -> bool: ...
    @property
    def reset(self) -> Optional[str]: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def engine(self) -> str: ...
    def decode(self) -> Dict[str, Any]:
        """The payload decoded, as ``decode`` gives it."""

@final
class Recording:
    """A ``kvevents record`` file, read one record at a time."""

    def __new__(cls, path: Union[str, "PathLike[str]"]) -> "Recording": ...
    @property
    def engine(self) -> str: ...
    @property
    def started_unix_ms(self) -> int: ...
    @property
    def sources(self) -> List[Tuple[int, str, Optional[str]]]: ...
    def __iter__(self) -> Iterator[Record]: ...
    def __next__(self) -> Record: ...

ENGINES: bool
"""The wheel was built with the ``engines`` feature: ``Fleet.follow_engine`` works."""

ERROR_BUCKETS: List[int]
"""Upper bounds of the prediction error buckets, in blocks (expected - realized)."""

class NotReady(Exception):
    """Replicas not exact in time, or a token query before any replica said its block size."""

    replicas: Dict[str, str]
    """Each replica not exact, with its state and why."""
    waited: float
    """Seconds waited."""

class BlockSizeUnknown(NotReady):
    """No replica said its block size yet: route as if nothing matched."""

class NotFollowed(KeyError):
    """A replica the fleet does not follow."""

@final
class RankStatus:
    """One engine rank as its follower last saw it."""

    @property
    def rank(self) -> int: ...
    @property
    def connected(self) -> bool: ...
    @property
    def since(self) -> Optional[float]:
        """Seconds it has been connected, or lost (None: not known)."""
    @property
    def degraded(self) -> bool: ...

@final
class ReplicaStatus:
    """One replica as the fleet knows it."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str:
        """The sidecar's URL."""
    @property
    def state(self) -> State:
        """``exact``, ``degraded`` or ``stale``."""
    @property
    def reason(self) -> Optional[Reason]:
        """Why it is not exact (``connecting``, ``engine_lost``, ``source_lost``, ...)."""
    @property
    def exact(self) -> bool: ...
    @property
    def blocks(self) -> int: ...
    @property
    def newest_change(self) -> Optional[float]:
        """Seconds since its newest change was applied."""
    @property
    def block_size(self) -> Optional[int]: ...
    @property
    def batches(self) -> int: ...
    @property
    def error(self) -> Optional[str]:
        """The last error or refusal, in the library's words."""
    @property
    def ranks(self) -> List[RankStatus]: ...
    @property
    def load(self) -> Optional[Load]:
        """What its engine was doing when its sidecar last read it (judge its ``age``)."""
    @property
    def load_error(self) -> Optional[str]:
        """Why the sidecar's reads of the load fail since then."""

@final
class IndexStats:
    """The index's counters."""

    @property
    def keys(self) -> int: ...
    @property
    def pairs(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def table_bytes(self) -> int: ...
    @property
    def mapper_bytes(self) -> int: ...
    @property
    def evicted_keys(self) -> int: ...
    @property
    def stashed(self) -> int: ...
    @property
    def applied(self) -> int: ...
    @property
    def sources(self) -> int: ...
    @property
    def shared_pairs(self) -> int: ...
    @property
    def duplication(self) -> float: ...

@final
class Score:
    """One replica's match."""

    @property
    def replica(self) -> str: ...
    @property
    def matched_blocks(self) -> int: ...
    @property
    def matched_tokens(self) -> int: ...
    @property
    def tier(self) -> str:
        """``T1`` (GPU) or ``T2`` (an offload tier)."""
    @property
    def state(self) -> State:
        """``exact``, ``degraded`` or ``stale``: route on exact, fail open otherwise."""
    @property
    def reason(self) -> Optional[Reason]: ...
    @property
    def exact(self) -> bool: ...
    @property
    def load(self) -> Optional[Load]:
        """What its engine was doing when its sidecar last read it (judge its ``age``)."""

@final
class Scores:
    """The answer to a query, best first."""

    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __getitem__(self, i: int, /) -> Score: ...
    def __iter__(self) -> Iterator[Score]: ...
    @property
    def best(self) -> Optional[Score]:
        """The exact replica holding the most of the prompt; None when no exact replica holds
        any of it. Routing weighs load too: ``Router.choose``."""
    @property
    def not_followed(self) -> List[str]:
        """With ``score_among``: the candidates the fleet does not follow."""

@final
class Accounting:
    """One replica's predictions so far."""

    @property
    def decisions(self) -> int: ...
    @property
    def exact(self) -> int: ...
    @property
    def optimistic(self) -> int: ...
    @property
    def pessimistic(self) -> int: ...
    @property
    def not_exact_state(self) -> int: ...
    @property
    def error_blocks(self) -> List[int]: ...
    @property
    def error_sum(self) -> int: ...

@final
class Change:
    """Every replica now, those changed (or added) since the previous change, those removed."""

    @property
    def replicas(self) -> List[ReplicaStatus]: ...
    @property
    def changed(self) -> List[ReplicaStatus]: ...
    @property
    def removed(self) -> List[str]: ...

@final
class _Waiting:
    def cancel(self) -> None: ...

@final
class _Changes:
    def poll(self) -> Optional[Change]: ...
    def next_blocking(self) -> Optional[Change]: ...
    @property
    def closed(self) -> bool: ...
    def then(self, callback: Callable[[Optional[BaseException]], None]) -> _Waiting: ...

@final
class Member:
    """A replica as discovery has it."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def upstream(self) -> Optional[str]: ...
    @property
    def ready(self) -> bool: ...

@final
class Load:
    """What an engine was doing when its sidecar last read it."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def kv_usage(self) -> Optional[float]:
        """KV-cache usage, 0-1, when the engine says it."""
    @property
    def age(self) -> float:
        """Seconds since it was read, when this object was made."""
    @property
    def failing(self) -> bool:
        """The sidecar's reads since this one fail: it only ages."""
    @property
    def ranks(self) -> List[Dict[str, Optional[Union[int, float]]]]:
        """Each DP rank's load: its figures by name (`rank`, `running`, `waiting`,
        `kv_usage`, and any the engine's load gains)."""

@final
class Choice:
    """Where a request goes, and what the decision rests on."""

    @property
    def replica(self) -> str: ...
    @property
    def matched_tokens(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def compute_tokens(self) -> int:
        """Prompt tokens it will compute there (the prompt less what the replica holds exactly)."""
    @property
    def queued(self) -> int:
        """Requests estimated queued ahead of this one there."""
    @property
    def failed_open(self) -> bool: ...
    @property
    def none_serving(self) -> bool:
        """No candidate could serve (each was known down): chosen among all of them."""
    @property
    def attempt(self) -> int:
        """0 for a first choice, 1 for a retry (``Router.retry``)."""
    @property
    def load(self) -> Literal["fresh", "old", "none"]: ...
    @property
    def cost_us(self) -> float: ...
    @property
    def state(self) -> State: ...
    @property
    def reason(self) -> Optional[Reason]: ...
    @property
    def exact(self) -> bool: ...

@final
class Flight:
    """A request in flight, from ``Router.start`` until ``end()`` or its ``with`` block ends."""

    def first_token(self) -> None:
        """Its first token came: its prompt no longer counts ahead of the next request."""
    def end(self) -> None: ...
    def finish(
        self, cached_tokens: Optional[int] = None
    ) -> Optional[Literal["exact", "optimistic", "pessimistic"]]:
        """Ends it, recording the engine's cached tokens against the choice's prediction."""
    def __enter__(self) -> Flight: ...
    def __exit__(self, *exc: object) -> bool: ...

@final
class Router:
    """The routing loop over a fleet (kvevent_fleet::route::Router): ``choose``, ``start``,
    ``retry`` after a replica failed a request."""

    def __new__(
        cls,
        fleet: _Fleet,
        policy: Literal["cost", "prefix-only", "least-loaded", "round-robin"] = "cost",
        *,
        prefill_us_per_token: Optional[float] = None,
        queue_us_per_request: Optional[float] = None,
        load_old_after: float = 1.0,
    ) -> "Router": ...
    @property
    def policy(self) -> str: ...
    def choose(
        self,
        candidates: Sequence[str],
        tokens: TokenIds,
        *,
        adapter: str = "",
    ) -> Optional[Choice]: ...
    def retry(
        self,
        failed: Choice,
        candidates: Sequence[str],
        tokens: TokenIds,
        *,
        reason: Literal["refused", "502", "503"] = "refused",
        adapter: str = "",
    ) -> Optional[Choice]: ...
    def start(self, replica: Union[Choice, str]) -> Flight: ...
    def in_flight(self, replica: str) -> int: ...
    def counters(self) -> Dict[str, Any]:
        """``{"retries": {(replica, reason): n}, "none_serving": n}``."""
    def weights(self) -> Optional[Dict[str, Any]]:
        """``{"prefill_us_per_token", "queue_us_per_request", "learned", "flights"}``; None
        for a policy other than cost."""

_F = TypeVar("_F", bound="_Fleet")

class _Fleet:
    def __new__(
        cls: "type[_F]",
        *,
        byte_budget: int = ...,
        dead_after: float = 3.0,
        drop_after: float = 60.0,
        connect_timeout: float = 5.0,
        lag_after: float = 0.3,
        reconnect_initial: float = 0.1,
        reconnect_max: float = 2.0,
        max_message_bytes: int = ...,
    ) -> _F: ...
    def follow(
        self,
        name: str,
        url: str,
        *,
        replica: str = "",
        model: str = "",
        token: Optional[str] = None,
        tls_ca: Optional[Union[str, "PathLike[str]"]] = None,
        tls_domain: Optional[str] = None,
    ) -> None:
        """Follows replica ``name`` through its sidecar's feed at ``url``."""
    def discover(self, spec: str, *, model: str = "") -> None:
        """Follows replicas as ``spec`` (``file:``, ``dns:``, ``kube:``) discovers them."""
    def discovered(self) -> List[Member]: ...
    def follow_engine(
        self,
        name: str,
        engine_sockets: str,
        *,
        replay: Optional[str] = None,
        dp: Optional[int] = None,
        topic: Optional[str] = None,
        engine: Optional[Literal["vllm", "sglang"]] = None,
        http: Optional[str] = None,
    ) -> None:
        """Follows replica ``name`` through its engine's sockets (a wheel built with the
        ``engines`` feature; RuntimeError otherwise)."""
    def remove(self, name: str) -> None:
        """Stops following ``name`` and forgets what it held."""
    def replicas(self) -> List[ReplicaStatus]: ...
    def replica(self, name: str) -> ReplicaStatus: ...
    @property
    def block_size(self) -> Optional[int]: ...
    def stats(self) -> IndexStats: ...
    def score(
        self,
        tokens: Optional[TokenIds] = None,
        *,
        keys: Optional[Keys] = None,
        block_size: Optional[int] = None,
        adapter: str = "",
    ) -> Scores:
        """Every replica holding block 0 of the query, best first."""
    def score_among(
        self,
        candidates: Sequence[str],
        tokens: Optional[TokenIds] = None,
        *,
        keys: Optional[Keys] = None,
        block_size: Optional[int] = None,
        adapter: str = "",
    ) -> Scores:
        """``score`` among ``candidates`` only; those not followed are in ``not_followed``."""
    def record(
        self,
        chosen: Union[Choice, Score, str],
        prompt_tokens: int,
        cached_tokens: int,
        *,
        block_size: Optional[int] = None,
    ) -> str:
        """Records what the engine reused: ``exact``, ``optimistic`` or ``pessimistic``."""
    def accounting(self) -> Dict[str, Accounting]: ...
    def ready_blocking(self, timeout: float, names: Optional[Sequence[str]] = None) -> None:
        """Blocks until the replicas are exact, for at most ``timeout`` seconds."""
    def _ready_then(
        self,
        timeout: float,
        names: Optional[Sequence[str]],
        callback: Callable[[Optional[BaseException]], None],
    ) -> _Waiting: ...
    def _changes(self) -> _Changes: ...
    def close(self) -> None:
        """Stops following every replica; ``ready`` fails and ``changes`` ends after."""
    @property
    def closed(self) -> bool: ...
