"""The scheduler's side of a client's look back (`distributed_server.client.history`):
``Client.story``, ``get_scheduler_logs``, ``get_worker_logs`` and ``get_task_stream``.

`HistoryRequests` answers the client ops `OPS`; the ones that ask every worker (a story,
the workers' logs) ask them over their streams (`WorkerRequests`) in the background, so
the client's later messages are not held up, and name the workers that stayed silent.
Every answer is a ``reply {reqid, result}``, a malformed request a ``reply {reqid,
error}``.
"""
from __future__ import annotations

import math

from distributed_core import bounded_repr

from .. import logs
from ..protocol import stories

__all__ = ["OPS", "HistoryRequests", "story_keys"]

#: The client requests this module answers.
OPS = ("story", "scheduler-logs", "worker-logs", "task-stream")


class HistoryRequests:
    """Answers a `Scheduler`'s clients' story, logs and task-stream requests;
    ``worker_requests`` (`WorkerRequests`) carries what it asks the workers."""

    def __init__(self, scheduler, worker_requests) -> None:
        self.scheduler = scheduler
        self.worker_requests = worker_requests
        self._handlers = {"story": self._story, "scheduler-logs": self._scheduler_logs,
                          "worker-logs": self._worker_logs, "task-stream": self._task_stream}

    def handle(self, client_id: str, msg: dict) -> None:
        """Answer one client request (`OPS`)."""
        self._handlers[msg["op"]](client_id, msg)

    def _story(self, client_id: str, msg: dict) -> None:
        """``story {keys, timeout, reqid}``: the scheduler's transitions of these keys and
        every worker's, sorted by time; workers silent for ``timeout`` are named."""
        reqid = msg.get("reqid")
        try:
            keys = story_keys(msg.get("keys"))
            timeout = stories.check_timeout(msg.get("timeout", 5.0))
        except ValueError as exc:
            self.scheduler.reply_failure(client_id, reqid, f"story: {exc}")
            return
        entries = self.scheduler.state.story(*keys)
        self.scheduler.in_background(self._story_answer(client_id, reqid, keys, entries,
                                                         timeout))

    async def _story_answer(self, client_id: str, reqid, keys: list, entries: list,
                            timeout: float) -> None:
        answers, silent = await self.worker_requests.ask(
            dict(self.scheduler.worker_comms), {"op": "story", "keys": keys}, timeout)
        wanted = set(keys)
        checked = {}
        for address, answer in answers.items():
            try:
                checked[address] = stories.check_story_answer(answer, wanted)
            except ValueError as exc:
                silent[address] = f"a malformed answer: {exc}"
        story = stories.merge_stories(entries, checked)
        told = {entry[0] for entry in story}
        tasks = self.scheduler.state.tasks
        unknown = [key for key in keys if key not in told and key not in tasks]
        self.scheduler.reply(client_id, {"reqid": reqid},
                              {"story": story, "silent": silent, "unknown": unknown})

    def _scheduler_logs(self, client_id: str, msg: dict) -> None:
        """``scheduler-logs {n, reqid}``: this process's last ``n`` log lines."""
        try:
            n = logs.check_line_count(msg.get("n"))
        except ValueError as exc:
            self.scheduler.reply_failure(client_id, msg.get("reqid"), f"scheduler-logs: {exc}")
            return
        self.scheduler.reply(client_id, msg, logs.recent_lines(n))

    def _worker_logs(self, client_id: str, msg: dict) -> None:
        """``worker-logs {n, timeout, reqid}``: every worker's last ``n`` log lines;
        workers silent for ``timeout`` are named."""
        reqid = msg.get("reqid")
        try:
            n = logs.check_line_count(msg.get("n"))
            timeout = stories.check_timeout(msg.get("timeout", 5.0))
        except ValueError as exc:
            self.scheduler.reply_failure(client_id, reqid, f"worker-logs: {exc}")
            return
        self.scheduler.in_background(self._worker_logs_answer(client_id, reqid, n, timeout))

    async def _worker_logs_answer(self, client_id: str, reqid, n, timeout: float) -> None:
        answers, silent = await self.worker_requests.ask(
            dict(self.scheduler.worker_comms), {"op": "logs", "n": n}, timeout)
        lines = {}
        for address, answer in answers.items():
            try:
                lines[address] = stories.check_logs_answer(answer)
            except ValueError as exc:
                silent[address] = f"a malformed answer: {exc}"
        self.scheduler.reply(client_id, {"reqid": reqid}, {"logs": lines, "silent": silent})

    def _task_stream(self, client_id: str, msg: dict) -> None:
        """``task-stream {start, stop, reqid}``: the tasks that ran between the two times
        (None: unbounded), and the scheduler's counters now (`Scheduler.counters`)."""
        bounds = msg.get("start"), msg.get("stop")
        if not all(b is None or (type(b) in (int, float) and math.isfinite(b))
                   for b in bounds):
            self.scheduler.reply_failure(
                client_id, msg.get("reqid"), f"task-stream: start and stop must be None or "
                f"numbers, not {bounded_repr(bounds, 100)}")
            return
        tasks = [{"key": key, "worker": worker, "start": start, "stop": stop,
                  "status": "memory" if ok else "erred"}
                 for _, key, worker, start, stop, ok in self.scheduler.task_stream.window(*bounds)]
        self.scheduler.reply(client_id, msg, {"tasks": tasks,
                                               "counters": self.scheduler.counters()})


def story_keys(keys) -> list:
    """The keys of a story request: a list of 1 to MAX_STORY_KEYS hashable keys."""
    if not isinstance(keys, (list, tuple)) or not 0 < len(keys) <= stories.MAX_STORY_KEYS:
        raise ValueError(f"keys must be a list of 1 to {stories.MAX_STORY_KEYS} keys, "
                         f"not {bounded_repr(keys, 100)}")
    try:
        hash(tuple(keys))
    except TypeError:
        raise ValueError(f"keys must be hashable: {bounded_repr(keys, 100)}") from None
    return list(keys)
