"""The task stream: which worker ran which task, and when (the scheduler's recent past).

The scheduler records one entry per task outcome it accepted from a worker's report:
``(key, worker, start, stop, ok)``, with the worker's own clock readings of when the
task began and ended. Recording is one tuple per task, added with its batch by one
``deque.extend`` (about 0.2 us a task: benchmarks/dashboard_cost.py), nothing else;
entries live in a bounded deque (the oldest fall off), so a long run costs a
fixed amount of memory. Everything that checks or converts an entry happens when it is
read, and reads touch only the entries they return.

Each entry has a sequence number (its position since the scheduler started), so a
reader that polls asks for what came after the last number it saw and never gets an
entry twice.

What it never does: walk the scheduler's tasks, keep anything beyond ``maxlen``
entries, or trust a report's times (a worker is a member, but its clock may be off or
its figures odd: a time that is not a finite number is dropped from what readers see).
"""
from __future__ import annotations

import math
from collections import deque
from itertools import islice

__all__ = ["TaskStream", "TaskStreamEntry"]

#: Entries kept by default (about 100 bytes each, keys not counted).
DEFAULT_MAXLEN = 100_000


class TaskStreamEntry(tuple):
    """One task outcome as readers see it: ``(seq, key, worker, start, stop, ok)``."""

    __slots__ = ()

    @property
    def seq(self) -> int:
        """Its sequence number."""
        return self[0]


class TaskStream:
    """A bounded record of task outcomes, fed from workers' reports.

    ``record(worker, reports, ok)`` is the scheduler's one call per accepted batch of
    ``task-finished`` (``ok=True``) or ``task-erred`` reports; ``after(seq)`` and
    ``window(start, stop)`` read.
    """

    def __init__(self, maxlen: int = DEFAULT_MAXLEN) -> None:
        if type(maxlen) is not int or maxlen < 1:
            raise ValueError(f"maxlen must be a positive int, not {maxlen!r}")
        self.maxlen = maxlen
        self._entries: deque = deque(maxlen=maxlen)
        #: Entries recorded since the start (the next entry's sequence number).
        self.total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, worker: str, reports: list, ok: bool) -> None:
        """Remember the outcome of every report of this batch (one append each)."""
        self._entries.extend([(msg.get("key"), worker, msg.get("start"), msg.get("stop"), ok)
                              for msg in reports])
        self.total += len(reports)

    def after(self, seq: int, limit: int = 1000, sample: bool = False) -> tuple:
        """``(entries, next_seq, skipped)``: at most ``limit`` entries numbered ``seq``
        or later, oldest first; the number to ask for next time; and how many entries
        after ``seq`` were not returned (fallen off the deque, or over ``limit``).

        Over ``limit``, the newest ``limit`` are returned, or with ``sample`` ``limit``
        entries spread evenly over all of them (a chart of the last second stays even).
        Costs only the entries returned."""
        entries = self._entries
        n = len(entries)
        first = self.total - n  # sequence number of entries[0]
        seq = max(seq, 0)
        wanted = max(self.total - max(seq, first), 0)
        take = min(wanted, max(limit, 0))
        if sample and 0 < take < wanted:
            step = -(-wanted // take)  # every step-th, counted back from the newest
            picked = list(islice(reversed(entries), 0, wanted, step))
            seqs = range(self.total - 1, self.total - 1 - step * len(picked), -step)
            raw = reversed(list(zip(seqs, picked)))
            take = len(picked)
        else:
            newest = list(islice(reversed(entries), take))
            newest.reverse()
            raw = zip(range(self.total - take, self.total), newest)
        out = []
        for number, item in raw:
            entry = _checked(number, item)
            if entry is not None:
                out.append(entry)
        skipped = max(self.total - seq, 0) - take
        return out, self.total, skipped

    def window(self, start: float | None = None, stop: float | None = None,
               limit: int = 100_000) -> list:
        """Entries whose task ran at least partly between ``start`` and ``stop``
        (seconds since the epoch; None: unbounded), at most the newest ``limit``, oldest
        first. Walks back from the newest entry and stops at the first one that ended
        well before ``start`` (entries arrive roughly in order of their stop time)."""
        out = []
        entries = self._entries
        first = self.total - len(entries)
        slack = 60.0  # reports from different workers arrive out of order by this much
        for i in range(len(entries) - 1, -1, -1):
            entry = _checked(first + i, entries[i])
            if entry is None:
                continue
            if start is not None and entry[4] < start:
                if entry[4] < start - slack:
                    break
                continue
            if stop is not None and entry[3] > stop:
                continue
            out.append(entry)
            if len(out) >= limit:
                break
        out.reverse()
        return out


def _checked(seq: int, raw: tuple) -> TaskStreamEntry | None:
    """The entry as readers see it, or None if its times are not finite numbers."""
    key, worker, start, stop, ok = raw
    if type(start) not in (int, float) or type(stop) not in (int, float):
        return None
    start, stop = float(start), float(stop)
    if not (math.isfinite(start) and math.isfinite(stop)):
        return None
    return TaskStreamEntry((seq, key, worker, start, max(stop, start), ok))
