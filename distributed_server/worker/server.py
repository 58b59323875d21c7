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
- Runs tasks on ``nthreads`` daemon executor threads (executor.py): ``Execute`` hands
  the task's spec and its inputs' values to them; each burst of outcomes comes back as
  one ``executions_done`` stimulus (a task cancelled before it began is skipped: the
  core says so on the task). Reports leave through the batched ``Comm.send``.
- Fetches inputs from peer workers (``Fetch``: one ``get-data`` per peer and burst) and
  serves peers and clients on its own listener (``get-data``, ``put-data``, ``run``,
  ``ping``: `PeerServer`, peer_server.py), every step within ``transfer_timeout``, large
  values in parts (transfers.py); their outcomes become stimuli (``fetch_done``,
  ``fetch_failed``, ``peer_gone``, ``serve_failed``, ``data_put``).
- Sends a heartbeat every ``heartbeat_interval``, with its memory figures; the scheduler
  answers each (in a cluster of hundreds of workers, asking for slower beats: the worker
  then beats at the slower of the two intervals). A scheduler silent for
  ``scheduler_timeout`` (60 s) counts as lost, as does a closed connection. On losing the
  scheduler it drops all data and tasks (``scheduler_lost``: the scheduler will treat it
  as a new worker) and tries to register again for ``reconnect_timeout`` seconds; then it
  shuts down.

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
from ..comm import DEFAULT_MAX_FRAME_BYTES, Comm, CommClosedError, connect, listen, parse_address
from ..comm.peer_pool import PeerPool
from ..plugins import WorkerPluginHost
from ..security import Security, check_listen_security
from ..versions import essential
from .executor import Executor
from .memory import (
    MEMORY_LIMIT_ENV,
    ON_DISK,
    ExecutionGate,
    MemoryMonitor,
    MemoryWatch,
    SpillBuffer,
    check_fractions,
)
from .peer_server import PeerServer
from .reports import ResultCannotTravel, finished_report, sizeof_quietly
from .scheduler_requests import introspection_reply, plugin_reply
from .spec_parts import SpecParts
from .task_context import make_client
from .transfers import (
    MAX_IDLE_PEER_COMMS,
    SINGLE_FRAME_REPLY_BYTES,
    TRANSFER_PART_BYTES,
    TRANSFER_TIMEOUT_ENV,
    decode_values,
    describe,
    fetch_data,
    refused,
)

__all__ = ["ResultCannotTravel", "Worker"]

logger = logging.getLogger("distributed_server.worker")

# Worker status.
CREATED, RUNNING_STATUS, CLOSING, CLOSED = "created", "running", "closing", "closed"

#: Most threads a worker may have (the scheduler counts them in 32 bits).
MAX_THREADS = 2**31 - 1
#: Seconds of silence (the scheduler answers every heartbeat) after which a worker treats
#: the scheduler as lost: it drops its data and tries to register again.
SCHEDULER_TIMEOUT = 60.0


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
        self._advised_interval: float | None = None  # the scheduler's, in a big cluster
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

        #: The executor threads (executor.py): jobs in, bursts of outcomes out.
        self._executor = Executor(self, nthreads, self._executions_done)
        #: Run specs pickled together by a client, as the scheduler sent them.
        self.spec_parts = SpecParts()
        self._task_client = None  # the Client of tasks that launch tasks, made on demand
        self._client_lock = threading.Lock()  # task threads may ask for it at once
        self._bursts = itertools.count()
        self._sids = itertools.count()  # numbers the shell's stimulus ids

        self._peer_pool = PeerPool(self.security, MAX_IDLE_PEER_COMMS)  # fetches' comms
        #: answers peers and clients on the listener (get-data, put-data, run, ping)
        self.peers = PeerServer(self, self._stimulus, self._sid)
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
        self._memory_watch: MemoryWatch | None = None
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
                                      self.peers.serve, {"role": "worker"}, self.security)
        bound_port = self._listener.port
        self.address = self.contact_address or _join_address(
            scheme, _contact_host(self.host, self.scheduler_address), bound_port)
        self._listener.set_handshake_info(address=self.address)  # known once bound
        logs.claim_address("worker", self.address)
        self.state = WorkerCore(self.address, self.nthreads, resources=self.resources or None,
                                validate=self.validate, clock=time.time,
                                seed=hash(self.address) & 0xFFFFFFFF)
        self._start_memory_management()
        self._executor.start(self._loop, self._gate)
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
        if self._heartbeat_handle is not None:
            self._heartbeat_handle.cancel()
        if self._memory_watch is not None:
            self._memory_watch.stop()
        await self._cancel_tasks()
        if self._listener is not None:
            await self._listener.stop()
        if self.http is not None:
            await self.http.stop()
        if self._scheduler_comm is not None:
            await self._scheduler_comm.close(timeout=1.0)
        self.peers.abort()
        self._peer_pool.close()
        busy = await self._executor.stop()
        if busy:
            logger.warning("worker %s: %d executor thread(s) still running a task; left "
                           "behind as daemon threads", self.address, busy)
        if self._task_client is not None:
            await asyncio.to_thread(self._task_client.close)
        self._stimulus(self.state.scheduler_lost, self._sid("worker-closing"))
        await self._plugin_host.close()
        if isinstance(self.data, SpillBuffer):
            self.data.close()
        self.data.clear()
        self.spec_parts.clear()
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
        MONITOR_INTERVAL seconds that spills and pauses (memory.py)."""
        if not self.memory_limit:
            return
        buffer = None
        if self.memory_target_fraction or self.memory_spill_fraction:
            target = (self.memory_target_fraction or 1.0) * self.memory_limit
            buffer = SpillBuffer(target, self._weight, self.local_directory)
            self.data = buffer
            self._discard_data = buffer.discard
            self._peek_input = buffer.in_memory
        self._memory_watch = MemoryWatch(
            self._loop, self.memory_limit, buffer, self.memory_target_fraction,
            self.memory_spill_fraction, self.memory_pause_fraction, on_pause=self.pause,
            on_resume=self.unpause, running=self._running,
            busy=lambda: bool(self._executor.outcomes), name=self.address)
        self.memory = self._memory_watch.monitor
        self._gate = self._memory_watch.gate

    def _pop_data(self, key) -> None:
        self.data.pop(key, None)

    def _weight(self, key, value) -> int:
        """A result's size for the spill buffer: what the machine knows, else sizeof."""
        ts = self.state.tasks.get(key)
        if ts is not None and ts.nbytes >= 0:
            return ts.nbytes
        return sizeof_quietly(value)

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
                "pid": os.getpid(), "memory_limit": self.memory_limit,
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
        put = self._executor.put
        resolve = self.spec_parts.resolve
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
                put((ins[0], ts, resolve(ts.run_spec), inputs, ts.check, read_back))
            elif kind is ReleaseData:
                discard(ins[0])
            elif kind is Fetch:
                self._start_fetch(ins.peer, ins.keys)
            elif kind is ReportHeld:
                now = time.time()
                send(finished_report(ins.key, data[ins.key], now, now))
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
                    self.spec_parts.clear()  # the next scheduler sends what it needs
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
            elif op == "spec-part":
                self._spec_part(msg)
            elif op == "free-spec-parts":
                self.spec_parts.free(msg.get("parts") or ())
            elif op == "close":
                self._close_requested = True
            elif op == "story" or op == "logs":
                self._send(introspection_reply(self.state, msg))
            elif op == "plugin-add" or op == "plugin-remove":
                self._plugin_message(msg)
            elif op == "heartbeat":  # the scheduler's answer to ours: it is alive
                self._heartbeat_advised(msg.get("interval"))
            else:
                logger.warning("worker %s ignores unknown operation %r from the scheduler",
                               self.address, op)
        if steals:  # no thread may begin a job while the machine decides what to give
            with self._executor.claim:
                self._scheduler_messages(tasks, self._executor.begun)
        elif tasks:
            self._scheduler_messages(tasks)

    def _spec_part(self, msg: dict) -> None:
        try:
            self.spec_parts.add(msg.get("part"), msg.get("blob"))
        except ValueError as exc:
            logger.warning("worker %s ignores a malformed spec part: %s", self.address, exc)

    def _heartbeat_advised(self, interval) -> None:
        """The scheduler of a big cluster asks for slower heartbeats (``interval``
        seconds, or None): beat at that or at our own interval, whichever is slower, but
        at least 4 times per ``scheduler_timeout`` (the scheduler's answers to them are
        what tells this worker that it is alive)."""
        if interval is None:
            self._advised_interval = None
        elif type(interval) in (int, float) and 0 < interval <= 60:
            self._advised_interval = min(float(interval), self.scheduler_timeout / 4)

    def _plugin_message(self, msg: dict) -> None:
        """Install or remove a worker plugin and answer (scheduler_requests.py); a plugin
        whose hooks are coroutines is answered once they are done."""
        reply = plugin_reply(self._plugin_host, msg)
        if not inspect.isawaitable(reply):
            self._send(reply)
            return

        async def answer_when_done():
            self._send(await reply)

        task = self._loop.create_task(answer_when_done())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
        interval = max(self.heartbeat_interval, self._advised_interval or 0.0)
        if now - self._last_tick > 2 * interval + 1.0:
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
        self._heartbeat_handle = self._loop.call_later(interval, self._heartbeat)

    # ------------------------------------------------------------------ tasks that launch tasks

    def task_seceded(self, key) -> None:
        """From a task's thread (task_context.secede): start an executor thread in its
        place and tell the scheduler the task no longer holds a thread."""
        self._executor.seceded()
        self._loop.call_soon_threadsafe(self._send, {"op": "long-running", "key": key})

    def task_rejoined(self) -> None:
        """From a task's thread (task_context.rejoin): it is an executor thread again,
        so one other executor thread retires after its current task."""
        self._executor.rejoined()

    def task_client(self, timeout: float | None = None):
        """The Client that tasks on this worker share (client/worker_client.get_client)."""
        with self._client_lock:
            if self._task_client is None or self._task_client.status == "closed":
                self._task_client = make_client(
                    self.scheduler_address, security=self.security, set_as_default=False,
                    timeout=timeout or self.connect_timeout, name=f"worker-{self.address}")
            return self._task_client

    # ------------------------------------------------------------------ execution outcomes

    def _executions_done(self, burst: list) -> None:
        """On the loop: a burst of outcomes from the executor threads, as one stimulus."""
        if self.status != RUNNING_STATUS:
            return
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

    # ------------------------------------------------------------------ fetching from peers

    def _start_fetch(self, peer: str, keys: list) -> None:
        task = self._loop.create_task(self._fetch_from(peer, keys))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _fetch_from(self, peer: str, keys: list) -> None:
        """One get-data request to one peer (transfers.py); then its outcome becomes a
        stimulus."""
        failure: BaseException | None = None
        try:
            frames, missing, nbytes, errors = await fetch_data(
                self._peer_pool, peer, {"role": "worker", "address": self.address}, keys,
                connect_timeout=self.connect_timeout, transfer_timeout=self.transfer_timeout,
                max_frame_bytes=self.peer_max_frame_bytes, keep=self._running)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means: try another holder
            failure = exc
        if self.status != RUNNING_STATUS:
            return
        if failure is not None:
            sid = self._sid(f"fetch-failed-{peer}")
            logger.warning("worker %s could not fetch %d key(s) from %s (%s): %s; keys %s",
                           self.address, len(keys), peer, sid, describe(failure),
                           bounded_repr(keys, 200))
            if refused(failure):
                self._stimulus(self.state.peer_gone, peer, self._sid(f"peer-gone-{peer}"))
            self._stimulus(self.state.fetch_failed, peer, keys, sid)
            return
        sid = self._sid(f"fetched-{peer}")
        values, undecodable = decode_values(frames)
        for key, exc in undecodable.items():
            logger.warning("worker %s cannot deserialize %s from %s (%s): %s",
                           self.address, bounded_repr(key), peer, sid, describe(exc))
        missing = [key for key in keys if key not in values]
        self._stimulus(self.state.fetch_done, peer, values, missing, sid,
                       nbytes=nbytes or None, errors=errors or None)

    def _running(self) -> bool:
        return self.status == RUNNING_STATUS


# ---------------------------------------------------------------------- helpers


def _rss() -> int:
    return psutil.Process().memory_info().rss


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
