"""The event loop of a sync client: an asyncio loop (tornado's IOLoop runs on it) in a
daemon thread.

A sync `Client` runs every operation as a coroutine on this loop and blocks on it
(`ClientLoopThread.run`); an asynchronous client runs on its caller's loop instead and
has none. Interrupting the blocked caller (KeyboardInterrupt, a timeout) cancels the
coroutine.
"""
from __future__ import annotations

import asyncio
import threading

from .futures import CancelledError

__all__ = ["ClientLoopThread"]


class ClientLoopThread:
    """An asyncio event loop (tornado's IOLoop runs on it) in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.wait(tasks, timeout=1))
        self.loop.close()

    def run(self, coro, timeout: float | None = None):
        """Run ``coro`` on the loop and wait for its result (an interrupt cancels it)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except asyncio.CancelledError as e:
            # our CancelledError (concurrent.futures') that asyncio turned into its own
            # on the way out of run_coroutine_threadsafe: a cancelled key, not a cancelled call
            raise CancelledError(*e.args) from None
        except BaseException:
            future.cancel()
            raise

    def stop(self, timeout: float) -> None:
        """Stop the loop and wait up to ``timeout`` seconds for the thread to end."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            return
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
