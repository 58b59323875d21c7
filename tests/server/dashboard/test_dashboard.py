"""The HTTP endpoints over real sockets: what they answer, and whom.

A validating in-process Scheduler (and, for the worker's /metrics, a real Worker) with
hand-driven raw peers; requests go through tornado's HTTP client. Bad input (paths,
parameters, credentials, methods, Host headers) gets a clear 4xx and never harms the
scheduler: it keeps serving its peers, and no test may make it log an ERROR.
"""
import asyncio
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import time

import pytest
from server_helpers import fetch, metrics

from distributed_server import Security
from distributed_server.comm import connect
from distributed_server.scheduler.server import Scheduler
from distributed_server.security import SecurityError, new_token
from distributed_server.worker.server import Worker

pytestmark = pytest.mark.timeout(60)
LOCAL = "127.0.0.1:0"


@pytest.fixture(autouse=True)
def no_errors_logged(caplog):
    """Bad requests are the sender's fault: WARNING at most."""
    with caplog.at_level(logging.WARNING, logger="distributed_server"):
        yield
    errors = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.ERROR and (r.name.startswith("distributed_server")
                                                 or r.name.startswith("tornado"))]
    assert not errors, errors


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 45))


async def run_one_task(scheduler, key="inc-1", ok=True):
    """A raw worker and client; one task computed; both comms returned."""
    worker = await connect(scheduler.address, {
        "role": "worker", "nthreads": 2, "address": "tcp://127.0.0.1:1", "name": "w1"},
        security=scheduler.security)
    client = await connect(scheduler.address, {"role": "client", "client_id": "c1"},
                           security=scheduler.security)
    client.send({"op": "update-graph", "tasks": [{"key": key, "spec": b"S"}], "keys": [key]})
    while not any(m["op"] == "compute-task" for m in await worker.read()):
        pass
    if ok:
        worker.send({"op": "task-finished", "key": key, "nbytes": 28, "type": "int",
                     "start": 100.0, "stop": 100.5})
    else:
        worker.send({"op": "task-erred", "key": key, "exception": b"E", "traceback": b"T",
                     "text": "boom", "start": 100.0, "stop": 100.5})
    wanted = "key-in-memory" if ok else "task-erred"
    while not any(m["op"] == wanted for m in await client.read()):
        pass
    worker.send({"op": "heartbeat", "memory": 50_000_000, "managed": 28, "spilled": 7,
                 "spilled_count": 1, "paused": False, "cpu": 0.5})
    return worker, client


def test_status_json_metrics_and_task_stream_show_a_finished_task():
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            base = s.http.url
            assert s.dashboard_url == base + "/status"
            worker, client = await run_one_task(s)
            await asyncio.sleep(0.05)  # the heartbeat

            status = json.loads((await fetch(base + "/api/v1/status")).body)
            assert status["tasks"]["memory"] == 1 and status["cluster"]["tasks"] == 1
            assert status["prefixes"] == [{"name": "inc", "released": 0, "waiting": 0,
                                           "queued": 0, "no-worker": 0, "processing": 0,
                                           "memory": 1, "erred": 0}]
            (w,) = status["workers"]
            assert (w["address"], w["nthreads"], w["in_memory"], w["nbytes"]) == \
                ("tcp://127.0.0.1:1", 2, 1, 28)
            assert (w["memory"], w["spilled"], w["cpu"], w["paused"]) == \
                (50_000_000, 7, 0.5, False)
            assert status["server"]["graph_updates"] == 1
            assert status["server"]["graph_tasks"] == 1
            assert status["server"]["transitions"] == s.state.transition_counter

            stream = json.loads((await fetch(base + "/api/v1/task-stream")).body)
            assert stream == {"entries": [[0, "inc-1", "tcp://127.0.0.1:1", 100.0, 100.5,
                                           True, "inc"]], "next": 1, "skipped": 0}
            later = json.loads((await fetch(base + "/api/v1/task-stream?after=1")).body)
            assert later == {"entries": [], "next": 1, "skipped": 0}
            together = json.loads((await fetch(base + "/api/v1/status?stream_after=0")).body)
            assert together["stream"] == stream and together["tasks"]["memory"] == 1

            response = await fetch(base + "/metrics")
            assert response.code == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=")
            m = metrics(response.body.decode())
            assert m[("dcore_scheduler_tasks", (("state", "memory"),))] == 1
            assert m[("dcore_scheduler_tasks", (("state", "processing"),))] == 0
            assert m[("dcore_scheduler_prefix_tasks",
                      (("prefix", "inc"), ("state", "memory")))] == 1
            assert m[("dcore_scheduler_workers", ())] == 1
            assert m[("dcore_scheduler_threads", ())] == 2
            worker_label = (("worker", "tcp://127.0.0.1:1"),)
            assert m[("dcore_scheduler_worker_memory_bytes", worker_label)] == 50_000_000
            assert m[("dcore_scheduler_worker_spilled_bytes", worker_label)] == 7
            assert m[("dcore_scheduler_worker_paused", worker_label)] == 0
            assert m[("dcore_scheduler_transitions_total", ())] == s.state.transition_counter
            assert m[("dcore_scheduler_stimuli_total", ())] >= 4
            assert m[("dcore_scheduler_graph_intake_seconds_total", ())] > 0
            assert m[("dcore_scheduler_comm_received_bytes_total", ())] > 0
            assert m[("dcore_scheduler_comm_sent_bytes_total", ())] > 0
            assert ("dcore_scheduler_event_loop_lag_seconds", ()) in m
            lag = s.loop_lag
            assert m[("dcore_scheduler_event_loop_lag_probes_seconds_count", ())] == \
                m[("dcore_scheduler_event_loop_lag_probes_seconds_bucket",
                   (("le", "+Inf"),))] <= lag.count
            assert m[("dcore_scheduler_event_loop_lag_probes_seconds_bucket",
                      (("le", "0.1"),))] <= lag.count
            assert ("process_cpu_seconds_total", ()) in m  # the process collector
            await worker.close()
            await client.close()

    run(main())


def test_an_erred_task_is_in_the_stream_and_the_counts():
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            worker, client = await run_one_task(s, key="boom-2", ok=False)
            base = s.http.url
            status = json.loads((await fetch(base + "/api/v1/status")).body)
            assert status["tasks"]["erred"] == 1
            stream = json.loads((await fetch(base + "/api/v1/task-stream")).body)
            assert stream["entries"][0][5] is False and stream["entries"][0][6] == "boom"

    run(main())


def test_the_page_and_its_assets_come_from_the_package():
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            base = s.http.url
            root = await fetch(base + "/")
            assert root.code == 302 and root.headers["Location"] == "/status"
            page = await fetch(base + "/status")
            assert page.code == 200 and page.headers["Content-Type"].startswith("text/html")
            html = page.body.decode()
            assert "/static/status.js" in html and "http" not in html.split("<footer")[0]
            for name, kind in [("status.js", "text/javascript"), ("status.css", "text/css"),
                               ("favicon.svg", "image/svg+xml")]:
                asset = await fetch(f"{base}/static/{name}")
                assert asset.code == 200 and asset.headers["Content-Type"].startswith(kind)
                assert b"//cdn" not in asset.body and b"https://" not in asset.body
            health = await fetch(base + "/health")
            assert (health.code, health.body) == (200, b"ok\n")

    run(main())


@pytest.mark.parametrize("path, code", [
    ("/nope", 404), ("/static/secret.txt", 404), ("/static/../scheduler.py", 404),
    ("/static/%2e%2e%2fscheduler.py", 404), ("/api/v1/status/extra", 404),
    ("/api/v1/task-stream?after=abc", 400), ("/api/v1/task-stream?limit=-1", 400),
    ("/api/v1/task-stream?limit=10001", 400), ("/api/v1/task-stream?after=1e99", 400),
    ("/api/v1/task-stream?sample=2", 400), ("/api/v1/status?stream_after=-1", 400),
])
def test_bad_paths_and_parameters_get_a_clear_error(path, code):
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            response = await fetch(s.http.url + path)
            assert response.code == code, response.body
            assert response.body.decode().startswith(f"{code} ")
            assert "Traceback" not in response.body.decode()
            worker, client = await run_one_task(s)  # the scheduler still serves its peers

    run(main())


def test_only_get_and_head_exist():
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            for method in ("POST", "PUT", "DELETE"):
                response = await fetch(s.http.url + "/api/v1/status", method=method)
                assert response.code == 405
            with_body = await fetch(s.http.url + "/api/v1/status", method="POST", body=b"x")
            assert with_body.code == 400  # no request has a body
            head = await fetch(s.http.url + "/health", method="HEAD")
            assert head.code == 200

    run(main())


def test_without_credentials_only_a_loopback_host_header_is_served():
    """DNS rebinding: a page of evil.example cannot read a loopback dashboard."""
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            url = s.http.url + "/api/v1/status"
            for host in ("localhost:8787", "127.0.0.1", "[::1]:8787"):
                assert (await fetch(url, headers={"Host": host})).code == 200
            refused = await fetch(url, headers={"Host": "evil.example:8787"})
            assert refused.code == 403 and b"loopback" in refused.body

    run(main())


def test_a_cluster_token_is_required_and_a_link_token_sets_a_cookie():
    async def main():
        security = Security(token=new_token())
        async with Scheduler(validate=True, security=security, dashboard_address=LOCAL) as s:
            url = s.http.url + "/api/v1/status"
            dashboard_token = security.dashboard_token()
            assert dashboard_token != security.token

            missing = await fetch(url)
            assert missing.code == 403 and b"dashboard token" in missing.body
            for wrong in ("Bearer nope", f"Bearer {dashboard_token}x", "Basic abc"):
                assert (await fetch(url, headers={"Authorization": wrong})).code == 403
            assert (await fetch(url + "?token=nope")).code == 403
            for token in (dashboard_token, security.token):
                ok = await fetch(url, headers={"Authorization": f"Bearer {token}"})
                assert ok.code == 200
            assert (await fetch(s.http.url + "/metrics", headers={
                "Authorization": f"Bearer {dashboard_token}"})).code == 200
            assert (await fetch(s.http.url + "/nope")).code == 403  # credentials first
            assert (await fetch(s.http.url + "/health")).code == 200  # open to all

            linked = await fetch(f"{s.http.url}/status?token={security.token}")
            assert linked.code == 200
            cookie = linked.headers["Set-Cookie"]
            name = f"dcore-dashboard-{s.http.port}"
            assert cookie.startswith(f"{name}={dashboard_token};")  # never the cluster's
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
            with_cookie = await fetch(url, headers={"Cookie": f"{name}={dashboard_token}"})
            assert with_cookie.code == 200
            assert (await fetch(url, headers={"Cookie": f"{name}=nope"})).code == 403
            worker, client = await run_one_task(s)  # refusals harmed nothing

    run(main())


def _client_context(security, with_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=security.tls_ca_file)
    context.check_hostname = False
    if with_cert:
        context.load_cert_chain(security.tls_cert, security.tls_key)
    return context


def test_tls_serves_https_and_admits_a_ca_certificate_or_the_token():
    async def main():
        security = Security.temporary()
        async with Scheduler(validate=True, security=security, dashboard_address=LOCAL) as s:
            assert s.http.url.startswith("https://")
            url = s.http.url + "/api/v1/status"
            no_cert = _client_context(security, with_cert=False)
            refused = await fetch(url, ssl_options=no_cert)
            assert refused.code == 403
            by_token = await fetch(url, ssl_options=no_cert, headers={
                "Authorization": f"Bearer {security.dashboard_token()}"})
            assert by_token.code == 200
            by_cert = await fetch(url, ssl_options=_client_context(security, with_cert=True))
            assert by_cert.code == 200
            try:
                plain = await fetch(url.replace("https://", "http://"))
            except OSError:  # the server drops a plain-HTTP connection at once
                pass
            else:
                assert plain.code != 200

    run(main())


def test_tls_without_a_token_needs_a_certificate():
    async def main():
        security = Security.temporary(token=False)
        async with Scheduler(validate=True, security=security, dashboard_address=LOCAL) as s:
            url = s.http.url + "/api/v1/status"
            refused = await fetch(url, ssl_options=_client_context(security, False))
            assert refused.code == 403 and b"certificate" in refused.body
            admitted = await fetch(url, ssl_options=_client_context(security, True))
            assert admitted.code == 200

    run(main())


def test_no_http_server_unless_asked_and_none_beyond_loopback_without_credentials():
    async def main():
        async with Scheduler(validate=True) as s:
            assert s.http is None and s.dashboard_url is None
        with pytest.raises(SecurityError, match="without credentials"):
            Scheduler(dashboard_address="0.0.0.0:0")
        with pytest.raises(ValueError, match="port"):
            Scheduler(dashboard_address="127.0.0.1:http")

    run(main())


def test_a_busy_port_gives_way_to_a_free_one(caplog):
    async def main():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            async with Scheduler(validate=True, dashboard_address=f"127.0.0.1:{port}") as s:
                assert s.http.port not in (0, port)
                assert (await fetch(s.http.url + "/health")).code == 200
        assert f"port {port} is in use" in caplog.text

    run(main())


def test_a_worker_serves_its_metrics_and_the_scheduler_links_to_them():
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            async with Worker(s.address, nthreads=3, dashboard_address=LOCAL,
                              validate=True) as w:
                assert w.http.url.startswith("http://127.0.0.1:")
                response = await fetch(w.http.url + "/metrics")
                assert response.code == 200
                m = metrics(response.body.decode())
                assert m[("dcore_worker_threads", ())] == 3
                assert m[("dcore_worker_tasks", (("state", "executing"),))] == 0
                assert m[("dcore_worker_memory_bytes", ())] > 0
                assert ("dcore_worker_comm_sent_bytes_total", ()) in m
                assert (await fetch(w.http.url + "/nope")).code == 404
                status = json.loads((await fetch(s.http.url + "/api/v1/status")).body)
                assert status["workers"][0]["dashboard"] == w.http.url
            assert w.http is not None

    run(main())


def test_a_worker_handshake_with_a_bad_dashboard_url_is_refused():
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            bad = await connect(s.address, {
                "role": "worker", "nthreads": 1, "address": "tcp://127.0.0.1:1",
                "dashboard": "javascript:alert(1)"})
            msgs = await bad.read()
            assert msgs[0]["op"] == "error" and "dashboard" in msgs[0]["error"]
            assert not s.state.workers

    run(main())


def test_a_heartbeat_with_a_bad_cpu_figure_closes_that_worker_only():
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            worker, client = await run_one_task(s)
            worker.send({"op": "heartbeat", "cpu": float("nan")})
            while s.state.workers:
                await asyncio.sleep(0.01)
            status = json.loads((await fetch(s.http.url + "/api/v1/status")).body)
            assert status["workers"] == []

    run(main())


def test_dcore_prints_the_dashboard_and_the_dashboard_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(new_token())
    command = [sys.executable, "-m", "distributed_server.cli"]
    printed = subprocess.run(command + ["dashboard-token", "--token-file", str(token_file)],
                             capture_output=True, text=True, timeout=30)
    assert printed.stdout.strip() == \
        Security(token_file=str(token_file)).dashboard_token()
    proc = subprocess.Popen(command + ["scheduler", "--port", "0", "--dashboard-address",
                                       LOCAL, "--token-file", str(token_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().startswith("Scheduler at tcp://127.0.0.1:")
        line = proc.stdout.readline()
        assert line.startswith("Dashboard at http://127.0.0.1:") and line.strip().endswith(
            "/status")
    finally:
        proc.terminate()
        proc.wait(10)
    off = subprocess.Popen(command + ["scheduler", "--port", "0", "--no-dashboard"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert off.stdout.readline().startswith("Scheduler at ")
    finally:
        off.terminate()
        assert off.stdout.read() == ""
        off.wait(10)
    refused = subprocess.run(command + ["scheduler", "--dashboard-address", "0.0.0.0:0"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "without credentials" in refused.stderr


def test_every_asset_of_the_page_is_installed_with_the_package():
    """The page is served from the installed package (package data), never a CDN."""
    from distributed_server.dashboard.scheduler_app import STATIC_DIR, STATIC_FILES

    for name in STATIC_FILES:
        assert os.path.isfile(os.path.join(STATIC_DIR, name)), name


def test_the_lag_histogram_counts_each_probe_in_its_bucket():
    """/metrics's lag histogram: a probe 300 ms late is over ``le="0.1"``, one 7 s late
    only in ``+Inf``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from distributed_server.dashboard.prometheus import _loop_lag
    from distributed_server.diagnostics.loop_lag import LoopLagMonitor

    monitor = LoopLagMonitor()
    for lag in (0.001, 0.07, 0.1, 0.3, 7.0):
        monitor._note(lag)

    class Lag:
        def collect(self):
            yield from _loop_lag("p", monitor)

    registry = CollectorRegistry()
    registry.register(Lag())
    text = generate_latest(registry).decode()
    samples = {(s.name, s.labels.get("le")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    buckets = {le: samples[("p_event_loop_lag_probes_seconds_bucket", le)]
               for le in ("0.01", "0.05", "0.1", "0.25", "0.5", "5.0", "+Inf")}
    assert buckets == {"0.01": 1, "0.05": 1, "0.1": 3, "0.25": 3, "0.5": 4, "5.0": 4,
                       "+Inf": 5}
    assert samples[("p_event_loop_lag_probes_seconds_count", None)] == 5
    assert abs(samples[("p_event_loop_lag_probes_seconds_sum", None)] - 7.471) < 1e-9


def test_figures_read_the_cores_counters_without_walking_the_tasks():
    """With a core that keeps counters (prefix_counts), a status read touches no task."""
    from distributed_server.dashboard.figures import SchedulerFigures
    from distributed_server.diagnostics.loop_lag import LoopLagMonitor
    from distributed_server.diagnostics.task_stream import TaskStream

    class Untouchable(dict):
        def values(self):
            raise AssertionError("the figures walked the tasks")

        __iter__ = items = values

    class CountingCore:
        tasks = Untouchable({i: None for i in range(3)})
        workers = {}
        transition_counter = 7

        def task_counts(self):
            return {"memory": 2, "processing": 1}

        def prefix_counts(self):
            return {"inc": {"tasks": 3, "task_counts": {"memory": 2, "processing": 1}}}

    class FakeScheduler:
        state = CountingCore()
        address, worker_memory, worker_dashboards, client_comms = "tcp://x:1", {}, {}, {}
        loop_lag, task_stream = LoopLagMonitor(), TaskStream()
        n_stimuli = graph_updates = graph_tasks = 0
        graph_intake_seconds = 0.0

    status = SchedulerFigures(FakeScheduler()).status()
    assert status["tasks"]["memory"] == 2 and status["cluster"]["tasks"] == 3
    assert status["prefixes"] == [{"name": "inc", "released": 0, "waiting": 0, "queued": 0,
                                   "no-worker": 0, "processing": 1, "memory": 2, "erred": 0}]


def test_without_counters_a_walk_is_reused_for_a_hundred_times_its_cost():
    """A core without counters is walked, and the counts serve a while: however often
    the page and Prometheus read, walks cost the scheduler at most ~1%."""
    from distributed_server.dashboard import figures as figures_module
    from distributed_server.dashboard.figures import SchedulerFigures

    class Task:
        def __init__(self, state):
            self.state, self.prefix = state, type("P", (), {"name": "inc"})

    walks = []

    class CountedWalks(dict):
        def values(self):
            walks.append(1)
            time.sleep(0.01)  # a walk that takes 10 ms: reused for ~1 s
            return super().values()

    class OldCore:
        tasks = CountedWalks({i: Task("memory") for i in range(5)})

    class FakeScheduler:
        state = OldCore()

    figures = SchedulerFigures(FakeScheduler())
    totals, by_prefix = figures.task_counts()
    assert totals["memory"] == 5 and by_prefix == {"inc": {**dict.fromkeys(
        figures_module.PREFIX_STATES, 0), "memory": 5}}
    for _ in range(20):
        figures.task_counts()
    assert len(walks) == 1 and figures.counts_age < 1
    # Reused for WALK_REUSE times what the walk took (at least the 10 ms slept; more on a
    # loaded machine): then walked again.
    reuse = figures._walk_valid_until - figures._walked_at
    assert reuse >= 0.01 * figures_module.WALK_REUSE
    time.sleep(max(figures._walk_valid_until - time.monotonic(), 0) + 0.05)
    figures.task_counts()
    assert len(walks) == 2


def test_a_scrape_reformats_only_the_families_that_changed(monkeypatch):
    """Exposition.render answers what prometheus_client's generate_latest answers for the
    same registry, scrape after scrape, and formats only the families whose samples
    changed since the last scrape (the others' text is reused)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from distributed_server.dashboard import prometheus as prometheus_module

    figures = {"workers": 2, "tasks": {"memory": 5, "erred": 0}, "moves": 10}

    class Collector:
        def describe(self):
            return []

        def collect(self):
            yield GaugeMetricFamily("t_workers", "Workers", value=figures["workers"])
            tasks = GaugeMetricFamily("t_tasks", 'Tasks "by" state\\', labels=["state"])
            for state, n in figures["tasks"].items():
                tasks.add_metric([state], n)
            yield tasks
            yield CounterMetricFamily("t_moves", "Moves", value=figures["moves"])

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    exposition = prometheus_module.Exposition(registry)
    formatted = []
    real = prometheus_module.generate_latest
    monkeypatch.setattr(prometheus_module, "generate_latest",
                        lambda one: formatted.append(one.family.name) or real(one))

    assert exposition.render() == generate_latest(registry)
    assert formatted == ["t_workers", "t_tasks", "t_moves"]
    formatted.clear()
    assert exposition.render() == generate_latest(registry)
    assert formatted == []  # nothing changed: nothing formatted
    figures["moves"] = 11
    figures["tasks"]["erred"] = 1
    assert exposition.render() == generate_latest(registry)
    assert formatted == ["t_tasks", "t_moves"]
    formatted.clear()
    figures["tasks"] = {"memory": 5, "erred": 0, "waiting": 3}  # a new label value
    figures["workers"] = float("nan")
    assert exposition.render() == generate_latest(registry)
    assert exposition.render() == generate_latest(registry)
    assert formatted[:2] == ["t_workers", "t_tasks"] and "t_moves" not in formatted
    assert len(exposition._texts) == 3  # the last scrape's families, no more
