"""Clients letting go of keys, leaving, cancelling, retrying and wanting existing keys."""
from __future__ import annotations

import pytest
from core_sim import Sim, assert_refused, compute, free, freed, snapshot, states, task

from distributed_core import Unauthorized

INF = float("inf")


def assert_nothing_left(sim: Sim) -> None:
    state = sim.state
    assert state.tasks == {}
    assert len(state.unrunnable) == 0
    assert state.n_queued == 0
    for ws in state.workers.values():
        assert (len(ws.has_what), ws.nbytes, len(ws.processing), ws.occupancy) == (0, 0, 0, 0)
    assert all(not data for data in sim.data.values())
    assert all(not computing for computing in sim.computing.values())


def mixed_sim() -> Sim:
    """Tasks in memory, processing, waiting, queued and no-worker, all wanted by client c."""
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    sim.submit([task("a"), task("b"), task("c", "a", "b"), task("d", "c"),
                task("g", workers=["Z"])], ["d", "g", "a"])
    sim.finish("a", nbytes=10)
    sim.finish("b", nbytes=20)
    sim.submit([task("e")], ["e"])  # fills the last free slot
    sim.submit([task("f")], ["f"])
    assert sorted(states(sim.state).items()) == [
        ("a", "memory"), ("b", "memory"), ("c", "processing"), ("d", "waiting"),
        ("e", "processing"), ("f", "queued"), ("g", "no-worker")]
    return sim


# -- client_releases_keys / remove_client --------------------------------------------------


def test_released_result_is_forgotten_and_freed_on_its_worker():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    sim.finish("x")
    assert sim.release(["x"], stimulus_id="r") == ({}, {"A": [free(["x"], "r")]})
    assert_nothing_left(sim)


def test_released_processing_task_is_freed_on_its_worker():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    assert sim.release(["x"], stimulus_id="r") == ({}, {"A": [free(["x"], "r")]})
    assert_nothing_left(sim)


def test_releasing_every_key_forgets_all_tasks_and_frees_all_memory():
    sim = mixed_sim()
    _, worker_msgs = sim.release(["d", "e", "f", "g", "a"])
    assert sorted(k for keys in freed(worker_msgs).values() for k in keys) == ["a", "b", "c", "e"]
    assert_nothing_left(sim)


def test_remove_client_releases_everything_it_wanted():
    sim = mixed_sim()
    client_msgs, _ = sim.remove_client()
    assert client_msgs == {}
    assert "c" not in sim.state.clients
    assert_nothing_left(sim)


def test_remove_client_in_slices_keeps_it_until_its_last_key_is_released():
    sim = mixed_sim()
    wanted = len(sim.state.clients["c"].wants_what)
    assert wanted == 5  # a, d, e, f, g
    calls = 0
    while "c" in sim.state.clients:
        before = len(sim.state.clients["c"].wants_what)
        sim.remove_client(max_keys=4)
        calls += 1
        if "c" in sim.state.clients:
            assert len(sim.state.clients["c"].wants_what) == before - 4
    assert calls == 2
    assert_nothing_left(sim)


def test_remove_client_in_slices_ends_as_in_one_call():
    sliced, whole = mixed_sim(), mixed_sim()
    while "c" in sliced.state.clients:
        sliced.remove_client(max_keys=1)
    whole.remove_client()

    # not compared: stimulus ids (the log, the last stimulus) and the count of
    # transitions (between slices a worker a slice freed may start a task a later one
    # releases)
    def settled(state) -> dict:
        return {k: v for k, v in snapshot(state).items()
                if k not in ("log", "pending", "counters")}

    assert settled(sliced.state) == settled(whole.state)
    assert_nothing_left(sliced)
    assert sliced.data == whole.data and sliced.computing == whole.computing


@pytest.mark.parametrize("max_keys", [0, -1, 1.5, "3", True])
def test_remove_client_refuses_a_bad_slice_size_and_changes_nothing(max_keys):
    sim = mixed_sim()
    assert_refused(sim.state, lambda: sim.state.remove_client("c", "bye", max_keys=max_keys),
                   match="max_keys must be a positive int or None")
    assert len(sim.state.clients["c"].wants_what) == 5


def test_released_key_another_client_wants_is_kept():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"], client="c1")
    sim.submit([task("x")], ["x"], client="c2")
    sim.finish("x")
    assert sim.release(["x"], client="c1") == ({}, {})
    assert states(sim.state) == {"x": "memory"}
    assert [cs.client_id for cs in sim.state.tasks["x"].who_wants] == ["c2"]


def test_released_input_is_kept_until_its_dependent_no_longer_needs_it():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x"), task("y", "x")], ["x", "y"])
    sim.finish("x")
    assert sim.release(["x"]) == ({}, {})
    assert states(sim.state) == {"x": "memory", "y": "processing"}
    assert sim.finish("y", stimulus_id="f")[1] == {"A": [free(["x"], "f")]}


def test_releasing_unknown_keys_or_as_unknown_client_changes_nothing():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    assert sim.release(["nope"]) == ({}, {})
    assert sim.release(["x"], client="stranger") == ({}, {})
    assert sim.remove_client("stranger") == ({}, {})
    assert states(sim.state) == {"x": "processing"}


# -- cancel --------------------------------------------------------------------------------


def test_cancel_stops_the_task_and_tells_the_client():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    result = sim.record(sim.state.cancel("c", ["x"], "cancel"))
    assert result == ({"c": [{"op": "cancelled-keys", "keys": ["x"]}]},
                      {"A": [free(["x"], "cancel")]})
    assert_nothing_left(sim)


def test_cancel_leaves_the_key_to_other_clients_that_want_it():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"], client="c1")
    sim.submit([task("x")], ["x"], client="c2")
    assert sim.state.cancel("c1", ["x"], "cancel") == (
        {"c1": [{"op": "cancelled-keys", "keys": ["x"]}]}, {})
    assert states(sim.state) == {"x": "processing"}


def test_forced_cancel_drops_the_key_for_every_client():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"], client="c1")
    sim.submit([task("x")], ["x"], client="c2")
    result = sim.record(sim.state.cancel("c1", ["x"], "cancel", force=True))
    assert result == ({"c1": [{"op": "cancelled-keys", "keys": ["x"]}],
                       "c2": [{"op": "cancelled-keys", "keys": ["x"]}]},
                      {"A": [free(["x"], "cancel")]})
    assert_nothing_left(sim)


def test_cancel_of_a_key_the_client_does_not_want_is_unauthorized():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x"), task("y")], ["x", "y"], client="c1")
    sim.submit([task("z")], ["z"], client="c2")
    for force in (False, True):
        error = assert_refused(
            sim.state, lambda: sim.state.cancel("c2", ["z", "x", "ghost"], "cancel", force=force),
            Unauthorized)
        assert "'x'" in str(error) and "'z'" not in str(error)
        assert_refused(sim.state, lambda: sim.state.cancel("stranger", ["x"], "cancel"),
                       Unauthorized)
    assert "stranger" not in sim.state.clients


def test_unauthorized_message_names_a_few_of_the_keys():
    sim = Sim()
    sim.submit([task(f"k{i}") for i in range(50)], [f"k{i}" for i in range(50)], client="c1")
    error = assert_refused(sim.state, lambda: sim.state.cancel(
        "c2", [f"k{i}" for i in range(50)], "cancel"), Unauthorized)
    assert "'k0', 'k1', 'k2'" in str(error) and "47 more" in str(error)
    assert "'k3'" not in str(error)


def test_cancel_of_an_unknown_key_is_reported_cancelled():
    sim = Sim()
    assert sim.state.cancel("c", ["ghost"], "cancel") == (
        {"c": [{"op": "cancelled-keys", "keys": ["ghost"]}]}, {})


# -- retry ---------------------------------------------------------------------------------


def test_retry_runs_an_erred_task_again():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"])
    sim.fail("t")
    assert sim.record(sim.state.retry("c", ["t"], "again")) == (
        {}, {"A": [compute("t", "again", (0, 0, 0))]})
    assert sim.state.tasks["t"].error is None
    assert sim.finish("t")[0] == {"c": [{"op": "key-in-memory", "key": "t", "type": "int"}]}


def test_retry_also_runs_the_erred_tasks_it_depends_on():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("a"), task("b", "a"), task("c", "b")], ["c"])
    sim.fail("a")
    assert states(sim.state) == {"a": "erred", "b": "erred", "c": "erred"}
    assert sim.record(sim.state.retry("c", ["c"], "again")) == (
        {}, {"A": [compute("a", "again", (0, 0, 0))]})
    assert states(sim.state) == {"a": "processing", "b": "waiting", "c": "waiting"}
    sim.run_all()
    assert states(sim.state) == {"a": "released", "b": "released", "c": "memory"}


def test_retry_of_an_erred_input_the_client_does_not_want_is_unauthorized():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("a"), task("b", "a")], ["b"])
    sim.fail("a")
    assert states(sim.state) == {"a": "erred", "b": "erred"}
    # client c holds a future for b, not a: a is only b's (erred) input
    error = assert_refused(sim.state, lambda: sim.state.retry("c", ["a"], "again"),
                           Unauthorized)
    assert "'a'" in str(error)


def test_retry_of_a_key_only_another_client_wants_is_unauthorized():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"], client="c1")
    sim.fail("t")
    assert_refused(sim.state, lambda: sim.state.retry("c2", ["t"], "again"), Unauthorized)
    assert_refused(sim.state, lambda: sim.state.retry("stranger", ["t", "ghost"], "again"),
                   Unauthorized)


def test_retry_of_a_task_that_did_not_err_does_nothing():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t")], ["t"])
    assert sim.state.retry("c", ["t", "unknown"], "again") == ({}, {})
    assert states(sim.state) == {"t": "processing"}


# -- client_desires_keys / add_client ------------------------------------------------------


def test_client_desiring_an_existing_key_is_told_when_it_is_in_memory():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"], client="c1")
    assert sim.state.client_desires_keys("c2", ["x"], "want") == ({}, {})
    assert sim.finish("x")[0] == {
        "c1": [{"op": "key-in-memory", "key": "x", "type": "int"}],
        "c2": [{"op": "key-in-memory", "key": "x", "type": "int"}]}


def test_client_desiring_a_key_nobody_has_is_told_it_is_cancelled():
    sim = Sim()
    assert sim.state.client_desires_keys("c", ["ghost"], "want") == (
        {"c": [{"op": "cancelled-keys", "keys": ["ghost"]}]}, {})


def test_add_client_registers_a_client_that_wants_nothing():
    sim = Sim()
    assert sim.state.add_client("c", "hello") == ({}, {})
    assert list(sim.state.clients) == ["c"]
    assert set(sim.state.clients["c"].wants_what) == set()


def test_check_cancel_refuses_what_cancel_refuses_and_changes_nothing():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"], client="c1")
    sim.submit([task("z")], ["z"], client="c2")
    assert_refused(sim.state, lambda: sim.state.check_cancel("c2", ["z", "x"]), Unauthorized)
    assert_refused(sim.state, lambda: sim.state.check_cancel("c2", "z"), match="keys")
    assert_refused(sim.state, lambda: sim.state.check_cancel("c2", ["z"], force=1),
                   match="force")
    before = snapshot(sim.state)
    assert sim.state.check_cancel("c2", ["z", "ghost"], force=True) is None
    assert snapshot(sim.state) == before  # a check, not a cancel
