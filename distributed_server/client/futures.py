"""Futures of distributed-core: `Future`, the key state its copies share, `wait`, `as_completed`.

What this module does
---------------------
- `Future` names a remote result by its key. Many Future objects may share one key; they
  share one ``KeyState``, counted by reference by the client's key table
  (`distributed_server.client.key_table`), and the client sends ``release-keys`` when
  the count drops to zero. A Future reaches its client only through `FutureClient`,
  the protocol below (hold and release a key, run a coroutine of the client's, wait,
  callbacks), so this module never imports `distributed_server.client.client`.
- `wait` and `as_completed` work on futures of one client, sync or async.
- A Future pickles only inside a value that a coordination primitive carries
  (`distributed_server.client.primitives`): there it records its key (``pickled_keys``) and
  unpickles as a Future of the same key on the receiving client (``unpickling_client``,
  else the default client), which then wants the key. Anywhere else pickling a Future
  raises TypeError: a task argument is the way to hand a task a Future's result.
- `default_client` is the client a ``Future(key)`` made without one attaches to: the
  most recent `Client` made with ``set_as_default=True`` and still open (the client
  registers and forgets itself here).
- The exceptions futures raise: `CancelledError`, `TaskFailedError`,
  `GraphRefusedError`, `SchedulerConnectionError`, `SchedulerError`, and the key
  statuses (``Future.status``).

Threads
-------
Every change of a key's status happens on the client's loop thread. ``Future.__del__``
never blocks and never takes a lock: it hands the release to the client, which queues it.

Errors
------
`CancelledError` is ``concurrent.futures.CancelledError`` (an ``Exception``; asyncio's is a
``BaseException`` that would read as "this coroutine was cancelled"). A task's own
exception is re-raised with the remote traceback as its ``__cause__``;
`TaskFailedError` (RuntimeError) is a failure the scheduler decided, `GraphRefusedError`
(ValueError) a graph it refused, `SchedulerConnectionError` (a ``CommClosedError``) is
raised by pending futures when the connection is lost or the client closed.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import functools
import html
import logging
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol, runtime_checkable

from ..comm import CommClosedError

__all__ = [
    "ALL_COMPLETED",
    "FIRST_COMPLETED",
    "FIRST_EXCEPTION",
    "CancelledError",
    "DoneAndNotDoneFutures",
    "Future",
    "FutureClient",
    "GraphRefusedError",
    "SchedulerConnectionError",
    "SchedulerError",
    "TaskFailedError",
    "as_completed",
    "default_client",
    "futures_of",
    "wait",
]

#: Raised by a cancelled future (concurrent.futures', not asyncio's: it is an Exception).
CancelledError = concurrent.futures.CancelledError

ALL_COMPLETED = "ALL_COMPLETED"
FIRST_COMPLETED = "FIRST_COMPLETED"
FIRST_EXCEPTION = "FIRST_EXCEPTION"

# Key statuses (Future.status)
PENDING = "pending"
FINISHED = "finished"
ERROR = "error"
CANCELLED = "cancelled"


class SchedulerConnectionError(CommClosedError):
    """The connection to the scheduler is gone (lost, or the client closed).

    Pending futures raise it instead of waiting forever; so does every call that needs
    the scheduler.
    """


class GraphRefusedError(ValueError):
    """The scheduler refused a submitted graph; the message is the scheduler's reason."""


class TaskFailedError(RuntimeError):
    """A task failed for a reason the scheduler decided (e.g. its workers kept dying)."""


class SchedulerError(RuntimeError):
    """The scheduler answered a request with an error."""


# ---------------------------------------------------------------------------- key state


class KeyState:
    """What the client knows about one key; shared by every Future of that key.

    ``refs`` counts the Futures holding it (changed under the client's lock); everything
    else changes on the client's loop thread only. ``watchers`` are callables run with
    the state when it settles; ``epoch`` counts settlings, so a fetch can tell whether a
    key it found missing has been recomputed meanwhile.
    """

    __slots__ = ("data", "epoch", "error", "key", "refs", "status", "traceback",
                 "type_name", "watchers")

    def __init__(self, key) -> None:
        self.key = key
        self.status = PENDING
        self.type_name: str | None = None
        self.data = None  # the pickled result, when the scheduler sent it inline
        self.error: Callable[[], BaseException] | None = None
        self.traceback: str | None = None
        self.refs = 0
        self.watchers: list | None = None
        self.epoch = 0

    def settle(self, status: str) -> None:
        """Take the final ``status`` (for now) and run the watchers once."""
        self.status = status
        self.epoch += 1
        watchers, self.watchers = self.watchers, None
        if watchers:
            for watcher in watchers:
                watcher(self)

    def finish(self, data, type_name) -> None:
        self.data = data
        if type_name is not None:  # scattered keys: the scheduler does not know the type
            self.type_name = type_name
        self.settle(FINISHED)

    def fail(self, error: Callable[[], BaseException], traceback: str | None) -> None:
        self.data = None  # a finished future failed afterwards (its graph) keeps no result
        self.error = error
        self.traceback = traceback
        self.settle(ERROR)

    def cancel(self, reason: str | None = None) -> None:
        """Settle as cancelled; ``reason`` (e.g. the cluster was restarted) goes into the
        `CancelledError` the futures raise."""
        self.data = self.traceback = None
        self.error = None if reason is None else functools.partial(
            CancelledError, f"{self.key!r} was cancelled: {reason}")
        self.settle(CANCELLED)

    def reset(self) -> None:
        """Back to pending (retried, or its data was lost) without running watchers."""
        self.status = PENDING
        self.data = self.error = self.traceback = None

    def watch(self, watcher: Callable) -> None:
        if self.watchers is None:
            self.watchers = [watcher]
        else:
            self.watchers.append(watcher)

    def unwatch(self, watcher: Callable) -> None:
        if self.watchers is not None and watcher in self.watchers:
            self.watchers.remove(watcher)

    def exception(self) -> BaseException:
        """A fresh exception for an erred or cancelled key."""
        if self.status == CANCELLED:
            if self.error is not None:
                return self.error()
            return CancelledError(f"{self.key!r} was cancelled")
        assert self.error is not None
        return self.error()

    def local_result(self):
        """The result if it is here already; raises the key's error; else `_NOT_HERE`."""
        if self.status == FINISHED:
            return _NOT_HERE if self.data is None else pickle.loads(self.data)
        if self.status == PENDING:
            return _NOT_HERE
        raise self.exception()


_NOT_HERE = object()  # a result that must be waited for or fetched


# ---------------------------------------------------------------------------- FutureClient


@runtime_checkable
class FutureClient(Protocol):
    """What a `Future` needs from its client (and `wait`, `as_completed` and
    `distributed_server.client.task_specs` too): `distributed_server.client.client.Client`
    implements it.

    The members are underscored because users do not call them: they are the contract
    between futures and their client, and nothing in this module reaches further into
    the client. Any thread may call the plain methods; the coroutine functions run on the
    client's loop, handed to `_sync`.
    """

    #: True for a client whose blocking methods return awaitables instead.
    asynchronous: bool

    def _hold_key(self, key) -> KeyState:
        """A new reference to ``key``'s state (the scheduler is asked about a new key)."""

    def _release_later(self, state: KeyState) -> None:
        """Drop one reference to ``state`` soon; never blocks, never takes a lock
        (`Future.__del__` calls it)."""

    def _sync(self, method: Callable, *args):
        """Run the coroutine function ``method(*args)`` on the client's loop: its result
        (blocking) in a sync client, an awaitable in an async one."""

    def _on_loop(self) -> bool:
        """Whether the caller runs on the client's loop thread (where blocking is
        refused)."""

    async def _result(self, future: Future, timeout: float | None):
        """The future's value (fetched from a worker if need be); raises its error."""

    async def _result_anywhere(self, future: Future):
        """`_result`, awaited from the client's loop or from any other asyncio loop."""

    async def _exception(self, future: Future, timeout: float | None):
        """Once settled: the future's exception, or None if it succeeded."""

    async def _traceback(self, future: Future, timeout: float | None):
        """Once settled: the remote traceback text of a failed task, else None."""

    async def _wait(self, futures: list[Future], timeout: float | None,
                    return_when: str) -> DoneAndNotDoneFutures:
        """`wait` on the client's loop."""

    def _add_done_callbacks(self, futures: list[Future], fn: Callable) -> None:
        """Call ``fn(future)`` on the loop thread once each future is done."""

    def cancel(self, futures, force: bool = False):
        """`Future.cancel` of a list of futures."""

    def retry(self, futures):
        """`Future.retry` of a list of futures."""


# ---------------------------------------------------------------------------- Future


class Future:
    """A remote result, named by its key.

    Made by `Client.submit`, `Client.map`, `Client.scatter`, or ``Future(key, client)``
    for a key the scheduler already has. ``status`` is 'pending', 'finished', 'error' or
    'cancelled'. In a sync client `result`, `exception`, `traceback`, `cancel` and
    `retry` block; in an async client they return awaitables, and ``await future`` gives
    the result. When the last Future of a key is released or garbage-collected, the
    client tells the scheduler it no longer wants the key.
    """

    __slots__ = ("__weakref__", "_held", "_state", "client", "key")

    #: dask treats objects with this flag as futures: inside a graph (e.g. a persisted
    #: collection's ``{key: future}``) a future stands for its key's value.
    __dask_future__ = True

    def __init__(self, key, client: FutureClient | None = None) -> None:
        client = client if client is not None else default_client()
        self._state = client._hold_key(key)
        self.key = key
        self.client = client
        self._held = True

    @classmethod
    def _attach(cls, state: KeyState, client: FutureClient) -> Future:
        """A Future for a state whose reference the caller already counted."""
        future = object.__new__(cls)
        future._state = state
        future.key = state.key
        future.client = client
        future._held = True
        return future

    @property
    def status(self) -> str:
        """'pending', 'finished', 'error' or 'cancelled'."""
        return self._state.status

    @property
    def type(self) -> str | None:
        """The type name of the result, once finished."""
        return self._state.type_name

    def done(self) -> bool:
        """Whether the key is finished, erred or cancelled."""
        return self._state.status != PENDING

    def cancelled(self) -> bool:
        """Whether the key was cancelled."""
        return self._state.status == CANCELLED

    def result(self, timeout: float | None = None):
        """The result; raises the task's exception (remote traceback as its cause),
        `CancelledError` if cancelled, ``TimeoutError`` after ``timeout`` seconds."""
        client = self.client
        if not client.asynchronous:
            value = self._state.local_result()
            if value is not _NOT_HERE:
                return value
        return client._sync(client._result, self, timeout)

    def exception(self, timeout: float | None = None):
        """The task's exception once done (None if it succeeded)."""
        return self.client._sync(self.client._exception, self, timeout)

    def traceback(self, timeout: float | None = None):
        """The remote traceback text of a failed task once done (None otherwise)."""
        return self.client._sync(self.client._traceback, self, timeout)

    def cancel(self, force: bool = False):
        """Cancel this key (for every client wanting it, with ``force``)."""
        return self.client.cancel([self], force=force)

    def retry(self):
        """Run this failed task (and the failed tasks it depends on) again."""
        return self.client.retry([self])

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        """Call ``fn(self)`` once done, on this process's callback thread (one thread,
        callbacks in the order they became due, as dask's), where blocking calls such as
        ``future.result()`` work; an exception it raises is logged."""
        self.client._add_done_callbacks([self], functools.partial(_on_callback_thread, fn))

    def release(self) -> None:
        """Drop this Future's hold on its key now instead of at garbage collection."""
        if self._held:
            self._held = False
            self.client._release_later(self._state)

    def __await__(self):
        return self.client._result_anywhere(self).__await__()

    def __del__(self) -> None:
        if getattr(self, "_held", False):
            self._held = False
            self.client._release_later(self._state)

    def __reduce__(self):
        keys = pickled_keys.get()
        if keys is None:
            raise TypeError("a Future cannot be pickled: pass it in a task's arguments (also "
                            "inside lists, tuples, sets and dicts) and the task gets its "
                            "result, or share it through a Variable, a Queue or Pub/Sub")
        keys.append(self.key)
        return (_future_of_key, (self.key,))

    def __dask_tokenize__(self):
        return ("distributed_server.Future", self.key)

    def __repr__(self) -> str:
        state = self._state
        kind = f", type: {state.type_name}" if state.status == FINISHED and state.type_name else ""
        return f"<Future: {state.status}{kind}, key: {state.key!r}>"

    def _repr_html_(self) -> str:
        """A notebook's summary: key, status and, once finished, the result's type."""
        state = self._state
        rows = [("key", repr(state.key)), ("status", state.status)]
        if state.status == FINISHED and state.type_name:
            rows.append(("type", state.type_name))
        return _html_table("Future", rows)


def _html_table(title: str, rows: list) -> str:
    """A small HTML table of ``(label, text)`` rows under ``title``, every text escaped."""
    body = "".join(f"<tr><th style='text-align:left'>{html.escape(label)}</th>"
                   f"<td style='text-align:left'>{html.escape(str(text))}</td></tr>"
                   for label, text in rows)
    return f"<div><strong>{html.escape(title)}</strong><table>{body}</table></div>"


# ---------------------------------------------------------------------------- pickled futures

#: While a primitive pickles a value: the list that collects the keys of its Futures.
pickled_keys: contextvars.ContextVar = contextvars.ContextVar("dcore_pickled_keys",
                                                               default=None)
#: While a primitive unpickles a value: the client its Futures belong to.
unpickling_client: contextvars.ContextVar = contextvars.ContextVar("dcore_unpickling_client",
                                                                    default=None)


def _future_of_key(key) -> Future:
    """A pickled Future, unpickled: a Future of the same key on the receiving client
    (which asks the scheduler for the key if it did not hold it)."""
    client = unpickling_client.get()
    if client is None:
        try:
            client = default_client()
        except ValueError:
            raise ValueError(f"a Future of {key!r} was unpickled where no client is open: "
                             "create a Client first") from None
    return Future(key, client)


# ---------------------------------------------------------------------------- default client


_callbacks: concurrent.futures.ThreadPoolExecutor | None = None
_callbacks_pid: int | None = None
_callbacks_lock = threading.Lock()


def _on_callback_thread(fn: Callable, future: Future) -> None:
    """Run a user's done callback on the callback thread (made on first use; a forked
    child makes its own)."""
    global _callbacks, _callbacks_pid
    with _callbacks_lock:
        if _callbacks is None or _callbacks_pid != os.getpid():
            _callbacks = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="distributed-core-callback")
            _callbacks_pid = os.getpid()
        executor = _callbacks
    executor.submit(_call_logged, fn, future)


def _call_logged(fn: Callable, future: Future) -> None:
    try:
        fn(future)
    except Exception:
        logging.getLogger("distributed_server.client").exception(
            "done callback %r of %r failed", fn, future)


#: The clients made with ``set_as_default=True`` and still open, oldest first (weak
#: references: an unclosed client that is collected drops out).
_defaults: list = []
_defaults_lock = threading.Lock()


def _live_defaults() -> list:
    return [c for c in (ref() for ref in _defaults) if c is not None]


def default_client() -> FutureClient:
    """The most recent client made with ``set_as_default=True`` and still open."""
    with _defaults_lock:
        live = _live_defaults()
    if not live:
        raise ValueError("no default client: create a Client first")
    return live[-1]


def has_default_client() -> bool:
    """Whether `default_client` has a client to return."""
    with _defaults_lock:
        return bool(_live_defaults())


def set_default_client(client: FutureClient) -> None:
    """Make ``client`` the one `default_client` returns (a Client made with
    ``set_as_default=True`` calls this once started)."""
    with _defaults_lock:
        _defaults[:] = [r for r in _defaults if r() is not None and r() is not client]
        _defaults.append(weakref.ref(client))


def forget_default_client(client: FutureClient) -> None:
    """``client`` closed: the default is again the most recent one before it, if any."""
    with _defaults_lock:
        _defaults[:] = [r for r in _defaults if r() is not None and r() is not client]


# ---------------------------------------------------------------------------- helpers


def futures_in(futures) -> list[Future]:
    """A single future or an iterable of futures, as a list."""
    if isinstance(futures, Future):
        return [futures]
    if isinstance(futures, dict):
        return list(futures.values())
    return list(futures)


def unique_states(futures: Iterable[Future]) -> list[KeyState]:
    return list(dict.fromkeys(f._state for f in futures))


# ---------------------------------------------------------------------------- wait, as_completed


class DoneAndNotDoneFutures(NamedTuple):
    """What `wait` returns: two sets of futures."""

    done: set
    not_done: set


def wait(futures, timeout: float | None = None, return_when: str = ALL_COMPLETED):
    """Wait until all of ``futures`` are done; with FIRST_COMPLETED until any is, with
    FIRST_EXCEPTION until all are or one failed (erred or was cancelled).

    Returns ``(done, not_done)`` sets; raises ``TimeoutError`` after ``timeout`` seconds.
    All futures must belong to one client; with an async client this returns an awaitable.
    """
    if return_when not in (ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION):
        raise ValueError(f"return_when must be ALL_COMPLETED, FIRST_COMPLETED or "
                         f"FIRST_EXCEPTION, not {return_when!r}")
    futures = futures_in(futures)
    client = _client_of(futures)
    if client is None:
        return DoneAndNotDoneFutures(set(), set())
    return client._sync(client._wait, futures, timeout, return_when)


def futures_of(obj) -> list[Future]:
    """The futures inside ``obj``, once each, in order: a future, lists, tuples, sets and
    dicts of them (nested), and dask collections whose graphs hold futures (persisted
    ones)."""
    found: dict = {}
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, Future):
            found[id(item)] = item
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo.extend(reversed(list(item)))
        elif isinstance(item, dict):
            todo.extend(reversed(list(item.values())))
        elif hasattr(item, "__dask_graph__"):
            graph = item.__dask_graph__()
            if graph is not None:
                todo.extend(reversed(list(graph.values())))
    return list(found.values())


def _client_of(futures: list[Future]) -> FutureClient | None:
    clients = {id(f.client): f.client for f in futures}
    if len(clients) > 1:
        raise ValueError("these futures belong to different clients")
    return next(iter(clients.values()), None)


class as_completed:
    """Iterate over futures as they finish: ``for future in as_completed(futures)``, or
    ``async for`` with an async client.

    ``with_results=True`` yields ``(future, result)`` pairs; a failed future then raises
    its exception, or yields ``(future, exception)`` with ``raise_errors=False``.
    `add` and `update` put more futures in while iterating.
    """

    def __init__(self, futures: Iterable[Future] = (), with_results: bool = False,
                 raise_errors: bool = True) -> None:
        self.with_results = with_results
        self.raise_errors = raise_errors
        self._cond = threading.Condition()
        self._ready: collections.deque = collections.deque()
        self._pending = 0
        self._generation = 0  # clear() starts a new one: older callbacks are ignored
        self._client: FutureClient | None = None
        self._wakeup: asyncio.Future | None = None
        self.update(futures)

    def add(self, future: Future) -> None:
        """Include one more future."""
        self.update([future])

    def update(self, futures: Iterable[Future]) -> None:
        """Include more futures."""
        futures = list(futures)
        client = _client_of(futures)
        if client is None:
            return
        with self._cond:
            if self._client not in (None, client):
                raise ValueError("these futures belong to another client")
            self._client = client
            self._pending += len(futures)
            generation = self._generation
        client._add_done_callbacks(futures, lambda f: self._on_done(f, generation))

    def count(self) -> int:
        """How many futures are still to be yielded."""
        with self._cond:
            return self._pending + len(self._ready)

    def is_empty(self) -> bool:
        """Whether every future was yielded (or cleared)."""
        return self.count() == 0

    def clear(self) -> None:
        """Forget every future not yet yielded: iteration ends."""
        with self._cond:
            self._ready.clear()
            self._generation += 1
            self._pending = 0
            self._cond.notify_all()
            wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.get_loop().call_soon_threadsafe(_resolve, wakeup)

    def next_batch(self, block: bool = True) -> list:
        """Every future done so far, at least one if ``block`` (an empty list if none is
        left). With ``with_results``, ``(future, result)`` pairs."""
        with self._cond:
            while block and not self._ready and self._pending:
                self._cond.wait()
            batch = list(self._ready)
            self._ready.clear()
        return [self._with_result(future) for future in batch]

    def batches(self):
        """Iterate over lists of futures as they finish: each list holds every future
        done since the last one."""
        while True:
            batch = self.next_batch(block=True)
            if not batch:
                return
            yield batch

    def _with_result(self, future: Future):
        if not self.with_results:
            return future
        try:
            return future, future.result()
        except Exception as e:
            if self.raise_errors:
                raise
            return future, e

    def _on_done(self, future: Future, generation: int) -> None:
        with self._cond:
            if generation != self._generation:  # cleared before it was done
                return
            self._pending -= 1
            self._ready.append(future)
            self._cond.notify_all()
            wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.get_loop().call_soon_threadsafe(_resolve, wakeup)

    def __iter__(self):
        return self

    def __next__(self):
        client = self._client
        if client is not None and client._on_loop():
            raise RuntimeError("iterate an as_completed of this client with 'async for'")
        with self._cond:
            while not self._ready:
                if not self._pending:
                    raise StopIteration
                self._cond.wait()
            future = self._ready.popleft()
        return self._with_result(future)

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            with self._cond:
                if self._ready:
                    future = self._ready.popleft()
                    break
                if not self._pending:
                    raise StopAsyncIteration
                self._wakeup = wakeup = asyncio.get_running_loop().create_future()
            await wakeup
        if not self.with_results:
            return future
        try:
            return future, await future
        except Exception as e:
            if self.raise_errors:
                raise
            return future, e


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
