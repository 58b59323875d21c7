"""Who may read the HTTP endpoints: the same cluster credentials as every other port.

A request is admitted when one of these holds (checked in this order):

- the cluster has no credentials at all (the server then listens on loopback only,
  unless told ``insecure``) and, on loopback, the ``Host`` header names a loopback host
  (``localhost``, 127.x.x.x, ::1): a web page elsewhere cannot read the dashboard
  through DNS rebinding;
- under TLS, the client presented a certificate of the cluster's CA (the TLS layer has
  checked it);
- the cluster has a token and the request carries it, or the dashboard token derived
  from it (`Security.dashboard_token`): ``Authorization: Bearer TOKEN``, a ``?token=``
  query parameter (which also sets an HttpOnly cookie, so a browser needs it once), or
  that cookie.

Everything else gets 403 with a sentence saying what is missing. ``/health`` is open to
all (it says only "ok"). Tokens are compared in constant time; a refused request changes
nothing on the server and is logged a few times per 10 s at most.

A request that changes the cluster (``POST /api/v1/retire_workers``, cluster_api.py)
needs more: the cluster's own credential, i.e. its token as ``Authorization: Bearer
TOKEN`` or, under TLS, a certificate of its CA. The dashboard token, a link's token and
the cookie only read. (A cluster without credentials on loopback: the Host rule alone.)

``open_cluster_api`` (``dcore scheduler --open-cluster-api``) admits the routes of the
cluster API (those the dask-kubernetes operator calls, which sends no credentials)
without any; every other route keeps the rules above. The Host rule still holds for a
cluster without credentials on loopback.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging

from ..security import Security, is_loopback

__all__ = ["HttpAuth"]

logger = logging.getLogger("distributed_server.dashboard")

#: Cookie lifetime: a browser that was given the token keeps it this long.
COOKIE_DAYS = 30


class HttpAuth:
    """Decides whether an HTTP request may read this server's endpoints, or change the
    cluster through them.

    ``host`` is the interface the server listens on and ``port`` its port (the cookie's
    name carries it, so two clusters on one host keep separate cookies).
    """

    def __init__(self, security: Security, host: str, port: int, *,
                 open_cluster_api: bool = False) -> None:
        self.security = security
        self.tokens = tuple(t for t in (security.dashboard_token(), security.token) if t)
        self.tls = security.tls
        self.check_host = not security.has_credentials and is_loopback(host)
        self.cookie_name = f"dcore-dashboard-{port}"
        #: The cluster API's routes need no credentials (`problem`'s ``cluster_api``).
        self.open_cluster_api = open_cluster_api

    @property
    def open(self) -> bool:
        """True if requests need no credentials (no token, no TLS)."""
        return not self.security.has_credentials

    def problem(self, request, query_token: str | None, cookie: str | None, *,
                cluster_api: bool = False, changes: bool = False) -> str | None:
        """Why ``request`` may not read (a sentence for the 403 page), or None.

        ``cluster_api``: the route is one of the cluster API's (open under
        ``open_cluster_api``); ``changes``: it changes the cluster, so it needs the
        cluster's own credential (`change_problem`)."""
        if self.open:
            if self.check_host and not _loopback_host_header(request.host):
                return ("this dashboard has no credentials and listens on loopback only: "
                        "open it as http://localhost:PORT or http://127.0.0.1:PORT")
            return None
        if cluster_api and self.open_cluster_api:
            return None
        if changes:
            return self.change_problem(request)
        if self.tls and request.get_ssl_certificate():
            return None  # the TLS layer verified it against the cluster's CA
        if not self.tokens:
            return ("present a certificate signed by the cluster's CA (this cluster has "
                    "TLS and no token)")
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and given:
            return None if self.valid(given.strip()) else "the bearer token is wrong"
        if query_token is not None:
            return None if self.valid(query_token) else "the token in the link is wrong"
        if cookie is not None and self.valid(cookie):
            return None
        return ("this dashboard needs the cluster's dashboard token: open the link the "
                "scheduler or LocalCluster.dashboard_link gives (…?token=…), send "
                "'Authorization: Bearer TOKEN', or use `dcore dashboard-token`")

    def change_problem(self, request) -> str | None:
        """Why ``request`` may not change the cluster, or None: it needs the cluster's
        token as a bearer token, or (under TLS) a certificate of the cluster's CA."""
        if self.tls and request.get_ssl_certificate():
            return None
        token = self.security.token
        if token is None:
            return ("this changes the cluster: present a certificate signed by the "
                    "cluster's CA")
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and given.strip():
            if hmac.compare_digest(given.strip().encode("utf-8", "replace"), token.encode()):
                return None
            return ("this changes the cluster: the bearer token is not the cluster's token "
                    "(the dashboard token only reads)")
        return ("this changes the cluster: send the cluster's token as 'Authorization: "
                "Bearer TOKEN' (the dashboard token only reads), or start the scheduler "
                "with --open-cluster-api behind a network policy")

    def valid(self, given: str) -> bool:
        """True if ``given`` is the cluster token or the dashboard token."""
        data = given.encode("utf-8", "replace")
        ok = False
        for token in self.tokens:
            ok |= hmac.compare_digest(data, token.encode())
        return ok

    @property
    def cookie_value(self) -> str:
        """What the cookie holds once a link's token was accepted: the dashboard token
        (never the cluster token, which could join the cluster)."""
        return self.security.dashboard_token() or ""


def _loopback_host_header(host_header: str) -> bool:
    """True if a Host header (``name[:port]``, ``[v6]:port``) names this machine."""
    host = host_header.strip()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
