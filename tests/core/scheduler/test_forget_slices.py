"""A released big graph is forgotten in slices (``forget_slice``, ``forget_more``).

Releasing the key of a reduction lets every task under it go at once: with a million
tasks, one stimulus would hold the server for seconds. With ``forget_slice`` a stimulus
forgets at most that many tasks and leaves the rest released (or in memory) until
``forget_more`` takes the next slice. Every state in between is valid, a task needed
again meanwhile is kept, and in the end every task is forgotten and every result freed.
"""
import pytest

from core_sim import Sim


def reduction(n: int) -> tuple:
    """``n`` leaves and one task that sums them: (tasks, wanted keys)."""
    tasks = [{"key": f"leaf-{i}", "spec": b"s", "order": i} for i in range(n)]
    tasks.append({"key": "total", "spec": b"s", "order": n,
                  "deps": [f"leaf-{i}" for i in range(n)]})
    return tasks, ["total"]


def computed(n: int, forget_slice: int) -> Sim:
    sim = Sim(forget_slice=forget_slice)
    sim.add_worker("tcp://w:1", nthreads=4)
    sim.submit(*reduction(n))
    sim.run_all()
    assert sim.state.tasks["total"].state == "memory"
    return sim


def forget_all(sim: Sim) -> int:
    """Call forget_more until nothing is left to forget; how many calls it took."""
    calls = 0
    while sim.state.forget_backlog:
        before = len(sim.state.tasks)
        sim.record(sim.state.forget_more(sim.sid("forget")))
        calls += 1
        assert before - len(sim.state.tasks) <= sim.state.forget_slice
    return calls


def test_a_released_graph_is_forgotten_a_slice_a_stimulus():
    sim = computed(100, forget_slice=10)
    sim.release(["total"])
    assert len(sim.state.tasks) == 101 - 10  # the total and nine leaves went at once
    assert sim.state.forget_backlog == 91
    assert forget_all(sim) == 10
    assert sim.state.tasks == {}
    assert sim.data["tcp://w:1"] == set()  # every result freed on the worker


def test_results_in_memory_wait_in_memory_and_are_freed_when_forgotten():
    sim = Sim(forget_slice=3)
    sim.add_worker("tcp://w:1", nthreads=2)
    sim.submit([{"key": f"x-{i}", "spec": b"s"} for i in range(10)],
               [f"x-{i}" for i in range(10)])
    sim.run_all()
    sim.release([f"x-{i}" for i in range(10)])
    assert len(sim.state.tasks) == 7
    assert {ts.state for ts in sim.state.tasks.values()} == {"memory"}
    assert len(sim.data["tcp://w:1"]) == 7
    forget_all(sim)
    assert sim.state.tasks == {} and sim.data["tcp://w:1"] == set()


def test_a_task_needed_again_before_its_slice_is_kept():
    sim = computed(20, forget_slice=5)
    sim.release(["total"])
    waiting = [key for key in sim.state.tasks if key.startswith("leaf-")]
    again = waiting[0]
    sim.submit([{"key": again, "spec": b"s"}], [again])  # a client wants it again
    forget_all(sim)
    assert list(sim.state.tasks) == [again]
    sim.run_all()
    assert sim.state.tasks[again].state in ("memory", "released", "waiting", "processing")
    sim.release([again])
    forget_all(sim)
    assert sim.state.tasks == {}


def test_cancelled_queued_work_stops_at_released_and_never_runs():
    sim = Sim(forget_slice=4)
    sim.add_worker("tcp://w:1", nthreads=1)
    keys = [f"q-{i}" for i in range(30)]
    sim.submit([{"key": k, "spec": b"s"} for k in keys], keys)
    sim.release(keys)
    assert all(ts.state == "released" for ts in sim.state.tasks.values())
    assert sim.state.n_queued == 0
    forget_all(sim)
    assert sim.state.tasks == {}
    assert not sim.computing["tcp://w:1"]


def test_a_restart_forgets_the_backlog_too():
    sim = computed(50, forget_slice=5)
    sim.release(["total"])
    assert sim.state.forget_backlog
    sim.record(sim.state.restart(sim.sid("restart")))
    assert sim.state.tasks == {} and sim.state.forget_backlog == 0


def test_without_a_slice_everything_goes_in_one_stimulus():
    sim = computed(100, forget_slice=None)
    sim.release(["total"])
    assert sim.state.tasks == {} and sim.state.forget_backlog == 0
    assert sim.state.forget_slice == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True])
def test_a_bad_forget_slice_is_refused(bad):
    with pytest.raises(ValueError, match="forget_slice"):
        Sim(forget_slice=bad)
