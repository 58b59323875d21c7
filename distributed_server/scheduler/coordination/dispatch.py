"""`Coordination`: the primitives' shared state behind one entry point. It gathers the
ops of every primitive (and of extensions such as the published datasets), hands each
client message to its handler, and undoes, expires, checks and counts across all of them.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

from distributed_core import bounded_repr

from ...protocol.coordination_limits import CoordinationLimits
from .events import Events
from .ledger import Ledger, Waiter, check_state
from .pubsub import PubSub
from .queues import Queues
from .requests import CoordinationError, check_reqid, refuse
from .semaphores import Locks, Semaphores
from .variables import Variables


class Coordination(Ledger):
    """The primitives' shared state; see the package docstring.

    ``key_exists(key)`` tells whether the scheduler knows a task key (a value may only
    hold Futures of existing tasks). ``limits``: `CoordinationLimits`.
    """

    def __init__(self, key_exists: Callable[[object], bool],
                 limits: CoordinationLimits | None = None) -> None:
        super().__init__(key_exists, limits)
        self._variables = Variables(self)
        self._queues = Queues(self)
        self._locks = Locks(self)
        self._semaphores = Semaphores(self)
        self._events = Events(self)
        self._pubsub = PubSub(self)
        self._primitives = (self._variables, self._queues, self._locks, self._semaphores,
                            self._events, self._pubsub)
        self._handlers: dict = {}  # op -> handler(client, msg, now)
        self._parked_by: dict = {}  # op that parks requests -> its primitive
        for primitive in self._primitives:
            self._handlers.update(primitive.handlers)
            self._parked_by.update(dict.fromkeys(primitive.handlers, primitive))
        self._handlers["value-received"] = self._value_received
        self._handlers["abandon-request"] = self._abandon_request
        self._extra_stores: list = []  # callables yielding the values of extensions

    # ------------------------------------------------------------ each primitive's table

    @property
    def variables(self) -> dict:
        """name -> `Value` of each variable."""
        return self._variables.table

    @property
    def variable_waiters(self) -> dict:
        """name -> {waiter id: waiter} of the gets waiting for a variable."""
        return self._variables.waiters

    @property
    def queues(self) -> dict:
        """name -> `QueueState` of each queue in use."""
        return self._queues.table

    @property
    def locks(self) -> dict:
        """name -> `LeasePool` (of one lease) of each lock held or waited on."""
        return self._locks.table

    @property
    def semaphores(self) -> dict:
        """name -> `LeasePool` of each semaphore held or waited on."""
        return self._semaphores.table

    @property
    def events(self) -> dict:
        """name -> `EventState` of each event set or waited on."""
        return self._events.table

    @property
    def topics(self) -> dict:
        """name -> {(client, sub_id): `Subscription`} of each topic subscribed to."""
        return self._pubsub.table

    # ------------------------------------------------------------ extensions

    def extend(self, handlers: dict, stored_values: Callable) -> None:
        """Add the ops of another store of values kept with this machinery (published
        datasets: `distributed_server.scheduler.datasets`). ``handlers``: op ->
        ``handler(client, msg, now)``, raising `CoordinationError` to refuse before
        changing anything; ``stored_values()`` yields every `Value` the store holds (so
        that validation, ``keys_lost`` and the key holds count them)."""
        self._handlers.update(handlers)
        self._extra_stores.append(stored_values)

    # ------------------------------------------------------------ entry points

    def handle(self, client: str, msg: dict, now: float) -> list:
        """One client message of `OPS`; returns the effects to carry out.

        A refused message changes nothing: the client is answered with an error (a
        ``reply`` with ``error`` if the message had a request id, else ``error``)."""
        op = msg["op"]
        try:
            self._handlers[op](client, msg, now)
        except BaseException as exc:
            self._effects.clear()  # a refusal left none; a bug (raised on) may have
            self._before.clear()
            if not isinstance(exc, CoordinationError):
                raise
            reqid = msg.get("reqid")
            if type(reqid) is int:
                reply = {"op": "reply", "reqid": reqid, "error": str(exc)}
            else:
                reply = {"op": "error", "request": op, "error": str(exc)}
            return [("send", client, reply)]
        return self._finish()

    def client_gone(self, client: str) -> list:
        """The client disconnected: its parked requests are dropped, its leases, its
        subscriptions and its unconfirmed handoffs released (other waiters served)."""
        record = self.clients.pop(client, None)
        if record is not None:
            for waiter in list(record.waiting.values()):
                self.unpark(waiter, record)
                self._waiter_gone(waiter)
            for primitive in self._primitives:
                primitive.client_gone(client, record)
            for keys in record.handoffs.values():
                self.count_keys(keys, -1)
        return self._finish()

    def expire(self, now: float) -> list:
        """Answer the parked requests whose deadline has come ("timed-out")."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            waiter = heapq.heappop(heap)[2]
            if waiter.active:
                self.unpark(waiter, self.clients[waiter.client])
                self._waiter_gone(waiter)
                self.answer(waiter, {"status": "timed-out"})
        return self._finish()

    def next_deadline(self) -> float | None:
        """When `expire` has something to do next (None: nothing waits with a deadline)."""
        heap = self._deadlines
        while heap and not heap[0][2].active:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def keys_lost(self, still_wanted: set) -> None:
        """The pseudo-client wants only ``still_wanted`` now (the cluster restarted, or a
        client cancelled keys with ``force``).

        Stored values keep their bytes (a Future in them will be cancelled when a client
        receives it, unless its key exists again by then), but hold no other key."""
        for value in self._stored_values():
            value.keys = tuple(k for k in value.keys if k in still_wanted)
        for record in self.clients.values():
            for handoff, keys in record.handoffs.items():
                record.handoffs[handoff] = tuple(k for k in keys if k in still_wanted)
        self.held = {}
        for value in self._stored_values():
            for key in value.keys:
                self.held[key] = self.held.get(key, 0) + 1
        for record in self.clients.values():
            for keys in record.handoffs.values():
                for key in keys:
                    self.held[key] = self.held.get(key, 0) + 1

    def validate(self) -> None:
        """Check the bookkeeping (validating schedulers, tests): held keys and bytes are
        those of the stored values and handoffs, every parked request is where its
        client's record says, no empty record is kept. Raises AssertionError."""
        held: dict = {}
        nbytes = 0
        for value in self._stored_values():
            nbytes += value.nbytes
            for key in value.keys:
                held[key] = held.get(key, 0) + 1
        for record in self.clients.values():
            for keys in record.handoffs.values():
                for key in keys:
                    held[key] = held.get(key, 0) + 1
        check_state(held == self.held, f"held keys {self.held} != counted {held}")
        check_state(nbytes == self.total_bytes, f"total bytes {self.total_bytes} != {nbytes}")
        containers = [c for primitive in self._primitives for c in primitive.validate()]
        parked = [w for container in containers for w in container.values()]
        check_state(all(w.active and self.clients[w.client].waiting[w.reqid] is w
                        for w in parked),
                    "a parked request its client's record does not know")
        check_state(len(parked) == sum(len(r.waiting) for r in self.clients.values()),
                    "a client's record knows a request no primitive holds")
        check_state(self._timed == sum(w.deadline is not None for w in parked),
                    "the count of requests with a deadline is off")

    def summary(self) -> dict:
        """How much the primitives hold now (counts only; O(1))."""
        return {"variables": len(self.variables), "queues": len(self.queues),
                "locks": len(self.locks), "semaphores": len(self.semaphores),
                "events": len(self.events), "topics": len(self.topics),
                "bytes": self.total_bytes, "keys": len(self.held),
                "waiting": sum(len(r.waiting) for r in self.clients.values())}

    # ------------------------------------------------------------ shared ops and helpers

    def _stored_values(self):
        for primitive in self._primitives:
            yield from primitive.stored_values()
        for stored_values in self._extra_stores:
            yield from stored_values()

    def _waiter_gone(self, waiter: Waiter) -> None:
        """A waiter left without being served: its primitive frees what it held."""
        self._parked_by[waiter.kind].waiter_gone(waiter)

    def _value_received(self, client: str, msg: dict, now: float) -> None:
        record, handoff = self.clients.get(client), msg.get("handoff")
        if type(handoff) is not int:
            refuse(f"'value-received' needs an int 'handoff', not {bounded_repr(handoff, 60)}")
        keys = record.handoffs.pop(handoff, None) if record is not None else None
        if keys is not None:
            self.count_keys(keys, -1)

    def _abandon_request(self, client: str, msg: dict, now: float) -> None:
        """The client gave up on a parked request: answer it "abandoned"."""
        record, reqid = self.clients.get(client), check_reqid(msg)
        waiter = record.waiting.get(reqid) if record is not None else None
        if waiter is not None:
            self.unpark(waiter, record)
            self._waiter_gone(waiter)
            self.answer(waiter, {"status": "abandoned"})


#: The client ops the Scheduler hands to `Coordination.handle`.
OPS = frozenset(Coordination(lambda key: False)._handlers)

__all__ = ["OPS", "Coordination"]
