"""The glue between the scheduler's client streams and the coordination primitives.

The primitives' state (`distributed_server.scheduler.coordination`: variables, queues,
locks, semaphores, events, pub/sub) and the published datasets (`DatasetStore`, which
extends it) are plain data, held by `CoordinationService` for the `Scheduler`: their
client messages (`OPS`) go to `Coordination.handle`, a client's departure to
``client_gone``, and a timer to ``expire``. The effects that come back are carried out
here, in order: replies to send, and task keys the pseudo-client ``coordination``
(`COORDINATION_CLIENT`) starts or stops wanting (the core's ``client_desires_keys`` /
``client_releases_keys`` stimuli), so that the tasks of Futures a primitive holds stay
alive. When the pseudo-client loses wants it did not drop itself (a restart, a forced
cancel), `CoordinationService.keys_lost` tells the primitives.
"""
from __future__ import annotations

import asyncio
import logging
import time

from distributed_core import bounded_repr

from .coordination import COORDINATION_CLIENT, Coordination, CoordinationLimits
from .coordination import OPS as COORDINATION_OPS
from .datasets import OPS as DATASET_OPS
from .datasets import DatasetStore
from .streams import send_quietly

__all__ = ["OPS", "CoordinationService"]

logger = logging.getLogger("distributed_server.scheduler")

#: The client messages this module handles: the primitives' and the datasets'.
OPS = COORDINATION_OPS | DATASET_OPS


class CoordinationService:
    """The coordination primitives and published datasets of a `Scheduler`.

    ``coordination`` is the `Coordination` state, ``datasets`` the `DatasetStore`. With
    ``validate``, the primitives' bookkeeping is checked after each of their messages."""

    def __init__(self, scheduler, limits: CoordinationLimits | None = None,
                 validate: bool = False) -> None:
        self.scheduler = scheduler
        self.validate = validate
        # (the core registers the pseudo-client COORDINATION_CLIENT at its first want)
        self.coordination = Coordination(self._task_exists, limits)
        self.datasets = DatasetStore(self.coordination)  # published datasets
        self._timer: asyncio.TimerHandle | None = None
        self._when = 0.0  # the deadline the timer is armed for

    def _task_exists(self, key) -> bool:
        return key in self.scheduler.state.tasks

    def handle(self, client_id: str, msg: dict) -> None:
        """A message of a coordination primitive (Variable, Queue, Lock, ...)."""
        try:
            effects = self.coordination.handle(client_id, msg, time.monotonic())
        except Exception:
            logger.exception("BUG: coordination message %r from %s", msg.get("op"), client_id)
            return
        if len(effects) == 1 and "error" in effects[0][-1]:  # refused: nothing changed
            logger.warning("refused %r from %s: %s", msg["op"], client_id,
                           effects[0][-1]["error"])
        self._apply(effects)

    def client_gone(self, client_id: str) -> None:
        """A client left: what it held, waited for or subscribed to is let go."""
        self._apply(self.coordination.client_gone(client_id))

    def keys_lost(self) -> None:
        """Tell the primitives which keys the pseudo-client still wants (after a restart
        or a forced cancel dropped some of its wants)."""
        self.coordination.keys_lost(self._wanted())
        if self.validate:
            self._validate()

    def close(self) -> None:
        """Stop the timer (the scheduler is closing)."""
        if self._timer is not None:
            self._timer.cancel()

    def _wanted(self) -> set:
        """The keys the pseudo-client wants now."""
        pseudo = self.scheduler.state.clients.get(COORDINATION_CLIENT)
        return {ts.key for ts in pseudo.wants_what} if pseudo is not None else set()

    def _apply(self, effects: list) -> None:
        """Carry out what `Coordination` returned, in order; re-arm its timer."""
        scheduler = self.scheduler
        for effect in effects:
            if effect[0] == "send":
                _, client_id, msg = effect
                comm = scheduler.client_comms.get(client_id)
                if comm is not None:
                    send_quietly(comm, msg)
            elif effect[0] == "hold":
                scheduler.stimulus(COORDINATION_CLIENT, "coordination-hold",
                                    scheduler.state.client_desires_keys, COORDINATION_CLIENT,
                                    effect[1])
            else:
                scheduler.stimulus(COORDINATION_CLIENT, "coordination-drop",
                                    scheduler.state.client_releases_keys, COORDINATION_CLIENT,
                                    effect[1])
        if self.validate:
            self._validate()
        self._arm_timer()

    def _validate(self) -> None:
        """Validation mode: the primitives' bookkeeping is consistent, and the
        pseudo-client wants exactly the keys they hold (except during a restart)."""
        try:
            self.coordination.validate()
            wanted = self._wanted()
            if not self.scheduler.restarts.under_way and wanted != set(self.coordination.held):
                raise AssertionError(f"the pseudo-client wants {bounded_repr(wanted)}, the "
                                     f"primitives hold {bounded_repr(self.coordination.held)}")
        except AssertionError:
            logger.exception("BUG: the coordination state is invalid")

    def _arm_timer(self) -> None:
        deadline = self.coordination.next_deadline()
        timer = self._timer
        if deadline is None or (timer is not None and self._when <= deadline):
            return
        if timer is not None:
            timer.cancel()
        delay = max(deadline - time.monotonic(), 0.0)
        self._when = deadline
        self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        self._apply(self.coordination.expire(time.monotonic()))
