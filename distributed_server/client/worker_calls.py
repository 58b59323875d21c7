"""Code the client runs on its workers: `Client.run`, `upload_file`, and the worker
plugins (`register_plugin`, `register_worker_plugin`, `unregister_worker_plugin`).

`WorkerCallsMixin` is one of the classes `Client` is made of. `run` packs the call
(`distributed_server.worker.remote_run`) and sends it straight to each worker on a pooled
connection (``{"op": "run"}``); plugins go through the scheduler, which installs them on
every worker, now and on those that join later (`distributed_server.plugins`).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from .. import plugins
from ..worker import remote_run
from .scheduler_comm import log_background_failure
from .transfers import WorkerTransfers

__all__ = ["WorkerCallsMixin"]


class WorkerCallsMixin:
    """`run`, `upload_file` and worker plugins.

    Mixed into `Client`, which provides ``_sync``, ``_worker_addresses`` and the
    transfers with workers (``_transfers``).
    """

    _transfers: WorkerTransfers | None

    def run(self, function: Callable, *args, workers=None, wait: bool = True,
            on_error: str = "raise", **kwargs):
        """Call ``function(*args, **kwargs)`` once in every worker process (or those of
        ``workers``: addresses or names); ``{address: result}``. A coroutine function
        runs on the worker's event loop, any other on a thread; a ``dask_worker``
        parameter receives the Worker. ``on_error="raise"`` raises the first error,
        ``"return"`` puts errors in the dict. ``wait=False`` returns None at once."""
        if on_error not in ("raise", "return"):
            raise ValueError(f"on_error must be 'raise' or 'return', not {on_error!r}")
        payload = remote_run.pack_call(function, args, kwargs)
        if not wait:
            self._sync(self._spawn_run, payload, workers)
            return None
        return self._sync(self._run_everywhere, payload, workers, on_error)

    async def _spawn_run(self, payload: bytes, workers) -> None:
        task = asyncio.ensure_future(self._run_everywhere(payload, workers, "return"))
        task.add_done_callback(log_background_failure)

    async def _run_everywhere(self, payload: bytes, workers, on_error: str) -> dict:
        addresses = await self._worker_addresses(workers)

        async def one(address):
            try:
                reply = await self._peer_request(address, {"op": "run", "function": payload})
            except OSError as exc:
                return exc
            return remote_run.unpack_reply(reply)

        results = dict(zip(addresses, await asyncio.gather(*map(one, addresses))))
        if on_error == "raise":
            for value in results.values():
                if isinstance(value, BaseException):
                    raise value
        return results

    async def _peer_request(self, address: str, msg: dict) -> dict:
        """One request/response with a worker on a pooled connection
        (`WorkerTransfers.request`)."""
        return await self._transfers.request(address, msg)

    def upload_file(self, path: str) -> dict:
        """Send a ``.py``, ``.zip``, ``.egg`` or ``.whl`` file to every worker now
        connected: it is written to a directory on the worker's ``sys.path`` and a
        module of that name is imported (again, if it was). ``{address: None}``.
        Workers that join later do not get it."""
        name = os.path.basename(path)
        if not name.endswith((".py", ".zip", ".egg", ".whl")):
            raise ValueError(f"upload_file takes .py, .zip, .egg or .whl files, not {name!r}")
        with open(path, "rb") as f:
            data = f.read()
        return self.run(remote_run.install_file, name, data)

    # ------------------------------------------------------------ worker plugins
    # Thin: the logic is in distributed_server/plugins.py.

    def register_plugin(self, plugin, name=None, idempotent: bool = False):
        """Install a `WorkerPlugin` on every worker, now and on those that join later;
        ``{address: {"status": "OK"}}``. A setup error is raised here (and the plugin
        removed). A SchedulerPlugin is refused with how to install it instead
        (``dcore scheduler --preload``); nanny plugins are not supported."""
        return plugins.register_worker_plugin(self, plugin, name, idempotent)

    def register_worker_plugin(self, plugin=None, name=None, nanny=None):
        """dask's older name for `register_plugin` (worker plugins only)."""
        if plugin is None:
            raise TypeError("register_worker_plugin needs a plugin")
        return plugins.register_worker_plugin(self, plugin, name, nanny=nanny)

    def unregister_worker_plugin(self, name: str, nanny=None):
        """Tear the worker plugin ``name`` down on every worker and forget it
        (ValueError if there is none)."""
        if nanny:
            raise plugins.NannyPluginRefused("nanny plugins are not supported by "
                                             "distributed-core")
        return plugins.unregister_worker_plugin(self, name)
