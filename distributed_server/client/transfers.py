"""The client's transfers with workers: results fetched, scattered data put, calls run.

Large results do not travel through the scheduler: the client asks it who holds them
(``who-has``) and fetches them straight from those workers (``get-data``, one request
per worker for a whole batch). `scatter` puts data on workers (``put-data``) before the
scheduler hears of it, and `Client.run` calls a function in every worker (``run``). All
of it goes over the workers' peer ports, on connections of a `PeerPool` (the same pool
class the workers use to fetch from each other), as ``{"role": "client"}``.

`WorkerTransfers` does the exchanges; what the values mean (key states, futures) stays
with the client, which hands it a ``who_has`` coroutine function for `fetch`.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import Awaitable, Callable, Iterable

from ..comm import Blob
from ..comm.peer_pool import PeerPool
from ..protocol.serialize import loads_data
from ..security import Security
from .futures import KeyState, SchedulerError

__all__ = ["WorkerTransfers"]

logger = logging.getLogger("distributed_server.client")

#: Idle connections kept per worker for fetching results.
PEER_POOL_SIZE = 4
#: Rounds of who-has + get-data before a fetch gives up on a key that holders do not give.
FETCH_ROUNDS = 12


class WorkerTransfers:
    """One client's requests to workers, each on a pooled connection.

    ``keep_connections()`` says whether a connection is worth keeping after an exchange
    (the client is running); `close` drops the idle ones.
    """

    def __init__(self, client_id: str, security: Security | None, timeout: float,
                 keep_connections: Callable[[], bool]) -> None:
        self._hello = {"role": "client", "client_id": client_id}
        self._timeout = timeout
        self._keep = keep_connections
        self._pool = PeerPool(security, PEER_POOL_SIZE)

    def close(self) -> None:
        """Abort the idle connections; none are kept from now on."""
        self._pool.close()

    async def request(self, address: str, msg: dict) -> dict:
        """One request/response with a worker, on a pooled connection."""
        return await self._pool.request(address, self._hello, msg, timeout=self._timeout,
                                        keep=self._keep)

    async def fetch(self, states: list[KeyState], values: dict,
                    who_has: Callable[[list], Awaitable[dict]]) -> list[KeyState]:
        """Fetch finished results from the workers into ``values`` (``{state: value}``).

        One who-has for all keys, then one get-data per worker. Keys a holder could not
        give are asked again (another holder, a fresh who-has). Returns the states whose
        data no worker has: pending again (being recomputed) unless news came meanwhile.
        """
        by_key = {s.key: s for s in states}
        tried: dict = collections.defaultdict(set)
        delay = 0.01
        for _ in range(FETCH_ROUNDS):
            epochs = {key: by_key[key].epoch for key in by_key}
            holders = await who_has(list(by_key))
            lost = [by_key.pop(k) for k in list(by_key) if not holders.get(k)]
            for state in lost:
                if state.epoch == epochs[state.key]:  # not recomputed since we asked
                    state.reset()
            plan = _plan_fetch(holders, by_key, tried)
            replies = await asyncio.gather(*[self.get_data(address, keys)
                                             for address, keys in plan.items()])
            for address, (data, missing) in zip(plan, replies):
                for key, value in data.items():
                    values[by_key.pop(key)] = value
                for key in missing:
                    tried[key].add(address)
            if not by_key:
                return lost
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise SchedulerError(f"could not fetch {list(by_key)[:5]!r} from the workers "
                             f"that hold them")

    async def get_data(self, address: str, keys: list) -> tuple[dict, list]:
        """``({key: value}, missing keys)`` from one worker; all missing if it fails."""
        try:
            reply = await self.request(address, {"op": "get-data", "keys": keys})
        except OSError as e:
            logger.info("cannot get data from %s: %s", address, e)
            return {}, keys
        if reply.get("op") != "data":
            logger.warning("worker %s answered get-data with %.200r", address, reply)
            return {}, keys
        data = {key: loads_data(frames) for key, frames in reply["data"].items()}
        missing = [key for key in keys if key not in data]
        return data, missing

    async def put_data(self, address: str, frames_by_key: dict) -> None:
        """Put serialized values (``{key: frames}``) on one worker; SchedulerError if it
        refuses."""
        msg = {"op": "put-data",
               "data": {k: [Blob(f) for f in frames] for k, frames in frames_by_key.items()}}
        reply = await self.request(address, msg)
        if reply.get("op") != "ok":
            raise SchedulerError(f"worker {address} refused put-data: {reply!r:.200}")


def _plan_fetch(who_has: dict, keys: Iterable, tried: dict) -> dict[str, list]:
    """``{worker: [keys]}``: one holder per key, preferring holders not tried yet."""
    plan: dict = collections.defaultdict(list)
    for key in keys:
        holders = who_has[key]
        fresh = [a for a in holders if a not in tried[key]] if tried else holders
        plan[random.choice(fresh or holders)].append(key)
    return plan


def place(keys: list, targets: list[str], broadcast: bool) -> dict[str, list]:
    """Where `scatter` puts ``keys``: ``{worker: [(index, key)]}``, round robin over
    ``targets``, or every key on each with ``broadcast``."""
    if not targets:
        raise ValueError("no workers to scatter to")
    placement: dict = collections.defaultdict(list)
    for i, key in enumerate(keys):
        for address in targets if broadcast else [targets[i % len(targets)]]:
            placement[address].append((i, key))
    return placement
