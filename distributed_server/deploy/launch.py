"""What ``dcore`` does around a server's start for batch systems and containers: the
scheduler file, preload modules, a worker's death timeout and lifetime.

- A scheduler file (``--scheduler-file``) is a small JSON document ``{"address": ...}``
  that the scheduler writes once it listens (atomically: written aside, then renamed)
  and removes when it stops; workers and clients started with the same path wait for it
  and read the address from it (SLURM and other batch systems start them all at once on
  a shared file system).
- A preload (``--preload``) is a module name or a ``.py`` file imported at start; if it
  defines ``dcore_setup(server)`` (or dask's name, ``dask_setup``) that is called once the
  server runs, and ``dcore_teardown(server)`` / ``dask_teardown`` when it stops. Either
  may be a coroutine function.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time

__all__ = ["Preload", "close_after", "read_scheduler_file", "write_scheduler_file"]


def write_scheduler_file(path: str, address: str) -> None:
    """Write ``{"address": address}`` to ``path`` atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"address": address, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def read_scheduler_file(path: str, timeout: float = 60.0) -> str:
    """The address in the scheduler file at ``path``, waiting up to ``timeout`` seconds
    for it to appear; TimeoutError after that, ValueError if it holds no address."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no scheduler file at {path} after {timeout:.0f}s")
        time.sleep(0.1)
    with open(path) as f:
        try:
            address = json.load(f).get("address")
        except (ValueError, AttributeError):
            address = None
    if not isinstance(address, str) or "://" not in address:
        raise ValueError(f"the scheduler file {path} holds no scheduler address")
    return address


class Preload:
    """One ``--preload``: a module name or a path to a ``.py`` file, imported at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name.endswith(".py"):
            if not os.path.exists(name):
                raise FileNotFoundError(f"preload {name}: no such file")
            module_name = os.path.splitext(os.path.basename(name))[0]
            spec = importlib.util.spec_from_file_location(module_name, name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(name)
        self.module = module

    async def setup(self, server) -> None:
        """Call the module's ``dcore_setup`` / ``dask_setup`` with the running server."""
        await self._call(("dcore_setup", "dask_setup"), server)

    async def teardown(self, server) -> None:
        """Call the module's ``dcore_teardown`` / ``dask_teardown``."""
        await self._call(("dcore_teardown", "dask_teardown"), server)

    async def _call(self, names: tuple, server) -> None:
        for name in names:
            hook = getattr(self.module, name, None)
            if hook is not None:
                result = hook(server)
                if inspect.isawaitable(result):
                    await result
                return


async def close_after(server, seconds: float) -> None:
    """Close ``server`` after ``seconds`` (a worker's ``--lifetime``)."""
    await asyncio.sleep(seconds)
    await server.close()
