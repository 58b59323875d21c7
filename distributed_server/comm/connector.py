"""The connecting side of the wire: `connect` opens a connection, shakes hands as the
connector (`distributed_server.comm.handshake`) and returns the admitted `Comm`.

Refused or dropped attempts to reach the address, and listeners too busy for now
(`ListenerBusyError`), are retried with exponential backoff until the timeout; a failed
handshake or a TLS error never is. This is the only place the comm layer retries.
"""

from __future__ import annotations

import asyncio
import ssl

from tornado.iostream import StreamClosedError
from tornado.tcpclient import TCPClient

from ..security import Security
from .addresses import format_address, parse_address, security_for
from .framing import (
    DEFAULT_INTERVAL,
    DEFAULT_MAX_FRAME_BYTES,
    Comm,
    CommClosedError,
    HandshakeError,
)
from .handshake import HANDSHAKE_MAX_FRAME_BYTES, admit, connector_handshake

__all__ = ["connect"]


async def connect(
    address: str,
    handshake: dict,
    timeout: float = 10,
    security: Security | None = None,
    *,
    interval: float = DEFAULT_INTERVAL,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Comm:
    """Connect to ``address``, prove our credentials, exchange ``handshake`` info, and
    return the `Comm` (its ``extra`` holds the peer's info).

    ``security`` gives the token and TLS files (``tls://`` needs TLS files, ``tcp://``
    must have none). Refused or dropped attempts to reach the address are retried with
    exponential backoff (10 ms doubling, capped at 1 s) until ``timeout`` seconds have
    passed; then ``TimeoutError`` (an OSError) names the address and the last error.
    So are refusals of a listener that has too many connections (``ListenerBusyError``).
    Once connected, a failed handshake (``HandshakeError``: a wrong token, a refusal, a
    TLS/plain mismatch) or a TLS error is raised at once, never retried.
    """
    scheme, host, port = parse_address(address)
    security = security_for(address, security)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    backoff = 0.01
    error: BaseException | None = None
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0 and error is not None:
            raise TimeoutError(f"could not connect to {address} within {timeout}s: "
                               f"{type(error).__name__}: {error}") from error
        try:
            return await _connect_once(
                scheme, host, port, handshake, max(remaining, 0.001), security,
                interval=interval, max_frame_bytes=max_frame_bytes,
            )
        except HandshakeError:
            raise
        except ssl.SSLError as e:
            raise HandshakeError(f"TLS connection to {address} failed: {e}") from e
        except (OSError, asyncio.TimeoutError, StreamClosedError) as e:
            error = e
            await asyncio.sleep(min(backoff, max(deadline - loop.time(), 0)))
            backoff = min(backoff * 2, 1.0)


async def _connect_once(
    scheme: str,
    host: str,
    port: int,
    handshake: dict,
    timeout: float,
    security: Security,
    *,
    interval: float,
    max_frame_bytes: int,
) -> Comm:
    """One attempt: open the stream and shake hands, all within ``timeout`` seconds."""
    stream = await TCPClient().connect(
        host, port, ssl_options=security.ssl_context(server_side=False), timeout=timeout,
        max_buffer_size=max_frame_bytes + (1 << 20),
    )
    comm = Comm(stream, scheme, interval=interval, max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES,
                max_buffers=0)
    try:
        await asyncio.wait_for(connector_handshake(comm, handshake, security.token), timeout)
    except (CommClosedError, StreamClosedError) as e:
        comm.abort()
        if isinstance(stream.error, ssl.SSLError) and not isinstance(e, HandshakeError):
            # TLS 1.3: a listener that refuses our certificate says so after the TLS
            # handshake, so we learn it only now. Not worth retrying.
            raise HandshakeError(f"TLS connection to {format_address(scheme, host, port)} "
                                 f"failed: {stream.error}") from e
        raise
    except BaseException:
        comm.abort()
        raise
    admit(comm, max_frame_bytes)
    return comm
