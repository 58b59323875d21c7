"""``dcore demo``: a local cluster runs a real graph and reports what it did.

The graph squares ``n`` numbers and sums them with a pairwise tree reduction, so most
tasks depend on results that live on other workers and must be fetched.
"""
from __future__ import annotations

import sys
import time

import distributed_core


def square(x: int) -> int:
    """A leaf task."""
    return x * x


def add(a: int, b: int) -> int:
    """An inner task of the reduction."""
    return a + b


def submit_tree_sum(client, n_leaves: int) -> tuple:
    """Submit the whole graph; return (all futures, the future of the total)."""
    level = client.map(square, range(n_leaves))
    futures = list(level)
    while len(level) > 1:
        carry = [level[-1]] if len(level) % 2 else []
        level = client.map(add, level[0:-1:2], level[1::2]) + carry
        futures += level[:len(level) - len(carry)]
    return futures, level[0]


def _progress(done: int, total: int, started: float) -> None:
    width = 40
    filled = width * done // total
    rate = done / max(time.perf_counter() - started, 1e-9)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tasks "
                     f"{rate:,.0f}/s")
    sys.stderr.flush()


def run_demo(n_workers: int = 2, threads_per_worker: int = 1, n_tasks: int = 5000) -> int:
    """Start a LocalCluster, run the graph, check the answer, print a report."""
    from .client.client import Client, as_completed
    from .deploy.local_cluster import LocalCluster

    kind = "compiled" if distributed_core.COMPILED else "interpreted"
    print(f"distributed-core {distributed_core.__version__}, core {kind}")
    print(f"starting a local cluster: {n_workers} workers x {threads_per_worker} threads")
    with LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker) as cluster, \
            Client(cluster) as client:
        started = time.perf_counter()
        futures, total = submit_tree_sum(client, n_tasks)
        done = 0
        for _ in as_completed(futures):
            done += 1
            if done % 500 == 0 or done == len(futures):
                _progress(done, len(futures), started)
        result = total.result()
        elapsed = time.perf_counter() - started
        sys.stderr.write("\n")
        del futures, total
    expected = sum(i * i for i in range(n_tasks))
    ok = result == expected
    n = 2 * n_tasks - 1
    print(f"graph: {n_tasks} squares + {n_tasks - 1} pairwise sums = {n} tasks")
    print(f"result: {result} ({'correct' if ok else f'WRONG, expected {expected}'})")
    print(f"time: {elapsed:.2f} s, {n / elapsed:,.0f} tasks/s, on {n_workers} workers x "
          f"{threads_per_worker} threads, core {kind}")
    return 0 if ok else 1
