"""progress(): a tqdm bar over futures and persisted collections, on a LocalCluster of
two worker processes (the task functions here are pickled by value: the workers cannot
import this module)."""
import asyncio
import io
import sys
import time

import cloudpickle
import pytest

from distributed_server import Client, futures_of, progress

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def slow(x, seconds=0.05):
    time.sleep(seconds)
    return x


def final_count(text: str) -> str:
    """The last "n/total" a tqdm bar drew."""
    return text.replace("\r", "\n").strip().splitlines()[-1].split("|")[2].split()[0]


def test_progress_blocks_until_every_future_is_done_and_shows_them_all(client):
    out = io.StringIO()
    futures = client.map(slow, range(30), pure=False)
    progress(futures, file=out)
    assert all(f.status == "finished" for f in futures)
    assert final_count(out.getvalue()) == "30/30"
    assert client.gather(futures) == list(range(30))


def test_progress_counts_a_key_once_however_many_futures_name_it(client):
    out = io.StringIO()
    a = client.submit(slow, 1, key="progress-same")
    progress([a, client.submit(slow, 1, key="progress-same"), {"x": a}], file=out)
    assert final_count(out.getvalue()) == "1/1"


def test_progress_moves_as_futures_finish_without_asking_the_scheduler(client):
    """The bar is driven by the futures' completion events: while it waits, the client
    sends the scheduler nothing."""
    futures = client.map(slow, range(10), [0.1] * 10, pure=False)
    client.scheduler_info()  # the graph has gone out
    sent = []
    conn = client._conn  # the scheduler connection: everything sent passes send_now
    original = conn.send_now
    conn.send_now = lambda msg: (sent.append(msg), original(msg))
    try:
        out = io.StringIO()
        progress(futures, file=out)
    finally:
        conn.send_now = original
    assert [msg for msg in sent if msg["op"] != "heartbeat"] == []
    counts = {line.split("|")[2].split()[0] for line in
              out.getvalue().replace("\r", "\n").splitlines() if line.count("|") == 2}
    assert len(counts) > 3  # drawn along the way, not only at the end


def test_progress_of_a_persisted_dask_collection_follows_its_pieces(client):
    da = pytest.importorskip("dask.array")
    x = client.persist(da.ones(100, chunks=10) + 1)
    assert len(futures_of(x)) == 10
    out = io.StringIO()
    progress(x, file=out, desc="array")
    assert final_count(out.getvalue()) == "10/10"
    assert out.getvalue().replace("\r", "\n").strip().splitlines()[-1].startswith("array")


def test_progress_of_an_unpersisted_collection_says_to_persist_it(client):
    da = pytest.importorskip("dask.array")
    with pytest.raises(ValueError, match=r"client.persist"):
        progress(da.ones(10, chunks=5))
    with pytest.raises(ValueError, match=r"needs futures"):
        progress([])


def test_progress_counts_failed_and_cancelled_keys_as_done_and_shows_the_failures(client):
    out = io.StringIO()
    ok = client.submit(slow, 1, pure=False)
    bad = client.submit(lambda: 1 / 0)
    gone = client.submit(slow, client.submit(slow, 2, 1, pure=False))
    gone.cancel()  # while it waits for its input
    progress([ok, bad, gone], file=out)
    last = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "3/3" in last and "erred=2" in last


def test_progress_gives_up_after_its_timeout(client):
    f = client.submit(slow, 1, 2, pure=False)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="1 of 1 keys not done after 0.3 s"):
        progress(f, timeout=0.3, file=io.StringIO())
    assert time.monotonic() - start < 5
    f.cancel()


def test_progress_refuses_futures_of_two_clients(cluster, client):
    with Client(cluster, set_as_default=False) as other:
        with pytest.raises(ValueError, match="different clients"):
            progress([client.submit(int, 1), other.submit(int, 2)])


def test_progress_with_an_asynchronous_client_returns_at_once_and_can_be_awaited(cluster):
    async def main():
        async with Client(cluster, asynchronous=True, set_as_default=False) as client:
            futures = client.map(slow, range(10), [0.1] * 10, pure=False)
            out = io.StringIO()
            start = time.monotonic()
            waiting = progress(futures, file=out)
            assert time.monotonic() - start < 0.1
            assert not all(f.done() for f in futures)
            await asyncio.wait_for(waiting, 30)
            assert all(f.done() for f in futures)
            assert final_count(out.getvalue()) == "10/10"
            with pytest.raises(TypeError, match="wait_for"):
                progress(futures, timeout=1)

    asyncio.run(asyncio.wait_for(main(), 60))
