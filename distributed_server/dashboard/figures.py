"""The scheduler's figures, read cheaply: what the status page, the JSON API and
``/metrics`` show.

Every reader goes through `SchedulerFigures`, and every count of tasks comes from one
function, `_task_counts`: the single place that knows how the core exposes them. With
the core's O(1) counters (``SchedulerState.prefix_counts()`` / ``task_counts()``) a read
costs O(prefixes + workers). A core without them is walked (O(tasks)), and a walk's
counts are reused for `WALK_REUSE` times as long as it took, so an open page costs the
scheduler at most ~1% however large the graph (its counts then lag by up to that long).

What it never does: change the state, or walk the tasks when the core keeps counts.
"""
from __future__ import annotations

import time

from distributed_core import COMPILED, TASK_STATES, __version__

from ..comm import TRAFFIC

__all__ = ["SchedulerFigures", "PREFIX_STATES", "MAX_PREFIXES"]

#: Task states the figures report (forgotten tasks are gone).
STATES = tuple(s for s in TASK_STATES if s != "forgotten")
#: The states a prefix's progress bar shows, in order.
PREFIX_STATES = ("released", "waiting", "queued", "no-worker", "processing", "memory",
                 "erred")
#: Most prefixes the JSON status lists (those with the most tasks).
MAX_PREFIXES = 200
#: Without the core's counters, a walk's counts serve for this many times as long as the
#: walk took: walks cost at most ~1 / WALK_REUSE of the scheduler's time.
WALK_REUSE = 100


def _task_counts(state) -> tuple[dict, dict] | None:
    """``({state: n}, {prefix: {state: n}})`` read from the core's counters, or None if
    the core keeps none (then `_walk_tasks` counts).

    The one place that reads task counts from the core."""
    prefix_counts = getattr(state, "prefix_counts", None)
    if prefix_counts is None:
        return None
    totals = dict.fromkeys(STATES, 0)
    totals.update(state.task_counts())
    by_prefix = {name: figures["task_counts"] for name, figures in prefix_counts().items()}
    return totals, by_prefix


def _walk_tasks(state) -> tuple[dict, dict]:
    """The same counts by a walk over every task (a core without counters)."""
    totals = dict.fromkeys(STATES, 0)
    by_prefix: dict = {}
    for ts in state.tasks.values():
        name = ts.prefix.name
        counts = by_prefix.get(name)
        if counts is None:
            counts = by_prefix[name] = dict.fromkeys(PREFIX_STATES, 0)
        counts[ts.state] += 1
        totals[ts.state] += 1
    return totals, by_prefix


class SchedulerFigures:
    """Read-only views of one `Scheduler`'s state and server counters."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.started = time.time()
        self._walked: tuple | None = None  # the last walk's counts, and when
        self._walked_at = 0.0
        self._walk_valid_until = 0.0

    def task_counts(self) -> tuple[dict, dict]:
        """``({state: n}, {prefix: {state: n}})``: from the core's counters, or else
        from a walk over the tasks that is reused for `WALK_REUSE` times as long as it
        took, so that walks take at most ~1% of the scheduler's time however often the
        figures are read (a million tasks: a walk of ~0.2 s is redone every ~20 s)."""
        counted = _task_counts(self.scheduler.state)
        if counted is not None:
            self._walked = None
            return counted
        now = time.monotonic()
        if self._walked is None or now >= self._walk_valid_until:
            started = time.perf_counter()
            self._walked = _walk_tasks(self.scheduler.state)
            took = time.perf_counter() - started
            self._walked_at = now
            self._walk_valid_until = now + WALK_REUSE * took
        return self._walked

    @property
    def counts_age(self) -> float:
        """Seconds since the task counts shown were taken (0 with the core's counters)."""
        return 0.0 if self._walked is None else time.monotonic() - self._walked_at

    def workers(self) -> list:
        """One dict per worker: its address, name, threads, tasks processing and held,
        bytes held (by the scheduler's count) and its last heartbeat's memory, spill,
        CPU and paused figures (None where unknown)."""
        scheduler = self.scheduler
        memory = scheduler.worker_memory
        links = scheduler.worker_dashboards
        out = []
        for address, ws in scheduler.state.workers.items():
            figures = memory.get(address) or {}
            out.append({
                "address": address, "name": str(ws.name), "nthreads": ws.nthreads,
                "processing": len(ws.processing), "in_memory": len(ws.has_what),
                "nbytes": ws.nbytes, "memory": figures.get("memory"),
                "managed": figures.get("managed"), "spilled": figures.get("spilled"),
                "cpu": figures.get("cpu"), "paused": bool(figures.get("paused", False)),
                "dashboard": links.get(address),
            })
        return out

    def server(self) -> dict:
        """Server-side counters: stimuli, transitions, loop lag, traffic, graph intake."""
        scheduler = self.scheduler
        lag = scheduler.loop_lag
        return {
            "stimuli": scheduler.n_stimuli,
            "transitions": scheduler.state.transition_counter,
            "loop_lag": lag.last, "loop_lag_max": lag.recent_max,
            "bytes_sent": TRAFFIC.bytes_sent, "bytes_received": TRAFFIC.bytes_received,
            "graph_updates": scheduler.graph_updates,
            "graph_tasks": scheduler.graph_tasks,
            "graph_intake_seconds": scheduler.graph_intake_seconds,
            "clients": len(scheduler.client_comms),
            "task_stream_total": scheduler.task_stream.total,
        }

    def status(self) -> dict:
        """Everything the status page shows, JSON-ready (``/api/v1/status``)."""
        scheduler = self.scheduler
        totals, by_prefix = self.task_counts()
        prefixes = sorted(((name, counts) for name, counts in by_prefix.items()
                           if any(counts.values())),
                          key=lambda item: -sum(item[1].values()))
        shown = [{"name": name, **{s: counts.get(s, 0) for s in PREFIX_STATES}}
                 for name, counts in prefixes[:MAX_PREFIXES]]
        shown.sort(key=lambda p: p["name"])
        workers = self.workers()
        known = [w for w in workers if w["memory"] is not None]
        cluster = {
            "workers": len(workers),
            "threads": sum(w["nthreads"] for w in workers),
            "tasks": sum(totals.values()),
            "nbytes": sum(w["nbytes"] for w in workers),
            "memory": sum(w["memory"] for w in known),
            "spilled": sum(w["spilled"] or 0 for w in workers),
            "cpu": sum(w["cpu"] or 0 for w in workers),
            "paused": sum(w["paused"] for w in workers),
        }
        return {
            "time": time.time(),
            "scheduler": {"address": scheduler.address, "version": __version__,
                          "compiled": COMPILED, "started": self.started},
            "cluster": cluster, "tasks": totals, "prefixes": shown,
            "counts_age": self.counts_age,
            "prefixes_not_shown": max(len(prefixes) - MAX_PREFIXES, 0),
            "workers": workers, "server": self.server(),
        }
