"""Does releasing a huge number of futures, or losing the worker that holds them, stall
the scheduler for everyone else?

A LocalCluster (1 worker) holds N tasks that a client created with
``client.map(add, range(N), [blocker] * N)`` (they wait on one sleeping task, so nothing
runs). A second client process, the probe, makes O(1) round trips to the scheduler
(``who_has([])``) in a loop. Then the first client drops its N futures at once and the
benchmark waits until the scheduler holds no task. Printed: how long the release took,
and the probe's worst and 99th-percentile wait during it (issue 11 asks for under 100 ms
at N = 1,000,000)::

    python benchmarks/release_stall.py 1000000
    python benchmarks/release_stall.py 200000 --json

With ``--worker-leaves``: one worker computes N no-op tasks and holds their N results, a
second worker joins, and the first is SIGKILLed; the probe runs from the kill until the
scheduler has let go of the dead worker's results (in slices) and one second more.
Printed: the probe's worst and 99th-percentile wait in that window, and how long the N
results took to be recomputed on the survivor.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _e2e_tasks import add  # noqa: E402
from e2e import save_results  # noqa: E402

from distributed_server import Client, LocalCluster, wait  # noqa: E402

PROBE = r"""
import sys, time
from distributed_server import Client
interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.002
with Client(sys.argv[1], set_as_default=False) as client:
    print("ready", flush=True)
    waits = []
    while not sys.stdin.closed:
        start = time.perf_counter()
        client.who_has([])
        waits.append((time.time(), time.perf_counter() - start))
        time.sleep(interval)
        if len(waits) % 50 == 0 and sys.stdin.readable():
            import select
            if select.select([sys.stdin], [], [], 0)[0]:
                break
    for at, wait in waits:
        print(f"{at:.6f} {wait:.6f}")
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        HERE, os.environ.get("PYTHONPATH")]))}


def _start_probe(cluster, env: dict, interval: float = 0.002) -> subprocess.Popen:
    """The probe client process: ``who_has([])`` every ``interval`` seconds."""
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE, cluster.scheduler_address, str(interval)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**env, **cluster.security.environment()})
    assert probe.stdout.readline().strip() == "ready"
    return probe


def _probe_waits(probe: subprocess.Popen) -> list:
    out, _ = probe.communicate("stop\n", timeout=60)
    return [(float(a), float(w)) for a, w in (line.split() for line in out.splitlines())]


def _stall_figures(waits: list, start: float, stop: float) -> dict:
    during = sorted(w for at, w in waits if start <= at <= stop)
    before = sorted(w for at, w in waits if at < start)
    return {
        "probe_requests_during": len(during),
        "probe_worst_ms": 1e3 * max(during, default=0.0),
        "probe_p99_ms": 1e3 * during[int(0.99 * (len(during) - 1))] if during else 0.0,
        "probe_median_before_ms": 1e3 * statistics.median(before) if before else 0.0,
    }


def _scheduler_samples(cluster) -> list:
    """The samples of the scheduler's ``/metrics`` now (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = cluster.dashboard_link.replace("/status", "/metrics")
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text)
            for sample in family.samples]


def _gc_pauses(cluster) -> dict:
    """The scheduler's garbage-collection pauses so far, from its ``/metrics``:
    {generation: (seconds in total, longest single pause)}."""
    total, longest = {}, {}
    for sample in _scheduler_samples(cluster):
        if sample.name == "dcore_scheduler_gc_pause_seconds_total":
            total[sample.labels["generation"]] = sample.value
        elif sample.name == "dcore_scheduler_gc_pause_max_seconds":
            longest[sample.labels["generation"]] = sample.value
    return {g: (total[g], longest[g]) for g in total}


def _gc_figures(before: dict, after: dict) -> dict:
    """GC seconds spent between two `_gc_pauses` readings, and the longest pause seen."""
    return {
        "gc_seconds_during": sum(after[g][0] - before[g][0] for g in after),
        "gc_longest_ms": {g: 1e3 * after[g][1] for g in after},
    }


def run_worker_leaves(n: int) -> dict:
    """One measurement: the worker holding ``n`` results is SIGKILLed."""
    env = _env()
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the workers import the task function
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False, timeout=60) as client:
        start = time.perf_counter()
        futures = client.map(add, range(n), [0] * n)
        wait(futures)
        assert cluster.scheduler_info()["task_counts"]["memory"] == n, "tasks failed"
        computed_s = time.perf_counter() - start
        (victim, pid), = client.run(os.getpid).items()
        cluster.scale(2)
        client.wait_for_workers(2, timeout=60)
        probe = _start_probe(cluster, env)
        time.sleep(1.0)
        gc_before = _gc_pauses(cluster)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        while victim in cluster.scheduler_info()["workers"]:
            time.sleep(0.01)
        removed_at = time.time()
        while cluster.scheduler_info()["task_counts"].get("memory", 0) < n:
            time.sleep(0.05)
        recomputed_s = time.time() - killed_at
        time.sleep(0.5)
        waits = _probe_waits(probe)
        gc_after = _gc_pauses(cluster)
        del futures
    # the departure's slices run right after the removal; the window covers them and the
    # first second of recomputation
    return {"n": n, "computed_s": computed_s, "removed_after_s": removed_at - killed_at,
            "recomputed_s": recomputed_s, **_gc_figures(gc_before, gc_after),
            **_stall_figures(waits, killed_at, removed_at + 1.0)}


def run(n: int) -> dict:
    """One measurement with ``n`` held tasks."""
    env = _env()
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False, timeout=60) as client:
        blocker = client.submit(time.sleep, 3600, pure=False)
        start = time.perf_counter()
        futures = client.map(add, range(n), [blocker] * n)
        while cluster.scheduler_info()["n_tasks"] < n + 1:
            time.sleep(0.2)
        held_after = time.perf_counter() - start
        probe = _start_probe(cluster, env)
        time.sleep(1.0)
        gc_before = _gc_pauses(cluster)
        released_at = time.time()
        del futures
        while cluster.scheduler_info()["n_tasks"] > 1:
            time.sleep(0.05)
        release_s = time.time() - released_at
        time.sleep(0.5)
        waits = _probe_waits(probe)
        gc_after = _gc_pauses(cluster)
    return {"n": n, "held_after_s": held_after, "release_s": release_s,
            **_gc_figures(gc_before, gc_after),
            **_stall_figures(waits, released_at, released_at + release_s)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="?", default=1_000_000, help="held tasks")
    parser.add_argument("--worker-leaves", action="store_true",
                        help="SIGKILL the worker holding the results instead of releasing")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    started = datetime.datetime.now()
    result = run_worker_leaves(args.n) if args.worker_leaves else run(args.n)
    if args.json:
        print(json.dumps(result, indent=1))
    elif args.worker_leaves:
        print(f"{result['n']:,} results on one worker (computed in "
              f"{result['computed_s']:.1f} s); SIGKILLed: removed after "
              f"{result['removed_after_s']:.2f} s, all recomputed after "
              f"{result['recomputed_s']:.1f} s")
        print(f"probe (who_has([]) round trips) from the kill to 1 s after the removal: "
              f"{result['probe_requests_during']} requests, worst "
              f"{result['probe_worst_ms']:.1f} ms, p99 {result['probe_p99_ms']:.1f} ms "
              f"(median before: {result['probe_median_before_ms']:.2f} ms)")
    else:
        print(f"{result['n']:,} held tasks (created in {result['held_after_s']:.1f} s); "
              f"released in {result['release_s']:.2f} s")
        print(f"probe (who_has([]) round trips): {result['probe_requests_during']} during the "
              f"release, worst {result['probe_worst_ms']:.1f} ms, p99 "
              f"{result['probe_p99_ms']:.1f} ms (median before: "
              f"{result['probe_median_before_ms']:.2f} ms)")
    if not args.json:
        longest = ", ".join(f"gen {g} {ms:.1f} ms" for g, ms in
                            sorted(result["gc_longest_ms"].items()))
        print(f"scheduler garbage collection: {result['gc_seconds_during']:.3f} s during "
              f"that window; longest single pause since start: {longest}")
    if not args.no_save:
        name = "worker-leaves-stall" if args.worker_leaves else "release-stall"
        print("saved", save_results(name, result, started, quick=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
