"""LocalCluster: a scheduler and N workers on this machine, started and stopped together.

With ``processes=True`` (the default) each is its own process, started with the same
``dcore`` commands one would run by hand: ``dcore scheduler`` and, per worker, ``dcore
worker``: a nanny that supervises its worker process (it restarts the worker when it
dies or passes its memory limit, and on `Client.restart`). `LocalCluster.scale` starts
or stops workers. With
``processes=False`` they share one background thread's event loop in this process (quick
to start, handy in tests; no nanny, no memory limit, no restart). Closing the cluster,
or the interpreter exiting, stops everything it started; on Linux the child processes
also die with their parent, so none is left orphaned. What the processes print passes
through to this process's stdout and stderr (nothing is kept), except the lines by
which they announce their addresses.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
import weakref

from ..comm import CommClosedError, connect
from ..security import ENVIRONMENT_VARIABLES, Security, new_token
from .nanny import parse_memory_limit
from .processes import (
    ClusterError,
    die_with_parent,
    pass_through,
    read_address,
    start_in_spawner,
    stop_processes,
)
from .scheduler_view import SchedulerView

logger = logging.getLogger("distributed_server.cluster")


#: The credentials of the clusters this process started and has not closed, by
#: scheduler address: ``Client(cluster.scheduler_address)`` in the same process finds
#: them here. Kept in this process's memory only, never written anywhere.
_CREDENTIALS: dict = {}
_CREDENTIALS_LOCK = threading.Lock()


def local_cluster_security(address: str) -> Security | None:
    """The `Security` of a LocalCluster this process started whose scheduler listens at
    ``address`` (``tcp://host:port``), or None."""
    with _CREDENTIALS_LOCK:
        return _CREDENTIALS.get(address)


class LocalCluster:
    """A scheduler and ``n_workers`` workers of ``threads_per_worker`` threads each.

    ``security`` is the cluster's credentials; by default a fresh random token (no
    TLS), which the processes get through their environment and `Client(cluster)` uses.
    ``memory_limit`` is each worker's: bytes (``"4GiB"``, ``4e9``), a fraction of this
    machine's memory (``0.5``), ``"auto"`` (the machine's memory divided by
    ``n_workers``) or 0 (none); with ``processes=True`` the nanny restarts a worker that
    passes 95% of it, and the worker finds it in ``DCORE_MEMORY_LIMIT``.

    ``dashboard_address`` is where the scheduler serves its status page and ``/metrics``
    (default ``":8787"`` on ``host``, a free port if that one is busy; ``":0"`` any free
    port; None: no HTTP server). ``dashboard_link`` is the page's URL, with the dashboard
    token in it when the cluster has a token.
    """

    def __init__(self, n_workers: int | None = None, threads_per_worker: int = 1,
                 processes: bool = True, *, host: str = "127.0.0.1", scheduler_port: int = 0,
                 worker_saturation: float | None = None, validate: bool = False,
                 timeout: float = 30.0, log_level: str = "WARNING",
                 security: Security | None = None, memory_limit="auto",
                 dashboard_address: str | None = ":8787"):
        if n_workers is None:
            n_workers = max(1, (os.cpu_count() or 1) // threads_per_worker)
        self.security = security if security is not None else Security(token=new_token())
        self.memory_limit = parse_memory_limit(memory_limit, n_workers)  # bytes, 0: none
        self.n_workers = n_workers
        self.threads_per_worker = threads_per_worker
        self.processes = processes
        self.scheduler_address = ""
        self.dashboard_address = dashboard_address
        self.dashboard_url: str | None = None  # without the token
        self._procs: list = []
        self._loop_thread: _LoopThread | None = None
        self._servers: list = []  # the scheduler, with processes=False
        self._workers: list = []  # nanny processes, or Worker objects (processes=False)
        self._worker_names: list = []  # the name of each of _workers
        self._names = itertools.count()
        self._host = host
        self._log_level = log_level
        self._finalizer = weakref.finalize(self, stop_processes, self._procs)
        try:
            if processes:
                self._start_processes(host, scheduler_port, worker_saturation, validate,
                                      timeout, log_level)
            else:
                self._start_in_thread(host, scheduler_port, worker_saturation, validate)
            self.wait_for_workers(n_workers, timeout)
        except BaseException:
            self.close()
            raise
        with _CREDENTIALS_LOCK:
            _CREDENTIALS[self.scheduler_address] = self.security

    def __repr__(self):
        kind = "processes" if self.processes else "threads"
        return (f"<LocalCluster {self.scheduler_address} {self.n_workers} workers x "
                f"{self.threads_per_worker} threads ({kind})>")

    def __enter__(self):
        return self

    @property
    def dashboard_link(self) -> str | None:
        """The status page's URL, carrying the dashboard token (`Security.dashboard_token`:
        it admits to the HTTP endpoints only) when the cluster has a token; None without
        a dashboard."""
        if self.dashboard_url is None:
            return None
        token = self.security.dashboard_token()
        return self.dashboard_url if token is None else f"{self.dashboard_url}?token={token}"

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ start

    def _start_processes(self, host, port, worker_saturation, validate, timeout, log_level):
        command = [sys.executable, "-m", "distributed_server.cli"]
        scheduler_cmd = command + ["scheduler", "--host", host, "--port", str(port),
                                   "--log-level", log_level]
        if worker_saturation is not None:  # else the scheduler reads configuration
            scheduler_cmd += ["--worker-saturation", str(worker_saturation)]
        if validate:
            scheduler_cmd.append("--validate")
        if self.dashboard_address is None:
            scheduler_cmd.append("--no-dashboard")
        else:
            scheduler_cmd += ["--dashboard-address", self.dashboard_address]
        scheduler = self._spawn(scheduler_cmd, keep=("Scheduler at ", "Dashboard at "))
        self.scheduler_address = read_address(scheduler, "Scheduler at ", timeout)
        if self.dashboard_address is not None:
            self.dashboard_url = read_address(scheduler, "Dashboard at ", timeout)
        self._log_level = log_level
        for _ in range(self.n_workers):
            self._add_worker()

    def _add_worker(self) -> None:
        """One more worker: a nanny process (``dcore worker``) and its worker, named
        ``worker-<i>``; a worker on the loop thread with ``processes=False``."""
        name = f"worker-{next(self._names)}"
        if not self.processes:
            from ..worker.server import Worker

            worker = Worker(self.scheduler_address, nthreads=self.threads_per_worker,
                            name=name, host=self._host, security=self.security,
                            memory_limit=0)  # one process for all: no per-worker limit
            self._loop_thread.run(worker.start())
        else:
            command = [sys.executable, "-m", "distributed_server.cli"]
            worker = self._spawn(
                command + ["worker", self.scheduler_address, "--nthreads",
                           str(self.threads_per_worker), "--name", name, "--memory-limit",
                           str(self.memory_limit), "--log-level", self._log_level],
                quiet=("Worker at ",))
        # both lists together, once it started: scale() pairs them to retire by name
        self._workers.append(worker)
        self._worker_names.append(name)

    def _spawn(self, cmd: list, keep: tuple | str | None = None,
               quiet: tuple = ()) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARIABLES}
        env.update(self.security.environment())  # not in argv: ps shows argv to everyone
        popen = functools.partial(
            subprocess.Popen, cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
            text=True, env=env,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        proc = start_in_spawner(popen)
        proc.lines = pass_through(proc, keep, quiet)
        self._procs.append(proc)
        return proc

    def worker_processes(self) -> list:
        """The worker processes running now (psutil.Process), without their nanny; empty
        with ``processes=False``. A worker the nanny restarted is a new process."""
        import psutil

        found = []
        for proc in self._procs[1:]:
            try:
                found += psutil.Process(proc.pid).children()
            except psutil.Error:
                pass
        return found

    def _start_in_thread(self, host, port, worker_saturation, validate):
        from ..scheduler.server import Scheduler

        self._loop_thread = _LoopThread()
        scheduler = self._loop_thread.run(Scheduler(
            host, port, worker_saturation=worker_saturation, validate=validate,
            security=self.security, dashboard_address=self.dashboard_address).start())
        self._servers.append(scheduler)
        self.scheduler_address = scheduler.address
        self.dashboard_url = scheduler.dashboard_url
        for _ in range(self.n_workers):
            self._add_worker()

    # ------------------------------------------------------------------ scale

    def scale(self, n: int, timeout: float = 30.0) -> None:
        """Run ``n`` workers: start new ones, or stop the most recently started ones.

        Workers leave gracefully: the scheduler first copies every result only they
        hold to the workers that stay (``retire-workers``), then they stop. If that
        cannot be done (no worker stays, or copies fail), they stop all the same and the
        scheduler recomputes what is still wanted. ``memory_limit`` stays what it was
        per worker."""
        if type(n) is not int or n < 0:
            raise ValueError(f"scale needs a number of workers >= 0, got {n!r}")
        while len(self._workers) < n:
            self._add_worker()
        leaving, names = [], []
        while len(self._workers) > n:
            leaving.append(self._workers.pop())
            names.append(self._worker_names.pop())
        if names and n > 0:
            self._retire(names, timeout)
        if self.processes:
            for proc in leaving:
                self._procs.remove(proc)
            stop_processes(leaving, timeout)
        else:
            for worker in leaving:
                self._loop_thread.run(worker.close(), timeout=timeout)
        self.n_workers = n
        self._wait_for_exactly(n, timeout)

    def _retire(self, names: list, timeout: float) -> None:
        """Ask the scheduler to move the named workers' results elsewhere (they stay
        connected, taking no task); a refusal is logged, the workers stop anyway."""
        try:
            result = _run_in_new_loop(_request(
                self.scheduler_address, {"op": "retire-workers", "workers": names,
                                         "close_workers": False}, timeout, self.security))
        except Exception as exc:  # noqa: BLE001 - scaling down goes on without it
            logger.warning("scaling down: could not retire %s gracefully: %s", names, exc)
            return
        for address, why in result.get("refused", {}).items():
            logger.warning("scaling down: worker %s was not retired gracefully (%s); its "
                           "results are recomputed where still wanted", address, why)

    def _wait_for_exactly(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.scheduler_info()["workers"]) != n:
            if time.monotonic() > deadline:
                raise ClusterError(f"the scheduler does not list {n} workers after "
                                   f"{timeout}s")
            self._check_processes()
            time.sleep(0.05)

    # ------------------------------------------------------------------ use

    def scheduler_info(self, timeout: float = 10.0) -> dict:
        """The scheduler's identity: its workers, task counts, compiled or not."""
        return _run_in_new_loop(_identity(self.scheduler_address, timeout, self.security))

    @property
    def scheduler(self) -> SchedulerView:
        """A read-only snapshot of the scheduler, taken now: ``.workers`` (address -> a
        view with ``name``, ``pid``, ``nthreads``, ``memory_limit``, ...) and the task
        counts, for code written against dask's ``cluster.scheduler``."""
        return SchedulerView(self.scheduler_info())

    def wait_for_workers(self, n: int, timeout: float = 30.0) -> None:
        """Block until the scheduler has ``n`` workers; raise ClusterError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_processes()
            try:
                workers = self.scheduler_info(timeout=max(deadline - time.monotonic(), 0.1))
            except (OSError, CommClosedError, asyncio.TimeoutError) as exc:
                raise ClusterError(f"cannot reach the scheduler at {self.scheduler_address}: "
                                   f"{exc}") from exc
            if len(workers["workers"]) >= n:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"only {len(workers['workers'])} of {n} workers joined "
                                   f"within {timeout}s")
            time.sleep(0.05)

    def _check_processes(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                raise ClusterError(f"{' '.join(proc.args[3:5])} exited with code "
                                   f"{proc.returncode}")

    # ------------------------------------------------------------------ stop

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker and the scheduler; wait for the processes to exit."""
        with _CREDENTIALS_LOCK:
            if _CREDENTIALS.get(self.scheduler_address) is self.security:
                del _CREDENTIALS[self.scheduler_address]
        if self._loop_thread is not None:
            for server in [*reversed(self._workers), *reversed(self._servers)]:
                try:
                    self._loop_thread.run(server.close(), timeout=timeout)
                except Exception:  # noqa: BLE001 - shutting down regardless
                    logger.exception("error closing %r", server)
            self._servers.clear()
            self._workers.clear()
            self._worker_names.clear()
            self._loop_thread.stop()
            self._loop_thread = None
        stop_processes(self._procs, timeout)
        self._workers.clear()
        self._worker_names.clear()
        self._finalizer.detach()


class _LoopThread:
    """An asyncio event loop running in a daemon thread; `run` waits for a coroutine."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="distributed-core-cluster")
        self._thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


async def _identity(address: str, timeout: float, security: Security) -> dict:
    return await _request(address, {"op": "identity"}, timeout, security)


async def _request(address: str, msg: dict, timeout: float, security: Security):
    """One request to the scheduler on a connection of its own; its result."""
    comm = await connect(address, {"role": "client", "client_id": f"probe-{uuid.uuid4().hex}"},
                         timeout=timeout, security=security)
    try:
        await comm.write([{**msg, "reqid": 0}])
        while True:
            for reply in await asyncio.wait_for(comm.read(), timeout):
                if reply.get("op") == "reply" and reply.get("reqid") == 0:
                    if "error" in reply:
                        raise ClusterError(f"the scheduler refused {msg['op']}: "
                                           f"{reply['error']}")
                    return reply["result"]
    finally:
        await comm.close()


def _run_in_new_loop(coro):
    """Run a coroutine to completion from sync code, even inside a running loop's thread."""
    result: list = []

    def target():
        try:
            result.append(("ok", asyncio.run(coro)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result.append(("error", exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join()
    kind, value = result[0]
    if kind == "error":
        raise value
    return value
