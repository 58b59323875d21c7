"""Workers leaving, losing data and giving tasks back; data scattered onto workers."""
from __future__ import annotations

import pytest
from core_sim import (
    Sim,
    assert_refused,
    compute,
    computed,
    free,
    freed,
    ops,
    snapshot,
    states,
    task,
)

from distributed_core import Unauthorized


def two_workers(**options) -> Sim:
    sim = Sim(**options)
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    return sim


# -- add_worker ----------------------------------------------------------------------------


def test_adding_a_worker_twice_or_with_no_threads_is_refused():
    sim = Sim()
    sim.add_worker("A", 1)
    assert_refused(sim.state, lambda: sim.state.add_worker("A", 1, "again"),
                   match="already registered")
    assert_refused(sim.state, lambda: sim.state.add_worker("B", 0, "none"), match="nthreads")
    assert list(sim.state.workers) == ["A"]


def test_worker_with_an_impossible_thread_count_is_refused():
    sim = Sim()
    sim.submit([task("t")], ["t"])
    for nthreads in (2 ** 63, 2 ** 31, -1, 1.0, 2.5, "4", None, True):
        assert_refused(sim.state, lambda: sim.state.add_worker("A", nthreads, "join"),
                       match="nthreads must be an int from 1 to 2147483647")
    sim.add_worker("A", 2 ** 31 - 1)
    assert states(sim.state) == {"t": "processing"}


def test_worker_with_bad_resources_or_name_is_refused():
    sim = Sim()
    bad_resources = [[("GPU", 1)], {"GPU": -1}, {"GPU": float("inf")}, {"GPU": float("nan")},
                     {"GPU": "1"}, {1: 1}, {"GPU": 2 ** 64}, {"GPU": True}]
    for resources in bad_resources:
        assert_refused(sim.state, lambda: sim.state.add_worker("A", 1, "join",
                                                               resources=resources),
                       match="resources")
    for name in (1.5, b"bytes", ["A"], 2 ** 64):
        assert_refused(sim.state, lambda: sim.state.add_worker("A", 1, "join", name=name),
                       match="name")
    for address in (None, 5, b"A"):
        assert_refused(sim.state, lambda: sim.state.add_worker(address, 1, "join"),
                       match="worker address must be a str")


def test_worker_resources_are_copied():
    sim = Sim()
    resources = {"GPU": 1}
    sim.add_worker("A", 1, resources=resources)
    resources["GPU"] = 100
    assert sim.state.workers["A"].resources == {"GPU": 1}


def test_worker_saturation_must_be_positive():
    for saturation in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="worker_saturation"):
            Sim(worker_saturation=saturation)


# -- remove_worker -------------------------------------------------------------------------


def test_processing_task_of_a_removed_worker_is_rescheduled_on_another():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"])
    sim.add_worker("B", 1)
    assert sim.remove_worker("A", stimulus_id="gone") == (
        {}, {"B": [compute("t", "gone", (0, 0, 0))]})
    assert sim.state.tasks["t"].processing_on.address == "B"
    assert sim.state.tasks["t"].suspicious == 1


def test_result_only_the_removed_worker_held_is_recomputed_when_still_needed():
    sim = two_workers()
    sim.submit([task("x", workers=["A"], allow_other_workers=True),
                task("z", workers=["B"]), task("y", "x", "z")], ["y"])
    sim.finish("x")
    assert states(sim.state) == {"x": "memory", "z": "processing", "y": "waiting"}
    assert sim.remove_worker("A", stimulus_id="gone") == (
        {}, {"B": [compute("x", "gone", (0, 0, 0))]})
    assert states(sim.state) == {"x": "processing", "z": "processing", "y": "waiting"}


def test_wanted_result_only_the_removed_worker_held_is_recomputed():
    sim = two_workers()
    sim.submit([task("x", workers=["A"], allow_other_workers=True)], ["x"])
    sim.finish("x")
    client_msgs, worker_msgs = sim.remove_worker("A")
    assert client_msgs == {}
    assert computed(worker_msgs) == {"x": "B"}


def test_result_also_held_by_another_worker_survives_the_removal():
    sim = two_workers()
    sim.submit([task("x", workers=["A"])], ["x"])
    sim.finish("x", nbytes=5)
    sim.scatter({"x": ["B"]}, {"x": 5})  # the client that wants x put a copy on B
    assert sim.remove_worker("A") == ({}, {})
    assert sim.state.who_has(["x"]) == {"x": ["B"]}
    assert sim.state.workers["B"].nbytes == 5


def test_removing_the_last_worker_queues_its_root_tasks():
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"])
    assert sim.remove_worker("A") == ({}, {})
    assert states(sim.state) == {"t": "queued"}


def test_removing_the_last_worker_without_queuing_leaves_tasks_with_no_worker():
    sim = Sim(worker_saturation=float("inf"))
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"])
    sim.remove_worker("A")
    assert states(sim.state) == {"t": "no-worker"}


# -- a departure in slices ---------------------------------------------------------------


def departing_with_results(n: int, max_keys: int) -> Sim:
    """Workers A and B; A computed ``r0`` .. ``r{n-1}`` (10 bytes each), wanted by client
    c, then left: its first slice of ``max_keys`` results is let go of."""
    sim = two_workers()
    keys = [f"r{i}" for i in range(n)]
    sim.submit([task(key, workers=["A"], allow_other_workers=True) for key in keys], keys)
    for key in keys:
        sim.finish(key, nbytes=10)
    sim.remove_worker("A", max_keys=max_keys)
    return sim


def test_a_worker_holding_many_results_lets_go_of_them_in_slices():
    sim = departing_with_results(5, max_keys=2)
    keys = [f"r{i}" for i in range(5)]
    worker_msgs = sim.log[-1][1]
    assert len(computed(worker_msgs)) == 2 and set(computed(worker_msgs).values()) == {"B"}
    departing = sim.state.departing["A"]
    assert "A" not in sim.state.workers and len(departing.has_what) == 3
    assert departing.nbytes == 30
    # r0 went in the first slice (recomputing on B); r2 is named only on the gone worker
    assert sim.state.who_has(["r0", "r2"]) == {"r2": ["A"]}
    sim.remove_worker("A", max_keys=2)
    _, worker_msgs = sim.remove_worker("A", max_keys=2)
    assert "A" not in sim.state.departing
    assert all(state in ("processing", "memory") for state in states(sim.state).values())
    assert not sim.state.departing
    assert sim.state.remove_worker("A", "again", max_keys=2) == ({}, {})


def test_results_that_tasks_still_need_go_in_the_first_slice():
    sim = two_workers()
    sim.submit([task("x", workers=["A"], allow_other_workers=True),
                task("z", workers=["B"]), task("y", "x", "z")]
               + [task(f"leaf{i}", workers=["A"], allow_other_workers=True)
                  for i in range(4)], ["y"] + [f"leaf{i}" for i in range(4)])
    for key in ["x", "leaf0", "leaf1", "leaf2", "leaf3"]:
        sim.finish(key)
    assert states(sim.state)["y"] == "waiting"
    _, worker_msgs = sim.remove_worker("A", max_keys=1)
    assert "x" in computed(worker_msgs)  # needed by y: recomputed at once
    assert states(sim.state)["x"] == "processing"
    assert len(sim.state.departing["A"].has_what) == 3


def test_a_task_never_fetches_from_a_departing_worker():
    """A result only a departing worker still holds is recomputed when a new task needs
    it, instead of sending the task to fetch it from a worker that is gone."""
    sim = departing_with_results(4, max_keys=1)
    held = sorted(ts.key for ts in sim.state.departing["A"].has_what)
    _, worker_msgs = sim.submit([task("use", held[0])], ["use"], client="d")
    assert computed(worker_msgs) == {held[0]: "B"}  # recomputed; Sim checks every who_has
    assert states(sim.state)["use"] == "waiting"
    sim.finish(held[0])
    assert computed(sim.log[-1][1]) == {"use": "B"}


def test_a_worker_back_at_a_departing_address_starts_with_nothing_of_the_old_one():
    sim = departing_with_results(4, max_keys=1)
    sim.add_worker("A", 1)
    assert not sim.state.departing and not sim.state.workers["A"].has_what


def test_a_bad_slice_size_is_refused():
    sim = two_workers()
    for bad in (0, -1, 1.5, "2", True, 2**63):
        assert_refused(sim.state, lambda: sim.state.remove_worker("A", "x", max_keys=bad),
                       match="max_keys")
    assert "A" in sim.state.workers


def test_removing_an_unknown_worker_changes_nothing():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"])
    assert sim.state.remove_worker("nowhere", "x") == ({}, {})
    assert states(sim.state) == {"t": "processing"}


def test_task_running_on_three_workers_that_died_is_erred_with_killed_worker():
    sim = Sim(allowed_failures=3)
    for address in "ABCD":
        sim.add_worker(address, 1)
    sim.submit([task("t")], ["t"])
    for _ in range(2):
        client_msgs, worker_msgs = sim.remove_worker(sim.where("t"))
        assert client_msgs == {}
        assert [m["key"] for msgs in worker_msgs.values() for m in msgs] == ["t"]
    last = sim.where("t")
    assert sim.remove_worker(last) == ({"c": [{
        "op": "task-erred", "key": "t", "exception": None, "traceback": None,
        "text": f"KilledWorker: 't' was running on 3 workers that died, the last one {last}",
        "blame": "t"}]}, {})
    assert states(sim.state) == {"t": "erred"}


def test_dependents_of_a_killed_worker_task_are_erred():
    sim = Sim(allowed_failures=1)
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    sim.submit([task("t", workers=["A"]), task("u", "t")], ["u"])
    client_msgs, _ = sim.remove_worker("A")
    [msg] = client_msgs["c"]
    assert (msg["key"], msg["blame"]) == ("u", "t")
    assert msg["text"].startswith("KilledWorker:")
    assert states(sim.state) == {"t": "erred", "u": "erred"}


def test_results_lost_together_with_their_inputs_are_recomputed():
    n = 20  # lost (a_i, b_i) pairs: the order they are handled in is the set order of has_what
    sim = Sim(worker_saturation=float("inf"))
    sim.add_worker("A", 1)
    sim.submit([t for i in range(n) for t in (task(f"a{i}"), task(f"b{i}", f"a{i}"))],
               [f"a{i}" for i in range(n)] + [f"b{i}" for i in range(n)])
    sim.run_all()
    sim.add_worker("B", 1)
    sim.submit([task(f"c{i}", f"b{i}", workers=["B"]) for i in range(n)],
               [f"c{i}" for i in range(n)])
    sim.release([f"b{i}" for i in range(n)])
    _, worker_msgs = sim.remove_worker("A")
    assert sorted(computed(worker_msgs)) == sorted(f"a{i}" for i in range(n))
    assert sim.state.task_counts()["processing"] == n


def test_task_rescheduled_from_a_dead_worker_keeps_inputs_held_elsewhere():
    sim = two_workers()
    sim.submit([task("x", workers=["B"]), task("y", "x", workers=["A", "C"])], ["y"])
    sim.finish("x")
    assert sim.where("y") == "A"
    sim.add_worker("C", 1)
    assert sim.remove_worker("A", stimulus_id="gone") == (
        {}, {"C": [compute("y", "gone", (0, 0, 1), who_has={"x": ["B"]})]})
    assert states(sim.state) == {"x": "memory", "y": "processing"}


# -- missing_data --------------------------------------------------------------------------


def test_missing_data_from_the_only_holder_recomputes_the_result():
    sim = two_workers()
    sim.submit([task("x", workers=["A"]), task("y", "x", workers=["B"])], ["y"])
    sim.finish("x")
    _, worker_msgs = sim.record(sim.state.missing_data("B", "x", "A", "missing"))
    assert freed(worker_msgs)["B"] == ["y"]  # y cannot run without x
    assert "compute-task" in [op for op, _ in ops(worker_msgs, "A")]
    assert states(sim.state) == {"x": "processing", "y": "waiting"}
    assert sim.state.who_has(["x"]) == {}


def test_missing_data_sends_the_recomputation_once():
    sim = two_workers()
    sim.submit([task("x", workers=["A"]), task("y", "x", workers=["B"])], ["y"])
    sim.finish("x")
    assert sim.record(sim.state.missing_data("B", "x", "A", "missing")) == (
        {}, {"A": [free(["x"], "missing"), compute("x", "missing", (0, 0, 0))],
             "B": [free(["y"], "missing")]})


def test_missing_data_from_one_of_two_holders_keeps_the_other():
    sim = two_workers()
    sim.add_worker("C", 1)
    sim.submit([task("x", workers=["A"])], ["x"])
    sim.finish("x", nbytes=3)
    sim.scatter({"x": ["B"]}, {"x": 3})
    sim.submit([task("y", "x", workers=["C"])], ["y"])
    # A no longer counts as a holder: it is told to drop its copy (else it leaks there)
    assert sim.record(sim.state.missing_data("C", "x", "A", "missing")) == (
        {}, {"A": [free(["x"], "missing")]})
    assert sim.state.who_has(["x"]) == {"x": ["B"]}
    assert (sim.state.workers["A"].nbytes, sim.state.workers["B"].nbytes) == (0, 3)


def test_missing_data_naming_a_worker_that_does_not_hold_the_key_changes_nothing():
    sim = two_workers()
    sim.submit([task("x", workers=["A"]), task("y", "x", workers=["B"])], ["y"])
    sim.finish("x")
    before = snapshot(sim.state)
    assert sim.state.missing_data("B", "x", "B", "missing") == ({}, {})
    assert sim.state.missing_data("B", "x", "nowhere", "missing") == ({}, {})
    assert snapshot(sim.state)["tasks"] == before["tasks"]


def test_missing_data_from_a_worker_that_needs_no_such_input_is_unauthorized():
    sim = two_workers()
    sim.add_worker("C", 1)
    sim.submit([task("x", workers=["A"]), task("y", "x", workers=["B"])], ["y", "x"])
    sim.finish("x")
    for worker, key in [("C", "x"),  # runs nothing that needs x
                        ("A", "x"),  # holds x, was not told to fetch it
                        ("nowhere", "x"), ("B", "unknown"), ("B", "y")]:
        assert_refused(sim.state, lambda: sim.state.missing_data(worker, key, "A", "missing"),
                       Unauthorized, match="runs no task that needs it")
    sim.finish("y")  # B is done with y: it no longer fetches x
    assert_refused(sim.state, lambda: sim.state.missing_data("B", "x", "A", "missing"),
                   Unauthorized)
    assert states(sim.state) == {"x": "memory", "y": "memory"}


# -- reschedule ----------------------------------------------------------------------------


def test_rescheduled_task_is_freed_on_its_worker_and_computed_again():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"])
    assert sim.record(sim.state.reschedule("A", "t", "back")) == (
        {}, {"A": [free(["t"], "back"), compute("t", "back", (0, 0, 0))]})
    assert states(sim.state) == {"t": "processing"}


def test_reschedule_from_a_worker_the_task_is_not_on_is_ignored():
    sim = two_workers()
    sim.submit([task("t", workers=["A"])], ["t"])
    assert sim.state.reschedule("B", "t", "back") == ({}, {})
    assert sim.state.reschedule("A", "unknown", "back") == ({}, {})
    assert states(sim.state) == {"t": "processing"}


def test_rescheduled_task_keeps_its_inputs_in_memory():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x"), task("y", "x")], ["y"])
    sim.finish("x")
    assert sim.record(sim.state.reschedule("A", "y", "back")) == (
        {}, {"A": [free(["y"], "back"), compute("y", "back", (0, 0, 1), who_has={"x": ["A"]})]})
    assert states(sim.state) == {"x": "memory", "y": "processing"}


# -- update_data (scatter) -----------------------------------------------------------------


def test_scattered_data_is_in_memory_where_the_client_put_it():
    sim = two_workers()
    _, worker_msgs = sim.scatter({"x": ["A", "B"]}, {"x": 100})
    assert worker_msgs == {}
    assert states(sim.state) == {"x": "memory"}
    assert sim.state.who_has(["x"]) == {"x": ["A", "B"]}
    assert (sim.state.workers["A"].nbytes, sim.state.workers["B"].nbytes) == (100, 100)
    assert [ts.key for ts in sim.state.clients["c"].wants_what] == ["x"]


def test_task_depending_on_scattered_data_runs_where_the_data_is():
    sim = two_workers()
    sim.scatter({"x": ["B"]}, {"x": 100})
    assert sim.submit([task("y", "x")], ["y"], stimulus_id="g") == (
        {}, {"B": [compute("y", "g", (0, 0, 0), who_has={"x": ["B"]})]})
    assert sim.finish("y") == ({"c": [{"op": "key-in-memory", "key": "y", "type": "int"}]}, {})


def test_scattered_key_whose_holder_dies_errs_with_lost_data():
    sim = two_workers()
    sim.scatter({"x": ["A"]}, {"x": 100})
    client_msgs, worker_msgs = sim.remove_worker("A")
    assert worker_msgs == {}
    [msg] = client_msgs["c"]
    assert (msg["op"], msg["key"], msg["exception"]) == ("task-erred", "x", None)
    assert "lost data" in msg["text"]
    assert states(sim.state) == {"x": "erred"}


def test_dependent_of_lost_scattered_data_is_erred_too():
    sim = two_workers()
    sim.scatter({"x": ["A"]}, {"x": 1})
    sim.submit([task("y", "x", workers=["B"])], ["y"])
    client_msgs, _ = sim.remove_worker("A")
    assert sorted((m["key"], m["blame"]) for m in client_msgs["c"]) == [("x", "x"), ("y", "x")]
    assert all("lost data" in m["text"] for m in client_msgs["c"])


def test_scatter_with_one_malformed_entry_changes_nothing():
    sim = two_workers()
    sim.submit([task("y", workers=["A"])], ["y"])
    cases = [
        ({"x": ["A"], "z": "A"}, {}),  # holders not a list
        ({"x": ["A"], "z": ["A", 5]}, {}),  # an address that is not a str
        ({"x": ["A"], "z": ["B"]}, {"x": 1, "z": "8"}),  # nbytes not an int
        ({"x": ["A"], "z": ["B"]}, {"x": 1, "z": -1}),
        ({"x": ["A"], "z": ["B"]}, {"x": 2 ** 62 + 1}),
        ({"x": ["A"], float("nan"): ["B"]}, {}),
        ([("x", ["A"])], {}),  # not a dict
        ({"x": ["A"]}, [("x", 1)]),
    ]
    for who_has, nbytes in cases:
        assert_refused(sim.state, lambda: sim.state.update_data("c", who_has, nbytes, "s"))
    assert states(sim.state) == {"y": "processing"}


def test_scatter_over_a_key_the_client_does_not_want_is_unauthorized():
    sim = two_workers()
    sim.submit([task("x", workers=["A"])], ["x"], client="c1")
    sim.finish("x")
    error = assert_refused(
        sim.state, lambda: sim.state.update_data("c2", {"new": ["B"], "x": ["B"]},
                                                 {"x": 1}, "s"), Unauthorized)
    assert "'x'" in str(error)
    assert "c2" not in sim.state.clients
    assert sim.state.who_has(["x"]) == {"x": ["A"]}


def test_scatter_to_unknown_workers_is_cancelled():
    sim = two_workers()
    assert sim.scatter({"x": ["nowhere"]}, {"x": 1}) == (
        {"c": [{"op": "cancelled-keys", "keys": ["x"]}]}, {})
    assert sim.state.tasks == {}


def test_scatter_over_a_processing_task_replaces_the_computation():
    sim = two_workers()
    sim.submit([task("x", workers=["A"])], ["x"])
    _, worker_msgs = sim.scatter({"x": ["B"]}, {"x": 7}, stimulus_id="sc")
    assert worker_msgs == {"A": [free(["x"], "sc")]}
    assert states(sim.state) == {"x": "memory"}
    assert sim.state.who_has(["x"]) == {"x": ["B"]}


def test_replica_of_a_different_size_keeps_worker_byte_counts_consistent():
    sim = two_workers()
    sim.submit([task("x", workers=["A"])], ["x"])
    sim.finish("x", nbytes=100)
    sim.scatter({"x": ["B"]}, {"x": 50})
    sim.state.validate_state()
    assert sim.state.workers["A"].nbytes == sum(ts.nbytes for ts in
                                                sim.state.workers["A"].has_what)


def test_a_seceded_task_frees_its_slot_for_queued_tasks_until_it_ends():
    sim = Sim()
    sim.add_worker("A", nthreads=1)  # saturation 1.1: 2 slots
    sim.submit([task(f"r{i}") for i in range(4)], [f"r{i}" for i in range(4)])
    assert sorted(sim.computing["A"]) == ["r0", "r1"]
    sim.record(sim.state.task_seceded("A", "r0", "secede"))
    assert sorted(sim.computing["A"]) == ["r0", "r1", "r2"]  # one more slot
    sim.record(sim.state.task_seceded("A", "r0", "again"))  # repeated: no second slot
    assert sorted(sim.computing["A"]) == ["r0", "r1", "r2"]
    sim.record(sim.state.task_seceded("A", "r3", "stale"))  # not processing there
    sim.finish("r0")  # the seceded task ends: its slot goes with it
    assert sim.state.workers["A"].slots == 2 and sim.state.workers["A"].long_running is None
    assert sorted(sim.computing["A"]) == ["r1", "r2"]
    sim.finish("r1")
    assert sorted(sim.computing["A"]) == ["r2", "r3"]
