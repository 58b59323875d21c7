"""The listening side of the wire: `listen` binds an address and returns a `Listener`,
which accepts connections, admits each one only through the handshake
(`distributed_server.comm.handshake`) and hands the admitted `Comm` to its handler.

What it protects
----------------
Until its handshake is done a connection may send frames of at most
``HANDSHAKE_MAX_FRAME_BYTES`` (64 KiB) and has ``handshake_timeout`` seconds. A listener
caps open connections (in all and per host) and connections still in their handshake
(`MAX_PENDING`, `MAX_PENDING_PER_HOST`: over a cap the oldest of the most crowded host
goes first), refuses the rest with a clear error, and pauses accepting (instead of
spinning) when the process runs out of file descriptors. Refusals and failed
handshakes are logged at most a few times per 10 s, so a peer cannot flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from tornado.iostream import IOStream, SSLIOStream
from tornado.netutil import bind_sockets

from ..logs import QuietLog
from ..security import Security
from .addresses import format_address, parse_address, security_for
from .framing import DEFAULT_INTERVAL, DEFAULT_MAX_FRAME_BYTES, Comm, HandshakeError, frame_bytes
from .handshake import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    HANDSHAKE_MAX_FRAME_BYTES,
    admit,
    listener_handshake,
)

__all__ = [
    "MAX_PENDING",
    "MAX_PENDING_PER_HOST",
    "Listener",
    "default_max_connections",
    "listen",
]

# Not __name__ on purpose: the admission and connection messages logged here were logged
# under "distributed_server.comm.framing" before this module left framing.py, and that is
# the name users' log settings and filters name; renaming it would silently undo them.
logger = logging.getLogger("distributed_server.comm.framing")

#: Connections still in their handshake, at most, in all and from one host.
MAX_PENDING = 128
MAX_PENDING_PER_HOST = 32
#: File descriptors a process keeps free for everything but incoming connections.
_RESERVED_FDS = 64
#: Accepts handled per wake-up of a listening socket.
_ACCEPTS_PER_WAKEUP = 64
#: How long accepting pauses when the process is out of file descriptors.
_ACCEPT_PAUSE = 1.0


def default_max_connections() -> int:
    """Open connections a listener allows by default: what the process's file
    descriptor limit leaves after a reserve, at most 16,384."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        soft = 1024
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        soft = 1 << 20
    return max(16, min(soft - _RESERVED_FDS, 16_384))


class Listener:
    """Accepts connections on one address, shakes hands, and hands each `Comm` over.

    ``address`` is the address actually bound (the real port when 0 was asked for).
    It refuses a connection beyond ``max_connections`` open ones (``max_per_host`` from
    one host), or beyond `MAX_PENDING` (`MAX_PENDING_PER_HOST`) still in their
    handshake; out of file descriptors, it stops accepting for a moment instead of
    spinning, and says so once.
    """

    def __init__(
        self,
        scheme: str,
        on_connection: Callable[[Comm], Any],
        handshake: dict,
        security: Security,
        comm_options: dict,
        handshake_timeout: float,
        max_connections: int,
        max_per_host: int,
    ) -> None:
        self._scheme = scheme
        self._on_connection = on_connection
        self._handshake = dict(handshake)
        self._security = security
        self._ssl_context = security.ssl_context(server_side=True)
        self._comm_options = comm_options
        self._handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.max_per_host = max_per_host
        self._loop = asyncio.get_running_loop()
        self._sockets: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()
        self._pending: dict[Comm, str] = {}  # comm -> host, oldest first
        self._pending_by_host: dict[str, int] = {}
        self._open_by_host: dict[str, int] = {}
        self.n_open = 0
        self._paused = False
        self._stopped = False
        self._log_refusal = QuietLog(logging.WARNING, log=logger)
        self._log_handshake = QuietLog(logging.WARNING, log=logger)
        self.address = ""

    def __repr__(self) -> str:
        return f"<Listener {self.address} open={self.n_open}>"

    @property
    def port(self) -> int:
        """The port actually bound."""
        return parse_address(self.address)[2]

    def set_handshake_info(self, **info: Any) -> None:
        """Change what this listener tells its peers in the handshake from now on."""
        self._handshake.update(info)

    def _bind(self, host: str, port: int) -> None:
        try:
            sockets = bind_sockets(port, address=host)
        except OSError as e:
            address = format_address(self._scheme, host, port)
            raise OSError(f"cannot listen on {address}: {e}") from e
        self._sockets = sockets
        bound_host, bound_port = sockets[0].getsockname()[:2]
        self.address = format_address(self._scheme, bound_host, bound_port)
        self._resume()

    # ------------------------------------------------------------ accepting

    def _resume(self) -> None:
        self._paused = False
        if self._stopped:
            return
        for sock in self._sockets:
            self._loop.add_reader(sock.fileno(), self._accept_ready, sock)

    def _pause(self, error: OSError) -> None:
        self._paused = True
        for sock in self._sockets:
            self._loop.remove_reader(sock.fileno())
        self._log_refusal("%s cannot accept connections (%s); pausing for %.1f s",
                          self.address, error.strerror or error, _ACCEPT_PAUSE)
        self._loop.call_later(_ACCEPT_PAUSE, self._resume)

    def _accept_ready(self, sock: socket.socket) -> None:
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                conn, peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS, ENOMEM ...
                self._pause(e)
                return
            self._admit_socket(conn, peer[0] if isinstance(peer, tuple) else str(peer))

    def _refusal(self, host: str) -> str | None:
        if self.n_open >= self.max_connections:
            return f"too many connections ({self.n_open}, limit {self.max_connections})"
        if self._open_by_host.get(host, 0) >= self.max_per_host:
            return f"too many connections from {host} (limit {self.max_per_host})"
        return None

    def _make_room_for_a_handshake(self, host: str) -> None:
        """Over a cap on connections in their handshake, drop the oldest one of this
        host if it is at its own cap, else the oldest of the host with the most: whoever
        keeps the caps full with silent connections only ever evicts its own. (Dropping
        the oldest of all let a flood from several hosts, reconnecting as fast as it was
        dropped, evict an honest peer still in its handshake within milliseconds.)"""
        if self._pending_by_host.get(host, 0) >= MAX_PENDING_PER_HOST:
            crowded = host
        elif len(self._pending) >= MAX_PENDING:
            crowded = max(self._pending_by_host, key=self._pending_by_host.__getitem__)
        else:
            return
        victim = next(c for c, h in self._pending.items() if h == crowded)
        self._log_refusal("%s dropped %s, the oldest connection in its handshake: too many "
                          "(limits %d, %d per host)", self.address, victim.peer_address,
                          MAX_PENDING, MAX_PENDING_PER_HOST)
        self._end_pending(victim)
        victim.abort()

    def _end_pending(self, comm: Comm) -> None:
        host = self._pending.pop(comm, None)
        if host is not None:
            _decrement(self._pending_by_host, host)

    def _admit_socket(self, conn: socket.socket, host: str) -> None:
        conn.setblocking(False)
        reason = self._refusal(host)
        if reason is not None:
            self._log_refusal("%s refused a connection from %s: %s", self.address, host, reason)
            if self._ssl_context is None:  # a plain peer can read why
                with contextlib.suppress(OSError):
                    conn.send(_busy_frame(reason))
            conn.close()
            return
        self._make_room_for_a_handshake(host)
        max_buffer = self._comm_options["max_frame_bytes"] + (1 << 20)
        try:
            if self._ssl_context is not None:
                conn = self._ssl_context.wrap_socket(conn, server_side=True,
                                                     do_handshake_on_connect=False)
                stream: IOStream = SSLIOStream(conn, max_buffer_size=max_buffer)
            else:
                stream = IOStream(conn, max_buffer_size=max_buffer)
            comm = Comm(stream, self._scheme, interval=self._comm_options["interval"],
                        max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES, max_buffers=0)
        except (OSError, ssl.SSLError) as e:  # the peer left before we looked at it
            logger.debug("connection to %s from %s dropped at once: %s", self.address, host, e)
            conn.close()
            return
        self.n_open += 1
        self._open_by_host[host] = self._open_by_host.get(host, 0) + 1
        comm.add_close_callback(lambda: self._forget(host))
        self._pending[comm] = host
        self._pending_by_host[host] = self._pending_by_host.get(host, 0) + 1
        task = self._loop.create_task(self._serve(comm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget(self, host: str) -> None:
        """A connection closed: it no longer counts against the limits."""
        self.n_open -= 1
        _decrement(self._open_by_host, host)

    async def _serve(self, comm: Comm) -> None:
        try:
            await asyncio.wait_for(
                listener_handshake(comm, self._handshake, self._security.token),
                self._handshake_timeout)
        except Exception as exc:  # noqa: BLE001 - one bad peer must not break the listener
            error = exc
            if isinstance(exc, asyncio.TimeoutError):
                error = HandshakeError(f"no handshake within {self._handshake_timeout}s")
            self._log_handshake("%s refused %s: %s", self.address, comm.peer_address, error)
            # The traceback runs through asyncio.wait_for, whose frame holds the task that
            # holds the exception: a cycle that would keep this comm alive until the
            # cyclic GC runs (rarely, in a server), a flood of bad peers with it.
            exc.__traceback__ = None
            comm.abort()
            return
        finally:
            self._end_pending(comm)
        admit(comm, self._comm_options["max_frame_bytes"])
        await self._run_handler(comm)

    async def _run_handler(self, comm: Comm) -> None:
        try:
            result = self._on_connection(comm)
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("connection handler failed for %s; closing it", comm.peer_address)
            comm.abort()

    async def stop(self) -> None:
        """Stop accepting and drop connections still in their handshake.

        Handshaken comms belong to ``on_connection`` and are left alone.
        """
        self._stopped = True
        for sock in self._sockets:
            if not self._paused:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._sockets = []
        for comm in list(self._pending):
            comm.abort()


def _busy_frame(reason: str) -> bytes:
    """The whole frame that tells a plain-TCP peer the listener is too busy."""
    return frame_bytes([{"op": "error", "error": reason, "busy": True}])


def _decrement(counts: dict, key: str) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


async def listen(
    address: str,
    on_connection: Callable[[Comm], Awaitable[None] | None],
    handshake: dict,
    security: Security | None = None,
    *,
    interval: float = DEFAULT_INTERVAL,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    max_connections: int | None = None,
    max_connections_per_host: int | None = None,
) -> Listener:
    """Listen on ``address`` (port 0 picks a free port) and return the `Listener`.

    Each accepted connection must complete the handshake (proving ``security``'s token,
    and under TLS presenting a certificate of its CA) within ``handshake_timeout``
    seconds; then ``await on_connection(comm)`` runs in a task of its own. A failed
    handshake is logged (rate-limited) and closes only that connection; an exception in
    ``on_connection`` is logged and closes that comm. When ``on_connection`` returns the
    comm stays open: the handler may keep it. ``max_connections`` (default: what the
    file descriptor limit allows) and ``max_connections_per_host`` (default: three
    quarters of that) bound the open connections.
    """
    scheme, host, port = parse_address(address)
    security = security_for(address, security)
    if max_connections is None:
        max_connections = default_max_connections()
    if max_connections_per_host is None:  # leave other hosts a quarter
        max_connections_per_host = max(1, max_connections * 3 // 4)
    options = {"interval": interval, "max_frame_bytes": max_frame_bytes}
    listener = Listener(scheme, on_connection, handshake, security, options, handshake_timeout,
                        max_connections, max_connections_per_host)
    listener._bind(host, port)
    return listener
