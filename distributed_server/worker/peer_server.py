"""What a worker answers on its peer port: ``get-data`` (peers and clients), ``put-data``
and ``run`` (clients only) and ``ping``.

`PeerServer` holds the worker's side of these requests; transfers.py moves their bytes
and keeps their time (`serve_requests`, `data_reply`). What a served or put value means
for the worker's state machine goes through the worker's stimuli (``serve_failed``,
``data_put``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from ..comm import Comm
from ..protocol.serialize import loads_data
from .remote_run import run_packed_call
from .transfers import BadRequest, data_reply, serve_requests

__all__ = ["PeerServer"]

logger = logging.getLogger("distributed_server.worker")


class PeerServer:
    """Answers the requests of the peers and clients connected to ``worker``'s listener.

    ``stimulus(method, *args)`` calls a stimulus of the worker's state machine and
    carries out its instructions (False: refused); ``sid(cause)`` makes a stimulus id.
    ``comms`` are the connections being served (the worker aborts them on close).
    """

    def __init__(self, worker, stimulus: Callable[..., bool], sid: Callable[[str], str]):
        self.worker = worker
        self.stimulus = stimulus
        self.sid = sid
        self.comms: set = set()

    async def serve(self, comm: Comm) -> None:
        """Answer a peer's requests on its connection until it leaves (transfers.py)."""
        worker = self.worker
        self.comms.add(comm)
        try:
            await serve_requests(comm, self.answer, self.run_function,
                                 part_bytes=worker.transfer_part_bytes,
                                 timeout=worker.transfer_timeout, address=worker.address)
        finally:
            self.comms.discard(comm)

    def abort(self) -> None:
        """Drop every served connection (the worker is closing)."""
        for comm in self.comms:
            comm.abort()

    def answer(self, comm: Comm, msg: dict) -> tuple:
        """``(reply, parts to send after it)`` for one request."""
        op = msg["op"]
        if op == "get-data":
            return self.get_data(msg)
        if op == "put-data":
            if comm.extra.get("role") != "client":  # workers only ever read from peers
                raise BadRequest(f"put-data from a {comm.extra.get('role')!r} connection")
            return self.put_data(msg), ()
        if op == "ping":
            return {"op": "pong"}, ()
        raise BadRequest(f"unknown operation {op!r}")

    async def run_function(self, comm: Comm, msg: dict) -> dict:
        """``Client.run``: call the client's function here (remote_run.py)."""
        if comm.extra.get("role") != "client":
            raise BadRequest(f"run from a {comm.extra.get('role')!r} connection")
        payload = msg.get("function")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise BadRequest("run needs the pickled function")
        return await run_packed_call(payload, self.worker)

    def get_data(self, msg: dict) -> tuple:
        """The answer to get-data (transfers.data_reply): ``(reply, parts)``. A value that
        cannot be serialized is reported missing with the reason, and dropped
        (``serve_failed``)."""
        worker = self.worker
        reply, parts, failed = data_reply(
            msg.get("keys"), worker.data, worker.state.tasks, in_parts=msg.get("parts") is True,
            part_bytes=worker.transfer_part_bytes,
            single_frame_bytes=worker.single_frame_reply_bytes)
        if failed:
            sid = self.sid("serve-failed")
            for text in failed.values():
                logger.warning("worker %s (%s): %s", worker.address, sid, text)
            self.stimulus(worker.state.serve_failed, failed, sid)
        return reply, parts

    def put_data(self, msg: dict) -> dict:
        """Take the values a client scatters here (``data_put``)."""
        items = msg.get("data")
        if not isinstance(items, dict):
            raise BadRequest("'put-data' needs a map 'data' of key -> frames")
        values = {key: loads_data(frames) for key, frames in items.items()}
        if not self.stimulus(self.worker.state.data_put, values, self.sid("put-data")):
            raise BadRequest("put-data refused")
        return {"op": "ok"}
