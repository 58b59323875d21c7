"""A worker's data transfers with its peers: fetching task inputs from other workers and
answering their (and clients') requests on its peer port.

Fetching (``Fetch``: one ``get-data`` per peer and burst) goes over the connections of a
`PeerPool` as ``{"role": "worker"}``, the exchange of comm/peer_pool.py that the client's
transfers use too. Every transfer has a connect timeout, and each frame of the answer a
read timeout (``transfer_timeout``, 30 s by default), so a fetch from a hung (SIGSTOPped)
peer fails in bounded time and is planned again at once from the next holder, or given
back. Large values travel in parts of ``transfer_part_bytes`` (32 MiB) each, so no frame
comes near a frame limit.

Serving: `serve_requests` answers ``get-data``, ``put-data`` (clients only), ``run``
(clients only) and ``ping``, one reply frame per request frame, then the parts of large
values; a peer that takes no data for ``transfer_timeout`` is dropped. `data_reply`
builds the answer to a ``get-data``: a value that cannot be serialized is reported
missing with the reason (``errors``) and handed back to the worker, which drops it
(``serve_failed``): the scheduler recomputes it, and the recomputation must show that its
result serializes, or the task fails with an error naming the key, the type, the size and
the cause, instead of looping.

What the values mean (the worker core's stimuli) stays with the Worker (server.py) and
its `PeerServer` (peer_server.py); this module moves bytes and keeps time. Data is
pickled and unpickled on the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator

from distributed_core import bounded_repr

from ..comm import DEFAULT_MAX_FRAME_BYTES, Blob, Comm, CommClosedError, ProtocolError
from ..comm.peer_pool import Deadline, PeerPool
from ..protocol.serialize import dumps_data, loads_data
from .reports import cannot_travel_text

__all__ = ["MAX_IDLE_PEER_COMMS", "SINGLE_FRAME_REPLY_BYTES", "TRANSFER_PART_BYTES",
           "TRANSFER_TIMEOUT", "TRANSFER_TIMEOUT_ENV", "BadRequest", "data_reply",
           "decode_values", "describe", "fetch_data", "refused", "serve_requests"]

logger = logging.getLogger("distributed_server.worker")

#: Idle pooled connections kept per peer worker.
MAX_IDLE_PEER_COMMS = 4
#: Seconds a peer transfer may wait to connect, and for each frame of an answer.
TRANSFER_TIMEOUT = 30.0
#: The environment variable that sets the default transfer timeout (``dcore worker``).
TRANSFER_TIMEOUT_ENV = "DCORE_TRANSFER_TIMEOUT"
#: Values whose frames are larger than this travel to peer workers in parts of this size.
TRANSFER_PART_BYTES = 32 * 1024 * 1024
#: The most a single-frame get-data answer (one that did not ask for parts) may carry.
SINGLE_FRAME_REPLY_BYTES = DEFAULT_MAX_FRAME_BYTES - 1024 * 1024


class BadRequest(ValueError):
    """A peer sent a request (or answer) the worker cannot take; its connection is closed."""


# ---------------------------------------------------------------------- fetching from peers


async def fetch_data(pool: PeerPool, peer: str, hello: dict, keys: list, *,
                     connect_timeout: float, transfer_timeout: float, max_frame_bytes: int,
                     keep: Callable[[], bool]) -> tuple:
    """One ``get-data`` that asks for parts, to ``peer``: ``(frames by key, missing,
    nbytes, errors)``. Connecting takes at most ``min(connect_timeout,
    transfer_timeout)``, each frame at most ``transfer_timeout`` (TimeoutError); any
    failure raises."""
    return await pool.request(
        peer, hello, {"op": "get-data", "keys": keys, "parts": True},
        timeout=min(connect_timeout, transfer_timeout), keep=keep, read=_read_data_reply,
        step_timeout=transfer_timeout, max_frame_bytes=max_frame_bytes)


async def _read_data_reply(comm: Comm, deadline: Deadline) -> tuple:
    """The answer to a get-data that asked for parts, each frame within the deadline."""
    deadline.arm()
    reply = (await comm.read())[0]
    if reply.get("op") != "data" or type(reply.get("data")) is not dict:
        raise BadRequest(f"get-data answered with {reply.get('op')!r}")
    frames = dict(reply["data"])
    parts = reply.get("parts") or {}
    if type(parts) is not dict:
        raise BadRequest("get-data answered with malformed parts")
    for key, lengths in parts.items():
        buffers = []
        for length in lengths:
            buffer = bytearray()  # grows as parts arrive, never to the announced size
            while len(buffer) < length:
                deadline.arm()
                part = (await comm.read())[0]
                if part.get("op") != "data-part" or part.get("key") != key:
                    raise BadRequest(f"expected a part of {key!r}, got {part.get('op')!r}")
                buffer += part["blob"]
                if len(buffer) > length:
                    raise BadRequest(f"the parts of {key!r} exceed {length} bytes")
            buffers.append(buffer)
        frames[key] = buffers
    nbytes = reply.get("nbytes")
    errors = reply.get("errors")
    return (frames, reply.get("missing") or (),
            nbytes if type(nbytes) is dict else None,
            errors if type(errors) is dict else None)


def decode_values(frames: dict) -> tuple[dict, dict]:
    """``({key: value}, {key: exception})``: the values fetched, and why the others could
    not be deserialized."""
    values: dict = {}
    failures: dict = {}
    for key, parts in frames.items():
        try:
            values[key] = loads_data(parts)
        except Exception as exc:  # noqa: BLE001 - this key only: try another holder
            failures[key] = exc
    return values, failures


def refused(exc: BaseException) -> bool:
    """Whether a failed transfer shows the peer is gone (it refused the connection)."""
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        exc = exc.__cause__
    return False


def describe(exc: BaseException) -> str:
    """``Type: text`` of an exception, for a log line."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ---------------------------------------------------------------------- serving peers


async def serve_requests(comm: Comm, answer: Callable[[Comm, dict], tuple],
                         run: Callable[[Comm, dict], Awaitable[dict]], *, part_bytes: int,
                         timeout: float, address: str) -> None:
    """Answer a peer's requests until it leaves, then abort its connection.

    One reply frame per request frame, then the parts of large values for a get-data
    that asked for them: ``answer(comm, msg)`` gives ``(reply, parts)`` for one request,
    ``run(comm, msg)`` the reply to ``run``. A peer that takes no data for ``timeout`` is
    dropped; a bad request closes its connection only. ``address``: this worker, for
    the log."""
    deadline = Deadline(asyncio.get_running_loop(), comm, timeout)
    try:
        while True:
            msgs = await comm.read()  # an idle connection may wait: the peer pools it
            replies, parts = [], []
            for msg in msgs:
                if msg.get("op") == "run":
                    replies.append(await run(comm, msg))
                    continue
                reply, more = answer(comm, msg)
                replies.append(reply)
                parts.extend(more)
            deadline.arm()  # a peer that takes no data for this long is dropped
            await comm.write(replies)
            del replies
            for msg in _data_parts(parts, part_bytes):
                deadline.arm()
                await comm.write([msg])
            deadline.cancel()
            del parts
    except ProtocolError as exc:
        logger.warning("worker %s: closing connection from %s: %s",
                       address, comm.peer_address, exc)
    except CommClosedError:
        if deadline.expired:
            logger.warning("worker %s: %s took no data for %.1fs; closing the connection",
                           address, comm.peer_address, timeout)
    except Exception as exc:  # noqa: BLE001 - a bad request closes this connection only
        logger.warning("worker %s: closing connection from %s after a bad request: %s",
                       address, comm.peer_address, describe(exc))
    finally:
        deadline.cancel()
        comm.abort()


def data_reply(keys, data, tasks: dict, *, in_parts: bool, part_bytes: int,
               single_frame_bytes: int) -> tuple[dict, list, dict]:
    """The answer to get-data: ``({"op": "data", "data", "missing", ...}, parts,
    {key: why it cannot travel})``.

    ``data`` holds the values, ``tasks`` the core's tasks (for the sizes it knows). With
    ``in_parts`` (workers), values larger than ``part_bytes`` are announced in ``parts``
    (``{key: [frame lengths]}``) and follow as ``data-part`` frames; without it
    (clients), the answer is one frame, and a value that would make it larger than
    ``single_frame_bytes`` is reported missing with the reason in ``errors``. A value
    that cannot be serialized is reported missing with the reason, and returned in the
    third item for the worker to drop."""
    if not isinstance(keys, (list, tuple)):
        raise BadRequest("'get-data' needs a list of 'keys'")
    budget = part_bytes if in_parts else single_frame_bytes
    values, missing, parts, announced, nbytes = {}, [], [], {}, {}
    errors: dict = {}
    failed: dict = {}
    inline = 0
    for key in keys:
        try:
            value = data[key]
        except (KeyError, TypeError):
            missing.append(key)
            continue
        try:
            frames = dumps_data(value)
        except Exception as exc:  # noqa: BLE001 - the value cannot travel: say why
            missing.append(key)
            errors[key] = failed[key] = cannot_travel_text(key, value, exc)
            continue
        size = sum(memoryview(frame).nbytes for frame in frames)
        ts = tasks.get(key)
        if ts is not None and ts.nbytes >= 0:
            nbytes[key] = ts.nbytes
        if inline + size <= budget:
            values[key] = [Blob(frame) for frame in frames]
            inline += size
        elif in_parts:
            announced[key] = [memoryview(frame).nbytes for frame in frames]
            parts.append((key, frames))
        else:
            missing.append(key)
            errors[key] = (f"{bounded_repr(key)} ({type(value).__name__}, {size} bytes "
                           f"serialized) does not fit in one frame of at most "
                           f"{single_frame_bytes} bytes: ask for it alone, or in parts")
    reply = {"op": "data", "data": values, "missing": missing}
    if nbytes:
        reply["nbytes"] = nbytes
    if errors:
        reply["errors"] = errors
    if announced:
        reply["parts"] = announced
    return reply, parts, failed


def _data_parts(parts: list, part_bytes: int) -> Iterator[dict]:
    """The ``data-part`` messages that carry the frames of large values, in order."""
    for key, frames in parts:
        for frame in frames:
            view = memoryview(frame).cast("B")
            for start in range(0, view.nbytes, part_bytes):
                yield {"op": "data-part", "key": key, "blob": Blob(view[start:start + part_bytes])}
