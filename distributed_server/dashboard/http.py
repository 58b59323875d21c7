"""The HTTP server of one process (scheduler or worker): tornado's, with our rules.

`HttpServer` binds ``host:port`` (port 0: any free port; a busy port: a free one, with
a warning), serves HTTPS with the cluster's certificate under TLS, refuses to listen
beyond loopback without credentials (unless ``insecure``), and runs every request
through `HttpAuth` (`BaseHandler.prepare`). Reads are GET and HEAD; the one route that
changes the cluster (the scheduler's ``POST /api/v1/retire_workers``, cluster_api.py) is
a POST, and needs the cluster's own credential. An unknown path is a 404, a missing or
wrong credential a 403, a bad parameter a 400: plain-text answers that say why, never a
traceback. Requests are small and short: headers are capped at 16 KiB, bodies at 0
(the POST route raises its own limit), idle connections close after 60 s.

Successful requests are not logged (a page polls every second); refusals are logged a
few times per 10 s at most; a handler that raises is logged at ERROR (that is a bug).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time

from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from tornado.web import Application, HTTPError, RequestHandler

from ..logs import QuietLog
from ..security import Security, check_listen_security
from .auth import COOKIE_DAYS, HttpAuth

__all__ = ["BaseHandler", "HttpServer", "parse_http_address"]

logger = logging.getLogger("distributed_server.dashboard")
_refusal_log = QuietLog(logging.WARNING, log=logger)

#: The scheduler's dashboard port unless told otherwise.
DEFAULT_DASHBOARD_PORT = 8787
MAX_HEADER_BYTES = 16 * 1024
IDLE_CONNECTION_SECONDS = 60.0


def parse_http_address(address, default_host: str) -> tuple[str, int]:
    """``(host, port)`` of a dashboard address: ``8787``, ``":8787"``, ``"host:8787"``,
    ``"[::1]:8787"``, ``"http://host:8787"``; a missing host is ``default_host``.
    ValueError on anything else."""
    text = str(address).strip()
    for prefix in ("http://", "https://"):
        if text.startswith(prefix):
            text = text[len(prefix):].rstrip("/")
    if text.isdigit():
        host, port_text = "", text
    elif text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"dashboard address {address!r}: expected HOST:PORT or PORT")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"dashboard address {address!r}: the port must be 0-65535")
    return host or default_host, int(port_text)


class BaseHandler(RequestHandler):
    """A handler whose requests must pass `HttpAuth`; answers errors in plain text.

    Subclasses set ``open_to_all = True`` to skip the check (``/health``),
    ``cluster_api = True`` for a route of the cluster API (open to all when the server
    was started with ``open_cluster_api``), ``changes_cluster = True`` for a route that
    changes the cluster (it needs the cluster's own credential, not the dashboard's)."""

    open_to_all = False
    cluster_api = False
    changes_cluster = False

    def prepare(self) -> None:
        """Admit the request, or answer 403; a valid ``?token=`` sets the cookie."""
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Cache-Control", "no-store")
        if self.open_to_all:
            return
        auth: HttpAuth = self.settings["auth"]
        query_token = self.get_query_argument("token", None)
        cookie = self.get_cookie(auth.cookie_name)
        problem = auth.problem(self.request, query_token, cookie,
                               cluster_api=self.cluster_api, changes=self.changes_cluster)
        if problem is not None:
            _refusal_log("HTTP %s %s from %s refused: %s", self.request.method,
                         self.request.path[:100], self.request.remote_ip, problem)
            raise HTTPError(403, reason="Forbidden", log_message=problem)
        # (a route open to all must not turn any ?token= into a valid cookie)
        if query_token is not None and (auth.open or auth.valid(query_token)):
            self.set_cookie(auth.cookie_name, auth.cookie_value, path="/",
                            expires_days=COOKIE_DAYS, httponly=True, samesite="Strict",
                            secure=self.request.protocol == "https")

    def compute_etag(self) -> None:
        """No ETag: every answer is ``no-store``, so none would be revalidated, and
        tornado would hash each body for it (a SHA-1 per poll and per scrape)."""
        return None

    def write_error(self, status_code: int, **kwargs) -> None:
        """A one-line plain-text answer: the status and why (never a traceback)."""
        self.clear_header("Content-Type")
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        reason = self._reason
        exc_info = kwargs.get("exc_info")
        detail = ""
        if exc_info is not None and isinstance(exc_info[1], HTTPError):
            detail = exc_info[1].log_message or ""
        self.finish(f"{status_code} {reason}{': ' + detail if detail else ''}\n")

    def log_exception(self, typ, value, tb) -> None:
        """HTTPErrors are answers, not failures (refusals log themselves, rate-limited);
        anything else raised by a handler is a bug and logged at ERROR."""
        if not isinstance(value, HTTPError):
            super().log_exception(typ, value, tb)

    def data_received(self, chunk: bytes) -> None:  # pragma: no cover - bodies are refused
        """Bodies are not accepted (max_body_size is 0), but where a route says so."""


class NotFoundHandler(BaseHandler):
    """Every path no route names: 404 (after the credentials check, like every path)."""

    def get(self, *args) -> None:
        """Answer 404."""
        raise HTTPError(404, log_message=f"no page at {self.request.path[:100]!r}")

    head = get


class HealthHandler(BaseHandler):
    """``/health``: 200 "ok" while the event loop answers; open to all."""

    open_to_all = True

    def get(self) -> None:
        """Answer ok."""
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish("ok\n")

    head = get


def _log_request(handler: RequestHandler) -> None:
    """Only server errors (bugs) are logged per request; refusals log themselves."""
    status = handler.get_status()
    if status >= 500:
        logger.error("HTTP %d %s %s (%.1f ms)", status, handler.request.method,
                     handler.request.path[:100], 1000 * handler.request.request_time())


class HttpServer:
    """HTTP endpoints of one process: ``routes`` (tornado rules) plus ``/health``;
    ``settings`` reach the handlers as ``self.settings``.

    ``await start()`` binds and serves; ``url`` tells where (``https`` under TLS);
    ``await stop()`` closes the listener and every open connection.
    ``open_cluster_api`` admits the routes of the cluster API without credentials
    (`HttpAuth`).
    """

    def __init__(self, routes: list, security: Security, host: str, port: int, *,
                 insecure: bool = False, role: str = "dashboard",
                 fallback: bool = True, settings: dict | None = None,
                 open_cluster_api: bool = False) -> None:
        check_listen_security(host, security, insecure, f"{role} HTTP server")
        self.security = security
        self.host = host
        self.port = port
        self.role = role
        self.fallback = fallback
        self.routes = [(r"/health", HealthHandler), *routes]
        self.settings = dict(settings or {})  # for the handlers (self.settings[...])
        self.open_cluster_api = open_cluster_api
        self.started = 0.0
        self._server: HTTPServer | None = None

    @property
    def scheme(self) -> str:
        """``https`` under TLS, else ``http``."""
        return "https" if self.security.tls else "http"

    @property
    def url(self) -> str:
        """The server's root URL, e.g. ``http://127.0.0.1:8787``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]", ""):
            host = socket.gethostname()  # every interface: the machine's name
        return f"{self.scheme}://{host}:{self.port}"

    async def start(self) -> HttpServer:
        """Bind and serve. A busy port gives way to a free one, with a warning."""
        try:
            sockets = bind_sockets(self.port, self.host)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or not self.fallback or self.port == 0:
                raise
            sockets = bind_sockets(0, self.host)
            logger.warning("%s: port %d is in use (another cluster?); serving HTTP on port "
                           "%d instead", self.role, self.port, sockets[0].getsockname()[1])
        self.port = sockets[0].getsockname()[1]
        auth = HttpAuth(self.security, self.host, self.port,
                        open_cluster_api=self.open_cluster_api)
        app = Application(self.routes, **self.settings, auth=auth, default_handler_class=NotFoundHandler,
                          log_function=_log_request, compress_response=False,
                          xsrf_cookies=False, serve_traceback=False)
        self._server = HTTPServer(app, ssl_options=self.security.http_ssl_context(),
                                  max_header_size=MAX_HEADER_BYTES, max_body_size=0,
                                  idle_connection_timeout=IDLE_CONNECTION_SECONDS,
                                  body_timeout=10.0)
        self._server.add_sockets(sockets)
        self.started = time.time()
        logger.info("%s HTTP server at %s", self.role, self.url)
        return self

    async def stop(self) -> None:
        """Stop listening and close open connections."""
        if self._server is not None:
            self._server.stop()
            try:
                await asyncio.wait_for(self._server.close_all_connections(), 1.0)
            except asyncio.TimeoutError:
                pass
            self._server = None
