"""The lean order of a big dask graph (`distributed_server.client.lean_order`).

Checked on random graphs (hypothesis): every task gets one place from 0 to n - 1, after
all of its dependencies inside the graph. Checked on real dask graphs against
``dask.order``: run one task at a time in the lean order, no graph holds more results at
once than in dask's order. The same tests run compiled and interpreted.
"""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import distributed_core
from distributed_server.client import lean_order as lean_module
from distributed_server.client.lean_order import LeanOrder, lean_order


def node(*dependencies):
    return SimpleNamespace(dependencies=frozenset(dependencies))


def assert_a_valid_order(nodes: dict, places: dict) -> None:
    assert set(places) == set(nodes)
    assert sorted(places.values()) == list(range(len(nodes)))
    for key, n in nodes.items():
        for dep in n.dependencies:
            if dep in nodes:
                assert places[dep] < places[key], (dep, key)


@st.composite
def dags(draw):
    """A random DAG: task i may depend on any earlier task and on keys outside it;
    its keys are shuffled, so the dict's order is not a topological order."""
    n = draw(st.integers(0, 60))
    keys = draw(st.permutations([("t", i) for i in range(n)]))
    nodes = {}
    for i, key in enumerate(keys):
        deps = draw(st.sets(st.integers(0, max(i - 1, 0)), max_size=min(i, 5))) if i else set()
        outside = draw(st.sets(st.sampled_from(["gone", ("held", 1)]), max_size=1))
        nodes[key] = node(*(keys[j] for j in deps), *outside)
    order = draw(st.permutations(list(nodes)))
    return {key: nodes[key] for key in order}


@settings(max_examples=300, deadline=None)
@given(dags())
def test_every_task_gets_one_place_after_its_dependencies(nodes):
    assert_a_valid_order(nodes, lean_order(nodes))


_SAME_ORDER_SCRIPT = """
import os
import subprocess
import sys
from types import SimpleNamespace
from distributed_server.client.lean_order import LeanOrder, lean_order
nodes = {f"x{i}": SimpleNamespace(dependencies=frozenset(f"x{j}" for j in range(i))) for i in range(8)}
nodes.update({f"y{i}": SimpleNamespace(dependencies=frozenset({f"x{i % 8}", f"x{7 - i % 8}", "out"}))
              for i in range(40)})
print(sorted(nodes, key=lean_order(nodes).__getitem__))
"""


def test_the_same_graph_gets_the_same_order_whatever_the_hash_seed():
    """The order follows the graph's dict, not how its sets of dependencies iterate
    (str hashes differ between processes)."""
    orders = [subprocess.run([sys.executable, "-c", _SAME_ORDER_SCRIPT], check=True,
                             capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
              for seed in ("1", "2", "3")]
    assert orders[0] and orders[0] == orders[1] == orders[2]


def test_a_task_with_many_dependencies():
    """A task that depends on 50,000 others (``delayed(sum)`` of a long list): their
    numbers are sorted in n log n, not by insertion."""
    nodes = {("x", i): node() for i in range(50_000)}
    nodes["total"] = node(*reversed(list(nodes)))
    places = lean_order(nodes)
    assert_a_valid_order(nodes, places)
    assert places["total"] == len(nodes) - 1


def test_a_chain_and_a_lone_task():
    nodes = {"c": node("b"), "b": node("a"), "a": node(), "alone": node()}
    places = lean_order(nodes)
    assert_a_valid_order(nodes, places)
    assert places["a"] < places["b"] < places["c"]


@pytest.mark.parametrize("nodes", [
    {"a": node("b"), "b": node("a")},  # no output, no root
    {"out": node("a"), "a": node("b"), "b": node("a"), "root": node()},
    {"self": node("self"), "other": node()},
])
def test_a_cycle_is_refused(nodes):
    with pytest.raises(ValueError, match="cycle"):
        lean_order(nodes)


def test_an_empty_graph():
    assert lean_order({}) == {}


def test_a_compiled_install_has_the_compiled_lean_order():
    if not distributed_core.COMPILED:
        pytest.skip("interpreted install: no extensions")
    assert lean_module.COMPILED


# ------------------------------------------------------------- beside dask.order


def peak_live(nodes: dict, places: dict) -> int:
    """The most results held at once running the tasks one by one in ``places``' order,
    each held until its last dependent has run."""
    uses = dict.fromkeys(nodes, 0)
    for n in nodes.values():
        for dep in n.dependencies:
            if dep in uses:
                uses[dep] += 1
    live = peak = 0
    for key in sorted(nodes, key=places.__getitem__):
        live += 1
        peak = max(peak, live)
        for dep in nodes[key].dependencies:
            if dep in uses:
                uses[dep] -= 1
                live -= uses[dep] == 0
    return peak


def dask_cases():
    """Collections whose graphs differ in shape: reductions, a matrix product (every
    chunk used many times), rechunking, a mean that every row needs, dataframe groupby
    and shuffle."""
    da = pytest.importorskip("dask.array")
    dd = pytest.importorskip("dask.dataframe")
    np = pytest.importorskip("numpy")
    pd = pytest.importorskip("pandas")
    x = da.random.RandomState(0).random((200, 200), chunks=20)
    df = dd.from_pandas(pd.DataFrame({"a": np.arange(4000) % 97, "b": np.arange(4000.0)}),
                        npartitions=32)
    return {
        "sum": lambda: (da.ones(2000, chunks=1) + 1).sum(),
        "matmul": lambda: (x.T @ x).sum(),
        "rechunk": lambda: x.rechunk((200, 5)).sum(axis=1),
        "mean-std": lambda: (x - x.mean(axis=0)).std(axis=1).sum(),
        "groupby": lambda: df.groupby("a").b.sum(),
        "shuffle": lambda: df.shuffle("a").map_partitions(len).sum(),
    }


@pytest.mark.parametrize("name", ["sum", "matmul", "rechunk", "mean-std", "groupby",
                                  "shuffle"])
def test_no_more_results_held_at_once_than_in_dask_order(name):
    pytest.importorskip("dask")
    import dask
    import dask.order

    from distributed_server.client.dask_graphs import materialize

    collection = dask_cases()[name]()
    graph = materialize(dask.base.collections_to_expr([collection]).optimize()).nodes
    ours = lean_order(graph)
    assert_a_valid_order(graph, ours)
    assert peak_live(graph, ours) <= peak_live(graph, dask.order.order(graph))


def _inc(x):
    return x + 1


def _add(*args):
    return sum(args)


@pytest.mark.parametrize("held", [set(), {("leaf", 3), ("sum", 1, 0)}])
def test_a_plan_in_the_lean_order_is_the_plan_of_that_order(monkeypatch, held):
    """Above ``dcore.client.lean-order-tasks`` tasks a plan takes the lean order and
    what it found on the way (keys and nodes by place, last uses, external
    dependencies); they must be what the plan finds itself from those places."""
    pytest.importorskip("dask")
    import dask

    from distributed_server.client import dask_graphs

    graph = {("leaf", i): (_inc, i) for i in range(40)}
    graph.update({("sum", 1, j): (_add, *[("leaf", i) for i in range(j, 40, 8)])
                  for j in range(8)})
    graph["total"] = (_add, *[("sum", 1, j) for j in range(8)])
    graph["other"] = (_add, ("leaf", 0), ("leaf", 39))
    wanted = ["total", "other"]

    def plan(threshold):
        materialized = dask_graphs.materialize(graph)
        with dask.config.set({"dcore.client.lean-order-tasks": threshold}):
            return dask_graphs.GraphPlan(materialized, wanted, held, {})

    made = []
    monkeypatch.setattr(dask_graphs, "LeanOrder",
                        lambda nodes: made.append(len(nodes)) or LeanOrder(nodes))
    monkeypatch.setattr(dask_graphs, "dask_priorities", lean_order)
    lean, own = plan(0), plan(10**9)
    assert made == [len(lean.sequence)]  # only the first plan made a LeanOrder
    assert lean.sequence == own.sequence
    assert lean.in_order == own.in_order
    assert list(lean.last_use) == list(own.last_use)
    assert lean.external == own.external == held
    assert lean._wanted_at == own._wanted_at
