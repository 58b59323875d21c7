"""`TaskTable`, the scheduler's tasks by key: a mapping that keeps a big graph's keys
(chunks and str keys) in 256 dicts, so no single dict doubles with a million tasks in it."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from distributed_core import TaskSet, TaskTable

# Keys as the scheduler meets them: str keys of submit / map, dask chunk keys
# (name, i) and (name, i, j) over several blocks, and equal keys of other types
# ((1, 0) == (True, 0) == (1.0, 0)), which must land in the same dict.
KEYS = st.one_of(
    st.sampled_from(["a", "b", "inc-1f3a", "work-2b66"]),
    # map's keys "<prefix>-<token>-<i>" over several blocks, digits alone, long runs
    st.builds("inc-{}-{}".format, st.sampled_from(["", "9f8e", "x" * 40]),
              st.integers(0, 5_000)),
    st.text("0123456789-a", max_size=25),
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
        table[i] = i
    sizes = table.sizes()
    assert sizes[0] == 1_000  # the keys that are neither str nor tuple
    shards = sizes[1:]
    assert len(shards) == 256 and sum(shards) == 300_000
    # blocks of 1,024 neighbours: about 293 blocks over 256 dicts, a few in the fullest
    assert max(shards) <= 8 * 1_024
    assert table[("ones-add-9f8e7d6c", 123_456)] == 123_456
    for i in range(0, 300_000, 2):
        del table[("ones-add-9f8e7d6c", i)]
    table.compact()
    assert len(table) == 151_000 and table.get(("ones-add-9f8e7d6c", 3)) == 3


def test_a_map_of_300_000_str_keys_is_spread_by_blocks_of_its_indexes():
    token = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
    table = TaskTable()
    for i in range(20 * 1_024):  # map's keys "<prefix>-<token>-<i>": 20 blocks of 1,024
        table[f"inc-{token}-{i}"] = i
    shards = [n for n in table.sizes()[1:] if n]
    assert len(shards) <= 20 and all(n % 1_024 == 0 for n in shards)
    for i in range(20 * 1_024, 300_000):
        table[f"inc-{token}-{i}"] = i
    shards = table.sizes()[1:]
    assert sum(shards) == 300_000 and max(shards) <= 8 * 1_024
    assert table[f"inc-{token}-299999"] == 299_999 and f"inc-{token}-300000" not in table
    # keys with no index (submit's "<prefix>-<uuid>") are spread by their characters
    spread = TaskTable()
    for i in range(20_000):
        spread[f"work-{i:08x}ab"] = i
    assert max(spread.sizes()[1:]) < 200


def test_a_few_tasks_stay_in_one_dict_in_the_order_they_came():
    table = TaskTable()
    keys = [("x", 3), "b", 7, ("x", 1), "a"]
    for key in keys:
        table[key] = str(key)
    assert table.sizes() == [5] and list(table) == keys
    for i in range(20_000):
        table[f"k-{i}"] = i
    assert len(table.sizes()) == 257 and table.sizes()[0] == 1  # the int key 7
    for i in range(20_000):
        del table[f"k-{i}"]
    table.compact()
    assert table.sizes() == [5] and sorted(map(repr, table)) == sorted(map(repr, keys))


class Task:
    """A stand-in for a TaskState: hashed by identity."""


@given(st.lists(st.tuples(st.sampled_from(["add", "discard", "in", "compact"]),
                          st.integers(0, 40)), max_size=200),
       st.integers(0, 3))
def test_a_task_set_answers_as_a_set_does(ops, many):
    tasks = [Task() for _ in range(41)]
    bulk = [Task() for _ in range(many * 10_000)]  # past the split, for some examples
    taskset, model = TaskSet(bulk), set(bulk)
    for op, i in ops:
        ts = tasks[i]
        if op == "add":
            taskset.add(ts)
            model.add(ts)
        elif op == "discard":
            taskset.discard(ts)
            model.discard(ts)
        elif op == "in":
            assert (ts in taskset) == (ts in model)
        else:
            taskset.compact()
        assert len(taskset) == len(model) and bool(taskset) == bool(model)
    assert set(taskset) == model and len(list(taskset)) == len(model)
    assert sum(taskset.sizes()) == len(model)


def test_a_task_set_splits_past_16_384_and_joins_again():
    tasks = [Task() for _ in range(100_000)]
    taskset = TaskSet(tasks[:10])
    assert list(taskset) == tasks[:10] and taskset.sizes() == [10]
    for ts in tasks:
        taskset.add(ts)
    sizes = taskset.sizes()
    assert len(sizes) == 257 and sizes[0] == 0 and sum(sizes) == 100_000
    assert max(sizes) < 100_000 // 8
    for ts in tasks[:95_000]:
        taskset.discard(ts)
    taskset.compact()
    assert taskset.sizes() == [5_000] and set(taskset) == set(tasks[95_000:])


def test_a_table_compares_with_dicts_and_tables():
    table = TaskTable()
    assert table == {} and table == TaskTable() and not (table != {})
    table["a"] = 1
    assert table != {} and table == {"a": 1} and (table == [("a", 1)]) is False


def test_a_compaction_goes_a_few_dicts_at_a_time_and_the_table_answers_throughout():
    table, model = TaskTable(), {}
    for i in range(100_000):
        table[("x", i)] = model[("x", i)] = i
    for i in range(0, 100_000, 2):
        del table[("x", i)]
        del model[("x", i)]
    table.begin_compaction()
    steps = []
    while n := table.compact_some(5_000):
        steps.append(n)
        assert table[("x", 1)] == 1 and ("x", 2) not in table and table == model
        table[f"new-{len(steps)}"] = model[f"new-{len(steps)}"] = len(steps)
    assert len(steps) >= 10 and max(steps) < 5_000 + 8 * 1_024
    assert table.compact_some(5_000) == 0 and table == model
