"""The Worker server: the shell around a worker's state machine (`distributed_core.WorkerCore`).

What this module does
---------------------
Every decision about a task (run it, fetch its inputs and from whom, keep or drop a
value, what to tell the scheduler) is the state machine's: the shell turns what happens
on sockets, threads and timers into its stimuli and carries out the instructions it
returns (docs/protocol.md, section 1b). ``worker.data`` holds a value exactly while the
machine has that key in memory.

- Registers with the scheduler (handshake role ``"worker"``) and reads its batched
  stream: the ``compute-task``, ``free-keys``, ``acquire-replicas`` (copies the
  scheduler wants here: retirement, replicate, rebalance) and ``steal-request`` (work
  stealing: a task no executor thread has begun is given back) messages of one frame are
  one ``scheduler_messages`` stimulus (their executions start in priority order, their
  inputs are asked of each peer in one request), ``close`` closes. No asyncio Task is
  made per task.
- Runs tasks on ``nthreads`` daemon executor threads. ``Execute`` puts the task's spec
  and its inputs' values on a thread-safe queue; the machine hands out at most
  ``prefetch`` executions, so a late urgent task is never stuck behind thousands. A
  thread runs ``loads_spec(spec)(inputs)``, builds the report (sized and, when small,
  pickled inline, on the thread) and appends the outcome to a deque; one
  ``call_soon_threadsafe`` per burst of outcomes wakes the loop, which turns each into
  ``execute_success`` / ``execute_failure`` / ``execute_skipped`` (a task cancelled
  before it began is skipped). Reports leave through the batched ``Comm.send``.
- Fetches inputs from peer workers (``Fetch``: one ``get-data`` per peer and burst, over
  pooled connections). Every transfer has a connect timeout, and each frame of the
  answer a read timeout (``transfer_timeout``, 30 s by default), so a fetch from a hung
  (SIGSTOPped) peer fails in bounded time and is planned again at once from the next
  holder, or given back. Large values travel in parts of ``transfer_part_bytes`` (32 MiB)
  each, so no frame comes near a frame limit.
- Serves peers and clients on its own listener: ``get-data``, ``put-data`` (clients
  only), ``ping``. A value it cannot serialize is reported missing with the reason
  (``errors``) and dropped (``serve_failed``): the scheduler recomputes it, and the
  recomputation must show that its result serializes, or the task fails with an error
  naming the key, the type, the size and the cause, instead of looping.
- Sends a heartbeat every ``heartbeat_interval``, with its memory figures; the scheduler
  answers each. A scheduler silent for ``scheduler_timeout`` (60 s) counts as lost, as
  does a closed connection. On losing the scheduler it drops all
  data and tasks (``scheduler_lost``: the scheduler will treat it as a new worker) and
  tries to register again for ``reconnect_timeout`` seconds; then it shuts down.

What it never does
------------------
- It never runs task code on the event loop: specs are unpickled and called, and
  results sized and pickled for inline reports, on executor threads. Data transfers
  (``get-data``/``put-data`` payloads) are pickled and unpickled on the loop.
- It never decides a task's fate itself, and never changes the machine's state except
  through a stimulus.
- It never blocks process exit or hangs in ``close()``: executor threads are daemons
  and are waited for only briefly.

Heartbeats and the GIL: a task that holds the GIL in one C call (``sum(range(10**9))``)
stops every Python thread of the process, the loop and any heartbeat thread alike, so no
heartbeat design inside the process can speak for it. What keeps such a worker alive is
the scheduler's worker TTL, 300 s by default as dask's.
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import socket
import threading
import time
from collections import deque
from queue import SimpleQueue

import psutil

from distributed_core import (
    Execute,
    Fetch,
    InvalidStimulus,
    ReleaseData,
    ReportHeld,
    SendMessage,
    StoreData,
    WorkerCore,
    bounded_repr,
)

from .. import config, logs
from ..comm import (
    DEFAULT_MAX_FRAME_BYTES,
    Blob,
    Comm,
    CommClosedError,
    ProtocolError,
    connect,
    listen,
    parse_address,
)
from ..comm.peer_pool import PeerPool
from ..plugins import WorkerPluginHost, check_plugin_name
from ..protocol.serialize import (
    dumps_data,
    dumps_error,
    dumps_inline_result,
    loads_data,
    loads_spec,
    sizeof,
)
from ..security import Security, check_listen_security
from ..versions import essential
from .memory import (
    MEMORY_LIMIT_ENV,
    MONITOR_INTERVAL,
    ON_DISK,
    ExecutionGate,
    MemoryMonitor,
    SpillBuffer,
    check_fractions,
)
from .remote_run import run_packed_call
from .task_context import enter_task, leave_task, make_client

__all__ = ["ResultCannotTravel", "Worker"]

logger = logging.getLogger("distributed_server.worker")

# Worker status.
CREATED, RUNNING_STATUS, CLOSING, CLOSED = "created", "running", "closing", "closed"

#: Idle pooled connections kept per peer worker.
MAX_IDLE_PEER_COMMS = 4
#: How long close() waits for executor threads to finish their current task.
THREAD_JOIN_TIMEOUT = 1.0
#: Most threads a worker may have (the scheduler counts them in 32 bits).
MAX_THREADS = 2**31 - 1
#: A result's size is reported clamped to this: a broken __sizeof__ cannot make the
#: scheduler refuse the report.
MAX_REPORTED_NBYTES = 2**62
#: Seconds of silence (the scheduler answers every heartbeat) after which a worker treats
#: the scheduler as lost: it drops its data and tries to register again.
SCHEDULER_TIMEOUT = 60.0
#: Seconds a peer transfer may wait to connect, and for each frame of an answer.
TRANSFER_TIMEOUT = 30.0
#: The environment variable that sets the default transfer timeout (``dcore worker``).
TRANSFER_TIMEOUT_ENV = "DCORE_TRANSFER_TIMEOUT"
#: Values whose frames are larger than this travel to peer workers in parts of this size.
TRANSFER_PART_BYTES = 32 * 1024 * 1024
#: The most a single-frame get-data answer (one that did not ask for parts) may carry.
SINGLE_FRAME_REPLY_BYTES = DEFAULT_MAX_FRAME_BYTES - 1024 * 1024

# What an execution came to (the kinds of WorkerCore.executions_done).
_SUCCESS, _FAILURE, _SKIPPED = "finished", "erred", "skipped"
_EXECUTING = "executing"  # the machine's state of a task whose execution is wanted


class ResultCannotTravel(TypeError):
    """A task's result cannot be serialized, so it cannot reach other workers or clients."""


class _BadRequest(ValueError):
    """A peer sent a request the worker cannot answer; its connection is closed."""


class Worker:
    """A worker server: executes tasks for a scheduler and serves results to peers.

    ``await worker.start()`` listens for peers on ``host:port`` (port 0 picks a free
    one; ``worker.address`` tells which), then registers with the scheduler at
    ``scheduler_address``. Results live in ``worker.data`` (key -> value); the task
    lifecycle is ``worker.state``, a `distributed_core.WorkerCore` (``state.story(key)``
    tells what happened to a key). ``resources`` (``{name: quantity}``) limit which
    tasks may run at once. ``security`` holds the cluster's token and/or TLS files
    (``tls://`` addresses need TLS): it is proven to the scheduler and to peers, and
    demanded of every peer that connects here. Without credentials the worker listens
    only on loopback unless ``insecure=True``. ``connect_timeout`` bounds connecting to
    the scheduler at start and to a peer; ``transfer_timeout`` (default 30 s, or
    ``DCORE_TRANSFER_TIMEOUT`` from the environment) bounds connecting to a peer and
    each frame of a transfer, both ways. ``validate`` checks the state
    machine's invariants after every stimulus (tests).

    ``contact_address`` is the address announced to the scheduler and peers when it is
    not where the worker listens (containers, NAT: they forward it to ``host:port``).

    ``memory_limit`` (bytes; default ``DCORE_MEMORY_LIMIT`` from the environment, as the
    nanny sets it, else none) turns on memory management (memory.py): results past
    ``memory_target_fraction`` of it spill to files under ``local_directory``, process
    memory past ``memory_spill_fraction`` spills more, past ``memory_pause_fraction`` no
    new task starts until it falls back. False turns a step off; None takes the
    configured value (config.py: dask's ``distributed.worker.memory.*`` keys carry
    over), else 0.6, 0.7 and 0.8. ``connect_timeout``, ``transfer_timeout`` and
    ``scheduler_timeout`` left at None come from configuration too. Heartbeats carry the process's memory, the bytes held and spilled, and whether
    the worker is paused.

    ``dashboard_address`` (``":0"``: any free port on ``host``) serves ``/metrics`` over
    HTTP (`distributed_server.dashboard.worker_app`); None (the default here; ``dcore
    worker`` serves on a free port) serves none.
    """

    def __init__(self, scheduler_address: str, nthreads: int = 1, name=None,
                 resources: dict | None = None, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_interval: float = 1.0, reconnect_timeout: float = 10.0,
                 scheduler_timeout: float | None = None,
                 security: Security | None = None, *, insecure: bool = False,
                 connect_timeout: float | None = None,
                 transfer_timeout: float | None = None,
                 transfer_part_bytes: int = TRANSFER_PART_BYTES,
                 memory_limit: int | None = None,
                 memory_target_fraction: float | bool | None = None,
                 memory_spill_fraction: float | bool | None = None,
                 memory_pause_fraction: float | bool | None = None,
                 local_directory: str | None = None, contact_address: str | None = None,
                 validate: bool = False, dashboard_address=None) -> None:
        if type(nthreads) is not int or not 1 <= nthreads <= MAX_THREADS:
            raise ValueError(f"nthreads must be an int from 1 to {MAX_THREADS}, "
                             f"got {nthreads!r}")
        if transfer_timeout is None and os.environ.get(TRANSFER_TIMEOUT_ENV):
            transfer_timeout = float(os.environ[TRANSFER_TIMEOUT_ENV])
        transfer_timeout = config.get("comm.timeouts.transfer", transfer_timeout)
        connect_timeout = config.get("comm.timeouts.connect", connect_timeout)
        scheduler_timeout = config.get("worker.scheduler-timeout", scheduler_timeout)
        memory_target_fraction, memory_spill_fraction, memory_pause_fraction = (
            None if value is False else config.get(f"worker.memory.{step}", value)
            for step, value in (("target", memory_target_fraction),
                                ("spill", memory_spill_fraction),
                                ("pause", memory_pause_fraction)))
        if not transfer_timeout > 0:
            raise ValueError(f"transfer_timeout must be positive, got {transfer_timeout!r}")
        if type(transfer_part_bytes) is not int or transfer_part_bytes < 1:
            raise ValueError(f"transfer_part_bytes must be a positive int, got "
                             f"{transfer_part_bytes!r}")
        if memory_limit is None:
            memory_limit = int(os.environ.get(MEMORY_LIMIT_ENV) or 0)
        if type(memory_limit) is not int or memory_limit < 0:
            raise ValueError(f"memory_limit must be bytes (an int >= 0; 0: none), got "
                             f"{memory_limit!r}")
        check_fractions(memory_target_fraction, memory_spill_fraction, memory_pause_fraction)
        self.security = security if security is not None else Security()
        check_listen_security(host, self.security, insecure, "worker")
        self.insecure = insecure
        self.dashboard_address = dashboard_address
        self.http = None  # the HTTP server of /metrics (dashboard/worker_app.py)
        self._process = psutil.Process()  # its CPU use goes with each heartbeat
        if parse_address(scheduler_address)[0] != self.security.scheme:
            raise ValueError(f"scheduler address {scheduler_address!r} does not fit the "
                             f"security given (use {self.security.scheme}://)")
        self.scheduler_address = scheduler_address
        self.nthreads = nthreads
        self.name = name
        self.resources = dict(resources or {})
        self.host = host
        self.port = port
        self.heartbeat_interval = heartbeat_interval
        self.reconnect_timeout = reconnect_timeout
        if not scheduler_timeout > 0:
            raise ValueError(f"scheduler_timeout must be positive, got {scheduler_timeout!r}")
        self.scheduler_timeout = scheduler_timeout
        self._last_heard = 0.0  # loop time of the scheduler's last frame
        self._last_tick = 0.0  # loop time of the last heartbeat
        self.connect_timeout = connect_timeout
        self.transfer_timeout = transfer_timeout
        self.transfer_part_bytes = transfer_part_bytes
        #: The most a get-data answer of one frame may carry (peers that do not ask for
        #: parts: clients). A larger value is reported missing with the reason.
        self.single_frame_reply_bytes = SINGLE_FRAME_REPLY_BYTES
        #: The frame limit of this worker's connections to peers.
        self.peer_max_frame_bytes = DEFAULT_MAX_FRAME_BYTES
        self.validate = validate
        self.memory_limit = memory_limit
        self.memory_target_fraction = memory_target_fraction or None
        self.memory_spill_fraction = memory_spill_fraction or None
        self.memory_pause_fraction = memory_pause_fraction or None
        self.local_directory = local_directory
        if contact_address is not None and \
                parse_address(contact_address)[0] != self.security.scheme:
            raise ValueError(f"contact address {contact_address!r} does not fit the "
                             f"security given (use {self.security.scheme}://)")
        self.contact_address = contact_address
        self.address = ""
        self.status = CREATED
        #: key -> value: a dict, or with a memory limit a SpillBuffer (memory.py).
        self.data: dict | SpillBuffer = {}
        self._discard_data = self._pop_data  # drops a key from data if held
        # a queued task's inputs: the values, or ON_DISK for those the executor thread
        # reads back when the task starts (with a SpillBuffer)
        self._peek_input = None
        self.memory: MemoryMonitor | None = None
        #: With a memory limit: holds executor threads that outrun the monitor.
        self._gate: ExecutionGate | None = None
        self.state: WorkerCore | None = None  # made at start, once the address is known

        self._queue: SimpleQueue = SimpleQueue()  # jobs (or None: stop) for the threads
        self._outcomes: deque = deque()  # (key, kind, value, report) from the threads
        self._wake_pending = False  # a call_soon_threadsafe to drain outcomes is queued
        self._stopping = False  # threads skip queued jobs and exit
        # A thread begins a job only under this lock, and notes its key in _begun (until
        # its outcome is drained): a steal request, answered under the lock, gives back
        # a job handed to the threads exactly when no thread began it.
        self._claim = threading.Lock()
        self._begun: set = set()
        self._threads: list = []
        self._threads_lock = threading.Lock()
        self._retiring = 0  # executor threads to retire (tasks that rejoined)
        self._task_client = None  # the Client of tasks that launch tasks, made on demand
        self._bursts = itertools.count()
        self._sids = itertools.count()  # numbers the shell's stimulus ids

        self._peer_pool = PeerPool(self.security, MAX_IDLE_PEER_COMMS)  # fetches' comms
        self._served: set = set()  # comms of peers we answer
        self._background: set = set()  # fetch tasks (one per peer per burst)
        #: name -> plugin object installed by Client.register_plugin (plugins.py)
        self.plugins: dict = {}
        self._plugin_host = WorkerPluginHost(self)
        self._plugin_watchers = self._plugin_host.watchers  # non-empty: tell transitions

        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener = None
        self._scheduler_comm: Comm | None = None
        self._reader: asyncio.Task | None = None
        self._heartbeat_handle: asyncio.TimerHandle | None = None
        self._memory_handle: asyncio.TimerHandle | None = None
        self._close_requested = False
        self._finished = asyncio.Event()

    def __repr__(self) -> str:
        tasks = len(self.state.tasks) if self.state is not None else 0
        return (f"<Worker {self.address or 'not started'} {self.status} "
                f"nthreads={self.nthreads} data={len(self.data)} tasks={tasks}>")

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> Worker:
        """Listen for peers, start the executor threads, register with the scheduler."""
        if self.status != CREATED:
            raise RuntimeError(f"{self!r} was already started")
        self._loop = asyncio.get_running_loop()
        logs.install_buffer()
        scheme = self.security.scheme
        self._listener = await listen(_join_address(scheme, self.host, self.port),
                                      self._serve_peer, {"role": "worker"}, self.security)
        bound_port = self._listener.port
        self.address = self.contact_address or _join_address(
            scheme, _contact_host(self.host, self.scheduler_address), bound_port)
        self._listener.set_handshake_info(address=self.address)  # known once bound
        logs.claim_address("worker", self.address)
        self.state = WorkerCore(self.address, self.nthreads, resources=self.resources or None,
                                validate=self.validate, clock=time.time,
                                seed=hash(self.address) & 0xFFFFFFFF)
        self._start_memory_management()
        self._start_threads()
        self.status = RUNNING_STATUS
        try:
            if self.dashboard_address is not None:
                from ..dashboard.worker_app import start_worker_http

                self.http = await start_worker_http(self, self.dashboard_address,
                                                    self.insecure)
            comm = await connect(self.scheduler_address, self._registration(),
                                 timeout=self.connect_timeout, security=self.security)
        except BaseException:
            await self.close()
            raise
        self._attach(comm)
        self._reader = self._loop.create_task(self._read_scheduler())
        self._heartbeat_handle = self._loop.call_later(self.heartbeat_interval, self._heartbeat)
        logger.info("worker %s (%d threads, name %r) connected to the scheduler at %s",
                    self.address, self.nthreads, self.name, self.scheduler_address)
        return self

    async def close(self) -> None:
        """Shut down: stop reading, stop serving, stop the threads. Safe to call twice."""
        if self.status in (CLOSING, CLOSED):
            await self._finished.wait()
            return
        if self.status == CREATED:
            self.status = CLOSED
            self._finished.set()
            return
        self.status = CLOSING
        logger.info("worker %s closing", self.address)
        for handle in (self._heartbeat_handle, self._memory_handle):
            if handle is not None:
                handle.cancel()
        await self._cancel_tasks()
        if self._listener is not None:
            await self._listener.stop()
        if self.http is not None:
            await self.http.stop()
        if self._scheduler_comm is not None:
            await self._scheduler_comm.close(timeout=1.0)
        for comm in self._served:
            comm.abort()
        self._peer_pool.close()
        await self._stop_threads()
        if self._task_client is not None:
            await asyncio.to_thread(self._task_client.close)
        self._stimulus(self.state.scheduler_lost, self._sid("worker-closing"))
        await self._plugin_host.close()
        if isinstance(self.data, SpillBuffer):
            self.data.close()
        self.data.clear()
        self.status = CLOSED
        self._finished.set()
        logger.info("worker %s closed", self.address)

    async def finished(self) -> None:
        """Wait until the worker has shut down."""
        await self._finished.wait()

    def pause(self) -> None:
        """Start no new task (memory is short); tasks already handed to the threads
        finish, fetches and peers are served as usual. On the event loop."""
        self._stimulus(self.state.pause, self._sid("pause"))

    def unpause(self) -> None:
        """Start tasks again. On the event loop."""
        self._stimulus(self.state.unpause, self._sid("unpause"))

    def memory_figures(self) -> dict:
        """What the heartbeat says of memory: the process's resident bytes (``memory``),
        the bytes of results held in RAM (``managed``, by their sizes; None without a
        memory limit) and on disk
        (``spilled``, with ``spilled_count``), and whether tasks are ``paused``."""
        data = self.data
        if isinstance(data, SpillBuffer):
            managed, spilled, count = data.memory_bytes, data.spilled_bytes, data.spilled_count
        else:  # without a limit the sum of sizes is not kept
            managed, spilled, count = None, 0, 0
        memory = self.memory.memory if self.memory is not None else _rss()
        return {"memory": memory, "managed": managed, "spilled": spilled,
                "spilled_count": count, "paused": bool(self.state and self.state.paused)}

    def _start_memory_management(self) -> None:
        """With a memory limit: results in a SpillBuffer, and a monitor every
        MONITOR_INTERVAL seconds that spills and pauses."""
        if not self.memory_limit:
            return
        buffer = None
        if self.memory_target_fraction or self.memory_spill_fraction:
            target = (self.memory_target_fraction or 1.0) * self.memory_limit
            buffer = SpillBuffer(target, self._weight, self.local_directory)
            self.data = buffer
            self._discard_data = buffer.discard
            self._peek_input = buffer.in_memory
        self.memory = MemoryMonitor(self.memory_limit, buffer, self.memory_target_fraction,
                                    self.memory_spill_fraction, self.memory_pause_fraction)
        fraction = self.memory_spill_fraction or self.memory_pause_fraction
        if fraction:
            self._gate = ExecutionGate(fraction * self.memory_limit, self._request_memory_check,
                                       self.memory.rss)
        self._memory_handle = self._loop.call_later(MONITOR_INTERVAL, self._check_memory)

    def _pop_data(self, key) -> None:
        self.data.pop(key, None)

    def _weight(self, key, value) -> int:
        """A result's size for the spill buffer: what the machine knows, else sizeof."""
        ts = self.state.tasks.get(key)
        if ts is not None and ts.nbytes >= 0:
            return ts.nbytes
        return _sizeof_quietly(value)

    def _check_memory(self) -> None:
        try:
            change = self.memory.check()
        except Exception:  # noqa: BLE001 - the monitor must keep running
            logger.exception("BUG: worker %s: memory check failed", self.address)
            change = None
        limit = self.memory_limit
        if change is True:
            logger.warning("worker %s paused: memory %s is over %.0f%% of the limit %s",
                           self.address, _mib(self.memory.memory),
                           100 * self.memory_pause_fraction, _mib(limit))
            self.pause()
        elif change is False:
            logger.warning("worker %s resumed: memory %s is back under %.0f%% of the limit "
                           "%s", self.address, _mib(self.memory.memory),
                           100 * self.memory_pause_fraction, _mib(limit))
            self.unpause()
        soon = self.memory.behind
        if self._gate is not None:
            soon = self._gate.checked(self.memory.estimate, self.memory.behind,
                                      bool(self._outcomes))
        if self.status == RUNNING_STATUS:
            delay = 0.001 if soon else MONITOR_INTERVAL
            self._memory_handle = self._loop.call_later(delay, self._check_memory)

    def _request_memory_check(self) -> None:
        """From an executor thread (the gate closed): run the monitor on the loop now."""
        try:
            self._loop.call_soon_threadsafe(self._check_memory_now)
        except RuntimeError:  # the loop is closed
            self._gate.release()

    def _check_memory_now(self) -> None:
        if self.status != RUNNING_STATUS:
            return
        if self._memory_handle is not None:
            self._memory_handle.cancel()
        self._check_memory()

    async def __aenter__(self):
        if self.status == CREATED:
            await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _cancel_tasks(self) -> None:
        """Cancel the scheduler reader and fetches, except the task calling close()."""
        current = asyncio.current_task()
        tasks = [t for t in (self._reader, *self._background)
                 if t is not None and t is not current and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    def _registration(self) -> dict:
        """The handshake info that registers this worker with the scheduler."""
        return {"role": "worker", "address": self.address, "nthreads": self.nthreads,
                "name": self.name, "resources": self.resources, "versions": essential(),
                "dashboard": self.http.url if self.http is not None else None}

    # ------------------------------------------------------------------ stimuli in, instructions out

    def _stimulus(self, method, *args, **kwargs) -> bool:
        """Call one stimulus of the state machine and carry out its instructions.

        The last positional argument is the stimulus id (every stimulus takes it last).
        False if the machine refused the input (logged as a warning: the sender's
        fault) or failed (logged as a bug, with the stimulus; the next stimulus
        carries out what it left pending)."""
        try:
            instructions = method(*args, **kwargs)
        except InvalidStimulus as exc:
            logger.warning("worker %s refused %s (%s): %s", self.address, method.__name__,
                           args[-1], exc)
            return False
        except Exception:
            logger.exception("BUG: worker %s: stimulus %s (%s) %.300r failed", self.address,
                             method.__name__, args[-1], args[:-1])
            return False
        self._apply(instructions)
        return True

    def _sid(self, cause: str) -> str:
        """A fresh stimulus id for a stimulus of the shell's own making."""
        return f"{cause}-{next(self._sids)}"

    def _apply(self, instructions: list) -> None:
        """Carry out the machine's instructions, in order."""
        if self._plugin_watchers:  # a plugin's transition method
            self._plugin_host.notify_transitions()
        data = self.data
        discard = self._discard_data
        send = self._send
        tasks = self.state.tasks
        put = self._queue.put
        peek = self._peek_input
        for ins in instructions:
            kind = type(ins)
            if kind is SendMessage:
                send(ins[0])
            elif kind is StoreData:
                data[ins[0]] = ins[1]
            elif kind is Execute:  # to the threads, with its spec and its inputs' values
                ts = tasks[ins[0]]
                deps = ts.dependencies
                read_back = None
                if not deps:
                    inputs = {}
                elif peek is None:
                    inputs = {dep.key: data[dep.key] for dep in deps}
                else:
                    inputs = {dep.key: peek(dep.key) for dep in deps}
                    if any(v is ON_DISK for v in inputs.values()):
                        read_back = data
                put((ins[0], ts, ts.run_spec, inputs, ts.check, read_back))
            elif kind is ReleaseData:
                discard(ins[0])
            elif kind is Fetch:
                self._start_fetch(ins.peer, ins.keys)
            elif kind is ReportHeld:
                now = time.time()
                send(_finished_report(ins.key, data[ins.key], now, now))
            else:  # pragma: no cover - the machine makes only the kinds above
                raise TypeError(f"unknown instruction {ins!r}")

    # ------------------------------------------------------------------ scheduler stream

    def _attach(self, comm: Comm) -> None:
        role = comm.extra.get("role")
        if role != "scheduler":
            logger.warning("%s answered with role %r, not 'scheduler'", comm.peer_address, role)
        self._scheduler_comm = comm
        self._last_heard = self._last_tick = self._loop.time()

    async def _read_scheduler(self) -> None:
        """Read the scheduler's batches until told to close or the scheduler is gone."""
        try:
            while self.status == RUNNING_STATUS:
                try:
                    msgs = await self._scheduler_comm.read()
                except CommClosedError as exc:
                    if self.status != RUNNING_STATUS:
                        return
                    logger.warning("worker %s lost the scheduler at %s (%s); dropping all "
                                   "data and tasks, reconnecting for up to %.1fs", self.address,
                                   self.scheduler_address, exc, self.reconnect_timeout)
                    self._stimulus(self.state.scheduler_lost, self._sid("scheduler-lost"))
                    if not await self._reconnect():
                        break
                    continue
                self._last_heard = self._loop.time()
                self._handle_batch(msgs)
                del msgs  # not kept alive while waiting for the next batch
                if self._close_requested:
                    logger.info("worker %s: the scheduler asked it to close", self.address)
                    break
        except Exception:
            logger.exception("worker %s: unexpected error reading from the scheduler",
                             self.address)
        await self.close()

    async def _reconnect(self) -> bool:
        """Register again within ``reconnect_timeout``; False if that failed."""
        loop = self._loop
        deadline = loop.time() + self.reconnect_timeout
        delay = 0.05
        error: Exception | None = None
        while self.status == RUNNING_STATUS and loop.time() < deadline:
            try:
                comm = await connect(self.scheduler_address, self._registration(),
                                     timeout=max(deadline - loop.time(), 0.01),
                                     security=self.security)
            except (OSError, asyncio.TimeoutError) as exc:  # includes HandshakeError
                error = exc
                await asyncio.sleep(min(delay, max(deadline - loop.time(), 0)))
                delay = min(delay * 2, 1.0)
                continue
            if self.status != RUNNING_STATUS:
                comm.abort()
                return False
            self._attach(comm)
            logger.info("worker %s registered again with the scheduler at %s",
                        self.address, self.scheduler_address)
            return True
        logger.error("worker %s could not reach the scheduler at %s within %.1fs (%s); "
                     "shutting down", self.address, self.scheduler_address,
                     self.reconnect_timeout, error)
        return False

    def _handle_batch(self, msgs: list) -> None:
        """Apply one frame of scheduler messages: its compute-task and free-keys
        messages are one stimulus (one fetch plan, executions in priority order)."""
        tasks: list = []
        steals = False
        for msg in msgs:
            op = msg.get("op")
            if op == "compute-task" or op == "free-keys" or op == "acquire-replicas":
                tasks.append(msg)
            elif op == "steal-request":
                tasks.append(msg)
                steals = True
            elif op == "close":
                self._close_requested = True
            elif op == "story" or op == "logs":
                self._send(self._introspection_reply(msg))
            elif op == "plugin-add" or op == "plugin-remove":
                self._plugin_message(msg)
            elif op != "heartbeat":  # the scheduler's answer to ours: it is alive
                logger.warning("worker %s ignores unknown operation %r from the scheduler",
                               self.address, op)
        if steals:  # no thread may begin a job while the machine decides what to give
            with self._claim:
                self._scheduler_messages(tasks, self._begun)
        elif tasks:
            self._scheduler_messages(tasks)

    def _plugin_message(self, msg: dict) -> None:
        """``plugin-add {name, plugin, reqid?}`` / ``plugin-remove {name, reqid?}``: install
        or remove a worker plugin (plugins.py) and answer with the outcome; a plugin
        whose hooks are plain functions is set up before the tasks that follow it."""
        reqid = msg.get("reqid")
        try:
            name = check_plugin_name(msg.get("name"))
            data = msg.get("plugin")
            if msg["op"] == "plugin-add" and not isinstance(data, (bytes, memoryview)):
                raise TypeError("plugin-add needs the plugin's pickle as bytes")
        except TypeError as exc:
            self._send({"op": "reply", "reqid": reqid, "error": str(exc)})
            return
        if msg["op"] == "plugin-add":
            outcome = self._plugin_host.add(name, data)
        else:
            outcome = self._plugin_host.remove(name)
        if not inspect.isawaitable(outcome):
            self._send({"op": "reply", "reqid": reqid, "result": outcome})
            return

        async def answer_when_done():
            self._send({"op": "reply", "reqid": reqid, "result": await outcome})

        task = self._loop.create_task(answer_when_done())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _introspection_reply(self, msg: dict) -> dict:
        """The answer to the scheduler's ``story {keys, reqid}`` (this worker's transitions
        of the keys) or ``logs {n, reqid}`` (its last n log lines)."""
        reply = {"op": "reply", "reqid": msg.get("reqid")}
        try:
            if msg["op"] == "story":
                keys = msg.get("keys")
                if not isinstance(keys, (list, tuple)):
                    raise ValueError("story needs a list of keys")
                hash(tuple(keys))
                reply["result"] = self.state.story(*keys)
            else:
                reply["result"] = logs.recent_lines(logs.check_line_count(msg.get("n")))
        except (TypeError, ValueError) as exc:
            reply["error"] = f"{type(exc).__name__}: {exc}"
        return reply

    def _scheduler_messages(self, msgs: list, begun=None) -> None:
        """One stimulus for the task messages of a frame; if the machine refuses the
        frame, one per message, so only the bad ones are dropped (and logged). ``begun``:
        the keys whose executions began (with steal requests in the frame)."""
        for msg in msgs:
            resources = msg.get("resources")
            if type(resources) is dict and resources:
                self._check_resources(msg.get("key"), resources, msg.get("stimulus_id"))
        sid = msgs[-1].get("stimulus_id")
        if not isinstance(sid, str):
            sid = "scheduler"
        try:
            instructions = self.state.scheduler_messages(msgs, sid, begun=begun)
        except InvalidStimulus:
            for msg in msgs:
                self._stimulus(self.state.scheduler_messages, [msg], sid, begun=begun)
            return
        except Exception:
            logger.exception("BUG: worker %s: stimulus scheduler_messages %s failed",
                             self.address, sid)
            return
        self._apply(instructions)

    def _check_resources(self, key, resources: dict, stimulus_id) -> None:
        short = {name: qty for name, qty in resources.items()
                 if not isinstance(qty, (int, float)) or self.resources.get(name, 0) < qty}
        if short:
            logger.warning("worker %s: task %s needs resources %s but the worker has only %s;"
                           " it will never run here (%s)", self.address, bounded_repr(key),
                           short, self.resources, stimulus_id)

    def _send(self, msg: dict) -> None:
        """Queue a message on the scheduler stream; dropped if the stream is down."""
        comm = self._scheduler_comm
        if comm is not None:
            try:
                comm.send(msg)
            except CommClosedError:
                pass

    def _heartbeat(self) -> None:
        now = self._loop.time()
        if now - self._last_tick > 2 * self.heartbeat_interval + 1.0:
            # This loop was not running (a task held the GIL, the process was stopped):
            # the scheduler's answers may be waiting unread. Silence counts from now.
            self._last_heard = max(self._last_heard, now)
        self._last_tick = now
        silent = now - self._last_heard
        comm = self._scheduler_comm
        if silent > self.scheduler_timeout and comm is not None and not comm.closed:
            # A stopped scheduler (a hung machine) keeps its connections open: only its
            # silence tells. Aborting makes the reader take the scheduler-lost path.
            logger.warning("worker %s: the scheduler at %s has not answered for %.1fs; "
                           "treating it as lost", self.address, self.scheduler_address, silent)
            comm.abort()
        self._send({"op": "heartbeat", **self.memory_figures(),
                    "cpu": self._process.cpu_percent(None) / 100})
        self._heartbeat_handle = self._loop.call_later(self.heartbeat_interval, self._heartbeat)

    # ------------------------------------------------------------------ execution

    def _start_threads(self) -> None:
        for i in range(self.nthreads):
            thread = threading.Thread(target=self._execute_jobs, daemon=True,
                                      name=f"dcore-worker-{i}")
            thread.start()
            self._threads.append(thread)

    def _execute_jobs(self) -> None:
        """An executor thread: run queued jobs, append outcomes, wake the loop per burst."""
        get = self._queue.get
        append = self._outcomes.append
        loop = self._loop
        drain = self._drain_outcomes
        gate = self._gate
        stopping = self._is_stopping
        while True:
            job = get()
            if job is None:
                return
            if gate is not None and not gate.is_open:
                gate.wait(stopping)
            extra = False
            with self._claim:
                begin = not self._stopping and job[1].state == _EXECUTING
                if begin:
                    self._begun.add(job[0])
            if not begin:
                append((job[0], _SKIPPED, None, None))  # cancelled before it began
            else:
                enter_task(self, job[0])
                try:
                    outcome = _run_job(job)
                    append(outcome)
                    if gate is not None and outcome[1] is _SUCCESS:
                        gate.produced(outcome[3]["nbytes"])
                    del outcome
                finally:
                    extra = leave_task()  # seceded: another thread took this one's place
            del job
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    loop.call_soon_threadsafe(drain)
                except RuntimeError:  # the loop is closed: nobody wants the outcome
                    return
            if extra or self._retire_one():
                return

    def _is_stopping(self) -> bool:
        return self._stopping

    def _retire_one(self) -> bool:
        """True for one executor thread per rejoined task: it leaves the pool."""
        if not self._retiring:
            return False
        with self._threads_lock:
            if self._retiring:
                self._retiring -= 1
                return True
        return False

    # ------------------------------------------------------------------ tasks that launch tasks

    def task_seceded(self, key) -> None:
        """From a task's thread (task_context.secede): start an executor thread in its
        place and tell the scheduler the task no longer holds a thread."""
        with self._threads_lock:
            thread = threading.Thread(target=self._execute_jobs, daemon=True,
                                      name=f"dcore-worker-{len(self._threads)}")
            self._threads.append(thread)
        thread.start()
        self._loop.call_soon_threadsafe(self._send, {"op": "long-running", "key": key})

    def task_rejoined(self) -> None:
        """From a task's thread (task_context.rejoin): it is an executor thread again,
        so one other executor thread retires after its current task."""
        with self._threads_lock:
            self._retiring += 1

    def task_client(self, timeout: float | None = None):
        """The Client that tasks on this worker share (client/worker_client.get_client)."""
        with self._threads_lock:
            if self._task_client is None or self._task_client.status == "closed":
                self._task_client = make_client(
                    self.scheduler_address, security=self.security, set_as_default=False,
                    timeout=timeout or self.connect_timeout, name=f"worker-{self.address}")
            return self._task_client

    def _drain_outcomes(self) -> None:
        """On the loop: the outcomes the threads produced, as one stimulus."""
        # cleared before draining: an outcome appended from now on schedules a new call
        self._wake_pending = False
        outcomes = self._outcomes
        begun = self._begun
        if self.status != RUNNING_STATUS:
            while outcomes:
                begun.discard(outcomes.popleft()[0])
            return
        burst = []
        while outcomes:
            outcome = outcomes.popleft()
            begun.discard(outcome[0])
            burst.append(outcome)
        sid = f"executor-{next(self._bursts)}"
        try:
            instructions = self.state.executions_done(burst, sid)
        except InvalidStimulus:  # one by one, so that only the bad one is lost (logged)
            for outcome in burst:
                self._stimulus(self.state.executions_done, [outcome], sid)
            return
        except Exception:
            logger.exception("BUG: worker %s: stimulus executions_done %s failed",
                             self.address, sid)
            return
        del burst
        self._apply(instructions)

    async def _stop_threads(self) -> None:
        """Tell the threads to stop; wait briefly for those busy with a task."""
        self._stopping = True
        if self._gate is not None:
            self._gate.release()
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + THREAD_JOIN_TIMEOUT
        while any(t.is_alive() for t in self._threads) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        busy = sum(t.is_alive() for t in self._threads)
        if busy:
            logger.warning("worker %s: %d executor thread(s) still running a task; left "
                           "behind as daemon threads", self.address, busy)

    # ------------------------------------------------------------------ fetching from peers

    def _start_fetch(self, peer: str, keys: list) -> None:
        task = self._loop.create_task(self._fetch_from(peer, keys))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _fetch_from(self, peer: str, keys: list) -> None:
        """One get-data request to one peer, every step within ``transfer_timeout``;
        then its outcome becomes a stimulus."""
        comm = None
        deadline = None
        failure: BaseException | None = None
        try:
            comm = await self._peer_comm(peer)
            deadline = _Deadline(self._loop, comm, self.transfer_timeout)
            try:
                deadline.arm()
                await comm.write([{"op": "get-data", "keys": keys, "parts": True}])
                frames, missing, nbytes, errors = await self._read_data_reply(comm, deadline)
            except CommClosedError:
                deadline.check()  # a timeout aborted the connection: say so
                raise
            deadline.cancel()
            self._peer_pool.give_back(peer, comm, keep=self.status == RUNNING_STATUS)
            comm = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means: try another holder
            failure = exc
        finally:
            if deadline is not None:
                deadline.cancel()
            if comm is not None:  # a failed exchange leaves the connection unusable
                comm.abort()
        if self.status != RUNNING_STATUS:
            return
        if failure is not None:
            sid = self._sid(f"fetch-failed-{peer}")
            logger.warning("worker %s could not fetch %d key(s) from %s (%s): %s; keys %s",
                           self.address, len(keys), peer, sid, _describe(failure),
                           bounded_repr(keys, 200))
            if _refused(failure):
                self._stimulus(self.state.peer_gone, peer, self._sid(f"peer-gone-{peer}"))
            self._stimulus(self.state.fetch_failed, peer, keys, sid)
            return
        sid = self._sid(f"fetched-{peer}")
        values: dict = {}
        for key, parts in frames.items():
            try:
                values[key] = loads_data(parts)
            except Exception as exc:  # noqa: BLE001 - this key only: try another holder
                logger.warning("worker %s cannot deserialize %s from %s (%s): %s",
                               self.address, bounded_repr(key), peer, sid, _describe(exc))
        missing = [key for key in keys if key not in values]
        self._stimulus(self.state.fetch_done, peer, values, missing, sid,
                       nbytes=nbytes or None, errors=errors or None)

    async def _read_data_reply(self, comm: Comm, deadline: _Deadline) -> tuple:
        """The answer to a get-data that asked for parts: ``(frames by key, missing,
        nbytes, errors)``. Each frame must arrive within ``transfer_timeout``."""
        deadline.arm()
        reply = (await comm.read())[0]
        if reply.get("op") != "data" or type(reply.get("data")) is not dict:
            raise _BadRequest(f"get-data answered with {reply.get('op')!r}")
        frames = dict(reply["data"])
        parts = reply.get("parts") or {}
        if type(parts) is not dict:
            raise _BadRequest("get-data answered with malformed parts")
        for key, lengths in parts.items():
            buffers = []
            for length in lengths:
                buffer = bytearray()  # grows as parts arrive, never to the announced size
                while len(buffer) < length:
                    deadline.arm()
                    part = (await comm.read())[0]
                    if part.get("op") != "data-part" or part.get("key") != key:
                        raise _BadRequest(f"expected a part of {key!r}, got {part.get('op')!r}")
                    buffer += part["blob"]
                    if len(buffer) > length:
                        raise _BadRequest(f"the parts of {key!r} exceed {length} bytes")
                buffers.append(buffer)
            frames[key] = buffers
        nbytes = reply.get("nbytes")
        errors = reply.get("errors")
        return (frames, reply.get("missing") or (),
                nbytes if type(nbytes) is dict else None,
                errors if type(errors) is dict else None)

    async def _peer_comm(self, peer: str) -> Comm:
        return await self._peer_pool.connection(
            peer, {"role": "worker", "address": self.address},
            timeout=min(self.connect_timeout, self.transfer_timeout),
            max_frame_bytes=self.peer_max_frame_bytes)

    # ------------------------------------------------------------------ serving peers

    async def _serve_peer(self, comm: Comm) -> None:
        """Answer a peer's requests, one reply frame per request frame (then the parts
        of large values, for a get-data that asked for them)."""
        self._served.add(comm)
        timeout = self.transfer_timeout
        deadline = _Deadline(self._loop, comm, timeout)
        try:
            while True:
                msgs = await comm.read()  # an idle connection may wait: the peer pools it
                replies, parts = [], []
                for msg in msgs:
                    if msg.get("op") == "run":
                        replies.append(await self._run_function(comm, msg))
                        continue
                    reply, more = self._answer(comm, msg)
                    replies.append(reply)
                    parts.extend(more)
                deadline.arm()  # a peer that takes no data for this long is dropped
                await comm.write(replies)
                del replies
                for msg in _parts(parts, self.transfer_part_bytes):
                    deadline.arm()
                    await comm.write([msg])
                deadline.cancel()
                del parts
        except ProtocolError as exc:
            logger.warning("worker %s: closing connection from %s: %s",
                           self.address, comm.peer_address, exc)
        except CommClosedError:
            if deadline.expired:
                logger.warning("worker %s: %s took no data for %.1fs; closing the connection",
                               self.address, comm.peer_address, timeout)
        except Exception as exc:  # noqa: BLE001 - a bad request closes this connection only
            logger.warning("worker %s: closing connection from %s after a bad request: %s",
                           self.address, comm.peer_address, _describe(exc))
        finally:
            deadline.cancel()
            self._served.discard(comm)
            comm.abort()

    def _answer(self, comm: Comm, msg: dict) -> tuple:
        """``(reply, parts to send after it)`` for one request."""
        op = msg["op"]
        if op == "get-data":
            return self._get_data(msg)
        if op == "put-data":
            if comm.extra.get("role") != "client":  # workers only ever read from peers
                raise _BadRequest(f"put-data from a {comm.extra.get('role')!r} connection")
            return self._put_data(msg), ()
        if op == "ping":
            return {"op": "pong"}, ()
        raise _BadRequest(f"unknown operation {op!r}")

    async def _run_function(self, comm: Comm, msg: dict) -> dict:
        """``Client.run``: call the client's function here (remote_run.py)."""
        if comm.extra.get("role") != "client":
            raise _BadRequest(f"run from a {comm.extra.get('role')!r} connection")
        payload = msg.get("function")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise _BadRequest("run needs the pickled function")
        return await run_packed_call(payload, self)

    def _get_data(self, msg: dict) -> tuple:
        """The answer to get-data: ``({"op": "data", "data", "missing", ...}, parts)``.

        With ``"parts": true`` (workers), values larger than ``transfer_part_bytes`` are
        announced in ``parts`` (``{key: [frame lengths]}``) and follow as ``data-part``
        frames; without it (clients), the answer is one frame, and a value that would
        make it larger than ``single_frame_reply_bytes`` is reported missing with the
        reason in ``errors``. A value that cannot be serialized is reported missing with
        the reason, and dropped (``serve_failed``)."""
        keys = msg.get("keys")
        if not isinstance(keys, (list, tuple)):
            raise _BadRequest("'get-data' needs a list of 'keys'")
        in_parts = msg.get("parts") is True
        budget = self.transfer_part_bytes if in_parts else self.single_frame_reply_bytes
        data, missing, parts, announced, nbytes = {}, [], [], {}, {}
        errors: dict = {}
        failed: dict = {}
        tasks = self.state.tasks
        inline = 0
        for key in keys:
            try:
                value = self.data[key]
            except (KeyError, TypeError):
                missing.append(key)
                continue
            try:
                frames = dumps_data(value)
            except Exception as exc:  # noqa: BLE001 - the value cannot travel: say why
                missing.append(key)
                errors[key] = failed[key] = _cannot_travel_text(key, value, exc)
                continue
            size = sum(memoryview(frame).nbytes for frame in frames)
            ts = tasks.get(key)
            if ts is not None and ts.nbytes >= 0:
                nbytes[key] = ts.nbytes
            if inline + size <= budget:
                data[key] = [Blob(frame) for frame in frames]
                inline += size
            elif in_parts:
                announced[key] = [memoryview(frame).nbytes for frame in frames]
                parts.append((key, frames))
            else:
                missing.append(key)
                errors[key] = (f"{bounded_repr(key)} ({type(value).__name__}, {size} bytes "
                               f"serialized) does not fit in one frame of at most "
                               f"{self.single_frame_reply_bytes} bytes: ask for it alone, "
                               f"or in parts")
        if failed:
            sid = self._sid("serve-failed")
            for key, text in failed.items():
                logger.warning("worker %s (%s): %s", self.address, sid, text)
            self._stimulus(self.state.serve_failed, failed, sid)
        reply = {"op": "data", "data": data, "missing": missing}
        if nbytes:
            reply["nbytes"] = nbytes
        if errors:
            reply["errors"] = errors
        if announced:
            reply["parts"] = announced
        return reply, parts

    def _put_data(self, msg: dict) -> dict:
        items = msg.get("data")
        if not isinstance(items, dict):
            raise _BadRequest("'put-data' needs a map 'data' of key -> frames")
        values = {key: loads_data(frames) for key, frames in items.items()}
        if not self._stimulus(self.state.data_put, values, self._sid("put-data")):
            raise _BadRequest("put-data refused")
        return {"op": "ok"}


# ---------------------------------------------------------------------- helpers


class _Deadline:
    """Aborts a connection when one step of a transfer takes longer than ``timeout``:
    ``arm()`` before each step. A timer handle, not a Task per step (``wait_for`` made
    one per frame: it doubled a worker's CPU per transferred key)."""

    __slots__ = ("comm", "expired", "handle", "loop", "timeout")

    def __init__(self, loop, comm: Comm, timeout: float) -> None:
        self.loop = loop
        self.comm = comm
        self.timeout = timeout
        self.handle = None
        self.expired = False

    def arm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.handle = self.loop.call_later(self.timeout, self._expire)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def check(self) -> None:
        """Raise TimeoutError if the deadline aborted the connection."""
        if self.expired:
            raise TimeoutError(f"no progress for {self.timeout}s: the peer does not answer")

    def _expire(self) -> None:
        self.handle = None
        self.expired = True
        self.comm.abort()


def _parts(parts: list, part_bytes: int):
    """The ``data-part`` messages that carry the frames of large values, in order."""
    for key, frames in parts:
        for frame in frames:
            view = memoryview(frame).cast("B")
            for start in range(0, view.nbytes, part_bytes):
                yield {"op": "data-part", "key": key, "blob": Blob(view[start:start + part_bytes])}


def _run_job(job: tuple) -> tuple:
    """On an executor thread: run one job; ``(key, kind, value, report)``."""
    key, _, spec, inputs, check, read_back = job
    if read_back is not None:  # inputs spilled since the task was queued: not task time
        for name, value in inputs.items():
            if value is ON_DISK:
                try:
                    inputs[name] = read_back[name]
                except Exception as exc:  # noqa: BLE001 - a failing disk: the task says so
                    now = time.time()
                    error = RuntimeError(
                        f"could not read input {name!r} of {key!r} back from the worker's "
                        f"spill directory: {type(exc).__name__}: {exc}")
                    return key, _FAILURE, None, _erred_report(key, error, now, now)
    start = time.time()
    try:
        value = loads_spec(spec)(inputs)
    except BaseException as exc:  # noqa: BLE001 - any failure of user code is the task's
        stop = time.time()
        return key, _FAILURE, None, _erred_report(key, exc, start, stop)
    stop = time.time()
    del job, inputs, spec  # release the inputs as soon as possible
    if check:  # its result failed to travel before: it must show that it serializes now
        try:
            dumps_data(value)
        except Exception as exc:  # noqa: BLE001
            error = ResultCannotTravel(_cannot_travel_text(key, value, exc))
            return key, _FAILURE, None, _erred_report(key, error, start, stop)
    return key, _SUCCESS, value, _finished_report(key, value, start, stop)


def _finished_report(key, value, start: float, stop: float) -> dict:
    try:
        nbytes = min(max(int(sizeof(value)), 0), MAX_REPORTED_NBYTES)
    except Exception:  # noqa: BLE001 - a broken nbytes property must not lose the result
        nbytes = 64
    report = {"op": "task-finished", "key": key, "nbytes": nbytes,
              "type": type(value).__name__, "start": start, "stop": stop}
    inline = dumps_inline_result(value)
    if inline is not None:
        report["data"] = inline
    return report


def _erred_report(key, exc: BaseException, start: float, stop: float) -> dict:
    try:
        exception, traceback, text = dumps_error(exc)
    except Exception:  # noqa: BLE001 - e.g. an exception whose __str__ raises
        exception, traceback, text = None, b"", f"{type(exc).__name__} (unprintable)"
    return {"op": "task-erred", "key": key, "exception": exception, "traceback": traceback,
            "text": text, "start": start, "stop": stop}


def _cannot_travel_text(key, value, exc: BaseException) -> str:
    """Why the result of ``key`` cannot travel: its key, type, size and the cause."""
    try:
        size = f"{min(max(int(sizeof(value)), 0), MAX_REPORTED_NBYTES)} bytes"
    except Exception:  # noqa: BLE001
        size = "size unknown"
    try:
        cause = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        cause = type(exc).__name__
    return (f"the result of {bounded_repr(key)} ({type(value).__module__}."
            f"{type(value).__qualname__}, {size}) cannot be serialized to send it to "
            f"another worker or a client: {cause[:500]}")


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _sizeof_quietly(value) -> int:
    try:
        return max(int(sizeof(value)), 0)
    except Exception:  # noqa: BLE001 - a broken __sizeof__ must not break storing
        return 64


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _refused(exc: BaseException) -> bool:
    """Whether a failed transfer shows the peer is gone (it refused the connection)."""
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        exc = exc.__cause__
    return False


def _join_address(scheme: str, host: str, port: int) -> str:
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _contact_host(host: str, scheduler_address: str) -> str:
    """The host peers should dial: ``host``, or for a wildcard, the interface that
    routes to the scheduler."""
    if host not in ("0.0.0.0", "::"):
        return host
    family = socket.AF_INET6 if host == "::" else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((parse_address(scheduler_address)[1], 9))  # sends nothing
            return probe.getsockname()[0]
    except OSError:
        return "::1" if family == socket.AF_INET6 else "127.0.0.1"
