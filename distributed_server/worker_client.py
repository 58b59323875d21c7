"""Tasks that launch tasks: ``get_worker``, ``get_client``, ``secede``, ``rejoin`` and
``worker_client``, as in dask.

A worker's executor thread records which task it runs (thread-local). ``get_client()``
in a task returns one `Client` per worker process, connected to the worker's scheduler
with the worker's credentials, made on first use and closed with the worker.

A task that waits for other tasks must not hold one of the worker's threads meanwhile, or
a cluster whose threads all wait deadlocks: ``secede()`` gives the thread back (the
worker starts another executor thread at once, and the scheduler stops counting the task
against the worker's threads); ``rejoin()`` makes it an executor thread again once it
is done waiting (one executor thread retires after its current task, so the count comes
back to ``nthreads``). ``with worker_client() as client:`` does both around a block.
"""
from __future__ import annotations

import contextlib
import threading

__all__ = ["get_client", "get_worker", "rejoin", "secede", "worker_client"]

_task = threading.local()  # .worker, .key, .seceded on an executor thread running a task


def get_worker():
    """The `Worker` running the current task; ValueError outside a task."""
    worker = getattr(_task, "worker", None)
    if worker is None:
        raise ValueError("get_worker() was called outside a task running on a worker")
    return worker


def get_client(timeout: float | None = None):
    """In a task: the worker's `Client` (one per worker process). Elsewhere: the
    default client (the most recent one made with ``set_as_default=True``)."""
    worker = getattr(_task, "worker", None)
    if worker is None:
        from .futures import default_client
        return default_client()
    return worker.task_client(timeout)


def secede() -> None:
    """Give this task's executor thread back to the worker (see the module's text)."""
    worker = get_worker()
    if _task.seceded:
        return
    _task.seceded = True
    worker.task_seceded(_task.key)


def rejoin() -> None:
    """Make a seceded task's thread an executor thread again."""
    worker = get_worker()
    if not _task.seceded:
        return
    _task.seceded = False
    worker.task_rejoined()


@contextlib.contextmanager
def worker_client(timeout: float | None = None):
    """``with worker_client() as client:``: the worker's client, with the thread given
    back for the duration of the block."""
    client = get_client(timeout)
    secede()
    try:
        yield client
    finally:
        rejoin()


def enter_task(worker, key) -> None:
    """The executor thread starts running ``key`` (worker.py)."""
    _task.worker = worker
    _task.key = key
    _task.seceded = False


def leave_task() -> bool:
    """The task is done; True if it had seceded (its thread is an extra one)."""
    seceded = getattr(_task, "seceded", False)
    _task.worker = _task.key = None
    _task.seceded = False
    return seceded
