"""What a worker tells the scheduler about itself, checked: its handshake (listen
address, threads, name, resources, dashboard URL) and the memory and CPU figures of its
heartbeats. A value of the wrong shape raises `MessageError` (the worker is refused, or
its connection closed); the state machine checks the values it keeps itself.
"""
from __future__ import annotations

from distributed_core import bounded_repr

from ..comm import parse_address
from .streams import MessageError, require

__all__ = ["MAX_CPU", "NO_MEMORY_FIGURES", "heartbeat_advice", "memory_figures",
           "worker_handshake", "worker_process"]

#: A worker's memory figures before its first heartbeat (or from one that sent none).
NO_MEMORY_FIGURES = {"memory": None, "managed": None, "spilled": None, "spilled_count": None,
                     "paused": False, "cpu": None}
#: The most CPU a heartbeat may claim, in cores.
MAX_CPU = 1e5


#: Heartbeats per second the scheduler asks of all its workers together, once they are
#: many: each worker then beats every n / this seconds (dask slows its workers' heartbeats
#: with the cluster's size too: 6 s at 1,000), so that 1,000 idle workers cost the
#: scheduler what 100 beating every second do (each costs it ~0.3 ms of CPU here, most
#: of it the answer's write; benchmarks/many_workers.py).
HEARTBEATS_PER_SECOND = 100
#: The slowest heartbeat asked of a worker: well inside a worker's scheduler-timeout
#: (60 s) and the scheduler's worker-ttl (300 s).
MAX_HEARTBEAT_SECONDS = 15.0


def heartbeat_advice(n_workers: int) -> float | None:
    """The heartbeat interval (seconds) the scheduler asks of each of its ``n_workers``
    workers in its answer to their heartbeats, or None while they are few enough for
    their own (1 s by default): a worker beats at its own interval or this one,
    whichever is slower."""
    if n_workers <= HEARTBEATS_PER_SECOND:
        return None
    return min(n_workers / HEARTBEATS_PER_SECOND, MAX_HEARTBEAT_SECONDS)


def worker_process(info: dict) -> dict:
    """The process facts of a worker's handshake, checked: ``pid`` and ``memory_limit``
    (bytes, 0: none), each an int or absent (None: an older worker did not say)."""
    process = {}
    for name in ("pid", "memory_limit"):
        value = info.get(name)
        require(value is None or (type(value) is int and 0 <= value <= 2**62),
                f"a worker's {name!r} must be an int >= 0, not {bounded_repr(value, 60)}")
        process[name] = value
    return process


def worker_handshake(info: dict, scheme: str) -> tuple:
    """Check a worker's handshake: (address, nthreads, name, resources, dashboard).

    The state machine checks the values themselves; this checks the message's shape.
    ``dashboard``, the URL of the worker's HTTP server, is optional (see also
    `worker_process`)."""
    address = info.get("address")
    try:
        require(parse_address(address)[0] == scheme,
                f"a worker of this cluster listens on {scheme}://, not {address!r}")
    except ValueError as exc:
        raise MessageError(f"worker handshake needs its listen 'address': {exc}") from None
    dashboard = info.get("dashboard")
    require(dashboard is None or (isinstance(dashboard, str) and len(dashboard) <= 300
                                  and dashboard.startswith(("http://", "https://"))
                                  and dashboard.isprintable()),
            f"a worker's 'dashboard' must be an http(s) URL, not "
            f"{bounded_repr(dashboard, 100)}")
    return (address, info.get("nthreads", 1), info.get("name"), info.get("resources"),
            dashboard)


def memory_figures(msg: dict, address: str) -> dict:
    """The memory figures of a worker's heartbeat, checked: byte counts are ints from 0
    to 2**62 or absent/None (unknown), ``paused`` a bool."""
    figures = {}
    for name in ("memory", "managed", "spilled", "spilled_count"):
        value = msg.get(name)
        require(value is None or (type(value) is int and 0 <= value <= 2**62),
                f"heartbeat from {address}: {name} must be bytes, not "
                f"{bounded_repr(value, 60)}")
        figures[name] = value
    cpu = msg.get("cpu")
    require(cpu is None or (type(cpu) in (int, float) and 0 <= cpu <= MAX_CPU),
            f"heartbeat from {address}: cpu must be a number of cores, not "
            f"{bounded_repr(cpu, 60)}")
    figures["cpu"] = cpu
    paused = msg.get("paused", False)
    require(type(paused) is bool, f"heartbeat from {address}: paused must be a bool, not "
                                  f"{bounded_repr(paused, 60)}")
    figures["paused"] = paused
    return figures
