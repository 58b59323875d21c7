"""Event-loop lag: how late a timer fires, measured by a timer of its own.

Every ``interval`` seconds a ``call_later`` callback notes how much later than asked
it ran. A loop that is busy (a long stimulus, a large decode, a slow handler) runs it
late by that much, so the lag is what any peer waiting on this process felt. One timer
callback per interval, no thread, no Task.
"""
from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import deque

__all__ = ["LAG_BUCKETS", "LoopLagMonitor"]

#: Upper bounds (seconds) of the lag histogram's buckets: how many samples were late by
#: more than 100 ms tells a stall of this loop from a peer's own (a starved process).
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLagMonitor:
    """Samples the running loop's lag every ``interval`` seconds once `start` is called.

    ``last`` is the latest sample (seconds), ``recent_max`` the largest of the last
    ``window`` samples, ``total`` the sum of every sample and ``count`` their number,
    and `cumulative` their histogram over `LAG_BUCKETS` (for Prometheus).
    """

    def __init__(self, interval: float = 0.5, window: int = 20) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be positive, not {interval!r}")
        self.interval = interval
        self.last = 0.0
        self.total = 0.0
        self.count = 0
        self._in_bucket = [0] * (len(LAG_BUCKETS) + 1)  # the last: over the largest bound
        self._recent: deque = deque(maxlen=window)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def cumulative(self) -> list:
        """``(bound, samples at most that late)`` for each of `LAG_BUCKETS`, then
        ``(inf, count)``."""
        out, running = [], 0
        for bound, n in zip(LAG_BUCKETS + (float("inf"),), self._in_bucket):
            running += n
            out.append((bound, running))
        return out

    @property
    def recent_max(self) -> float:
        """The largest lag among the recent samples (0 before the first)."""
        return max(self._recent, default=0.0)

    def start(self) -> None:
        """Begin sampling on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._arm()

    def stop(self) -> None:
        """Stop sampling."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self) -> None:
        self._due = self._loop.time() + self.interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        self._note(max(self._loop.time() - self._due, 0.0))
        self._arm()

    def _note(self, lag: float) -> None:
        self.last = lag
        self.total += lag
        self.count += 1
        self._in_bucket[bisect_left(LAG_BUCKETS, lag)] += 1
        self._recent.append(lag)
