"""Copies of results between workers, and retiring workers, in the scheduler's state machine.

`acquire_replicas` asks a worker for copies; its answers (`replicas_added`,
`replicas_failed`) are accepted only for keys it was asked for; `remove_replicas` never
drops a last copy; a retiring worker (`retire_worker`) takes no new task until
`unretire_worker`. Every state is validated after every stimulus (Sim).
"""
from __future__ import annotations

import pytest
from core_sim import Sim, assert_refused, task

from distributed_core import InvalidStimulus, Unauthorized


def two_workers_one_result(nbytes=10) -> tuple:
    """A Sim with workers a and b, and result x computed on one of them: (sim, holder,
    other)."""
    sim = Sim()
    sim.add_worker("a")
    sim.add_worker("b")
    sim.submit([task("x")], ["x"])
    holder = sim.where("x")
    sim.finish("x", nbytes=nbytes)
    return sim, holder, "b" if holder == "a" else "a"


def test_a_copy_counts_once_the_worker_confirms_it():
    sim, holder, other = two_workers_one_result()
    _, worker_msgs = sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    assert worker_msgs == {other: [{"op": "acquire-replicas", "who_has": {"x": [holder]},
                                    "stimulus_id": "copy"}]}
    assert sim.state.who_has(["x"]) == {"x": [holder]}  # not before it confirms
    sim.copied(other, "x")
    assert sorted(sim.state.who_has(["x"])["x"]) == ["a", "b"]
    assert sim.state.workers[other].nbytes == 10
    assert sim.state.counters()["nbytes_in_memory"] == 10  # one result, however many copies
    assert sim.state.workers[other].acquiring is None
    sim.check_workers_agree()


def test_a_copy_that_failed_changes_nothing_but_ends_the_request():
    sim, holder, other = two_workers_one_result()
    sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    assert sim.record(sim.state.replicas_failed(other, ["x"], "failed")) == ({}, {})
    assert sim.state.who_has(["x"]) == {"x": [holder]}
    assert sim.state.workers[other].acquiring is None


def test_a_copy_of_a_result_released_meanwhile_is_freed_on_arrival():
    sim, holder, other = two_workers_one_result()
    sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    sim.release(["x"])
    assert "x" not in sim.state.tasks
    _, worker_msgs = sim.copied(other, "x", stimulus_id="late")
    assert worker_msgs == {other: [{"op": "free-keys", "keys": ["x"], "stimulus_id": "late"}]}
    sim.check_workers_agree()


def test_a_worker_may_report_missing_an_input_it_was_asked_to_copy():
    sim, holder, other = two_workers_one_result()
    sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    _, worker_msgs = sim.record(sim.state.missing_data(other, "x", holder, "missing"))
    assert worker_msgs[holder][0] == {"op": "free-keys", "keys": ["x"], "stimulus_id": "missing"}
    assert sim.state.tasks["x"].state == "processing"  # its only holder lost it: run again


def test_answers_about_copies_it_was_not_asked_for_are_refused_and_change_nothing():
    sim, holder, other = two_workers_one_result()
    assert_refused(sim.state, lambda: sim.state.replicas_added(other, ["x"], "lie"),
                   Unauthorized, "was not asked to copy")
    assert_refused(sim.state, lambda: sim.state.replicas_failed(other, ["x"], "lie"),
                   Unauthorized)
    sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    assert_refused(sim.state, lambda: sim.state.replicas_added(holder, ["x"], "lie"),
                   Unauthorized)
    assert_refused(sim.state, lambda: sim.state.replicas_added(other, ["x", "y"], "lie"),
                   Unauthorized, r"\['y'\]")
    assert_refused(sim.state, lambda: sim.state.replicas_added(other, "x", "junk"))
    assert_refused(sim.state, lambda: sim.state.replicas_added(other, [["x"]], "junk"))
    # a worker that left is not refused: its stale answer is ignored
    assert sim.state.replicas_added("gone", ["x"], "late") == ({}, {})


def test_acquire_replicas_refuses_what_cannot_be_copied():
    sim, holder, other = two_workers_one_result()
    sim.submit([task("y")], ["y"])  # processing
    for worker, keys, match in [(holder, ["x"], "already holds"), ("ghost", ["x"], "running"),
                                (other, ["y"], "not in memory"), (other, ["nope"], "not in memory"),
                                (other, "x", "list"), (5, ["x"], "str")]:
        assert_refused(sim.state, lambda: sim.state.acquire_replicas(worker, keys, "copy"),
                       InvalidStimulus, match)
    sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    assert_refused(sim.state, lambda: sim.state.acquire_replicas(other, ["x"], "again"),
                   InvalidStimulus, "already asked")


def test_remove_replicas_never_drops_the_last_copy():
    sim, holder, other = two_workers_one_result()
    assert_refused(sim.state, lambda: sim.state.remove_replicas(holder, ["x"], "drop"),
                   InvalidStimulus, "only copy")
    assert_refused(sim.state, lambda: sim.state.remove_replicas(other, ["x"], "drop"),
                   InvalidStimulus, "holds no")
    sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    sim.copied(other, "x")
    _, worker_msgs = sim.record(sim.state.remove_replicas(holder, ["x"], "drop"))
    assert worker_msgs == {holder: [{"op": "free-keys", "keys": ["x"], "stimulus_id": "drop"}]}
    assert sim.state.who_has(["x"]) == {"x": [other]}
    assert sim.state.workers[holder].nbytes == 0
    sim.check_workers_agree()


def test_a_retiring_worker_takes_no_new_task_until_unretired():
    sim = Sim()
    sim.add_worker("a")
    sim.add_worker("b")
    sim.record(sim.state.retire_worker("a", "retire"))
    assert "a" not in sim.state.idle
    sim.submit([task(f"t{i}") for i in range(4)] + [task("r", workers=["a"])],
               [f"t{i}" for i in range(4)] + ["r"])
    assert not sim.computing["a"]
    assert sim.state.tasks["r"].state == "no-worker"
    sim.run_all()
    assert not sim.computing["a"] and sim.state.workers["a"].nbytes == 0
    assert_refused(sim.state, lambda: sim.state.retire_worker("a", "again"),
                   InvalidStimulus, "not a running worker")
    assert_refused(sim.state, lambda: sim.state.acquire_replicas("a", ["t0"], "copy"),
                   InvalidStimulus, "running")
    sim.record(sim.state.unretire_worker("a", "back"))
    assert sim.where("r") == "a"
    assert_refused(sim.state, lambda: sim.state.unretire_worker("a", "again"),
                   InvalidStimulus, "not a retiring worker")


def test_a_retiring_worker_still_hears_about_its_tasks_and_results():
    sim, holder, other = two_workers_one_result()
    sim.record(sim.state.retire_worker(holder, "retire"))
    _, worker_msgs = sim.release(["x"])
    assert worker_msgs[holder][0]["op"] == "free-keys"
    sim.check_workers_agree()


def test_a_retired_worker_leaves_without_losing_copied_results():
    sim, holder, other = two_workers_one_result()
    sim.record(sim.state.retire_worker(holder, "retire"))
    sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    sim.copied(other, "x")
    sim.remove_worker(holder)
    assert sim.state.tasks["x"].state == "memory"
    assert sim.state.who_has(["x"]) == {"x": [other]}


def test_pending_copies_go_with_a_worker_that_leaves():
    sim, holder, other = two_workers_one_result()
    sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    sim.remove_worker(other)
    sim.add_worker(other)
    assert sim.state.workers[other].acquiring is None
    assert_refused(sim.state, lambda: sim.state.replicas_added(other, ["x"], "stale"),
                   Unauthorized)


@pytest.mark.parametrize("compute_again", [False, True])
def test_a_copy_confirmed_after_its_key_was_computed_again_does_not_free_the_new_one(
        compute_again):
    sim, holder, other = two_workers_one_result()
    sim.record(sim.state.acquire_replicas(other, ["x"], "copy"))
    sim.release(["x"])
    sim.submit([task("x", workers=[other])], ["x"])
    if compute_again:
        sim.finish("x", worker=other)
    _, worker_msgs = sim.copied(other, "x")
    assert not worker_msgs  # the new x (running or held there) is left alone
    assert sim.state.tasks["x"].state == ("memory" if compute_again else "processing")
