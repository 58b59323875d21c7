"""Tasks are invisible to the cyclic GC when compiled; their memory must still come back."""
import gc
import sys
import tracemalloc

from distributed_core import SchedulerState


def _diamonds(n: int) -> list:
    tasks = []
    for i in range(n):
        tasks += [{"key": f"a-{i}", "spec": b"s"},
                  {"key": f"b-{i}", "spec": b"s", "deps": [f"a-{i}"]},
                  {"key": f"c-{i}", "spec": b"s", "deps": [f"a-{i}"]},
                  {"key": f"d-{i}", "spec": b"s", "deps": [f"b-{i}", f"c-{i}"]}]
    return tasks


def _held_graph(n: int) -> SchedulerState:
    """A state holding tasks that refer to each other, a worker and a client (cycles)."""
    state = SchedulerState()
    state.add_worker("tcp://w:1", 2, "join")
    state.update_graph("client", _diamonds(n), [f"d-{i}" for i in range(n)], "submit")
    running = [ts.key for ts in state.workers["tcp://w:1"].processing]
    state.task_finished("tcp://w:1", [{"key": k, "nbytes": 8} for k in running], "done")
    return state


def test_a_dropped_scheduler_state_frees_the_tasks_it_still_held():
    _held_graph(10)  # warm up caches and interned strings
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        state = _held_graph(2_000)
        held = tracemalloc.get_traced_memory()[0] - before
        del state
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held > 1_000_000  # 8,000 tasks really were held
    assert left < held / 50, f"{left} of {held} bytes were not freed"


def test_forgotten_tasks_free_their_memory():
    gc.collect()
    tracemalloc.start()
    try:
        state = SchedulerState()
        before = tracemalloc.get_traced_memory()[0]
        state.add_worker("tcp://w:1", 2, "join")
        state.update_graph("client", _diamonds(2_000), [f"d-{i}" for i in range(2_000)], "s")
        held = tracemalloc.get_traced_memory()[0] - before
        state.remove_client("client", "bye")
        state.clear_transition_log()
        assert not state.tasks
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert left < held / 20, f"{left} of {held} bytes were not freed"


def test_a_shrink_rebuilds_the_tables_in_place():
    """Once most tasks are gone, the tables they grew are rebuilt at their size, each in
    place: the same dict and set objects (one made anew during a big release would sit
    among the release's freed blocks and keep their arena mapped), their large tables
    given back."""
    state = SchedulerState(worker_saturation=float("inf"))
    state.add_worker("tcp://w:1", 1, "join")
    ws = state.workers["tcp://w:1"]
    processing, unrunnable = ws.processing, state.unrunnable
    keys = [f"t-{i}" for i in range(10_000)]
    state.update_graph("client", [{"key": k, "spec": b"s"} for k in keys], keys, "submit")
    grown = sys.getsizeof(ws.processing)
    state.remove_client("client", "bye")
    for i in range(100):  # the shrink goes a few tables per stimulus
        state.update_graph("client", [{"key": f"u-{i}", "spec": b"s"}], [f"u-{i}"], f"s{i}")
    assert len(state.tasks) <= 100
    assert ws.processing is processing and state.unrunnable is unrunnable
    assert sys.getsizeof(ws.processing) < grown / 50
