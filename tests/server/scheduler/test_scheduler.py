"""The Scheduler server over real loopback sockets, with hand-driven peers.

The peers here are raw comms, so each test controls exactly what the scheduler reads:
malformed input must close only the connection it came on, refused input must change
nothing, and no test may make the scheduler log an ERROR (that is kept for its bugs).
"""
import asyncio
import logging

import pytest

from distributed_core import SPEC_PART_PREFIX
from distributed_server.comm import CommClosedError, connect, parse_address
from distributed_server.scheduler import server as scheduler_server
from distributed_server.scheduler.server import Scheduler

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def no_errors_logged(caplog):
    """Bad input is the peer's fault: the scheduler logs it as a WARNING at most."""
    with caplog.at_level(logging.WARNING, logger="distributed_server"):
        yield
    errors = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.ERROR and r.name.startswith("distributed_server")]
    assert not errors, errors


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _worker(scheduler, port=1, nthreads=1):
    return await connect(scheduler.address, {"role": "worker", "nthreads": nthreads,
                                             "address": f"tcp://127.0.0.1:{port}",
                                             "name": f"w{port}"})


async def _client(scheduler, client_id="c1"):
    return await connect(scheduler.address, {"role": "client", "client_id": client_id})


async def _read_op(comm, op):
    """Read batches until a message with this op arrives; return it (drops the rest)."""
    while True:
        for msg in await comm.read():
            if msg["op"] == op:
                return msg


async def _request(comm, op, **fields):
    comm.send({"op": op, "reqid": 99, **fields})
    while True:
        msg = await _read_op(comm, "reply")
        if msg["reqid"] == 99:
            return msg["result"]


async def _closed(comm) -> bool:
    try:
        while True:
            await comm.read()
    except CommClosedError:
        return True


def test_task_round_trip_with_tuple_keys_and_inline_data():
    async def main():
        async with Scheduler(validate=True) as s:
            w, c = await _worker(s), await _client(s)
            key = ("x", 1)
            c.send({"op": "update-graph", "tasks": [{"key": key, "spec": b"S"}], "keys": [key]})
            compute = await _read_op(w, "compute-task")
            assert compute["key"] == key and compute["spec"] == b"S"
            w.send({"op": "task-finished", "key": key, "nbytes": 28, "type": "int",
                    "start": 1.0, "stop": 1.5, "data": b"result"})
            done = await _read_op(c, "key-in-memory")
            assert done == {"op": "key-in-memory", "key": key, "type": "int", "data": b"result"}
            assert await _request(c, "who-has", keys=[key]) == {key: ("tcp://127.0.0.1:1",)}

    run(main())


def test_a_batch_of_finished_reports_is_one_stimulus():
    async def main():
        async with Scheduler(worker_saturation=float("inf")) as s:
            w, c = await _worker(s), await _client(s)
            keys = [f"t-{i}" for i in range(50)]
            c.send({"op": "update-graph", "keys": keys,
                    "tasks": [{"key": k, "spec": b"S"} for k in keys]})
            seen = 0
            while seen < 50:
                seen += sum(m["op"] == "compute-task" for m in await w.read())
            await w.write([{"op": "task-finished", "key": k, "nbytes": 1} for k in keys])
            finished = 0
            while finished < 50:
                finished += sum(m["op"] == "key-in-memory" for m in await c.read())
            stimuli = {sid for key, start, finish, sid, _ in s.state.transition_log
                       if finish == "memory"}
            assert len(stimuli) == 1

    run(main())


def test_a_worker_batch_over_a_slice_is_handled_in_turns():
    """Reports that piled up on a worker (more than ``slice_keys``) are one stimulus per
    slice, in order, with every other peer served in between."""
    n = 2_500

    async def main():
        async with Scheduler(worker_saturation=float("inf")) as s:
            s.slice_keys = 1_000
            w, c = await _worker(s), await _client(s)
            keys = [f"t-{i}" for i in range(n)]
            c.send({"op": "update-graph", "keys": keys,
                    "tasks": [{"key": k, "spec": b"S"} for k in keys]})
            seen = 0
            while seen < n:
                seen += sum(m["op"] == "compute-task" for m in await w.read())
            await w.write([{"op": "task-finished", "key": k, "nbytes": 1} for k in keys])
            while s.state.task_counts()["memory"] < n:
                await asyncio.sleep(0.01)
            stimuli = [sid for key, start, finish, sid, _ in s.state.transition_log
                       if finish == "memory"]
            assert len(set(stimuli)) == 3  # 1,000 + 1,000 + 500, in the batch's order
            firsts = [stimuli.index(sid) for sid in dict.fromkeys(stimuli)]
            assert firsts == [0, 1_000, 2_000]

    run(main())


def test_identity_carries_the_counters_of_the_core():
    async def main():
        async with Scheduler(validate=True) as s:
            w, c = await _worker(s, nthreads=2), await _client(s)
            c.send({"op": "update-graph", "keys": ["inc-1", "inc-2"],
                    "tasks": [{"key": "inc-1", "spec": b"S"}, {"key": "inc-2", "spec": b"S"}]})
            await _read_op(w, "compute-task")
            w.send({"op": "task-finished", "key": "inc-1", "nbytes": 28})
            await _read_op(c, "key-in-memory")
            info = await _request(c, "identity")
            assert info["n_tasks"] == 2
            assert info["task_counts"]["memory"] == info["task_counts"]["processing"] == 1
            counters = info["counters"]
            assert counters["nbytes_in_memory"] == 28 and counters["nthreads"] == 2
            assert counters["transitions"] == s.state.transition_counter
            assert counters["stimuli"] == s.state.stimulus_counter >= 4
            assert info["prefix_counts"]["inc"]["task_counts"]["memory"] == 1
            worker = info["workers"]["tcp://127.0.0.1:1"]
            assert (worker["name"], worker["nthreads"], worker["nanny"]) == ("w1", 2, False)
            assert (worker["processing"], worker["in_memory"], worker["nbytes"]) == (1, 1, 28)

    run(main())


def test_identity_reads_no_task():
    """identity() (what scheduler_info() returns) gives the same answer after every task
    was poisoned and the task table taken away: it read only counters."""
    s = Scheduler()  # not started: identity() needs only the state
    state = s.state
    state.add_worker("tcp://127.0.0.1:1", 2, "join")
    keys = [f"inc-{i}" for i in range(10_000)]
    state.update_graph("c", [{"key": key, "spec": b"S"} for key in keys], keys, "graph")
    before = s.identity()
    tasks = state.tasks
    for ts in tasks.values():
        ts.state_id = -1  # no state: a read that looked would fail
        ts.nbytes = -1
    state.tasks = None
    try:
        after = s.identity()
    finally:
        state.tasks = tasks
    assert after == before
    assert after["n_tasks"] == 10_000
    assert after["task_counts"]["queued"] + after["task_counts"]["processing"] == 10_000
    assert after["prefix_counts"]["inc"]["tasks"] == 10_000
    assert after["workers"]["tcp://127.0.0.1:1"]["processing"] == \
        after["task_counts"]["processing"] > 0


def test_a_collecting_trim_packs_the_recent_past_and_reads_stay_the_same():
    """Once a big job is gone, the heap trimmer's collecting trims first pack what the
    scheduler keeps of its recent past: the task stream's chunks are squeezed and the
    transition log is packed; both read as before."""
    s = Scheduler()  # not started: the histories need only the state
    state = s.state
    state.add_worker("tcp://127.0.0.1:1", 2, "join")
    keys = [f"inc-{i}" for i in range(3_000)]
    state.update_graph("c", [{"key": key, "spec": b"S"} for key in keys], keys, "graph")
    s.task_stream.record("tcp://127.0.0.1:1", [
        {"key": key, "start": 1.0 + i, "stop": 1.5 + i} for i, key in enumerate(keys)], True)
    log, stream = state.transition_log, s.task_stream.window()
    assert s.heap_trimmer.before_collect == s._pack_histories
    s.heap_trimmer.before_collect()
    assert s.task_stream._squeezed.count(1) == 3  # the 3 chunks of 1,024 entries
    assert state.transition_log == log and state.story("inc-7") == [
        entry for entry in log if entry[0] == "inc-7"]
    assert s.task_stream.window() == stream


def test_a_collecting_trim_runs_in_parts_with_the_loop_turning_between(monkeypatch):
    """After a big release the collecting trim's parts (histories, collection, heap)
    each run in their own loop callback: a peer's message that came in meanwhile waits
    for one part, not for all of them and the release's stimulus."""
    order = []
    monkeypatch.setattr(scheduler_server.HeapTrimmer, "step", _recording_step(order))

    async def main():
        async with Scheduler(validate=True) as s:
            s.heap_trimmer.collect_after = 2
            w, c = await _worker(s), await _client(s)
            c.send({"op": "update-graph", "tasks": [{"key": k, "spec": b"S"} for k in "ab"],
                    "keys": ["a", "b"]})
            await _read_op(w, "compute-task")
            c.send({"op": "release-keys", "keys": ["a", "b"]})
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while order.count("step") < 3:
                assert loop.time() < deadline, order
                order.append("turn")
                await asyncio.sleep(0.001)
            assert order.count("step") == 3 and s.heap_trimmer.trims >= 1
            # between two parts the loop turned: other callbacks ran
            first, last = order.index("step"), len(order) - order[::-1].index("step") - 1
            assert "turn" in order[first:last]

    run(main())


def _recording_step(order):
    real = scheduler_server.HeapTrimmer.step

    def step(self):
        order.append("step")
        return real(self)
    return step


def test_releasing_keys_frees_them_on_the_worker_and_the_scheduler():
    async def main():
        async with Scheduler(validate=True) as s:
            w, c = await _worker(s), await _client(s)
            c.send({"op": "update-graph", "tasks": [{"key": "a", "spec": b"S"}], "keys": ["a"]})
            await _read_op(w, "compute-task")
            w.send({"op": "task-finished", "key": "a", "nbytes": 1})
            await _read_op(c, "key-in-memory")
            c.send({"op": "release-keys", "keys": ["a"]})
            assert (await _read_op(w, "free-keys"))["keys"] == ("a",)
            assert (await _request(c, "identity"))["n_tasks"] == 0

    run(main())


@pytest.mark.parametrize("bad", [
    {"op": "no-such-op"},
    {"op": "update-graph", "tasks": [{"key": "x", "spec": b"S"}], "keys": ["x"], "op2": 1,
     "reqid": 1} | {"op": 7},
])
def test_a_malformed_client_message_closes_only_that_connection(bad):
    async def main():
        async with Scheduler(validate=True) as s:
            w, good = await _worker(s), await _client(s, "good")
            evil = await _client(s, "evil")
            evil.send(bad)
            assert await _closed(evil)
            good.send({"op": "update-graph", "tasks": [{"key": "a", "spec": b"S"}],
                       "keys": ["a"]})
            await _read_op(w, "compute-task")
            w.send({"op": "task-finished", "key": "a", "nbytes": 1})
            assert (await _read_op(good, "key-in-memory"))["key"] == "a"

    run(main())


@pytest.mark.parametrize("bad", [
    {"op": "release-keys", "keys": 5},
    {"op": "release-keys", "keys": [{"a": 1}]},
    {"op": "update-data", "who_has": [], "nbytes": {}},
    {"op": "update-data", "who_has": {"fine": ["tcp://127.0.0.1:1"], "bad": 3},
     "nbytes": {"fine": 10}},
    {"op": "cancel", "keys": ["a"], "force": True},
    {"op": "retry", "keys": ["a"]},
])
def test_a_refused_client_message_changes_nothing_and_keeps_the_connection(bad):
    async def main():
        async with Scheduler(validate=True) as s:
            w, good = await _worker(s), await _client(s, "good")
            evil = await _client(s, "evil")
            good.send({"op": "update-graph", "tasks": [{"key": "a", "spec": b"S"}],
                       "keys": ["a"]})
            await _read_op(w, "compute-task")
            before = await _request(good, "identity")
            evil.send(bad)
            refusal = await _read_op(evil, "error")
            assert refusal["request"] == bad["op"] and refusal["error"]
            assert await _request(good, "identity") == before
            assert (await _request(evil, "identity"))["n_tasks"] == 1  # still connected
            w.send({"op": "task-finished", "key": "a", "nbytes": 1})
            assert (await _read_op(good, "key-in-memory"))["key"] == "a"

    run(main())


def test_a_client_that_stops_heartbeating_is_disconnected():
    async def main():
        async with Scheduler(validate=True, client_idle_timeout=0.3) as s:
            silent = await _client(s, "silent")
            talking = await _client(s, "talking")
            for _ in range(8):
                talking.send({"op": "heartbeat"})
                await asyncio.sleep(0.1)
            assert await asyncio.wait_for(_closed(silent), 2)
            assert "talking" in s.client_comms and "silent" not in s.client_comms

    run(main())


def test_a_real_client_heartbeats_and_stays_connected(monkeypatch):
    from distributed_server.client import scheduler_comm as client_comm
    from distributed_server.client.client import Client

    monkeypatch.setattr(client_comm, "HEARTBEAT_INTERVAL", 0.05)

    async def main():
        async with Scheduler(validate=True, client_idle_timeout=0.3) as s:
            async with Client(s.address, asynchronous=True, set_as_default=False) as c:
                await asyncio.sleep(1.0)
                assert c.status == "running" and len(s.client_comms) == 1

    run(main())


def test_garbage_bytes_close_only_that_connection():
    async def main():
        async with Scheduler(validate=True) as s:
            good = await _client(s, "good")
            _, host, port = parse_address(s.address)
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"\xff" * 64)
            await writer.drain()
            await asyncio.wait_for(reader.read(), 10)  # returns once the scheduler hangs up
            assert reader.at_eof()
            writer.close()
            assert (await _request(good, "identity"))["address"] == s.address

    run(main())


def test_an_impossible_worker_report_fails_that_task_only():
    async def main():
        async with Scheduler(validate=True, worker_saturation=float("inf")) as s:
            w = await _worker(s, port=1)
            c = await _client(s)
            c.send({"op": "update-graph", "keys": ["a", "b"],
                    "tasks": [{"key": "a", "spec": b"S"}, {"key": "b", "spec": b"S"}]})
            computing = 0
            while computing < 2:
                computing += sum(m["op"] == "compute-task" for m in await w.read())
            await w.write([{"op": "task-finished", "key": "a", "nbytes": "not an int"},
                           {"op": "task-finished", "key": "b", "nbytes": 1}])
            got = {}
            while len(got) < 2:
                for msg in await c.read():
                    if msg["op"] in ("task-erred", "key-in-memory"):
                        got[msg["key"]] = msg
            assert got["a"]["op"] == "task-erred" and "nbytes" in got["a"]["text"]
            assert got["b"]["op"] == "key-in-memory"
            assert "tcp://127.0.0.1:1" in s.worker_comms  # the worker keeps its connection

    run(main())


def test_bad_graph_is_refused_with_a_message_and_the_connection_stays_open():
    async def main():
        async with Scheduler(validate=True) as s:
            c = await _client(s)
            c.send({"op": "update-graph", "keys": ["b"],
                    "tasks": [{"key": "b", "spec": b"S", "deps": ["missing"]}]})
            refused = await _read_op(c, "graph-refused")
            assert "missing" in refused["error"]
            assert (await _request(c, "identity"))["n_tasks"] == 0

    run(main())


async def _until_compute(comm) -> tuple:
    """Read until a compute-task arrives: ``(the messages before it, it)``."""
    before: list = []
    while True:
        for msg in await comm.read():
            if msg["op"] == "compute-task":
                return before, msg
            before.append(msg)


def test_a_spec_part_goes_to_a_worker_once_as_the_same_bytes_then_is_dropped():
    """The part's bytes (a large one too) reach the worker unchanged, once, before its
    tasks' references; forgotten, the worker is told to drop it. A malformed part is
    refused and the graph counters do not count it."""
    blob = b"P" * 200_000  # over BLOB_MIN_BYTES: a frame of its own on the wire
    part = {"blob": blob, "keys": ["a", "b"], "deps": ["a"], "ndeps": [0, 1]}

    async def main():
        async with Scheduler(validate=True) as s:
            w, c = await _worker(s), await _client(s)
            c.send({"op": "update-graph", "tasks": [], "keys": ["b"],
                    "part": {**part, "ndeps": [0, 2]}})
            refused = await _read_op(c, "graph-refused")
            assert "dependency count #1 is 2" in refused["error"]
            assert (s.graph_updates, s.graph_tasks) == (0, 0)
            c.send({"op": "update-graph", "tasks": [], "keys": ["b"], "part": part})
            sent, first = await _until_compute(w)
            assert [m["op"] for m in sent] == ["spec-part"]
            assert sent[0]["part"] == 1 and bytes(sent[0]["blob"]) == blob
            assert first["key"] == "a" and first["spec"].startswith(SPEC_PART_PREFIX)
            assert (s.graph_updates, s.graph_tasks) == (1, 2)
            w.send({"op": "task-finished", "key": "a", "nbytes": 8, "type": "int",
                    "start": 1.0, "stop": 1.5})
            sent, second = await _until_compute(w)
            assert "spec-part" not in [m["op"] for m in sent]  # the worker has the part
            assert second["key"] == "b" and second["spec"][-4:] == (1).to_bytes(4, "little")
            w.send({"op": "task-finished", "key": "b", "nbytes": 8, "type": "int",
                    "start": 1.0, "stop": 1.5})
            await _read_op(c, "key-in-memory")
            c.send({"op": "release-keys", "keys": ["b"]})
            freed = await _read_op(w, "free-spec-parts")
            assert freed["parts"] == (1,) or freed["parts"] == [1]

    run(main())


def test_duplicate_worker_address_is_refused():
    async def main():
        async with Scheduler() as s:
            await _worker(s, port=1)
            second = await _worker(s, port=1)
            assert await _closed(second)
            c = await _client(s)
            assert len((await _request(c, "identity"))["workers"]) == 1

    run(main())


def test_silent_worker_is_removed_after_its_ttl():
    async def main():
        async with Scheduler(worker_ttl=0.3) as s:
            w = await _worker(s)
            c = await _client(s)
            assert await _closed(w)
            assert (await _request(c, "identity"))["workers"] == {}

    run(main())


def test_client_leaving_releases_its_tasks():
    async def main():
        async with Scheduler(validate=True) as s:
            w, c = await _worker(s), await _client(s)
            c.send({"op": "update-graph", "tasks": [{"key": "a", "spec": b"S"}], "keys": ["a"]})
            await _read_op(w, "compute-task")
            c.send({"op": "close-client"})
            assert await _closed(c)
            assert (await _read_op(w, "free-keys"))["keys"] == ("a",)
            assert len(s.state.tasks) == 0

    run(main())


async def _holding_many(s, n: int):
    """Client "big" holding ``n`` tasks that wait on one running task (on a worker that
    never answers), and client "other": ``(big, other, keys, worker)``."""
    w = await _worker(s)
    big, other = await _client(s, "big"), await _client(s, "other")
    keys = [("held", i) for i in range(n)]
    big.send({"op": "update-graph", "keys": keys,
              "tasks": [{"key": "blocker", "spec": b"S"}]
              + [{"key": k, "spec": b"S", "deps": ["blocker"]} for k in keys]})
    await _read_op(w, "compute-task")
    while len(s.state.tasks) < n + 1:
        await asyncio.sleep(0.01)
    return big, other, keys, w


def test_a_huge_release_is_applied_in_slices_and_others_are_served_meanwhile():
    n = 60_000

    async def main():
        async with Scheduler(validate=False) as s:
            big, other, keys, _worker_comm = await _holding_many(s, n)
            big.send({"op": "release-keys", "keys": keys})
            await asyncio.sleep(0.001)
            seen = (await _request(other, "identity"))["n_tasks"]
            assert 1 < seen < n + 1  # answered while the release was under way
            while len(s.state.tasks) > 1:
                await asyncio.sleep(0.01)

    run(main())


def test_a_client_that_leaves_holding_many_keys_is_removed_in_slices():
    """Its keys are released ``slice_keys`` at a time, one stimulus each, with every
    other peer served in between; its id stays taken until it is gone."""
    n = 60_000

    async def main():
        async with Scheduler(validate=False) as s:
            big, other, _keys, _worker_comm = await _holding_many(s, n)
            removals = []
            stimulus = s.stimulus

            def counted(peer, cause, *args, **kwargs):
                if cause == "remove-client":
                    removals.append(kwargs.get("max_keys"))
                return stimulus(peer, cause, *args, **kwargs)

            s.stimulus = counted
            big.abort()
            while "big" in s.client_comms:
                await asyncio.sleep(0)
            seen = (await _request(other, "identity"))["n_tasks"]
            assert 1 < seen < n + 1  # answered while the client was being removed
            assert "big" in s.state.clients
            while "big" in s.state.clients or s.state.tasks:
                await asyncio.sleep(0.01)
            assert removals == [s.slice_keys] * -(-n // s.slice_keys)

    run(main())


def test_a_leaving_clients_id_is_refused_until_it_is_gone():
    async def main():
        async with Scheduler(validate=True) as s:
            s._leaving_clients.add("big")
            assert await _closed(await _client(s, "big"))
            s._leaving_clients.discard("big")
            c = await _client(s, "big")
            assert (await _request(c, "identity"))["n_tasks"] == 0

    run(main())


def test_the_scheduler_sends_a_client_heartbeats_it_did_not_ask_for(monkeypatch):
    """A client's heartbeat waits behind the messages it sent before; the scheduler's
    own heartbeats do not (this client sends nothing)."""
    monkeypatch.setattr(scheduler_server, "CLIENT_HEARTBEAT_INTERVAL", 0.05)

    async def main():
        async with Scheduler(validate=False) as s:
            c = await _client(s)
            assert (await _read_op(c, "heartbeat")) == {"op": "heartbeat"}

    run(main())


def test_a_released_big_graph_is_forgotten_in_slices_and_others_are_served_meanwhile():
    """Releasing the one wanted key of a reduction lets its whole graph go: the core
    forgets a slice per stimulus (``forget_slice``) and the server takes the next slice
    in a later turn."""
    n = 60_000

    async def main():
        async with Scheduler(validate=False) as s:
            await _worker(s)
            big, other = await _client(s, "big"), await _client(s, "other")
            leaves = [("leaf", i) for i in range(n)]
            big.send({"op": "update-graph", "keys": ["total"],
                      "tasks": [{"key": k, "spec": b"S"} for k in leaves]
                      + [{"key": "total", "spec": b"S", "deps": leaves}]})
            while len(s.state.tasks) < n + 1:
                await asyncio.sleep(0.01)
            assert s.state.forget_slice < n
            stimuli = s.state.stimulus_counter
            big.send({"op": "release-keys", "keys": ["total"]})
            await asyncio.sleep(0.001)
            seen = (await _request(other, "identity"))["n_tasks"]
            assert 0 < seen < n + 1  # answered while the graph was being forgotten
            while s.state.tasks:
                await asyncio.sleep(0.01)
            assert s.state.stimulus_counter - stimuli >= n // s.state.forget_slice
            assert s.state.forget_backlog == 0

    run(main())


def test_a_huge_cancel_is_applied_in_slices_and_answered_once():
    n = 60_000

    async def main():
        async with Scheduler(validate=False) as s:
            big, other, keys, _worker_comm = await _holding_many(s, n)
            big.send({"op": "cancel", "keys": keys, "reqid": 7})
            await asyncio.sleep(0.001)
            seen = (await _request(other, "identity"))["n_tasks"]
            assert 1 < seen < n + 1  # answered while the cancel was under way
            answer = await _read_op(big, "cancelled-keys")
            assert answer["reqid"] == 7 and len(s.state.tasks) == 0  # the blocker too
            big.send({"op": "identity", "reqid": 8})
            msgs = []
            while not any(m["op"] == "reply" for m in msgs):
                msgs += await big.read()
            assert not [m for m in msgs if m["op"] == "cancelled-keys"]  # only one answer

    run(main())


def test_a_huge_cancel_with_one_key_of_another_client_changes_nothing():
    async def main():
        async with Scheduler(validate=True) as s:
            s.slice_keys = 10
            await _worker(s)
            mine, theirs = await _client(s, "mine"), await _client(s, "theirs")
            keys = [f"k{i}" for i in range(35)]
            mine.send({"op": "update-graph", "keys": keys,
                       "tasks": [{"key": k, "spec": b"S"} for k in keys]})
            theirs.send({"op": "update-graph", "keys": ["other"],
                         "tasks": [{"key": "other", "spec": b"S"}]})
            while len(s.state.tasks) < 36:
                await asyncio.sleep(0.01)
            mine.send({"op": "cancel", "keys": keys + ["other"], "reqid": 3})
            error = await _read_op(mine, "error")
            assert "does not want ['other']" in error["error"]
            assert len(s.state.tasks) == 36 and len(s.state.clients["mine"].wants_what) == 35

    run(main())


def test_each_client_op_has_one_handler_and_the_services_register_theirs():
    """The services (their modules' ``OPS``) and the server's own handlers claim disjoint
    client ops, and every op a service declares is routed to that service."""
    from distributed_server.scheduler import (
        client_keys,
        coordination_service,
        history,
        restart,
        retirement,
    )

    scheduler = Scheduler()
    services = {client_keys: scheduler.client_keys.handle,
                coordination_service: scheduler.coordination_service.handle,
                history: scheduler.history.handle, restart: scheduler.restarts.handle,
                retirement: scheduler._move_replicas}
    claimed = [op for module in services for op in module.OPS]
    assert len(claimed) == len(set(claimed)), claimed
    for module, handler in services.items():
        for op in module.OPS:
            assert scheduler._client_handlers[op] == handler, op
    assert {"update-graph", "update-data", "heartbeat", "identity", "versions",
            "register-worker-plugin"} <= set(scheduler._client_handlers) - set(claimed)
