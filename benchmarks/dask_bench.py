"""dask collections on distributed-core: ingestion (client + scheduler) and execution.

Two graphs, each computed on a cluster of 2 worker processes x 1 thread on this machine::

    array    ``da.ones(CHUNKS * 100, chunks=100).sum()``: a tree sum over CHUNKS chunks
             (``--chunks``, default 20,000: about 26,700 tasks)
    shuffle  ``dask.datasets.timeseries`` over DAYS one-day partitions at one row a
             minute, shuffled on ``id`` with the task-based shuffle, then
             ``map_partitions(len).sum()`` (``--days``, default 365)

For distributed-core, in a fresh subprocess per graph (``LocalCluster(n_workers=2,
threads_per_worker=1)``, the ``Client`` in the benchmark process):

    client side, measured piece by piece on the same expression dask hands a scheduler:
      materialize  ``__dask_graph__()`` (dask's low-level optimization included) and
                   ``convert_legacy_graph``
      order        ``dask.order.order`` and the sending order (`GraphPlan`)
      encode       pickling every task and building the task dicts
    decode,        the scheduler's side, replayed in a process of its own: each slice's
    intake         update-graph message decoded as the comm layer does (msgpack), then
                   the core's ``update_graph`` on a fresh ``SchedulerState`` with two
                   workers (which core: see the header); intake µs per task is the
                   target figure (<= 10 µs)
    end to end, on the cluster, a fresh copy of the graph:
      ingest       from ``client.compute(...)`` until the scheduler has taken in the last
                   slice (an empty ``who_has`` sent after it is answered); slices are
                   pickled while the scheduler takes in the previous one
      execute      from there until the result is in the client

With ``--dask`` the same graphs run on dask.distributed (if installed): a
``dask_scheduler`` process and two ``dask_worker --nthreads 1`` processes. Its
scheduler's own update-graph event gives materialization, ordering and state creation;
ingest ends at that event, execute runs from there to the result.

    PYTHONPATH=/tmp/dask4-core python benchmarks/dask_bench.py --dask   # a scratch build
    python benchmarks/dask_bench.py --chunks 2000 --days 30          # quick
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULT_MARK = "DASK-BENCH-RESULT "
TARGET_INTAKE_US = 10.0
#: dask.distributed's per-task figures from /work/shared/notes (a 93,362-task array graph)
DASK_NOTE_US = {"state creation": 26, "with materialization and ordering": 89}


# ---------------------------------------------------------------------------- graphs


def make_graph(workload: str, args: dict):
    """(collection, expected result) for a workload."""
    import dask
    import dask.array as da

    if workload == "array":
        chunks = args["chunks"]
        return da.ones(chunks * 100, chunks=100).sum(), chunks * 100
    if workload == "shuffle":
        import pandas as pd

        days = args["days"]
        start = pd.Timestamp("2000-01-01")
        ts = dask.datasets.timeseries(start=start, end=start + pd.Timedelta(days=days),
                                      freq="1min", partition_freq="1D", seed=0)
        return (ts.shuffle(on="id", shuffle_method="tasks").map_partitions(len).sum(),
                days * 24 * 60)
    raise ValueError(workload)


# ---------------------------------------------------------------------------- children


def child_dcore(workload: str, args: dict) -> dict:
    import dask
    import msgpack

    from distributed_server.client.client import Client
    from distributed_server.client import dask_graphs as dask_support
    from distributed_server.deploy.local_cluster import LocalCluster

    out: dict = {"system": "distributed-core", "workload": workload}
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        # ---- client side, piece by piece
        collection, expected = make_graph(workload, args)
        seen: dict = {}

        def capture(expr, keys, **kwargs):
            seen.update(expr=expr, keys=keys, at=time.perf_counter())
            return [None] * len(keys)

        start = time.perf_counter()
        dask.compute(collection, scheduler=capture)
        out["dask_expr_s"] = seen["at"] - start
        with dask_support.gc_paused():  # as in the Client
            start = time.perf_counter()
            graph = dask_support.materialize(seen["expr"])
            out["materialize_s"] = time.perf_counter() - start
            start = time.perf_counter()
            plan = dask_support.GraphPlan(graph, seen["keys"], set(), {})
            out["order_s"] = time.perf_counter() - start
            parts = []
            start = time.perf_counter()
            while not plan.done:
                parts.append(plan.encode_next())
            out["encode_s"] = time.perf_counter() - start
        out["tasks"] = len(plan.sequence)
        out["slices"] = len(parts)
        out["by_value"] = plan.pickler.by_value
        out["spec_bytes"] = sum(len(t["spec"]) for p in parts for t in p.tasks) + sum(
            len(p.part["blob"]) for p in parts if p.part is not None)  # spec parts
        # ---- scheduler intake, replayed on the core in a process of its own (as the
        # scheduler: this process's heap, the whole dask graph, would make every
        # garbage collection during the replay far slower than the scheduler's)
        with tempfile.NamedTemporaryFile(suffix=".msgpack") as f:
            for part in parts:
                frame = msgpack.packb({**part.message(), "release": part.release})
                f.write(len(frame).to_bytes(8, "little") + frame)
            f.flush()
            del parts, plan, graph
            seen.clear()
            replay = subprocess.run([sys.executable, os.path.abspath(__file__),
                                     "--replay", f.name], capture_output=True, text=True,
                                    check=True)
        out.update(json.loads(replay.stdout.splitlines()[-1]))
        # ---- end to end
        with LocalCluster(n_workers=2, threads_per_worker=1) as cluster, \
                Client(cluster) as client:
            out["cluster_compiled"] = client.scheduler_info()["compiled"]
            warm, _ = make_graph(workload, {**args, "chunks": 10, "days": 2})
            client.compute(warm).result()
            collection, expected = make_graph(workload, args)
            start = time.perf_counter()
            future = client.compute(collection)
            sent = time.perf_counter()
            client.who_has([])
            ingested = time.perf_counter()
            result = future.result()
            done = time.perf_counter()
        assert result == expected, (result, expected)
        out["compute_returned_s"] = sent - start
        out["ingest_s"] = ingested - start
        out["execute_s"] = done - ingested
    return out


def replay_intake(path: str) -> dict:
    """Decode each update-graph message of ``path`` as the scheduler's comm does and
    hand it to a fresh SchedulerState with two workers; time both steps."""
    import msgpack

    import distributed_core
    from distributed_core import SchedulerState

    state = SchedulerState(validate=False, clock=time.time)
    for i in range(2):
        state.add_worker(f"tcp://127.0.0.1:{10_000 + i}", 1, f"w{i}")
    state.add_client("bench", "c")
    decode = intake = 0.0
    with open(path, "rb") as f:
        frames = []
        while header := f.read(8):
            frames.append(f.read(int.from_bytes(header, "little")))
    for i, frame in enumerate(frames):
        start = time.perf_counter()
        msg = msgpack.unpackb(frame, use_list=False, strict_map_key=False)
        decoded = time.perf_counter()
        state.update_graph("bench", msg["tasks"], msg["keys"], f"slice-{i}",
                           part=msg.get("part"))
        done = time.perf_counter()
        if msg["release"]:
            state.client_releases_keys("bench", msg["release"], f"release-{i}")
        decode += decoded - start
        intake += done - decoded
    return {"decode_s": decode, "intake_s": intake, "core_compiled": distributed_core.COMPILED,
            "replayed_tasks": len(state.tasks)}


def child_dask(workload: str, args: dict) -> dict:
    import dask
    import distributed

    out: dict = {"system": "dask.distributed", "workload": workload,
                 "version": distributed.__version__}
    with tempfile.TemporaryDirectory() as logdir, dask.config.set(
            {"dataframe.shuffle.method": "tasks"}):
        procs = []
        try:
            log = os.path.join(logdir, "scheduler.log")
            procs.append(_spawn([sys.executable, "-m", "distributed.cli.dask_scheduler",
                                 "--host", "127.0.0.1", "--port", "0", "--no-dashboard"],
                                log))
            address = _wait_for(log, r"Scheduler at:\s+(\S+)", 60)
            for i in range(2):
                procs.append(_spawn([sys.executable, "-m", "distributed.cli.dask_worker",
                                     address, "--nthreads", "1", "--no-dashboard",
                                     "--name", f"w{i}"], os.path.join(logdir, f"w{i}.log")))
            with distributed.Client(address) as client:
                client.wait_for_workers(2, timeout=60)
                warm, _ = make_graph(workload, {**args, "chunks": 10, "days": 2})
                client.compute(warm).result()
                collection, expected = make_graph(workload, args)
                since = time.time()
                start = time.perf_counter()
                future = client.compute(collection)
                sent = time.perf_counter()
                event = _update_graph_event(client, since)
                result = future.result()
                done = time.perf_counter()
        finally:
            for proc in procs:
                _kill(proc)
    assert result == expected, (result, expected)
    metrics = event[1]["metrics"]
    out["tasks"] = metrics["tasks"]
    out["materialize_s"] = abs(metrics["materialization_duration_seconds"])
    out["order_s"] = abs(metrics["ordering_duration_seconds"])
    out["state_s"] = abs(metrics["state_initialization_duration_seconds"])
    out["scheduler_update_graph_s"] = metrics["duration_seconds"]
    ingested = start + (event[0] - since)  # the event's time, on this process's clock
    out["compute_returned_s"] = sent - start
    out["ingest_s"] = ingested - start
    out["execute_s"] = done - ingested
    return out


def _update_graph_event(client, since: float, timeout: float = 600) -> tuple:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for when, msg in client.get_events("scheduler"):
            if when >= since and isinstance(msg, dict) and \
                    msg.get("action") == "update-graph" and msg.get("status") == "OK":
                return when, msg
        time.sleep(0.05)
    raise TimeoutError("no update-graph event from the dask scheduler")


def _spawn(cmd: list, log: str) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_for(path: str, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            match = re.search(pattern, f.read())
        if match:
            return match.group(1)
        time.sleep(0.1)
    raise TimeoutError(f"{pattern!r} not in {path}")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------- parent


def child_env() -> dict:
    """The environment of a child: this process's distributed_core and
    distributed_server first on PYTHONPATH (the cluster's processes inherit it)."""
    import distributed_core
    import distributed_server

    paths = [os.path.dirname(os.path.dirname(module.__file__))
             for module in (distributed_core, distributed_server)]
    existing = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + existing.split(os.pathsep)))
    return env


def run_child(system: str, workload: str, args: dict, timeout: float) -> dict:
    spec = json.dumps({"system": system, "workload": workload, "args": args})
    # not run from the checkout: ``python -m`` (the cluster's processes) puts the working
    # directory first on sys.path, where the interpreted core would shadow a build
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec],
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env=child_env(), cwd=tempfile.gettempdir())
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    return {"system": system, "workload": workload,
            "error": (proc.stderr or proc.stdout)[-2000:]}


def _us(seconds: float, n: int) -> str:
    return f"{1e6 * seconds / n:7.1f}"


def report(results: list) -> None:
    for r in results:
        print()
        if "error" in r:
            print(f"{r['system']} / {r['workload']}: FAILED\n{r['error']}")
            continue
        n = r["tasks"]
        print(f"{r['system']} / {r['workload']}: {n:,} tasks")
        print(f"  {'phase':<34}{'seconds':>9}{'µs/task':>9}")
        rows = []
        if r["system"] == "distributed-core":
            rows += [
                ("client: materialize", r["materialize_s"]),
                ("client: order (dask.order)", r["order_s"]),
                ("client: encode (pickle, dicts)", r["encode_s"]),
                ("scheduler: decode messages", r["decode_s"]),
                (f"scheduler: intake (core {'compiled' if r['core_compiled'] else 'interp.'})",
                 r["intake_s"]),
            ]
        else:
            rows += [
                ("scheduler: materialize", r["materialize_s"]),
                ("scheduler: order (dask.order)", r["order_s"]),
                ("scheduler: state creation", r["state_s"]),
                ("scheduler: update-graph total", r["scheduler_update_graph_s"]),
            ]
        rows += [
            ("end to end: compute() returned", r["compute_returned_s"]),
            ("end to end: ingest", r["ingest_s"]),
            ("end to end: execute", r["execute_s"]),
            ("end to end: total", r["ingest_s"] + r["execute_s"]),
        ]
        for name, seconds in rows:
            print(f"  {name:<34}{seconds:9.2f}{_us(seconds, n):>9}")
        if r["system"] == "distributed-core":
            intake_us = 1e6 * r["intake_s"] / n
            print(f"  slices: {r['slices']}, specs {r['spec_bytes'] / n:.0f} B/task, "
                  f"{r['by_value']} pickled by value; cluster core "
                  f"{'compiled' if r['cluster_compiled'] else 'interpreted'}; intake "
                  f"{intake_us:.1f} µs/task (target <= {TARGET_INTAKE_US:.0f}: "
                  f"{'met' if intake_us <= TARGET_INTAKE_US else 'NOT met'})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=20_000)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--only", choices=("array", "shuffle"), default=None)
    parser.add_argument("--dask", action="store_true",
                        help="also run the graphs on dask.distributed")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--replay", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if REPO not in sys.path:
        sys.path.append(REPO)  # last: an installed (or PYTHONPATH) package comes first
    if args.replay:
        print(json.dumps(replay_intake(args.replay)))
        return 0
    if args.child:
        spec = json.loads(args.child)
        run = child_dcore if spec["system"] == "dcore" else child_dask
        print(RESULT_MARK + json.dumps(run(spec["workload"], spec["args"])), flush=True)
        return 0
    sizes = {"chunks": args.chunks, "days": args.days}
    systems = ["dcore"]
    if args.dask:
        try:
            import distributed  # noqa: F401
        except ImportError:
            print("--dask: dask.distributed is not installed; skipping it")
        else:
            systems.append("dask")
    workloads = [args.only] if args.only else ["array", "shuffle"]
    import distributed_core

    print(f"dask_bench: {platform.python_version()} on {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; distributed_core "
          f"{'compiled' if distributed_core.COMPILED else 'interpreted'} "
          f"({distributed_core.CORE_FILE})")
    results = []
    for workload in workloads:
        for system in systems:
            results.append(run_child(system, workload, sizes, args.timeout))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        report(results)
        print(f"\n(dask.distributed's notes, for scale: {DASK_NOTE_US['state creation']} "
              f"µs/task state creation, {DASK_NOTE_US['with materialization and ordering']}"
              f" µs/task with materialization and ordering)")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
