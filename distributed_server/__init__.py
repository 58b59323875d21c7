"""distributed-core's server shell: comms, the Scheduler server, Worker, Client, LocalCluster.

Everything here is plain Python on tornado and msgpack; the scheduling decisions are
made by the compiled state machine in ``distributed_core``, which the Scheduler holds.
"""
from distributed_core import COMPILED, __version__

from .client.client import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    CancelledError,
    Client,
    Future,
    as_completed,
    fire_and_forget,
    futures_of,
    wait,
)
from .client.performance_report import performance_report
from .client.primitives import Event, Lock, Pub, Queue, Semaphore, Sub, Variable
from .client.progress import progress
from .client.worker_client import get_client, worker_client
from .deploy.local_cluster import LocalCluster
from .plugins import SchedulerPlugin, WorkerPlugin
from .protocol.stories import StoryEntry, WorkerSilent
from .scheduler.server import Scheduler
from .security import Security, SecurityError
from .worker.server import Worker
from .worker.task_context import get_worker, rejoin, secede

__all__ = [
    "ALL_COMPLETED", "COMPILED", "CancelledError", "Client", "Event", "FIRST_COMPLETED",
    "FIRST_EXCEPTION", "Future", "LocalCluster", "Lock", "Pub", "Queue", "Scheduler",
    "SchedulerPlugin", "Security", "SecurityError", "Semaphore", "StoryEntry", "Sub",
    "Variable", "Worker", "WorkerPlugin", "WorkerSilent", "__version__", "as_completed",
    "fire_and_forget", "futures_of", "get_client", "get_worker", "performance_report", "progress", "rejoin", "secede", "wait",
    "worker_client",
]
