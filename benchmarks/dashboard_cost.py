"""What the dashboard costs the scheduler: a status page left open and a 1 s Prometheus
scrape, during a 1,000,000-task map.

Each run starts a LocalCluster (a scheduler process and 2 worker processes of 1 thread)
and maps a no-op over N tasks (``client.map`` + ``wait``); the figure is the scheduler
process's CPU time (user + system) from the submit to the last result. Two modes,
interleaved run by run so that a change in the machine's load hits both:

- ``off``: ``dcore scheduler --no-dashboard``;
- ``on``:  the dashboard, with what the status page does (``/api/v1/status`` with the
  task stream since its last poll, 100 entries sampled, every second, as its script
  polls) plus a scrape of ``/metrics`` every second, from a thread of this process, for
  the whole run. Each of the two keeps its HTTP connection open, as a browser and
  Prometheus do.

Printed: per-mode medians and the extra CPU of ``on`` in percent (target: under 1 %).
Then, with the N tasks held in memory, the scheduler's CPU per request (its process CPU
over 200 requests each, on one kept-alive connection) for one ``/metrics`` scrape, one
status JSON read, one page poll and one task-stream read, and one
``Client.scheduler_info()``; and what the ``on`` runs' requests cost at those figures,
in percent of the ``off`` median (an estimate that the runs' noise does not blur)::

    python benchmarks/dashboard_cost.py                  # 1,000,000 tasks, 3 rounds
    python benchmarks/dashboard_cost.py --tasks 200000 --rounds 2 --json
"""
from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import statistics
import sys
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The workers import the task function from this directory (by reference: cheap).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))

import psutil  # noqa: E402
from _e2e_tasks import noop  # noqa: E402

import distributed_core  # noqa: E402
from distributed_server import Client, LocalCluster, wait  # noqa: E402

POLL_SECONDS = 1.0


class Poller(threading.Thread):
    """What an open status page and a Prometheus server do: every second, the status
    JSON with the task stream after the last entry seen, and /metrics."""

    def __init__(self, base: str, token: str | None) -> None:
        super().__init__(daemon=True)
        url = urllib.parse.urlsplit(base)
        self.host, self.port = url.hostname, url.port
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.connections: dict = {}  # one kept-alive connection per client
        self.stop_event = threading.Event()
        self.requests = 0
        self.errors = 0

    def get(self, path: str, client: str = "page") -> bytes:
        """GET ``path`` on ``client``'s connection (opened at its first request, and
        again after an error)."""
        connection = self.connections.get(client)
        if connection is None:
            connection = self.connections[client] = http.client.HTTPConnection(
                self.host, self.port, timeout=30)
        try:
            connection.request("GET", path, headers=self.headers)
            response = connection.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException):
            connection.close()
            del self.connections[client]
            raise
        if response.status != 200:
            raise OSError(f"GET {path}: HTTP {response.status}")
        return body

    def run(self) -> None:
        after = 0
        while not self.stop_event.is_set():
            started = time.monotonic()
            try:
                status = json.loads(self.get(f"/api/v1/status?stream_after={after}"
                                             "&stream_limit=100"))
                after = status["stream"]["next"]
                self.get("/metrics", client="prometheus")
                self.requests += 2
            except (OSError, http.client.HTTPException):
                self.errors += 1
            self.stop_event.wait(max(POLL_SECONDS - (time.monotonic() - started), 0))


def scheduler_cpu(cluster: LocalCluster) -> float:
    """CPU seconds (user + system) the scheduler process has used so far."""
    times = psutil.Process(cluster._procs[0].pid).cpu_times()
    return times.user + times.system


def one_run(mode: str, n: int, measure_reads: bool = False) -> dict:
    """One map of ``n`` no-op tasks with the dashboard ``mode`` ('on' or 'off')."""
    address = "127.0.0.1:0" if mode == "on" else None
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=address,
                      memory_limit=0) as cluster, \
            Client(cluster, set_as_default=False, timeout=60) as client:
        poller = None
        if mode == "on":
            base = cluster.dashboard_url.rsplit("/status", 1)[0]
            poller = Poller(base, cluster.security.dashboard_token())
            poller.start()
        time.sleep(1.0)  # start-up settles (and the poller has made a round)
        cpu0, wall0 = scheduler_cpu(cluster), time.perf_counter()
        futures = client.map(noop, range(n), pure=False)
        wait(futures)
        wall, cpu = time.perf_counter() - wall0, scheduler_cpu(cluster) - cpu0
        result = {"mode": mode, "tasks": n, "wall_s": wall, "scheduler_cpu_s": cpu,
                  "tasks_per_s": n / wall}
        if poller is not None:
            poller.stop_event.set()
            poller.join()
            result.update(requests=poller.requests, request_errors=poller.errors)
            if measure_reads:
                result["reads"] = measure_read_costs(cluster, poller, client)
        del futures
    return result


def measure_read_costs(cluster: LocalCluster, poller: Poller, client: Client,
                       repeats: int = 200) -> dict:
    """Scheduler CPU and wall time per request while it holds the map's tasks."""
    out = {}
    reads = {"health": "/health", "metrics": "/metrics", "status_json": "/api/v1/status",
             "status_and_stream": "/api/v1/status?stream_after=0&stream_limit=100",
             "task_stream_2000": "/api/v1/task-stream?after=0&limit=2000"}
    for name, path in reads.items():
        poller.get(path)  # warm
        cpu0, wall0 = scheduler_cpu(cluster), time.perf_counter()
        size = 0
        for _ in range(repeats):
            size = len(poller.get(path))
        out[name] = {"scheduler_cpu_ms": 1000 * (scheduler_cpu(cluster) - cpu0) / repeats,
                     "wall_ms": 1000 * (time.perf_counter() - wall0) / repeats,
                     "bytes": size}
    client.scheduler_info()
    cpu0, wall0 = scheduler_cpu(cluster), time.perf_counter()
    for _ in range(repeats):
        client.scheduler_info()
    out["scheduler_info"] = {"scheduler_cpu_ms": 1000 * (scheduler_cpu(cluster) - cpu0) / repeats,
                             "wall_ms": 1000 * (time.perf_counter() - wall0) / repeats}
    return out


def task_stream_cost(n: int = 1_000_000, batch: int = 100) -> float:
    """Seconds per task of TaskStream.record, in batches as workers report."""
    from distributed_server.diagnostics.task_stream import TaskStream

    stream = TaskStream()
    reports = [{"op": "task-finished", "key": f"noop-{i}", "nbytes": 16, "start": 1.0 + i,
                "stop": 1.5 + i} for i in range(batch)]
    started = time.process_time()
    for _ in range(n // batch):
        stream.record("tcp://127.0.0.1:1", reports, True)
    return (time.process_time() - started) / n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode")
    parser.add_argument("--json", action="store_true", help="also save the results")
    args = parser.parse_args(argv)
    kind = "compiled" if distributed_core.COMPILED else "interpreted"
    print(f"dashboard cost: {args.tasks:,} no-op tasks, 2 workers x 1 thread, core {kind}, "
          f"{args.rounds} rounds (off/on interleaved), load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    for i in range(args.rounds):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        for mode in order:
            run = one_run(mode, args.tasks, measure_reads=(mode == "on" and i == 0))
            runs.append(run)
            print(f"  round {i + 1} {mode:>3}: {run['wall_s']:6.1f} s wall, "
                  f"{run['tasks_per_s']:8,.0f} tasks/s, scheduler CPU "
                  f"{run['scheduler_cpu_s']:6.2f} s"
                  + (f", {run['requests']} requests" if mode == "on" else ""), flush=True)
    median = {mode: statistics.median(r["scheduler_cpu_s"] for r in runs if r["mode"] == mode)
              for mode in ("off", "on")}
    rate = {mode: statistics.median(r["tasks_per_s"] for r in runs if r["mode"] == mode)
            for mode in ("off", "on")}
    extra = 100 * (median["on"] - median["off"]) / median["off"]
    print(f"scheduler CPU, median: off {median['off']:.2f} s, on {median['on']:.2f} s: "
          f"extra {extra:+.2f} % (target < 1 %); tasks/s off {rate['off']:,.0f}, "
          f"on {rate['on']:,.0f}")
    per_task = task_stream_cost()
    print(f"task stream (always on, in both modes): {1e6 * per_task:.3f} us of scheduler CPU "
          f"per task = {100 * per_task * args.tasks / median['off']:.2f} % of the off run's "
          "scheduler CPU")
    reads = next(r["reads"] for r in runs if "reads" in r)
    print(f"with {args.tasks:,} tasks held, scheduler CPU per request (wall on this client):")
    for name, figures in reads.items():
        size = f", {figures['bytes']:,} bytes" if "bytes" in figures else ""
        print(f"  {name:<18} {figures['scheduler_cpu_ms']:7.2f} ms "
              f"({figures['wall_ms']:.2f} ms wall{size})")
    # The same cost from the other side: the on runs' polls at the per-request figures
    # (each poll: a status read with 100 stream entries sampled, and a scrape).
    poll_ms = (reads["status_and_stream"]["scheduler_cpu_ms"]
               + reads["metrics"]["scheduler_cpu_ms"])
    polls = statistics.median(r["requests"] / 2 for r in runs if r["mode"] == "on")
    estimate = 100 * polls * poll_ms / 1000 / median["off"]
    print(f"the on runs' requests at these figures: {polls:.0f} polls x {poll_ms:.2f} ms = "
          f"{estimate:.2f} % of the off run's scheduler CPU")
    if args.json:
        # benchmarks/results/ is git-ignored; the run the docs cite is copied to
        # benchmarks/baselines/ by hand
        path = os.path.join(HERE, "results", "dashboard-cost-" + datetime.datetime.now()
                            .strftime("%Y-%m-%d-%H%M%S") + ".json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"tasks": args.tasks, "compiled": distributed_core.COMPILED,
                       "runs": runs, "median_cpu_s": median, "extra_percent": extra,
                       "polls_median": polls, "poll_ms": poll_ms,
                       "estimate_percent": estimate,
                       "load_average": os.getloadavg()}, f,
                      indent=1)
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
