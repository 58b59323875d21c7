"""The scheduler's cluster API: the HTTP routes a cluster manager drives it through.

The dask-kubernetes operator scales a cluster with these four routes, as dask's
scheduler serves them (same paths, same JSON):

    GET  /api/v1/adaptive_target  {"workers": n}: how many workers the work wants
    GET  /api/v1/get_workers      {"num_workers": n, "workers": [{"name", "address"}]}
    GET  /api/v1/check_idle       {"idle_since": seconds since the epoch, or null}
    POST /api/v1/retire_workers   body {"n": k} or {"workers": [address or name, ...]};
                                  {address: {"name": ..., ...}} of the workers retired

A retirement is graceful: the results only those workers hold move to the others
first, then the workers stay connected, taking no task, until whatever runs them stops
them (the operator deletes their pods). The answers come from the scheduler's
``adaptive`` object (`distributed_server.scheduler.adaptive.AdaptiveRequests`), passed in
the server's settings: this package never imports the scheduler's.

Who may call them (`HttpAuth`): the three reads follow the dashboard's rules; the
retirement changes the cluster, so it needs the cluster's own credential (its token as
``Authorization: Bearer TOKEN``, or a certificate of its CA), never the dashboard token,
a link's ``?token=`` or a cookie; its body must be ``Content-Type: application/json``, so
a web page cannot post one without the browser asking first. A scheduler started with
``open_cluster_api`` (``dcore scheduler --open-cluster-api``) serves all four without
credentials, since the operator sends none: only for a scheduler whose HTTP port a network
policy closes to all but the operator. A refused or malformed request (bad JSON, a bad
``n``, an unknown worker) changes nothing and gets a one-line 4xx answer.
"""
from __future__ import annotations

import json
import math

from tornado.web import HTTPError, stream_request_body

from .http import BaseHandler

__all__ = ["CLUSTER_API_ROUTES", "MAX_REQUEST_BYTES"]

#: Largest retirement request body accepted (a list of a few thousand addresses).
MAX_REQUEST_BYTES = 256 * 1024


class _ClusterAPIHandler(BaseHandler):
    """A route of the cluster API: open to all under ``open_cluster_api``."""

    cluster_api = True

    @property
    def adaptive(self):
        """The scheduler's `AdaptiveRequests`."""
        return self.settings["adaptive"]

    def write_json(self, data) -> None:
        """Answer ``data`` as JSON (NaN and infinities, which JSON lacks, as null)."""
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(_finite(data), separators=(",", ":"), allow_nan=False,
                               default=str))


class AdaptiveTargetHandler(_ClusterAPIHandler):
    """``GET /api/v1/adaptive_target``: the number of workers the work wants."""

    def get(self) -> None:
        """``{"workers": n}``."""
        self.write_json({"workers": self.adaptive.adaptive_target()})

    head = get


class GetWorkersHandler(_ClusterAPIHandler):
    """``GET /api/v1/get_workers``: the registered workers, by name and address."""

    def get(self) -> None:
        """``{"num_workers": n, "workers": [{"name", "address"}, ...]}``."""
        self.write_json(self.adaptive.workers())

    head = get


class CheckIdleHandler(_ClusterAPIHandler):
    """``GET /api/v1/check_idle``: since when no task has been left to run."""

    def get(self) -> None:
        """``{"idle_since": t}`` (the scheduler's ``time.time()``), or null while some
        task waits or runs."""
        self.write_json({"idle_since": self.adaptive.check_idle()})

    head = get


@stream_request_body
class RetireWorkersHandler(_ClusterAPIHandler):
    """``POST /api/v1/retire_workers``: retire ``n`` workers (those best let go) or the
    ``workers`` named, gracefully; needs the cluster's credential (`HttpAuth`). The only
    route that reads a body (up to `MAX_REQUEST_BYTES`; the server takes none)."""

    changes_cluster = True

    def prepare(self) -> None:
        """Admit the request (`BaseHandler.prepare`), then take a body."""
        super().prepare()
        self._chunks: list = []
        self._size = 0
        self.request.connection.set_max_body_size(MAX_REQUEST_BYTES)

    def data_received(self, chunk: bytes) -> None:
        """Keep the body (the connection refuses more than `MAX_REQUEST_BYTES`)."""
        self._size += len(chunk)
        if self._size <= MAX_REQUEST_BYTES:
            self._chunks.append(chunk)

    async def post(self) -> None:
        """``{address: {"name": ..., ...}}`` of the workers retired (``{}`` for none)."""
        n, workers = _retire_request(self.request.headers.get("Content-Type", ""),
                                     b"".join(self._chunks), self._size)
        try:
            retired = await self.adaptive.retire(n=n, workers=workers)
        except ValueError as exc:  # an unknown worker, a bad count: nothing was changed
            raise HTTPError(400, log_message=_one_line(exc)) from None
        self.write_json(retired)


def _retire_request(content_type: str, body: bytes, size: int) -> tuple:
    """``(n, workers)`` of a retirement request body, exactly one of them not None;
    HTTPError 415 or 400 with the reason otherwise."""
    if content_type.partition(";")[0].strip().lower() != "application/json":
        raise HTTPError(415, log_message="send the request as JSON, with "
                                         "'Content-Type: application/json'")
    if size > MAX_REQUEST_BYTES:
        raise HTTPError(413, log_message=f"the body is over {MAX_REQUEST_BYTES} bytes")
    try:
        params = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, log_message=f"the body is not JSON: {_one_line(exc)}") from None
    if not isinstance(params, dict):
        raise HTTPError(400, log_message='the body must be a JSON object: {"n": 2} or '
                                         '{"workers": [ADDRESS, ...]}')
    unknown = sorted(set(params) - {"n", "workers"})
    if unknown:
        raise HTTPError(400, log_message=f"unknown field {unknown[0][:60]!r}: give "
                                         "'n' or 'workers'")
    if ("n" in params) == ("workers" in params):
        raise HTTPError(400, log_message="give either 'n' (how many workers to retire) "
                                         "or 'workers' (which ones)")
    n = params.get("n")
    workers = params.get("workers")
    if "n" in params and (type(n) is not int or n < 0):
        raise HTTPError(400, log_message="n must be a whole number >= 0")
    if "workers" in params and not (isinstance(workers, list) and
                                    all(isinstance(w, (str, int)) for w in workers)):
        raise HTTPError(400, log_message="workers must be a list of worker addresses or "
                                         "names")
    return n, workers


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:200] + "…"


def _finite(value):
    """``value`` with NaN and infinities replaced by None, at any depth."""
    if type(value) is float:
        return value if math.isfinite(value) else None
    if type(value) is dict:
        return {k: _finite(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return [_finite(v) for v in value]
    return value


#: ``(pattern, handler)`` of every route of the cluster API.
CLUSTER_API_ROUTES = [
    (r"/api/v1/adaptive_target", AdaptiveTargetHandler),
    (r"/api/v1/get_workers", GetWorkersHandler),
    (r"/api/v1/check_idle", CheckIdleHandler),
    (r"/api/v1/retire_workers", RetireWorkersHandler),
]
