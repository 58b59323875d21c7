"""task_finished and task_erred: results in, clients told, inputs freed, retries, errors."""
from __future__ import annotations

import pytest
from core_sim import Sim, compute, free, snapshot, states, task

from distributed_core import InvalidStimulus

INF = float("inf")


def in_memory(key, type_name="int", **extra) -> dict:
    return {"op": "key-in-memory", "key": key, "type": type_name, **extra}


def erred(key, blame, exception=b"exc", traceback=b"tb", text="ValueError('boom')") -> dict:
    return {"op": "task-erred", "key": key, "exception": exception, "traceback": traceback,
            "text": text, "blame": blame}


# -- task_finished -------------------------------------------------------------------------


def test_one_finished_stimulus_carries_many_reports():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 3)
    sim.submit([task("a"), task("b"), task("c")], ["a", "b", "c"])
    assert sim.finish("c", "a", "b") == (
        {"c": [in_memory("c"), in_memory("a"), in_memory("b")]}, {})
    assert states(sim.state) == {"a": "memory", "b": "memory", "c": "memory"}
    assert sim.state.workers["A"].nbytes == 3


def test_reports_decoded_from_the_wire_as_a_tuple_are_accepted():
    sim = Sim()
    sim.add_worker("A", 2)
    sim.submit([task("a"), task("b")], ["a", "b"])
    assert sim.state.task_finished("A", ({"key": "a", "nbytes": 1},), "f") == (
        {"c": [in_memory("a", None)]}, {})
    assert sim.state.task_erred("A", ({"key": "b", "exception": b"e", "traceback": b"t",
                                       "text": "boom"},), "e") == (
        {"c": [erred("b", "b", b"e", b"t", "boom")]}, {})


def test_finished_batch_can_complete_a_task_and_its_dependent_inputs_together():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 2)
    sim.submit([task("x1"), task("x2"), task("y", "x1", "x2")], ["y"])
    _, worker_msgs = sim.finish("x1", "x2", stimulus_id="f")
    assert worker_msgs == {"A": [compute("y", "f", (0, 0, 2),
                                         who_has={"x1": ["A"], "x2": ["A"]})]}


def test_finished_task_frees_the_inputs_nobody_needs_any_more():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x"), task("y", "x")], ["y"])
    sim.finish("x")
    assert sim.finish("y", stimulus_id="f") == ({"c": [in_memory("y")]},
                                                {"A": [free(["x"], "f")]})
    assert sim.state.workers["A"].nbytes == 1
    assert [ts.key for ts in sim.state.workers["A"].has_what] == ["y"]


def test_input_still_needed_by_another_dependent_is_kept():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 2)
    sim.submit([task("x"), task("y1", "x"), task("y2", "x")], ["y1", "y2"])
    sim.finish("x")
    assert sim.finish("y1") == ({"c": [in_memory("y1")]}, {})
    assert states(sim.state)["x"] == "memory"


def test_input_the_client_wants_is_kept():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x"), task("y", "x")], ["y", "x"])
    sim.finish("x")
    assert sim.finish("y") == ({"c": [in_memory("y")]}, {})
    assert states(sim.state) == {"x": "memory", "y": "memory"}


def test_every_client_that_wants_a_result_is_told():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"], client="c1")
    sim.submit([task("x")], ["x"], client="c2")
    client_msgs, _ = sim.finish("x", type="numpy.ndarray")
    assert client_msgs == {"c1": [in_memory("x", "numpy.ndarray")],
                           "c2": [in_memory("x", "numpy.ndarray")]}


def test_small_result_data_is_passed_through_to_the_clients():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    payload = b"\x80\x05\x95 not unpickled \xff"
    client_msgs, _ = sim.finish("x", data=payload)
    assert client_msgs == {"c": [in_memory("x", data=payload)]}
    assert client_msgs["c"][0]["data"] is payload


def test_late_report_of_a_forgotten_task_frees_it_on_the_worker():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    sim.release(["x"])
    assert "x" not in sim.state.tasks
    assert sim.finish("x", worker="A", stimulus_id="late") == ({}, {"A": [free(["x"], "late")]})


def test_report_from_a_worker_the_task_is_not_processing_on_is_freed_there():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    sim.submit([task("x", workers=["A"])], ["x"])
    assert sim.finish("x", worker="B", stimulus_id="stale") == ({}, {"B": [free(["x"], "stale")]})
    assert states(sim.state) == {"x": "processing"}


def test_report_of_a_result_in_memory_from_another_worker_frees_it_there():
    # A worker names only results it was told to compute: it cannot claim to hold a key.
    sim = Sim()
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    sim.submit([task("x", workers=["A"])], ["x"])
    sim.finish("x", nbytes=8)
    assert sim.finish("x", worker="B", nbytes=8, stimulus_id="claim") == (
        {}, {"B": [free(["x"], "claim")]})
    assert sim.state.who_has(["x"]) == {"x": ["A"]}
    assert sim.state.workers["B"].nbytes == 0


def test_repeated_report_from_the_worker_that_holds_the_result_changes_nothing():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    sim.finish("x", nbytes=8)
    assert sim.finish("x", worker="A", nbytes=8) == ({}, {})
    assert sim.state.who_has(["x"]) == {"x": ["A"]}
    assert sim.state.workers["A"].nbytes == 8


def test_report_from_a_removed_worker_is_ignored():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    sim.remove_worker("A")
    result = sim.state.task_finished("A", [{"key": "x", "nbytes": 1}], "late")
    assert result == ({}, {})
    assert states(sim.state) == {"x": "queued"}


def test_report_with_an_impossible_field_errs_that_task_only():
    bad_fields = [{"nbytes": "8"}, {"nbytes": -1}, {"nbytes": 2 ** 62 + 1}, {"nbytes": 1.5},
                  {"nbytes": True}, {"type": 5}, {"data": "not bytes"}]
    for fields in bad_fields:
        sim = Sim(worker_saturation=INF)
        sim.add_worker("A", 2)
        sim.submit([task("x"), task("y")], ["x", "y"])
        client_msgs, worker_msgs = sim.state.task_finished(
            "A", [{"key": "x", "nbytes": 8}, {"key": "y", "nbytes": 8, **fields}], "bad")
        [told_x, told_y] = client_msgs["c"]
        assert told_x == in_memory("x", None)
        assert (told_y["op"], told_y["key"], told_y["exception"], told_y["blame"]) == (
            "task-erred", "y", None, "y")
        assert "invalid task-finished report from A for 'y'" in told_y["text"], fields
        assert worker_msgs == {"A": [free(["y"], "bad")]}
        assert states(sim.state) == {"x": "memory", "y": "erred"}
        assert sim.state.tasks["y"].error == (None, None, told_y["text"], "y")


def test_message_about_an_impossible_field_quotes_a_bounded_part_of_it():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    client_msgs, _ = sim.state.task_finished("A", [{"key": "x", "nbytes": "9" * 10_000}], "f")
    text = client_msgs["c"][0]["text"]
    assert "nbytes" in text and len(text) < 400


def test_reports_that_name_no_usable_key_are_ignored():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    reports = ["not a dict", None, {"nbytes": 1}, {"key": ["unhashable"], "nbytes": 1},
               {"key": {"a": 1}}, {"key": "x", "nbytes": 1}]
    assert sim.state.task_finished("A", reports, "f") == ({"c": [in_memory("x", None)]}, {})
    assert sim.state.task_erred("A", reports[:5], "e") == ({}, {})


def test_bad_report_for_a_task_not_processing_there_is_a_stale_report():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    sim.submit([task("x", workers=["A"])], ["x"])
    assert sim.state.task_finished("B", [{"key": "x", "nbytes": -5}], "bad") == (
        {}, {"B": [free(["x"], "bad")]})
    assert sim.state.task_finished("B", [{"key": "nope", "nbytes": -5}], "bad2") == (
        {}, {"B": [free(["nope"], "bad2")]})
    assert states(sim.state) == {"x": "processing"}


def test_implausible_run_times_are_not_learned():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 4)
    sim.submit([task(f"inc-{i}") for i in range(4)], [f"inc-{i}" for i in range(4)])
    timings = [{"start": 0.0, "stop": float("inf")}, {"start": "0", "stop": 1.0},
               {"start": 5.0, "stop": 1.0}, {"start": 0, "stop": 2 ** 80}]
    reports = [{"key": f"inc-{i}", "nbytes": 1, **t} for i, t in enumerate(timings)]
    sim.state.task_finished("A", reports, "f")
    assert states(sim.state) == {f"inc-{i}": "memory" for i in range(4)}
    assert sim.state.prefixes["inc"].n_durations == 0


def test_finished_reports_that_are_not_a_list_are_refused():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    before = snapshot(sim.state)
    with pytest.raises(InvalidStimulus, match="reports must be a list"):
        sim.state.task_finished("A", {"key": "x"}, "bad")
    with pytest.raises(InvalidStimulus, match="reports must be a list"):
        sim.state.task_erred("A", "x", "bad")
    assert snapshot(sim.state) == before


# -- task_erred ----------------------------------------------------------------------------


def test_erred_task_is_run_again_while_it_has_retries():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t", retries=2)], ["t"])
    for attempt in ("e1", "e2"):
        assert sim.fail("t", stimulus_id=attempt) == (
            {}, {"A": [free(["t"], attempt), compute("t", attempt, (0, 0, 0))]})
    assert states(sim.state) == {"t": "processing"}


def test_erred_task_errs_once_its_retries_are_used_up():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t", retries=1)], ["t"])
    sim.fail("t")
    assert sim.fail("t", stimulus_id="last") == ({"c": [erred("t", "t")]}, {})
    assert states(sim.state) == {"t": "erred"}


def test_exception_and_traceback_bytes_pass_through_unchanged():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"])
    exception, traceback = b"\x80\x04pickled\x00exc\xff", b"\x80\x04pickled\x00tb\xfe"
    client_msgs, _ = sim.fail("t", exception=exception, traceback=traceback,
                              text="KeyError('k')")
    assert client_msgs == {"c": [erred("t", "t", exception, traceback, "KeyError('k')")]}
    assert client_msgs["c"][0]["exception"] is exception


def test_dependents_of_an_erred_task_are_erred_and_their_clients_told():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("a"), task("b", "a"), task("c", "b"), task("d")], ["c", "d"])
    sim.finish("a")
    client_msgs, _ = sim.fail("b", exception=b"E")
    assert client_msgs == {"c": [erred("c", "b", exception=b"E")]}
    assert states(sim.state) == {"a": "released", "b": "erred", "c": "erred",
                                 "d": "processing"}


def test_every_client_that_wants_an_erred_task_is_told():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"], client="c1")
    sim.submit([task("t"), task("u", "t")], ["u"], client="c2")
    client_msgs, _ = sim.fail("t")
    assert client_msgs == {"c1": [erred("t", "t")], "c2": [erred("u", "t")]}


def test_erred_task_frees_the_inputs_nobody_needs_any_more():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x"), task("y", "x")], ["y"])
    sim.finish("x")
    assert sim.fail("y", stimulus_id="e") == ({"c": [erred("y", "y")]},
                                              {"A": [free(["x"], "e")]})


def test_erred_report_for_a_task_not_processing_on_that_worker_is_ignored():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    sim.submit([task("t", workers=["A"])], ["t"])
    assert sim.fail("t", worker="B") == ({}, {})
    assert states(sim.state) == {"t": "processing"}


def test_erred_report_with_fields_of_the_wrong_type_errs_the_task_without_retry():
    for fields in [{"exception": "str, not bytes"}, {"traceback": 5}, {"text": b"bytes"}]:
        sim = Sim()
        sim.add_worker("A", 1)
        sim.submit([task("t", retries=3)], ["t"])
        report = {"key": "t", "exception": b"e", "traceback": b"t", "text": "boom", **fields}
        client_msgs, _ = sim.state.task_erred("A", [report], "e")
        [msg] = client_msgs["c"]
        assert (msg["key"], msg["exception"], msg["traceback"], msg["blame"]) == (
            "t", None, None, "t")
        assert msg["text"].startswith("invalid task-erred report from A for 't': "), fields
        assert states(sim.state) == {"t": "erred"}


def test_retried_task_keeps_its_inputs_in_memory():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("a"), task("b", "a"), task("c", "b", retries=1)], ["c"])
    sim.finish("a")
    sim.finish("b")
    assert sim.fail("c", stimulus_id="e") == (
        {}, {"A": [free(["c"], "e"), compute("c", "e", (0, 0, 2), who_has={"b": ["A"]})]})
    assert states(sim.state) == {"a": "released", "b": "memory", "c": "processing"}
