"""The counters the transitions keep: counters(), task_counts(), prefix_counts(),
worker_counts(). They are exact after every stimulus (validation compares them with a
walk over the tasks, so the hypothesis machine checks them too), and reading them
touches no task."""
from __future__ import annotations

import collections

import pytest
from core_sim import Sim, assert_refused, task

import distributed_core
from distributed_core import InvariantError, SchedulerState, TaskPrefix

HELD = ("released", "waiting", "queued", "no-worker", "processing", "memory", "erred")


def counts(**nonzero) -> dict:
    """Tasks per held state: ``counts(no_worker=1)`` (zero for the states not named)."""
    out = dict.fromkeys(HELD, 0)
    for name, n in nonzero.items():
        out[name.replace("_", "-")] = n
    return out


def entered(**nonzero) -> dict:
    return {**counts(**nonzero), "forgotten": nonzero.get("forgotten", 0)}


def test_counters_follow_tasks_through_their_lives():
    sim = Sim()
    state = sim.state
    sim.add_worker("A", 1)
    assert state.counters() == {
        "tasks": 0, "task_counts": counts(), "tasks_entered": entered(),
        "nbytes_in_memory": 0, "transitions": 0, "stimuli": 1, "workers": 1,
        "idle_workers": 1, "nthreads": 1, "clients": 0, "prefixes": 0}

    sim.submit([task("x"), task("y", "x")], ["y"])
    c = state.counters()
    assert c["tasks"] == 2 and c["task_counts"] == counts(waiting=1, processing=1)
    assert c["tasks_entered"] == entered(released=2, waiting=2, processing=1)
    assert (c["transitions"], c["stimuli"], c["clients"], c["prefixes"]) == (3, 2, 1, 2)
    assert state.task_counts() == counts(waiting=1, processing=1)

    sim.finish("x", nbytes=10)
    c = state.counters()
    assert c["task_counts"] == counts(processing=1, memory=1)
    assert c["nbytes_in_memory"] == 10
    assert state.worker_counts() == {"A": {"name": "A", "nthreads": 1, "processing": 1,
                                           "in_memory": 1, "nbytes": 10, "occupancy": 0.5,
                                           "status": "running"}}

    sim.finish("y", nbytes=5)  # nobody needs x's result: released, kept for y
    c = state.counters()
    assert c["task_counts"] == counts(released=1, memory=1) and c["nbytes_in_memory"] == 5
    assert c["tasks_entered"] == entered(released=3, waiting=2, processing=2, memory=2)
    assert c["transitions"] == state.transition_counter == 7
    assert state.prefix_counts() == {
        "x": {"tasks": 1, "task_counts": counts(released=1), "nbytes_in_memory": 0,
              "tasks_entered": entered(released=2, waiting=1, processing=1, memory=1)},
        "y": {"tasks": 1, "task_counts": counts(memory=1), "nbytes_in_memory": 5,
              "tasks_entered": entered(released=1, waiting=1, processing=1, memory=1)}}

    sim.release(["y"])
    c = state.counters()
    assert (c["tasks"], c["task_counts"], c["nbytes_in_memory"], c["prefixes"]) == (
        0, counts(), 0, 0)
    assert c["tasks_entered"]["forgotten"] == 2
    assert state.prefix_counts() == state.prefix_counts(every=True) == {}
    assert state.prefixes == {}  # dropped with their last task


def test_a_result_held_by_two_workers_counts_once_in_memory():
    sim = Sim()
    sim.add_worker("A", 2)
    sim.add_worker("B", 1)
    sim.scatter({"data": ["A", "B"]}, {"data": 100})
    assert sim.state.counters()["nbytes_in_memory"] == 100
    assert sim.state.counters()["nthreads"] == 3
    workers = sim.state.worker_counts()
    assert [(w["in_memory"], w["nbytes"]) for w in workers.values()] == [(1, 100), (1, 100)]
    sim.remove_worker("B")
    assert sim.state.counters()["nbytes_in_memory"] == 100
    assert sim.state.counters()["nthreads"] == 2
    sim.remove_worker("A")  # the last copy is gone: the scattered data is lost
    c = sim.state.counters()
    assert c["nbytes_in_memory"] == 0 and c["task_counts"] == counts(erred=1)
    assert (c["workers"], c["nthreads"]) == (0, 0)


def test_states_and_prefixes_are_counted_for_every_kind_of_task():
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.submit([task("load-1")], ["load-1"])  # processing
    sim.submit([task(("part", 0), "load-1"), task(("part", 1), "load-1")],
               [("part", 0), ("part", 1)])  # waiting
    sim.submit([task("gpu-1", resources={"GPU": 1})], ["gpu-1"])  # no-worker
    sim.submit([task("load-2"), task("load-3")], ["load-2", "load-3"])  # queued
    assert sim.state.task_counts() == counts(processing=1, waiting=2, no_worker=1, queued=2)
    sim.fail("load-1")  # and the parts; load-2 takes the free thread
    prefixes = sim.state.prefix_counts()
    assert {name: p["task_counts"] for name, p in prefixes.items()} == {
        "load": counts(processing=1, queued=1, erred=1),
        "part": counts(erred=2),
        "gpu": counts(no_worker=1)}
    assert {name: p["tasks"] for name, p in prefixes.items()} == {"load": 3, "part": 2,
                                                                  "gpu": 1}
    assert sim.state.task_counts() == counts(processing=1, queued=1, no_worker=1, erred=3)


def test_stimuli_count_those_taken_and_a_refused_one_changes_no_counter():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    before = sim.state.counters()
    assert before["stimuli"] == 2
    assert_refused(sim.state, lambda: sim.state.update_data("c", {"y": ["A"]}, {"y": -1}, "s"))
    assert sim.state.counters() == before
    sim.state.add_client("other", "hello")
    assert sim.state.counters()["stimuli"] == 3


def _bump_state_count(state):
    counts = list(state._state_counts)
    counts[1] += 1
    state._state_counts = counts


def _bump_prefix_count(state):
    prefix = state.prefixes["x"]
    counts = list(prefix.counts)
    counts[5] -= 1
    counts[0] += 1
    prefix.counts = counts


def _bump_bytes(state):
    state.nbytes_in_memory += 1


def _bump_prefix_bytes(state):
    state.prefixes["x"].nbytes_in_memory += 1


def _bump_prefix_tasks(state):
    state.prefixes["x"].n_tasks += 1


def _drop_active_prefix(state):
    del state._active_prefixes["x"]


def _bump_threads(state):
    state.total_nthreads += 1


DRIFTS = [_bump_state_count, _bump_prefix_count, _bump_bytes, _bump_prefix_bytes,
          _bump_prefix_tasks, _drop_active_prefix, _bump_threads]


@pytest.mark.parametrize("drift", DRIFTS, ids=[f.__name__ for f in DRIFTS])
def test_validation_catches_a_counter_that_drifted(drift):
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    sim.finish("x", nbytes=7)
    sim.state.validate_state()
    drift(sim.state)
    with pytest.raises(InvariantError, match="counted|active|entered"):
        sim.state.validate_state()


def _idle_prefix_kept(state, prefix):
    state.prefixes["x"] = prefix


def _idle_prefix_kept_active(state, prefix):
    state.prefixes["x"] = state._active_prefixes["x"] = prefix


@pytest.mark.parametrize("drift", [_idle_prefix_kept, _idle_prefix_kept_active])
def test_validation_catches_a_prefix_kept_without_tasks(drift):
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    prefix = sim.state.prefixes["x"]
    sim.finish("x")
    sim.release(["x"])
    sim.state.validate_state()
    drift(sim.state, prefix)
    with pytest.raises(InvariantError, match="'x'"):
        sim.state.validate_state()


def test_a_prefix_is_dropped_with_its_last_task_and_its_duration_is_kept():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x-1"), task(("layer-1", 0))], ["x-1", ("layer-1", 0)])
    sim.finish("x-1", duration=2.0)
    sim.finish(("layer-1", 0))
    sim.release(["x-1", ("layer-1", 0)])
    assert sim.state.prefixes == {} and sim.state._prefix_of_name == {}
    assert sim.state.counters()["prefixes"] == 0
    sim.submit([task("x-2"), task(("layer-1", 1))], ["x-2", ("layer-1", 1)])
    assert sim.state.prefixes["x"].duration_average == 2.0  # learned before, kept
    assert sorted(sim.state.prefixes) == ["layer", "x"]
    sim.state.validate_state()


def test_durations_of_dropped_prefixes_are_bounded():
    sim = Sim(validate=False, worker_saturation=float("inf"))
    sim.add_worker("A", 1)
    kept = distributed_core._core._DURATIONS_KEPT
    n = kept + 5
    for i in range(0, n, 1000):
        keys = [f"name{j}_x-1" for j in range(i, min(i + 1000, n))]
        sim.submit([task(key) for key in keys], keys)
        sim.finish(*keys, duration=1.0)
        sim.release(keys)
    assert sim.state.prefixes == {}
    assert len(sim.state._durations) == kept
    assert all(f"name{j}_x" in sim.state._durations for j in range(kept, n))  # the newest


def test_a_transition_that_raises_after_moving_its_task_keeps_the_counters_true():
    def fails(state, ts, start, finish):
        if (start, finish) == ("waiting", "processing"):
            raise RuntimeError("a bug in a transition")

    sim = Sim()
    sim.add_worker("A", 1)
    sim.state._transition_hook = fails
    with pytest.raises(RuntimeError, match="a bug"):
        sim.state.update_graph("c", [task("x")], ["x"], "graph")
    sim.state._transition_hook = None
    assert sim.state.task_counts() == counts(processing=1)
    sim.state.validate_state()


# -- a read with a million tasks ---------------------------------------------------------


def test_reading_the_counters_touches_no_task():
    """With a million tasks held (100,000 interpreted: same proof, less waiting), the
    reads give the right figures after every task was poisoned and the task table taken
    away: no read can have walked the tasks, whatever route it took to them (the task
    table, a worker's sets, a client's wants, the queue)."""
    n = 1_000_000 if distributed_core.COMPILED else 100_000
    state = SchedulerState()  # no validation: it walks every task after each stimulus
    state.add_worker("A", 2, "join-A")
    state.add_worker("B", 2, "join-B")
    graph = [{"key": f"inc-{i}", "spec": b"s"} for i in range(n)]
    graph += [{"key": f"sum-{j}", "spec": b"s", "deps": [f"inc-{2 * j}", f"inc-{2 * j + 1}"]}
              for j in range(1000)]
    graph += [{"key": f"gpu-{k}", "spec": b"s", "resources": {"GPU": 1}} for k in range(10)]
    state.update_graph("c", graph, [entry["key"] for entry in graph], "graph")
    del graph
    for round_ in range(3):
        for address in ("A", "B"):
            keys = sorted(ts.key for ts in state.workers[address].processing)
            state.task_erred(address, [{"key": keys[0], "exception": b"e", "traceback": b"t",
                                        "text": "E"}], f"erred-{round_}-{address}")
            state.task_finished(address, [{"key": key, "nbytes": 100 + i}
                                          for i, key in enumerate(keys[1:])],
                                f"finished-{round_}-{address}")
    reads = (state.counters, state.task_counts, state.prefix_counts, state.worker_counts)
    before = [read() for read in reads]

    # One pass: what a walk would find, then poison the task.
    tasks = state.tasks
    expected_states = collections.Counter()
    expected_prefixes = collections.defaultdict(collections.Counter)
    expected_bytes = collections.Counter()
    poison = TaskPrefix("poison")
    for ts in tasks.values():
        name = ts.prefix.name
        expected_states[ts.state] += 1
        expected_prefixes[name][ts.state] += 1
        if ts.state == "memory":
            expected_bytes[name] += ts.nbytes
        ts.state_id = -1  # no state: a read that looked would fail
        ts.nbytes = -(2 ** 40)
        ts.prefix = poison
    assert len(tasks) == n + 1010
    assert set(expected_states) == {
        "queued", "processing", "memory", "erred", "waiting", "no-worker"}
    state.tasks = None
    try:
        after = [read() for read in reads]
    finally:
        state.tasks = tasks  # so that dropping the state frees the tasks
    assert after == before
    c = after[0]
    assert c["tasks"] == n + 1010
    assert c["task_counts"] == counts(**{s.replace("-", "_"): k
                                         for s, k in expected_states.items()})
    assert c["nbytes_in_memory"] == sum(expected_bytes.values()) > 0
    assert {name: (p["tasks"], p["task_counts"], p["nbytes_in_memory"])
            for name, p in after[2].items()} == {
        name: (sum(states.values()), counts(**{s.replace("-", "_"): k
                                               for s, k in states.items()}),
               expected_bytes[name])
        for name, states in expected_prefixes.items()}
    assert sum(w["processing"] for w in after[3].values()) == expected_states["processing"]


def test_key_prefix_drops_hashes_uuids_and_counters():
    """Tasks of one kind share a prefix: a uuid4 (``pure=False``) counts as one token,
    its short groups included, so their durations are learned under one name."""
    import uuid

    from distributed_core import key_prefix

    assert key_prefix(f"work-{uuid.uuid4()}") == "work"
    assert key_prefix(f"my-task-{uuid.uuid4()}-3") == "my-task"
    assert key_prefix("inc-1f3a9c0d5e") == "inc"
    assert key_prefix(("sum-aggregate-9ab1c2d3e4", 0)) == "sum-aggregate"
    assert key_prefix("read-csv-2020-01-01") == "read-csv"
    assert key_prefix("a-beef-cafe") == "a-beef-cafe"  # short hex words stay words
    assert key_prefix("1f3a9c0d") == "1f3a9c0d"
    assert key_prefix(()) == "tuple" and key_prefix(7) == "int"
