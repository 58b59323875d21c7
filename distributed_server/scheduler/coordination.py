"""The state of the coordination primitives, kept by the scheduler: plain data, no I/O.

What this module does
---------------------
`Coordination` holds what `distributed_server.client.primitives` (Variable, Queue, Lock,
Semaphore, Event, Pub/Sub) share between clients: variables' values, queues' items,
lock and semaphore leases, events, subscriptions. The Scheduler holds one by
composition and hands it every client message of `OPS`, the departure of a client and
the passing of time; each call returns the effects the server carries out, in order:

- ``("send", client_id, msg)``: a message to that client (a ``reply`` to a request, or an
  ``error`` for a refused message that had no request id);
- ``("hold", keys)`` / ``("drop", keys)``: the coordination pseudo-client
  (`COORDINATION_CLIENT`) now wants, or no longer wants, these task keys.

Values are opaque bytes (the client's pickle) with the list of task keys of the
Futures inside them. Each stored copy of a value (a variable, a queue item, a parked put,
a subscription's buffer) and each handoff counts towards its keys: while any count is
above zero the pseudo-client wants the key, so its task is kept alive after every client
released it. A value handed to a client becomes a *handoff* that keeps its keys until the
client says ``value-received`` (after it asked for the keys itself), so no key dies in
between.

What it never does
------------------
It never unpickles, never reads a clock (``now`` is passed in), never sends. A refused
message changes nothing: every handler checks its whole input before it changes state.
Waiting requests (a lock not free, an empty queue, an unset variable or event) are
parked: answered later, or at their deadline (`expire`), never awaited. Everything is
bounded (`CoordinationLimits`): value sizes, total bytes, names, queue items, parked
requests, subscriptions and handoffs per client.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable

from distributed_core import bounded_repr

from ..comm import Blob
from ..protocol.coordination_limits import (  # noqa: F401 - the limits are part of this API
    BLOB_MIN_BYTES,
    COORDINATION_CLIENT,
    MAX_HOLDER_CHARS,
    MAX_LEASES,
    MAX_NAME_CHARS,
    MAX_TIMEOUT,
    CoordinationLimits,
)


class CoordinationError(ValueError):
    """A coordination message the scheduler refuses; nothing was changed."""


# ---------------------------------------------------------------------------- records


class Value:
    """A value as the scheduler keeps it: opaque bytes and the keys of its Futures."""

    __slots__ = ("data", "keys", "nbytes")

    def __init__(self, data, keys: tuple) -> None:
        self.data = data
        self.keys = keys
        self.nbytes = len(data) if isinstance(data, bytes) else data.nbytes


class _Waiter:
    """A parked request: answered when its primitive can, or at its deadline."""

    __slots__ = ("active", "client", "container", "deadline", "extra", "kind", "name",
                 "reqid")

    def __init__(self, client: str, reqid: int, kind: str, name, deadline: float | None,
                 container: dict, extra=None) -> None:
        self.client = client
        self.reqid = reqid
        self.kind = kind  # the op that parked it
        self.name = name  # the primitive's name (a subscription's id for sub-get)
        self.deadline = deadline
        self.container = container  # the primitive's waiters: {(client, reqid): waiter}
        self.extra = extra  # a parked put's Value, a getter's count, a holder's id
        self.active = True

    @property
    def id(self) -> tuple:
        return (self.client, self.reqid)


class _QueueState:
    __slots__ = ("getters", "items", "maxsize", "putters")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.items: deque = deque()
        self.getters: dict = {}
        self.putters: dict = {}


class _LeasePool:
    """A Semaphore's leases (a Lock is a pool of one)."""

    __slots__ = ("by_client", "leases", "max_leases", "total", "waiters")

    def __init__(self, max_leases: int) -> None:
        self.max_leases = max_leases
        self.leases: dict = {}  # (client, holder) -> leases it holds
        self.by_client: dict = {}  # client -> leases it holds
        self.total = 0
        self.waiters: dict = {}


class _EventState:
    __slots__ = ("is_set", "waiters")

    def __init__(self) -> None:
        self.is_set = False
        self.waiters: dict = {}


class _Subscription:
    __slots__ = ("buffer", "client", "dropped", "sub_id", "topic", "waiters")

    def __init__(self, client: str, sub_id: int, topic: str) -> None:
        self.client = client
        self.sub_id = sub_id
        self.topic = topic
        self.buffer: deque = deque()
        self.dropped = 0
        self.waiters: dict = {}


class _ClientRecord:
    """What one client has here, so that its departure undoes all of it."""

    __slots__ = ("handoffs", "next_handoff", "pools", "subs", "waiting")

    def __init__(self) -> None:
        self.waiting: dict = {}  # reqid -> _Waiter
        self.pools: set = set()  # (kind, name) of pools where it holds leases
        self.subs: dict = {}  # sub_id -> _Subscription
        self.handoffs: dict = {}  # handoff id -> keys
        self.next_handoff = 0


# ---------------------------------------------------------------------------- input checks


def _fail(text: str):
    raise CoordinationError(text)


def _check(condition: bool, text: str) -> None:
    if not condition:
        raise AssertionError(f"coordination state: {text}")


def _reqid(msg: dict) -> int:
    reqid = msg.get("reqid")
    if type(reqid) is not int or not 0 <= reqid < 2**63:
        _fail(f"{msg['op']!r} needs an int 'reqid', not {bounded_repr(reqid, 60)}")
    return reqid


def _name(msg: dict, field: str = "name") -> str:
    name = msg.get(field)
    if type(name) is not str or not 0 < len(name) <= MAX_NAME_CHARS:
        _fail(f"{msg['op']!r}: the name must be a str of 1 to {MAX_NAME_CHARS} characters, "
              f"not {bounded_repr(name, 80)}")
    return name


def _holder(msg: dict) -> str:
    holder = msg.get("holder")
    if type(holder) is not str or not 0 < len(holder) <= MAX_HOLDER_CHARS:
        _fail(f"{msg['op']!r}: 'holder' must be a str of 1 to {MAX_HOLDER_CHARS} "
              f"characters, not {bounded_repr(holder, 80)}")
    return holder


def _deadline(msg: dict, now: float) -> float | None:
    """The request's deadline: None (wait forever), or ``now`` + its timeout."""
    timeout = msg.get("timeout")
    if timeout is None:
        return None
    if type(timeout) not in (int, float) or math.isnan(timeout) or timeout < 0:
        _fail(f"{msg['op']!r}: timeout must be None or a number of seconds >= 0, not "
              f"{bounded_repr(timeout, 60)}")
    return None if timeout > MAX_TIMEOUT else now + timeout


def _count(msg: dict, field: str, low: int, high: int, default: int) -> int:
    value = msg.get(field, default)
    if type(value) is not int or not low <= value <= high:
        _fail(f"{msg['op']!r}: {field} must be an int from {low} to {high}, not "
              f"{bounded_repr(value, 60)}")
    return value


def _wire(data):
    """A value's bytes as they go in a reply: large ones out of band."""
    if (len(data) if isinstance(data, bytes) else data.nbytes) >= BLOB_MIN_BYTES:
        return Blob(data)
    return data


#: For stores that extend `Coordination` (`Coordination.extend`): the same input checks.
check_reqid, check_name, wire_value, refuse = _reqid, _name, _wire, _fail


# ---------------------------------------------------------------------------- the state


class Coordination:
    """The primitives' shared state; see the module docstring.

    ``key_exists(key)`` tells whether the scheduler knows a task key (a value may only
    hold Futures of existing tasks). ``limits``: `CoordinationLimits`.
    """

    def __init__(self, key_exists: Callable[[object], bool],
                 limits: CoordinationLimits | None = None) -> None:
        self.limits = limits if limits is not None else CoordinationLimits()
        self._key_exists = key_exists
        self.variables: dict = {}  # name -> Value
        self.variable_waiters: dict = {}  # name -> {waiter id: waiter}
        self.queues: dict = {}  # name -> _QueueState
        self.locks: dict = {}  # name -> _LeasePool of one lease
        self.semaphores: dict = {}  # name -> _LeasePool
        self.events: dict = {}  # name -> _EventState
        self.topics: dict = {}  # name -> {(client, sub_id): _Subscription}
        self.clients: dict = {}  # client id -> _ClientRecord
        self.held: dict = {}  # key -> stored copies and handoffs that hold it
        self.total_bytes = 0
        self._deadlines: list = []  # heap of (deadline, seq, waiter)
        self._seq = itertools.count()
        self._timed = 0  # active waiters with a deadline
        self._effects: list = []
        self._before: dict = {}  # key -> its count in `held` before this call
        self._extra_stores: list = []  # callables yielding the values of extensions
        self._handlers = {
            "variable-set": self._variable_set,
            "variable-get": self._variable_get,
            "variable-delete": self._variable_delete,
            "queue-put": self._queue_put,
            "queue-get": self._queue_get,
            "queue-qsize": self._queue_qsize,
            "lock-acquire": self._lock_acquire,
            "lock-release": self._lock_release,
            "lock-locked": self._lock_locked,
            "semaphore-acquire": self._semaphore_acquire,
            "semaphore-release": self._semaphore_release,
            "semaphore-value": self._semaphore_value,
            "event-set": self._event_set,
            "event-clear": self._event_clear,
            "event-wait": self._event_wait,
            "event-is-set": self._event_is_set,
            "pub-put": self._pub_put,
            "sub-subscribe": self._sub_subscribe,
            "sub-get": self._sub_get,
            "sub-unsubscribe": self._sub_unsubscribe,
            "value-received": self._value_received,
            "abandon-request": self._abandon_request,
        }

    # ------------------------------------------------------------ extensions

    def extend(self, handlers: dict, stored_values: Callable) -> None:
        """Add the ops of another store of values kept with this machinery (published
        datasets: `distributed_server.client.datasets`). ``handlers``: op -> ``handler(client,
        msg, now)``, raising `CoordinationError` to refuse before changing anything;
        ``stored_values()`` yields every `Value` the store holds (so that validation,
        ``keys_lost`` and the key holds count them)."""
        self._handlers.update(handlers)
        self._extra_stores.append(stored_values)

    def checked_value(self, msg: dict, copies: int = 1, freed: int = 0) -> Value:
        """The ``value`` and ``keys`` of ``msg`` as a `Value`, checked against the limits
        (`CoordinationError` otherwise)."""
        return self._value(msg, copies, freed)

    def check_room(self, table: dict, name: str, kind: str) -> None:
        """Refuse a new ``name`` in ``table`` once it holds ``max_names`` names."""
        self._check_room(table, name, kind)

    def check_can_receive(self, client: str) -> None:
        """Refuse to hand ``client`` a value while it has too many unconfirmed ones."""
        self._check_can_receive(client)

    def retain(self, value: Value) -> None:
        """An extension stores ``value`` (once more): its bytes and keys count."""
        self._retain(value)

    def release(self, value: Value) -> None:
        """An extension no longer stores one copy of ``value``."""
        self._release(value)

    def reply(self, client: str, reqid: int, result) -> None:
        """Answer request ``reqid`` of ``client`` (sent with this call's effects)."""
        self._reply(client, reqid, result)

    def hand_over(self, client: str, values: list, result: dict) -> dict:
        """``result`` carrying ``values`` to ``client``; their keys stay held until it
        confirms receipt (``value-received``)."""
        return self._hand_over(client, values, result)

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
                self._unpark(waiter, record)
                self._after_waiter_gone(waiter)
            for kind, name in record.pools:
                table = self.locks if kind == "lock" else self.semaphores
                pool = table[name]
                for lease in [lease for lease in pool.leases if lease[0] == client]:
                    pool.total -= pool.leases.pop(lease)
                del pool.by_client[client]
                self._grant_leases(kind, name, pool)
                self._tidy_pool(table, name, pool)
            for sub in record.subs.values():
                self._close_subscription(sub)
            for keys in record.handoffs.values():
                self._count_keys(keys, -1)
        return self._finish()

    def expire(self, now: float) -> list:
        """Answer the parked requests whose deadline has come ("timed-out")."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            waiter = heapq.heappop(heap)[2]
            if waiter.active:
                self._unpark(waiter, self.clients[waiter.client])
                self._after_waiter_gone(waiter)
                self._answer(waiter, {"status": "timed-out"})
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
        _check(held == self.held, f"held keys {self.held} != counted {held}")
        _check(nbytes == self.total_bytes, f"total bytes {self.total_bytes} != {nbytes}")
        containers = [*self.variable_waiters.values()]
        for queue in self.queues.values():
            _check(bool(queue.items or queue.getters or queue.putters), "an empty queue")
            containers += [queue.getters, queue.putters]
        for table in (self.locks, self.semaphores):
            for pool in table.values():
                _check(pool.total == sum(pool.leases.values()) == sum(pool.by_client.values())
                       and pool.total <= pool.max_leases, "lease counts disagree")
                _check(bool(pool.total or pool.waiters), "an empty lease pool")
                _check(not pool.waiters or pool.total == pool.max_leases, "a pool with "
                       "free leases has waiters")
                containers.append(pool.waiters)
        for event in self.events.values():
            _check(event.is_set or bool(event.waiters), "an empty event")
            _check(not (event.is_set and event.waiters), "waiters on a set event")
            containers.append(event.waiters)
        for subs in self.topics.values():
            _check(bool(subs), "an empty topic")
            for sub in subs.values():
                _check(self.clients[sub.client].subs[sub.sub_id] is sub, "a lost subscription")
                containers.append(sub.waiters)
        parked = [w for container in containers for w in container.values()]
        _check(all(w.active and self.clients[w.client].waiting[w.reqid] is w for w in parked),
               "a parked request its client's record does not know")
        _check(len(parked) == sum(len(r.waiting) for r in self.clients.values()),
               "a client's record knows a request no primitive holds")
        _check(self._timed == sum(w.deadline is not None for w in parked),
               "the count of requests with a deadline is off")
        _check(not self.variable_waiters.keys() & self.variables.keys(),
               "waiters on a set variable")

    def summary(self) -> dict:
        """How much the primitives hold now (counts only; O(1))."""
        return {"variables": len(self.variables), "queues": len(self.queues),
                "locks": len(self.locks), "semaphores": len(self.semaphores),
                "events": len(self.events), "topics": len(self.topics),
                "bytes": self.total_bytes, "keys": len(self.held),
                "waiting": sum(len(r.waiting) for r in self.clients.values())}

    # ------------------------------------------------------------ effects and key holds

    def _finish(self) -> list:
        effects, self._effects = self._effects, []
        hold, drop = [], []
        held = self.held
        for key, before in self._before.items():
            after = held.get(key, 0)
            if before == 0 and after > 0:
                hold.append(key)
            elif before > 0 and after == 0:
                drop.append(key)
        self._before.clear()
        if hold:
            effects.append(("hold", hold))
        if drop:
            effects.append(("drop", drop))
        return effects

    def _count_keys(self, keys: tuple, delta: int) -> None:
        held, before = self.held, self._before
        for key in keys:
            count = held.get(key, 0)
            if key not in before:
                before[key] = count
            count += delta
            if count:
                held[key] = count
            else:
                del held[key]

    def _retain(self, value: Value) -> None:
        """``value`` is now stored (once more)."""
        self.total_bytes += value.nbytes
        self._count_keys(value.keys, 1)

    def _release(self, value: Value) -> None:
        """One stored copy of ``value`` is gone."""
        self.total_bytes -= value.nbytes
        self._count_keys(value.keys, -1)

    def _stored_values(self):
        yield from self.variables.values()
        for stored_values in self._extra_stores:
            yield from stored_values()
        for queue in self.queues.values():
            yield from queue.items
            for waiter in queue.putters.values():
                yield waiter.extra
        for subs in self.topics.values():
            for sub in subs.values():
                yield from sub.buffer

    def _value(self, msg: dict, copies: int = 1, freed: int = 0) -> Value:
        """The message's value, checked: bytes within the limits, keys of known tasks."""
        limits = self.limits
        data, keys = msg.get("value"), msg.get("keys", ())
        if not isinstance(data, (bytes, memoryview)):
            _fail(f"{msg['op']!r}: 'value' must be bytes (the client's pickle), not "
                  f"{type(data).__name__}")
        nbytes = len(data) if isinstance(data, bytes) else data.nbytes
        if nbytes > limits.max_value_bytes:
            _fail(f"{msg['op']!r}: the value is {nbytes:,} bytes pickled; a primitive holds "
                  f"at most {limits.max_value_bytes:,} bytes per value (share large data "
                  f"as a Future: scatter it, then put the Future in)")
        if self.total_bytes - freed + nbytes * copies > limits.max_total_bytes:
            _fail(f"{msg['op']!r}: the scheduler already holds {self.total_bytes:,} bytes "
                  f"of primitive values, and may hold at most "
                  f"{limits.max_total_bytes:,}; this value ({nbytes:,} bytes"
                  f"{f' x {copies} subscribers' if copies > 1 else ''}) does not fit")
        if type(keys) not in (list, tuple) or len(keys) > limits.max_keys_per_value:
            _fail(f"{msg['op']!r}: 'keys' must be a list of at most "
                  f"{limits.max_keys_per_value:,} keys, not {bounded_repr(keys, 80)}")
        try:
            keys = tuple(dict.fromkeys(keys))
        except TypeError:
            _fail(f"{msg['op']!r}: keys must be hashable")
        unknown = [key for key in keys if not self._key_exists(key)]
        if unknown:
            _fail(f"{msg['op']!r}: the value holds Futures of keys the scheduler does not "
                  f"know (released or cancelled?): {bounded_repr(unknown[:5], 200)}")
        if isinstance(data, memoryview) and nbytes < BLOB_MIN_BYTES:
            data = bytes(data)
        return Value(data, keys)

    def _check_room(self, table: dict, name: str, kind: str) -> None:
        if name not in table and len(table) >= self.limits.max_names:
            _fail(f"the scheduler holds {len(table):,} {kind}s, the most it may; "
                  f"{kind} {bounded_repr(name, 80)} cannot be made (delete or release some)")

    # ------------------------------------------------------------ parking and answering

    def _record(self, client: str) -> _ClientRecord:
        record = self.clients.get(client)
        if record is None:
            record = self.clients[client] = _ClientRecord()
        return record

    def _check_can_park(self, client: str, reqid: int) -> None:
        record = self.clients.get(client)
        if record is None:
            return
        if reqid in record.waiting:
            _fail(f"request {reqid} is already waiting")
        if len(record.waiting) >= self.limits.max_waiting_per_client:
            _fail(f"this client has {len(record.waiting):,} requests waiting, the most it "
                  f"may")

    def _park(self, client: str, reqid: int, kind: str, name, deadline: float | None,
              container: dict, extra=None) -> None:
        """Park a request (the caller ran `_check_can_park` before changing anything)."""
        waiter = _Waiter(client, reqid, kind, name, deadline, container, extra)
        self._record(client).waiting[reqid] = waiter
        container[waiter.id] = waiter
        if deadline is not None:
            self._timed += 1
            heapq.heappush(self._deadlines, (deadline, next(self._seq), waiter))
            if len(self._deadlines) > 2 * self._timed + 64:  # answered ones pile up
                self._deadlines = [e for e in self._deadlines if e[2].active]
                heapq.heapify(self._deadlines)

    def _unpark(self, waiter: _Waiter, record: _ClientRecord) -> None:
        waiter.active = False
        if waiter.deadline is not None:
            self._timed -= 1
        del record.waiting[waiter.reqid]
        del waiter.container[waiter.id]

    def _pop_waiter(self, container: dict) -> _Waiter:
        waiter = container[next(iter(container))]
        self._unpark(waiter, self.clients[waiter.client])
        return waiter

    def _after_waiter_gone(self, waiter: _Waiter) -> None:
        """A waiter left without being served: free what it held, tidy its primitive."""
        kind, name = waiter.kind, waiter.name
        if kind == "queue-put":
            self._release(waiter.extra)
        if kind in ("queue-put", "queue-get"):
            self._tidy_queue(name)
        elif kind == "variable-get":
            if not self.variable_waiters[name]:
                del self.variable_waiters[name]
        elif kind == "lock-acquire":
            self._tidy_pool(self.locks, name, self.locks[name])
        elif kind == "semaphore-acquire":
            self._tidy_pool(self.semaphores, name, self.semaphores[name])
        elif kind == "event-wait":
            self._tidy_event(name)

    def _send(self, client: str, msg: dict) -> None:
        self._effects.append(("send", client, msg))

    def _reply(self, client: str, reqid: int, result) -> None:
        self._send(client, {"op": "reply", "reqid": reqid, "result": result})

    def _answer(self, waiter: _Waiter, result) -> None:
        self._reply(waiter.client, waiter.reqid, result)

    def _hand_over(self, client: str, values: list, result: dict) -> dict:
        """``result`` carrying ``values`` to ``client``: their keys stay held until it
        confirms receipt (``value-received`` with the handoff id)."""
        keys = tuple(dict.fromkeys(k for v in values for k in v.keys))
        if keys:
            record = self._record(client)
            handoff = record.next_handoff
            record.next_handoff += 1
            record.handoffs[handoff] = keys
            self._count_keys(keys, 1)
            result["handoff"] = handoff
        return result

    def _check_can_receive(self, client: str) -> None:
        record = self.clients.get(client)
        if record is not None and len(record.handoffs) >= self.limits.max_handoffs_per_client:
            _fail(f"this client has not confirmed {len(record.handoffs):,} values it "
                  f"received (value-received), the most it may")

    def _value_received(self, client: str, msg: dict, now: float) -> None:
        record, handoff = self.clients.get(client), msg.get("handoff")
        if type(handoff) is not int:
            _fail(f"'value-received' needs an int 'handoff', not {bounded_repr(handoff, 60)}")
        keys = record.handoffs.pop(handoff, None) if record is not None else None
        if keys is not None:
            self._count_keys(keys, -1)

    def _abandon_request(self, client: str, msg: dict, now: float) -> None:
        """The client gave up on a parked request: answer it "abandoned"."""
        record, reqid = self.clients.get(client), _reqid(msg)
        waiter = record.waiting.get(reqid) if record is not None else None
        if waiter is not None:
            self._unpark(waiter, record)
            self._after_waiter_gone(waiter)
            self._answer(waiter, {"status": "abandoned"})

    # ------------------------------------------------------------ Variable

    def _variable_set(self, client: str, msg: dict, now: float) -> None:
        reqid, name = _reqid(msg), _name(msg)
        old = self.variables.get(name)
        value = self._value(msg, freed=old.nbytes if old is not None else 0)
        self._check_room(self.variables, name, "variable")
        waiters = self.variable_waiters.get(name)
        self._retain(value)
        self.variables[name] = value
        if old is not None:
            self._release(old)
        while waiters:
            waiter = self._pop_waiter(waiters)
            self._answer(waiter, self._hand_over(waiter.client, [value], {
                "status": "ok", "value": _wire(value.data)}))
        self.variable_waiters.pop(name, None)
        self._reply(client, reqid, {"status": "ok"})

    def _variable_get(self, client: str, msg: dict, now: float) -> None:
        reqid, name, deadline = _reqid(msg), _name(msg), _deadline(msg, now)
        self._check_can_receive(client)
        value = self.variables.get(name)
        if value is not None:
            self._reply(client, reqid, self._hand_over(client, [value], {
                "status": "ok", "value": _wire(value.data)}))
        elif deadline is not None and deadline <= now:
            self._reply(client, reqid, {"status": "timed-out"})
        else:
            self._check_can_park(client, reqid)
            waiters = self.variable_waiters.setdefault(name, {})
            self._park(client, reqid, "variable-get", name, deadline, waiters)

    def _variable_delete(self, client: str, msg: dict, now: float) -> None:
        reqid, name = _reqid(msg), _name(msg)
        old = self.variables.pop(name, None)
        if old is not None:
            self._release(old)
        self._reply(client, reqid, {"status": "ok"})

    # ------------------------------------------------------------ Queue

    def _queue_put(self, client: str, msg: dict, now: float) -> None:
        reqid, name, deadline = _reqid(msg), _name(msg), _deadline(msg, now)
        maxsize = _count(msg, "maxsize", 0, self.limits.max_queue_items, 0)
        value = self._value(msg)
        queue = self.queues.get(name)
        if queue is None:
            self._check_room(self.queues, name, "queue")
            maxsize_now, n_items, n_putters = maxsize, 0, 0
        else:
            maxsize_now, n_items, n_putters = queue.maxsize, len(queue.items), len(queue.putters)
        full = n_items + n_putters >= (maxsize_now or self.limits.max_queue_items)
        if full and not maxsize_now:
            _fail(f"queue {bounded_repr(name, 80)} holds {n_items:,} items, the most a "
                  f"queue may hold (give it a maxsize to make put wait instead)")
        if full and not (deadline is not None and deadline <= now):
            self._check_can_park(client, reqid)
        if queue is None:
            queue = self.queues[name] = _QueueState(maxsize)
        if not full:
            self._retain(value)
            queue.items.append(value)
            self._reply(client, reqid, {"status": "ok"})
            self._settle_queue(name, queue)
        elif deadline is not None and deadline <= now:
            self._reply(client, reqid, {"status": "timed-out"})
            self._tidy_queue(name)
        else:
            self._retain(value)
            self._park(client, reqid, "queue-put", name, deadline, queue.putters, value)

    def _queue_get(self, client: str, msg: dict, now: float) -> None:
        reqid, name, deadline = _reqid(msg), _name(msg), _deadline(msg, now)
        batch = msg.get("batch", False)
        if batch is not True and batch is not False:
            batch = _count(msg, "batch", 1, self.limits.max_queue_items, 1)
        maxsize = _count(msg, "maxsize", 0, self.limits.max_queue_items, 0)
        self._check_can_receive(client)
        queue = self.queues.get(name)
        if batch is True:
            items = list(queue.items) if queue is not None else []
            if queue is not None:
                queue.items.clear()
            self._reply(client, reqid, self._hand_over(client, items, {
                "status": "ok", "values": [_wire(v.data) for v in items]}))
            for value in items:
                self._release(value)
            if queue is not None:
                self._settle_queue(name, queue)
            return
        need = 1 if batch is False else batch
        if queue is not None and queue.maxsize and need > queue.maxsize:
            _fail(f"'queue-get': a batch of {need} from queue {bounded_repr(name, 80)} of "
                  f"maxsize {queue.maxsize} could never be served")
        if queue is not None and len(queue.items) >= need:
            self._give(client, reqid, queue, need, batch is not False)
            self._settle_queue(name, queue)
        elif deadline is not None and deadline <= now:
            self._reply(client, reqid, {"status": "timed-out"})
        else:
            self._check_can_park(client, reqid)
            if queue is None:
                self._check_room(self.queues, name, "queue")
                queue = self.queues[name] = _QueueState(maxsize)
            self._park(client, reqid, "queue-get", name, deadline, queue.getters,
                       (need, batch is not False))

    def _give(self, client: str, reqid: int, queue: _QueueState, need: int,
              as_list: bool) -> None:
        items = [queue.items.popleft() for _ in range(need)]
        if as_list:
            result = {"status": "ok", "values": [_wire(v.data) for v in items]}
        else:
            result = {"status": "ok", "value": _wire(items[0].data)}
        self._reply(client, reqid, self._hand_over(client, items, result))
        for value in items:
            self._release(value)

    def _settle_queue(self, name: str, queue: _QueueState) -> None:
        """Serve waiting getters (the first that enough items satisfy) and admit waiting
        putters while there is room, until neither can move."""
        capacity = queue.maxsize or self.limits.max_queue_items
        moved = True
        while moved:
            moved = False
            for waiter in list(queue.getters.values()):
                need, as_list = waiter.extra
                if len(queue.items) >= need:
                    self._unpark(waiter, self.clients[waiter.client])
                    self._give(waiter.client, waiter.reqid, queue, need, as_list)
                    moved = True
            while queue.putters and len(queue.items) < capacity:
                waiter = self._pop_waiter(queue.putters)
                queue.items.append(waiter.extra)  # stays retained: it moves
                self._answer(waiter, {"status": "ok"})
                moved = True
        self._tidy_queue(name)

    def _tidy_queue(self, name: str) -> None:
        queue = self.queues.get(name)
        if queue is not None and not (queue.items or queue.getters or queue.putters):
            del self.queues[name]

    def _queue_qsize(self, client: str, msg: dict, now: float) -> None:
        reqid, name = _reqid(msg), _name(msg)
        queue = self.queues.get(name)
        self._reply(client, reqid, {"status": "ok",
                                    "size": len(queue.items) if queue is not None else 0})

    # ------------------------------------------------------------ Lock and Semaphore

    def _lock_acquire(self, client: str, msg: dict, now: float) -> None:
        self._acquire(client, msg, now, "lock", self.locks, 1)

    def _semaphore_acquire(self, client: str, msg: dict, now: float) -> None:
        name, max_leases = _name(msg), _count(msg, "max_leases", 1, MAX_LEASES, 1)
        pool = self.semaphores.get(name)
        if pool is not None and pool.max_leases != max_leases:
            _fail(f"semaphore {bounded_repr(name, 80)} has max_leases="
                  f"{pool.max_leases}, not {max_leases}")
        self._acquire(client, msg, now, "semaphore", self.semaphores, max_leases)

    def _acquire(self, client: str, msg: dict, now: float, kind: str, table: dict,
                 max_leases: int) -> None:
        reqid, name, holder = _reqid(msg), _name(msg), _holder(msg)
        deadline = _deadline(msg, now)
        pool = table.get(name)
        free = pool is None or (pool.total < pool.max_leases and not pool.waiters)
        expired = deadline is not None and deadline <= now
        if pool is None:
            self._check_room(table, name, kind)
        if not free and not expired:
            self._check_can_park(client, reqid)
        if free:
            if pool is None:
                pool = table[name] = _LeasePool(max_leases)
            self._lease(kind, name, pool, client, holder)
            self._reply(client, reqid, {"status": "ok"})
        elif expired:
            self._reply(client, reqid, {"status": "timed-out"})
        else:
            self._park(client, reqid, f"{kind}-acquire", name, deadline, pool.waiters, holder)

    def _lease(self, kind: str, name: str, pool: _LeasePool, client: str,
               holder: str) -> None:
        lease = (client, holder)
        pool.leases[lease] = pool.leases.get(lease, 0) + 1
        pool.by_client[client] = pool.by_client.get(client, 0) + 1
        pool.total += 1
        self._record(client).pools.add((kind, name))

    def _grant_leases(self, kind: str, name: str, pool: _LeasePool) -> None:
        while pool.waiters and pool.total < pool.max_leases:
            waiter = self._pop_waiter(pool.waiters)
            self._lease(kind, name, pool, waiter.client, waiter.extra)
            self._answer(waiter, {"status": "ok"})

    def _tidy_pool(self, table: dict, name: str, pool: _LeasePool) -> None:
        if not pool.total and not pool.waiters:
            del table[name]

    def _lock_release(self, client: str, msg: dict, now: float) -> None:
        self._release_lease(client, msg, "lock", self.locks)

    def _semaphore_release(self, client: str, msg: dict, now: float) -> None:
        self._release_lease(client, msg, "semaphore", self.semaphores)

    def _release_lease(self, client: str, msg: dict, kind: str, table: dict) -> None:
        reqid, name, holder = _reqid(msg), _name(msg), _holder(msg)
        pool = table.get(name)
        lease = (client, holder)
        if pool is None or lease not in pool.leases:
            _fail(f"{kind} {bounded_repr(name, 80)} is not held by this {kind.title()} "
                  f"object: release without acquire")
        if pool.leases[lease] == 1:
            del pool.leases[lease]
        else:
            pool.leases[lease] -= 1
        pool.total -= 1
        if pool.by_client[client] == 1:
            del pool.by_client[client]
            self.clients[client].pools.discard((kind, name))
        else:
            pool.by_client[client] -= 1
        self._reply(client, reqid, {"status": "ok"})
        self._grant_leases(kind, name, pool)
        self._tidy_pool(table, name, pool)

    def _lock_locked(self, client: str, msg: dict, now: float) -> None:
        reqid, name = _reqid(msg), _name(msg)
        self._reply(client, reqid, {"status": "ok", "locked": name in self.locks
                                    and self.locks[name].total > 0})

    def _semaphore_value(self, client: str, msg: dict, now: float) -> None:
        reqid, name = _reqid(msg), _name(msg)
        pool = self.semaphores.get(name)
        self._reply(client, reqid, {"status": "ok", "value": pool.total if pool else 0})

    # ------------------------------------------------------------ Event

    def _event_set(self, client: str, msg: dict, now: float) -> None:
        reqid, name = _reqid(msg), _name(msg)
        self._check_room(self.events, name, "event")
        event = self.events.get(name)
        if event is None:
            event = self.events[name] = _EventState()
        event.is_set = True
        while event.waiters:
            self._answer(self._pop_waiter(event.waiters), {"status": "ok"})
        self._reply(client, reqid, {"status": "ok"})

    def _event_clear(self, client: str, msg: dict, now: float) -> None:
        reqid, name = _reqid(msg), _name(msg)
        event = self.events.get(name)
        if event is not None:
            event.is_set = False
            self._tidy_event(name)
        self._reply(client, reqid, {"status": "ok"})

    def _event_wait(self, client: str, msg: dict, now: float) -> None:
        reqid, name, deadline = _reqid(msg), _name(msg), _deadline(msg, now)
        event = self.events.get(name)
        if event is not None and event.is_set:
            self._reply(client, reqid, {"status": "ok"})
        elif deadline is not None and deadline <= now:
            self._reply(client, reqid, {"status": "timed-out"})
        else:
            self._check_can_park(client, reqid)
            self._check_room(self.events, name, "event")
            if event is None:
                event = self.events[name] = _EventState()
            self._park(client, reqid, "event-wait", name, deadline, event.waiters)

    def _event_is_set(self, client: str, msg: dict, now: float) -> None:
        reqid, name = _reqid(msg), _name(msg)
        event = self.events.get(name)
        self._reply(client, reqid, {"status": "ok", "is_set": bool(event and event.is_set)})

    def _tidy_event(self, name: str) -> None:
        event = self.events.get(name)
        if event is not None and not event.is_set and not event.waiters:
            del self.events[name]

    # ------------------------------------------------------------ Pub / Sub

    def _pub_put(self, client: str, msg: dict, now: float) -> None:
        name = _name(msg)
        subs = self.topics.get(name)
        value = self._value(msg, copies=len(subs) if subs else 1)
        if not subs:
            return  # nobody listens: the message is gone, as in dask
        limit = self.limits.max_sub_buffer
        for sub in subs.values():
            if sub.waiters:
                waiter = self._pop_waiter(sub.waiters)
                self._answer(waiter, self._hand_over(sub.client, [value], {
                    "status": "ok", "value": _wire(value.data), "dropped": sub.dropped}))
                sub.dropped = 0
                continue
            self._retain(value)
            sub.buffer.append(value)
            if len(sub.buffer) > limit:
                self._release(sub.buffer.popleft())
                sub.dropped += 1

    def _sub_id(self, msg: dict) -> int:
        sub_id = msg.get("sub_id")
        if type(sub_id) is not int or not 0 <= sub_id < 2**63:
            _fail(f"{msg['op']!r} needs an int 'sub_id', not {bounded_repr(sub_id, 60)}")
        return sub_id

    def _sub_subscribe(self, client: str, msg: dict, now: float) -> None:
        reqid, name, sub_id = _reqid(msg), _name(msg), self._sub_id(msg)
        record = self.clients.get(client)
        if record is not None:
            if sub_id in record.subs:
                _fail(f"subscription {sub_id} exists already")
            if len(record.subs) >= self.limits.max_subscriptions_per_client:
                _fail(f"this client has {len(record.subs):,} subscriptions, the most it may")
        self._check_room(self.topics, name, "topic")
        sub = _Subscription(client, sub_id, name)
        self._record(client).subs[sub_id] = sub
        self.topics.setdefault(name, {})[(client, sub_id)] = sub
        self._reply(client, reqid, {"status": "ok"})

    def _subscription(self, client: str, msg: dict) -> _Subscription:
        sub_id = self._sub_id(msg)
        record = self.clients.get(client)
        sub = record.subs.get(sub_id) if record is not None else None
        if sub is None:
            _fail(f"{msg['op']!r}: this client has no subscription {sub_id}")
        return sub

    def _sub_get(self, client: str, msg: dict, now: float) -> None:
        reqid, deadline = _reqid(msg), _deadline(msg, now)
        sub = self._subscription(client, msg)
        self._check_can_receive(client)
        if sub.buffer:
            value = sub.buffer.popleft()
            self._reply(client, reqid, self._hand_over(client, [value], {
                "status": "ok", "value": _wire(value.data), "dropped": sub.dropped}))
            sub.dropped = 0
            self._release(value)
        elif deadline is not None and deadline <= now:
            self._reply(client, reqid, {"status": "timed-out"})
        else:
            self._check_can_park(client, reqid)
            self._park(client, reqid, "sub-get", sub.sub_id, deadline, sub.waiters)

    def _sub_unsubscribe(self, client: str, msg: dict, now: float) -> None:
        sub = self._subscription(client, msg)
        del self.clients[client].subs[sub.sub_id]
        for waiter in list(sub.waiters.values()):
            self._unpark(waiter, self.clients[client])
            self._answer(waiter, {"status": "closed"})
        self._close_subscription(sub)

    def _close_subscription(self, sub: _Subscription) -> None:
        for value in sub.buffer:
            self._release(value)
        sub.buffer.clear()
        subs = self.topics[sub.topic]
        del subs[(sub.client, sub.sub_id)]
        if not subs:
            del self.topics[sub.topic]


#: The client ops the Scheduler hands to `Coordination.handle`.
OPS = frozenset(Coordination(lambda key: False)._handlers)
