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
- The client's key table (`distributed_server.client.key_table`) owns the key states its
  futures share (`distributed_server.client.futures`: `Future`, `wait`, `as_completed`,
  the exceptions) and sends ``release-keys`` when the last Future of a key goes away.
  Task specs are built by `distributed_server.client.task_specs`. The names of both
  modules that users import are exported here too (see ``__all__``).

The modules of the client
-------------------------
`Client` is made of parts, each in a module of its own and none of which imports this
one. Here stay its lifecycle (connect, close, sync and async use), the plumbing every
part uses (``_sync``, ``_request``, the outbox), `submit`, `map`, `get`, `compute`,
`persist`, `cancel` and `retry`.

- `distributed_server.client.key_table`: `KeyTable`, the one owner of the key states
  (one `KeyState` per key held, counted by reference under its lock) and the handler of
  the scheduler's messages about keys; the client delegates to it (``_keys``).
- Classes mixed into `Client`, one group of methods each:
  `distributed_server.client.results` (`gather`, and waiting for futures),
  `distributed_server.client.scatter` (`scatter`),
  `distributed_server.client.cluster_info` (`scheduler_info`, `who_has`, `nthreads`,
  versions, ...), `distributed_server.client.cluster_control` (`restart`,
  `retire_workers`, `replicate`, `rebalance`), `distributed_server.client.history`
  (`story`, logs, the task stream), `distributed_server.client.worker_calls` (`run`,
  `upload_file`, worker plugins) and `distributed_server.client.datasets` (published
  datasets).
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
states and references (under the key table's lock) and queue messages in the client's outbox,
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
`dask_graphs`; the graph takes its turn in the outbox when it is submitted and
`dask_compute.GraphSender.send_plan` sends its slices one at a time from there, so that
nothing queued later overtakes them. Without dask these methods raise an
ImportError naming the extra, and `get` converts dict graphs itself
(`task_specs.LegacyGraph`).

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
import functools
import logging
import threading
import uuid
import weakref
from collections.abc import Callable

from ..deploy.launch import read_scheduler_file
from ..security import Security
from ..worker.task_context import install_client_factory
from . import dask_graphs
from .cluster_control import ClusterControlMixin
from .cluster_info import ClusterInfoMixin
from .dask_compute import GraphSender
from .datasets import DatasetsMixin
from .futures import (
    ALL_COMPLETED,
    CANCELLED,
    ERROR,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
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
from .gc_pause import collector_paused
from .history import HistoryMixin
from .key_table import RELEASE_BATCH_KEYS, KeyTable  # noqa: F401 - RELEASE_BATCH_KEYS: re-exported
from .loop_thread import ClientLoopThread
from .results import ResultsMixin
from .scatter import ScatterMixin
from .scheduler_comm import HEARTBEAT_INTERVAL, SchedulerComm  # noqa: F401 - re-exported
from .task_specs import (
    MapEncoder,
    TaskEncoder,
    map_columns,
    task_options,
)
from .transfers import (  # noqa: F401 - FETCH_ROUNDS, PEER_POOL_SIZE: re-exported
    FETCH_ROUNDS,
    PEER_POOL_SIZE,
    WorkerTransfers,
)
from .worker_calls import WorkerCallsMixin

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

logger = logging.getLogger("distributed_server.client")

#: Seconds `close` waits for the scheduler connection to flush, and for the loop thread.
CLOSE_TIMEOUT = 5.0
#: Tasks per update-graph that `map` sends: the scheduler decodes a message whole, so
#: this bounds what a large map costs it in transient memory.
MAP_BATCH_TASKS = 2_000


# Client statuses
_CREATED, _RUNNING, _LOST, _CLOSING, _CLOSED = "created", "running", "lost", "closing", "closed"


def _local_cluster_security(address) -> Security | None:
    """The credentials of a LocalCluster this process started at ``address``, if any."""
    if not isinstance(address, str):
        return None
    from ..deploy.local_cluster import local_cluster_security

    return local_cluster_security(address)


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


class Client(ResultsMixin, ScatterMixin, ClusterInfoMixin, ClusterControlMixin, HistoryMixin,
             WorkerCallsMixin, DatasetsMixin):
    """Connects to a distributed-core scheduler; submits work; holds futures.

    ``address`` is a scheduler address (``tcp://host:port``), a LocalCluster-like object
    with ``.scheduler_address``, or None to start ``LocalCluster(**cluster_kwargs)`` that
    this client owns and closes. ``timeout`` bounds connecting. With
    ``asynchronous=True``, ``await Client(...)`` (or ``async with``) starts it and the
    methods that talk to the cluster return awaitables; `submit` and `map` always
    return futures directly. Closed by `close`, the context manager, or at exit.

    Sync, async and on the client's own loop, one rule (as dask.distributed's): a method
    that waits for the cluster blocks and returns its value in a sync client, and returns
    an awaitable when the client is asynchronous *or* the call is made on the client's
    own event loop (a coroutine run with `sync`, a task started with ``loop`` code);
    `asynchronous` tells which. Methods that need no answer (`submit`, `map`, `compute`
    without ``sync``, `persist`, `cancel`, `retry`, `fire_and_forget`) return the same
    thing in every context. Done callbacks run on a callback thread of their own, where
    blocking calls work.
    A scheduler that stops answering (it answers every heartbeat, sent each
    `HEARTBEAT_INTERVAL` seconds) for ``scheduler_timeout`` seconds counts as lost: the
    pending futures raise `SchedulerConnectionError`. ``security`` holds the cluster's
    token and/or TLS files (`Security`); by default those of the LocalCluster given or
    started, else those named by the ``DCORE_TOKEN`` / ``DCORE_TOKEN_FILE`` /
    ``DCORE_TLS_*`` environment variables.
    ``scheduler_file`` reads the address from the file ``dcore scheduler
    --scheduler-file`` wrote (waiting up to ``timeout`` for it).

    Its key states live in its key table (`KeyTable`); its other methods come from the
    classes it is made of (`ResultsMixin`, `ScatterMixin`, `ClusterInfoMixin`,
    `ClusterControlMixin`, `HistoryMixin`, `WorkerCallsMixin`, `DatasetsMixin`).
    """

    def __init__(self, address=None, *, asynchronous: bool = False, timeout: float = 10,
                 name: str | None = None, set_as_default: bool = True,
                 security: Security | None = None, scheduler_timeout: float = 30.0,
                 scheduler_file: str | None = None, **cluster_kwargs) -> None:
        if scheduler_file is not None:
            if address is not None:
                raise TypeError("give an address or a scheduler_file, not both")
            address = read_scheduler_file(scheduler_file, timeout=max(timeout, 1.0))
        self._asynchronous = asynchronous
        self.timeout = timeout
        self.scheduler_timeout = scheduler_timeout
        if isinstance(address, str) and "://" not in address:
            address = f"tcp://{address}"
        if security is None and address is not None:
            security = (getattr(address, "security", None)
                        or _local_cluster_security(address)
                        or Security.from_environment(role="client"))
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
        self.scheduler_address: str | None = address
        self._set_as_default = set_as_default
        #: The key states and their reference counts, and the scheduler's messages about
        #: keys (`KeyTable`).
        self._keys = KeyTable(self._check_running, self._is_running)
        # status changes that must not interleave with taking a reference hold its lock
        self._lock = self._keys.lock
        self._transfers: WorkerTransfers | None = None  # with workers (made at connect)
        self._runner: ClientLoopThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread_id: int | None = None
        self._finalizer: weakref.finalize | None = None
        #: Sends this client's dask graphs (compute, persist, get).
        self._graphs = GraphSender(self)
        self._dask_default = None  # a dask_graphs.DefaultScheduler while we are dask's
        #: The scheduler connection and the ordered outbox every message goes through.
        self._conn = SchedulerComm(self.id, self._keys.handlers(),
                                   release=self._keys.release,
                                   on_lost=self._connection_lost)
        self._keys.outbox = self._conn
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
            if dask_graphs.dask_available():
                try:
                    self._dask_default = dask_graphs.DefaultScheduler(self)
                except Exception:  # dask is broken: the client works without it
                    logger.exception("could not make %s dask's default scheduler", self.id)

    def __await__(self):
        return self._start_async().__await__()

    async def __aenter__(self):
        return await self._start_async()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    @property
    def asynchronous(self) -> bool:
        """True when the methods that wait for the cluster return awaitables: in an
        asynchronous client, and in any client while called from its own event loop."""
        return self._asynchronous or self._on_loop()

    def __enter__(self):
        if self._asynchronous:
            raise TypeError("use 'async with' for an asynchronous client")
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self, timeout: float = CLOSE_TIMEOUT):
        """Tell the scheduler goodbye, close connections, stop the loop thread and the
        owned LocalCluster. Idempotent; pending futures fail with
        `SchedulerConnectionError`. A sync client cannot close from its own loop
        (it would stop the loop it runs on): RuntimeError there."""
        if self._asynchronous:
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

    # ------------------------------------------------------------ threads, sync and the outbox

    def _on_loop(self) -> bool:
        return threading.get_ident() == self._loop_thread_id

    def _sync(self, method, *args):
        """Run ``method(*args)`` (a coroutine function) on the loop: an awaitable in an
        async client, the result (blocking) in a sync one."""
        if self.asynchronous:  # an asynchronous client, or a call on the client's loop
            return method(*args)
        if self._runner is None or self.status == _CLOSED:
            raise SchedulerConnectionError(f"{self.id} is closed")
        return self._runner.run(method(*args))

    def sync(self, func: Callable, *args, **kwargs):
        """Run ``func(*args, **kwargs)``, a coroutine function, on this client's loop and
        return its result (an awaitable in an asynchronous client), as dask's."""
        async def call():
            return await func(*args, **kwargs)
        return self._sync(call)

    def _call_soon(self, fn, *args) -> None:
        if self._on_loop():
            self._loop.call_soon(fn, *args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _post(self, item) -> None:
        """Queue a message (dict) or a reference to drop (`KeyState`), from any thread,
        in the scheduler connection's ordered outbox (`SchedulerComm.post`)."""
        self._conn.post(item)

    def _send_on_loop(self, msg: dict) -> None:
        """Send from the loop thread, after everything queued before it (through the
        outbox: `SchedulerComm.send_in_order`)."""
        self._conn.send_in_order(msg)

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

    # ------------------------------------------------------------ the key table
    # What futures, dask graphs and primitives take of the key table (`KeyTable`).

    @property
    def _refusals(self) -> int:
        """How many graph-refused messages came (a graph's slices stop at one)."""
        return self._keys.refusals

    def _hold_key(self, key) -> KeyState:
        """A reference to ``key``'s state; the scheduler is asked about a key new here."""
        return self._keys.hold(key)

    def _release_later(self, state: KeyState) -> None:
        """Drop one reference to ``state`` soon; safe in ``__del__`` (never blocks)."""
        self._keys.release_later(state)

    def _register(self, tasks: list[dict], wanted: list | None = None) -> list[Future]:
        """Futures for the ``wanted`` keys (default: every task's key, in order).

        Keys this client holds already are not sent again; if any wanted key is new, one
        update-graph goes out with the new wanted tasks and every task not wanted itself.
        """
        return [Future._attach(state, self) for state in self._keys.register(tasks, wanted)]

    def _detach(self, state: KeyState) -> bool:
        """Forget ``state`` (its key is no longer wanted); False if it was not current."""
        return self._keys.detach(state)

    def _hold_graph(self, nodes, wanted: list) -> tuple:
        """For a dask graph (`dask_compute`): Futures of its ``wanted`` keys.

        Returns ``({key: Future}, new keys, keys of the graph held already, states
        created, references taken on those held keys)``; the caller drops the last ones
        (`_release_later`) once its plan holds what it needs. KeyError for a new wanted
        key that is not in the graph.
        """
        by_key, new, known, created, first_holds = self._keys.hold_graph(nodes, wanted)
        futures = {key: Future._attach(state, self) for key, state in by_key.items()}
        return futures, new, known, created, first_holds

    def _hold_present(self, keys) -> list[KeyState]:
        """A reference to each of ``keys`` this client holds (dropped with
        `_release_later`): a graph being sent needs them meanwhile."""
        return self._keys.hold_present(keys)

    def _release_temporary(self, keys) -> None:
        """Release frontier keys the client wanted only while its graph was sent (keys it
        holds futures of meanwhile stay wanted); nothing once the client is closing."""
        self._keys.release_temporary(keys)

    def _connection_lost(self, reason: Exception) -> None:
        """Fail what is pending: nothing more will come from the scheduler."""
        with self._lock:
            closing = self.status == _CLOSING
            self.status = _CLOSED if closing else _LOST
            pending = self._keys.pending()
        if closing:
            text = f"{self.id} was closed"
        else:
            text = f"lost the connection to the scheduler at {self.scheduler_address}: {reason}"
            logger.warning("%s", text)
        error = functools.partial(SchedulerConnectionError, text)
        self._keys.fail(pending, error)
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
        once, as a task the others depend on (`task_specs.MapEncoder`)."""
        _refuse_actors("map", actor or actors)
        keys = key if isinstance(key, list) else None
        prefix = key if isinstance(key, str) else None
        options = task_options(retries, priority, workers, resources, allow_other_workers)
        encoder = TaskEncoder(self, func, pure, options, prefix)
        columns, n = map_columns(iterables)
        if keys is not None and len(keys) != n:
            raise ValueError(f"map got {len(keys)} keys for {n} tasks")
        mapper = MapEncoder(encoder, columns, n, kwargs)
        futures: list[Future] = []
        # shared values go first, wanted until the last batch that needs them is sent
        shared = self._register(mapper.shared) if mapper.shared else []
        ahead = None  # the previous batch's mark: the caller waits until it is written
        paced = not self._conn.on_loop()
        try:
            with collector_paused():  # a Future and a KeyState a task, all kept
                for batch in mapper.batches(keys, batch_size or MAP_BATCH_TASKS):
                    futures.extend(self._register(batch))
                    if paced:
                        while ahead is not None and not ahead.event.wait(1.0):
                            self._check_running()  # closed meanwhile: stop waiting
                        ahead = self._conn.mark_written()
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
        `dask_graphs`); without it a dict graph is converted here. The options apply
        to every task; dask annotations (``with dask.annotate(...)``) override them.
        Other keywords are accepted and ignored, as dask.distributed does: dask forwards
        whatever a caller gave ``compute`` (``x.compute(num_workers=4)``) to its scheduler.
        """
        if kwargs:
            logger.debug("get(): ignored keywords %s", sorted(kwargs))
        options = task_options(retries, priority, workers, resources, allow_other_workers)
        return self._graphs.get(dsk, keys, options)

    # ------------------------------------------------------------ dask collections

    def compute(self, collections, sync: bool = False, optimize_graph: bool = True, *,
                retries: int = 0, priority: int = 0, workers=None,
                resources: dict | None = None, allow_other_workers: bool = False,
                **kwargs):
        """Start computing dask collections; a Future of each one's final value.

        One collection gives one Future; a list (tuple, set) of them gives a list, with
        anything that is not a dask collection passed through. ``sync=True`` returns the
        values instead (as `gather`). Returns once the graph is sent to the scheduler
        (an asynchronous client sends it in the background). Options as in `submit`;
        dask annotations override them per task. Other keywords (dask's optimization
        options, scheduler keywords) are accepted and ignored. Needs dask.
        """
        if kwargs:
            logger.debug("compute(): ignored keywords %s", sorted(kwargs))
        options = task_options(retries, priority, workers, resources, allow_other_workers)
        return self._graphs.compute(collections, sync, optimize_graph, options)

    def persist(self, collections, optimize_graph: bool = True, *, retries: int = 0,
                priority: int = 0, workers=None, resources: dict | None = None,
                allow_other_workers: bool = False, **kwargs):
        """Start computing dask collections and keep their pieces on the workers.

        Returns the same kind of collection (a list for a list), whose graph holds the
        futures of its keys: later computations reuse those results instead of
        recomputing them, and the results are released when the collection is garbage
        collected. Returns once the graph is sent. Other keywords are accepted and
        ignored, as in `compute`. Needs dask.
        """
        if kwargs:
            logger.debug("persist(): ignored keywords %s", sorted(kwargs))
        options = task_options(retries, priority, workers, resources, allow_other_workers)
        return self._graphs.persist(collections, optimize_graph, options)

    # ------------------------------------------------------------ managing futures

    def cancel(self, futures, force: bool = False):
        """Cancel futures: the scheduler stops computing them for this client (for every
        client with ``force``); they raise `CancelledError`."""
        return self._sync(self._cancel, futures_in(futures), force)

    async def _cancel(self, futures: list[Future], force: bool) -> None:
        states = [s for s in unique_states(futures) if s.status != CANCELLED]
        if not states:
            return
        self._check_running()
        self._keys.cancel(states, force)

    def retry(self, futures):
        """Run failed futures again (with the failed tasks they depend on)."""
        return self._sync(self._retry, futures_in(futures))

    async def _retry(self, futures: list[Future]) -> None:
        states = [s for s in unique_states(futures) if s.status == ERROR]
        if not states:
            return
        self._check_running()
        self._keys.retry(states)


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
