"""dask users' code, unchanged: what a dask.distributed user writes and expects to run
(issue 24), each against a real LocalCluster of worker processes with a validating
scheduler.

- scheduler keywords dask forwards (``x.compute(num_workers=4)``) are accepted;
- keys holding numpy scalars (``vindex``) are made plain before they travel;
- one rule for sync, async and on-loop calls, per method family: a call made on the
  client's own loop returns an awaitable, as in dask.distributed;
- ``Client(cluster.scheduler_address)`` finds the credentials of a LocalCluster this
  process started; another process does not;
- dask's config holds a name, not the client, so it can be deep-copied;
- ``cluster.scheduler`` is a read-only view of the scheduler's workers (with their pids);
- notebooks get an HTML summary of a Client and a Future.

Functions defined here travel by value (`register_pickle_by_value`): the worker
processes cannot import this module.
"""
from __future__ import annotations

import copy
import inspect
import os
import subprocess
import sys
import threading

import cloudpickle
import psutil
import pytest

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
np = pytest.importorskip("numpy")

import dask.config  # noqa: E402

from distributed_server import Client, LocalCluster, futures_of, wait  # noqa: E402
from distributed_server.client.futures import Future  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def inc(x):
    return x + 1


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, validate=True,
                      dashboard_address=":0") as c:
        yield c


@pytest.fixture
def client(cluster):
    with Client(cluster) as c:
        yield c


# ---------------------------------------------------------------- keywords and keys


def test_scheduler_keywords_dask_forwards_are_accepted(client):
    x = da.arange(10, chunks=3) + 1
    assert int(x.sum().compute(num_workers=4)) == 55
    assert dask.compute(x.sum(), bogus_keyword=1) == (55,)
    assert client.get({"a": (inc, 1), "b": (inc, "a")}, "b", bogus=1, sync=True) == 3
    assert client.compute(x.sum(), fifo_timeout="60s").result() == 55
    assert int(client.persist(x, bogus=1).sum().compute()) == 55


def test_keys_with_numpy_integers_are_made_plain(client):
    x = da.arange(10, chunks=3)
    picked = x.vindex[[1, 5, 7]]
    assert any(isinstance(part, np.integer) for key in picked.__dask_graph__()
               if isinstance(key, tuple) for part in key)
    assert picked.compute().tolist() == [1, 5, 7]
    graph = {("x", np.int64(0)): (inc, 1), ("x", np.int64(1)): (inc, ("x", np.int64(0)))}
    assert client.get(graph, [("x", np.int64(1))]) == [3]
    persisted = client.persist(picked)
    futures = futures_of(persisted)
    wait(futures)
    held = client.who_has(futures)  # held, and asked about, under their plain keys
    assert held and all(type(part) in (str, int) for key in held for part in key)
    assert persisted.compute().tolist() == [1, 5, 7]


# ---------------------------------------------------------------- sync, async, on the loop


def test_a_sync_client_on_its_own_loop_returns_awaitables_per_method_family(client):
    """Inside a coroutine run with ``client.sync`` every method that waits for the
    cluster returns an awaitable (dask.distributed's rule); outside it blocks."""
    futures = client.map(inc, range(4))
    wait(futures)
    assert not client.asynchronous

    async def on_the_loop():
        assert client.asynchronous  # the rule, as the client reports it
        found = {}
        # results
        found["gather"] = await client.gather(futures)
        found["result"] = await futures[0].result()
        found["exception"] = await futures[0].exception()
        # submission returns futures directly, in every context
        submitted = client.submit(inc, 10)
        mapped = client.map(inc, [20, 21])
        assert isinstance(submitted, Future) and all(isinstance(f, Future) for f in mapped)
        found["submitted"] = await client.gather([submitted, *mapped])
        # data in
        [scattered] = await client.scatter([5])
        found["scatter"] = await scattered.result()
        # information about the cluster
        found["info"] = len((await client.scheduler_info())["workers"])
        found["nthreads"] = sum((await client.nthreads()).values())
        found["who_has"] = set(await client.who_has(futures[:1]))
        # dask collections and graphs
        total = da.arange(6, chunks=2).sum()
        found["compute"] = int(await client.compute(total, sync=True))
        found["get"] = await client.get({"a": (inc, 1)}, "a")
        # waiting
        await client.sync(lambda: asyncio_sleep_zero())  # nested sync: an awaitable too
        return found

    found = client.sync(on_the_loop)
    assert found == {"gather": [1, 2, 3, 4], "result": 1, "exception": None,
                     "submitted": [11, 21, 22], "scatter": 5, "info": 2, "nthreads": 2,
                     "who_has": {futures[0].key}, "compute": 15, "get": 2}
    # and off the loop the same methods block again
    assert client.gather(futures) == [1, 2, 3, 4]
    assert not inspect.isawaitable(client.scheduler_info())


async def asyncio_sleep_zero():
    import asyncio

    await asyncio.sleep(0)
    return None


def test_every_public_method_that_waits_is_awaitable_on_the_loop(client):
    """Each public method that waits for the cluster, called on the client's loop,
    returns an awaitable instead of blocking (which would deadlock the loop)."""
    future = client.submit(inc, 1)
    wait([future])
    calls = {
        "gather": lambda: client.gather([future]),
        "scheduler_info": client.scheduler_info,
        "who_has": client.who_has,
        "has_what": client.has_what,
        "nthreads": client.nthreads,
        "run": lambda: client.run(os.getpid),
        "wait_for_workers": lambda: client.wait_for_workers(1),
        "cancel": lambda: client.cancel([client.submit(inc, 99)]),
        "story": lambda: client.story(future.key),
        "get_scheduler_logs": client.get_scheduler_logs,
        "get_versions": client.get_versions,
        "list_datasets": client.list_datasets,
    }

    async def on_the_loop():
        returned = {}
        for name, call in calls.items():
            value = call()
            returned[name] = inspect.isawaitable(value)
            if returned[name]:
                await value
        return returned

    assert client.sync(on_the_loop) == dict.fromkeys(calls, True)


def test_done_callbacks_may_block_as_in_dask(client):
    seen = []
    done = threading.Event()

    def callback(future):
        seen.append((future.result(), client.scheduler_info()["address"]))
        done.set()

    client.submit(inc, 41).add_done_callback(callback)
    assert done.wait(10)
    assert seen == [(42, client.scheduler_address)]


# ---------------------------------------------------------------- credentials and config


def test_a_client_finds_the_credentials_of_a_local_cluster_by_its_address(cluster):
    with Client(cluster.scheduler_address, set_as_default=False) as c:
        assert c.submit(inc, 1).result() == 2
        assert c.security is cluster.security
    host_port = cluster.scheduler_address.split("://", 1)[1]
    with Client(host_port, set_as_default=False) as c:
        assert c.submit(inc, 2).result() == 3


def test_another_process_cannot_use_the_address_without_the_secret(cluster):
    code = ("import sys\nfrom distributed_server import Client\n"
            "try:\n    Client(sys.argv[1], timeout=5)\nexcept Exception as e:\n"
            "    print('refused', type(e).__name__)\nelse:\n    print('admitted')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCORE_")}
    out = subprocess.run([sys.executable, "-c", code, cluster.scheduler_address],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.startswith("refused"), (out.stdout, out.stderr)


def test_dask_config_holds_a_name_so_it_can_be_deep_copied(cluster):
    with Client(cluster) as c:
        assert dask.config.get("scheduler") == "distributed-core"
        snapshot = copy.deepcopy(dask.config.config)
        assert snapshot["scheduler"] == "distributed-core"
        assert int(da.ones(4, chunks=2).sum().compute()) == 4  # the name finds c
        persisted = da.ones(4, chunks=2).persist()  # dask asks the client to persist
        futures = futures_of(persisted)
        assert len(futures) == 2 and all(f.client is c for f in futures)
        with Client(cluster) as inner:
            assert dask.config.get("scheduler") == "distributed-core"
            assert int(da.ones(2, chunks=1).sum().compute()) == 2
            del inner
        # the outer client is the default again
        assert int(da.ones(3, chunks=1).sum().compute()) == 3
    assert dask.config.get("scheduler", None) is None


# ---------------------------------------------------------------- cluster.scheduler, repr


def test_cluster_scheduler_is_a_read_only_view_with_the_workers_pids(cluster):
    view = cluster.scheduler
    assert len(view.workers) == 2 and view.address == cluster.scheduler_address
    workers = list(view.workers.values())
    for worker in workers:
        assert worker.nthreads == 1 and worker.name.startswith("worker-")
        process = psutil.Process(worker.pid)
        assert "distributed_server" in " ".join(process.cmdline())
        assert worker.memory_limit == cluster.memory_limit
    assert view.n_tasks == sum(view.task_counts.values())


def test_notebooks_get_a_summary_of_a_client_and_a_future(client):
    future = client.submit(inc, 1)
    future.result()
    summary = client._repr_html_()
    assert "<table>" in summary and client.scheduler_address in summary
    assert "<th style='text-align:left'>workers</th><td style='text-align:left'>2</td>" \
        in summary
    assert "dashboard" in summary and "token=" in summary  # the link carries the token
    shown = future._repr_html_()
    assert "finished" in shown and "int" in shown and future.key in shown
