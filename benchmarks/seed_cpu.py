"""Where the seed's CPU goes, process by process, and what the workers' garbage
collector costs.

Starts a distributed-core LocalCluster (scheduler + 2 workers x 1 thread, as compare.py's
seed cell), runs the seed shuffle once to warm up, then once measured, and prints the
wall, each process's CPU seconds (user + sys), and per worker the time spent in garbage
collections (timed with ``gc.callbacks``), by generation, with the objects they freed.
``--gc-thresholds 700,10,10`` sets the workers' thresholds before the measured run (the
default leaves the workers' own, cli.WORKER_GC_THRESHOLDS)::

    python benchmarks/seed_cpu.py                       # two months, 46,360 tasks
    python benchmarks/seed_cpu.py --gc-thresholds 700,10,10
    python benchmarks/seed_cpu.py --end 2021            # the full year
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import e2e  # noqa: E402
from compare import seed_collection  # noqa: E402


def install_gc_timer():
    """On a worker: time every collection (kept in ``builtins`` for `read_gc_timer`)."""
    import builtins
    import gc
    import time

    totals = {"seconds": [0.0, 0.0, 0.0], "count": [0, 0, 0], "freed": [0, 0, 0]}
    started = [0.0]

    def timer(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
            return
        generation = info["generation"]
        totals["seconds"][generation] += time.perf_counter() - started[0]
        totals["count"][generation] += 1
        totals["freed"][generation] += info["collected"]

    gc.callbacks.append(timer)
    builtins._seed_cpu_gc = totals
    return gc.get_threshold()


def read_gc_timer():
    import builtins

    return builtins._seed_cpu_gc


def set_gc_thresholds(thresholds):
    import gc

    gc.set_threshold(*thresholds)
    return gc.get_threshold()


def cpu_seconds(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", default="2020-01-01")
    parser.add_argument("--end", default="2020-03-01")
    parser.add_argument("--gc-thresholds", help="the workers' thresholds, e.g. 700,10,10")
    args = parser.parse_args()

    import dask

    system = e2e.DcoreSystem(2, 1)
    client = system.client
    try:
        thresholds = client.run(install_gc_timer)
        if args.gc_thresholds:
            wanted = tuple(int(x) for x in args.gc_thresholds.split(","))
            thresholds = client.run(set_gc_thresholds, wanted)
        with dask.config.set({"dataframe.shuffle.method": "tasks"}):
            client.compute(seed_collection("2000-01-01", "2000-01-01T06:00")).result()
            e2e.wait_until_forgotten(system)
            client.run(install_gc_timer)  # the warm-up's collections are not counted
            collection = seed_collection(args.start, args.end)
            processes = [system.scheduler, *system.workers]
            before = [cpu_seconds(p) for p in processes]
            client_before = time.process_time()
            t0 = time.perf_counter()
            result = client.compute(collection).result()
            wall = time.perf_counter() - t0
            after = [cpu_seconds(p) for p in processes]
            client_cpu = time.process_time() - client_before
        collections = client.run(read_gc_timer)
    finally:
        system.close()
    print(f"seed {args.start}..{args.end}: {int(result):,} rows, wall {wall:.1f} s")
    print(f"CPU s: scheduler {after[0] - before[0]:.1f}, client {client_cpu:.1f}, "
          "worker processes (nannies included) "
          + " + ".join(f"{b - a:.1f}" for a, b in zip(before[1:], after[1:])))
    for address, totals in collections.items():
        print(f"  worker {address}: thresholds {tuple(thresholds[address])}, "
              f"GC {sum(totals['seconds']):.2f} s in {sum(totals['count'])} collections "
              "(by generation: " + ", ".join(
                  f"{n} in {s:.2f} s" for n, s in zip(totals["count"], totals["seconds"]))
              + f"), {sum(totals['freed']):,} objects freed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
