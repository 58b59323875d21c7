"""A worker's memory: where its results live (RAM or local disk), and what the process's
memory use asks of it (spill, pause, resume).

With a memory limit, ``worker.data`` is a `SpillBuffer`: a ``zict.Buffer`` whose fast
side is a dict weighed by each result's size and whose slow side is `SpillDirectory`,
files in a private directory. Past ``target`` × limit of results held in RAM, the least
recently used go to disk as they are stored; reading a spilled key brings it back. A
`MemoryMonitor` reads the process's resident memory every `MONITOR_INTERVAL` seconds:
past ``spill`` × limit it spills least recently used results until the process should
be back under ``target``; past ``pause`` × limit it asks the worker to start no task
until memory falls back under it. Past ``terminate`` the nanny kills and restarts the
process (nanny.py). The defaults are dask's: 0.6, 0.7, 0.8 and 0.95.

Executor threads can make results faster than a reading every `MONITOR_INTERVAL` sees
them (a 1-thread worker holds dozens of queued tasks): an `ExecutionGate` counts the
bytes they produce since the last reading and holds them before their next task once
that reading plus those bytes pass ``spill`` × limit, until the monitor has looked again
(and spilled). A `MemoryWatch` runs the monitor on the worker's event loop, at once when
the gate asks, and pauses or resumes the worker.

A queued task's inputs that are on disk are read back by the executor thread when the
task starts (`SpillBuffer.in_memory` tells which), not when it is queued: a 1-thread
worker queues dozens of tasks, and their spilled inputs all read back at once would pass
the limit. So the spill directory is used from two threads; its bookkeeping is locked.

Nothing here raises into the worker: a value that cannot be pickled, or a disk that is
full or failing, keeps the value in RAM (counted, and logged once per minute).
"""
from __future__ import annotations

import gc
import itertools
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable, MutableMapping

import psutil
import zict

from ..protocol.serialize import dumps_data, loads_data

logger = logging.getLogger("distributed_server.worker")

__all__ = ["MEMORY_LIMIT_ENV", "MONITOR_INTERVAL", "ExecutionGate", "MemoryMonitor", "MemoryWatch",
           "SpillBuffer", "SpillDirectory", "check_fractions"]

#: The environment variable through which a worker process gets its memory limit (bytes;
#: 0 or unset: none), set by the nanny and by `dcore worker`.
MEMORY_LIMIT_ENV = "DCORE_MEMORY_LIMIT"

#: Default fractions of the memory limit (dask's): results held in RAM past ``target``
#: spill as they are stored; process memory past ``spill`` spills until under ``target``;
#: past ``pause`` no new task starts.
TARGET_FRACTION = 0.6
SPILL_FRACTION = 0.7
PAUSE_FRACTION = 0.8
#: Seconds between two readings of the process's memory.
MONITOR_INTERVAL = 0.1
#: The longest the monitor spills in one go before it lets the event loop run.
SPILL_SLICE_SECONDS = 0.05
#: Results of at most this many bytes never spill (SpillBuffer).
SMALL_RESULT_BYTES = 1024
#: An executor thread that made a result at least this large reads the process's memory
#: (`ExecutionGate.produced`) instead of adding its size to the monitor's last reading.
GATE_READS_RSS_BYTES = 1 << 20
#: Bytes of small results threads may make between two looks while memory is past the
#: gate's threshold for reasons spilling cannot help (`ExecutionGate.checked`; at most a
#: tenth of the threshold).
GATE_BUDGET_BYTES = 8 << 20
#: After a disk error, seconds during which no spill is tried (values stay in RAM).
DISK_RETRY_SECONDS = 30.0
#: Seconds between two garbage collections the monitor runs because memory is past the
#: spill line with no result left in RAM to spill (a worker collects rarely by itself).
COLLECT_EVERY_SECONDS = 5.0
_LOG_EVERY = 60.0
_MISSING = object()
ON_DISK = object()
"""`SpillBuffer.in_memory`'s answer for a key whose value is on disk."""


def check_fractions(target, spill, pause) -> None:
    """Raise ValueError unless each fraction is a number in (0, 1] or False/None (off)."""
    for name, value in (("target", target), ("spill", spill), ("pause", pause)):
        if value is None or value is False:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 < value <= 1:
            raise ValueError(f"memory {name} fraction must be in (0, 1] or False, "
                             f"got {value!r}")


class SpillDirectory(MutableMapping):
    """The slow side of a `SpillBuffer`: each value pickled into one file of a private
    directory (``zict.File``), with the frames' lengths in a small header.

    A value that cannot be pickled, and any value while the disk is failing, is kept in
    RAM here instead (``kept``), so eviction never fails and nothing is lost."""

    def __init__(self, parent: str | None = None) -> None:
        self.directory = tempfile.mkdtemp(prefix=f"dcore-spill-{os.getpid()}-", dir=parent)
        self._files = zict.File(self.directory)
        self.sizes: dict = {}  # key -> bytes on disk
        self._names: dict = {}  # key -> its file's name
        self._counter = itertools.count()
        self.spilled_bytes = 0
        self.kept: dict = {}  # key -> value held in RAM: it cannot be written
        self.unpicklable: set = set()
        self._disk_failed_until = 0.0
        self._last_log = -_LOG_EVERY
        # the loop thread spills and drops, executor threads read inputs back (and so
        # evict): the bookkeeping dicts and counters change under this lock
        self._lock = threading.Lock()

    def __setitem__(self, key, value) -> None:
        self.discard(key)
        if key in self.unpicklable or time.monotonic() < self._disk_failed_until:
            self._keep(key, value)
            return
        try:
            frames = dumps_data(value)
        except Exception as exc:  # noqa: BLE001 - any pickling failure: keep it in RAM
            with self._lock:
                self.unpicklable.add(key)
                self.kept[key] = value
            self._log("cannot spill %r: its value (%s) cannot be pickled: %s; keeping it in "
                      "memory", key, type(value).__name__, exc)
            return
        header = struct.pack(f"<I{len(frames)}Q", len(frames),
                             *(memoryview(f).nbytes for f in frames))
        name = str(next(self._counter))
        try:
            self._files[name] = [header, *frames]
        except OSError as exc:
            self._files.discard(name)
            self._disk_failed_until = time.monotonic() + DISK_RETRY_SECONDS
            self._keep(key, value)
            self._log("cannot spill to %s: %s; keeping results in memory for %.0fs",
                      self.directory, exc, DISK_RETRY_SECONDS)
            return
        size = len(header) + sum(memoryview(f).nbytes for f in frames)
        with self._lock:
            self.sizes[key] = size
            self._names[key] = name
            self.spilled_bytes += size

    def __getitem__(self, key):
        try:
            return self.kept[key]
        except KeyError:
            pass
        name = self._names.get(key)
        if name is None:
            raise KeyError(key)
        blob = memoryview(self._files[name])
        (n,) = struct.unpack_from("<I", blob)
        lengths = struct.unpack_from(f"<{n}Q", blob, 4)
        frames, offset = [], 4 + 8 * n
        for length in lengths:
            frames.append(blob[offset:offset + length])
            offset += length
        return loads_data(frames)

    def __delitem__(self, key) -> None:
        with self._lock:
            if key in self.kept:
                del self.kept[key]
                self.unpicklable.discard(key)
                return
            size = self.sizes.pop(key)  # KeyError if absent, as a mapping should
            self.spilled_bytes -= size
            name = self._names.pop(key)
        self._files.discard(name)

    def discard(self, key) -> None:
        """Drop ``key`` if held."""
        try:
            del self[key]
        except KeyError:
            pass

    def __contains__(self, key) -> bool:
        return key in self.sizes or key in self.kept

    def __iter__(self):
        with self._lock:  # a snapshot: another thread may spill meanwhile
            keys = [*self.sizes, *self.kept]
        yield from keys

    def __len__(self) -> int:
        return len(self.sizes) + len(self.kept)

    def close(self) -> None:
        """Forget everything and remove the directory."""
        with self._lock:
            self.sizes.clear()
            self._names.clear()
            self.kept.clear()
            self.unpicklable.clear()
            self.spilled_bytes = 0
        shutil.rmtree(self.directory, ignore_errors=True)

    def _keep(self, key, value) -> None:
        with self._lock:
            self.kept[key] = value

    def _log(self, text: str, *args) -> None:
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY:
            self._last_log = now
            logger.warning(text, *args)


class SpillBuffer(MutableMapping):
    """``worker.data`` under a memory limit: results in RAM up to ``target_bytes`` of
    their sizes (``weight(key, value)``), the least recently used beyond that on disk
    (a ``zict.Buffer`` over a `SpillDirectory`). Reading a spilled key brings it back,
    spilling others if need be.

    Results of at most `SMALL_RESULT_BYTES` stay in a plain dict and never spill: on disk
    they would save less than the bookkeeping of a spilled key costs, and storing one
    costs a dict assignment instead of the buffer's locks and LRU (the no-op task path).
    Their bytes count in `memory_bytes` all the same."""

    def __init__(self, target_bytes: float, weight: Callable, directory: str | None = None):
        self.weight = weight
        self.small: dict = {}  # key -> value
        self._small_weights: dict = {}  # key -> its weight
        self.small_bytes = 0
        self.target_bytes = target_bytes
        self.buffer = zict.Buffer({}, SpillDirectory(directory), target_bytes, weight=weight)

    def fit_process_memory(self, process_bytes: int) -> None:
        """Keep results in RAM only as far as the process as a whole stays under the
        target: what the process holds besides them (interpreter, libraries, task code,
        transfers) is subtracted from ``target_bytes`` for the results stored from now on.
        Without this a process whose own memory is large next to its limit would sit
        between the spill and pause thresholds, pausing and resuming."""
        unmanaged = max(process_bytes - self.memory_bytes, 0)
        self.buffer.n = max(self.target_bytes - unmanaged, 0)

    def __setitem__(self, key, value) -> None:
        weight = self.weight(key, value)
        if weight <= SMALL_RESULT_BYTES:
            if key in self.buffer:
                del self.buffer[key]
            self.small_bytes += weight - self._small_weights.get(key, 0)
            self._small_weights[key] = weight
            self.small[key] = value
            return
        if key in self.small:
            self._pop_small(key)
        self.buffer[key] = value

    def __getitem__(self, key):
        value = self.small.get(key, _MISSING)
        if value is _MISSING:
            return self.buffer[key]
        return value

    def in_memory(self, key):
        """``key``'s value if it is in RAM (marked recently used), `ON_DISK` if it is
        spilled; KeyError if not held. Reads nothing back from disk."""
        value = self.small.get(key, _MISSING)
        if value is not _MISSING:
            return value
        try:
            return self.buffer.fast[key]
        except KeyError:
            pass
        if key in self.buffer.slow:
            return ON_DISK
        return self.buffer[key]  # moved to RAM meanwhile by another thread, or KeyError

    def __delitem__(self, key) -> None:
        if key in self.small:
            self._pop_small(key)
        else:
            del self.buffer[key]

    def discard(self, key) -> None:
        """Drop ``key`` if held; a spilled value's file is deleted, not read back (as
        ``pop`` would)."""
        if key in self.small:
            self._pop_small(key)
        elif key in self.buffer:
            del self.buffer[key]

    def __contains__(self, key) -> bool:
        return key in self.small or key in self.buffer

    def __iter__(self):
        yield from self.small
        yield from self.buffer

    def __len__(self) -> int:
        return len(self.small) + len(self.buffer)

    @property
    def memory_bytes(self) -> int:
        """Bytes of results held in RAM (their sizes): small, buffered and kept ones."""
        kept = self.buffer.slow.kept
        return (self.small_bytes + int(self.buffer.fast.total_weight)
                + sum(self.weight(k, v) for k, v in list(kept.items())))

    @property
    def spilled_bytes(self) -> int:
        """Bytes of results on disk."""
        return self.buffer.slow.spilled_bytes

    @property
    def spilled_count(self) -> int:
        """How many results are on disk."""
        return len(self.buffer.slow.sizes)

    def spill_oldest(self) -> int | None:
        """Move the least recently used result in RAM to disk: the weight moved (0 if it
        could not be written and stays in RAM), None if no result is left to spill."""
        try:
            key, _, weight = self.buffer.fast.evict()
        except KeyError:
            return None
        if key is None or key in self.buffer.slow.kept:
            return 0
        return int(weight)

    def clear(self) -> None:
        """Drop every result (spilled files included)."""
        self.small.clear()
        self._small_weights.clear()
        self.small_bytes = 0
        self.buffer.fast.clear()
        for key in list(self.buffer.slow):
            self.buffer.slow.discard(key)

    def close(self) -> None:
        """Drop every result and remove the spill directory."""
        self.clear()
        self.buffer.slow.close()

    def _pop_small(self, key):
        self.small_bytes -= self._small_weights.pop(key)
        return self.small.pop(key)


class MemoryMonitor:
    """Reads the process's memory and tells what to do about it; one `check` per
    `MONITOR_INTERVAL`. ``spill``/``pause`` are fractions of ``limit`` or None (off)."""

    def __init__(self, limit: int, buffer: SpillBuffer | None, target: float | None,
                 spill: float | None, pause: float | None,
                 rss: Callable[[], int] | None = None) -> None:
        self.limit = limit
        self.buffer = buffer
        self.target = target
        self.spill = spill
        self.pause = pause
        self.rss = rss if rss is not None else _process_rss()
        self.memory = 0  # the last reading
        self.paused = False
        #: The last check ran out of time with more to spill: check again at once.
        self.behind = False
        #: The last reading less what the check then moved to disk.
        self.estimate = 0
        self._last_spill_log = -_LOG_EVERY
        self._last_collect = -COLLECT_EVERY_SECONDS
        #: Collections run because nothing was left to spill.
        self.collections = 0

    def check(self) -> bool | None:
        """Read memory, spill if past ``spill``; True to pause, False to resume, None if
        the paused state should not change."""
        memory = self.memory = self.estimate = self.rss()
        self.behind = False
        if self.buffer is not None:
            self.buffer.fit_process_memory(memory)
        if self.spill and self.buffer is not None and memory > self.spill * self.limit:
            self.estimate = max(memory - self._spill(memory), 0)
            if not self.buffer.buffer.fast:
                self._collect_garbage()
        if not self.pause:
            return None
        over = memory > self.pause * self.limit
        if over != self.paused:
            self.paused = over
            return over
        return None

    def _collect_garbage(self) -> None:
        """Memory is past the spill line and no result is left in RAM: what holds it may
        be cyclic garbage the worker's rare automatic collections have not reached yet.
        A full collection, at most once per `COLLECT_EVERY_SECONDS`."""
        now = time.monotonic()
        if now - self._last_collect < COLLECT_EVERY_SECONDS:
            return
        self._last_collect = now
        self.collections += 1
        gc.collect()

    def _spill(self, memory: int) -> int:
        """Spill the least recently used results until about ``memory - target × limit``
        bytes of them are on disk, for at most `SPILL_SLICE_SECONDS`; the bytes moved."""
        goal = (self.target or self.spill) * self.limit
        need = memory - goal
        moved = count = 0
        deadline = time.monotonic() + SPILL_SLICE_SECONDS
        while moved < need:
            if time.monotonic() > deadline:
                self.behind = True
                break
            weight = self.buffer.spill_oldest()
            if weight is None:
                break
            moved += weight
            count += 1
        now = time.monotonic()
        if count and now - self._last_spill_log >= _LOG_EVERY:
            self._last_spill_log = now
            logger.info("memory %s is over %.0f%% of the limit %s: spilled %d results (%s)",
                        _mb(memory), 100 * self.spill, _mb(self.limit), count, _mb(moved))
        elif not count and not self.buffer.buffer.fast and now - self._last_spill_log >= _LOG_EVERY:
            self._last_spill_log = now
            logger.warning("memory %s is over %.0f%% of the limit %s with no result left "
                           "to spill: task code or a leak holds it", _mb(memory),
                           100 * self.spill, _mb(self.limit))
        return moved


class ExecutionGate:
    """Holds executor threads before their next task while the results they made since
    the monitor's last look could push memory past ``threshold`` bytes, or while the
    monitor is still spilling, or the loop has results of theirs still to store. Never
    just because memory is high (nor while paused): jobs already queued may hold their
    inputs, and only running them frees that memory (the pause stops new jobs).

    Threads call `produced` after each result (with its size) and `wait` before each
    task; the first result after which one more as large would cross the threshold
    closes the gate and calls ``request_check`` (which must make the event loop run the
    monitor soon); the loop reopens it with `checked` once the results are stored and
    spilled. Costs a thread an addition and a comparison per small result while the gate
    is open, and a reading of the process's memory per large one."""

    def __init__(self, threshold: float, request_check: Callable[[], None],
                 rss: Callable[[], int] | None = None) -> None:
        self.threshold = threshold
        self._request_check = request_check
        self._rss = rss
        self._budget = min(GATE_BUDGET_BYTES, threshold / 10)
        self._base = 0  # process memory at the monitor's last look (or a thread's reading)
        self._produced = 0  # bytes of results made since (races between threads only
        # lose a few counts, and the next timed check corrects the base)
        self._open = threading.Event()
        self._open.set()

    def produced(self, nbytes: int) -> None:
        """From an executor thread: a result of ``nbytes`` was made; the gate closes if
        one more result as large would pass the threshold. After a result of
        `GATE_READS_RSS_BYTES` or more the thread reads the process's memory itself
        (about 20 µs, little next to making a MiB), so memory that grew since the
        monitor's last look in other ways (task code, transfers, imports) counts too."""
        if nbytes >= GATE_READS_RSS_BYTES and self._rss is not None:
            self._base = self._rss()
            self._produced = 0
        else:
            self._produced += nbytes
        # one result ahead: the next task is likely to make as much as this one did
        if self._base + self._produced + nbytes > self.threshold and self._open.is_set():
            self._open.clear()
            self._request_check()

    def wait(self, stopping: Callable[[], bool]) -> None:
        """From an executor thread, before a task: return once the gate is open, or once
        ``stopping()`` is true."""
        while not self._open.wait(0.1):
            if stopping():
                return

    @property
    def is_open(self) -> bool:
        """Whether threads may start tasks."""
        return self._open.is_set()

    def checked(self, estimate: int, spilling: bool, unstored: bool) -> bool:
        """From the event loop, after the monitor looked: its ``estimate`` of process
        memory, whether it is still spilling, and whether results the threads made are
        still waiting for the loop to store them (only stored results can spill). True if
        threads must keep holding: the loop should look again soon.

        Holds while spilling, and while the estimate is past the threshold with results
        unstored: storing them lets them spill, and a thread let go meanwhile would add
        one result per look, faster than a busy loop stores them. Otherwise it opens even
        past the threshold: what holds the memory then (task code, inputs of queued jobs)
        only running tasks can free, and the pause stops new jobs."""
        self._produced = 0
        hold = spilling or (unstored and estimate > self.threshold)
        if hold:
            self._base = estimate
            self._open.clear()
        else:
            # near or past the threshold: small results get at least a budget until the
            # next look instead of one look per task (a large one reads the memory and
            # closes the gate again, as it should: it has to spill)
            self._base = min(estimate, self.threshold - self._budget)
            self._open.set()
        return hold

    def release(self) -> None:
        """Open for good (the worker is closing: threads must reach their exit)."""
        self.threshold = float("inf")
        self._open.set()


class MemoryWatch:
    """On the worker's event loop: reads the `MemoryMonitor` every `MONITOR_INTERVAL`
    seconds (sooner while it is behind, at once when the `ExecutionGate` asks), and
    pauses or resumes the worker when memory crosses ``pause`` × limit.

    ``monitor`` and ``gate`` (None without ``spill`` and ``pause``) are made here, over
    ``buffer`` (the worker's SpillBuffer, or None). The worker gives ``on_pause`` and
    ``on_resume``, ``running()`` (False once it closes) and ``busy()`` (outcomes of its
    executor threads wait for the loop); ``name`` is its address, for the log.
    """

    def __init__(self, loop, limit: int, buffer, target, spill, pause, *,
                 on_pause: Callable[[], None], on_resume: Callable[[], None],
                 running: Callable[[], bool], busy: Callable[[], bool], name: str) -> None:
        self._loop = loop
        self.limit = limit
        self.pause_fraction = pause
        self._on_pause, self._on_resume = on_pause, on_resume
        self._running, self._busy = running, busy
        self._name = name
        self.monitor = MemoryMonitor(limit, buffer, target, spill, pause)
        fraction = spill or pause
        self.gate = (ExecutionGate(fraction * limit, self.request_check, self.monitor.rss)
                     if fraction else None)
        self._handle = loop.call_later(MONITOR_INTERVAL, self.check)

    def check(self) -> None:
        """Read the monitor now (it spills), pause or resume, and schedule the next read."""
        monitor = self.monitor
        try:
            change = monitor.check()
        except Exception:  # the monitor must keep running
            logger.exception("BUG: worker %s: memory check failed", self._name)
            change = None
        if change is True:
            logger.warning("worker %s paused: memory %s is over %.0f%% of the limit %s",
                           self._name, _mb(monitor.memory), 100 * self.pause_fraction,
                           _mb(self.limit))
            self._on_pause()
        elif change is False:
            logger.warning("worker %s resumed: memory %s is back under %.0f%% of the limit "
                           "%s", self._name, _mb(monitor.memory), 100 * self.pause_fraction,
                           _mb(self.limit))
            self._on_resume()
        soon = monitor.behind
        if self.gate is not None:
            soon = self.gate.checked(monitor.estimate, monitor.behind, self._busy())
        if self._running():
            delay = 0.001 if soon else MONITOR_INTERVAL
            self._handle = self._loop.call_later(delay, self.check)

    def request_check(self) -> None:
        """From an executor thread (the gate closed): run the monitor on the loop now."""
        try:
            self._loop.call_soon_threadsafe(self._check_now)
        except RuntimeError:  # the loop is closed
            self.gate.release()

    def _check_now(self) -> None:
        if not self._running():
            return
        if self._handle is not None:
            self._handle.cancel()
        self.check()

    def stop(self) -> None:
        """No more reads."""
        if self._handle is not None:
            self._handle.cancel()


def _process_rss() -> Callable[[], int]:
    process = psutil.Process()

    def rss() -> int:
        return process.memory_info().rss
    return rss


def _mb(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"
