"""Pooled connections to workers' peer ports, and the request/answer exchange on them:
one pool class for clients and workers.

A worker fetches task inputs from other workers (``get-data``) and a client fetches
results from workers and puts scattered data on them (``get-data``, ``put-data``,
``run``): both speak to the same peer port, and both keep a few idle connections per
worker for the next request. `PeerPool` is that pool: it connects, lends and takes back
connections, and `PeerPool.request` makes one exchange (a request, then its whole
answer) on one of them: the connection goes back to the pool only after a complete
exchange and is aborted after a failed one. What the messages mean stays with the
caller (client/transfers.py, worker/transfers.py), which may read an answer in several
frames and bound each step of the exchange with a `Deadline`.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ..security import Security
from .connector import connect
from .framing import DEFAULT_MAX_FRAME_BYTES, Comm, CommClosedError

__all__ = ["Deadline", "PeerPool"]


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

    async def request(self, address: str, handshake: dict, msg: dict, *, timeout: float,
                      keep: Callable[[], bool],
                      read: Callable[[Comm, Deadline | None], Awaitable] | None = None,
                      step_timeout: float | None = None,
                      max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        """Send ``msg`` to ``address`` and return its answer, on a pooled connection.

        ``timeout`` bounds connecting. ``read(comm, deadline)`` reads the whole answer
        (default: the first message of one frame). With ``step_timeout`` each step (the
        request, and each frame of the answer: ``read`` arms ``deadline`` before each of
        its reads) must end within it, or the connection is aborted and TimeoutError
        raised. After the exchange the connection is kept for reuse if ``keep()``; after
        a failure it is aborted and the error raised.
        """
        comm = await self.connection(address, handshake, timeout=timeout,
                                     max_frame_bytes=max_frame_bytes)
        deadline = None
        try:
            if step_timeout is not None:
                deadline = Deadline(asyncio.get_running_loop(), comm, step_timeout)
                deadline.arm()
            try:
                await comm.write([msg])
                if read is not None:
                    answer = await read(comm, deadline)
                else:
                    if deadline is not None:
                        deadline.arm()
                    answer = (await comm.read())[0]
            except CommClosedError:
                if deadline is not None:
                    deadline.check()  # a timeout aborted the connection: say so
                raise
        except BaseException:
            comm.abort()  # a failed exchange leaves the connection unusable
            raise
        finally:
            if deadline is not None:
                deadline.cancel()
        self.give_back(address, comm, keep=keep())
        return answer

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


class Deadline:
    """Aborts a connection when one step of a transfer takes longer than ``timeout``:
    ``arm()`` before each step. A timer handle, not a Task per step (``wait_for`` made
    one per frame: it doubled a worker's CPU per transferred key)."""

    __slots__ = ("comm", "expired", "handle", "loop", "timeout")

    def __init__(self, loop: asyncio.AbstractEventLoop, comm: Comm, timeout: float) -> None:
        self.loop = loop
        self.comm = comm
        self.timeout = timeout
        self.handle = None
        self.expired = False

    def arm(self) -> None:
        """Start the clock of the next step (the previous one is done)."""
        if self.handle is not None:
            self.handle.cancel()
        self.handle = self.loop.call_later(self.timeout, self._expire)

    def cancel(self) -> None:
        """Stop the clock: no step is pending."""
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def check(self) -> None:
        """Raise TimeoutError if the deadline aborted the connection."""
        if self.expired:
            raise TimeoutError(f"no progress for {self.timeout}s: the peer does not answer")

    def _expire(self) -> None:
        self.handle = None
        self.expired = True
        self.comm.abort()
