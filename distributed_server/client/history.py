"""What happened in the cluster, as the client asks for it: the story of keys
(`Client.story`), the log lines of the scheduler and the workers (`get_scheduler_logs`,
`get_worker_logs`) and the task stream (`get_task_stream`, which `performance_report`
reads too).

`HistoryMixin` is one of the classes `Client` is made of. The scheduler answers each
from what it keeps (bounded logs, its last 100,000 tasks) and asks its workers where
needed; workers that do not answer in time are named, never waited for.
"""
from __future__ import annotations

import datetime
import math
import warnings

from .. import logs
from ..protocol.stories import StoryEntry, WorkerSilent, check_timeout
from .futures import Future

__all__ = ["HistoryMixin"]


class HistoryMixin:
    """Stories, logs and the task stream.

    Mixed into `Client`, which provides ``_sync`` and ``_request``.
    """

    def story(self, *keys, timeout: float = 5.0):
        """What happened to these keys (or futures), in the scheduler and on every worker:
        a list of `StoryEntry` ``(key, start, finish, stimulus_id, time, where)`` sorted
        by time. Workers that do not answer within ``timeout`` seconds are left out with
        a RuntimeWarning naming them. KeyError for a key that neither the scheduler nor
        any worker knows (never submitted, or forgotten and out of their bounded logs).
        """
        keys = [k.key if isinstance(k, Future) else k for k in keys]
        if not keys:
            raise TypeError("story() needs at least one key or future")
        try:
            hash(tuple(keys))
        except TypeError:
            raise TypeError(f"story(): keys must be hashable, got {keys!r:.200}") from None
        timeout = check_timeout(timeout)
        return self._sync(self._story, keys, timeout)

    async def _story(self, keys: list, timeout: float) -> list:
        result = await self._request("story", keys=keys, timeout=timeout)
        if result["unknown"]:
            raise KeyError(f"no story for {list(result['unknown'])!r:.300}: neither the "
                           "scheduler nor any worker knows it (never submitted here, or "
                           "forgotten and out of their bounded logs)")
        _warn_silent("story", result["silent"])
        return [StoryEntry(*entry) for entry in result["story"]]

    def get_scheduler_logs(self, n: int | None = None):
        """The scheduler's last ``n`` log lines (every line it keeps, up to 10,000, for
        None), oldest first."""
        n = logs.check_line_count(n)
        return self._sync(self._scheduler_logs, n)

    async def _scheduler_logs(self, n) -> list:
        return list(await self._request("scheduler-logs", n=n))

    def get_worker_logs(self, n: int | None = None, timeout: float = 5.0):
        """``{worker address: its last n log lines}`` (every line kept, up to 10,000, for
        None), oldest first. A worker that does not answer within ``timeout`` seconds
        (or left meanwhile) gets a `WorkerSilent` exception saying so instead of lines."""
        n = logs.check_line_count(n)
        timeout = check_timeout(timeout)
        return self._sync(self._worker_logs, n, timeout)

    async def _worker_logs(self, n, timeout: float) -> dict:
        result = await self._request("worker-logs", n=n, timeout=timeout)
        answers: dict = {address: list(lines) for address, lines in result["logs"].items()}
        for address, reason in result["silent"].items():
            answers[address] = WorkerSilent(f"worker {address} did not answer: {reason}")
        return dict(sorted(answers.items()))

    def get_task_stream(self, start=None, stop=None):
        """The tasks that ran (finished or failed) at some time between ``start`` and
        ``stop``: seconds since the epoch (``time.time()``) or datetimes, None for no
        bound. A list of ``{"key", "worker", "start", "stop", "status"}`` ("memory" or
        "erred"), oldest report first. The scheduler remembers its last 100,000 tasks;
        times are the clocks of the workers that ran them."""
        start, stop = _time_bound(start, "start"), _time_bound(stop, "stop")
        if start is not None and stop is not None and start > stop:
            raise ValueError(f"start ({start}) is after stop ({stop})")
        return self._sync(self._get_task_stream, start, stop)

    async def _get_task_stream(self, start, stop) -> list:
        return (await self._task_stream_and_counters(start, stop))["tasks"]

    async def _task_stream_and_counters(self, start, stop) -> dict:
        """``{"tasks": [...], "counters": {...}}`` (`Scheduler.counters`)."""
        result = await self._request("task-stream", start=start, stop=stop)
        return {"tasks": [dict(task) for task in result["tasks"]],
                "counters": dict(result["counters"])}


def _time_bound(value, name: str) -> float | None:
    """A task stream bound: None, a number of seconds since the epoch, or a datetime."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    if type(value) in (int, float) and math.isfinite(value):
        return float(value)
    raise TypeError(f"{name} must be None, seconds since the epoch or a datetime, not "
                    f"{value!r:.100}")


def _warn_silent(what: str, silent: dict) -> None:
    if silent:
        named = "; ".join(f"{address}: {reason}" for address, reason in sorted(silent.items()))
        warnings.warn(f"{what}: {len(silent)} worker(s) left out: {named}", RuntimeWarning,
                      stacklevel=4)
