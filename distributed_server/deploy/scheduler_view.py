"""A read-only view of a running scheduler, for code written against dask's
``cluster.scheduler`` (``cluster.scheduler.workers.values()``, each worker's ``pid``).

The scheduler runs in a process of its own, so its objects cannot be handed out: a view
is a snapshot of what the scheduler reports about itself (``Client.scheduler_info()``'s
answer), taken when ``cluster.scheduler`` is read. Nothing in it changes the cluster.
"""
from __future__ import annotations

import types

__all__ = ["SchedulerView", "WorkerView"]


class WorkerView(types.SimpleNamespace):
    """One worker as the scheduler saw it: ``address``, ``name``, ``pid``, ``nthreads``,
    ``memory_limit`` (bytes, 0: none), ``nanny``, and its task and memory figures
    (``processing``, ``in_memory``, ``nbytes``, ``memory``, ...)."""

    def __repr__(self) -> str:
        return (f"<WorkerView {self.address!r} name={self.name!r} pid={self.pid} "
                f"nthreads={self.nthreads}>")


class SchedulerView:
    """A snapshot of the scheduler: ``address``, ``workers`` (address -> `WorkerView`),
    ``n_tasks``, ``task_counts`` (state -> number of tasks), ``compiled``, ``version``."""

    def __init__(self, identity: dict) -> None:
        self.address: str = identity["address"]
        self.compiled: bool = identity["compiled"]
        self.version: str = identity["version"]
        self.n_tasks: int = identity["n_tasks"]
        self.task_counts: dict = dict(identity["task_counts"])
        self.workers: dict = {
            address: WorkerView(address=address, **{k: v for k, v in figures.items()
                                                    if k != "address"})
            for address, figures in identity["workers"].items()}

    def __repr__(self) -> str:
        return (f"<SchedulerView {self.address!r}: {len(self.workers)} workers, "
                f"{self.n_tasks} tasks>")
