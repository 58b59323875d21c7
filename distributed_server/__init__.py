"""distributed-core's server shell: comms, the Scheduler server, Worker, Client, LocalCluster.

Everything here is plain Python on tornado and msgpack; the scheduling decisions are
made by the compiled state machine in ``distributed_core``, which the Scheduler holds.
"""
import importlib

from distributed_core import COMPILED, __version__

# What each public name is imported from, on first use (PEP 562): a worker, nanny or
# scheduler process imports only the modules of its role, not the client's (a third of a
# second less to start each process, which adapt() and scale() wait for).
_EXPORTS = {
    "ALL_COMPLETED": "client.client", "FIRST_COMPLETED": "client.client",
    "FIRST_EXCEPTION": "client.client", "CancelledError": "client.client",
    "Client": "client.client", "Future": "client.client", "as_completed": "client.client",
    "fire_and_forget": "client.client", "futures_of": "client.client",
    "wait": "client.client",
    "performance_report": "client.performance_report",
    "Event": "client.primitives", "Lock": "client.primitives", "Pub": "client.primitives",
    "Queue": "client.primitives", "Semaphore": "client.primitives",
    "Sub": "client.primitives", "Variable": "client.primitives",
    "progress": "client.progress",
    "get_client": "client.worker_client", "worker_client": "client.worker_client",
    "LocalCluster": "deploy.local_cluster", "SLURMCluster": "deploy.slurm",
    "SchedulerPlugin": "plugins", "WorkerPlugin": "plugins",
    "StoryEntry": "protocol.stories", "WorkerSilent": "protocol.stories",
    "Scheduler": "scheduler.server",
    "Security": "security", "SecurityError": "security",
    "Worker": "worker.server",
    "get_worker": "worker.task_context", "rejoin": "worker.task_context",
    "secede": "worker.task_context",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distributed_server' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "ALL_COMPLETED", "COMPILED", "CancelledError", "Client", "Event", "FIRST_COMPLETED",
    "FIRST_EXCEPTION", "Future", "LocalCluster", "Lock", "Pub", "Queue", "SLURMCluster", "Scheduler",
    "SchedulerPlugin", "Security", "SecurityError", "Semaphore", "StoryEntry", "Sub",
    "Variable", "Worker", "WorkerPlugin", "WorkerSilent", "__version__", "as_completed",
    "fire_and_forget", "futures_of", "get_client", "get_worker", "performance_report", "progress", "rejoin", "secede", "wait",
    "worker_client",
]
