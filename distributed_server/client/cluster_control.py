"""What the client can ask of its cluster's workers as a whole: `Client.restart`,
`retire_workers`, `replicate` and `rebalance`.

`ClusterControlMixin` is one of the classes `Client` is made of. Each is one request to
the scheduler, which does the work (restart through the nannies, retirement and moving
results: `distributed_server.scheduler.retirement`); what it could not do comes back as
a RuntimeWarning here, or an error.
"""
from __future__ import annotations

import warnings

from .futures import futures_in, unique_states

__all__ = ["ClusterControlMixin"]


class ClusterControlMixin:
    """Restarting, retiring workers and moving results between them.

    Mixed into `Client`, which provides ``_sync`` and ``_request``.
    """

    def restart(self, timeout: float = 30.0):
        """Restart every worker of the cluster (each through its nanny) and forget every
        task; returns this client.

        Every future of every client is cancelled: it raises `CancelledError` saying the
        cluster was restarted (results are dropped with the workers, work in flight is
        abandoned), as in dask. Returns once as many workers as before have registered
        again, or raises TimeoutError if they have not within ``timeout`` seconds. Refused
        with `SchedulerError`, nothing changed, while a worker has no nanny (started with
        ``dcore worker --no-nanny`` or by ``LocalCluster(processes=False)``).
        """
        return self._sync(self._restart, timeout)

    async def _restart(self, timeout: float):
        result = await self._request("restart", timeout=timeout)
        if result.get("status") != "OK":
            raise TimeoutError(f"restart: {result.get('workers')} of "
                               f"{result.get('expected')} workers came back within "
                               f"{timeout} s")
        return self

    def retire_workers(self, workers=None, n: int | None = None, close_workers: bool = True):
        """Retire workers gracefully: ``workers`` (addresses or names), or the ``n``
        holding the fewest bytes. A retiring worker takes no new task; every result only
        it holds is copied to another worker first; then, with ``close_workers``, it
        closes (its nanny does not start it again), else it stays connected, taking no
        task and holding nothing. Returns ``{address: worker info}`` of the workers
        retired, as dask. A worker whose results no other worker could take (none is
        running, or every copy failed) is not retired: it takes tasks again, and a
        RuntimeWarning says why. Tasks still running on a retired worker when it leaves
        run again elsewhere."""
        if workers is None and n is None:
            raise ValueError("retire_workers needs workers= (addresses or names) or n=")
        if isinstance(workers, (str, int)):
            workers = [workers]
        return self._sync(self._retire_workers, None if workers is None else list(workers),
                          n, close_workers)

    async def _retire_workers(self, workers, n, close_workers: bool) -> dict:
        result = await self._request("retire-workers", workers=workers, n=n,
                                     close_workers=close_workers)
        for address, why in result["refused"].items():
            warnings.warn(f"worker {address} was not retired: {why}", RuntimeWarning)
        return dict(result["retired"])

    def replicate(self, futures, n: int | None = None, workers=None,
                  branching_factor: int = 2) -> None:
        """Copy the futures' results onto ``n`` workers (all of ``workers``, or of the
        cluster, for None), worker to worker, ``branching_factor`` new copies per holder
        and round; copies past ``n`` among those workers are dropped. A RuntimeWarning
        names the keys left short (not computed yet, or copies that failed)."""
        keys = [state.key for state in unique_states(futures_in(futures))]
        return self._sync(self._move_results, "replicate",
                          {"keys": keys, "n": n, "branching_factor": branching_factor,
                           "workers": None if workers is None else list(workers)})

    def rebalance(self, futures=None, workers=None) -> None:
        """Move results from workers holding more bytes than the mean to those holding
        fewer (only the futures' results, and only among ``workers``, if given). A
        RuntimeWarning names given futures that could not move."""
        keys = None if futures is None else [
            state.key for state in unique_states(futures_in(futures))]
        return self._sync(self._move_results, "rebalance",
                          {"keys": keys, "workers": None if workers is None else list(workers)})

    async def _move_results(self, op: str, fields: dict) -> None:
        result = await self._request(op, **fields)
        if result.get("status") == "partial-fail":
            warnings.warn(f"{op}: not done for {list(result['keys'])!r:.300}: not in memory, "
                          "or their copies failed", RuntimeWarning)
