"""The nanny: a small supervisor that runs worker processes and restarts them.

What this module does
---------------------
- `Nanny` starts ``nworkers`` worker processes, each ``python -m distributed_server.cli
  worker SCHEDULER --no-nanny ...`` with the flags the nanny was given. Credentials
  reach a worker through its environment (`Security.environment`), never its argv
  (``ps`` shows argv to every user); so does its memory limit, in bytes:
  ``DCORE_MEMORY_LIMIT`` (`MEMORY_LIMIT_ENV`; 0 means none), which memory management
  inside the worker may read.
- One nanny process supervises all the workers of one ``dcore worker`` command (as dask's
  ``dask worker --nworkers N`` runs N nannies in one process): one process and one
  scheduler connection per machine instead of one each, and every worker is still
  supervised on its own (its own restarts, backoff and memory watch).
- A worker's stdout and stderr are the nanny's (inherited: they pass through untouched
  and nothing is kept). The worker tells the nanny its address over a private pipe (the
  file descriptor named by ``DCORE_NANNY_FD`` in its environment).
- A worker that dies (a non-zero exit, or a signal such as SIGKILL) is started again
  after a backoff: `BACKOFF_MIN` seconds, doubling up to `BACKOFF_MAX`, back to the
  minimum once a worker has run `HEALTHY_SECONDS`. A worker that exits with code 0 (the
  scheduler closed it, or it gave up on a scheduler that is gone) is not restarted; the
  nanny exits once none of its workers is left.
- Every `MEMORY_POLL_INTERVAL` seconds it reads each worker's resident memory (psutil);
  past ``terminate_fraction`` of the memory limit (default 0.95, as dask) the worker is
  killed (SIGKILL), with one WARNING line giving the figures, and restarted.
- It connects to the scheduler (handshake role ``"nanny"``) and keeps it told which
  worker addresses it supervises (``nanny-workers``); the scheduler may ask it to
  ``restart-workers`` (`Client.restart`): every worker is killed and started again at
  once. ``close`` from the scheduler means the cluster is shutting down: workers are
  not restarted any more. The connection is re-made if it drops. A scheduler that
  refuses the nanny's handshake (wrong credentials, TLS against plain TCP) is a mistake
  that waiting cannot fix: the nanny stops its workers and exits with code 1.
- SIGTERM or SIGINT stops the workers (SIGTERM, then SIGKILL after `STOP_GRACE` seconds)
  and the nanny. On Linux the workers also die with the nanny if it is killed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys

import psutil

from ..comm import CommClosedError, HandshakeError, connect
from ..security import ENVIRONMENT_VARIABLES, Security
from ..worker.memory import MEMORY_LIMIT_ENV

__all__ = ["MEMORY_LIMIT_ENV", "Nanny", "format_bytes", "machine_memory", "parse_memory_limit"]

logger = logging.getLogger("distributed_server.nanny")

#: The environment variable that gives a worker process its memory limit in bytes (0: none).
#: The fraction of its memory limit past which a worker is killed and restarted (as dask).
TERMINATE_FRACTION = 0.95
#: glibc's ``MALLOC_TRIM_THRESHOLD_`` for worker processes (bytes): freed memory past it
#: returns to the system.
MALLOC_TRIM_THRESHOLD = 64 * 1024
#: The exit code of a worker that reached its ``--lifetime`` with ``--lifetime-restart``:
#: the nanny starts a fresh one at once.
LIFETIME_EXIT_CODE = 75
#: Seconds between two readings of a worker's memory.
MEMORY_POLL_INTERVAL = 0.25
#: Restart backoff: the first delay, the longest, and how long a worker must run before
#: the delay goes back to the first.
BACKOFF_MIN = 0.1
BACKOFF_MAX = 10.0
HEALTHY_SECONDS = 60.0
#: Seconds a stopping worker gets between SIGTERM and SIGKILL.
STOP_GRACE = 5.0
#: The environment variable naming the pipe on which a worker writes its address.
ADDRESS_FD_ENV = "DCORE_NANNY_FD"

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
          "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}


# ---------------------------------------------------------------------------- memory limits


def machine_memory() -> int:
    """The memory this machine (or its cgroup, if that is smaller) gives processes."""
    total = psutil.virtual_memory().total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
        break
    return total


def parse_memory_limit(value, nworkers: int = 1, total: int | None = None) -> int:
    """A worker's memory limit in bytes (0: no limit).

    ``value``: ``None`` or ``"auto"`` (this machine's memory divided by ``nworkers``), a
    number of bytes (int, or text such as ``"4GiB"``, ``"4GB"``, ``"4e9"``), or a number
    from 0 to 1 (exclusive of 0; ``"0.5"``, ``1``) as a fraction of the machine's
    memory. ``0`` means no limit. A limit above the machine's memory is capped to it.
    """
    total = machine_memory() if total is None else total
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return max(total // max(nworkers, 1), 1)
    if isinstance(value, bool):
        raise ValueError(f"memory limit {value!r}: give bytes, a fraction or 'auto'")
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([a-z]*)", text)
        if match is None or match.group(2) not in _UNITS and match.group(2):
            raise ValueError(f"memory limit {value!r} is not bytes ('4GiB', '4GB', '4e9'), "
                             "a fraction ('0.5') or 'auto'")
        number = float(match.group(1))
        if match.group(2):
            return min(int(number * _UNITS[match.group(2)]), total)
        value = number
    if not isinstance(value, (int, float)) or value != value or value < 0:
        raise ValueError(f"memory limit {value!r}: give bytes, a fraction or 'auto'")
    if value == 0:
        return 0
    if value <= 1:
        return max(int(value * total), 1)
    return min(int(value), total)


def format_bytes(n: float) -> str:
    """``1.50 GiB``-style text of a byte count."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                       ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------- the nanny


class _Slot:
    """One supervised worker: its current process (if any) and its restart record."""

    __slots__ = ("address", "delay", "done", "index", "last_label", "memory_kill", "name",
                 "proc", "ps", "restart_requested", "restarts", "wake")

    def __init__(self, index: int, name: str | None) -> None:
        self.index = index
        self.name = name
        self.proc: asyncio.subprocess.Process | None = None
        self.ps: psutil.Process | None = None  # the same process, for memory readings
        self.address: str | None = None  # known once the worker wrote it to the pipe
        self.last_label = ""  # the label of the process that ran last
        self.delay = BACKOFF_MIN
        self.restarts = 0
        self.restart_requested = False  # killed on purpose: start again at once
        self.memory_kill: str | None = None  # the figures, when killed for its memory
        self.done = False  # exited cleanly: not restarted
        self.wake = asyncio.Event()  # cuts a backoff short (a restart request, closing)

    @property
    def label(self) -> str:
        name = self.name if self.name is not None else f"#{self.index}"
        return f"{name} at {self.address}" if self.address else str(name)


class Nanny:
    """Supervises ``nworkers`` worker processes of the scheduler at ``scheduler_address``.

    ``worker_args`` are extra ``dcore worker`` flags for every worker (``--nthreads``,
    ``--resources``, ``--host``, ``--log-level``, ...); ``names`` one name per worker
    (or None). ``memory_limit`` is each worker's limit in bytes (0: none) and
    ``terminate_fraction`` the fraction of it past which a worker is killed and
    restarted (None: never). ``security`` is the cluster's credentials.
    ``await nanny.run()`` starts everything and returns when the nanny is done: 0, or
    1 if the scheduler refused it.
    """

    def __init__(self, scheduler_address: str, nworkers: int = 1, *,
                 worker_args: list | None = None, names: list | None = None,
                 memory_limit: int = 0, terminate_fraction: float | None = TERMINATE_FRACTION,
                 security: Security | None = None) -> None:
        if nworkers < 1:
            raise ValueError(f"a nanny needs at least one worker, not {nworkers}")
        names = list(names) if names is not None else [None] * nworkers
        if len(names) != nworkers:
            raise ValueError(f"{len(names)} names for {nworkers} workers")
        self.scheduler_address = scheduler_address
        self.worker_args = list(worker_args or [])
        self.memory_limit = int(memory_limit)
        self.terminate_fraction = terminate_fraction
        self.security = security if security is not None else Security()
        self.slots = [_Slot(i, name) for i, name in enumerate(names)]
        self._closing = False
        self._stopped_by_scheduler = False
        self._refused = False
        self._comm = None
        self._tasks: list = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        alive = sum(slot.proc is not None and slot.proc.returncode is None
                    for slot in self.slots)
        return f"<Nanny {self.scheduler_address} workers={alive}/{len(self.slots)}>"

    # ------------------------------------------------------------------ life cycle

    async def run(self) -> int:
        """Start the workers, supervise them until the nanny is stopped or none is left."""
        self._loop = asyncio.get_running_loop()
        supervisors = [self._loop.create_task(self._supervise(slot)) for slot in self.slots]
        self._tasks = [self._loop.create_task(self._watch_memory()),
                       self._loop.create_task(self._stay_connected())]
        try:
            await asyncio.gather(*supervisors)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._comm is not None:
                self._comm.abort()
        logger.info("nanny: every worker has exited; stopping")
        return 1 if self._refused else 0

    def stop(self) -> None:
        """Stop supervising: terminate every worker (SIGTERM, then SIGKILL); `run` returns
        once they are gone. Safe to call from a signal handler, and twice."""
        if self._closing:
            return
        self._closing = True
        logger.info("nanny: stopping %d workers", len(self.slots))
        for slot in self.slots:
            slot.wake.set()
            proc = slot.proc
            if proc is not None and proc.returncode is None:
                _signal(proc, signal.SIGTERM)
                self._loop.call_later(STOP_GRACE, _signal, proc, signal.SIGKILL)

    def restart_workers(self, reason: str = "") -> None:
        """Kill every worker and start it again at once (no backoff)."""
        if self._closing:
            return
        logger.info("nanny: restarting %d workers%s", len(self.slots),
                    f" ({reason})" if reason else "")
        for slot in self.slots:
            if slot.done:
                continue
            slot.restart_requested = True
            slot.wake.set()
            if slot.proc is not None and slot.proc.returncode is None:
                _signal(slot.proc, signal.SIGKILL)

    # ------------------------------------------------------------------ one worker

    async def _supervise(self, slot: _Slot) -> None:
        loop = self._loop
        while not self._closing and not self._stopped_by_scheduler:
            slot.restart_requested = False
            slot.memory_kill = None
            slot.wake.clear()
            started = loop.time()
            try:
                code = await self._run_once(slot)
            except OSError as exc:
                logger.error("nanny: cannot start worker %s: %s", slot.label, exc)
                slot.last_label = slot.label
                code = None
            if self._closing or self._stopped_by_scheduler:
                break
            if slot.restart_requested:
                slot.delay = BACKOFF_MIN
                slot.restarts += 1
                continue
            if code == 0 and slot.memory_kill is None:
                logger.info("nanny: worker %s exited cleanly; not restarting it",
                            slot.last_label)
                slot.done = True
                break
            if code == LIFETIME_EXIT_CODE:
                logger.info("nanny: worker %s reached its --lifetime; starting a fresh one",
                            slot.last_label)
                slot.delay = BACKOFF_MIN
                slot.restarts += 1
                continue
            if loop.time() - started >= HEALTHY_SECONDS:
                slot.delay = BACKOFF_MIN
            delay, slot.delay = slot.delay, min(slot.delay * 2, BACKOFF_MAX)
            slot.restarts += 1
            logger.warning("nanny: worker %s %s after %.1f s; restart %d in %.1f s",
                           slot.last_label,
                           _why(code, slot.memory_kill), loop.time() - started,
                           slot.restarts, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(slot.wake.wait(), delay)

    async def _run_once(self, slot: _Slot) -> int | None:
        """Run one worker process until it exits; its exit code (negative: a signal)."""
        cmd = [sys.executable, "-m", "distributed_server.cli", "worker",
               self.scheduler_address, "--no-nanny", *self.worker_args]
        if slot.name is not None:
            cmd += ["--name", str(slot.name)]
        from .processes import die_with_parent

        env = self._environment()
        read_end, write_end = os.pipe()
        try:
            env[ADDRESS_FD_ENV] = str(write_end)
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=subprocess.DEVNULL, env=env, pass_fds=(write_end,),
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        slot.proc = proc
        slot.restart_requested = False  # a request during the start: this one is fresh
        if self._closing:  # stop() came while it was starting
            _signal(proc, signal.SIGTERM)
            self._loop.call_later(STOP_GRACE, _signal, proc, signal.SIGKILL)
        try:
            slot.ps = psutil.Process(proc.pid)
        except psutil.Error:
            slot.ps = None
        reading = self._loop.create_task(self._read_address(slot, read_end))
        try:
            return await proc.wait()
        finally:
            reading.cancel()
            if proc.returncode is None:  # cancelled: never leave it behind
                _signal(proc, signal.SIGKILL)
            slot.proc = slot.ps = None
            slot.last_label = slot.label
            if slot.address is not None:
                slot.address = None
                self._tell_workers()

    async def _read_address(self, slot: _Slot, fd: int) -> None:
        """The worker's address, from the pipe it writes it to once registered."""
        pipe = os.fdopen(fd, "rb", buffering=0)
        reader = asyncio.StreamReader(limit=4096)
        try:
            transport, _ = await self._loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), pipe)
        except BaseException:
            pipe.close()
            raise
        try:
            line = await reader.readline()
            address = line.decode(errors="replace").strip()
            if address:
                slot.address = address
                self._tell_workers()
        except ValueError:  # a line over the limit: not an address
            logger.warning("nanny: worker %s wrote garbage on its address pipe", slot.label)
        finally:
            transport.close()

    def _environment(self) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ENVIRONMENT_VARIABLES and k != ADDRESS_FD_ENV}
        env.update(self.security.environment())
        env[MEMORY_LIMIT_ENV] = str(self.memory_limit)
        # glibc keeps freed memory in its arenas unless told to give back what passes
        # this threshold: without it a worker that spilled or freed large results keeps
        # their pages, and its RSS (which the nanny and the spill monitor read) does not
        # fall. dask's nanny sets the same. A value the user chose is kept.
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(MALLOC_TRIM_THRESHOLD))
        return env

    # ------------------------------------------------------------------ memory

    async def _watch_memory(self) -> None:
        if not self.memory_limit or not self.terminate_fraction:
            return
        threshold = self.terminate_fraction * self.memory_limit
        while True:
            await asyncio.sleep(MEMORY_POLL_INTERVAL)
            for slot in self.slots:
                proc, ps = slot.proc, slot.ps
                if proc is None or ps is None or proc.returncode is not None \
                        or slot.memory_kill is not None or slot.restart_requested:
                    continue
                try:
                    rss = ps.memory_info().rss
                except psutil.Error:
                    continue
                if rss > threshold:
                    slot.memory_kill = (
                        f"{format_bytes(rss)} resident, over {self.terminate_fraction:.0%} "
                        f"of its memory limit {format_bytes(self.memory_limit)}")
                    logger.warning("nanny: worker %s (pid %d) uses %s: killing it",
                                   slot.label, proc.pid, slot.memory_kill)
                    _signal(proc, signal.SIGKILL)

    # ------------------------------------------------------------------ the scheduler

    def _addresses(self) -> list:
        return [slot.address for slot in self.slots if slot.address is not None]

    def _tell_workers(self) -> None:
        """Send the scheduler the addresses of the workers now supervised here."""
        comm = self._comm
        if comm is not None and not comm.closed:
            with contextlib.suppress(CommClosedError):
                comm.send({"op": "nanny-workers", "workers": self._addresses()})

    async def _stay_connected(self) -> None:
        """Keep a connection to the scheduler and obey it; reconnect when it drops."""
        delay = BACKOFF_MIN
        warned = False
        while not self._closing:
            try:
                comm = await connect(self.scheduler_address,
                                     {"role": "nanny", "pid": os.getpid(),
                                      "workers": self._addresses()},
                                     timeout=10, security=self.security)
            except HandshakeError as exc:
                logger.error("nanny: the scheduler at %s refused it (%s); stopping its "
                             "workers", self.scheduler_address, exc)
                self._refused = True
                self.stop()
                return
            except (OSError, asyncio.TimeoutError) as exc:
                if not warned:
                    logger.warning("nanny: cannot reach the scheduler at %s (%s); retrying",
                                   self.scheduler_address, exc)
                    warned = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self._comm = comm
            delay, warned = BACKOFF_MIN, False
            self._tell_workers()  # addresses learned during the handshake
            try:
                while True:
                    for msg in await comm.read():
                        self._handle(msg)
            except CommClosedError:
                pass
            finally:
                self._comm = None
                comm.abort()
            if self._stopped_by_scheduler:
                return
            if not self._closing:
                logger.info("nanny: lost the scheduler at %s; reconnecting",
                            self.scheduler_address)
                await asyncio.sleep(delay)

    def _handle(self, msg: dict) -> None:
        op = msg.get("op")
        if op == "restart-workers":
            self.restart_workers(str(msg.get("reason", "")))
        elif op == "close":
            # The workers are told to close too. None is restarted any more; the nanny
            # ends when they have exited, or stops them if they linger.
            logger.info("nanny: the scheduler is closing; workers will not be restarted")
            self._stopped_by_scheduler = True
            for slot in self.slots:
                slot.wake.set()
            self._loop.call_later(STOP_GRACE, self.stop)
        else:
            logger.warning("nanny: ignoring unknown operation %.100r from the scheduler", op)


def _signal(proc, sig: int) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _why(code: int | None, memory_kill: str | None) -> str:
    if memory_kill is not None:
        return f"was killed for its memory ({memory_kill})"
    if code is None:
        return "could not be started"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
