"""Spec parts: a slice's run specs pickled together, held once, sent once to a worker."""
from __future__ import annotations

import pytest
from core_sim import Sim, as_part, states, task

from distributed_core import SPEC_PART_PREFIX

INF = float("inf")


def reference(number: int, index: int) -> bytes:
    return SPEC_PART_PREFIX + number.to_bytes(8, "little") + index.to_bytes(4, "little")


def part_of(keys_deps: dict, blob: bytes = b"blob") -> dict:
    """A part of the tasks ``{key: [deps]}``, in that order."""
    return as_part([task(key, *deps) for key, deps in keys_deps.items()], blob)[1]


def ops_of(msgs: list) -> list:
    return [(m["op"], m.get("key", m.get("part", m.get("parts")))) for m in msgs]


def test_a_part_goes_to_a_worker_once_before_its_first_task():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 2)
    _, worker_msgs = sim.submit([], ["a", "b"], part=part_of({"a": [], "b": []}, b"AB"),
                                stimulus_id="g")
    msgs = worker_msgs["A"]
    assert ops_of(msgs) == [("spec-part", 1), ("compute-task", "a"), ("compute-task", "b")]
    assert msgs[0]["blob"] == b"AB"
    assert [m["spec"] for m in msgs[1:]] == [reference(1, 0), reference(1, 1)]
    assert [m["priority"][2] for m in msgs[1:]] == [0, 1]  # the index is the order
    sim.finish("a", "b")
    assert states(sim.state) == {"a": "memory", "b": "memory"}


def test_each_worker_given_a_task_of_a_part_is_sent_the_part():
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    _, worker_msgs = sim.submit([], ["a", "b", "c"],
                                part=part_of({"a": [], "b": [], "c": []}))
    sent = {address: ops_of(msgs) for address, msgs in worker_msgs.items()}
    assert sorted(sent) == ["A", "B"]
    for msgs in sent.values():
        assert msgs[0] == ("spec-part", 1) and msgs[1][0] == "compute-task"
    first = sim.where("a")
    _, worker_msgs = sim.finish("a")
    assert ops_of(worker_msgs[first]) == [("compute-task", "c")]  # it has the part


def test_the_holders_drop_a_part_when_its_last_task_is_forgotten():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    sim.submit([], ["b"], part=part_of({"a": [], "b": ["a"]}))
    sim.finish("a")
    sim.finish("b")
    part = sim.state.tasks["b"].run_spec
    assert part.n_tasks == 2 and part.number == 1  # "a" stays while "b" depends on it
    _, worker_msgs = sim.release(["b"])
    assert ("free-spec-parts", [1]) in ops_of(worker_msgs["A"])
    assert part.n_tasks == 0 and not part.holders
    assert sim.parts["A"] == {}


def test_a_part_is_not_dropped_while_one_of_its_tasks_is_held():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    sim.submit([], ["a", "b"], part=part_of({"a": [], "b": []}))
    sim.finish("a", "b")
    _, worker_msgs = sim.release(["a"])
    assert all(m["op"] != "free-spec-parts" for m in worker_msgs.get("A", ()))
    assert sim.state.tasks["b"].run_spec.n_tasks == 1


def test_a_worker_that_comes_back_is_sent_the_part_again():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    sim.submit([], ["a"], part=part_of({"a": []}))
    sim.remove_worker("A")
    assert states(sim.state) == {"a": "no-worker"}
    _, worker_msgs = sim.add_worker("A", 1)
    assert ops_of(worker_msgs["A"]) == [("spec-part", 1), ("compute-task", "a")]


def test_a_part_and_task_dicts_come_in_one_graph_in_any_order():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 4)
    part = part_of({"b": ["a"], "c": ["b", "a"]})  # "a" is a task dict of the same message
    sim.submit([task("a", spec=b"own")], ["c"], part=part)
    assert sim.computing["A"]["a"]["spec"] == b"own"
    sim.finish("a")
    assert sim.computing["A"]["b"]["spec"] == reference(1, 0)
    sim.finish("b")
    assert sim.computing["A"]["c"]["spec"] == reference(1, 1)
    assert [d.key for d in sim.state.tasks["c"].dependencies] == ["b", "a"]


def test_known_keys_of_a_part_are_reused_and_parts_are_numbered_in_turn():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    sim.submit([], ["a"], part=part_of({"a": []}))
    sim.submit([], ["a", "b"], part=part_of({"a": [], "b": []}), client="d")
    assert sim.state.tasks["a"].run_spec.number == 1
    assert sim.state.tasks["b"].run_spec.number == 2
    assert sim.state.tasks["a"].run_spec.n_tasks == 1
    assert sim.state.tasks["b"].run_spec.n_tasks == 1


BAD_PARTS = [
    ([1, 2], "'part' must be a dict"),
    ({"blob": "text", "keys": ["a"], "deps": [], "ndeps": [0]}, "'blob' must be bytes"),
    ({"blob": b"x", "keys": "a", "deps": [], "ndeps": [0]}, "'keys' must be a list"),
    ({"blob": b"x", "keys": ["a"], "deps": [], "ndeps": []}, "1 keys and 0 dependency counts"),
    ({"blob": b"x", "keys": ["a"], "deps": [], "ndeps": [1]}, "dependency count #0 is 1"),
    ({"blob": b"x", "keys": ["a"], "deps": [], "ndeps": [-1]}, "dependency count #0 is -1"),
    ({"blob": b"x", "keys": ["a"], "deps": ["z"], "ndeps": [0]}, "lists 1 dependencies"),
    ({"blob": b"x", "keys": ["a"], "deps": ["z"], "ndeps": [1]}, "unknown key 'z'"),
    ({"blob": b"x", "keys": ["a", "a"], "deps": [], "ndeps": [0, 0]}, "appears twice"),
    ({"blob": b"x", "keys": [["a"]], "deps": [], "ndeps": [0]}, "task #0"),
]


@pytest.mark.parametrize("part, error_part", BAD_PARTS)
def test_a_malformed_part_is_refused_and_changes_nothing(part, error_part):
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    sim.state.add_client("c", "hello")
    before = (states(sim.state), sim.state.generation, sim.state.transition_counter)
    client_msgs, worker_msgs = sim.submit([], ["a"], part=part)
    assert worker_msgs == {}
    [msg] = client_msgs["c"]
    assert msg["op"] == "graph-refused" and error_part in msg["error"], msg
    assert (states(sim.state), sim.state.generation, sim.state.transition_counter) == before
    sim.submit([], ["b"], part=part_of({"b": []}))
    assert sim.state.tasks["b"].run_spec.number == 1  # the refused part took no number
