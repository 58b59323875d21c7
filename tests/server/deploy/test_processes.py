"""Whole processes: the dcore command, workers killed mid-graph, clients that vanish.

Every scheduler and worker here is a real process on loopback, started the way a user
starts them (``python -m distributed_server.cli`` is what the ``dcore`` script runs).
"""
import inspect
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import psutil
import pytest
from server_helpers import wait_for

import distributed_core
from distributed_server import Client, LocalCluster, wait

pytestmark = pytest.mark.timeout(120)
# Worker processes cannot import test modules: these functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def slow_square(x, delay=0.0):
    if delay:
        time.sleep(delay)
    return x * x


def add(a, b):
    return a + b


def tree_sum(client, n):
    level = client.map(slow_square, range(n))
    while len(level) > 1:
        carry = [level[-1]] if len(level) % 2 else []
        level = client.map(add, level[0:-1:2], level[1::2]) + carry
    return level[0]


# The source a child client process needs to submit the same tasks.
TASKS = "import time\n" + inspect.getsource(slow_square)

DCORE = [sys.executable, "-m", "distributed_server.cli"]


def _start(args: list) -> subprocess.Popen:
    return subprocess.Popen(DCORE + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True)


def _first_line(proc: subprocess.Popen, prefix: str) -> str:
    line = proc.stdout.readline()
    assert line.startswith(prefix), line
    return line


def _gone(pids, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_version_says_which_core_is_loaded():
    out = subprocess.run(DCORE + ["--version"], capture_output=True, text=True, check=True)
    kind = "compiled" if distributed_core.COMPILED else "interpreted"
    assert f"core {kind}" in out.stdout
    assert distributed_core.__version__ in out.stdout


def test_dcore_scheduler_and_two_workers_run_a_graph_with_transfers():
    scheduler = _start(["scheduler", "--port", "0", "--log-level", "WARNING"])
    procs = [scheduler]
    try:
        address = _first_line(scheduler, "Scheduler at ").split()[2]
        for name in ("left", "right"):
            worker = _start(["worker", address, "--nthreads", "2", "--name", name,
                             "--log-level", "WARNING"])
            procs.append(worker)
            _first_line(worker, "Worker at ")
        with Client(address, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=30)
            names = {w["name"] for w in client.scheduler_info()["workers"].values()}
            assert names == {"left", "right"}
            total = tree_sum(client, 200)
            assert total.result(timeout=60) == sum(i * i for i in range(200))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            assert proc.wait(timeout=20) is not None


def test_graph_completes_correctly_when_a_worker_is_killed_midway():
    with LocalCluster(n_workers=2, threads_per_worker=1) as cluster, \
            Client(cluster, set_as_default=False) as client:
        leaves = client.map(slow_square, range(60), delay=0.05)
        total = client.submit(sum, leaves)
        while sum(f.done() for f in leaves) < 10:
            time.sleep(0.02)
        victim = cluster.worker_processes()[0]  # a worker process, not its nanny
        victim.send_signal(signal.SIGKILL)
        assert total.result(timeout=90) == sum(i * i for i in range(60))
        client.wait_for_workers(2, timeout=30)  # its nanny started it again


def test_client_process_dying_midgraph_releases_its_tasks_and_others_are_served():
    with LocalCluster(n_workers=1, threads_per_worker=1) as cluster, \
            Client(cluster, set_as_default=False) as survivor:
        script = textwrap.dedent(f"""
            from distributed_server import Client
            client = Client({cluster.scheduler_address!r}, set_as_default=False)
            futures = client.map(slow_square, range(500), delay=0.01)
            print("submitted", flush=True)
            time.sleep(60)
        """)
        doomed = subprocess.Popen([sys.executable, "-c", TASKS + script],
                                  stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, **cluster.security.environment()})
        assert doomed.stdout.readline().strip() == "submitted"
        deadline = time.monotonic() + 30
        while survivor.scheduler_info()["n_tasks"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert survivor.scheduler_info()["n_tasks"] > 0
        doomed.kill()
        doomed.wait()
        assert survivor.submit(slow_square, 7, delay=0).result(timeout=30) == 49
        deadline = time.monotonic() + 30
        while survivor.scheduler_info()["n_tasks"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert survivor.scheduler_info()["n_tasks"] <= 1  # only the survivor's own task


def test_closing_a_local_cluster_leaves_no_processes():
    cluster = LocalCluster(n_workers=2, threads_per_worker=1)
    pids = [proc.pid for proc in cluster._procs] + [p.pid for p in cluster.worker_processes()]
    assert len(pids) == 5  # the scheduler, a nanny per worker, two workers
    cluster.close()
    assert _gone(pids)


@pytest.mark.parametrize("processes", [True, False])
def test_a_local_cluster_scales_up_and_down_and_keeps_computing(processes):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=processes) as cluster, \
            Client(cluster, set_as_default=False) as client:
        assert client.cluster is cluster
        held = client.submit(slow_square, 6)
        assert held.result(timeout=30) == 36
        cluster.scale(3)
        names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
        assert names == ["worker-0", "worker-1", "worker-2"]
        assert tree_sum(client, 30).result(timeout=60) == sum(i * i for i in range(30))
        if processes:
            assert len(cluster.worker_processes()) == 3
        # a result only worker-2 holds: moved before worker-2 leaves, not recomputed
        (w2,) = [a for a, w in client.scheduler_info()["workers"].items()
                 if w["name"] == "worker-2"]
        drawn = client.submit(random.random, pure=False, workers=[w2])
        wait([drawn], timeout=30)
        client.cluster.scale(1)
        assert [w["name"] for w in client.scheduler_info()["workers"].values()] == ["worker-0"]
        assert held.result(timeout=30) == 36  # held by worker-0, which stayed
        assert 0 <= drawn.result(timeout=30) < 1
        story = [(e.start, e.finish) for e in client.story(drawn) if e.where == "scheduler"]
        assert story == [("released", "waiting"), ("waiting", "processing"),
                         ("processing", "memory")], story
        assert tree_sum(client, 10).result(timeout=60) == sum(i * i for i in range(10))
        with pytest.raises(ValueError, match="number of workers"):
            cluster.scale(-1)


def test_workers_started_from_a_short_lived_thread_outlive_it():
    """Linux's parent-death signal follows the thread that forked the child: a worker
    added by ``scale`` from a thread that then exits must keep running."""
    with LocalCluster(n_workers=1, threads_per_worker=1) as cluster, \
            Client(cluster, set_as_default=False) as client:
        thread = threading.Thread(target=cluster.scale, args=(2,))
        thread.start()
        thread.join()
        time.sleep(1.0)  # a SIGTERMed nanny would be gone by now
        assert len(cluster.worker_processes()) == 2
        assert len(client.scheduler_info()["workers"]) == 2
        assert tree_sum(client, 10).result(timeout=60) == sum(i * i for i in range(10))


def test_cluster_processes_die_with_a_killed_parent():
    script = textwrap.dedent("""
        from distributed_server import LocalCluster
        cluster = LocalCluster(n_workers=2, threads_per_worker=1)
        print(*[p.pid for p in cluster._procs], *[p.pid for p in cluster.worker_processes()],
              flush=True)
        import time; time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 5  # the scheduler, a nanny per worker, two workers
    parent.kill()
    parent.wait()
    if not sys.platform.startswith("linux"):
        pytest.skip("only Linux kills children with their parent")
    assert _gone(pids)



def test_a_stopped_scheduler_is_noticed_by_the_client_within_its_timeout(monkeypatch):
    """SIGSTOP the scheduler process (a hung machine: the kernel still answers TCP
    keepalives): pending futures raise instead of waiting forever."""
    from distributed_server.client import scheduler_comm as client_comm
    from distributed_server.client.futures import SchedulerConnectionError

    monkeypatch.setattr(client_comm, "HEARTBEAT_INTERVAL", 0.2)
    with LocalCluster(n_workers=1, threads_per_worker=1) as cluster, \
            Client(cluster, set_as_default=False, scheduler_timeout=1.5) as client:
        assert client.submit(slow_square, 3).result(timeout=30) == 9
        scheduler = cluster._procs[0]
        pending = client.submit(slow_square, 4, delay=5)
        scheduler.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(SchedulerConnectionError, match="lost the connection"):
                pending.result(timeout=30)
            assert time.monotonic() - start < 5
        finally:
            scheduler.send_signal(signal.SIGCONT)


def test_a_client_whose_own_loop_was_held_keeps_a_live_scheduler(monkeypatch, caplog):
    """The client's loop thread is held for longer than its timeout (a callback of
    seconds): the scheduler's frames wait unread meanwhile, so the late heartbeat does
    not count the silence, and the client goes on."""
    from distributed_server.client import scheduler_comm as client_comm

    monkeypatch.setattr(client_comm, "HEARTBEAT_INTERVAL", 0.2)
    with LocalCluster(n_workers=1, threads_per_worker=1) as cluster, \
            Client(cluster, set_as_default=False, scheduler_timeout=1.0) as client:
        assert client.submit(slow_square, 3).result(timeout=30) == 9
        held = threading.Event()
        client._loop.call_soon_threadsafe(lambda: (held.set(), time.sleep(2.0)))
        assert held.wait(10)
        assert client.submit(slow_square, 4, pure=False).result(timeout=30) == 16
        time.sleep(0.5)  # a few more heartbeats, on time
        assert client.submit(slow_square, 5, pure=False).result(timeout=30) == 25
    assert "has not answered" not in caplog.text


def test_a_stopped_scheduler_is_noticed_by_its_worker_within_its_timeout(tmp_path):
    """SIGSTOP the scheduler: the worker, hearing nothing for --scheduler-timeout, drops
    the connection, fails to register again within --reconnect-timeout, and exits with
    code 0 (so a nanny would not restart it against a dead scheduler)."""
    scheduler = subprocess.Popen(DCORE + ["scheduler", "--port", "0"], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    worker = None
    try:
        address = scheduler.stdout.readline().split()[2]
        log = tmp_path / "worker.log"
        with open(log, "wb") as out:
            worker = subprocess.Popen(DCORE + ["worker", address, "--no-nanny",
                                               "--scheduler-timeout", "1.5",
                                               "--reconnect-timeout", "1"],
                                      stdout=out, stderr=out)
        wait_for(lambda: "connected to the scheduler" in log.read_text())
        scheduler.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        assert worker.wait(timeout=30) == 0
        took = time.monotonic() - start
        text = log.read_text()
        assert "has not answered for" in text and "treating it as lost" in text, text
        assert "could not reach the scheduler" in text, text
        assert took < 1.5 + 1.0 + 1 + 3, (took, text)  # timeout + a heartbeat + reconnect
    finally:
        scheduler.send_signal(signal.SIGCONT)
        for proc in (worker, scheduler):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        scheduler.stdout.close()


def inc(x):
    return x + 1


def test_a_worker_holding_many_results_dies_and_they_come_back(tmp_path, monkeypatch):
    """A worker holding many times more results than one slice of a departure
    (``dcore.scheduler.slice-keys``, 50 here) is SIGKILLed: the scheduler lets go of them in
    slices, recomputes each one still wanted, and a graph built on them afterwards is
    correct; the validating scheduler logs no ERROR."""
    from server_helpers import Processes, children

    monkeypatch.setenv("DASK_DCORE__SCHEDULER__SLICE_KEYS", "50")
    n = 607
    processes = Processes(tmp_path)
    try:
        holder = processes.nanny("--nthreads", "1", name="holder", log="holder.log")
        processes.nanny("--nthreads", "1", name="other", log="other.log")
        with Client(processes.address, security=processes.security,
                    set_as_default=False) as client:
            client.wait_for_workers(2, timeout=30)
            by_name = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
            results = client.map(inc, range(n), workers=[by_name["holder"]],
                                 allow_other_workers=True)
            wait_for(lambda: all(f.done() for f in results), timeout=60)
            assert client.has_what()[by_name["holder"]].__len__() == n
            (victim,) = wait_for(lambda: children(holder))
            victim.send_signal(signal.SIGKILL)
            wait_for(lambda: by_name["holder"] not in client.scheduler_info()["workers"])
            total = client.submit(sum, results)
            assert total.result(timeout=90) == sum(range(1, n + 1))
            assert client.gather(results[-3:]) == [n - 2, n - 1, n]
            # The scheduler's log of the results' moves names the departure's stimuli.
            lost = {entry.stimulus_id for entry in client.story(*results)
                    if entry.where == "scheduler" and entry.start == "memory"
                    and entry.finish == "released"}
            assert all(sid.startswith("remove-worker") for sid in lost), lost
            assert len(lost) >= n // 50, lost
            del results, total
            wait_for(lambda: client.scheduler_info()["n_tasks"] == 0)
    finally:
        processes.close()
    processes.assert_no_errors()
