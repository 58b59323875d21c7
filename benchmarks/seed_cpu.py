"""Where the seed's CPU goes, process by process, and what the workers' garbage
collector costs.

Starts a distributed-core LocalCluster (scheduler + 2 workers x 1 thread, as compare.py's
seed cell), runs the seed shuffle once to warm up, then once measured, and prints the
wall, each process's CPU seconds (user + sys), and per worker the time spent in garbage
collections (timed by the worker's own ``gc_pauses.GC_PAUSES``), by generation, with the
objects they freed.
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


def gc_totals():
    """On a worker: its collections so far (timed by the worker's own GC_PAUSES)."""
    import gc

    from distributed_server.diagnostics.gc_pauses import GC_PAUSES

    return {"seconds": list(GC_PAUSES.total), "count": list(GC_PAUSES.count),
            "freed": list(GC_PAUSES.collected), "thresholds": gc.get_threshold()}


def set_gc_thresholds(thresholds):
    import gc

    gc.set_threshold(*thresholds)


def since(after: dict, before: dict) -> dict:
    return {name: [a - b for a, b in zip(after[name], before[name])]
            for name in ("seconds", "count", "freed")}


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
        if args.gc_thresholds:
            client.run(set_gc_thresholds, tuple(int(x) for x in args.gc_thresholds.split(",")))
        with dask.config.set({"dataframe.shuffle.method": "tasks"}):
            client.compute(seed_collection("2000-01-01", "2000-01-01T06:00")).result()
            e2e.wait_until_forgotten(system)
            collection = seed_collection(args.start, args.end)
            processes = [system.scheduler, *system.workers]
            before = [e2e.cpu_seconds([p]) for p in processes]
            gc_before = client.run(gc_totals)
            client_before = time.process_time()
            t0 = time.perf_counter()
            result = client.compute(collection).result()
            wall = time.perf_counter() - t0
            client_cpu = time.process_time() - client_before
            after = [e2e.cpu_seconds([p]) for p in processes]
            gc_after = client.run(gc_totals)
    finally:
        system.close()
    print(f"seed {args.start}..{args.end}: {int(result):,} rows, wall {wall:.1f} s")
    print(f"CPU s: scheduler {after[0] - before[0]:.1f}, client {client_cpu:.1f}, "
          "worker processes (nannies included) "
          + " + ".join(f"{b - a:.1f}" for a, b in zip(before[1:], after[1:])))
    for address, totals in gc_after.items():
        spent = since(totals, gc_before[address])
        print(f"  worker {address}: thresholds {tuple(totals['thresholds'])}, "
              f"GC {sum(spent['seconds']):.2f} s in {sum(spent['count'])} collections "
              "(by generation: " + ", ".join(
                  f"{n} in {s:.2f} s" for n, s in zip(spent["count"], spent["seconds"]))
              + f"), {sum(spent['freed']):,} objects freed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
