"""How many workers the work wants (``adaptive_target``), which to let go
(``workers_to_close``) and since when nothing runs (``check_idle``).

Cluster managers ask these every second; they read the core's counters, so the
answers follow the work as it is queued, runs, finishes and is released.
"""
import pytest

from core_sim import Sim


def burst(n: int, prefix: str = "burst") -> tuple:
    """``n`` independent tasks of one prefix: (tasks, wanted keys)."""
    keys = [f"{prefix}-{i}" for i in range(n)]
    return [{"key": key, "spec": b"s", "order": i} for i, key in enumerate(keys)], keys


def test_no_work_no_workers_wanted():
    sim = Sim()
    assert sim.state.adaptive_target() == 0
    sim.add_worker("tcp://w:1")
    assert sim.state.adaptive_target() == 0


def test_work_without_workers_wants_one_then_scales_with_the_estimate():
    sim = Sim(default_duration=0.5)
    sim.submit(*burst(100))
    # 100 tasks x 0.5 s unknown duration, done within 5 s on 1-thread workers: 10
    assert sim.state.adaptive_target(5.0) == 10
    assert sim.state.adaptive_target(50.0) == 1
    assert sim.state.adaptive_target(0.1) == 100  # never more workers than tasks


def test_learned_durations_price_the_work():
    sim = Sim()
    sim.add_worker("tcp://w:1", nthreads=2)
    sim.submit(*burst(40))
    for _ in range(4):  # learn that a burst task takes 2 s
        key = next(iter(sim.computing["tcp://w:1"]))
        sim.finish(key, duration=2.0)
    runnable = sim.state.task_counts()
    left = runnable["queued"] + runnable["processing"]
    assert left == 36
    # 36 x 2 s over 5 s on 2-thread workers: ceil(72 / 5 / 2) = 8
    assert sim.state.adaptive_target(5.0) == 8


def test_waiting_tasks_keep_one_worker_but_do_not_count_as_work():
    sim = Sim()
    sim.add_worker("tcp://w:1")
    sim.submit([{"key": "a", "spec": b"s"}, {"key": "b", "spec": b"s", "deps": ["a"]}],
               ["b"])
    assert sim.state.adaptive_target(5.0) == 1
    sim.run_all()
    assert sim.state.adaptive_target(5.0) == 1  # "b" is held, on a worker without a limit
    sim.release(["b"])
    assert sim.state.adaptive_target(5.0) == 0


def test_memory_held_asks_for_workers_to_keep_results_under_sixty_percent():
    sim = Sim()
    for i in range(2):
        sim.add_worker(f"tcp://w:{i}", memory_limit=1000)
    keys = [f"x-{i}" for i in range(4)]
    sim.submit([{"key": k, "spec": b"s"} for k in keys], keys)
    for _ in range(2):
        for address, computing in sim.computing.items():
            for key in list(computing):
                sim.finish(key, worker=address, nbytes=400)
    assert sim.state.task_counts()["memory"] == 4
    # 1,600 bytes held; 60% of a 1,000-byte worker is 600: 3 workers
    assert sim.state.adaptive_target() == 3


def test_the_memory_answer_grows_at_most_twice_the_workers_at_a_time():
    sim = Sim()
    sim.add_worker("tcp://w:0", memory_limit=10)
    sim.submit([{"key": "big", "spec": b"s"}], ["big"])
    sim.finish("big", nbytes=10**12)
    assert sim.state.adaptive_target() == 2


def test_shrinking_never_counts_out_a_busy_worker():
    sim = Sim(default_duration=0.01)
    for i in range(4):
        sim.add_worker(f"tcp://w:{i}")
    sim.submit(*burst(3))
    busy = [a for a, computing in sim.computing.items() if computing]
    assert len(busy) == 3
    # 3 x 0.01 s wants one worker, but three are running a task each
    assert sim.state.adaptive_target(5.0) == 3


def test_workers_to_close_takes_idle_workers_with_least_data_then_idle_longest():
    sim = Sim()
    clock = sim.clock
    for i in range(4):
        clock.now = float(i)
        sim.add_worker(f"tcp://w:{i}")
    # w:0 holds a result; w:3 runs a task; w:1 (idle since 1) and w:2 (since 2) hold none
    sim.submit([{"key": "kept", "spec": b"s", "workers": ["tcp://w:0"]}], ["kept"])
    sim.finish("kept", nbytes=100)
    sim.submit([{"key": "run", "spec": b"s", "workers": ["tcp://w:3"]}], ["run"])
    assert sim.state.workers_to_close(2) == ["tcp://w:1", "tcp://w:2"]
    assert sim.state.workers_to_close(3) == ["tcp://w:1", "tcp://w:2", "tcp://w:0"]
    assert sim.state.workers_to_close(4)[-1] == "tcp://w:3"  # busy ones last
    assert len(sim.state.workers_to_close(10)) == 4
    assert sim.state.workers_to_close(0) == []


def test_a_worker_that_just_finished_counts_as_idle_since_then():
    sim = Sim()
    clock = sim.clock
    sim.add_worker("tcp://w:0")
    sim.add_worker("tcp://w:1")
    sim.submit([{"key": "t", "spec": b"s", "workers": ["tcp://w:0"]}], ["t"])
    clock.now = 10.0
    sim.finish("t", nbytes=0)
    sim.release(["t"])
    # both hold nothing; w:1 has been idle since 0, w:0 since 10
    assert sim.state.workers_to_close(1) == ["tcp://w:1"]


def test_retiring_workers_are_neither_counted_nor_chosen():
    sim = Sim()
    for i in range(3):
        sim.add_worker(f"tcp://w:{i}")
    sim.record(sim.state.retire_worker("tcp://w:0", sim.sid("retire")))
    assert "tcp://w:0" not in sim.state.workers_to_close(3)
    sim.submit(*burst(2))
    assert sim.state.adaptive_target(100.0) == 2  # the two busy running workers


def test_check_idle_says_since_when_nothing_is_left_to_run():
    sim = Sim()
    clock = sim.clock
    assert sim.state.check_idle() == 0.0
    sim.add_worker("tcp://w:1")
    clock.now = 5.0
    sim.submit(*burst(2))
    assert sim.state.check_idle() is None
    clock.now = 7.0
    sim.run_all()
    assert sim.state.check_idle() == 7.0
    assert sim.state.adaptive_target() == 1  # the results held need a worker
    clock.now = 9.0
    sim.release([f"burst-{i}" for i in range(2)])
    assert sim.state.check_idle() == 7.0  # still idle since the work ended


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "5s", True, None,
                                 5e-324, 10**400, 1e10])
def test_adaptive_target_refuses_a_bad_duration(bad):
    with pytest.raises(ValueError, match="target_duration"):
        Sim().state.adaptive_target(bad)


@pytest.mark.parametrize("bad", [-1, 1.5, "2", None])
def test_workers_to_close_refuses_a_bad_count(bad):
    with pytest.raises(ValueError, match="n must be"):
        Sim().state.workers_to_close(bad)


@pytest.mark.parametrize("bad", [-1, 1.5, "1GiB", True])
def test_add_worker_refuses_a_bad_memory_limit_and_changes_nothing(bad):
    from distributed_core import InvalidStimulus

    sim = Sim()
    with pytest.raises(InvalidStimulus, match="memory_limit"):
        sim.state.add_worker("tcp://w:1", 1, "add", memory_limit=bad)
    assert sim.state.workers == {}
