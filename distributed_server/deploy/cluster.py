"""What every cluster manager shares: a scheduler it started, workers it starts and
stops through its engine (processes on this machine, batch jobs, ...), and `scale`,
`adapt`, `close`, `get_logs` on top.

A manager subclasses `Cluster` and gives three things: ``_start_worker()`` (start one
more worker, or one more unit of workers, through the engine; return their names),
``_stop_workers(names, timeout)`` (stop them; they were retired first when possible)
and ``worker_names`` (the names it has started and not stopped, oldest first: the
cluster's size as the manager planned it, joined or not). Everything else is here:
scaling down asks the scheduler which workers are best let go and retires them
gracefully (their results move to the workers that stay) before the engine stops them.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import subprocess
import sys
import threading
import time
import uuid
import weakref

from ..comm import CommClosedError, connect
from ..security import ENVIRONMENT_VARIABLES, Security, new_token
from .processes import (
    ClusterError,
    die_with_parent,
    pass_through,
    read_address,
    start_in_spawner,
    stop_processes,
)
from .scheduler_view import SchedulerView

__all__ = ["Cluster", "cluster_security", "scheduler_request"]

#: Seconds a graceful retirement may take (its tasks finish, its results move) before
#: scaling down gives up on it.
RETIRE_TIMEOUT = 600.0

logger = logging.getLogger("distributed_server.cluster")

#: The credentials of the clusters this process started and has not closed, by
#: scheduler address: ``Client(cluster.scheduler_address)`` in the same process finds
#: them here. Kept in this process's memory only, never written anywhere.
_CREDENTIALS: dict = {}
_CREDENTIALS_LOCK = threading.Lock()


def cluster_security(address: str) -> Security | None:
    """The `Security` of a cluster this process started whose scheduler listens at
    ``address`` (``tcp://host:port``), or None."""
    with _CREDENTIALS_LOCK:
        return _CREDENTIALS.get(address)


class Cluster:
    """A scheduler and workers started by a cluster manager (the base of `LocalCluster`
    and the batch-system managers).

    ``security`` is the cluster's credentials; by default a fresh random token (no
    TLS), which the processes get through their environment (or a file only the user
    can read) and `Client(cluster)` uses. ``dashboard_link`` is the status page's URL,
    with the dashboard token in it.
    """

    def __init__(self, security: Security | None = None) -> None:
        self.security = security if security is not None else Security(token=new_token())
        self.scheduler_address = ""
        self.dashboard_url: str | None = None  # without the token
        self._procs: list = []  # the processes started on this machine; the scheduler first
        self._scale_lock = threading.RLock()
        self._adaptive = None
        self._closing = False  # set first thing by close(): no scaling from then on
        self._closed = False
        self._finalizer = weakref.finalize(self, stop_processes, self._procs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ the engine's part

    def _start_worker(self) -> list:
        """Start one more worker (or one unit of workers) through the engine; their names."""
        raise NotImplementedError

    def _stop_workers(self, names: list, timeout: float) -> None:
        """Stop the named workers through the engine."""
        raise NotImplementedError

    @property
    def worker_names(self) -> list:
        """The names of the workers started and not stopped, oldest first."""
        raise NotImplementedError

    def _check_workers(self) -> None:
        """Called before each scaling decision: a manager replaces workers the engine
        lost while they were still wanted. Nothing by default."""

    def check_workers(self) -> None:
        """Let the manager notice workers its engine lost (a killed nanny, a batch job
        that ended): those still wanted are started again at the next scaling; `adapt`
        calls it at every step."""
        with self._scale_lock:
            self._check_workers()

    # ------------------------------------------------------------------ the scheduler

    def _start_scheduler(self, host: str, port: int, timeout: float, log_level: str,
                         dashboard_address: str | None, extra: tuple = ()) -> None:
        """Start ``dcore scheduler`` as a process of this machine and read its addresses."""
        cmd = [sys.executable, "-m", "distributed_server.cli", "scheduler", "--host", host,
               "--port", str(port), "--log-level", log_level, *extra]
        if dashboard_address is None:
            cmd.append("--no-dashboard")
        else:
            cmd += ["--dashboard-address", dashboard_address]
        scheduler = self._spawn(cmd, keep=("Scheduler at ", "Dashboard at "))
        self.scheduler_address = read_address(scheduler, "Scheduler at ", timeout)
        if dashboard_address is not None:
            self.dashboard_url = read_address(scheduler, "Dashboard at ", timeout)
        self._register_credentials()

    def _register_credentials(self) -> None:
        with _CREDENTIALS_LOCK:
            _CREDENTIALS[self.scheduler_address] = self.security

    def _spawn(self, cmd: list, keep: tuple | str | None = None, quiet: tuple = (),
               env: dict | None = None) -> subprocess.Popen:
        """Start a process of this machine that dies with this one; the cluster's
        credentials go in its environment (``ps`` shows a command line to everyone)."""
        child_env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARIABLES}
        child_env.update(self.security.environment())
        child_env.update(env or {})

        def popen():
            return subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                env=child_env,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)

        proc = start_in_spawner(popen)
        proc.lines = pass_through(proc, keep, quiet)
        self._procs.append(proc)
        return proc

    def request(self, msg: dict, timeout: float = 10.0):
        """One request to the scheduler (``{"op": ..., fields}``) on a connection of its
        own; its result. Raises ClusterError if the scheduler refuses it."""
        return _run_in_new_loop(scheduler_request(self.scheduler_address, msg, timeout,
                                                  self.security))

    def scheduler_info(self, timeout: float = 10.0) -> dict:
        """The scheduler's identity: its workers, task counts, compiled or not."""
        return self.request({"op": "identity"}, timeout)

    @property
    def scheduler(self) -> SchedulerView:
        """A read-only snapshot of the scheduler, taken now: ``.workers`` (address -> a
        view with ``name``, ``pid``, ``nthreads``, ``memory_limit``, ...) and the task
        counts, for code written against dask's ``cluster.scheduler``."""
        return SchedulerView(self.scheduler_info())

    @property
    def dashboard_link(self) -> str | None:
        """The status page's URL, carrying the dashboard token (`Security.dashboard_token`:
        it admits to the HTTP endpoints only) when the cluster has a token; None without
        a dashboard."""
        if self.dashboard_url is None:
            return None
        token = self.security.dashboard_token()
        return self.dashboard_url if token is None else f"{self.dashboard_url}?token={token}"

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
        """Raise ClusterError if a process this manager started here has exited."""
        for proc in self._procs:
            if proc.poll() is not None:
                raise ClusterError(f"{' '.join(proc.args[3:5])} exited with code "
                                   f"{proc.returncode}")

    def get_logs(self, n: int | None = None) -> dict:
        """The last ``n`` log lines (all kept, for None) of the scheduler (under
        ``"Scheduler"``) and of each worker (under its address), oldest first."""
        found = {"Scheduler": list(self.request({"op": "scheduler-logs", "n": n}))}
        workers = self.request({"op": "worker-logs", "n": n, "timeout": 10.0}, 20.0)
        for address, lines in workers["logs"].items():
            found[address] = list(lines)
        for address, why in workers["silent"].items():
            found[address] = [f"(no answer: {why})"]
        return found

    # ------------------------------------------------------------------ scaling

    def scale(self, n: int, timeout: float = 30.0) -> None:
        """Run ``n`` workers: start new ones, or let go of the most recently started ones
        (those that have not joined yet first), and wait until the scheduler lists
        ``n``. Stops `adapt` if it was on (which lets go of the workers the scheduler
        finds best to close instead).

        Workers leave gracefully: the scheduler first copies every result only they
        hold to the workers that stay, then they stop. If that cannot be done (no worker
        stays, or copies fail), they stop all the same and the scheduler recomputes what
        is still wanted."""
        if type(n) is not int or n < 0:
            raise ValueError(f"scale needs a number of workers >= 0, got {n!r}")
        self._stop_adaptive("scale() was called")
        self.scale_to(n, timeout, ask_scheduler=False)
        self._wait_for_exactly(n, timeout)

    def scale_to(self, n: int, timeout: float = 30.0, ask_scheduler: bool = True) -> None:
        """Start or let go of workers until ``n`` are planned, without waiting for new
        ones to join (what `adapt` calls). Those let go: first any that have not joined
        yet, newest first; then, with ``ask_scheduler``, the scheduler's choice
        (`SchedulerState.workers_to_close`: idle ones holding the least data, then idle
        longest), else the newest."""
        with self._scale_lock:
            if self._closing:
                return
            self._check_workers()
            planned = len(self.worker_names)
            while planned < n:
                planned += len(self._start_worker())
            if planned > n:
                self.scale_down(self._choose_to_close(planned - n, ask_scheduler), timeout,
                                force=not ask_scheduler)

    def _choose_to_close(self, k: int, ask_scheduler: bool) -> list:
        """The names of ``k`` of this manager's workers to let go (see `scale_to`)."""
        names = self.worker_names
        workers = self.scheduler_info()["workers"].values()
        joined = {info["name"] for info in workers}
        chosen = [name for name in reversed(names) if name not in joined][:k]
        # retired already (a retirement that outlasted the last try): let go of those next
        chosen += [info["name"] for info in workers
                   if info.get("status", "running") != "running" and info["name"] in names
                   and info["name"] not in chosen][:k - len(chosen)]
        if len(chosen) < k and ask_scheduler:
            ours = set(names)
            for entry in self.request({"op": "workers-to-close", "n": len(joined)}):
                if entry["name"] in ours and entry["name"] not in chosen:
                    chosen.append(entry["name"])
                    if len(chosen) == k:
                        break
        for name in reversed(names):
            if len(chosen) == k:
                break
            if name not in chosen:
                chosen.append(name)
        return chosen

    def scale_down(self, names: list, timeout: float = 30.0, force: bool = True) -> list:
        """Retire the named workers (they finish the tasks they were given, and their
        results move to the others), then stop them through the engine; the names
        stopped. If the retirement fails (no other worker can take the results, copies
        fail), ``force`` stops them all the same (`scale`: the scheduler recomputes what
        is still wanted); without it (`adapt`) none is stopped, and a later step tries
        again. When every worker goes there is nowhere to move results: they are lost."""
        with self._scale_lock:
            ours = set(self.worker_names)
            names = [name for name in names if name in ours]
            if not names:
                return []
            if len(names) < len(self.worker_names) and not self._retire(names, timeout) \
                    and not force:
                logger.warning("scaling down: %s not retired; they stay for now", names)
                return []
            self._stop_workers(names, timeout)
            return names

    def _retire(self, names: list, timeout: float) -> bool:
        """Ask the scheduler to retire the named workers: they finish their tasks and
        their results move elsewhere (they stay connected, taking no task). True if every
        one was retired; a refusal or a timeout is logged."""
        joined = {info["name"] for info in self.scheduler_info()["workers"].values()}
        names = [name for name in names if name in joined]
        if not names:
            return True
        try:
            result = self.request({"op": "retire-workers", "workers": names,
                                   "close_workers": False}, max(timeout, RETIRE_TIMEOUT))
        except Exception as exc:  # noqa: BLE001 - the caller decides (force or not)
            logger.warning("scaling down: could not retire %s gracefully: %s", names, exc)
            return False
        for address, why in result.get("refused", {}).items():
            logger.warning("scaling down: worker %s was not retired gracefully (%s)",
                           address, why)
        return not result.get("refused")

    def _wait_for_exactly(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.scheduler_info()["workers"]) != n:
            if time.monotonic() > deadline:
                raise ClusterError(f"the scheduler does not list {n} workers after "
                                   f"{timeout}s")
            self._check_processes()
            time.sleep(0.05)

    def adapt(self, minimum: int = 0, maximum: float = math.inf,
              target_duration="5s", interval="1s", wait_count: int = 3):
        """Grow and shrink the cluster with its work from now on (`Adaptive`): every
        ``interval`` ask the scheduler how many workers the work wants within
        ``target_duration``, bounded by ``minimum`` and ``maximum``; scale up at once,
        scale down only once the answer has stayed lower ``wait_count`` times, always by
        graceful retirement. Replaces an earlier `adapt`; `scale` or `close` stops it.
        Returns the `Adaptive`."""
        from .adaptive import Adaptive

        adaptive = Adaptive(self, minimum=minimum, maximum=maximum,
                            target_duration=target_duration, interval=interval,
                            wait_count=wait_count)
        self._stop_adaptive("adapt() was called again")
        self._adaptive = adaptive
        adaptive.start()
        return adaptive

    def _stop_adaptive(self, why: str) -> None:
        adaptive, self._adaptive = self._adaptive, None
        if adaptive is not None:
            logger.info("adaptive scaling stops: %s", why)
            adaptive.stop()

    # ------------------------------------------------------------------ stop

    def close(self, timeout: float = 10.0) -> None:
        """Stop adaptive scaling, every worker and the scheduler. A scaling step under
        way finishes first; none starts after."""
        self._closing = True
        self._stop_adaptive("the cluster closes")
        with self._scale_lock:
            with _CREDENTIALS_LOCK:
                if _CREDENTIALS.get(self.scheduler_address) is self.security:
                    del _CREDENTIALS[self.scheduler_address]
            try:
                self._close_workers(timeout)
            finally:
                stop_processes(self._procs, timeout)
                self._closed = True
                self._finalizer.detach()

    def _close_workers(self, timeout: float) -> None:
        """Stop every worker before the scheduler goes (the engine's part of `close`)."""
        names = list(self.worker_names)
        if names:
            self._stop_workers(names, timeout)


async def scheduler_request(address: str, msg: dict, timeout: float, security: Security):
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
