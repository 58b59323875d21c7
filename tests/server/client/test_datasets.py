"""Published datasets end to end: real ``dcore`` processes on loopback.

A ``dcore scheduler --validate`` process (its log must hold no ERROR line) and one nanny
with a worker of two threads. Clients in this process and in a process of their own
publish values and Futures by name, get them, list and unpublish them, with dask's
calls; the tasks of published Futures outlive the client that made them until the
dataset is unpublished. Bad input is refused with a clear error and changes nothing.
"""
import asyncio
import functools
import subprocess
import sys
import time

import cloudpickle
import pytest
from server_helpers import one_nanny_cluster, wait_for

from distributed_server import Client
from distributed_server.client.futures import SchedulerError
from distributed_server.client.primitives import MAX_VALUE_BYTES

pytestmark = pytest.mark.timeout(90)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def inc(x):
    return x + 1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A validating scheduler and one nanny of one worker with two threads."""
    with one_nanny_cluster(tmp_path_factory.mktemp("datasets"), "--nthreads", "2") as processes:
        yield processes


def connect(cluster) -> Client:
    return Client(cluster.address, security=cluster.security, set_as_default=False)


@pytest.fixture
def a(cluster):
    with connect(cluster) as c:
        c.wait_for_workers(1, timeout=30)
        yield c
        for name in c.list_datasets():
            c.unpublish_dataset(name)
    cluster.assert_no_errors()


@pytest.fixture
def b(cluster):
    with connect(cluster) as c:
        yield c


def raw_request(client, op: str, **fields):
    """A request as a client that skips its own checks would send it."""
    return client._sync(functools.partial(client._request, op, **fields))


def no_tasks_left(client) -> bool:
    return client.scheduler_info()["n_tasks"] == 0


def test_a_value_published_by_one_client_is_got_by_another(a, b):
    a.publish_dataset({"lr": 0.1}, name="config")
    assert b.get_dataset("config") == {"lr": 0.1}
    assert b.list_datasets() == ["config"]
    b.unpublish_dataset("config")
    assert a.list_datasets() == []


def test_publish_by_keyword_and_by_collection_name(a, b):
    class Named:
        def __init__(self, name):
            self.name = name

    a.publish_dataset(Named("frame-1"), x=1, y=[2, 3])
    assert sorted(b.list_datasets()) == ["frame-1", "x", "y"]
    assert b.get_dataset("frame-1").name == "frame-1"
    assert b.get_dataset("y") == [2, 3]
    a.publish_dataset(1, 2, name="pair")  # several values under one name: a tuple
    assert b.get_dataset("pair") == (1, 2)


def test_a_published_name_is_refused_again_unless_override(a, b):
    a.publish_dataset(x=1)
    with pytest.raises(KeyError, match="'x' already exists"):
        b.publish_dataset(x=2, z=3)
    assert b.get_dataset("x") == 1 and "z" not in b.list_datasets()  # all or none
    b.publish_dataset(x=2, override=True)
    assert a.get_dataset("x") == 2


def test_get_dataset_of_an_unknown_name_raises_key_error_or_gives_the_default(a):
    with pytest.raises(KeyError, match="Dataset 'nope' not found"):
        a.get_dataset("nope")
    assert a.get_dataset("nope", default=None) is None
    a.unpublish_dataset("nope")  # as in dask: not an error


def test_the_datasets_mapping(a, b):
    a.datasets["m"] = {"k": 1}
    assert "m" in b.datasets and len(b.datasets) == 1 and list(b.datasets) == ["m"]
    assert b.datasets["m"] == {"k": 1}
    with pytest.raises(KeyError, match="already exists"):
        b.datasets["m"] = 2
    del b.datasets["m"]
    assert "m" not in a.datasets
    with pytest.raises(KeyError, match="not found"):
        del a.datasets["m"]
    with pytest.raises(KeyError):
        a.datasets["m"]


def test_published_futures_outlive_their_client_until_unpublished(cluster, a):
    with connect(cluster) as maker:
        future = maker.submit(inc, 1, key="published-future")
        assert future.result(timeout=30) == 2
        maker.publish_dataset(answer=future, more={"f": future})
    time.sleep(0.2)  # the maker left: only the dataset holds the task
    assert a.scheduler_info()["n_tasks"] == 1
    got = a.get_dataset("answer")
    assert got.key == "published-future" and got.client is a
    assert got.result(timeout=30) == 2
    assert a.submit(inc, a.get_dataset("more")["f"]).result(timeout=30) == 3
    a.unpublish_dataset("answer")
    a.unpublish_dataset("more")
    assert a.scheduler_info()["n_tasks"] >= 1  # this client still holds its Future
    del got
    wait_for(lambda: no_tasks_left(a), timeout=20)


def test_unpublishing_releases_the_futures_nobody_else_holds(a):
    futures = a.map(inc, range(5), key=[f"ds-{i}" for i in range(5)])
    a.publish_dataset(futures, name="many")
    del futures
    time.sleep(0.2)
    assert a.scheduler_info()["n_tasks"] == 5
    a.unpublish_dataset("many")
    wait_for(lambda: no_tasks_left(a), timeout=20)


def test_a_client_in_another_process_gets_the_dataset_and_its_results(cluster, a):
    future = a.submit(inc, 41, key="for-another-process")
    a.publish_dataset(shared=future)
    script = ("import sys\n"
              "from distributed_server import Client\n"
              "with Client(sys.argv[1]) as c:\n"
              "    print(c.get_dataset('shared').result(timeout=30), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script, cluster.address], env=cluster.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "42"


def test_a_dask_collection_published_and_computed_elsewhere(a, b):
    da = pytest.importorskip("dask.array")
    x = a.persist(da.ones((40, 40), chunks=(10, 10)))
    a.publish_dataset(x, name="ones")
    del x
    got = b.get_dataset("ones")
    assert float(b.compute(got.sum()).result(timeout=30)) == 1600.0


def test_an_asynchronous_client_publishes_and_gets(cluster):
    async def main():
        async with Client(cluster.address, security=cluster.security, asynchronous=True,
                          set_as_default=False) as c:
            await c.publish_dataset(v=[1, 2], override=True)
            assert await c.get_dataset("v") == [1, 2]
            assert await c.list_datasets() == ["v"]
            assert await c.datasets["v"] == [1, 2]
            with pytest.raises(TypeError, match="synchronous client"):
                len(c.datasets)
            await c.unpublish_dataset("v")

    asyncio.run(main())


def test_bad_input_is_refused_clearly_and_changes_nothing(a):
    with pytest.raises(TypeError, match="name must be a str"):
        a.publish_dataset(1, name=3)
    with pytest.raises(TypeError, match="name must be a str"):
        a.get_dataset(("a", 1))
    with pytest.raises(ValueError, match="If name is provided"):
        a.publish_dataset(name="x")
    with pytest.raises(ValueError, match="needs something to publish"):
        a.publish_dataset()
    with pytest.raises(ValueError, match="must be a dask collection"):
        a.publish_dataset(5)
    with pytest.raises(ValueError, match=f"a dataset holds at most {MAX_VALUE_BYTES:,}"):
        a.publish_dataset(big=b"x" * (MAX_VALUE_BYTES + 1))
    # what a client that skips its own checks sends is refused by the scheduler too
    with pytest.raises(SchedulerError, match="must be a str"):
        raw_request(a, "dataset-put", datasets=[{"name": 7, "value": b"x", "keys": []}],
                    override=False)
    with pytest.raises(SchedulerError, match="does not know"):
        raw_request(a, "dataset-put", override=False,
                    datasets=[{"name": "ghost", "value": b"x", "keys": ["no-such-key"]}])
    assert a.list_datasets() == []
