"""The scheduler's HTTP endpoints: the status page, its JSON API, ``/metrics``.

    /                      redirects to /status
    /status                the live status page (static HTML; its script polls the API)
    /static/NAME           the page's script, style sheet and icon, from this package
    /api/v1/status         the figures as JSON (figures.SchedulerFigures.status);
                           ?stream_after=N adds the task stream after N (sampled)
    /api/v1/task-stream    task outcomes after a sequence number: ?after=N&limit=M
    /metrics               Prometheus text format (prometheus.SchedulerCollector)
    /health                "ok" (open to all)
    /api/v1/adaptive_target, /api/v1/get_workers, /api/v1/check_idle,
    /api/v1/retire_workers the cluster API, which cluster managers (the dask-kubernetes
                           operator) scale the cluster with (cluster_api.py)

Every read is O(prefixes + workers) with the core's counters, plus O(entries returned)
for the task stream; only ``POST /api/v1/retire_workers`` changes the scheduler.
"""
from __future__ import annotations

import json
import logging
import math
import os

from tornado.web import HTTPError

from distributed_core import bounded_repr, key_prefix

from .cluster_api import CLUSTER_API_ROUTES
from .figures import SchedulerFigures
from .http import BaseHandler, HttpServer
from .prometheus import CONTENT_TYPE_LATEST, Exposition, SchedulerCollector, registry_for

__all__ = ["start_scheduler_http", "STATIC_FILES"]

logger = logging.getLogger("distributed_server.dashboard")

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
#: The files the page needs, each with its content type: nothing else is served.
STATIC_FILES = {
    "status.html": "text/html; charset=utf-8",
    "status.js": "text/javascript; charset=utf-8",
    "status.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
#: Most task-stream entries one request returns.
MAX_STREAM_LIMIT = 10_000
#: Characters of a key the task stream shows.
KEY_CHARS = 120


def _static(name: str) -> bytes:
    with open(os.path.join(STATIC_DIR, name), "rb") as f:
        return f.read()


class _JSONHandler(BaseHandler):
    def write_json(self, data) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data, separators=(",", ":"), allow_nan=False,
                               default=str))

    def int_argument(self, name: str, default: int, low: int, high: int) -> int:
        text = self.get_query_argument(name, None)
        if text is None:
            return default
        try:
            value = int(text)
        except ValueError:
            raise HTTPError(400, log_message=f"{name} must be a whole number") from None
        if not low <= value <= high:
            raise HTTPError(400, log_message=f"{name} must be from {low} to {high}")
        return value


class StatusJSONHandler(_JSONHandler):
    """``/api/v1/status``: the figures of the status page; with ``?stream_after=N``
    also ``"stream"``: the task stream after N, as ``/api/v1/task-stream?sample=1``
    answers it (``stream_limit``, default 100), so the page polls with one request."""

    def get(self) -> None:
        """The scheduler's figures as JSON."""
        status = _finite(self.settings["figures"].status())
        if self.get_query_argument("stream_after", None) is not None:
            after = self.int_argument("stream_after", 0, 0, 2**62)
            limit = self.int_argument("stream_limit", 100, 0, MAX_STREAM_LIMIT)
            status["stream"] = _stream_json(self.settings["task_stream"], after, limit, True)
        self.write_json(status)


class TaskStreamHandler(_JSONHandler):
    """``/api/v1/task-stream?after=N&limit=M[&sample=1]``: task outcomes numbered N or
    later (the newest M of them, at most 10,000, or with ``sample=1`` M spread evenly
    over them), with the number to ask for next."""

    def get(self) -> None:
        """``{"entries": [[seq, key, worker, start, stop, ok, prefix]...], "next": n,
        "skipped": n}``."""
        after = self.int_argument("after", 0, 0, 2**62)
        limit = self.int_argument("limit", 1000, 0, MAX_STREAM_LIMIT)
        sample = self.int_argument("sample", 0, 0, 1) == 1
        self.write_json(_stream_json(self.settings["task_stream"], after, limit, sample))


def _stream_json(stream, after: int, limit: int, sample: bool) -> dict:
    entries, next_seq, skipped = stream.after(after, limit, sample)
    prefix_of = _prefix_namer()
    rows = [[seq, _key_text(key), worker, start, stop, ok, prefix_of(key)]
            for seq, key, worker, start, stop, ok in entries]
    return {"entries": rows, "next": next_seq, "skipped": skipped}


class MetricsHandler(BaseHandler):
    """``/metrics``: Prometheus text format."""

    def get(self) -> None:
        """Every metric, read now."""
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(self.settings["exposition"].render())


class StaticHandler(BaseHandler):
    """The page and its assets, from the package (``/status`` and ``/static/NAME``)."""

    def get(self, name: str = "status.html") -> None:
        """One of STATIC_FILES, or 404."""
        content_type = STATIC_FILES.get(name)
        if content_type is None:
            raise HTTPError(404, log_message=f"no file {name[:100]!r}")
        cache = self.settings["static_cache"]
        body = cache.get(name)
        if body is None:
            body = cache[name] = _static(name)
        self.set_header("Content-Type", content_type)
        self.finish(body)


class RootHandler(BaseHandler):
    """``/``: redirects to the status page."""

    def get(self) -> None:
        """Redirect to /status (a token in the link has set the cookie by now)."""
        self.redirect("/status")


async def start_scheduler_http(scheduler, host: str, port: int, *,
                               insecure: bool = False, fallback: bool = True,
                               open_cluster_api: bool = False) -> HttpServer:
    """Start the scheduler's HTTP server on ``host:port``; returns it, started.

    ``open_cluster_api`` serves the cluster API's routes (cluster_api.py) without
    credentials, for the dask-kubernetes operator (logged at WARNING)."""
    figures = SchedulerFigures(scheduler)
    settings = {"figures": figures, "task_stream": scheduler.task_stream,
                "exposition": Exposition(registry_for(SchedulerCollector(figures))),
                "static_cache": {}, "adaptive": scheduler.adaptive}
    routes = [
        (r"/", RootHandler, None),
        (r"/status/?", StaticHandler, None),
        (r"/static/([a-z]+\.[a-z]+)", StaticHandler, None),
        (r"/api/v1/status", StatusJSONHandler, None),
        (r"/api/v1/task-stream", TaskStreamHandler, None),
        (r"/metrics", MetricsHandler, None),
        *((pattern, handler, None) for pattern, handler in CLUSTER_API_ROUTES),
    ]
    server = HttpServer([(pattern, handler) for pattern, handler, _ in routes],
                        scheduler.security, host, port, insecure=insecure,
                        role="scheduler", fallback=fallback, settings=settings,
                        open_cluster_api=open_cluster_api)
    await server.start()
    if open_cluster_api:
        logger.warning("the cluster API (%s/api/v1/adaptive_target, get_workers, check_idle, "
                       "retire_workers) is open without credentials (--open-cluster-api): "
                       "anyone who reaches this port can retire workers; keep it behind a "
                       "network policy", server.url)
    return server


def _prefix_namer():
    """``key -> prefix name`` for one request, remembering names it has seen."""
    seen: dict = {}

    def name(key):
        head = key[0] if isinstance(key, tuple) and key else key
        try:
            found = seen.get(head)
        except TypeError:
            return key_prefix(key)
        if found is None:
            found = seen[head] = key_prefix(key)
        return found

    return name


def _key_text(key) -> str:
    """A key as the page shows it: its text, or a bounded repr for other kinds."""
    if isinstance(key, str):
        return key if len(key) <= KEY_CHARS else key[:KEY_CHARS] + "…"
    return bounded_repr(key, KEY_CHARS)


def _finite(value):
    """NaN and infinities (a worker's odd figure) become None: JSON has neither."""
    if type(value) is float:
        return value if math.isfinite(value) else None
    if type(value) is dict:
        return {k: _finite(v) for k, v in value.items()}
    if type(value) is list:
        return [_finite(v) for v in value]
    return value
