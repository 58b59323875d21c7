"""Settings from configuration: dask's keys a dask user already set, and our own.

Every setting below has a name of ours, the dask key it corresponds to (if dask has one)
and a default. A value is looked up, first found wins:

1. an explicit argument (``Scheduler(worker_ttl=60)``, ``dcore scheduler --worker-ttl``);
2. our own key under ``dcore.`` in dask's configuration (``dcore.scheduler.worker-ttl``:
   a YAML file dask reads, ``dask.config.set``, or ``DASK_DCORE__SCHEDULER__WORKER_TTL``);
3. dask's key (``distributed.scheduler.worker-ttl``, or
   ``DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL``), so a dask user's settings carry over;
4. the default.

Without dask installed, the ``DASK_DCORE__...`` and ``DASK_DISTRIBUTED__...`` environment
variables are still read (dask's format: ``__`` nests, values are Python literals or
strings). Durations take numbers of seconds or dask's strings (``"300s"``, ``"5
minutes"``, ``"100ms"``); memory fractions take a number or ``False`` (off). A value
that does not parse raises ValueError naming the key.
"""
from __future__ import annotations

import ast
import math
import os
import re

__all__ = ["SETTINGS", "get", "parse_seconds"]


def parse_seconds(value) -> float:
    """Seconds from a number or a duration string (``"300s"``, ``"5 minutes"``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match:
        raise ValueError(f"not a duration: {value!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    for names, factor in ((("", "s", "sec", "secs", "second", "seconds"), 1.0),
                          (("ms", "millisecond", "milliseconds"), 1e-3),
                          (("us", "microsecond", "microseconds"), 1e-6),
                          (("m", "min", "mins", "minute", "minutes"), 60.0),
                          (("h", "hr", "hour", "hours"), 3600.0),
                          (("d", "day", "days"), 86400.0)):
        if unit in names:
            return number * factor
    raise ValueError(f"not a duration: {value!r} (unknown unit {unit!r})")


def _fraction(value):
    if value is False or value is None or (isinstance(value, str) and
                                           value.lower() in ("false", "none", "off")):
        return None
    value = float(value)
    if not 0 <= value <= 1:
        raise ValueError(f"not a fraction from 0 to 1: {value!r}")
    return value or None


def _saturation(value) -> float:
    if isinstance(value, str) and value.lower() in ("inf", "infinity"):
        return math.inf
    value = float(value)
    if not value > 0:
        raise ValueError(f"worker saturation must be positive, got {value!r}")
    return value


def _count(value) -> int:
    if isinstance(value, bool) or int(value) != float(value) or int(value) < 0:
        raise ValueError(f"not a count: {value!r}")
    return int(value)


def _positive_count(value) -> int:
    count = _count(value)
    if not count:
        raise ValueError(f"not a positive count: {value!r}")
    return count


def _positive_seconds(value) -> float:
    seconds = parse_seconds(value)
    if not seconds >= 0.001:  # 0 would run its periodic job without a pause
        raise ValueError(f"needs at least 1 ms, not {value!r}")
    return seconds


def _flag(value) -> bool:
    if isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
        return False
    if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
        return True
    if isinstance(value, bool):
        return value
    raise ValueError(f"not a boolean: {value!r}")


def _path(value):
    return None if value in (None, "", False) else str(value)


#: our name -> (dask's key or None, default, parser)
SETTINGS = {
    "scheduler.worker-ttl": ("distributed.scheduler.worker-ttl", 300.0, parse_seconds),
    "scheduler.worker-saturation": ("distributed.scheduler.worker-saturation", 1.1,
                                    _saturation),
    "scheduler.allowed-failures": ("distributed.scheduler.allowed-failures", 3, _count),
    "scheduler.client-idle-timeout": (None, 300.0, parse_seconds),
    "scheduler.slice-keys": (None, 1_000, _positive_count),
    "scheduler.work-stealing": ("distributed.scheduler.work-stealing", True, _flag),
    "scheduler.work-stealing-interval": ("distributed.scheduler.work-stealing-interval",
                                         0.1, _positive_seconds),
    "worker.memory.target": ("distributed.worker.memory.target", 0.6, _fraction),
    "worker.memory.spill": ("distributed.worker.memory.spill", 0.7, _fraction),
    "worker.memory.pause": ("distributed.worker.memory.pause", 0.8, _fraction),
    "worker.memory.terminate": ("distributed.worker.memory.terminate", 0.95, _fraction),
    "worker.scheduler-timeout": (None, 60.0, parse_seconds),
    "comm.timeouts.connect": ("distributed.comm.timeouts.connect", 10.0, parse_seconds),
    "comm.timeouts.transfer": ("distributed.comm.timeouts.tcp", 30.0, parse_seconds),
    "comm.tls.ca-file": ("distributed.comm.tls.ca-file", None, _path),
    **{f"comm.tls.{role}.{part}": (f"distributed.comm.tls.{role}.{part}", None, _path)
       for role in ("client", "scheduler", "worker") for part in ("cert", "key")},
    "comm.token-file": (None, None, _path),
    "client.lean-order-tasks": (None, 1_000_000, _count),
}


def get(name: str, explicit=None, *, role: str | None = None):
    """The setting ``name`` (a key of `SETTINGS`): ``explicit`` if not None, else from
    configuration, else the default."""
    if explicit is not None:
        return explicit
    dask_key, default, parse = SETTINGS[name]
    for key in (f"dcore.{name}", dask_key):
        if key is None:
            continue
        value = _lookup(key)
        if value is not _UNSET:
            try:
                return parse(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"configuration {key}: {exc}") from None
    return default


_UNSET = object()


def _lookup(key: str):
    try:
        import dask.config
    except ImportError:
        return _from_environment(key)
    value = dask.config.get(key, default=_UNSET)
    return value


def _from_environment(key: str):
    """dask's environment variable for ``key`` (``DASK_A__B_C`` for ``a.b-c``), parsed as
    dask does: a Python literal, else the string."""
    wanted = [part.replace("-", "_") for part in key.split(".")]
    for name, text in os.environ.items():
        if not name.startswith("DASK_"):
            continue
        parts = [p.lower().replace("-", "_") for p in name[5:].split("__")]
        if parts == wanted:
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError):
                return text
    return _UNSET
