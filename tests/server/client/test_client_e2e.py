"""The Client end to end: a real LocalCluster (a scheduler and two worker processes).

Task functions are defined here and pickled by value (`register_pickle_by_value`), since
the worker processes cannot import this test module. The slow-marked tests print the
client's throughput and round-trip figures (``pytest -m slow -s -k figures``).
"""
from __future__ import annotations

import asyncio
import gc
import sys
import time

import cloudpickle
import pytest
from server_helpers import wait_until_no_tasks, workers_of

from distributed_server.client.client import (
    FIRST_EXCEPTION,
    CancelledError,
    Client,
    as_completed,
    futures_of,
    wait,
)
from distributed_server.deploy.local_cluster import LocalCluster

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


def inc(x):
    return x + 1


def add(*args):
    return sum(args)


def noop(x):
    return x


def span(n):
    """A result too large to travel inline: it stays on its worker."""
    return list(range(n))


def total(*lists):
    return sum(len(x) for x in lists)


def slow(seconds):
    time.sleep(seconds)
    return seconds


def boom(x):
    raise ZeroDivisionError(f"boom {x}")


def flaky(path: str, failures: int):
    """Fail the first ``failures`` calls, counted in the file at ``path``."""
    with open(path, "a+") as f:
        f.seek(0)
        calls = len(f.read())
        f.write("x")
    if calls < failures:
        raise RuntimeError(f"failure {calls + 1}")
    return calls


class Counted:
    """A value that appends a byte to the file at ``path`` each time it is unpickled."""

    def __init__(self, path: str, payload: bytes) -> None:
        self.path = path
        self.payload = payload

    def __getstate__(self):
        return self.path, self.payload

    def __setstate__(self, state) -> None:
        self.path, self.payload = state
        with open(self.path, "ab") as f:
            f.write(b"x")


def scaled(x, const, extra=None):
    return x * len(const.payload) + (len(extra.payload) if extra else 0)


# ---------------------------------------------------------------- basics


def test_submit_map_gather(client):
    assert client.submit(inc, 1).result() == 2
    futures = client.map(inc, range(100))
    assert client.gather(futures) == list(range(1, 101))
    assert client.gather({"x": futures[0], "l": [futures[1]]}) == {"x": 1, "l": [2]}


def test_large_results_are_fetched_from_workers(client):
    futures = client.map(span, [100_000, 200_000])
    assert [len(x) for x in client.gather(futures)] == [100_000, 200_000]
    assert futures[0].result()[-1] == 99_999


def test_dependencies_across_two_workers(client):
    first, second = workers_of(client)
    x = client.submit(span, 50_000, workers=[first])
    y = client.submit(span, 70_000, workers=[second])
    z = client.submit(total, x, y)
    assert z.result() == 120_000
    who_has = client.who_has([x, y])
    assert who_has[x.key] == (first,) or first in who_has[x.key]
    assert second in who_has[y.key]


def test_restrictions_by_worker_address(client):
    for i, address in enumerate(workers_of(client)):
        futures = client.map(span, range(2000 + 100 * i, 2010 + 100 * i), workers=address)
        wait(futures)
        assert all(holders == (address,) for holders in client.who_has(futures).values())


def test_exception_with_remote_traceback(client):
    future = client.submit(boom, 3)
    with pytest.raises(ZeroDivisionError, match="boom 3") as info:
        future.result()
    assert "Remote traceback" in str(info.value.__cause__)
    assert "boom" in future.traceback()
    assert future.status == "error"
    with pytest.raises(ZeroDivisionError):
        client.submit(inc, future).result()


def test_retries(client, tmp_path):
    path = str(tmp_path / "calls")
    assert client.submit(flaky, path, 2, retries=2).result() == 2
    failing = client.submit(flaky, str(tmp_path / "other"), 3, retries=1)
    with pytest.raises(RuntimeError, match="failure 2"):
        failing.result()
    failing.retry()
    with pytest.raises(RuntimeError, match="failure 3"):
        failing.result()
    failing.retry()
    assert failing.result() == 3


def test_releasing_futures_leaves_no_tasks(client):
    futures = client.map(inc, range(500))
    big = client.submit(span, 100_000)
    dependent = client.submit(total, big)
    client.gather(futures + [dependent])
    del futures, big, dependent
    gc.collect()
    wait_until_no_tasks(client)


def test_map_decodes_a_shared_constant_once_per_worker_and_drops_it(client, tmp_path):
    """``map(f, xs, [const] * n, extra=big)``: each shared value is unpickled about
    once per worker process (not once per task), and nothing of it stays on the
    scheduler or the workers once the map's futures are released."""
    const_log, extra_log = tmp_path / "const", tmp_path / "extra"
    const = Counted(str(const_log), b"c" * 10_000)
    extra = Counted(str(extra_log), b"e" * 3_000)
    futures = client.map(scaled, range(60), [const] * 60, extra=extra, batch_size=7)
    assert client.gather(futures) == [x * 10_000 + 3_000 for x in range(60)]
    n_workers = len(client.scheduler_info()["workers"])
    for log in (const_log, extra_log):
        # once per worker that holds it, not once per task; a worker that dropped its
        # copy and is then given (stolen) tasks needing it fetches it again
        assert 1 <= len(log.read_bytes()) <= 2 * n_workers
    del futures
    gc.collect()
    wait_until_no_tasks(client)
    assert not any(client.has_what().values())


def test_cancel(client):
    future = client.submit(slow, 5, pure=False)
    time.sleep(0.1)
    future.cancel()
    assert future.status == "cancelled"
    with pytest.raises(CancelledError):
        future.result()
    wait_until_no_tasks(client)
    assert client.submit(inc, 10).result() == 11  # the worker is free again


def test_scatter_then_submit(client):
    [data] = client.scatter([list(range(10_000))])
    assert client.submit(total, data).result() == 10_000
    assert client.gather(data)[-1] == 9_999
    everywhere = client.scatter({"shared": 7}, broadcast=True)
    assert len(client.who_has(everywhere)["shared"]) == 2
    assert client.submit(inc, everywhere["shared"]).result() == 8


def test_get_of_a_dict_graph(client):
    graph = {"a": 1, "b": (inc, "a"), "c": (add, "a", "b", (inc, "b")), "d": ["a", "c"]}
    assert client.get(graph, ["c", ["d"]]) == [6, [[1, 6]]]
    assert client.get(graph, "b") == 2


def test_as_completed(client):
    futures = [client.submit(slow, s, pure=False) for s in (0.4, 0.0, 0.2)]
    seen = [f.result() for f in as_completed(futures)]
    assert sorted(seen) == [0.0, 0.2, 0.4] and seen[0] != 0.4
    results = [r for _, r in as_completed(client.map(inc, range(5)), with_results=True)]
    assert sorted(results) == [1, 2, 3, 4, 5]


def test_as_completed_in_batches_and_cleared(client):
    futures = client.map(inc, range(20))
    ac = as_completed(futures)
    batches = list(ac.batches())
    assert sorted(f.result() for batch in batches for f in batch) == list(range(1, 21))
    assert ac.is_empty() and ac.next_batch(block=False) == []
    slow_ones = [client.submit(slow, 5, pure=False) for _ in range(2)]
    ac = as_completed(slow_ones, with_results=True)
    assert not ac.is_empty() and ac.next_batch(block=False) == []
    ac.clear()
    assert ac.is_empty() and list(ac) == []
    ac.add(client.submit(inc, 41))
    assert [r for _, r in ac] == [42]
    client.cancel(slow_ones)


def test_wait_first_exception_returns_at_the_first_failure(client):
    slow_one = client.submit(slow, 30, pure=False)
    failing = client.submit(boom, 1)
    done, not_done = wait([slow_one, failing], timeout=20, return_when=FIRST_EXCEPTION)
    assert done == {failing} and not_done == {slow_one}
    slow_one.cancel()
    wait([slow_one], timeout=20)
    assert slow_one.cancelled() and not failing.cancelled()
    with pytest.raises(ValueError, match="return_when"):
        wait([failing], return_when="SOMETIMES")


def test_futures_of_finds_futures_in_containers_and_collections(client):
    a, b = client.map(inc, [1, 2])
    assert futures_of([a, (b, {"x": a}), {b}]) == [a, b]
    da = pytest.importorskip("dask.array")
    x = client.persist(da.ones(10, chunks=5))
    assert len(futures_of(x)) == 2 and all(f.result().shape == (5,) for f in futures_of(x))


def test_dask_submit_keywords_are_not_passed_to_the_function(client):
    assert client.submit(inc, 1, fifo_timeout="100 ms").result() == 2
    assert client.gather(client.map(inc, [1, 2], fifo_timeout=0)) == [2, 3]
    for call in (lambda: client.submit(inc, 1, actor=True),
                 lambda: client.map(inc, [1], actors=True)):
        with pytest.raises(NotImplementedError, match="actors are not supported"):
            call()


def pid_and(x, dask_worker=None):
    import os
    return os.getpid(), x, dask_worker.address


async def async_double(x):
    return 2 * x


def test_run_calls_a_function_once_in_every_worker_process(client):
    workers = workers_of(client)
    results = client.run(pid_and, 7)
    assert set(results) == set(workers)
    assert len({pid for pid, _, _ in results.values()}) == len(workers)
    assert all(x == 7 and address == w for w, (_, x, address) in results.items())
    assert client.run(async_double, 4, workers=[workers[0]]) == {workers[0]: 8}
    with pytest.raises(ZeroDivisionError, match="boom 3"):
        client.run(boom, 3)
    errors = client.run(boom, 3, on_error="return")
    assert all(isinstance(e, ZeroDivisionError) for e in errors.values())
    with pytest.raises(ValueError, match="no worker"):
        client.run(inc, 1, workers=["nobody"])
    assert client.run(inc, 1, wait=False) is None


def test_nthreads_and_has_what(client):
    workers = workers_of(client)
    assert client.nthreads() == dict.fromkeys(workers, 1)
    futures = client.map(span, [10_000, 10_001])  # large: they stay on their workers
    wait(futures)
    held = client.has_what()
    assert set(held) == set(workers)
    assert sorted(k for keys in held.values() for k in keys) == sorted(f.key for f in futures)
    one = workers[0]
    assert client.has_what([one]) == {one: held[one]}


def test_get_versions_names_every_process_and_checks_them(client):
    found = client.get_versions(check=True)
    assert set(found["workers"]) == set(workers_of(client))
    for info in [found["scheduler"], *found["workers"].values()]:
        assert info["python"] == found["client"]["python"]
        assert info["distributed-core"] == found["client"]["distributed-core"]


def test_versions_check_names_each_difference():
    from distributed_server.versions import check, versions
    mine = versions()
    other = {**mine, "cloudpickle": "0.0.1"}
    assert check(mine, mine, {"w1": mine}) == []
    assert check(mine, mine, {"w1": other}) == [
        f"cloudpickle: client {mine['cloudpickle']}, but w1: 0.0.1"]
    from distributed_server.versions import essential, mismatches
    assert mismatches(essential(), essential()) == [] and mismatches(essential(), None) == []
    assert mismatches(essential(), {**essential(), "python": "2.7"}) == [
        f"python: ours {mine['python']}, theirs 2.7"]


def test_sync_runs_a_coroutine_function_on_the_client_loop(client):
    async def twice(x, delay=0.0):
        await asyncio.sleep(delay)
        return 2 * x
    assert client.sync(twice, 21, delay=0.01) == 42


def test_upload_file_makes_a_module_importable_on_every_worker(client, tmp_path):
    module = tmp_path / "dcore_uploaded_mod.py"
    module.write_text("VALUE = 1\n")
    assert client.upload_file(str(module)) == dict.fromkeys(workers_of(client))

    def read_value():
        import dcore_uploaded_mod
        return dcore_uploaded_mod.VALUE
    assert client.submit(read_value, pure=False).result() == 1
    module.write_text("VALUE = 2\n")  # uploaded again: reloaded
    client.upload_file(str(module))
    assert set(client.run(read_value).values()) == {2}
    with pytest.raises(ValueError, match="upload_file takes"):
        client.upload_file(str(tmp_path / "data.csv"))


def append_line(path, text, delay):
    time.sleep(delay if isinstance(delay, float) else 0.0)
    with open(path, "a") as f:
        f.write(text + "\n")
    return text


def test_fire_and_forget_runs_to_completion_after_the_client_left(cluster, tmp_path):
    from distributed_server import fire_and_forget
    out = tmp_path / "side-effects.txt"
    with Client(cluster, set_as_default=False) as other:
        first = other.submit(append_line, str(out), "first", 1.0, pure=False)
        # Starts only once first is done, long after its client left: without
        # fire_and_forget the scheduler would have forgotten it by then.
        second = other.submit(append_line, str(out), "second", first, pure=False)
        fire_and_forget([first, {"x": second}])
    deadline = time.monotonic() + 30
    while (not out.exists() or len(out.read_text().split()) < 2) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text().split() == ["first", "second"]
    with Client(cluster, set_as_default=False) as probe:
        wait_until_no_tasks(probe)  # done, then forgotten: nothing is held for nobody


def test_dashboard_link_comes_from_the_local_cluster(cluster):
    with Client(cluster, set_as_default=False) as client:
        assert client.dashboard_link == cluster.dashboard_link
    with Client(cluster.scheduler_address, security=cluster.security,
                set_as_default=False) as client:
        assert client.dashboard_link is None


def test_async_client(cluster):
    async def main():
        async with Client(cluster.scheduler_address, asynchronous=True,
                          security=cluster.security) as client:
            assert await client.submit(inc, 1) == 2
            futures = client.map(inc, range(10))
            assert await client.gather(futures) == list(range(1, 11))
            async for future in as_completed(futures):
                assert future.done()
            assert (await client.scatter([5]))[0].key.startswith("int-")
            with pytest.raises(ZeroDivisionError):
                await client.submit(boom, 0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_client_starts_and_closes_its_own_cluster():
    with Client(n_workers=1) as client:
        assert client.submit(inc, 1).result() == 2
        cluster = client._cluster
        assert len(client.scheduler_info()["workers"]) == 1
    assert not cluster._procs  # every process was stopped


# ---------------------------------------------------------------- many tasks, one worker thread
# (throughput and round-trip times are measured by benchmarks/e2e.py, not here)


@pytest.mark.slow
def test_a_large_map_and_many_round_trips_return_every_result_and_leave_nothing_behind():
    """map(noop, range(20_000)) + gather three times on 1 worker x 1 thread, then 200
    submit().result(): every result comes back in order, and once the futures are gone
    the scheduler holds no task."""
    with LocalCluster(n_workers=1, threads_per_worker=1) as cluster, Client(cluster) as client:
        for _ in range(3):
            futures = client.map(noop, range(20_000), pure=False)
            assert client.gather(futures) == list(range(20_000))
            del futures
        assert [client.submit(inc, i).result() for i in range(200)] == \
            [inc(i) for i in range(200)]
        gc.collect()  # futures held by reference cycles of raised errors, if any
        wait_until_no_tasks(client, timeout=60)
