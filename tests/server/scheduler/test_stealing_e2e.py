"""Work stealing end to end: real ``dcore`` processes on loopback.

A ``dcore scheduler --validate`` process (its log must hold no ERROR line) and nannies
of one worker with one thread each. Every task needs the result of one root task, so
the scheduler places them all on the root's holder: only stealing gives the other
worker any of them. Each task returns its input and the pid of the worker process that
ran it, so the test sees both the results and where they ran.
"""
import os
import sys
import time

import cloudpickle
import pytest
from server_helpers import Processes, wait_for

from distributed_server import Client

pytestmark = pytest.mark.timeout(180)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def root():
    return 1000


def work(i, base, seconds):
    time.sleep(seconds)
    return base + i, os.getpid()


def connect(processes) -> Client:
    return Client(processes.address, security=processes.security, set_as_default=False)


@pytest.fixture
def processes(tmp_path):
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.close()
    processes.assert_no_errors()


def test_a_worker_joining_mid_run_receives_queued_work(processes):
    processes.nanny("--nthreads", "1", name="first", log="first.log")
    with connect(processes) as c:
        c.wait_for_workers(1, timeout=30)
        base = c.submit(root)
        # 20 s of work on one thread: the second worker joins with most of it left
        futures = [c.submit(work, i, base, 0.1, pure=False) for i in range(200)]
        wait_for(lambda: sum(f.done() for f in futures) >= 8, timeout=60)
        first_pids = {f.result()[1] for f in futures if f.done()}
        processes.nanny("--nthreads", "1", name="second", log="second.log")
        c.wait_for_workers(2, timeout=30)
        left = sum(not f.done() for f in futures)
        results = c.gather(futures)
    assert left >= 20, f"only {left} tasks were left when the second worker joined"
    assert [value for value, _ in results] == [1000 + i for i in range(200)]
    pids = {pid for _, pid in results}
    assert len(first_pids) == 1 and len(pids) == 2, (first_pids, pids)
    assert sum(pid not in first_pids for _, pid in results) >= 5


def test_uneven_durations_are_spread_over_both_workers(processes):
    processes.nanny("--nthreads", "1", "--nworkers", "2", name="pair")
    with connect(processes) as c:
        c.wait_for_workers(2, timeout=30)
        base = c.submit(root)
        seconds = [0.5 if i % 10 == 0 else 0.02 for i in range(60)]
        futures = [c.submit(work, i, base, s, pure=False) for i, s in enumerate(seconds)]
        results = c.gather(futures)
    assert [value for value, _ in results] == [1000 + i for i in range(60)]
    ran = {}
    for (_, pid), s in zip(results, seconds):
        ran[pid] = ran.get(pid, 0) + s
    # Without stealing every task runs where `base` is; with it, both share the work.
    assert len(ran) == 2 and min(ran.values()) >= 0.5, ran
