"""How long this process's garbage collections stop it, per generation.

A scheduler holding a million tasks has millions of objects the cyclic collector may
walk: a generation-2 collection then stops the event loop for as long as it takes, and
every peer waits. `GCPauses` times each collection through ``gc.callbacks`` (two
``perf_counter`` calls per collection, nothing per allocation), keeps per-generation
counts, totals and maxima for the metrics, and logs a warning for a collection longer
than ``warn_seconds``.

One instance per process (`GC_PAUSES`), installed by the ``dcore`` command for the
scheduler and worker processes.

`LoopCollector` moves the scheduler's collections between event-loop callbacks. Left
automatic, a collection runs inside whichever allocation crosses the threshold: in the
middle of a stimulus, so a peer waits for the stimulus and the collection together (a
worker leaving with 1,000,000 results: 12 generation-0 collections of 16-50 ms CPU
each inside its slices).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time

__all__ = ["GC_PAUSES", "GCPauses", "LoopCollector"]

logger = logging.getLogger("distributed_server.gc")


class GCPauses:
    """Collection pauses by generation: ``count[g]``, ``total[g]`` (seconds), ``longest[g]``
    (seconds), ``collected[g]`` (objects freed), and ``recent_longest`` (the longest
    since `take_recent_longest`)."""

    def __init__(self, warn_seconds: float = 1.0) -> None:
        self.warn_seconds = warn_seconds
        self.count = [0, 0, 0]
        self.total = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self.collected = [0, 0, 0]
        self.recent_longest = 0.0
        self._started = 0.0
        self._installed = False

    @property
    def installed(self) -> bool:
        """Whether collections are being timed."""
        return self._installed

    def install(self) -> None:
        """Start timing this process's collections (idempotent)."""
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def uninstall(self) -> None:
        """Stop timing collections."""
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def take_recent_longest(self) -> float:
        """The longest pause since the last call, and start a new window."""
        longest, self.recent_longest = self.recent_longest, 0.0
        return longest

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self.count[generation] += 1
        self.total[generation] += pause
        self.collected[generation] += info.get("collected", 0)
        if pause > self.longest[generation]:
            self.longest[generation] = pause
        if pause > self.recent_longest:
            self.recent_longest = pause
        if pause > self.warn_seconds:
            logger.warning("a generation-%d garbage collection stopped this process for "
                           "%.2f s (%d objects collected)", generation, pause,
                           info.get("collected", 0))


GC_PAUSES = GCPauses()


class LoopCollector:
    """Runs the cyclic garbage collector from a timer on the event loop, every
    ``interval`` seconds, by the thresholds the automatic collector had (``gc.get_count``
    against ``gc.get_threshold``), with automatic collection off.

    A collection then never lands inside a stimulus; it is a callback of its own, which
    peers wait for only as long as it lasts. Only cyclic garbage waits for the next timer
    (reference counting frees the rest at once), so a long stimulus cannot pile up
    memory. Meant for the scheduler, whose own code runs only on its loop; a worker's
    task threads keep the automatic collector."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self._thresholds = gc.get_threshold()
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Turn automatic collection off and start the timer on the running loop."""
        self._thresholds = gc.get_threshold()
        self._loop = asyncio.get_running_loop()
        gc.disable()
        self._handle = self._loop.call_later(self.interval, self._tick)

    def stop(self) -> None:
        """Stop the timer; automatic collection again."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        gc.enable()

    def _tick(self) -> None:
        self.collect_if_due()
        self._handle = self._loop.call_later(self.interval, self._tick)

    def collect_if_due(self) -> int | None:
        """Collect the oldest generation whose count passed its threshold; the
        generation, or None. Unlike the automatic collector, a generation-2 collection
        does not also wait for the long-lived objects to have grown by a quarter (the
        interpreter does not expose that count): with the scheduler's thresholds
        (``cli.SCHEDULER_GC_THRESHOLDS``: 100,000, 10, 5,000) it comes after five billion
        net allocations at the earliest."""
        counts = gc.get_count()
        if counts[0] <= self._thresholds[0]:
            return None
        generation = 0
        for older in (1, 2):
            if counts[older] > self._thresholds[older]:
                generation = older
        gc.collect(generation)
        return generation
