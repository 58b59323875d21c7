"""Copies of results between workers, and retiring workers, in the scheduler's state machine.

`acquire_replicas` asks a worker for copies; its answers (`replicas_added`,
`replicas_failed`) are accepted only for keys it was asked for; `remove_replicas` never
drops a last copy; a retiring worker (`retire_worker`) takes no new task until
`unretire_worker`. Every state is validated after every stimulus (Sim).

The plans behind retirement, replicate and rebalance are core queries too
(`retirement_plan`, `replication`, `surplus_holders`, `rebalance_moves`, ...): plain data in
and out, and they change nothing.
"""
from __future__ import annotations

import pytest
from core_sim import Sim, assert_refused, snapshot, task

from distributed_core import MAX_RECIPIENTS_PER_KEY, InvalidStimulus, Unauthorized


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


# ---------------------------------------------------------------------------- plans


def scattered(workers: dict, who_has: dict, nbytes: dict) -> Sim:
    """A Sim with ``workers`` ({address: name}) and results placed by ``update_data``."""
    sim = Sim()
    for address, name in workers.items():
        sim.add_worker(address, name=name)
    sim.scatter(who_has, nbytes)
    return sim


def unchanged(sim: Sim, query):
    """``query()``'s answer, checking that it changed nothing."""
    before = snapshot(sim.state)
    answer = query()
    assert snapshot(sim.state) == before
    return answer


def test_a_retirement_plan_sends_results_only_the_leaving_hold_largest_first_to_the_emptiest():
    sim = scattered({"a": None, "b": None, "c": None, "d": None},
                    {"x": ["a"], "y": ["a", "b"], "z": ["a", "c"], "big": ["b"], "w": ["d"]},
                    {"x": 10, "y": 30, "z": 5, "big": 100, "w": 1})
    # a and b leave: x, y, big are held only by them (y listed once, under a); z and w
    # stay where they are. a's first, largest first, each to the recipient holding the
    # fewest bytes so far: y (30) to d (1), x (10) to c (5), then b's big to c (15)
    plan, stuck = unchanged(sim, lambda: sim.state.retirement_plan(["a", "b"], ["c", "d"], {}))
    assert plan == {"d": ["y"], "c": ["x", "big"]} and stuck == {}
    # a holder is never a recipient, a worker that failed a key is not asked again
    plan, stuck = sim.state.retirement_plan(["a"], ["b", "c"], {"x": {"b"}})
    assert plan == {"c": ["x"]} and stuck == {}
    plan, stuck = sim.state.retirement_plan(["a"], ["b", "c"], {"x": {"b", "c"}})
    assert plan == {} and stuck == {"a": ["x"]}
    many = {"x": {f"tcp://{i}" for i in range(MAX_RECIPIENTS_PER_KEY)}}
    assert sim.state.retirement_plan(["a"], ["b", "c"], many) == ({}, {"a": ["x"]})
    assert sim.state.retirement_plan(["a"], [], {}) == ({}, {"a": ["x"]})
    # nothing held only there, or a worker not registered: nothing to plan
    assert sim.state.retirement_plan(["c", "ghost"], ["a"], {}) == ({}, {})


def test_replication_grows_a_tree_toward_n_holders_of_the_pool():
    sim = scattered({"a": None, "b": None, "c": None, "d": None, "e": None},
                    {"x": ["a"], "y": ["a", "b", "c"]}, {"x": 10, "y": 1})
    pool = ["a", "b", "c", "d", "e"]
    # x: one holder, branching 2: two copies this round, on the emptiest (d, e)
    assert unchanged(sim, lambda: sim.state.replication(["x", "y"], pool, 4, 2, {})) == \
        {"d": ["x", "y"], "e": ["x"]}
    assert sim.state.replication(["x"], pool, 4, 2, {"x": {"d"}}) == {"e": ["x"], "b": ["x"]}
    assert sim.state.replication(["x", "y"], pool, 1, 2, {}) == {}  # enough holders
    # keys not in memory and workers not registered are left out
    assert sim.state.replication(["nope", "x"], ["a", "ghost", "c"], 2, 1, {}) == {"c": ["x"]}


def test_surplus_holders_drop_copies_past_n_from_the_fullest_never_the_last():
    sim = scattered({"a": None, "b": None, "c": None},
                    {"x": ["a", "b", "c"], "y": ["a"], "z": ["b", "c"]},
                    {"x": 1, "y": 50, "z": 20})
    assert unchanged(sim, lambda: sim.state.surplus_holders(["x", "y", "z", "nope"],
                                                            ["a", "b", "c"], 1)) == \
        {"a": ["x"], "b": ["x", "z"]}
    assert sim.state.surplus_holders(["x", "z"], ["b", "c"], 1) == {"b": ["x", "z"]}
    assert sim.state.surplus_holders(["x"], ["a", "b", "c"], 3) == {}


def test_rebalance_moves_results_from_the_fullest_toward_the_mean():
    sim = scattered({"a": None, "b": None, "c": None},
                    {"big": ["a"], "mid": ["a"], "small": ["a"], "both": ["a", "b"]},
                    {"big": 60, "mid": 30, "small": 9, "both": 1})
    # a holds 100, b 1, c 0: mean 33, gap 1. big would take a below the mean; mid goes to
    # the neediest (c), small to b, then "both" to c (b holds it already)
    moves = unchanged(sim, lambda: sim.state.rebalance_moves(["a", "b", "c"]))
    assert moves == [("a", "c", "mid"), ("a", "b", "small"), ("a", "c", "both")]
    assert sim.state.rebalance_moves(["a", "b", "c"], ["small"]) == [("a", "c", "small")]
    assert sim.state.rebalance_moves([]) == [] and sim.state.rebalance_moves(["ghost"]) == []
    assert sim.state.rebalance_moves(["b", "c"], ["small"]) == []


def test_queries_a_retirement_asks():
    sim = scattered({"a": "alice", "b": "bob", "c": 7},
                    {"x": ["a"], "y": ["a", "b"]}, {"x": 10, "y": 1})
    sim.submit([task("p")], ["p"])
    state = sim.state
    # by name or address, each once, running ones; unknown names reported
    assert state.workers_to_retire(["bob", "a", "b", 7, "nobody"], None) == (
        ["b", "a", "c"], ["nobody"])
    assert state.workers_to_retire(None, 2) == (["c", "b"], [])  # fewest bytes first
    assert state.workers_to_retire(None, None)[0] == ["c", "b", "a"]
    sim.record(state.retire_worker("c", "retire"))
    assert state.workers_to_retire([7], None) == ([], [])
    assert state.workers_to_retire(None, 0) == ([], [])
    assert state.copy_recipients() == ["a", "b"]
    assert state.copy_recipients(["alice", "c"]) == ["a"]
    assert state.copy_recipients(exclude=["a"]) == ["b"]
    assert state.copy_recipients(paused=["b"]) == ["a"]
    assert state.registered(["ghost", "c", "a"]) == ["c", "a"]
    assert state.results_held("a") == ["x", "y"] and state.results_held("ghost") == []
    assert state.keys_not_in_memory(["x", "p", "nope", "y"]) == ["p", "nope"]
    assert state.keys_not_wanted("c", ["x", "nope"]) == []
    assert state.keys_not_wanted("other", ["x", "nope"]) == ["x"]
    assert state.holders_short(["x", "y", "nope"], ["a", "b"], 2) == ["x", "nope"]
    assert state.holders_short(["y"], ["b"], 1) == []
    assert state.droppable("a", ["x", "y", "nope"]) == ["y"]
    assert state.droppable("ghost", ["y"]) == []
    sim.record(state.acquire_replicas("b", ["x"], "copy"))
    assert state.copies_pending([("b", "x")]) and not state.copies_pending([("a", "x")])
    assert state.copies_held([("b", "x"), ("a", "x")]) == [("a", "x")]
    sim.copied("b", "x")
    assert not state.copies_pending([("b", "x")])
    assert state.copies_held([("b", "x"), ("ghost", "x")]) == [("b", "x")]
