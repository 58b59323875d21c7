"""How the scheduler's cost grows with the number of workers (issue 25, target 3).

A real ``dcore scheduler`` process (token handshake, its dashboard on) is joined by N
lightweight worker endpoints: each is a real connection that registers as a worker does
(the same handshake, versions and process facts), heartbeats as a worker does by default
(every second, or slower when the scheduler of a big cluster asks), and answers every
``compute-task`` at once with the ``task-finished`` report a worker sends for a no-op
task (``None``, inline), and every ``steal-request`` as a worker whose task is done
(not given). Many endpoints share a process
(a few processes in all), so a thousand fit on this machine; what the scheduler sees is
what a thousand workers send it. Printed per N:

- the scheduler's idle CPU, in % of one core, over 10 s with nobody computing
  (heartbeats only; target: at most 5 % at 1,000);
- the throughput of ``client.map`` of no-op tasks (tasks/s; target at 1,000: within
  25 % of at 10);
- the median time to fetch the dashboard page (``/status``) and ``/metrics``
  (target: under 5 ms each at 1,000).

dask.distributed runs beside it with real workers (a LocalCluster of 1-thread worker
processes) at the N that fit here (``--dask-n``, default 10): the same figures.

    python benchmarks/many_workers.py                  # N = 10, 100, 1000; dask at 10
    python benchmarks/many_workers.py --n 10 100 --tasks 5000 --dask-n 10 20
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [HERE, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])

from _e2e_tasks import noop  # noqa: E402

#: Endpoints per process (each process is one event loop).
PER_PROCESS = 250
#: Endpoints of one process in their handshake at once: all come from one host here, and
#: a listener admits 32 handshakes per host at once (a real cluster's workers come from
#: many hosts); 4 processes x 6 stay under it.
JOINING_PER_PROCESS = 6
#: Seconds the idle CPU is measured over.
IDLE_SECONDS = 10.0
HEARTBEAT_SECONDS = 1.0  # a worker's default (Worker(heartbeat_interval=1.0))


# ---------------------------------------------------------------------- the endpoints


async def endpoint(scheduler: str, name: str, security, listener_host: str,
                   joined: asyncio.Future) -> None:
    """One lightweight worker: register, heartbeat, answer compute-task at once."""
    from distributed_server.comm import connect, listen
    from distributed_server.protocol.serialize import dumps_inline_result
    from distributed_server.versions import essential

    async def refuse_peer(comm):  # no peer ever needs data from a no-op worker
        await comm.close()

    listener = await listen(f"tcp://{listener_host}:0", refuse_peer, {"role": "worker"},
                            security)
    address = f"tcp://{listener_host}:{listener.port}"
    listener.set_handshake_info(address=address)
    comm = await connect(scheduler, {
        "role": "worker", "address": address, "nthreads": 1, "name": name,
        "resources": None, "versions": essential(), "pid": os.getpid(),
        "memory_limit": 0, "dashboard": None}, timeout=60, security=security)
    joined.set_result(None)
    none = dumps_inline_result(None)

    advised = [None]  # a big cluster's scheduler asks for slower beats, as of a worker

    async def heartbeat():
        while True:
            await asyncio.sleep(max(HEARTBEAT_SECONDS, advised[0] or 0.0))
            comm.send({"op": "heartbeat", "memory": 50_000_000, "managed": None,
                       "spilled": 0, "spilled_count": 0, "paused": False, "cpu": 0.0})

    beating = asyncio.get_running_loop().create_task(heartbeat())
    try:
        while True:
            for msg in await comm.read():
                if msg.get("op") == "compute-task":
                    now = time.time()
                    comm.send({"op": "task-finished", "key": msg["key"], "nbytes": 16,
                               "type": "NoneType", "start": now, "stop": now,
                               "data": none})
                elif msg.get("op") == "steal-request":  # finished already: not given
                    comm.send({"op": "steal-response", "key": msg["key"],
                               "request": msg["request"], "given": False, "state": None,
                               "stimulus_id": f"steal-{msg['request']}"})
                elif msg.get("op") == "heartbeat":
                    advised[0] = msg.get("interval")
                elif msg.get("op") == "close":
                    return
    except Exception:  # noqa: BLE001 - the scheduler went away: the run is over
        return
    finally:
        beating.cancel()


def serve_endpoints(scheduler: str, first: int, count: int) -> None:
    """A child process's main: ``count`` endpoints named ``ep-<first + i>``."""
    from distributed_server.security import Security

    security = Security.from_environment()

    async def main():
        joining = asyncio.Semaphore(JOINING_PER_PROCESS)

        async def one(i):
            async with joining:  # released once registered: see endpoint's `joined`
                joined = asyncio.get_running_loop().create_future()
                task = asyncio.ensure_future(
                    endpoint(scheduler, f"ep-{first + i}", security, "127.0.0.1", joined))
                await asyncio.wait([joined, task], return_when=asyncio.FIRST_COMPLETED)
            await task

        await asyncio.gather(*(one(i) for i in range(count)))

    asyncio.run(main())


# ---------------------------------------------------------------------- measuring


def idle_cpu(pid: int, seconds: float = IDLE_SECONDS) -> float:
    """% of one core the process used over ``seconds``."""
    import psutil

    proc = psutil.Process(pid)
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    return 100.0 * used / seconds


def http_median_ms(url: str, headers: dict, n: int = 21) -> float:
    """Median milliseconds of ``n`` GETs of ``url`` (after one warm-up)."""
    times = []
    for i in range(n + 1):
        request = urllib.request.Request(url, headers=headers)
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
        if i:
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def map_rate(client, n_tasks: int) -> float:
    """Tasks per second of ``client.map(noop, range(n_tasks))`` until all are done."""
    start = time.perf_counter()
    futures = client.map(noop, range(n_tasks), pure=False)
    client.gather(futures)
    rate = n_tasks / (time.perf_counter() - start)
    del futures
    return rate


def run_dcore(n: int, n_tasks: int) -> dict:
    """The figures of a dcore scheduler with ``n`` endpoints."""
    from distributed_server import Client, LocalCluster

    cluster = LocalCluster(n_workers=0, dashboard_address="127.0.0.1:0")
    children = []
    try:
        env = dict(os.environ)
        env.update(cluster.security.environment())
        for first in range(0, n, PER_PROCESS):
            count = min(PER_PROCESS, n - first)
            code = (f"import sys; sys.path.insert(0, {HERE!r}); import many_workers; "
                    f"many_workers.serve_endpoints({cluster.scheduler_address!r}, "
                    f"{first}, {count})")
            children.append(subprocess.Popen([sys.executable, "-c", code], env=env))
        cluster.wait_for_workers(n, timeout=300)
        time.sleep(3)  # registrations settle
        scheduler_pid = cluster._procs[0].pid
        cpu = idle_cpu(scheduler_pid)
        headers = {"Authorization": f"Bearer {cluster.security.dashboard_token()}"}
        base = "/".join(cluster.dashboard_url.split("/")[:3])  # http://host:port
        status_ms = http_median_ms(base + "/status", headers)
        api_ms = http_median_ms(base + "/api/v1/status", headers)
        metrics_ms = http_median_ms(base + "/metrics", headers)
        with Client(cluster) as client:
            map_rate(client, min(n_tasks, 1000))  # warm-up
            rate = map_rate(client, n_tasks)
    finally:
        for child in children:
            child.terminate()
        cluster.close()
        for child in children:
            child.wait()
    return {"idle_cpu_pct": cpu, "map_tasks_per_s": rate, "status_ms": status_ms,
            "api_status_ms": api_ms, "metrics_ms": metrics_ms}


def run_dask(n: int, n_tasks: int) -> dict:
    """The same figures for dask.distributed with ``n`` real worker processes."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                           dashboard_address="127.0.0.1:0")
    try:
        with Client(cluster) as client:
            client.wait_for_workers(n)
            time.sleep(3)
            pid = client.run_on_scheduler(os.getpid)
            cpu = idle_cpu(pid)
            base = "/".join(cluster.dashboard_link.split("/")[:3])
            status_ms = http_median_ms(base + "/status", {})
            metrics_ms = http_median_ms(base + "/metrics", {})
            map_rate(client, min(n_tasks, 1000))
            rate = map_rate(client, n_tasks)
    finally:
        cluster.close()
    return {"idle_cpu_pct": cpu, "map_tasks_per_s": rate, "status_ms": status_ms,
            "api_status_ms": None, "metrics_ms": metrics_ms}


def main(argv=None) -> None:
    """Run every N for each system and print the figures beside the targets."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--dask-n", type=int, nargs="*", default=[10])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)
    import distributed_core

    print(f"no-op map of {args.tasks} tasks; heartbeats every {HEARTBEAT_SECONDS:g} s; "
          f"distributed-core compiled: {distributed_core.COMPILED}", flush=True)
    results = {}
    for n in args.n:
        results[("dcore", n)] = run_dcore(n, args.tasks)
        print(f"  dcore N={n}: {results[('dcore', n)]}", flush=True)
    for n in args.dask_n:
        results[("dask", n)] = run_dask(n, args.tasks)
        print(f"  dask N={n}: {results[('dask', n)]}", flush=True)
    print()
    print(f"{'system':8s}{'N':>6s}{'idle CPU %':>12s}{'map tasks/s':>13s}"
          f"{'/status ms':>12s}{'/api/v1/status ms':>19s}{'/metrics ms':>13s}")
    for (system, n), r in results.items():
        api = "-" if r["api_status_ms"] is None else f"{r['api_status_ms']:.2f}"
        print(f"{system:8s}{n:6d}{r['idle_cpu_pct']:12.2f}{r['map_tasks_per_s']:13.0f}"
              f"{r['status_ms']:12.2f}{api:>19s}{r['metrics_ms']:13.2f}")
    small, big = min(args.n), max(args.n)
    if ("dcore", small) in results and ("dcore", big) in results and small != big:
        at_big, at_small = results[("dcore", big)], results[("dcore", small)]
        ratio = at_big["map_tasks_per_s"] / at_small["map_tasks_per_s"]
        slowest = max(at_big["status_ms"], at_big["metrics_ms"])
        print(f"\ntargets at N={big}: idle CPU {at_big['idle_cpu_pct']:.2f} % (<= 5 %: "
              f"{'met' if at_big['idle_cpu_pct'] <= 5 else 'MISSED'}); map throughput "
              f"{ratio:.2f}x of N={small} (>= 0.75: {'met' if ratio >= 0.75 else 'MISSED'}); "
              f"/status {at_big['status_ms']:.2f} ms, /metrics {at_big['metrics_ms']:.2f} ms "
              f"(< 5 ms: {'met' if slowest < 5 else 'MISSED'})")
    if args.json:
        print(json.dumps({f"{s}-{n}": r for (s, n), r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
