"""Variable: one named value that clients set, get (waiting until it is set) and delete."""
from __future__ import annotations

from .ledger import Ledger, Primitive, Waiter, check_state
from .requests import check_deadline, check_name, check_reqid, wire_value


class Variables(Primitive):
    """The variables (``table``: name -> `Value`) and the gets waiting for one
    (``waiters``: name -> {waiter id: waiter})."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.waiters: dict = {}
        self.handlers = {"variable-set": self._set, "variable-get": self._get,
                         "variable-delete": self._delete}

    def _set(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        reqid, name = check_reqid(msg), check_name(msg)
        old = self.table.get(name)
        value = ledger.checked_value(msg, freed=old.nbytes if old is not None else 0)
        ledger.check_room(self.table, name, "variable")
        waiters = self.waiters.get(name)
        ledger.retain(value)
        self.table[name] = value
        if old is not None:
            ledger.release(old)
        while waiters:
            waiter = ledger.pop_waiter(waiters)
            ledger.answer(waiter, ledger.hand_over(waiter.client, [value], {
                "status": "ok", "value": wire_value(value.data)}))
        self.waiters.pop(name, None)
        ledger.reply(client, reqid, {"status": "ok"})

    def _get(self, client: str, msg: dict, now: float) -> None:
        ledger = self.ledger
        reqid, name, deadline = check_reqid(msg), check_name(msg), check_deadline(msg, now)
        ledger.check_can_receive(client)
        value = self.table.get(name)
        if value is not None:
            ledger.reply(client, reqid, ledger.hand_over(client, [value], {
                "status": "ok", "value": wire_value(value.data)}))
        elif deadline is not None and deadline <= now:
            ledger.reply(client, reqid, {"status": "timed-out"})
        else:
            ledger.check_can_park(client, reqid)
            waiters = self.waiters.setdefault(name, {})
            ledger.park(client, reqid, "variable-get", name, deadline, waiters)

    def _delete(self, client: str, msg: dict, now: float) -> None:
        reqid, name = check_reqid(msg), check_name(msg)
        old = self.table.pop(name, None)
        if old is not None:
            self.ledger.release(old)
        self.ledger.reply(client, reqid, {"status": "ok"})

    def stored_values(self):
        """Each variable's value."""
        return self.table.values()

    def waiter_gone(self, waiter: Waiter) -> None:
        """Forget the name's waiters once none is left."""
        if not self.waiters[waiter.name]:
            del self.waiters[waiter.name]

    def validate(self) -> list:
        """No set variable has waiters."""
        check_state(not self.waiters.keys() & self.table.keys(), "waiters on a set variable")
        return list(self.waiters.values())
