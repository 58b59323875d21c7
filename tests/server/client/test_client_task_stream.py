"""Client.get_task_stream and performance_report on a LocalCluster of two worker
processes, and the report's HTML on its own (the scheduler's TaskStream itself:
test_task_stream.py)."""
import asyncio
import datetime
import re
import sys
import time

import cloudpickle
import pytest

from distributed_core import key_prefix
from distributed_server import Client, performance_report
from distributed_server.client.futures import SchedulerError
from distributed_server.client.report_html import render

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def nap(x, seconds=0.02):
    time.sleep(seconds)
    return x


def fail(x):
    raise ValueError(x)


# ---------------------------------------------------------------------------- the report's HTML


def test_the_report_groups_tasks_by_the_cores_key_prefix():
    # the dashboard's grouping (distributed_core.key_prefix), uuids of pure=False keys too
    keys = ["inc-5c3a9e0f12ab34cd", ("random_sample-b94844198fd102695bd4c4023526cb66", 7, 4),
            "work-2b66532a-49c4-4a05-8f1e-0c2d4e6f8a9b", "read-csv-2020-01-01", 12]
    tasks = [{"key": key, "worker": "tcp://w:1", "start": 1.0, "stop": 2.0,
              "status": "memory"} for key in keys]
    page = render(tasks, {"transitions": 0}, {"transitions": 7}, 0.0, 3.0)
    table = page[page.index("<h2>Tasks by prefix</h2>"):]
    assert sorted({key_prefix(key) for key in keys}) == [
        "inc", "int", "random_sample", "read-csv", "work"]
    for prefix in ("inc", "int", "random_sample", "read-csv", "work"):
        assert f"<td>{prefix}</td>" in table, prefix


def test_the_page_escapes_keys_and_needs_nothing_from_outside():
    tasks = [{"key": "<script>alert(1)</script>", "worker": "tcp://w:1", "start": 1.0,
              "stop": 2.0, "status": "memory"}]
    page = render(tasks, {"transitions": 0}, {"transitions": 7}, 0.0, 3.0)
    assert "<script" not in page and "&lt;script&gt;" in page
    assert not re.search(r"""(src|href)=|@import|url\(""", page)


# ---------------------------------------------------------------------------- from the client


def test_get_task_stream_lists_each_task_with_its_worker_and_times(client):
    before = time.time()
    futures = client.map(nap, range(20), pure=False)
    client.gather(futures)
    stream = client.get_task_stream(start=before)
    workers = set(client.scheduler_info()["workers"])
    mine = {f.key for f in futures}
    ours = [t for t in stream if t["key"] in mine]
    assert len(ours) == 20
    for task in ours:
        assert task["worker"] in workers and task["status"] == "memory"
        assert before - 1 <= task["start"] <= task["stop"] <= time.time() + 1
        assert task["stop"] - task["start"] >= 0.015
    assert {t["worker"] for t in ours} == workers  # both workers ran some


def test_get_task_stream_takes_a_window_by_times_or_datetimes(client):
    client.gather(client.map(nap, range(4), pure=False))
    middle = time.time()
    time.sleep(0.05)
    later = client.map(nap, range(4), pure=False)
    client.gather(later)
    after = client.get_task_stream(start=datetime.datetime.now() - datetime.timedelta(
        seconds=time.time() - middle))
    assert {t["key"] for t in after} == {f.key for f in later}
    assert all(t["stop"] <= middle for t in client.get_task_stream(stop=middle))


def test_failed_tasks_are_in_the_stream_as_erred(client):
    start = time.time()
    f = client.submit(fail, 1)
    assert isinstance(f.exception(), ValueError)
    (task,) = [t for t in client.get_task_stream(start) if t["key"] == f.key]
    assert task["status"] == "erred"


def test_bad_task_stream_bounds_are_clear_errors_and_harm_nothing(client):
    with pytest.raises(TypeError, match="start must be None, seconds"):
        client.get_task_stream(start="yesterday")
    with pytest.raises(ValueError, match="is after stop"):
        client.get_task_stream(start=10.0, stop=5.0)
    with pytest.raises(SchedulerError, match="task-stream: start and stop"):
        client._sync(lambda: client._request("task-stream", start="x", stop=None))
    assert client.submit(pow, 2, 4).result() == 16


def test_performance_report_writes_the_runs_tasks_and_counters(client, tmp_path):
    path = tmp_path / "report.html"
    client.gather(client.map(nap, range(5), key="before-the-report"))  # not in the report
    with performance_report(path, client=client):
        client.gather(client.map(nap, range(30), key="inside"))
        client.submit(fail, 1, key="failing-0123456789abcdef").exception()
    page = path.read_text()
    assert "<svg" in page and page.count("<rect") == 31
    assert re.search(r"<td>tasks run</td><td>31</td>", page)
    assert re.search(r"<td>tasks erred</td><td>1</td>", page)
    assert re.search(r"<tr><td>inside</td><td>30</td><td>0</td>", page)
    assert re.search(r"<tr><td>failing</td><td>1</td><td>1</td>", page)
    assert "before-the-report" not in page
    assert re.search(r"<td>scheduler transitions</td><td>\d+</td>", page)
    assert not re.search(r"""(src|href)=|@import|url\(""", page)  # self-contained


def test_performance_report_is_written_when_the_block_raises(client, tmp_path):
    path = tmp_path / "report.html"
    with pytest.raises(ZeroDivisionError):
        with performance_report(path, client=client):
            client.submit(nap, 1, pure=False).result()
            1 / 0
    assert "<td>tasks run</td><td>1</td>" in path.read_text()


def test_performance_report_with_an_asynchronous_client(cluster, tmp_path):
    path = tmp_path / "report.html"

    async def main():
        async with Client(cluster, asynchronous=True, set_as_default=False) as client:
            async with performance_report(path, client=client):
                await client.gather(client.map(nap, range(6), pure=False))
            with pytest.raises(TypeError, match="async with"):
                with performance_report(path, client=client):
                    pass

    asyncio.run(asyncio.wait_for(main(), 60))
    assert "<td>tasks run</td><td>6</td>" in path.read_text()
