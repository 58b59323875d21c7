"""The worker's state machine answering steal requests: a task not handed to the
executor is given back (and forgotten here); one handed out, finished or unknown is
kept; each request gets exactly one steal-response."""
from __future__ import annotations

import pytest

from distributed_core import Execute, Fetch, InvalidStimulus, SendMessage, StoreData, WorkerCore

ME = "tcp://me:1"
A = "tcp://a:1"


def core(**options) -> WorkerCore:
    options.setdefault("validate", True)
    return WorkerCore(ME, 1, **options)


def compute(key, who_has=None, priority=(0, 0, 0)) -> dict:
    msg = {"op": "compute-task", "key": key, "spec": f"run {key}".encode(),
           "priority": priority, "stimulus_id": f"compute-{key}"}
    if who_has is not None:
        msg["who_has"] = who_has
    return msg


def answer(key, request, given, state, stimulus_id) -> SendMessage:
    return SendMessage({"op": "steal-response", "key": key, "request": request,
                        "given": given, "state": state, "stimulus_id": stimulus_id})


def states(w: WorkerCore) -> dict:
    return {key: ts.state for key, ts in w.tasks.items()}


def test_a_ready_task_is_given_back_and_forgotten():
    w = core(prefetch=1)
    assert w.compute_tasks([compute("a", priority=(0, 0, 0)),
                            compute("b", priority=(0, 0, 1))], "s") == [Execute("a")]
    assert states(w) == {"a": "executing", "b": "ready"}
    assert w.steal_request("b", 7, "steal") == [answer("b", 7, True, "ready", "steal")]
    assert states(w) == {"a": "executing"}
    # the executor's next free slot does not run it
    assert w.execute_success("a", 1, {"op": "task-finished", "key": "a", "nbytes": 8,
                                      "type": "int", "start": 0.0, "stop": 1.0},
                             "done")[0] == StoreData("a", 1)
    assert w.executing_tasks == {}


def test_an_executing_task_is_kept():
    w = core()
    w.compute_tasks([compute("a")], "s")
    assert w.steal_request("a", 1, "steal") == [answer("a", 1, False, "executing", "steal")]
    assert states(w) == {"a": "executing"}


def test_an_execution_that_has_not_begun_is_given_back_and_skipped():
    w = core()
    w.compute_tasks([compute("a"), compute("b", priority=(0, 0, 1))], "s")
    assert states(w) == {"a": "executing", "b": "executing"}
    # the shell says which executions began: a did, b is still queued for the threads
    out = w.steal_request("b", 1, "steal", begun={"a"})
    assert out == [answer("b", 1, True, "executing", "steal")]
    assert states(w) == {"a": "executing", "b": "cancelled"}
    assert w.steal_request("a", 2, "steal", begun={"a"}) == \
        [answer("a", 2, False, "executing", "steal")]
    w.execute_skipped("b", "skipped")  # the thread skips the cancelled job
    assert states(w) == {"a": "executing"}
    assert list(w.executing_tasks) == [w.tasks["a"]]


def test_a_given_back_execution_adopted_again_runs_here_once():
    w = core()
    w.compute_tasks([compute("a")], "s")
    w.steal_request("a", 1, "steal", begun=())
    assert states(w) == {"a": "cancelled"}
    # the scheduler gives it back to this worker before the thread reached the job
    assert w.compute_tasks([compute("a")], "again") == []
    assert states(w) == {"a": "executing"}


def test_a_waiting_task_is_given_back_and_its_fetch_dropped():
    w = core()
    assert w.compute_tasks([compute("t", who_has={"x": [A]})], "s") == [Fetch(A, ["x"])]
    assert states(w) == {"t": "waiting", "x": "flight"}
    assert w.steal_request("t", 2, "steal") == [answer("t", 2, True, "waiting", "steal")]
    # the input in flight is no longer needed here: its answer will be dropped
    assert states(w).get("t") is None
    w.validate_state()


def test_a_finished_or_unknown_task_is_kept():
    w = core()
    w.compute_tasks([compute("a")], "s")
    w.execute_success("a", 1, {"op": "task-finished", "key": "a", "nbytes": 8,
                               "type": "int", "start": 0.0, "stop": 1.0}, "done")
    assert w.steal_request("a", 3, "steal") == [answer("a", 3, False, "memory", "steal")]
    assert w.steal_request("zz", 4, "steal") == [answer("zz", 4, False, None, "steal")]
    assert states(w) == {"a": "memory"}


def test_steal_requests_come_in_the_scheduler_stream_in_order():
    """A compute-task and a steal-request of the same frame: executions are handed out
    at the end of the frame, so the task is given back; a later compute-task brings it
    back."""
    w = core(prefetch=1)
    out = w.scheduler_messages([
        compute("a"), compute("b", priority=(0, 0, 1)),
        {"op": "steal-request", "key": "b", "request": 5, "stimulus_id": "bal-1"}], "frame")
    assert out == [answer("b", 5, True, "ready", "bal-1"), Execute("a")]
    assert states(w) == {"a": "executing"}
    w.scheduler_messages([compute("b", priority=(0, 0, 1))], "frame-2")
    assert states(w) == {"a": "executing", "b": "ready"}


@pytest.mark.parametrize("key, request_id, match", [
    (["k"], 1, "steal-request"),
    ("k", "1", "request must be an int"),
    ("k", None, "request must be an int"),
])
def test_bad_steal_requests_are_refused(key, request_id, match):
    w = core()
    w.compute_tasks([compute("a")], "s")
    with pytest.raises(InvalidStimulus, match=match):
        w.steal_request(key, request_id, "bad")
    with pytest.raises(InvalidStimulus, match=match):
        w.scheduler_messages([{"op": "steal-request", "key": key, "request": request_id}],
                             "bad")
    assert states(w) == {"a": "executing"}
