"""Type stubs of the native module (see the package's docstring)."""

from os import PathLike
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

__version__: str

class DecodeError(ValueError):
    """A payload that is not a batch of the engine's wire: what was wrong and at which byte."""

class RecordingError(ValueError):
    """A file that is not a recording, or a damaged one: the file and what was wrong where."""

def fingerprint_keys(
    token_ids: Sequence[int], block_size: int, parent: Optional[int] = None
) -> List[int]:
    """The prefix keys of ``token_ids``, one per full block of ``block_size`` tokens."""

def decode(payload: bytes, engine: str = "vllm") -> Dict[str, Any]:
    """The batch in ``payload`` as a dict: ``ts``, ``data_parallel_rank``, ``events``."""

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

class Recording:
    """A ``kvevents record`` file, read one record at a time."""

    def __init__(self, path: Union[str, "PathLike[str]"]) -> None: ...
    @property
    def engine(self) -> str: ...
    @property
    def started_unix_ms(self) -> int: ...
    @property
    def sources(self) -> List[Tuple[int, str, Optional[str]]]: ...
    def __iter__(self) -> Iterator[Record]: ...
    def __next__(self) -> Record: ...
