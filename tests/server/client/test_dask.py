"""dask collections on distributed-core: dask.array, dask.dataframe and dask.delayed.

Every computation is checked against dask's own synchronous scheduler on the same
expression. The cluster is a real LocalCluster (a scheduler and two worker processes,
one thread each), started once for the module. Functions defined here travel by value
(`register_pickle_by_value`): the worker processes cannot import this module.

The first tests need no cluster: they check how a materialized graph is planned and
encoded (slices, frontier keys, annotations, keys).
"""
from __future__ import annotations

import gc
import io
import json
import os
import pickle
import statistics
import subprocess
import sys
import time

import cloudpickle
import pytest

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
dd = pytest.importorskip("dask.dataframe")
np = pytest.importorskip("numpy")
pd = pytest.importorskip("pandas")

from dask._task_spec import Task
from dask.delayed import Delayed
from server_helpers import wait_until_no_tasks, workers_of

from distributed_server.client import dask_graphs as dask_support
from distributed_server.client.client import Client, wait

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(180)


def inc(x):
    return x + 1


def add(*args):
    return sum(args)


def boom(block):
    raise ZeroDivisionError("boom in a block")


def worker_pid(block):
    """A block holding the pid of the process that computed it."""
    return np.full(block.shape, os.getpid(), dtype="int64")


def counted(block, path):
    """The block, after appending one byte to the file at ``path`` (counts executions)."""
    with open(path, "ab") as f:
        f.write(b"x")
    return block


def flaky(x, path, failures):
    """Fail the first ``failures`` calls, counted in the file at ``path``."""
    with open(path, "a+") as f:
        f.seek(0)
        calls = len(f.read())
        f.write("x")
    if calls < failures:
        raise RuntimeError(f"failure {calls + 1}")
    return x


# ---------------------------------------------------------------- fixtures


def same_as_sync(client, *collections):
    """Compute on the cluster (``client.get`` as the scheduler) and with dask's
    synchronous scheduler; return both."""
    ours = dask.compute(*collections, scheduler=client.get)
    theirs = dask.compute(*collections, scheduler="sync")
    return ours, theirs


def tree_graph(n_leaves: int) -> tuple[dict, tuple]:
    """A dict graph: ``n_leaves`` leaves and a pairwise sum tree over them (2n - 1
    tasks); returns it with the root key. Keys are nested tuples."""
    graph: dict = {("leaf", i): (inc, i) for i in range(n_leaves)}
    level = [("leaf", i) for i in range(n_leaves)]
    depth = 0
    while len(level) > 1:
        depth += 1
        nxt = []
        for j in range(0, len(level) - 1, 2):
            key = ("sum", (depth, j // 2))
            graph[key] = (add, level[j], level[j + 1])
            nxt.append(key)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return graph, level[0]


# ---------------------------------------------------------------- planning (no cluster)


def tasks_of(part: dask_support.SlicePart) -> list:
    """A slice's tasks as task dicts, whichever form it took: a spec part's as ``{"key",
    "deps", "order": its index, "node": its node unpickled}``."""
    if part.part is None:
        return part.tasks
    nodes = pickle.loads(part.part["blob"])
    deps = iter(part.part["deps"])
    tasks = []
    for i, (key, n) in enumerate(zip(part.part["keys"], part.part["ndeps"], strict=True)):
        task = {"key": key, "order": i, "node": nodes[i]}
        if n:
            task["deps"] = [next(deps) for _ in range(n)]
        tasks.append(task)
    assert next(deps, None) is None and len(nodes) == len(tasks)
    return tasks


def plan_of(graph: dict, wanted: list, **kwargs) -> dask_support.GraphPlan:
    options = kwargs.pop("options", {})
    return dask_support.GraphPlan(dask_support.materialize(graph), wanted, set(), options,
                                  **kwargs)


def test_plan_sends_dependencies_first_in_dask_order():
    graph, root = tree_graph(64)
    plan = plan_of(graph, [root])
    part = plan.encode_next()
    assert plan.done and part.keys == [root] and not part.temporary
    assert part.part is not None and not part.tasks  # one spec part
    seen = set()
    for task in tasks_of(part):
        assert all(dep in seen for dep in task.get("deps", ())), task["key"]
        assert task["node"].key == task["key"]
        seen.add(task["key"])
    assert seen == set(graph)
    order = dask.order.order(dask_support.materialize(graph).nodes)
    assert part.part["keys"] == sorted(order, key=order.__getitem__)
    # as task dicts (a graph with options), each carries its place in dask's order
    as_dicts = plan_of(graph, [root], options={"retries": 1}).encode_next()
    assert as_dicts.part is None
    assert [t["order"] for t in as_dicts.tasks] == sorted(order.values())
    assert [t["key"] for t in as_dicts.tasks] == part.part["keys"]


@pytest.mark.parametrize("numbers, placed", [
    ([2, 0, 1], True),  # dask.order's own numbering: each key goes to its place
    ([5, 0, 9], False),  # any other numbering: sorted by it
    ([1, 1, 0], False), ([-1, 0, 1], False), ([0.0, 1, 2], False)])
def test_the_sequence_follows_dask_order_however_it_numbers(numbers, placed):
    nodes = dict.fromkeys(["a", "b", "c"])
    order = dict(zip(nodes, numbers))
    sequence, position = dask_support._in_order(nodes, order)
    assert sorted(sequence, key=order.__getitem__) == sequence
    assert sorted(sequence) == ["a", "b", "c"]
    assert position == {key: i for i, key in enumerate(sequence)}
    assert (position is order) is placed


def test_a_plan_cut_at_held_keys_orders_what_is_left():
    graph, root = tree_graph(64)
    nodes = dask_support.materialize(graph)
    held = {key for key in graph if key[0] == "sum" and key[1][0] == 2}
    plan = dask_support.GraphPlan(nodes, [root], held, {})
    assert plan.external == held  # the graph is cut there
    part = plan.encode_next()
    keys = part.part["keys"]
    assert plan.done and root in keys and len(keys) == 15  # the sums above level 2
    seen = set()
    for task in tasks_of(part):
        assert all(dep in seen or dep in held for dep in task.get("deps", ()))
        seen.add(task["key"])


def test_slices_want_their_frontier_until_its_last_dependent_is_sent():
    graph, root = tree_graph(500)
    dependents: dict = {}
    for key, task in graph.items():
        for dep in task[1:]:
            if dep in graph:
                dependents.setdefault(dep, []).append(key)
    plan = plan_of(graph, [root], slice_tasks=100)
    sent, wanted, released = [], set(), []
    while not plan.done:
        part = plan.encode_next()
        tasks = tasks_of(part)
        assert len(tasks) <= 100 and part.n_tasks == len(tasks)
        for task in tasks:  # dependencies are in this slice or an earlier one
            assert all(dep in sent or dep in {t["key"] for t in tasks}
                       for dep in task.get("deps", ()))
        sent += [t["key"] for t in tasks]
        slice_keys = {t["key"] for t in tasks}
        assert set(part.temporary) <= slice_keys
        wanted |= set(part.temporary)
        for key in part.release:  # released once every dependent has been sent
            assert key in wanted and all(d in sent for d in dependents[key])
            wanted.discard(key)
            released.append(key)
        # a key sent without a dependent yet is wanted, or it would be forgotten
        for key in sent:
            if not all(d in sent for d in dependents.get(key, ())):
                assert key in wanted, key
    assert part.keys == [root] and not wanted
    assert len(sent) == len(graph) == 999 and released


def expression_of(*collections):
    """The expression (and keys) dask.compute hands a scheduler for ``collections``."""
    seen = {}

    def scheduler(expr, keys, **kwargs):
        seen.update(expr=expr, keys=keys)
        return [None] * len(keys)

    dask.compute(*collections, scheduler=scheduler)
    return seen["expr"], seen["keys"]


def test_annotations_become_task_fields():
    with dask.annotate(workers=["tcp://127.0.0.1:1"], allow_other_workers=True,
                       resources={"GPU": 1}, priority=5, retries=2, team="blue"):
        x = da.ones(10, chunks=5) + 1
    expr, keys = expression_of(x.sum())
    graph = dask_support.materialize(expr)
    plan = dask_support.GraphPlan(graph, keys, set(), {"retries": 1})
    tasks = plan.encode_next().tasks
    annotated = [t for t in tasks if t.get("resources")]
    assert annotated
    for task in annotated:
        assert task["workers"] == ["tcp://127.0.0.1:1"]
        assert task["allow_other_workers"] is True
        assert task["priority"] == 5 and task["retries"] == 2
        assert task["annotations"] == {"team": "blue"}


def test_keys_must_survive_msgpack():
    plan = plan_of({("x", 0, ("y", 1.5)): 1, b"raw": 2}, [("x", 0, ("y", 1.5)), b"raw"])
    assert {t["key"] for t in tasks_of(plan.encode_next())} == {("x", 0, ("y", 1.5)), b"raw"}
    # numpy scalars in keys (dask.array's vindex makes them) travel as plain numbers,
    # in the key and in the dependencies
    numpy_keys = plan_of({("x", np.int64(1)): 1, ("y", np.float64(0.5)): (inc, ("x", 1))},
                         [("y", np.float64(0.5))])
    tasks = {t["key"]: t for t in tasks_of(numpy_keys.encode_next())}
    assert all(type(part) in (str, int, float) for key in tasks for part in key)
    assert [type(p) for p in tasks[("y", 0.5)]["deps"][0]] == [str, int]
    bad = plan_of({("x", frozenset([1])): 1}, [("x", frozenset([1]))])
    with pytest.raises(TypeError, match="task key"):
        bad.encode_next()


@pytest.mark.parametrize("keys, plain", [
    ([], True), (["a", 1, 2.5, b"b"], True), ([("x", 1), ("y", 2)], True),
    (["a", ("x", 1, ("y", 1.5))], True), ([("x", 1), ("x", np.int64(2))], False),
    ([("x", frozenset())], False), (["a", None], False), ([("x", ("y", None))], False)])
def test_keys_that_survive_msgpack_are_told_apart_from_those_that_do_not(keys, plain):
    assert dask_support._all_plain(keys) is plain


def test_specs_of_importable_functions_use_the_standard_pickler():
    pickler = dask_support.SpecPickler()
    nodes = dask_support.materialize({"a": 1, "b": (np.negative, "a"),
                                      "c": (inc, "b")}).nodes
    assert b"__main__" not in pickler.dumps(nodes["b"])
    assert pickler.by_value == 0
    spec = pickler.dumps(nodes["c"])  # this module is registered by value
    assert pickler.by_value == 1
    assert pickle.loads(spec)({"b": 1}) == 2


def test_specs_of_wrapped_numpy_functions_leave_numpy_docstrings_behind():
    # dask.array's ones/full/... are toolz curries carrying numpy's docstring: 2 KB a task
    graph = dask_support.materialize((da.ones(4, chunks=1) + 1).sum()).nodes
    ones = [node for key, node in graph.items() if key[0].startswith("ones")]
    curry = ones[0].func.func
    assert len(curry.__doc__) > 1000
    pickler = dask_support.SpecPickler()
    specs = [pickler.dumps(node) for node in ones]
    assert all(len(spec) < 1000 for spec in specs), [len(spec) for spec in specs]
    assert curry.__doc__.encode()[:100] not in specs[0]
    rebuilt = pickle.loads(specs[1])
    assert rebuilt.func.func.__name__ == curry.__name__
    np.testing.assert_array_equal(rebuilt({}), np.ones(1))
    assert pickler.by_value == 0


def test_task_nodes_pickle_to_the_bytes_of_the_default_reduction():
    # the Task reducer reads the state in one C call; what it writes must not change
    graph = dask_support.materialize((da.ones(8, chunks=2) + 1).sum()).nodes
    pickler = dask_support.SpecPickler()
    assert Task in pickler._plain.dispatch_table
    for key, node in graph.items():
        default = io.BytesIO()
        plain = pickle.Pickler(default, protocol=5)
        plain.dispatch_table = {
            typ: reduce for typ, reduce in pickler._plain.dispatch_table.items()
            if typ is not Task}
        plain.dump(node)
        assert pickler.dumps(node) == default.getvalue(), key
    total = [key for key in graph if key[0].startswith("sum-aggregate")][0]
    assert pickle.loads(pickler.dumps(graph[total])).key == graph[total].key


# ---------------------------------------------------------------- dask.array


@pytest.fixture(scope="module")
def arrays():
    state = da.random.RandomState(42)
    return state.random((300, 200), chunks=(50, 40)), state.random((200, 120), chunks=(40, 60))


@pytest.mark.parametrize("name, make", [
    ("elementwise", lambda x, y: np.sin(x) * 2 + x ** 2 - 1),
    ("sum-axis0", lambda x, y: x.sum(axis=0)),
    ("mean-axis1", lambda x, y: x.mean(axis=1)),
    ("max-all", lambda x, y: x.max()),
    ("std", lambda x, y: x.std(axis=0)),
    ("transpose", lambda x, y: x.T + 1),
    ("matmul", lambda x, y: x @ y),
    ("rechunk", lambda x, y: x.rechunk((300, 10)) + 0),
    ("slicing", lambda x, y: x[10:250:3, ::-2][5:, [1, 4, 7]]),
    ("cumsum", lambda x, y: x.cumsum(axis=1)),
])
def test_array(client, arrays, name, make):
    ours, theirs = same_as_sync(client, make(*arrays))
    np.testing.assert_array_equal(ours[0], theirs[0])


def test_array_through_compute_and_the_default_scheduler(client, arrays):
    x, y = arrays
    expected = (x @ y).sum(axis=1).compute(scheduler="sync")
    future = client.compute((x @ y).sum(axis=1))
    np.testing.assert_array_equal(future.result(), expected)
    assert dask.config.get("scheduler") == "distributed-core"  # finds the default client
    np.testing.assert_array_equal((x @ y).sum(axis=1).compute(), expected)  # no scheduler=
    first, second = client.compute([x.sum(), y.sum()])
    assert (first.result(), second.result()) == dask.compute(x.sum(), y.sum(), scheduler="sync")
    assert client.compute([x.sum(), 7], sync=True) == [first.result(), 7]
    assert dask.compute(x.sum(), scheduler=client)[0] == first.result()  # the client itself


def test_graphs_in_the_lean_order_compute_as_in_dask_order(client, arrays, monkeypatch):
    """With ``dcore.client.lean-order-tasks`` at 0 every graph gets the lean order
    (the order of graphs over a million tasks)."""
    x, y = arrays
    ordered = []
    lean = dask_support.LeanOrder
    monkeypatch.setattr(dask_support, "LeanOrder",
                        lambda nodes: ordered.append(len(nodes)) or lean(nodes))
    collections = ((x @ y).sum(axis=1), (x - x.mean(axis=0)).std(axis=1))
    with dask.config.set({"dcore.client.lean-order-tasks": 0}):
        ours, theirs = same_as_sync(client, *collections)
    assert ordered and ordered[0] > 100
    for mine, dasks in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(mine, dasks)


def test_the_default_scheduler_is_undone_on_close(cluster):
    before = dask.config.get("scheduler", None)
    with Client(cluster):
        assert dask.config.get("scheduler") == "distributed-core"  # a name, not the client
        assert dask.config.get("dataframe.shuffle.method") == "tasks"
    assert dask.config.get("scheduler", None) is before
    with Client(cluster, set_as_default=False):
        assert dask.config.get("scheduler", None) is before


# ---------------------------------------------------------------- dask.dataframe


@pytest.fixture(scope="module")
def frames():
    rng = np.random.default_rng(7)
    left = pd.DataFrame({"id": rng.integers(0, 50, 2000), "x": rng.random(2000),
                         "name": rng.choice(list("abcdef"), 2000)})
    right = pd.DataFrame({"id": np.arange(50), "y": rng.random(50)})
    return dd.from_pandas(left, npartitions=8), dd.from_pandas(right, npartitions=3)


def assert_same_frame(ours, theirs):
    if isinstance(theirs, (pd.DataFrame, pd.Series)):
        pd.testing.assert_frame_equal(pd.DataFrame(ours), pd.DataFrame(theirs))
    else:
        assert ours == theirs


@pytest.mark.parametrize("name, make", [
    ("from_pandas", lambda l, r: l),
    ("groupby-sum", lambda l, r: l.groupby("name").x.sum()),
    ("groupby-agg", lambda l, r: l.groupby("id").agg({"x": ["mean", "max", "count"]})),
    ("merge", lambda l, r: l.merge(r, on="id", how="inner")),
    ("merge-reduce", lambda l, r: l.merge(r, on="id").assign(z=lambda d: d.x * d.y).z.sum()),
    ("set_index", lambda l, r: l.set_index("x")),
    ("value_counts", lambda l, r: l.name.value_counts()),
])
def test_dataframe(client, frames, name, make):
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        ours, theirs = same_as_sync(client, make(*frames))
    assert_same_frame(ours[0], theirs[0])


def test_task_based_shuffle(client, frames):
    left, _ = frames
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        shuffled = left.shuffle(on="name", npartitions=5)
        ours, theirs = same_as_sync(client, shuffled, shuffled.x.sum())
        parts, expected = same_as_sync(client, *shuffled.to_delayed())
    assert_same_frame(ours[0], theirs[0])
    assert ours[1] == theirs[1]
    for part, other in zip(parts, expected):
        pd.testing.assert_frame_equal(part, other)
    names = [name for part in parts for name in set(part.name)]
    assert sorted(names) == sorted(set(left.name.compute(scheduler="sync")))  # each once


def test_timeseries_pipeline(client):
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        ts = dask.datasets.timeseries(start="2000-01-01", end="2000-01-15", freq="10min",
                                      partition_freq="1D", seed=1)
        result = (ts[ts.x > 0].assign(xy=ts.x * ts.y)
                  .groupby("name").agg({"xy": "sum", "id": "count"}))
        everything = ts.shuffle(on="id").map_partitions(len).sum()
        ours, theirs = same_as_sync(client, result, everything)
    assert_same_frame(ours[0], theirs[0])
    assert ours[1] == theirs[1] == 14 * 24 * 6


# ---------------------------------------------------------------- dask.delayed


def test_delayed_dag_with_a_shared_dependency(client, tmp_path):
    path = str(tmp_path / "calls")
    shared = dask.delayed(flaky)(10, path, 0)  # counts its runs, never fails
    left = dask.delayed(inc)(shared)
    right = dask.delayed(add)(shared, 5)
    total = dask.delayed(add)(left, right, shared)
    assert dask.compute(total, left, scheduler=client.get) == (36, 11)
    assert os.path.getsize(path) == 1  # the shared task ran once


def test_futures_inside_delayed(client):
    future = client.submit(inc, 1)
    assert dask.delayed(inc)(future).compute(scheduler=client.get) == 3
    assert dask.delayed(sum)([future, future, 1]).compute(scheduler=client.get) == 5
    assert dask.delayed(add)(future, dask.delayed(inc)(future)).compute() == 5


# ---------------------------------------------------------------- persist


def test_persist_then_a_second_computation_reuses_the_results(client, tmp_path):
    path = tmp_path / "calls"
    path.touch()
    x = da.arange(1000, chunks=100).map_blocks(counted, str(path), dtype="int64",
                                               meta=np.array((), dtype="int64"))
    assert os.path.getsize(path) == 0
    persisted = client.persist(x)
    assert type(persisted) is type(x) and persisted.chunks == x.chunks
    futures = list(persisted.__dask_graph__().values())
    assert len(futures) == 10 and all(f.key[0] == x.name for f in futures)
    wait(futures)
    assert os.path.getsize(path) == 10
    assert set(client.who_has(futures)) == {f.key for f in futures}
    total = (persisted * 2).sum()
    assert total.compute(scheduler=client.get) == 2 * sum(range(1000))
    assert int(persisted[::7].sum().compute()) == sum(range(0, 1000, 7))
    assert os.path.getsize(path) == 10  # nothing was recomputed
    del persisted, futures, total
    wait_until_no_tasks(client)  # the collections held the results


def test_persist_a_list_and_dask_persist_with_the_default_client(client, frames):
    left, _ = frames
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        grouped = left.groupby("name").x.sum()
        p_left, p_grouped = client.persist([left, grouped])
        (p_again,) = dask.persist(left.x + 1)  # through Client.persist
    pd.testing.assert_frame_equal(p_left.compute(), left.compute(scheduler="sync"))
    pd.testing.assert_series_equal(p_grouped.compute(), grouped.compute(scheduler="sync"))
    pd.testing.assert_series_equal(p_again.compute(), (left.x + 1).compute(scheduler="sync"))


# ---------------------------------------------------------------- errors, annotations, keys


def test_an_exception_in_a_task_is_raised_on_the_client(client):
    x = da.ones(100, chunks=10).map_blocks(boom, dtype=float)
    with pytest.raises(ZeroDivisionError, match="boom in a block") as info:
        x.sum().compute(scheduler=client.get)
    assert "Remote traceback" in str(info.value.__cause__)
    future = client.compute(x.sum())
    with pytest.raises(ZeroDivisionError):
        future.result()


def test_workers_annotation_places_tasks(client):
    first, second = workers_of(client)
    for i, address in enumerate([first, second]):
        with dask.annotate(workers=[address]):
            x = da.zeros(40, chunks=4).map_blocks(worker_pid, dtype="int64", name=f"pid-{i}")
        persisted = client.persist(x)
        futures = list(persisted.__dask_graph__().values())
        wait(futures)
        assert set(client.who_has(futures).values()) == {(address,)}
        pids = set(persisted.compute(scheduler=client.get))
        assert len(pids) == 1 and pids != {os.getpid()}
    del persisted, futures


def test_resources_and_allow_other_workers_annotations(client):
    with dask.annotate(resources={"GPU": 1}):  # no worker of this cluster has a GPU
        stuck = dask.delayed(inc)(1, dask_key_name="needs-a-gpu")
    future = client.compute(stuck)
    deadline = time.monotonic() + 10
    while client.scheduler_info()["task_counts"].get("no-worker", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert future.status == "pending"
    future.release()
    with dask.annotate(workers=["no-such-worker"], allow_other_workers=True):
        loose = dask.delayed(inc)(1)
    assert loose.compute(scheduler=client.get) == 2


def test_retries_annotation(client, tmp_path):
    path = str(tmp_path / "calls")
    with dask.annotate(retries=2):
        value = dask.delayed(flaky)(7, path, 2)
    assert value.compute(scheduler=client.get) == 7
    with pytest.raises(RuntimeError, match="failure 1"):
        dask.delayed(flaky)(7, str(tmp_path / "other"), 2).compute(scheduler=client.get)


def test_nested_tuple_keys_round_trip(client):
    graph = {("x", 0, ("part", 1)): 1, ("y", 2): (inc, ("x", 0, ("part", 1))),
             "z": (add, ("y", 2), ("x", 0, ("part", 1))), 7: (inc, "z")}
    assert client.get(graph, [[("y", 2)], "z", 7]) == [[2], 3, 4]
    futures = client.compute([Delayed(("y", 2), graph), Delayed(7, graph)])
    assert [f.key for f in futures] == [("y", 2), 7]
    assert client.gather(futures) == [2, 4]
    x = da.ones((4, 4), chunks=2)
    persisted = client.persist(x)
    assert set(persisted.__dask_graph__()) == {(x.name, i, j) for i in (0, 1) for j in (0, 1)}
    assert all(f.key == k for k, f in persisted.__dask_graph__().items())


def test_async_client_compute_and_persist(cluster):
    import asyncio

    async def main():
        async with Client(cluster, asynchronous=True, set_as_default=False) as client:
            x = da.arange(100, chunks=10)
            assert await client.compute(x.sum()) == 4950
            persisted = client.persist(x + 1)
            assert await client.gather(client.compute(persisted.sum())) == 5050
            assert await client.get({"a": 1, "b": (inc, "a")}, "b") == 2

    asyncio.run(asyncio.wait_for(main(), 60))


def test_without_dask_only_the_dask_methods_fail(client, monkeypatch):
    monkeypatch.setattr(dask_support, "_dask_found", False)
    monkeypatch.setitem(sys.modules, "dask", None)  # import dask -> ImportError
    with pytest.raises(ImportError, match=r'pip install "distributed-core\[dask\]"'):
        client.compute(object())
    with pytest.raises(ImportError, match=r"distributed-core\[dask\]"):
        client.persist(object())
    assert client.get({"a": 1, "b": (inc, "a")}, "b") == 2  # the dask-free converter
    assert client.submit(inc, 1).result() == 2


# ---------------------------------------------------------------- large graphs


def test_slice_sizes_follow_the_scheduler_rate(monkeypatch):
    monkeypatch.setattr(dask_support, "SLICE_TASKS", 10_000)
    graph, root = tree_graph(20_000)
    plan = plan_of(graph, [root])
    assert plan.sliced and plan.slice_tasks == dask_support.SLICE_FIRST_TASKS
    plan.adapt(2000, 0.01)  # 200,000 tasks/s: up to the largest size
    plan.adapt(2000, 0.01)
    assert plan.slice_tasks == dask_support.SLICE_MAX_TASKS < 10_000
    for _ in range(10):
        plan.adapt(plan.slice_tasks, plan.slice_tasks / 10_000)  # 10,000 tasks/s
    assert abs(plan.slice_tasks - 1000) < 50
    plan.adapt(1000, 100.0)
    assert plan.slice_tasks >= dask_support.SLICE_MIN_TASKS
    small, small_root = tree_graph(100)
    assert not plan_of(small, [small_root]).sliced


def test_a_graph_in_many_slices(client, monkeypatch):
    monkeypatch.setattr(dask_support, "SLICE_TASKS", 97)
    graph, root = tree_graph(2000)
    plan = plan_of(graph, [root])
    assert plan.sliced and plan.slice_tasks == 97
    assert client.get(graph, root) == sum(range(1, 2001))
    x = da.arange(5000, chunks=10)
    assert x.sum().compute() == sum(range(5000))
    wait_until_no_tasks(client)


def spec_parts_held(dask_worker) -> int:
    return len(dask_worker.spec_parts)


def test_a_graph_goes_in_spec_parts_that_workers_drop_once_its_tasks_are_gone(
        client, monkeypatch):
    """A sliced dask.array graph goes as spec parts (each slice's specs pickled
    together); the workers hold the parts of the tasks they ran while the scheduler holds
    those tasks, and drop them once it has forgotten them."""
    monkeypatch.setattr(dask_support, "SLICE_TASKS", 97)
    kinds: list = []
    message = dask_support.SlicePart.message

    def recorded(part):
        kinds.append(part.part is not None)
        return message(part)

    monkeypatch.setattr(dask_support.SlicePart, "message", recorded)
    x = da.arange(3000, chunks=3) * 2
    y = client.persist(x)
    n_parts = len(kinds)  # each held by a worker or two, while y is
    assert y.sum().compute() == 2 * sum(range(3000))
    assert n_parts > 5 and len(kinds) > n_parts and all(kinds), kinds
    held = client.run(spec_parts_held)
    assert sum(held.values()) >= n_parts, held
    del y
    wait_until_no_tasks(client)
    deadline = time.monotonic() + 10
    while any(client.run(spec_parts_held).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.run(spec_parts_held) == dict.fromkeys(held, 0)


def test_the_collector_stays_paused_from_the_first_slice_to_the_last(client, monkeypatch):
    """Resumed between slices, the automatic collector walked the graph's objects again
    and again; it is back on once the graph is sent."""
    monkeypatch.setattr(dask_support, "SLICE_TASKS", 97)
    adapt = dask_support.GraphPlan.adapt
    collecting: list = []

    def recorded(plan, *args):  # a slice answered: between two slices
        collecting.append(gc.isenabled())
        return adapt(plan, *args)

    monkeypatch.setattr(dask_support.GraphPlan, "adapt", recorded)
    assert gc.isenabled()
    graph, root = tree_graph(2000)
    assert client.get(graph, root) == sum(range(1, 2001))  # sent, then gathered
    assert da.arange(5000, chunks=10).sum().compute() == sum(range(5000))
    assert len(collecting) > 10 and not any(collecting), collecting
    assert gc.isenabled()
    wait_until_no_tasks(client)


class Unpicklable:
    """An argument that cannot be pickled."""

    def __reduce__(self):
        raise TypeError("this argument cannot be pickled")


def add_all(values, _unused):
    return sum(values)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_graph_whose_later_slice_fails_leaves_nothing_behind(cluster, client, monkeypatch,
                                                               asynchronous):
    """The first slices went out (their keys wanted by the client) when a later one
    cannot be pickled: the user gets that error, every future of the graph fails with
    it (an earlier slice's result arriving later does not change that) and the
    scheduler ends up holding nothing of the graph."""
    monkeypatch.setattr(dask_support, "SLICE_TASKS", 20)
    graph: dict = {("x", i): (inc, i) for i in range(100)}
    graph["total"] = (add_all, [("x", i) for i in range(100)], Unpicklable())
    wanted = [("x", i) for i in range(100)] + ["total"]
    if not asynchronous:
        with pytest.raises(TypeError, match="cannot be pickled") as info:
            client.get(graph, wanted)
        if sys.version_info >= (3, 11):  # exception notes
            assert any("tasks had gone to the scheduler" in n for n in info.value.__notes__)
        del info
    else:
        import asyncio

        async def main():
            async with Client(cluster, asynchronous=True, set_as_default=False) as aclient:
                # what persist does: the futures at once, the graph sent in the background
                futures = aclient._graphs.submit(graph, wanted, {})
                with pytest.raises(TypeError, match="cannot be pickled"):
                    await aclient.gather(futures)
                # the scheduler's answer showing nothing held comes after every result
                # it sent this client: a late result has been read by then
                while (await aclient.scheduler_info())["n_tasks"]:
                    await asyncio.sleep(0.05)
                assert all(f.status == "error" for f in futures)
                del futures

        asyncio.run(asyncio.wait_for(main(), 60))
    wait_until_no_tasks(client)
    assert client.get(tree_graph(50)[0], ("leaf", 3)) == 4  # the client still works


# Another client, in its own process: round trips to the scheduler (an empty who-has)
# and through a worker (submit with a high priority: at default priority a new task
# waits, first in first out, behind the queued tasks of the big graph, as in
# dask.distributed). One JSON line per sample; stops when stdin closes.
MEASURER = """
import json, operator, sys, threading, time
from distributed_server.client.client import Client
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with Client(sys.argv[1], set_as_default=False) as client:
    print("ready", flush=True)
    i = 0
    while not stop.is_set():
        start = time.time()
        client.who_has([])
        middle = time.time()
        assert client.submit(operator.neg, i, pure=False, priority=100).result() == -i
        print(json.dumps([start, middle - start, time.time() - middle]), flush=True)
        i += 1
        time.sleep(0.01)
"""


def test_large_graph_does_not_stall_the_scheduler(cluster, client):
    """A 200,000-task graph goes in slices while another client keeps making round
    trips to the scheduler; the slowest one stays short."""
    graph, root = tree_graph(100_000)
    assert len(graph) == 199_999
    other = subprocess.Popen([sys.executable, "-c", MEASURER, cluster.scheduler_address],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **cluster.security.environment()})
    try:
        assert other.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        start = time.time()
        future = client.compute(Delayed(root, graph))
        sent = time.time()
        client.who_has([])  # answered once the scheduler has taken in every slice
        ingested = time.time()
    finally:
        out, _ = other.communicate("", timeout=60)
    future.release()
    samples = [json.loads(line) for line in out.splitlines()]
    during = [s for s in samples if start <= s[0] <= ingested]
    scheduler_rt = [s[1] for s in during]
    submit_rt = [s[2] for s in during]
    compiled = client.scheduler_info()["compiled"]
    print(f"\n200k-task graph (scheduler core {'compiled' if compiled else 'interpreted'}): "
          f"compute() returned after {sent - start:.1f} s, scheduler had "
          f"it all after {ingested - start:.1f} s; another client meanwhile "
          f"({len(during)} samples): who_has round trip median "
          f"{1e3 * statistics.median(scheduler_rt):.0f} ms, max "
          f"{1e3 * max(scheduler_rt):.0f} ms; submit(priority=100).result() median "
          f"{1e3 * statistics.median(submit_rt):.0f} ms, max {1e3 * max(submit_rt):.0f} ms")
    assert len(during) >= 5
    assert max(scheduler_rt) < 2.0
    assert max(submit_rt) < 3.0
    wait_until_no_tasks(client, timeout=60)
