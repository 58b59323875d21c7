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

Nannies (`distributed_server.deploy.nanny`) connect with the role ``"nanny"`` and keep the
scheduler told which workers they supervise. A client's ``restart`` forgets every task
(the core's ``restart`` stimulus: each client is told its keys were cancelled), asks
every nanny to restart its workers, and answers once as many workers as before have
registered again, or after the request's timeout. It is refused, with nothing changed,
while any worker has no nanny (it could not come back).

``retire-workers``, ``replicate`` and ``rebalance`` are carried out by `ReplicaMover`
(retirement.py) through the core's replica stimuli; workers' ``add-keys`` and
``acquire-failed`` answers become ``replicas_added`` / ``replicas_failed``.

The coordination primitives' state (`distributed_server.scheduler.coordination`: variables,
queues, locks, semaphores, events, pub/sub) is held by composition too: their client
messages go to `Coordination.handle`, a client's departure to ``client_gone``, and a
timer to ``expire``; the effects that come back are replies to send and task keys the
pseudo-client ``coordination`` starts or stops wanting (core stimuli).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time

from distributed_core import COMPILED, InvalidStimulus, SchedulerState, __version__, bounded_repr

from .. import config, logs
from ..comm import Blob, CommClosedError, ProtocolError, listen, parse_address
from ..diagnostics.heap_trim import HeapTrimmer
from ..diagnostics.loop_lag import LoopLagMonitor
from ..diagnostics.task_stream import TaskStream
from ..protocol import stories
from ..security import Security, check_listen_security
from ..versions import essential, mismatches, versions
from .coordination import COORDINATION_CLIENT, Coordination, CoordinationLimits
from .coordination import OPS as COORDINATION_OPS
from .datasets import OPS as DATASET_OPS
from .datasets import DatasetStore
from .plugins import PluginRequestError, SchedulerPluginHooks, WorkerPluginRegistry
from .retirement import OPS as REPLICA_OPS
from .retirement import ReplicaMover
from .worker_requests import WorkerRequests

logger = logging.getLogger("distributed_server.scheduler")

#: Run specs at least this large go to workers as out-of-band blobs.
BLOB_MIN_BYTES = 64 * 1024
#: A restart waits this long for the nannies of workers that joined a moment ago to say
#: they supervise them (a nanny learns its worker's address after the worker registered).
NANNY_GRACE_SECONDS = 2.0
#: Most worker addresses one nanny may name.
MAX_NANNY_WORKERS = 4096
#: The client id under which the scheduler wants fire-and-forget keys until they are
#: done; not printable, so no real client can take it.
FIRE_AND_FORGET = "fire-and-forget\t"
#: Longest client id accepted; it must be printable (it appears in the log).
MAX_CLIENT_ID = 256
#: A client's batch is handled in turns of about this long; between turns the scheduler
#: serves every other peer (a release of a million futures must not stall them).
TURN_SECONDS = 0.02
#: A release-keys message over this many keys is applied in slices of this many keys,
#: one stimulus each, so that no single stimulus holds the event loop for long; so are a
#: restart and the results of a worker that left (``dcore.scheduler.slice-keys``).
RELEASE_SLICE_KEYS = config.SETTINGS["scheduler.slice-keys"][1]


class MessageError(ValueError):
    """A peer sent a message the scheduler cannot accept."""


def _require(condition: bool, text: str) -> None:
    if not condition:
        raise MessageError(text)


def _keys(msg: dict) -> list:
    """The message's list of keys, checked hashable before any stimulus sees them."""
    keys = msg.get("keys")
    _require(isinstance(keys, (list, tuple)), f"{msg.get('op')!r} needs a list of 'keys'")
    try:
        hash(tuple(keys))
    except TypeError:
        raise MessageError(f"{msg.get('op')!r}: keys must be hashable") from None
    return keys


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
    warning; ``dashboard_url`` tells where it is.
    ``coordination_limits`` bounds what the coordination primitives may hold
    (`CoordinationLimits`). ``work_stealing`` (None: configuration
    ``scheduler.work-stealing``, default True) moves tasks waiting on busy workers to
    workers with room (the core's ``balance``), every ``scheduler.work-stealing-interval``
    (100 ms) while two workers or more are registered, when a worker joins, and when a
    worker's reports leave it no task waiting for a thread.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 worker_ttl: float | None = None,
                 security: Security | None = None, insecure: bool = False,
                 validate: bool = False, worker_saturation: float | None = None,
                 allowed_failures: int | None = None,
                 client_idle_timeout: float | None = None,
                 max_connections: int | None = None, dashboard_address=None,
                 coordination_limits: CoordinationLimits | None = None,
                 work_stealing: bool | None = None):
        worker_ttl = config.get("scheduler.worker-ttl", worker_ttl)
        #: Work stealing on (the core's ``balance``, every ``stealing_interval`` seconds
        #: while there are two workers or more, and when a worker joins).
        self.work_stealing = config.get("scheduler.work-stealing", work_stealing)
        self.stealing_interval = config.get("scheduler.work-stealing-interval")
        self._last_balance = 0.0  # time.monotonic() of the last balance
        worker_saturation = config.get("scheduler.worker-saturation", worker_saturation)
        allowed_failures = config.get("scheduler.allowed-failures", allowed_failures)
        client_idle_timeout = config.get("scheduler.client-idle-timeout", client_idle_timeout)
        #: Keys per stimulus in a long operation (a huge release, a restart, a departure).
        self.slice_keys = config.get("scheduler.slice-keys")
        self.security = security if security is not None else Security()
        check_listen_security(host, self.security, insecure, "scheduler")
        self.insecure = insecure
        self.dashboard_address = dashboard_address
        if dashboard_address is not None:
            from ..dashboard.http import parse_http_address

            dashboard_host, _ = parse_http_address(dashboard_address, host)
            check_listen_security(dashboard_host, self.security, insecure, "dashboard")
        self.state = SchedulerState(validate=validate, worker_saturation=worker_saturation,
                                    allowed_failures=allowed_failures, clock=time.time)
        self._validate = validate  # also check the coordination state after its messages
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
        self.nanny_comms: dict = {}  # nanny id -> Comm
        self.nanny_workers: dict = {}  # nanny id -> tuple of the worker addresses it runs
        self._registrations = 0  # workers registered so far (a restart counts new ones)
        self._joined: dict = {}  # worker address -> its registration number
        self._workers_changed = asyncio.Event()  # set when a worker or a nanny comes or goes
        self._restarting = False
        self._background: set = set()
        self._worker_requests = WorkerRequests()  # story, logs
        self._listener = None
        self._ttl_task: asyncio.Task | None = None
        self._steal_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._closed = asyncio.Event()
        #: Recent task outcomes: (key, worker, start, stop, ok), one append per task.
        self.task_stream = TaskStream()
        #: worker address -> the URL of its HTTP server (from its registration)
        self.worker_dashboards: dict = {}
        self.loop_lag = LoopLagMonitor()  # sampled while the dashboard runs
        self.n_stimuli = 0
        #: malloc_trim once many tasks are forgotten, so the RSS goes back down with them
        self.heap_trimmer = HeapTrimmer()
        self.graph_updates = 0
        self.graph_tasks = 0
        self.graph_intake_seconds = 0.0
        self.http = None  # the dashboard's HttpServer, once started
        self._client_handlers = {
            "update-graph": self._update_graph,
            "update-data": self._update_data,
            "release-keys": self._release_keys,
            "desire-keys": self._desire_keys,
            "cancel": self._cancel,
            "retry": self._retry,
            "who-has": self._who_has,
            "has-what": self._has_what,
            "fire-and-forget": self._fire_and_forget,
            "versions": self._versions,
            "identity": self._identity,
            "heartbeat": self._client_heartbeat,
            "restart": self._restart,
            "story": self._story,
            "scheduler-logs": self._scheduler_logs,
            "worker-logs": self._worker_logs,
            "task-stream": self._task_stream,
            "register-worker-plugin": self._register_worker_plugin,
            "unregister-worker-plugin": self._unregister_worker_plugin,
        }
        self.worker_plugins = WorkerPluginRegistry(self.worker_comms, self._worker_requests)
        self._plugin_hooks = SchedulerPluginHooks(self)
        #: name -> scheduler plugin added with `add_plugin`
        self.plugins = self._plugin_hooks.plugins
        self._plugin_watchers = self._plugin_hooks.watchers  # non-empty: tell transitions
        # (the core registers the pseudo-client COORDINATION_CLIENT at its first want)
        self.coordination = Coordination(self._task_exists, coordination_limits)
        self._coordination_timer: asyncio.TimerHandle | None = None
        self._coordination_when = 0.0
        self.datasets = DatasetStore(self.coordination)  # published datasets
        for op in COORDINATION_OPS | DATASET_OPS:
            self._client_handlers[op] = self._coordinate
        #: retire_workers, replicate, rebalance (retirement.py)
        self.replicas = ReplicaMover(self)
        for op in REPLICA_OPS:
            self._client_handlers[op] = self._move_replicas

    def __repr__(self):
        return (f"<Scheduler {self.address or 'not started'} workers={len(self.worker_comms)}"
                f" clients={len(self.client_comms)} tasks={len(self.state.tasks)}>")

    async def start(self) -> "Scheduler":
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
            self.http = await start_scheduler_http(self, host, port, insecure=self.insecure)
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
        if self._steal_task is not None:
            self._steal_task.cancel()
        self.loop_lag.stop()
        if self._coordination_timer is not None:
            self._coordination_timer.cancel()
        if self._listener is not None:
            await self._listener.stop()
        comms = list(self.client_comms.values())
        if close_workers:
            for comm in [*self.nanny_comms.values(), *self.worker_comms.values()]:
                _send_quietly(comm, {"op": "close"})
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
            await self._serve_nanny(comm)
        else:
            logger.warning("connection from %s with unknown role %s; closing it",
                           comm.peer_address, bounded_repr(role, 60))
            comm.abort()

    async def _serve_worker(self, comm) -> None:
        info = comm.extra
        try:
            address, nthreads, name, resources, dashboard = _worker_info(info,
                                                                         self.security.scheme)
            _require(address not in self.worker_comms,
                     f"a worker at {address} is already registered")
            messages = self.state.add_worker(address, nthreads, self._sid("add-worker"),
                                             name=name, resources=resources)
            self.n_stimuli += 1
        except (MessageError, InvalidStimulus) as exc:
            logger.warning("refusing worker from %s: %s", comm.peer_address, exc)
            await _refuse(comm, str(exc))
            return
        differ = mismatches(self._versions_here, info.get("versions"))
        if differ:
            logger.warning("worker %s runs other versions than the scheduler (%s): tasks "
                           "may fail to unpickle there", address, "; ".join(differ))
        self.worker_comms[address] = comm
        if dashboard is not None:
            self.worker_dashboards[address] = dashboard
        self.last_seen[address] = time.monotonic()
        self._registrations += 1
        self._joined[address] = self._registrations
        self._workers_changed.set()
        self.worker_plugins.worker_joined(comm)  # set up before its first task
        self._apply(messages)  # only now: they may be for this worker
        logger.info("worker %s joined (%d threads, name %r)", address, nthreads, name)
        if self.work_stealing:  # work queued on the others may move to it at once
            self._balance()
        if self._plugin_hooks.plugins:
            self._plugin_hooks.call("add_worker", worker=address)
        try:
            await self._read_loop(comm, address, self._handle_worker_batch)
        finally:
            del self.worker_comms[address]
            self._worker_requests.worker_left(address)
            self.last_seen.pop(address, None)
            self.worker_memory.pop(address, None)
            self.worker_dashboards.pop(address, None)
            self._stimulus(address, "remove-worker", self.state.remove_worker, address,
                           max_keys=self.slice_keys)
            if address in self.state.departing:
                self._in_background(self._let_go_of_departed(address))
            self._joined.pop(address, None)
            self._workers_changed.set()
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
            self._stimulus(address, "remove-worker", self.state.remove_worker, address,
                           max_keys=self.slice_keys)

    async def _serve_nanny(self, comm) -> None:
        nanny_id = f"nanny-{next(self._ids)}"
        try:
            workers = _nanny_workers(comm.extra.get("workers", ()))
        except MessageError as exc:
            logger.warning("refusing nanny from %s: %s", comm.peer_address, exc)
            await _refuse(comm, str(exc))
            return
        self.nanny_comms[nanny_id] = comm
        self.nanny_workers[nanny_id] = workers
        self._workers_changed.set()
        logger.info("nanny %s (pid %s) connected from %s", nanny_id,
                    bounded_repr(comm.extra.get("pid"), 20), comm.peer_address)
        try:
            await self._read_loop(comm, nanny_id, self._handle_nanny_batch)
        finally:
            del self.nanny_comms[nanny_id]
            del self.nanny_workers[nanny_id]
            logger.info("nanny %s left", nanny_id)

    def _handle_nanny_batch(self, nanny_id: str, msgs: list) -> None:
        """A nanny only says which workers it runs (or that it is alive)."""
        for msg in msgs:
            op = msg["op"]
            if op == "nanny-workers":
                self.nanny_workers[nanny_id] = _nanny_workers(msg.get("workers"))
                self._workers_changed.set()
            elif op != "heartbeat":
                raise MessageError(f"unknown operation {bounded_repr(op, 60)} from "
                                   f"{nanny_id}")

    def _workers_without_nanny(self) -> list:
        supervised = {address for workers in self.nanny_workers.values() for address in workers}
        return sorted(address for address in self.state.workers if address not in supervised)

    async def _serve_client(self, comm) -> None:
        client_id = comm.extra.get("client_id")
        if not isinstance(client_id, str) or not 0 < len(client_id) <= MAX_CLIENT_ID \
                or not client_id.isprintable() or client_id in self.client_comms \
                or client_id == COORDINATION_CLIENT:
            text = f"bad or duplicate client_id {bounded_repr(client_id, 100)}"
            logger.warning("refusing client from %s: %s", comm.peer_address, text)
            await _refuse(comm, text)
            return
        self.client_comms[client_id] = comm
        self.client_last_seen[client_id] = time.monotonic()
        self._stimulus(client_id, "add-client", self.state.add_client, client_id)
        logger.info("client %s connected from %s", client_id, comm.peer_address)
        if self._plugin_hooks.plugins:
            self._plugin_hooks.call("add_client", client=client_id)
        try:
            await self._read_loop(comm, client_id, self._handle_client_batch)
        finally:
            del self.client_comms[client_id]
            self.client_last_seen.pop(client_id, None)
            self._apply_coordination(self.coordination.client_gone(client_id))
            self._stimulus(client_id, "remove-client", self.state.remove_client, client_id)
            logger.info("client %s left", client_id)
            if self._plugin_hooks.plugins:
                self._plugin_hooks.call("remove_client", client=client_id)

    async def _read_loop(self, comm, peer: str, handle) -> None:
        """Read batches until the peer leaves; a bad message closes this comm only."""
        try:
            while True:
                # Not bound to a name: a decoded batch (a whole graph, maybe) must not
                # stay alive while the loop waits for the next one.
                pending = handle(peer, await comm.read())
                if pending is not None:  # a batch handled in turns
                    await pending
        except ProtocolError as exc:
            logger.warning("closing connection to %s: %s", peer, exc)
        except CommClosedError:
            pass
        except MessageError as exc:
            logger.warning("closing connection to %s after a malformed message: %s", peer, exc)
        finally:
            comm.abort()

    def _stimulus(self, peer: str, cause: str, stimulus, *args, **kwargs) -> bool:
        """Run one stimulus of the state machine and send what it returns.

        Returns False if the state machine refused the input (nothing changed; logged).
        Any other exception is a bug in the state machine: it is logged at ERROR with
        the stimulus id and the state is validated; the peer is not blamed.
        """
        stimulus_id = self._sid(cause)
        self.n_stimuli += 1
        try:
            messages = stimulus(*args, stimulus_id, **kwargs)
        except InvalidStimulus as exc:
            logger.warning("refused %r from %s (%s): %s", cause, peer, stimulus_id, exc)
            self._reply_error(peer, cause, exc)
            return False
        except Exception:
            logger.exception("BUG: stimulus %s (%r from %s) raised after it may have changed "
                             "the state", stimulus_id, cause, peer)
            self._validate_after_bug(stimulus_id)
            return False
        self._apply(messages)
        self.heap_trimmer.held(len(self.state.tasks))
        return True

    def _validate_after_bug(self, stimulus_id: str) -> None:
        try:
            self.state.validate_state()
        except Exception:
            logger.exception("BUG: the state is invalid after stimulus %s", stimulus_id)
        else:
            logger.warning("the state is still valid after stimulus %s", stimulus_id)

    def _reply_error(self, peer: str, cause: str, exc: Exception) -> None:
        """Tell a client why its message was refused (workers get no replies)."""
        comm = self.client_comms.get(peer)
        if comm is not None:
            _send_quietly(comm, {"op": "error", "request": cause, "error": str(exc)})

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
                self.worker_memory[address] = _memory_figures(msg, address)
                comm = self.worker_comms.get(address)
                if comm is not None:  # the worker's proof that we are alive
                    _send_quietly(comm, {"op": "heartbeat"})
                continue
            if op == "reply":  # to a story or logs request (WorkerRequests)
                self._worker_requests.answer(address, msg)
                continue
            self._flush_reports(address, finished, erred, steals)
            finished, erred, steals = [], [], []
            if op == "missing-data":
                self._stimulus(address, op, self.state.missing_data, address, msg.get("key"),
                               msg.get("errant_worker"))
            elif op == "reschedule":
                self._stimulus(address, op, self.state.reschedule, address, msg.get("key"))
            elif op == "long-running":  # a task seceded: it waits without a thread
                self._stimulus(address, op, self.state.task_seceded, address, msg.get("key"))
            elif op == "add-keys":  # it holds copies it was asked for (retirement.py)
                self._stimulus(address, op, self.state.replicas_added, address, msg.get("keys"))
                self.replicas.changed()
            elif op == "acquire-failed":
                self._stimulus(address, op, self.state.replicas_failed, address,
                               msg.get("keys"))
                self.replicas.changed()
            else:
                raise MessageError(f"unknown operation {bounded_repr(op, 60)} from worker "
                                   f"{address}")
        self._flush_reports(address, finished, erred, steals)

    def _flush_reports(self, address: str, finished: list, erred: list,
                       steals: list) -> None:
        if finished and self._stimulus(address, "task-finished", self.state.task_finished,
                                       address, finished):
            self.task_stream.record(address, finished, True)
            if self.work_stealing and len(self.state.workers) > 1:
                ws = self.state.workers.get(address)
                # nothing waits there: do not wait for the timer (but balance at most
                # four times an interval: a stream of fast reports must not become a
                # stream of balances)
                if ws is not None and len(ws.processing) <= ws.nthreads and \
                        time.monotonic() - self._last_balance >= self.stealing_interval / 4:
                    self._balance()
        if erred and self._stimulus(address, "task-erred", self.state.task_erred, address,
                                    erred):
            self.task_stream.record(address, erred, False)
        if steals:
            self._stimulus(address, "steal-response", self.state.steal_responses, address,
                           steals)

    async def _steal_loop(self) -> None:
        """Work stealing: the core's ``balance`` every ``stealing_interval`` while two
        workers or more are registered (with one, nothing is called)."""
        while True:
            await asyncio.sleep(self.stealing_interval)
            if len(self.state.workers) > 1:
                self._balance()

    def _balance(self) -> None:
        self._last_balance = time.monotonic()
        self._stimulus("scheduler", "balance", self.state.balance)

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
        turn_end = time.monotonic() + TURN_SECONDS
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
            if time.monotonic() > turn_end:
                await asyncio.sleep(0)  # let every other peer be served
                turn_end = time.monotonic() + TURN_SECONDS

    def _update_graph(self, client_id: str, msg: dict) -> None:
        started = time.perf_counter()
        tasks = msg.get("tasks")
        taken = self.state.stimulus_counter
        if self._stimulus(client_id, "update-graph", self.state.update_graph, client_id,
                          tasks, msg.get("keys")):
            self.graph_updates += 1
            self.graph_tasks += len(tasks)
            # (a refused graph is answered, not counted: the plugins are not told of it)
            if self._plugin_hooks.hooks["update_graph"] and self.state.stimulus_counter > taken:
                self._plugin_hooks.call(
                    "update_graph", client=client_id, keys=set(msg.get("keys") or ()),
                    tasks=[task["key"] for task in tasks],
                    dependencies={task["key"]: list(task.get("deps") or ())
                                  for task in tasks},
                    annotations={}, priority={}, stimulus_id=f"update-graph-{client_id}")
        self.graph_intake_seconds += time.perf_counter() - started

    def _update_data(self, client_id: str, msg: dict) -> None:
        self._stimulus(client_id, "update-data", self.state.update_data, client_id,
                       msg.get("who_has"), msg.get("nbytes") or {})

    def _release_keys(self, client_id: str, msg: dict):
        keys = msg.get("keys")
        if type(keys) not in (list, tuple) or len(keys) <= self.slice_keys:
            self._stimulus(client_id, "release-keys", self.state.client_releases_keys,
                           client_id, keys)
            return None
        return self._release_keys_in_slices(client_id, keys)

    async def _release_keys_in_slices(self, client_id: str, keys) -> None:
        """A huge release, one stimulus per slice with a turn for everyone in between.

        Every key is checked first, so a bad key refuses the whole message as a single
        stimulus would."""
        try:
            hash(tuple(keys))
        except TypeError:
            self._reply_error(client_id, "release-keys", ValueError("keys must be hashable"))
            logger.warning("refused 'release-keys' from %s (%s): unhashable keys", client_id,
                           self._sid("release-keys"))
            return
        size = self.slice_keys
        for i in range(0, len(keys), size):
            self._stimulus(client_id, "release-keys", self.state.client_releases_keys,
                           client_id, keys[i:i + size])
            await asyncio.sleep(0)

    def _desire_keys(self, client_id: str, msg: dict) -> None:
        self._stimulus(client_id, "desire-keys", self.state.client_desires_keys, client_id,
                       msg.get("keys"))

    def _cancel(self, client_id: str, msg: dict):
        """The core's cancel; its answer to the canceller carries the request's ``reqid``
        so the client tells it from a cancel by someone else (``force``)."""
        reqid = msg.get("reqid")
        _require(reqid is None or type(reqid) is int, "cancel: reqid must be an int")
        force = msg.get("force", False) is True
        keys = msg.get("keys")
        if type(keys) in (list, tuple) and len(keys) > self.slice_keys:
            return self._cancel_in_slices(client_id, keys, force, reqid)
        if self._stimulus(client_id, "cancel", self._tagged_cancel(client_id, reqid),
                          client_id, keys, force=force) and force and self.coordination.held:
            self._coordination_keys_lost()  # the pseudo-client's wants may be gone too
        return None

    def _tagged_cancel(self, client_id: str, reqid, answer: bool = True):
        """The core's cancel, its answer to ``client_id`` tagged with ``reqid``; without
        ``answer`` that answer is dropped (the canceller applied the cancel itself and
        waits for one answer, the last slice's)."""
        def cancel(*args, **kwargs):
            client_msgs, worker_msgs = self.state.cancel(*args, **kwargs)
            if not answer:
                mine = [m for m in client_msgs.get(client_id, ())
                        if m.get("op") != "cancelled-keys"]
                if mine:
                    client_msgs[client_id] = mine
                else:
                    client_msgs.pop(client_id, None)
            elif reqid is not None:
                for reply in client_msgs.get(client_id, ()):
                    if reply.get("op") == "cancelled-keys":
                        reply["reqid"] = reqid
            return client_msgs, worker_msgs
        return cancel

    async def _cancel_in_slices(self, client_id: str, keys, force: bool, reqid) -> None:
        """A huge cancel, checked whole (a bad key refuses all of it), then one stimulus
        per slice with a turn for everyone in between."""
        try:
            self.state.check_cancel(client_id, keys, force)
        except InvalidStimulus as exc:
            logger.warning("refused 'cancel' from %s (%s): %s", client_id,
                           self._sid("cancel"), exc)
            self._reply_error(client_id, "cancel", exc)
            return
        size = self.slice_keys
        for i in range(0, len(keys), size):
            last = i + size >= len(keys)
            if not self._stimulus(client_id, "cancel",
                                  self._tagged_cancel(client_id, reqid, answer=last),
                                  client_id, keys[i:i + size], force=force):
                return
            if not last:
                await asyncio.sleep(0)
        if force and self.coordination.held:
            self._coordination_keys_lost()

    def _retry(self, client_id: str, msg: dict) -> None:
        self._stimulus(client_id, "retry", self.state.retry, client_id, msg.get("keys"))

    def _client_heartbeat(self, client_id: str, msg: dict) -> None:
        """Answer, so the client knows we are alive (it gives up on a silent scheduler)."""
        comm = self.client_comms.get(client_id)
        if comm is not None:
            _send_quietly(comm, {"op": "heartbeat"})

    def _restart(self, client_id: str, msg: dict):
        """``restart {timeout, reqid}``: forget every task, restart every worker through
        its nanny, answer once as many workers as before are back (or at the timeout).

        The client's later messages are handled after the tasks are forgotten (while the
        nannies of just-joined workers are awaited, its batch waits); the wait for the
        workers to come back runs in the background."""
        reqid, timeout = msg.get("reqid"), msg.get("timeout", 30.0)
        if type(timeout) not in (int, float) or not 0 < timeout < 1e6:
            self._reply_failure(client_id, reqid, f"restart: timeout must be a positive "
                                                  f"number, not {bounded_repr(timeout)}")
            return None
        if self._restarting:
            self._reply_failure(client_id, reqid, "restart: a restart is already under way")
            return None
        self._restarting = True
        return self._restart_begin(client_id, reqid, float(timeout))

    async def _restart_begin(self, client_id: str, reqid, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            grace_end = started + min(NANNY_GRACE_SECONDS, timeout)
            while self._workers_without_nanny() and loop.time() < grace_end:
                await asyncio.sleep(0.02)
            orphans = self._workers_without_nanny()
            if orphans:
                text = (f"restart refused: {len(orphans)} worker(s) have no nanny to restart "
                        f"them: {', '.join(orphans[:10])}{' ...' if len(orphans) > 10 else ''}"
                        " (started with --no-nanny, or in a LocalCluster(processes=False)); "
                        "nothing was changed")
                logger.warning("%s (asked by client %s)", text, client_id)
                self._reply_failure(client_id, reqid, text)
                self._restarting = False
                return
            n_before, mark = len(self.state.workers), self._registrations
            forgotten = await self._forget_everything(client_id)
            self._coordination_keys_lost()
            if not forgotten:
                self._reply_failure(client_id, reqid, "restart: the scheduler could not "
                                                      "forget its tasks (see its log)")
                self._restarting = False
                return
            logger.info("restarting %d workers through %d nannies (asked by client %s)",
                        n_before, len(self.nanny_comms), client_id)
            for comm in self.nanny_comms.values():
                _send_quietly(comm, {"op": "restart-workers",
                                     "reason": f"Client.restart by {client_id}"})
        except BaseException:
            self._restarting = False
            raise
        task = loop.create_task(self._restart_wait(client_id, reqid, n_before, mark,
                                                   started, timeout))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _forget_everything(self, client_id: str) -> bool:
        """The core's restart in slices of ``slice_keys`` wanted keys, one stimulus
        each, serving every other peer in between; the last call takes whatever is left
        (work other clients submit meanwhile is forgotten too)."""
        wanted = sum(len(cs.wants_what) for cs in self.state.clients.values())
        last = wanted // self.slice_keys + 10  # then one call without a limit
        for i in itertools.count():
            final = i >= last
            if not self._stimulus(client_id, "restart", self.state.restart,
                                  max_keys=None if final else self.slice_keys):
                return False
            if final or not self.state.tasks:
                return True
            await asyncio.sleep(0)
        return False  # not reached

    async def _restart_wait(self, client_id: str, reqid, n_before: int, mark: int,
                            started: float, timeout: float) -> None:
        """Wait until every registered worker joined after the restart began and there
        are as many as before; then answer the client."""
        loop = asyncio.get_running_loop()
        deadline = started + timeout
        try:
            while True:
                fresh = sum(self._joined.get(address, 0) > mark for address in self.state.workers)
                if fresh == len(self.state.workers) and fresh >= n_before:
                    status = "OK"
                    break
                if loop.time() >= deadline:
                    status = "timed-out"
                    break
                self._workers_changed.clear()
                try:
                    await asyncio.wait_for(self._workers_changed.wait(),
                                           deadline - loop.time())
                except asyncio.TimeoutError:
                    pass
        finally:
            self._restarting = False
        seconds = loop.time() - started
        log = logger.info if status == "OK" else logger.warning
        log("restart %s after %.2f s: %d of %d workers are back", status, seconds, fresh,
            n_before)
        self._reply(client_id, {"reqid": reqid}, {"status": status, "workers": fresh,
                                                  "expected": n_before, "seconds": seconds})

    # ------------------------------------------------------------------ introspection

    def _story(self, client_id: str, msg: dict) -> None:
        """``story {keys, timeout, reqid}``: the scheduler's transitions of these keys and
        every worker's, sorted by time; workers silent for ``timeout`` are named."""
        reqid = msg.get("reqid")
        try:
            keys = _story_keys(msg.get("keys"))
            timeout = stories.check_timeout(msg.get("timeout", 5.0))
        except ValueError as exc:
            self._reply_failure(client_id, reqid, f"story: {exc}")
            return
        entries = self.state.story(*keys)
        self._in_background(self._story_answer(client_id, reqid, keys, entries, timeout))

    async def _story_answer(self, client_id: str, reqid, keys: list, entries: list,
                            timeout: float) -> None:
        answers, silent = await self._worker_requests.ask(
            dict(self.worker_comms), {"op": "story", "keys": keys}, timeout)
        wanted = set(keys)
        checked = {}
        for address, answer in answers.items():
            try:
                checked[address] = stories.check_story_answer(answer, wanted)
            except ValueError as exc:
                silent[address] = f"a malformed answer: {exc}"
        story = stories.merge_stories(entries, checked)
        told = {entry[0] for entry in story}
        unknown = [key for key in keys if key not in told and key not in self.state.tasks]
        self._reply(client_id, {"reqid": reqid},
                    {"story": story, "silent": silent, "unknown": unknown})

    def _scheduler_logs(self, client_id: str, msg: dict) -> None:
        """``scheduler-logs {n, reqid}``: this process's last ``n`` log lines."""
        try:
            n = logs.check_line_count(msg.get("n"))
        except ValueError as exc:
            self._reply_failure(client_id, msg.get("reqid"), f"scheduler-logs: {exc}")
            return
        self._reply(client_id, msg, logs.recent_lines(n))

    def _worker_logs(self, client_id: str, msg: dict) -> None:
        """``worker-logs {n, timeout, reqid}``: every worker's last ``n`` log lines;
        workers silent for ``timeout`` are named."""
        reqid = msg.get("reqid")
        try:
            n = logs.check_line_count(msg.get("n"))
            timeout = stories.check_timeout(msg.get("timeout", 5.0))
        except ValueError as exc:
            self._reply_failure(client_id, reqid, f"worker-logs: {exc}")
            return
        self._in_background(self._worker_logs_answer(client_id, reqid, n, timeout))

    async def _worker_logs_answer(self, client_id: str, reqid, n, timeout: float) -> None:
        answers, silent = await self._worker_requests.ask(
            dict(self.worker_comms), {"op": "logs", "n": n}, timeout)
        lines = {}
        for address, answer in answers.items():
            try:
                lines[address] = stories.check_logs_answer(answer)
            except ValueError as exc:
                silent[address] = f"a malformed answer: {exc}"
        self._reply(client_id, {"reqid": reqid}, {"logs": lines, "silent": silent})

    def _task_stream(self, client_id: str, msg: dict) -> None:
        """``task-stream {start, stop, reqid}``: the tasks that ran between the two times
        (None: unbounded), and the scheduler's counters now (`counters`)."""
        bounds = msg.get("start"), msg.get("stop")
        if not all(b is None or (type(b) in (int, float) and math.isfinite(b))
                   for b in bounds):
            self._reply_failure(client_id, msg.get("reqid"), f"task-stream: start and stop "
                                f"must be None or numbers, not {bounded_repr(bounds, 100)}")
            return
        tasks = [{"key": key, "worker": worker, "start": start, "stop": stop,
                  "status": "memory" if ok else "erred"}
                 for _, key, worker, start, stop, ok in self.task_stream.window(*bounds)]
        self._reply(client_id, msg, {"tasks": tasks, "counters": self.counters()})

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
            self._reply_failure(client_id, reqid, str(exc))
            return
        if idempotent and name in self.worker_plugins.plugins:
            self._reply(client_id, msg, {"status": "OK", "workers": {}, "silent": {}})
            return
        self._in_background(self._answer_plugin_request(
            client_id, reqid, self.worker_plugins.register(name, data, timeout)))

    def _unregister_worker_plugin(self, client_id: str, msg: dict) -> None:
        """``unregister-worker-plugin {name, timeout?, reqid}``: tear it down everywhere."""
        reqid = msg.get("reqid")
        try:
            name, timeout = self.worker_plugins.check_unregister(msg)
        except PluginRequestError as exc:
            self._reply_failure(client_id, reqid, str(exc))
            return
        if name not in self.worker_plugins.plugins:
            self._reply(client_id, msg, {"status": "missing"})
            return
        self._in_background(self._answer_plugin_request(
            client_id, reqid, self.worker_plugins.unregister(name, timeout)))

    async def _answer_plugin_request(self, client_id: str, reqid, request) -> None:
        self._reply(client_id, {"reqid": reqid}, await request)

    def _in_background(self, coro) -> None:
        """Run ``coro`` as a task the scheduler keeps until it is done; a failure is a bug
        (logged), never the client's."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    def _reply_failure(self, client_id: str, reqid, text: str) -> None:
        comm = self.client_comms.get(client_id)
        if comm is not None:
            _send_quietly(comm, {"op": "reply", "reqid": reqid, "error": text})

    # ------------------------------------------------------------------ coordination

    def _move_replicas(self, client_id: str, msg: dict) -> None:
        """``retire-workers``, ``replicate``, ``rebalance``: carried out by
        `ReplicaMover` in the background (the client's later messages are not held up);
        answered when done."""
        self._in_background(self.replicas.handle(client_id, msg))

    def _task_exists(self, key) -> bool:
        return key in self.state.tasks

    def _coordinate(self, client_id: str, msg: dict) -> None:
        """A message of a coordination primitive (Variable, Queue, Lock, ...)."""
        try:
            effects = self.coordination.handle(client_id, msg, time.monotonic())
        except Exception:
            logger.exception("BUG: coordination message %r from %s", msg.get("op"), client_id)
            return
        if len(effects) == 1 and "error" in effects[0][-1]:  # refused: nothing changed
            logger.warning("refused %r from %s: %s", msg["op"], client_id,
                           effects[0][-1]["error"])
        self._apply_coordination(effects)

    def _apply_coordination(self, effects: list) -> None:
        """Carry out what `Coordination` returned, in order; re-arm its timer."""
        for effect in effects:
            if effect[0] == "send":
                _, client_id, msg = effect
                comm = self.client_comms.get(client_id)
                if comm is not None:
                    _send_quietly(comm, msg)
            elif effect[0] == "hold":
                self._stimulus(COORDINATION_CLIENT, "coordination-hold",
                               self.state.client_desires_keys, COORDINATION_CLIENT, effect[1])
            else:
                self._stimulus(COORDINATION_CLIENT, "coordination-drop",
                               self.state.client_releases_keys, COORDINATION_CLIENT, effect[1])
        if self._validate:
            self._validate_coordination()
        self._arm_coordination_timer()

    def _coordination_keys_lost(self) -> None:
        """Tell the primitives which keys the pseudo-client still wants (after a restart
        or a forced cancel dropped some of its wants)."""
        pseudo = self.state.clients.get(COORDINATION_CLIENT)
        self.coordination.keys_lost(
            {ts.key for ts in pseudo.wants_what} if pseudo is not None else set())
        if self._validate:
            self._validate_coordination()

    def _validate_coordination(self) -> None:
        """Validation mode: the primitives' bookkeeping is consistent, and the
        pseudo-client wants exactly the keys they hold (except during a restart)."""
        try:
            self.coordination.validate()
            pseudo = self.state.clients.get(COORDINATION_CLIENT)
            wanted = {ts.key for ts in pseudo.wants_what} if pseudo is not None else set()
            if not self._restarting and wanted != set(self.coordination.held):
                raise AssertionError(f"the pseudo-client wants {bounded_repr(wanted)}, the "
                                     f"primitives hold {bounded_repr(self.coordination.held)}")
        except AssertionError:
            logger.exception("BUG: the coordination state is invalid")

    def _arm_coordination_timer(self) -> None:
        deadline = self.coordination.next_deadline()
        timer = self._coordination_timer
        if deadline is None or (timer is not None and self._coordination_when <= deadline):
            return
        if timer is not None:
            timer.cancel()
        delay = max(deadline - time.monotonic(), 0.0)
        self._coordination_when = deadline
        self._coordination_timer = asyncio.get_running_loop().call_later(
            delay, self._coordination_expire)

    def _coordination_expire(self) -> None:
        self._coordination_timer = None
        self._apply_coordination(self.coordination.expire(time.monotonic()))

    def _who_has(self, client_id: str, msg: dict) -> None:
        self._reply(client_id, msg, self.state.who_has(_keys(msg)))

    def _has_what(self, client_id: str, msg: dict) -> None:
        workers = msg.get("workers")
        if workers is None:
            workers = list(self.state.workers)
        _require(type(workers) in (list, tuple) and all(type(w) is str for w in workers),
                 "has-what: workers must be a list of addresses")
        result = {}
        for address in workers:
            ws = self.state.workers.get(address)
            result[address] = [ts.key for ts in ws.has_what] if ws is not None else []
        self._reply(client_id, msg, result)

    def _fire_and_forget(self, client_id: str, msg: dict) -> None:
        """Keep the keys wanted (by `FIRE_AND_FORGET`) until each is done, whatever
        their clients do meanwhile."""
        self._stimulus(client_id, "fire-and-forget", self.state.client_desires_keys,
                       FIRE_AND_FORGET, _keys(msg))

    def _fired_and_done(self, msgs: list) -> None:
        """The core told `FIRE_AND_FORGET` that keys are done: it stops wanting them
        (in a stimulus of its own, after the current one)."""
        done = [msg["key"] for msg in msgs if msg.get("op") in ("key-in-memory", "task-erred")]
        if done:
            asyncio.get_running_loop().call_soon(
                self._stimulus, FIRE_AND_FORGET, "fire-and-forget-done",
                self.state.client_releases_keys, FIRE_AND_FORGET, done)

    def _versions(self, client_id: str, msg: dict) -> None:
        self._reply(client_id, msg, versions())

    def _identity(self, client_id: str, msg: dict) -> None:
        self._reply(client_id, msg, self.identity())

    def identity(self) -> dict:
        """What a client sees of the scheduler (``Client.scheduler_info()``): address,
        version, whether the core is compiled, each worker's figures (the core's
        ``worker_counts()``, nanny, memory figures), the task counts, the core's
        ``counters()`` and its ``prefix_counts()``.

        Read from the counters the state machine keeps, never from a walk over the
        tasks: polling it costs the same with a million tasks as with ten."""
        state = self.state
        supervised = {address for workers in self.nanny_workers.values() for address in workers}
        memory = self.worker_memory
        workers = state.worker_counts()
        for address, figures in workers.items():
            figures["nanny"] = address in supervised
            figures.update(memory.get(address, _NO_MEMORY_FIGURES))
        counters = state.counters()
        return {"address": self.address, "workers": workers, "compiled": COMPILED,
                "version": __version__, "n_tasks": counters["tasks"],
                "task_counts": counters["task_counts"], "counters": counters,
                "prefix_counts": state.prefix_counts()}

    def _reply(self, client_id: str, msg: dict, result) -> None:
        comm = self.client_comms.get(client_id)
        if comm is not None:
            _send_quietly(comm, {"op": "reply", "reqid": msg.get("reqid"), "result": result})

    # ------------------------------------------------------------------ sending

    def _sid(self, cause: str) -> str:
        return f"{cause}-{next(self._ids)}"

    def _apply(self, messages: tuple) -> None:
        """Send what a stimulus returned to the clients and workers it names."""
        if self._plugin_watchers:  # a scheduler plugin's transition hook
            self._plugin_hooks.notify_transitions()
        client_msgs, worker_msgs = messages
        for client_id, msgs in client_msgs.items():
            if client_id == FIRE_AND_FORGET:
                self._fired_and_done(msgs)
                continue
            comm = self.client_comms.get(client_id)
            if comm is not None:
                for msg in msgs:
                    _send_quietly(comm, msg)
        for address, msgs in worker_msgs.items():
            comm = self.worker_comms.get(address)
            if comm is None:
                continue
            for msg in msgs:
                spec = msg.get("spec")
                if spec is not None and len(spec) >= BLOB_MIN_BYTES:
                    msg["spec"] = Blob(spec)
                _send_quietly(comm, msg)


def _send_quietly(comm, msg: dict) -> None:
    """Queue a message; a closed comm is noticed (and cleaned up) by its read loop."""
    try:
        comm.send(msg)
    except CommClosedError:
        pass


async def _refuse(comm, reason: str) -> None:
    try:
        await comm.write([{"op": "error", "error": reason}])
    except CommClosedError:
        pass
    comm.abort()


def _log_failure(task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("BUG: a background request failed", exc_info=task.exception())


def _story_keys(keys) -> list:
    """The keys of a story request: a list of 1 to MAX_STORY_KEYS hashable keys."""
    if not isinstance(keys, (list, tuple)) or not 0 < len(keys) <= stories.MAX_STORY_KEYS:
        raise ValueError(f"keys must be a list of 1 to {stories.MAX_STORY_KEYS} keys, "
                         f"not {bounded_repr(keys, 100)}")
    try:
        hash(tuple(keys))
    except TypeError:
        raise ValueError(f"keys must be hashable: {bounded_repr(keys, 100)}") from None
    return list(keys)


def _nanny_workers(workers) -> tuple:
    """Check a nanny's list of worker addresses."""
    _require(isinstance(workers, (list, tuple)) and len(workers) <= MAX_NANNY_WORKERS
             and all(isinstance(a, str) and len(a) <= 1000 for a in workers),
             f"a nanny's 'workers' must be a list of at most {MAX_NANNY_WORKERS} addresses, "
             f"not {bounded_repr(workers, 100)}")
    return tuple(workers)


def _worker_info(info: dict, scheme: str) -> tuple:
    """Check a worker's handshake: (address, nthreads, name, resources, dashboard).

    The state machine checks the values themselves; this checks the message's shape.
    ``dashboard``, the URL of the worker's HTTP server, is optional."""
    address = info.get("address")
    try:
        _require(parse_address(address)[0] == scheme,
                 f"a worker of this cluster listens on {scheme}://, not {address!r}")
    except ValueError as exc:
        raise MessageError(f"worker handshake needs its listen 'address': {exc}") from None
    dashboard = info.get("dashboard")
    _require(dashboard is None or (isinstance(dashboard, str) and len(dashboard) <= 300
                                   and dashboard.startswith(("http://", "https://"))
                                   and dashboard.isprintable()),
             f"a worker's 'dashboard' must be an http(s) URL, not "
             f"{bounded_repr(dashboard, 100)}")
    return (address, info.get("nthreads", 1), info.get("name"), info.get("resources"),
            dashboard)


#: A worker's memory figures before its first heartbeat (or from one that sent none).
_NO_MEMORY_FIGURES = {"memory": None, "managed": None, "spilled": None, "spilled_count": None,
                      "paused": False, "cpu": None}
#: The most CPU a heartbeat may claim, in cores.
_MAX_CPU = 1e5


def _memory_figures(msg: dict, address: str) -> dict:
    """The memory figures of a worker's heartbeat, checked: byte counts are ints from 0
    to 2**62 or absent/None (unknown), ``paused`` a bool."""
    figures = {}
    for name in ("memory", "managed", "spilled", "spilled_count"):
        value = msg.get(name)
        _require(value is None or (type(value) is int and 0 <= value <= 2**62),
                 f"heartbeat from {address}: {name} must be bytes, not "
                 f"{bounded_repr(value, 60)}")
        figures[name] = value
    cpu = msg.get("cpu")
    _require(cpu is None or (type(cpu) in (int, float) and 0 <= cpu <= _MAX_CPU),
             f"heartbeat from {address}: cpu must be a number of cores, not "
             f"{bounded_repr(cpu, 60)}")
    figures["cpu"] = cpu
    paused = msg.get("paused", False)
    _require(type(paused) is bool, f"heartbeat from {address}: paused must be a bool, not "
                                   f"{bounded_repr(paused, 60)}")
    figures["paused"] = paused
    return figures
