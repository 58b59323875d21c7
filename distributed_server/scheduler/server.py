"""The Scheduler server: a `SchedulerState` connected to workers and clients.

It listens for connections, turns each incoming message into one stimulus of the state
machine, and sends what the stimulus returns. It never writes into the state itself,
never unpickles anything (run specs, results and errors pass through as bytes), and
never runs user code. A worker's batch of finished-task reports becomes one stimulus.

Only peers holding the cluster's credentials (`Security`: a token, TLS certificates)
get past the handshake. A malformed message closes the connection it came on, with a
logged error; a well-formed message the state machine refuses (bad input, or a key the
peer may not touch) changes nothing, is logged, and costs a client an ``error`` reply,
never its connection; everyone else keeps being served. A stimulus that raises after it
began changing state is a bug: it is logged at ERROR with its stimulus id and the state
is validated. A worker whose connection closes, or that stays silent past
``worker_ttl``, is removed and its work rescheduled; a client silent past
``client_idle_timeout`` is disconnected.

The services the server hosts are objects of their own modules; each registers the client
ops it answers (its module's ``OPS``) in the server's table of client handlers:

- client_keys.py: `ClientKeyRequests`, a client's messages about the keys it submitted
  (``release-keys``, ``desire-keys``, ``cancel``, ``retry``, ``who-has``, ``has-what``,
  ``fire-and-forget``; huge releases and cancels in slices);
- restart.py: `RestartService`, ``Client.restart`` through the nannies (the role
  ``"nanny"``, the nanny registry ``nanny_comms`` / ``nanny_workers``, the count of
  worker registrations a restart waits on);
- coordination_service.py: `CoordinationService`, the glue between the client streams
  and the coordination primitives' state (``coordination``, `Coordination`) and the
  published datasets (``datasets``): their messages, the keys the pseudo-client
  ``coordination`` wants for them, their timer, a client's departure;
- retirement.py: `ReplicaMover`, ``retire-workers``, ``replicate`` and ``rebalance``,
  through the core's replica stimuli (workers' ``add-keys`` and ``acquire-failed``
  answers become ``replicas_added`` / ``replicas_failed``);
- history.py: `HistoryRequests`, ``story``, ``scheduler-logs``, ``worker-logs`` and
  ``task-stream``, asking the workers through worker_requests.py's `WorkerRequests`;
- plugins.py: scheduler plugins' hooks and the worker plugins' registry.

This module keeps the connections (handshakes by role, read loops, departures), the
stimulus runner and the sending of what stimuli return, the workers' streams (reports,
heartbeats, work stealing), a graph's intake (``update-graph``, ``update-data``), the
worker plugins' requests, and what a client reads of the scheduler (``identity``,
``versions``, `counters`). What the handlers share (`MessageError`, sending quietly, a
peer's read loop) is in streams.py; the checks of a worker's handshake and heartbeat
figures in worker_info.py.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from distributed_core import COMPILED, InvalidStimulus, SchedulerState, __version__, bounded_repr

from .. import config, logs
from ..comm import Blob, CommClosedError, listen
from ..diagnostics.heap_trim import HeapTrimmer
from ..diagnostics.loop_lag import LoopLagMonitor
from ..diagnostics.task_stream import TaskStream
from ..security import Security, check_listen_security
from ..versions import essential, mismatches, versions
from .adaptive import OPS as ADAPTIVE_OPS
from .adaptive import AdaptiveRequests
from .client_keys import FIRE_AND_FORGET, ClientKeyRequests
from .client_keys import OPS as CLIENT_KEY_OPS
from .coordination import COORDINATION_CLIENT, CoordinationLimits
from .coordination_service import OPS as COORDINATION_OPS
from .coordination_service import CoordinationService
from .history import OPS as HISTORY_OPS
from .history import HistoryRequests
from .plugins import PluginRequestError, SchedulerPluginHooks, WorkerPluginRegistry
from .restart import OPS as RESTART_OPS
from .restart import RestartService
from .retirement import OPS as REPLICA_OPS
from .retirement import ReplicaMover
from .streams import (
    LOOP_TURN,
    MessageError,
    log_failure,
    read_loop,
    refuse,
    require,
    send_quietly,
)
from .worker_info import (
    NO_MEMORY_FIGURES,
    heartbeat_advice,
    memory_figures,
    worker_handshake,
    worker_process,
)
from .worker_requests import WorkerRequests

logger = logging.getLogger("distributed_server.scheduler")

#: A worker's process facts when its registration gave none.
_NO_PROCESS = {"pid": None, "memory_limit": None}

#: Run specs at least this large go to workers as out-of-band blobs.
BLOB_MIN_BYTES = 64 * 1024
#: Longest client id accepted; it must be printable (it appears in the log).
MAX_CLIENT_ID = 256
#: A release-keys message over this many keys is applied in slices of this many keys,
#: one stimulus each, so that no single stimulus holds the event loop for long; so are a
#: restart and the results of a worker that left (``dcore.scheduler.slice-keys``).
RELEASE_SLICE_KEYS = config.SETTINGS["scheduler.slice-keys"][1]
#: A stimulus forgets at most this many tasks per key of ``slice-keys`` (forgetting is
#: cheaper than releasing a key: 5,000 take about 10 ms).
FORGET_SLICE_PER_KEY = 5
#: Seconds between the heap trimmer's looks for a trim it owes (`HeapTrimmer.settle`).
HEAP_SETTLE_INTERVAL = 1.0
#: Seconds between the parts of a collecting heap trim (`HeapTrimmer.step`): what came
#: in meanwhile is handled between them, not after all of them.
HEAP_TRIM_STEP_GAP = 0.005
#: Seconds between the heartbeats the scheduler sends every client (`_heartbeat_clients`).
CLIENT_HEARTBEAT_INTERVAL = 5.0


class Scheduler:
    """The scheduler server.

    ``await Scheduler(...).start()`` listens on ``host:port`` (port 0 picks a free one;
    ``address`` tells which), with ``tls://`` when ``security`` has TLS files. Peers
    must hold ``security``'s token and/or certificates; a scheduler without credentials
    may listen only on loopback unless ``insecure=True``. Keyword arguments of the state
    machine (``validate``, ``worker_saturation``, ``allowed_failures``) pass through.
    ``max_connections`` bounds open connections (default: what the file descriptor limit
    allows). ``worker_ttl``, ``worker_saturation``, ``allowed_failures`` and
    ``client_idle_timeout`` left at None come from configuration (config.py: dask's
    ``distributed.scheduler.*`` keys carry over), else 300 s, 1.1, 3 and 300 s.

    ``dashboard_address`` (``":8787"``, ``"host:port"``, ``":0"`` for any free port; the
    host defaults to ``host``) starts the HTTP server of the status page, the JSON API and
    ``/metrics`` (`distributed_server.dashboard`); None (the default here; ``dcore
    scheduler`` serves on 8787) starts none. A busy port gives way to a free one, with a
    warning; ``dashboard_url`` tells where it is. ``open_cluster_api`` serves its cluster
    API (the routes the dask-kubernetes operator calls) without credentials.
    ``coordination_limits`` bounds what the coordination primitives may hold
    (`CoordinationLimits`). ``work_stealing`` (None: configuration
    ``scheduler.work-stealing``, default True) moves tasks waiting on busy workers to
    workers with room (the core's ``balance``), every ``scheduler.work-stealing-interval``
    (100 ms) while two workers or more are registered, when a worker joins, and when a
    worker's reports leave it no task waiting for a thread.

    The services it hosts (client_keys.py, restart.py, history.py, retirement.py,
    coordination_service.py, ...) act through a small public surface: `stimulus`,
    `sid`, `reply`, `reply_failure`, `reply_error` and `in_background`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 worker_ttl: float | None = None,
                 security: Security | None = None, insecure: bool = False,
                 validate: bool = False, worker_saturation: float | None = None,
                 allowed_failures: int | None = None,
                 client_idle_timeout: float | None = None,
                 max_connections: int | None = None, dashboard_address=None,
                 coordination_limits: CoordinationLimits | None = None,
                 work_stealing: bool | None = None, open_cluster_api: bool = False):
        worker_ttl = config.get("scheduler.worker-ttl", worker_ttl)
        #: Work stealing on (the core's ``balance``, every ``stealing_interval`` seconds
        #: while there are two workers or more, and when a worker joins).
        self.work_stealing = config.get("scheduler.work-stealing", work_stealing)
        self.stealing_interval = config.get("scheduler.work-stealing-interval")
        self._last_balance = 0.0  # time.monotonic() of the last balance
        worker_saturation = config.get("scheduler.worker-saturation", worker_saturation)
        allowed_failures = config.get("scheduler.allowed-failures", allowed_failures)
        client_idle_timeout = config.get("scheduler.client-idle-timeout", client_idle_timeout)
        self.security = security if security is not None else Security()
        check_listen_security(host, self.security, insecure, "scheduler")
        self.insecure = insecure
        self.dashboard_address = dashboard_address
        self.open_cluster_api = open_cluster_api  # the dashboard's cluster API needs no credentials
        if dashboard_address is not None:
            from ..dashboard.http import parse_http_address

            dashboard_host, _ = parse_http_address(dashboard_address, host)
            check_listen_security(dashboard_host, self.security, insecure, "dashboard")
        #: Keys per stimulus in a long operation (a huge release, a restart, a departure).
        self.slice_keys = config.get("scheduler.slice-keys")
        # a stimulus forgets at most this many tasks, the rest in turns (_forget_in_turns)
        self.state = SchedulerState(validate=validate, worker_saturation=worker_saturation,
                                    allowed_failures=allowed_failures, clock=time.time,
                                    forget_slice=FORGET_SLICE_PER_KEY * self.slice_keys)
        self._forgetting = False
        self.host = host
        self.port = port
        self.worker_ttl = worker_ttl
        self.client_idle_timeout = client_idle_timeout
        self.max_connections = max_connections
        self.address = ""
        self.worker_comms: dict = {}  # address -> Comm
        self.client_comms: dict = {}  # client id -> Comm
        self.last_seen: dict = {}  # worker address -> time.monotonic()
        #: worker address -> its memory figures from the last heartbeat (Worker.memory_figures)
        self.worker_memory: dict = {}
        self._versions_here = essential()
        self.client_last_seen: dict = {}  # client id -> time.monotonic()
        self._leaving_clients: set = set()  # gone, their keys still being released
        #: Client.restart through the nannies (restart.py), and the nanny registry
        self.restarts = RestartService(self)
        self.nanny_comms = self.restarts.nanny_comms  # nanny id -> Comm
        #: nanny id -> tuple of the worker addresses it runs
        self.nanny_workers = self.restarts.nanny_workers
        self._background: set = set()
        self._worker_requests = WorkerRequests()  # story, logs
        self._listener = None
        self._ttl_task: asyncio.Task | None = None
        self._heap_task: asyncio.Task | None = None
        self._client_beat_task: asyncio.Task | None = None
        self._steal_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._closed = asyncio.Event()
        #: Recent task outcomes: (key, worker, start, stop, ok), packed a chunk at a time.
        self.task_stream = TaskStream()
        #: worker address -> the URL of its HTTP server (from its registration)
        self.worker_dashboards: dict = {}
        #: worker address -> its process (pid, memory_limit), from its registration
        self.worker_processes: dict = {}
        self.loop_lag = LoopLagMonitor()  # sampled while the dashboard runs
        self.n_stimuli = 0
        #: malloc_trim once many tasks are forgotten, so the RSS goes back down with them
        self.heap_trimmer = HeapTrimmer(before_trim=self.task_stream.pack,
                                        before_collect=self._pack_histories)
        self.graph_updates = 0
        self.graph_tasks = 0
        self.graph_intake_seconds = 0.0
        self.http = None  # the dashboard's HttpServer, once started
        self._client_handlers = {
            "update-graph": self._update_graph,
            "update-data": self._update_data,
            "versions": self._versions,
            "identity": self._identity,
            "heartbeat": self._client_heartbeat,
            "register-worker-plugin": self._register_worker_plugin,
            "unregister-worker-plugin": self._unregister_worker_plugin,
        }
        self.worker_plugins = WorkerPluginRegistry(self.worker_comms, self._worker_requests)
        self._plugin_hooks = SchedulerPluginHooks(self)
        #: name -> scheduler plugin added with `add_plugin`
        self.plugins = self._plugin_hooks.plugins
        self._plugin_watchers = self._plugin_hooks.watchers  # non-empty: tell transitions
        #: the coordination primitives and published datasets (coordination_service.py);
        #: ``validate`` also checks their state after their messages
        self.coordination_service = CoordinationService(self, coordination_limits, validate)
        self.coordination = self.coordination_service.coordination  # `Coordination`
        self.datasets = self.coordination_service.datasets  # published datasets
        #: retire_workers, replicate, rebalance (retirement.py)
        self.replicas = ReplicaMover(self)
        #: story, scheduler and worker logs, task stream (history.py)
        self.history = HistoryRequests(self, self._worker_requests)
        #: release-keys, desire-keys, cancel, retry, who-has, has-what, fire-and-forget
        self.client_keys = ClientKeyRequests(self)
        self._register(CLIENT_KEY_OPS, self.client_keys.handle)
        self._register(RESTART_OPS, self.restarts.handle)
        self._register(COORDINATION_OPS, self.coordination_service.handle)
        self._register(REPLICA_OPS, self._move_replicas)
        self._register(HISTORY_OPS, self.history.handle)
        #: adaptive_target, workers_to_close, check_idle (adaptive.py; its retire, for
        #: the HTTP API, goes through ReplicaMover.retire)
        self.adaptive = AdaptiveRequests(self)
        self._register(ADAPTIVE_OPS, self.adaptive.handle)

    def _register(self, ops, handler) -> None:
        """Route the client messages ``ops`` to ``handler(client_id, msg)`` (a service's;
        it may return an awaitable, which the client's batch waits for)."""
        for op in ops:
            self._client_handlers[op] = handler

    def __repr__(self):
        return (f"<Scheduler {self.address or 'not started'} workers={len(self.worker_comms)}"
                f" clients={len(self.client_comms)} tasks={len(self.state.tasks)}>")

    async def start(self) -> Scheduler:
        """Listen for workers and clients."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._listener = await listen(
            f"{self.security.scheme}://{host}:{self.port}", self._on_connection,
            {"role": "scheduler", "compiled": COMPILED, "version": __version__},
            self.security, max_connections=self.max_connections)
        self.address = self._listener.address
        logs.claim_address("scheduler", self.address)
        logs.install_buffer()
        self._ttl_task = asyncio.get_running_loop().create_task(self._check_ttl())
        self._heap_task = asyncio.get_running_loop().create_task(self._settle_heap())
        self._client_beat_task = asyncio.get_running_loop().create_task(
            self._heartbeat_clients())
        if self.work_stealing:
            self._steal_task = asyncio.get_running_loop().create_task(self._steal_loop())
        logger.info("scheduler at %s (core compiled: %s)", self.address, COMPILED)
        await self._plugin_hooks.start()
        if self.dashboard_address is not None:
            await self._start_dashboard()
        return self

    async def _start_dashboard(self) -> None:
        from ..dashboard.http import parse_http_address
        from ..dashboard.scheduler_app import start_scheduler_http

        host, port = parse_http_address(self.dashboard_address, self.host)
        try:
            self.http = await start_scheduler_http(self, host, port, insecure=self.insecure,
                                                   open_cluster_api=self.open_cluster_api)
        except BaseException:
            await self.close()
            raise
        self.loop_lag.start()

    @property
    def dashboard_url(self) -> str | None:
        """The status page's URL (``http(s)://host:port/status``), or None."""
        return None if self.http is None else f"{self.http.url}/status"

    async def close(self, close_workers: bool = True) -> None:
        """Stop listening; ask the workers to shut down; drop every connection."""
        if self._closed.is_set():
            return
        self._closed.set()
        await self._plugin_hooks.close()
        if self._ttl_task is not None:
            self._ttl_task.cancel()
        if self._heap_task is not None:
            self._heap_task.cancel()
        if self._client_beat_task is not None:
            self._client_beat_task.cancel()
        if self._steal_task is not None:
            self._steal_task.cancel()
        self.loop_lag.stop()
        self.coordination_service.close()
        if self._listener is not None:
            await self._listener.stop()
        comms = list(self.client_comms.values())
        if close_workers:
            for comm in [*self.nanny_comms.values(), *self.worker_comms.values()]:
                send_quietly(comm, {"op": "close"})
            comms += list(self.worker_comms.values())
        comms += list(self.nanny_comms.values())
        await asyncio.gather(*(comm.close(timeout=1.0) for comm in comms),
                             return_exceptions=True)
        if self.http is not None:  # last: the peers' close messages must not wait for it
            await self.http.stop()

    async def finished(self) -> None:
        """Wait until the scheduler is closed."""
        await self._closed.wait()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.close()

    # ------------------------------------------------------------------ connections

    async def _on_connection(self, comm) -> None:
        role = comm.extra.get("role")
        if role == "worker":
            await self._serve_worker(comm)
        elif role == "client":
            await self._serve_client(comm)
        elif role == "nanny":
            await self.restarts.serve_nanny(comm, f"nanny-{next(self._ids)}")
        else:
            logger.warning("connection from %s with unknown role %s; closing it",
                           comm.peer_address, bounded_repr(role, 60))
            comm.abort()

    async def _serve_worker(self, comm) -> None:
        info = comm.extra
        try:
            address, nthreads, name, resources, dashboard = worker_handshake(
                info, self.security.scheme)
            process = worker_process(info)
            require(address not in self.worker_comms,
                    f"a worker at {address} is already registered")
            messages = self.state.add_worker(address, nthreads, self.sid("add-worker"),
                                             name=name, resources=resources,
                                             memory_limit=process["memory_limit"])
            self.n_stimuli += 1
        except (MessageError, InvalidStimulus) as exc:
            logger.warning("refusing worker from %s: %s", comm.peer_address, exc)
            await refuse(comm, str(exc))
            return
        differ = mismatches(self._versions_here, info.get("versions"))
        if differ:
            logger.warning("worker %s runs other versions than the scheduler (%s): tasks "
                           "may fail to unpickle there", address, "; ".join(differ))
        self.worker_comms[address] = comm
        if dashboard is not None:
            self.worker_dashboards[address] = dashboard
        self.worker_processes[address] = process
        self.last_seen[address] = time.monotonic()
        self.restarts.worker_joined(address)
        self.worker_plugins.worker_joined(comm)  # set up before its first task
        self._apply(messages)  # only now: they may be for this worker
        logger.info("worker %s joined (%d threads, name %r)", address, nthreads, name)
        if self.work_stealing:  # work queued on the others may move to it at once
            self._balance()
        if self._plugin_hooks.plugins:
            self._plugin_hooks.call("add_worker", worker=address)
        try:
            await read_loop(comm, address, self._handle_worker_batch)
        finally:
            del self.worker_comms[address]
            self._worker_requests.worker_left(address)
            self.last_seen.pop(address, None)
            self.worker_memory.pop(address, None)
            self.worker_dashboards.pop(address, None)
            self.worker_processes.pop(address, None)
            self.stimulus(address, "remove-worker", self.state.remove_worker, address,
                           max_keys=self.slice_keys)
            if address in self.state.departing:
                self.in_background(self._let_go_of_departed(address))
            self.restarts.worker_left(address)
            self.replicas.changed()
            logger.info("worker %s left", address)
            if self._plugin_hooks.plugins:
                self._plugin_hooks.call("remove_worker", worker=address,
                                        stimulus_id=f"remove-worker-{address}")

    async def _let_go_of_departed(self, address: str) -> None:
        """The results a worker that left still held, ``slice_keys`` a stimulus,
        with a turn for every other peer in between (the core recomputes those it needs
        at once, and never sends a task to fetch from the departed worker)."""
        while address in self.state.departing:
            await asyncio.sleep(0)
            self.stimulus(address, "remove-worker", self.state.remove_worker, address,
                           max_keys=self.slice_keys)

    async def _serve_client(self, comm) -> None:
        client_id = comm.extra.get("client_id")
        if not isinstance(client_id, str) or not 0 < len(client_id) <= MAX_CLIENT_ID \
                or not client_id.isprintable() or client_id in self.client_comms \
                or client_id in self._leaving_clients or client_id == COORDINATION_CLIENT:
            text = f"bad or duplicate client_id {bounded_repr(client_id, 100)}"
            logger.warning("refusing client from %s: %s", comm.peer_address, text)
            await refuse(comm, text)
            return
        self.client_comms[client_id] = comm
        self.client_last_seen[client_id] = time.monotonic()
        self.stimulus(client_id, "add-client", self.state.add_client, client_id)
        logger.info("client %s connected from %s", client_id, comm.peer_address)
        if self._plugin_hooks.plugins:
            self._plugin_hooks.call("add_client", client=client_id)
        try:
            await read_loop(comm, client_id, self._handle_client_batch)
        finally:
            del self.client_comms[client_id]
            self.client_last_seen.pop(client_id, None)
            self.coordination_service.client_gone(client_id)
            self._leaving_clients.add(client_id)
            try:
                await self._remove_client(client_id)
            finally:
                self._leaving_clients.discard(client_id)
            logger.info("client %s left", client_id)
            if self._plugin_hooks.plugins:
                self._plugin_hooks.call("remove_client", client=client_id)

    async def _remove_client(self, client_id: str) -> None:
        """The core's remove_client in slices of ``slice_keys`` of the keys the client
        wanted, one stimulus each, serving every other peer in between (a client that
        left holding ten million futures released them in one stimulus of seconds).
        Its id stays taken until it is gone."""
        state = self.state
        while self.stimulus(client_id, "remove-client", state.remove_client, client_id,
                            max_keys=self.slice_keys) and client_id in state.clients:
            await asyncio.sleep(0)

    def stimulus(self, peer: str, cause: str, stimulus, *args, **kwargs) -> bool:
        """Run one stimulus of the state machine and send what it returns.

        ``stimulus(*args, stimulus_id, **kwargs)`` is called with a fresh id made from
        ``cause`` (`sid`); ``peer`` (a client id, a worker address or ``"scheduler"``) is
        who asked, told of a refusal (`reply_error`). Returns False if the state machine
        refused the input (nothing changed; logged). Any other exception is a bug in the
        state machine: it is logged at ERROR with the stimulus id and the state is
        validated; the peer is not blamed.
        """
        stimulus_id = self.sid(cause)
        self.n_stimuli += 1
        try:
            messages = stimulus(*args, stimulus_id, **kwargs)
        except InvalidStimulus as exc:
            logger.warning("refused %r from %s (%s): %s", cause, peer, stimulus_id, exc)
            self.reply_error(peer, cause, exc)
            return False
        except Exception:
            logger.exception("BUG: stimulus %s (%r from %s) raised after it may have changed "
                             "the state", stimulus_id, cause, peer)
            self._validate_after_bug(stimulus_id)
            return False
        self._apply(messages)
        if self.heap_trimmer.held(len(self.state.tasks), in_steps=True) \
                and self.heap_trimmer.steps_owed:
            self._trim_step(now=False)
        if self.state.forget_backlog and not self._forgetting:
            self._forgetting = True
            self.in_background(self._forget_in_turns())
        return True

    async def _forget_in_turns(self) -> None:
        """What the core left to forget (a released graph of a million tasks), a slice
        a stimulus, with a turn for every other peer in between."""
        try:
            while self.state.forget_backlog and not self._closed.is_set():
                await LOOP_TURN.give_way()
                self.stimulus("scheduler", "forget", self.state.forget_more)
        finally:
            self._forgetting = False

    def _validate_after_bug(self, stimulus_id: str) -> None:
        try:
            self.state.validate_state()
        except Exception:
            logger.exception("BUG: the state is invalid after stimulus %s", stimulus_id)
        else:
            logger.warning("the state is still valid after stimulus %s", stimulus_id)

    def reply_error(self, peer: str, cause: str, exc: Exception) -> None:
        """Tell a client why its message was refused (workers get no replies)."""
        comm = self.client_comms.get(peer)
        if comm is not None:
            send_quietly(comm, {"op": "error", "request": cause, "error": str(exc)})

    # ------------------------------------------------------------------ workers

    def _handle_worker_batch(self, address: str, msgs: list):
        """A worker's batch of messages, in order; one over ``slice_keys`` messages (a
        worker's reports piled up while the scheduler was busy) in turns of that many,
        with every other peer served in between."""
        self.last_seen[address] = time.monotonic()
        if len(msgs) > self.slice_keys:
            return self._handle_worker_batch_in_turns(address, msgs)
        self._handle_worker_msgs(address, msgs)
        return None

    async def _handle_worker_batch_in_turns(self, address: str, msgs: list) -> None:
        size = self.slice_keys
        for i in range(0, len(msgs), size):
            if i:
                await asyncio.sleep(0)
            self._handle_worker_msgs(address, msgs[i:i + size])

    def _handle_worker_msgs(self, address: str, msgs: list) -> None:
        finished: list = []
        erred: list = []
        steals: list = []  # a victim's answers to a balance's steal requests: one stimulus
        for msg in msgs:
            op = msg["op"]
            if op == "task-finished":
                finished.append(msg)
                continue
            if op == "task-erred":
                erred.append(msg)
                continue
            if op == "steal-response":
                steals.append((msg.get("key"), msg.get("request"), msg.get("given")))
                continue
            if op == "heartbeat":
                self.worker_memory[address] = memory_figures(msg, address)
                comm = self.worker_comms.get(address)
                if comm is not None:  # the worker's proof that we are alive
                    interval = heartbeat_advice(len(self.worker_comms))
                    send_quietly(comm, {"op": "heartbeat"} if interval is None else
                                 {"op": "heartbeat", "interval": interval})
                continue
            if op == "reply":  # to a story or logs request (WorkerRequests)
                self._worker_requests.answer(address, msg)
                continue
            self._flush_reports(address, finished, erred, steals)
            finished, erred, steals = [], [], []
            if op == "missing-data":
                self.stimulus(address, op, self.state.missing_data, address, msg.get("key"),
                               msg.get("errant_worker"))
            elif op == "reschedule":
                self.stimulus(address, op, self.state.reschedule, address, msg.get("key"))
            elif op == "long-running":  # a task seceded: it waits without a thread
                self.stimulus(address, op, self.state.task_seceded, address, msg.get("key"))
            elif op == "add-keys":  # it holds copies it was asked for (retirement.py)
                self.stimulus(address, op, self.state.replicas_added, address, msg.get("keys"))
                self.replicas.changed()
            elif op == "acquire-failed":
                self.stimulus(address, op, self.state.replicas_failed, address,
                               msg.get("keys"))
                self.replicas.changed()
            else:
                raise MessageError(f"unknown operation {bounded_repr(op, 60)} from worker "
                                   f"{address}")
        self._flush_reports(address, finished, erred, steals)

    def _flush_reports(self, address: str, finished: list, erred: list,
                       steals: list) -> None:
        if finished and self.stimulus(address, "task-finished", self.state.task_finished,
                                       address, finished):
            self.task_stream.record(address, finished, True)
            # the core says when the worker has room with nothing waiting: then do not wait
            # for the timer (but balance at most four times an interval: a stream of fast
            # reports must not become a stream of balances)
            if self.work_stealing and self.state.balance_wanted(address) and \
                    time.monotonic() - self._last_balance >= self.stealing_interval / 4:
                self._balance()
        if erred and self.stimulus(address, "task-erred", self.state.task_erred, address,
                                    erred):
            self.task_stream.record(address, erred, False)
        if steals:
            self.stimulus(address, "steal-response", self.state.steal_responses, address,
                           steals)

    async def _steal_loop(self) -> None:
        """Work stealing: the core's ``balance`` every ``stealing_interval`` while the core
        says one is wanted (``balance_wanted``: two workers or more are registered; with
        one, nothing is called)."""
        while True:
            await asyncio.sleep(self.stealing_interval)
            if self.state.balance_wanted():
                self._balance()

    def _balance(self) -> None:
        self._last_balance = time.monotonic()
        self.stimulus("scheduler", "balance", self.state.balance)

    def _pack_histories(self) -> None:
        """Before a collecting trim (a big job is gone): the recent past the scheduler
        keeps, the task stream and the transition log, packed into a few large objects,
        so that the arenas their small objects were spread over can go back."""
        self.task_stream.squeeze()
        self.state.pack_transition_log()

    def _trim_step(self, now: bool = True) -> None:
        """The next part of a collecting heap trim (``now``), and a call for the one
        after; all of them at once where no event loop runs."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            while self.heap_trimmer.step():
                pass
            return
        if not now or self.heap_trimmer.step():
            loop.call_later(HEAP_TRIM_STEP_GAP, self._trim_step)

    async def _settle_heap(self) -> None:
        """Once a second, let the heap trimmer trim once more after a release that left
        few tasks (what the release's last messages freed)."""
        while True:
            await asyncio.sleep(HEAP_SETTLE_INTERVAL)
            self.heap_trimmer.settle(len(self.state.tasks))

    async def _heartbeat_clients(self) -> None:
        """Every `CLIENT_HEARTBEAT_INTERVAL` seconds, tell each client the scheduler is
        alive. A client's own heartbeat is answered only after the messages it sent
        before it are handled: a client that released ten million futures heard nothing
        for 31 s while the scheduler worked through them, gave it up and disconnected."""
        while True:
            await asyncio.sleep(CLIENT_HEARTBEAT_INTERVAL)
            for comm in list(self.client_comms.values()):
                send_quietly(comm, {"op": "heartbeat"})

    async def _check_ttl(self) -> None:
        """Remove workers silent for longer than ``worker_ttl``, and disconnect clients
        silent for longer than ``client_idle_timeout``."""
        period = max(min(self.worker_ttl, self.client_idle_timeout) / 4, 0.05)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for peers, comms, limit, kind in (
                    (self.last_seen, self.worker_comms, self.worker_ttl, "worker"),
                    (self.client_last_seen, self.client_comms, self.client_idle_timeout,
                     "client")):
                for peer, seen in list(peers.items()):
                    if seen < now - limit:
                        logger.warning("%s %s silent for over %.1fs; disconnecting it",
                                       kind, peer, limit)
                        peers.pop(peer, None)
                        comm = comms.get(peer)
                        if comm is not None:
                            comm.abort()

    # ------------------------------------------------------------------ clients

    async def _handle_client_batch(self, client_id: str, msgs: list) -> None:
        self.client_last_seen[client_id] = time.monotonic()
        turn = LOOP_TURN
        for msg in msgs:
            op = msg["op"]
            if op == "close-client":
                raise CommClosedError(f"client {client_id} closed")
            handler = self._client_handlers.get(op)
            if handler is None:
                raise MessageError(f"unknown operation {bounded_repr(op, 60)} from client "
                                   f"{client_id}")
            pending = handler(client_id, msg)
            if pending is not None:
                await pending
            if turn.over():
                await turn.give_way()  # let every other peer be served

    def _update_graph(self, client_id: str, msg: dict) -> None:
        started = time.perf_counter()
        tasks = msg.get("tasks")
        part = msg.get("part")
        taken = self.state.stimulus_counter
        if self.stimulus(client_id, "update-graph", self.state.update_graph, client_id,
                          tasks, msg.get("keys"), part=part) \
                and self.state.stimulus_counter > taken:
            # (a refused graph is answered, not counted: the plugins are not told of it)
            self.graph_updates += 1
            self.graph_tasks += len(tasks) + (len(part["keys"]) if part is not None else 0)
            if self._plugin_hooks.hooks["update_graph"]:
                dependencies = {task["key"]: list(task.get("deps") or ()) for task in tasks}
                if part is not None:
                    dependencies.update(_part_dependencies(part))
                self._plugin_hooks.call(
                    "update_graph", client=client_id, keys=set(msg.get("keys") or ()),
                    tasks=list(dependencies), dependencies=dependencies,
                    annotations={}, priority={}, stimulus_id=f"update-graph-{client_id}")
        self.graph_intake_seconds += time.perf_counter() - started

    def _update_data(self, client_id: str, msg: dict) -> None:
        self.stimulus(client_id, "update-data", self.state.update_data, client_id,
                       msg.get("who_has"), msg.get("nbytes") or {})

    def _client_heartbeat(self, client_id: str, msg: dict) -> None:
        """Answer, so the client knows we are alive (it gives up on a silent scheduler)."""
        comm = self.client_comms.get(client_id)
        if comm is not None:
            send_quietly(comm, {"op": "heartbeat"})

    # ------------------------------------------------------------------ counters

    def counters(self) -> dict:
        """The scheduler's running totals, without a walk over tasks: its clock, tasks
        held, transitions so far, tasks the task stream recorded, workers and threads."""
        workers = self.state.workers
        return {"time": time.time(), "tasks": len(self.state.tasks),
                "transitions": self.state.transition_counter,
                "tasks_recorded": self.task_stream.total, "workers": len(workers),
                "threads": sum(ws.nthreads for ws in workers.values()),
                "clients": len(self.client_comms), "compiled": COMPILED,
                "version": __version__}

    # ------------------------------------------------------------------ plugins

    def add_plugin(self, plugin, name=None, idempotent: bool = False) -> None:
        """Install a scheduler plugin (`distributed_server.SchedulerPlugin`: hooks
        ``start``, ``close``, ``add_worker``, ``remove_worker``, ``add_client``,
        ``remove_client``, ``update_graph``, ``transition``), in this process: from a
        module given to ``dcore scheduler --preload`` (its ``dcore_setup(scheduler)``).
        ``name`` defaults to the plugin's ``name`` attribute; a plugin of the same name
        is replaced, unless ``idempotent``. On a running scheduler ``start`` runs now."""
        self._plugin_hooks.add(plugin, name, idempotent)

    def remove_plugin(self, name: str) -> None:
        """Remove the scheduler plugin ``name`` (KeyError if there is none)."""
        self._plugin_hooks.remove(name)

    def _register_worker_plugin(self, client_id: str, msg: dict) -> None:
        """``register-worker-plugin {name, plugin, idempotent, timeout?, reqid}``: keep the
        plugin's bytes, install it on every worker (`WorkerPluginRegistry`)."""
        reqid = msg.get("reqid")
        try:
            name, data, idempotent, timeout = self.worker_plugins.check_register(msg)
        except PluginRequestError as exc:
            logger.warning("refused 'register-worker-plugin' from %s: %s", client_id, exc)
            self.reply_failure(client_id, reqid, str(exc))
            return
        if idempotent and name in self.worker_plugins.plugins:
            self.reply(client_id, msg, {"status": "OK", "workers": {}, "silent": {}})
            return
        self.in_background(self._answer_plugin_request(
            client_id, reqid, self.worker_plugins.register(name, data, timeout)))

    def _unregister_worker_plugin(self, client_id: str, msg: dict) -> None:
        """``unregister-worker-plugin {name, timeout?, reqid}``: tear it down everywhere."""
        reqid = msg.get("reqid")
        try:
            name, timeout = self.worker_plugins.check_unregister(msg)
        except PluginRequestError as exc:
            self.reply_failure(client_id, reqid, str(exc))
            return
        if name not in self.worker_plugins.plugins:
            self.reply(client_id, msg, {"status": "missing"})
            return
        self.in_background(self._answer_plugin_request(
            client_id, reqid, self.worker_plugins.unregister(name, timeout)))

    async def _answer_plugin_request(self, client_id: str, reqid, request) -> None:
        self.reply(client_id, {"reqid": reqid}, await request)

    def in_background(self, coro) -> None:
        """Run ``coro`` as a task the scheduler keeps until it is done; a failure is a bug
        (logged), never the client's."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(log_failure)

    def reply_failure(self, client_id: str, reqid, text: str) -> None:
        """Answer a client's request ``reqid`` with an error (``text``); nothing changed."""
        comm = self.client_comms.get(client_id)
        if comm is not None:
            send_quietly(comm, {"op": "reply", "reqid": reqid, "error": text})

    # ------------------------------------------------------------------ replicas, identity

    def _move_replicas(self, client_id: str, msg: dict) -> None:
        """``retire-workers``, ``replicate``, ``rebalance``: carried out by
        `ReplicaMover` in the background (the client's later messages are not held up);
        answered when done."""
        self.in_background(self.replicas.handle(client_id, msg))

    def _versions(self, client_id: str, msg: dict) -> None:
        self.reply(client_id, msg, versions())

    def _identity(self, client_id: str, msg: dict) -> None:
        self.reply(client_id, msg, self.identity())

    def identity(self) -> dict:
        """What a client sees of the scheduler (``Client.scheduler_info()``): address,
        version, whether the core is compiled, each worker's figures (the core's
        ``worker_counts()``, nanny, memory figures, pid and memory limit), the task
        counts, the core's
        ``counters()`` and its ``prefix_counts()``.

        Read from the counters the state machine keeps, never from a walk over the
        tasks: polling it costs the same with a million tasks as with ten."""
        state = self.state
        supervised = self.restarts.supervised()
        memory = self.worker_memory
        workers = state.worker_counts()
        for address, figures in workers.items():
            figures["nanny"] = address in supervised
            figures.update(memory.get(address, NO_MEMORY_FIGURES))
            figures.update(self.worker_processes.get(address, _NO_PROCESS))
        counters = state.counters()
        return {"address": self.address, "workers": workers, "compiled": COMPILED,
                "version": __version__, "n_tasks": counters["tasks"],
                "task_counts": counters["task_counts"], "counters": counters,
                "prefix_counts": state.prefix_counts()}

    def reply(self, client_id: str, msg: dict, result) -> None:
        """Answer a client's request ``msg`` (its ``reqid``) with ``result``; dropped if
        the client is gone."""
        comm = self.client_comms.get(client_id)
        if comm is not None:
            send_quietly(comm, {"op": "reply", "reqid": msg.get("reqid"), "result": result})

    # ------------------------------------------------------------------ sending

    def sid(self, cause: str) -> str:
        """A fresh stimulus id: ``cause`` and a number."""
        return f"{cause}-{next(self._ids)}"

    def _apply(self, messages: tuple) -> None:
        """Send what a stimulus returned to the clients and workers it names."""
        if self._plugin_watchers:  # a scheduler plugin's transition hook
            self._plugin_hooks.notify_transitions()
        client_msgs, worker_msgs = messages
        for client_id, msgs in client_msgs.items():
            if client_id == FIRE_AND_FORGET:
                self.client_keys.fired_and_done(msgs)
                continue
            comm = self.client_comms.get(client_id)
            if comm is not None:
                for msg in msgs:
                    send_quietly(comm, msg)
        for address, msgs in worker_msgs.items():
            comm = self.worker_comms.get(address)
            if comm is None:
                continue
            for msg in msgs:
                spec = msg.get("spec")
                if spec is not None and len(spec) >= BLOB_MIN_BYTES:
                    msg["spec"] = Blob(spec)
                elif "blob" in msg and len(msg["blob"]) >= BLOB_MIN_BYTES:  # a spec part
                    msg["blob"] = Blob(msg["blob"])
                send_quietly(comm, msg)



def _part_dependencies(part: dict) -> dict:
    """``{key: [dependency, ...]}`` of the tasks of an update-graph's spec part."""
    out = {}
    deps = part["deps"]
    start = 0
    for key, count in zip(part["keys"], part["ndeps"]):
        out[key] = list(deps[start:start + count])
        start += count
    return out
