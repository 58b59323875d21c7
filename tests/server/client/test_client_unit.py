"""The Client against a scripted scheduler: exactly what it sends, and what it makes of
what it receives.

`ScriptedScheduler` listens with the role "scheduler" on a loop thread of its own and
records every message a client sends. With ``compute=True`` it runs each task it
receives on the spot, the way a worker would (``pickle.loads(spec)(deps)``), and answers
``key-in-memory`` (small results inline, others held by its peer listener, which
answers ``get-data``/``put-data`` like a worker) or ``task-erred``. With
``compute=False`` a test sends the scheduler's messages itself. Task functions live at
module level, so their specs pickle by reference.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import logging
import pickle
import threading
import time

import pytest

from distributed_server.client import client as client_module
from distributed_server.client.client import (
    FIRST_COMPLETED,
    CancelledError,
    Client,
    Future,
    GraphRefusedError,
    SchedulerConnectionError,
    TaskFailedError,
    as_completed,
    wait,
)
from distributed_server.comm import Blob, CommClosedError, listen
from distributed_server.protocol.serialize import (
    Call,
    dumps_data,
    dumps_error,
    dumps_inline_result,
    loads_data,
)

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- task functions


def inc(x):
    return x + 1


def add(*args):
    return sum(args)


def span(n):
    """A result too large to travel inline."""
    return list(range(n))


def boom(x):
    raise ZeroDivisionError(f"boom {x}")


def echo(*args, **kwargs):
    return args, kwargs


def call(func, *args):
    return func(*args)


# ---------------------------------------------------------------- the scripted scheduler


class ScriptedScheduler:
    """The scheduler's (and one worker's) side of the client protocol, in a thread."""

    def __init__(self, compute: bool = True) -> None:
        self.compute = compute
        self.graphs = 0  # update-graph messages received
        self.refuse_graph = 0  # the number of the update-graph to refuse (0: none)
        self.msgs: list[dict] = []
        self.peer_msgs: list[dict] = []
        self.values: dict = {}
        self.errors: dict = {}  # key -> (exception, traceback, text)
        self.comms: list = []
        self._cond = threading.Condition()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.worker = self._run(listen("tcp://127.0.0.1:0", self._serve_peer,
                                       {"role": "worker"}))
        self.listener = self._run(listen("tcp://127.0.0.1:0", self._serve_client,
                                         {"role": "scheduler", "compiled": False}))
        self.address = self.listener.address

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        async def stop():
            await self.listener.stop()
            await self.worker.stop()
            for comm in self.comms:
                comm.abort()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    # ------------------------------------------------------------ what the test uses

    def latest_comm(self, timeout: float = 10):
        """The latest client connection, once the handshake on this side is done."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.comms, timeout), "no client connected"
            return self.comms[-1]

    def send(self, *msgs: dict) -> None:
        """Send messages to the (latest) client, as one frame."""
        self._run(self.latest_comm().write(list(msgs)))

    def drop_client(self) -> None:
        self.loop.call_soon_threadsafe(self.latest_comm().abort)

    def sent(self, op: str) -> list[dict]:
        with self._cond:
            return [m for m in self.msgs if m["op"] == op]

    def wait_for(self, op: str, count: int = 1, timeout: float = 10) -> list[dict]:
        """The first ``count`` messages with this op, once they arrived."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: len([m for m in self.msgs if m["op"] == op]) >= count, timeout)
            assert ok, f"no {count} {op!r} messages; got {[m['op'] for m in self.msgs]}"
            return [m for m in self.msgs if m["op"] == op][:count]

    # ------------------------------------------------------------ scheduler side

    async def _serve_client(self, comm) -> None:
        with self._cond:
            self.comms.append(comm)
            self._cond.notify_all()
        try:
            while True:
                for msg in await comm.read():
                    with self._cond:
                        self.msgs.append(msg)
                        self._cond.notify_all()
                    handler = getattr(self, "_on_" + msg["op"].replace("-", "_"), None)
                    if handler is not None:
                        handler(comm, msg)
        except CommClosedError:
            pass

    def _on_update_graph(self, comm, msg) -> None:
        self.graphs += 1
        if self.graphs == self.refuse_graph:  # as the scheduler refuses a bad message
            comm.send({"op": "graph-refused", "error": "refused by the test",
                       "keys": list(msg["keys"])})
            return
        if self.compute:
            wanted = set(msg["keys"])
            for task in graph_tasks(msg):
                self._run_task(comm, task, task["key"] in wanted)

    def _run_task(self, comm, task, wanted: bool) -> None:
        key = task["key"]
        blamed = [d for d in task.get("deps", ()) if d in self.errors]
        if blamed:  # like the core: a task whose input erred errs with that error
            self.errors[key] = self.errors[blamed[0]]
        else:
            try:
                deps = {d: self.values[d] for d in task.get("deps", ())}
                run = task["node"] if "node" in task else pickle.loads(task["spec"])
                value = run(deps)
            except Exception as e:  # noqa: BLE001 - the task's error goes to the client
                self.errors[key] = dumps_error(e)
        if key in self.errors:
            exception, traceback, text = self.errors[key]
            comm.send({"op": "task-erred", "key": key, "exception": exception,
                       "traceback": traceback, "text": text})
            return
        self.values[key] = value
        if wanted:
            self._announce(comm, key, value)

    def _announce(self, comm, key, value) -> None:
        msg = {"op": "key-in-memory", "key": key, "type": type(value).__name__}
        inline = dumps_inline_result(value)
        if inline is not None:
            msg["data"] = inline
        comm.send(msg)

    def _on_who_has(self, comm, msg) -> None:
        result = {k: [self.worker.address] for k in msg["keys"] if k in self.values}
        comm.send({"op": "reply", "reqid": msg["reqid"], "result": result})

    def _on_identity(self, comm, msg) -> None:
        result = {"address": self.address, "compiled": False, "n_tasks": len(self.values),
                  "workers": {self.worker.address: {"nthreads": 1, "name": "w0"}},
                  "task_counts": {}}
        comm.send({"op": "reply", "reqid": msg["reqid"], "result": result})

    def _on_update_data(self, comm, msg) -> None:
        for key in msg["who_has"]:
            comm.send({"op": "key-in-memory", "key": key, "type": None})

    def _on_cancel(self, comm, msg) -> None:  # the answer carries the request's id
        comm.send({"op": "cancelled-keys", "keys": list(msg["keys"]), "reqid": msg["reqid"]})

    def _on_desire_keys(self, comm, msg) -> None:
        if not self.compute:
            return
        for key in msg["keys"]:
            if key in self.values:
                self._announce(comm, key, self.values[key])
            else:
                comm.send({"op": "cancelled-keys", "keys": [key]})

    # ------------------------------------------------------------ worker side

    async def _serve_peer(self, comm) -> None:
        try:
            while True:
                for msg in await comm.read():
                    self.peer_msgs.append(msg)
                    await comm.write([self._answer_peer(msg)])
        except CommClosedError:
            pass

    def _answer_peer(self, msg) -> dict:
        if msg["op"] == "put-data":
            for key, frames in msg["data"].items():
                self.values[key] = loads_data(frames)
            return {"op": "ok"}
        data = {k: [Blob(f) for f in dumps_data(self.values[k])]
                for k in msg["keys"] if k in self.values}
        return {"op": "data", "data": data, "missing": [k for k in msg["keys"] if k not in data]}


@pytest.fixture
def scheduler():
    s = ScriptedScheduler()
    yield s
    s.close()


@pytest.fixture
def manual():
    s = ScriptedScheduler(compute=False)
    yield s
    s.close()


@pytest.fixture
def client(scheduler):
    with Client(scheduler.address) as c:
        yield c


@pytest.fixture
def mclient(manual):
    with Client(manual.address) as c:
        yield c


def until(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# ---------------------------------------------------------------- connecting


def test_handshake_names_the_client(scheduler, client):
    assert scheduler.latest_comm().extra == {"role": "client", "client_id": client.id}


def test_close_says_goodbye_and_is_idempotent(scheduler):
    client = Client(scheduler.address)
    client.close()
    client.close()
    assert scheduler.wait_for("close-client")
    assert client.status == "closed"
    with pytest.raises(SchedulerConnectionError):
        client.submit(inc, 1)


def test_cluster_arguments_need_address_none(scheduler):
    with pytest.raises(TypeError, match="LocalCluster"):
        Client(scheduler.address, n_workers=2)


# ---------------------------------------------------------------- submit and keys


def test_submit_result_with_inline_data(scheduler, client):
    future = client.submit(inc, 1)
    assert future.result() == 2
    assert future.status == "finished" and future.done() and future.type == "int"
    (msg,) = scheduler.sent("update-graph")
    (task,) = msg["tasks"]
    assert msg["keys"] == (future.key,) and task["key"] == future.key
    assert set(task) == {"key", "spec"}  # defaults are left out
    assert not scheduler.peer_msgs  # nothing fetched from a worker
    assert "finished" in repr(future) and future.key in repr(future)


def test_pure_keys_are_deterministic_and_impure_keys_unique(client):
    a, b = client.submit(inc, 1), client.submit(inc, 1)
    assert a.key == b.key and a.key.startswith("inc-")
    assert client.submit(inc, 2).key != a.key
    assert client.submit(inc, 1, pure=False).key != client.submit(inc, 1, pure=False).key
    assert client.submit(lambda x: x, 1).key.startswith("lambda-")
    assert client.map(inc, [1])[0].key == a.key  # submit and map agree
    assert client.submit(inc, 1, key="mine").key == "mine"


def test_resubmitting_a_held_key_sends_nothing(scheduler, client):
    first = client.submit(inc, 1)
    first.result()
    again = client.submit(inc, 1)
    assert again.result() == 2 and again is not first
    time.sleep(0.05)
    assert len(scheduler.sent("update-graph")) == 1


def test_futures_in_arguments_become_dependencies(scheduler, client):
    x, y = client.submit(inc, 1), client.submit(inc, 2)
    total = client.submit(add, x, [y, {"k": x}][0], 10)
    nested = client.submit(lambda d, l: d["a"] + l[0][0], {"a": x}, [(y,)])
    assert total.result() == 2 + 3 + 10
    assert nested.result() == 5
    graphs = scheduler.sent("update-graph")
    assert set(graphs[2]["tasks"][0]["deps"]) == {x.key, y.key}
    assert set(graphs[3]["tasks"][0]["deps"]) == {x.key, y.key}


def test_task_options_pass_through(scheduler, client):
    client.submit(inc, 1, priority=5, retries=2, workers="tcp://127.0.0.1:1",
                  allow_other_workers=True, resources={"GPU": 1})
    (task,) = scheduler.wait_for("update-graph")[0]["tasks"]
    assert task["priority"] == 5 and task["retries"] == 2
    assert task["workers"] == ("tcp://127.0.0.1:1",) and task["allow_other_workers"] is True
    assert task["resources"] == {"GPU": 1}


def test_specs_are_standard_pickles_of_calls(scheduler, client):
    shared = "shared"
    args = (1, shared, shared, (2.5, None, True), [b"x", {"k": {1, 2}}], frozenset({3}))
    future = client.submit(echo, *args, flag=(shared, shared))
    assert future.result() == (args, {"flag": (shared, shared)})
    spec = scheduler.sent("update-graph")[0]["tasks"][0]["spec"]
    for loads in (pickle.loads, pickle._loads):  # the C and the pure-Python unpickler
        call = loads(spec)
        assert isinstance(call, Call) and call.func is echo
        assert call({}) == (args, {"flag": (shared, shared)})


def test_arguments_plain_pickle_cannot_carry_use_cloudpickle(client):
    assert client.submit(call, lambda x: x * 2, 21).result() == 42
    assert client.gather(client.map(call, [lambda: 1, lambda: 2])) == [1, 2]


def test_large_spec_travels_as_a_blob(scheduler, client):
    payload = b"x" * 100_000
    assert client.submit(len, payload).result() == 100_000
    (task,) = scheduler.sent("update-graph")[0]["tasks"]
    assert isinstance(task["spec"], memoryview)  # an out-of-band buffer on the wire


# ---------------------------------------------------------------- map, gather, get


def test_map_sends_one_update_graph(scheduler, client):
    futures = client.map(inc, range(100))
    assert client.gather(futures) == list(range(1, 101))
    (msg,) = scheduler.sent("update-graph")
    assert len(msg["tasks"]) == 100 and len(set(msg["keys"])) == 100


def test_a_large_map_goes_in_update_graphs_of_map_batch_tasks(scheduler, client, monkeypatch):
    monkeypatch.setattr(client_module, "MAP_BATCH_TASKS", 40)
    futures = client.map(inc, range(100))
    assert client.gather(futures) == list(range(1, 101))
    assert [len(g["tasks"]) for g in scheduler.sent("update-graph")] == [40, 40, 20]


class PickleLog:
    """A map argument that notes in ``log`` when it is pickled."""

    log: list = []

    def __init__(self, i):
        self.i = i

    def __reduce__(self):
        PickleLog.log.append("row")
        return (PickleLog, (self.i,))


def test_a_map_sends_each_batch_before_it_builds_the_next(scheduler, client, monkeypatch):
    """The rows of a big map are built a batch at a time, each sent before the next is
    built: its first tasks can run while the caller is still building the rest."""
    PickleLog.log = log = []
    register = client._register
    monkeypatch.setattr(client, "_register",
                        lambda tasks, *a: log.append(len(tasks)) or register(tasks, *a))
    futures = client.map(bool, [PickleLog(i) for i in range(5)], batch_size=2, pure=False)
    assert log == ["row", "row", 2, "row", "row", 2, "row", 1]
    assert len({f.key for f in futures}) == 5 and futures[0].key.startswith("bool-")
    assert client.gather(futures) == [True] * 5
    assert [len(g["tasks"]) for g in scheduler.sent("update-graph")] == [2, 2, 1]


def test_a_map_builds_its_futures_with_the_collector_paused(scheduler, client, monkeypatch):
    """The futures of a big map all live on: the automatic collector is off while they
    are made (it would walk all of them again and again), and on again after."""
    import gc

    seen = []
    register = client._register
    monkeypatch.setattr(client, "_register",
                        lambda tasks, *a: seen.append(gc.isenabled()) or register(tasks, *a))
    assert gc.isenabled()
    futures = client.map(inc, range(5), batch_size=2)
    assert seen == [False, False, False] and gc.isenabled()
    with pytest.raises(TypeError):
        client.map(inc, [1, threading.Lock()], batch_size=1)  # an error on the way: on again
    assert gc.isenabled()
    assert client.gather(futures) == [1, 2, 3, 4, 5]


def test_a_map_stays_one_batch_ahead_of_the_socket(scheduler, client, monkeypatch):
    """A big map does not queue the whole job in the client: before it builds a batch,
    the one before the last is written to the socket."""
    marks, seen = [], []
    mark_written = client._conn.mark_written
    monkeypatch.setattr(client._conn, "mark_written",
                        lambda: marks.append(mark_written()) or marks[-1])
    register = client._register
    monkeypatch.setattr(client, "_register", lambda tasks, *a: seen.append(
        [m.event.is_set() for m in marks]) or register(tasks, *a))
    futures = client.map(inc, range(7), batch_size=2)
    assert [len(flags) for flags in seen] == [0, 1, 2, 3] and len(marks) == 4
    assert all(flags[:-1] == [True] * (len(flags) - 1) for flags in seen)
    assert client.gather(futures) == list(range(1, 8))


def test_a_written_mark_is_set_at_once_without_a_connection(client):
    conn = client._conn
    comm, conn.comm = conn.comm, None
    try:
        conn._set_when_written(event := threading.Event())
        assert event.is_set()
    finally:
        conn.comm = comm


def test_map_batches_and_shares_duplicate_keys(scheduler, client):
    futures = client.map(inc, [1, 2, 1, 3, 4], batch_size=2, key="step")
    assert client.gather(futures) == [2, 3, 2, 4, 5]
    assert futures[0].key == futures[2].key and futures[0].key.startswith("step-")
    graphs = scheduler.sent("update-graph")
    assert [len(g["tasks"]) for g in graphs] == [2, 1, 1]


def combine(table, x, const, y=b""):
    return x + len(table) + len(const) + len(y)


def test_map_sends_a_shared_function_and_constants_once(scheduler, client, monkeypatch):
    """A large function, an argument that is the same object in every row and a large
    keyword go to the scheduler once each, as tasks every map task depends on; they
    are wanted until the last batch is sent, then released."""
    monkeypatch.setattr(client_module, "MAP_BATCH_TASKS", 10)
    func = functools.partial(combine, b"F" * 3000)  # its pickle holds the table
    const, y = b"C" * 5000, b"Y" * 4000
    futures = client.map(func, range(30), [const] * 30, y=y)
    assert client.gather(futures) == [x + 12_000 for x in range(30)]
    graphs = scheduler.sent("update-graph")
    assert [len(g["tasks"]) for g in graphs] == [3, 10, 10, 10]
    specs = [bytes(t["spec"]) for g in graphs for t in g["tasks"]]
    for marker in (b"F" * 3000, b"C" * 5000, b"Y" * 4000):
        assert sum(marker in spec for spec in specs) == 1
    assert sum(len(spec) for spec in specs) < 12_000 + 30 * 500  # ~360 B per task
    shared = sorted(t["key"] for t in graphs[0]["tasks"])
    assert all(key.startswith("shared-") for key in shared)
    for g in graphs[1:]:
        assert all(sorted(t["deps"]) == shared for t in g["tasks"])
    # each shared future is released on its own, so the loop may send them in one
    # release-keys message or in several (whenever it drains its outbox meanwhile)
    deadline = time.monotonic() + 10
    while True:
        released = sorted(k for m in scheduler.sent("release-keys") for k in m["keys"])
        if set(shared) <= set(released) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert released == shared


def test_map_shares_constants_with_rows_that_need_the_general_path(scheduler, client):
    """Rows holding lists and futures take `TaskEncoder.task`; the shared constant
    still goes once and every task depends on it (and on its own futures)."""
    const = b"C" * 5000
    xs = client.map(inc, range(4))
    futures = client.map(combine, [[i] for i in range(4)], xs, [const] * 4)
    assert client.gather(futures) == [i + 1 + 1 + 5000 for i in range(4)]
    (graph,) = [g for g in scheduler.sent("update-graph") if len(g["tasks"]) == 4][1:]
    (shared,) = [t["key"] for g in scheduler.sent("update-graph") for t in g["tasks"]
                 if t["key"].startswith("shared-")]
    assert sum(const in bytes(t["spec"]) for g in scheduler.sent("update-graph")
               for t in g["tasks"]) == 1
    assert [sorted(t["deps"]) for t in graph["tasks"]] == [sorted([x.key, shared]) for x in xs]


def measure(table, xs, c):
    return len(table) + sum(xs) + len(c)


def test_map_shares_a_large_function_with_rows_that_need_the_general_path(scheduler,
                                                                         client):
    """Rows holding other objects take `TaskEncoder.task`'s general path; a shared
    function's spec there calls the shared task's reference, so the function's bytes
    still travel once."""
    func = functools.partial(measure, b"F" * 3000)
    futures = client.map(func, [range(i) for i in range(4)], [b"c"] * 4)  # not plain
    assert client.gather(futures) == [3000 + sum(range(i)) + 1 for i in range(4)]
    specs = [bytes(t["spec"]) for g in scheduler.sent("update-graph") for t in g["tasks"]]
    assert sum(b"F" * 3000 in spec for spec in specs) == 1, [len(s) for s in specs]


def test_map_of_one_task_or_small_values_shares_nothing(scheduler, client):
    assert client.gather(client.map(combine, [b"t"], [1], [b"c" * 5000])) == [5002]
    assert client.gather(client.map(combine, [b"t", b"u"], [1, 2], [b"c", b"c"])) == [3, 4]
    assert all("deps" not in t for g in scheduler.sent("update-graph") for t in g["tasks"])


def test_map_with_iterators_of_different_lengths_zips_them(scheduler, client):
    futures = client.map(add, iter(range(5)), itertools.repeat(10))
    assert client.gather(futures) == [10, 11, 12, 13, 14]
    assert client.gather(client.map(add, [1, 2, 3], (10, 20))) == [11, 22]


def test_map_that_cannot_pickle_a_row_sends_nothing(scheduler, client):
    with pytest.raises(TypeError, match="cannot pickle"):
        client.map(inc, [1, 2, threading.Lock()])
    assert client.who_has() == {}
    assert not scheduler.sent("update-graph")


def test_map_with_futures_and_kwargs(scheduler, client):
    xs = client.map(inc, range(3))
    ys = client.map(add, xs, [10, 20, 30])
    assert client.gather(ys) == [11, 22, 33]
    assert [t["deps"] for t in scheduler.sent("update-graph")[1]["tasks"]] == \
        [(x.key,) for x in xs]


def test_gather_keeps_the_structure(client):
    a, b = client.submit(inc, 1), client.submit(inc, 2)
    assert client.gather({"a": a, "l": [b, (a, 7)]}) == {"a": 2, "l": [3, (2, 7)]}
    assert client.gather(a) == 2


def test_results_not_inline_are_fetched_in_one_batch(scheduler, client):
    futures = client.map(span, range(1000, 1020))
    assert client.gather(futures) == [list(range(n)) for n in range(1000, 1020)]
    assert len(scheduler.sent("who-has")) == 1
    assert [m["op"] for m in scheduler.peer_msgs] == ["get-data"]
    assert len(scheduler.peer_msgs[0]["keys"]) == 20


def test_gather_skip_leaves_failures_out(client):
    good, bad = client.submit(inc, 1), client.submit(boom, 1)
    assert client.gather([good, bad, good], errors="skip") == [2, 2]
    with pytest.raises(ZeroDivisionError):
        client.gather([good, bad])


def graph_tasks(msg: dict) -> list:
    """An update-graph's tasks: its task dicts, then its spec part's tasks as dicts whose
    ``node`` is their spec unpickled."""
    tasks = list(msg["tasks"])
    part = msg.get("part")
    if part is not None:
        nodes = pickle.loads(part["blob"])
        start = 0
        for key, n, node in zip(part["keys"], part["ndeps"], nodes, strict=True):
            task = {"key": key, "node": node}
            if n:
                task["deps"] = tuple(part["deps"][start:start + n])
                start += n
            tasks.append(task)
    return tasks


def test_get_converts_a_legacy_graph(scheduler, client):
    graph = {
        "x": 1,
        "y": (inc, "x"),
        "z": (add, "x", (inc, "y"), 100),  # a nested task
        "w": ["x", "y"],  # a list of keys
        "v": "z",  # an alias
    }
    assert client.get(graph, ["z", ["w", "v"]]) == [104, [[1, 2], 104]]
    (msg,) = scheduler.sent("update-graph")
    tasks = {t["key"]: t for t in graph_tasks(msg)}
    assert set(tasks) == set(graph)
    assert set(msg["keys"]) == {"z", "w", "v"}
    assert "deps" not in tasks["x"]
    assert tasks["y"]["deps"] == ("x",)
    assert set(tasks["z"]["deps"]) == {"x", "y"} and tasks["v"]["deps"] == ("z",)
    assert client.get(graph, "y") == 2
    with pytest.raises(KeyError):
        client.get(graph, "nope")


@pytest.mark.parametrize("refused", ["second to last", "last"])
def test_a_refused_late_slice_fails_the_whole_graph_and_releases_what_went(
        manual, mclient, monkeypatch, refused):
    """A graph goes in slices, at most two unanswered; the scheduler refuses one of the
    last two. The graph is all or nothing: get raises GraphRefusedError, and every key
    that went in an accepted slice is released."""
    from distributed_server.client import dask_graphs as dask_support
    monkeypatch.setattr(dask_support, "SLICE_TASKS", 20)
    graph: dict = {("x", i): (inc, i) for i in range(100)}
    graph["total"] = (add, *[("x", i) for i in range(100)])
    n_slices = 6  # 101 tasks, 20 a slice
    manual.refuse_graph = n_slices - 1 if refused == "second to last" else n_slices
    with pytest.raises(GraphRefusedError, match="refused part of the graph"):
        mclient.get(graph, "total")
    graphs = manual.sent("update-graph")
    assert len(graphs) == n_slices
    accepted = [m for i, m in enumerate(graphs, 1) if i != manual.refuse_graph]
    wanted = {key for m in accepted for key in m["keys"]}
    assert len(wanted) >= 80  # the frontier of each slice, until its last dependent went
    until(lambda: wanted <= {k for m in manual.sent("release-keys") for k in m["keys"]})


# ---------------------------------------------------------------- errors


def test_task_erred_raises_the_original_exception_with_remote_traceback(client):
    future = client.submit(boom, 7)
    with pytest.raises(ZeroDivisionError, match="boom 7") as info:
        future.result()
    assert "Remote traceback" in str(info.value.__cause__)
    assert future.status == "error"
    assert isinstance(future.exception(), ZeroDivisionError)
    assert "in boom" in future.traceback()
    dependent = client.submit(inc, future)
    with pytest.raises(ZeroDivisionError):
        dependent.result()


def test_core_made_error_without_exception(manual, mclient):
    future = mclient.submit(inc, 1)
    manual.wait_for("update-graph")
    manual.send({"op": "task-erred", "key": future.key, "exception": None,
                 "traceback": None, "text": "KilledWorker: died three times"})
    with pytest.raises(TaskFailedError, match="KilledWorker"):
        future.result()


def test_graph_refused_fails_those_futures(manual, mclient):
    future = mclient.submit(inc, 1)
    msg = manual.wait_for("update-graph")[0]
    manual.send({"op": "graph-refused", "error": "a cycle", "keys": list(msg["keys"])})
    with pytest.raises(GraphRefusedError, match="a cycle") as info:
        future.result()
    assert isinstance(info.value, ValueError)
    assert mclient.submit(inc, 1).status == "pending"  # the same key is submitted anew
    assert len(manual.wait_for("update-graph", 2)) == 2


def test_connection_loss_fails_pending_futures(manual, mclient):
    future = mclient.submit(inc, 1)
    manual.wait_for("update-graph")
    manual.drop_client()
    with pytest.raises(SchedulerConnectionError, match="lost the connection"):
        future.result(timeout=10)
    assert isinstance(future.exception(), CommClosedError)
    with pytest.raises(SchedulerConnectionError):
        mclient.submit(inc, 2)
    with pytest.raises(SchedulerConnectionError):
        mclient.scheduler_info()


def test_close_fails_pending_futures(manual):
    client = Client(manual.address)
    future = client.submit(inc, 1)
    client.close()
    assert future.status == "error"
    with pytest.raises(SchedulerConnectionError, match="closed"):
        future.result()


def test_result_timeout(mclient):
    future = mclient.submit(inc, 1)
    with pytest.raises(TimeoutError):
        future.result(timeout=0.05)


# ---------------------------------------------------------------- cancel, retry, release


def test_cancel(manual, mclient):
    future = mclient.submit(inc, 1)
    future.cancel()
    assert future.status == "cancelled"
    with pytest.raises(CancelledError):
        future.result()
    (msg,) = manual.wait_for("cancel")
    assert msg["keys"] == (future.key,) and msg["force"] is False
    # the echo of our own cancel must not cancel the same key submitted again
    again = mclient.submit(inc, 1)
    manual.wait_for("update-graph", 2)
    time.sleep(0.05)
    assert again.status == "pending"
    with pytest.raises(CancelledError):
        mclient.submit(inc, future)


def test_a_cancel_never_overtakes_a_graph_still_going_out(manual):
    """An asynchronous client's compute() returns while its graph still goes out in
    slices; a cancel made at once must reach the scheduler after every slice (else it
    cancels keys the scheduler does not know yet, and the later slices create tasks
    wanted by nobody's future)."""
    Delayed = pytest.importorskip("dask.delayed").Delayed
    graph = {("inc", i): (inc, i) for i in range(20_000)}
    graph["total"] = (sum, list(graph))

    async def main():
        async with Client(manual.address, asynchronous=True) as client:
            future = client.compute(Delayed("total", graph))
            await client.cancel([future])
            await asyncio.to_thread(manual.wait_for, "cancel")
    asyncio.run(asyncio.wait_for(main(), 60))
    ops = [m["op"] for m in manual.msgs]
    assert ops.count("update-graph") >= 2  # it did go out in slices
    assert ops.index("cancel") > max(i for i, op in enumerate(ops) if op == "update-graph")


def test_cancelled_by_the_scheduler(manual, mclient):
    future = mclient.submit(inc, 1)
    manual.wait_for("update-graph")
    manual.send({"op": "cancelled-keys", "keys": [future.key]})
    with pytest.raises(CancelledError):
        future.result(timeout=5)


def test_retry_runs_a_failed_task_again(manual, mclient):
    future = mclient.submit(inc, 1)
    manual.wait_for("update-graph")
    manual.send({"op": "task-erred", "key": future.key, "exception": None,
                 "traceback": None, "text": "flaky"})
    until(lambda: future.status == "error")
    future.retry()
    assert future.status == "pending"
    assert manual.wait_for("retry")[0]["keys"] == (future.key,)
    manual.send({"op": "key-in-memory", "key": future.key, "type": "int",
                 "data": pickle.dumps(2)})
    assert future.result(timeout=5) == 2


def test_release_keys_when_the_last_future_is_gone(scheduler, client):
    a = client.submit(inc, 1)
    b = Future(a.key, client)  # another Future of the same key
    a.result()
    del a
    gc.collect()
    time.sleep(0.05)
    assert not scheduler.sent("release-keys")
    key = b.key
    del b
    gc.collect()
    assert scheduler.wait_for("release-keys")[0]["keys"] == (key,)
    c = client.submit(inc, 2)
    c.release()  # explicitly, while the object lives on
    assert scheduler.wait_for("release-keys", 2)[1]["keys"] == (c.key,)


def test_releases_are_batched(scheduler, client):
    futures = client.map(inc, range(50))
    client.gather(futures)
    keys = {f.key for f in futures}
    del futures
    gc.collect()
    until(lambda: {k for m in scheduler.sent("release-keys") for k in m["keys"]} == keys)
    assert len(scheduler.sent("release-keys")) < len(keys)


def test_future_of_an_unknown_key_asks_the_scheduler(manual, mclient):
    future = Future("somebody-else", mclient)
    assert manual.wait_for("desire-keys")[0]["keys"] == ("somebody-else",)
    manual.send({"op": "key-in-memory", "key": "somebody-else", "type": "int",
                 "data": pickle.dumps(3)})
    assert future.result(timeout=5) == 3


# ---------------------------------------------------------------- wait, as_completed, callbacks


def test_wait(manual, mclient):
    a, b = mclient.submit(inc, 1), mclient.submit(inc, 2)
    manual.wait_for("update-graph", 2)
    with pytest.raises(TimeoutError):
        wait([a, b], timeout=0.05)
    manual.send({"op": "key-in-memory", "key": a.key, "type": "int", "data": pickle.dumps(2)})
    done, not_done = wait([a, b], return_when=FIRST_COMPLETED)
    assert done == {a} and not_done == {b}
    manual.send({"op": "key-in-memory", "key": b.key, "type": "int", "data": pickle.dumps(3)})
    assert wait([a, b], timeout=5).done == {a, b}


def test_as_completed_yields_in_finishing_order(manual, mclient):
    futures = mclient.map(inc, range(3))
    ac = as_completed(futures)
    manual.wait_for("update-graph")
    for i in (2, 0, 1):
        manual.send({"op": "key-in-memory", "key": futures[i].key, "type": "int",
                     "data": pickle.dumps(i + 1)})
    assert list(ac) == [futures[2], futures[0], futures[1]]


def test_as_completed_with_results_and_add(client):
    ac = as_completed([client.submit(inc, 1)], with_results=True)
    ac.add(client.submit(inc, 2))
    assert sorted(result for _, result in ac) == [2, 3]


def test_done_callbacks_run_on_a_callback_thread_may_block_and_errors_are_logged(client,
                                                                                caplog):
    called = []
    done = threading.Event()

    def callback(future):
        # a blocking call works here (as in dask): the callback is not on the loop
        called.append((future, threading.current_thread().name, future.result(timeout=5)))
        done.set()

    future = client.submit(inc, 1)
    future.add_done_callback(lambda f: 1 / 0)
    future.add_done_callback(callback)
    with caplog.at_level(logging.ERROR, logger="distributed_server.client"):
        assert done.wait(5)
    assert called[0][0] is future and called[0][2] == 2
    assert called[0][1].startswith("distributed-core-callback")
    until(lambda: "done callback" in caplog.text)


# ---------------------------------------------------------------- scatter, info


def test_scatter_puts_data_on_a_worker_then_tells_the_scheduler(scheduler, client):
    futures = client.scatter([10, 20])
    assert [m["op"] for m in scheduler.peer_msgs] == ["put-data"]
    (msg,) = scheduler.wait_for("update-data")
    assert set(msg["who_has"]) == {f.key for f in futures}
    assert all(v == (scheduler.worker.address,) for v in msg["who_has"].values())
    assert all(f.status == "finished" for f in futures)
    assert client.gather(futures) == [10, 20]
    assert client.submit(add, *futures).result() == 30
    named = client.scatter({"a": 1})
    assert named["a"].key == "a" and named["a"].result() == 1
    single = client.scatter(5)
    assert isinstance(single, Future) and single.result() == 5


def test_scheduler_info_and_who_has(scheduler, client):
    info = client.scheduler_info()
    assert info["workers"] == {scheduler.worker.address: {"nthreads": 1, "name": "w0"}}
    future = client.submit(inc, 1)
    future.result()
    assert client.who_has([future]) == {future.key: (scheduler.worker.address,)}
    client.wait_for_workers(1, timeout=5)
    with pytest.raises(TimeoutError):
        client.wait_for_workers(2, timeout=0.2)


def test_lost_data_is_awaited_again(manual, mclient):
    future = mclient.submit(span, 5000)
    manual.wait_for("update-graph")
    manual.send({"op": "key-in-memory", "key": future.key, "type": "list"})
    result = []
    thread = threading.Thread(target=lambda: result.append(future.result(timeout=10)))
    thread.start()
    manual.wait_for("who-has")  # the scripted scheduler holds nothing: the key is lost
    until(lambda: future.status == "pending")
    manual.values[future.key] = list(range(5000))  # recomputed
    manual.send({"op": "key-in-memory", "key": future.key, "type": "list"})
    thread.join(10)
    assert result == [list(range(5000))]


# ---------------------------------------------------------------- async use


def test_async_client(scheduler):
    async def main():
        async with Client(scheduler.address, asynchronous=True) as client:
            future = client.submit(inc, 1)
            assert await future == 2
            assert await future.result() == 2
            # a future nobody else holds stays held while awaited
            assert await client.submit(inc, 10) == 11
            assert await client.submit(inc, 20).result() == 21
            assert isinstance(await client.submit(boom, 2).exception(), ZeroDivisionError)
            futures = client.map(inc, range(5))
            assert await client.gather(futures) == [1, 2, 3, 4, 5]
            seen = [f async for f in as_completed(futures)]
            assert set(seen) == set(futures)
            done, _ = await wait(futures)
            assert done == set(futures)
            bad = client.submit(boom, 1)
            with pytest.raises(ZeroDivisionError):
                await bad
            assert (await client.scheduler_info())["workers"]
        assert client.status == "closed"

    asyncio.run(asyncio.wait_for(main(), 30))


def test_await_a_sync_clients_future_from_another_loop(client):
    future = client.submit(inc, 41)

    async def main():
        return await future

    assert asyncio.run(main()) == 42
