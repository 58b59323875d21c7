"""What a worker tells the scheduler about a result: the ``task-finished`` and
``task-erred`` reports (docs/protocol.md), a result's size, and why a result cannot travel.

Reports are built where the result is: on the executor thread that ran the task
(executor.py), or on the loop for a value already held (``ReportHeld``). A broken
``__sizeof__`` or ``__str__`` of user objects never loses a result or its report.
"""
from __future__ import annotations

from distributed_core import bounded_repr

from ..protocol.serialize import dumps_error, dumps_inline_result, sizeof

__all__ = ["MAX_REPORTED_NBYTES", "ResultCannotTravel", "cannot_travel_text", "erred_report",
           "finished_report", "sizeof_quietly"]

#: A result's size is reported clamped to this: a broken __sizeof__ cannot make the
#: scheduler refuse the report.
MAX_REPORTED_NBYTES = 2**62


class ResultCannotTravel(TypeError):
    """A task's result cannot be serialized, so it cannot reach other workers or clients."""


def finished_report(key, value, start: float, stop: float) -> dict:
    """The ``task-finished`` message for ``value``: its size, type and, when small, the
    value pickled inline."""
    try:
        nbytes = min(max(int(sizeof(value)), 0), MAX_REPORTED_NBYTES)
    except Exception:  # noqa: BLE001 - a broken nbytes property must not lose the result
        nbytes = 64
    report = {"op": "task-finished", "key": key, "nbytes": nbytes,
              "type": type(value).__name__, "start": start, "stop": stop}
    inline = dumps_inline_result(value)
    if inline is not None:
        report["data"] = inline
    return report


def erred_report(key, exc: BaseException, start: float, stop: float) -> dict:
    """The ``task-erred`` message for ``exc``, even if it cannot be pickled or printed."""
    try:
        exception, traceback, text = dumps_error(exc)
    except Exception:  # noqa: BLE001 - e.g. an exception whose __str__ raises
        exception, traceback, text = None, b"", f"{type(exc).__name__} (unprintable)"
    return {"op": "task-erred", "key": key, "exception": exception, "traceback": traceback,
            "text": text, "start": start, "stop": stop}


def cannot_travel_text(key, value, exc: BaseException) -> str:
    """Why the result of ``key`` cannot travel: its key, type, size and the cause."""
    try:
        size = f"{min(max(int(sizeof(value)), 0), MAX_REPORTED_NBYTES)} bytes"
    except Exception:  # noqa: BLE001
        size = "size unknown"
    try:
        cause = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        cause = type(exc).__name__
    return (f"the result of {bounded_repr(key)} ({type(value).__module__}."
            f"{type(value).__qualname__}, {size}) cannot be serialized to send it to "
            f"another worker or a client: {cause[:500]}")


def sizeof_quietly(value) -> int:
    """``sizeof(value)``, or 64 if the value's ``__sizeof__`` is broken."""
    try:
        return max(int(sizeof(value)), 0)
    except Exception:  # noqa: BLE001 - a broken __sizeof__ must not break storing
        return 64
