"""Benchmark of the scheduler core (``distributed_core.SchedulerState``), compiled vs interpreted.

No network, no real workers: the benchmark drives the state machine the way the server
does. Simulated workers answer instantly. Each workload goes through the whole lifecycle
on a fresh ``SchedulerState`` with 4 workers of 2 threads each:

    update_graph -> compute-task messages -> task_finished reports (each worker sends
    everything it has finished, at most 1000 reports per stimulus) -> the client
    releases its keys -> everything is forgotten (asserted: ``state.tasks`` is empty and
    every simulated worker was told to free every result it computed).

Workloads (``--quick`` shrinks them to about 10,000 tasks):

    independent      100,000 tasks without dependencies, all wanted (client.map)
    independent-inf  the same with worker_saturation=inf (no queuing: all assigned at once)
    chain            one chain of 100,000 tasks, the last one wanted
    tree             an 8-ary tree reduction over 100,000 leaves, the root wanted
    shuffle          dask's staged task shuffle: 1024 partitions, max_branch 32, so 2
                     stages of (1024 shuffle-group, 32,768 shuffle-split, 1024
                     shuffle-join) tasks on 1024 inputs; the 1024 outputs wanted

Measured per workload (medians over ``--repeat`` runs):

    us/task        CPU time (thread_time) spent inside SchedulerState stimuli over the whole lifecycle /
                   tasks (the simulated workers' own time is excluded; gc stays enabled)
    us/transition  the same time / the change of ``state.transition_counter``
    bytes/held     tracemalloc traced-memory delta of ``update_graph`` with no worker
                   registered (tasks stay waiting / queued / no-worker) / tasks

The memory figures do NOT count the keys, the run-spec bytes or the task dicts of the
update_graph message: those are all created before tracing starts (the keys' own size is
shown in a separate column). They DO count everything the scheduler allocates: TaskStates,
dependency tuples, dependents sets, the tasks dict, the client's wants_what set, the
queue heap entries, the unrunnable dict, TaskPrefixes. The transition log (a deque
bounded at 10,000 entries by default) is shown separately. The "memory" row holds N finished
independent tasks whose results the client still wants.

The parent process starts one subprocess per variant (``DISTRIBUTED_CORE_PURE=1`` for the
interpreted core, the normal import for the compiled one), each prints its medians as
JSON, and the parent prints one table (or ``--json``)::

    PYTHONPATH=/tmp/bc python benchmarks/core.py          # scratch build of the extension
    python benchmarks/core.py --quick --repeat 5          # with an installed package
    python benchmarks/core.py --profile independent       # cProfile of one lifecycle
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import deque

N_WORKERS = 4
NTHREADS = 2
BATCH = 1000  # most task-finished reports one worker sends in one stimulus
CLIENT = "client-0"
REPORT_NBYTES = 8  # every result is a small int
TARGET_US_PER_TASK = 5.0
TARGET_SPEEDUP = 3.0
TARGET_BYTES_PER_TASK = 700
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_HINT = (
    f"rm -rf /tmp/bc && mkdir /tmp/bc && cd {_REPO} && cp -r distributed_core setup.py "
    "pyproject.toml /tmp/bc/ && mkdir -p /tmp/bc/distributed_server && touch "
    "/tmp/bc/README.md /tmp/bc/distributed_server/__init__.py && (cd /tmp/bc && python "
    "setup.py -q build_ext --inplace) && PYTHONPATH=/tmp/bc python benchmarks/core.py   "
    "(or: pip install . and run this script from anywhere)")

WORKLOADS = ("independent", "independent-inf", "chain", "tree", "shuffle")


# ------------------------------------------------------------------ importing the core


def import_core():
    """``distributed_core`` from sys.path (PYTHONPATH / installed); else this checkout."""
    try:
        import distributed_core
    except ImportError:
        sys.path.insert(0, _REPO)
        import distributed_core
    return distributed_core


def core_info(dc) -> dict:
    info = {"compiled": bool(dc.COMPILED), "core_file": dc._core.__file__,
            "package_version": getattr(dc, "__version__", "?"),
            "python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "executable": sys.executable, "cython_installed": None, "cython_built_with": None}
    try:
        import Cython
        info["cython_installed"] = Cython.__version__
    except ImportError:
        pass
    if dc.COMPILED:
        try:
            with open(dc._core.__file__, "rb") as f:
                m = re.search(rb"_cython_(\d+)_(\d+)_(\d+)", f.read())
            if m:
                info["cython_built_with"] = ".".join(x.decode() for x in m.groups())
        except OSError:
            pass
    return info


# ------------------------------------------------------------------ workloads


class Workload:
    def __init__(self, name, description, tasks, wanted, saturation=1.1):
        self.name = name
        self.description = description
        self.tasks = tasks  # the update_graph message: list of task dicts
        self.wanted = wanted
        self.saturation = saturation
        self.n_tasks = len(tasks)
        self.n_edges = sum(len(t.get("deps", ())) for t in tasks)


def _tokens(rng, n):
    return [f"{rng.getrandbits(128):032x}" for _ in range(n)]


def _spec(i):
    # a distinct bytes object per task, about the size of a small pickled run spec
    return b"\x80\x05\x95run-spec-" + i.to_bytes(8, "little") + b"." * 80


def _graph(keys_deps):
    """Task dicts in the given (dependencies-first) order; ``order`` = position."""
    tasks = []
    for i, (key, deps) in enumerate(keys_deps):
        task = {"key": key, "spec": _spec(i), "order": i}
        if deps:
            task["deps"] = deps
        tasks.append(task)
    return tasks


def make_workload(name: str, n: int) -> Workload:
    rng = random.Random(42)
    if name in ("independent", "independent-inf"):
        keys = [f"inc-{tok}" for tok in _tokens(rng, n)]
        tasks = _graph([(k, None) for k in keys])
        return Workload(name, f"{n:,} independent tasks, all wanted", tasks, keys,
                        float("inf") if name == "independent-inf" else 1.1)
    if name == "chain":
        keys = [f"inc-{tok}" for tok in _tokens(rng, n)]
        tasks = _graph([(k, [keys[i - 1]] if i else None) for i, k in enumerate(keys)])
        return Workload(name, f"one chain of {n:,} tasks, last wanted", tasks, [keys[-1]])
    if name == "tree":
        tok = _tokens(rng, 2)
        level = [(f"chunk-{tok[0]}", i) for i in range(n)]
        entries = [(k, None) for k in level]
        depth = 1
        while len(level) > 1:
            parents = []
            for j in range(0, len(level), 8):
                children = level[j:j + 8]
                key = (f"sum-partial-{tok[1]}", depth, j // 8)
                if len(level) <= 8:
                    key = f"sum-aggregate-{tok[1]}"
                entries.append((key, children))
                parents.append(key)
            level = parents
            depth += 1
        return Workload(name, f"8-ary tree reduction over {n:,} leaves, root wanted",
                        _graph(entries), level)
    if name == "shuffle":
        # dask.dataframe's task-based shuffle (rearrange_by_column_tasks): partitions are
        # numbered in base k; stage s regroups along digit s.
        npart, k = (1024, 32) if n >= 50_000 else (256, 16)
        stages = 2
        tok = _tokens(rng, 4)
        inp = [(f"make-partition-{tok[0]}", i) for i in range(npart)]
        entries = [(key, None) for key in inp]
        prev = inp
        for s in range(stages):
            group = [(f"shuffle-group-{tok[1]}", s, i) for i in range(npart)]
            entries += [(group[i], [prev[i]]) for i in range(npart)]
            split = {(j, i): (f"shuffle-split-{tok[2]}", s, j, i)
                     for i in range(npart) for j in range(k)}
            entries += [(split[j, i], [group[i]]) for i in range(npart) for j in range(k)]
            weight = k ** s
            join = []
            for i in range(npart):
                digit = (i // weight) % k
                base = i - digit * weight
                join.append((f"shuffle-join-{tok[3]}", s, i))
                entries.append((join[-1], [split[digit, base + m * weight] for m in range(k)]))
            prev = join
        return Workload(name, f"task shuffle, {npart} partitions, {stages} stages of k={k}",
                        _graph(entries), prev)
    raise ValueError(f"unknown workload {name!r}")


def keys_bytes(workload: Workload) -> float:
    """Own size of the key objects (tuples, their strings and ints, counted once) / task."""
    seen = set()
    total = 0
    stack = [t["key"] for t in workload.tasks]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if type(obj) is tuple:
            stack.extend(obj)
    return total / workload.n_tasks


# ------------------------------------------------------------------ simulated cluster


class Driver:
    """A scheduler, one client and N instant workers; times only the stimuli."""

    def __init__(self, dc, saturation: float, n_workers: int = N_WORKERS, track=True):
        self.track = track  # keep the workers' own bookkeeping (off when measuring memory)
        self.state = dc.SchedulerState(worker_saturation=saturation)
        self.elapsed = 0.0
        self.stimuli = 0
        self.addresses = [f"tcp://10.0.0.{i + 1}:40000" for i in range(n_workers)]
        self.inbox = {a: deque() for a in self.addresses}  # compute-task keys received
        self.held = {a: set() for a in self.addresses}  # results each worker holds
        self.in_memory = 0  # key-in-memory messages the client got
        self.computed = 0
        self._seq = 0

    def call(self, method, *args):
        # CPU time of this thread, not wall time: a busy neighbour on this 2-core box
        # must not count as scheduler time.
        t0 = time.thread_time()
        result = method(*args)
        self.elapsed += time.thread_time() - t0
        self.stimuli += 1
        return result

    def sid(self, what):
        self._seq += 1
        return f"{what}-{self._seq}"

    def deliver(self, result):
        client_msgs, worker_msgs = result
        for msg in client_msgs.get(CLIENT, ()):
            if msg["op"] == "key-in-memory":
                self.in_memory += 1
            elif msg["op"] != "cancelled-keys":
                raise AssertionError(f"unexpected client message {msg}")
        for address, msgs in worker_msgs.items():
            inbox, held = self.inbox[address], self.held[address]
            for msg in msgs:
                op = msg["op"]
                if op == "compute-task":
                    inbox.append(msg["key"])
                elif op == "free-keys":
                    if self.track:
                        held.difference_update(msg["keys"])
                else:
                    raise AssertionError(f"unexpected worker message {msg}")

    def start(self, workers=True):
        self.deliver(self.call(self.state.add_client, CLIENT, self.sid("add-client")))
        if workers:
            for address in self.addresses:
                self.deliver(self.call(self.state.add_worker, address, NTHREADS,
                                       self.sid("add-worker")))

    def submit(self, workload: Workload):
        self.deliver(self.call(self.state.update_graph, CLIENT, workload.tasks,
                               workload.wanted, self.sid("update-graph")))

    def compute(self):
        """Workers finish everything they were sent until nothing is left to run."""
        busy = True
        while busy:
            busy = False
            for address in self.addresses:
                inbox = self.inbox[address]
                if not inbox:
                    continue
                busy = True
                n = min(len(inbox), BATCH)
                keys = [inbox.popleft() for _ in range(n)]
                reports = [{"key": key, "nbytes": REPORT_NBYTES, "type": "int",
                            "start": 1.0, "stop": 1.001} for key in keys]
                if self.track:
                    self.held[address].update(keys)
                self.computed += n
                self.deliver(self.call(self.state.task_finished, address, reports,
                                       self.sid("task-finished")))

    def release(self, workload: Workload):
        self.deliver(self.call(self.state.client_releases_keys, CLIENT, workload.wanted,
                               self.sid("client-releases-keys")))


def run_lifecycle(dc, workload: Workload) -> dict:
    gc.collect()
    driver = Driver(dc, workload.saturation)
    driver.start()
    state = driver.state
    counter0 = state.transition_counter
    t0 = time.perf_counter()
    driver.submit(workload)
    driver.compute()
    assert driver.computed == workload.n_tasks, (driver.computed, workload.n_tasks)
    assert driver.in_memory == len(workload.wanted), (driver.in_memory, len(workload.wanted))
    driver.release(workload)
    wall = time.perf_counter() - t0
    assert not state.tasks, f"{len(state.tasks)} tasks left after release"
    assert not any(driver.held.values()), "a worker was not told to free a result"
    transitions = state.transition_counter - counter0
    return {"us_per_task": driver.elapsed / workload.n_tasks * 1e6,
            "us_per_transition": driver.elapsed / transitions * 1e6,
            "sched_s": driver.elapsed, "wall_s": wall, "transitions": transitions,
            "stimuli": driver.stimuli}


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def measure_held(dc, workload: Workload) -> dict:
    """update_graph with no worker: every task stays waiting / queued / no-worker."""
    gc.collect()
    driver = Driver(dc, workload.saturation)
    driver.start(workers=False)
    state = driver.state
    tracemalloc.start()
    try:
        base = _traced()
        result = state.update_graph(CLIENT, workload.tasks, workload.wanted, "update-graph")
        del result
        total = _traced() - base
        state.clear_transition_log()
        without_log = _traced() - base
    finally:
        tracemalloc.stop()
    assert len(state.tasks) == workload.n_tasks
    counts = {k: v for k, v in state.task_counts().items() if v}
    return {"bytes_per_task": without_log / workload.n_tasks,
            "log_bytes_per_task": (total - without_log) / workload.n_tasks,
            "key_bytes_per_task": keys_bytes(workload), "states": counts}


def measure_in_memory(dc, workload: Workload) -> dict:
    """N finished tasks whose results the client still wants (state memory, on 4 workers)."""
    gc.collect()
    driver = Driver(dc, workload.saturation, track=False)
    driver.start()
    state = driver.state
    tracemalloc.start()
    try:
        base = _traced()
        driver.submit(workload)
        driver.compute()
        total = _traced() - base
        state.clear_transition_log()
        without_log = _traced() - base
    finally:
        tracemalloc.stop()
    assert state.task_counts()["memory"] == workload.n_tasks
    return {"bytes_per_task": without_log / workload.n_tasks,
            "log_bytes_per_task": (total - without_log) / workload.n_tasks,
            "key_bytes_per_task": keys_bytes(workload), "states": {"memory": workload.n_tasks}}


# ------------------------------------------------------------------ child: one variant


def child_main(args) -> None:
    dc = import_core()
    info = core_info(dc)
    if args.probe:
        print(json.dumps({"info": info}))
        return
    n = 10_000 if args.quick else args.tasks
    names = args.workloads or list(WORKLOADS)
    log = sys.stderr
    mode = "compiled" if info["compiled"] else "interpreted"
    # A workload's update_graph message (100,000 task dicts) is built right before its
    # run and dropped after it: only one graph is alive at a time, as in a real
    # scheduler, so the garbage collector's cost is not inflated by the other graphs.
    runs = {name: [] for name in names}
    shape = {}
    for r in range(args.repeat):
        for name in names:  # interleaved: noise spreads over all workloads
            wl = make_workload(name, n)
            shape[name] = (wl.description, wl.n_tasks, wl.n_edges)
            res = run_lifecycle(dc, wl)
            del wl
            runs[name].append(res)
            print(f"[{mode}] run {r + 1}/{args.repeat} {name:16s} "
                  f"{res['us_per_task']:7.2f} us/task {res['us_per_transition']:6.2f} "
                  f"us/transition ({res['stimuli']:,} stimuli)", file=log, flush=True)
    results = {}
    for name in names:
        description, n_tasks, n_edges = shape[name]
        rs = runs[name]
        results[name] = {
            "description": description, "tasks": n_tasks, "edges": n_edges,
            "transitions": rs[0]["transitions"], "stimuli": rs[0]["stimuli"],
            "us_per_task": statistics.median(x["us_per_task"] for x in rs),
            "us_per_transition": statistics.median(x["us_per_transition"] for x in rs),
            "wall_s_incl_workers": statistics.median(x["wall_s"] for x in rs),
            "us_per_task_runs": [round(x["us_per_task"], 3) for x in rs],
        }
    if not args.no_memory:
        for name in names:
            print(f"[{mode}] memory {name} ...", file=log, flush=True)
            results[name]["memory_held"] = measure_held(dc, make_workload(name, n))
        print(f"[{mode}] memory of finished tasks ...", file=log, flush=True)
        results["memory"] = {"description": f"{n:,} finished tasks, results wanted",
                             "tasks": n, "memory_held":
                             measure_in_memory(dc, make_workload("independent", n))}
    print(json.dumps({"info": info, "n": n, "repeat": args.repeat, "results": results}))


# ------------------------------------------------------------------ parent: both variants


def machine_info() -> dict:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu,
            "cpus": os.cpu_count(), "loadavg": load}


def run_child(python: str, pure: bool, argv: list, probe=False) -> dict:
    env = dict(os.environ)
    env.pop("DISTRIBUTED_CORE_PURE", None)
    if pure:
        env["DISTRIBUTED_CORE_PURE"] = "1"
    cmd = [python, os.path.abspath(__file__), "--child"] + argv + (["--probe"] if probe else [])
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL if probe else None, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark subprocess failed ({'pure' if pure else 'normal'}): "
                         f"rc={proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _load(load):
    return "?" if not load else "/".join(f"{x:.2f}" for x in load)


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def print_table(combined: dict) -> None:
    m = combined["machine"]
    comp, interp = combined.get("compiled"), combined["interpreted"]
    ii = interp["info"]
    print(f"distributed-core scheduler benchmark -- {combined['n']:,} tasks per workload, "
          f"median of {combined['repeat']} runs")
    print(f"machine: {m['cpu']}, {m['cpus']} CPUs, {m['platform']}, "
          f"loadavg {_load(m['loadavg'])} at start, {_load(m.get('loadavg_end'))} at end")
    print(f"python:  {ii['implementation']} {ii['python']} ({ii['executable']}); "
          f"Cython installed: {ii['cython_installed']}")
    if comp:
        ci = comp["info"]
        print(f"compiled:    {ci['core_file']} (built with Cython {ci['cython_built_with']})")
    else:
        print("compiled:    UNAVAILABLE -- the normal import gives the interpreted core "
              "(no extension importable). Build it with:")
        print(f"             {BUILD_HINT}")
    print(f"interpreted: {ii['core_file']} (DISTRIBUTED_CORE_PURE=1)")
    print(f"cluster: {N_WORKERS} simulated workers x {NTHREADS} threads, instant tasks, "
          f"<= {BATCH} reports per task_finished; worker_saturation 1.1 unless noted; gc on")
    print()
    cols = ["workload", "tasks", "compiled us/task", "interp us/task", "ratio",
            "compiled us/trans", "interp us/trans", "bytes/held task comp | interp"]
    rows = []
    names = [k for k in interp["results"] if k != "memory"]
    for name in names + (["memory"] if "memory" in interp["results"] else []):
        ir = interp["results"][name]
        cr = comp["results"].get(name) if comp else None
        ci_t = cr and cr.get("us_per_task")
        ii_t = ir.get("us_per_task")
        mem_c = cr and cr.get("memory_held", {}).get("bytes_per_task")
        mem_i = ir.get("memory_held", {}).get("bytes_per_task")
        label = name if name != "memory" else "memory (finished, wanted)"
        rows.append([label, f"{ir['tasks']:,}", _fmt(ci_t, ".2f"), _fmt(ii_t, ".2f"),
                     _fmt(ii_t / ci_t if ci_t and ii_t else None, ".2f") + ("x" if ci_t and ii_t else ""),
                     _fmt(cr and cr.get("us_per_transition"), ".3f"),
                     _fmt(ir.get("us_per_transition"), ".3f"),
                     f"{_fmt(mem_c, '.0f')} | {_fmt(mem_i, '.0f')}"])
    widths = [max(len(str(r[i])) for r in rows + [cols]) for i in range(len(cols))]
    line = " | ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                      for i, c in enumerate(cols))
    print(line)
    print("-" * len(line))
    for r in rows:
        print(" | ".join(str(c).ljust(widths[i]) if i == 0 else str(c).rjust(widths[i])
                         for i, c in enumerate(r)))
    print()
    print("workloads:")
    for name in names:
        ir = interp["results"][name]
        cr = comp["results"].get(name) if comp else None
        wall_c = cr and cr["wall_s_incl_workers"] / cr["tasks"] * 1e6
        wall_i = ir["wall_s_incl_workers"] / ir["tasks"] * 1e6
        print(f"  {name:16s} {ir['description']}; {ir['edges']:,} edges, "
              f"{ir['transitions']:,} transitions, {ir['stimuli']:,} stimuli; "
              f"wall incl. simulated workers {_fmt(wall_c, '.2f')} | {wall_i:.2f} us/task")
    if "memory" in interp["results"] or any("memory_held" in interp["results"][k] for k in names):
        print()
        print("memory per task (tracemalloc delta / tasks). Counted: TaskStates, dependency "
              "tuples, dependents sets, tasks dict,")
        print("  wants_what, queue heap entries, unrunnable dict, worker sets. Not counted: keys, "
              "run-spec bytes, task dicts (made before")
        print("  tracing). 'log' = the bounded transition log (<= 10,000 entries), shown apart. "
              "'keys' = the key objects' own size.")
        print(f"  {'workload':26s} {'held as':30s} {'comp':>6s} {'+log':>5s} "
              f"{'interp':>6s} {'+log':>5s} {'keys':>5s}")
        for name in names + ["memory"]:
            ir = interp["results"].get(name, {}).get("memory_held")
            if not ir:
                continue
            cr = comp and comp["results"].get(name, {}).get("memory_held")
            held = ", ".join(f"{k} {v:,}" for k, v in ir["states"].items())
            label = name if name != "memory" else "memory (finished, wanted)"
            print(f"  {label:26s} {held:30s} {_fmt(cr and cr['bytes_per_task'], '6.0f')} "
                  f"{_fmt(cr and cr['log_bytes_per_task'], '5.0f')} "
                  f"{ir['bytes_per_task']:6.0f} {ir['log_bytes_per_task']:5.0f} "
                  f"{ir['key_bytes_per_task']:5.0f}")
    print()
    print(f"targets (reported, not asserted): compiled <= {TARGET_US_PER_TASK:g} us/task, "
          f"compiled >= {TARGET_SPEEDUP:g}x faster than interpreted, <= {TARGET_BYTES_PER_TASK} "
          "bytes/held task")
    print("  (for scale: dask.distributed's state machine spends 45-70 us/task and holds "
          "2.6-6.2 KB/task)")
    if comp:
        for name in names:
            c, i = comp["results"][name], interp["results"][name]
            mem = c.get("memory_held", {}).get("bytes_per_task")
            verdict = [
                f"{c['us_per_task']:.2f} us/task "
                + ("ok" if c["us_per_task"] <= TARGET_US_PER_TASK else "MISSED"),
                f"{i['us_per_task'] / c['us_per_task']:.2f}x "
                + ("ok" if i["us_per_task"] / c["us_per_task"] >= TARGET_SPEEDUP else "MISSED"),
            ]
            if mem is not None:
                verdict.append(f"{mem:.0f} B " + ("ok" if mem <= TARGET_BYTES_PER_TASK
                                                   else "MISSED"))
            print(f"  {name:16s} " + "; ".join(verdict))
        mem = comp["results"].get("memory", {}).get("memory_held")
        if mem:
            print(f"  {'memory':16s} {mem['bytes_per_task']:.0f} B "
                  + ("ok" if mem["bytes_per_task"] <= TARGET_BYTES_PER_TASK else "MISSED"))
    else:
        print("  compiled variant unavailable: targets not evaluated")


def parent_main(args, argv) -> None:
    python = args.python or sys.executable
    probe = run_child(python, False, argv, probe=True)
    compiled_available = probe["info"]["compiled"]
    combined = {"machine": machine_info(), "n": 10_000 if args.quick else args.tasks,
                "repeat": args.repeat, "compiled": None, "interpreted": None,
                "compiled_available": compiled_available}
    if compiled_available:
        combined["compiled"] = run_child(python, False, argv)
    else:
        print("NOTE: the compiled variant is unavailable (distributed_core imports the "
              f"interpreted core: {probe['info']['core_file']}). Build it with:\n  {BUILD_HINT}",
              file=sys.stderr)
    combined["interpreted"] = run_child(python, True, argv)
    combined["machine"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if args.json:
        print(json.dumps(combined, indent=2))
    else:
        print_table(combined)


# ------------------------------------------------------------------ profiling helper


def profile_main(args) -> None:
    import cProfile
    import pstats
    dc = import_core()
    n = 10_000 if args.quick else args.tasks
    wl = make_workload(args.profile, n)
    run_lifecycle(dc, wl)  # warm up
    prof = cProfile.Profile()
    prof.enable()
    res = run_lifecycle(dc, wl)
    prof.disable()
    print(f"{'compiled' if dc.COMPILED else 'interpreted'} core, {args.profile}: "
          f"{res['us_per_task']:.2f} us/task (under cProfile)", file=sys.stderr)
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per workload (median)")
    parser.add_argument("--quick", action="store_true", help="10,000 tasks per workload")
    parser.add_argument("--tasks", type=int, default=100_000, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--python", help="interpreter for the benchmark subprocesses")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, help="subset to run")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc runs")
    parser.add_argument("--profile", choices=WORKLOADS,
                        help="cProfile one lifecycle of a workload in this process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile:
        profile_main(args)
    elif args.child:
        child_main(args)
    else:
        argv = ["--repeat", str(args.repeat), "--tasks", str(args.tasks)]
        argv += ["--quick"] if args.quick else []
        argv += ["--no-memory"] if args.no_memory else []
        argv += ["--workloads", *args.workloads] if args.workloads else []
        parent_main(args, argv)


if __name__ == "__main__":
    main()
