"""Adaptive scaling, the scheduler's side: how many workers the work wants, which of
them to let go, and since when nothing has run.

Cluster managers ask it: `Cluster.adapt` through a client's requests (`OPS`), the
dask-kubernetes operator through the HTTP API (``/api/v1/adaptive_target``,
``/api/v1/retire_workers``, ``/api/v1/get_workers``, ``/api/v1/check_idle``, served by
the dashboard with this object). The core answers (`SchedulerState.adaptive_target`,
``workers_to_close``, ``check_idle``: O(prefixes + workers), read from its counters);
a retirement goes through `ReplicaMover.retire`, so results move before a worker goes.
"""
from __future__ import annotations

import logging

from distributed_core import bounded_repr

logger = logging.getLogger("distributed_server.adaptive")

#: The client requests this module answers.
OPS = ("adaptive-target", "workers-to-close", "check-idle")
#: Seconds the work should take on the workers `adaptive_target` asks for (dask's default).
DEFAULT_TARGET_DURATION = 5.0
#: Most workers one request may ask to close or retire.
MAX_WORKERS = 1_000_000


class AdaptiveRequests:
    """Answers a `Scheduler`'s adaptive-scaling questions, from clients and from HTTP."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def handle(self, client_id: str, msg: dict) -> None:
        """Answer one client request (`OPS`) with ``reply {reqid, result}``, or ``reply
        {reqid, error}`` if its arguments are refused."""
        op = msg["op"]
        try:
            if op == "adaptive-target":
                result = self.adaptive_target(msg.get("target_duration",
                                                      DEFAULT_TARGET_DURATION))
            elif op == "workers-to-close":
                result = self.workers_to_close(msg.get("n"))
            else:
                result = self.check_idle()
        except ValueError as exc:
            logger.warning("refused %r from %s: %s", op, client_id, exc)
            self.scheduler.reply_failure(client_id, msg.get("reqid"), f"{op}: {exc}")
            return
        self.scheduler.reply(client_id, msg, result)

    def adaptive_target(self, target_duration=DEFAULT_TARGET_DURATION) -> int:
        """The number of workers the work wants (`SchedulerState.adaptive_target`)."""
        return self.scheduler.state.adaptive_target(target_duration)

    def workers_to_close(self, n) -> list:
        """The ``n`` workers best let go, as ``[{"address", "name"}]``
        (`SchedulerState.workers_to_close`)."""
        _check_count(n)
        state = self.scheduler.state
        return [{"address": address, "name": state.workers[address].name}
                for address in state.workers_to_close(n)]

    def check_idle(self):
        """Since when (the scheduler's ``time.time()``) no task has been left to run, or
        None while some is."""
        return self.scheduler.state.check_idle()

    def workers(self) -> dict:
        """``{"num_workers": n, "workers": [{"name", "address"}]}``, as dask's
        ``/api/v1/get_workers`` answers."""
        workers = self.scheduler.state.workers
        return {"num_workers": len(workers),
                "workers": [{"name": ws.name, "address": address}
                            for address, ws in workers.items()]}

    async def retire(self, n=None, workers=None) -> dict:
        """Retire the ``n`` workers best let go (`workers_to_close`), or those named in
        ``workers``: their results move to the others first, then they stay connected,
        taking no task, until whatever runs them stops them (the operator deletes their
        pods). ``{address: {"name": ..., ...}}`` of those retired, as dask answers."""
        if workers is None:
            _check_count(n)
            workers = self.scheduler.state.workers_to_close(n)
        elif not (isinstance(workers, list) and len(workers) <= MAX_WORKERS
                  and all(isinstance(w, (str, int)) for w in workers)):
            raise ValueError("workers must be a list of worker addresses or names")
        if not workers:
            return {}
        result = await self.scheduler.replicas.retire(workers, None, close=False)
        return result["retired"]


def _check_count(n) -> None:
    if type(n) is not int or not 0 <= n <= MAX_WORKERS:
        raise ValueError(f"n must be an int from 0 to {MAX_WORKERS}, not {bounded_repr(n, 60)}")
