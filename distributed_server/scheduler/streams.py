"""What the scheduler's handlers of peer streams share (the server and the services it
hosts): `MessageError`, raised for a malformed message (it closes the connection the
message came on) and the checks that raise it; sending without raising on a closed comm;
refusing a peer at its handshake; the read loop of one peer's stream; logging the failure
of a background request.
"""
from __future__ import annotations

import logging

from ..comm import CommClosedError, ProtocolError

__all__ = ["MessageError", "checked_keys", "log_failure", "read_loop", "refuse", "require",
           "send_quietly"]

logger = logging.getLogger("distributed_server.scheduler")


class MessageError(ValueError):
    """A peer sent a message the scheduler cannot accept."""


def require(condition: bool, text: str) -> None:
    """Raise `MessageError` with ``text`` unless ``condition`` holds."""
    if not condition:
        raise MessageError(text)


def checked_keys(msg: dict) -> list:
    """The message's list of keys, checked hashable before any stimulus sees them."""
    keys = msg.get("keys")
    require(isinstance(keys, (list, tuple)), f"{msg.get('op')!r} needs a list of 'keys'")
    try:
        hash(tuple(keys))
    except TypeError:
        raise MessageError(f"{msg.get('op')!r}: keys must be hashable") from None
    return keys


def send_quietly(comm, msg: dict) -> None:
    """Queue a message; a closed comm is noticed (and cleaned up) by its read loop."""
    try:
        comm.send(msg)
    except CommClosedError:
        pass


async def refuse(comm, reason: str) -> None:
    """Tell a peer at its handshake why it is refused, and drop its connection."""
    try:
        await comm.write([{"op": "error", "error": reason}])
    except CommClosedError:
        pass
    comm.abort()


async def read_loop(comm, peer: str, handle) -> None:
    """Read batches until the peer leaves; a bad message closes this comm only.

    ``handle(peer, msgs)`` may return an awaitable (a batch handled in turns): the next
    batch is read once it is done."""
    try:
        while True:
            # Not bound to a name: a decoded batch (a whole graph, maybe) must not
            # stay alive while the loop waits for the next one.
            pending = handle(peer, await comm.read())
            if pending is not None:  # a batch handled in turns
                await pending
    except ProtocolError as exc:
        logger.warning("closing connection to %s: %s", peer, exc)
    except CommClosedError:
        pass
    except MessageError as exc:
        logger.warning("closing connection to %s after a malformed message: %s", peer, exc)
    finally:
        comm.abort()


def log_failure(task) -> None:
    """A done-callback: a background request that raised is a bug, logged."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("BUG: a background request failed", exc_info=task.exception())
