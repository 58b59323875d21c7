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
import itertools
import logging
import os
import sys
import threading

from .cluster import Cluster, cluster_security
from .nanny import parse_memory_limit
from .processes import stop_processes

logger = logging.getLogger("distributed_server.cluster")


def local_cluster_security(address: str):
    """The `Security` of a cluster this process started whose scheduler listens at
    ``address`` (``tcp://host:port``), or None."""
    return cluster_security(address)


class LocalCluster(Cluster):
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
    token in it when the cluster has a token. `scale` and `adapt` (`Cluster`) change the
    number of workers; ``n_workers=0`` with ``adapt()`` starts them with the work.
    """

    def __init__(self, n_workers: int | None = None, threads_per_worker: int = 1,
                 processes: bool = True, *, host: str = "127.0.0.1", scheduler_port: int = 0,
                 worker_saturation: float | None = None, validate: bool = False,
                 timeout: float = 30.0, log_level: str = "WARNING",
                 security=None, memory_limit="auto",
                 dashboard_address: str | None = ":8787"):
        super().__init__(security)
        if n_workers is None:
            n_workers = max(1, (os.cpu_count() or 1) // threads_per_worker)
        self.memory_limit = parse_memory_limit(memory_limit, max(n_workers, 1))  # 0: none
        self.n_workers = n_workers
        self.threads_per_worker = threads_per_worker
        self.processes = processes
        self.dashboard_address = dashboard_address
        self._loop_thread: _LoopThread | None = None
        self._servers: list = []  # the scheduler, with processes=False
        self._workers: list = []  # nanny processes, or Worker objects (processes=False)
        self._worker_names: list = []  # the name of each of _workers
        self._names = itertools.count()
        self._host = host
        self._log_level = log_level
        try:
            if processes:
                extra = []
                if worker_saturation is not None:  # else the scheduler reads configuration
                    extra += ["--worker-saturation", str(worker_saturation)]
                if validate:
                    extra.append("--validate")
                self._start_scheduler(host, scheduler_port, timeout, log_level,
                                      dashboard_address, tuple(extra))
            else:
                self._start_in_thread(host, scheduler_port, worker_saturation, validate)
            for _ in range(n_workers):
                self._start_worker()
            self.wait_for_workers(n_workers, timeout)
        except BaseException:
            self.close()
            raise

    def __repr__(self):
        kind = "processes" if self.processes else "threads"
        return (f"<LocalCluster {self.scheduler_address} {len(self._workers)} workers x "
                f"{self.threads_per_worker} threads ({kind})>")

    # ------------------------------------------------------------------ the engine's part

    @property
    def worker_names(self) -> list:
        """The names of the workers started and not stopped, oldest first."""
        return list(self._worker_names)

    def _start_worker(self) -> list:
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
            worker = self._spawn(
                [sys.executable, "-m", "distributed_server.cli", "worker",
                 self.scheduler_address, "--nthreads", str(self.threads_per_worker),
                 "--name", name, "--memory-limit", str(self.memory_limit),
                 "--log-level", self._log_level],
                quiet=("Worker at ",))
        # both lists together, once it started: scale_down pairs them by name
        self._workers.append(worker)
        self._worker_names.append(name)
        self.n_workers = len(self._workers)
        return [name]

    def _stop_workers(self, names: list, timeout: float) -> None:
        leaving = []
        for name in names:
            i = self._worker_names.index(name)
            del self._worker_names[i]
            leaving.append(self._workers.pop(i))
        self.n_workers = len(self._workers)
        if self.processes:
            for proc in leaving:
                self._procs.remove(proc)
            stop_processes(leaving, timeout)
        else:
            for worker in leaving:
                self._loop_thread.run(worker.close(), timeout=timeout)

    def _check_workers(self) -> None:
        """A nanny that exited (killed: a nanny that lost its worker starts it again) is
        dropped from the plan, so that scaling starts a new one if still wanted."""
        if not self.processes:
            return
        for name, proc in list(zip(self._worker_names, self._workers)):
            if proc.poll() is not None:
                logger.warning("the nanny of %s exited (code %s); a new worker replaces it "
                               "if the cluster still wants one", name, proc.returncode)
                i = self._workers.index(proc)
                del self._workers[i], self._worker_names[i]
                self._procs.remove(proc)
        self.n_workers = len(self._workers)

    def worker_processes(self) -> list:
        """The worker processes running now (psutil.Process), without their nanny; empty
        with ``processes=False``. A worker the nanny restarted is a new process."""
        import psutil

        found = []
        for proc in list(self._workers) if self.processes else ():
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
        self._register_credentials()

    # ------------------------------------------------------------------ stop

    def _close_workers(self, timeout: float) -> None:
        if self._loop_thread is not None:
            for server in [*reversed(self._workers), *reversed(self._servers)]:
                try:
                    self._loop_thread.run(server.close(), timeout=timeout)
                except Exception:  # noqa: BLE001 - shutting down regardless
                    logger.exception("error closing %r", server)
            self._servers.clear()
            self._loop_thread.stop()
            self._loop_thread = None
        self._workers.clear()
        self._worker_names.clear()


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
