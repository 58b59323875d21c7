"""Where a scheduler's memory per held task goes: a tracemalloc profile of the scheduler.

Runs a `Scheduler` in this process (tuned like ``dcore scheduler``), one ``dcore worker``
and a client as separate processes. The client makes one task that sleeps on the only
worker, then ``client.map(add, range(N), [blocker] * N)``: N tasks wait on it (workload 5
of compare.py). Prints the RSS growth per task, then drops the futures and prints the
scheduler's RSS once only the blocker is left, against its RSS before the map (what a
release gives back, arena fragmentation included). With ``--trace``, what tracemalloc
counts per task, by the line that allocated it (compiled-core allocations show as the
server line that called into the core)::

    python benchmarks/sched_memory.py 1000000
    python benchmarks/sched_memory.py 100000 --trace
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import tracemalloc

import psutil

from distributed_server.cli import SCHEDULER_GC_THRESHOLDS
from distributed_server.scheduler.server import Scheduler

HERE = os.path.dirname(os.path.abspath(__file__))

CLIENT = r"""
import sys, time
from distributed_server import Client
from _e2e_tasks import add
client = Client(sys.argv[1])
blocker = client.submit(time.sleep, 600, pure=False)
time.sleep(0.5)
print("ready", flush=True)
sys.stdin.readline()
futures = client.map(add, range(int(sys.argv[2])), [blocker] * int(sys.argv[2]))
sys.stdin.readline()
del futures
print("released", flush=True)
sys.stdin.readline()
"""


async def profile(n: int, trace: bool, top: int) -> None:
    scheduler = await Scheduler().start()
    gc.freeze()
    gc.set_threshold(*SCHEDULER_GC_THRESHOLDS)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
    worker = subprocess.Popen([sys.executable, "-m", "distributed_server.cli", "worker",
                               scheduler.address, "--nthreads", "1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, scheduler.address, str(n)],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    loop = asyncio.get_running_loop()
    try:
        line = await asyncio.wait_for(loop.run_in_executor(None, client.stdout.readline), 60)
        if line.strip() != "ready":
            raise RuntimeError("the client did not start")
        await asyncio.sleep(0.5)
        if trace:
            tracemalloc.start()
        before = tracemalloc.take_snapshot() if trace else None
        rss0 = psutil.Process().memory_info().rss
        client.stdin.write("\n")
        client.stdin.flush()
        while len(scheduler.state.tasks) < n + 1:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        rss1 = psutil.Process().memory_info().rss
        print(f"{n:,} held tasks: scheduler RSS +{(rss1 - rss0) / n:,.0f} B/task"
              + (" (tracemalloc on: adds its own overhead)" if trace else ""))
        print(f"RSS {rss0 / 2 ** 20:,.1f} MiB before the map, {rss1 / 2 ** 20:,.1f} MiB "
              "with the tasks held", flush=True)
        if trace:
            now, peak = tracemalloc.get_traced_memory()
            print(f"traced: {now / n:,.0f} B/task now, {peak / n:,.0f} B/task at the peak")
            after = tracemalloc.take_snapshot()
            for stat in after.compare_to(before, "lineno")[:top]:
                print(f"  {stat.size_diff / n:8.1f} B/task  {stat.count_diff:>9,} blocks  "
                      f"{stat.traceback}")
        if trace:
            tracemalloc.stop()
        client.stdin.write("\n")
        client.stdin.flush()
        while len(scheduler.state.tasks) > 1:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        rss2 = psutil.Process().memory_info().rss
        print(f"released: RSS {rss2 / 2 ** 20:,.1f} MiB, {rss2 / rss0:.2f}x its start "
              f"(+{(rss2 - rss0) / n:,.0f} B per task that was held)")
    finally:
        client.kill()
        worker.kill()
        await scheduler.close(close_workers=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="?", default=100_000, help="tasks held")
    parser.add_argument("--trace", action="store_true", help="tracemalloc by line")
    parser.add_argument("--top", type=int, default=8, help="lines shown with --trace")
    args = parser.parse_args()
    asyncio.run(profile(args.n, args.trace, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
