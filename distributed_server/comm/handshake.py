"""The handshake and admission of a connection: the trust boundary of every port.

What this module does
---------------------
Every connection (`connect`, `listen`) starts with a handshake in two rounds, connector
first (docs/protocol.md, section 3)::

    connector -> {"op": "hello", "protocol", "auth", "nonce"}
    listener  -> {"op": "hello", "protocol", "auth", "nonce"}   (or an error, and close)
    connector -> {"op": "handshake", "proof"?, **info}
    listener  -> {"op": "handshake", "proof"?, **info}           (or an error, and close)

``hello`` carries the protocol version, the auth mode and a fresh nonce; ``handshake``
carries the role's info and, when the cluster has a token, an HMAC-SHA256 proof keyed by
the token over both nonces and the sender's side: the token never crosses the wire. Under
TLS (`Security` with TLS files) both sides also present certificates of the cluster's CA.
The listener checks the connector's proof before it says anything about itself; on any
mismatch the side that notices writes ``{"op": "error", "error": ...}`` and closes, and
the other raises `HandshakeError` (`ListenerBusyError` for a listener's "too busy").

Until the handshake is done a frame may hold at most `HANDSHAKE_MAX_FRAME_BYTES` and no
out-of-band buffer (the `Comm` is made with those limits); `admit` lifts them once it
is done. The caller bounds the time: `DEFAULT_HANDSHAKE_TIMEOUT` on a listener.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from typing import NoReturn

from distributed_core import bounded_repr

from .framing import (
    DEFAULT_MAX_BUFFERS,
    Comm,
    CommClosedError,
    HandshakeError,
    ListenerBusyError,
    ProtocolError,
)

#: Version of the wire protocol; both ends of a connection must agree on it.
PROTOCOL_VERSION = 2

#: Limit on one frame before the handshake is done.
HANDSHAKE_MAX_FRAME_BYTES = 64 * 1024
#: Default time a peer has to complete the handshake (TLS included).
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
_NONCE_BYTES = 32
_PROOF_LABEL = b"distributed-core handshake v2\0"
_CONNECTOR, _LISTENER = b"connector", b"listener"
_HINT = " (is the address's scheme, tcp:// or tls://, right, and does the cluster need a token?)"


def _proof(token: str, side: bytes, listener_nonce: bytes, connector_nonce: bytes) -> bytes:
    """What ``side`` sends to prove it holds ``token``, bound to this connection's nonces."""
    message = _PROOF_LABEL + side + b"\0" + listener_nonce + connector_nonce
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def _hello(token: str | None) -> dict:
    return {"op": "hello", "protocol": PROTOCOL_VERSION,
            "auth": "token" if token is not None else "none",
            "nonce": secrets.token_bytes(_NONCE_BYTES)}


def _hello_problem(ours: dict, theirs: dict) -> str | None:
    """Why the peer's hello does not fit ours, or None."""
    if theirs.get("protocol") != ours["protocol"]:
        return (f"protocol mismatch: peer speaks {bounded_repr(theirs.get('protocol'), 40)}, "
                f"we speak {ours['protocol']!r}")
    nonce = theirs.get("nonce")
    if type(nonce) is not bytes or len(nonce) != _NONCE_BYTES:
        return "the hello carries no valid nonce"
    if theirs.get("auth") != ours["auth"]:
        if ours["auth"] == "token":
            return ("this cluster requires its token: give the peer Security(token=...) or "
                    "set DCORE_TOKEN / DCORE_TOKEN_FILE")
        return "the peer expects a cluster token, but this process has none"
    return None


async def _read_handshake_msg(comm: Comm, expected_op: str) -> dict:
    """The peer's next handshake message; HandshakeError (after closing) if it is not one."""
    try:
        msgs = await comm.read()
    except ProtocolError as e:
        raise HandshakeError(f"handshake with {comm.peer_address} failed: {e}{_HINT}") from e
    except CommClosedError as e:
        raise HandshakeError(f"{comm.peer_address} closed the connection during the "
                             f"handshake{_HINT}") from e
    msg = msgs[0] if len(msgs) == 1 else {"op": f"a frame of {len(msgs)} messages"}
    if msg["op"] == "error":
        comm.abort()
        error = ListenerBusyError if msg.get("busy") is True else HandshakeError
        raise error(f"{comm.peer_address} refused the connection: "
                    f"{bounded_repr(msg.get('error'))}")
    if msg["op"] != expected_op:
        problem = f"expected {expected_op!r}, got {bounded_repr(msg['op'], 60)}"
        await _refuse(comm, problem)
        raise HandshakeError(f"handshake with {comm.peer_address} failed: {problem}")
    return msg


async def _fail(comm: Comm, problem: str) -> NoReturn:
    """Refuse the peer with ``problem`` and raise HandshakeError."""
    await _refuse(comm, problem)
    raise HandshakeError(f"handshake with {comm.peer_address} failed: {problem}")


def _peer_info(msg: dict) -> dict:
    return {k: v for k, v in msg.items() if k not in ("op", "proof")}


async def _check_proof(comm: Comm, msg: dict, expected: bytes, problem: str) -> None:
    """Refuse the peer with ``problem`` unless ``msg`` carries the ``expected`` proof
    (compared in constant time)."""
    proof = msg.get("proof")
    if type(proof) is not bytes or not hmac.compare_digest(proof, expected):
        await _fail(comm, problem)


async def connector_handshake(comm: Comm, info: dict, token: str | None) -> None:
    """Shake hands as the side that connected: send ``info``, prove ``token`` (if any),
    check the listener's proof; the listener's info lands in ``comm.extra``. Raises
    `HandshakeError` (or `ListenerBusyError`), having closed the comm."""
    ours = _hello(token)
    await comm.write([ours])
    theirs = await _read_handshake_msg(comm, "hello")
    problem = _hello_problem(ours, theirs)
    if problem is not None:
        await _fail(comm, problem)
    msg = {**info, "op": "handshake"}
    if token is not None:
        msg["proof"] = _proof(token, _CONNECTOR, theirs["nonce"], ours["nonce"])
    await comm.write([msg])
    reply = await _read_handshake_msg(comm, "handshake")
    if token is not None:
        await _check_proof(comm, reply, _proof(token, _LISTENER, theirs["nonce"], ours["nonce"]),
                           "the listener could not prove it holds the cluster token")
    comm.extra = _peer_info(reply)


async def listener_handshake(comm: Comm, info: dict, token: str | None) -> None:
    """Shake hands as the side that accepted: check the connector's hello and proof before
    sending anything about ourselves (``info``); the connector's info lands in
    ``comm.extra``. Raises `HandshakeError`, having refused and closed the comm."""
    theirs = await _read_handshake_msg(comm, "hello")
    ours = _hello(token)
    problem = _hello_problem(ours, theirs)
    if problem is not None:
        await _fail(comm, problem)
    await comm.write([ours])
    msg = await _read_handshake_msg(comm, "handshake")
    if token is not None:
        await _check_proof(comm, msg, _proof(token, _CONNECTOR, ours["nonce"], theirs["nonce"]),
                           "wrong cluster token")
    reply = {**info, "op": "handshake"}
    if token is not None:
        reply["proof"] = _proof(token, _LISTENER, ours["nonce"], theirs["nonce"])
    await comm.write([reply])
    comm.extra = _peer_info(msg)


async def _refuse(comm: Comm, reason: str) -> None:
    """Tell the peer why we hang up (best effort), then close."""
    try:
        await asyncio.wait_for(comm.write([{"op": "error", "error": reason}]), 1.0)
    except (OSError, asyncio.TimeoutError):
        pass
    comm.abort()


def admit(comm: Comm, max_frame_bytes: int) -> None:
    """The handshake is done: lift the pre-handshake limits."""
    comm.max_frame_bytes = max_frame_bytes
    comm.max_buffers = DEFAULT_MAX_BUFFERS
