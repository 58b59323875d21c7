"""Which versions of what a client, the scheduler and the workers run, and whether
they fit together.

A task's function and its data are pickled by the client and unpickled by a worker, so
Python (major.minor), cloudpickle, msgpack and this package must agree between them, and
so should dask when dask collections are used. `check` names every difference."""
from __future__ import annotations

import importlib.metadata
import platform
import sys

__all__ = ["MUST_MATCH", "VersionMismatch", "check", "essential", "mismatches", "versions"]

#: The packages whose versions must be the same everywhere (python: major.minor).
MUST_MATCH = ("python", "distributed-core", "cloudpickle", "msgpack", "dask")
_PACKAGES = ("distributed-core", "cloudpickle", "msgpack", "tornado", "dask", "zict",
             "psutil", "numpy", "pandas")


class VersionMismatch(ValueError):
    """The client, the scheduler and the workers do not run matching versions."""


def versions() -> dict:
    """``{"python": "3.11", "platform": ..., package: version or None}`` for this process."""
    found = {"python": "%d.%d" % sys.version_info[:2], "python-full": platform.python_version(),
             "platform": platform.platform(terse=True)}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def check(client: dict, scheduler: dict, workers: dict) -> list[str]:
    """The differences, one line each, in the packages of `MUST_MATCH` between the
    client's, the scheduler's and each worker's ``versions()`` (dask only where the
    client has it)."""
    problems = []
    for name in MUST_MATCH:
        mine = client.get(name)
        if name == "dask" and mine is None:
            continue
        others = {"scheduler": scheduler.get(name),
                  **{address: v.get(name) for address, v in workers.items()
                     if isinstance(v, dict)}}
        differ = {who: v for who, v in others.items() if v != mine}
        if differ:
            shown = ", ".join(f"{who}: {v}" for who, v in sorted(differ.items()))
            problems.append(f"{name}: client {mine}, but {shown}")
    return problems


def essential() -> dict:
    """This process's versions of `MUST_MATCH` (what a worker sends when it registers)."""
    found = versions()
    return {name: found.get(name) for name in MUST_MATCH}


def mismatches(mine: dict, theirs) -> list[str]:
    """``"name: ours X, theirs Y"`` for each package of `MUST_MATCH` that differs (dask
    only where both have it); nothing if ``theirs`` is not a dict (an older peer)."""
    if not isinstance(theirs, dict):
        return []
    out = []
    for name in MUST_MATCH:
        a, b = mine.get(name), theirs.get(name)
        if name == "dask" and (a is None or b is None):
            continue
        if a != b:
            out.append(f"{name}: ours {a}, theirs {bounded(b)}")
    return out


def bounded(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
