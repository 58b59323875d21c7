"""The bookkeeping every coordination primitive shares: stored values and the task keys
they hold, parked requests and their deadlines, per-client records, and the effects a
call returns. `Ledger` is the base of `Coordination`; each primitive (a `Primitive`) gets
the ledger and keeps only its own tables.

Values are opaque bytes (the client's pickle) with the list of task keys of the Futures
inside them. Each stored copy of a value and each handoff counts towards its keys (see
the package docstring); a call's net change of those counts becomes its ``hold`` and
``drop`` effects.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from distributed_core import bounded_repr

from ...protocol.coordination_limits import BLOB_MIN_BYTES, CoordinationLimits
from .requests import refuse


class Value:
    """A value as the scheduler keeps it: opaque bytes and the keys of its Futures."""

    __slots__ = ("data", "keys", "nbytes")

    def __init__(self, data, keys: tuple) -> None:
        self.data = data
        self.keys = keys
        self.nbytes = len(data) if isinstance(data, bytes) else data.nbytes


class Waiter:
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
        """``(client, reqid)``: the waiter's key in its container."""
        return (self.client, self.reqid)


class ClientRecord:
    """What one client has here, so that its departure undoes all of it."""

    __slots__ = ("handoffs", "next_handoff", "pools", "subs", "waiting")

    def __init__(self) -> None:
        self.waiting: dict = {}  # reqid -> Waiter
        self.pools: set = set()  # (kind, name) of lease pools where it holds leases
        self.subs: dict = {}  # sub_id -> Subscription
        self.handoffs: dict = {}  # handoff id -> keys
        self.next_handoff = 0


def check_state(condition: bool, text: str) -> None:
    """Raise AssertionError (a bug in the bookkeeping, not bad input) unless ``condition``."""
    if not condition:
        raise AssertionError(f"coordination state: {text}")


class Primitive:
    """One kind of primitive (Variable, Queue, ...): its tables and its handlers.

    ``handlers`` maps each op to ``handler(client, msg, now)``, which checks its whole
    input (raising `CoordinationError`) before it changes anything. The hooks below let
    `Coordination` undo and check what the primitive holds without knowing its tables.
    """

    #: name -> the primitive's state (for counts: `Coordination.summary`)
    table: dict
    handlers: dict

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.table = {}
        self.handlers = {}

    def stored_values(self):
        """Every `Value` this primitive stores, once per stored copy."""
        return ()

    def waiter_gone(self, waiter: Waiter) -> None:
        """A request it parked left unserved (timed out, abandoned, its client gone):
        free what the waiter held and forget state nobody uses any more."""

    def client_gone(self, client: str, record: ClientRecord) -> None:
        """``client`` left (its parked requests are gone already): undo what it held."""

    def validate(self) -> list:
        """Check this primitive's tables (AssertionError); return its waiter containers."""
        return []


class Ledger:
    """The shared bookkeeping; see the module docstring.

    ``key_exists(key)`` tells whether the scheduler knows a task key (a value may only
    hold Futures of existing tasks). ``limits``: `CoordinationLimits`.
    """

    def __init__(self, key_exists: Callable[[object], bool],
                 limits: CoordinationLimits | None = None) -> None:
        self.limits = limits if limits is not None else CoordinationLimits()
        self._key_exists = key_exists
        self.clients: dict = {}  # client id -> ClientRecord
        self.held: dict = {}  # key -> stored copies and handoffs that hold it
        self.total_bytes = 0
        self._deadlines: list = []  # heap of (deadline, seq, waiter)
        self._seq = itertools.count()
        self._timed = 0  # active waiters with a deadline
        self._effects: list = []
        self._before: dict = {}  # key -> its count in `held` before this call

    # ------------------------------------------------------------ effects and key holds

    def _finish(self) -> list:
        """The effects of this call: what was sent, then the keys now held or dropped."""
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

    def count_keys(self, keys: tuple, delta: int) -> None:
        """Add ``delta`` to the holds of ``keys`` (remembering their counts before)."""
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

    def retain(self, value: Value) -> None:
        """``value`` is now stored (once more): its bytes and keys count."""
        self.total_bytes += value.nbytes
        self.count_keys(value.keys, 1)

    def release(self, value: Value) -> None:
        """One stored copy of ``value`` is gone."""
        self.total_bytes -= value.nbytes
        self.count_keys(value.keys, -1)

    def checked_value(self, msg: dict, copies: int = 1, freed: int = 0) -> Value:
        """The ``value`` and ``keys`` of ``msg`` as a `Value`, checked: bytes within the
        limits (``copies`` stored, ``freed`` bytes given back), keys of known tasks
        (`CoordinationError` otherwise)."""
        limits = self.limits
        data, keys = msg.get("value"), msg.get("keys", ())
        if not isinstance(data, (bytes, memoryview)):
            refuse(f"{msg['op']!r}: 'value' must be bytes (the client's pickle), not "
                   f"{type(data).__name__}")
        nbytes = len(data) if isinstance(data, bytes) else data.nbytes
        if nbytes > limits.max_value_bytes:
            refuse(f"{msg['op']!r}: the value is {nbytes:,} bytes pickled; a primitive holds "
                   f"at most {limits.max_value_bytes:,} bytes per value (share large data "
                   f"as a Future: scatter it, then put the Future in)")
        if self.total_bytes - freed + nbytes * copies > limits.max_total_bytes:
            refuse(f"{msg['op']!r}: the scheduler already holds {self.total_bytes:,} bytes "
                   f"of primitive values, and may hold at most "
                   f"{limits.max_total_bytes:,}; this value ({nbytes:,} bytes"
                   f"{f' x {copies} subscribers' if copies > 1 else ''}) does not fit")
        if type(keys) not in (list, tuple) or len(keys) > limits.max_keys_per_value:
            refuse(f"{msg['op']!r}: 'keys' must be a list of at most "
                   f"{limits.max_keys_per_value:,} keys, not {bounded_repr(keys, 80)}")
        try:
            keys = tuple(dict.fromkeys(keys))
        except TypeError:
            refuse(f"{msg['op']!r}: keys must be hashable")
        unknown = [key for key in keys if not self._key_exists(key)]
        if unknown:
            refuse(f"{msg['op']!r}: the value holds Futures of keys the scheduler does not "
                   f"know (released or cancelled?): {bounded_repr(unknown[:5], 200)}")
        if isinstance(data, memoryview) and nbytes < BLOB_MIN_BYTES:
            data = bytes(data)
        return Value(data, keys)

    def check_room(self, table: dict, name: str, kind: str) -> None:
        """Refuse a new ``name`` in ``table`` once it holds ``max_names`` names."""
        if name not in table and len(table) >= self.limits.max_names:
            refuse(f"the scheduler holds {len(table):,} {kind}s, the most it may; "
                   f"{kind} {bounded_repr(name, 80)} cannot be made (delete or release some)")

    # ------------------------------------------------------------ parking and answering

    def record(self, client: str) -> ClientRecord:
        """``client``'s record, made if it has none yet."""
        record = self.clients.get(client)
        if record is None:
            record = self.clients[client] = ClientRecord()
        return record

    def check_can_park(self, client: str, reqid: int) -> None:
        """Refuse to park request ``reqid`` of ``client`` (a duplicate, or too many)."""
        record = self.clients.get(client)
        if record is None:
            return
        if reqid in record.waiting:
            refuse(f"request {reqid} is already waiting")
        if len(record.waiting) >= self.limits.max_waiting_per_client:
            refuse(f"this client has {len(record.waiting):,} requests waiting, the most it "
                   f"may")

    def park(self, client: str, reqid: int, kind: str, name, deadline: float | None,
             container: dict, extra=None) -> None:
        """Park a request in ``container`` (the caller ran `check_can_park` before
        changing anything)."""
        waiter = Waiter(client, reqid, kind, name, deadline, container, extra)
        self.record(client).waiting[reqid] = waiter
        container[waiter.id] = waiter
        if deadline is not None:
            self._timed += 1
            heapq.heappush(self._deadlines, (deadline, next(self._seq), waiter))
            if len(self._deadlines) > 2 * self._timed + 64:  # answered ones pile up
                self._deadlines = [e for e in self._deadlines if e[2].active]
                heapq.heapify(self._deadlines)

    def unpark(self, waiter: Waiter, record: ClientRecord) -> None:
        """Take ``waiter`` out of its container and its client's ``record``."""
        waiter.active = False
        if waiter.deadline is not None:
            self._timed -= 1
        del record.waiting[waiter.reqid]
        del waiter.container[waiter.id]

    def pop_waiter(self, container: dict) -> Waiter:
        """Unpark and return the oldest waiter of ``container``."""
        waiter = container[next(iter(container))]
        self.unpark(waiter, self.clients[waiter.client])
        return waiter

    def reply(self, client: str, reqid: int, result) -> None:
        """Answer request ``reqid`` of ``client`` (sent with this call's effects)."""
        self._effects.append(("send", client, {"op": "reply", "reqid": reqid,
                                               "result": result}))

    def answer(self, waiter: Waiter, result) -> None:
        """Answer a parked request (already unparked)."""
        self.reply(waiter.client, waiter.reqid, result)

    def hand_over(self, client: str, values: list, result: dict) -> dict:
        """``result`` carrying ``values`` to ``client``: their keys stay held until it
        confirms receipt (``value-received`` with the handoff id)."""
        keys = tuple(dict.fromkeys(k for v in values for k in v.keys))
        if keys:
            record = self.record(client)
            handoff = record.next_handoff
            record.next_handoff += 1
            record.handoffs[handoff] = keys
            self.count_keys(keys, 1)
            result["handoff"] = handoff
        return result

    def check_can_receive(self, client: str) -> None:
        """Refuse to hand ``client`` a value while it has too many unconfirmed ones."""
        record = self.clients.get(client)
        if record is not None and len(record.handoffs) >= self.limits.max_handoffs_per_client:
            refuse(f"this client has not confirmed {len(record.handoffs):,} values it "
                   f"received (value-received), the most it may")
