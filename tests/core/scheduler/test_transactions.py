"""Stimuli are transactions: bad input is refused before anything changes.

Every public stimulus checks its arguments (types, ranges, hashable keys, a str stimulus
id) and raises InvalidStimulus with the state exactly as it was (``assert_refused``
compares a snapshot of the whole state before and after).
"""
from __future__ import annotations

import pytest
from core_sim import Sim, assert_refused, snapshot, task

from distributed_core import GraphError, InvalidStimulus, Unauthorized, bounded_repr

UNHASHABLE = [["a", "list"], {"a": "dict"}, ("tuple", ["with", "a", "list"]), {1, 2}]
NOT_KEY_LISTS = ["x", None, 5, {"x": 1}, {"x"}, b"keys"]


def busy_sim() -> Sim:
    """Tasks in several states, two clients, two workers."""
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    sim.submit([task("a"), task("b", "a"), task("c"), task("d")], ["b", "c", "d"], client="c1")
    sim.finish("a")
    sim.submit([task("e", workers=["Z"])], ["e"], client="c2")
    sim.scatter({"s": ["B"]}, {"s": 10}, client="c2")
    return sim


def every_stimulus(state, stimulus_id="sid") -> dict:
    """A valid call of each stimulus that takes a stimulus id, by name."""
    return {
        "add_client": lambda: state.add_client("c3", stimulus_id),
        "remove_client": lambda: state.remove_client("c1", stimulus_id),
        "add_worker": lambda: state.add_worker("C", 1, stimulus_id),
        "remove_worker": lambda: state.remove_worker("A", stimulus_id),
        "update_graph": lambda: state.update_graph("c1", [task("new")], ["new"], stimulus_id),
        "update_data": lambda: state.update_data("c1", {"n": ["A"]}, {"n": 1}, stimulus_id),
        "task_finished": lambda: state.task_finished("A", [{"key": "b", "nbytes": 1}],
                                                     stimulus_id),
        "task_erred": lambda: state.task_erred("A", [{"key": "b", "text": "x"}], stimulus_id),
        "client_releases_keys": lambda: state.client_releases_keys("c1", ["d"], stimulus_id),
        "client_desires_keys": lambda: state.client_desires_keys("c2", ["d"], stimulus_id),
        "cancel": lambda: state.cancel("c1", ["d"], stimulus_id),
        "retry": lambda: state.retry("c1", ["b"], stimulus_id),
        "missing_data": lambda: state.missing_data("A", "a", "A", stimulus_id),
        "reschedule": lambda: state.reschedule("A", "b", stimulus_id),
        "restart": lambda: state.restart(stimulus_id),
    }


# -- every stimulus ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(every_stimulus(None)))
def test_each_stimulus_accepts_its_valid_call(name):
    sim = busy_sim()
    every_stimulus(sim.state)[name]()
    sim.state.validate_state()


@pytest.mark.parametrize("name", sorted(every_stimulus(None)))
@pytest.mark.parametrize("stimulus_id", [None, 5, b"sid", ["sid"]])
def test_stimulus_id_that_is_not_a_str_is_refused(name, stimulus_id):
    sim = busy_sim()
    call = every_stimulus(sim.state, stimulus_id)[name]
    assert_refused(sim.state, call, match="stimulus_id must be a str")


@pytest.mark.parametrize("name,call", [
    ("add_client", lambda s, x: s.add_client(x, "sid")),
    ("remove_client", lambda s, x: s.remove_client(x, "sid")),
    ("update_graph", lambda s, x: s.update_graph(x, [task("new")], ["new"], "sid")),
    ("update_data", lambda s, x: s.update_data(x, {"n": ["A"]}, {}, "sid")),
    ("client_releases_keys", lambda s, x: s.client_releases_keys(x, ["d"], "sid")),
    ("client_desires_keys", lambda s, x: s.client_desires_keys(x, ["d"], "sid")),
    ("cancel", lambda s, x: s.cancel(x, ["d"], "sid")),
    ("retry", lambda s, x: s.retry(x, ["b"], "sid")),
    ("remove_worker", lambda s, x: s.remove_worker(x, "sid")),
    ("task_finished", lambda s, x: s.task_finished(x, [{"key": "b"}], "sid")),
    ("task_erred", lambda s, x: s.task_erred(x, [{"key": "b"}], "sid")),
    ("missing_data", lambda s, x: s.missing_data(x, "a", "A", "sid")),
    ("missing_data errant", lambda s, x: s.missing_data("A", "a", x, "sid")),
    ("reschedule", lambda s, x: s.reschedule(x, "b", "sid")),
])
def test_client_or_worker_that_is_not_a_str_is_refused(name, call):
    sim = busy_sim()
    for bad in (None, 1, b"A", ("A",)):
        assert_refused(sim.state, lambda: call(sim.state, bad), match="must be a str")


@pytest.mark.parametrize("name,call", [
    ("client_releases_keys", lambda s, keys: s.client_releases_keys("c1", keys, "sid")),
    ("client_desires_keys", lambda s, keys: s.client_desires_keys("c1", keys, "sid")),
    ("cancel", lambda s, keys: s.cancel("c1", keys, "sid")),
    ("retry", lambda s, keys: s.retry("c1", keys, "sid")),
    ("who_has", lambda s, keys: s.who_has(keys)),
])
def test_keys_must_be_a_list_of_hashable_keys(name, call):
    sim = busy_sim()
    for keys in NOT_KEY_LISTS:
        assert_refused(sim.state, lambda: call(sim.state, keys), match="keys must be a list")
    for key in UNHASHABLE + [float("nan")]:
        # the valid keys come first: checked before any of them is acted on
        assert_refused(sim.state, lambda: call(sim.state, ["d", "c", key]))


def test_single_key_arguments_must_be_hashable():
    sim = busy_sim()
    for key in UNHASHABLE:
        assert_refused(sim.state, lambda: sim.state.missing_data("A", key, "A", "sid"),
                       match="not hashable")
        assert_refused(sim.state, lambda: sim.state.reschedule("A", key, "sid"),
                       match="not hashable")


def test_cancel_force_must_be_a_bool():
    sim = busy_sim()
    for force in (None, 1, "yes"):
        assert_refused(sim.state, lambda: sim.state.cancel("c1", ["d"], "sid", force=force),
                       match="force must be a bool")


def test_refused_input_is_quoted_at_most_about_200_characters():
    sim = busy_sim()
    huge = ["k" * 1000] * 1000
    error = assert_refused(sim.state, lambda: sim.state.update_data("c1", {"x": huge[0]}, {},
                                                                   "sid"))
    assert len(str(error)) < 500
    error = assert_refused(sim.state, lambda: sim.state.add_worker("C", 10 ** 5000, "sid"))
    assert len(str(error)) < 500
    error = assert_refused(sim.state, lambda: sim.state.cancel("c1", tuple(huge), "sid",
                                                               force=huge))
    assert len(str(error)) < 500


# -- update_graph --------------------------------------------------------------------------


def test_graph_error_and_unauthorized_are_invalid_stimuli():
    assert issubclass(GraphError, InvalidStimulus)
    assert issubclass(Unauthorized, InvalidStimulus)
    assert issubclass(InvalidStimulus, ValueError)


def test_refused_graph_changes_nothing_not_even_the_client_list():
    sim = busy_sim()
    before = snapshot(sim.state)
    bad_graphs = [
        ([task("x"), task("y", "nowhere")], ["y"]),
        ([task("x"), {"key": ["unhashable"], "spec": b"s"}], ["x"]),
        ([task("x", "y"), task("y", "x")], ["x"]),
        ([task("x", priority=2 ** 40)], ["x"]),
        ([task("x", resources={"GPU": float("inf")})], ["x"]),
        ([task("x")], [{"unhashable": 1}]),
        ([task(float("nan"))], []),
        ("not a list", ["x"]),
    ]
    for tasks, keys in bad_graphs:
        client_msgs, worker_msgs = sim.state.update_graph("newcomer", tasks, keys, "g")
        assert [msg["op"] for msg in client_msgs["newcomer"]] == ["graph-refused"]
        assert worker_msgs == {}
        after = snapshot(sim.state)
        after["pending"] = before["pending"]  # the stimulus id of the last stimulus
        assert after == before
    assert "newcomer" not in sim.state.clients


def test_graph_refused_message_quotes_a_bounded_part_of_the_input():
    sim = Sim()
    client_msgs, _ = sim.submit([task("x", "y" * 100_000)], ["x"])
    [msg] = client_msgs["c"]
    assert msg["op"] == "graph-refused" and len(msg["error"]) < 500


# -- bounded_repr --------------------------------------------------------------------------


def test_bounded_repr_is_repr_when_short():
    for value in ["x", ("x", 1), [1, 2.5, None], {"a": b"b"}, ("t",), set(), frozenset({1})]:
        assert bounded_repr(value) == repr(value)


def test_bounded_repr_cuts_long_values_without_rendering_them_whole():
    assert len(bounded_repr("x" * 10 ** 6)) == 200
    assert bounded_repr("x" * 10 ** 6).endswith("...")
    assert len(bounded_repr(list(range(10 ** 6)))) == 200
    assert bounded_repr(10 ** 100_000) == "<int of 332193 bits>"  # repr() would raise
    nested = []
    for _ in range(10_000):
        nested = [nested]
    assert len(bounded_repr(nested)) <= 200
    assert len(bounded_repr({str(i): "v" * 300 for i in range(1000)}, 50)) == 50


def test_bounded_repr_survives_a_repr_that_raises():
    class Broken:
        def __repr__(self):
            raise RuntimeError("no")

    assert bounded_repr([Broken()]) == "[<Broken object>]"
