"""Work stealing: makespan against its lower bound, for compare.py (workload 8).

The graph (``dask.delayed``, the same for both systems): one tiny root task and N tasks
``work(i, root, seconds)`` that each need the root's result and sleep ``seconds``:
1 % of them (at fixed pseudo-random positions) 0.5 s, the rest 5 ms (100x shorter).
Sleeping keeps the figures about placement, not about CPU contention on 2 cores.

- ``uneven``: 2 workers x 1 thread from the start.
- ``join``: 1 worker x 1 thread; a second one is started once 20 % of the work (in
  seconds of sleep) is done (another thread gathers the results: the work goes on
  while the worker starts, and the makespan never waits for it).

Makespan: from ``client.compute`` of the N tasks until ``gather`` has every result
(results checked); also reported: when ``compute`` returned (``submit_s``) and when the
first result was in (``first_result_s``: intake, the root, one task), which the lower
bound does not count. Lower bound: the longest chain (the root, then the longest task) or
the work divided among the threads, whichever is larger; for ``join``, the second
thread counts only from the moment the second worker is registered (``t_join``, seen by
the client): ``max(chain, W if W <= t_join else t_join + (W - t_join) / 2)``.
"""
from __future__ import annotations

import random
import threading
import time

LONG_S = 0.5
SHORT_S = 0.005
LONG_EVERY = 100  # 1 % of the tasks are long
JOIN_AT = 0.2  # the second worker joins after this fraction of the work


def root() -> int:
    return 1000


def work(i: int, base: int, seconds: float) -> int:
    time.sleep(seconds)
    return base + i


def durations(n: int) -> list:
    """Seconds per task: 1 % long at fixed pseudo-random positions, the rest short."""
    long_ones = set(random.Random(14).sample(range(n), max(1, n // LONG_EVERY)))
    return [LONG_S if i in long_ones else SHORT_S for i in range(n)]


def lower_bound(seconds: list, threads: int, join_s: float | None = None) -> float:
    """The makespan no schedule can beat (module docstring)."""
    total = sum(seconds)
    chain = max(seconds)
    if join_s is None:
        return max(chain, total / threads)
    if total <= join_s:
        return max(chain, total)
    return max(chain, join_s + (total - join_s) / 2)


def _graph(seconds: list) -> list:
    from dask import delayed

    base = delayed(root, pure=False)()
    return [delayed(work, pure=False)(i, base, s) for i, s in enumerate(seconds)]


def _add_worker(system, logdir: str) -> None:
    """Start one more worker of one thread and wait until it is registered."""
    if hasattr(system, "cluster"):  # distributed-core's LocalCluster
        system.cluster.scale(system.cluster.n_workers + 1, timeout=60)
        return
    import os
    import sys

    address = system.client.scheduler.address
    n = len(system.client.scheduler_info()["workers"])
    system._spawn([sys.executable, "-m", "distributed.cli.dask_worker", address,
                   "--nthreads", "1", "--name", f"worker-{n}"],
                  os.path.join(logdir, f"dask-worker-{n}.log"), dict(os.environ))
    system.client.wait_for_workers(n + 1, timeout=60)


def child(spec: dict, system, logdir: str) -> dict:
    """One run of ``spec["mode"]`` (uneven / join) with ``spec["n"]`` tasks."""
    client = system.client
    warm = client.compute(_graph([0.0] * 4))
    assert client.gather(warm) == [1000 + i for i in range(4)]
    del warm
    seconds = durations(spec["n"])
    expected = [1000 + i for i in range(spec["n"])]
    join = spec["mode"] == "join"
    tasks = _graph(seconds)
    t0 = time.perf_counter()
    futures = client.compute(tasks)
    submit_s = time.perf_counter() - t0
    done: list = []  # [results, makespan], from the thread that gathers

    def gather():
        results = client.gather(futures)
        done.extend([results, time.perf_counter() - t0])

    # The main thread starts the second worker: a worker process dies with the thread
    # that spawned it (distributed-core's LocalCluster: PR_SET_PDEATHSIG).
    gatherer = threading.Thread(target=gather, daemon=True)
    gatherer.start()
    first_s = None  # when the first task's result was in (intake, root, first task)
    while first_s is None and gatherer.is_alive():
        if any(f.done() for f in futures):
            first_s = time.perf_counter() - t0
        else:
            time.sleep(0.005)
    join_s = None
    if join:
        total = sum(seconds)
        while sum(s for f, s in zip(futures, seconds) if f.done()) < JOIN_AT * total \
                and gatherer.is_alive():
            time.sleep(0.01)
        _add_worker(system, logdir)  # the work goes on meanwhile, and may end first
        join_s = time.perf_counter() - t0
    gatherer.join()
    results, makespan = done
    if join_s is not None:
        join_s = min(join_s, makespan)
    assert results == expected, "wrong results"
    bound = lower_bound(seconds, spec["workers"], join_s)
    return {"makespan_s": makespan, "lower_bound_s": bound, "ratio": makespan / bound,
            "join_s": join_s, "work_s": sum(seconds), "tasks": spec["n"],
            "submit_s": submit_s, "first_result_s": first_s}
