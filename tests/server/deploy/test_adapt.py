"""`Cluster.adapt`: a LocalCluster grows with its work and shrinks when idle, letting
workers go only by graceful retirement (their results move first: nothing computed is
computed again).

Every scheduler and worker here is a real process (or, with ``processes=False``, a
real server on loopback in a thread); the tasks are real; the clock is the machine's.
"""
import math
import os
import signal
import sys
import time

import cloudpickle
import psutil
import pytest
from server_helpers import wait_for

from distributed_server import Client, LocalCluster, wait
from distributed_server.deploy.adaptive import Adaptive

pytestmark = pytest.mark.timeout(180)
# Worker processes cannot import test modules: these functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def sleepy(i, delay, record_dir):
    """Sleep ``delay`` seconds and return ``i``, leaving a file per run (so a test can
    count how many times each task ran)."""
    time.sleep(delay)
    with open(os.path.join(record_dir, f"{i}-{time.monotonic_ns()}"), "w"):
        pass
    return i


def runs(record_dir) -> dict:
    """How many times each task ran: ``{i: n}``."""
    counts: dict = {}
    for name in os.listdir(record_dir):
        i = int(name.split("-")[0])
        counts[i] = counts.get(i, 0) + 1
    return counts


def n_workers(cluster) -> int:
    return len(cluster.scheduler_info()["workers"])


@pytest.mark.parametrize("processes", [True, False])
def test_adapt_grows_from_zero_under_a_burst_and_goes_back_when_idle(processes, tmp_path):
    with LocalCluster(n_workers=0, processes=processes, dashboard_address=None,
                      validate=True) as cluster, \
            Client(cluster, set_as_default=False) as client:
        adaptive = cluster.adapt(minimum=0, maximum=3, interval="200ms", wait_count=3)
        futures = client.map(sleepy, range(24), delay=0.5, record_dir=str(tmp_path),
                             pure=False)
        peak = 0
        while not all(f.done() for f in futures):
            peak = max(peak, n_workers(cluster))
            time.sleep(0.1)
        assert client.gather(futures) == list(range(24))
        assert peak >= 2, peak  # 24 x 0.5 s over 5 s wants three 1-thread workers
        assert peak <= 3
        del futures
        wait_for(lambda: n_workers(cluster) == 0, timeout=30)
        assert cluster.worker_names == []
        assert runs(tmp_path) == {i: 1 for i in range(24)}
        actions = [entry[3] for entry in adaptive.log]
        assert "up" in actions and "down" in actions


@pytest.mark.parametrize("processes", [True, False])
def test_scaling_down_during_work_recomputes_nothing(processes, tmp_path):
    """Results held on the workers adapt lets go are moved, not recomputed: every task
    ran exactly once, and every result is still there."""
    with LocalCluster(n_workers=0, processes=processes, dashboard_address=None,
                      validate=True) as cluster, \
            Client(cluster, set_as_default=False) as client:
        cluster.adapt(minimum=1, maximum=3, interval="200ms", wait_count=2)
        kept = client.map(sleepy, range(30), delay=0.3, record_dir=str(tmp_path),
                          pure=False)
        wait(kept, timeout=120)
        # idle now, holding 30 results spread over the workers: back to the minimum
        wait_for(lambda: n_workers(cluster) == 1, timeout=30)
        assert client.gather(kept) == list(range(30))
        assert runs(tmp_path) == {i: 1 for i in range(30)}
        # a second burst on the remaining worker grows the cluster again
        more = client.map(sleepy, range(30, 50), delay=0.3, record_dir=str(tmp_path),
                          pure=False)
        assert client.gather(more) == list(range(30, 50))
        assert runs(tmp_path) == {i: 1 for i in range(50)}


def test_scale_stops_adapt_and_a_second_adapt_replaces_the_first():
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        first = cluster.adapt(minimum=1, maximum=2, interval="100ms")
        wait_for(lambda: n_workers(cluster) == 1, timeout=20)
        second = cluster.adapt(minimum=2, maximum=2, interval="100ms")
        assert not first.running and second.running
        wait_for(lambda: n_workers(cluster) == 2, timeout=20)
        cluster.scale(1)
        assert not second.running
        time.sleep(0.5)  # nothing scales it back
        assert n_workers(cluster) == 1


class PlannedCluster:
    """What `Adaptive.recommendation` needs of a cluster: nothing."""


@pytest.mark.parametrize("targets, expected", [
    ([4, 4, 4], [4, 4, 4]),            # up at once, then steady
    ([4, 1, 1, 1], [4, 4, 4, 1]),      # down only after 3 lower answers in a row
    ([4, 1, 1, 4, 1, 1, 1], [4, 4, 4, 4, 4, 4, 1]),  # a higher answer resets the count
    ([9, 0, 0, 0], [5, 5, 5, 1]),      # bounded by maximum 5 and minimum 1
])
def test_adapt_scales_up_at_once_and_down_after_wait_count_lower_answers(targets,
                                                                         expected):
    adaptive = Adaptive(PlannedCluster(), minimum=1, maximum=5, wait_count=3)
    planned = 0
    out = []
    for target in targets:
        planned = adaptive.recommendation(target, planned)
        out.append(planned)
    assert out == expected


@pytest.mark.parametrize("kwargs, match", [
    ({"minimum": -1}, "minimum"),
    ({"minimum": 3, "maximum": 2}, "maximum"),
    ({"maximum": 2.5}, "maximum"),
    ({"wait_count": 0}, "wait_count"),
    ({"interval": "0s"}, "positive"),
    ({"target_duration": "soon"}, "duration"),
])
def test_adapt_refuses_bad_bounds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Adaptive(PlannedCluster(), **kwargs)


def test_maximum_may_be_infinite():
    assert Adaptive(PlannedCluster(), maximum=math.inf).recommendation(50, 0) == 50


def test_adapt_replaces_a_worker_whose_nanny_was_killed(tmp_path):
    with LocalCluster(n_workers=0, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        cluster.adapt(minimum=2, maximum=2, interval="200ms")
        wait_for(lambda: n_workers(cluster) == 2, timeout=30)
        victim = cluster.worker_names[0]
        nanny = cluster._workers[0]
        worker_pids = [p.pid for p in psutil.Process(nanny.pid).children()]
        nanny.send_signal(signal.SIGKILL)
        for pid in worker_pids:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: victim not in cluster.worker_names and n_workers(cluster) == 2,
                 timeout=30)
        futures = client.map(sleepy, range(4), delay=0.1, record_dir=str(tmp_path),
                             pure=False)
        assert client.gather(futures) == list(range(4))


@pytest.mark.parametrize("processes", [True, False])
def test_workers_let_go_while_running_tasks_finish_them_first(processes, tmp_path):
    """Scaling down while every worker runs a task: the leaving ones finish theirs, their
    results move, and nothing runs twice."""
    with LocalCluster(n_workers=3, processes=processes, dashboard_address=None,
                      validate=True) as cluster, \
            Client(cluster, set_as_default=False) as client:
        futures = client.map(sleepy, range(6), delay=1.0, record_dir=str(tmp_path),
                             pure=False)
        wait_for(lambda: sum(w["processing"] for w in
                             cluster.scheduler_info()["workers"].values()) >= 3, timeout=30)
        cluster.scale(1)
        assert n_workers(cluster) == 1
        assert client.gather(futures) == list(range(6))
        assert runs(tmp_path) == {i: 1 for i in range(6)}


def test_adapt_keeps_a_worker_while_results_are_held_without_memory_limits(tmp_path):
    """Workers without a memory limit (processes=False): held results still need a worker
    to live on, so adapt(minimum=0) stops at one until they are released."""
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        cluster.adapt(minimum=0, maximum=2, interval="100ms", wait_count=2)
        kept = client.map(sleepy, range(4), delay=0.2, record_dir=str(tmp_path),
                          pure=False)
        wait(kept, timeout=60)
        time.sleep(1.5)  # many steps with nothing to run
        assert n_workers(cluster) == 1
        assert client.gather(kept) == list(range(4))
        assert runs(tmp_path) == {i: 1 for i in range(4)}
        del kept
        wait_for(lambda: n_workers(cluster) == 0, timeout=30)
