"""Tasks that launch tasks (worker/task_context.py, client/worker_client.py) on real
worker processes: get_worker, get_client, secede/rejoin and worker_client, including a
fan-out that would deadlock a one-thread worker if waiting tasks kept their threads."""
import sys

import cloudpickle
import pytest

from distributed_server import (
    Client,
    LocalCluster,
    get_client,
    get_worker,
    rejoin,
    secede,
    worker_client,
)

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def inc(x):
    return x + 1


def fib(n):
    """Each call submits its two halves from inside a task and waits for them."""
    if n < 2:
        return n
    with worker_client() as client:
        a, b = client.submit(fib, n - 1), client.submit(fib, n - 2)
        return a.result() + b.result()


def where_am_i(x):
    return get_worker().address, x


def fan_out(n):
    client = get_client()
    futures = client.map(inc, range(n), pure=False)
    secede()
    total = sum(client.gather(futures))
    rejoin()
    return total


@pytest.fixture(scope="module")
def one_thread():
    with LocalCluster(n_workers=1, threads_per_worker=1, validate=True) as cluster, \
            Client(cluster, set_as_default=False) as client:
        yield client


def test_get_worker_names_the_worker_running_the_task(one_thread):
    (address,) = one_thread.scheduler_info()["workers"]
    assert one_thread.submit(where_am_i, 3).result(timeout=30) == (address, 3)
    with pytest.raises(ValueError, match="outside a task"):
        get_worker()


def test_a_one_thread_worker_runs_a_recursive_fan_out(one_thread):
    # fib(8) holds up to 8 waiting tasks at once on a worker with one thread.
    assert one_thread.submit(fib, 8).result(timeout=90) == 21


def test_secede_and_rejoin_around_a_gather_of_many_root_tasks(one_thread):
    assert one_thread.submit(fan_out, 50, pure=False).result(timeout=60) == sum(
        range(1, 51))
    # The pool is back to one thread: two sleepy tasks run one after the other.
    assert one_thread.gather(one_thread.map(inc, range(20))) == list(range(1, 21))
