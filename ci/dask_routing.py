"""A pytest plugin that sends every dask compute of a test session to a distributed-core
cluster: ``pytest -p dask_routing`` (with this folder on ``PYTHONPATH``).

At the start of the session it starts a `LocalCluster` of real worker processes and a
`Client`; from then on whichever scheduler a test asks dask for — none, ``"sync"``,
``"threads"``, ``"processes"``, a pool — dask's ``get_scheduler`` hands back the client's
``get``, so the graph goes through this project's scheduler and workers. A scheduler that
a test passes as its own callable (a test of dask's scheduler API) is left alone. Used by
ci/dask_oracle.py to run dask's own test files through this project.
"""
from __future__ import annotations

import os

import dask.base

_state: dict = {}


def _routed(original):
    def get_scheduler(get=None, scheduler=None, collections=None, cls=None):
        chosen = original(get=get, scheduler=scheduler, collections=collections, cls=cls)
        if callable(scheduler) and not isinstance(scheduler, str):
            return chosen  # the test's own scheduler function
        _state["routed"] = _state.get("routed", 0) + 1
        return _state["client"].get
    return get_scheduler


def pytest_configure(config):
    from distributed_server import Client, LocalCluster

    workers = int(os.environ.get("DCORE_ORACLE_WORKERS", "2"))
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1)
    _state["cluster"] = cluster
    _state["client"] = Client(cluster, set_as_default=False)
    _state["original"] = dask.base.get_scheduler
    dask.base.get_scheduler = _routed(dask.base.get_scheduler)


def pytest_unconfigure(config):
    if "original" in _state:
        dask.base.get_scheduler = _state.pop("original")
    client, cluster = _state.pop("client", None), _state.pop("cluster", None)
    if client is not None:
        client.close()
    if cluster is not None:
        cluster.close()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"dask_routing: {_state.get('routed', 0)} computes ran on distributed-core")
