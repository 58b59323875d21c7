"""The Worker server over real loopback sockets, driven by a fake scheduler.

`FakeScheduler` plays the scheduler's side of docs/protocol.md: it listens with the
role "scheduler", sends compute-task / free-keys / close to the workers that register,
and records every frame and message they send back. Each test controls exactly what
the worker reads. Task functions live at module level so that specs pickle by
reference; `GATES` lets a test hold a task on its executor thread until it says so.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest

from distributed_server.comm import Blob, CommClosedError, connect, listen
from distributed_server.protocol.serialize import (
    Call,
    TaskRef,
    dumps_data,
    dumps_spec,
    loads_data,
    loads_error,
    sizeof,
)
from distributed_server.worker.server import Worker

pytestmark = pytest.mark.timeout(60)


def run(coro, timeout: float = 30):
    """Run one test coroutine on a fresh event loop, failing it after ``timeout`` s."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ---------------------------------------------------------------- task functions

GATES: dict = {}  # name -> threading.Event that a gated task waits for
CALLS: list = []  # (name, argument) appended by `record`, in execution order
_running = {"now": 0, "max": 0}
_running_lock = threading.Lock()


def noop():
    return None


def inc(x):
    return x + 1


def total_length(*parts):
    return sum(len(p) for p in parts)


def boom():
    raise ZeroDivisionError("boom on purpose")


def gated(name, value=None):
    """Wait (on the executor thread) until the test opens gate ``name``."""
    GATES[name].wait(10)
    CALLS.append((name, value))
    return value


def record(name, value=None):
    CALLS.append((name, value))
    return value


def exclusive(seconds):
    """Sleep, tracking how many of these run at once."""
    with _running_lock:
        _running["now"] += 1
        _running["max"] = max(_running["max"], _running["now"])
    time.sleep(seconds)
    with _running_lock:
        _running["now"] -= 1


@pytest.fixture(autouse=True)
def _clean_globals():
    GATES.clear()
    CALLS.clear()
    _running.update(now=0, max=0)
    yield
    for gate in GATES.values():  # never leave an executor thread waiting
        gate.set()


def gate(name: str) -> threading.Event:
    GATES[name] = threading.Event()
    return GATES[name]


# ---------------------------------------------------------------- fake scheduler


class FakeScheduler:
    """The scheduler's side of the protocol, scripted by the test."""

    def __init__(self) -> None:
        self.comms: dict = {}  # worker address -> Comm
        self.handshakes: list = []
        self.received: list = []  # every message from any worker, in order
        self.frames = 0
        self.listener = None
        self.address = ""

    async def start(self, port: int = 0) -> FakeScheduler:
        self.listener = await listen(f"tcp://127.0.0.1:{port}", self._serve,
                                     {"role": "scheduler", "compiled": False})
        self.address = self.listener.address
        return self

    async def _serve(self, comm) -> None:
        self.comms[comm.extra["address"]] = comm
        self.handshakes.append(comm.extra)
        try:
            while True:
                msgs = await comm.read()
                self.frames += 1
                self.received.extend(msgs)
        except CommClosedError:
            pass

    async def close(self) -> None:
        await self.listener.stop()
        for comm in self.comms.values():
            comm.abort()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def worker(self, **kwargs) -> Worker:
        """A started Worker registered with this fake scheduler."""
        kwargs.setdefault("connect_timeout", 2.0)
        worker = await Worker(self.address, **kwargs).start()
        await self.wait_for(lambda: worker.address in self.comms)
        return worker

    def send(self, worker: Worker, *msgs: dict) -> None:
        """Queue messages for ``worker`` on its batched stream."""
        for msg in msgs:
            self.comms[worker.address].send(msg)

    async def write(self, worker: Worker, msgs: list) -> None:
        """Send ``msgs`` to ``worker`` as one frame."""
        await self.comms[worker.address].write(msgs)

    def ops(self, op: str) -> list:
        return [m for m in self.received if m["op"] == op]

    def finished_keys(self) -> list:
        return [m["key"] for m in self.ops("task-finished")]

    async def wait_for(self, predicate, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; received: {self.received[-5:]!r}")
            await asyncio.sleep(0.005)


def compute(key, func, *args, priority=(0, 0, 0), who_has=None, resources=None) -> dict:
    msg = {"op": "compute-task", "key": key, "spec": dumps_spec(Call(func, args)),
           "priority": priority, "stimulus_id": "test"}
    if who_has is not None:
        msg["who_has"] = who_has
    if resources is not None:
        msg["resources"] = resources
    return msg


async def peer(worker: Worker, role: str = "client"):
    return await connect(worker.address, {"role": role}, timeout=5)


async def request(comm, msg: dict) -> dict:
    await comm.write([msg])
    (reply,) = await comm.read()
    return reply


# ---------------------------------------------------------------- registration


def test_worker_registers_with_its_listen_address_and_details():
    async def main():
        async with FakeScheduler() as s:
            w = await s.worker(nthreads=3, name="alice", resources={"GPU": 2})
            (info,) = s.handshakes
            assert info["role"] == "worker" and info["address"] == w.address
            assert (info["nthreads"], info["name"], info["resources"]) == (3, "alice", {"GPU": 2})
            assert w.address.startswith("tcp://127.0.0.1:")
            comm = await peer(w)
            assert comm.extra["role"] == "worker" and comm.extra["address"] == w.address
            comm.abort()
            await w.close()
            assert w.status == "closed"
    run(main())


# ---------------------------------------------------------------- running tasks


def test_runs_a_task_and_reports_it_with_the_result_inline():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            before = time.time()
            s.send(w, compute(("inc", 1), inc, 1))
            await s.wait_for(lambda: s.ops("task-finished"))
            (report,) = s.ops("task-finished")
            assert report["key"] == ("inc", 1)
            assert report["type"] == "int" and report["nbytes"] > 0
            assert pickle.loads(report["data"]) == 2
            assert before <= report["start"] <= report["stop"] <= time.time()
            assert w.data == {("inc", 1): 2}
    run(main())


def test_a_large_result_is_not_inlined():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            s.send(w, compute("big", bytes, 10_000))
            await s.wait_for(lambda: s.ops("task-finished"))
            (report,) = s.ops("task-finished")
            assert "data" not in report and report["type"] == "bytes"
            assert report["nbytes"] >= 10_000 and w.data["big"] == bytes(10_000)
    run(main())


def test_result_sizes_use_nbytes_or_dask_sizeof():
    np = pytest.importorskip("numpy")
    pd = pytest.importorskip("pandas")
    dask_sizeof = pytest.importorskip("dask.sizeof").sizeof
    assert sizeof(np.zeros(1000)) == 8000
    assert sizeof(7) == sys.getsizeof(7)
    frame = pd.DataFrame({"name": [f"n{i}" for i in range(5000)], "x": range(5000)})
    # dask samples object columns; sys.getsizeof would walk every string
    assert sizeof(frame) == dask_sizeof(frame) > 5000 * 8
    assert sizeof({"a": frame, "b": frame}) == dask_sizeof({"a": frame, "b": frame})


def test_pandas_results_are_sized_from_their_arrays_as_dask_sizes_them():
    np = pytest.importorskip("numpy")
    pd = pytest.importorskip("pandas")
    dask_sizeof = pytest.importorskip("dask.sizeof").sizeof
    backends = pytest.importorskip("dask.dataframe.backends")
    n = 3000
    frame = pd.DataFrame({
        "when": pd.date_range("2020", periods=n, freq="s"),
        "name": pd.array([f"name-{i % 50}" for i in range(n)], dtype="string[pyarrow]"),
        "id": np.arange(n), "x": np.random.random(n),
        "kind": pd.Categorical(["a", "b", "c"] * (n // 3))}).set_index("when")
    piece = frame.iloc[100:400]
    group = backends.ShuffleGroupResult({i: frame.iloc[i * 100:(i + 1) * 100] for i in range(5)})
    for value in (frame, piece, frame["x"], frame["name"], frame.index, group,
                  pd.DataFrame({"x": np.arange(10.0)}), pd.DataFrame()):
        ours, dasks = sizeof(value), dask_sizeof(value)
        # dask adds 1,200 bytes per run of same-dtype columns, this per block
        assert abs(ours - dasks) <= max(0.1 * dasks, 2400), (type(value), ours, dasks)
    # a slice counts its own rows, not the frame it views
    assert sizeof(piece) < sizeof(frame) / 5
    # object values are sampled, as dask does (not counted as 8-byte pointers)
    objects = pd.DataFrame({"o": [f"n{i}" for i in range(n)]}, dtype=object)
    python_strings = pd.DataFrame({"s": pd.array([f"s{i}" for i in range(n)],
                                                 dtype="string[python]")})
    for value in (objects, objects["o"], python_strings):
        ours, dasks = sizeof(value), dask_sizeof(value)
        assert ours > n * 40 and abs(ours - dasks) < 0.2 * dasks, (type(value), ours, dasks)


def test_a_task_that_raises_is_reported_with_its_exception():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            s.send(w, compute("bad", boom))
            await s.wait_for(lambda: s.ops("task-erred"))
            (report,) = s.ops("task-erred")
            assert report["key"] == "bad" and "boom on purpose" in report["text"]
            assert report["start"] <= report["stop"]
            exc = loads_error(report["exception"], report["traceback"], report["text"])
            assert isinstance(exc, ZeroDivisionError)
            assert "boom" in str(exc.__cause__)
            assert "bad" not in w.data
    run(main())


def test_many_tasks_are_reported_in_few_frames():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            frames_before = s.frames
            await s.write(w, [compute(i, noop) for i in range(1000)])
            await s.wait_for(lambda: len(s.ops("task-finished")) == 1000)
            assert sorted(s.finished_keys()) == list(range(1000))
            assert s.frames - frames_before < 100
    run(main())


def test_a_batch_queued_behind_a_busy_thread_runs_in_priority_order():
    async def main():
        async with FakeScheduler() as s, await s.worker(nthreads=1) as w:
            blocker = gate("blocker")
            s.send(w, compute("blocker", gated, "blocker"))
            await s.wait_for(lambda: len(w.state.tasks) == 1)
            order = [5, 2, 8, 0, 9, 1, 7, 3, 6, 4]
            await s.write(w, [compute(f"t{p}", record, "t", p, priority=(0, 0, p))
                              for p in order])
            await s.wait_for(lambda: len(w.state.tasks) == 11)
            blocker.set()
            await s.wait_for(lambda: len(s.ops("task-finished")) == 11)
            assert [v for name, v in CALLS if name == "t"] == sorted(order)
    run(main())


def test_a_late_high_priority_task_overtakes_a_long_backlog():
    async def main():
        async with FakeScheduler() as s, await s.worker(nthreads=1) as w:
            blocker = gate("blocker")
            s.send(w, compute("blocker", gated, "blocker"))
            await s.write(w, [compute(f"low-{i}", record, "low", i, priority=(0, 0, 10 + i))
                              for i in range(500)])
            await s.write(w, [compute("urgent", record, "urgent", priority=(-1, 0, 0))])
            await s.wait_for(lambda: len(w.state.tasks) == 502)
            blocker.set()
            await s.wait_for(lambda: len(s.ops("task-finished")) == 502)
            names = [name for name, _ in CALLS]
            # only the prefetched jobs were already queued on the thread before it
            assert names.index("urgent") <= 1 + w.state.prefetch
            assert names.index("urgent") < 500 // 2
    run(main())


def test_resources_limit_how_many_tasks_run_at_once():
    async def main():
        async with (FakeScheduler() as s,
                    await s.worker(nthreads=4, resources={"GPU": 1}) as w):
                await s.write(w, [compute(f"g{i}", exclusive, 0.05, resources={"GPU": 1})
                                  for i in range(5)])
                await s.wait_for(lambda: len(s.ops("task-finished")) == 5)
                assert _running["max"] == 1
                # without restrictions the same tasks run side by side
                await s.write(w, [compute(f"f{i}", exclusive, 0.2) for i in range(4)])
                await s.wait_for(lambda: len(s.ops("task-finished")) == 9)
                assert _running["max"] > 1
    run(main())


def test_a_paused_worker_starts_no_task_until_unpaused():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            w.pause()
            s.send(w, compute("a", inc, 1))
            await s.wait_for(lambda: "a" in w.state.tasks)
            await asyncio.sleep(0.1)
            assert not s.ops("task-finished") and w.state.tasks["a"].state == "ready"
            w.unpause()
            await s.wait_for(lambda: s.ops("task-finished"))
            assert w.data == {"a": 2}
    run(main())


# ---------------------------------------------------------------- dependencies


def test_dependencies_are_fetched_from_the_worker_that_holds_them():
    async def main():
        async with FakeScheduler() as s, await s.worker() as a, await s.worker() as b:
            # large enough for its pickle buffer to travel out of band
            s.send(a, compute("x", bytes, 200_000), compute("y", bytes, 10))
            await s.wait_for(lambda: len(s.ops("task-finished")) == 2)
            who_has = {"x": [a.address], "y": [a.address]}
            s.send(b, compute_call("z", Call(total_length, (TaskRef("x"), TaskRef("y"))),
                                   who_has))
            await s.wait_for(lambda: "z" in s.finished_keys())
            assert b.data == {"z": 200_010}  # the fetched copies are dropped
            assert set(a.data) == {"x", "y"}
            assert not s.ops("missing-data") and not s.ops("reschedule")
    run(main())


def compute_call(key, call, who_has):
    """A compute-task whose spec is a ready-made Call (dependencies via TaskRef)."""
    return {"op": "compute-task", "key": key, "spec": dumps_spec(call),
            "priority": (0, 0, 0), "who_has": who_has, "stimulus_id": "test"}


def test_deps_of_one_burst_share_one_request_per_peer():
    async def main():
        async with FakeScheduler() as s, await s.worker() as a, await s.worker() as b:
            s.send(a, *(compute(f"x{i}", bytes, i) for i in range(20)))
            await s.wait_for(lambda: len(s.ops("task-finished")) == 20)
            requests = []
            original = a.peers.get_data
            a.peers.get_data = lambda msg: requests.append(msg) or original(msg)
            await s.write(b, [
                compute_call(f"z{i}", Call(total_length, (TaskRef(f"x{i}"),)),
                             {f"x{i}": [a.address]})
                for i in range(20)])
            await s.wait_for(lambda: len(s.ops("task-finished")) == 40)
            assert len(requests) == 1 and len(requests[0]["keys"]) == 20
            assert b.data == {f"z{i}": i for i in range(20)}
    run(main())


def test_a_fetched_copy_lives_as_long_as_a_pending_task_needs_it():
    async def main():
        async with FakeScheduler() as s, await s.worker() as a, await s.worker(nthreads=2) as b:
            s.send(a, compute("x", inc, 1))
            await s.wait_for(lambda: s.ops("task-finished"))
            g = gate("z2")
            s.send(b, compute_call("z1", Call(inc, (TaskRef("x"),)), {"x": [a.address]}),
                   compute_call("z2", Call(gated, ("z2", TaskRef("x"))), {"x": [a.address]}))
            await s.wait_for(lambda: "z1" in s.finished_keys())
            assert b.data == {"z1": 3, "x": 2}  # z2 still needs x
            g.set()
            await s.wait_for(lambda: "z2" in s.finished_keys())
            assert b.data == {"z1": 3, "z2": 2}
            # asked to compute a key it holds only as a copy, it reports the copy and keeps it
            g = gate("z3")
            s.send(b, compute_call("z3", Call(gated, ("z3", TaskRef("x"))), {"x": [a.address]}))
            await s.wait_for(lambda: "x" in b.data)
            s.send(b, compute("x", inc, 1))
            await s.wait_for(lambda: s.finished_keys().count("x") == 2)
            g.set()
            await s.wait_for(lambda: "z3" in s.finished_keys())
            assert b.data == {"z1": 3, "z2": 2, "z3": 2, "x": 2}
            assert CALLS == [("z2", 2), ("z3", 2)]
    run(main())


def test_a_failing_holder_is_replaced_by_the_next_one():
    async def main():
        async with (FakeScheduler() as s, await s.worker() as a,
                    await s.worker(connect_timeout=0.2) as b):
                s.send(a, compute("x", inc, 1))
                await s.wait_for(lambda: s.ops("task-finished"))
                dead = await listen("tcp://127.0.0.1:0", lambda comm: None, {})
                dead_address = dead.address
                await dead.stop()
                s.send(b, compute_call("z", Call(inc, (TaskRef("x"),)),
                                       {"x": [dead_address, a.address]}))
                await s.wait_for(lambda: "z" in s.finished_keys())
                assert b.data == {"z": 3}
                assert not s.ops("missing-data") and not s.ops("reschedule")
    run(main())


def test_a_dependency_nobody_has_is_reported_missing_and_the_task_given_back():
    async def main():
        async with FakeScheduler() as s, await s.worker() as a, await s.worker() as b:
            s.send(b, compute_call("z", Call(inc, (TaskRef("x"),)), {"x": [a.address]}))
            await s.wait_for(lambda: s.ops("reschedule"))
            assert s.ops("missing-data") == [
                {"op": "missing-data", "key": "x", "errant_worker": a.address}]
            assert s.ops("reschedule") == [{"op": "reschedule", "key": "z"}]
            assert not s.ops("task-finished") and not b.state.tasks and not b.data
            # the same key can be sent again later and then runs
            s.send(a, compute("x", inc, 1))
            await s.wait_for(lambda: "x" in s.finished_keys())
            s.send(b, compute_call("z", Call(inc, (TaskRef("x"),)), {"x": [a.address]}))
            await s.wait_for(lambda: "z" in s.finished_keys())
            assert b.data == {"z": 3}
    run(main())


# ---------------------------------------------------------------- free-keys


def test_free_keys_drops_data():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            s.send(w, compute("a", inc, 1), compute("b", inc, 2))
            await s.wait_for(lambda: len(s.ops("task-finished")) == 2)
            s.send(w, {"op": "free-keys", "keys": ["a", "never-heard-of"],
                       "stimulus_id": "test"})
            await s.wait_for(lambda: "a" not in w.data)
            assert w.data == {"b": 3}
    run(main())


def test_free_keys_forgets_queued_tasks():
    async def main():
        async with FakeScheduler() as s, await s.worker(nthreads=1) as w:
            blocker = gate("blocker")
            s.send(w, compute("blocker", gated, "blocker"))
            await s.write(w, [compute(f"q{i}", record, "q", i) for i in range(200)])
            await s.write(w, [{"op": "free-keys", "keys": [f"q{i}" for i in range(200)],
                               "stimulus_id": "test"}])
            # the prefetched ones are on the thread's queue: cancelled, not forgotten
            await s.wait_for(lambda: len(w.state.tasks) == w.state.prefetch)
            assert w.state.task_counts()["cancelled"] == w.state.prefetch - 1
            blocker.set()
            await s.wait_for(lambda: s.finished_keys() == ["blocker"])
            await s.wait_for(lambda: list(w.state.tasks) == ["blocker"])
            await asyncio.sleep(0.05)
            assert s.finished_keys() == ["blocker"]
            assert not [c for c in CALLS if c[0] == "q"]
            assert w.data == {"blocker": None}
    run(main())


def test_free_keys_during_execution_discards_the_result():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            g = gate("slow")
            s.send(w, compute("slow", gated, "slow", 42))
            await s.wait_for(lambda: len(w.state.tasks) == 1)
            await asyncio.sleep(0.02)  # let it start executing
            s.send(w, {"op": "free-keys", "keys": ["slow"], "stimulus_id": "test"})
            await s.wait_for(lambda: w.state.tasks["slow"].state == "cancelled")
            g.set()
            await s.wait_for(lambda: not w.state.tasks)
            s.send(w, compute("after", inc, 1))
            await s.wait_for(lambda: s.ops("task-finished"))
            assert s.finished_keys() == ["after"]
            assert "slow" not in w.data and CALLS == [("slow", 42)]
    run(main())


def test_compute_task_after_free_keys_adopts_the_running_execution():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            g = gate("slow")
            s.send(w, compute("slow", gated, "slow", 42))
            await s.wait_for(lambda: len(w.state.tasks) == 1)
            await asyncio.sleep(0.02)
            s.send(w, {"op": "free-keys", "keys": ["slow"], "stimulus_id": "test"})
            await s.wait_for(lambda: w.state.tasks["slow"].state == "cancelled")
            s.send(w, compute("slow", gated, "slow", 42))
            await s.wait_for(lambda: w.state.tasks["slow"].state == "executing")
            g.set()
            await s.wait_for(lambda: s.ops("task-finished"))
            assert s.finished_keys() == ["slow"] and w.data == {"slow": 42}
            assert CALLS == [("slow", 42)]  # ran once
    run(main())


def test_compute_task_for_a_key_held_reports_it_without_running_again():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            s.send(w, compute("r", record, "r", 7))
            await s.wait_for(lambda: s.ops("task-finished"))
            s.send(w, compute("r", record, "r", 7))
            await s.wait_for(lambda: len(s.ops("task-finished")) == 2)
            assert CALLS == [("r", 7)]
            assert pickle.loads(s.ops("task-finished")[1]["data"]) == 7
    run(main())


def test_a_duplicate_compute_task_runs_once():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            g = gate("d")
            s.send(w, compute("d", gated, "d", 1))
            await s.wait_for(lambda: len(w.state.tasks) == 1)
            s.send(w, compute("d", gated, "d", 1))
            await asyncio.sleep(0.05)
            g.set()
            await s.wait_for(lambda: s.ops("task-finished"))
            await asyncio.sleep(0.05)
            assert s.finished_keys() == ["d"] and CALLS == [("d", 1)]
    run(main())


# ---------------------------------------------------------------- heartbeats, peers


def test_heartbeats_arrive_on_the_batched_stream():
    async def main():
        async with FakeScheduler() as s, await s.worker(heartbeat_interval=0.05):
            await s.wait_for(lambda: len(s.ops("heartbeat")) >= 3, timeout=5)
    run(main())


def test_a_worker_beats_slower_when_the_scheduler_of_a_big_cluster_asks():
    """The scheduler's answer may carry ``interval``: the worker then beats at the
    slower of its own interval and that one (and back at its own without it); a
    malformed interval is ignored."""
    async def main():
        async with FakeScheduler() as s, await s.worker(heartbeat_interval=0.05) as w:
            await s.wait_for(lambda: len(s.ops("heartbeat")) >= 2, timeout=5)
            s.send(w, {"op": "heartbeat", "interval": 0.6})
            await s.wait_for(lambda: w._advised_interval == 0.6, timeout=5)
            await asyncio.sleep(0.1)  # the beat already timed at 0.05 s goes out
            before = len(s.ops("heartbeat"))
            await asyncio.sleep(1.0)
            assert len(s.ops("heartbeat")) - before <= 3  # ~1 at 0.6 s, not ~20
            for bad in (-1, "2", 1e9, True):
                s.send(w, {"op": "heartbeat", "interval": bad})
            s.send(w, {"op": "heartbeat"})  # a small cluster again: our own interval
            await s.wait_for(lambda: w._advised_interval is None, timeout=5)
            await asyncio.sleep(0.7)
            before = len(s.ops("heartbeat"))
            await asyncio.sleep(0.5)
            assert len(s.ops("heartbeat")) - before >= 4
    run(main())


def test_an_advised_heartbeat_stays_well_inside_the_workers_scheduler_timeout():
    """A worker that counts the scheduler lost after 2 s of silence beats at least every
    0.5 s, whatever the scheduler asks: its answers are the worker's proof of life."""
    async def main():
        async with FakeScheduler() as s, \
                await s.worker(heartbeat_interval=0.05, scheduler_timeout=2.0) as w:
            s.send(w, {"op": "heartbeat", "interval": 10.0})
            await s.wait_for(lambda: w._advised_interval is not None, timeout=5)
            assert w._advised_interval == 0.5
    run(main())


def test_the_scheduler_asks_for_slower_heartbeats_only_of_a_big_cluster():
    from distributed_server.scheduler.worker_info import (
        MAX_HEARTBEAT_SECONDS,
        heartbeat_advice,
    )

    assert heartbeat_advice(1) is None and heartbeat_advice(100) is None
    assert heartbeat_advice(1000) == 10.0
    assert heartbeat_advice(10**6) == MAX_HEARTBEAT_SECONDS


def test_peers_can_put_get_and_ping():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            comm = await peer(w)
            frames = [Blob(f) for f in dumps_data(b"z" * 100_000)]
            reply = await request(comm, {"op": "put-data", "data": {("k", 1): frames}})
            assert reply == {"op": "ok"}
            assert w.data[("k", 1)] == b"z" * 100_000
            reply = await request(comm, {"op": "get-data", "keys": [("k", 1), "nope"]})
            assert reply["op"] == "data" and reply["missing"] == ("nope",)
            assert loads_data(reply["data"][("k", 1)]) == b"z" * 100_000
            assert await request(comm, {"op": "ping"}) == {"op": "pong"}
            comm.abort()
    run(main())


def test_only_clients_may_put_data_on_a_worker():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            comm = await peer(w, role="worker")
            frames = [Blob(f) for f in dumps_data(b"forged")]
            await comm.write([{"op": "put-data", "data": {"k": frames}}])
            with pytest.raises(CommClosedError):
                await comm.read()
            assert "k" not in w.data
    run(main())


def test_a_malformed_peer_request_closes_only_that_connection(caplog):
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            good, bad, worse = await peer(w), await peer(w), await peer(w)
            await bad.write([{"op": "get-data"}])  # no keys
            await worse.write([{"op": "launch-missiles"}])
            for comm in (bad, worse):
                with pytest.raises(CommClosedError):
                    await comm.read()
            assert await request(good, {"op": "ping"}) == {"op": "pong"}
            s.send(w, compute("still", inc, 1))
            await s.wait_for(lambda: s.ops("task-finished"))
            good.abort()
    with caplog.at_level(logging.WARNING, logger="distributed_server.worker"):
        run(main())
    assert "bad request" in caplog.text


def test_unknown_scheduler_operations_are_ignored():
    async def main():
        async with FakeScheduler() as s, await s.worker() as w:
            s.send(w, {"op": "what-is-this"}, compute("a", inc, 1),
                   {"op": "compute-task"})  # no key: logged, the rest still applies
            await s.wait_for(lambda: s.ops("task-finished"))
            assert w.data == {"a": 2} and w.status == "running"
    run(main())


# ---------------------------------------------------------------- losing the scheduler


def test_the_scheduler_asking_to_close_shuts_the_worker_down():
    async def main():
        async with FakeScheduler() as s:
            w = await s.worker()
            s.send(w, {"op": "close"})
            await asyncio.wait_for(w.finished(), 5)
            assert w.status == "closed"
    run(main())


def test_worker_closes_when_the_scheduler_is_gone_for_good():
    async def main():
        s = await FakeScheduler().start()
        w = await s.worker(reconnect_timeout=0.5)
        started = time.monotonic()
        await s.close()
        await asyncio.wait_for(w.finished(), 5)
        assert w.status == "closed" and time.monotonic() - started < 3
    run(main())


def test_worker_registers_again_after_losing_the_scheduler_and_drops_its_state():
    async def main():
        async with FakeScheduler() as s:
            w = await s.worker(reconnect_timeout=5)
            s.send(w, compute("a", inc, 1))
            await s.wait_for(lambda: s.ops("task-finished"))
            s.comms.pop(w.address).abort()
            await s.wait_for(lambda: len(s.handshakes) == 2)
            await s.wait_for(lambda: w.address in s.comms)
            assert w.data == {} and w.status == "running"
            s.send(w, compute("b", inc, 2))
            await s.wait_for(lambda: "b" in s.finished_keys())
            await w.close()
    run(main())


def test_close_does_not_wait_for_a_long_running_task():
    async def main():
        async with FakeScheduler() as s:
            w = await s.worker()
            gate("forever")
            s.send(w, compute("forever", gated, "forever"))
            await s.wait_for(lambda: len(w.state.tasks) == 1)
            started = time.monotonic()
            await w.close()
            assert time.monotonic() - started < 3 and w.status == "closed"
    run(main())


def test_start_fails_cleanly_without_a_scheduler():
    async def main():
        dead = await listen("tcp://127.0.0.1:0", lambda comm: None, {})
        address = dead.address
        await dead.stop()
        w = Worker(address, connect_timeout=0.2)
        with pytest.raises(OSError):
            await w.start()
        assert w.status == "closed"
    run(main())


# ---------------------------------------------------------------- transfers: hung peers, parts


def worker_process(scheduler_address: str) -> subprocess.Popen:
    """A worker in its own process (``dcore worker --no-nanny``), so it can be stopped."""
    return subprocess.Popen(
        [sys.executable, "-m", "distributed_server.cli", "worker", scheduler_address,
         "--no-nanny", "--nthreads", "1", "--log-level", "ERROR"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


async def started_process(s: FakeScheduler) -> tuple[subprocess.Popen, str]:
    """A worker process registered with ``s``, and its address."""
    before = set(s.comms)
    proc = worker_process(s.address)
    await s.wait_for(lambda: set(s.comms) - before, timeout=30)
    (address,) = set(s.comms) - before
    return proc, address


def stop_process(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait(10)


def call(key, func, *args, who_has=None) -> dict:
    """A compute-task for ``func(*args)``; only builtins, so a worker process runs it."""
    return compute_call(key, Call(func, args), who_has or {})


def test_a_fetch_from_a_stopped_peer_times_out_and_is_planned_again_at_once():
    """The only holder is SIGSTOPped: connecting to it times out after transfer_timeout;
    the fetch moves at once to a holder named meanwhile."""
    async def main():
        async with FakeScheduler() as s:
            proc, stopped = await started_process(s)
            try:
                await s.comms[stopped].write([call("x", bytes, 1000)])
                await s.wait_for(lambda: "x" in s.finished_keys(), timeout=20)
                async with await s.worker() as c, \
                        await s.worker(transfer_timeout=1.0) as b:
                    s.send(c, call("x", bytes, 1000))
                    await s.wait_for(lambda: s.finished_keys().count("x") == 2)
                    proc.send_signal(signal.SIGSTOP)
                    started = time.monotonic()
                    s.send(b, call("z", len, TaskRef("x"), who_has={"x": [stopped]}))
                    await s.wait_for(lambda: "x" in b.state.tasks
                                     and b.state.tasks["x"].coming_from == stopped)
                    s.send(b, call("z2", len, TaskRef("x"), who_has={"x": [stopped, c.address]}))
                    await s.wait_for(lambda: {"z", "z2"} <= set(s.finished_keys()))
                    assert time.monotonic() - started < 1.0 + 4
                    assert b.data == {"z": 1000, "z2": 1000}
                    assert not s.ops("missing-data") and not s.ops("reschedule")
                    story = [entry[1:3] for entry in b.state.story("x")]
                    assert story.count(("fetch", "flight")) == 2
                    assert ("flight", "fetch") in story  # the stopped peer failed it
            finally:
                stop_process(proc)
    run(main(), timeout=60)


def test_a_fetch_on_a_pooled_connection_to_a_stopped_peer_times_out_and_is_given_back():
    """A connection to the peer is open (an earlier fetch) when it is SIGSTOPped: the
    read times out after transfer_timeout and, with no other holder, the task goes back
    (missing-data, then reschedule)."""
    async def main():
        async with FakeScheduler() as s:
            proc, stopped = await started_process(s)
            try:
                await s.comms[stopped].write([call("y", bytes, 10), call("x", bytes, 10)])
                await s.wait_for(lambda: {"x", "y"} <= set(s.finished_keys()), timeout=20)
                async with await s.worker(transfer_timeout=1.0) as b:
                    s.send(b, call("z0", len, TaskRef("y"), who_has={"y": [stopped]}))
                    await s.wait_for(lambda: "z0" in s.finished_keys())
                    assert b._peer_pool.idle(stopped)  # the connection it will use
                    proc.send_signal(signal.SIGSTOP)
                    started = time.monotonic()
                    s.send(b, call("z", len, TaskRef("x"), who_has={"x": [stopped]}))
                    await s.wait_for(lambda: s.ops("reschedule"))
                    assert time.monotonic() - started < 1.0 + 4
                    assert s.ops("missing-data") == [
                        {"op": "missing-data", "key": "x", "errant_worker": stopped}]
                    assert s.ops("reschedule") == [{"op": "reschedule", "key": "z"}]
                    assert b.data == {"z0": 10} and set(b.state.tasks) == {"z0"}
            finally:
                stop_process(proc)
    run(main(), timeout=60)


def test_the_transfer_timeout_comes_from_the_environment_by_default(monkeypatch):
    monkeypatch.setenv("DCORE_TRANSFER_TIMEOUT", "7.5")
    assert Worker("tcp://127.0.0.1:1").transfer_timeout == 7.5
    assert Worker("tcp://127.0.0.1:1", transfer_timeout=2).transfer_timeout == 2
    monkeypatch.delenv("DCORE_TRANSFER_TIMEOUT")
    assert Worker("tcp://127.0.0.1:1").transfer_timeout == 30.0
    with pytest.raises(ValueError, match="transfer_timeout"):
        Worker("tcp://127.0.0.1:1", transfer_timeout=0)


def test_a_large_result_travels_to_a_peer_in_parts_under_its_frame_limit():
    async def main():
        async with (FakeScheduler() as s, await s.worker(transfer_part_bytes=256 * 1024) as a,
                    await s.worker() as b):
            b.peer_max_frame_bytes = 1024 * 1024  # a single 5 MB frame would be refused
            s.send(a, call("x", bytes, 5_000_000))
            await s.wait_for(lambda: s.ops("task-finished"))
            served = []
            original = a.peers.get_data
            a.peers.get_data = lambda msg: served.append(original(msg)) or served[-1]
            s.send(b, call("z", len, TaskRef("x"), who_has={"x": [a.address]}))
            await s.wait_for(lambda: "z" in s.finished_keys())
            assert b.data == {"z": 5_000_000}
            ((reply, parts),) = served
            assert reply["missing"] == [] and reply["data"] == {}
            assert sum(reply["parts"]["x"]) >= 5_000_000 and len(parts) == 1
    run(main())


def test_a_result_too_large_for_one_frame_is_refused_to_a_client_with_the_reason():
    async def main():
        async with FakeScheduler() as s, await s.worker() as a:
            a.single_frame_reply_bytes = 1024 * 1024
            s.send(a, call("x", bytes, 5_000_000))
            await s.wait_for(lambda: s.ops("task-finished"))
            comm = await peer(a)
            reply = await request(comm, {"op": "get-data", "keys": ["x"]})
            assert reply["missing"] == ("x",) and not reply["data"]
            why = reply["errors"]["x"]
            assert why.startswith("'x' (bytes, 500") and "does not fit in one frame" in why
            assert a.data["x"] == bytes(5_000_000)  # it can still travel to workers
            comm.abort()
    run(main())


# ---------------------------------------------------------------- results that cannot travel


def test_a_result_that_cannot_be_serialized_is_dropped_and_its_recomputation_fails():
    """A peer asks for a result that does not pickle: the holder says why and drops it
    (the peer gives the task back); when the scheduler asks for it again, its task
    fails with an error naming the key, the type, the size and the cause."""
    async def main():
        async with FakeScheduler() as s, await s.worker() as a, await s.worker() as b:
            s.send(a, call("x", threading.Lock))
            await s.wait_for(lambda: s.ops("task-finished"))
            s.send(b, call("z", type, TaskRef("x"), who_has={"x": [a.address]}))
            await s.wait_for(lambda: s.ops("reschedule"))
            assert s.ops("missing-data") == [
                {"op": "missing-data", "key": "x", "errant_worker": a.address}]
            assert "x" not in a.data and "x" not in a.state.tasks  # freed, not leaked
            assert "cannot pickle" in b.state.cannot_travel["x"]
            s.send(a, call("x", threading.Lock))  # the scheduler recomputes it
            await s.wait_for(lambda: s.ops("task-erred"))
            (report,) = s.ops("task-erred")
            text = report["text"]
            assert report["key"] == "x" and text.startswith("ResultCannotTravel")
            for part in ("'x'", "_thread.lock", "bytes", "TypeError", "cannot pickle"):
                assert part in text, (part, text)
            exc = loads_error(report["exception"], report["traceback"], text)
            assert isinstance(exc, TypeError) and "'x'" in str(exc)
            assert "x" not in a.data
    run(main())


def test_a_client_asking_for_a_result_that_cannot_be_serialized_learns_why():
    async def main():
        async with FakeScheduler() as s, await s.worker() as a:
            s.send(a, call("x", threading.Lock), call("ok", int, "5"))
            await s.wait_for(lambda: len(s.ops("task-finished")) == 2)
            comm = await peer(a)
            reply = await request(comm, {"op": "get-data", "keys": ["x", "ok"]})
            assert reply["missing"] == ("x",) and loads_data(reply["data"]["ok"]) == 5
            assert "cannot pickle" in reply["errors"]["x"]
            assert a.data == {"ok": 5}  # the worker frees what it failed to serve
            comm.abort()
    run(main())


def make_lock(_=None):
    return threading.Lock()


def test_an_unpicklable_result_fails_its_task_instead_of_a_recompute_loop():
    from distributed_server.scheduler.server import Scheduler

    async def main():
        async with (Scheduler(validate=True) as s, Worker(s.address) as a,
                    Worker(s.address) as b):
            client = await connect(s.address, {"role": "client", "client_id": "c"})
            tasks = [{"key": "x", "spec": dumps_spec(Call(threading.Lock)),
                      "workers": [a.address]},
                     {"key": "z", "deps": ["x"], "workers": [b.address],
                      "spec": dumps_spec(Call(type, (TaskRef("x"),)))}]
            client.send({"op": "update-graph", "tasks": tasks, "keys": ["z"]})
            msg = await read_until(client, "task-erred", "z")
            assert "the result of 'x'" in msg["text"] and "cannot pickle" in msg["text"]
            assert s.state.transition_counter < 60  # a loop ran 17,015 in 3 s
            client.send({"op": "release-keys", "keys": ["z"]})
            deadline = time.monotonic() + 10
            while (a.data or b.data or s.state.tasks) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert a.data == {} and b.data == {} and not s.state.tasks
            client.abort()
    run(main())


# ---------------------------------------------------------------- heartbeats and the GIL


def test_the_default_worker_ttl_is_no_shorter_than_dask():
    from distributed_server import config
    from distributed_server.cli import _parser
    from distributed_server.scheduler.server import Scheduler

    assert Scheduler().worker_ttl >= 300
    # dcore scheduler leaves it to the configuration, whose default is dask's
    flag = _parser().parse_args(["scheduler"]).worker_ttl
    assert config.get("scheduler.worker-ttl", flag) >= 300


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_task_holding_the_gil_longer_than_the_old_ttl_does_not_kill_its_worker():
    """A task holds the GIL for 40 s in one C call: no thread of its worker process runs,
    heartbeats included. With the scheduler's default TTL (300 s, as dask's) the worker
    is not removed and the task completes (with the old 30 s it was KilledWorker)."""
    from distributed_server import Client

    def hold_gil(seconds):
        import ctypes
        ctypes.PyDLL(None).sleep(seconds)  # PyDLL: the GIL stays held during the call
        return seconds

    scheduler = subprocess.Popen(
        [sys.executable, "-m", "distributed_server.cli", "scheduler", "--port", "0",
         "--log-level", "WARNING"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, text=True)
    procs = [scheduler]
    try:
        address = scheduler.stdout.readline().split()[2]
        procs.append(worker_process(address))
        with Client(address, set_as_default=False) as client:
            client.wait_for_workers(1, timeout=30)
            (worker,) = client.scheduler_info()["workers"]
            assert client.submit(hold_gil, 40, pure=False).result(timeout=120) == 40
            assert list(client.scheduler_info()["workers"]) == [worker]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------- throughput


def _cpu_seconds_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_twenty_thousand_no_op_tasks_are_all_reported_in_batched_frames(capsys):
    """20,000 no-op tasks to a worker process with one thread: every one is reported,
    in far fewer frames than tasks. Prints tasks/s and CPU per task (a figure, not a test:
    benchmarks/e2e.py measures throughput)."""
    n = 20_000

    async def main():
        async with FakeScheduler() as s:
            proc = subprocess.Popen(
                [sys.executable, "-m", "distributed_server.cli", "worker", s.address,
                 "--no-nanny", "--nthreads", "1", "--log-level", "WARNING"], stdout=subprocess.DEVNULL)
            try:
                await s.wait_for(lambda: s.comms, timeout=30)
                (comm,) = s.comms.values()
                spec = dumps_spec(Call(int))  # a builtin: the worker process imports no test
                msgs = [{"op": "compute-task", "key": f"noop-{i}", "spec": spec,
                         "priority": (0, 0, i), "stimulus_id": "bench"} for i in range(n)]
                cpu0, t0 = _cpu_seconds_of(proc.pid), time.perf_counter()
                for i in range(0, n, 1000):
                    await comm.write(msgs[i:i + 1000])
                await s.wait_for(lambda: len(s.ops("task-finished")) >= n, timeout=60)
                elapsed, cpu = time.perf_counter() - t0, _cpu_seconds_of(proc.pid) - cpu0
                await comm.write([{"op": "close"}])
                return elapsed, cpu, s.frames
            finally:
                try:
                    await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    elapsed, cpu, frames = run(main(), timeout=120)
    with capsys.disabled():
        print(f"\nworker: {n / elapsed:,.0f} tasks/s, {cpu / n * 1e6:.1f} µs CPU per task, "
              f"{frames} report frames")
    assert frames < n / 2  # unbatched would be one frame per task


# ---------------------------------------------------------------- with the real scheduler


def add(a, b):
    return a + b


def tree_sum_graph(n: int) -> tuple[list, object]:
    """Tasks squaring 0..n-1 and summing them pairwise; (task dicts, the final key)."""
    tasks = [{"key": ("sq", i), "spec": dumps_spec(Call(pow, (i, 2)))} for i in range(n)]
    level, depth = [("sq", i) for i in range(n)], 0
    while len(level) > 1:
        depth += 1
        nxt = []
        for j in range(0, len(level) - 1, 2):
            key = ("add", depth, j)
            left, right = level[j], level[j + 1]
            tasks.append({"key": key, "deps": [left, right],
                          "spec": dumps_spec(Call(add, (TaskRef(left), TaskRef(right))))})
            nxt.append(key)
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    return tasks, level[0]


async def read_until(comm, op: str, key) -> dict:
    while True:
        for msg in await comm.read():
            if msg["op"] == op and msg.get("key") == key:
                return msg
            assert msg["op"] in ("key-in-memory", "heartbeat"), msg


def count_calls(*workers) -> tuple[dict, dict]:
    """Count compute-task messages and get-data requests each worker handles."""
    computed = dict.fromkeys(workers, 0)
    served = dict.fromkeys(workers, 0)
    for w in workers:
        def on_compute(msgs, begun=None, w=w, original=w._scheduler_messages):
            computed[w] += sum(msg["op"] == "compute-task" for msg in msgs)
            original(msgs, begun)

        def on_get_data(msg, w=w, original=w.peers.get_data):
            served[w] += 1
            return original(msg)
        w._scheduler_messages = on_compute
        w.peers.get_data = on_get_data
    return computed, served


def test_a_graph_runs_across_two_workers_with_the_real_scheduler():
    from distributed_server.scheduler.server import Scheduler

    async def main():
        async with (Scheduler(validate=True) as s, Worker(s.address, nthreads=2) as a,
                    Worker(s.address, nthreads=2) as b):
                computed, served = count_calls(a, b)
                client = await connect(s.address, {"role": "client", "client_id": "c"})
                tasks, final = tree_sum_graph(200)
                client.send({"op": "update-graph", "tasks": tasks, "keys": [final]})
                msg = await read_until(client, "key-in-memory", final)
                assert pickle.loads(msg["data"]) == sum(i * i for i in range(200))
                assert computed[a] and computed[b] and computed[a] + computed[b] >= len(tasks)
                assert served[a] + served[b] > 0  # dependencies crossed between workers
                client.send({"op": "release-keys", "keys": [final]})
                deadline = time.monotonic() + 10
                while (a.data or b.data) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert a.data == {} and b.data == {}  # freed, fetched copies included
                assert not a.state.tasks and not b.state.tasks
                client.abort()
    run(main())


def test_a_task_that_raises_reaches_the_client_through_the_real_scheduler():
    from distributed_server.scheduler.server import Scheduler

    async def main():
        async with Scheduler(validate=True) as s, Worker(s.address):
            client = await connect(s.address, {"role": "client", "client_id": "c"})
            client.send({"op": "update-graph", "keys": ["bad"],
                         "tasks": [{"key": "bad", "spec": dumps_spec(Call(boom))}]})
            msg = await read_until(client, "task-erred", "bad")
            exc = loads_error(msg["exception"], msg["traceback"], msg["text"])
            assert isinstance(exc, ZeroDivisionError)
            client.abort()
    run(main())


def test_the_real_scheduler_closing_shuts_its_workers_down():
    from distributed_server.scheduler.server import Scheduler

    async def main():
        s = await Scheduler().start()
        w = await Worker(s.address).start()
        while w.address not in s.worker_comms:
            await asyncio.sleep(0.005)
        await s.close()
        await asyncio.wait_for(w.finished(), 5)
        assert w.status == "closed"
    run(main())


def test_workers_speak_tls_with_a_token_to_the_scheduler_and_to_each_other():
    from distributed_server.scheduler.server import Scheduler
    from distributed_server.security import Security

    security = Security.temporary()

    async def main():
        async with Scheduler(security=security, validate=True) as s:
            async with Worker(s.address, security=security) as a, \
                    Worker(s.address, security=security) as b:
                assert a.address.startswith("tls://") and b.address.startswith("tls://")
                _, served = count_calls(a, b)
                client = await connect(s.address, {"role": "client", "client_id": "c"},
                                       security=security)
                tasks, final = tree_sum_graph(64)
                client.send({"op": "update-graph", "tasks": tasks, "keys": [final]})
                msg = await read_until(client, "key-in-memory", final)
                assert pickle.loads(msg["data"]) == sum(i * i for i in range(64))
                assert served[a] + served[b] > 0
                client.abort()
    run(main())
