"""Putting the client's data on workers: `Client.scatter`.

`ScatterMixin` is one of the classes `Client` is made of. The values are pickled here,
named (by their type and a hash of their bytes, or at random with ``hash=False``),
placed on workers (`distributed_server.client.transfers.place`), sent with ``put-data``
straight to each worker, and only then announced to the scheduler (``update-data``: who
holds what, and the sizes); their futures are finished at once.
"""
from __future__ import annotations

import asyncio
import collections
import uuid

from ..protocol.serialize import dumps_data, sizeof
from .futures import PENDING, Future
from .key_table import KeyTable
from .task_specs import key_digest
from .transfers import place

__all__ = ["ScatterMixin"]


class ScatterMixin:
    """`scatter`.

    Mixed into `Client`, which provides ``_sync``, ``_request``, ``_wait_for_workers``,
    ``_send_on_loop``, the key table (``_keys``) and the transfers with workers
    (``_transfers``).
    """

    _keys: KeyTable

    def scatter(self, data, workers=None, broadcast: bool = False, hash: bool = True):
        """Put data on workers; returns futures shaped like ``data`` (a dict keeps its
        keys as the keys; a list/tuple/set gives a list; anything else one future).
        ``workers`` (addresses or names) limits where; ``broadcast`` puts every item on
        each of them."""
        return self._sync(self._scatter, data, workers, broadcast, hash)

    async def _scatter(self, data, workers, broadcast: bool, hash: bool):
        if isinstance(data, dict):
            keys, values = list(data), list(data.values())
        else:
            values = list(data) if isinstance(data, (list, tuple, set, frozenset)) else [data]
            keys = None
        if not values:
            return {} if isinstance(data, dict) else []
        frames = [dumps_data(value) for value in values]
        if keys is None:
            keys = [f"{type(v).__name__}-{key_digest(*f) if hash else uuid.uuid4().hex}"
                    for v, f in zip(values, frames)]
        targets = await self._scatter_targets(workers)
        placement = place(keys, targets, broadcast)
        transfers = self._transfers
        await asyncio.gather(*[transfers.put_data(address, {k: frames[i] for i, k in items})
                               for address, items in placement.items()])
        futures = self._register_scattered(keys, values, placement)
        if isinstance(data, dict):
            return dict(zip(keys, futures))
        if isinstance(data, (list, tuple, set, frozenset)):
            return futures
        return futures[0]

    async def _scatter_targets(self, workers) -> list[str]:
        known = (await self._request("identity"))["workers"]
        if not known:
            await self._wait_for_workers(1, self.timeout)
            known = (await self._request("identity"))["workers"]
        if workers is None:
            return list(known)
        by_name = {info.get("name"): address for address, info in known.items()}
        chosen = []
        for worker in [workers] if isinstance(workers, str) else workers:
            address = worker if worker in known else by_name.get(worker)
            if address is None:
                raise ValueError(f"unknown worker {worker!r}")
            chosen.append(address)
        return chosen

    def _register_scattered(self, keys: list, values: list, placement: dict) -> list[Future]:
        """Futures for scattered keys; the scheduler learns where they are (loop thread)."""
        who_has: dict = collections.defaultdict(list)
        for address, items in placement.items():
            for _, key in items:
                who_has[key].append(address)
        states = self._keys.hold_all(keys)
        nbytes = {key: sizeof(value) for key, value in zip(keys, values)}
        self._send_on_loop({"op": "update-data", "who_has": dict(who_has), "nbytes": nbytes})
        for state, value in zip(states, values):
            if state.status == PENDING:
                state.finish(None, type(value).__name__)
        return [Future._attach(state, self) for state in states]
