"""The task stream: which worker ran which task, and when (the scheduler's recent past).

The scheduler records one entry per task outcome it accepted from a worker's report:
``(key, worker, start, stop, ok)``, with the worker's own clock readings of when the
task began and ended. Recording is one tuple per task, written with its batch by one
slice assignment (about 0.2 us a task: benchmarks/dashboard_cost.py), nothing else.

Entries live in a ring: a list of ``maxlen`` slots and a running count ``total`` of
entries recorded. Entry number ``seq`` (its position since the scheduler started) sits
in slot ``seq % maxlen`` until ``maxlen`` newer entries overwrite it, so a long run costs
a fixed amount of memory and any held entry is found in O(1) (a deque would index in
O(n)). Everything that checks or converts an entry happens when it is read, and a read
touches only the entries it returns: a page that samples 100 of the last 100,000 reads
100 slots.

A reader that polls asks for what came after the last number it saw and never gets an
entry twice.

What it never does: walk the scheduler's tasks, keep anything beyond ``maxlen``
entries, or trust a report's times (a worker is a member, but its clock may be off or
its figures odd: a time that is not a finite number is dropped from what readers see).
"""
from __future__ import annotations

import math

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
        #: The ring: entry number ``seq`` is in slot ``seq % maxlen`` while it is held.
        self._slots: list = [None] * maxlen
        #: Entries recorded since the start (the next entry's sequence number).
        self.total = 0

    def __len__(self) -> int:
        return min(self.total, self.maxlen)

    @property
    def first(self) -> int:
        """The sequence number of the oldest entry held."""
        return max(self.total - self.maxlen, 0)

    def record(self, worker: str, reports: list, ok: bool) -> None:
        """Remember the outcome of every report of this batch (one slot each)."""
        maxlen = self.maxlen
        new = [(msg.get("key"), worker, msg.get("start"), msg.get("stop"), ok)
               for msg in reports[-maxlen:]]  # a batch over maxlen: its newest
        slot = (self.total + len(reports) - len(new)) % maxlen
        room = maxlen - slot
        if len(new) <= room:
            self._slots[slot:slot + len(new)] = new
        else:  # wraps: the end of the list, then its start
            self._slots[slot:] = new[:room]
            self._slots[:len(new) - room] = new[room:]
        self.total += len(reports)

    def _raw(self, seq: int) -> tuple:
        """The stored tuple of entry ``seq`` (which the caller knows is held)."""
        return self._slots[seq % self.maxlen]

    def after(self, seq: int, limit: int = 1000, sample: bool = False) -> tuple:
        """``(entries, next_seq, skipped)``: at most ``limit`` entries numbered ``seq``
        or later, oldest first; the number to ask for next time; and how many entries
        after ``seq`` were not returned (fallen out of the ring, or over ``limit``).

        Over ``limit``, the newest ``limit`` are returned, or with ``sample`` ``limit``
        entries spread evenly over all of them (a chart of the last second stays even).
        Costs only the entries returned."""
        total = self.total
        seq = max(seq, 0)
        wanted = max(total - max(seq, self.first), 0)
        take = min(wanted, max(limit, 0))
        if sample and 0 < take < wanted:
            step = -(-wanted // take)  # every step-th, counted back from the newest
            numbers = range(total - 1 - step * ((wanted - 1) // step), total, step)
        else:
            numbers = range(total - take, total)
        out = []
        for number in numbers:
            entry = _checked(number, self._raw(number))
            if entry is not None:
                out.append(entry)
        skipped = max(total - seq, 0) - len(numbers)
        return out, total, skipped

    def window(self, start: float | None = None, stop: float | None = None,
               limit: int = 100_000) -> list:
        """Entries whose task ran at least partly between ``start`` and ``stop``
        (seconds since the epoch; None: unbounded), at most the newest ``limit``, oldest
        first. Walks back from the newest entry and stops at the first one that ended
        well before ``start`` (entries arrive roughly in order of their stop time)."""
        out = []
        slack = 60.0  # reports from different workers arrive out of order by this much
        for number in range(self.total - 1, self.first - 1, -1):
            entry = _checked(number, self._raw(number))
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
