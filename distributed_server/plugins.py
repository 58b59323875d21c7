"""Plugins: code of the user's that runs inside the workers or the scheduler, with
dask.distributed's interfaces.

What this module does
---------------------
- `WorkerPlugin`: ``setup(worker)``, ``teardown(worker)``, ``transition(key, start,
  finish, **kwargs)``. ``Client.register_plugin`` pickles one (this class's subclasses,
  dask's ``distributed.diagnostics.plugin.WorkerPlugin`` subclasses, or any object with
  those methods) and sends it through the scheduler, which keeps the bytes without
  unpickling them and hands them to every worker, now and when one joins later
  (`distributed_server.scheduler.plugins`). On the worker, `WorkerPluginHost` unpickles
  it, tears down a plugin of the same name, calls ``setup`` (awaited if it returns an
  awaitable) and reports the outcome; a failed setup comes back to the client as the
  original exception.
- ``transition`` is called on the worker's event loop with the transitions of its state
  machine, which records them (``WorkerCore.record_transitions``) only while a plugin
  with a ``transition`` method is installed; the worker takes them after each stimulus.
  With none, the machine records nothing and the worker does not look.
- `SchedulerPlugin`: ``start(scheduler)``, ``close()``, ``add_worker(scheduler,
  worker)``, ``remove_worker(scheduler, worker, **kwargs)``, ``add_client``,
  ``remove_client``, ``update_graph(scheduler, *, client, keys, tasks, **kwargs)``,
  ``transition(key, start, finish, **kwargs)``. The scheduler never unpickles what a
  peer sends, so a scheduler plugin cannot come from a client: ``register_plugin``
  refuses one and says how to install it (``Scheduler.add_plugin`` from a module given
  to ``dcore scheduler --preload``).

What it never does
------------------
Nanny plugins are not supported (`NannyPluginRefused`): the nanny runs no user code.
A plugin's failure (in a hook or a transition) is logged and never stops the worker or
the scheduler.
"""
from __future__ import annotations

import inspect
import logging
import pickle
import uuid
import warnings

import cloudpickle

from .protocol.serialize import dumps_error, loads_error
from .protocol.wire import Blob

__all__ = ["MAX_PLUGIN_BYTES", "MAX_PLUGIN_NAME", "NannyPluginRefused",
           "SchedulerPlugin", "SchedulerPluginRefused", "WorkerPlugin"]

logger = logging.getLogger("distributed_server.plugins")

#: The most bytes a worker plugin may have, pickled.
MAX_PLUGIN_BYTES = 64 * 2**20
#: The longest plugin name, in characters.
MAX_PLUGIN_NAME = 256
#: Pickles at least this large travel as out-of-band buffers.
BLOB_MIN_BYTES = 64 * 1024


class WorkerPlugin:
    """Code that runs in every worker: subclass it and override what you need.

    ``setup(worker)`` runs when the plugin is installed on a worker (at registration on
    the workers then connected, and on every worker that joins later); ``teardown(worker)``
    when it is removed or replaced, or the worker closes; ``transition(key, start,
    finish, **kwargs)`` after each change of a task's state on the worker (``kwargs``:
    ``stimulus_id``). ``setup`` and ``teardown`` may be coroutine functions. A ``name``
    attribute names the plugin (registering a plugin of a name in use replaces it)."""

    def setup(self, worker) -> None:
        """Called when the plugin is installed on ``worker``."""

    def teardown(self, worker) -> None:
        """Called when the plugin is removed from ``worker`` or the worker closes."""

    def transition(self, key, start: str, finish: str, **kwargs) -> None:
        """Called when task ``key`` goes from state ``start`` to ``finish`` on the worker."""


class SchedulerPlugin:
    """Code that runs in the scheduler process, installed with ``Scheduler.add_plugin``
    from a module given to ``dcore scheduler --preload`` (never from a client).

    Hooks (override what you need; ``start`` and ``close`` may be coroutine functions):
    ``start(scheduler)``, ``close()``, ``add_worker(scheduler, worker)``,
    ``remove_worker(scheduler, worker, **kwargs)``, ``add_client(scheduler, client)``,
    ``remove_client(scheduler, client, **kwargs)``, ``update_graph(scheduler, *, client,
    keys, tasks, dependencies, stimulus_id, **kwargs)`` and ``transition(key, start,
    finish, **kwargs)`` (``kwargs``: ``stimulus_id``)."""

    async def start(self, scheduler) -> None:
        """The scheduler runs (or the plugin was added to a running one)."""

    async def close(self) -> None:
        """The scheduler is closing."""

    def add_worker(self, scheduler, worker: str) -> None:
        """A worker joined (its address)."""

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        """A worker left (its address)."""

    def add_client(self, scheduler, client: str) -> None:
        """A client connected (its id)."""

    def remove_client(self, scheduler, client: str, **kwargs) -> None:
        """A client left (its id)."""

    def update_graph(self, scheduler, *, client: str, keys: set, tasks: list,
                     **kwargs) -> None:
        """A client sent tasks (a large dask graph arrives in several slices, one call
        each): ``keys`` it wants, ``tasks`` the keys of all tasks it sent,
        ``dependencies`` ``{key: [keys]}``."""

    def transition(self, key, start: str, finish: str, **kwargs) -> None:
        """Task ``key`` went from state ``start`` to ``finish`` in the scheduler."""


class SchedulerPluginRefused(TypeError):
    """A scheduler plugin was passed to a client; the scheduler takes none from peers."""


class NannyPluginRefused(NotImplementedError):
    """A nanny plugin was passed to a client; distributed-core has none."""


def defined_by(obj, class_name: str) -> bool:
    """Whether ``obj`` is an instance of our class ``class_name`` or of dask's."""
    for cls in type(obj).__mro__:
        if cls.__name__ == class_name and (cls.__module__ == __name__
                                           or cls.__module__.startswith("distributed.")):
            return True
    return False


def has_own_hook(obj, method: str, base_name: str) -> bool:
    """Whether ``obj``'s ``method`` does something: it exists and is not the no-op of
    a base class named ``base_name`` (ours or dask's)."""
    function = getattr(type(obj), method, None)
    if function is None:
        return callable(getattr(obj, method, None))  # set on the instance
    for cls in type(obj).__mro__:
        if cls.__name__ == base_name and cls.__dict__.get(method) is function:
            return False
    return True


def check_plugin_name(name) -> str:
    """A plugin's name, checked: a str of 1 to `MAX_PLUGIN_NAME` characters."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_PLUGIN_NAME:
        raise TypeError(f"a plugin's name must be a str of 1 to {MAX_PLUGIN_NAME} "
                        f"characters, not {name!r:.100}")
    return name


def plugin_name(plugin, name=None) -> str:
    """``name``, else the plugin's ``name`` attribute, else its class name and a uuid
    (as dask names plugins); checked by `check_plugin_name`."""
    if name is None:
        name = getattr(plugin, "name", None)
        if name is None:
            name = f"{type(plugin).__name__}-{uuid.uuid4().hex}"
    return check_plugin_name(name)


def worker_plugin_payload(plugin, name=None, nanny=None) -> tuple:
    """``(name, pickled plugin)`` of a worker plugin a client registers; a scheduler or
    nanny plugin, or an object that is no plugin, is refused with what to do instead."""
    if nanny or defined_by(plugin, "NannyPlugin"):
        raise NannyPluginRefused(
            "nanny plugins are not supported by distributed-core: the nanny runs no user "
            "code. Register a WorkerPlugin (it is installed again in every worker the "
            "nanny restarts), or use `dcore worker --preload` for process setup")
    if defined_by(plugin, "SchedulerPlugin"):
        raise SchedulerPluginRefused(
            f"{type(plugin).__name__} is a SchedulerPlugin: the distributed-core scheduler "
            "never unpickles what a client sends, so it cannot take a plugin from one. "
            "Install it where the scheduler starts: write a module with\n"
            "    def dcore_setup(scheduler):\n"
            f"        scheduler.add_plugin({type(plugin).__name__}(...))\n"
            "and start the scheduler with `dcore scheduler --preload path/to/module.py`")
    if isinstance(plugin, type):
        raise TypeError(f"register_plugin takes a plugin instance, not the class "
                        f"{plugin.__name__}: pass {plugin.__name__}()")
    if not any(callable(getattr(plugin, hook, None))
               for hook in ("setup", "teardown", "transition")):
        raise TypeError(f"{type(plugin).__name__} is not a plugin: a WorkerPlugin has "
                        "setup(worker), teardown(worker) and/or transition(key, start, "
                        "finish, **kwargs) (subclass distributed_server.WorkerPlugin)")
    name = plugin_name(plugin, name)
    data = cloudpickle.dumps(plugin, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_PLUGIN_BYTES:
        raise ValueError(f"plugin {name!r} is {len(data):,} bytes pickled; a plugin may have "
                         f"at most {MAX_PLUGIN_BYTES:,} (let setup() load large data)")
    return name, (Blob(data) if len(data) >= BLOB_MIN_BYTES else data)


def register_worker_plugin(client, plugin, name=None, idempotent: bool = False,
                           nanny=None):
    """``Client.register_plugin``: install ``plugin`` on every worker, now and later;
    ``{address: {"status": "OK"}}``. Raises the first worker's setup error (the plugin
    is then removed everywhere), `SchedulerPluginRefused` or `NannyPluginRefused`."""
    if type(idempotent) is not bool:
        raise TypeError(f"idempotent must be True or False, not {idempotent!r:.100}")
    name, data = worker_plugin_payload(plugin, name, nanny)
    return client._sync(_register, client, name, data, idempotent)


async def _register(client, name: str, data, idempotent: bool) -> dict:
    result = await client._request("register-worker-plugin", name=name, plugin=data,
                                   idempotent=idempotent)
    return _worker_outcomes(f"plugin {name!r}", "setup", result)


def unregister_worker_plugin(client, name):
    """``Client.unregister_worker_plugin``: tear the plugin down on every worker and
    forget it; ValueError if no plugin has that name."""
    check_plugin_name(name)
    return client._sync(_unregister, client, name)


async def _unregister(client, name: str) -> dict:
    result = await client._request("unregister-worker-plugin", name=name)
    if result.get("status") == "missing":
        raise ValueError(f"The worker plugin {name} does not exist.")
    return _worker_outcomes(f"plugin {name!r}", "teardown", result)


def _worker_outcomes(what: str, hook: str, result: dict) -> dict:
    """The workers' outcomes of a plugin request: raise the first failure (the original
    exception, the worker's traceback as its cause), warn of workers that did not
    answer, else ``{address: {"status": "OK"}}``."""
    workers = dict(result["workers"])
    for address, outcome in sorted(workers.items()):
        if outcome["status"] != "OK":
            exc = loads_error(outcome.get("exception"), outcome.get("traceback"),
                              outcome.get("text", "failed"))
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"({what}: {hook} failed on worker {address}"
                             f"{'; the plugin was removed again' if hook == 'setup' else ''})")
            raise exc
    silent = result.get("silent") or {}
    if silent:
        named = "; ".join(f"{address}: {why}" for address, why in sorted(silent.items()))
        warnings.warn(f"{what}: {len(silent)} worker(s) did not answer the {hook}: {named}",
                      RuntimeWarning, stacklevel=4)
    return {address: {"status": "OK"} for address in workers}


def _failure(exc: BaseException) -> dict:
    """A hook's failure as it travels back to the client (its pickle, its traceback)."""
    exception, traceback, text = dumps_error(exc)
    return {"status": "error", "exception": exception, "traceback": traceback, "text": text}


_OK = {"status": "OK"}


class WorkerPluginHost:
    """The plugins installed on one worker (``worker.plugins``: name -> plugin object)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.plugins: dict = worker.plugins
        self._bytes: dict = {}  # name -> the pickle it was installed from
        #: name -> the plugin's transition method, for plugins that have their own
        self.watchers: dict = {}
        self._failures: dict = {}  # name -> transition calls that raised

    def add(self, name: str, data):
        """Install plugin ``name`` from its pickle: tear down the plugin of that name,
        call ``setup``. The outcome (``{"status": "OK"}`` or a failure), or an awaitable
        of it if a hook returned one: hooks that are plain functions run now, so a
        plugin is set up before the tasks that follow it on the stream. The same pickle
        again (the worker registered again) changes nothing."""
        data = bytes(data)
        if self._bytes.get(name) == data:
            return _OK
        try:
            plugin = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - the client hears why
            logger.warning("worker %s: plugin %r cannot be unpickled here: %r",
                           self.worker.address, name, exc)
            return _failure(exc)
        before = self.remove(name)
        if inspect.isawaitable(before):
            return self._add_after(before, name, plugin, data)
        return self._set_up(name, plugin, data)

    async def _add_after(self, teardown, name: str, plugin, data: bytes) -> dict:
        await teardown  # a failure is logged; the new plugin goes in anyway
        outcome = self._set_up(name, plugin, data)
        return (await outcome) if inspect.isawaitable(outcome) else outcome

    def _set_up(self, name: str, plugin, data: bytes):
        self.plugins[name] = plugin
        self._bytes[name] = data
        setup = getattr(plugin, "setup", None)
        try:
            result = setup(self.worker) if setup is not None else None
        except Exception as exc:  # noqa: BLE001 - the client hears why
            return self._setup_failed(name, exc)
        if inspect.isawaitable(result):
            return self._setup_awaited(name, plugin, result)
        return self._installed(name, plugin)

    async def _setup_awaited(self, name: str, plugin, result) -> dict:
        try:
            await result
        except Exception as exc:  # noqa: BLE001 - the client hears why
            return self._setup_failed(name, exc)
        return self._installed(name, plugin)

    def _setup_failed(self, name: str, exc: Exception) -> dict:
        logger.warning("worker %s: setup of plugin %r failed: %r", self.worker.address, name,
                       exc)
        self.plugins.pop(name, None)
        self._bytes.pop(name, None)
        return _failure(exc)

    def _installed(self, name: str, plugin) -> dict:
        if has_own_hook(plugin, "transition", "WorkerPlugin"):
            if not self.watchers:
                self.worker.state.record_transitions(True)
            self.watchers[name] = plugin.transition
        logger.info("worker %s: plugin %r installed", self.worker.address, name)
        return _OK

    def remove(self, name: str):
        """Tear down and forget plugin ``name``: the outcome (``{"status": "OK"}`` also if
        there was none), or an awaitable of it if ``teardown`` returned one."""
        plugin = self.plugins.pop(name, None)
        self._bytes.pop(name, None)
        if self.watchers.pop(name, None) is not None and not self.watchers:
            self.worker.state.record_transitions(False)
        self._failures.pop(name, None)
        teardown = getattr(plugin, "teardown", None)
        if teardown is None:
            return _OK
        try:
            result = teardown(self.worker)
        except Exception as exc:  # noqa: BLE001 - the client hears why
            return self._teardown_failed(name, exc)
        if inspect.isawaitable(result):
            return self._teardown_awaited(name, result)
        return _OK

    async def _teardown_awaited(self, name: str, result) -> dict:
        try:
            await result
        except Exception as exc:  # noqa: BLE001 - the client hears why
            return self._teardown_failed(name, exc)
        return _OK

    def _teardown_failed(self, name: str, exc: Exception) -> dict:
        logger.warning("worker %s: teardown of plugin %r failed: %r", self.worker.address,
                       name, exc)
        return _failure(exc)

    async def close(self) -> None:
        """The worker closes: tear every plugin down, last installed first."""
        for name in reversed(list(self.plugins)):
            outcome = self.remove(name)
            if inspect.isawaitable(outcome):
                await outcome

    def notify_transitions(self) -> None:
        """Call each plugin's ``transition`` with the transitions since the last call."""
        tell_transitions(list(self.watchers.items()), self.worker.state.take_transitions(),
                         self._failures, f"worker {self.worker.address}: plugin")


def tell_transitions(watchers: list, entries: list, failures: dict, who: str) -> None:
    """Call each ``(name, transition)`` of ``watchers`` with every ``(key, start, finish,
    stimulus_id)`` of ``entries``. A call that raises is counted in ``failures[name]``
    and logged (``who`` names the plugin's kind) the first and every 1,000th time."""
    for name, transition in watchers:
        for key, start, finish, stimulus_id in entries:
            try:
                transition(key, start, finish, stimulus_id=stimulus_id)
            except Exception:
                count = failures[name] = failures.get(name, 0) + 1
                if count == 1 or count % 1000 == 0:
                    logger.exception("%s %r failed in transition (%d failures so far)", who,
                                     name, count)
