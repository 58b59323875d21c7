"""The user-facing client of distributed-core: submit work, hold futures, get results back.

What this module does
---------------------
- `Client` connects to a scheduler (or starts a `LocalCluster` and owns it) and speaks the
  client side of docs/protocol.md: ``update-graph`` for `submit`/`map`/`get`,
  ``update-data`` after `scatter`, ``release-keys`` when the last `Future` of a key goes
  away, ``cancel``, ``retry``, ``desire-keys``, and ``who-has``/``identity`` requests
  matched to their ``reply`` by ``reqid``. Results arrive inline in ``key-in-memory``
  when small; otherwise they are fetched straight from the workers (``get-data`` over a
  pooled ``{"role": "peer"}`` connection, one request per worker for a whole batch).
- Sync and async use share one implementation: every operation is a coroutine on the
  client's event loop. A sync client runs that loop (tornado's IOStreams on asyncio) in a
  daemon thread and blocks on it; an async client (``asynchronous=True``) runs on the
  caller's loop and its methods return awaitables.
- `Future`: many Future objects may share one key. They share one ``_KeyState``, counted
  by reference; the client sends ``release-keys`` when the count drops to zero.
- `wait` and `as_completed` work on futures of one client, sync or async.

Threads
-------
Every change of a key's status happens on the loop thread. User threads only create key
states and references (under ``Client._lock``) and queue messages in the client's outbox,
which the loop drains in order, so a task is always sent before the release of a future
it depends on. ``Future.__del__`` never blocks and never takes a lock: it queues the
release and, at most once per drain, wakes the loop.

Task specs
----------
The worker runs ``pickle.loads(spec)(deps)`` and gets ``Call(func, args, kwargs)``. `map`
pickles the function once (cloudpickle: by value where needed). When the arguments are
builtin scalars, containers of them, and futures, each task's spec is that pickle's
fixed opening followed by the standard pickle of its arguments, so the per-task cost is
one small ``pickle.dumps`` instead of a cloudpickle of the whole call (which pickles a
function defined in ``__main__`` by value every time). Other arguments go through
cloudpickle. `submit` builds its spec the same way, so ``submit(f, x)`` and
``map(f, [x])`` give the same key. A pure task's key is ``f"{funcname}-{blake2b(spec)}"``.
At interpreter exit an open client just drops its connection (the scheduler releases
its keys as on ``close-client``) and stops the LocalCluster it owns.

dask collections
----------------
With dask installed (the ``dask`` extra), `get` is a dask scheduler
(``dask.compute(x, scheduler=client.get)``), `compute` and `persist` take dask
collections, and a client made with ``set_as_default=True`` is dask's default scheduler
until it closes. The graph is materialized, ordered and pickled here, in slices, by
`dask_support`; `_send_plan` sends the slices one at a time, holding the outbox meanwhile
so that nothing queued later overtakes them. Without dask these methods raise an
ImportError naming the extra, and `get` converts dict graphs itself (`_LegacyGraph`).

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
import contextlib
import functools
import hashlib
import itertools
import logging
import pickle
import random
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from . import dask_support
from .comm import Blob, Comm, CommClosedError, connect
from .serialize import (
    Call,
    TaskRef,
    dumps_data,
    dumps_spec,
    loads_data,
    loads_error,
    sizeof,
)

__all__ = [
    "ALL_COMPLETED",
    "FIRST_COMPLETED",
    "CancelledError",
    "Client",
    "DoneAndNotDoneFutures",
    "Future",
    "GraphRefusedError",
    "SchedulerConnectionError",
    "SchedulerError",
    "TaskFailedError",
    "as_completed",
    "default_client",
    "wait",
]

logger = logging.getLogger(__name__)

#: Raised by a cancelled future (concurrent.futures', not asyncio's: it is an Exception).
CancelledError = concurrent.futures.CancelledError

ALL_COMPLETED = "ALL_COMPLETED"
FIRST_COMPLETED = "FIRST_COMPLETED"

#: Task specs larger than this travel as an out-of-band Blob.
SPEC_BLOB_BYTES = 64 * 1024
#: Idle connections kept per worker for fetching results.
PEER_POOL_SIZE = 4
#: Rounds of who-has + get-data before a fetch gives up on a key that holders do not give.
FETCH_ROUNDS = 12
#: Seconds `close` waits for the scheduler connection to flush, and for the loop thread.
CLOSE_TIMEOUT = 5.0

# Key statuses (Future.status)
PENDING = "pending"
FINISHED = "finished"
ERROR = "error"
CANCELLED = "cancelled"

# Client statuses
_CREATED, _RUNNING, _LOST, _CLOSING, _CLOSED = "created", "running", "lost", "closing", "closed"


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


class _KeyState:
    """What the client knows about one key; shared by every Future of that key.

    ``refs`` counts the Futures holding it (changed under ``Client._lock``); everything
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
        self.error = error
        self.traceback = traceback
        self.settle(ERROR)

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
_SKIPPED = object()  # a failed future left out by gather(errors="skip")


def _task_error(exception, traceback, text: str) -> BaseException:
    """The exception of a ``task-erred`` message (a core-made one has no pickle)."""
    if exception is None:
        return TaskFailedError(text)
    return loads_error(exception, traceback, text)


class _Latch:
    """Resolves ``future`` once ``needed`` watched states settled, or at the first
    failure with ``stop_on_error``."""

    __slots__ = ("future", "needed", "stop_on_error")

    def __init__(self, needed: int, stop_on_error: bool, future: asyncio.Future) -> None:
        self.needed = needed
        self.stop_on_error = stop_on_error
        self.future = future

    def __call__(self, state: _KeyState) -> None:
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

    def __call__(self, state: _KeyState) -> None:
        try:
            self.fn(self.future)
        except Exception:
            logger.exception("done callback %r of %r failed", self.fn, self.future)


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

    def __init__(self, key, client: Client | None = None) -> None:
        client = client if client is not None else default_client()
        self._state = client._hold_key(key)
        self.key = key
        self.client = client
        self._held = True

    @classmethod
    def _attach(cls, state: _KeyState, client: Client) -> Future:
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
        """Call ``fn(self)`` once done, on the client's loop thread; errors are logged."""
        self.client._add_done_callbacks([self], fn)

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
        raise TypeError("a Future cannot be pickled: pass it in a task's arguments (also "
                        "inside lists, tuples, sets and dicts) and the task gets its result")

    def __dask_tokenize__(self):
        return ("distributed_server.Future", self.key)

    def __repr__(self) -> str:
        state = self._state
        kind = f", type: {state.type_name}" if state.status == FINISHED and state.type_name else ""
        return f"<Future: {state.status}{kind}, key: {state.key!r}>"


# ---------------------------------------------------------------------------- task encoding


_ATOMIC = frozenset({int, float, complex, bool, str, bytes, type(None), TaskRef})
_SEQUENCES = (tuple, list, set, frozenset)


class _PickledFunction:
    """A function pickled once; each task's spec embeds these bytes.

    Pickled inside a spec it is ``pickle.loads(payload)``, so the worker gets the function
    back with nothing of this module needed on its side.
    """

    __slots__ = ("payload",)

    def __init__(self, func: Callable) -> None:
        self.payload = dumps_spec(func)

    def __reduce__(self):
        return (pickle.loads, (self.payload,))

    def spec_head(self) -> bytes:
        """The opening of ``pickle.dumps(Call(self, args, kwargs))``, up to ``args``.

        Protocol-3 opcodes: PROTO 3, GLOBAL Call, GLOBAL pickle.loads, BINBYTES payload,
        TUPLE1, REDUCE. It writes nothing to the memo, so pickles of ``args`` and
        ``kwargs`` made separately (each numbering its memo from 0, and reading only
        what it wrote) may follow it: see `_plain_spec_body`.
        """
        loads = pickle.loads
        return b"".join([
            b"\x80\x03",
            f"c{Call.__module__}\n{Call.__qualname__}\n".encode(),
            f"c{loads.__module__}\n{loads.__name__}\n".encode(),
            b"B", struct.pack("<I", len(self.payload)), self.payload,
            b"\x85R",
        ])


def _pickle_segment(obj) -> bytes:
    """``obj``'s protocol-3 pickle without PROTO and STOP: opcodes that push ``obj``."""
    return pickle.dumps(obj, protocol=3)[2:-1]


def _plain_spec_body(args: tuple, kwargs: dict | None) -> bytes:
    """What follows `_PickledFunction.spec_head`: args, kwargs, TUPLE3, REDUCE, STOP."""
    kwargs_ops = _pickle_segment(kwargs) if kwargs else b"N"
    return b"".join([_pickle_segment(args), kwargs_ops, b"\x87R."])


class _ArgWalker:
    """Replaces this client's futures in nested tuples, lists, sets and dicts by TaskRefs.

    Collects their keys in ``deps`` and clears ``plain`` on meeting anything that is not
    a builtin scalar, a container of those, or a future: only plain arguments may be
    pickled with the standard pickler (which would pickle ``__main__`` objects by
    reference, useless on a worker).
    """

    __slots__ = ("client", "deps", "plain")

    def __init__(self, client: Client) -> None:
        self.client = client
        self.deps: list = []
        self.plain = True

    def walk(self, obj):
        typ = type(obj)
        if typ in _ATOMIC:
            return obj
        if typ in _SEQUENCES:
            return typ([self.walk(item) for item in obj])
        if typ is dict:
            if not all(type(k) in _ATOMIC for k in obj):
                self.plain = False
            return {k: self.walk(v) for k, v in obj.items()}
        if isinstance(obj, Future):
            return self._reference(obj)
        self.plain = False
        return obj

    def _reference(self, future: Future) -> TaskRef:
        if future.client is not self.client:
            raise ValueError(f"{future!r} belongs to another client")
        if future.status == CANCELLED:
            raise CancelledError(f"{future.key!r} was cancelled; it cannot be an argument")
        self.deps.append(future.key)
        return TaskRef(future.key)


def _funcname(func) -> str:
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__name__", None) or type(func).__name__
    return "lambda" if name == "<lambda>" else name


def _digest(*buffers) -> str:
    h = hashlib.blake2b(digest_size=16)
    for buffer in buffers:
        h.update(buffer)
    return h.hexdigest()


def _wire_spec(spec: bytes):
    return Blob(spec) if len(spec) > SPEC_BLOB_BYTES else spec


def _task_options(retries, priority, workers, resources, allow_other_workers) -> dict:
    """The optional task dict fields that differ from their defaults."""
    options: dict = {}
    if priority:
        options["priority"] = int(priority)
    if retries:
        options["retries"] = int(retries)
    if workers:
        options["workers"] = [workers] if isinstance(workers, str) else list(workers)
        if allow_other_workers:
            options["allow_other_workers"] = True
    if resources:
        options["resources"] = dict(resources)
    return options


class _TaskEncoder:
    """Turns calls of one function into task dicts; the function is pickled once.

    Plain arguments (see `_ArgWalker`) take the fast path: the spec is the function's
    pickled head plus the arguments' standard pickle, and a pure key hashes the head
    once. Other arguments are pickled with cloudpickle, task by task. Either way the
    spec unpickles to ``Call(func, args, kwargs)`` and a pure key is
    ``f"{prefix}-{blake2b(spec)}"``.
    """

    def __init__(self, client: Client, func: Callable, pure: bool, options: dict,
                 prefix: str | None = None) -> None:
        if not callable(func):
            raise TypeError(f"{func!r} is not callable")
        self.client = client
        self.func = _PickledFunction(func)
        self.head = self.func.spec_head()
        self.head_hash = hashlib.blake2b(self.head, digest_size=16)
        self.prefix = prefix or _funcname(func)
        self.pure = pure
        self.options = options

    def task(self, args: tuple, kwargs: dict | None, key=None) -> dict:
        walker = _ArgWalker(self.client)
        args = tuple([walker.walk(a) for a in args])
        kwargs = walker.walk(kwargs) if kwargs else None
        if walker.plain:
            body = _plain_spec_body(args, kwargs)
            spec = self.head + body
            if key is None and self.pure:
                digest = self.head_hash.copy()
                digest.update(body)
                key = f"{self.prefix}-{digest.hexdigest()}"
        else:
            spec = dumps_spec(Call(self.func, args, kwargs))
            if key is None and self.pure:
                key = f"{self.prefix}-{_digest(spec)}"
        if key is None:
            key = f"{self.prefix}-{uuid.uuid4().hex}"
        task = {"key": key, "spec": _wire_spec(spec)}
        if walker.deps:
            task["deps"] = walker.deps
        if self.options:
            task.update(self.options)
        return task


def _identity(value):
    """The spec of a legacy graph entry that is a literal or an alias of another key."""
    return value


class _LegacyGraph:
    """Converts a dict graph of ``(func, *args)`` tuples into Call/TaskRef task specs.

    An argument that is a key of the graph becomes a TaskRef (a dependency); a tuple
    starting with a callable is a nested task; lists are walked; anything else is a
    literal. An entry that is not a task (a literal, an alias, a list of keys) becomes a
    Call of `_identity`.
    """

    def __init__(self, graph: dict) -> None:
        self.graph = graph

    def tasks(self, options: dict) -> list[dict]:
        out = []
        for key, value in self.graph.items():
            deps: list = []
            spec = self._convert(value, deps)
            if type(spec) is not Call:
                spec = Call(_identity, (spec,))
            task = {"key": key, "spec": _wire_spec(dumps_spec(spec)), **options}
            if deps:
                task["deps"] = deps
            out.append(task)
        return out

    def _convert(self, obj, deps: list):
        if self._is_key(obj):
            deps.append(obj)
            return TaskRef(obj)
        typ = type(obj)
        if typ is tuple and obj and callable(obj[0]):
            return Call(obj[0], tuple([self._convert(a, deps) for a in obj[1:]]))
        if typ is list:
            return [self._convert(item, deps) for item in obj]
        return obj

    def _is_key(self, obj) -> bool:
        if type(obj) not in (str, int, float, tuple):
            return False
        try:
            return obj in self.graph
        except TypeError:  # a tuple holding something unhashable
            return False


def _flatten_keys(keys) -> list:
    if type(keys) is list:
        return [k for item in keys for k in _flatten_keys(item)]
    return [keys]


# ---------------------------------------------------------------------------- structure walks


def _collect_states(obj, client: Client, found: dict) -> None:
    """The key states of every Future inside nested lists, tuples, sets and dict values."""
    if isinstance(obj, Future):
        if obj.client is not client:
            raise ValueError(f"{obj!r} belongs to another client")
        found[obj._state] = None
    elif type(obj) in _SEQUENCES:
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
    if typ in _SEQUENCES:
        return typ([v for v in (_rebuild(item, values) for item in obj) if v is not _SKIPPED])
    if typ is dict:
        pairs = ((k, _rebuild(v, values)) for k, v in obj.items())
        return {k: v for k, v in pairs if v is not _SKIPPED}
    return obj


def _futures_in(futures) -> list[Future]:
    """A single future or an iterable of futures, as a list."""
    if isinstance(futures, Future):
        return [futures]
    if isinstance(futures, dict):
        return list(futures.values())
    return list(futures)


def _unique_states(futures: Iterable[Future]) -> list[_KeyState]:
    return list(dict.fromkeys(f._state for f in futures))


# ---------------------------------------------------------------------------- loop thread


class _ClientLoopThread:
    """An asyncio event loop (tornado's IOLoop runs on it) in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.wait(tasks, timeout=1))
        self.loop.close()

    def run(self, coro, timeout: float | None = None):
        """Run ``coro`` on the loop and wait for its result (an interrupt cancels it)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except asyncio.CancelledError as e:
            # our CancelledError (concurrent.futures') that asyncio turned into its own
            # on the way out of run_coroutine_threadsafe: a cancelled key, not a cancelled call
            raise CancelledError(*e.args) from None
        except BaseException:
            future.cancel()
            raise

    def stop(self, timeout: float) -> None:
        """Stop the loop and wait up to ``timeout`` seconds for the thread to end."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            return
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)


def _shutdown(runner: _ClientLoopThread | None, cluster) -> None:
    """At interpreter exit (or collection) of an unclosed client: stop, never hang."""
    if runner is not None:
        runner.stop(CLOSE_TIMEOUT)
    if cluster is not None:
        try:
            cluster.close()
        except Exception:
            logger.exception("closing the client's LocalCluster failed")


# ---------------------------------------------------------------------------- Client


_default_client: Client | None = None


def default_client() -> Client:
    """The most recent client made with ``set_as_default=True`` and still open."""
    if _default_client is None:
        raise ValueError("no default client: create a Client first")
    return _default_client


class Client:
    """Connects to a distributed-core scheduler; submits work; holds futures.

    ``address`` is a scheduler address (``tcp://host:port``), a LocalCluster-like object
    with ``.scheduler_address``, or None to start ``LocalCluster(**cluster_kwargs)`` that
    this client owns and closes. ``timeout`` bounds connecting. With
    ``asynchronous=True``, ``await Client(...)`` (or ``async with``) starts it and the
    methods that talk to the cluster return awaitables; `submit` and `map` always
    return futures directly. Closed by `close`, the context manager, or at exit.
    """

    def __init__(self, address=None, *, asynchronous: bool = False, timeout: float = 10,
                 name: str | None = None, set_as_default: bool = True,
                 **cluster_kwargs) -> None:
        self.asynchronous = asynchronous
        self.timeout = timeout
        self.id = f"{name or 'Client'}-{uuid.uuid4().hex}"
        self.status = _CREATED
        self._cluster = None  # the LocalCluster this client started and closes
        self._cluster_kwargs = cluster_kwargs
        if address is not None and cluster_kwargs:
            raise TypeError(f"unexpected arguments {sorted(cluster_kwargs)}: keyword "
                            "arguments are for the LocalCluster started when address=None")
        if hasattr(address, "scheduler_address"):
            address = address.scheduler_address
        if isinstance(address, str) and "://" not in address:
            address = f"tcp://{address}"
        self.scheduler_address: str | None = address
        self._set_as_default = set_as_default
        self._lock = threading.Lock()
        self._states: dict = {}
        self._outbox: collections.deque = collections.deque()
        self._drain_scheduled = False
        self._replies: dict[int, asyncio.Future] = {}
        self._reqids = itertools.count(1)
        self._cancel_echoes: collections.Counter = collections.Counter()
        self._peers: dict[str, list[Comm]] = {}
        self._comm: Comm | None = None
        self._reader: asyncio.Task | None = None
        self._runner: _ClientLoopThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread_id: int | None = None
        self._finalizer: weakref.finalize | None = None
        # dask graphs: one is sent at a time (_graph_lock, made on the loop); while one
        # is being sent the outbox is held (_outbox_held), so nothing queued after it
        # overtakes its slices; _refusals counts graph-refused messages
        self._graph_lock: asyncio.Lock | None = None
        self._outbox_held = 0
        self._refusals = 0
        self._background_sends: set = set()
        self._dask_default = None  # a dask_support.DefaultScheduler while we are dask's
        self._handlers = {
            "key-in-memory": self._handle_key_in_memory,
            "task-erred": self._handle_task_erred,
            "cancelled-keys": self._handle_cancelled_keys,
            "graph-refused": self._handle_graph_refused,
            "reply": self._handle_reply,
            "error": self._handle_error,
        }
        if not asynchronous:
            self._start_sync()

    def __repr__(self) -> str:
        return f"<Client {self.id}: scheduler={self.scheduler_address!r}, status={self.status}>"

    # ------------------------------------------------------------ starting and closing

    def _start_sync(self) -> None:
        if self.scheduler_address is None:
            self._cluster = self._make_cluster()
            self.scheduler_address = self._cluster.scheduler_address
        self._runner = _ClientLoopThread(name=f"{self.id}-loop")
        try:
            self._runner.run(self._connect())
        except BaseException:
            _shutdown(self._runner, self._cluster)
            self.status = _CLOSED
            raise
        self._started()

    async def _start_async(self) -> Client:
        if self.status != _CREATED:
            return self
        if self.scheduler_address is None:
            self._cluster = await asyncio.to_thread(self._make_cluster)
            self.scheduler_address = self._cluster.scheduler_address
        try:
            await self._connect()
        except BaseException:
            await asyncio.to_thread(_shutdown, None, self._cluster)
            self.status = _CLOSED
            raise
        self._started()
        return self

    def _make_cluster(self):
        from .cluster import LocalCluster

        return LocalCluster(**self._cluster_kwargs)

    async def _connect(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        comm = await connect(self.scheduler_address, {"role": "client", "client_id": self.id},
                             timeout=self.timeout)
        if comm.extra.get("role") != "scheduler":
            comm.abort()
            raise ConnectionError(f"{self.scheduler_address} is not a scheduler "
                                  f"(it says role={comm.extra.get('role')!r})")
        self._comm = comm
        self._reader = self._loop.create_task(self._read_loop(comm))
        self.status = _RUNNING

    def _started(self) -> None:
        global _default_client
        self._finalizer = weakref.finalize(self, _shutdown, self._runner, self._cluster)
        if self._set_as_default:
            _default_client = self
            if dask_support.dask_available():
                try:
                    self._dask_default = dask_support.DefaultScheduler(self)
                except Exception:  # dask is broken: the client works without it
                    logger.exception("could not make %s dask's default scheduler", self.id)

    def __await__(self):
        return self._start_async().__await__()

    async def __aenter__(self):
        return await self._start_async()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def __enter__(self):
        if self.asynchronous:
            raise TypeError("use 'async with' for an asynchronous client")
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self, timeout: float = CLOSE_TIMEOUT):
        """Tell the scheduler goodbye, close connections, stop the loop thread and the
        owned LocalCluster. Idempotent; pending futures fail with
        `SchedulerConnectionError`."""
        if self.asynchronous:
            return self._close_async(timeout)
        if self.status == _CLOSED or self._runner is None:
            return None
        if self._on_loop():
            raise RuntimeError("close() of a sync client cannot run on its own loop thread")
        try:
            self._runner.run(asyncio.wait_for(self._disconnect(), timeout))
        except Exception as e:  # noqa: BLE001 - closing goes on whatever happened
            logger.warning("closing %s did not finish cleanly: %r", self.id, e)
        self._finish_close()
        return None

    async def _close_async(self, timeout: float) -> None:
        if self.status == _CLOSED:
            return
        try:
            await asyncio.wait_for(self._disconnect(), timeout)
        except Exception as e:  # noqa: BLE001
            logger.warning("closing %s did not finish cleanly: %r", self.id, e)
        await asyncio.to_thread(self._finish_close)

    def _finish_close(self) -> None:
        global _default_client
        if _default_client is self:
            _default_client = None
        if self._dask_default is not None:
            self._dask_default, default = None, self._dask_default
            default.undo()
        self.status = _CLOSED
        if self._finalizer is not None:
            self._finalizer.detach()
        _shutdown(self._runner, self._cluster)

    async def _disconnect(self) -> None:
        """Say goodbye on the scheduler connection, close it and the worker connections."""
        with self._lock:
            if self.status not in (_RUNNING, _LOST):
                return
            self.status = _CLOSING
        comm = self._comm
        if comm is not None and not comm.closed:
            self._drain_outbox()
            comm.send({"op": "close-client"})
            await comm.close()
        if self._reader is not None:
            await self._reader
        for pool in self._peers.values():
            for peer in pool:
                peer.abort()
        self._peers.clear()

    # ------------------------------------------------------------ threads and the outbox

    def _on_loop(self) -> bool:
        return threading.get_ident() == self._loop_thread_id

    def _sync(self, method, *args):
        """Run ``method(*args)`` (a coroutine function) on the loop: an awaitable in an
        async client, the result (blocking) in a sync one."""
        if self.asynchronous:
            return method(*args)
        if self._runner is None or self.status == _CLOSED:
            raise SchedulerConnectionError(f"{self.id} is closed")
        if self._on_loop():
            raise RuntimeError("a blocking Client call was made on the client's own loop "
                               "thread (e.g. in a done callback); use the async API there")
        return self._runner.run(method(*args))

    def _call_soon(self, fn, *args) -> None:
        if self._on_loop():
            self._loop.call_soon(fn, *args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _post(self, item) -> None:
        """Queue a message (dict) or a reference to drop (`_KeyState`), from any thread.

        The loop drains the outbox in order; it is woken once per drain, not per item.
        """
        self._outbox.append(item)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._call_soon(self._drain_outbox)

    def _release_later(self, state: _KeyState) -> None:
        """Drop one reference to ``state`` soon; safe in ``__del__`` (never blocks)."""
        if self.status != _RUNNING:
            return
        with contextlib.suppress(Exception):  # the loop is gone (e.g. at interpreter exit)
            self._post(state)

    def _drain_outbox(self) -> None:
        """Send what the outbox holds, in order; consecutive releases share a message.

        Nothing is sent while a dask graph is being sent in slices (`_outbox_held`); the
        outbox is drained when it is done.
        """
        self._drain_scheduled = False
        if self._outbox_held:
            return
        outbox = self._outbox
        released: list = []
        while outbox:
            item = outbox.popleft()
            if type(item) is _KeyState:
                if self._drop_reference(item):
                    released.append(item.key)
                continue
            if released:
                self._send_now({"op": "release-keys", "keys": released})
                released = []
            self._send_now(item)
        if released:
            self._send_now({"op": "release-keys", "keys": released})

    def _drop_reference(self, state: _KeyState) -> bool:
        """One Future of ``state`` is gone; True if it was the last and the key is released."""
        with self._lock:
            state.refs -= 1
            if state.refs > 0 or self._states.get(state.key) is not state:
                return False
            del self._states[state.key]
        return True

    def _send_now(self, msg: dict) -> None:
        comm = self._comm
        if comm is not None and not comm.closed:
            comm.send(msg)

    def _send_on_loop(self, msg: dict) -> None:
        """Send from the loop thread, after everything queued before it."""
        self._drain_outbox()
        self._send_now(msg)

    def _check_running(self) -> None:
        if self.status != _RUNNING:
            raise SchedulerConnectionError(f"{self.id} is {self.status}: it cannot reach the "
                                           f"scheduler at {self.scheduler_address}")

    async def _request(self, op: str, **fields):
        """Send a request on the scheduler stream and wait for its ``reply``."""
        self._check_running()
        reqid = next(self._reqids)
        reply = self._loop.create_future()
        self._replies[reqid] = reply
        try:
            self._send_on_loop({"op": op, "reqid": reqid, **fields})
            return await reply
        finally:
            self._replies.pop(reqid, None)

    # ------------------------------------------------------------ registering keys

    def _register(self, tasks: list[dict], wanted: list | None = None) -> list[Future]:
        """Futures for the ``wanted`` keys (default: every task's key, in order).

        Keys this client holds already are not sent again; if any wanted key is new, one
        update-graph goes out with the new wanted tasks and every task not wanted itself.
        """
        if wanted is None:
            wanted = [task["key"] for task in tasks]
        states = []
        new: dict = {}
        with self._lock:
            self._check_running()
            held = self._states
            for key in wanted:
                state = held.get(key)
                if state is None:
                    state = held[key] = new[key] = _KeyState(key)
                state.refs += 1
                states.append(state)
        if new:
            self._send_graph(tasks, new, wanted)
        return [Future._attach(state, self) for state in states]

    def _send_graph(self, tasks: list[dict], new: dict, wanted: list) -> None:
        if len(wanted) == len(tasks) and len(new) == len(tasks):
            send = tasks  # the common case: all new, no duplicates
        else:
            wanted_set = set(wanted)
            send_by_key: dict = {}
            for task in tasks:
                key = task["key"]
                if (key in new or key not in wanted_set) and key not in send_by_key:
                    send_by_key[key] = task
            send = list(send_by_key.values())
        self._post({"op": "update-graph", "tasks": send, "keys": list(new)})

    def _hold_key(self, key) -> _KeyState:
        """A reference to ``key``'s state; the scheduler is asked about a key new here."""
        with self._lock:
            self._check_running()
            state = self._states.get(key)
            is_new = state is None
            if is_new:
                state = self._states[key] = _KeyState(key)
            state.refs += 1
        if is_new:
            self._post({"op": "desire-keys", "keys": [key]})
        return state

    def _detach(self, state: _KeyState) -> bool:
        """Forget ``state`` (its key is no longer wanted); False if it was not current."""
        with self._lock:
            if self._states.get(state.key) is not state:
                return False
            del self._states[state.key]
        return True

    # ------------------------------------------------------------ messages from the scheduler

    async def _read_loop(self, comm: Comm) -> None:
        handlers = self._handlers
        try:
            while True:
                for msg in await comm.read():
                    handler = handlers.get(msg["op"])
                    if handler is None:
                        logger.warning("unknown message from the scheduler: %.200r", msg)
                        continue
                    try:
                        handler(msg)
                    except Exception:
                        logger.exception("cannot handle %.200r", msg)
        except CommClosedError as e:
            self._connection_lost(e)

    def _handle_key_in_memory(self, msg: dict) -> None:
        state = self._states.get(msg["key"])
        if state is not None:
            state.finish(msg.get("data"), msg.get("type"))

    def _handle_task_erred(self, msg: dict) -> None:
        state = self._states.get(msg["key"])
        if state is None:
            return
        exception, traceback, text = msg.get("exception"), msg.get("traceback"), msg["text"]
        tb_text = bytes(traceback).decode(errors="replace") if traceback else None
        state.fail(functools.partial(_task_error, exception, traceback, text), tb_text)

    def _handle_cancelled_keys(self, msg: dict) -> None:
        echoes = self._cancel_echoes
        for key in msg["keys"]:
            if echoes[key] > 0:  # the answer to our own cancel: already applied
                echoes[key] -= 1
                if not echoes[key]:
                    del echoes[key]
                continue
            state = self._states.get(key)
            if state is not None and self._detach(state):
                state.settle(CANCELLED)

    def _handle_graph_refused(self, msg: dict) -> None:
        self._refusals += 1
        error = functools.partial(GraphRefusedError, f"the scheduler refused the graph: "
                                                     f"{msg['error']}")
        for key in msg["keys"]:
            state = self._states.get(key)
            if state is not None and state.status == PENDING and self._detach(state):
                state.fail(error, None)

    def _handle_reply(self, msg: dict) -> None:
        reply = self._replies.pop(msg["reqid"], None)
        if reply is None or reply.done():
            return
        if "error" in msg:
            reply.set_exception(SchedulerError(msg["error"]))
        else:
            reply.set_result(msg.get("result"))

    def _handle_error(self, msg: dict) -> None:
        logger.error("the scheduler reports an error: %s", msg.get("error"))

    def _connection_lost(self, reason: Exception) -> None:
        """Fail what is pending: nothing more will come from the scheduler."""
        with self._lock:
            closing = self.status == _CLOSING
            self.status = _CLOSED if closing else _LOST
            pending = [s for s in self._states.values() if s.status == PENDING]
        if closing:
            text = f"{self.id} was closed"
        else:
            text = f"lost the connection to the scheduler at {self.scheduler_address}: {reason}"
            logger.warning("%s", text)
        error = functools.partial(SchedulerConnectionError, text)
        for state in pending:
            state.fail(error, None)
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(error())
        self._replies.clear()

    # ------------------------------------------------------------ submitting work

    def submit(self, func: Callable, *args, key=None, pure: bool = True, retries: int = 0,
               priority: int = 0, workers=None, resources: dict | None = None,
               allow_other_workers: bool = False, **kwargs) -> Future:
        """Run ``func(*args, **kwargs)`` on a worker; returns its Future at once.

        Futures anywhere in ``args``/``kwargs`` (nested in lists, tuples, sets, dicts)
        become the task's dependencies and are replaced by their results. A pure call's
        key is ``f"{funcname}-{hash of the spec}"``: the same call gives the same key and
        shares its result; ``pure=False`` gives a fresh key. ``priority`` (higher first)
        and ``retries`` pass through; ``workers`` (addresses or names) restricts where it
        runs, loosely with ``allow_other_workers``; ``resources`` like ``{"GPU": 1}``.
        """
        options = _task_options(retries, priority, workers, resources, allow_other_workers)
        task = _TaskEncoder(self, func, pure, options).task(args, kwargs, key)
        return self._register([task])[0]

    def map(self, func: Callable, *iterables, key=None, pure: bool = True, retries: int = 0,
            priority: int = 0, workers=None, resources: dict | None = None,
            allow_other_workers: bool = False, batch_size: int | None = None,
            **kwargs) -> list[Future]:
        """``submit`` over zipped ``iterables`` in one update-graph (or one per
        ``batch_size`` tasks). ``key`` is a key prefix or a list of keys."""
        keys = key if isinstance(key, list) else None
        prefix = key if isinstance(key, str) else None
        options = _task_options(retries, priority, workers, resources, allow_other_workers)
        encoder = _TaskEncoder(self, func, pure, options, prefix)
        arg_tuples = list(zip(*iterables))
        if keys is not None and len(keys) != len(arg_tuples):
            raise ValueError(f"map got {len(keys)} keys for {len(arg_tuples)} tasks")
        tasks = [encoder.task(args, kwargs, keys[i] if keys else None)
                 for i, args in enumerate(arg_tuples)]
        step = batch_size or len(tasks) or 1
        futures: list[Future] = []
        for start in range(0, len(tasks), step):
            futures.extend(self._register(tasks[start:start + step]))
        return futures

    def get(self, dsk, keys, *, retries: int = 0, priority: int = 0, workers=None,
            resources: dict | None = None, allow_other_workers: bool = False, **kwargs):
        """Compute a graph; return the values of ``keys`` (one key, or nested lists of
        keys) in the same shape. This is a dask scheduler:
        ``dask.compute(x, scheduler=client.get)``.

        ``dsk`` is what dask hands a scheduler (an expression), a dask collection, a
        HighLevelGraph, or a dict graph of legacy ``(func, *args)`` tuples. With dask
        installed every graph goes through dask's conversion and ordering (see
        `dask_support`); without it a dict graph is converted here. The options apply
        to every task; dask annotations (``with dask.annotate(...)``) override them.
        """
        if kwargs:
            raise TypeError(f"get() got unexpected keyword arguments {sorted(kwargs)}")
        options = _task_options(retries, priority, workers, resources, allow_other_workers)
        if not dask_support.dask_available():
            if not isinstance(dsk, dict):
                raise ImportError(dask_support.DASK_REQUIRED)
            return self._get_legacy(dsk, keys, options)
        futures, submission = self._dask_graph_futures(dsk, keys, options)
        return self._sync(self._send_then_gather, submission, futures)

    def _get_legacy(self, graph: dict, keys, options: dict):
        """`get` without dask: a dict graph of legacy tuples converted by _LegacyGraph."""
        wanted = _flatten_keys(keys)
        unknown = [k for k in wanted if k not in graph]
        if unknown:
            raise KeyError(f"keys not in the graph: {unknown[:5]!r}")
        futures = self._register(_LegacyGraph(graph).tasks(options), wanted)
        by_key = dict(zip(wanted, futures))
        return self._sync(self._gather, _keys_to_futures(keys, by_key), "raise")

    # ------------------------------------------------------------ dask collections

    def compute(self, collections, sync: bool = False, optimize_graph: bool = True, *,
                retries: int = 0, priority: int = 0, workers=None,
                resources: dict | None = None, allow_other_workers: bool = False):
        """Start computing dask collections; a Future of each one's final value.

        One collection gives one Future; a list (tuple, set) of them gives a list, with
        anything that is not a dask collection passed through. ``sync=True`` returns the
        values instead (as `gather`). Returns once the graph is sent to the scheduler
        (an asynchronous client sends it in the background). Options as in `submit`;
        dask annotations override them per task. Needs dask.
        """
        dask = dask_support.require_dask()
        options = _task_options(retries, priority, workers, resources, allow_other_workers)
        singleton = not isinstance(collections, (list, tuple, set, frozenset))
        items = [collections] if singleton else list(collections)
        scheduler = functools.partial(_futures_scheduler, self, options)
        futures = list(dask.compute(*items, scheduler=scheduler, optimize_graph=optimize_graph))
        result = futures[0] if singleton else futures
        return self.gather(result) if sync else result

    def persist(self, collections, optimize_graph: bool = True, *, retries: int = 0,
                priority: int = 0, workers=None, resources: dict | None = None,
                allow_other_workers: bool = False):
        """Start computing dask collections and keep their pieces on the workers.

        Returns the same kind of collection (a list for a list), whose graph holds the
        futures of its keys: later computations reuse those results instead of
        recomputing them, and the results are released when the collection is garbage
        collected. Returns once the graph is sent. Needs dask.
        """
        dask = dask_support.require_dask()
        options = _task_options(retries, priority, workers, resources, allow_other_workers)
        singleton = not isinstance(collections, (list, tuple, set, frozenset))
        items = [collections] if singleton else list(collections)
        scheduler = functools.partial(_futures_scheduler, self, options)
        persisted = list(dask.persist(*items, scheduler=scheduler,
                                      optimize_graph=optimize_graph))
        return persisted[0] if singleton else persisted

    def _dask_submit(self, dsk, keys, options: dict) -> list:
        """Futures for ``keys`` (a flat list) of a dask graph; sends the graph (in the
        background for an asynchronous client)."""
        futures, submission = self._dask_graph_futures(dsk, keys, options)
        if submission is not None:
            if self.asynchronous:
                self._send_in_background(submission)
            else:
                self._sync(self._send_plan, *submission)
        return futures

    def _dask_graph_futures(self, dsk, keys, options: dict) -> tuple:
        """Materialize, order and plan a dask graph for ``keys``.

        Returns ``(futures shaped like keys, submission or None)``; the submission,
        ``(plan, holds, new states)``, is for `_send_plan`. Keys this client holds already
        are not sent again and the graph is cut there. Held keys the graph depends on
        are held (``holds``) until it is sent, so nothing releases them meanwhile.
        """
        with dask_support.gc_paused():
            graph = dask_support.materialize(dsk)
        nodes = graph.nodes
        flat = _flatten_keys(keys)
        wanted = list(dict.fromkeys(flat))
        with self._lock:
            self._check_running()
            held = self._states
            new = [k for k in wanted if k not in held]
            missing = [k for k in new if k not in nodes]
            if missing:
                raise KeyError(f"keys not in the graph: {missing[:5]!r}")
            known = held.keys() & nodes.keys()
            first_holds = [held[k] for k in known]
            for state in first_holds:
                state.refs += 1
            by_key = {}
            created = []
            for key in wanted:
                state = held.get(key)
                if state is None:
                    state = held[key] = _KeyState(key)
                    created.append(state)
                state.refs += 1
                by_key[key] = Future._attach(state, self)
        futures = _keys_to_futures(keys, by_key)
        try:
            if not new:
                return futures, None
            with dask_support.gc_paused():
                plan = dask_support.GraphPlan(graph, new, known, options, wire=_wire_spec)
            with self._lock:
                holds = [held[k] for k in plan.external if k in held]
                for state in holds:
                    state.refs += 1
        finally:
            for state in first_holds:
                self._release_later(state)
        return futures, (plan, holds, created)

    async def _send_then_gather(self, submission, futures):
        if submission is not None:
            await self._send_plan(*submission)
        return await self._gather(futures, "raise")

    def _send_in_background(self, submission) -> None:
        coro = self._send_plan(*submission)
        if self._on_loop():
            task = self._loop.create_task(coro)
        else:
            task = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._background_sends.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._background_sends.discard)
        task.add_done_callback(_log_background_failure)

    async def _send_plan(self, plan, holds: list, created: list) -> None:
        """Send a planned dask graph: slice by slice, one update-graph at a time.

        The next slice is pickled while the scheduler takes in the previous one; a
        ``who-has`` request after each slice paces the sending, so the scheduler handles
        one slice per turn of its event loop and serves heartbeats and other clients in
        between. Slice sizes follow the time from sending a slice to that answer (which
        covers pickling the next one), aiming at `dask_support.SLICE_SECONDS`. Frontier
        keys are wanted only until their last dependent is sent
        (`dask_support.SlicePart`). Failures fail the new keys.
        """
        if self._graph_lock is None:
            self._graph_lock = asyncio.Lock()
        async with self._graph_lock:
            self._drain_outbox()  # what was queued before this graph goes first
            self._outbox_held += 1
            temporary: set = set()
            try:
                refusals = self._refusals
                ack = None
                sent_at, n_sent = 0.0, 0
                part = await self._encode(plan)
                while True:
                    if ack is not None:
                        await ack
                        taken = time.monotonic() - sent_at
                        logger.debug("graph slice of %d tasks taken in by the scheduler "
                                     "in %.1f ms", n_sent, 1e3 * taken)
                        plan.adapt(n_sent, taken)
                        if self._refusals != refusals:
                            raise GraphRefusedError("the scheduler refused part of the "
                                                    "graph; the rest was not sent")
                    self._check_running()
                    self._send_now({"op": "update-graph", "tasks": part.tasks,
                                    "keys": part.keys})
                    sent_at, n_sent = time.monotonic(), len(part.tasks)
                    temporary.update(part.temporary)
                    if part.release:
                        temporary.difference_update(part.release)
                        self._release_temporary(part.release)
                    if plan.done:
                        break
                    ack = self._ping()
                    part = await self._encode(plan)  # while the scheduler takes it in
            except BaseException as exc:
                error = exc if isinstance(exc, Exception) else SchedulerConnectionError(
                    f"sending the graph was interrupted: {exc!r}")
                for state in created:
                    if state.status == PENDING:
                        state.fail(functools.partial(_same_error, error), None)
                raise
            finally:
                if temporary and self.status == _RUNNING:
                    self._release_temporary(temporary)
                self._outbox_held -= 1
                if not self._outbox_held:
                    self._drain_outbox()
                for state in holds:
                    self._release_later(state)

    async def _encode(self, plan):
        """The next slice of ``plan``, pickled right here on the loop while the scheduler
        takes in the previous one (in its own process).

        Not in a thread: it was no faster (on a small machine the workers, already
        running the first slices, compete for the same cores) and two busy threads
        share the GIL badly. The loop is busy for at most about one slice's time.
        """
        with dask_support.gc_paused():
            return plan.encode_next()

    def _ping(self) -> asyncio.Future:
        """An empty who-has request, sent now; its reply says the scheduler has handled
        everything sent before it."""
        reqid = next(self._reqids)
        reply = self._loop.create_future()
        self._replies[reqid] = reply
        self._send_now({"op": "who-has", "reqid": reqid, "keys": []})
        return reply

    def _release_temporary(self, keys) -> None:
        """Release frontier keys the client wanted only while its graph was sent (keys it
        holds futures of meanwhile stay wanted)."""
        with self._lock:
            keys = [key for key in keys if key not in self._states]
        if keys:
            self._send_now({"op": "release-keys", "keys": keys})

    # ------------------------------------------------------------ results

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

    async def _wait_settled(self, states: list[_KeyState], stop_on_error: bool = False,
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

    async def _gather_states(self, states: list[_KeyState], errors: str) -> dict:
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
            todo = await self._fetch(remote, values) if remote else []
        return values

    async def _fetch(self, states: list[_KeyState], values: dict) -> list[_KeyState]:
        """Fetch finished results from the workers into ``values``.

        One who-has for all keys, then one get-data per worker. Keys a holder could not
        give are asked again (another holder, a fresh who-has). Returns the states whose
        data no worker has: pending again (being recomputed) unless news came meanwhile.
        """
        by_key = {s.key: s for s in states}
        tried: dict = collections.defaultdict(set)
        delay = 0.01
        for _ in range(FETCH_ROUNDS):
            epochs = {key: by_key[key].epoch for key in by_key}
            who_has = await self._request("who-has", keys=list(by_key))
            lost = [by_key.pop(k) for k in list(by_key) if not who_has.get(k)]
            for state in lost:
                if state.epoch == epochs[state.key]:  # not recomputed since we asked
                    state.reset()
            plan = _plan_fetch(who_has, by_key, tried)
            replies = await asyncio.gather(*[self._get_data(address, keys)
                                             for address, keys in plan.items()])
            for address, (data, missing) in zip(plan, replies):
                for key, value in data.items():
                    values[by_key.pop(key)] = value
                for key in missing:
                    tried[key].add(address)
            if not by_key:
                return lost
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise SchedulerError(f"could not fetch {list(by_key)[:5]!r} from the workers "
                             f"that hold them")

    async def _get_data(self, address: str, keys: list) -> tuple[dict, list]:
        """``({key: value}, missing keys)`` from one worker; all missing if it fails."""
        try:
            reply = await self._peer_request(address, {"op": "get-data", "keys": keys})
        except OSError as e:
            logger.info("cannot get data from %s: %s", address, e)
            return {}, keys
        if reply.get("op") != "data":
            logger.warning("worker %s answered get-data with %.200r", address, reply)
            return {}, keys
        data = {key: loads_data(frames) for key, frames in reply["data"].items()}
        missing = [key for key in keys if key not in data]
        return data, missing

    async def _peer_request(self, address: str, msg: dict) -> dict:
        """One request/response with a worker, on a pooled connection."""
        pool = self._peers.setdefault(address, [])
        comm = None
        while pool and comm is None:
            candidate = pool.pop()
            comm = None if candidate.closed else candidate
        if comm is None:
            comm = await connect(address, {"role": "peer"}, timeout=self.timeout)
        try:
            await comm.write([msg])
            reply = (await comm.read())[0]
        except BaseException:
            comm.abort()
            raise
        if len(pool) < PEER_POOL_SIZE and self.status == _RUNNING:
            pool.append(comm)
        else:
            comm.abort()
        return reply

    # ------------------------------------------------------------ scatter

    def scatter(self, data, workers=None, broadcast: bool = False, hash: bool = True):
        """Put data on workers; returns futures shaped like ``data`` (a dict keeps its
        keys as the keys; a list/tuple/set gives a list; anything else one future).
        ``workers`` (addresses or names) limits where; ``broadcast`` puts every item on
        each of them."""
        return self._sync(self._scatter, data, workers, broadcast, hash)

    async def _scatter(self, data, workers, broadcast: bool, hash: bool):
        if isinstance(data, dict):
            keys, values = list(data), list(data.values())
        else:
            values = list(data) if isinstance(data, (list, tuple, set, frozenset)) else [data]
            keys = None
        if not values:
            return {} if isinstance(data, dict) else []
        frames = [dumps_data(value) for value in values]
        if keys is None:
            keys = [f"{type(v).__name__}-{_digest(*f) if hash else uuid.uuid4().hex}"
                    for v, f in zip(values, frames)]
        targets = await self._scatter_targets(workers)
        placement = _place(keys, targets, broadcast)
        await asyncio.gather(*[self._put_data(address, {k: frames[i] for i, k in items})
                               for address, items in placement.items()])
        futures = self._register_scattered(keys, values, placement)
        if isinstance(data, dict):
            return dict(zip(keys, futures))
        if isinstance(data, (list, tuple, set, frozenset)):
            return futures
        return futures[0]

    async def _scatter_targets(self, workers) -> list[str]:
        known = (await self._request("identity"))["workers"]
        if not known:
            await self._wait_for_workers(1, self.timeout)
            known = (await self._request("identity"))["workers"]
        if workers is None:
            return list(known)
        by_name = {info.get("name"): address for address, info in known.items()}
        chosen = []
        for worker in [workers] if isinstance(workers, str) else workers:
            address = worker if worker in known else by_name.get(worker)
            if address is None:
                raise ValueError(f"unknown worker {worker!r}")
            chosen.append(address)
        return chosen

    async def _put_data(self, address: str, frames_by_key: dict) -> None:
        msg = {"op": "put-data",
               "data": {k: [Blob(f) for f in frames] for k, frames in frames_by_key.items()}}
        reply = await self._peer_request(address, msg)
        if reply.get("op") != "ok":
            raise SchedulerError(f"worker {address} refused put-data: {reply!r:.200}")

    def _register_scattered(self, keys: list, values: list, placement: dict) -> list[Future]:
        """Futures for scattered keys; the scheduler learns where they are (loop thread)."""
        who_has: dict = collections.defaultdict(list)
        for address, items in placement.items():
            for _, key in items:
                who_has[key].append(address)
        states = []
        with self._lock:
            self._check_running()
            for key in keys:
                state = self._states.get(key)
                if state is None:
                    state = self._states[key] = _KeyState(key)
                state.refs += 1
                states.append(state)
        nbytes = {key: sizeof(value) for key, value in zip(keys, values)}
        self._send_on_loop({"op": "update-data", "who_has": dict(who_has), "nbytes": nbytes})
        for state, value in zip(states, values):
            if state.status == PENDING:
                state.finish(None, type(value).__name__)
        return [Future._attach(state, self) for state in states]

    # ------------------------------------------------------------ managing futures

    def cancel(self, futures, force: bool = False):
        """Cancel futures: the scheduler stops computing them for this client (for every
        client with ``force``); they raise `CancelledError`."""
        return self._sync(self._cancel, _futures_in(futures), force)

    async def _cancel(self, futures: list[Future], force: bool) -> None:
        states = [s for s in _unique_states(futures) if s.status != CANCELLED]
        if not states:
            return
        keys = [s.key for s in states]
        self._check_running()
        self._cancel_echoes.update(keys)
        self._send_on_loop({"op": "cancel", "keys": keys, "force": force})
        for state in states:
            self._detach(state)
            state.settle(CANCELLED)

    def retry(self, futures):
        """Run failed futures again (with the failed tasks they depend on)."""
        return self._sync(self._retry, _futures_in(futures))

    async def _retry(self, futures: list[Future]) -> None:
        states = [s for s in _unique_states(futures) if s.status == ERROR]
        if not states:
            return
        self._check_running()
        self._send_on_loop({"op": "retry", "keys": [s.key for s in states]})
        for state in states:
            state.reset()

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
        states = _unique_states(futures)
        needed = 1 if return_when == FIRST_COMPLETED else None
        await asyncio.wait_for(self._wait_settled(states, needed=needed), timeout)
        done = {f for f in futures if f.done()}
        return DoneAndNotDoneFutures(done, {f for f in futures if f not in done})

    # ------------------------------------------------------------ cluster information

    def who_has(self, futures=None):
        """``{key: [worker address]}`` for ``futures`` (default: every key held)."""
        if futures is None:
            with self._lock:
                keys = list(self._states)
        else:
            keys = [s.key for s in _unique_states(_futures_in(futures))]
        return self._sync(self._who_has, keys)

    async def _who_has(self, keys: list) -> dict:
        return await self._request("who-has", keys=keys)

    def scheduler_info(self):
        """The scheduler's ``identity``: address, workers, compiled, n_tasks, task_counts."""
        return self._sync(self._request, "identity")

    def wait_for_workers(self, n_workers: int = 1, timeout: float | None = None):
        """Block until at least ``n_workers`` workers are connected (TimeoutError after
        ``timeout`` seconds)."""
        return self._sync(self._wait_for_workers, n_workers, timeout)

    async def _wait_for_workers(self, n_workers: int, timeout: float | None) -> None:
        async def poll():
            while len((await self._request("identity"))["workers"]) < n_workers:
                await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(poll(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"fewer than {n_workers} workers after {timeout}s") from None


def _keys_to_futures(keys, by_key: dict):
    if type(keys) is list:
        return [_keys_to_futures(k, by_key) for k in keys]
    return by_key[keys]


def _futures_scheduler(client: Client, options: dict, dsk, keys, **kwargs) -> list:
    """A dask scheduler function that returns the keys' futures instead of their values
    (what `Client.compute` and `Client.persist` hand to ``dask.compute``/``dask.persist``;
    a partial of it has no ``__self__``, so dask does not take it for a client)."""
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    return client._dask_submit(dsk, keys, options)


def _same_error(error: BaseException) -> BaseException:
    return error


def _log_background_failure(task) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("sending a dask graph failed: %r", exc)


def _plan_fetch(who_has: dict, keys: Iterable, tried: dict) -> dict[str, list]:
    """``{worker: [keys]}``: one holder per key, preferring holders not tried yet."""
    plan: dict = collections.defaultdict(list)
    for key in keys:
        holders = who_has[key]
        fresh = [a for a in holders if a not in tried[key]] if tried else holders
        plan[random.choice(fresh or holders)].append(key)
    return plan


def _place(keys: list, targets: list[str], broadcast: bool) -> dict[str, list]:
    """``{worker: [(index, key)]}``: round robin, or every key everywhere."""
    if not targets:
        raise ValueError("no workers to scatter to")
    placement: dict = collections.defaultdict(list)
    for i, key in enumerate(keys):
        for address in targets if broadcast else [targets[i % len(targets)]]:
            placement[address].append((i, key))
    return placement


# ---------------------------------------------------------------------------- wait, as_completed


class DoneAndNotDoneFutures(NamedTuple):
    """What `wait` returns: two sets of futures."""

    done: set
    not_done: set


def wait(futures, timeout: float | None = None, return_when: str = ALL_COMPLETED):
    """Wait until all (or, with FIRST_COMPLETED, any) of ``futures`` are done.

    Returns ``(done, not_done)`` sets; raises ``TimeoutError`` after ``timeout`` seconds.
    All futures must belong to one client; with an async client this returns an awaitable.
    """
    if return_when not in (ALL_COMPLETED, FIRST_COMPLETED):
        raise ValueError(f"return_when must be ALL_COMPLETED or FIRST_COMPLETED, "
                         f"not {return_when!r}")
    futures = _futures_in(futures)
    client = _client_of(futures)
    if client is None:
        return DoneAndNotDoneFutures(set(), set())
    return client._sync(client._wait, futures, timeout, return_when)


def _client_of(futures: list[Future]) -> Client | None:
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
        self._client: Client | None = None
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
        client._add_done_callbacks(futures, self._on_done)

    def count(self) -> int:
        """How many futures are still to be yielded."""
        with self._cond:
            return self._pending + len(self._ready)

    def _on_done(self, future: Future) -> None:
        with self._cond:
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
        if not self.with_results:
            return future
        try:
            return future, future.result()
        except Exception as e:
            if self.raise_errors:
                raise
            return future, e

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
