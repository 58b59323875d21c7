"""A worker's HTTP endpoints: ``/metrics`` (Prometheus) and ``/health``.

The worker calls `start_worker_http` once it listens for peers (with its
``dashboard_address``; ``dcore worker`` defaults to any free port on the worker's
host) and tells the scheduler the URL in its registration, so the status page links
to it. Same credentials as the worker's peer port. Metrics are read at scrape time
from the worker and its state machine (`prometheus.WorkerCollector`); an event-loop lag
probe runs while the server does.
"""
from __future__ import annotations

from ..diagnostics.loop_lag import LoopLagMonitor
from .http import BaseHandler, HttpServer, parse_http_address

__all__ = ["WorkerHttp", "start_worker_http"]


class _MetricsHandler(BaseHandler):
    def get(self) -> None:
        # prometheus_client is imported at the first scrape, not at start: a worker that
        # is never scraped keeps its memory (~1.3 MiB) for its results.
        from .prometheus import CONTENT_TYPE_LATEST, Exposition, WorkerCollector, registry_for

        state = self.settings["state"]
        if state.get("exposition") is None:
            state["exposition"] = Exposition(registry_for(
                WorkerCollector(state["worker"], state["loop_lag"])))
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(state["exposition"].render())


class _RootHandler(BaseHandler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish("distributed-core worker: /metrics, /health\n")


class WorkerHttp:
    """A worker's HTTP server and its loop-lag probe; ``url`` tells where it is."""

    def __init__(self, server: HttpServer, loop_lag: LoopLagMonitor) -> None:
        self.server = server
        self.loop_lag = loop_lag

    @property
    def url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:40123``."""
        return self.server.url

    async def stop(self) -> None:
        """Stop serving and probing."""
        self.loop_lag.stop()
        await self.server.stop()


async def start_worker_http(worker, address, insecure: bool = False) -> WorkerHttp:
    """Serve ``worker``'s metrics on ``address`` (``":0"``, ``"host:port"``; the host
    defaults to the worker's)."""
    host, port = parse_http_address(address, worker.host)
    loop_lag = LoopLagMonitor()
    settings = {"state": {"worker": worker, "loop_lag": loop_lag, "exposition": None}}
    server = HttpServer([(r"/", _RootHandler), (r"/metrics", _MetricsHandler)],
                        worker.security, host, port, insecure=insecure, role="worker",
                        fallback=False, settings=settings)
    await server.start()
    loop_lag.start()
    return WorkerHttp(server, loop_lag)
