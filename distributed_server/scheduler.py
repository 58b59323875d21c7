"""The Scheduler server: a `SchedulerState` connected to workers and clients.

It listens for connections, turns each incoming message into one stimulus of the state
machine, and sends what the stimulus returns. It never writes into the state itself,
never unpickles anything (run specs, results and errors pass through as bytes), and
never runs user code. A worker's batch of finished-task reports becomes one stimulus.

A malformed message closes the connection it came on, with a logged error; everyone
else keeps being served. A worker whose connection closes, or that stays silent past
``worker_ttl``, is removed and its work rescheduled.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from distributed_core import COMPILED, SchedulerState, __version__

from .comm import Blob, CommClosedError, ProtocolError, listen

logger = logging.getLogger("distributed_server.scheduler")

#: Run specs at least this large go to workers as out-of-band blobs.
BLOB_MIN_BYTES = 64 * 1024


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

    ``await Scheduler(...).start()`` listens on ``tcp://host:port`` (port 0 picks a free
    one; ``address`` tells which). Keyword arguments of the state machine
    (``validate``, ``worker_saturation``, ``allowed_failures``) pass through.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, worker_ttl: float = 30.0,
                 ssl_context=None, validate: bool = False, worker_saturation: float = 1.1,
                 allowed_failures: int = 3):
        self.state = SchedulerState(validate=validate, worker_saturation=worker_saturation,
                                    allowed_failures=allowed_failures, clock=time.time)
        self.host = host
        self.port = port
        self.worker_ttl = worker_ttl
        self.ssl_context = ssl_context
        self.address = ""
        self.worker_comms: dict = {}  # address -> Comm
        self.client_comms: dict = {}  # client id -> Comm
        self.last_seen: dict = {}  # worker address -> time.monotonic()
        self._listener = None
        self._ttl_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._closed = asyncio.Event()
        self._client_handlers = {
            "update-graph": self._update_graph,
            "update-data": self._update_data,
            "release-keys": self._release_keys,
            "desire-keys": self._desire_keys,
            "cancel": self._cancel,
            "retry": self._retry,
            "who-has": self._who_has,
            "identity": self._identity,
            "heartbeat": _ignore,
        }

    def __repr__(self):
        return (f"<Scheduler {self.address or 'not started'} workers={len(self.worker_comms)}"
                f" clients={len(self.client_comms)} tasks={len(self.state.tasks)}>")

    async def start(self) -> "Scheduler":
        """Listen for workers and clients."""
        scheme = "tls" if self.ssl_context is not None else "tcp"
        self._listener = await listen(
            f"{scheme}://{self.host}:{self.port}", self._on_connection,
            {"role": "scheduler", "compiled": COMPILED, "version": __version__},
            self.ssl_context)
        self.address = self._listener.address
        self._ttl_task = asyncio.get_running_loop().create_task(self._check_ttl())
        logger.info("scheduler at %s (core compiled: %s)", self.address, COMPILED)
        return self

    async def close(self, close_workers: bool = True) -> None:
        """Stop listening; ask the workers to shut down; drop every connection."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._ttl_task is not None:
            self._ttl_task.cancel()
        if self._listener is not None:
            await self._listener.stop()
        comms = list(self.client_comms.values())
        if close_workers:
            for comm in self.worker_comms.values():
                _send_quietly(comm, {"op": "close"})
            comms += list(self.worker_comms.values())
        await asyncio.gather(*(comm.close(timeout=1.0) for comm in comms),
                             return_exceptions=True)

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
        else:
            logger.error("connection from %s with unknown role %r; closing it",
                         comm.peer_address, role)
            comm.abort()

    async def _serve_worker(self, comm) -> None:
        info = comm.extra
        try:
            address, nthreads, name, resources = _worker_info(info)
            _require(address not in self.worker_comms,
                     f"a worker at {address} is already registered")
        except MessageError as exc:
            logger.error("refusing worker from %s: %s", comm.peer_address, exc)
            await _refuse(comm, str(exc))
            return
        self.worker_comms[address] = comm
        self.last_seen[address] = time.monotonic()
        self._apply(self.state.add_worker(address, nthreads, self._sid("add-worker"),
                                          name=name, resources=resources))
        logger.info("worker %s joined (%d threads, name %r)", address, nthreads, name)
        try:
            await self._read_loop(comm, address, self._handle_worker_batch)
        finally:
            del self.worker_comms[address]
            self.last_seen.pop(address, None)
            self._apply(self.state.remove_worker(address, self._sid("remove-worker")))
            logger.info("worker %s left", address)

    async def _serve_client(self, comm) -> None:
        client_id = comm.extra.get("client_id")
        if not isinstance(client_id, str) or not client_id or client_id in self.client_comms:
            logger.error("refusing client from %s: bad or duplicate client_id %r",
                         comm.peer_address, client_id)
            await _refuse(comm, f"bad or duplicate client_id {client_id!r}")
            return
        self.client_comms[client_id] = comm
        self._apply(self.state.add_client(client_id, self._sid("add-client")))
        logger.info("client %s connected from %s", client_id, comm.peer_address)
        try:
            await self._read_loop(comm, client_id, self._handle_client_batch)
        finally:
            del self.client_comms[client_id]
            self._apply(self.state.remove_client(client_id, self._sid("remove-client")))
            logger.info("client %s left", client_id)

    async def _read_loop(self, comm, peer: str, handle) -> None:
        """Read batches until the peer leaves; a bad message closes this comm only."""
        try:
            while True:
                # Not bound to a name: a decoded batch (a whole graph, maybe) must not
                # stay alive while the loop waits for the next one.
                handle(peer, await comm.read())
        except ProtocolError as exc:
            logger.error("closing connection to %s: %s", peer, exc)
        except CommClosedError:
            pass
        except (MessageError, TypeError, KeyError, ValueError) as exc:
            logger.error("closing connection to %s after a malformed message: %s: %s",
                         peer, type(exc).__name__, exc)
        finally:
            comm.abort()

    # ------------------------------------------------------------------ workers

    def _handle_worker_batch(self, address: str, msgs: list) -> None:
        self.last_seen[address] = time.monotonic()
        finished: list = []
        erred: list = []
        for msg in msgs:
            op = msg["op"]
            if op == "task-finished":
                finished.append(msg)
                continue
            if op == "task-erred":
                erred.append(msg)
                continue
            if op == "heartbeat":
                continue
            self._flush_reports(address, finished, erred)
            finished, erred = [], []
            key = msg.get("key")
            hash(key)
            if op == "missing-data":
                errant = msg.get("errant_worker")
                _require(isinstance(errant, str), "'missing-data' needs 'errant_worker'")
                self._apply(self.state.missing_data(address, key, errant, self._sid(op)))
            elif op == "reschedule":
                self._apply(self.state.reschedule(address, key, self._sid(op)))
            else:
                raise MessageError(f"unknown operation {op!r} from worker {address}")
        self._flush_reports(address, finished, erred)

    def _flush_reports(self, address: str, finished: list, erred: list) -> None:
        if finished:
            self._apply(self.state.task_finished(address, finished, self._sid("task-finished")))
        if erred:
            self._apply(self.state.task_erred(address, erred, self._sid("task-erred")))

    async def _check_ttl(self) -> None:
        """Remove workers that have been silent for longer than ``worker_ttl``."""
        while True:
            await asyncio.sleep(max(self.worker_ttl / 4, 0.05))
            deadline = time.monotonic() - self.worker_ttl
            for address, seen in list(self.last_seen.items()):
                if seen < deadline:
                    logger.warning("worker %s silent for over %.1fs; removing it",
                                   address, self.worker_ttl)
                    comm = self.worker_comms.get(address)
                    if comm is not None:
                        comm.abort()

    # ------------------------------------------------------------------ clients

    def _handle_client_batch(self, client_id: str, msgs: list) -> None:
        for msg in msgs:
            op = msg["op"]
            if op == "close-client":
                raise CommClosedError(f"client {client_id} closed")
            handler = self._client_handlers.get(op)
            if handler is None:
                raise MessageError(f"unknown operation {op!r} from client {client_id}")
            handler(client_id, msg)

    def _update_graph(self, client_id: str, msg: dict) -> None:
        self._apply(self.state.update_graph(client_id, msg.get("tasks"), msg.get("keys"),
                                            self._sid("update-graph")))

    def _update_data(self, client_id: str, msg: dict) -> None:
        who_has, nbytes = msg.get("who_has"), msg.get("nbytes") or {}
        _require(isinstance(who_has, dict) and isinstance(nbytes, dict),
                 "'update-data' needs dicts 'who_has' and 'nbytes'")
        self._apply(self.state.update_data(client_id, who_has, nbytes, self._sid("update-data")))

    def _release_keys(self, client_id: str, msg: dict) -> None:
        self._apply(self.state.client_releases_keys(client_id, _keys(msg),
                                                    self._sid("release-keys")))

    def _desire_keys(self, client_id: str, msg: dict) -> None:
        self._apply(self.state.client_desires_keys(client_id, _keys(msg),
                                                   self._sid("desire-keys")))

    def _cancel(self, client_id: str, msg: dict) -> None:
        self._apply(self.state.cancel(client_id, _keys(msg), self._sid("cancel"),
                                      force=bool(msg.get("force", False))))

    def _retry(self, client_id: str, msg: dict) -> None:
        self._apply(self.state.retry(client_id, _keys(msg), self._sid("retry")))

    def _who_has(self, client_id: str, msg: dict) -> None:
        self._reply(client_id, msg, self.state.who_has(_keys(msg)))

    def _identity(self, client_id: str, msg: dict) -> None:
        self._reply(client_id, msg, self.identity())

    def identity(self) -> dict:
        """What a client sees of the scheduler: address, workers, task counts."""
        workers = {
            address: {"nthreads": ws.nthreads, "name": ws.name}
            for address, ws in self.state.workers.items()
        }
        return {"address": self.address, "workers": workers, "compiled": COMPILED,
                "version": __version__, "n_tasks": len(self.state.tasks),
                "task_counts": self.state.task_counts()}

    def _reply(self, client_id: str, msg: dict, result) -> None:
        comm = self.client_comms.get(client_id)
        if comm is not None:
            _send_quietly(comm, {"op": "reply", "reqid": msg.get("reqid"), "result": result})

    # ------------------------------------------------------------------ sending

    def _sid(self, cause: str) -> str:
        return f"{cause}-{next(self._ids)}"

    def _apply(self, messages: tuple) -> None:
        """Send what a stimulus returned to the clients and workers it names."""
        client_msgs, worker_msgs = messages
        for client_id, msgs in client_msgs.items():
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


def _ignore(peer: str, msg: dict) -> None:
    """Messages that only prove the peer is alive."""


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


def _worker_info(info: dict) -> tuple:
    """Check a worker's handshake: (address, nthreads, name, resources)."""
    address = info.get("address")
    nthreads = info.get("nthreads", 1)
    name = info.get("name")
    resources = info.get("resources")
    _require(isinstance(address, str) and "://" in address,
             f"worker handshake needs its listen 'address', got {address!r}")
    _require(type(nthreads) is int and nthreads >= 1,
             f"'nthreads' must be a positive int, got {nthreads!r}")
    _require(name is None or isinstance(name, (str, int)), f"bad worker name {name!r}")
    _require(resources is None or (isinstance(resources, dict) and all(
        isinstance(k, str) and isinstance(v, (int, float)) for k, v in resources.items())),
        f"bad worker resources {resources!r}")
    return address, nthreads, name, resources
