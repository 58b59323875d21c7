"""Checks of the fields of a coordination request, shared by every primitive (and by the
published datasets, `distributed_server.scheduler.datasets`).

Each check returns the field's value or raises `CoordinationError` before anything
changed, so that a handler can check its whole input first.
"""
from __future__ import annotations

import math

from distributed_core import bounded_repr

from ...comm import Blob
from ...protocol.coordination_limits import (
    BLOB_MIN_BYTES,
    MAX_HOLDER_CHARS,
    MAX_NAME_CHARS,
    MAX_TIMEOUT,
)


class CoordinationError(ValueError):
    """A coordination message the scheduler refuses; nothing was changed."""


def refuse(text: str):
    """Refuse the message being handled: raise `CoordinationError` with ``text``."""
    raise CoordinationError(text)


def check_reqid(msg: dict) -> int:
    """The message's request id (an int in [0, 2**63))."""
    reqid = msg.get("reqid")
    if type(reqid) is not int or not 0 <= reqid < 2**63:
        refuse(f"{msg['op']!r} needs an int 'reqid', not {bounded_repr(reqid, 60)}")
    return reqid


def check_name(msg: dict, field: str = "name") -> str:
    """The primitive's name in ``field`` (a str of 1 to `MAX_NAME_CHARS` characters)."""
    name = msg.get(field)
    if type(name) is not str or not 0 < len(name) <= MAX_NAME_CHARS:
        refuse(f"{msg['op']!r}: the name must be a str of 1 to {MAX_NAME_CHARS} characters, "
               f"not {bounded_repr(name, 80)}")
    return name


def check_holder(msg: dict) -> str:
    """The id of the Lock or Semaphore object that acquires or releases a lease."""
    holder = msg.get("holder")
    if type(holder) is not str or not 0 < len(holder) <= MAX_HOLDER_CHARS:
        refuse(f"{msg['op']!r}: 'holder' must be a str of 1 to {MAX_HOLDER_CHARS} "
               f"characters, not {bounded_repr(holder, 80)}")
    return holder


def check_deadline(msg: dict, now: float) -> float | None:
    """The request's deadline: None (wait forever), or ``now`` + its timeout."""
    timeout = msg.get("timeout")
    if timeout is None:
        return None
    if type(timeout) not in (int, float) or math.isnan(timeout) or timeout < 0:
        refuse(f"{msg['op']!r}: timeout must be None or a number of seconds >= 0, not "
               f"{bounded_repr(timeout, 60)}")
    return None if timeout > MAX_TIMEOUT else now + timeout


def check_count(msg: dict, field: str, low: int, high: int, default: int) -> int:
    """The int in ``field`` (``default`` if absent), from ``low`` to ``high``."""
    value = msg.get(field, default)
    if type(value) is not int or not low <= value <= high:
        refuse(f"{msg['op']!r}: {field} must be an int from {low} to {high}, not "
               f"{bounded_repr(value, 60)}")
    return value


def wire_value(data):
    """A value's bytes as they go in a reply: large ones out of band."""
    if (len(data) if isinstance(data, bytes) else data.nbytes) >= BLOB_MIN_BYTES:
        return Blob(data)
    return data
