"""Chaos soak: a dask.dataframe task shuffle, round after round, while workers are
SIGKILLed and SIGSTOPped.

A real cluster, started the way a user starts one: ``dcore scheduler --validate
--worker-ttl T`` and ``dcore worker --nworkers N`` (a nanny and N worker processes, one
thread each, the default memory limit, ``DCORE_TRANSFER_TIMEOUT`` shortened). Every
round computes the same task shuffle of a ``dask.datasets.timeseries`` frame
(``client.compute``) and compares it, frame for frame, with the answer dask's own
synchronous scheduler gave in this process. While the round's graph runs, a chaos
thread picks random moments and random worker processes and either

- SIGKILLs one (its nanny must start it again), or
- SIGSTOPs one for longer than the transfer timeout but shorter than the worker TTL
  (peers fetching from it must give up and fetch or recompute elsewhere; the stopped
  worker then resumes its own work), or
- SIGSTOPs one for longer than the worker TTL (the scheduler removes it; after SIGCONT
  it finds its scheduler connection gone, drops everything and registers again).

At most ``--events`` (default 2) signals per round, so at most 2 workers are lost and
no task can be on 3 workers that died (that would be a correct ``KilledWorker``, not a
finding). A round fails on a wrong result, an exception instead of a result (a lost or
cancelled future, ``KilledWorker``), no result within ``--round-timeout`` seconds (a
hang), tasks the scheduler still holds after the round's future was released, or a
cluster that does not get all N workers back. At the end every worker must hold no
result and no task, and no process may have logged an ERROR line. Every choice (kinds,
moments, victims) comes from ``--seed``; which of them land while the graph still runs
depends on timing.

    python benchmarks/chaos_soak.py --rounds 30
    python benchmarks/chaos_soak.py --rounds 3 --seed 7 --keep-logs /tmp/soak

Exit status 0 only if every round was right and nothing leaked.
tests/server/test_chaos.py runs a short version of the same code (`run_soak`).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import cloudpickle
import psutil

from distributed_server import Client, Security
from distributed_server.security import ENVIRONMENT_VARIABLES, new_token

DCORE = [sys.executable, "-m", "distributed_server.cli"]
PROBE_PREFIX = "chaos-probe-"


@dataclasses.dataclass
class SoakConfig:
    """Everything a soak run depends on. Times in seconds."""

    rounds: int = 30
    seed: int = 0
    nworkers: int = 3
    #: The frame: ``timeseries(start, end, freq, partition_freq)`` shuffled on ``id``
    #: into ``npartitions`` (defaults: 16 days of 10 s rows, 16 partitions, ~330 tasks).
    start: str = "2000-01-01"
    end: str = "2000-01-17"
    freq: str = "10s"
    partition_freq: str = "1D"
    npartitions: int = 16
    transfer_timeout: float = 2.0
    worker_ttl: float = 6.0
    #: Most workers lost (killed, or stopped past the TTL) per round; also the most events.
    events: int = 2
    #: Chances of the three kinds of event (the rest: a stop shorter than the TTL).
    p_kill: float = 0.4
    p_long_stop: float = 0.3
    #: Each round's kinds of event in turn (cycled), instead of drawing them.
    kinds: tuple | None = None
    #: A short stop lasts transfer_timeout * this; a long one worker_ttl * this.
    stop_factor: tuple = (1.5, 1.5)
    round_timeout: float = 120.0
    #: Each worker's, as ``dcore worker --memory-limit`` takes it (auto: the machine's
    #: memory among the workers; results live in the spill buffer).
    memory_limit: str = "auto"
    heal_timeout: float = 60.0
    #: Seconds the scheduler may take to forget a round's tasks once it is released.
    drain_timeout: float = 30.0
    validate: bool = True
    log_level: str = "INFO"


@dataclasses.dataclass
class Event:
    round: int
    at: float  # seconds after the round's graph was submitted
    kind: str  # "kill", "stop" (< TTL) or "long-stop" (> TTL)
    pid: int
    duration: float = 0.0


@dataclasses.dataclass
class RoundResult:
    index: int
    ok: bool
    seconds: float  # submit to result
    heal_seconds: float  # waiting for all workers before the round
    events: list
    scheduler_rss: int
    error: str = ""


@dataclasses.dataclass
class SoakReport:
    config: SoakConfig
    compiled: bool = False
    baseline_seconds: float = 0.0
    rounds: list = dataclasses.field(default_factory=list)
    failures: list = dataclasses.field(default_factory=list)
    leaked_tasks: int = 0
    held_by_workers: dict = dataclasses.field(default_factory=dict)
    scheduler_errors: list = dataclasses.field(default_factory=list)
    worker_errors: list = dataclasses.field(default_factory=list)
    restarts: int = 0
    ttl_removals: int = 0
    failed_fetches: int = 0
    wall: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def count(self, kind: str) -> int:
        return sum(e.kind == kind for r in self.rounds for e in r.events)

    def summary(self) -> str:
        c = self.config
        times = [r.seconds for r in self.rounds]
        good = sum(r.ok for r in self.rounds)
        rss = [r.scheduler_rss for r in self.rounds]
        lines = [
            f"chaos soak: {len(self.rounds)} of {c.rounds} rounds, {good} right; seed "
            f"{c.seed}; {c.nworkers} workers under a nanny; core "
            f"{'compiled' if self.compiled else 'interpreted'}; scheduler validate="
            f"{c.validate}",
            f"graph: timeseries({c.start!r}, {c.end!r}, freq={c.freq!r}, partition_freq="
            f"{c.partition_freq!r}).shuffle(on='id', npartitions={c.npartitions}), task "
            f"shuffle; transfer timeout {c.transfer_timeout} s, worker TTL {c.worker_ttl} s",
            f"events: {self.count('kill')} SIGKILL, {self.count('stop')} SIGSTOP < TTL, "
            f"{self.count('long-stop')} SIGSTOP > TTL; nanny restarts {self.restarts}, "
            f"workers removed by the TTL {self.ttl_removals}, failed peer fetches "
            f"{self.failed_fetches}",
        ]
        if times:
            lines.append(
                f"seconds per round: baseline (no chaos) {self.baseline_seconds:.2f}, "
                f"median {statistics.median(times):.2f}, min {min(times):.2f}, max "
                f"{max(times):.2f}; waiting for workers to come back: median "
                f"{statistics.median(r.heal_seconds for r in self.rounds):.2f}, max "
                f"{max(r.heal_seconds for r in self.rounds):.2f}")
            lines.append(f"scheduler RSS: first round {rss[0] / 2**20:.1f} MiB, last "
                         f"{rss[-1] / 2**20:.1f} MiB, max {max(rss) / 2**20:.1f} MiB")
        lines.append(f"after the soak: scheduler tasks {self.leaked_tasks}, results or tasks "
                     f"held by workers {sum(self.held_by_workers.values())}, scheduler ERROR "
                     f"lines {len(self.scheduler_errors)}, worker/nanny ERROR lines "
                     f"{len(self.worker_errors)}; wall {self.wall:.1f} s")
        lines.append("per round (s): " + " ".join(
            f"{r.seconds:.1f}{'' if r.ok else '!'}" for r in self.rounds))
        if self.failures:
            lines.append(f"FAILED ({len(self.failures)}):")
            lines += [f"  {f}" for f in self.failures[:20]]
        else:
            lines.append("OK: every round right, nothing leaked, no ERROR logged")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- the cluster


class ChaosCluster:
    """A validating ``dcore scheduler`` and one ``dcore worker --nworkers N`` nanny, their
    logs in ``directory``."""

    def __init__(self, config: SoakConfig, directory: Path):
        self.config = config
        self.directory = Path(directory)
        self.security = Security(token=new_token())
        env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARIABLES}
        env.update(self.security.environment())
        env["DCORE_TRANSFER_TIMEOUT"] = str(config.transfer_timeout)
        self.env = env
        self.procs: list = []
        args = ["scheduler", "--port", "0", "--worker-ttl", str(config.worker_ttl),
                "--log-level", config.log_level]
        if config.validate:
            args.append("--validate")
        self.scheduler = self._spawn(args, "scheduler.log", stdout=subprocess.PIPE)
        line = self.scheduler.stdout.readline()
        if not line.startswith("Scheduler at "):
            self.close()
            raise RuntimeError(f"the scheduler did not start: {line!r}\n"
                               f"{self.log('scheduler.log')}")
        self.address = line.split()[2]
        self.nanny = self._spawn(
            ["worker", self.address, "--nworkers", str(config.nworkers), "--nthreads", "1",
             "--name", "chaos", "--memory-limit", str(config.memory_limit),
             "--log-level", config.log_level],
            "workers.log")

    def _spawn(self, args: list, log: str, stdout=None) -> subprocess.Popen:
        with open(self.directory / log, "ab") as out:
            proc = subprocess.Popen(DCORE + args, stdin=subprocess.DEVNULL, stderr=out,
                                    stdout=stdout or out, text=True, env=self.env)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.directory / name
        return path.read_text(errors="replace") if path.exists() else ""

    def error_lines(self, name: str) -> list:
        return [line for line in self.log(name).splitlines() if " ERROR " in line]

    def worker_processes(self) -> list:
        try:
            return psutil.Process(self.nanny.pid).children()
        except psutil.Error:
            return []

    def scheduler_rss(self) -> int:
        try:
            return psutil.Process(self.scheduler.pid).memory_info().rss
        except psutil.Error:
            return 0

    def close(self) -> None:
        for proc in self.worker_processes():  # none may stay stopped
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        for proc in reversed(self.procs):  # the nanny first
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


# ---------------------------------------------------------------------------- chaos


def chaos_plan(config: SoakConfig, rng: random.Random, round_index: int,
               within: float) -> list:
    """A round's events: ``(seconds to wait first, kind, duration, victim pick in [0,
    1))``, the first wait within ``within`` seconds, each later one as long after the end
    of the previous event. Kinds are ``config.kinds[round_index - 1]`` if given (cycled),
    else drawn."""
    plan = []
    for i in range(config.events):
        x = rng.random()
        kind = "kill" if x < config.p_kill else (
            "long-stop" if x < config.p_kill + config.p_long_stop else "stop")
        if config.kinds:
            kinds = config.kinds[(round_index - 1) % len(config.kinds)]
            kind = kinds[i % len(kinds)]
        duration = {"kill": 0.0, "stop": config.transfer_timeout * config.stop_factor[0],
                    "long-stop": config.worker_ttl * config.stop_factor[1]}[kind]
        plan.append((rng.uniform(0.1, within), kind, duration, rng.random()))
    return plan


class Chaos(threading.Thread):
    """Carries out a `chaos_plan` on the cluster's worker processes until `finish` is
    called. A stop always ends with SIGCONT after its full duration, also when the
    round finished meanwhile: `finish` waits for it."""

    def __init__(self, cluster: ChaosCluster, plan: list, round_index: int):
        super().__init__(daemon=True, name="chaos")
        self.cluster = cluster
        self.plan = plan
        self.round = round_index
        self.events: list = []
        self._done = threading.Event()
        self._t0 = time.monotonic()

    def finish(self) -> list:
        self._done.set()
        self.join()
        return self.events

    def run(self) -> None:
        for wait, kind, duration, pick in self.plan:
            if self._done.wait(wait):
                return
            procs = sorted(self.cluster.worker_processes(), key=lambda p: p.pid)
            if not procs:
                continue
            victim = procs[int(pick * len(procs))]
            event = Event(self.round, round(time.monotonic() - self._t0, 2), kind,
                          victim.pid, duration)
            try:
                if kind == "kill":
                    victim.send_signal(signal.SIGKILL)
                else:
                    victim.send_signal(signal.SIGSTOP)
                    try:
                        time.sleep(duration)  # not cut short: the stop is the point
                    finally:
                        victim.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                continue
            self.events.append(event)


# ---------------------------------------------------------------------------- the workload


def make_collection(config: SoakConfig):
    import dask

    ts = dask.datasets.timeseries(start=config.start, end=config.end, freq=config.freq,
                                  partition_freq=config.partition_freq, seed=config.seed)
    return ts.shuffle(on="id", npartitions=config.npartitions, shuffle_method="tasks")


def expected_result(config: SoakConfig):
    """The answer of dask's synchronous scheduler, in this process."""
    return make_collection(config).compute(scheduler="sync")


def same_frame(got, expected) -> str:
    """'' when equal, else what differs."""
    import pandas as pd

    try:
        pd.testing.assert_frame_equal(got, expected)
    except AssertionError as exc:
        return f"wrong result: {str(exc)[:300]}"
    return ""


def held_by_this_worker() -> dict:
    """Run on a worker: the keys its data and its state machine hold (probe tasks
    excluded), found through the Worker object of this process."""
    import gc

    from distributed_server.worker.server import Worker

    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, Worker):
            data = [k for k in obj.data if not str(k).startswith(PROBE_PREFIX)]
            tasks = [k for k in obj.state.tasks if not str(k).startswith(PROBE_PREFIX)]
            found[obj.address] = {"data": len(data), "tasks": len(tasks),
                                  "sample": [repr(k) for k in (data or tasks)[:5]]}
    return found


cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---------------------------------------------------------------------------- the soak


def _wait_for(condition, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def run_soak(config: SoakConfig, directory: Path | None = None, log=print) -> SoakReport:
    """Run the soak; the report says what happened (``report.ok``)."""
    report = SoakReport(config)
    rng = random.Random(config.seed)
    started = time.monotonic()
    own_dir = directory is None
    directory = Path(tempfile.mkdtemp(prefix="chaos-soak-") if own_dir else directory)
    directory.mkdir(parents=True, exist_ok=True)
    # dask's own answer, computed in a thread while the cluster starts
    expected_box: dict = {}

    def compute_expected():
        try:
            expected_box["value"] = expected_result(config)
        except BaseException as exc:  # noqa: BLE001 - raised by the first round
            expected_box["error"] = exc

    expecting = threading.Thread(target=compute_expected, daemon=True, name="expected")
    expecting.start()

    def expected():
        expecting.join()
        if "error" in expected_box:
            raise expected_box["error"]
        return expected_box["value"]

    cluster = ChaosCluster(config, directory)
    try:
        with Client(cluster.address, security=cluster.security, set_as_default=False,
                    timeout=60) as client:
            report.compiled = bool(client.scheduler_info()["compiled"])

            def healthy():
                info = client.scheduler_info()
                return (len(info["workers"]) == config.nworkers
                        and len(cluster.worker_processes()) == config.nworkers)

            def one_round(index: int, chaos_within: float | None) -> RoundResult:
                t0 = time.monotonic()
                if not _wait_for(healthy, config.heal_timeout):
                    info = client.scheduler_info()
                    return RoundResult(index, False, 0.0, time.monotonic() - t0, [],
                                       cluster.scheduler_rss(),
                                       f"round {index}: only {len(info['workers'])} of "
                                       f"{config.nworkers} workers after "
                                       f"{config.heal_timeout} s")
                heal = time.monotonic() - t0
                rss = cluster.scheduler_rss()
                start = time.monotonic()
                future = client.compute(make_collection(config))
                chaos = None
                if chaos_within is not None:
                    chaos = Chaos(cluster, chaos_plan(config, rng, index, chaos_within),
                                  index)
                    chaos.start()
                error = ""
                try:
                    got = future.result(timeout=config.round_timeout)
                except (TimeoutError, asyncio.TimeoutError):
                    info = client.scheduler_info()
                    error = (f"round {index}: no result within {config.round_timeout} s "
                             f"(hang); scheduler task counts {info['task_counts']}, "
                             f"workers {len(info['workers'])}")
                except Exception as exc:  # noqa: BLE001 - a lost future is a finding
                    error = (f"round {index}: {type(exc).__name__} instead of a result: "
                             f"{str(exc)[:300]}")
                else:
                    error = same_frame(got, expected())
                    if error:
                        error = f"round {index}: {error}"
                    del got
                seconds = time.monotonic() - start
                events = chaos.finish() if chaos is not None else []
                future.release()
                del future
                if not _wait_for(lambda: client.scheduler_info()["n_tasks"] == 0,
                                 config.drain_timeout):
                    info = client.scheduler_info()
                    error = error or (f"round {index}: the scheduler still holds "
                                      f"{info['n_tasks']} tasks ({info['task_counts']}) "
                                      f"{config.drain_timeout} s after the release")
                return RoundResult(index, not error, seconds, heal, events, rss, error)

            # Two rounds without chaos: the first warms the workers up (imports), the
            # second is the round's length undisturbed; both must be right.
            for _ in range(2):
                baseline = one_round(0, None)
                if not baseline.ok:
                    report.failures.append(f"without chaos: {baseline.error}")
                    return report
            report.baseline_seconds = baseline.seconds
            log(f"baseline round without chaos: {baseline.seconds:.2f} s")
            for index in range(1, config.rounds + 1):
                result = one_round(index, max(0.2, 0.5 * baseline.seconds))
                report.rounds.append(result)
                kinds = ", ".join(f"{e.kind}@{e.at:.1f}s" for e in result.events) or "none"
                log(f"round {index}/{config.rounds}: {'ok' if result.ok else 'FAILED'} "
                    f"{result.seconds:.2f} s (heal {result.heal_seconds:.2f} s), events: "
                    f"{kinds}; scheduler RSS {result.scheduler_rss / 2**20:.1f} MiB"
                    + (f"\n  {result.error}" if result.error else ""))
                if not result.ok:
                    report.failures.append(result.error)
                    if "hang" in result.error or "workers after" in result.error:
                        break  # the cluster is stuck: later rounds would say nothing new

            # Afterwards: nothing left on the scheduler or on any worker.
            if not _wait_for(healthy, config.heal_timeout):
                report.failures.append("after the soak: not every worker came back")
            report.leaked_tasks = client.scheduler_info()["n_tasks"]
            if report.leaked_tasks:
                report.failures.append(f"after the soak: the scheduler holds "
                                       f"{report.leaked_tasks} tasks")
            report.held_by_workers = _held_by_workers(client, report)
    finally:
        cluster.close()
        report.scheduler_errors = cluster.error_lines("scheduler.log")
        report.worker_errors = cluster.error_lines("workers.log")
        workers_log = cluster.log("workers.log")
        report.restarts = workers_log.count("; restart ")
        report.failed_fetches = workers_log.count(" could not fetch ")
        report.ttl_removals = sum("silent for over" in line and "worker" in line
                                  for line in cluster.log("scheduler.log").splitlines())
        if report.scheduler_errors:
            report.failures.append(f"the scheduler logged {len(report.scheduler_errors)} "
                                   f"ERROR lines, first: {report.scheduler_errors[0][:500]}")
        if report.worker_errors:
            report.failures.append(f"workers or the nanny logged "
                                   f"{len(report.worker_errors)} ERROR lines, first: "
                                   f"{report.worker_errors[0][:500]}")
        report.wall = time.monotonic() - started
        if report.failures:
            log(f"logs kept in {directory}")
        elif own_dir:
            shutil.rmtree(directory, ignore_errors=True)
    return report


def _held_by_workers(client, report: SoakReport) -> dict:
    """What every worker still holds, asked of each by a probe task pinned to it; a
    worker may take a moment to get the last free-keys.  A worker killed at the very end
    of the last round may still be listed for a moment: its probe is dropped and the
    workers are listed again."""

    def totals(held: dict) -> dict:
        return {w: c["data"] + c["tasks"] for w, c in held.items()}

    held: dict = {}
    for attempt in range(50):
        held = {}
        for address in sorted(client.scheduler_info()["workers"]):
            probe = client.submit(held_by_this_worker, key=f"{PROBE_PREFIX}{address}-"
                                  f"{attempt}", workers=[address], pure=False)
            try:
                found = _probe_result(client, probe, address, timeout=30.0)
            except Exception as exc:  # noqa: BLE001
                report.failures.append(f"after the soak: the probe of {address} failed: "
                                       f"{type(exc).__name__}: {exc}")
                return totals(held)
            finally:
                probe.release()
            if found is None:
                break  # the worker left: list them again
            for worker, counts in found.items():
                held[worker] = counts
        else:
            if not any(c["data"] or c["tasks"] for c in held.values()):
                return {w: 0 for w in held}
        time.sleep(0.1)
    report.failures.append(f"after the soak: workers still hold results or tasks: {held}")
    return totals(held)


def _probe_result(client, probe, address: str, timeout: float):
    """The probe's answer, or None once its worker is no longer in the cluster."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return probe.result(timeout=0.5)
        except (TimeoutError, asyncio.TimeoutError):
            if address not in client.scheduler_info()["workers"]:
                return None
            if time.monotonic() > deadline:
                raise


def main(argv: list | None = None) -> int:
    defaults = SoakConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--nworkers", type=int, default=defaults.nworkers)
    parser.add_argument("--npartitions", type=int, default=defaults.npartitions)
    parser.add_argument("--end", default=defaults.end,
                        help="the frame's last day (start: 2000-01-01)")
    parser.add_argument("--transfer-timeout", type=float, default=defaults.transfer_timeout)
    parser.add_argument("--worker-ttl", type=float, default=defaults.worker_ttl)
    parser.add_argument("--events", type=int, default=defaults.events,
                        help="most signals (and workers lost) per round")
    parser.add_argument("--round-timeout", type=float, default=defaults.round_timeout,
                        help="seconds a round may take before it counts as a hang")
    parser.add_argument("--memory-limit", default=defaults.memory_limit,
                        help="each worker's, as dcore worker takes it")
    parser.add_argument("--no-validate", action="store_true",
                        help="run the scheduler without --validate")
    parser.add_argument("--keep-logs", default=None,
                        help="directory for the processes' logs (default: a temporary "
                             "one, removed after a clean run)")
    args = parser.parse_args(argv)
    config = SoakConfig(rounds=args.rounds, seed=args.seed, nworkers=args.nworkers,
                        npartitions=args.npartitions, end=args.end,
                        transfer_timeout=args.transfer_timeout, worker_ttl=args.worker_ttl,
                        events=args.events, round_timeout=args.round_timeout,
                        memory_limit=args.memory_limit,
                        validate=not args.no_validate)
    report = run_soak(config, Path(args.keep_logs) if args.keep_logs else None)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
