"""The task stream: which worker ran which task, from when to when.

What this module does
---------------------
`TaskStream` keeps the last ``maxlen`` finished (or failed) tasks the scheduler heard
of, one tuple each, in the order their reports arrived. Recording is O(1) (a deque
append); `window` answers "what ran between these times" for `Client.get_task_stream`
and `performance_report` by one pass over what is kept, only when asked.

What it never does
------------------
It never reads the state machine and never touches a key's data: the scheduler calls
`record` with what a worker's report says (its key, its start and stop times).

Note: a minimal recorder with the interface agreed for issue 12 (``TaskStream(maxlen)``,
``record(key, worker, start, stop)``, ``window(start, stop)``); the dashboard's recorder
is being built on another branch and the two are to be reconciled.
"""
from __future__ import annotations

import collections
import math

__all__ = ["MAXLEN", "TaskStream"]

#: Tasks the scheduler remembers by default (about 10 MB).
MAXLEN = 100_000


class TaskStream:
    """The last ``maxlen`` tasks that ran: ``(key, worker, start, stop, status)``."""

    def __init__(self, maxlen: int = MAXLEN) -> None:
        if type(maxlen) is not int or maxlen < 1:
            raise ValueError(f"maxlen must be a positive int, not {maxlen!r}")
        self.maxlen = maxlen
        self._tasks: collections.deque = collections.deque(maxlen=maxlen)
        self.recorded = 0  # every task ever recorded, the forgotten ones too

    def __len__(self) -> int:
        return len(self._tasks)

    def record(self, key, worker: str, start, stop, status: str = "memory") -> None:
        """One task ran on ``worker`` from ``start`` to ``stop`` (seconds since the epoch,
        the worker's clock) and ended in ``status`` ("memory" or "erred"). Times that are
        not finite numbers with start <= stop are not recorded."""
        if type(start) not in (int, float) or type(stop) not in (int, float) \
                or not math.isfinite(start) or not math.isfinite(stop) or start > stop:
            return
        self._tasks.append((key, worker, start, stop, status))
        self.recorded += 1

    def window(self, start: float | None = None, stop: float | None = None) -> list[dict]:
        """The tasks that ran at some time between ``start`` and ``stop`` (None: no
        bound), oldest first: ``{"key", "worker", "start", "stop", "status"}``."""
        low = -math.inf if start is None else start
        high = math.inf if stop is None else stop
        return [{"key": key, "worker": worker, "start": begin, "stop": end, "status": status}
                for key, worker, begin, end, status in self._tasks
                if end >= low and begin <= high]
