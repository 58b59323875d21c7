"""`performance_report`: record a run and write it as one self-contained HTML file.

What this module does
---------------------
On entering, it asks the scheduler for its counters and its clock; on leaving, for the
task stream between then and now and the counters again, and writes the page
(`report_html.render`) to ``filename``. Times are the scheduler's and the workers'
clocks (those that ran the tasks), so the window is right even when the client's
machine keeps another time. The file is written even when the block raised, and the
exception goes on.

What it never does
------------------
It never polls during the run: two requests in all, one at each end.
"""
from __future__ import annotations

import os

from . import report_html
from .futures import default_client

__all__ = ["performance_report"]


class performance_report:
    """``with performance_report("report.html"):`` (``async with`` for an asynchronous
    client) records what the cluster ran inside the block and writes it to
    ``filename``: the task stream, per-prefix and per-worker time, and the scheduler's
    counters at the start and the end. ``client`` defaults to the default client.
    The task stream remembers the scheduler's last 100,000 tasks: a longer run keeps
    its latest ones. ``filename`` is the path written once the block ends."""

    def __init__(self, filename: str = "dcore-report.html", client=None,
                 title: str = "distributed-core performance report") -> None:
        self.filename = os.fspath(filename)
        self.client = client
        self.title = title
        self._before: dict | None = None

    def _client(self):
        return self.client if self.client is not None else default_client()

    def __enter__(self):
        client = self._client()
        if client.asynchronous:
            raise TypeError("use 'async with performance_report(...)' with an "
                            "asynchronous client")
        self.client = client
        self._before = client._sync(client._task_stream_and_counters, 0.0, 0.0)["counters"]
        return self

    def __exit__(self, *exc_info) -> None:
        after = self.client._sync(self.client._task_stream_and_counters,
                                  self._before["time"], None)
        self._write(after)

    async def __aenter__(self):
        self.client = self._client()
        self._before = (await self.client._task_stream_and_counters(0.0, 0.0))["counters"]
        return self

    async def __aexit__(self, *exc_info) -> None:
        after = await self.client._task_stream_and_counters(self._before["time"], None)
        self._write(after)

    def _write(self, after: dict) -> None:
        counters = after["counters"]
        page = report_html.render(after["tasks"], self._before, counters,
                                  self._before["time"], counters["time"], self.title)
        with open(self.filename, "w", encoding="utf-8") as file:
            file.write(page)
