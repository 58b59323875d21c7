"""What does ``Client.scheduler_info()`` cost with a million tasks held?

Two measurements, each at a small and a large number of held tasks (default 10 and
1,000,000; the tasks are a ``client.map`` that waits for workers, so they sit queued):

- round trip: a scheduler process holds the tasks (its state is filled directly with one
  ``update_graph`` call, which is what a client's graph becomes, but takes seconds
  instead of minutes); a ``Client`` in this process calls ``scheduler_info()`` again and
  again. Median and 90th percentile of the wall time of one call.
- core read: in this process, a ``SchedulerState`` holding the tasks; the median CPU
  cost of ``counters()``, ``task_counts()``, ``prefix_counts()`` and of the scheduler's
  whole ``identity()`` (what the round trip returns), plus, for scale, one walk over the
  tasks that counts them by state (what ``task_counts()`` did before the counters).

Run with the core you want to measure importable (an installed package, or
``PYTHONPATH=<a tree with the extension built in place>``)::

    python benchmarks/info_cost.py                      # 10 and 1,000,000 tasks
    python benchmarks/info_cost.py --tasks 100000 --calls 500 --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import asyncio, sys
from distributed_server.scheduler.server import Scheduler

async def main(n):
    s = Scheduler()
    tasks = [{"key": f"inc-{i}", "spec": b"spec"} for i in range(n)]
    s.state.update_graph("filler", tasks, [t["key"] for t in tasks], "fill")
    del tasks
    await s.start()
    print("address", s.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await s.close()

asyncio.run(main(int(sys.argv[1])))
"""


def _graph(n: int) -> list:
    return [{"key": f"inc-{i}", "spec": b"spec"} for i in range(n)]


def round_trip(n: int, calls: int) -> dict:
    """Seconds per scheduler_info() call of a Client to a scheduler holding n tasks."""
    from distributed_server import Client
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        if line[:1] != ["address"]:
            raise SystemExit(f"the scheduler process did not start: {line}")
        with Client(line[1], set_as_default=False) as client:
            info = client.scheduler_info()
            assert info["n_tasks"] == n, info["n_tasks"]
            for _ in range(min(20, calls)):  # warm up
                client.scheduler_info()
            waits = []
            for _ in range(calls):
                start = time.perf_counter()
                client.scheduler_info()
                waits.append(time.perf_counter() - start)
    finally:
        proc.stdin.close()
        proc.wait(30)
    waits.sort()
    return {"median_s": statistics.median(waits), "p90_s": waits[int(0.9 * len(waits))],
            "calls": calls, "keys": sorted(info)}


def _cpu_median(call, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.thread_time()
        call()
        samples.append(time.thread_time() - start)
    return statistics.median(samples)


def _walk(state) -> dict:
    counts = {}
    for ts in state.tasks.values():
        counts[ts.state] = counts.get(ts.state, 0) + 1
    return counts


def core_read(n: int, calls: int) -> dict:
    """CPU seconds of the core's reads (and the scheduler's identity()) with n tasks."""
    import distributed_core
    from distributed_server.scheduler.server import Scheduler
    scheduler = Scheduler()  # not started: identity() needs only its state
    state = scheduler.state
    tasks = _graph(n)
    state.update_graph("filler", tasks, [t["key"] for t in tasks], "fill")
    del tasks
    out = {"compiled": distributed_core.COMPILED, "core_file": distributed_core.CORE_FILE}
    reads = {"identity": scheduler.identity, "task_counts": state.task_counts}
    if hasattr(state, "counters"):  # the core before the counters had only task_counts
        reads.update(counters=state.counters, prefix_counts=state.prefix_counts)
    for name, read in reads.items():
        out[f"{name}_s"] = _cpu_median(read, calls if n < 100_000 else max(calls // 10, 5))
    out["walk_s"] = _cpu_median(lambda: _walk(state), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[10, 1_000_000],
                        help="numbers of held tasks to measure at")
    parser.add_argument("--calls", type=int, default=300, help="calls per measurement")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    results = []
    for n in args.tasks:
        print(f"{n:,} tasks: core read ...", file=sys.stderr, flush=True)
        core = core_read(n, args.calls)
        print(f"{n:,} tasks: round trips ...", file=sys.stderr, flush=True)
        results.append({"tasks": n, "core": core, "round_trip": round_trip(n, args.calls)})
    if args.json:
        print(json.dumps({"loadavg": os.getloadavg(), "results": results}, indent=2))
        return
    print(f"core: {'compiled' if results[0]['core']['compiled'] else 'interpreted'} "
          f"({results[0]['core']['core_file']}); load average "
          f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'tasks':>10} | {'scheduler_info() round trip':>36} | {'identity()':>10} | "
          f"{'counters()':>10} | {'task_counts()':>13} | {'prefix_counts()':>15} | "
          f"{'walk (old way)':>14}")
    print("-" * 128)

    def us(x):
        return "n/a" if x is None else f"{x * 1e6:,.1f} us"

    for r in results:
        core, rt = r["core"], r["round_trip"]
        print(f"{r['tasks']:>10,} | {'median ' + us(rt['median_s']) + ', p90 ' + us(rt['p90_s']):>36}"
              f" | {us(core.get('identity_s')):>10} | {us(core.get('counters_s')):>10} | "
              f"{us(core.get('task_counts_s')):>13} | {us(core.get('prefix_counts_s')):>15} | "
              f"{us(core['walk_s']):>14}")
    print("round trip: wall time of one Client.scheduler_info() to a scheduler process "
          "(median, 90th percentile); the others: CPU time of one call in this process "
          "(median); walk: one pass over the tasks counting states, for scale")


if __name__ == "__main__":
    main()
