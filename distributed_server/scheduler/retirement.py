"""Moving results between workers: graceful retirement, replicate and rebalance.

The scheduler server's side of ``Client.retire_workers``, ``Client.replicate`` and
``Client.rebalance``. The core plans (`SchedulerState` queries: ``workers_to_retire``,
``copy_recipients``, ``retirement_plan``, ``replication``, ``surplus_holders``,
``rebalance_moves``, ...: addresses and keys in, addresses and keys out); this module only
carries the plans out, through the core's stimuli, via the server's ``stimulus``, and
reports:

- a copy: ``acquire_replicas(recipient, keys)`` sends the recipient ``acquire-replicas``;
  the recipient fetches each key from its holders and answers once per key, ``add-keys``
  (``replicas_added``: it now counts as a holder) or ``acquire-failed``
  (``replicas_failed``); `ReplicaMover.copy` waits for every answer, or for the
  recipient to leave;
- dropping a copy: ``remove_replicas`` (never the last one);
- retirement: ``retire_worker`` (it takes no new task; those it was given finish there),
  copies of every result that only retiring workers hold, then ``close`` to the worker
  (its nanny does not restart a worker that exits cleanly) and its normal departure
  (``remove_worker``); or ``unretire_worker`` when some result could not be copied.

One operation at a time (a lock): plans never race each other. What it never does: read
the core's tasks or workers (it asks the core), write into the state, unpickle, or drop
the last copy of a result.
"""
from __future__ import annotations

import asyncio
import logging
import time

from distributed_core import MAX_RECIPIENTS_PER_KEY, bounded_repr

from ..comm import CommClosedError

logger = logging.getLogger("distributed_server.retirement")

#: The client requests this module answers.
OPS = ("retire-workers", "replicate", "rebalance")
#: Seconds a retired worker has to leave after it was told to close; then its connection
#: is cut (which removes it just the same).
CLOSE_TIMEOUT = 30.0
#: Seconds between two looks at pending copies when no answer wakes the wait (a safety
#: net: every answer and every departure wakes it).
POLL_SECONDS = 1.0
#: Seconds between two looks at a retiring worker's tasks: it finishes the tasks it was
#: given before its retirement (their results then move too) before it counts as retired.
DRAIN_POLL_SECONDS = 0.05
#: Rounds of copies a replicate makes at most (each doubles the copies, or better).
MAX_REPLICATE_ROUNDS = 64
#: Most keys or workers one request may name.
MAX_NAMES = 1_000_000


class RequestError(ValueError):
    """A client's request is malformed or not allowed; nothing was done."""


class ReplicaMover:
    """Carries out retirements, replications and rebalances for a `Scheduler`."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """A worker answered a copy request, or a worker left: pending copies may be
        settled."""
        self._changed.set()

    # ------------------------------------------------------------------ requests

    async def handle(self, client_id: str, msg: dict) -> None:
        """Answer one client request (`OPS`) with ``reply {reqid, result}``, or ``reply
        {reqid, error}`` if it is refused."""
        op = msg["op"]
        try:
            if op == "retire-workers":
                workers, n = _workers_field(msg.get("workers")), msg.get("n")
                close = msg.get("close_workers", True)
                _require(n is None or (type(n) is int and n >= 0),
                         f"n must be None or an int >= 0, not {bounded_repr(n, 60)}")
                _require(type(close) is bool, "close_workers must be a bool")
                result = await self.retire(workers, n, close)
            elif op == "replicate":
                keys = self._wanted_keys(client_id, msg.get("keys"), op)
                n, branching = msg.get("n"), msg.get("branching_factor", 2)
                _require(n is None or (type(n) is int and n >= 1),
                         f"n must be None or an int >= 1, not {bounded_repr(n, 60)}")
                _require(type(branching) is int and branching >= 1,
                         "branching_factor must be an int >= 1")
                result = await self.replicate(keys, n, _workers_field(msg.get("workers")),
                                              branching)
            else:
                keys = msg.get("keys")
                if keys is not None:
                    keys = self._wanted_keys(client_id, keys, op)
                result = await self.rebalance(keys, _workers_field(msg.get("workers")))
        except RequestError as exc:
            logger.warning("refused %r from %s: %s", op, client_id, exc)
            self.scheduler.reply_failure(client_id, msg.get("reqid"), f"{op}: {exc}")
            return
        except Exception:
            logger.exception("BUG: %r from %s failed", op, client_id)
            self.scheduler.reply_failure(client_id, msg.get("reqid"),
                                          f"{op} failed in the scheduler (see its log)")
            return
        self.scheduler.reply(client_id, msg, result)

    def _wanted_keys(self, client_id: str, keys, op: str) -> list:
        """The request's keys, each one the client wants (a client acts on its own keys)."""
        _require(isinstance(keys, (list, tuple)) and len(keys) <= MAX_NAMES,
                 "keys must be a list of keys")
        try:
            keys = list(dict.fromkeys(keys))
        except TypeError:
            raise RequestError("keys must be hashable") from None
        foreign = self.scheduler.state.keys_not_wanted(client_id, keys)
        _require(not foreign, f"the client does not want {bounded_repr(foreign[:3], 200)}")
        return keys

    # ------------------------------------------------------------------ copies

    async def copy(self, plan: dict) -> tuple[set, set]:
        """Ask each recipient of ``plan`` (``{address: [key, ...]}``) to copy its keys and
        wait for every answer: ``(copied, failed)``, sets of ``(address, key)``."""
        state = self.scheduler.state
        asked = []
        refused = set()
        for address, keys in plan.items():
            if self.scheduler.stimulus("scheduler", "acquire-replicas",
                                        state.acquire_replicas, address, keys):
                asked.extend((address, key) for key in keys)
            else:  # (logged) counts as failed, so that no plan asks it again forever
                refused.update((address, key) for key in keys)
        while state.copies_pending(asked):
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), POLL_SECONDS)
            except asyncio.TimeoutError:
                pass
        copied = set(state.copies_held(asked))
        return copied, (set(asked) - copied) | refused

    def _drop(self, drops: dict) -> None:
        """``remove_replicas`` for ``{address: [key, ...]}``, of the copies that are still
        there and not the last (checked right before: the state may have moved on)."""
        state = self.scheduler.state
        for address, keys in drops.items():
            keys = state.droppable(address, keys)  # asked right before each drop
            if keys:
                self.scheduler.stimulus("scheduler", "remove-replicas",
                                         state.remove_replicas, address, keys)

    def _pool(self, workers, exclude=()) -> list:
        """The addresses of the running, unpaused workers (of ``workers``, if given) that
        may take copies."""
        paused = [address for address, figures in self.scheduler.worker_memory.items()
                  if figures.get("paused")]
        return self.scheduler.state.copy_recipients(workers, exclude, paused)

    # ------------------------------------------------------------------ retirement

    async def retire(self, workers, n, close: bool) -> dict:
        """Retire ``workers`` (addresses or names), or the ``n`` holding the fewest bytes:
        ``{"retired": {address: info}, "refused": {address: why}}``."""
        async with self._lock:
            started = time.monotonic()
            state = self.scheduler.state
            leaving = self._choose(workers, n)
            for address in leaving:
                self.scheduler.stimulus("scheduler", "retire-workers", state.retire_worker,
                                         address)
            logger.info("retiring %d worker(s): %s", len(leaving), ", ".join(leaving))
            refused = await self._move_unique_results(leaving)
            while True:  # a task it was given before its retirement finishes there first
                busy = self._busy([a for a in leaving if a not in refused])
                if not busy:
                    break
                await asyncio.sleep(DRAIN_POLL_SECONDS)
                refused.update(await self._move_unique_results(busy))
            retired = {}
            figures = self.scheduler.identity()["workers"]
            present = set(state.registered(leaving))
            for address in leaving:
                if address not in present:
                    refused.setdefault(address, "it left the cluster during its retirement "
                                                "(results only it held are recomputed)")
                elif address in refused:
                    self.scheduler.stimulus("scheduler", "retire-workers",
                                             state.unretire_worker, address)
                else:
                    retired[address] = figures[address]
            if close:
                await self._close(list(retired))
            else:  # it stays registered, taking no task: drop the copies it still holds
                self._drop({address: state.results_held(address) for address in retired})
            for address, why in refused.items():
                logger.warning("could not retire worker %s: %s", address, why)
            logger.info("retired %d worker(s) in %.2f s%s", len(retired),
                        time.monotonic() - started,
                        f" ({len(refused)} refused)" if refused else "")
            return {"retired": retired, "refused": refused}

    def _busy(self, addresses: list) -> list:
        """Those of ``addresses`` still registered and running or assigned a task."""
        counts = self.scheduler.state.worker_counts()
        return [a for a in addresses if a in counts and counts[a]["processing"]]

    def _choose(self, workers, n) -> list:
        """The addresses to retire (`SchedulerState.workers_to_retire`)."""
        _require(workers is not None or n is not None, "name the workers, or give n")
        chosen, unknown = self.scheduler.state.workers_to_retire(workers, n)
        if unknown:
            raise RequestError(f"no worker {bounded_repr(unknown[0], 100)}")
        return chosen

    async def _move_unique_results(self, leaving: list) -> dict:
        """Copy every result that only retiring workers hold to other workers, until
        none is left; ``{address: why}`` for the workers whose results could not all be
        copied."""
        state = self.scheduler.state
        refused: dict = {}
        tried: dict = {}  # key -> addresses that failed to copy it
        while True:
            active = [address for address in leaving if address not in refused]
            recipients = self._pool(None, exclude=set(leaving))
            plan, stuck = state.retirement_plan(active, recipients, tried)
            if not plan and not stuck:  # no result is held only by retiring workers
                return refused
            cause = ("no other running worker can take them" if not recipients
                     else f"{MAX_RECIPIENTS_PER_KEY} workers tried and failed, "
                          "or none is left to try")
            for address, keys in stuck.items():
                refused[address] = (
                    f"{len(keys)} result(s) held only there could not be copied to another "
                    f"worker ({cause}; e.g. {bounded_repr(keys[:3], 150)}): it was not "
                    "retired and takes tasks again")
            if stuck:
                continue
            _, failed = await self.copy(plan)
            for address, key in failed:
                tried.setdefault(key, set()).add(address)

    async def _close(self, addresses: list) -> None:
        """Tell each retired worker to close; wait until each has left (its departure
        removes it from the state), cutting its connection after `CLOSE_TIMEOUT`."""
        scheduler = self.scheduler
        for address in addresses:
            comm = scheduler.worker_comms.get(address)
            if comm is not None:
                try:
                    comm.send({"op": "close"})
                except CommClosedError:
                    pass  # gone already: its departure is under way
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while scheduler.state.registered(addresses):
            if time.monotonic() > deadline:
                for address in addresses:
                    comm = scheduler.worker_comms.get(address)
                    if comm is not None:
                        logger.warning("retired worker %s did not leave within %.0f s; "
                                       "closing its connection", address, CLOSE_TIMEOUT)
                        comm.abort()
                deadline = float("inf")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), POLL_SECONDS)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------ replicate, rebalance

    async def replicate(self, keys: list, n, workers, branching_factor: int) -> dict:
        """Make each key held by ``n`` workers of the pool (every running worker, or
        ``workers``; None: all of them), dropping copies past ``n`` there:
        ``{"status": "OK"}`` or ``{"status": "partial-fail", "keys": [...]}`` (not in
        memory, or short of ``n`` holders at the end)."""
        async with self._lock:
            state = self.scheduler.state
            pool = self._pool(workers)
            n = len(pool) if n is None else min(n, len(pool))
            _require(n >= 1, "no running worker to replicate to")
            missing = state.keys_not_in_memory(keys)
            if missing:
                return {"status": "partial-fail", "keys": missing}
            self._drop(state.surplus_holders(keys, pool, n))
            tried: dict = {}
            for _ in range(MAX_REPLICATE_ROUNDS):
                pool = state.registered(pool)
                plan = state.replication(keys, pool, n, branching_factor, tried)
                if not plan:
                    break
                copied, failed = await self.copy(plan)
                for address, key in failed:
                    tried.setdefault(key, set()).add(address)
            short = state.holders_short(keys, pool, n)
            logger.info("replicated %d key(s) to %d of %d worker(s)%s", len(keys), n,
                        len(pool), f"; {len(short)} short" if short else "")
            return {"status": "partial-fail", "keys": short} if short else {"status": "OK"}

    async def rebalance(self, keys, workers) -> dict:
        """Move results from workers holding more bytes than the pool's mean to those
        holding fewer (`SchedulerState.rebalance_moves`): ``{"status": "OK", "moved": n}``, or
        ``{"status": "partial-fail", "keys": [...]}`` naming keys given that are not in
        memory or failed to move."""
        async with self._lock:
            state = self.scheduler.state
            if keys is not None:
                missing = state.keys_not_in_memory(keys)
                if missing:
                    return {"status": "partial-fail", "keys": missing}
            moves = state.rebalance_moves(self._pool(workers), keys)
            plan: dict = {}
            for _, recipient, key in moves:
                plan.setdefault(recipient, []).append(key)
            copied, failed = await self.copy(plan)
            drops: dict = {}
            for sender, recipient, key in moves:
                if (recipient, key) in copied:
                    drops.setdefault(sender, []).append(key)
            self._drop(drops)
            logger.info("rebalance moved %d of %d planned result(s)", len(copied), len(moves))
            if failed and keys is not None:
                return {"status": "partial-fail", "keys": sorted({k for _, k in failed}, key=repr)}
            return {"status": "OK", "moved": len(copied)}


def _require(condition: bool, text: str) -> None:
    if not condition:
        raise RequestError(text)


def _workers_field(workers):
    """A request's ``workers``: None, or a list of addresses or names (str or int)."""
    if workers is None:
        return None
    _require(isinstance(workers, (list, tuple)) and len(workers) <= MAX_NAMES and all(
        type(w) in (str, int) for w in workers), "workers must be a list of addresses or names")
    return list(workers)
