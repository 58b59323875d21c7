"""Tasks that launch tasks, as in dask: ``get_client`` and ``worker_client``.

``get_client()`` in a task returns one `Client` per worker process, connected to the
worker's scheduler with the worker's credentials, made on first use and closed with the
worker; elsewhere it returns the default client. ``with worker_client() as client:``
gives the task's thread back to the worker for the duration of the block (``secede`` and
``rejoin``, worker/task_context.py).
"""
from __future__ import annotations

import contextlib

from ..worker.task_context import rejoin, running_worker, secede

__all__ = ["get_client", "worker_client"]


def get_client(timeout: float | None = None):
    """In a task: the worker's `Client` (one per worker process). Elsewhere: the
    default client (the most recent one made with ``set_as_default=True``)."""
    worker = running_worker()
    if worker is None:
        from .futures import default_client
        return default_client()
    return worker.task_client(timeout)


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
