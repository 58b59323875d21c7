"""Coordination primitives end to end: real ``dcore`` processes on loopback.

A ``dcore scheduler --validate`` process (its log must hold no ERROR line) and one nanny
with a worker of two threads. Two clients in this process (two connections) coordinate
through each primitive; other clients run in processes of their own, one of which is
SIGKILLed while it holds a lock. Futures travel inside variables, queues and Pub/Sub and
their tasks outlive the client that made them. Bad input is refused with a clear error
and changes nothing. A task uses a primitive through the worker's client (no client
passed, as in dask), or through a Client of its own (the worker's environment holds the
cluster's credentials).
"""
import asyncio
import functools
import pickle
import signal
import subprocess
import sys
import threading
import time

import cloudpickle
import pytest
from server_helpers import Processes, wait_for

from distributed_server import (
    CancelledError,
    Client,
    Event,
    Lock,
    Pub,
    Queue,
    Scheduler,
    Semaphore,
    Sub,
    Variable,
)
from distributed_server.client.futures import SchedulerError
from distributed_server.client.primitives import MAX_VALUE_BYTES

pytestmark = pytest.mark.timeout(90)
# Worker processes cannot import test modules: these functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def inc(x):
    return x + 1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A validating scheduler and one nanny of one worker with two threads."""
    processes = Processes(tmp_path_factory.mktemp("primitives"))
    try:
        processes.nanny("--nthreads", "2")
        yield processes
    finally:
        processes.close()
    processes.assert_no_errors()


def connect(cluster) -> Client:
    return Client(cluster.address, security=cluster.security, set_as_default=False)


@pytest.fixture
def a(cluster):
    with connect(cluster) as c:
        c.wait_for_workers(1, timeout=30)
        yield c
    cluster.assert_no_errors()


@pytest.fixture
def b(cluster):
    with connect(cluster) as c:
        yield c


def no_tasks_left(client) -> bool:
    return client.scheduler_info()["n_tasks"] == 0


def raw_request(client, op: str, **fields):
    """A request as a client that skips its own checks would send it."""
    return client._sync(functools.partial(client._request, op, **fields))


def spawn_client(cluster, script: str, *args) -> subprocess.Popen:
    """A client in a process of its own, running ``script`` with the scheduler address
    as ``sys.argv[1]``; its stdout is a pipe."""
    return subprocess.Popen([sys.executable, "-c", script, cluster.address, *args],
                            env=cluster.env, stdout=subprocess.PIPE, text=True)


# ---------------------------------------------------------------------------- each primitive


def test_two_clients_share_a_variable(a, b):
    Variable("config", client=a).set({"lr": 0.1, "layers": [3, 4]})
    assert Variable("config", client=b).get() == {"lr": 0.1, "layers": [3, 4]}
    Variable("config", client=b).set("changed")
    assert Variable("config", client=a).get() == "changed"
    Variable("config", client=a).delete()
    with pytest.raises(TimeoutError, match="was not set within 0.2 s"):
        Variable("config", client=b).get(timeout=0.2)


def test_a_get_waits_until_another_client_sets_the_variable(a, b):
    later = threading.Timer(0.3, Variable("late", client=a).set, [42])
    later.start()
    start = time.monotonic()
    assert Variable("late", client=b).get(timeout=10) == 42
    assert time.monotonic() - start >= 0.25
    Variable("late", client=a).delete()


def test_two_clients_share_a_queue_first_in_first_out(a, b):
    producer, consumer = Queue("jobs", client=a), Queue("jobs", client=b)
    for i in range(5):
        producer.put(i)
    assert consumer.qsize() == 5
    assert [consumer.get() for _ in range(2)] == [0, 1]
    assert consumer.get(batch=2) == [2, 3]
    assert consumer.get(batch=True) == [4]
    assert consumer.get(batch=True) == []
    with pytest.raises(TimeoutError):
        consumer.get(timeout=0.1)


def test_a_bounded_queue_makes_put_wait_until_another_client_gets(a, b):
    producer = Queue("bounded", client=a, maxsize=1)
    producer.put("first")
    with pytest.raises(TimeoutError, match="stayed full"):
        producer.put("second", timeout=0.2)
    threading.Timer(0.3, Queue("bounded", client=b).get).start()
    producer.put("second", timeout=10)
    assert Queue("bounded", client=b).get(timeout=5) == "second"


def test_a_lock_passes_between_clients(a, b):
    mine, theirs = Lock("L", client=a), Lock("L", client=b)
    assert mine.acquire()
    assert theirs.locked()
    assert theirs.acquire(blocking=False) is False
    assert theirs.acquire(timeout=0.2) is False
    threading.Timer(0.3, mine.release).start()
    start = time.monotonic()
    assert theirs.acquire(timeout=10)
    assert time.monotonic() - start >= 0.25
    with pytest.raises(RuntimeError, match="released more often than acquired"):
        mine.release()
    theirs.release()
    assert not mine.locked()
    with Lock("L", client=a) as held:
        assert held.locked()
    assert not mine.locked()


def test_a_semaphore_bounds_holders_across_clients(a, b):
    ours, theirs = Semaphore(2, "pool", client=a), Semaphore(2, "pool", client=b)
    assert ours.acquire() and theirs.acquire()
    assert theirs.get_value() == 2
    assert ours.acquire(timeout=0.1) is False
    with pytest.raises(SchedulerError, match="has max_leases=2, not 3"):
        Semaphore(3, "pool", client=b).acquire(timeout=0)
    ours.release()
    assert ours.acquire(timeout=5)
    ours.release()
    theirs.release()
    assert ours.get_value() == 0


def test_an_event_wakes_a_waiter_in_another_client(a, b):
    event = Event("go", client=a)
    assert not event.is_set()
    assert Event("go", client=b).wait(timeout=0.1) is False
    threading.Timer(0.2, event.set).start()
    assert Event("go", client=b).wait(timeout=10) is True
    assert Event("go", client=b).is_set()
    event.clear()
    assert not Event("go", client=b).is_set()


def test_pub_sub_between_clients(a, b):
    sub = Sub("news", client=b)
    pub = Pub("news", client=a)
    for i in range(3):
        pub.put({"n": i})
    received = [msg for _, msg in zip(range(3), sub)]
    assert received == [{"n": 0}, {"n": 1}, {"n": 2}]
    with pytest.raises(TimeoutError, match="received nothing"):
        sub.get(timeout=0.1)
    sub.close()
    pub.put("nobody listens")  # dropped, as in dask


def test_primitives_with_asynchronous_clients(cluster):
    async def main():
        async with Client(cluster.address, security=cluster.security, asynchronous=True,
                          set_as_default=False) as c1, \
                Client(cluster.address, security=cluster.security, asynchronous=True,
                       set_as_default=False) as c2:
            await Variable("async", client=c1).set([1, 2])
            assert await Variable("async", client=c2).get() == [1, 2]
            await Variable("async", client=c1).delete()
            sub = await Sub("async-topic", client=c2)
            Pub("async-topic", client=c1).put("hi")
            assert await sub.get(timeout=5) == "hi"
            async with Lock("async-lock", client=c1):
                assert not await Lock("async-lock", client=c2).acquire(timeout=0.1)
            # a waiter cancelled on the client side is dropped by the scheduler; the
            # lock it might have been granted meanwhile is given back
            holder = Lock("async-lock", client=c1)
            assert await holder.acquire()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(Lock("async-lock", client=c2).acquire(), 0.2)
            await holder.release()
            assert await Lock("async-lock", client=c1).acquire(timeout=5)
            assert await Queue("async-q", client=c2).qsize() == 0

    asyncio.run(asyncio.wait_for(main(), 60))


def test_an_async_client_shares_a_collection_whose_graph_is_still_being_sent(cluster):
    """An asynchronous client sends a persisted dask collection's graph in the
    background; a Variable set right after waits for it (its Futures' keys must be
    known), and another client computes with the collection it gets."""
    da = pytest.importorskip("dask.array")

    async def main():
        async with Client(cluster.address, security=cluster.security, asynchronous=True,
                          set_as_default=False) as c1, \
                Client(cluster.address, security=cluster.security, asynchronous=True,
                       set_as_default=False) as c2:
            persisted = c1.persist(da.ones(300, chunks=1))
            await Variable("collection", client=c1).set(persisted)
            got = await Variable("collection", client=c2).get(timeout=30)
            assert await c2.compute(got.sum()) == 300
            await Variable("collection", client=c1).delete()

    asyncio.run(asyncio.wait_for(main(), 80))


# ---------------------------------------------------------------------------- futures inside


def test_a_future_in_a_variable_outlives_the_client_that_made_it(cluster, a):
    with connect(cluster) as maker:
        future = maker.submit(inc, 1, key="held-by-variable")
        assert future.result(timeout=30) == 2
        Variable("result", client=maker).set({"answer": future})
    # the maker closed: only the variable holds the task now
    time.sleep(0.2)
    got = Variable("result", client=a).get()["answer"]
    assert got.key == "held-by-variable" and got.client is a
    assert got.result(timeout=30) == 2
    assert a.submit(inc, got).result(timeout=30) == 3
    Variable("result", client=a).delete()
    del got
    wait_for(lambda: no_tasks_left(a), timeout=20)


def test_a_future_through_a_queue_survives_its_producer_releasing_it(a, b):
    future = a.submit(inc, 10, key="queued-future")
    Queue("futures", client=a).put(future)
    future.release()
    time.sleep(0.2)
    assert a.scheduler_info()["n_tasks"] == 1  # the queue holds it
    got = Queue("futures", client=b).get(timeout=10)
    assert got.result(timeout=30) == 11
    got.release()
    wait_for(lambda: no_tasks_left(a), timeout=20)


def test_futures_in_pub_sub_messages(a, b):
    sub = Sub("future-news", client=b)
    future = a.submit(inc, 20)
    Pub("future-news", client=a).put([future, "text"])
    future.release()
    got, text = sub.get(timeout=10)
    assert text == "text" and got.result(timeout=30) == 21
    del got
    sub.close()
    wait_for(lambda: no_tasks_left(a), timeout=20)


def test_a_future_cannot_be_pickled_outside_a_primitive_but_travels_in_task_arguments(a):
    future = a.submit(inc, 1)
    with pytest.raises(TypeError, match="share it through a Variable"):
        pickle.dumps(future)
    assert a.submit(sum, [future, future]).result(timeout=30) == 4  # in a collection


def test_a_restart_cancels_the_futures_a_variable_holds(a):
    future = a.submit(inc, 1)
    future.result(timeout=30)
    Variable("before-restart", client=a).set(future)
    del future
    a.restart(timeout=30)
    got = Variable("before-restart", client=a).get()
    with pytest.raises(CancelledError):
        got.result(timeout=10)
    Variable("before-restart", client=a).delete()
    del got
    a.wait_for_workers(1, timeout=30)
    wait_for(lambda: no_tasks_left(a), timeout=20)


def test_a_large_value_travels_out_of_band(a, b):
    value = bytes(range(256)) * (4 * 2**20 // 256)  # 4 MiB
    Variable("big", client=a).set(value)
    assert Variable("big", client=b).get() == value
    Variable("big", client=a).delete()


# ---------------------------------------------------------------------------- other processes


def use_primitives_in_a_task(address):
    """A task: opens a client (credentials from the worker's environment), takes a
    Future from a Variable, puts its result plus one in a Queue."""
    with Client(address, set_as_default=False) as client:
        future = Variable("task-input", client=client).get(timeout=30)
        value = future.result(timeout=30) + 1
        Queue("task-output", client=client).put(value)
        Lock("task-lock", client=client).acquire(timeout=30)
        return value


def test_a_task_uses_primitives_through_a_client_of_its_own(cluster, a):
    Variable("task-input", client=a).set(a.submit(inc, 99))
    task = a.submit(use_primitives_in_a_task, cluster.address, pure=False)
    assert Queue("task-output", client=a).get(timeout=60) == 101
    assert task.result(timeout=30) == 101
    # the task's client closed when the task ended: its lock went with it
    lock = Lock("task-lock", client=a)
    assert lock.acquire(timeout=10)
    lock.release()
    Variable("task-input", client=a).delete()


def wait_then_read(gate_name):
    """A task that passes no client: the primitives use the worker's."""
    Event(gate_name).wait(timeout=30)
    return Variable("after-gate").get(timeout=30)


def test_a_task_uses_primitives_through_the_workers_client(a):
    gate = Event("gate", client=a)
    task = a.submit(wait_then_read, gate.name, pure=False)
    Variable("after-gate", client=a).set("opened")
    time.sleep(0.2)
    assert not task.done()
    gate.set()
    assert task.result(timeout=30) == "opened"
    Variable("after-gate", client=a).delete()


HOLDER = """
import sys
from distributed_server import Client, Lock, Queue, Semaphore
with Client(sys.argv[1], set_as_default=False) as client:
    assert Lock("held", client=client).acquire()
    assert Semaphore(1, "lease", client=client).acquire()
    print("holding", flush=True)
    Queue("never-served", client=client).get()   # parked until the process dies
"""


def test_a_sigkilled_client_releases_its_lock_lease_and_parked_requests(cluster, a):
    holder = spawn_client(cluster, HOLDER)
    try:
        assert holder.stdout.readline().strip() == "holding"
        lock, lease = Lock("held", client=a), Semaphore(1, "lease", client=a)
        assert lock.locked() and lease.get_value() == 1
        assert lock.acquire(timeout=0.2) is False
        time.sleep(0.3)  # its Queue.get is parked at the scheduler
        holder.send_signal(signal.SIGKILL)
        start = time.monotonic()
        assert lock.acquire(timeout=10)
        assert lease.acquire(timeout=10)
        print(f"\nlock of a SIGKILLed client free after {time.monotonic() - start:.3f} s")
        queue = Queue("never-served", client=a)
        queue.put("still here")
        assert queue.qsize() == 1  # the dead client's get was dropped
        assert queue.get() == "still here"
        lock.release()
        lease.release()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


WAITER = """
import sys
from distributed_server import Client, Variable
with Client(sys.argv[1], set_as_default=False) as client:
    print("waiting", flush=True)
    print(Variable("between-processes", client=client).get(timeout=30).result(timeout=30),
          flush=True)
"""


def test_a_future_passes_between_client_processes(cluster, a):
    waiter = spawn_client(cluster, WAITER)
    try:
        assert waiter.stdout.readline().strip() == "waiting"
        Variable("between-processes", client=a).set(a.submit(inc, 6, key="seven"))
        assert waiter.stdout.readline().strip() == "7"
        assert waiter.wait(timeout=30) == 0
    finally:
        waiter.kill()
        waiter.wait()
        waiter.stdout.close()
    Variable("between-processes", client=a).delete()
    wait_for(lambda: no_tasks_left(a), timeout=20)


# ---------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_locally_with_a_clear_error(a):
    with pytest.raises(TypeError, match="name must be a str"):
        Variable(3, client=a)
    with pytest.raises(ValueError, match="1 to 256 characters"):
        Queue("q" * 300, client=a)
    with pytest.raises(TypeError, match="max_leases must be an int"):
        Semaphore("2", client=a)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        Variable("v", client=a).get(timeout=-1)
    with pytest.raises(ValueError, match="batch must be"):
        Queue("q", client=a).get(batch=0)
    with pytest.raises(ValueError, match="can't specify a timeout"):
        Lock("L", client=a).acquire(blocking=False, timeout=1)
    with pytest.raises(TypeError):
        Variable("v", client=a).set(threading.Lock())  # cannot be pickled


def test_an_oversized_value_is_refused_and_changes_nothing(a, b):
    variable = Variable("sized", client=a)
    variable.set("small")
    too_big = b"x" * (MAX_VALUE_BYTES + 1)
    with pytest.raises(ValueError, match="at most 16,777,216 bytes per value"):
        variable.set(too_big)
    with pytest.raises(ValueError, match="scatter it"):
        Queue("sized", client=a).put(too_big)
    # a client that skips its own check is refused by the scheduler, which keeps its
    # connection and changes nothing
    with pytest.raises(SchedulerError, match="at most 16,777,216 bytes per value"):
        raw_request(a, "variable-set", name="sized", value=too_big + b"\x80")
    with pytest.raises(SchedulerError, match="does not know"):
        raw_request(a, "variable-set", name="sized", value=pickle.dumps(1),
                    keys=["no-such-key"])
    with pytest.raises(SchedulerError, match="name must be a str"):
        raw_request(a, "queue-put", name=["q"], value=pickle.dumps(1))
    assert Variable("sized", client=b).get() == "small"
    assert Queue("sized", client=b).qsize() == 0
    variable.delete()


def test_the_scheduler_holds_no_more_than_its_limits_allow():
    """A scheduler with small limits: a value past the total refused, nothing changed."""
    from distributed_server.scheduler.coordination import CoordinationLimits

    async def main():
        limits = CoordinationLimits(max_total_bytes=1000, max_names=2)
        async with Scheduler(validate=True, coordination_limits=limits) as scheduler:
            async with Client(scheduler.address, asynchronous=True,
                              set_as_default=False) as client:
                await Variable("first", client=client).set(b"x" * 600)
                with pytest.raises(SchedulerError, match="does not fit"):
                    await Variable("second", client=client).set(b"y" * 600)
                await Variable("second", client=client).set(b"small")
                with pytest.raises(SchedulerError, match="holds 2 variables, the most"):
                    await Variable("third", client=client).set(1)
                assert await Variable("first", client=client).get() == b"x" * 600
                assert scheduler.coordination.summary()["variables"] == 2

    asyncio.run(asyncio.wait_for(main(), 30))
