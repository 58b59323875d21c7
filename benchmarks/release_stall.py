"""Does releasing a huge number of futures stall the scheduler for everyone else?

A LocalCluster (1 worker) holds N tasks that a client created with
``client.map(add, range(N), [blocker] * N)`` (they wait on one sleeping task, so nothing
runs). A second client process, the probe, makes O(1) round trips to the scheduler
(``who_has([])``) in a loop. Then the first client drops its N futures at once and the
benchmark waits until the scheduler holds no task. Printed: how long the release took,
and the probe's worst and 99th-percentile wait during it (issue 11 asks for under 100 ms
at N = 1,000,000)::

    python benchmarks/release_stall.py 1000000
    python benchmarks/release_stall.py 200000 --json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _e2e_tasks import add  # noqa: E402
from e2e import save_results  # noqa: E402

from distributed_server import Client, LocalCluster  # noqa: E402

PROBE = r"""
import sys, time
from distributed_server import Client
with Client(sys.argv[1], set_as_default=False) as client:
    print("ready", flush=True)
    waits = []
    while not sys.stdin.closed:
        start = time.perf_counter()
        client.who_has([])
        waits.append((time.time(), time.perf_counter() - start))
        time.sleep(0.002)
        if len(waits) % 50 == 0 and sys.stdin.readable():
            import select
            if select.select([sys.stdin], [], [], 0)[0]:
                break
    for at, wait in waits:
        print(f"{at:.6f} {wait:.6f}")
"""


def run(n: int) -> dict:
    """One measurement with ``n`` held tasks."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        HERE, os.environ.get("PYTHONPATH")]))}
    with LocalCluster(n_workers=1, threads_per_worker=1) as cluster, \
            Client(cluster, set_as_default=False, timeout=60) as client:
        blocker = client.submit(time.sleep, 3600, pure=False)
        start = time.perf_counter()
        futures = client.map(add, range(n), [blocker] * n)
        while cluster.scheduler_info()["n_tasks"] < n + 1:
            time.sleep(0.2)
        held_after = time.perf_counter() - start
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, cluster.scheduler_address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**env, **cluster.security.environment()})
        assert probe.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        released_at = time.time()
        del futures
        while cluster.scheduler_info()["n_tasks"] > 1:
            time.sleep(0.05)
        release_s = time.time() - released_at
        time.sleep(0.5)
        out, _ = probe.communicate("stop\n", timeout=60)
    waits = [(float(a), float(w)) for a, w in (line.split() for line in out.splitlines())]
    during = sorted(w for at, w in waits if released_at <= at <= released_at + release_s)
    before = sorted(w for at, w in waits if at < released_at)
    return {
        "n": n, "held_after_s": held_after, "release_s": release_s,
        "probe_requests_during": len(during),
        "probe_worst_ms": 1e3 * max(during, default=0.0),
        "probe_p99_ms": 1e3 * during[int(0.99 * (len(during) - 1))] if during else 0.0,
        "probe_median_before_ms": 1e3 * statistics.median(before) if before else 0.0,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="?", default=1_000_000, help="held tasks")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    started = datetime.datetime.now()
    result = run(args.n)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{result['n']:,} held tasks (created in {result['held_after_s']:.1f} s); "
              f"released in {result['release_s']:.2f} s")
        print(f"probe (who_has([]) round trips): {result['probe_requests_during']} during the "
              f"release, worst {result['probe_worst_ms']:.1f} ms, p99 "
              f"{result['probe_p99_ms']:.1f} ms (median before: "
              f"{result['probe_median_before_ms']:.2f} ms)")
    if not args.no_save:
        print("saved", save_results("release-stall", result, started, quick=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
