"""The scheduler core's longest stimuli while a big graph arrives, runs and leaves.

No network and no real workers: the state machine (``distributed_core.SchedulerState``,
garbage collector off, as the scheduler's own runs only between callbacks) takes a
graph the way the server hands it over, two simulated 1-thread workers finish what they
are sent, and every stimulus is timed. A stall here is one the probe of ``big_job.py``
meets, without the noise of the sockets and the other processes. Three graphs:

- ``dask``: the shape of ``(da.ones(N, chunks=1) + 1).sum()`` as dask optimizes it:
  N chunks with no inputs, then a tree reduction with 4 inputs a task (N + N/3 tasks),
  keys ``(name, i)`` and ``(name, level, i)``, sent in dask's order in slices of 4,000
  with each slice's frontier kept wanted until its dependents are sent, as
  ``dask_compute`` sends it; the workers finish about a slice between two slices.
- ``map``: ``client.map`` of N no-op tasks, in batches of 2,000, then gathered and
  released 1,000 keys a message; keys ``noop-<token>-<i>``, as the client makes them.
- ``submit``: the same with keys ``noop-<uuid>`` (as N ``submit`` calls make them), which
  have no index to keep neighbours together.

Printed per graph: the seconds spent in each kind of stimulus, and every stimulus over
``--over`` ms with the number of tasks held when it ran.

::

    python benchmarks/table_growth.py 1000000
    python benchmarks/table_growth.py 300000 --graphs dask --over 10
"""
from __future__ import annotations

import argparse
import gc
import heapq
import sys
import time
import uuid

from distributed_core import COMPILED, SchedulerState

WORKERS = ("tcp://10.0.0.1:1", "tcp://10.0.0.2:1")
FAN_IN = 4
DASK_SLICE = 4_000
MAP_BATCH = 2_000
REPORTS_PER_MESSAGE = 1_000
FORGET_SLICE = 5_000  # as the server sets it (5 per key of its slice of 1,000 keys)


class Run:
    """A state with two simulated workers; every stimulus timed."""

    def __init__(self, over_ms: float) -> None:
        self.state = SchedulerState(forget_slice=FORGET_SLICE)
        for address in WORKERS:
            self.state.add_worker(address, 1, "add-worker")
        self.over = over_ms / 1e3
        self.seconds: dict = {}
        self.slow: list = []
        self.running = {address: [] for address in WORKERS}

    def timed(self, name: str, stimulus, *args) -> None:
        held = len(self.state.tasks)
        start = time.perf_counter()
        out = stimulus(*args)
        took = time.perf_counter() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + took
        if took > self.over:
            self.slow.append((name, took, held))
        for address, msgs in out[1].items():
            self.running[address].extend(m["key"] for m in msgs if m["op"] == "compute-task")

    def forget_all(self) -> None:
        """What a release left to forget, a slice a stimulus (as the server does)."""
        while self.state.forget_backlog:
            self.timed("forget", self.state.forget_more, "forget")
        assert not self.state.tasks

    def finish(self, budget: int) -> None:
        """The workers report what they run, about ``budget`` tasks."""
        done = 0
        while done < budget and any(self.running.values()):
            for address in WORKERS:
                keys, self.running[address] = self.running[address], []
                done += len(keys)
                for i in range(0, len(keys), REPORTS_PER_MESSAGE):
                    reports = [{"key": k, "nbytes": 8, "type": "int", "start": 0.0,
                                "stop": 0.0001} for k in keys[i:i + REPORTS_PER_MESSAGE]]
                    self.timed("task-finished", self.state.task_finished, address, reports,
                               "finished")


def dask_graph(n: int) -> tuple[list, dict, object]:
    """Keys in dask's order (each reduction after its inputs), the inputs of each
    reduction, and the root."""
    level = [("ones-add-sum-6f1c0e9a", i) for i in range(n)]
    inputs: dict = {}
    depth = 1
    while len(level) > 1:
        above = []
        for j in range(0, len(level), FAN_IN):
            key = (("sum-partial-6f1c0e9a", depth, j // FAN_IN) if len(level) > FAN_IN
                   else ("sum-aggregate-6f1c0e9a", 0))
            inputs[key] = level[j:j + FAN_IN]
            above.append(key)
        level, depth = above, depth + 1
    root = level[0]
    order: list = []
    stack = [(root, False)]
    while stack:
        key, expanded = stack.pop()
        if expanded:
            order.append(key)
            continue
        stack.append((key, True))
        stack.extend((dep, False) for dep in reversed(inputs.get(key, ())))
    return order, inputs, root


def run_dask(n: int, over_ms: float) -> Run:
    order, inputs, root = dask_graph(n)
    position = {key: i for i, key in enumerate(order)}
    dependent = {dep: key for key, deps in inputs.items() for dep in deps}
    run = Run(over_ms)
    frontier: list = []  # (position of the last dependent, key)
    spec = b"\x80" * 300
    for start in range(0, len(order), DASK_SLICE):
        end = min(len(order), start + DASK_SLICE)
        part = order[start:end]
        tasks = [{"key": k, "spec": spec, "order": position[k], "deps": inputs[k]}
                 if k in inputs else {"key": k, "spec": spec, "order": position[k]}
                 for k in part]
        temporary = [k for k in part if k in dependent and position[dependent[k]] >= end]
        wanted = ([root] if end == len(order) else []) + temporary
        run.timed("update-graph", run.state.update_graph, "client", tasks, wanted, "graph")
        for key in temporary:
            heapq.heappush(frontier, (position[dependent[key]], key))
        done = []
        while frontier and frontier[0][0] < end:
            done.append(heapq.heappop(frontier)[1])
        if done:
            run.timed("release-keys", run.state.client_releases_keys, "client", done, "rel")
        run.finish(DASK_SLICE)
    run.finish(sys.maxsize)
    assert run.state.tasks[root].state == "memory"
    run.timed("release-keys", run.state.client_releases_keys, "client", [root], "release")
    run.forget_all()
    return run


def run_map(n: int, over_ms: float) -> Run:
    token = uuid.uuid4().hex
    return run_flat([f"noop-{token}-{i}" for i in range(n)], over_ms)


def run_submit(n: int, over_ms: float) -> Run:
    return run_flat([f"noop-{uuid.uuid4().hex}" for _ in range(n)], over_ms)


def run_flat(keys: list, over_ms: float) -> Run:
    n = len(keys)
    run = Run(over_ms)
    spec = b"\x80" * 100
    for start in range(0, n, MAP_BATCH):
        part = keys[start:start + MAP_BATCH]
        run.timed("update-graph", run.state.update_graph, "client",
                  [{"key": k, "spec": spec} for k in part], part, "graph")
        run.finish(MAP_BATCH // 2)
    run.finish(sys.maxsize)
    for start in range(0, n, REPORTS_PER_MESSAGE):
        run.timed("release-keys", run.state.client_releases_keys, "client",
                  keys[start:start + REPORTS_PER_MESSAGE], "release")
    run.forget_all()
    return run


GRAPHS = {"dask": run_dask, "map": run_map, "submit": run_submit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=1_000_000, help="N (see above)")
    parser.add_argument("--graphs", default="dask,map,submit",
                        help="dask, map, submit: any of them, by commas (default all)")
    parser.add_argument("--over", type=float, default=25.0,
                        help="list the stimuli longer than this many ms (default 25)")
    args = parser.parse_args()
    gc.disable()
    print(f"SchedulerState, COMPILED={COMPILED}; N = {args.n:,}; stimuli over {args.over:g} ms")
    for name in args.graphs.split(","):
        run = GRAPHS[name](args.n, args.over)
        totals = ", ".join(f"{kind} {s:.2f} s" for kind, s in run.seconds.items())
        worst = max((took for _, took, _ in run.slow), default=0.0)
        print(f"{name}: {totals}; {len(run.slow)} stimuli over {args.over:g} ms"
              + (f", the longest {1e3 * worst:.1f} ms" if run.slow else ""))
        for kind, took, held in run.slow:
            print(f"    {kind:14} {1e3 * took:7.1f} ms  with {held:,} tasks held")
        del run
        gc.collect()


if __name__ == "__main__":
    main()
