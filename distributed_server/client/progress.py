"""`progress`: a progress bar over futures and persisted dask collections.

What this module does
---------------------
- The bar is `tqdm.auto`'s: a text bar in a terminal, a widget in a Jupyter notebook.
- It moves on completion events: each key's state tells the client's loop when it
  settles (finished, erred or cancelled) and a done callback counts it. Nothing polls
  the scheduler or walks the keys while waiting.
- With a synchronous client `progress` blocks until every key is done, drawing the bar
  from the calling thread (so a notebook widget is updated from the thread that owns
  it). With an asynchronous client it returns at once: the bar moves from the client's
  event loop, and the awaitable it returns resolves when every key is done.

What it never does
------------------
It never fetches a result and never holds a key longer than the futures given to it do.
"""
from __future__ import annotations

import asyncio
import threading
import time

from .futures import FINISHED, futures_of

__all__ = ["progress"]

#: Seconds between two redraws of a synchronous bar at most (it redraws on completions).
REDRAW_INTERVAL = 0.1


def progress(*objs, timeout: float | None = None, **bar_options):
    """Show a progress bar until these futures (or persisted dask collections, or lists
    and dicts of them) are done.

    A synchronous client's ``progress`` blocks until all are done (``TimeoutError``
    after ``timeout`` seconds) and returns None. An asynchronous client's returns at
    once an awaitable that resolves when all are done; the bar moves meanwhile.
    Erred and cancelled keys count as done and are shown in the bar's postfix. Keyword
    arguments go to ``tqdm`` (``desc``, ``file``, ``disable``, ``leave``, ...).
    Raises ValueError if there is nothing to follow (e.g. a collection that was not
    persisted: ``client.persist(x)`` first) or the futures belong to several clients.
    """
    futures = futures_of(list(objs))
    if not futures:
        raise ValueError("progress() needs futures, or dask collections persisted with "
                         "client.persist(...) (an unpersisted collection has no futures)")
    clients = {id(f.client): f.client for f in futures}
    if len(clients) > 1:
        raise ValueError("progress(): these futures belong to different clients")
    client = next(iter(clients.values()))
    if client.asynchronous and timeout is not None:
        raise TypeError("progress(timeout=) is for a synchronous client; with an "
                        "asynchronous one use asyncio.wait_for(progress(...), timeout)")
    unique = list({id(f._state): f for f in futures}.values())  # one per key
    tracker = _Tracker(len(unique), bar_options)
    if client.asynchronous:
        return tracker.follow_async(client, unique)
    tracker.follow_sync(client, unique, timeout)
    return None


class _Tracker:
    """Counts settled keys (from done callbacks on the client's loop) into a tqdm bar."""

    def __init__(self, total: int, bar_options: dict) -> None:
        from tqdm.auto import tqdm

        # miniters=1: redraw on any progress (at most every mininterval, 0.1 s), never
        # skip updates because earlier ones came in bursts
        options = {"desc": "progress", "unit": "task", "miniters": 1, **bar_options}
        self.bar = tqdm(total=total, **options)
        self.total = total
        self.done = 0
        self.failed = 0
        self.shown = 0  # what the bar shows
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.finished: asyncio.Future | None = None

    def on_done(self, future) -> None:
        """A done callback: one more key settled (on the client's loop thread)."""
        with self.lock:
            self.done += 1
            if future._state.status != FINISHED:
                self.failed += 1
        self.changed.set()

    def redraw(self) -> None:
        with self.lock:
            done, failed = self.done, self.failed
        if done != self.shown:
            if failed:
                self.bar.set_postfix(erred=failed, refresh=False)
            self.bar.update(done - self.shown)
            self.shown = done

    def follow_sync(self, client, futures: list, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            client._add_done_callbacks(futures, self.on_done)
            while True:
                self.redraw()
                if self.shown >= self.total:
                    return
                left = REDRAW_INTERVAL if deadline is None else min(
                    REDRAW_INTERVAL, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"progress: {self.total - self.shown} of "
                                       f"{self.total} keys not done after {timeout} s")
                if self.changed.wait(left):
                    self.changed.clear()
        finally:
            self.bar.close()

    def follow_async(self, client, futures: list) -> asyncio.Future:
        loop = client._loop
        self.finished = loop.create_future()

        def on_done(future) -> None:  # on the client's (the caller's) loop
            self.on_done(future)
            self.redraw()
            if self.shown >= self.total and not self.finished.done():
                self.bar.close()
                self.finished.set_result(None)

        client._add_done_callbacks(futures, on_done)
        return self.finished
