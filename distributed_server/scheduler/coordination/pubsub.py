"""Pub/Sub: values published to a topic reach every subscription to it at that moment;
each subscription buffers what its client has not yet got (the oldest dropped beyond
``max_sub_buffer``). Published to a topic nobody subscribes to, a value is gone."""
from __future__ import annotations

from collections import deque

from distributed_core import bounded_repr

from .ledger import ClientRecord, Ledger, Primitive, check_state
from .requests import check_deadline, check_name, check_reqid, refuse, wire_value


class Subscription:
    """One client's subscription to a topic: its buffer and its waiting gets."""

    __slots__ = ("buffer", "client", "dropped", "sub_id", "topic", "waiters")

    def __init__(self, client: str, sub_id: int, topic: str) -> None:
        self.client = client
        self.sub_id = sub_id
        self.topic = topic
        self.buffer: deque = deque()
        self.dropped = 0
        self.waiters: dict = {}


class PubSub(Primitive):
    """The topics (``table``: name -> {(client, sub_id): `Subscription`}); a topic is
    forgotten with its last subscription. A client's subscriptions are also in its
    record (``subs``)."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.handlers = {"pub-put": self._put, "sub-subscribe": self._subscribe,
                         "sub-get": self._get, "sub-unsubscribe": self._unsubscribe}

    def _put(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        name = check_name(msg)
        subs = self.table.get(name)
        value = ledger.checked_value(msg, copies=len(subs) if subs else 1)
        if not subs:
            return  # nobody listens: the message is gone, as in dask
        limit = ledger.limits.max_sub_buffer
        for sub in subs.values():
            if sub.waiters:
                waiter = ledger.pop_waiter(sub.waiters)
                ledger.answer(waiter, ledger.hand_over(sub.client, [value], {
                    "status": "ok", "value": wire_value(value.data), "dropped": sub.dropped}))
                sub.dropped = 0
                continue
            ledger.retain(value)
            sub.buffer.append(value)
            if len(sub.buffer) > limit:
                ledger.release(sub.buffer.popleft())
                sub.dropped += 1

    def _sub_id(self, msg: dict) -> int:
        sub_id = msg.get("sub_id")
        if type(sub_id) is not int or not 0 <= sub_id < 2**63:
            refuse(f"{msg['op']!r} needs an int 'sub_id', not {bounded_repr(sub_id, 60)}")
        return sub_id

    def _subscribe(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        reqid, name, sub_id = check_reqid(msg), check_name(msg), self._sub_id(msg)
        record = ledger.clients.get(client)
        if record is not None:
            if sub_id in record.subs:
                refuse(f"subscription {sub_id} exists already")
            if len(record.subs) >= ledger.limits.max_subscriptions_per_client:
                refuse(f"this client has {len(record.subs):,} subscriptions, the most it may")
        ledger.check_room(self.table, name, "topic")
        sub = Subscription(client, sub_id, name)
        ledger.record(client).subs[sub_id] = sub
        self.table.setdefault(name, {})[(client, sub_id)] = sub
        ledger.reply(client, reqid, {"status": "ok"})

    def _subscription(self, client: str, msg: dict) -> Subscription:
        sub_id = self._sub_id(msg)
        record = self.ledger.clients.get(client)
        sub = record.subs.get(sub_id) if record is not None else None
        if sub is None:
            refuse(f"{msg['op']!r}: this client has no subscription {sub_id}")
        return sub

    def _get(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        reqid, deadline = check_reqid(msg), check_deadline(msg, now)
        sub = self._subscription(client, msg)
        ledger.check_can_receive(client)
        if sub.buffer:
            value = sub.buffer.popleft()
            ledger.reply(client, reqid, ledger.hand_over(client, [value], {
                "status": "ok", "value": wire_value(value.data), "dropped": sub.dropped}))
            sub.dropped = 0
            ledger.release(value)
        elif deadline is not None and deadline <= now:
            ledger.reply(client, reqid, {"status": "timed-out"})
        else:
            ledger.check_can_park(client, reqid)
            ledger.park(client, reqid, "sub-get", sub.sub_id, deadline, sub.waiters)

    def _unsubscribe(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        sub = self._subscription(client, msg)
        del ledger.clients[client].subs[sub.sub_id]
        for waiter in list(sub.waiters.values()):
            ledger.unpark(waiter, ledger.clients[client])
            ledger.answer(waiter, {"status": "closed"})
        self._close(sub)

    def _close(self, sub: Subscription) -> None:
        for value in sub.buffer:
            self.ledger.release(value)
        sub.buffer.clear()
        subs = self.table[sub.topic]
        del subs[(sub.client, sub.sub_id)]
        if not subs:
            del self.table[sub.topic]

    def stored_values(self):
        """What every subscription has buffered."""
        for subs in self.table.values():
            for sub in subs.values():
                yield from sub.buffer

    def client_gone(self, client: str, record: ClientRecord) -> None:
        """The client's subscriptions close, their buffers released."""
        for sub in record.subs.values():
            self._close(sub)

    def validate(self) -> list:
        """No empty topic is kept; every subscription is in its client's record."""
        containers = []
        for subs in self.table.values():
            check_state(bool(subs), "an empty topic")
            for sub in subs.values():
                check_state(self.ledger.clients[sub.client].subs[sub.sub_id] is sub,
                            "a lost subscription")
                containers.append(sub.waiters)
        return containers
