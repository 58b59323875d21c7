"""Looking inside: story(), the bounded transition log, validate_state, memory left behind."""
from __future__ import annotations

import sys

import pytest
from core_sim import Clock, Sim, states, task

from distributed_core import InvariantError, SchedulerState


def test_story_lists_a_tasks_transitions_with_stimulus_ids_and_times():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.clock.now = 10.0
    sim.submit([task("x")], ["x"], stimulus_id="graph-x")
    sim.clock.now = 12.5
    sim.finish("x", stimulus_id="done-x")
    assert sim.state.story("x") == [
        ("x", "released", "waiting", "graph-x", 10.0),
        ("x", "waiting", "processing", "graph-x", 10.0),
        ("x", "processing", "memory", "done-x", 12.5),
    ]


def test_story_of_several_keys_keeps_the_order_they_happened_in():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x"), task("y", "x")], ["y"], stimulus_id="g")
    sim.finish("x", stimulus_id="fx")
    story = sim.state.story("x", "y")
    assert [(key, finish, sid) for key, _, finish, sid, _ in story] == [
        ("y", "waiting", "g"), ("x", "waiting", "g"), ("x", "processing", "g"),
        ("x", "memory", "fx"), ("y", "processing", "fx")]
    assert sim.state.story("unknown") == []


def test_story_shows_a_move_through_released_as_two_steps():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    sim.finish("x")
    sim.release(["x"], stimulus_id="bye")  # memory -> forgotten goes through released
    assert [entry[1:4] for entry in sim.state.story("x")][-2:] == [
        ("memory", "released", "bye"), ("released", "forgotten", "bye")]


def test_transition_log_is_bounded():
    sim = Sim(transition_log_length=5, worker_saturation=float("inf"))
    sim.add_worker("A", 1)
    sim.submit([task(f"t{i}") for i in range(10)], [f"t{i}" for i in range(10)])
    sim.run_all()
    log = sim.state.transition_log
    assert len(log) == 5
    assert sim.state.transition_counter == 30
    assert all(finish == "memory" for _, _, finish, _, _ in log)


def _twin_logs(length: int, keys: list, pack_after: set) -> None:
    """Two states take the same stimuli; one packs its log after the steps in
    ``pack_after``. Their logs and stories read the same after every step."""
    packed, plain = Sim(transition_log_length=length), Sim(transition_log_length=length)
    steps = []
    for i, key in enumerate(keys):
        steps.append(lambda sim, key=key, i=i: sim.submit([task(key)], [key],
                                                          stimulus_id=f"graph-{i}"))
        steps.append(lambda sim, key=key: sim.release([key], stimulus_id="bye"))
    for sim in (packed, plain):
        sim.add_worker("A", 1)
    for n, step in enumerate(steps):
        for sim in (packed, plain):
            sim.clock.now = float(n)
            step(sim)
        if n in pack_after:
            packed.state.pack_transition_log()
        assert packed.state.transition_log == plain.state.transition_log
        assert packed.state.story(*keys[:3]) == plain.state.story(*keys[:3])
    assert len(packed.state.transition_log) == min(length, plain.state.transition_counter)


@pytest.mark.parametrize("keys", [
    [f"noop-{i}" for i in range(12)],                      # str keys
    [("x", i) for i in range(12)],                         # dask keys
    ["a", ("b", 1), "", "nul\0inside", 3, 2.5, b"raw"] * 2,  # all the kinds at once
    ["same-a", "other", "same-b", "same-c", ""] * 3,       # first and last share more
    [("x", i, -i) for i in range(6)] + [("y",), ("z", 2**63 - 1, -2**63)] * 3,  # shapes
    [("a\0b", i) for i in range(12)],                      # a name that holds a NUL
    [("x", 2**64 + i) for i in range(12)],                 # ints over 64 bits
    [("x", True), ("x", 2), ("x", 1.5), ("x", ("y", 1))] * 3,  # not a name and ints
], ids=["str", "tuple", "mixed", "prefixes", "tuple-shapes", "tuple-nul", "tuple-big",
        "tuple-other"])
def test_a_packed_transition_log_reads_as_before_and_stays_bounded(keys):
    # packed when empty, when part full, twice in a row, once full, and never again
    # until the new transitions have pushed the packed ones out
    _twin_logs(7, keys, pack_after={0, 1, 2, 5, 6, 9})
    _twin_logs(100, keys, pack_after={3, 20})


@pytest.mark.parametrize("make_key", [lambda i: f"noop-{i}", lambda i: ("x", i, 2 * i)],
                         ids=["str", "tuple"])
def test_a_packed_transition_log_holds_no_key_object(make_key):
    # the last keys of a released job must not keep the allocator's arenas of the job
    sim = Sim()
    sim.add_worker("A", 1)
    keys = [make_key(i) for i in range(1000, 1004)]
    sim.submit([task(key) for key in keys], keys)
    sim.run_all()
    sim.release(keys, stimulus_id="bye")
    held = [sys.getrefcount(key) for key in keys]
    logged = [sum(entry[0] is key for entry in sim.state.transition_log) for key in keys]
    assert all(logged)
    sim.state.pack_transition_log()
    assert [sys.getrefcount(key) for key in keys] == [
        n - times for n, times in zip(held, logged)]


def test_clearing_the_log_drops_the_packed_transitions_too():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    sim.state.pack_transition_log()
    assert len(sim.state.transition_log) == 2
    sim.state.clear_transition_log()
    assert sim.state.transition_log == []
    sim.finish("x", stimulus_id="done")
    assert sim.state.story("x") == [("x", "processing", "memory", "done", 0.0)]


def test_clock_is_only_the_one_passed_in():
    clock = Clock(now=123.0)
    state = SchedulerState(validate=True, clock=clock)
    state.add_worker("A", 1, "join")
    state.update_graph("c", [task("x")], ["x"], "g")
    assert {entry[4] for entry in state.transition_log} == {123.0}


# -- validate_state ------------------------------------------------------------------------


def corrupted_sim() -> Sim:
    """x in memory on A, y processing on A, z queued."""
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.submit([task("x"), task("y", "x")], ["y"])
    sim.finish("x")
    sim.submit([task("z")], ["z"])
    assert states(sim.state) == {"x": "memory", "y": "processing", "z": "queued"}
    sim.state.validate_state()
    return sim


def break_worker_bytes(state):
    state.workers["A"].nbytes += 1


def break_waiter_count(state):
    state.tasks["x"].n_waiters += 1


def break_task_state(state):
    state.tasks["y"].state = "memory"


def break_queue_count(state):
    state.n_queued += 1


def break_idle_set(state):
    state.idle["A"] = state.workers["A"]


def break_client_wants(state):
    state.clients["c"].wants_what.add(state.tasks["x"])


def break_holders(state):
    state.workers["A"].has_what.discard(state.tasks["x"])


CORRUPTIONS = [break_worker_bytes, break_waiter_count, break_task_state, break_queue_count,
               break_idle_set, break_client_wants, break_holders]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=[f.__name__ for f in CORRUPTIONS])
def test_validate_state_catches_a_corrupted_state(corrupt):
    sim = corrupted_sim()
    corrupt(sim.state)
    with pytest.raises(InvariantError):
        sim.state.validate_state()


def test_every_stimulus_validates_when_validate_is_on():
    sim = corrupted_sim()
    break_worker_bytes(sim.state)
    with pytest.raises(InvariantError, match="holds 1 bytes, counted 2"):
        sim.state.add_client("other", "hello")


def test_nothing_is_checked_when_validate_is_off():
    sim = Sim(validate=False)
    sim.add_worker("A", 1)
    sim.state.workers["A"].nbytes = 99
    assert sim.state.add_client("other", "hello") == ({}, {})


# -- memory left behind --------------------------------------------------------------------


def test_nothing_is_kept_after_a_large_graph_is_released():
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 2)
    sim.add_worker("B", 2)
    tasks = [task(f"r{i}") for i in range(200)]
    tasks += [task(f"s{i}", f"r{i}", f"r{(i + 1) % 200}") for i in range(200)]
    tasks += [task("restricted", workers=["nowhere"])]
    keys = [f"s{i}" for i in range(200)] + ["restricted"]
    sim.submit(tasks, keys)
    for _ in range(50):
        busy = next(a for a, computing in sim.computing.items() if computing)
        sim.finish(*list(sim.computing[busy]), worker=busy)
    counts = sim.state.task_counts()
    assert counts["queued"] and counts["memory"] and counts["no-worker"] == 1
    sim.release(keys)
    assert sim.state.tasks == {}
    assert len(sim.state.unrunnable) == 0
    assert sim.state.n_queued == 0
    assert not any(ts.state == "queued" for ts in sim.state.queued)
    assert sim.state.task_counts() == dict.fromkeys(
        ["released", "waiting", "queued", "no-worker", "processing", "memory", "erred"], 0)
    for ws in sim.state.workers.values():
        assert (len(ws.has_what), ws.nbytes, len(ws.processing)) == (0, 0, 0)
    assert all(not data for data in sim.data.values())


def test_recorded_transitions_are_all_taken_even_past_the_bounded_log():
    sim = Sim(transition_log_length=5, worker_saturation=float("inf"))
    sim.add_worker("A", 1)
    assert sim.state.take_transitions() == []  # off: nothing recorded
    sim.state.record_transitions(True)
    sim.submit([task(f"t{i}") for i in range(10)], [f"t{i}" for i in range(10)],
               stimulus_id="g")
    taken = sim.state.take_transitions()
    assert len(taken) == 20 and taken[:2] == [("t0", "released", "waiting", "g"),
                                              ("t0", "waiting", "processing", "g")]
    assert {finish for _, _, finish, _ in taken} == {"waiting", "processing"}
    assert sim.state.take_transitions() == []  # taken once
    sim.run_all()
    assert [entry[2] for entry in sim.state.take_transitions()] == ["memory"] * 10
    sim.state.record_transitions(False)
    sim.release([f"t{i}" for i in range(10)])
    assert sim.state.take_transitions() == []
