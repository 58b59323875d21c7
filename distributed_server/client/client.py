"""The user-facing client of distributed-core: submit work, hold futures, get results back.

What this module does
---------------------
- `Client` connects to a scheduler (or starts a `LocalCluster` and owns it) and speaks the
  client side of docs/protocol.md: ``update-graph`` for `submit`/`map`/`get`,
  ``update-data`` after `scatter`, ``release-keys`` when the last `Future` of a key goes
  away, ``cancel``, ``retry``, ``desire-keys``, and ``who-has``/``identity`` requests
  matched to their ``reply`` by ``reqid``. Results arrive inline in ``key-in-memory``
  when small; otherwise they are fetched straight from the workers (``get-data`` over a
  pooled ``{"role": "client"}`` connection, one request per worker for a whole batch).
- Sync and async use share one implementation: every operation is a coroutine on the
  client's event loop. A sync client runs that loop (tornado's IOStreams on asyncio) in a
  daemon thread and blocks on it; an async client (``asynchronous=True``) runs on the
  caller's loop and its methods return awaitables.
- The client owns the key states its futures share (`distributed_server.client.futures`: `Future`,
  `wait`, `as_completed`, the exceptions) and sends ``release-keys`` when the last Future
  of a key goes away. Task specs are built by `distributed_server.client.task_specs`. The names of
  both modules that users import are exported here too (see ``__all__``).

The modules of the client
-------------------------
The `Client` class stays here, with its key table (``_states``: one `KeyState` per key
held, counted by reference under ``_lock``), the scheduler's messages about keys, and
its public methods; each of these modules does one job for it:

- `distributed_server.client.futures`: `Future`, `wait`, `as_completed`, the exceptions, and
  `FutureClient`, the protocol of what a Future needs from its client (this class
  implements it; futures never import this module).
- `distributed_server.client.scheduler_comm`: the connection to the scheduler (`SchedulerComm`:
  handshake, heartbeats, reading) and the ordered outbox every message goes through,
  with a dask graph's turn in it (`GraphTurn`) and requests matched to replies by id.
- `distributed_server.client.loop_thread`: the event loop thread of a sync client.
- `distributed_server.client.transfers`: fetching results from workers, ``put-data``
  for `scatter`, ``run`` (`WorkerTransfers`), on the `PeerPool` of
  `distributed_server.comm.peer_pool`, the pool class the workers use too.
- `distributed_server.client.dask_compute`: `compute`, `persist` and `get` of dask graphs
  (`GraphSender`), on top of `distributed_server.client.dask_graphs`'s conversion and plan.
- `distributed_server.client.task_specs`: the task dicts of `submit` and `map`, and their keys.

Threads
-------
Every change of a key's status happens on the loop thread. User threads only create key
states and references (under ``Client._lock``) and queue messages in the client's outbox,
which the loop drains in order, so a task is always sent before the release of a future
it depends on. ``Future.__del__`` never blocks and never takes a lock: it queues the
release and, at most once per drain, wakes the loop.

Exit
----
At interpreter exit an open client just drops its connection (the scheduler releases
its keys as on ``close-client``) and stops the LocalCluster it owns.

dask collections
----------------
With dask installed (the ``dask`` extra), `get` is a dask scheduler
(``dask.compute(x, scheduler=client.get)``), `compute` and `persist` take dask
collections, and a client made with ``set_as_default=True`` is dask's default scheduler
until it closes. The graph is materialized, ordered and pickled here, in slices, by
`dask_support`; the graph takes its turn in the outbox when it is submitted and
`client_dask.GraphSender.send_plan` sends its slices one at a time from there, so that
nothing queued later overtakes them. Without dask these methods raise an
ImportError naming the extra, and `get` converts dict graphs itself
(`taskspec.LegacyGraph`).

Errors
------
The exception classes live in `distributed_server.client.futures` (see its docstring) and are
exported here. `SchedulerConnectionError` is raised by every call that needs the
scheduler once the connection is lost or the client closed; `SchedulerError` by a request
the scheduler answered with an error, and when workers do not give or take data
(a fetch that keeps failing, a refused ``put-data`` in `scatter`).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import functools
import logging
import math
import os
import pickle
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable

from .. import logs, plugins
from .. import versions as versions_module
from ..deploy.launch import read_scheduler_file
from ..protocol.serialize import dumps_data, loads_error, sizeof
from ..protocol.stories import StoryEntry, WorkerSilent, check_timeout
from ..security import Security
from ..worker import remote_run
from ..worker.task_context import install_client_factory
from . import dask_graphs as dask_support
from . import datasets
from .dask_compute import GraphSender
from .futures import (
    ALL_COMPLETED,
    CANCELLED,
    ERROR,
    FINISHED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    PENDING,
    CancelledError,
    DoneAndNotDoneFutures,
    Future,
    GraphRefusedError,
    KeyState,
    SchedulerConnectionError,
    SchedulerError,
    TaskFailedError,
    as_completed,
    default_client,
    forget_default_client,
    futures_in,
    futures_of,
    set_default_client,
    unique_states,
    wait,
)
from .loop_thread import ClientLoopThread
from .scheduler_comm import (  # noqa: F401 - HEARTBEAT_INTERVAL, RELEASE_BATCH_KEYS: re-exported
    HEARTBEAT_INTERVAL,
    RELEASE_BATCH_KEYS,
    SchedulerComm,
    log_background_failure,
)
from .task_specs import (
    SEQUENCES,
    MapEncoder,
    TaskEncoder,
    key_digest,
    map_columns,
    task_options,
)
from .transfers import (  # noqa: F401 - FETCH_ROUNDS, PEER_POOL_SIZE: re-exported
    FETCH_ROUNDS,
    PEER_POOL_SIZE,
    WorkerTransfers,
    place,
)

__all__ = [
    "ALL_COMPLETED",
    "FIRST_COMPLETED",
    "FIRST_EXCEPTION",
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
    "fire_and_forget",
    "futures_of",
    "wait",
]

logger = logging.getLogger(__name__)

#: Seconds `close` waits for the scheduler connection to flush, and for the loop thread.
CLOSE_TIMEOUT = 5.0
#: Tasks per update-graph that `map` sends: the scheduler decodes a message whole, so
#: this bounds what a large map costs it in transient memory.
MAP_BATCH_TASKS = 2_000


# Client statuses
_CREATED, _RUNNING, _LOST, _CLOSING, _CLOSED = "created", "running", "lost", "closing", "closed"


# ---------------------------------------------------------------------------- results and waiting


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


# ---------------------------------------------------------------------------- structure walks


def _collect_states(obj, client: Client, found: dict) -> None:
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


def _shutdown(runner: ClientLoopThread | None, cluster) -> None:
    """At interpreter exit (or collection) of an unclosed client: stop, never hang."""
    if runner is not None:
        runner.stop(CLOSE_TIMEOUT)
    if cluster is not None:
        try:
            cluster.close()
        except Exception:
            logger.exception("closing the client's LocalCluster failed")


# ---------------------------------------------------------------------------- Client


class Client:
    """Connects to a distributed-core scheduler; submits work; holds futures.

    ``address`` is a scheduler address (``tcp://host:port``), a LocalCluster-like object
    with ``.scheduler_address``, or None to start ``LocalCluster(**cluster_kwargs)`` that
    this client owns and closes. ``timeout`` bounds connecting. With
    ``asynchronous=True``, ``await Client(...)`` (or ``async with``) starts it and the
    methods that talk to the cluster return awaitables; `submit` and `map` always
    return futures directly. Closed by `close`, the context manager, or at exit.
    A scheduler that stops answering (it answers every heartbeat, sent each
    `HEARTBEAT_INTERVAL` seconds) for ``scheduler_timeout`` seconds counts as lost: the
    pending futures raise `SchedulerConnectionError`. ``security`` holds the cluster's token and/or TLS files (`Security`); by default
    those of the LocalCluster given or started, else those named by the ``DCORE_TOKEN``
    / ``DCORE_TOKEN_FILE`` / ``DCORE_TLS_*`` environment variables.
    ``scheduler_file`` reads the address from the file ``dcore scheduler
    --scheduler-file`` wrote (waiting up to ``timeout`` for it).
    """

    def __init__(self, address=None, *, asynchronous: bool = False, timeout: float = 10,
                 name: str | None = None, set_as_default: bool = True,
                 security: Security | None = None, scheduler_timeout: float = 30.0,
                 scheduler_file: str | None = None, **cluster_kwargs) -> None:
        if scheduler_file is not None:
            if address is not None:
                raise TypeError("give an address or a scheduler_file, not both")
            address = read_scheduler_file(scheduler_file, timeout=max(timeout, 1.0))
        self.asynchronous = asynchronous
        self.timeout = timeout
        self.scheduler_timeout = scheduler_timeout
        if security is None and address is not None:
            security = getattr(address, "security", None) or Security.from_environment(
                role="client")
        self.security = security
        self.id = f"{name or 'Client'}-{uuid.uuid4().hex}"
        self.status = _CREATED
        self._cluster = None  # the LocalCluster this client started and closes
        self._cluster_kwargs = cluster_kwargs
        if address is not None and cluster_kwargs:
            raise TypeError(f"unexpected arguments {sorted(cluster_kwargs)}: keyword "
                            "arguments are for the LocalCluster started when address=None")
        #: The LocalCluster given as ``address`` (or started by this client), else None.
        self.cluster = None
        if hasattr(address, "scheduler_address"):
            self.cluster = address
            address = address.scheduler_address
        if isinstance(address, str) and "://" not in address:
            address = f"tcp://{address}"
        self.scheduler_address: str | None = address
        self._set_as_default = set_as_default
        self._lock = threading.Lock()
        self._states: dict = {}
        self._own_cancels: set = set()  # reqids of our cancels: their echoes are no news
        self._transfers: WorkerTransfers | None = None  # with workers (made at connect)
        self._runner: ClientLoopThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread_id: int | None = None
        self._finalizer: weakref.finalize | None = None
        # _refusals counts graph-refused messages (a graph's slices stop at one)
        self._refusals = 0
        #: Sends this client's dask graphs (compute, persist, get).
        self._graphs = GraphSender(self)
        self._dask_default = None  # a dask_support.DefaultScheduler while we are dask's
        #: The scheduler connection and the ordered outbox every message goes through.
        self._conn = SchedulerComm(self.id, {
            "key-in-memory": self._handle_key_in_memory,
            "task-erred": self._handle_task_erred,
            "cancelled-keys": self._handle_cancelled_keys,
            "graph-refused": self._handle_graph_refused,
        }, release=self._drop_reference, on_lost=self._connection_lost)
        if not asynchronous:
            self._start_sync()

    def __repr__(self) -> str:
        return f"<Client {self.id}: scheduler={self.scheduler_address!r}, status={self.status}>"

    # ------------------------------------------------------------ starting and closing

    def _start_sync(self) -> None:
        if self.scheduler_address is None:
            self._cluster = self.cluster = self._make_cluster()
            self.scheduler_address = self._cluster.scheduler_address
        self._runner = ClientLoopThread(name=f"{self.id}-loop")
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
            self._cluster = self.cluster = await asyncio.to_thread(self._make_cluster)
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
        from ..deploy.local_cluster import LocalCluster

        kwargs = dict(self._cluster_kwargs)
        if self.security is not None:
            kwargs["security"] = self.security
        cluster = LocalCluster(**kwargs)
        if self.security is None:
            self.security = cluster.security
        return cluster

    async def _connect(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._transfers = WorkerTransfers(self.id, self.security, self.timeout,
                                          keep_connections=self._is_running)
        await self._conn.connect(self.scheduler_address, self.timeout, self.security,
                                 self.scheduler_timeout)
        self.status = _RUNNING

    def _started(self) -> None:
        self._call_soon(self._check_versions_soon)
        self._finalizer = weakref.finalize(self, _shutdown, self._runner, self._cluster)
        if self._set_as_default:
            set_default_client(self)
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
        forget_default_client(self)
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
        await self._conn.close()
        if self._transfers is not None:
            self._transfers.close()

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
        """Queue a message (dict) or a reference to drop (`KeyState`), from any thread,
        in the scheduler connection's ordered outbox (`SchedulerComm.post`)."""
        self._conn.post(item)

    def _release_later(self, state: KeyState) -> None:
        """Drop one reference to ``state`` soon; safe in ``__del__`` (never blocks)."""
        if self.status != _RUNNING:
            return
        with contextlib.suppress(Exception):  # the loop is gone (e.g. at interpreter exit)
            self._conn.post(state)

    def _drop_reference(self, state: KeyState) -> bool:
        """One Future of ``state`` is gone; True if it was the last and the key is released
        (the outbox calls this on the loop as it drains)."""
        with self._lock:
            state.refs -= 1
            if state.refs > 0 or self._states.get(state.key) is not state:
                return False
            del self._states[state.key]
        return True

    def _send_on_loop(self, msg: dict) -> None:
        """Send from the loop thread, after everything queued before it (through the
        outbox: `SchedulerComm.send_in_order`)."""
        self._conn.send_in_order(msg)

    async def _peer_request(self, address: str, msg: dict) -> dict:
        """One request/response with a worker on a pooled connection
        (`WorkerTransfers.request`)."""
        return await self._transfers.request(address, msg)

    def _is_running(self) -> bool:
        return self.status == _RUNNING

    def _check_running(self) -> None:
        if self.status != _RUNNING:
            raise SchedulerConnectionError(f"{self.id} is {self.status}: it cannot reach the "
                                           f"scheduler at {self.scheduler_address}")

    async def _request(self, op: str, on_abandon: Callable | None = None, **fields):
        """Send a request on the scheduler stream, in order, and wait for its ``reply``
        (`SchedulerComm.request`; ``on_abandon`` undoes what a request its caller gave
        up on granted)."""
        self._check_running()
        return await self._conn.request(op, on_abandon, fields)

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
                    state = held[key] = new[key] = KeyState(key)
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

    def _hold_key(self, key) -> KeyState:
        """A reference to ``key``'s state; the scheduler is asked about a key new here."""
        with self._lock:
            self._check_running()
            state = self._states.get(key)
            is_new = state is None
            if is_new:
                state = self._states[key] = KeyState(key)
            state.refs += 1
        if is_new:
            self._post({"op": "desire-keys", "keys": [key]})
        return state

    def _detach(self, state: KeyState) -> bool:
        """Forget ``state`` (its key is no longer wanted); False if it was not current."""
        with self._lock:
            if self._states.get(state.key) is not state:
                return False
            del self._states[state.key]
        return True

    def _hold_graph(self, nodes, wanted: list) -> tuple:
        """For a dask graph (`client_dask`): Futures of its ``wanted`` keys.

        Returns ``({key: Future}, new keys, keys of the graph held already, states
        created, references taken on those held keys)``; the caller drops the last ones
        (`_release_later`) once its plan holds what it needs. KeyError for a new wanted
        key that is not in the graph.
        """
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
                    state = held[key] = KeyState(key)
                    created.append(state)
                state.refs += 1
                by_key[key] = Future._attach(state, self)
        return by_key, new, known, created, first_holds

    def _hold_present(self, keys) -> list[KeyState]:
        """A reference to each of ``keys`` this client holds (dropped with
        `_release_later`): a graph being sent needs them meanwhile."""
        with self._lock:
            held = self._states
            holds = [held[k] for k in keys if k in held]
            for state in holds:
                state.refs += 1
        return holds

    def _release_temporary(self, keys) -> None:
        """Release frontier keys the client wanted only while its graph was sent (keys it
        holds futures of meanwhile stay wanted); nothing once the client is closing."""
        if self.status != _RUNNING:
            return
        with self._lock:
            keys = [key for key in keys if key not in self._states]
        if keys:
            self._conn.send_now({"op": "release-keys", "keys": keys})

    # ------------------------------------------------------------ messages from the scheduler

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
        reqid = msg.get("reqid")
        if reqid is not None and reqid in self._own_cancels:
            self._own_cancels.discard(reqid)  # the answer to our own cancel: applied
            return
        reason = msg.get("reason")  # e.g. a restart
        for key in msg["keys"]:
            state = self._states.get(key)
            if state is not None and self._detach(state):
                state.cancel(reason if isinstance(reason, str) else None)

    def _handle_graph_refused(self, msg: dict) -> None:
        self._refusals += 1
        error = functools.partial(GraphRefusedError, f"the scheduler refused the graph: "
                                                     f"{msg['error']}")
        for key in msg["keys"]:
            state = self._states.get(key)
            if state is not None and state.status == PENDING and self._detach(state):
                state.fail(error, None)

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
        self._conn.fail_requests(error)

    # ------------------------------------------------------------ submitting work

    def submit(self, func: Callable, *args, key=None, pure: bool = True, retries: int = 0,
               priority: int = 0, workers=None, resources: dict | None = None,
               allow_other_workers: bool = False, fifo_timeout=None, actor: bool = False,
               actors: bool = False, **kwargs) -> Future:
        """Run ``func(*args, **kwargs)`` on a worker; returns its Future at once.

        Futures anywhere in ``args``/``kwargs`` (nested in lists, tuples, sets, dicts)
        become the task's dependencies and are replaced by their results. A pure call's
        key is ``f"{funcname}-{hash of the spec}"``: the same call gives the same key and
        shares its result; ``pure=False`` gives a fresh key. ``priority`` (higher first)
        and ``retries`` pass through; ``workers`` (addresses or names) restricts where it
        runs, loosely with ``allow_other_workers``; ``resources`` like ``{"GPU": 1}``.
        dask's ``fifo_timeout`` is accepted and has no effect (tasks of one client run
        in submission order already); ``actor=True`` is refused (no actors here).
        """
        _refuse_actors("submit", actor or actors)
        options = task_options(retries, priority, workers, resources, allow_other_workers)
        task = TaskEncoder(self, func, pure, options).task(args, kwargs, key)
        return self._register([task])[0]

    def map(self, func: Callable, *iterables, key=None, pure: bool = True, retries: int = 0,
            priority: int = 0, workers=None, resources: dict | None = None,
            allow_other_workers: bool = False, batch_size: int | None = None,
            fifo_timeout=None, actor: bool = False, actors: bool = False,
            **kwargs) -> list[Future]:
        """``submit`` over zipped ``iterables``: one update-graph per ``batch_size``
        tasks (default `MAP_BATCH_TASKS`), each taken or refused by the scheduler on its
        own. ``key`` is a key prefix or a list of keys. A large function, an argument
        that is the same object in every task and a large keyword argument are sent
        once, as a task the others depend on (`taskspec.MapEncoder`)."""
        _refuse_actors("map", actor or actors)
        keys = key if isinstance(key, list) else None
        prefix = key if isinstance(key, str) else None
        options = task_options(retries, priority, workers, resources, allow_other_workers)
        encoder = TaskEncoder(self, func, pure, options, prefix)
        columns, n = map_columns(iterables)
        if keys is not None and len(keys) != n:
            raise ValueError(f"map got {len(keys)} keys for {n} tasks")
        mapper = MapEncoder(encoder, columns, n, kwargs)
        tasks = mapper.tasks(keys)
        step = batch_size or MAP_BATCH_TASKS
        futures: list[Future] = []
        # shared values go first, wanted until the last batch that needs them is sent
        shared = self._register(mapper.shared) if mapper.shared else []
        try:
            for start in range(0, len(tasks), step):
                futures.extend(self._register(tasks[start:start + step]))
        finally:
            for future in shared:
                future.release()
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
        options = task_options(retries, priority, workers, resources, allow_other_workers)
        return self._graphs.get(dsk, keys, options)

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
        options = task_options(retries, priority, workers, resources, allow_other_workers)
        return self._graphs.compute(collections, sync, optimize_graph, options)

    def persist(self, collections, optimize_graph: bool = True, *, retries: int = 0,
                priority: int = 0, workers=None, resources: dict | None = None,
                allow_other_workers: bool = False):
        """Start computing dask collections and keep their pieces on the workers.

        Returns the same kind of collection (a list for a list), whose graph holds the
        futures of its keys: later computations reuse those results instead of
        recomputing them, and the results are released when the collection is garbage
        collected. Returns once the graph is sent. Needs dask.
        """
        options = task_options(retries, priority, workers, resources, allow_other_workers)
        return self._graphs.persist(collections, optimize_graph, options)

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
            keys = [f"{type(v).__name__}-{key_digest(*f) if hash else uuid.uuid4().hex}"
                    for v, f in zip(values, frames)]
        targets = await self._scatter_targets(workers)
        placement = place(keys, targets, broadcast)
        transfers = self._transfers
        await asyncio.gather(*[transfers.put_data(address, {k: frames[i] for i, k in items})
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
                    state = self._states[key] = KeyState(key)
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
        return self._sync(self._cancel, futures_in(futures), force)

    async def _cancel(self, futures: list[Future], force: bool) -> None:
        states = [s for s in unique_states(futures) if s.status != CANCELLED]
        if not states:
            return
        keys = [s.key for s in states]
        self._check_running()
        reqid = self._conn.next_reqid()
        self._own_cancels.add(reqid)
        self._send_on_loop({"op": "cancel", "keys": keys, "force": force, "reqid": reqid})
        for state in states:
            self._detach(state)
            state.cancel()

    def retry(self, futures):
        """Run failed futures again (with the failed tasks they depend on)."""
        return self._sync(self._retry, futures_in(futures))

    async def _retry(self, futures: list[Future]) -> None:
        states = [s for s in unique_states(futures) if s.status == ERROR]
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
        states = unique_states(futures)
        needed = 1 if return_when == FIRST_COMPLETED else None
        await asyncio.wait_for(self._wait_settled(
            states, stop_on_error=return_when == FIRST_EXCEPTION, needed=needed), timeout)
        done = {f for f in futures if f.done()}
        return DoneAndNotDoneFutures(done, {f for f in futures if f not in done})

    # ------------------------------------------------------------ cluster information

    def run(self, function: Callable, *args, workers=None, wait: bool = True,
            on_error: str = "raise", **kwargs):
        """Call ``function(*args, **kwargs)`` once in every worker process (or those of
        ``workers``: addresses or names); ``{address: result}``. A coroutine function
        runs on the worker's event loop, any other on a thread; a ``dask_worker``
        parameter receives the Worker. ``on_error="raise"`` raises the first error,
        ``"return"`` puts errors in the dict. ``wait=False`` returns None at once."""
        if on_error not in ("raise", "return"):
            raise ValueError(f"on_error must be 'raise' or 'return', not {on_error!r}")
        payload = remote_run.pack_call(function, args, kwargs)
        if not wait:
            self._sync(self._spawn_run, payload, workers)
            return None
        return self._sync(self._run_everywhere, payload, workers, on_error)

    async def _spawn_run(self, payload: bytes, workers) -> None:
        task = asyncio.ensure_future(self._run_everywhere(payload, workers, "return"))
        task.add_done_callback(log_background_failure)

    async def _run_everywhere(self, payload: bytes, workers, on_error: str) -> dict:
        addresses = await self._worker_addresses(workers)

        async def one(address):
            try:
                reply = await self._peer_request(address, {"op": "run", "function": payload})
            except OSError as exc:
                return exc
            return remote_run.unpack_reply(reply)

        results = dict(zip(addresses, await asyncio.gather(*map(one, addresses))))
        if on_error == "raise":
            for value in results.values():
                if isinstance(value, BaseException):
                    raise value
        return results

    async def _worker_addresses(self, workers) -> list:
        """The addresses of ``workers`` (addresses or names; None: every worker)."""
        known = (await self._request("identity"))["workers"]
        if workers is None:
            return list(known)
        if isinstance(workers, (str, int)):
            workers = [workers]
        by_name = {info.get("name"): address for address, info in known.items()}
        addresses = []
        for worker in workers:
            address = worker if worker in known else by_name.get(worker)
            if address is None:
                raise ValueError(f"no worker {worker!r} (known: {sorted(known)})")
            addresses.append(address)
        return addresses

    def get_versions(self, check: bool = False) -> dict:
        """``{"client": ..., "scheduler": ..., "workers": {address: ...}}``: Python,
        platform and package versions of every process (versions.py). ``check=True``
        raises `VersionMismatch` naming every difference in Python, distributed-core,
        cloudpickle, msgpack or dask."""
        return self._sync(self._get_versions, check)

    async def _get_versions(self, check: bool) -> dict:
        mine = versions_module.versions()
        scheduler = await self._request("versions")
        workers = await self._run_everywhere(
            remote_run.pack_call(versions_module.versions, (), {}), None, "return")
        workers = {address: (v if isinstance(v, dict) else {"error": repr(v)})
                   for address, v in workers.items()}
        if check:
            problems = versions_module.check(mine, scheduler, workers)
            if problems:
                raise versions_module.VersionMismatch(
                    "mismatched versions: " + "; ".join(problems))
        return {"client": mine, "scheduler": scheduler, "workers": workers}

    def _check_versions_soon(self) -> None:
        task = self._loop.create_task(self._warn_on_other_versions())
        task.add_done_callback(log_background_failure)

    async def _warn_on_other_versions(self) -> None:
        """At connect: warn if the scheduler runs other versions of what must match."""
        try:
            theirs = await self._request("versions")
        except Exception:  # noqa: BLE001 - best effort: closed meanwhile, or gone
            return
        differ = versions_module.mismatches(versions_module.essential(), theirs)
        if differ:
            logger.warning("the scheduler at %s runs other versions than this client (%s): "
                           "tasks may fail to unpickle; client.get_versions(check=True) "
                           "names every process's", self.scheduler_address, "; ".join(differ))

    def sync(self, func: Callable, *args, **kwargs):
        """Run ``func(*args, **kwargs)``, a coroutine function, on this client's loop and
        return its result (an awaitable in an asynchronous client), as dask's."""
        async def call():
            return await func(*args, **kwargs)
        return self._sync(call)

    def upload_file(self, path: str) -> dict:
        """Send a ``.py``, ``.zip``, ``.egg`` or ``.whl`` file to every worker now
        connected: it is written to a directory on the worker's ``sys.path`` and a
        module of that name is imported (again, if it was). ``{address: None}``.
        Workers that join later do not get it."""
        name = os.path.basename(path)
        if not name.endswith((".py", ".zip", ".egg", ".whl")):
            raise ValueError(f"upload_file takes .py, .zip, .egg or .whl files, not {name!r}")
        with open(path, "rb") as f:
            data = f.read()
        return self.run(remote_run.install_file, name, data)

    def nthreads(self, workers=None) -> dict:
        """``{address: threads}`` of every worker (or of ``workers``)."""
        return self._sync(self._nthreads, workers)

    async def _nthreads(self, workers) -> dict:
        known = (await self._request("identity"))["workers"]
        wanted = await self._worker_addresses(workers) if workers is not None else known
        return {address: known[address]["nthreads"] for address in wanted}

    def has_what(self, workers=None) -> dict:
        """``{address: [keys it holds]}`` for every worker (or for ``workers``)."""
        return self._sync(self._has_what, workers)

    async def _has_what(self, workers) -> dict:
        addresses = await self._worker_addresses(workers) if workers is not None else None
        return await self._request("has-what", workers=addresses)

    def who_has(self, futures=None):
        """``{key: [worker address]}`` for ``futures`` (default: every key held)."""
        if futures is None:
            with self._lock:
                keys = list(self._states)
        else:
            keys = [s.key for s in unique_states(futures_in(futures))]
        return self._sync(self._who_has, keys)

    async def _who_has(self, keys: list) -> dict:
        return await self._request("who-has", keys=keys)

    @property
    def dashboard_link(self) -> str | None:
        """The status page's URL when this client's cluster is a `LocalCluster` (given or
        started here), else None."""
        return getattr(self.cluster, "dashboard_link", None)

    def scheduler_info(self):
        """The scheduler's ``identity``: address, version, compiled, workers (each with
        name, nthreads, nanny, processing, in_memory, nbytes, occupancy and its memory
        figures), n_tasks, task_counts, counters (transitions, stimuli, bytes in memory,
        ...) and prefix_counts. The scheduler reads them from counters, never from a walk
        over its tasks: it is cheap to poll."""
        return self._sync(self._request, "identity")

    def wait_for_workers(self, n_workers: int = 1, timeout: float | None = None):
        """Block until at least ``n_workers`` workers are connected (TimeoutError after
        ``timeout`` seconds)."""
        return self._sync(self._wait_for_workers, n_workers, timeout)

    def restart(self, timeout: float = 30.0):
        """Restart every worker of the cluster (each through its nanny) and forget every
        task; returns this client.

        Every future of every client is cancelled: it raises `CancelledError` saying the
        cluster was restarted (results are dropped with the workers, work in flight is
        abandoned), as in dask. Returns once as many workers as before have registered
        again, or raises TimeoutError if they have not within ``timeout`` seconds. Refused
        with `SchedulerError`, nothing changed, while a worker has no nanny (started with
        ``dcore worker --no-nanny`` or by ``LocalCluster(processes=False)``).
        """
        return self._sync(self._restart, timeout)

    async def _restart(self, timeout: float):
        result = await self._request("restart", timeout=timeout)
        if result.get("status") != "OK":
            raise TimeoutError(f"restart: {result.get('workers')} of "
                               f"{result.get('expected')} workers came back within "
                               f"{timeout} s")
        return self

    # ------------------------------------------------------------ introspection

    def story(self, *keys, timeout: float = 5.0):
        """What happened to these keys (or futures), in the scheduler and on every worker:
        a list of `StoryEntry` ``(key, start, finish, stimulus_id, time, where)`` sorted
        by time. Workers that do not answer within ``timeout`` seconds are left out with
        a RuntimeWarning naming them. KeyError for a key that neither the scheduler nor
        any worker knows (never submitted, or forgotten and out of their bounded logs).
        """
        keys = [k.key if isinstance(k, Future) else k for k in keys]
        if not keys:
            raise TypeError("story() needs at least one key or future")
        try:
            hash(tuple(keys))
        except TypeError:
            raise TypeError(f"story(): keys must be hashable, got {keys!r:.200}") from None
        timeout = check_timeout(timeout)
        return self._sync(self._story, keys, timeout)

    async def _story(self, keys: list, timeout: float) -> list:
        result = await self._request("story", keys=keys, timeout=timeout)
        if result["unknown"]:
            raise KeyError(f"no story for {list(result['unknown'])!r:.300}: neither the "
                           "scheduler nor any worker knows it (never submitted here, or "
                           "forgotten and out of their bounded logs)")
        _warn_silent("story", result["silent"])
        return [StoryEntry(*entry) for entry in result["story"]]

    def get_scheduler_logs(self, n: int | None = None):
        """The scheduler's last ``n`` log lines (every line it keeps, up to 10,000, for
        None), oldest first."""
        n = logs.check_line_count(n)
        return self._sync(self._scheduler_logs, n)

    async def _scheduler_logs(self, n) -> list:
        return list(await self._request("scheduler-logs", n=n))

    def get_worker_logs(self, n: int | None = None, timeout: float = 5.0):
        """``{worker address: its last n log lines}`` (every line kept, up to 10,000, for
        None), oldest first. A worker that does not answer within ``timeout`` seconds
        (or left meanwhile) gets a `WorkerSilent` exception saying so instead of lines."""
        n = logs.check_line_count(n)
        timeout = check_timeout(timeout)
        return self._sync(self._worker_logs, n, timeout)

    async def _worker_logs(self, n, timeout: float) -> dict:
        result = await self._request("worker-logs", n=n, timeout=timeout)
        answers: dict = {address: list(lines) for address, lines in result["logs"].items()}
        for address, reason in result["silent"].items():
            answers[address] = WorkerSilent(f"worker {address} did not answer: {reason}")
        return dict(sorted(answers.items()))

    def get_task_stream(self, start=None, stop=None):
        """The tasks that ran (finished or failed) at some time between ``start`` and
        ``stop``: seconds since the epoch (``time.time()``) or datetimes, None for no
        bound. A list of ``{"key", "worker", "start", "stop", "status"}`` ("memory" or
        "erred"), oldest report first. The scheduler remembers its last 100,000 tasks;
        times are the clocks of the workers that ran them."""
        start, stop = _time_bound(start, "start"), _time_bound(stop, "stop")
        if start is not None and stop is not None and start > stop:
            raise ValueError(f"start ({start}) is after stop ({stop})")
        return self._sync(self._get_task_stream, start, stop)

    async def _get_task_stream(self, start, stop) -> list:
        return (await self._task_stream_and_counters(start, stop))["tasks"]

    async def _task_stream_and_counters(self, start, stop) -> dict:
        """``{"tasks": [...], "counters": {...}}`` (`Scheduler.counters`)."""
        result = await self._request("task-stream", start=start, stop=stop)
        return {"tasks": [dict(task) for task in result["tasks"]],
                "counters": dict(result["counters"])}

    async def _wait_for_workers(self, n_workers: int, timeout: float | None) -> None:
        async def poll():
            while len((await self._request("identity"))["workers"]) < n_workers:
                await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(poll(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"fewer than {n_workers} workers after {timeout}s") from None

    # ------------------------------------------------------------ moving results
    # (the scheduler's side: retirement.py)

    def retire_workers(self, workers=None, n: int | None = None, close_workers: bool = True):
        """Retire workers gracefully: ``workers`` (addresses or names), or the ``n``
        holding the fewest bytes. A retiring worker takes no new task; every result only
        it holds is copied to another worker first; then, with ``close_workers``, it
        closes (its nanny does not start it again), else it stays connected, taking no
        task and holding nothing. Returns ``{address: worker info}`` of the workers
        retired, as dask. A worker whose results no other worker could take (none is
        running, or every copy failed) is not retired: it takes tasks again, and a
        RuntimeWarning says why. Tasks still running on a retired worker when it leaves
        run again elsewhere."""
        if workers is None and n is None:
            raise ValueError("retire_workers needs workers= (addresses or names) or n=")
        if isinstance(workers, (str, int)):
            workers = [workers]
        return self._sync(self._retire_workers, None if workers is None else list(workers),
                          n, close_workers)

    async def _retire_workers(self, workers, n, close_workers: bool) -> dict:
        result = await self._request("retire-workers", workers=workers, n=n,
                                     close_workers=close_workers)
        for address, why in result["refused"].items():
            warnings.warn(f"worker {address} was not retired: {why}", RuntimeWarning)
        return dict(result["retired"])

    def replicate(self, futures, n: int | None = None, workers=None,
                  branching_factor: int = 2) -> None:
        """Copy the futures' results onto ``n`` workers (all of ``workers``, or of the
        cluster, for None), worker to worker, ``branching_factor`` new copies per holder
        and round; copies past ``n`` among those workers are dropped. A RuntimeWarning
        names the keys left short (not computed yet, or copies that failed)."""
        keys = [state.key for state in unique_states(futures_in(futures))]
        return self._sync(self._move_results, "replicate",
                          {"keys": keys, "n": n, "branching_factor": branching_factor,
                           "workers": None if workers is None else list(workers)})

    def rebalance(self, futures=None, workers=None) -> None:
        """Move results from workers holding more bytes than the mean to those holding
        fewer (only the futures' results, and only among ``workers``, if given). A
        RuntimeWarning names given futures that could not move."""
        keys = None if futures is None else [
            state.key for state in unique_states(futures_in(futures))]
        return self._sync(self._move_results, "rebalance",
                          {"keys": keys, "workers": None if workers is None else list(workers)})

    async def _move_results(self, op: str, fields: dict) -> None:
        result = await self._request(op, **fields)
        if result.get("status") == "partial-fail":
            warnings.warn(f"{op}: not done for {list(result['keys'])!r:.300}: not in memory, "
                          "or their copies failed", RuntimeWarning)

    # ------------------------------------------------------------ datasets and plugins
    # Thin: the logic is in datasets.py and plugins.py.

    def publish_dataset(self, *args, **kwargs):
        """Publish values by name in the scheduler, for every client: ``(value,
        name="x")``, ``(collection, ...)`` (named by their ``.name``) or ``(x=value,
        ...)``; all or none. Futures inside stay alive while published. KeyError if a
        name is published already, unless ``override=True``."""
        return datasets.publish_dataset(self, args, kwargs)

    def get_dataset(self, name: str, default=datasets.NO_DEFAULT):
        """The value published as ``name`` (its Futures now held by this client);
        ``default`` if there is none, else KeyError."""
        return datasets.get_dataset(self, name, default)

    def list_datasets(self) -> list:
        """The names of the published datasets."""
        return datasets.list_datasets(self)

    def unpublish_dataset(self, name: str) -> None:
        """Unpublish ``name`` (nothing happens if it is not published, as in dask)."""
        return datasets.unpublish_dataset(self, name)

    @property
    def datasets(self) -> datasets.Datasets:
        """The published datasets as a mutable mapping (`datasets.Datasets`)."""
        return datasets.Datasets(self)

    def register_plugin(self, plugin, name=None, idempotent: bool = False):
        """Install a `WorkerPlugin` on every worker, now and on those that join later;
        ``{address: {"status": "OK"}}``. A setup error is raised here (and the plugin
        removed). A SchedulerPlugin is refused with how to install it instead
        (``dcore scheduler --preload``); nanny plugins are not supported."""
        return plugins.register_worker_plugin(self, plugin, name, idempotent)

    def register_worker_plugin(self, plugin=None, name=None, nanny=None):
        """dask's older name for `register_plugin` (worker plugins only)."""
        if plugin is None:
            raise TypeError("register_worker_plugin needs a plugin")
        return plugins.register_worker_plugin(self, plugin, name, nanny=nanny)

    def unregister_worker_plugin(self, name: str, nanny=None):
        """Tear the worker plugin ``name`` down on every worker and forget it
        (ValueError if there is none)."""
        if nanny:
            raise plugins.NannyPluginRefused("nanny plugins are not supported by "
                                             "distributed-core")
        return plugins.unregister_worker_plugin(self, name)


def _time_bound(value, name: str) -> float | None:
    """A task stream bound: None, a number of seconds since the epoch, or a datetime."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    if type(value) in (int, float) and math.isfinite(value):
        return float(value)
    raise TypeError(f"{name} must be None, seconds since the epoch or a datetime, not "
                    f"{value!r:.100}")


def _warn_silent(what: str, silent: dict) -> None:
    if silent:
        named = "; ".join(f"{address}: {reason}" for address, reason in sorted(silent.items()))
        warnings.warn(f"{what}: {len(silent)} worker(s) left out: {named}", RuntimeWarning,
                      stacklevel=4)


def fire_and_forget(obj) -> None:
    """Run the futures in ``obj`` (a future, containers of them, persisted collections)
    to completion even if every client releases them or disconnects; their results are
    then dropped."""
    by_client: dict = {}
    for future in futures_of(obj):
        by_client.setdefault(id(future.client), (future.client, []))[1].append(future.key)
    for client, keys in by_client.values():
        client._post({"op": "fire-and-forget", "keys": keys})


def _refuse_actors(method: str, wanted: bool) -> None:
    if wanted:
        raise NotImplementedError(f"Client.{method}(actor=True): actors are not supported "
                                  f"by distributed-core; submit plain tasks")


# A task's client (get_client() inside a task) is made by the worker through this factory:
# the worker side never imports the client.
install_client_factory(Client)
