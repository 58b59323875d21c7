"""Semaphore and Lock: named pools of leases that clients acquire (waiting while none is
free) and release. A Lock is a pool of one lease; both are `LeasePools`, each with its
own names and ops. A lease belongs to a holder (the Lock or Semaphore object) of a client.
"""
from __future__ import annotations

from distributed_core import bounded_repr

from ...protocol.coordination_limits import MAX_LEASES
from .ledger import ClientRecord, Ledger, Primitive, Waiter, check_state
from .requests import check_count, check_deadline, check_holder, check_name, check_reqid, refuse


class LeasePool:
    """The leases of one Semaphore or Lock, and the acquires waiting for one."""

    __slots__ = ("by_client", "leases", "max_leases", "total", "waiters")

    def __init__(self, max_leases: int) -> None:
        self.max_leases = max_leases
        self.leases: dict = {}  # (client, holder) -> leases it holds
        self.by_client: dict = {}  # client -> leases it holds
        self.total = 0
        self.waiters: dict = {}


class LeasePools(Primitive):
    """The pools of one kind (``table``: name -> `LeasePool`); a pool nobody holds or
    waits on is forgotten. Subclasses name the kind and its ops."""

    kind = ""

    def _acquire(self, client: str, msg: dict, now: float, max_leases: int) -> None:
        ledger, kind, table = self.ledger, self.kind, self.table
        reqid, name, holder = check_reqid(msg), check_name(msg), check_holder(msg)
        deadline = check_deadline(msg, now)
        pool = table.get(name)
        free = pool is None or (pool.total < pool.max_leases and not pool.waiters)
        expired = deadline is not None and deadline <= now
        if pool is None:
            ledger.check_room(table, name, kind)
        if not free and not expired:
            ledger.check_can_park(client, reqid)
        if free:
            if pool is None:
                pool = table[name] = LeasePool(max_leases)
            self._lease(name, pool, client, holder)
            ledger.reply(client, reqid, {"status": "ok"})
        elif expired:
            ledger.reply(client, reqid, {"status": "timed-out"})
        else:
            ledger.park(client, reqid, f"{kind}-acquire", name, deadline, pool.waiters, holder)

    def _lease(self, name: str, pool: LeasePool, client: str, holder: str) -> None:
        lease = (client, holder)
        pool.leases[lease] = pool.leases.get(lease, 0) + 1
        pool.by_client[client] = pool.by_client.get(client, 0) + 1
        pool.total += 1
        self.ledger.record(client).pools.add((self.kind, name))

    def _grant(self, name: str, pool: LeasePool) -> None:
        while pool.waiters and pool.total < pool.max_leases:
            waiter = self.ledger.pop_waiter(pool.waiters)
            self._lease(name, pool, waiter.client, waiter.extra)
            self.ledger.answer(waiter, {"status": "ok"})

    def _tidy(self, name: str, pool: LeasePool) -> None:
        if not pool.total and not pool.waiters:
            del self.table[name]

    def _release(self, client: str, msg: dict, now: float) -> None:
        ledger, kind = self.ledger, self.kind
        reqid, name, holder = check_reqid(msg), check_name(msg), check_holder(msg)
        pool = self.table.get(name)
        lease = (client, holder)
        if pool is None or lease not in pool.leases:
            refuse(f"{kind} {bounded_repr(name, 80)} is not held by this {kind.title()} "
                   f"object: release without acquire")
        if pool.leases[lease] == 1:
            del pool.leases[lease]
        else:
            pool.leases[lease] -= 1
        pool.total -= 1
        if pool.by_client[client] == 1:
            del pool.by_client[client]
            ledger.clients[client].pools.discard((kind, name))
        else:
            pool.by_client[client] -= 1
        ledger.reply(client, reqid, {"status": "ok"})
        self._grant(name, pool)
        self._tidy(name, pool)

    def waiter_gone(self, waiter: Waiter) -> None:
        """Forget the pool if nobody holds or waits on it any more."""
        self._tidy(waiter.name, self.table[waiter.name])

    def client_gone(self, client: str, record: ClientRecord) -> None:
        """The client's leases go back to their pools; waiting acquires get them."""
        for kind, name in record.pools:
            if kind != self.kind:
                continue
            pool = self.table[name]
            for lease in [lease for lease in pool.leases if lease[0] == client]:
                pool.total -= pool.leases.pop(lease)
            del pool.by_client[client]
            self._grant(name, pool)
            self._tidy(name, pool)

    def validate(self) -> list:
        """Lease counts agree; no pool is empty; no pool with free leases has waiters."""
        for pool in self.table.values():
            check_state(pool.total == sum(pool.leases.values()) == sum(pool.by_client.values())
                        and pool.total <= pool.max_leases, "lease counts disagree")
            check_state(bool(pool.total or pool.waiters), "an empty lease pool")
            check_state(not pool.waiters or pool.total == pool.max_leases, "a pool with "
                        "free leases has waiters")
        return [pool.waiters for pool in self.table.values()]


class Locks(LeasePools):
    """Locks: pools of one lease."""

    kind = "lock"

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.handlers = {"lock-acquire": self._lock_acquire, "lock-release": self._release,
                         "lock-locked": self._locked}

    def _lock_acquire(self, client: str, msg: dict, now: float) -> None:
        self._acquire(client, msg, now, 1)

    def _locked(self, client: str, msg: dict, now: float) -> None:
        reqid, name = check_reqid(msg), check_name(msg)
        self.ledger.reply(client, reqid, {"status": "ok", "locked": name in self.table
                                          and self.table[name].total > 0})


class Semaphores(LeasePools):
    """Semaphores: pools of ``max_leases`` leases, fixed by their first acquire."""

    kind = "semaphore"

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.handlers = {"semaphore-acquire": self._semaphore_acquire,
                         "semaphore-release": self._release, "semaphore-value": self._value}

    def _semaphore_acquire(self, client: str, msg: dict, now: float) -> None:
        name, max_leases = check_name(msg), check_count(msg, "max_leases", 1, MAX_LEASES, 1)
        pool = self.table.get(name)
        if pool is not None and pool.max_leases != max_leases:
            refuse(f"semaphore {bounded_repr(name, 80)} has max_leases="
                   f"{pool.max_leases}, not {max_leases}")
        self._acquire(client, msg, now, max_leases)

    def _value(self, client: str, msg: dict, now: float) -> None:
        reqid, name = check_reqid(msg), check_name(msg)
        pool = self.table.get(name)
        self.ledger.reply(client, reqid, {"status": "ok", "value": pool.total if pool else 0})
