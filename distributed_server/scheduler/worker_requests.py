"""Requests the scheduler sends to every worker over the worker's own stream
(``{"op": "story" | "logs", "reqid", ...}``), each matched to the ``reply`` the worker
sends back on it, for at most a timeout: a worker that does not answer in time, leaves
meanwhile, or answers with an error is reported as silent, with the reason, and never
waited on beyond the timeout.
"""
from __future__ import annotations

import asyncio
import itertools

from distributed_core import bounded_repr

from ..comm import CommClosedError

__all__ = ["WorkerRequests"]


class WorkerRequests:
    """Requests to workers over their streams, matched to their ``reply`` by
    ``(worker address, reqid)``: a worker can answer only what it was asked."""

    def __init__(self) -> None:
        self._pending: dict = {}  # (address, reqid) -> asyncio.Future
        self._ids = itertools.count(1)

    async def ask(self, comms: dict, msg: dict, timeout: float) -> tuple[dict, dict]:
        """Send ``msg`` (plus a ``reqid``) to every worker in ``comms`` (address -> Comm)
        and wait up to ``timeout`` seconds in all. Returns ``(answers, silent)``:
        ``{address: result}`` and ``{address: why there is no answer}``."""
        loop = asyncio.get_running_loop()
        waiting: dict = {}
        silent: dict = {}
        for address, comm in comms.items():
            reqid = next(self._ids)
            future = loop.create_future()
            try:
                comm.send({**msg, "reqid": reqid})
            except CommClosedError:
                silent[address] = "its connection is closed"
                continue
            self._pending[(address, reqid)] = future
            waiting[address] = (reqid, future)
        try:
            if waiting:
                await asyncio.wait([f for _, f in waiting.values()], timeout=timeout)
        finally:
            for address, (reqid, _) in waiting.items():
                self._pending.pop((address, reqid), None)
        answers = {}
        for address, (_, future) in waiting.items():
            if not future.done():
                future.cancel()
                silent[address] = f"no answer within {timeout:g} s"
            elif future.cancelled():
                silent[address] = "it left the cluster"
            else:
                ok, value = future.result()
                if ok:
                    answers[address] = value
                else:
                    silent[address] = value
        return answers, silent

    def answer(self, address: str, msg: dict) -> None:
        """A worker's ``reply {reqid, result | error}``; one nobody waits for is dropped."""
        reqid = msg.get("reqid")
        if type(reqid) is not int:
            return
        future = self._pending.pop((address, reqid), None)
        if future is None or future.done():
            return
        if "error" in msg:
            future.set_result((False, (f"it answered with an error: "
                                       f"{bounded_repr(msg.get('error'), 300)}")))
        else:
            future.set_result((True, msg.get("result")))

    def worker_left(self, address: str) -> None:
        """``address`` is gone: whatever it was asked will never be answered."""
        for pending in [p for p in self._pending if p[0] == address]:
            future = self._pending.pop(pending)
            if not future.done():
                future.cancel()
