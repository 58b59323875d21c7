"""The nanny and Client.restart, with real processes and real signals.

A ``dcore scheduler --validate`` process (its log must hold no ERROR line) and ``dcore
worker --nworkers 2`` (one nanny process, two worker processes) on loopback. Workers are
SIGKILLed, pushed past their memory limit, restarted by the client; nannies are
SIGTERMed. Figures (restart times, memory-kill reaction) are printed, not asserted.
"""
import asyncio
import re
import signal
import subprocess
import sys
import time

import cloudpickle
import psutil
import pytest
from server_helpers import DCORE, Processes, children, wait_for

from distributed_server import CancelledError, Client, LocalCluster
from distributed_server.client.futures import SchedulerError, TaskFailedError
from distributed_server.deploy.nanny import MEMORY_LIMIT_ENV, format_bytes, parse_memory_limit
from distributed_server.security import new_token

pytestmark = pytest.mark.timeout(90)
# Worker processes cannot import test modules: these functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Each worker's memory limit in the shared cluster: far above what a worker needs
#: (~30-60 MiB), far below what `hog` takes.
MEMORY_LIMIT = 200 * 2**20


def inc(x, delay=0.0):
    if delay:
        time.sleep(delay)
    return x + 1


def add(a, b):
    return a + b


def hog(nbytes):
    """Hold ``nbytes`` of memory that is really written (RSS), for a while."""
    print(f"hog starts at {time.time():.3f}", flush=True)
    block = bytearray(b"x") * nbytes
    time.sleep(10)
    return len(block)


def reaction_times(log: str) -> list:
    """Seconds from each 'hog starts' line to the nanny's next kill line (figures)."""
    out, start = [], None
    for line in log.splitlines():
        if line.startswith("hog starts at "):
            start = float(line.split()[-1])
        elif "killing it" in line and start is not None:
            stamp, ms = line[:23].split(",")
            killed = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1e3
            out.append(round(killed - start, 2))
            start = None
    return out


def tree(client, n=40):
    level = client.map(inc, range(n), pure=False)
    while len(level) > 1:
        carry = [level[-1]] if len(level) % 2 else []
        level = client.map(add, level[0:-1:2], level[1::2], pure=False) + carry
    return level[0]


def expected_tree(n=40):
    return sum(range(1, n + 1))


def gone(pids, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A validating scheduler and one nanny of two workers with a low memory limit."""
    processes = Processes(tmp_path_factory.mktemp("nanny"))
    try:
        processes.main = processes.nanny("--nworkers", "2", "--memory-limit",
                                         str(MEMORY_LIMIT))
        yield processes
    finally:
        processes.close()
    processes.assert_no_errors()


@pytest.fixture
def client(cluster):
    with Client(cluster.address, security=cluster.security, set_as_default=False) as c:
        c.wait_for_workers(2, timeout=30)
        wait_for(lambda: len(children(cluster.main)) == 2)
        yield c
    cluster.assert_no_errors()


def workers(client) -> dict:
    return client.scheduler_info()["workers"]


def replaced(client, before: set) -> bool:
    """As many workers as ``before``, not all the same."""
    now = set(workers(client))
    return len(now) == len(before) and now != before


# ---------------------------------------------------------------------------- the nanny


def test_nworkers_2_gives_two_supervised_workers_with_their_memory_limit(cluster, client):
    info = workers(client)
    assert sorted(w["name"] for w in info.values()) == ["w-0", "w-1"]
    assert all(w["nanny"] for w in info.values())
    procs = children(cluster.main)
    assert len(procs) == 2
    for proc in procs:
        cmdline = proc.cmdline()
        assert "--no-nanny" in cmdline
        assert not any(cluster.security.token in part for part in cmdline)  # env, not argv
        assert proc.environ()[MEMORY_LIMIT_ENV] == str(MEMORY_LIMIT)
    assert tree(client).result(timeout=30) == expected_tree()


def test_a_sigkilled_worker_is_restarted_registers_again_and_new_work_runs(cluster, client):
    before = set(workers(client))
    victim = children(cluster.main)[0]
    log_size = len(cluster.log("nanny.log"))
    started = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    wait_for(lambda: replaced(client, before))
    took = time.monotonic() - started
    print(f"\nSIGKILL -> the restarted worker registered: {took:.2f} s")
    assert victim.pid not in [p.pid for p in children(cluster.main)]
    assert re.search(r"WARNING nanny: worker w-\d at \S+ was killed by SIGKILL after "
                     r"[\d.]+ s; restart \d+ in 0.1 s", cluster.log("nanny.log")[log_size:])
    assert tree(client).result(timeout=30) == expected_tree()


def test_a_worker_past_its_memory_limit_is_killed_and_the_task_fails_after_3_deaths(
        cluster, client):
    log_size = len(cluster.log("nanny.log"))
    started = time.monotonic()
    hogging = client.submit(hog, 2 * MEMORY_LIMIT, pure=False)
    with pytest.raises(TaskFailedError, match="KilledWorker: .* was running on 3 workers"):
        hogging.result(timeout=60)
    took = time.monotonic() - started
    kills = re.findall(r"WARNING nanny: worker (w-\d) at \S+ \(pid \d+\) uses ([\d.]+ MiB) "
                       r"resident, over 95% of its memory limit 200.00 MiB: killing it",
                       cluster.log("nanny.log")[log_size:])
    assert len(kills) == 3, cluster.log("nanny.log")[log_size:]
    print(f"\nmemory kills: {kills}; KilledWorker after {took:.2f} s; from the task's "
          f"start to the kill: {reaction_times(cluster.log('nanny.log')[log_size:])}")
    client.wait_for_workers(2, timeout=30)
    assert tree(client).result(timeout=30) == expected_tree()


def test_restart_cancels_every_future_and_the_workers_come_back(cluster, client):
    done = client.submit(inc, 1, pure=False)
    assert done.result(timeout=30) == 2
    in_flight = client.map(inc, range(6), delay=5, pure=False)
    wait_for(lambda: client.scheduler_info()["task_counts"]["processing"] >= 2)
    many = client.map(inc, range(5_000), pure=False)  # forgotten in slices of 2,000
    old = set(workers(client))
    old_pids = {p.pid for p in children(cluster.main)}
    started = time.monotonic()
    assert client.restart(timeout=30) is client
    took = time.monotonic() - started
    print(f"\nclient.restart() with 2 workers: {took:.2f} s")
    assert all(future.status == "cancelled" for future in many)
    for future in [done, *in_flight]:
        assert future.status == "cancelled"
        with pytest.raises(CancelledError, match="was cancelled: the cluster was restarted"):
            future.result(timeout=1)
    new = set(workers(client))
    assert len(new) == 2 and not new & old
    assert not old_pids & {p.pid for p in children(cluster.main)}
    assert client.scheduler_info()["n_tasks"] == 0
    assert client.submit(inc, 1, pure=False).result(timeout=30) == 2  # same key: new work
    assert tree(client).result(timeout=30) == expected_tree()
    assert "restart OK after" in cluster.log()


def test_restart_is_refused_while_a_worker_has_no_nanny(cluster, client):
    lone = cluster.spawn(["worker", cluster.address, "--no-nanny", "--name", "lone"],
                         cluster.directory / "lone.log", stdout="log")
    try:
        client.wait_for_workers(3, timeout=30)
        kept = client.submit(inc, 10, pure=False)
        assert kept.result(timeout=30) == 11
        lone_address = next(a for a, w in workers(client).items() if w["name"] == "lone")
        assert not workers(client)[lone_address]["nanny"]
        with pytest.raises(SchedulerError, match=f"no nanny .*{re.escape(lone_address)}"):
            client.restart(timeout=10)
        assert kept.status == "finished" and kept.result() == 11  # nothing was changed
        assert len(workers(client)) == 3
    finally:
        lone.send_signal(signal.SIGTERM)
        assert lone.wait(timeout=20) == 0


def test_sigterm_to_a_nanny_stops_its_workers_and_leaves_no_process(cluster, client):
    extra = cluster.nanny("--nworkers", "2", name="extra", log="extra.log")
    client.wait_for_workers(4, timeout=30)
    pids = [extra.pid] + [p.pid for p in wait_for(lambda: len(children(extra)) == 2
                                                    and children(extra))]
    extra.send_signal(signal.SIGTERM)
    assert extra.wait(timeout=20) == 0
    assert gone(pids)
    wait_for(lambda: len(workers(client)) == 2)
    assert "was killed" not in cluster.log("extra.log")  # stopped, not restarted


def test_the_nanny_exits_when_the_scheduler_closes(tmp_path):
    processes = Processes(tmp_path)
    try:
        nanny = processes.nanny("--nworkers", "2")
        with Client(processes.address, security=processes.security,
                    set_as_default=False) as client:
            client.wait_for_workers(2, timeout=30)
        pids = [nanny.pid] + [p.pid for p in wait_for(lambda: len(children(nanny)) == 2
                                                       and children(nanny))]
        processes.scheduler.send_signal(signal.SIGTERM)
        assert processes.scheduler.wait(timeout=20) == 0
        assert nanny.wait(timeout=20) == 0
        assert gone(pids)
        assert not re.search(r"; restart \d+ in", processes.log("nanny.log"))
        assert "the scheduler is closing; workers will not be restarted" in \
            processes.log("nanny.log")
    finally:
        processes.close()
    processes.assert_no_errors()


def test_a_nanny_with_the_wrong_token_stops_with_code_1(tmp_path):
    processes = Processes(tmp_path)
    try:
        processes.env["DCORE_TOKEN"] = new_token()
        nanny = processes.nanny()
        assert nanny.wait(timeout=30) == 1
        assert "refused it" in processes.log("nanny.log")
    finally:
        processes.close()


def test_dcore_worker_refuses_inconsistent_flags():
    for args, text in [(["--no-nanny", "--nworkers", "2"], "--nworkers needs the nanny"),
                       (["--nworkers", "2", "--port", "9999"], "cannot serve 2 workers"),
                       (["--memory-limit", "lots"], "memory limit 'lots'"),
                       (["--nworkers", "0"], "at least 1")]:
        out = subprocess.run(DCORE + ["worker", "tcp://127.0.0.1:1", *args],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and text in out.stderr, (args, out.stderr)


# ---------------------------------------------------------------------------- LocalCluster


def test_local_cluster_runs_its_workers_under_a_nanny(capfd):
    with Client(n_workers=2, memory_limit="1GiB", set_as_default=False) as client:
        cluster = client._cluster
        assert cluster.memory_limit == 2**30
        procs = cluster.worker_processes()
        assert len(procs) == 2
        assert [p.environ()[MEMORY_LIMIT_ENV] for p in procs] == [str(2**30)] * 2
        assert all(w["nanny"] for w in workers(client).values())
        before = set(workers(client))
        procs[0].send_signal(signal.SIGKILL)
        wait_for(lambda: replaced(client, before))
        assert tree(client).result(timeout=30) == expected_tree()
        # what a task prints passes through (and is not kept); the address lines do not
        assert client.submit(print, "printed-by-a-task", flush=True).result() is None
        wait_for(lambda: "printed-by-a-task" in capfd.readouterr().out, timeout=10,
                 interval=0.1)
    out = capfd.readouterr().out
    assert "Worker at" not in out and "Scheduler at" not in out


def test_local_cluster_without_processes_has_no_nanny_to_restart():
    with LocalCluster(n_workers=1, processes=False) as cluster, \
            Client(cluster, set_as_default=False) as client:
        with pytest.raises(SchedulerError, match="no nanny"):
            client.restart(timeout=5)


# ---------------------------------------------------------------------------- units


def test_a_nanny_may_only_say_which_workers_it_runs(caplog):
    from distributed_server import Scheduler
    from distributed_server.comm import CommClosedError, connect

    async def main():
        async with Scheduler(validate=True) as scheduler:
            refused = await connect(scheduler.address, {"role": "nanny", "workers": "w"})
            (reply,) = await asyncio.wait_for(refused.read(), 10)
            assert reply["op"] == "error" and "list of at most 4096" in reply["error"]
            nanny = await connect(scheduler.address, {"role": "nanny", "workers": []})
            nanny.send({"op": "nanny-workers", "workers": ["tcp://127.0.0.1:1"]})
            while ("tcp://127.0.0.1:1",) not in scheduler.nanny_workers.values():
                await asyncio.sleep(0.01)
            nanny.send({"op": "update-graph", "tasks": [], "keys": ["x"]})  # not its role
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(nanny.read(), 10)
            while scheduler.nanny_comms:
                await asyncio.sleep(0.01)
            assert not scheduler.state.tasks and not scheduler.state.clients

    asyncio.run(asyncio.wait_for(main(), 30))
    assert "unknown operation 'update-graph' from nanny" in caplog.text


def test_memory_limits_parse_like_dasks():
    total = 16 * 2**30
    assert parse_memory_limit(None, 4, total) == 4 * 2**30
    assert parse_memory_limit("auto", 2, total) == 8 * 2**30
    assert parse_memory_limit("4GiB", 1, total) == 4 * 2**30
    assert parse_memory_limit("4 GB", 1, total) == 4 * 10**9
    assert parse_memory_limit("4e9", 1, total) == 4 * 10**9
    assert parse_memory_limit(4_000_000_000, 1, total) == 4 * 10**9
    assert parse_memory_limit("0.5", 1, total) == 8 * 2**30
    assert parse_memory_limit(0.25, 1, total) == 4 * 2**30
    assert parse_memory_limit(1, 1, total) == total
    assert parse_memory_limit("64TiB", 1, total) == total  # capped at the machine's
    assert parse_memory_limit(0, 1, total) == parse_memory_limit("0", 1, total) == 0
    for bad in ("lots", "-1", "4XB", True, -5, float("nan"), [1]):
        with pytest.raises(ValueError):
            parse_memory_limit(bad, 1, total)
    assert format_bytes(3 * 2**29) == "1.50 GiB" and format_bytes(10) == "10 B"
