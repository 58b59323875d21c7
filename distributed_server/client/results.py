"""Getting results back and waiting for futures: `Client.gather`, and what a `Future`
awaits of its client (``_result``, ``_exception``, ``_traceback``, ``_wait``, done
callbacks: the coroutine half of `FutureClient`).

`ResultsMixin` is one of the classes `Client` is made of. A result small enough came
inline with ``key-in-memory`` and is unpickled here; the others are fetched from the
workers that hold them (`WorkerTransfers.fetch`, asking the scheduler ``who-has`` again
when a holder is gone). Waiting is a latch watched by the key states: nothing polls.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Callable

from .futures import (
    CANCELLED,
    ERROR,
    FINISHED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    PENDING,
    DoneAndNotDoneFutures,
    Future,
    KeyState,
    unique_states,
)
from .task_specs import SEQUENCES
from .transfers import WorkerTransfers

__all__ = ["ResultsMixin"]

logger = logging.getLogger("distributed_server.client")

_SKIPPED = object()  # a failed future left out by gather(errors="skip")


class _Latch:
    """Resolves ``future`` once ``needed`` watched states settled, or at the first
    failure with ``stop_on_error``."""

    __slots__ = ("future", "needed", "stop_on_error")

    def __init__(self, needed: int, stop_on_error: bool, future: asyncio.Future) -> None:
        self.needed = needed
        self.stop_on_error = stop_on_error
        self.future = future

    def __call__(self, state: KeyState) -> None:
        self.needed -= 1
        if (self.needed <= 0 or self.stop_on_error and state.status != FINISHED) \
                and not self.future.done():
            self.future.set_result(None)


class _DoneCallback:
    """A user's done callback, called with its future; failures are logged."""

    __slots__ = ("fn", "future")

    def __init__(self, future: Future, fn: Callable) -> None:
        self.future = future
        self.fn = fn

    def __call__(self, state: KeyState) -> None:
        try:
            self.fn(self.future)
        except Exception:
            logger.exception("done callback %r of %r failed", self.fn, self.future)


def _collect_states(obj, client, found: dict) -> None:
    """The key states of every Future inside nested lists, tuples, sets and dict values."""
    if isinstance(obj, Future):
        if obj.client is not client:
            raise ValueError(f"{obj!r} belongs to another client")
        found[obj._state] = None
    elif type(obj) in SEQUENCES:
        for item in obj:
            _collect_states(item, client, found)
    elif type(obj) is dict:
        for item in obj.values():
            _collect_states(item, client, found)


def _rebuild(obj, values: dict):
    """``obj`` with each Future replaced by its value; failures left out (`_SKIPPED`)."""
    if isinstance(obj, Future):
        return values.get(obj._state, _SKIPPED)
    typ = type(obj)
    if typ in SEQUENCES:
        return typ([v for v in (_rebuild(item, values) for item in obj) if v is not _SKIPPED])
    if typ is dict:
        pairs = ((k, _rebuild(v, values)) for k, v in obj.items())
        return {k: v for k, v in pairs if v is not _SKIPPED}
    return obj


class ResultsMixin:
    """`gather`, and the waiting futures do on their client's loop.

    Mixed into `Client`, which provides ``_sync``, ``_call_soon``, ``_who_has``, the
    loop (``_loop``) and the transfers with workers (``_transfers``).
    """

    _loop: asyncio.AbstractEventLoop | None
    _transfers: WorkerTransfers | None

    def gather(self, futures, errors: str = "raise"):
        """The results of ``futures`` (a future, or nested lists/tuples/sets/dicts of
        them) in the same structure. ``errors="raise"`` raises the first failure;
        ``"skip"`` leaves failed futures out."""
        if errors not in ("raise", "skip"):
            raise ValueError(f"errors must be 'raise' or 'skip', not {errors!r}")
        return self._sync(self._gather, futures, errors)

    async def _gather(self, futures, errors: str):
        found: dict = {}
        _collect_states(futures, self, found)
        values = await self._gather_states(list(found), errors)
        result = _rebuild(futures, values)
        return None if result is _SKIPPED else result

    # These take the Future, not its state: the coroutine holds the key while it runs,
    # even when the caller kept no reference (``await client.submit(f).result()``).

    async def _result(self, future: Future, timeout: float | None):
        state = future._state
        values = await asyncio.wait_for(self._gather_states([state], "raise"), timeout)
        return values[state]

    async def _result_anywhere(self, future: Future):
        """The result, awaited from the client's loop or from any other asyncio loop."""
        if asyncio.get_running_loop() is self._loop:
            return await self._result(future, None)
        result = asyncio.run_coroutine_threadsafe(self._result(future, None), self._loop)
        return await asyncio.wrap_future(result)

    async def _exception(self, future: Future, timeout: float | None):
        state = future._state
        await asyncio.wait_for(self._wait_settled([state]), timeout)
        if state.status == CANCELLED:
            raise state.exception()
        return state.exception() if state.status == ERROR else None

    async def _traceback(self, future: Future, timeout: float | None):
        await asyncio.wait_for(self._wait_settled([future._state]), timeout)
        return future._state.traceback

    async def _wait_settled(self, states: list[KeyState], stop_on_error: bool = False,
                            needed: int | None = None) -> None:
        """Wait until ``needed`` (default: all) of ``states`` settled (or one failed)."""
        pending = [s for s in states if s.status == PENDING]
        if needed is not None:
            needed -= len(states) - len(pending)
        else:
            needed = len(pending)
        if stop_on_error and any(s.status not in (PENDING, FINISHED) for s in states):
            return
        if needed <= 0 or not pending:
            return
        latch = _Latch(needed, stop_on_error, self._loop.create_future())
        for state in pending:
            state.watch(latch)
        try:
            await latch.future
        finally:
            for state in pending:
                state.unwatch(latch)

    async def _gather_states(self, states: list[KeyState], errors: str) -> dict:
        """``{state: value}``; with errors="raise" the first failure (in order) is raised,
        with "skip" failures are left out."""
        values: dict = {}
        todo = states
        while todo:
            await self._wait_settled(todo, stop_on_error=errors == "raise")
            if errors == "raise":
                for state in todo:
                    if state.status in (ERROR, CANCELLED):
                        raise state.exception()
            remote = []
            for state in todo:
                if state.status == FINISHED:
                    if state.data is None:
                        remote.append(state)
                    else:
                        values[state] = pickle.loads(state.data)
            todo = await self._transfers.fetch(remote, values, self._who_has) if remote else []
        return values

    def _add_done_callbacks(self, futures: list[Future], fn: Callable) -> None:
        """Call ``fn(future)`` for each future once done, on the loop thread."""
        self._call_soon(self._watch_futures, futures, fn)

    def _watch_futures(self, futures: list[Future], fn: Callable) -> None:
        for future in futures:
            callback = _DoneCallback(future, fn)
            if future._state.status == PENDING:
                future._state.watch(callback)
            else:
                callback(future._state)

    async def _wait(self, futures: list[Future], timeout, return_when: str):
        states = unique_states(futures)
        needed = 1 if return_when == FIRST_COMPLETED else None
        await asyncio.wait_for(self._wait_settled(
            states, stop_on_error=return_when == FIRST_EXCEPTION, needed=needed), timeout)
        done = {f for f in futures if f.done()}
        return DoneAndNotDoneFutures(done, {f for f in futures if f not in done})
