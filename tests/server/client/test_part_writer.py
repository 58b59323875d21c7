"""The compiled part writer (`distributed_server.client._part_writer`): a slice of dask
nodes written as one pickle without the pickler's Python callbacks.

What ``pickle.loads`` makes of its bytes must be what it makes of the standard
pickler's: the same node classes, slots and values (checked structurally, `same`), the
same results when the nodes run, the same sharing of mutable objects. Where the writer
cannot write a slice, `SpecPickler.dumps_together` falls back to the pickler.

The writer is compiled only: an interpreted install has none (those tests skip there;
a compiled install without it fails).
"""
from __future__ import annotations

import functools
import math
import operator
import pickle
import sys
import threading

import cloudpickle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distributed_core

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
dd = pytest.importorskip("dask.dataframe")
np = pytest.importorskip("numpy")
pd = pytest.importorskip("pandas")

from dask._task_spec import Alias, DataNode, GraphNode, List, Task, TaskRef
from dask.base import collections_to_expr

from distributed_server.client import spec_pickler
from distributed_server.client.dask_graphs import materialize

cloudpickle.register_pickle_by_value(sys.modules[__name__])

needs_writer = pytest.mark.skipif(
    spec_pickler.PartWriter is None,
    reason="the part writer is compiled; this install is interpreted")


def test_a_compiled_install_has_the_part_writer():
    if not distributed_core.COMPILED:
        pytest.skip("interpreted install: no extensions")
    assert spec_pickler.PartWriter is not None


def same(x, y) -> bool:
    """Structural equality of what two unpicklings made (functions and other objects
    without a useful ``==`` compared by their standard pickle)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, GraphNode):
        return all(same(getattr(x, slot, None), getattr(y, slot, None))
                   for slot in x.get_all_slots())
    if type(x) in (tuple, list):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    if type(x) is dict:
        return list(x) == list(y) and all(same(x[k], y[k]) for k in x)
    if type(x) is float:
        return ((x == y and math.copysign(1, x) == math.copysign(1, y))
                or (math.isnan(x) and math.isnan(y)))
    if type(x) in (int, str, bytes, bool, type(None), frozenset, set, slice):
        return x == y
    return pickle.dumps(x) == pickle.dumps(y)


def written(nodes: list) -> bytes:
    pickler = spec_pickler.SpecPickler()
    writer = pickler._part_writer()
    assert writer is not None
    return writer.write(nodes)


def standard(nodes: list) -> bytes:
    pickler = spec_pickler.SpecPickler()
    return spec_pickler._pickled(pickler._plain_buffer, pickler._plain, nodes)


def optimized(collection) -> tuple[dict, list]:
    """The nodes dask hands a scheduler for ``collection``, and the keys it wants."""
    expr = collections_to_expr([collection], optimize_graph=True).optimize()
    return materialize(expr.__dask_graph__()).nodes, flatten(expr.__dask_keys__())


def run(nodes: dict, wanted):
    """The value of ``wanted``, each node called with its dependencies' values."""
    values: dict = {}

    def value(key):
        if key not in values:
            node = nodes[key]
            values[key] = node({dep: value(dep) for dep in node.dependencies})
        return values[key]

    return value(wanted)


def collections():
    x = da.arange(60, chunks=7).reshape(6, 10).rechunk((4, 3))
    frame = dd.from_pandas(pd.DataFrame({"k": np.arange(40) % 3, "v": np.arange(40.0)}),
                           npartitions=4)
    return {
        "array reduction": (da.ones(40, chunks=3) + 1).sum(),
        "array slicing and rechunking": (x[1:5, ::2] * 2.5).T.rechunk(2).mean(axis=0),
        "dataframe groupby": frame.groupby("k").v.sum(),
        "dataframe shuffle": frame.shuffle("k").v.cumsum(),
        "delayed containers": dask.delayed(dict)(
            a=[dask.delayed(sum)([1, 2, 3]), {"b": (4, 5.5)}], c={1, 2}, d=slice(1, None)),
    }


@needs_writer
@pytest.mark.parametrize("name", list(collections()))
def test_dask_graphs_load_as_the_standard_pickle_loads_them_and_compute_the_same(name):
    collection = collections()[name]
    nodes, outputs = optimized(collection)
    keys = list(nodes)
    ours = pickle.loads(written([nodes[k] for k in keys]))
    theirs = pickle.loads(standard([nodes[k] for k in keys]))
    assert len(ours) == len(keys)
    for key, a, b in zip(keys, ours, theirs):
        assert same(a, b), key
    assert outputs
    for wanted in outputs:
        assert_equal(run(dict(zip(keys, ours)), wanted), run(nodes, wanted))


def flatten(keys) -> list:
    return [k for item in keys for k in flatten(item)] if isinstance(keys, list) else [keys]


def assert_equal(a, b):
    if isinstance(b, (pd.Series, pd.DataFrame)):
        assert a.equals(b)
    elif isinstance(b, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text()
    | st.text(min_size=250, max_size=300) | st.binary(max_size=300)
    | st.builds(slice, st.integers(), st.none()),
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.tuples(inner, inner, inner, inner)
                   | st.dictionaries(st.text(max_size=5), inner, max_size=3)
                   | st.frozensets(st.integers(), max_size=4)
                   | st.sets(st.text(max_size=3), max_size=4)),
    max_leaves=12)


@needs_writer
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=st.lists(values, max_size=3), kwargs=st.dictionaries(st.text(max_size=4), values,
                                                                 max_size=2),
       data=values)
def test_random_values_in_task_nodes_round_trip(args, kwargs, data):
    nodes = [Task(("x", 1), repr, *args, **kwargs), DataNode(("y", 2), data),
             Task("z", sorted, List(TaskRef(("x", 1)), Alias(("y", 2)))),
             Alias("w", ("x", 1))]
    ours = pickle.loads(written(nodes))
    theirs = pickle.loads(standard(nodes))
    for a, b in zip(ours, theirs):
        assert same(a, b)


@needs_writer
@pytest.mark.parametrize("number", [0, 1, 255, 256, 65535, 65536, -1, -256, -2**31, 2**31 - 1,
                                    2**31, -2**31 - 1, 2**40, -2**40, 2**63 - 1, -2**63,
                                    2**63, -2**63 - 1, 10**30])
def test_integers_of_every_width_round_trip(number):
    (node,) = pickle.loads(written([DataNode("n", number)]))
    assert node.value == number and type(node.value) is int


@needs_writer
def test_mutable_objects_stay_shared_and_cycles_survive():
    shared = [1, 2]
    table = {"k": shared}
    cyclic: list = []
    cyclic.append(cyclic)
    a, b, c = pickle.loads(written([Task("a", len, shared), Task("b", len, shared, table),
                                    DataNode("c", cyclic)]))
    assert a.args[0] is b.args[0] is b.args[1]["k"]
    assert c.value[0] is c.value


class Model:
    """A class defined here (pickled by value: this module is registered so)."""

    def __init__(self, weights) -> None:
        self.weights = weights

    def predict(self, x):
        return x * len(self.weights)


@needs_writer
def test_what_opaque_objects_share_stays_shared_and_is_written_once():
    model = Model(np.arange(100_000))  # 800 kB
    nodes = [Task(("p", i), model.predict, i) for i in range(20)]  # a new method each
    blob = written(nodes)
    assert len(blob) < 2 * model.weights.nbytes  # not once per task
    loaded = pickle.loads(blob)
    assert len({id(node.func.__self__) for node in loaded}) == 1
    assert [node({}) for node in loaded[:3]] == [0, 100_000, 200_000]


@needs_writer
def test_shared_tuples_bytes_and_tasks_are_written_once():
    chunks = tuple((5,) * 40 for _ in range(40))  # dask's chunks: a tuple of tuples
    payload = bytes(100_000)
    inner = Task("inner", len, payload)
    deep: tuple = (1, 2)
    for _ in range(40):  # each level refers twice to the one below: 2**40 if copied
        deep = (deep, deep)
    nodes = [Task(("n", i), len, chunks, DataNode(None, deep), inner) for i in range(50)]
    blob = written(nodes)
    assert len(blob) < len(payload) + 20_000
    loaded = pickle.loads(blob)
    assert loaded[0].args[0] == chunks and loaded[0].args[0] is loaded[49].args[0]
    assert loaded[0].args[2] is loaded[1].args[2]
    assert loaded[0].args[1].value[0] is loaded[0].args[1].value[1]


def local_function(x):
    return x * 3


@needs_writer
def test_functions_a_worker_cannot_import_go_by_value_each_once():
    square = lambda x: x * x  # the standard pickler refuses lambdas
    nodes = [Task(("t", i), local_function if i % 2 else square, i) for i in range(6)]
    pickler = spec_pickler.SpecPickler()
    blob = pickler.dumps_together(nodes)
    # this module is registered by value: the function's code is in the part once
    by_value = cloudpickle.dumps(local_function).count(b"local_function")
    assert blob.count(b"local_function") == by_value > 0
    loaded = pickle.loads(blob)
    assert [node({}) for node in loaded] == [0, 3, 4, 9, 16, 15]


@needs_writer
def test_a_slice_the_writer_refuses_goes_to_the_pickler():
    surrogate = [DataNode("s", "a\ud800b")]
    pickler = spec_pickler.SpecPickler()
    with pytest.raises(UnicodeEncodeError):
        pickler._part_writer().write(surrogate)
    assert pickle.loads(pickler.dumps_together(surrogate))[0].value == "a\ud800b"
    # nothing takes a lock: the slice is not a part (its nodes go one by one)
    assert pickler.dumps_together([DataNode("l", threading.Lock())]) is None


@needs_writer
def test_the_writer_leaves_no_state_between_parts():
    pickler = spec_pickler.SpecPickler()
    writer = pickler._part_writer()
    first = writer.write([Task("a", len, "shared-name", [1])])
    second = writer.write([Task("a", len, "shared-name", [1])])
    assert first == second
    assert pickle.loads(writer.write([]))  == []


@needs_writer
def test_many_objects_met_again_and_again_are_each_what_they_were():
    # more shared objects than the writer's seen cache has slots (512), met in turns, and
    # equal strings that are distinct objects (found in its strings dict by value)
    functions = [functools.partial(operator.add, [i]) for i in range(1_500)]
    shared = [[i] for i in range(1_500)]
    nodes = []
    for turn in range(3):
        for i in range(0, 1_500, 7 + turn):
            name = "".join(["name-", str(i % 50)])  # a new str object each time
            nodes.append(Task((name, turn, i), functions[i], shared[i]))
    loaded = pickle.loads(written(nodes))
    assert all(same(a, b) for a, b in zip(loaded, pickle.loads(standard(nodes)), strict=True))
    lists: dict = {}
    for node in loaded:
        name, _, i = node.key
        assert name == f"name-{i % 50}" and node({}) == [i, i]
        assert lists.setdefault(i, node.args[0]) is node.args[0]  # still one list each
