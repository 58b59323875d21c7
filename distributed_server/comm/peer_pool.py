"""Pooled connections to workers' peer ports: one pool class for clients and workers.

A worker fetches task inputs from other workers (``get-data``) and a client fetches
results from workers and puts scattered data on them (``get-data``, ``put-data``,
``run``): both speak to the same peer port, and both keep a few idle connections per
worker for the next request. `PeerPool` is that pool. It only connects, lends and takes
back connections; what travels on them (one request and its answer, or an answer in
parts) stays with the caller, who gives a connection back only after a complete
exchange and aborts it after a failed one.
"""
from __future__ import annotations

from ..security import Security
from .framing import DEFAULT_MAX_FRAME_BYTES, Comm, connect

__all__ = ["PeerPool"]


class PeerPool:
    """Idle connections to peers, at most ``max_idle`` per peer address, for reuse.

    `connection` lends an idle open connection or opens a new one (the handshake says
    who we are: ``{"role": "client", ...}`` or ``{"role": "worker", ...}``); `give_back`
    keeps it for the next caller, or aborts it when the pool is full or closed. `close`
    aborts every idle connection and makes the pool keep none from then on.
    """

    __slots__ = ("_idle", "closed", "max_idle", "security")

    def __init__(self, security: Security | None, max_idle: int) -> None:
        self.security = security
        self.max_idle = max_idle
        self.closed = False
        self._idle: dict[str, list[Comm]] = {}

    async def connection(self, address: str, handshake: dict, timeout: float,
                         max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Comm:
        """An idle open connection to ``address``, else a new one (``connect``)."""
        idle = self._idle.get(address)
        while idle:
            comm = idle.pop()
            if not comm.closed:
                return comm
        return await connect(address, handshake, timeout=timeout, security=self.security,
                             max_frame_bytes=max_frame_bytes)

    def give_back(self, address: str, comm: Comm, keep: bool = True) -> None:
        """After a complete exchange: keep ``comm`` idle for reuse, unless ``keep`` is
        False, the pool is closed or already holds ``max_idle`` for this peer."""
        idle = self._idle.setdefault(address, [])
        if keep and not self.closed and len(idle) < self.max_idle:
            idle.append(comm)
        else:
            comm.abort()

    def idle(self, address: str) -> int:
        """How many idle connections to ``address`` the pool keeps now."""
        return len(self._idle.get(address, ()))

    def close(self) -> None:
        """Abort every idle connection; connections given back later are aborted too."""
        self.closed = True
        for idle in self._idle.values():
            for comm in idle:
                comm.abort()
        self._idle.clear()
