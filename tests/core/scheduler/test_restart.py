"""The restart stimulus: every task is forgotten, every client is told why, workers free
what they ran or held; workers and clients stay registered."""
from __future__ import annotations

from core_sim import Sim, assert_refused, freed, states, task
from distributed_core._core import RESTART_REASON

from distributed_core import SchedulerState


def busy() -> Sim:
    """Tasks in every state the scheduler keeps, two clients, two workers."""
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    # c1: a chain (a in memory, b processing), a queued root, a failed task and its dependent
    sim.submit([task("a"), task("b", "a"), task("q1"), task("q2")], ["b", "q1", "q2"],
               client="c1")
    sim.finish("a")
    sim.submit([task("bad"), task("after", "bad")], ["after"], client="c1")
    # c2: shares b with c1, wants a result in memory, a task no worker fits, scattered data
    sim.submit([task("b", "a")], ["b"], client="c2")
    sim.submit([task("gpu", resources={"GPU": 1})], ["gpu"], client="c2")
    sim.scatter({"s": ["B"]}, {"s": 10}, client="c2")
    return sim


def cancelled(client_msgs) -> dict:
    """``{client: sorted keys}`` of the cancelled-keys messages, checking the reason."""
    out = {}
    for client, msgs in client_msgs.items():
        for msg in msgs:
            assert msg["op"] == "cancelled-keys", msg
            assert msg["reason"] == RESTART_REASON
            out.setdefault(client, []).extend(msg["keys"])
    return {client: sorted(keys, key=repr) for client, keys in out.items()}


def test_restart_forgets_every_task_and_tells_every_client_why():
    sim = busy()
    while sim.computing["A"] or sim.computing["B"]:
        key = next(iter(sim.computing["A"] or sim.computing["B"]))
        if key == "bad":
            sim.fail("bad")
            break
        sim.finish(key)
    kinds = set(states(sim.state).values())
    assert {"memory", "erred", "no-worker"} <= kinds, states(sim.state)
    before = {c: sorted((ts.key for ts in cs.wants_what), key=repr)
              for c, cs in sim.state.clients.items()}
    client_msgs, worker_msgs = sim.record(sim.state.restart("restart-1"))
    assert cancelled(client_msgs) == before
    assert sim.state.tasks == {}
    assert all(not cs.wants_what for cs in sim.state.clients.values())
    assert set(sim.state.clients) == {"c1", "c2"}
    assert set(sim.state.workers) == {"A", "B"}
    for ws in sim.state.workers.values():
        assert not ws.processing and not ws.has_what and ws.nbytes == 0
        assert ws.occupancy == 0
    assert sim.state.n_queued == 0 and not sim.state.unrunnable
    assert set(sim.state.idle) == {"A", "B"}
    sim.check_workers_agree()  # every result was freed on its worker
    assert all(msg["stimulus_id"] == "restart-1" for msgs in worker_msgs.values()
               for msg in msgs)


def test_restart_frees_work_in_flight_and_held_results_on_the_workers():
    sim = busy()
    assert sim.state.n_queued > 0  # a root task waits in the scheduler's queue
    held = {address: set(sim.computing[address]) | sim.data[address] for address in "AB"}
    assert held["B"] >= {"s"}
    _, worker_msgs = sim.record(sim.state.restart("restart-2"))
    assert {a: set(keys) for a, keys in freed(worker_msgs).items()} == \
        {a: keys for a, keys in held.items() if keys}
    assert not any(sim.computing.values()) and not any(sim.data.values())
    assert sim.state.tasks == {}
    assert "restart-2" in {entry[3] for entry in sim.state.transition_log}


def test_restart_of_an_empty_cluster_says_nothing():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.state.add_client("idle", "hello")
    assert sim.state.restart("restart") == ({}, {})
    assert set(sim.state.clients) == {"idle"}


def test_new_work_after_a_restart_runs_from_scratch():
    sim = busy()
    sim.record(sim.state.restart("restart"))
    sim.submit([task("a"), task("b", "a")], ["b"], client="c1")
    assert states(sim.state) == {"a": "processing", "b": "waiting"}
    assert sim.run_all() == ["a", "b"]
    assert states(sim.state)["b"] == "memory"


def test_restart_with_a_stimulus_id_that_is_not_a_str_is_refused():
    sim = busy()
    for bad in (None, 1, b"restart", ["restart"]):
        assert_refused(sim.state, lambda: sim.state.restart(bad),
                       match="stimulus_id must be a str")
    assert sim.state.tasks


def test_restart_then_the_workers_leave_and_new_ones_join():
    """What the server does around the stimulus: the old workers die and are removed,
    restarted ones register; nothing about the old tasks comes back."""
    sim = busy()
    sim.record(sim.state.restart("restart"))
    assert sim.remove_worker("A") == ({}, {})
    assert sim.remove_worker("B") == ({}, {})
    assert sim.add_worker("A2", 1) == ({}, {})
    sim.submit([task("x")], ["x"], client="c2")
    assert sim.run_all() == ["x"]
    assert states(sim.state) == {"x": "memory"}


def test_stale_reports_after_a_restart_are_freed_not_believed():
    sim = busy()
    running = dict(sim.computing["A"])
    sim.record(sim.state.restart("restart"))
    key = next(iter(running))
    _, worker_msgs = sim.state.task_finished("A", [{"key": key, "nbytes": 1, "type": "int"}],
                                             "late")
    assert freed(worker_msgs) == {"A": [key]}
    assert sim.state.tasks == {}


def test_restart_validates_with_a_big_graph():
    state = SchedulerState(validate=False)
    state.add_worker("A", 2, "join")
    tasks = [task(("x", i)) for i in range(500)] + [
        task(("y", i), ("x", i), ("x", (i + 1) % 500)) for i in range(500)]
    state.update_graph("c", tasks, [("y", i) for i in range(500)], "graph")
    state.validate = True
    client_msgs, _ = state.restart("restart")
    assert len(client_msgs["c"][0]["keys"]) == 500
    assert state.tasks == {}
    state.validate_state()


def test_restart_in_slices_drops_at_most_max_keys_wants_a_call():
    sim = busy()
    wanted = {c: sorted((ts.key for ts in cs.wants_what), key=repr)
              for c, cs in sim.state.clients.items()}
    told: dict = {}
    calls = 0
    while sim.state.tasks:
        calls += 1
        assert calls < 20
        client_msgs, _ = sim.record(sim.state.restart(f"restart-{calls}", max_keys=2))
        dropped = cancelled(client_msgs)
        assert sum(len(keys) for keys in dropped.values()) <= 2
        for client, keys in dropped.items():
            told.setdefault(client, []).extend(keys)
    assert {c: sorted(keys, key=repr) for c, keys in told.items()} == wanted
    assert calls == 4  # 7 wanted keys, 2 a call
    assert not any(sim.computing.values()) and not any(sim.data.values())
    assert sim.state.restart("after", max_keys=2) == ({}, {})


def test_restart_max_keys_must_be_a_positive_int():
    sim = busy()
    for bad in (0, -1, 1.5, "2", True, 2 ** 63, [2]):
        assert_refused(sim.state, lambda: sim.state.restart("restart", max_keys=bad),
                       match="max_keys must be a positive int")
