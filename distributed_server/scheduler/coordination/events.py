"""Event: a named flag that clients set, clear, and wait on until it is set."""
from __future__ import annotations

from .ledger import Ledger, Primitive, Waiter, check_state
from .requests import check_deadline, check_name, check_reqid


class EventState:
    """One event: set or not, and the requests waiting for it to be set."""

    __slots__ = ("is_set", "waiters")

    def __init__(self) -> None:
        self.is_set = False
        self.waiters: dict = {}


class Events(Primitive):
    """The events (``table``: name -> `EventState`); an event that is clear and has no
    waiters is forgotten."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.handlers = {"event-set": self._set, "event-clear": self._clear,
                         "event-wait": self._wait, "event-is-set": self._is_set}

    def _set(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        reqid, name = check_reqid(msg), check_name(msg)
        ledger.check_room(self.table, name, "event")
        event = self.table.get(name)
        if event is None:
            event = self.table[name] = EventState()
        event.is_set = True
        while event.waiters:
            ledger.answer(ledger.pop_waiter(event.waiters), {"status": "ok"})
        ledger.reply(client, reqid, {"status": "ok"})

    def _clear(self, client: str, msg: dict, now: float) -> None:
        reqid, name = check_reqid(msg), check_name(msg)
        event = self.table.get(name)
        if event is not None:
            event.is_set = False
            self._tidy(name)
        self.ledger.reply(client, reqid, {"status": "ok"})

    def _wait(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        reqid, name, deadline = check_reqid(msg), check_name(msg), check_deadline(msg, now)
        event = self.table.get(name)
        if event is not None and event.is_set:
            ledger.reply(client, reqid, {"status": "ok"})
        elif deadline is not None and deadline <= now:
            ledger.reply(client, reqid, {"status": "timed-out"})
        else:
            ledger.check_can_park(client, reqid)
            ledger.check_room(self.table, name, "event")
            if event is None:
                event = self.table[name] = EventState()
            ledger.park(client, reqid, "event-wait", name, deadline, event.waiters)

    def _is_set(self, client: str, msg: dict, now: float) -> None:
        reqid, name = check_reqid(msg), check_name(msg)
        event = self.table.get(name)
        self.ledger.reply(client, reqid, {"status": "ok",
                                          "is_set": bool(event and event.is_set)})

    def _tidy(self, name: str) -> None:
        event = self.table.get(name)
        if event is not None and not event.is_set and not event.waiters:
            del self.table[name]

    def waiter_gone(self, waiter: Waiter) -> None:
        """Forget the event if it is clear and nobody waits any more."""
        self._tidy(waiter.name)

    def validate(self) -> list:
        """Every event kept is set or waited on, never both."""
        for event in self.table.values():
            check_state(event.is_set or bool(event.waiters), "an empty event")
            check_state(not (event.is_set and event.waiters), "waiters on a set event")
        return [event.waiters for event in self.table.values()]
