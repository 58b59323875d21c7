"""update_graph: taking a client's graph in, reusing known keys, refusing bad graphs whole."""
from __future__ import annotations

import pytest
from core_sim import Sim, compute, free, states, task

INF = float("inf")


def snapshot(state) -> tuple:
    """Everything a refused graph must leave as it was."""
    return (
        {key: (ts.state, tuple(d.key for d in ts.dependencies),
               None if ts.who_wants is None else tuple(c.client_id for c in ts.who_wants))
         for key, ts in state.tasks.items()},
        {a: (sorted(t.key for t in ws.processing), sorted(t.key for t in ws.has_what))
         for a, ws in state.workers.items()},
        {c: sorted(t.key for t in cs.wants_what) for c, cs in state.clients.items()},
        state.transition_counter, state.generation, state.n_queued, len(state.unrunnable),
    )


def busy_sim() -> Sim:
    """x in memory, y processing, both wanted by client c."""
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 2)
    sim.state.add_client("c", "hello")
    sim.submit([task("x"), task("y", "x")], ["y", "x"])
    sim.finish("x")
    assert states(sim.state) == {"x": "memory", "y": "processing"}
    return sim


def assert_refused(sim: Sim, tasks, keys, error_part: str) -> None:
    before = snapshot(sim.state)
    client_msgs, worker_msgs = sim.submit(tasks, keys, stimulus_id="bad")
    assert worker_msgs == {}
    assert list(client_msgs) == ["c"]
    [msg] = client_msgs["c"]
    assert msg["op"] == "graph-refused"
    assert msg["keys"] == (list(keys) if isinstance(keys, list) else [])
    assert error_part in msg["error"]
    assert snapshot(sim.state) == before


# -- accepted graphs -----------------------------------------------------------------------


def test_independent_tasks_are_all_sent_to_the_worker():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 4)
    client_msgs, worker_msgs = sim.submit([task("a"), task("b"), task("c")], ["a", "b", "c"],
                                          stimulus_id="g")
    assert client_msgs == {}
    assert sorted(worker_msgs["A"], key=lambda m: m["key"]) == [
        compute("a", "g", (0, 0, 0)), compute("b", "g", (0, 0, 1)), compute("c", "g", (0, 0, 2))]
    assert states(sim.state) == {"a": "processing", "b": "processing", "c": "processing"}


def test_chain_runs_one_task_after_another_and_frees_spent_inputs():
    sim = Sim()
    sim.add_worker("A", 1)
    assert sim.submit([task("a"), task("b", "a"), task("c", "b")], ["c"], stimulus_id="g") \
        == ({}, {"A": [compute("a", "g", (0, 0, 0))]})
    assert sim.finish("a", stimulus_id="fa") == (
        {}, {"A": [compute("b", "fa", (0, 0, 1), who_has={"a": ["A"]})]})
    assert sim.finish("b", stimulus_id="fb") == (
        {}, {"A": [compute("c", "fb", (0, 0, 2), who_has={"b": ["A"]}), free(["a"], "fb")]})
    assert sim.finish("c", stimulus_id="fc") == (
        {"c": [{"op": "key-in-memory", "key": "c", "type": "int"}]},
        {"A": [free(["b"], "fc")]})
    # a and b stay known (released) as c's lineage, in case c must be recomputed
    assert states(sim.state) == {"a": "released", "b": "released", "c": "memory"}


def test_diamond_runs_the_join_once_both_branches_are_in_memory():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 4)
    sim.submit([task("a"), task("b", "a"), task("c", "a"), task("d", "b", "c")], ["d"])
    _, worker_msgs = sim.finish("a", stimulus_id="fa")
    assert sorted(m["key"] for m in worker_msgs["A"]) == ["b", "c"]
    assert sim.finish("b", stimulus_id="fb") == ({}, {})
    assert states(sim.state) == {"a": "memory", "b": "memory", "c": "processing",
                                 "d": "waiting"}
    assert sim.finish("c", stimulus_id="fc") == ({}, {"A": [
        compute("d", "fc", (0, 0, 3), who_has={"b": ["A"], "c": ["A"]}), free(["a"], "fc")]})


def test_tasks_nobody_wants_or_needs_are_not_kept():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("a"), task("b"), task("c", "b")], ["a"])
    assert set(sim.state.tasks) == {"a"}


def test_known_keys_are_reused_not_duplicated():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("a"), task("b", "a")], ["b"], client="c1")
    a = sim.state.tasks["a"]
    result = sim.submit([task("a", spec=b"other spec"), task("e", "a")], ["e", "a"],
                        client="c2")
    assert result == ({}, {})  # a is already being computed: not sent again
    assert sim.state.tasks["a"] is a
    assert a.run_spec == b"run a"
    assert sim.state.tasks["e"].dependencies == (a,)
    assert {ts.key for ts in a.dependents} == {"b", "e"}
    assert sorted(cs.client_id for cs in a.who_wants) == ["c2"]
    assert states(sim.state) == {"a": "processing", "b": "waiting", "e": "waiting"}


def test_wanting_a_key_already_in_memory_is_answered_at_once():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("a")], ["a"], client="c1")
    sim.finish("a")
    assert sim.submit([task("a")], ["a"], client="c2") == (
        {"c2": [{"op": "key-in-memory", "key": "a", "type": "int"}]}, {})


def test_out_of_order_but_acyclic_batch_is_accepted():
    sim = Sim()
    sim.add_worker("A", 1)
    client_msgs, worker_msgs = sim.submit(
        [task("c", "b"), task("b", "a"), task("a")], ["c"], stimulus_id="g")
    assert client_msgs == {}
    # without an explicit "order", dependencies come first in the graph order
    assert worker_msgs == {"A": [compute("a", "g", (0, 0, 0))]}
    assert sim.run_all() == ["a", "b", "c"]
    assert states(sim.state) == {"a": "released", "b": "released", "c": "memory"}


def test_task_depending_on_an_erred_key_errs_at_once():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("a")], ["a"])
    sim.fail("a", exception=b"E", traceback=b"T", text="ZeroDivisionError()")
    assert sim.submit([task("b", "a")], ["b"], stimulus_id="g2") == (
        {"c": [{"op": "task-erred", "key": "b", "exception": b"E", "traceback": b"T",
                "text": "ZeroDivisionError()", "blame": "a"}]}, {})
    assert states(sim.state) == {"a": "erred", "b": "erred"}


def test_inputs_of_a_task_that_errs_at_once_are_not_run():
    # b is recommended 'waiting' by z, then z errs through e in the same stimulus
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("x")], ["x"])
    sim.fail("x")
    client_msgs, worker_msgs = sim.submit(
        [task("a"), task("b", "a"), task("e", "x"), task("z", "b", "e")], ["z"])
    assert worker_msgs == {}
    assert [(m["op"], m["key"]) for m in client_msgs["c"]] == [("task-erred", "z")]
    assert states(sim.state) == {"x": "erred", "a": "released", "b": "released",
                                 "e": "erred", "z": "erred"}


def test_user_priority_and_graph_order_make_the_compute_priority():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 4)
    sim.submit([task("a")], ["a"])
    _, worker_msgs = sim.submit([task("b", priority=5, order=7)], ["b"], stimulus_id="g")
    assert worker_msgs == {"A": [compute("b", "g", (-5, 1, 7))]}


def test_the_largest_32_bit_priorities_and_orders_are_kept_exactly():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 4)
    top, bottom = 2 ** 31 - 1, -(2 ** 31 - 1)
    _, worker_msgs = sim.submit([task("hi", priority=top, order=top),
                                 task("lo", priority=bottom, order=0)], ["hi", "lo"],
                                stimulus_id="g")
    assert sorted(worker_msgs["A"], key=lambda m: m["key"]) == [
        compute("hi", "g", (-top, 0, top)), compute("lo", "g", (-bottom, 0, 0))]


def test_graph_decoded_from_the_wire_as_tuples_is_accepted():
    sim = Sim()
    sim.add_worker("A", 1)
    tasks = ({"key": "a", "spec": b"a"},
             {"key": "b", "spec": b"b", "deps": ("a",), "workers": ("A",)})
    _, worker_msgs = sim.submit(tasks, ("b",), stimulus_id="g")
    assert worker_msgs == {"A": [compute("a", "g", (0, 0, 0), spec=b"a")]}


def test_tuple_and_int_keys_are_accepted():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task(("x", 0)), task(7, ("x", 0))], [7])
    assert sim.run_all() == [("x", 0), 7]
    assert states(sim.state) == {("x", 0): "released", 7: "memory"}


def test_tuple_keys_of_one_layer_share_one_copy_of_its_name():
    """Each key decoded from a message has its own copy of the layer name; the state
    keeps one, and the keys stay equal to (and found by) the copies."""
    sim = Sim()
    sim.add_worker("A", 1)
    copies = ["".join(["layer-", "9f8e7d6c"]) for _ in range(3)]
    assert copies[0] is not copies[1]
    sim.submit([task((copies[0], 0)), task((copies[1], 1))], [(copies[0], 0), (copies[1], 1)])
    sim.submit([task((copies[2], 2), (copies[1], 1))], [(copies[2], 2)])
    names = {id(key[0]) for key in sim.state.tasks}
    assert len(names) == 1
    assert sorted(sim.run_all(), key=repr) == [("layer-9f8e7d6c", i) for i in range(3)]
    assert sim.state.prefixes["layer"].name == "layer"


def test_equal_tuple_keys_of_other_types_keep_their_own_first_element():
    """1, 1.0 and True are equal; sharing a layer name must not change a key's type."""
    sim = Sim()
    sim.add_worker("A", 1)
    keys = [(1, 0), (True, 1), (1.0, 2)]
    sim.submit([task(k) for k in keys], keys)
    assert [type(k[0]) for k in sim.state.tasks] == [int, bool, float]
    computed = sim.run_all()  # the keys the worker was sent, as it was sent them
    assert sorted((k[1], type(k[0])) for k in computed) == [(0, int), (1, bool), (2, float)]


def test_many_layer_names_keep_their_prefixes():
    """Past the scheduler's cache of layer names, keys and prefixes stay right."""
    sim = Sim()
    keys = [(f"op{i % 7}-{i:08x}", 0) for i in range(10_050)]
    sim.submit([task(k) for k in keys], keys)
    assert sorted(sim.state.prefixes) == [f"op{i}" for i in range(7)]
    assert all(sim.state.tasks[k].prefix.name == k[0].split("-")[0] for k in keys)


# -- refused graphs ------------------------------------------------------------------------


def test_graph_with_a_cycle_is_refused():
    sim = busy_sim()
    assert_refused(sim, [task("n"), task("p", "q"), task("q", "p")], ["p"], "cycle")


def test_graph_with_a_self_dependency_is_refused():
    sim = busy_sim()
    assert_refused(sim, [task("n"), task("p", "p")], ["p"], "cycle")


def test_graph_with_an_unknown_dependency_is_refused():
    sim = busy_sim()
    assert_refused(sim, [task("n"), task("p", "nowhere")], ["p"], "unknown key 'nowhere'")


def test_graph_with_a_duplicate_key_is_refused():
    sim = busy_sim()
    assert_refused(sim, [task("n"), task("p"), task("p")], ["p"], "appears twice")


def test_graph_whose_wanted_key_is_not_in_it_is_refused():
    sim = busy_sim()
    assert_refused(sim, [task("n"), task("p")], ["p", "elsewhere"], "'elsewhere'")


MALFORMED = {
    "not-a-dict": (["p", b"spec"], "not a dict"),
    "no-key": ({"spec": b"s"}, "no 'key'"),
    "unhashable-key": ({"key": ["p"], "spec": b"s"}, "not hashable"),
    "no-spec": ({"key": "p"}, "run spec"),
    "spec-not-bytes": ({"key": "p", "spec": "a str"}, "run spec"),
    "deps-not-a-list": ({"key": "p", "spec": b"s", "deps": "x"}, "'deps'"),
    "priority-str": ({"key": "p", "spec": b"s", "priority": "high"}, "'priority'"),
    "priority-float": ({"key": "p", "spec": b"s", "priority": 1.5}, "'priority'"),
    "priority-bool": ({"key": "p", "spec": b"s", "priority": True}, "'priority'"),
    "priority-beyond-32-bits": ({"key": "p", "spec": b"s", "priority": 2 ** 31}, "32 bits"),
    "priority-below-32-bits": ({"key": "p", "spec": b"s", "priority": -2 ** 31}, "32 bits"),
    "order-str": ({"key": "p", "spec": b"s", "order": "1"}, "'order'"),
    "order-beyond-32-bits": ({"key": "p", "spec": b"s", "order": 2 ** 40}, "'order'"),
    "retries-beyond-32-bits": ({"key": "p", "spec": b"s", "retries": 2 ** 31}, "'retries'"),
    "retries-str": ({"key": "p", "spec": b"s", "retries": "3"}, "'retries'"),
    "retries-negative": ({"key": "p", "spec": b"s", "retries": -1}, "'retries'"),
    "workers-a-str": ({"key": "p", "spec": b"s", "workers": "A"}, "'workers'"),
    "workers-not-str": ({"key": "p", "spec": b"s", "workers": [1]}, "'workers'"),
    "resources-a-list": ({"key": "p", "spec": b"s", "resources": ["GPU"]}, "'resources'"),
    "resources-str-quantity": ({"key": "p", "spec": b"s", "resources": {"GPU": "1"}},
                               "'resources'"),
    "resources-negative": ({"key": "p", "spec": b"s", "resources": {"GPU": -1}},
                           "'resources'"),
    "annotations-not-dict": ({"key": "p", "spec": b"s", "annotations": [1]}, "'annotations'"),
}


@pytest.mark.parametrize("entry,error_part", list(MALFORMED.values()), ids=list(MALFORMED))
def test_graph_with_a_malformed_entry_is_refused_whole(entry, error_part):
    sim = busy_sim()
    assert_refused(sim, [task("n"), task("m", "n"), entry], ["m"], error_part)


def test_graph_whose_tasks_are_not_a_list_is_refused():
    sim = busy_sim()
    assert_refused(sim, {"n": task("n")}, ["n"], "'tasks'")


def test_graph_whose_keys_are_not_a_list_is_refused():
    sim = busy_sim()
    assert_refused(sim, [task("n")], "n", "'keys'")


def test_graph_with_an_unhashable_dependency_is_refused():
    sim = busy_sim()
    assert_refused(sim, [task("n"), task("p", ["n"])], ["p"], "not hashable")


def test_graph_with_an_unhashable_wanted_key_is_refused():
    sim = busy_sim()
    assert_refused(sim, [task("n")], [["n"]], "not hashable")


def test_refused_graph_does_not_stop_the_next_one():
    sim = busy_sim()
    sim.submit([task("p", "p")], ["p"])
    _, worker_msgs = sim.submit([task("p", "x")], ["p"], stimulus_id="good")
    assert worker_msgs == {"A": [compute("p", "good", (0, 1, 0), who_has={"x": ["A"]})]}
