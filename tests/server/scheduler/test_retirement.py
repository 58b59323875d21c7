"""Client.retire_workers, replicate and rebalance against real processes.

A ``dcore scheduler --validate`` process (its log must hold no ERROR line) and one nanny
running three worker processes, on loopback, fresh for each test. Results must survive
every move without being computed again: each key's scheduler story has exactly one
``processing -> memory``.
"""
import sys
import time
import warnings

import cloudpickle
import pytest
from server_helpers import children, nanny_client, nanny_processes, wait_for

from distributed_server.client.futures import SchedulerError

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIZE = 100_000


def make(i):
    return bytes(SIZE) + str(i).encode()


def expected(i):
    return bytes(SIZE) + str(i).encode()


@pytest.fixture
def cluster(tmp_path):
    yield from nanny_processes(tmp_path, "--nworkers", "3")


@pytest.fixture
def client(cluster):
    yield from nanny_client(cluster, 3)


def computed_once(client, futures) -> bool:
    """Every key went processing -> memory exactly once in the scheduler (never lost,
    never recomputed)."""
    story = client.story(*futures)
    for future in futures:
        entries = [e for e in story if e.key == future.key and e.where == "scheduler"
                   and (e.start, e.finish) == ("processing", "memory")]
        if len(entries) != 1:
            return False
    return True


def test_retiring_a_worker_moves_its_results_and_its_process_is_gone_for_good(cluster, client):
    futures = client.map(make, range(30), pure=False)
    assert client.gather(futures) == [expected(i) for i in range(30)]
    held = client.has_what()
    victim = max(held, key=lambda address: len(held[address]))
    assert held[victim]
    pids = {p.pid for p in children(cluster.main)}
    started = time.monotonic()
    retired = client.retire_workers([victim])
    print(f"\nretired a worker holding {len(held[victim])} results of {SIZE} bytes in "
          f"{time.monotonic() - started:.2f} s")
    assert list(retired) == [victim] and retired[victim]["in_memory"] == len(held[victim])
    assert victim not in client.scheduler_info()["workers"]
    assert all(victim not in holders and holders for holders in
               client.who_has(futures).values())
    assert client.gather(futures) == [expected(i) for i in range(30)]
    assert computed_once(client, futures)
    # the worker process exited cleanly and its nanny does not start it again
    wait_for(lambda: len(children(cluster.main)) == 2)
    time.sleep(2)
    assert len(children(cluster.main)) == 2 and len(client.scheduler_info()["workers"]) == 2
    assert len({p.pid for p in children(cluster.main)} - pids) == 0
    assert "exited cleanly; not restarting it" in cluster.log("nanny.log")
    assert client.submit(make, 99, pure=False).result(timeout=30) == expected(99)


def test_retiring_by_count_and_by_name(cluster, client):
    futures = client.map(make, range(12), pure=False)
    client.gather(futures)
    info = client.scheduler_info()["workers"]
    fewest = min(info, key=lambda a: (info[a]["nbytes"], info[a]["processing"], a))
    assert list(client.retire_workers(n=1)) == [fewest]
    name = next(w["name"] for a, w in client.scheduler_info()["workers"].items())
    retired = client.retire_workers(workers=[name])
    assert [w["name"] for w in retired.values()] == [name]
    assert len(client.scheduler_info()["workers"]) == 1
    assert client.gather(futures) == [expected(i) for i in range(12)]
    assert computed_once(client, futures)
    with pytest.raises(ValueError, match="workers= .* or n="):
        client.retire_workers()
    with pytest.raises(SchedulerError, match="no worker 'nobody'"):
        client.retire_workers(["nobody"])


def test_retirement_is_refused_when_no_other_worker_can_take_the_results(cluster, client):
    futures = client.map(make, range(12), pure=False)
    client.gather(futures)
    everyone = list(client.has_what())
    holding = [a for a, keys in client.has_what().items() if keys]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        retired = client.retire_workers(everyone)
    assert not set(retired) & set(holding)
    texts = [str(w.message) for w in caught]
    assert len(texts) == len(holding)
    assert all("could not be copied to another worker (no other running worker can take "
               "them" in text for text in texts)
    # the refused workers hold their results and take tasks again
    assert client.gather(futures) == [expected(i) for i in range(12)]
    assert computed_once(client, futures)
    assert client.submit(make, 7, pure=False).result(timeout=30) == expected(7)
    assert "could not retire worker" in cluster.log()


def test_a_retired_worker_left_connected_takes_no_task_and_holds_nothing(cluster, client):
    futures = client.map(make, range(12), pure=False)
    client.gather(futures)
    held = client.has_what()
    victim = max(held, key=lambda address: len(held[address]))
    assert list(client.retire_workers([victim], close_workers=False)) == [victim]
    assert victim in client.scheduler_info()["workers"]
    wait_for(lambda: not client.has_what([victim])[victim])
    more = client.map(make, range(100, 130), pure=False)
    client.gather(more)
    assert not client.has_what([victim])[victim]
    assert client.gather(futures) == [expected(i) for i in range(12)]
    assert computed_once(client, futures)


def test_replicate_to_two_then_back_to_one(cluster, client):
    futures = client.map(make, range(6), pure=False)
    client.gather(futures)
    client.replicate(futures, n=2)
    who_has = client.who_has(futures)
    assert all(len(set(holders)) == 2 for holders in who_has.values()), who_has
    client.replicate(futures)  # every worker
    assert all(len(holders) == 3 for holders in client.who_has(futures).values())
    client.replicate(futures, n=1)
    assert all(len(holders) == 1 for holders in client.who_has(futures).values())
    assert client.gather(futures) == [expected(i) for i in range(6)]
    assert computed_once(client, futures)


def test_rebalance_moves_results_off_the_worker_holding_most(cluster, client):
    first = sorted(client.scheduler_info()["workers"])[0]
    futures = client.map(make, range(30), workers=[first], pure=False)
    client.gather(futures)
    assert len(client.has_what()[first]) == 30
    client.rebalance()
    counts = sorted(len(keys) for keys in client.has_what().values())
    print(f"\nrebalance of 30 results from one worker of three: {counts}")
    assert counts == [10, 10, 10]
    assert all(len(holders) == 1 for holders in client.who_has(futures).values())
    assert client.gather(futures) == [expected(i) for i in range(30)]
    assert computed_once(client, futures)
