"""Queue: named FIFO queues of values; gets wait for items, puts to a full queue (one with
a maxsize) wait for room."""
from __future__ import annotations

from collections import deque

from distributed_core import bounded_repr

from .ledger import Ledger, Primitive, Waiter, check_state
from .requests import check_count, check_deadline, check_name, check_reqid, refuse, wire_value


class QueueState:
    """One queue: its items, waiting getters and waiting putters (each holding its value)."""

    __slots__ = ("getters", "items", "maxsize", "putters")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.items: deque = deque()
        self.getters: dict = {}
        self.putters: dict = {}


class Queues(Primitive):
    """The queues (``table``: name -> `QueueState`); an empty queue nobody waits on is
    forgotten. A queue without a maxsize holds at most ``max_queue_items`` items."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.handlers = {"queue-put": self._put, "queue-get": self._get,
                         "queue-qsize": self._qsize}

    def _put(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        reqid, name, deadline = check_reqid(msg), check_name(msg), check_deadline(msg, now)
        maxsize = check_count(msg, "maxsize", 0, ledger.limits.max_queue_items, 0)
        value = ledger.checked_value(msg)
        queue = self.table.get(name)
        if queue is None:
            ledger.check_room(self.table, name, "queue")
            maxsize_now, n_items, n_putters = maxsize, 0, 0
        else:
            maxsize_now, n_items, n_putters = queue.maxsize, len(queue.items), len(queue.putters)
        full = n_items + n_putters >= (maxsize_now or ledger.limits.max_queue_items)
        if full and not maxsize_now:
            refuse(f"queue {bounded_repr(name, 80)} holds {n_items:,} items, the most a "
                   f"queue may hold (give it a maxsize to make put wait instead)")
        if full and not (deadline is not None and deadline <= now):
            ledger.check_can_park(client, reqid)
        if queue is None:
            queue = self.table[name] = QueueState(maxsize)
        if not full:
            ledger.retain(value)
            queue.items.append(value)
            ledger.reply(client, reqid, {"status": "ok"})
            self._settle(name, queue)
        elif deadline is not None and deadline <= now:
            ledger.reply(client, reqid, {"status": "timed-out"})
            self._tidy(name)
        else:
            ledger.retain(value)
            ledger.park(client, reqid, "queue-put", name, deadline, queue.putters, value)

    def _get(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        reqid, name, deadline = check_reqid(msg), check_name(msg), check_deadline(msg, now)
        batch = msg.get("batch", False)
        if batch is not True and batch is not False:
            batch = check_count(msg, "batch", 1, ledger.limits.max_queue_items, 1)
        maxsize = check_count(msg, "maxsize", 0, ledger.limits.max_queue_items, 0)
        ledger.check_can_receive(client)
        queue = self.table.get(name)
        if batch is True:
            items = list(queue.items) if queue is not None else []
            if queue is not None:
                queue.items.clear()
            ledger.reply(client, reqid, ledger.hand_over(client, items, {
                "status": "ok", "values": [wire_value(v.data) for v in items]}))
            for value in items:
                ledger.release(value)
            if queue is not None:
                self._settle(name, queue)
            return
        need = 1 if batch is False else batch
        if queue is not None and queue.maxsize and need > queue.maxsize:
            refuse(f"'queue-get': a batch of {need} from queue {bounded_repr(name, 80)} of "
                   f"maxsize {queue.maxsize} could never be served")
        if queue is not None and len(queue.items) >= need:
            self._give(client, reqid, queue, need, batch is not False)
            self._settle(name, queue)
        elif deadline is not None and deadline <= now:
            ledger.reply(client, reqid, {"status": "timed-out"})
        else:
            ledger.check_can_park(client, reqid)
            if queue is None:
                ledger.check_room(self.table, name, "queue")
                queue = self.table[name] = QueueState(maxsize)
            ledger.park(client, reqid, "queue-get", name, deadline, queue.getters,
                        (need, batch is not False))

    def _give(self, client: str, reqid: int, queue: QueueState, need: int,
              as_list: bool) -> None:
        ledger = self.ledger
        items = [queue.items.popleft() for _ in range(need)]
        if as_list:
            result = {"status": "ok", "values": [wire_value(v.data) for v in items]}
        else:
            result = {"status": "ok", "value": wire_value(items[0].data)}
        ledger.reply(client, reqid, ledger.hand_over(client, items, result))
        for value in items:
            ledger.release(value)

    def _settle(self, name: str, queue: QueueState) -> None:
        """Serve waiting getters (the first that enough items satisfy) and admit waiting
        putters while there is room, until neither can move."""
        ledger = self.ledger
        capacity = queue.maxsize or ledger.limits.max_queue_items
        moved = True
        while moved:
            moved = False
            for waiter in list(queue.getters.values()):
                need, as_list = waiter.extra
                if len(queue.items) >= need:
                    ledger.unpark(waiter, ledger.clients[waiter.client])
                    self._give(waiter.client, waiter.reqid, queue, need, as_list)
                    moved = True
            while queue.putters and len(queue.items) < capacity:
                waiter = ledger.pop_waiter(queue.putters)
                queue.items.append(waiter.extra)  # stays retained: it moves
                ledger.answer(waiter, {"status": "ok"})
                moved = True
        self._tidy(name)

    def _tidy(self, name: str) -> None:
        queue = self.table.get(name)
        if queue is not None and not (queue.items or queue.getters or queue.putters):
            del self.table[name]

    def _qsize(self, client: str, msg: dict, now: float) -> None:
        reqid, name = check_reqid(msg), check_name(msg)
        queue = self.table.get(name)
        self.ledger.reply(client, reqid, {"status": "ok",
                                          "size": len(queue.items) if queue is not None else 0})

    def stored_values(self):
        """The items of every queue, and the values of its waiting puts."""
        for queue in self.table.values():
            yield from queue.items
            for waiter in queue.putters.values():
                yield waiter.extra

    def waiter_gone(self, waiter: Waiter) -> None:
        """A waiting put gives its value back; an unused queue is forgotten."""
        if waiter.kind == "queue-put":
            self.ledger.release(waiter.extra)
        self._tidy(waiter.name)

    def validate(self) -> list:
        """No empty queue nobody waits on is kept."""
        containers = []
        for queue in self.table.values():
            check_state(bool(queue.items or queue.getters or queue.putters), "an empty queue")
            containers += [queue.getters, queue.putters]
        return containers
