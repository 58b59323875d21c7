"""How an adaptive LocalCluster follows a burst of work, beside dask.distributed's.

Each system starts a LocalCluster with no worker (processes, 1 thread each) and calls
``cluster.adapt(minimum=0, maximum=4)`` with the defaults (target duration 5 s, a look
every second, 3 lower answers before scaling down). A client then submits a burst of
N tasks of 0.5 s each and keeps their results; once every task is done it waits for the
cluster to shrink back (the results must move off the workers that leave), gathers them,
and counts how many times each task ran (each run leaves a file). Printed per system:

- seconds from the submission to the first worker joining;
- the most workers at once;
- seconds from the last task's end until the cluster is back to the minimum of... one
  worker holding the results (it cannot go to 0 while results are held: they have to
  live somewhere) -- then the futures are released and the seconds to 0 are printed too;
- tasks run more than once (the target is 0: a result moved is not recomputed).

    python benchmarks/adaptive_burst.py            # 40 tasks, both systems, 3 runs each
    python benchmarks/adaptive_burst.py --tasks 80 --repeat 1 --only dcore
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the workers import the task function by reference, from this directory
os.environ["PYTHONPATH"] = os.pathsep.join(
    [HERE, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])

from _e2e_tasks import sleep_and_record  # noqa: E402


def run(system: str, n_tasks: int, poll: float = 0.05) -> dict:
    """One burst on one system's adaptive LocalCluster; the figures."""
    if system == "dcore":
        from distributed_server import Client, LocalCluster, wait
        cluster = LocalCluster(n_workers=0, threads_per_worker=1, dashboard_address=None)
    else:
        from distributed import Client, LocalCluster, wait
        cluster = LocalCluster(n_workers=0, threads_per_worker=1, dashboard_address=None,
                               processes=True)
    record = tempfile.mkdtemp(prefix=f"adaptive-{system}-")
    try:
        cluster.adapt(minimum=0, maximum=4)
        client = Client(cluster)
        try:
            def workers() -> int:
                return len(client.scheduler_info()["workers"])

            started = time.monotonic()
            futures = client.map(sleep_and_record, range(n_tasks), delay=0.5,
                                 record_dir=record, pure=False)
            first = peak = None
            while not all(f.done() for f in futures):
                n = workers()
                if n and first is None:
                    first = time.monotonic() - started
                peak = max(peak or 0, n)
                time.sleep(poll)
            done = time.monotonic()
            wait(futures)
            while workers() > 1:
                time.sleep(poll)
            to_one = time.monotonic() - done
            results = client.gather(futures)
            assert results == list(range(n_tasks)), "wrong results"
            del futures, results
            released = time.monotonic()
            while workers() > 0:
                time.sleep(poll)
            to_zero = time.monotonic() - released
        finally:
            client.close()
    finally:
        cluster.close()
    counts: dict = {}
    for name in os.listdir(record):
        i = int(name.split("-")[0])
        counts[i] = counts.get(i, 0) + 1
    return {"first_worker_s": first, "peak_workers": peak, "back_to_one_s": to_one,
            "back_to_zero_s": to_zero,
            "recomputed": sum(n - 1 for n in counts.values()),
            "missing": n_tasks - len(counts)}


def main(argv=None) -> None:
    """Run the burst on each system, alternating, and print the medians side by side
    (each run's figures too)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3, help="runs per system (alternating)")
    parser.add_argument("--only", choices=["dcore", "dask"])
    args = parser.parse_args(argv)
    systems = [args.only] if args.only else ["dcore", "dask"]
    import distributed_core

    print(f"burst of {args.tasks} tasks x 0.5 s; adapt(minimum=0, maximum=4), defaults; "
          f"distributed-core compiled: {distributed_core.COMPILED}; median of {args.repeat}")
    runs: dict = {system: [] for system in systems}
    for i in range(args.repeat):
        for system in systems:
            runs[system].append(run(system, args.tasks))
            print(f"  run {i + 1} {system}: {runs[system][-1]}", flush=True)
    # medians of the times and sizes; the worst run for the counts that should be 0
    worst = {"recomputed", "missing"}
    figures = {system: {field: (max if field in worst else statistics.median)(
                            [r[field] for r in results])
                        for field in results[0]}
               for system, results in runs.items()}
    rows = [("seconds to the first worker", "first_worker_s", "{:.2f}"),
            ("peak workers", "peak_workers", "{:g}"),
            ("seconds back to 1 worker once idle (results held)", "back_to_one_s",
             "{:.2f}"),
            ("seconds back to 0 once released", "back_to_zero_s", "{:.2f}"),
            ("tasks run more than once (worst run)", "recomputed", "{:g}"),
            ("tasks never run (worst run)", "missing", "{:g}")]
    print(f"{'':52s}" + "".join(f"{s:>14s}" for s in systems))
    for label, field, fmt in rows:
        print(f"{label:52s}" + "".join(f"{fmt.format(figures[s][field]):>14s}"
                                       for s in systems))


if __name__ == "__main__":
    main()
