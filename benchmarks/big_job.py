"""Does a big job stall the scheduler for everyone else, in any of its phases?

A LocalCluster (2 workers of 1 thread) runs the big job of one client while a second
client process, the probe, makes O(1) round trips to the scheduler (``who_has([])``)
every 10 ms. Each round trip is counted in the phase it started in. Printed: the probe's
worst and 99th-percentile wait per phase and when in the phase the worst began ("at s"),
how long each phase took, the scheduler's RSS (at the start, its peak in each phase, at
the end), how many of the scheduler's own event-loop lag probes (0.5 s apart) ran over
100 ms late in each phase ("sched late": none, with a long worst wait, means the probe's
side stalled, not the scheduler's loop), and the caller's CPU per task of intake. The target (issue 25) is a worst wait under 100 ms in every phase. The map also
prints its figures beside issue 25's target 2: when the first task was done, how much the
scheduler grew per task in flight and the client per future held, and the scheduler's
RSS 5 s and 50 s after the release against its RSS before the map (the heap
trimmer's late collecting trims come 10, 25 and 45 s after the release).

Jobs (``--jobs``, all by default):

- ``map``: ``client.map(noop, range(N), pure=False)``: intake (until ``map`` returns),
  run (until every future is done), gather, release (until the scheduler holds no task).
- ``dask``: a dask.array graph of about N tasks (``(da.ones(N, chunks=1) + 1).sum()``):
  dask's own graph building (reported apart), intake (``client.compute``), run, release.
  The intake's CPU on the caller is split: dask's optimizing and materializing, dask's
  ordering (with collecting the cyclic garbage ``dask.order`` leaves: dask's own objects,
  which only the collector frees), and ours (with pickling the nodes and our lean order
  of a graph over a million tasks apart). The RSS sampler's thread is not counted.
  Optimized, dask fuses it to 4 N / 3 tasks; with ``--dask-unoptimized``
  (``optimize_graph=False``) the 10 N / 3 tasks dask built are sent as they are.
- ``cancel``: N / 10 futures waiting on one sleeping task are cancelled; the phase ends
  when the next ``submit(inc, 1).result()`` returns (its time is printed too).
- ``death``: the worker holding the N results of a map is SIGKILLed; the phase ends when
  the survivor holds all N again.

::

    python benchmarks/big_job.py 1000000
    python benchmarks/big_job.py 200000 --jobs map,cancel --json
    python benchmarks/big_job.py 3000000 --jobs dask --dask-unoptimized  # 10,000,003 tasks
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import resource
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import psutil  # noqa: E402
from _e2e_tasks import inc, noop, second, wait_for_event  # noqa: E402
from e2e import save_results  # noqa: E402
from release_stall import (  # noqa: E402
    _env,
    _gc_pauses,
    _probe_waits,
    _scheduler_samples,
    _start_probe,
)

from distributed_server import Client, Event, LocalCluster, wait  # noqa: E402

TARGET_WORST_MS = 100.0
#: Issue 25's target 2, for the map: bytes per task the scheduler may grow by while the
#: tasks are in flight, bytes per future the client may hold, and how far above its start
#: the scheduler's RSS may stay after the release.
TARGET_SCHEDULER_BYTES = 600
TARGET_CLIENT_BYTES = 400
TARGET_INTAKE_US = 5.0  # our intake's CPU per task on the caller
TARGET_RSS_ABOVE_START = 0.10
#: Seconds after the release before the scheduler's RSS is read.
RSS_SETTLE_S = 5.0
#: ...and later, once the heap trimmer's late collecting trims have run (the issue's
#: first figures were read from 5 s to 30 s after the release).
RSS_LATER_S = 50.0
#: Seconds between the probe's requests.
PROBE_INTERVAL = 0.01


class Phases:
    """Phase marks on the wall clock, and the scheduler's RSS sampled every 50 ms."""

    def __init__(self, scheduler_pid: int, late_probes=None):
        self.marks: list[tuple[str, float, float]] = []
        #: Reads how many of the scheduler's own loop-lag probes ran over 100 ms late so
        #: far (None: not read); each phase reports its difference.
        self._late_probes = late_probes
        self._late_at_begin = 0
        self.late: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.process = psutil.Process(scheduler_pid)
        self.rss_start = self.process.memory_info().rss
        self._current: str | None = None
        self._stop = threading.Event()
        #: The sampler's own CPU so far: this process's, not the caller's (see `_cpu`).
        self.sampler_cpu = 0.0
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            name = self._current
            if name is not None:
                rss = self.process.memory_info().rss
                self.peak[name] = max(self.peak.get(name, 0), rss)
            self.sampler_cpu = time.thread_time()

    def begin(self, name: str) -> float:
        if self._late_probes is not None:
            self._late_at_begin = self._late_probes()
        self._current = name
        self._started = time.time()
        return self._started

    def end(self) -> float:
        ended = time.time()
        self.marks.append((self._current, self._started, ended))
        if self._late_probes is not None:
            self.late[self._current] = self._late_probes() - self._late_at_begin
        self.peak[self._current] = max(self.peak.get(self._current, 0),
                                       self.process.memory_info().rss)
        self._current = None
        return ended

    def close(self) -> None:
        self._stop.set()
        self._sampler.join()

    def figures(self, waits: list) -> list[dict]:
        """Per phase: seconds, probe requests, worst and p99 wait, peak RSS."""
        out = []
        for name, start, stop in self.marks:
            timed = [(w, at - w) for at, w in waits if start <= at - w <= stop]
            during = sorted(w for w, _ in timed)
            worst = max(timed, default=(0.0, start))
            out.append({
                "phase": name, "seconds": stop - start, "probe_requests": len(during),
                "worst_ms": 1e3 * worst[0],
                # when the worst request began, in seconds into the phase: to match it
                # with the scheduler's log (trims, collections) or the client's work
                "worst_at_s": worst[1] - start,
                # the scheduler's own lag probes (0.5 s apart) over 100 ms late: 0 with a
                # long worst wait means the probe's side stalled, not the scheduler's loop
                "scheduler_late_probes": self.late.get(name),
                "p99_ms": 1e3 * during[int(0.99 * (len(during) - 1))] if during else 0.0,
                "peak_rss_mib": self.peak.get(name, 0) / 2**20,
            })
        return out


def _scheduler_pid() -> int:
    for child in psutil.Process().children(recursive=True):
        if "scheduler" in " ".join(child.cmdline()):
            return child.pid
    raise RuntimeError("no scheduler process found")


def _n_tasks(cluster) -> int:
    return cluster.scheduler_info()["n_tasks"]


def _until_empty(cluster, leave: int = 0) -> None:
    while _n_tasks(cluster) > leave:
        time.sleep(0.05)


def _cpu(phases: Phases) -> float:
    """This process's CPU time so far, but for the RSS sampler's thread (the benchmark's
    own, not the caller's: 0.3 us a task of the dask intake)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime - phases.sampler_cpu


def job_map(client, cluster, phases: Phases, n: int) -> dict:
    """Intake, run, gather and release of a map of ``n`` no-op tasks; with issue 25's
    target-2 figures: when the first task was done, the client's and the scheduler's
    bytes per task held, and the scheduler's RSS after the release."""
    me = psutil.Process()
    client_before = me.memory_info().rss
    scheduler_before = phases.process.memory_info().rss
    first = FirstDone(cluster)
    began = phases.begin("map: intake")
    cpu = _cpu(phases)
    futures = client.map(noop, range(n), pure=False)
    cpu = _cpu(phases) - cpu
    phases.end()
    client_held = me.memory_info().rss - client_before
    phases.begin("map: run")
    wait(futures)
    phases.end()
    scheduler_peak = max(phases.peak["map: intake"], phases.peak["map: run"])
    phases.begin("map: gather")
    results = client.gather(futures)
    phases.end()
    assert len(results) == n
    phases.begin("map: release")
    del futures, results
    _until_empty(cluster)
    phases.end()
    time.sleep(RSS_SETTLE_S)
    after_release = phases.process.memory_info().rss
    time.sleep(RSS_LATER_S - RSS_SETTLE_S)
    return {"map_intake_caller_cpu_us_per_task": 1e6 * cpu / n,
            "map_first_task_done_s": first.seen() - began,
            "map_client_bytes_per_future": client_held / n,
            "map_scheduler_bytes_per_task": (scheduler_peak - scheduler_before) / n,
            "map_scheduler_rss_before_mib": scheduler_before / 2**20,
            "map_scheduler_rss_after_release_mib": after_release / 2**20,
            "map_scheduler_rss_later_mib": phases.process.memory_info().rss / 2**20}


class FirstDone:
    """Polls the scheduler from a thread (every 50 ms, once ``begin`` is set if given)
    until a task is in memory: when. Each poll is a connection of its own; one that
    fails (its handshake starved of the GIL while dask materializes a graph on the main
    thread) is tried again."""

    def __init__(self, cluster, begin: threading.Event | None = None) -> None:
        self._cluster = cluster
        self._begin = begin
        self._at: float | None = None
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        if self._begin is not None:
            self._begin.wait()
        while True:
            try:
                done = self._cluster.scheduler_info()["task_counts"].get("memory", 0)
            except Exception as exc:  # noqa: BLE001 - a poll that failed is tried again
                print(f"first-task poll failed, trying again: {exc!r}", file=sys.stderr)
                done = 0
            if done:
                break
            time.sleep(0.05)
        self._at = time.time()

    def seen(self) -> float:
        """The wall-clock time the first task was seen in memory."""
        self._thread.join()
        return self._at


def job_dask(client, cluster, phases: Phases, n: int, optimize: bool = True) -> dict:
    """A dask.array graph of about ``n`` tasks: build (dask), intake, run, release;
    ``optimize``: dask's ``optimize_graph`` (False: the tasks are sent as dask built them).

    The intake's CPU on the caller is split three ways: dask's own work inside
    ``client.compute`` (optimizing and materializing its graph: `dask_nodes`), dask's
    ordering (`dask_priorities`: ``dask.order.order``, which dask.distributed runs on its
    scheduler, and collecting the cyclic garbage it leaves, printed apart), and ours
    (everything else: plain keys, the futures, the plan, our lean order of a big graph,
    pickling the nodes (a slice's together, as a spec part), sending), with pickling and
    the lean order apart."""
    import dask
    import dask.array as da
    import dask.order

    from distributed_server.client import dask_graphs

    def build():
        return (da.ones(n, chunks=1) + 1).sum()

    phases.begin("dask: build (dask's own)")
    total = build()
    # counted on a twin: materializing a layer keeps its tasks in the layer, which would
    # hold them in `total` through the whole job (630 B a task before optimization: 2.1 GB
    # at a million, tracemalloc). Unoptimized, the tasks sent are the count.
    unoptimized = len(dict(build().__dask_graph__())) if optimize else None
    phases.end()
    scheduler_before = phases.process.memory_info().rss
    spent: dict = {}
    first_slice = _first_call(dask_graphs.GraphPlan, "encode_next", spent)
    first = FirstDone(cluster, first_slice.called)  # polls once dask's own work is done
    began = phases.begin("dask: intake")
    received = _graph_tasks(cluster)
    intake_before = _graph_intake_seconds(cluster)
    cpu = _cpu(phases)
    with _cpu_of(dask_graphs, "dask_nodes", spent), \
            _cpu_of(dask_graphs, "dask_priorities", spent), \
            _cpu_of(dask.order, "order", spent), \
            _cpu_of(dask_graphs.SpecPickler, "dumps", spent), \
            _cpu_of(dask_graphs.SpecPickler, "dumps_together", spent), \
            _cpu_of(dask_graphs, "LeanOrder", spent), \
            _collections_on_this_thread(spent, "collector"), \
            first_slice, \
            dask.config.set(scheduler=None):
        future = client.compute(total, optimize_graph=optimize)
    cpu = _cpu(phases) - cpu
    phases.end()
    intake_seconds = _graph_intake_seconds(cluster) - intake_before
    phases.begin("dask: run")
    assert future.result() == 2 * n
    phases.end()
    tasks = _graph_tasks(cluster) - received  # as dask optimized it (fused), if it did
    scheduler_peak = max(phases.peak["dask: intake"], phases.peak["dask: run"])
    phases.begin("dask: release")
    del future
    _until_empty(cluster)
    phases.end()
    time.sleep(RSS_SETTLE_S)
    after_release = phases.process.memory_info().rss
    time.sleep(RSS_LATER_S - RSS_SETTLE_S)
    first_done = first.seen()
    dasks = spent.get("dask_nodes", 0.0) + spent.get("dask_priorities", 0.0)
    return {"dask_tasks": tasks, "dask_optimized": optimize,
            "dask_first_task_done_s": first_done - began,
            "dask_first_task_done_after_first_slice_s": first_done - spent["encode_next"],
            "dask_scheduler_rss_before_mib": scheduler_before / 2**20,
            "dask_scheduler_rss_after_release_mib": after_release / 2**20,
            "dask_scheduler_rss_later_mib": phases.process.memory_info().rss / 2**20,
            "dask_tasks_before_optimization": tasks if unoptimized is None else unoptimized,
            "dask_scheduler_bytes_per_task": (scheduler_peak - scheduler_before) / tasks,
            "dask_intake_caller_cpu_us_per_task": 1e6 * cpu / tasks,
            "dask_materialize_cpu_us_per_task": 1e6 * spent.get("dask_nodes", 0.0) / tasks,
            "dask_order_cpu_us_per_task": 1e6 * spent.get("dask_priorities", 0.0) / tasks,
            "dask_order_garbage_cpu_us_per_task":
                1e6 * (spent.get("dask_priorities", 0.0) - spent.get("order", 0.0)) / tasks,
            "dask_ours_cpu_us_per_task": 1e6 * (cpu - dasks) / tasks,
            "dask_scheduler_intake_us_per_task": 1e6 * intake_seconds / tasks,
            "dask_lean_order_cpu_us_per_task": 1e6 * spent.get("LeanOrder", 0.0) / tasks,
            # outside dask_priorities (whose collection of dask.order's garbage is dask's)
            "dask_collector_us_per_task": 1e6 * max(0.0, spent.get("collector", 0.0) - (
                spent.get("dask_priorities", 0.0) - spent.get("order", 0.0))) / tasks,
            "dask_pickle_cpu_us_per_task":
                1e6 * (spent.get("dumps", 0.0) + spent.get("dumps_together", 0.0)) / tasks}


class _cpu_of:
    """Inside: ``owner.name`` (a function or method) adds the CPU time its calls take,
    on the thread that makes them, to ``spent[name]``."""

    def __init__(self, owner, name: str, spent: dict) -> None:
        self.owner, self.name, self.spent = owner, name, spent
        self.original = owner.__dict__[name]

    def __enter__(self):
        original, spent, name = self.original, self.spent, self.name
        spent.setdefault(name, 0.0)

        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - started

        setattr(self.owner, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self.original)


class _collections_on_this_thread:
    """Inside: the seconds the cyclic garbage collector runs on this thread are added to
    ``spent[name]`` (its collections are CPU-bound: wall time)."""

    def __init__(self, spent: dict, name: str) -> None:
        self.spent, self.name = spent, name
        self.thread = threading.get_ident()
        self.started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self.thread:
            return
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.spent[self.name] += time.perf_counter() - self.started

    def __enter__(self):
        self.spent.setdefault(self.name, 0.0)
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


class _first_call:
    """Inside: the wall-clock time of the first call of ``owner.name`` goes to
    ``when[name]``, and ``called`` is set."""

    def __init__(self, owner, name: str, when: dict) -> None:
        self.owner, self.name, self.when = owner, name, when
        self.original = owner.__dict__[name]
        self.called = threading.Event()

    def __enter__(self):
        original, when, name, called = self.original, self.when, self.name, self.called

        def first(*args, **kwargs):
            if not called.is_set():
                when[name] = time.time()
                called.set()
            return original(*args, **kwargs)

        setattr(self.owner, name, first)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self.original)


def _graph_tasks(cluster) -> int:
    """Tasks the scheduler has received in graph updates so far (its ``/metrics``)."""
    for sample in _scheduler_samples(cluster):
        if sample.name == "dcore_scheduler_graph_tasks_total":
            return int(sample.value)
    raise RuntimeError("the scheduler's /metrics has no graph_tasks counter")


def job_cancel(client, cluster, phases: Phases, n: int) -> dict:
    """Cancel ``n // 10`` pending futures; the next round trip ends the phase."""
    count = max(1, n // 10)
    gate = Event(client=client)
    blocker = client.submit(wait_for_event, gate.name, pure=False)
    futures = client.map(second, [blocker] * count, range(count), pure=False)
    while _n_tasks(cluster) < count + 1:
        time.sleep(0.1)
    phases.begin("cancel: cancel + next round trip")
    client.cancel(futures)
    start = time.perf_counter()
    assert client.submit(inc, 1, pure=False).result() == 2
    round_trip = time.perf_counter() - start
    _until_empty(cluster, leave=1)
    phases.end()
    gate.set()
    blocker.result()
    del futures, blocker
    _until_empty(cluster)
    return {"cancelled": count, "next_round_trip_s": round_trip}


def job_death(client, cluster, phases: Phases, n: int) -> dict:
    """The worker holding ``n`` results is SIGKILLed; ends when all are held again."""
    cluster.scale(1)
    client.wait_for_workers(1, timeout=60)
    futures = client.map(noop, range(n), pure=False)
    wait(futures)
    (victim, pid), = client.run(os.getpid).items()
    cluster.scale(2)
    client.wait_for_workers(2, timeout=60)
    time.sleep(0.5)
    phases.begin("death: SIGKILL until recomputed")
    os.kill(pid, signal.SIGKILL)
    while victim in cluster.scheduler_info()["workers"]:
        time.sleep(0.02)
    while cluster.scheduler_info()["task_counts"].get("memory", 0) < n:
        time.sleep(0.05)
    phases.end()
    del futures
    _until_empty(cluster)
    return {}


JOBS = {"map": job_map, "dask": job_dask, "cancel": job_cancel, "death": job_death}


def run(n: int, jobs: list[str], dask_optimize: bool = True) -> dict:
    env = _env()
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the workers import the task functions
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0",
                      memory_limit=0) as cluster, \
            Client(cluster, set_as_default=False, timeout=120) as client:
        phases = Phases(_scheduler_pid(), lambda: _late_lag_probes(cluster))
        probe = _start_probe(cluster, env, PROBE_INTERVAL)
        time.sleep(0.5)
        extra: dict = {}
        try:
            for name in jobs:
                job = JOBS[name]
                if name == "dask":
                    job = functools.partial(job, optimize=dask_optimize)
                extra.update(job(client, cluster, phases, n))
        finally:
            waits = _probe_waits(probe)
            phases.close()
        rss_end = phases.process.memory_info().rss
        gc_pauses = _gc_pauses(cluster)
        trims = _heap_trims(cluster)
    return {"n": n, "jobs": jobs, "phases": phases.figures(waits), **trims,
            "scheduler_gc_longest_ms": {g: 1e3 * longest for g, (_, longest) in gc_pauses.items()},
            "scheduler_gc_total_s": sum(total for total, _ in gc_pauses.values()),
            "scheduler_rss_start_mib": phases.rss_start / 2**20,
            "scheduler_rss_end_mib": rss_end / 2**20, **extra}


def _graph_intake_seconds(cluster) -> float:
    """Seconds the scheduler has spent taking in graph updates so far (``/metrics``)."""
    for sample in _scheduler_samples(cluster):
        if sample.name == "dcore_scheduler_graph_intake_seconds_total":
            return sample.value
    raise RuntimeError("the scheduler's /metrics has no graph_intake_seconds counter")


def _late_lag_probes(cluster) -> int:
    """How many of the scheduler's event-loop lag probes so far ran over 100 ms late
    (its ``/metrics`` histogram)."""
    total = within = 0.0
    for sample in _scheduler_samples(cluster):
        if sample.name == "dcore_scheduler_event_loop_lag_probes_seconds_bucket":
            if sample.labels["le"] == "+Inf":
                total = sample.value
            elif float(sample.labels["le"]) == 0.1:
                within = sample.value
    return int(total - within)


def _heap_trims(cluster) -> dict:
    """The scheduler's heap trims so far (seconds in all, the longest), from ``/metrics``."""
    found = {}
    for sample in _scheduler_samples(cluster):
        if sample.name == "dcore_scheduler_heap_trim_seconds_total":
            found["scheduler_heap_trim_total_s"] = sample.value
        elif sample.name == "dcore_scheduler_heap_trim_max_seconds":
            found["scheduler_heap_trim_longest_ms"] = 1e3 * sample.value
    return found


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def report(result: dict) -> str:
    lines = [(f"N = {result['n']:,}; probe: who_has([]) every {1e3 * PROBE_INTERVAL:.0f} ms "
              f"from a second client; target: worst wait < {TARGET_WORST_MS:.0f} ms in every "
              "phase"),
             (f"{'phase':36} {'seconds':>8} {'requests':>9} {'worst ms':>9} {'at s':>7} "
              f"{'p99 ms':>7} {'peak RSS MiB':>13} {'sched late':>10}  target")]
    for p in result["phases"]:
        own = p["phase"].endswith("(dask's own)")
        verdict = "-" if own else ("met" if p["worst_ms"] < TARGET_WORST_MS else "MISSED")
        lines.append(f"{p['phase']:36} {p['seconds']:8.2f} {p['probe_requests']:9d} "
                     f"{p['worst_ms']:9.1f} {p.get('worst_at_s', 0.0):7.1f} "
                     f"{p['p99_ms']:7.1f} {p['peak_rss_mib']:13.0f} "
                     f"{_or_dash(p.get('scheduler_late_probes')):>10}  "
                     f"{verdict}")
    lines.append(f"scheduler RSS: {result['scheduler_rss_start_mib']:.0f} MiB at the start, "
                 f"{result['scheduler_rss_end_mib']:.0f} MiB at the end")
    longest = ", ".join(f"gen {g} {ms:.0f} ms" for g, ms in
                        sorted(result["scheduler_gc_longest_ms"].items()))
    lines.append(f"scheduler garbage collection: {result['scheduler_gc_total_s']:.2f} s in all; "
                 f"longest pause: {longest}")
    if "scheduler_heap_trim_total_s" in result:
        lines.append(f"scheduler heap trims (malloc_trim): "
                     f"{result['scheduler_heap_trim_total_s']:.2f} s in all; longest "
                     f"{result['scheduler_heap_trim_longest_ms']:.0f} ms")
    if "dask_tasks" in result:
        built = (f"{result['dask_tasks_before_optimization']:,} before dask optimized it"
                 if result.get("dask_optimized", True) else
                 "as dask built them: optimize_graph=False")
        lines.append(f"dask graph: {result['dask_tasks']:,} tasks sent ({built})")
    for key in ("map_intake_caller_cpu_us_per_task", "dask_intake_caller_cpu_us_per_task"):
        if key in result:
            lines.append(f"{key.replace('_', ' ')}: {result[key]:.2f}")
    if "dask_ours_cpu_us_per_task" in result:
        ours = result["dask_ours_cpu_us_per_task"]
        ordering = (
            f"{result['dask_order_cpu_us_per_task']:.1f} (dask.order, of which collecting "
            f"its garbage {max(0.0, result.get('dask_order_garbage_cpu_us_per_task', 0.0)):.1f})"
            if result["dask_order_cpu_us_per_task"] else "0 (dask.order not run: ours ordered it)")
        lines.append(
            f"dask intake on the caller, us per task: dask's own "
            f"{result['dask_materialize_cpu_us_per_task']:.1f} (optimize and materialize) + "
            f"{ordering}; "
            f"ours {ours:.1f}, of which pickling the nodes "
            f"{result['dask_pickle_cpu_us_per_task']:.1f}, our lean order "
            f"{result.get('dask_lean_order_cpu_us_per_task', 0.0):.1f} and the cyclic "
            f"collector {result.get('dask_collector_us_per_task', 0.0):.1f} (target: "
            f"ours <= {TARGET_INTAKE_US}): {'met' if ours <= TARGET_INTAKE_US else 'MISSED'}")
        if "dask_scheduler_intake_us_per_task" in result:
            lines.append(f"dask: the scheduler took the graph in at "
                         f"{result['dask_scheduler_intake_us_per_task']:.1f} us per task "
                         f"(its graph_intake_seconds over graph_tasks on /metrics)")
        grew = result["dask_scheduler_bytes_per_task"]
        lines.append(
            f"dask: scheduler grew {grew:,.0f} B per task (peak RSS of intake and run - RSS "
            f"before; target <= {TARGET_SCHEDULER_BYTES}): "
            f"{'met' if grew <= TARGET_SCHEDULER_BYTES else 'MISSED'}")
        if "dask_first_task_done_s" in result:
            lines.extend(_dask_targets(result))
    if "map_first_task_done_s" in result:
        lines.extend(_map_targets(result))
    if "next_round_trip_s" in result:
        lines.append(f"cancel of {result['cancelled']:,} pending futures: next round trip "
                     f"{1e3 * result['next_round_trip_s']:.0f} ms (target < 1,000 ms)")
    return "\n".join(lines)


def _dask_targets(result: dict) -> list[str]:
    """The dask graph's figures beside issue 25's target 2 (when the first task was
    done; the scheduler's RSS after the release)."""
    lines = [(f"dask: first task done {result['dask_first_task_done_after_first_slice_s']:.2f} "
              f"s after the client encoded the first slice "
              f"({result['dask_first_task_done_s']:.2f} s after compute() began, dask's own "
              f"work first)")]
    return lines + _rss_after_release("dask", result)


def _rss_after_release(job: str, result: dict) -> list[str]:
    """The scheduler's RSS 5 s and 50 s after ``job``'s release against its RSS before."""
    before = result[f"{job}_scheduler_rss_before_mib"]
    lines = []
    for seconds, key in ((RSS_SETTLE_S, f"{job}_scheduler_rss_after_release_mib"),
                         (RSS_LATER_S, f"{job}_scheduler_rss_later_mib")):
        above = result[key] / before - 1
        verdict = "met" if above <= TARGET_RSS_ABOVE_START else "MISSED"
        lines.append(
            f"{job}: scheduler RSS {seconds:.0f} s after the release {result[key]:.0f} MiB, "
            f"{100 * above:+.0f} % of {before:.0f} MiB before the {job} (target <= "
            f"+{100 * TARGET_RSS_ABOVE_START:.0f} %): {verdict}")
    return lines


def _map_targets(result: dict) -> list[str]:
    """The map's figures beside issue 25's target 2."""
    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    scheduler = result["map_scheduler_bytes_per_task"]
    client = result["map_client_bytes_per_future"]
    lines = [
        f"map: first task done {result['map_first_task_done_s']:.2f} s after map() began",
        f"map: scheduler grew {scheduler:,.0f} B per task in flight (peak RSS of intake and "
        f"run - RSS before; target <= {TARGET_SCHEDULER_BYTES}): "
        f"{verdict(scheduler <= TARGET_SCHEDULER_BYTES)}",
        f"map: client grew {client:,.0f} B per future held (RSS after map() - before; target "
        f"<= {TARGET_CLIENT_BYTES}): {verdict(client <= TARGET_CLIENT_BYTES)}",
    ]
    return lines + _rss_after_release("map", result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="?", default=1_000_000, help="tasks per job")
    parser.add_argument("--jobs", default=",".join(JOBS),
                        help=f"comma-separated, of {', '.join(JOBS)}")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--dask-unoptimized", action="store_true",
                        help="the dask job sends its graph as dask built it "
                             "(optimize_graph=False): 10 N / 3 tasks")
    args = parser.parse_args(argv)
    jobs = args.jobs.split(",")
    unknown = set(jobs) - set(JOBS)
    if unknown:
        parser.error(f"unknown jobs: {', '.join(sorted(unknown))}")
    started = datetime.datetime.now()
    result = run(args.n, jobs, dask_optimize=not args.dask_unoptimized)
    print(json.dumps(result, indent=1) if args.json else report(result))
    if not args.no_save:
        print("saved", save_results("big-job", result, started, quick=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
