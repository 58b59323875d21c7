"""``/metrics`` in Prometheus' text format, from collectors that read at scrape time.

Each server gets its own ``CollectorRegistry`` (never prometheus_client's global one, so
two servers in one process never mix): a collector that turns the server's figures into
metric families when scraped, plus prometheus_client's process collector
(``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ...). Nothing is
updated per task: every figure is read when Prometheus asks.

Names follow Prometheus' conventions: ``dcore_scheduler_*`` and ``dcore_worker_*``,
base units in the name (``_bytes``, ``_seconds``), ``_total`` on counters, labels with
bounded values (a task state, a task prefix, a worker address; never a key).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from distributed_core import COMPILED, __version__

from ..comm import TRAFFIC
from ..diagnostics.gc_pauses import GC_PAUSES
from .figures import STATES, SchedulerFigures

__all__ = ["CONTENT_TYPE_LATEST", "Exposition", "registry_for", "SchedulerCollector",
           "WorkerCollector"]


def registry_for(collector) -> CollectorRegistry:
    """A fresh registry holding ``collector`` and this process's process metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


class Exposition:
    """A registry's metrics in the text exposition format, scrape after scrape.

    prometheus_client formats every sample of every family on each scrape (~0.5 ms of
    the scheduler's CPU for its ~40 families); most families (the info, thread and
    worker counts, per-worker figures of idle workers, ...) have not changed since the
    last scrape. ``render()`` collects the families, as ``generate_latest`` would, and
    formats only those whose samples differ from the last scrape's: the text of the
    others is reused. It holds the text of one scrape, no more."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._texts: dict = {}  # the last scrape's families: their key -> their text

    def render(self) -> bytes:
        """Every metric, read now, as ``generate_latest(registry)`` answers."""
        texts = {}
        last = self._texts
        for family in self.registry.collect():
            key = (family.name, family.type, family.documentation,
                   tuple([(s.name, tuple(s.labels.items()), s.value, s.timestamp)
                          for s in family.samples]))
            text = last.get(key)
            if text is None:
                text = generate_latest(_OneFamily(family))
            texts[key] = text
        self._texts = texts
        return b"".join(texts.values())


class _OneFamily:
    """One metric family where ``generate_latest`` expects a registry."""

    __slots__ = ("family",)

    def __init__(self, family) -> None:
        self.family = family

    def collect(self):
        return (self.family,)


def _gauge(name: str, doc: str, value=None, labels=()):
    family = GaugeMetricFamily(name, doc, labels=list(labels) or None)
    if value is not None:
        family.add_metric([], value)
    return family


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _traffic(prefix: str):
    yield _counter(f"{prefix}_comm_sent_bytes", "Bytes this process wrote to its comms "
                   "(frames of msgpack, handshakes included)", TRAFFIC.bytes_sent)
    yield _counter(f"{prefix}_comm_received_bytes", "Bytes this process read from its "
                   "comms", TRAFFIC.bytes_received)
    yield _counter(f"{prefix}_comm_sent_frames", "Frames written", TRAFFIC.frames_sent)
    yield _counter(f"{prefix}_comm_received_frames", "Frames read", TRAFFIC.frames_received)


def _loop_lag(prefix: str, lag):
    yield _gauge(f"{prefix}_event_loop_lag_seconds", "How late the event loop ran the "
                 "latest lag-probe timer", lag.last)
    yield _gauge(f"{prefix}_event_loop_lag_max_seconds", "The largest event-loop lag of the "
                 f"last {lag._recent.maxlen} probes ({lag.interval} s apart)", lag.recent_max)
    yield HistogramMetricFamily(
        f"{prefix}_event_loop_lag_probes_seconds", f"How late each lag probe ({lag.interval} "
        "s apart) ran, since the process started",
        buckets=[(floatToGoString(bound), n) for bound, n in lag.cumulative()],
        sum_value=lag.total)


def _gc_pauses(prefix: str):
    """Garbage-collection pauses, once the process times them (the ``dcore`` command)."""
    if not GC_PAUSES.installed:
        return
    total = CounterMetricFamily(f"{prefix}_gc_pause_seconds", "Time garbage collections "
                                "stopped this process, by generation", labels=["generation"])
    longest = GaugeMetricFamily(f"{prefix}_gc_pause_max_seconds", "The longest single "
                                "garbage-collection pause, by generation",
                                labels=["generation"])
    for generation in range(3):
        total.add_metric([str(generation)], GC_PAUSES.total[generation])
        longest.add_metric([str(generation)], GC_PAUSES.longest[generation])
    yield total
    yield longest


def _info(prefix: str, what: str):
    info = GaugeMetricFamily(f"{prefix}_info", f"This {what}: version and core",
                             labels=["version", "compiled"])
    info.add_metric([__version__, str(COMPILED).lower()], 1)
    return info


class SchedulerCollector:
    """The scheduler's metrics (``dcore_scheduler_*``), read from `SchedulerFigures`."""

    def __init__(self, figures: SchedulerFigures) -> None:
        self.figures = figures

    def describe(self):
        """Nothing up front: the families depend on the figures (auto_describe off)."""
        return []

    def collect(self):
        """Every metric family, from one read of the figures."""
        figures = self.figures
        p = "dcore_scheduler"
        yield _info(p, "scheduler")
        totals, by_prefix = figures.task_counts()
        tasks = _gauge(f"{p}_tasks", "Tasks the scheduler holds, by state", labels=["state"])
        for state in STATES:
            tasks.add_metric([state], totals.get(state, 0))
        yield tasks
        prefix_tasks = _gauge(f"{p}_prefix_tasks", "Tasks the scheduler holds, by task "
                              "prefix (the function name) and state",
                              labels=["prefix", "state"])
        for name, counts in by_prefix.items():
            for state, n in counts.items():
                if n:
                    prefix_tasks.add_metric([name, state], n)
        yield prefix_tasks
        workers = figures.workers()
        yield _gauge(f"{p}_workers", "Workers connected", len(workers))
        yield _gauge(f"{p}_threads", "Threads of all workers",
                     sum(w["nthreads"] for w in workers))
        per_worker = [
            ("threads", "Threads of the worker", "nthreads"),
            ("processing_tasks", "Tasks the scheduler assigned to the worker, not yet done",
             "processing"),
            ("memory_tasks", "Results the worker holds (the scheduler's count)", "in_memory"),
            ("result_bytes", "Bytes of results the worker holds (the sizes it reported)",
             "nbytes"),
            ("memory_bytes", "The worker process's resident memory (last heartbeat)",
             "memory"),
            ("managed_bytes", "Bytes of results in the worker's memory, by their sizes, "
                              "under a memory limit (last heartbeat)", "managed"),
            ("spilled_bytes", "Bytes of results the worker spilled to disk (last "
                              "heartbeat)", "spilled"),
            ("cpu_ratio", "The worker process's CPU use, in cores (1.0 = one core busy; "
                          "last heartbeat)", "cpu"),
            ("paused", "1 if the worker is paused (memory is short), else 0", "paused"),
        ]
        for suffix, doc, field in per_worker:
            family = _gauge(f"{p}_worker_{suffix}", doc, labels=["worker"])
            for w in workers:
                value = w[field]
                if value is not None:
                    family.add_metric([w["address"]], float(value))
            yield family
        server = figures.server()
        yield _gauge(f"{p}_clients", "Clients connected", server["clients"])
        yield _counter(f"{p}_transitions", "Task state transitions", server["transitions"])
        yield _counter(f"{p}_stimuli", "Stimuli run by the state machine (messages and "
                       "events it handled)", server["stimuli"])
        yield _counter(f"{p}_graph_updates", "Graph updates (update-graph messages) taken "
                       "in", server["graph_updates"])
        yield _counter(f"{p}_graph_tasks", "Tasks received in graph updates",
                       server["graph_tasks"])
        yield _counter(f"{p}_graph_intake_seconds", "Time the scheduler spent taking in "
                       "graph updates (checking and adding their tasks)",
                       server["graph_intake_seconds"])
        yield _counter(f"{p}_task_stream_records", "Task outcomes recorded in the task "
                       "stream", server["task_stream_total"])
        yield from _loop_lag(p, figures.scheduler.loop_lag)
        yield from _gc_pauses(p)
        trimmer = figures.scheduler.heap_trimmer
        yield _counter(f"{p}_heap_trim_seconds", "Time spent giving freed heap memory "
                       "back to the operating system after big releases", trimmer.seconds)
        yield _gauge(f"{p}_heap_trim_max_seconds", "The longest single heap trim",
                     trimmer.longest)
        yield _counter(f"{p}_empty_pool_bytes_released", "Bytes of the small-object "
                       "allocator's empty pools given back to the operating system",
                       trimmer.pool_bytes)
        yield from _traffic(p)


class WorkerCollector:
    """A worker's metrics (``dcore_worker_*``), read from the worker and its machine."""

    def __init__(self, worker, loop_lag) -> None:
        self.worker = worker
        self.loop_lag = loop_lag

    def describe(self):
        """Nothing up front (auto_describe off)."""
        return []

    def collect(self):
        """Every metric family, read now."""
        worker = self.worker
        p = "dcore_worker"
        yield _info(p, "worker")
        core = worker.state
        tasks = _gauge(f"{p}_tasks", "Tasks the worker knows, by what it does with them",
                       labels=["state"])
        if core is not None:
            in_flight = sum(len(keys) for keys in core.in_flight.values())
            counts = {"executing": len(core.executing_tasks), "ready": core.n_ready,
                      "constrained": len(core.constrained), "fetch": len(core.data_needed),
                      "flight": in_flight, "memory": len(worker.data)}
            for state, n in counts.items():
                tasks.add_metric([state], n)
            yield _gauge(f"{p}_known_tasks", "Tasks the worker's state machine holds",
                         len(core.tasks))
            yield _counter(f"{p}_transitions", "Task state transitions on the worker",
                           core.transition_counter)
        yield tasks
        yield _gauge(f"{p}_threads", "Executor threads", worker.nthreads)
        figures = worker.memory_figures()
        yield _gauge(f"{p}_memory_bytes", "Resident memory of the worker process",
                     figures["memory"])
        if figures["managed"] is not None:
            yield _gauge(f"{p}_managed_bytes", "Bytes of results in memory, by their sizes",
                         figures["managed"])
        yield _gauge(f"{p}_spilled_bytes", "Bytes of results spilled to disk",
                     figures["spilled"] or 0)
        yield _gauge(f"{p}_paused", "1 if the worker is paused (memory is short)",
                     int(figures["paused"]))
        yield _gauge(f"{p}_memory_limit_bytes", "The worker's memory limit (0: none)",
                     worker.memory_limit)
        yield from _loop_lag(p, self.loop_lag)
        yield from _gc_pauses(p)
        yield from _traffic(p)
