"""distributed-core's server shell: comms, the Scheduler server, Worker, Client, LocalCluster.

Everything here is plain Python on tornado and msgpack; the scheduling decisions are
made by the compiled state machine in ``distributed_core``, which the Scheduler holds.
"""
from distributed_core import COMPILED, __version__

from .client import CancelledError, Client, Future, as_completed, wait
from .cluster import LocalCluster
from .primitives import Event, Lock, Pub, Queue, Semaphore, Sub, Variable
from .scheduler import Scheduler
from .security import Security, SecurityError
from .worker import Worker

__all__ = [
    "COMPILED", "CancelledError", "Client", "Event", "Future", "LocalCluster", "Lock", "Pub",
    "Queue", "Scheduler", "Security", "SecurityError", "Semaphore", "Sub", "Variable",
    "Worker", "__version__", "as_completed", "wait",
]
