"""What the client can learn about its cluster: `Client.scheduler_info`, `who_has`,
`has_what`, `nthreads`, `wait_for_workers`, `dashboard_link` and the versions of every
process (`get_versions`, and the warning at connect when the scheduler's differ).

`ClusterInfoMixin` is one of the classes `Client` is made of. Every answer comes from
one request to the scheduler, which reads it from its counters (cheap to poll); the
versions of the workers come from running `versions.versions` on each of them.
"""
from __future__ import annotations

import asyncio
import html
import logging

from .. import versions as versions_module
from ..worker import remote_run
from .futures import futures_in, unique_states
from .key_table import KeyTable
from .scheduler_comm import log_background_failure

__all__ = ["ClusterInfoMixin"]


def _html_rows(rows: list) -> str:
    return "".join(f"<tr><th style='text-align:left'>{html.escape(label)}</th>"
                   f"<td style='text-align:left'>{html.escape(str(text))}</td></tr>"
                   for label, text in rows)


logger = logging.getLogger("distributed_server.client")


class ClusterInfoMixin:
    """The cluster's workers, where keys are, and the versions of every process.

    Mixed into `Client`, which provides ``_sync``, ``_request``, ``_run_everywhere``,
    the key table (``_keys``), the loop (``_loop``), ``cluster`` and
    ``scheduler_address``.
    """

    _keys: KeyTable
    _loop: asyncio.AbstractEventLoop | None

    def scheduler_info(self):
        """The scheduler's ``identity``: address, version, compiled, workers (each with
        name, nthreads, nanny, processing, in_memory, nbytes, occupancy and its memory
        figures), n_tasks, task_counts, counters (transitions, stimuli, bytes in memory,
        ...) and prefix_counts. The scheduler reads them from counters, never from a walk
        over its tasks: it is cheap to poll."""
        return self._sync(self._request, "identity")

    def _repr_html_(self) -> str:
        """A notebook's summary: scheduler, status, workers, threads, memory and the
        dashboard link. The figures are asked of the scheduler (for at most 2 s); an
        asynchronous client, or one called on its loop, shows what it knows without
        asking."""
        rows = [("scheduler", self.scheduler_address), ("status", self.status)]
        from ..deploy.nanny import format_bytes

        info = None
        if self.status == "running" and not self.asynchronous:
            try:
                info = self._sync(self._identity_within, 2.0)
            except Exception:  # noqa: BLE001 - a summary must not raise
                info = None
        if info is not None:
            workers = info["workers"].values()
            memory = sum(w.get("memory_limit") or 0 for w in workers)
            rows += [("workers", len(workers)),
                     ("threads", sum(w["nthreads"] for w in workers)),
                     ("memory", format_bytes(memory) if memory else "no limit"),
                     ("tasks", info["n_tasks"])]
        body = _html_rows(rows)
        link = self.dashboard_link
        if link is not None:
            body += (f"<tr><th style='text-align:left'>dashboard</th><td><a href="
                     f"'{html.escape(link, quote=True)}' target='_blank'>"
                     f"{html.escape(link.split('?', 1)[0])}</a></td></tr>")
        return f"<div><strong>Client</strong> {html.escape(self.id)}<table>{body}</table></div>"

    async def _identity_within(self, timeout: float) -> dict:
        return await asyncio.wait_for(self._request("identity"), timeout)

    @property
    def dashboard_link(self) -> str | None:
        """The status page's URL when this client's cluster is a `LocalCluster` (given or
        started here), else None."""
        return getattr(self.cluster, "dashboard_link", None)

    def who_has(self, futures=None):
        """``{key: [worker address]}`` for ``futures`` (default: every key held)."""
        if futures is None:
            keys = self._keys.held_keys()
        else:
            keys = [s.key for s in unique_states(futures_in(futures))]
        return self._sync(self._who_has, keys)

    async def _who_has(self, keys: list) -> dict:
        return await self._request("who-has", keys=keys)

    def has_what(self, workers=None) -> dict:
        """``{address: [keys it holds]}`` for every worker (or for ``workers``)."""
        return self._sync(self._has_what, workers)

    async def _has_what(self, workers) -> dict:
        addresses = await self._worker_addresses(workers) if workers is not None else None
        return await self._request("has-what", workers=addresses)

    def nthreads(self, workers=None) -> dict:
        """``{address: threads}`` of every worker (or of ``workers``)."""
        return self._sync(self._nthreads, workers)

    async def _nthreads(self, workers) -> dict:
        known = (await self._request("identity"))["workers"]
        wanted = await self._worker_addresses(workers) if workers is not None else known
        return {address: known[address]["nthreads"] for address in wanted}

    async def _worker_addresses(self, workers) -> list:
        """The addresses of ``workers`` (addresses or names; None: every worker)."""
        known = (await self._request("identity"))["workers"]
        if workers is None:
            return list(known)
        if isinstance(workers, (str, int)):
            workers = [workers]
        by_name = {info.get("name"): address for address, info in known.items()}
        addresses = []
        for worker in workers:
            address = worker if worker in known else by_name.get(worker)
            if address is None:
                raise ValueError(f"no worker {worker!r} (known: {sorted(known)})")
            addresses.append(address)
        return addresses

    def wait_for_workers(self, n_workers: int = 1, timeout: float | None = None):
        """Block until at least ``n_workers`` workers are connected (TimeoutError after
        ``timeout`` seconds)."""
        return self._sync(self._wait_for_workers, n_workers, timeout)

    async def _wait_for_workers(self, n_workers: int, timeout: float | None) -> None:
        async def poll():
            while len((await self._request("identity"))["workers"]) < n_workers:
                await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(poll(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"fewer than {n_workers} workers after {timeout}s") from None

    # ------------------------------------------------------------ versions

    def get_versions(self, check: bool = False) -> dict:
        """``{"client": ..., "scheduler": ..., "workers": {address: ...}}``: Python,
        platform and package versions of every process (versions.py). ``check=True``
        raises `VersionMismatch` naming every difference in Python, distributed-core,
        cloudpickle, msgpack or dask."""
        return self._sync(self._get_versions, check)

    async def _get_versions(self, check: bool) -> dict:
        mine = versions_module.versions()
        scheduler = await self._request("versions")
        workers = await self._run_everywhere(
            remote_run.pack_call(versions_module.versions, (), {}), None, "return")
        workers = {address: (v if isinstance(v, dict) else {"error": repr(v)})
                   for address, v in workers.items()}
        if check:
            problems = versions_module.check(mine, scheduler, workers)
            if problems:
                raise versions_module.VersionMismatch(
                    "mismatched versions: " + "; ".join(problems))
        return {"client": mine, "scheduler": scheduler, "workers": workers}

    def _check_versions_soon(self) -> None:
        task = self._loop.create_task(self._warn_on_other_versions())
        task.add_done_callback(log_background_failure)

    async def _warn_on_other_versions(self) -> None:
        """At connect: warn if the scheduler runs other versions of what must match."""
        try:
            theirs = await self._request("versions")
        except Exception:  # noqa: BLE001 - best effort: closed meanwhile, or gone
            return
        differ = versions_module.mismatches(versions_module.essential(), theirs)
        if differ:
            logger.warning("the scheduler at %s runs other versions than this client (%s): "
                           "tasks may fail to unpickle; client.get_versions(check=True) "
                           "names every process's", self.scheduler_address, "; ".join(differ))
