"""The Fleet's async side: what asyncio awaits is a future on the caller's loop, settled from
the fleet's runtime thread with ``loop.call_soon_threadsafe``. Nothing waits in a thread of
the loop's executor."""

import asyncio
from typing import Callable, Iterable, Optional

from ._kvevent import Change, _Changes, _Fleet, _Waiting


def _settle(future: "asyncio.Future[None]", error: Optional[BaseException]) -> None:
    if future.done():  # cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _awaitable(start: Callable[[Callable[[Optional[BaseException]], None]], _Waiting]) -> "asyncio.Future[None]":
    """A future on the running loop that ``start(callback)``'s wait settles; cancelling the
    future cancels the wait."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def done(error: Optional[BaseException]) -> None:  # on the fleet's runtime thread
        try:
            loop.call_soon_threadsafe(_settle, future, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    waiting = start(done)
    future.add_done_callback(lambda f: waiting.cancel() if f.cancelled() else None)
    return future


class Changes:
    """The fleet's changes from when ``Fleet.changes()`` was called: iterate with ``for`` (each
    step blocks, the GIL released) or ``async for`` (on the caller's loop). Each item is a
    ``Change``; the iteration ends when the fleet is closed. Changes that came and went while
    nobody looked fold into one item, or none."""

    def __init__(self, native: _Changes) -> None:
        self._native = native

    def __iter__(self) -> "Changes":
        return self

    def __next__(self) -> Change:
        change = self._native.next_blocking()
        if change is None:
            raise StopIteration
        return change

    def __aiter__(self) -> "Changes":
        return self

    async def __anext__(self) -> Change:
        while True:
            change = self._native.poll()
            if change is not None:
                return change
            if self._native.closed:
                raise StopAsyncIteration
            await _awaitable(self._native.then)


class Fleet(_Fleet):
    """A router's replicas in one prefix index, each followed by name through its sidecar's feed
    (``kvevent-subscriber --feed-address``): everything it holds, then its changes and its
    engine's health. Every answer says how far to trust it: route on ``exact``.

    Make it anywhere (it runs its own thread); ``close()`` it, or use it as a context manager.
    ``await fleet.ready(timeout)`` and ``async for change in fleet.changes()`` on an event loop;
    ``fleet.ready_blocking(timeout)`` and ``for change in fleet.changes()`` in a thread.
    """

    async def ready(self, timeout: float, names: Optional[Iterable[str]] = None) -> None:
        """Waits until the replicas ``names`` (every one followed when None) are exact, for at
        most ``timeout`` seconds: ``NotReady`` says which are not and why, ``NotFollowed`` names
        one not followed."""
        listed = None if names is None else list(names)
        await _awaitable(lambda done: self._ready_then(timeout, listed, done))

    def changes(self) -> Changes:
        """The changes from now on, for ``for`` or ``async for``."""
        return Changes(self._changes())

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "Fleet":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
