"""The worker's state machine, fed stimuli by hand: each test asserts the exact
instructions a stimulus returns (docs/protocol.md for the messages to the scheduler)."""
from __future__ import annotations

import pytest

from distributed_core import (
    Execute,
    Fetch,
    InvalidStimulus,
    ReleaseData,
    ReportHeld,
    SendMessage,
    StoreData,
    TransitionLimitExceeded,
    WorkerCore,
)

ME = "tcp://me:1"
A = "tcp://a:1"
B = "tcp://b:1"


def core(nthreads: int = 1, **options) -> WorkerCore:
    options.setdefault("validate", True)
    return WorkerCore(ME, nthreads, **options)


def compute(key, who_has=None, priority=(0, 0, 0), resources=None, spec=None) -> dict:
    """A compute-task message as the scheduler sends it."""
    msg = {"op": "compute-task", "key": key, "spec": spec or f"run {key}".encode(),
           "priority": priority, "stimulus_id": f"compute-{key}"}
    if who_has is not None:
        msg["who_has"] = who_has
    if resources is not None:
        msg["resources"] = resources
    return msg


def finished(key, nbytes: int = 8) -> dict:
    return {"op": "task-finished", "key": key, "nbytes": nbytes, "type": "int",
            "start": 1.0, "stop": 2.0}


def erred(key) -> dict:
    return {"op": "task-erred", "key": key, "exception": b"E", "traceback": b"T",
            "text": "ValueError()", "start": 1.0, "stop": 2.0}


def missing(key, errant) -> SendMessage:
    return SendMessage({"op": "missing-data", "key": key, "errant_worker": errant})


def reschedule(key) -> SendMessage:
    return SendMessage({"op": "reschedule", "key": key})


def states(w: WorkerCore) -> dict:
    return {key: ts.state for key, ts in w.tasks.items()}


def run(w: WorkerCore, key, value=None, nbytes: int = 8) -> list:
    """The execution of ``key`` succeeded with ``value``."""
    return w.execute_success(key, value, finished(key, nbytes), f"done-{key}")


def assert_refused(w: WorkerCore, call, match: str) -> None:
    before = (states(w), w.transition_counter, list(w.ready), dict(w.in_flight))
    with pytest.raises(InvalidStimulus, match=match):
        call()
    assert (states(w), w.transition_counter, list(w.ready), dict(w.in_flight)) == before


# -- executing -------------------------------------------------------------------------


def test_a_task_without_inputs_is_executed_at_once():
    w = core()
    assert w.compute_tasks([compute("a")], "s") == [Execute("a")]
    assert states(w) == {"a": "executing"}
    assert w.tasks["a"].run_spec == b"run a"


def test_a_result_is_stored_and_reported():
    w = core()
    w.compute_tasks([compute("a")], "s")
    assert run(w, "a", 42) == [StoreData("a", 42), SendMessage(finished("a"))]
    assert states(w) == {"a": "memory"} and w.tasks["a"].reported


def test_a_failure_is_reported_and_the_task_forgotten():
    w = core()
    w.compute_tasks([compute("a")], "s")
    assert w.execute_failure("a", erred("a"), "boom") == [SendMessage(erred("a"))]
    assert w.tasks == {}


def test_executions_of_one_batch_are_handed_out_in_priority_order():
    w = core(prefetch=2)
    msgs = [compute(f"t{p}", priority=(0, 0, p)) for p in (5, 2, 8, 0, 9)]
    assert w.compute_tasks(msgs, "s") == [Execute("t0"), Execute("t2")]
    assert run(w, "t0") == [StoreData("t0", None), SendMessage(finished("t0")), Execute("t5")]


def test_a_burst_of_outcomes_is_one_stimulus_and_makes_room_in_priority_order():
    w = core(prefetch=2)
    w.compute_tasks([compute(i, priority=(0, 0, i)) for i in range(6)], "s")
    assert w.executions_done([(0, "finished", "a", finished(0)), (1, "erred", None, erred(1))],
                             "burst") == [
        StoreData(0, "a"), SendMessage(finished(0)), SendMessage(erred(1)),
        Execute(2), Execute(3)]
    assert states(w) == {0: "memory", 2: "executing", 3: "executing", 4: "ready", 5: "ready"}


def test_at_most_prefetch_executions_are_handed_out():
    w = core(nthreads=1, prefetch=3)
    instructions = w.compute_tasks([compute(i, priority=(0, 0, i)) for i in range(10)], "s")
    assert instructions == [Execute(0), Execute(1), Execute(2)]
    assert w.n_executing == 3 and w.task_counts()["ready"] == 7


def test_a_late_urgent_task_overtakes_the_backlog():
    w = core(prefetch=2)
    w.compute_tasks([compute(i, priority=(0, 0, 10 + i)) for i in range(100)], "s")
    assert w.compute_tasks([compute("urgent", priority=(-1, 0, 0))], "s2") == []
    assert run(w, 0)[-1] == Execute("urgent")


def test_the_default_prefetch_is_four_per_thread_and_at_least_64():
    assert WorkerCore(ME, 1).prefetch == 64
    assert WorkerCore(ME, 32).prefetch == 128


def test_resources_limit_how_many_tasks_run_at_once():
    w = core(nthreads=4, resources={"GPU": 1})
    msgs = [compute(f"g{i}", priority=(0, 0, i), resources={"GPU": 1}) for i in range(3)]
    assert w.compute_tasks(msgs + [compute("free")], "s") == [Execute("g0"), Execute("free")]
    assert states(w) == {"g0": "executing", "g1": "constrained", "g2": "constrained",
                         "free": "executing"}
    assert run(w, "g0")[-1] == Execute("g1")
    assert w.available_resources == {"GPU": 0}


def test_a_task_needing_resources_the_worker_lacks_waits():
    w = core(resources={"GPU": 1})
    assert w.compute_tasks([compute("big", resources={"GPU": 2})], "s") == []
    assert w.compute_tasks([compute("tpu", resources={"TPU": 1})], "s") == []
    assert states(w) == {"big": "constrained", "tpu": "constrained"}
    assert w.free_keys(["big", "tpu"], "free") == [] and w.tasks == {}


def test_no_execution_starts_while_paused():
    w = core()
    assert w.pause("pause") == []
    assert w.compute_tasks([compute("a")], "s") == []
    assert states(w) == {"a": "ready"}
    assert w.unpause("unpause") == [Execute("a")]


# -- inputs from peers -------------------------------------------------------------------


def test_an_input_is_fetched_then_the_task_runs_and_the_copy_is_dropped():
    w = core()
    assert w.compute_tasks([compute("z", {"x": [A]})], "s") == [Fetch(A, ["x"])]
    assert states(w) == {"z": "waiting", "x": "flight"}
    assert w.fetch_done(A, {"x": 1}, [], "got", nbytes={"x": 28}) == [
        StoreData("x", 1), Execute("z")]
    assert w.tasks["x"].nbytes == 28 and not w.tasks["x"].reported
    assert run(w, "z", 2) == [StoreData("z", 2), SendMessage(finished("z")), ReleaseData("x")]
    assert states(w) == {"z": "memory"}


def test_inputs_of_one_burst_share_one_request_per_peer():
    w = core()
    msgs = [compute(f"z{i}", {f"x{i}": [A]}, priority=(0, 0, i)) for i in range(3)]
    assert w.compute_tasks(msgs, "s") == [Fetch(A, ["x0", "x1", "x2"])]


def test_a_peer_already_asked_in_a_burst_is_preferred():
    w = core()
    msgs = [compute("z1", {"x1": [A]}), compute("z2", {"x2": [B, A]})]
    assert w.compute_tasks(msgs, "s") == [Fetch(A, ["x1", "x2"])]


def test_the_least_loaded_holder_is_asked():
    w = core()
    w.compute_tasks([compute("z1", {"x1": [A]})], "s")
    assert w.compute_tasks([compute("z2", {"x2": [A, B]})], "s2") == [Fetch(B, ["x2"])]


def test_an_input_already_held_is_not_fetched():
    w = core()
    w.compute_tasks([compute("x")], "s")
    run(w, "x", 1)
    assert w.compute_tasks([compute("z", {"x": [ME]})], "s2") == [Execute("z")]
    assert run(w, "z", 2) == [StoreData("z", 2), SendMessage(finished("z"))]
    assert states(w) == {"x": "memory", "z": "memory"}  # x is reported: kept


def test_an_input_computed_here_is_awaited_not_fetched():
    w = core()
    w.compute_tasks([compute("x")], "s")
    assert w.compute_tasks([compute("z", {"x": [A]})], "s2") == []
    assert run(w, "x", 1) == [StoreData("x", 1), SendMessage(finished("x")), Execute("z")]


def test_a_fetched_copy_lives_as_long_as_a_pending_task_needs_it():
    w = core(nthreads=2)
    w.compute_tasks([compute("z1", {"x": [A]}), compute("z2", {"x": [A]})], "s")
    assert w.fetch_done(A, {"x": 1}, [], "got") == [StoreData("x", 1), Execute("z1"),
                                                     Execute("z2")]
    assert run(w, "z1") == [StoreData("z1", None), SendMessage(finished("z1"))]
    assert run(w, "z2") == [StoreData("z2", None), SendMessage(finished("z2")),
                            ReleaseData("x")]


def test_a_fetched_copy_asked_to_be_computed_is_reported_held_and_kept():
    w = core()
    w.compute_tasks([compute("z", {"x": [A]})], "s")
    w.fetch_done(A, {"x": 1}, [], "got")
    assert w.compute_tasks([compute("x")], "s2") == [ReportHeld("x")]
    assert run(w, "z") == [StoreData("z", None), SendMessage(finished("z"))]
    assert states(w) == {"x": "memory", "z": "memory"}


def test_a_failing_holder_is_replaced_by_the_next_one_at_once():
    w = core()
    (fetch,) = w.compute_tasks([compute("z", {"x": [A, B]})], "s")
    other = B if fetch.peer == A else A
    assert w.fetch_failed(fetch.peer, ["x"], "timeout") == [Fetch(other, ["x"])]
    assert w.fetch_done(other, {"x": 1}, [], "got") == [StoreData("x", 1), Execute("z")]


def test_a_holder_that_answers_missing_is_replaced_too():
    w = core()
    (fetch,) = w.compute_tasks([compute("z", {"x": [A, B]})], "s")
    other = B if fetch.peer == A else A
    assert w.fetch_done(fetch.peer, {}, ["x"], "missing") == [Fetch(other, ["x"])]


def test_when_no_holder_gives_an_input_its_tasks_are_given_back():
    w = core()
    w.compute_tasks([compute("z1", {"x": [A]}, priority=(0, 0, 1)),
                     compute("z2", {"x": [A], "y": [B]}, priority=(0, 0, 2))], "s")
    assert w.fetch_done(A, {}, ["x"], "missing") == [
        missing("x", A), reschedule("z1"), reschedule("z2")]
    assert w.tasks == {}
    assert w.fetch_done(B, {"y": 1}, [], "late") == []  # y is no longer wanted
    assert w.tasks == {}


def test_a_holder_list_naming_this_worker_counts_it_as_failed():
    w = core()
    assert w.compute_tasks([compute("z", {"x": [ME]})], "s") == [
        missing("x", ME), reschedule("z")]
    assert w.tasks == {}


def test_an_input_is_given_back_after_max_fetch_attempts():
    w = core(max_fetch_attempts=2)
    holders = [f"tcp://h{i}:1" for i in range(5)]
    (first,) = w.compute_tasks([compute("z", {"x": holders})], "s")
    (second,) = w.fetch_failed(first.peer, ["x"], "fail")
    assert w.fetch_failed(second.peer, ["x"], "fail") == [
        missing("x", first.peer), missing("x", second.peer), reschedule("z")]


def test_a_holder_that_failed_is_not_asked_again_when_named_again():
    w = core()
    w.compute_tasks([compute("z1", {"x": [A]})], "s")
    assert w.compute_tasks([compute("z2", {"x": [A]})], "s2") == []  # x is in flight
    assert w.fetch_failed(A, ["x"], "fail") == [
        missing("x", A), reschedule("z1"), reschedule("z2")]


def test_a_peer_gone_is_asked_for_nothing_more():
    w = core()
    w.compute_tasks([compute("z1", {"x1": [A]})], "s")
    w.compute_tasks([compute("z2", {"x2": [A, B]})], "s2")  # asks B: A is busier
    assert w.peer_gone(A, "gone") == [missing("x1", A), reschedule("z1")]
    assert w.tasks["x2"].who_has is None and w.tasks["x2"].failed == [A]


def test_an_answer_from_a_peer_not_asked_is_ignored():
    w = core()
    w.compute_tasks([compute("z", {"x": [A]})], "s")
    assert w.fetch_done(B, {"x": 1}, [], "stray") == []
    assert states(w) == {"z": "waiting", "x": "flight"}


def test_an_answer_after_the_task_was_freed_is_dropped():
    w = core()
    w.compute_tasks([compute("z", {"x": [A]})], "s")
    assert w.free_keys(["z"], "free") == []
    assert w.tasks == {}
    assert w.fetch_done(A, {"x": 1}, [], "late") == []


def test_a_key_in_flight_that_the_scheduler_asks_to_compute_is_computed():
    w = core()
    w.compute_tasks([compute("z", {"x": [A]})], "s")
    assert w.compute_tasks([compute("x")], "s2") == [Execute("x")]
    assert w.fetch_done(A, {"x": 1}, [], "late") == []  # computing it: the copy is dropped
    assert run(w, "x", 1) == [StoreData("x", 1), SendMessage(finished("x")), Execute("z")]


# -- free-keys, cancelled executions ----------------------------------------------------------


def test_free_keys_drops_results_and_forgets_pending_tasks():
    w = core(prefetch=1)
    w.compute_tasks([compute("a"), compute("b"), compute("c", {"x": [A]})], "s")
    run(w, "a", 1)
    assert states(w) == {"a": "memory", "b": "executing", "c": "waiting", "x": "flight"}
    assert w.free_keys(["a", "c", "never-heard-of"], "free") == [ReleaseData("a")]
    assert states(w) == {"b": "executing"}


def test_free_keys_of_a_queued_task_forgets_it_before_it_runs():
    w = core(prefetch=1)
    w.compute_tasks([compute("a"), compute("b")], "s")
    assert w.free_keys(["b"], "free") == []
    assert run(w, "a") == [StoreData("a", None), SendMessage(finished("a"))]


def test_free_keys_during_execution_discards_the_result():
    w = core()
    w.compute_tasks([compute("slow")], "s")
    assert w.free_keys(["slow"], "free") == []
    assert states(w) == {"slow": "cancelled"} and w.n_executing == 1
    assert run(w, "slow", 42) == []
    assert w.tasks == {} and w.n_executing == 0


def test_a_cancelled_execution_still_holds_its_executor_slot():
    w = core(prefetch=1)
    w.compute_tasks([compute("slow")], "s")
    w.free_keys(["slow"], "free")
    assert w.compute_tasks([compute("next")], "s2") == []
    assert run(w, "slow") == [Execute("next")]


def test_compute_task_after_free_keys_adopts_the_running_execution():
    w = core()
    w.compute_tasks([compute("slow")], "s")
    w.free_keys(["slow"], "free")
    assert w.compute_tasks([compute("slow")], "again") == []  # not run twice
    assert states(w) == {"slow": "executing"}
    assert run(w, "slow", 42) == [StoreData("slow", 42), SendMessage(finished("slow"))]


def test_the_core_says_whether_an_execution_handed_out_is_still_wanted():
    """``execution_wanted`` is what an executor thread reads to skip a job: set when an
    execution is handed out or adopted, cleared when it is cancelled or over."""
    w = core()
    w.compute_tasks([compute("t")], "s")
    ts = w.tasks["t"]
    assert ts.execution_wanted is True
    w.free_keys(["t"], "free")
    assert ts.state == "cancelled" and ts.execution_wanted is False
    w.compute_tasks([compute("t")], "again")
    assert ts.state == "executing" and ts.execution_wanted is True
    run(w, "t", 1)
    assert ts.state == "memory" and ts.execution_wanted is False
    w.compute_tasks([compute("u")], "s2")
    w.scheduler_lost("lost")
    assert w.tasks["u"].execution_wanted is False


def test_an_execution_skipped_while_cancelled_runs_again_once_adopted():
    w = core()
    w.compute_tasks([compute("t", {"x": [A]})], "s")
    w.fetch_done(A, {"x": 1}, [], "got")
    w.free_keys(["t"], "free")
    w.compute_tasks([compute("t", {"x": [A]})], "again")
    assert w.execute_skipped("t", "skipped") == [Execute("t")]  # x is still held
    assert states(w) == {"t": "executing", "x": "memory"}


def test_an_execution_skipped_while_cancelled_is_forgotten():
    w = core()
    w.compute_tasks([compute("t", {"x": [A]})], "s")
    w.fetch_done(A, {"x": 1}, [], "got")
    assert w.free_keys(["t"], "free") == []  # x stays until the execution's outcome
    assert w.execute_skipped("t", "skipped") == [ReleaseData("x")]
    assert w.tasks == {}


def test_a_cancelled_execution_whose_result_is_needed_here_provides_it():
    w = core(nthreads=2)
    w.compute_tasks([compute("x")], "s")
    w.free_keys(["x"], "free")
    assert w.compute_tasks([compute("z", {"x": [A]})], "s2") == []  # x is being computed
    assert run(w, "x", 1) == [StoreData("x", 1), Execute("z")]  # a copy: not reported
    assert not w.tasks["x"].reported
    assert run(w, "z") == [StoreData("z", None), SendMessage(finished("z")), ReleaseData("x")]


def test_a_cancelled_execution_needed_here_that_fails_is_fetched_instead():
    w = core(nthreads=2)
    w.compute_tasks([compute("x")], "s")
    w.free_keys(["x"], "free")
    w.compute_tasks([compute("z", {"x": [A]})], "s2")
    assert w.execute_failure("x", erred("x"), "boom") == [Fetch(A, ["x"])]


def test_a_frame_of_the_scheduler_is_one_stimulus_in_message_order():
    w = core()
    frame = [compute("z1", {"x1": [A]}), compute("gone"), {"op": "free-keys",
             "keys": ["gone"], "stimulus_id": "f"}, compute("z2", {"x2": [A]}),
             {"op": "free-keys", "keys": ["z1"], "stimulus_id": "f2"}, compute("z1", {"x1": [A]})]
    assert w.scheduler_messages(frame, "frame") == [Fetch(A, ["x1", "x2"])]
    assert states(w) == {"z1": "waiting", "x1": "flight", "z2": "waiting", "x2": "flight"}
    assert w.story("gone") == [("gone", "released", "ready", "compute-gone", 0.0),
                               ("gone", "ready", "released", "frame", 0.0),
                               ("gone", "released", "forgotten", "frame", 0.0)]
    with pytest.raises(InvalidStimulus, match="not a compute-task, free-keys or acquire-replicas"):
        w.scheduler_messages([{"op": "close"}], "frame")


def test_a_duplicate_compute_task_runs_once():
    w = core()
    assert w.compute_tasks([compute("d"), compute("d")], "s") == [Execute("d")]
    assert w.compute_tasks([compute("d")], "s2") == []


def test_compute_task_for_a_key_held_reports_it_without_running_again():
    w = core()
    w.compute_tasks([compute("r")], "s")
    run(w, "r", 7)
    assert w.compute_tasks([compute("r")], "s2") == [ReportHeld("r")]


def test_a_stale_outcome_is_ignored():
    w = core()
    assert run(w, "never-ran") == []
    assert w.execute_failure("never-ran", erred("never-ran"), "x") == []
    assert w.execute_skipped("never-ran", "x") == []
    assert w.tasks == {}


# -- the scheduler lost, values put by clients, values that cannot travel --------------------


def test_losing_the_scheduler_drops_everything():
    w = core(nthreads=2, prefetch=2)
    w.compute_tasks([compute("a"), compute("b"), compute("c"), compute("z", {"x": [A]})], "s")
    run(w, "a", 1)
    assert states(w) == {"a": "memory", "b": "executing", "c": "executing",
                         "z": "waiting", "x": "flight"}
    assert w.scheduler_lost("lost") == [ReleaseData("a")]
    assert states(w) == {"b": "cancelled", "c": "cancelled"}
    assert run(w, "b") == [] and w.execute_skipped("c", "skip") == []
    assert w.fetch_done(A, {"x": 1}, [], "late") == []
    assert w.tasks == {} and w.n_executing == 0


def adopted_after_the_scheduler_was_lost(w: WorkerCore) -> None:
    """``z`` runs with ``x`` put here; the scheduler is lost (``x`` is dropped); the
    new scheduler asks for ``z`` again: the execution in progress is adopted and ``x``
    fetched from ``A`` in case the executor skips it."""
    w.data_put({"x": 1}, "put", nbytes={"x": 8})
    assert w.compute_tasks([compute("z", {"x": []})], "s") == [Execute("z")]
    assert w.scheduler_lost("lost") == [ReleaseData("x")]
    assert w.compute_tasks([compute("z", {"x": [A]})], "again") == [Fetch(A, ["x"])]
    assert states(w) == {"z": "executing", "x": "flight"}


def test_an_input_lost_under_a_cancelled_execution_sends_no_reschedule():
    w = core(max_fetch_attempts=1)
    adopted_after_the_scheduler_was_lost(w)
    assert w.free_keys(["z"], "free") == []
    # z is not wanted: no reschedule (the scheduler refuses this missing-data; the
    # worker cannot tell it from one of a task given back in the same stimulus)
    assert w.fetch_failed(A, ["x"], "gone") == [missing("x", A)]
    assert states(w) == {"z": "cancelled"}
    assert run(w, "z", 2) == [] and w.tasks == {}


def test_an_input_lost_under_an_adopted_execution_gives_the_task_back():
    w = core(max_fetch_attempts=1)
    adopted_after_the_scheduler_was_lost(w)
    assert w.fetch_failed(A, ["x"], "gone") == [missing("x", A), reschedule("z")]
    assert states(w) == {"z": "cancelled"}  # its inputs let go of
    # the scheduler asks again, naming another holder: the execution is adopted again,
    # and if the executor skipped it, it runs once the input is here
    assert w.compute_tasks([compute("z", {"x": [B]})], "again") == [Fetch(B, ["x"])]
    assert w.execute_skipped("z", "skipped") == []
    assert states(w) == {"z": "waiting", "x": "flight"}
    assert w.fetch_done(B, {"x": 1}, [], "got") == [StoreData("x", 1), Execute("z")]


def test_a_cancelled_execution_adopted_again_learns_the_new_holders():
    w = core(max_fetch_attempts=2)
    adopted_after_the_scheduler_was_lost(w)
    w.free_keys(["z"], "free")
    assert w.compute_tasks([compute("z", {"x": [B]})], "again") == []  # x is in flight
    assert w.fetch_failed(A, ["x"], "gone") == [Fetch(B, ["x"])]


def test_an_input_let_go_of_in_a_give_up_is_not_fetched():
    w = core()
    # x is said to be here, which it is not: z is given back, and y, its other input,
    # is needed by nothing when its fetch would be planned
    assert w.compute_tasks([compute("z", {"x": [ME], "y": [A]})], "s") == [
        missing("x", ME), reschedule("z")]
    assert w.tasks == {} and not w.in_flight


def test_values_put_by_a_client_are_held_and_reported_held():
    w = core()
    assert w.data_put({"k": b"v"}, "put", nbytes={"k": 33}) == [StoreData("k", b"v")]
    assert w.tasks["k"].reported and w.tasks["k"].nbytes == 33
    assert w.compute_tasks([compute("k")], "s") == [ReportHeld("k")]
    assert w.free_keys(["k"], "free") == [ReleaseData("k")]


def test_a_value_that_failed_to_travel_is_dropped_and_its_recomputation_checked():
    w = core()
    w.compute_tasks([compute("x")], "s")
    run(w, "x", "unpicklable")
    why = "the result of 'x' (Lock, 64 bytes) cannot be serialized: TypeError"
    assert w.serve_failed({"x": why}, "serve") == [ReleaseData("x")]
    assert w.tasks == {} and w.cannot_travel == {"x": why}
    assert w.compute_tasks([compute("x")], "again") == [Execute("x")]
    assert w.tasks["x"].check  # the shell must show the result serializes
    assert run(w, "x", 1) == [StoreData("x", 1), SendMessage(finished("x"))]
    assert w.cannot_travel == {}  # it did


def test_no_fetch_starts_while_paused():
    w = core()
    w.pause("pause")
    assert w.compute_tasks([compute("z", {"x": [A]})], "s") == []
    assert states(w) == {"z": "waiting", "x": "fetch"}
    assert w.unpause("go") == [Fetch(A, ["x"])]


def test_a_value_that_failed_to_travel_but_is_needed_here_stays_and_errs_if_asked():
    w = core()
    w.compute_tasks([compute("z", {"x": [A]})], "s")
    w.pause("pause")
    w.fetch_done(A, {"x": 1}, [], "got")
    why = "cannot be serialized"
    assert w.serve_failed({"x": why}, "serve") == []
    assert w.compute_tasks([compute("x")], "s2") == [SendMessage(
        {"op": "task-erred", "key": "x", "exception": None, "traceback": None, "text": why})]
    assert w.unpause("go") == [Execute("z")]


def test_a_key_a_peer_could_not_serialize_is_remembered_here_too():
    w = core()
    w.compute_tasks([compute("z", {"x": [A]})], "s")
    assert w.fetch_done(A, {}, ["x"], "missing", errors={"x": "no pickle"}) == [
        missing("x", A), reschedule("z")]
    assert w.cannot_travel == {"x": "no pickle"}


def test_remembered_failures_are_bounded():
    from distributed_core import _worker_core
    w = core(validate=False)
    for i in range(_worker_core.CANNOT_TRAVEL_MEMORY + 5):
        w.serve_failed({i: "no"}, "serve")
    assert len(w.cannot_travel) == _worker_core.CANNOT_TRAVEL_MEMORY
    assert 0 not in w.cannot_travel and _worker_core.CANNOT_TRAVEL_MEMORY + 4 in w.cannot_travel


# -- transactions, story, limits -------------------------------------------------------------


@pytest.mark.parametrize("call, match", [
    (lambda w: w.compute_tasks([compute("ok"), {"op": "compute-task"}], "s"), "without a key"),
    (lambda w: w.compute_tasks([compute("ok"), compute([1])], "s"), "not hashable"),
    (lambda w: w.compute_tasks([dict(compute("ok"), spec=None)], "s"), "spec must be bytes"),
    (lambda w: w.compute_tasks([compute("ok", priority="high")], "s"), "priority"),
    (lambda w: w.compute_tasks([compute("ok", {"ok": [A]})], "s"), "depends on itself"),
    (lambda w: w.compute_tasks([compute("ok", {"x": A})], "s"), "list of addresses"),
    (lambda w: w.compute_tasks([compute("ok", resources={"GPU": -1})], "s"), "resources"),
    (lambda w: w.compute_tasks("nope", "s"), "must be a list"),
    (lambda w: w.free_keys("abc", "s"), "list of keys"),
    (lambda w: w.free_keys(["a"], 7), "stimulus_id"),
    (lambda w: w.execute_success("a", 1, {"op": "task-finished", "key": "b"}, "s"), "report"),
    (lambda w: w.execute_success("a", 1, dict(finished("a"), nbytes="big"), "s"), "nbytes"),
    (lambda w: w.executions_done([("a", "finished", 1, finished("a")), ("a", "won", 1, None)],
                                 "s"), "kind of an outcome"),
    (lambda w: w.executions_done([("a", 1)], "s"), "must be a tuple"),
    (lambda w: w.fetch_done(A, [], [], "s"), "data must be a dict"),
    (lambda w: w.fetch_done(A, {}, [], "s", errors={"x": 1}), "must be a str"),
    (lambda w: w.serve_failed(["x"], "s"), "errors must be a dict"),
    (lambda w: w.data_put({"k": 1}, "s", nbytes={"k": -5}), "nbytes"),
])
def test_a_refused_stimulus_changes_nothing(call, match):
    w = core(prefetch=1)
    w.compute_tasks([compute("a"), compute("b"), compute("z", {"x": [A]})], "setup")
    assert_refused(w, lambda: call(w), match)


def test_the_story_of_a_key_says_what_happened_and_why():
    w = core(clock=lambda: 5.0)
    w.compute_tasks([compute("z", {"x": [A]})], "s")
    w.fetch_done(A, {"x": 1}, [], "got-x")
    run(w, "z")
    assert w.story("x") == [
        ("x", "released", "fetch", "compute-z", 5.0),  # the scheduler's stimulus id
        ("x", "fetch", "flight", "s", 5.0),  # planned at the end of the frame's stimulus
        ("x", "flight", "memory", "got-x", 5.0),
        ("x", "memory", "released", "done-z", 5.0),
        ("x", "released", "forgotten", "done-z", 5.0)]
    assert [entry[1:3] for entry in w.story("z")] == [
        ("released", "waiting"), ("waiting", "ready"), ("ready", "executing"),
        ("executing", "memory")]
    assert w.story("z")[0][3] == "compute-z"


def test_the_transition_log_is_bounded():
    w = core(transition_log_length=3)
    w.compute_tasks([compute("a")], "s")
    run(w, "a")
    assert w.transition_counter == 3  # released -> ready (all inputs held) -> executing ...
    w.compute_tasks([compute("b")], "s2")
    assert len(w.transition_log) == 3 and w.transition_counter == 5
    assert w.transition_log[0] == ("a", "executing", "memory", "done-a", 0.0)


def test_a_runaway_stimulus_raises_transition_limit_exceeded():
    w = core(max_transitions_per_stimulus=5)
    w.compute_tasks([compute(i) for i in range(10)], "many")
    w.executions_done([(i, "finished", i, finished(i)) for i in range(10)], "done")
    with pytest.raises(TransitionLimitExceeded, match="more than 5 transitions"):
        w.free_keys(list(range(10)), "free")  # ten recommendations


def test_validation_catches_a_broken_invariant():
    from distributed_core import InvariantError
    w = core()
    w.compute_tasks([compute("a")], "s")
    w.tasks["a"].run_spec = None  # tampering: executing without a spec
    with pytest.raises(InvariantError):
        w.validate_state()


def test_freeing_many_ready_tasks_does_not_leave_them_in_the_heap():
    w = core(prefetch=1, validate=False)
    w.compute_tasks([compute(i, priority=(0, 0, i)) for i in range(1000)], "s")
    assert w.n_ready == 999
    w.free_keys(list(range(1, 1000)), "free")
    assert w.n_ready == 0 and len(w.ready) <= 64
    w.validate_state()


def test_every_missing_data_of_a_stimulus_goes_before_its_reschedules():
    """Found by the chaos soak: a reschedule sent before the other inputs' missing-data
    made the scheduler refuse them (no task there needed the keys any more), so it kept
    counting a hung worker as their holder."""
    w = WorkerCore("tcp://me:1", max_fetch_attempts=1, validate=True)
    w.compute_tasks([compute("D", {k: [A] for k in ("k1", "k2", "k3")})], "s1")
    ops = [ins.msg["op"] for ins in w.fetch_failed(A, ["k1", "k2", "k3"], "s2")]
    assert ops == ["missing-data"] * 3 + ["reschedule"]


# ---------------------------------------------------------------------- copies asked for


def added(*keys, sid) -> SendMessage:
    return SendMessage({"op": "add-keys", "keys": list(keys), "stimulus_id": sid})


def not_acquired(*keys, sid) -> SendMessage:
    return SendMessage({"op": "acquire-failed", "keys": list(keys), "stimulus_id": sid})


def test_a_copy_asked_for_is_fetched_kept_and_confirmed():
    w = core()
    assert w.acquire_replicas({"x": [A], "y": [A]}, "copy") == [Fetch(A, ["x", "y"])]
    assert w.fetch_done(A, {"x": 1, "y": 2}, [], "got", nbytes={"x": 8, "y": 9}) == [
        StoreData("x", 1), StoreData("y", 2), added("x", "y", sid="got")]
    assert w.tasks["x"].reported and w.tasks["x"].nbytes == 8
    assert w.story("x") == [("x", "released", "fetch", "copy", 0.0),
                            ("x", "fetch", "flight", "copy", 0.0),
                            ("x", "flight", "memory", "got", 0.0)]
    assert w.free_keys(["x"], "free") == [ReleaseData("x")]  # a held copy goes when freed


def test_a_value_held_for_a_task_here_is_confirmed_at_once_and_kept_after_the_task():
    w = core()
    w.compute_tasks([compute("z", who_has={"x": [A]})], "c")
    w.fetch_done(A, {"x": 1}, [], "got")
    assert w.acquire_replicas({"x": [A]}, "copy") == [added("x", sid="copy")]
    w.execute_success("z", 3, finished("z"), "ran")
    assert states(w) == {"x": "memory", "z": "memory"}  # the scheduler counts on x here


def test_a_copy_no_holder_gives_is_reported_missing_then_failed():
    w = core(max_fetch_attempts=2)
    assert w.acquire_replicas({"x": [A, B]}, "copy") in ([Fetch(A, ["x"])], [Fetch(B, ["x"])])
    first = w.tasks["x"].coming_from
    second = B if first == A else A
    assert w.fetch_done(first, {}, ["x"], "no") == [Fetch(second, ["x"])]
    assert w.fetch_failed(second, ["x"], "down") == [
        missing("x", first), missing("x", second), not_acquired("x", sid="down")]
    assert w.tasks == {}


def test_a_copy_freed_before_it_arrives_is_answered_failed_and_not_kept():
    w = core()
    w.acquire_replicas({"x": [A]}, "copy")
    assert w.free_keys(["x"], "free") == [not_acquired("x", sid="free")]
    assert w.fetch_done(A, {"x": 1}, [], "late") == []
    assert w.tasks == {}


def test_a_copy_of_a_key_computed_here_is_confirmed_when_it_is_done():
    w = core()
    w.compute_tasks([compute("x")], "c")
    assert w.acquire_replicas({"x": [A]}, "copy") == []
    assert w.execute_success("x", 1, finished("x"), "ran") == [
        StoreData("x", 1), SendMessage(finished("x")), added("x", sid="ran")]


def test_acquire_replicas_refuses_malformed_holders_and_changes_nothing():
    w = core()
    w.acquire_replicas({"x": [A]}, "copy")
    before = (states(w), w.tasks["x"].who_has, w.transition_log)
    for bad in [{"y": []}, {"y": A}, {"y": [1]}, [("y", [A])], {float("nan"): [A]}]:
        with pytest.raises(InvalidStimulus):
            w.acquire_replicas(bad, "bad")
        with pytest.raises(InvalidStimulus):
            w.scheduler_messages([{"op": "acquire-replicas", "who_has": bad}], "bad")
    assert (states(w), w.tasks["x"].who_has, w.transition_log) == before


def test_the_scheduler_lost_drops_copies_without_answering():
    w = core()
    w.pause("memory")  # the copy stays to fetch
    w.acquire_replicas({"x": [A]}, "copy")
    assert w.scheduler_lost("lost") == []
    assert w.tasks == {}


def test_recorded_transitions_are_taken_in_order_only_while_recording():
    w = core()
    w.scheduler_messages([compute("x")], "s1")
    assert w.take_transitions() == []  # off: nothing recorded
    w.record_transitions(True)
    w.scheduler_messages([compute("y")], "s2")
    run(w, "y", 1)
    assert w.take_transitions() == [
        ("y", "released", "ready", "compute-y"), ("y", "ready", "executing", "s2"),
        ("y", "executing", "memory", "done-y")]
    w.record_transitions(False)
    run(w, "x", 1)
    assert w.take_transitions() == []
