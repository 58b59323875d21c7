"""``Client.story`` and ``Client.get_worker_logs``: the scheduler asks every worker over its
stream and puts the answers together; the client turns them into what users read.

What this module does
---------------------
- `WorkerRequests` sends one request to each worker on the worker's own connection
  (``{"op": "story" | "logs", "reqid", ...}``) and waits for the ``reply`` messages
  the workers send back on theirs, for at most a timeout: a worker that does not answer
  in time, leaves meanwhile, or answers with an error is reported as silent, with the
  reason, and never waited on beyond the timeout.
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

import asyncio
import itertools
import math
from typing import Any, NamedTuple

from .comm import CommClosedError, bounded_repr

__all__ = ["MAX_STORY_KEYS", "MAX_TIMEOUT", "StoryEntry", "WorkerRequests", "WorkerSilent",
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


class WorkerRequests:
    """Requests to workers over their streams, matched to their ``reply`` by
    ``(worker address, reqid)``: a worker can answer only what it was asked."""

    def __init__(self) -> None:
        self._pending: dict = {}  # (address, reqid) -> asyncio.Future
        self._ids = itertools.count(1)

    async def ask(self, comms: dict, msg: dict, timeout: float) -> tuple[dict, dict]:
        """Send ``msg`` (plus a ``reqid``) to every worker in ``comms`` (address -> Comm)
        and wait up to ``timeout`` seconds in all. Returns ``(answers, silent)``:
        ``{address: result}`` and ``{address: why there is no answer}``."""
        loop = asyncio.get_running_loop()
        waiting: dict = {}
        silent: dict = {}
        for address, comm in comms.items():
            reqid = next(self._ids)
            future = loop.create_future()
            try:
                comm.send({**msg, "reqid": reqid})
            except CommClosedError:
                silent[address] = "its connection is closed"
                continue
            self._pending[(address, reqid)] = future
            waiting[address] = (reqid, future)
        try:
            if waiting:
                await asyncio.wait([f for _, f in waiting.values()], timeout=timeout)
        finally:
            for address, (reqid, _) in waiting.items():
                self._pending.pop((address, reqid), None)
        answers = {}
        for address, (_, future) in waiting.items():
            if not future.done():
                future.cancel()
                silent[address] = f"no answer within {timeout:g} s"
            elif future.cancelled():
                silent[address] = "it left the cluster"
            else:
                ok, value = future.result()
                if ok:
                    answers[address] = value
                else:
                    silent[address] = value
        return answers, silent

    def answer(self, address: str, msg: dict) -> None:
        """A worker's ``reply {reqid, result | error}``; one nobody waits for is dropped."""
        reqid = msg.get("reqid")
        if type(reqid) is not int:
            return
        future = self._pending.pop((address, reqid), None)
        if future is None or future.done():
            return
        if "error" in msg:
            future.set_result((False, f"it answered with an error: "
                                      f"{bounded_repr(msg.get('error'), 300)}"))
        else:
            future.set_result((True, msg.get("result")))

    def worker_left(self, address: str) -> None:
        """``address`` is gone: whatever it was asked will never be answered."""
        for pending in [p for p in self._pending if p[0] == address]:
            future = self._pending.pop(pending)
            if not future.done():
                future.cancel()


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
