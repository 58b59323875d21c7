"""What a running task knows about where it runs: ``get_worker``, ``secede``, ``rejoin``,
and the client factory through which a task gets its worker's client.

A worker's executor thread records which task it runs (thread-local, `enter_task` /
`leave_task`). A task that waits for other tasks must not hold one of the worker's
threads meanwhile, or a cluster whose threads all wait deadlocks: ``secede()`` gives the
thread back (the worker starts another executor thread at once, and the scheduler stops
counting the task against the worker's threads); ``rejoin()`` makes it an executor thread
again once it is done waiting (one executor thread retires after its current task, so the
count comes back to ``nthreads``).

The worker never imports the client: the client side installs the factory that makes a
task's client (`install_client_factory`, done when `distributed_server.client` is
imported), and `Worker.task_client` calls it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["enter_task", "get_worker", "install_client_factory", "leave_task", "make_client",
           "rejoin", "running_worker", "secede"]

_task = threading.local()  # .worker, .key, .seceded on an executor thread running a task
_client_factory: Callable | None = None


def running_worker():
    """The `Worker` running the current task, or None outside a task."""
    return getattr(_task, "worker", None)


def get_worker():
    """The `Worker` running the current task; ValueError outside a task."""
    worker = running_worker()
    if worker is None:
        raise ValueError("get_worker() was called outside a task running on a worker")
    return worker


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


def enter_task(worker, key) -> None:
    """The executor thread starts running ``key`` (worker/executor.py)."""
    _task.worker = worker
    _task.key = key
    _task.seceded = False


def leave_task() -> bool:
    """The task is done; True if it had seceded (its thread is an extra one)."""
    seceded = getattr(_task, "seceded", False)
    _task.worker = _task.key = None
    _task.seceded = False
    return seceded


def install_client_factory(factory: Callable) -> None:
    """Set what makes a task's client: ``factory(address, security=, timeout=, name=)``."""
    global _client_factory
    _client_factory = factory


def make_client(address: str, **kwargs):
    """A new client for tasks on a worker, made by the installed factory."""
    if _client_factory is None:
        raise RuntimeError("no client factory is installed: import "
                           "distributed_server.client.client (get_client does) before tasks "
                           "ask for a client")
    return _client_factory(address, **kwargs)
