"""The scheduler's side of plugins: worker plugins kept as bytes and handed to workers,
and the scheduler plugins a preload module installs (`Scheduler.add_plugin`).

What this module does
---------------------
- `WorkerPluginRegistry` keeps each worker plugin a client registered (name -> its
  pickle, in registration order) and installs it on every worker: the workers connected
  now are asked (``plugin-add {name, plugin, reqid}`` on their stream, answered by a
  ``reply``), a worker that joins later gets every plugin before its first task. If a
  worker's setup fails, the plugin is forgotten and removed from every worker again,
  and the client hears the first failure (the exception's pickle, passed on as bytes).
  ``unregister`` removes a plugin from the workers (``plugin-remove``).
- `SchedulerPluginHooks` holds the scheduler plugins added in this process and calls
  their hooks (`distributed_server.plugins.SchedulerPlugin`) when the scheduler starts
  and closes, a worker or client comes or goes, a client sends tasks, and after each
  stimulus with the transitions it made (the state machine records them, with
  ``SchedulerState.record_transitions``, only while a plugin defines ``transition``).
  Only plugins that define a hook are called for it; with none defining ``transition``
  nothing is recorded and the scheduler does not look.

What it never does
------------------
It never unpickles a worker plugin: the bytes go to workers as they came. A scheduler
plugin's failure is logged with the hook's name and never reaches the state machine or
a peer.
"""
from __future__ import annotations

import asyncio
import inspect
import logging

from distributed_core import bounded_repr

from ..comm import Blob, CommClosedError
from ..plugins import (
    BLOB_MIN_BYTES,
    MAX_PLUGIN_BYTES,
    check_plugin_name,
    defined_by,
    has_own_hook,
    plugin_name,
    tell_transitions,
)
from ..protocol.stories import MAX_TIMEOUT

__all__ = ["MAX_WORKER_PLUGINS", "SchedulerPluginHooks", "WorkerPluginRegistry"]

logger = logging.getLogger("distributed_server.scheduler")

#: The most worker plugins a scheduler keeps.
MAX_WORKER_PLUGINS = 1_000
#: The most bytes of worker plugins a scheduler keeps, all together.
MAX_WORKER_PLUGIN_TOTAL = 512 * 2**20
#: How long a registration waits for the workers' setups by default (seconds).
SETUP_TIMEOUT = 120.0
#: The scheduler-plugin hooks called with ``(scheduler, ...)``.
_SCHEDULER_HOOKS = ("start", "close", "add_worker", "remove_worker", "add_client",
                    "remove_client", "update_graph", "transition")


def _nbytes(data) -> int:
    return len(data) if isinstance(data, bytes) else data.nbytes


def _wire(data):
    return Blob(data) if _nbytes(data) >= BLOB_MIN_BYTES else data


class PluginRequestError(ValueError):
    """A plugin request the scheduler refuses; nothing changed."""


class WorkerPluginRegistry:
    """The worker plugins of a scheduler. ``worker_comms`` is the scheduler's live map
    of worker address -> Comm, ``requests`` its `WorkerRequests`."""

    def __init__(self, worker_comms: dict, requests) -> None:
        self.plugins: dict = {}  # name -> pickle (bytes or memoryview)
        self._worker_comms = worker_comms
        self._requests = requests

    @property
    def total_bytes(self) -> int:
        """Bytes of all plugins kept."""
        return sum(_nbytes(data) for data in self.plugins.values())

    def check_register(self, msg: dict) -> tuple:
        """``(name, data, idempotent, timeout)`` of a ``register-worker-plugin`` message,
        checked (`PluginRequestError` otherwise)."""
        try:
            name = check_plugin_name(msg.get("name"))
        except TypeError as exc:
            raise PluginRequestError(str(exc)) from None
        data = msg.get("plugin")
        if not isinstance(data, (bytes, memoryview)):
            raise PluginRequestError("register-worker-plugin: 'plugin' must be the "
                                     "plugin's pickle, as bytes")
        if _nbytes(data) > MAX_PLUGIN_BYTES:
            raise PluginRequestError(f"plugin {name!r} is {_nbytes(data):,} bytes; a plugin "
                                     f"may have at most {MAX_PLUGIN_BYTES:,}")
        idempotent = msg.get("idempotent", False)
        if type(idempotent) is not bool:
            raise PluginRequestError("register-worker-plugin: idempotent must be a bool")
        timeout = _timeout(msg)
        if name not in self.plugins and len(self.plugins) >= MAX_WORKER_PLUGINS:
            raise PluginRequestError(f"the scheduler keeps {len(self.plugins):,} worker "
                                     f"plugins, the most it may; unregister some")
        old = _nbytes(self.plugins[name]) if name in self.plugins else 0
        if self.total_bytes - old + _nbytes(data) > MAX_WORKER_PLUGIN_TOTAL:
            raise PluginRequestError(f"the scheduler keeps {self.total_bytes:,} bytes of "
                                     f"worker plugins and may keep at most "
                                     f"{MAX_WORKER_PLUGIN_TOTAL:,}; plugin {name!r} does "
                                     f"not fit")
        return name, data, idempotent, timeout

    async def register(self, name: str, data, timeout: float) -> dict:
        """Keep the plugin and install it on every worker connected now. The answer:
        ``{"status": "OK" | "error", "workers": {address: outcome}, "silent":
        {address: why}}``; on any failed setup the plugin is forgotten again."""
        self.plugins[name] = data
        answers, silent = await self._requests.ask(
            dict(self._worker_comms),
            {"op": "plugin-add", "name": name, "plugin": _wire(data)}, timeout)
        workers = {address: _outcome(answer) for address, answer in answers.items()}
        failed = any(outcome["status"] != "OK" for outcome in workers.values())
        if failed and self.plugins.get(name) is data:
            del self.plugins[name]
            for comm in self._worker_comms.values():
                _send_quietly(comm, {"op": "plugin-remove", "name": name})
            logger.warning("worker plugin %r failed to set up on %d worker(s); it was "
                           "removed again", name,
                           sum(outcome["status"] != "OK" for outcome in workers.values()))
        elif not failed:
            logger.info("worker plugin %r installed on %d worker(s)", name, len(workers))
        return {"status": "error" if failed else "OK", "workers": workers, "silent": silent}

    def check_unregister(self, msg: dict) -> tuple:
        """``(name, timeout)`` of an ``unregister-worker-plugin`` message, checked."""
        try:
            name = check_plugin_name(msg.get("name"))
        except TypeError as exc:
            raise PluginRequestError(str(exc)) from None
        return name, _timeout(msg)

    async def unregister(self, name: str, timeout: float) -> dict:
        """Forget the plugin and tear it down on every worker: ``{"workers": {address:
        outcome}, "silent": {address: why}}``."""
        del self.plugins[name]
        answers, silent = await self._requests.ask(
            dict(self._worker_comms), {"op": "plugin-remove", "name": name}, timeout)
        workers = {address: _outcome(answer) for address, answer in answers.items()}
        logger.info("worker plugin %r removed", name)
        return {"workers": workers, "silent": silent}

    def worker_joined(self, comm) -> None:
        """Send a new worker every plugin, before anything else on its stream."""
        for name, data in self.plugins.items():
            _send_quietly(comm, {"op": "plugin-add", "name": name, "plugin": _wire(data)})


def _timeout(msg: dict) -> float:
    timeout = msg.get("timeout", SETUP_TIMEOUT)
    if type(timeout) not in (int, float) or not 0 < timeout <= MAX_TIMEOUT:
        raise PluginRequestError(f"{msg.get('op')}: timeout must be seconds in (0, "
                                 f"{MAX_TIMEOUT:g}], not {bounded_repr(timeout, 60)}")
    return float(timeout)


def _outcome(answer) -> dict:
    """A worker's answer to plugin-add/remove, checked: ``{"status": "OK"}`` or
    ``{"status": "error", "exception": bytes, "traceback": bytes, "text": str}``."""
    if type(answer) is dict and answer.get("status") == "OK":
        return {"status": "OK"}
    if (type(answer) is dict and answer.get("status") == "error"
            and isinstance(answer.get("exception"), (bytes, memoryview))
            and isinstance(answer.get("traceback"), (bytes, memoryview))
            and isinstance(answer.get("text"), str)):
        return {"status": "error", "exception": answer["exception"],
                "traceback": answer["traceback"], "text": answer["text"][:10_000]}
    return {"status": "error", "exception": None, "traceback": None,
            "text": f"a malformed answer: {bounded_repr(answer, 200)}"}


def _send_quietly(comm, msg: dict) -> None:
    try:
        comm.send(msg)
    except CommClosedError:
        pass


class SchedulerPluginHooks:
    """The scheduler plugins of one scheduler (``plugins``: name -> plugin) and the
    calls of their hooks. ``hooks[name]`` lists the plugins that define hook ``name``
    (a plugin without a hook costs that hook nothing)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.plugins: dict = {}
        self.hooks: dict = {hook: [] for hook in _SCHEDULER_HOOKS}
        #: plugins with a transition hook; non-empty: the scheduler reads transitions
        self.watchers: list = self.hooks["transition"]
        self._tasks: set = set()
        self._failures: dict = {}  # name -> transition calls that raised

    def add(self, plugin, name=None, idempotent: bool = False) -> None:
        """Install ``plugin``; ``name`` defaults to its ``name`` attribute, else its class
        name and a uuid. A plugin of the same name is replaced (``idempotent``: kept)."""
        if isinstance(plugin, type):
            raise TypeError(f"add_plugin takes a plugin instance, not the class "
                            f"{plugin.__name__}")
        if not defined_by(plugin, "SchedulerPlugin") and not any(
                callable(getattr(plugin, hook, None)) for hook in _SCHEDULER_HOOKS):
            raise TypeError(f"{type(plugin).__name__} is not a scheduler plugin (subclass "
                            "distributed_server.SchedulerPlugin)")
        name = plugin_name(plugin, name)
        if name in self.plugins:
            if idempotent:
                return
            logger.warning("scheduler plugin %r replaced", name)
            self.remove(name)
        if not self.watchers and has_own_hook(plugin, "transition", "SchedulerPlugin"):
            self.scheduler.state.record_transitions(True)
        self.plugins[name] = plugin
        for hook, plugins in self.hooks.items():
            if has_own_hook(plugin, hook, "SchedulerPlugin"):
                plugins.append((name, getattr(plugin, hook)))
        logger.info("scheduler plugin %r added", name)
        if self.scheduler.address:  # running: it starts now
            for owner, start in self.hooks["start"]:
                if owner == name:
                    self._call(name, "start", start, self.scheduler)

    def remove(self, name: str) -> None:
        """Remove the plugin ``name`` (KeyError if there is none); its ``close`` is not
        called (as in dask)."""
        del self.plugins[name]
        for plugins in self.hooks.values():
            plugins[:] = [(n, hook) for n, hook in plugins if n != name]
        if not self.watchers:
            self.scheduler.state.record_transitions(False)

    async def start(self) -> None:
        """The scheduler runs: await every plugin's ``start``."""
        for name, hook in list(self.hooks["start"]):
            await self._await(name, "start", hook, self.scheduler)

    async def close(self) -> None:
        """The scheduler closes: await every plugin's ``close``, then tasks of hooks
        still running. No hook is called after ``close`` (workers and clients that
        leave as the connections close are not told of)."""
        closing = list(self.hooks["close"])
        for plugins in self.hooks.values():
            plugins.clear()
        self.scheduler.state.record_transitions(False)
        for name, hook in closing:
            await self._await(name, "close", hook)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)

    def call(self, hook: str, *args, **kwargs) -> None:
        """Call ``hook`` of every plugin that has it: ``hook(scheduler, *args, **kwargs)``."""
        for name, method in list(self.hooks[hook]):
            self._call(name, hook, method, self.scheduler, *args, **kwargs)

    def notify_transitions(self) -> None:
        """Call every plugin's ``transition`` with the transitions since the last call."""
        tell_transitions(list(self.watchers), self.scheduler.state.take_transitions(),
                         self._failures, "scheduler plugin")

    def _call(self, name: str, hook: str, method, *args, **kwargs) -> None:
        try:
            result = method(*args, **kwargs)
        except Exception:
            logger.exception("scheduler plugin %r failed in %s", name, hook)
            return
        if inspect.isawaitable(result):
            task = asyncio.get_running_loop().create_task(
                self._await_result(name, hook, result))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _await(self, name: str, hook: str, method, *args) -> None:
        try:
            result = method(*args)
        except Exception:
            logger.exception("scheduler plugin %r failed in %s", name, hook)
            return
        if inspect.isawaitable(result):
            await self._await_result(name, hook, result)

    async def _await_result(self, name: str, hook: str, result) -> None:
        try:
            await result
        except Exception:
            logger.exception("scheduler plugin %r failed in %s", name, hook)
