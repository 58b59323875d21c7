"""`TaskTable`, the scheduler's tasks by key: a mapping that keeps a big graph's chunk
keys in 256 dicts, so no single dict doubles with a million tasks in it."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from distributed_core import TaskTable

# Keys as the scheduler meets them: str keys of submit / map, dask chunk keys
# (name, i) and (name, i, j) over several blocks, and equal keys of other types
# ((1, 0) == (True, 0) == (1.0, 0)), which must land in the same dict.
KEYS = st.one_of(
    st.sampled_from(["a", "b", "inc-1f3a", "work-2b66"]),
    st.tuples(st.sampled_from(["x", "y-9f8e"]), st.integers(0, 5_000)),
    st.tuples(st.sampled_from(["x", "z"]), st.integers(0, 3), st.integers(0, 3_000)),
    st.tuples(st.sampled_from([1, True, 1.0, 0, False]), st.integers(0, 2)),
    # parts whose hashes are negative or huge, and nested tuples
    st.tuples(st.text(max_size=3), st.one_of(st.text(max_size=3), st.integers(-2**70, 2**70),
                                             st.floats(allow_nan=False))),
    st.tuples(st.sampled_from(["n"]), st.tuples(st.sampled_from(["m", "n"]),
                                               st.integers(-3, 3))),
    st.tuples(),
)
OPS = st.lists(st.tuples(st.sampled_from(["put", "drop", "has", "get", "compact"]), KEYS,
                         st.integers()), max_size=300)


@given(OPS)
def test_a_table_answers_as_a_dict_does(ops):
    table, model = TaskTable(), {}
    for op, key, value in ops:
        if op == "put":
            table[key] = value
            model[key] = value
        elif op == "drop":
            if key in model:
                del table[key]
                del model[key]
            else:
                try:
                    del table[key]
                except KeyError:
                    pass
                else:
                    raise AssertionError(f"deleted {key!r}, which it did not hold")
        elif op == "has":
            assert (key in table) == (key in model)
        elif op == "get":
            assert table.get(key, "none") == model.get(key, "none")
        else:
            table.compact()
        assert len(table) == len(model)
    assert table == model and dict(table.items()) == model
    assert sorted(map(repr, table)) == sorted(map(repr, model))
    assert sorted(map(repr, table.values())) == sorted(map(repr, model.values()))
    assert sum(table.sizes()) == len(model)


def test_equal_keys_of_other_types_are_one_key():
    table = TaskTable()
    table[(1, 0)] = "first"
    table[(True, 0)] = "second"
    table[(1.0, 0)] = "third"
    assert len(table) == 1 and table[(1, 0)] == "third"
    assert type(next(iter(table))[0]) is int  # the key keeps its first object, as a dict's


def test_a_layer_of_300_000_chunks_is_spread_and_other_keys_stay_in_one_dict():
    table = TaskTable()
    for i in range(300_000):
        table[("ones-add-9f8e7d6c", i)] = i
    for i in range(1_000):
        table[f"work-{i}"] = i
    sizes = table.sizes()
    assert sizes[0] == 1_000  # the keys that are not chunks
    chunks = sizes[1:]
    assert len(chunks) == 256 and sum(chunks) == 300_000
    # blocks of 1,024 neighbours: about 293 blocks over 256 dicts, a few in the fullest
    assert max(chunks) <= 8 * 1_024
    assert table[("ones-add-9f8e7d6c", 123_456)] == 123_456
    for i in range(0, 300_000, 2):
        del table[("ones-add-9f8e7d6c", i)]
    table.compact()
    assert len(table) == 151_000 and table.get(("ones-add-9f8e7d6c", 3)) == 3


def test_a_table_compares_with_dicts_and_tables():
    table = TaskTable()
    assert table == {} and table == TaskTable() and not (table != {})
    table["a"] = 1
    assert table != {} and table == {"a": 1} and (table == [("a", 1)]) is False
