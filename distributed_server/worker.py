"""The Worker server: runs tasks in a thread pool, holds their results, serves them to peers.

What this module does
---------------------
- Registers with the scheduler (handshake role ``"worker"``) and reads its batched
  stream: ``compute-task``, ``free-keys`` and ``close``. Each frame is handled in one
  pass of plain calls on the event loop; no asyncio Task is made per task.
- Runs tasks on ``nthreads`` daemon executor threads. The loop keeps ready tasks in a
  priority heap and feeds a thread-safe queue with a bounded prefetch, so a task that
  arrives late with a high priority is never stuck behind thousands. A thread runs
  ``loads_spec(spec)(deps)``, builds the report and appends the outcome to a deque;
  one ``call_soon_threadsafe`` per burst of outcomes wakes the loop, which stores the
  results in ``Worker.data`` and reports them through the batched ``Comm.send``, so
  many reports share a frame.
- Fetches dependencies it does not hold from peer workers: one ``get-data`` per peer
  per burst, over pooled connections; a failing holder is replaced by the next one;
  when none works the task goes back to the scheduler (``missing-data`` for each
  failed holder, then ``reschedule``).
- Serves peers and clients on its own listener: ``get-data``, ``put-data``, ``ping``.
- Sends a heartbeat every ``heartbeat_interval``. On losing the scheduler it drops all
  data and tasks (the scheduler will treat it as a new worker) and tries to register
  again for ``reconnect_timeout`` seconds; then it shuts down.

What it never does
------------------
- It never runs task code on the event loop: specs are unpickled and called, and
  results sized (``sizeof``) and pickled for inline reports, on executor threads. Only
  data transfers (``get-data``/``put-data`` payloads) are pickled and unpickled on the
  loop.
- It never runs a task twice for the same key while one execution is pending or its
  result is held, and never keeps fetched copies the scheduler does not know about
  once no pending task here needs them.
- It never blocks process exit or hangs in ``close()``: executor threads are daemons
  and are waited for only briefly.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
import socket
import threading
import time
from collections import deque
from queue import SimpleQueue

from .comm import Blob, Comm, CommClosedError, ProtocolError, connect, listen, parse_address
from .security import Security, check_listen_security
from .serialize import (
    dumps_data,
    dumps_error,
    dumps_inline_result,
    loads_data,
    loads_spec,
    sizeof,
)

__all__ = ["Worker"]

logger = logging.getLogger("distributed_server.worker")

# Where a task stands on this worker.
FETCHING = "fetching"  # waiting for dependencies from peers
READY = "ready"  # in the priority heap
CONSTRAINED = "constrained"  # ready, but the worker's free resources do not cover it
RUNNING = "running"  # handed to the executor threads: queued there, or executing
DONE = "done"  # finished, dropped or forgotten; stale heap entries are skipped

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


class _Job:
    """One task this worker was asked to compute."""

    __slots__ = ("borrowed", "cancelled", "deps", "key", "n_missing", "priority", "resources",
                 "spec", "state")

    def __init__(self, key, spec, priority: tuple, resources: dict | None) -> None:
        self.key = key
        self.spec = spec
        self.priority = priority
        self.resources = resources
        self.deps: dict = {}  # dependency key -> value, filled before the job is ready
        self.n_missing = 0  # dependencies still being fetched
        self.borrowed: list | None = None  # fetched-copy keys this job keeps alive
        self.state = FETCHING
        # set by free-keys while RUNNING: the outcome is discarded unless a new
        # compute-task for the key adopts the execution first
        self.cancelled = False

    def __repr__(self) -> str:
        return f"<_Job {self.key!r} {self.state}{' cancelled' if self.cancelled else ''}>"


class _Fetch:
    """A dependency being fetched from peers, shared by every job that waits for it."""

    __slots__ = ("failed", "holders", "in_flight", "key", "waiters")

    def __init__(self, key) -> None:
        self.key = key
        self.holders: list = []  # addresses not tried yet
        self.failed: list = []  # addresses that could not provide it
        self.waiters: list = []  # jobs that need it
        self.in_flight: str | None = None  # the peer asked right now


class _BadRequest(ValueError):
    """A peer sent a request the worker cannot answer; its connection is closed."""


class Worker:
    """A worker server: executes tasks for a scheduler and serves results to peers.

    ``await worker.start()`` listens for peers on ``host:port`` (port 0 picks a free
    one; ``worker.address`` tells which), then registers with the scheduler at
    ``scheduler_address``. Results live in ``worker.data`` (key -> value).
    ``resources`` (``{name: quantity}``) limit which tasks may run at once.
    ``security`` holds the cluster's token and/or TLS files (``tls://`` addresses need
    TLS): it is proven to the scheduler and to peers, and demanded of every peer that
    connects here. Without credentials the worker listens only on loopback unless
    ``insecure=True``.
    ``connect_timeout`` bounds connecting to the scheduler at start and to a peer.
    """

    def __init__(self, scheduler_address: str, nthreads: int = 1, name=None,
                 resources: dict | None = None, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_interval: float = 1.0, reconnect_timeout: float = 10.0,
                 security: Security | None = None, *, insecure: bool = False,
                 connect_timeout: float = 10.0) -> None:
        if type(nthreads) is not int or not 1 <= nthreads <= MAX_THREADS:
            raise ValueError(f"nthreads must be an int from 1 to {MAX_THREADS}, "
                             f"got {nthreads!r}")
        self.security = security if security is not None else Security()
        check_listen_security(host, self.security, insecure, "worker")
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
        self.connect_timeout = connect_timeout
        self.address = ""
        self.status = CREATED
        self.data: dict = {}

        self._jobs: dict = {}  # key -> _Job not yet reported (including cancelled RUNNING ones)
        self._ready: list = []  # heap of (priority, sequence number, _Job)
        self._sequence = itertools.count()
        self._constrained: list = []  # READY jobs waiting for resources
        self._free_resources = dict(self.resources)
        self._prefetch = max(4 * nthreads, 64)
        self._n_handed = 0  # jobs handed to the threads whose outcome is not drained yet

        self._queue: SimpleQueue = SimpleQueue()  # jobs (or None: stop) for the threads
        self._outcomes: deque = deque()  # (job, report or None, value) from the threads
        self._wake_pending = False  # a call_soon_threadsafe to drain outcomes is queued
        self._stopping = False  # threads skip queued jobs and exit
        self._threads: list = []

        self._fetches: dict = {}  # dependency key -> _Fetch
        self._to_fetch: set = set()  # dependency keys that need a request
        self._fetched_keys: set = set()  # keys in data that are only copies for our deps
        self._borrowers: dict = {}  # fetched key -> number of pending jobs using it
        self._peer_pool: dict = {}  # peer address -> idle Comms
        self._served: set = set()  # comms of peers we answer
        self._background: set = set()  # fetch tasks (one per peer per burst)

        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener = None
        self._scheduler_comm: Comm | None = None
        self._reader: asyncio.Task | None = None
        self._heartbeat_handle: asyncio.TimerHandle | None = None
        self._close_requested = False
        self._finished = asyncio.Event()
        self._handlers = {
            "compute-task": self._compute_task,
            "free-keys": self._free_keys,
            "close": self._close_request,
        }

    def __repr__(self) -> str:
        return (f"<Worker {self.address or 'not started'} {self.status} "
                f"nthreads={self.nthreads} data={len(self.data)} tasks={len(self._jobs)}>")

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> Worker:
        """Listen for peers, start the executor threads, register with the scheduler."""
        if self.status != CREATED:
            raise RuntimeError(f"{self!r} was already started")
        self._loop = asyncio.get_running_loop()
        scheme = self.security.scheme
        self._listener = await listen(_join_address(scheme, self.host, self.port),
                                      self._serve_peer, {"role": "worker"}, self.security)
        bound_port = self._listener.port
        self.address = _join_address(scheme, _contact_host(self.host, self.scheduler_address),
                                     bound_port)
        self._listener.set_handshake_info(address=self.address)  # known once bound
        self._start_threads()
        self.status = RUNNING_STATUS
        try:
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
        await self._cancel_tasks()
        if self._listener is not None:
            await self._listener.stop()
        if self._scheduler_comm is not None:
            await self._scheduler_comm.close(timeout=1.0)
        for comm in [*self._served, *itertools.chain(*self._peer_pool.values())]:
            comm.abort()
        self._peer_pool.clear()
        await self._stop_threads()
        self._drop_everything()
        self.status = CLOSED
        self._finished.set()
        logger.info("worker %s closed", self.address)

    async def finished(self) -> None:
        """Wait until the worker has shut down."""
        await self._finished.wait()

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
                "name": self.name, "resources": self.resources}

    # ------------------------------------------------------------------ scheduler stream

    def _attach(self, comm: Comm) -> None:
        role = comm.extra.get("role")
        if role != "scheduler":
            logger.warning("%s answered with role %r, not 'scheduler'", comm.peer_address, role)
        self._scheduler_comm = comm

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
                    self._drop_everything()
                    if not await self._reconnect():
                        break
                    continue
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
        """Apply one frame of scheduler messages, then start what they made runnable."""
        handlers = self._handlers
        for msg in msgs:
            handler = handlers.get(msg["op"])
            if handler is None:
                logger.warning("worker %s ignores unknown operation %r from the scheduler",
                               self.address, msg["op"])
                continue
            try:
                handler(msg)
            except Exception:
                logger.exception("worker %s could not apply %r from the scheduler",
                                 self.address, msg["op"])
        self._feed()
        if self._to_fetch:
            self._start_fetches()

    def _send(self, msg: dict) -> None:
        """Queue a message on the scheduler stream; dropped if the stream is down."""
        comm = self._scheduler_comm
        if comm is not None:
            try:
                comm.send(msg)
            except CommClosedError:
                pass

    def _heartbeat(self) -> None:
        self._send({"op": "heartbeat"})
        self._heartbeat_handle = self._loop.call_later(self.heartbeat_interval, self._heartbeat)

    def _close_request(self, msg: dict) -> None:
        self._close_requested = True

    # ------------------------------------------------------------------ compute-task / free-keys

    def _compute_task(self, msg: dict) -> None:
        key = msg["key"]
        if key in self.data:
            self._report_held(key)
            return
        job = self._jobs.get(key)
        if job is not None:
            job.cancelled = False  # a pending or running execution serves this request
            return
        resources = msg.get("resources") or None
        if resources is not None:
            self._check_resources(key, resources)
        job = _Job(key, msg["spec"], _as_priority(msg.get("priority", ())), resources)
        self._jobs[key] = job
        who_has = msg.get("who_has")
        if who_has:
            self._collect_deps(job, who_has)
        if job.n_missing == 0:
            self._make_ready(job)

    def _report_held(self, key) -> None:
        """Asked to compute a key already in memory: report the value held."""
        self._fetched_keys.discard(key)  # the scheduler knows about it now
        now = time.time()
        self._send(_finished_report(key, self.data[key], now, now))

    def _check_resources(self, key, resources: dict) -> None:
        short = {name: qty for name, qty in resources.items()
                 if self.resources.get(name, 0) < qty}
        if short:
            logger.warning("worker %s: task %r needs resources %s but the worker has only %s;"
                           " it will never run here", self.address, key, short, self.resources)

    def _free_keys(self, msg: dict) -> None:
        data, jobs = self.data, self._jobs
        for key in msg["keys"]:
            data.pop(key, None)
            self._fetched_keys.discard(key)
            job = jobs.get(key)
            if job is None:
                continue
            if job.state == RUNNING:
                job.cancelled = True
            else:
                self._forget(job)

    def _forget(self, job: _Job) -> None:
        """Drop a job that is not running (its heap entry, if any, is skipped later)."""
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if job.state == FETCHING and job.borrowed:
            for dep in job.borrowed:
                fetch = self._fetches.get(dep)
                if fetch is not None and job in fetch.waiters:
                    fetch.waiters.remove(job)
        elif job.state == CONSTRAINED:
            self._constrained.remove(job)
        job.state = DONE
        self._release_borrowed(job)

    def _drop_everything(self) -> None:
        """Forget all data and tasks; running executions are cancelled, not waited for."""
        self.data.clear()
        self._fetched_keys.clear()
        self._borrowers.clear()
        running = {}
        for key, job in self._jobs.items():
            job.borrowed = None
            if job.state == RUNNING:
                job.cancelled = True
                running[key] = job
            else:
                job.state = DONE
        self._jobs = running
        self._ready.clear()
        self._constrained.clear()
        self._to_fetch.clear()
        for dep, fetch in list(self._fetches.items()):
            fetch.waiters.clear()
            fetch.holders.clear()
            fetch.failed.clear()
            if fetch.in_flight is None:
                del self._fetches[dep]

    # ------------------------------------------------------------------ execution

    def _make_ready(self, job: _Job) -> None:
        job.state = READY
        heapq.heappush(self._ready, (job.priority, next(self._sequence), job))

    def _feed(self) -> None:
        """Hand the best ready jobs to the threads, up to the prefetch bound."""
        ready = self._ready
        handed = self._n_handed
        limit = self._prefetch
        if not ready or handed >= limit or self._stopping:
            return
        put = self._queue.put
        heappop = heapq.heappop
        while ready and handed < limit:
            job = heappop(ready)[2]
            if job.state != READY:
                continue
            if job.resources is not None and not self._acquire(job.resources):
                job.state = CONSTRAINED
                self._constrained.append(job)
                continue
            job.state = RUNNING
            handed += 1
            put(job)
        self._n_handed = handed

    def _acquire(self, resources: dict) -> bool:
        free = self._free_resources
        for name, qty in resources.items():
            if free.get(name, 0) < qty:
                return False
        for name, qty in resources.items():
            free[name] -= qty
        return True

    def _release_resources(self, resources: dict) -> None:
        free = self._free_resources
        for name, qty in resources.items():
            free[name] += qty
        # constrained jobs go back to the heap; _feed holds back those still not covered
        for job in self._constrained:
            job.state = READY
            heapq.heappush(self._ready, (job.priority, next(self._sequence), job))
        self._constrained.clear()

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
        while True:
            job = get()
            if job is None:
                return
            if job.cancelled or self._stopping:
                append((job, None, None))  # skipped: not started
            else:
                append(_run_job(job))
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    loop.call_soon_threadsafe(drain)
                except RuntimeError:  # the loop is closed: nobody wants the outcome
                    return

    def _drain_outcomes(self) -> None:
        """On the loop: store and report every outcome the threads have produced."""
        # cleared before draining: an outcome appended from now on schedules a new call
        self._wake_pending = False
        outcomes = self._outcomes
        if self.status != RUNNING_STATUS:
            outcomes.clear()
            return
        data, fetched = self.data, self._fetched_keys
        comm = self._scheduler_comm
        send = comm.send if comm is not None and not comm.closed else None
        drained = 0
        released = False
        while outcomes:
            job, report, value = outcomes.popleft()
            drained += 1
            if job.resources is not None:
                self._release_resources(job.resources)
                released = True
            if job.cancelled or job.state != RUNNING:
                self._finish(job)
            elif report is None:  # skipped while cancelled, then adopted again: rerun it
                self._make_ready(job)
            else:
                self._finish(job)
                if report["op"] == "task-finished":
                    data[job.key] = value
                    if fetched:  # computed here while a copy was fetched: ours now
                        fetched.discard(job.key)
                if send is not None:
                    try:
                        send(report)
                    except CommClosedError:
                        send = None
        self._n_handed -= drained
        if released or self._ready:
            self._feed()

    def _finish(self, job: _Job) -> None:
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        job.state = DONE
        if job.borrowed is not None:
            self._release_borrowed(job)

    async def _stop_threads(self) -> None:
        """Tell the threads to stop; wait briefly for those busy with a task."""
        self._stopping = True
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + THREAD_JOIN_TIMEOUT
        while any(t.is_alive() for t in self._threads) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        busy = sum(t.is_alive() for t in self._threads)
        if busy:
            logger.warning("worker %s: %d executor thread(s) still running a task; left "
                           "behind as daemon threads", self.address, busy)

    # ------------------------------------------------------------------ dependencies

    def _collect_deps(self, job: _Job, who_has: dict) -> None:
        """Take local dependencies now; register the job as waiting for the others."""
        data = self.data
        for dep, holders in who_has.items():
            if dep in data:
                job.deps[dep] = data[dep]
                if dep in self._fetched_keys:
                    self._borrow(job, dep)
                continue
            self._borrow(job, dep)
            job.n_missing += 1
            fetch = self._fetches.get(dep)
            if fetch is None:
                fetch = self._fetches[dep] = _Fetch(dep)
            fetch.waiters.append(job)
            for holder in holders:
                if holder == self.address:  # the scheduler thinks we hold it; we do not
                    if holder not in fetch.failed:
                        fetch.failed.append(holder)
                elif holder not in fetch.holders and holder not in fetch.failed:
                    fetch.holders.append(holder)
            if fetch.in_flight is None:
                self._to_fetch.add(dep)

    def _borrow(self, job: _Job, dep) -> None:
        self._borrowers[dep] = self._borrowers.get(dep, 0) + 1
        if job.borrowed is None:
            job.borrowed = [dep]
        else:
            job.borrowed.append(dep)

    def _release_borrowed(self, job: _Job) -> None:
        """The job is gone: drop fetched copies that no other pending job needs."""
        if not job.borrowed:
            return
        borrowers = self._borrowers
        for dep in job.borrowed:
            count = borrowers.get(dep, 0) - 1
            if count > 0:
                borrowers[dep] = count
                continue
            borrowers.pop(dep, None)
            if dep in self._fetched_keys:
                self._fetched_keys.discard(dep)
                self.data.pop(dep, None)
        job.borrowed = None

    def _start_fetches(self) -> None:
        """Ask one holder for each wanted dependency: one request per peer."""
        to_fetch, self._to_fetch = self._to_fetch, set()
        by_peer: dict = {}
        for dep in to_fetch:
            fetch = self._fetches.get(dep)
            if fetch is None or fetch.in_flight is not None:
                continue
            if not fetch.waiters:
                del self._fetches[dep]
                continue
            peer = _pick_holder(fetch.holders, by_peer)
            if peer is None:
                self._give_up(fetch)
                continue
            fetch.holders.remove(peer)
            fetch.in_flight = peer
            by_peer.setdefault(peer, []).append(dep)
        for peer, deps in by_peer.items():
            task = self._loop.create_task(self._fetch_from(peer, deps))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _fetch_from(self, peer: str, deps: list) -> None:
        """One get-data request to one peer; then hand the outcome to _fetch_done."""
        values: dict = {}
        comm = None
        try:
            comm = await self._peer_comm(peer)
            await comm.write([{"op": "get-data", "keys": deps}])
            reply = (await comm.read())[0]
            if reply["op"] != "data":
                raise _BadRequest(f"get-data answered with {reply['op']!r}")
            self._return_peer_comm(peer, comm)
            comm = None
            for key, frames in reply["data"].items():
                values[key] = loads_data(frames)
        except Exception as exc:  # noqa: BLE001 - any failure means: try another holder
            logger.warning("worker %s could not fetch %d key(s) from %s: %s: %s",
                           self.address, len(deps), peer, type(exc).__name__, exc)
        finally:
            if comm is not None:  # a failed exchange leaves the connection unusable
                comm.abort()
        if self.status == RUNNING_STATUS:
            self._fetch_done(peer, deps, values)

    def _fetch_done(self, peer: str, deps: list, values: dict) -> None:
        for dep in deps:
            fetch = self._fetches.get(dep)
            if fetch is None or fetch.in_flight != peer:
                continue
            fetch.in_flight = None
            if dep not in values:
                fetch.failed.append(peer)
                self._to_fetch.add(dep)
                continue
            del self._fetches[dep]
            if not fetch.waiters:
                continue  # nobody needs it any more
            value = self.data.get(dep, values[dep])
            if dep not in self.data:
                self.data[dep] = value
                self._fetched_keys.add(dep)
            for job in fetch.waiters:
                job.deps[dep] = value
                job.n_missing -= 1
                if job.n_missing == 0:
                    self._make_ready(job)
        if self._to_fetch:
            self._start_fetches()
        self._feed()

    def _give_up(self, fetch: _Fetch) -> None:
        """No holder could provide a dependency: give its waiting tasks back."""
        del self._fetches[fetch.key]
        logger.warning("worker %s: no holder could provide %r (failed: %s); rescheduling %d "
                       "task(s)", self.address, fetch.key, fetch.failed, len(fetch.waiters))
        for errant in fetch.failed:
            self._send({"op": "missing-data", "key": fetch.key, "errant_worker": errant})
        for job in list(fetch.waiters):
            self._send({"op": "reschedule", "key": job.key})
            self._forget(job)

    async def _peer_comm(self, peer: str) -> Comm:
        idle = self._peer_pool.get(peer)
        while idle:
            comm = idle.pop()
            if not comm.closed:
                return comm
        return await connect(peer, {"role": "worker", "address": self.address},
                             timeout=self.connect_timeout,
                             security=self.security)

    def _return_peer_comm(self, peer: str, comm: Comm) -> None:
        idle = self._peer_pool.setdefault(peer, [])
        if self.status != RUNNING_STATUS or len(idle) >= MAX_IDLE_PEER_COMMS:
            comm.abort()
        else:
            idle.append(comm)

    # ------------------------------------------------------------------ serving peers

    async def _serve_peer(self, comm: Comm) -> None:
        """Answer a peer's requests, one reply frame per request frame."""
        self._served.add(comm)
        try:
            while True:
                msgs = await comm.read()
                await comm.write([self._answer(comm, msg) for msg in msgs])
        except ProtocolError as exc:
            logger.warning("worker %s: closing connection from %s: %s",
                         self.address, comm.peer_address, exc)
        except CommClosedError:
            pass
        except Exception as exc:  # noqa: BLE001 - a bad request closes this connection only
            logger.warning("worker %s: closing connection from %s after a bad request: %s: %s",
                         self.address, comm.peer_address, type(exc).__name__, exc)
        finally:
            self._served.discard(comm)
            comm.abort()

    def _answer(self, comm: Comm, msg: dict) -> dict:
        op = msg["op"]
        if op == "get-data":
            return self._get_data(msg)
        if op == "put-data":
            if comm.extra.get("role") != "client":  # workers only ever read from peers
                raise _BadRequest(f"put-data from a {comm.extra.get('role')!r} connection")
            return self._put_data(msg)
        if op == "ping":
            return {"op": "pong"}
        raise _BadRequest(f"unknown operation {op!r}")

    def _get_data(self, msg: dict) -> dict:
        keys = msg.get("keys")
        if not isinstance(keys, (list, tuple)):
            raise _BadRequest("'get-data' needs a list of 'keys'")
        data, missing = {}, []
        for key in keys:
            if key not in self.data:
                missing.append(key)
                continue
            try:
                data[key] = [Blob(frame) for frame in dumps_data(self.data[key])]
            except Exception:  # an unpicklable value is reported missing
                logger.exception("worker %s cannot serialize %r", self.address, key)
                missing.append(key)
        return {"op": "data", "data": data, "missing": missing}

    def _put_data(self, msg: dict) -> dict:
        items = msg.get("data")
        if not isinstance(items, dict):
            raise _BadRequest("'put-data' needs a map 'data' of key -> frames")
        values = {key: loads_data(frames) for key, frames in items.items()}
        self.data.update(values)
        self._fetched_keys.difference_update(values)
        return {"op": "ok"}


# ---------------------------------------------------------------------- helpers


def _run_job(job: _Job) -> tuple:
    """On an executor thread: run one job; ``(job, report, value)``."""
    start = time.time()
    try:
        value = loads_spec(job.spec)(job.deps)
    except BaseException as exc:  # noqa: BLE001 - any failure of user code is the task's
        stop = time.time()
        job.spec = job.deps = None
        return job, _erred_report(job.key, exc, start, stop), None
    stop = time.time()
    job.spec = job.deps = None  # release dependency values as soon as possible
    return job, _finished_report(job.key, value, start, stop), value


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


def _as_priority(priority) -> tuple:
    """Priorities compare as tuples (lower runs first), whatever shape they came in."""
    if type(priority) is tuple:
        return priority
    if isinstance(priority, list):
        return tuple(priority)
    return (priority,)


def _pick_holder(holders: list, chosen: dict) -> str | None:
    """A holder already asked in this burst if possible (fewer requests), else a random one."""
    if not holders:
        return None
    for holder in holders:
        if holder in chosen:
            return holder
    return random.choice(holders)


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
