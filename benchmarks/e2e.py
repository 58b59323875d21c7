"""End to end: distributed-core and dask.distributed side by side on real local processes.

One command times both systems in the same run, on clusters of the same shape (N worker
processes x 1 thread, all on this machine), alternating the systems from one repeat to
the next, and prints the medians of the repeats as one table with ratios::

    PYTHONPATH=/tmp/be python benchmarks/e2e.py          # a scratch build of the extension
    python benchmarks/e2e.py --quick                     # ~5,000 tasks, 1 repeat
    python benchmarks/e2e.py --both-cores --repeat 5     # + the interpreted core
    python benchmarks/e2e.py --only dcore --json
    python benchmarks/e2e.py --only dcore --security tls   # TLS + token (default: token)

Workloads (``--quick``: about 5,000 tasks each, one repeat):

    map    ``client.map(noop, range(N))`` + ``client.gather``; 1x1 and 2x1
           (``--tasks`` N, default 20,000; ``--quick`` 5,000)
    tree   ``client.get(graph, root)`` of a pairwise tree reduction over L leaves
           (``("leaf", i): (noop_leaf, i)``, ``("add", level, i): (add, left, right)``):
           2L-1 tasks; 1x1 and 2x1 (``--leaves`` L, default 20,000; ``--quick`` 2,500)
    rt     ``client.submit(inc, i).result()`` in a loop (``--iterations``, 300); 1x1

plus dask.distributed with queuing off (``worker-saturation: inf`` in its scheduler
process's environment) on map 1x1 (not with ``--quick``).

How each system runs:

- distributed-core: ``distributed_server.deploy.local_cluster.LocalCluster(processes=True)``, i.e. a
  ``python -m distributed_server.cli scheduler`` process and N ``... worker`` processes;
  ``distributed_server.client.client.Client`` in the benchmark process. ``--security``: the
  cluster's credentials, ``none`` (``Security()``), ``token`` (a fresh token, what
  LocalCluster does by default) or ``tls`` (``Security.temporary()``: TLS + a token).
- dask.distributed, default configuration: a ``python -m distributed.cli.dask_scheduler``
  process and N ``python -m distributed.cli.dask_worker ADDRESS --nthreads 1`` processes
  (each a nanny and its worker process, dask's default); ``distributed.Client(address)``
  in the benchmark process. (``distributed.LocalCluster(processes=True)`` would run the
  scheduler inside the client's process, so its CPU could not be told apart.)

Measured per run, in a fresh subprocess with a fresh cluster and a warm-up round first:

- wall: from the first submit to the last result in the client.
- scheduler CPU / task: user+sys CPU time (psutil) of the scheduler process, from just
  before the first submit until the scheduler has forgotten every task of the run again
  (the client's releases included), divided by the tasks.
- workers CPU / task: the same over all worker processes (dask: nanny + worker).
- client CPU / task: the benchmark process itself (its main and event-loop threads).

The task functions live in ``benchmarks/_e2e_tasks.py``, an importable module on every
process's PYTHONPATH, so both systems pickle them by reference. Each run is a
subprocess killed (with everything it started) after ``--timeout`` seconds and then
reported as "did not finish". Results also go to ``benchmarks/results/e2e-*.json``
(ignored by git; the run the docs cite is in ``benchmarks/baselines/``).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# Where every benchmark writes its results by default: ignored by git. The runs the docs
# cite are copied to benchmarks/baselines/ (one per benchmark) by hand.
RESULTS_DIR = os.path.join(HERE, "results")
RESULT_MARK = "E2E-RESULT "
TASKS_MODULE = "_e2e_tasks"

# Targets (reported, never asserted) and dask.distributed's figures for scale.
TARGET_MAP_TASKS_PER_S = 15_000
TARGET_RT_MS = 1.0
TARGET_SCHED_US = 30.0
DASK_SCALE = {"map_1x1": 290, "map_1x1_noqueue": 900, "rt_ms": (10, 15),
              "sched_us": (250, 890)}

DCORE, DASK = "dcore", "dask"


# ====================================================================== the workloads


def tree_graph(n_leaves: int, offset: int = 0) -> tuple[dict, object]:
    """A pairwise tree reduction over ``n_leaves`` leaves: (graph, root key).

    Leaf keys are ``("leaf", offset + i)``; level ``l`` adds neighbours pairwise into
    ``("add", l, offset + j)``; an odd one out is carried up to the next level as is.
    """
    from _e2e_tasks import add, noop_leaf

    graph: dict = {}
    level = []
    for i in range(n_leaves):
        key = ("leaf", offset + i)
        graph[key] = (noop_leaf, i)
        level.append(key)
    depth = 0
    while len(level) > 1:
        depth += 1
        nxt = []
        for j in range(0, len(level) - 1, 2):
            key = ("add", depth, offset + j // 2)
            graph[key] = (add, level[j], level[j + 1])
            nxt.append(key)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return graph, level[0]


def run_map(client, n: int, start: int = 0) -> dict:
    from _e2e_tasks import noop

    futures = client.map(noop, range(start, start + n))
    results = client.gather(futures)
    assert len(results) == n and results[0] is None, "map: wrong results"
    del futures, results
    return {}


def run_tree(client, n: int, offset: int = 0) -> dict:
    graph, root = tree_graph(n, offset)
    total = client.get(graph, root)
    assert total == n * (n - 1) // 2, f"tree: got {total}, expected {n * (n - 1) // 2}"
    return {}


def run_round_trips(client, iterations: int, start: int = 0) -> dict:
    from _e2e_tasks import inc

    latencies = []
    for i in range(start, start + iterations):
        t0 = time.perf_counter()
        value = client.submit(inc, i).result()
        latencies.append(time.perf_counter() - t0)
        assert value == i + 1, "round trip: wrong result"
    return {"rt_median_ms": 1e3 * statistics.median(latencies),
            "rt_p90_ms": 1e3 * percentile(latencies, 90)}


def percentile(values: list, q: float) -> float:
    """The q-th percentile, linear between closest ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def n_tasks_of(workload: str, spec: dict) -> int:
    if workload == "map":
        return spec["n"]
    if workload == "tree":
        return 2 * spec["leaves"] - 1
    return spec["iterations"]


# ====================================================================== clusters (child side)


def _die_with_parent() -> None:
    """In a cluster process, before exec: SIGTERM it when the benchmark child dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG
    except Exception:  # noqa: BLE001, S110 - best effort; the parent kills the group anyway
        pass


SECURITY_MODES = ("none", "token", "tls")


def make_security(mode: str):
    """The `Security` of a ``--security`` mode: none, token, or tls (TLS + a token)."""
    from distributed_server.security import Security, new_token

    return {"none": Security, "token": lambda: Security(token=new_token()),
            "tls": Security.temporary}[mode]()


class DcoreSystem:
    """distributed-core: its own LocalCluster of processes, and its Client.

    ``security``: one of `SECURITY_MODES` (the Client takes the cluster's credentials)."""

    def __init__(self, n_workers: int, threads: int, security: str = "token"):
        import psutil

        from distributed_server.client.client import Client
        from distributed_server.deploy.local_cluster import LocalCluster

        self.cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads,
                                    processes=True, timeout=60,
                                    security=make_security(security))
        self.client = Client(self.cluster, set_as_default=False, timeout=60)
        procs = self.cluster._procs  # the scheduler, then the nanny of the workers
        self.scheduler = psutil.Process(procs[0].pid)
        self.workers = []
        for proc in procs[1:]:  # the nanny and the worker processes it started, as for dask
            top = psutil.Process(proc.pid)
            self.workers += [top] + top.children(recursive=True)
        info = self.cluster.scheduler_info()
        self.info = {"compiled": bool(info.get("compiled")),
                     "n_workers": len(info["workers"]), "security": security,
                     "scheme": self.cluster.scheduler_address.split("://")[0]}

    def scheduler_n_tasks(self) -> int:
        return self.cluster.scheduler_info()["n_tasks"]

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


class DaskSystem:
    """dask.distributed with default settings: a scheduler process, N nanny+worker
    processes started with dask's own commands, and a distributed.Client."""

    def __init__(self, n_workers: int, threads: int, no_queue: bool, logdir: str):
        import distributed
        import psutil

        self.procs: list = []
        sched_env = dict(os.environ)
        if no_queue:
            sched_env["DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION"] = "inf"
        sched_log = os.path.join(logdir, "dask-scheduler.log")
        self._spawn([sys.executable, "-m", "distributed.cli.dask_scheduler",
                     "--host", "127.0.0.1", "--port", "0"], sched_log, sched_env)
        address = _wait_for_line(sched_log, r"Scheduler at:\s+(tcp://\S+)", 60,
                                 self.procs[0])
        for i in range(n_workers):
            self._spawn([sys.executable, "-m", "distributed.cli.dask_worker", address,
                         "--nthreads", str(threads), "--name", f"worker-{i}"],
                        os.path.join(logdir, f"dask-worker-{i}.log"), dict(os.environ))
        self.client = distributed.Client(address, set_as_default=False, timeout=60)
        self.client.wait_for_workers(n_workers, timeout=60)
        self.scheduler = psutil.Process(self.procs[0].pid)
        self.workers = []
        for proc in self.procs[1:]:  # the nanny and the worker process it started
            top = psutil.Process(proc.pid)
            self.workers += [top] + top.children(recursive=True)
        from _e2e_tasks import dask_scheduler_saturation

        saturation = self.client.run_on_scheduler(dask_scheduler_saturation)
        self.info = {"worker_saturation": saturation,
                     "n_workers": len(self.client.scheduler_info()["workers"])}

    def _spawn(self, cmd: list, log: str, env: dict) -> None:
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=env,
                                               preexec_fn=_die_with_parent))  # noqa: PLW1509

    def scheduler_n_tasks(self) -> int:
        from _e2e_tasks import dask_scheduler_n_tasks

        return self.client.run_on_scheduler(dask_scheduler_n_tasks)

    def close(self) -> None:
        """Stop everything; the measurement is over, so a slow graceful exit (dask's
        worker command takes ~8 s) gets 0.5 s and then SIGKILL (the benchmark's parent
        kills whatever is left in the session, e.g. a worker whose nanny was killed)."""
        try:
            self.client.close(timeout=10)
        finally:
            for proc in reversed(self.procs):
                proc.terminate()
            deadline = time.monotonic() + 0.5
            for proc in self.procs:
                try:
                    proc.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_for_line(path: str, pattern: str, timeout: float, proc) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, errors="replace") as f:
            found = re.search(pattern, f.read())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with code {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"no {pattern!r} in {path} within {timeout} s")


def cpu_seconds(procs) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except Exception:  # noqa: BLE001, S112 - a process that is gone adds nothing more
            continue
        total += times.user + times.system
    return total


def wait_until_forgotten(system, timeout: float = 30.0) -> bool:
    """Poll the scheduler until it holds no task; False if it still does at timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if system.scheduler_n_tasks() == 0:
            return True
        time.sleep(0.02)
    return False


def child_main(spec: dict) -> None:
    """One measurement: start the cluster, warm up, time one workload, print JSON."""
    import psutil

    sys.path.insert(0, HERE)
    workload, n_workers = spec["workload"], spec["workers"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="e2e-") as logdir:
        if spec["system"] == DCORE:
            system = DcoreSystem(n_workers, spec["threads"], spec.get("security", "token"))
        else:
            system = DaskSystem(n_workers, spec["threads"], spec.get("no_queue", False),
                                logdir)
        try:
            startup = time.perf_counter() - t0
            client = system.client
            run = {"map": lambda start: run_map(client, spec["n"], start),
                   "tree": lambda start: run_tree(client, spec["leaves"], start),
                   "rt": lambda start: run_round_trips(client, spec["iterations"], start),
                   }[workload]
            warm = {"map": lambda: run_map(client, 200, 10 * spec["n"]),
                    "tree": lambda: run_tree(client, 64, 10 * spec["leaves"]),
                    "rt": lambda: run_round_trips(client, 20, -1000),
                    }[workload]
            warm()
            wait_until_forgotten(system)

            me = psutil.Process()
            sched0, workers0, me0 = (cpu_seconds([system.scheduler]),
                                     cpu_seconds(system.workers), cpu_seconds([me]))
            t1 = time.perf_counter()
            extra = run(0)
            wall = time.perf_counter() - t1
            forgotten = wait_until_forgotten(system)
            settle = time.perf_counter() - t1 - wall
            sched1, workers1, me1 = (cpu_seconds([system.scheduler]),
                                     cpu_seconds(system.workers), cpu_seconds([me]))
        finally:
            system.close()
    n = n_tasks_of(workload, spec)
    result = {"wall_s": wall, "tasks": n, "tasks_per_s": n / wall,
              "sched_cpu_us": 1e6 * (sched1 - sched0) / n,
              "workers_cpu_us": 1e6 * (workers1 - workers0) / n,
              "client_cpu_us": 1e6 * (me1 - me0) / n,
              "settle_s": settle, "forgotten": forgotten, "startup_s": startup,
              **extra, **system.info}
    print(RESULT_MARK + json.dumps(result), flush=True)


# ====================================================================== the parent


class Variant:
    """One system as it appears in the table (a row label and how to run it)."""

    def __init__(self, name: str, system: str, label: str, env: dict, no_queue=False):
        self.name, self.system, self.label = name, system, label
        self.env, self.no_queue = env, no_queue


def base_env(pythonpath_extra: list) -> dict:
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts += [p for p in pythonpath_extra if p not in parts]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def probe_core(env: dict) -> dict:
    """Which distributed_core the cluster processes will import with ``env``."""
    code = ("import json, distributed_core as d; print(json.dumps({'version': "
            "d.__version__, 'compiled': bool(d.COMPILED), 'file': d._core.__file__}))")
    with tempfile.TemporaryDirectory(prefix="e2e-cwd-") as cwd:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, cwd=cwd, check=False)
    if out.returncode:
        raise SystemExit(f"cannot import distributed_core: {out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def core_env_and_info(args) -> tuple[dict, dict, list]:
    """The environment for distributed-core's processes per variant, and what each loads.

    Returns (default env, default core info, [(name, env, info) of extra variants]).
    ``distributed_core`` is taken from PYTHONPATH / the installed package; if neither has
    it, from this checkout.
    """
    extra = [HERE]
    env = base_env(extra)
    env_auto = dict(env)
    try:
        info = probe_core(env_auto)
    except SystemExit:
        env = base_env([REPO, HERE])
        env_auto = dict(env)
        info = probe_core(env_auto)
    if args.variant == "pure":
        env_auto["DISTRIBUTED_CORE_PURE"] = "1"
        info = probe_core(env_auto)
    elif args.variant == "compiled":
        env_auto.pop("DISTRIBUTED_CORE_PURE", None)
        info = probe_core(env_auto)
        if not info["compiled"]:
            raise SystemExit(f"--variant compiled: no compiled core importable "
                             f"(loaded {info['file']}); build one, e.g. in /tmp/be, and "
                             f"set PYTHONPATH")
    extras = []
    if args.both_cores and info["compiled"]:
        env_pure = dict(env_auto, DISTRIBUTED_CORE_PURE="1")
        extras.append(("dcore-pure", env_pure, probe_core(env_pure)))
    elif args.both_cores:
        print(f"--both-cores: the core in use is already the interpreted one "
              f"({info['file']}); no compiled build to compare with", file=sys.stderr)
    return env_auto, info, extras


def save_results(name: str, doc: dict, started: datetime.datetime, quick: bool) -> str:
    """Write ``doc`` as ``benchmarks/results/<name>-<start time>[-quick].json`` (a folder
    git ignores); return its path relative to the checkout."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    stamp = started.strftime("%Y-%m-%d-%H%M%S") + ("-quick" if quick else "")
    path = os.path.join(RESULTS_DIR, f"{name}-{stamp}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return os.path.relpath(path, REPO)


def versions() -> dict:
    out = {}
    for name in ("dask", "distributed", "tornado", "msgpack", "cloudpickle", "psutil"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_child(spec: dict, env: dict, timeout: float, script: str = __file__) -> dict:
    """Run one measurement (``script --child spec``) in its own session.

    Returns as soon as the child prints its result (a cluster's shutdown is not waited
    for) and kills the whole session then, or at ``timeout``."""
    cmd = [sys.executable, os.path.abspath(script), "--child", json.dumps(spec)]
    # An empty working directory: `python -m` puts it first on the cluster processes'
    # sys.path, where a stray module of the same name must not shadow ours.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.TemporaryDirectory(prefix="bench-cwd-") as cwd:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, cwd=cwd)
        deadline = time.monotonic() + timeout
        result = _result_in(out)
        while result is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            result = _result_in(out)
        _kill_session(proc)
        if result is None:
            result = _result_in(out)
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            return {"error": f"did not finish in {timeout:g} s"}
        err.seek(0)
        tail = [ln for ln in err.read().strip().splitlines() if ln.strip()][-3:]
        return {"error": f"exit code {proc.returncode}: " + " | ".join(tail)[-300:]}


def _result_in(out) -> dict | None:
    """The result line a child printed so far, if any."""
    out.seek(0)
    for line in out.read().splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    return None


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the child's session (its cluster processes included)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def plan_cells(args) -> list:
    """(workload, n_workers) in table order."""
    return [("map", 1), ("map", 2), ("tree", 1), ("tree", 2), ("rt", 1)]


def variants_for(cell, variants: list, args) -> list:
    out = []
    for v in variants:
        if v.no_queue and (cell != ("map", 1) or args.quick):
            continue
        out.append(v)
    return out


def median_of(runs: list, field: str):
    values = [r[field] for r in runs if r.get(field) is not None]
    return statistics.median(values) if values else None


def aggregate(runs: list) -> dict:
    ok = [r for r in runs if "error" not in r]
    row = {"runs": len(runs), "ok": len(ok)}
    if not ok:
        row["error"] = runs[0]["error"] if runs else "not run"
        return row
    for field in ("wall_s", "tasks_per_s", "sched_cpu_us", "workers_cpu_us",
                  "client_cpu_us", "rt_median_ms", "rt_p90_ms", "settle_s", "startup_s"):
        row[field] = median_of(ok, field)
    row["tasks"] = ok[0]["tasks"]
    if not all(r.get("forgotten") for r in ok):
        row["error"] = "the scheduler still held tasks 30 s after the results"
    if len(ok) < len(runs):
        row["error"] = f"{len(runs) - len(ok)} of {len(runs)} runs failed: " + \
            next(r["error"] for r in runs if "error" in r)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="5,000 tasks, 1 repeat, no dask-queuing-off row")
    parser.add_argument("--repeat", type=int, default=None, help="repeats (default 3)")
    parser.add_argument("--tasks", type=int, default=None,
                        help="map tasks (default 20,000; --quick 5,000)")
    parser.add_argument("--leaves", type=int, default=None,
                        help="tree leaves (default 20,000; --quick 2,500, so ~5,000 tasks)")
    parser.add_argument("--iterations", type=int, default=300,
                        help="submit().result() round trips (default 300)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--only", choices=(DCORE, DASK), default=None)
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per run, cluster start included (default 600; "
                             "--quick 180)")
    parser.add_argument("--variant", choices=("auto", "compiled", "pure"), default="auto",
                        help="distributed-core's core: whatever `import distributed_core` "
                             "gives (auto), or require the compiled / force the "
                             "interpreted one")
    parser.add_argument("--both-cores", action="store_true",
                        help="also run distributed-core with DISTRIBUTED_CORE_PURE=1")
    parser.add_argument("--security", choices=SECURITY_MODES, default="token",
                        help="distributed-core's credentials: none, a token (default, as "
                             "LocalCluster), or tls (TLS + a token)")
    parser.add_argument("--no-save", action="store_true",
                        help="do not write benchmarks/results/e2e-*.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return 0

    repeat = args.repeat or (1 if args.quick else 3)
    n = args.tasks or (5_000 if args.quick else 20_000)
    leaves = args.leaves or (2_500 if args.quick else 20_000)
    timeout = args.timeout or (180.0 if args.quick else 600.0)
    started = datetime.datetime.now()

    variants: list[Variant] = []
    core_info = None
    if args.only != DASK:
        env, core_info, extras = core_env_and_info(args)
        kind = "compiled" if core_info["compiled"] else "interpreted"
        variants.append(Variant(DCORE, DCORE, f"distributed-core ({kind})", env))
        for name, env_x, info_x in extras:
            kind_x = "compiled" if info_x["compiled"] else "interpreted"
            variants.append(Variant(name, DCORE, f"distributed-core ({kind_x})", env_x))
    if args.only != DCORE:
        dask_env = base_env([HERE])
        dask_env.pop("DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION", None)
        variants.append(Variant(DASK, DASK, "dask.distributed", dask_env))
        variants.append(Variant("dask-noqueue", DASK, "dask.distributed, queuing off",
                                dask_env, no_queue=True))

    header = {
        "date": started.isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "platform": platform.platform(),
        "distributed_core": core_info, "versions": versions(), "repeat": repeat,
        "tasks": n, "leaves": leaves, "iterations": args.iterations, "timeout_s": timeout,
        "quick": args.quick, "variant": args.variant, "security": args.security,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    if not args.json:
        print_header(header)

    cells = plan_cells(args)
    raw: dict = {}
    for r in range(repeat):
        for cell in cells:
            order = variants_for(cell, variants, args)
            if r % 2:
                order = order[::-1]  # alternate which system goes first
            for v in order:
                spec = {"system": v.system, "workload": cell[0], "workers": cell[1],
                        "threads": 1, "n": n, "leaves": leaves,
                        "iterations": args.iterations,
                        "no_queue": v.no_queue, "security": args.security}
                t0 = time.perf_counter()
                result = run_child(spec, v.env, timeout)
                result["repeat"] = r
                raw.setdefault((cell, v.name), []).append(result)
                if not args.json:
                    status = result.get("error") or \
                        f"{result['tasks_per_s']:,.0f} tasks/s"
                    print(f"  [{r + 1}/{repeat}] {cell[0]:<4} {cell[1]}x1 {v.label:<32}"
                          f" {status}  ({time.perf_counter() - t0:.0f} s)",
                          file=sys.stderr, flush=True)

    rows = []
    for cell in cells:
        for v in variants_for(cell, variants, args):
            row = aggregate(raw.get((cell, v.name), []))
            row.update({"workload": cell[0], "workers": cell[1], "threads": 1,
                        "variant": v.name, "system": v.system, "label": v.label})
            rows.append(row)
    add_ratios(rows)
    targets = check_targets(rows)
    doc = {"header": header, "rows": rows, "targets": targets,
           "measured": MEASURED_NOTES,
           "runs": [{"workload": c[0], "workers": c[1], "variant": name, **res}
                    for (c, name), results in raw.items() for res in results],
           "elapsed_s": (datetime.datetime.now() - started).total_seconds()}
    if not args.no_save:
        doc["saved_to"] = save_results("e2e", doc, started, args.quick)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print_table(rows, n, leaves, args.iterations)
        print_targets(targets)
        print()
        for line in MEASURED_NOTES:
            print(line)
        if "saved_to" in doc:
            print(f"\nresults: {doc['saved_to']}  (total {doc['elapsed_s']:.0f} s)")
    return 0


MEASURED_NOTES = f"""\
what was measured (medians over the repeats; every run a fresh cluster after a warm-up round):
  wall        first submit -> last result in the client
  sched us    user+sys CPU (psutil) of the scheduler PROCESS per task, from the first submit
              until the scheduler has forgotten all tasks again; dcore: the `dcore scheduler`
              process (cluster._procs[0]); dask: a separate `python -m
              distributed.cli.dask_scheduler` process, not the client's process
  workers us  the same over the worker processes (nanny + workers, both systems' default)
  client us   the benchmark's client process (main + event-loop threads)
  speedup     the first distributed-core row's tasks/s / this row's (rt: this row's median
              latency / its)
  sched x     this row's scheduler CPU per task / the first distributed-core row's
  CPU times   psutil counts in 10 ms clock ticks: +-10 ms per process per run
  tasks       functions in benchmarks/{TASKS_MODULE}.py, an importable module on every
              process's PYTHONPATH, so both systems pickle them by reference (not by value
              as functions of __main__ would be)""".splitlines()


def add_ratios(rows: list) -> None:
    ref = {(r["workload"], r["workers"]): r for r in rows if r["variant"] == DCORE}
    for row in rows:
        base = ref.get((row["workload"], row["workers"]))
        row["speedup"] = row["sched_ratio"] = None
        if base is None or row.get("tasks_per_s") is None or \
                base.get("tasks_per_s") is None:
            continue
        if row["workload"] == "rt":
            row["speedup"] = row["rt_median_ms"] / base["rt_median_ms"]
        else:
            row["speedup"] = base["tasks_per_s"] / row["tasks_per_s"]
        if base.get("sched_cpu_us"):
            row["sched_ratio"] = row["sched_cpu_us"] / base["sched_cpu_us"]


def check_targets(rows: list) -> list:
    def find(workload, workers, variant):
        for r in rows:
            if (r["workload"], r["workers"], r["variant"]) == (workload, workers, variant):
                return r
        return None

    out = []
    m = find("map", 1, DCORE)
    if m and m.get("tasks_per_s"):
        out.append({"target": f"distributed-core map 1x1 >= {TARGET_MAP_TASKS_PER_S:,} "
                              "tasks/s", "measured": f"{m['tasks_per_s']:,.0f} tasks/s",
                    "met": m["tasks_per_s"] >= TARGET_MAP_TASKS_PER_S})
    rt = find("rt", 1, DCORE)
    if rt and rt.get("rt_median_ms") is not None:
        out.append({"target": f"distributed-core round trip <= {TARGET_RT_MS:g} ms",
                    "measured": f"median {rt['rt_median_ms']:.2f} ms, "
                                f"p90 {rt['rt_p90_ms']:.2f} ms",
                    "met": rt["rt_median_ms"] <= TARGET_RT_MS})
    sched = [r for r in rows if r["variant"] == DCORE and r["workload"] != "rt"
             and r.get("sched_cpu_us") is not None]
    if sched:
        worst = max(sched, key=lambda r: r["sched_cpu_us"])
        each = ", ".join(f"{r['workload']} {r['workers']}x1 {r['sched_cpu_us']:.1f}"
                         for r in sched)
        out.append({"target": f"distributed-core scheduler CPU <= {TARGET_SCHED_US:g} "
                              "us/task (map, tree)", "measured": f"{each} us",
                    "met": worst["sched_cpu_us"] <= TARGET_SCHED_US})
    d = find("map", 1, DASK)
    dq = find("map", 1, "dask-noqueue")
    if d and d.get("tasks_per_s"):
        text = f"{d['tasks_per_s']:,.0f} tasks/s"
        if dq and dq.get("tasks_per_s"):
            text += f" ({dq['tasks_per_s']:,.0f} queuing off)"
        out.append({"target": f"for scale: dask.distributed map 1x1 ~"
                              f"{DASK_SCALE['map_1x1']} tasks/s "
                              f"(~{DASK_SCALE['map_1x1_noqueue']} queuing off)",
                    "measured": text, "met": None})
    drt = find("rt", 1, DASK)
    if drt and drt.get("rt_median_ms") is not None:
        lo, hi = DASK_SCALE["rt_ms"]
        out.append({"target": f"for scale: dask.distributed round trip {lo}-{hi} ms",
                    "measured": f"median {drt['rt_median_ms']:.2f} ms, "
                                f"p90 {drt['rt_p90_ms']:.2f} ms", "met": None})
    dsched = [r["sched_cpu_us"] for r in rows if r["system"] == DASK
              and r["workload"] != "rt" and r.get("sched_cpu_us") is not None]
    if dsched:
        lo, hi = DASK_SCALE["sched_us"]
        out.append({"target": f"for scale: dask.distributed scheduler CPU {lo}-{hi} us/task",
                    "measured": f"{min(dsched):.0f}-{max(dsched):.0f} us/task (map, tree)",
                    "met": None})
    return out


# ====================================================================== printing


def print_header(h: dict) -> None:
    v = h["versions"]
    core = h["distributed_core"]
    print(f"distributed-core vs dask.distributed, end to end   {h['date']}")
    print(f"  machine   {h['cpu_count']} CPUs, {h['platform']}, Python {h['python']}, "
          f"load average {'/'.join(f'{x:.1f}' for x in h['loadavg_at_start'])} at start")
    if core:
        print(f"  dcore     distributed-core {core['version']}  COMPILED={core['compiled']}  "
              f"({core['file']}), security {h['security']}")
    print(f"  versions  dask {v['dask']}, distributed {v['distributed']}, tornado "
          f"{v['tornado']}, msgpack {v['msgpack']}, cloudpickle {v['cloudpickle']}, "
          f"psutil {v['psutil']}")
    print(f"  runs      map {h['tasks']:,} tasks, tree {h['leaves']:,} leaves = "
          f"{2 * h['leaves'] - 1:,} tasks, {h['iterations']} round trips; median of "
          f"{h['repeat']} repeat(s), systems alternating; timeout {h['timeout_s']:g} s/run")
    print("  clusters  all processes local; N workers x 1 thread; dcore: LocalCluster("
          "processes=True);")
    print("            dask: dask scheduler + N x dask worker --nthreads 1 (nanny), "
          "default config")
    print(f"  tasks     benchmarks/{TASKS_MODULE}.py, importable on every process "
          "(pickled by reference)")
    print(flush=True)


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_table(rows: list, n: int, leaves: int, iterations: int) -> None:
    names = {"map": f"map {n:,} no-op", "tree": f"tree {leaves:,} leaves",
             "rt": f"submit().result() x{iterations}"}
    cols = ["workload", "cluster", "system", "wall s", "tasks/s", "sched us",
            "workers us", "client us", "rt med/p90 ms", "speedup", "sched x"]
    table = []
    last = None
    for r in rows:
        cell = (r["workload"], r["workers"])
        first = cell != last
        last = cell
        line = [names[r["workload"]] if first else "", f"{r['workers']}x1" if first else "",
                r["label"]]
        if r.get("tasks_per_s") is None:
            line += [r.get("error", "no result")]
            table.append(line)
            continue
        rt = (f"{r['rt_median_ms']:.2f} / {r['rt_p90_ms']:.2f}"
              if r.get("rt_median_ms") is not None else "")
        line += [f"{r['wall_s']:.2f}", f"{r['tasks_per_s']:,.0f}",
                 _fmt(r.get("sched_cpu_us"), ".1f"), _fmt(r.get("workers_cpu_us"), ".0f"),
                 _fmt(r.get("client_cpu_us"), ".0f"), rt,
                 _fmt(r.get("speedup"), ".1f") + ("x" if r.get("speedup") else ""),
                 _fmt(r.get("sched_ratio"), ".1f") + ("x" if r.get("sched_ratio") else "")]
        if r.get("error"):
            line.append(f"({r['error']})")
        table.append(line)
    widths = [len(c) for c in cols]
    for line in table:
        if len(line) >= len(cols):
            for i, c in enumerate(line[:len(cols)]):
                widths[i] = max(widths[i], len(c))
    left = {0, 1, 2}

    def render(line):
        parts = []
        for i, c in enumerate(line):
            if i >= len(cols):
                parts.append(c)
            elif i == len(line) - 1 and len(line) < len(cols):
                parts.append(c)  # an error message spans the rest
            else:
                parts.append(c.ljust(widths[i]) if i in left else c.rjust(widths[i]))
        return "  ".join(parts).rstrip()

    print(render(cols))
    print("  ".join("-" * w for w in widths))
    for i, line in enumerate(table):
        if i and line[0]:
            print()
        print(render(line))


def print_targets(targets: list) -> None:
    if not targets:
        return
    print("\ntargets (reported, not asserted)")
    width = max(len(t["target"]) for t in targets)
    for t in targets:
        mark = {True: "met", False: "MISSED", None: ""}[t["met"]]
        print(f"  {t['target'].ljust(width)}  {t['measured']}  {mark}".rstrip())


if __name__ == "__main__":
    sys.exit(main())
