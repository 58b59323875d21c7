"""What the scheduler's handlers of peer streams share (the server and the services it
hosts): `MessageError`, raised for a malformed message (it closes the connection the
message came on) and the checks that raise it; sending without raising on a closed comm;
refusing a peer at its handshake; the read loop of one peer's stream; the loop's turns
(`LOOP_TURN`); logging the failure of a background request.
"""
from __future__ import annotations

import asyncio
import logging
import time

from ..comm import CommClosedError, ProtocolError

__all__ = ["LOOP_TURN", "TURN_SECONDS", "LoopTurn", "MessageError", "checked_keys",
           "log_failure", "read_loop", "refuse", "require", "send_quietly"]

logger = logging.getLogger("distributed_server.scheduler")


#: The longest the scheduler's own work for one peer (its batches of messages, a huge
#: release) holds the event loop before every other peer is served. A peer's request
#: takes a few loop iterations (read, handle, write), each of which may wait one turn of
#: every busy peer: turns of 20 ms let a probe wait 300-400 ms behind a 100,000-task map.
TURN_SECONDS = 0.005


class LoopTurn:
    """The scheduler's turns on its event loop, shared by every peer's handler.

    Bulk work calls `over` between units (a message, a frame, a slice) and, when it is,
    awaits `give_way`: every other ready callback runs before it goes on. A stream that
    arrives faster than it is handled never yields by itself (reading an already
    buffered frame completes without suspending), hence the turn is checked between
    frames too (`read_loop`), not only within one batch. A turn starts with the first
    check after the loop has run anything else (a callback scheduled when the turn
    starts tells), so a request that arrives at an idle scheduler never yields."""

    __slots__ = ("_turned", "end", "seconds", "yields")

    def __init__(self, seconds: float = TURN_SECONDS) -> None:
        self.seconds = seconds
        self.end = 0.0
        self.yields = 0
        self._turned = True  # the loop has run other callbacks since the turn began

    def over(self) -> bool:
        """Whether the current turn has run out (a new one starts if the loop turned)."""
        if self._turned:
            self._begin()
            return False
        return time.monotonic() > self.end

    async def give_way(self) -> None:
        """Let every other ready callback run, then start a new turn."""
        self.yields += 1
        await asyncio.sleep(0)
        self._begin()

    def _begin(self) -> None:
        self._turned = False
        self.end = time.monotonic() + self.seconds
        asyncio.get_running_loop().call_soon(self._mark_turned)

    def _mark_turned(self) -> None:
        self._turned = True


#: The scheduler process's turns (one event loop).
LOOP_TURN = LoopTurn()


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
    batch is read once it is done. Between batches the peer gives way when its turn is
    over (`LOOP_TURN`)."""
    turn = LOOP_TURN
    try:
        while True:
            # Not bound to a name: a decoded batch (a whole graph, maybe) must not
            # stay alive while the loop waits for the next one.
            pending = handle(peer, await comm.read())
            if pending is not None:  # a batch handled in turns
                await pending
            if turn.over():
                await turn.give_way()
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
