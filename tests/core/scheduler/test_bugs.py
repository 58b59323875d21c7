"""A bug in the state machine: work it left pending is kept, a runaway loop is caught.

An exception from a stimulus after it began to change the state is a bug, not bad input.
The recommendations and messages it left pending are carried out and returned by the
next stimulus. A stimulus that loops raises TransitionLimitExceeded instead of hanging.

The bugs are injected by replacing entries of the core's transition table, which both
the compiled and the interpreted core look up at run time.
"""
from __future__ import annotations

import pytest
from core_sim import Sim, computed, states, task

import distributed_core
from distributed_core import InvariantError, SchedulerState, TransitionLimitExceeded


def test_transition_limit_exceeded_is_a_runtime_error():
    assert issubclass(TransitionLimitExceeded, RuntimeError)
    assert not issubclass(TransitionLimitExceeded, ValueError)  # not bad input


# -- pending work is kept ------------------------------------------------------------


def after(start, finish, action):
    """A transition hook that runs ``action(state, ts)`` after each ``start -> finish``."""
    def hook(state, ts, moved_from, moved_to):
        if (moved_from, moved_to) == (start, finish):
            action(state, ts)
    return hook


def test_work_left_pending_by_a_stimulus_that_raised_is_done_by_the_next():
    sim = Sim(worker_saturation=float("inf"))
    sim.add_worker("A", 2)
    failed = []

    def fails_once(state, ts):  # the task is assigned, its compute-task message collected
        if not failed:
            failed.append(ts.key)
            raise RuntimeError("a bug in a transition")

    sim.state._transition_hook = after("waiting", "processing", fails_once)
    with pytest.raises(RuntimeError, match="a bug"):
        sim.state.update_graph("c", [task("a"), task("b")], ["a", "b"], "graph")
    sim.state._transition_hook = None
    client_msgs, worker_msgs = sim.record(sim.state.add_client("c2", "next"))
    assert sorted(computed(worker_msgs)) == ["a", "b"]
    stimulus_ids = {msg["key"]: msg["stimulus_id"] for msg in worker_msgs["A"]}
    assert stimulus_ids[failed[0]] == "graph"
    assert states(sim.state) == {"a": "processing", "b": "processing"}
    sim.state.validate_state()
    sim.run_all()
    assert states(sim.state) == {"a": "memory", "b": "memory"}


def test_messages_are_kept_when_validation_fails_at_the_end():
    sim = Sim()
    sim.add_worker("A", 1)

    def corrupts(state, ts):  # a bug that only validate_state (at the end) notices
        state.idle["ghost"] = state.workers["A"]

    sim.state._transition_hook = after("waiting", "processing", corrupts)
    with pytest.raises(InvariantError, match="ghost"):
        sim.state.update_graph("c", [task("a")], ["a"], "graph")
    sim.state._transition_hook = None
    del sim.state.idle["ghost"]
    _, worker_msgs = sim.record(sim.state.add_client("c2", "next"))
    assert computed(worker_msgs) == {"a": "A"}


# -- runaway loops -------------------------------------------------------------------


def loop_released_waiting(state):
    """Make released -> waiting recommend 'released' again: a recommendation loop."""
    released = distributed_core.TASK_STATES.index("released")

    def recommend_released(state, ts):
        state._recs[ts] = released

    state._transition_hook = after("released", "waiting", recommend_released)


def test_recommendation_loop_raises_transition_limit_exceeded():
    state = SchedulerState(validate=True, max_transitions_per_stimulus=1000)
    state.add_worker("A", 1, "join")
    loop_released_waiting(state)
    with pytest.raises(TransitionLimitExceeded) as info:
        state.update_graph("c", [task("spin")], ["spin"], "graph-7")
    message = str(info.value)
    assert "'graph-7'" in message and "1000 transitions" in message
    assert "'spin': released -> waiting" in message or "'spin': waiting -> released" in message
    state._transition_hook = None
    # The loop's recommendations were dropped: the next stimulus does not spin again.
    state.validate = False
    assert state.add_client("c2", "next") == ({}, {})


def test_default_transition_limit_scales_with_the_number_of_tasks():
    state = SchedulerState()  # no validation: the loop runs ~150,000 transitions
    state.add_worker("A", 1, "join")
    state.update_graph("c", [task(f"t{i}") for i in range(1000)],
                       [f"t{i}" for i in range(1000)], "graph")
    assert len(state.tasks) == 1000
    loop_released_waiting(state)
    with pytest.raises(TransitionLimitExceeded, match=f"more than {50 * 1002 + 100_000} "):
        state.update_graph("c", [task("spin")], ["spin"], "spin")


def test_max_transitions_per_stimulus_must_be_positive():
    for bad in (0, -1, 1.5, "10"):
        with pytest.raises(ValueError, match="max_transitions_per_stimulus"):
            SchedulerState(max_transitions_per_stimulus=bad)


def test_large_legitimate_stimuli_stay_under_the_default_limit():
    sim = Sim(validate=False, worker_saturation=float("inf"))
    sim.add_worker("A", 4)
    n = 20_000
    sim.submit([task(f"x{i}") for i in range(n)] + [task("sum", *[f"x{i}" for i in range(n)])],
               ["sum"])
    sim.run_all()  # one stimulus finishes all inputs, one the sum and forgets the inputs
    sim.release(["sum"])
    chain = [task("c0")] + [task(f"c{i}", f"c{i - 1}") for i in range(1, n)]
    sim.submit(chain, [f"c{n - 1}"])
    sim.release([f"c{n - 1}"])  # forgets the whole chain, one task after the other
    assert sim.state.tasks == {}
