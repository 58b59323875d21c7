"""Stories and logs gathered from workers (``Client.story``, ``Client.get_worker_logs``):
what a client may ask, what a worker's answer may hold, and what the client gets back.

What this module does
---------------------
- The scheduler asks every worker over its stream (scheduler/worker_requests.py) and
  puts the answers together with what is here.
- `check_story_answer` / `check_logs_answer` check what a worker sent (shape, size, only
  the keys asked about) before it goes anywhere; `merge_stories` puts the scheduler's
  and the workers' transitions into one list sorted by time.
- On the client: `StoryEntry` (one transition, and where it happened) and
  `WorkerSilent`, what `Client.get_worker_logs` gives for a worker that did not answer.

What it never does
------------------
It never unpickles: keys are msgpack values and travel as they came. It never touches
the state machine: the scheduler passes in ``SchedulerState.story``'s entries.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from distributed_core import bounded_repr

__all__ = ["MAX_STORY_KEYS", "MAX_TIMEOUT", "StoryEntry", "WorkerSilent",
           "check_logs_answer", "check_story_answer", "check_timeout", "merge_stories"]

#: Most keys one story request may ask about.
MAX_STORY_KEYS = 1_000
#: Longest a client may ask the scheduler to wait for its workers (seconds).
MAX_TIMEOUT = 300.0
#: Most entries a worker's story answer may hold per key asked about (its log is bounded).
MAX_ENTRIES_PER_KEY = 100_000
#: Most lines a worker's logs answer may hold (its buffer keeps 10,000).
MAX_LOG_LINES = 10_000
#: Longest log line kept from a worker's answer (characters).
MAX_LINE_CHARS = 100_000


class StoryEntry(NamedTuple):
    """One transition of a key: from state ``start`` to ``finish`` because of the stimulus
    ``stimulus_id``, at ``time`` (seconds since the epoch, the clock of the process where
    it happened), ``where`` ("scheduler" or a worker's address)."""

    key: Any
    start: str
    finish: str
    stimulus_id: str
    time: float
    where: str


class WorkerSilent(TimeoutError):
    """A worker did not answer (in time, or at all): `Client.get_worker_logs` gives this,
    with the reason, in place of the worker's lines."""


def check_timeout(timeout) -> float:
    """A client's ``timeout`` for waiting on workers: a number in (0, MAX_TIMEOUT]."""
    if type(timeout) not in (int, float) or not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], "
                         f"not {bounded_repr(timeout, 60)}")
    return float(timeout)


def check_story_answer(answer, keys: set) -> list:
    """A worker's story entries ``(key, start, finish, stimulus_id, time)``, checked:
    ValueError if the answer is not a list of such entries about ``keys``."""
    if not isinstance(answer, (list, tuple)) or len(answer) > MAX_ENTRIES_PER_KEY * len(keys):
        raise ValueError(f"a story must be a list of entries, not {bounded_repr(answer, 80)}")
    entries = []
    for entry in answer:
        if not isinstance(entry, (list, tuple)) or len(entry) != 5:
            raise ValueError(f"a story entry must have 5 fields: {bounded_repr(entry, 80)}")
        key, start, finish, stimulus_id, time = entry
        try:
            asked = key in keys
        except TypeError:
            asked = False
        if not asked or not all(isinstance(v, str) for v in (start, finish, stimulus_id)) \
                or type(time) not in (int, float) or not math.isfinite(time):
            raise ValueError(f"a story entry of a key not asked about, or with bad fields: "
                             f"{bounded_repr(entry, 80)}")
        entries.append(entry)
    return entries


def check_logs_answer(answer) -> list:
    """A worker's log lines, checked: ValueError unless a list of at most
    `MAX_LOG_LINES` strings (each cut to `MAX_LINE_CHARS`)."""
    if not isinstance(answer, (list, tuple)) or len(answer) > MAX_LOG_LINES \
            or not all(isinstance(line, str) for line in answer):
        raise ValueError(f"logs must be a list of at most {MAX_LOG_LINES} strings, not "
                         f"{bounded_repr(answer, 80)}")
    return [line[:MAX_LINE_CHARS] for line in answer]


def merge_stories(scheduler_entries: list, worker_entries: dict) -> list:
    """One story sorted by time (stable: one process's entries keep their order):
    ``[key, start, finish, stimulus_id, time, where]``, where ``where`` is
    ``"scheduler"`` or a worker's address."""
    merged = [[*entry, "scheduler"] for entry in scheduler_entries]
    for address, entries in worker_entries.items():
        merged.extend([*entry, address] for entry in entries)
    merged.sort(key=_time_of)
    return merged


def _time_of(entry: list) -> float:
    return entry[4]
