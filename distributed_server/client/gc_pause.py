"""The automatic garbage collector held off while one call makes many objects that all
live on (`Client.map`'s futures and their key states)."""
from __future__ import annotations

import contextlib
import gc
import sys
import threading

__all__ = ["collected_apart", "collector_paused"]

# CPython 3.12 keeps immortal objects in the permanent generation, so there a freeze
# count does not tell whether someone else has frozen objects
_FREEZE_COUNT_TELLS = sys.version_info[:2] != (3, 12)

_paused_lock = threading.Lock()
_paused_depth = 0
_paused_resume = False


@contextlib.contextmanager
def collector_paused():
    """Automatic collection off for the ``with`` block, back on after it if it was on.

    A call that makes millions of objects which all live on makes the automatic
    collector walk all of them again and again: every time the long-lived objects have
    grown by a quarter, a generation-2 collection walks every one (``Client.map`` of a
    million tasks: 13 such collections, 1.35 s of the caller's 3.9 s). Paused, they are
    walked a few times after the block instead. Nested and concurrent blocks (other
    threads) share one pause, which ends with the last of them; cyclic garbage made
    meanwhile waits for it."""
    global _paused_depth, _paused_resume
    with _paused_lock:
        if _paused_depth == 0:
            _paused_resume = gc.isenabled()
            gc.disable()
        _paused_depth += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused_depth -= 1
            if _paused_depth == 0 and _paused_resume:
                gc.enable()


@contextlib.contextmanager
def collected_apart():
    """The cyclic garbage made inside collected at its end, walking only what was made
    inside.

    For a call that leaves much cyclic garbage among many objects that live on:
    ``dask.order`` leaves its working sets (about 3.5 objects a task, held by closures
    that refer to themselves) after the client has materialized the graph (about 10 a
    task, kept by the user's collection). Collected with the rest when the pause ends,
    that garbage cost a walk of every object of the graph (1.4 us a task of 133,000), and
    held its memory until then. Here the objects that exist already are set aside
    (``gc.freeze``) and, after the collection, put in the oldest generation, which
    young collections do not walk (``gc.unfreeze``): as if they had survived those.
    The lean order of a big graph (`lean_order.LeanOrder`), which leaves no garbage,
    runs inside it too, so that the graph's objects are aged the same way: else the first
    young collection after the pause walked them all (1.5 us a task of a million tasks
    that dask's collection kept, ``optimize_graph=False``).

    Does nothing more than the ``with`` block if the program turned the collector off
    (``gc.disable`` before `collector_paused`), if objects are frozen already (someone
    else's ``gc.freeze``: unfreezing would hand theirs back too), and on CPython 3.12,
    where that cannot be told."""
    collecting = gc.isenabled() or (_paused_depth > 0 and _paused_resume)
    if not collecting or not _FREEZE_COUNT_TELLS or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        try:
            gc.collect(0)
        finally:
            gc.unfreeze()
