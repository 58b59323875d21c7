"""Work stealing in the scheduler's core: ``balance`` asks busy workers for tasks they
have not begun, ``steal_response`` enacts their answers. Every stimulus runs with
validate on (a task processing on exactly one worker, steal records consistent)."""
from __future__ import annotations

import pytest
from core_sim import Sim, assert_refused, computed, states, task

from distributed_core import InvalidStimulus

FANOUT = 10


def loaded_worker(n: int = FANOUT, nthreads: int = 1) -> Sim:
    """Worker a ran the root ``r``; the ``n`` tasks ``t0..`` that need it all went to a
    (the holder of their input); then an empty worker b joined."""
    sim = Sim()
    sim.add_worker("a", nthreads)
    sim.submit([task("r")] + [task(f"t{i}", "r") for i in range(n)],
               [f"t{i}" for i in range(n)])
    sim.finish("r", nbytes=1000)
    assert set(sim.computing["a"]) == {f"t{i}" for i in range(n)}
    sim.add_worker("b", 1)
    return sim


def steal_asks(sim: Sim, address: str) -> list:
    return [msg["key"] for msg in sim.steal_asks.get(address, [])]


def test_balance_asks_the_busy_worker_for_its_least_urgent_tasks():
    sim = loaded_worker()
    _, worker_msgs = sim.balance()
    assert list(worker_msgs) == ["a"]
    # Equal estimates (0.5 s, no duration known): half moves, the least urgent first.
    assert steal_asks(sim, "a") == ["t9", "t8", "t7", "t6", "t5"]
    msg = worker_msgs["a"][0]
    assert msg["op"] == "steal-request" and isinstance(msg["request"], int)
    assert sim.state.steal_counts() == {"requests": 5, "moved": 0, "in_flight": 5,
                                        "refused_running": 0}
    # Until the answer, the tasks stay processing on the victim only.
    assert {ts.key for ts in sim.state.workers["a"].processing} == \
        {f"t{i}" for i in range(FANOUT)}
    assert not sim.state.workers["b"].processing
    # A second balance before the answers asks for nothing more.
    assert sim.balance()[1] == {}


def test_a_task_given_back_goes_to_the_thief_with_its_inputs_holders():
    sim = loaded_worker()
    sim.balance()
    sim.answer_steals("a")
    moved = {f"t{i}" for i in range(5, FANOUT)}
    assert set(sim.computing["b"]) == moved
    assert {ts.key for ts in sim.state.workers["b"].processing} == moved
    assert {ts.key for ts in sim.state.workers["a"].processing} == \
        {f"t{i}" for i in range(5)}
    for key in moved:
        assert sim.computing["b"][key]["who_has"] == {"r": ["a"]}
    assert sim.state.steal_counts()["moved"] == 5
    assert sim.state.steal_counts()["in_flight"] == 0
    sim.run_all()
    assert all(state == "memory" for key, state in states(sim.state).items()
               if key != "r")


def test_a_refused_steal_keeps_the_task_and_is_not_asked_again():
    """The task began on the victim (a race with the task starting)."""
    sim = loaded_worker()
    sim.balance()
    sim.answer_steals("a", give=False, keys=["t9"])
    sim.answer_steals("a", give=True)
    assert sim.state.tasks["t9"].processing_on.address == "a"
    assert sim.state.steal_counts()["refused_running"] == 1
    assert "t9" not in set(sim.computing["b"])
    sim.finish(*sim.computing["b"], worker="b")
    sim.balance()
    assert "t9" not in steal_asks(sim, "a")
    sim.finish("t9", worker="a")
    assert sim.state.steal_counts()["refused_running"] == 0


def test_a_task_finished_before_the_answer_stays_finished():
    """The victim finished the task; its answer (a refusal, or a lying "given") is stale."""
    sim = loaded_worker()
    sim.balance()
    sim.finish("t9", worker="a")
    assert sim.state.tasks["t9"].state == "memory"
    assert sim.state.steal_counts()["in_flight"] == 4
    request = sim.steal_asks["a"][0]["request"]
    client_msgs, worker_msgs = sim.record(
        sim.state.steal_response("a", "t9", request, True, "late-answer"))
    assert (client_msgs, worker_msgs) == ({}, {})
    assert sim.state.tasks["t9"].state == "memory"
    sim.steal_asks["a"].pop(0)
    sim.answer_steals("a")
    assert sim.state.steal_counts()["moved"] == 4


def test_an_answer_with_another_request_id_or_from_another_worker_is_ignored():
    sim = loaded_worker()
    sim.balance()
    msg = sim.steal_asks["a"][0]
    key, request = msg["key"], msg["request"]
    assert sim.state.steal_response("a", key, request + 1000, True, "wrong-id") == ({}, {})
    assert sim.state.steal_response("b", key, request, True, "not-its-task") == ({}, {})
    assert sim.state.tasks[key].processing_on.address == "a"
    assert sim.state.steal_counts()["in_flight"] == 5


def test_the_victim_leaving_during_a_steal_reschedules_its_tasks_once():
    sim = loaded_worker()
    sim.balance()
    pending = list(sim.steal_asks["a"])
    sim.remove_worker("a")
    # r was held only by a: it is computed again, then every t runs on b.
    assert sim.state.steal_counts()["in_flight"] == 0
    for msg in pending:  # answers from the departed worker change nothing
        assert sim.state.steal_response("a", msg["key"], msg["request"], True,
                                        sim.sid("late")) == ({}, {})
    sim.run_all()
    assert all(sim.state.tasks[f"t{i}"].state == "memory" for i in range(FANOUT))


def test_the_thief_leaving_during_a_steal_places_a_given_task_again():
    sim = loaded_worker()
    sim.balance()
    sim.remove_worker("b")
    assert sim.state.steal_counts()["in_flight"] == 5
    _answers = sim.answer_steals("a")
    # Given back with no thief: through waiting, and the only worker left takes it.
    assert set(sim.computing["a"]) == {f"t{i}" for i in range(FANOUT)}
    assert sim.state.steal_counts() == {"requests": 5, "moved": 0, "in_flight": 0,
                                        "refused_running": 0}
    sim.run_all()
    assert all(sim.state.tasks[f"t{i}"].state == "memory" for i in range(FANOUT))


def test_a_task_released_by_its_client_during_a_steal():
    sim = loaded_worker()
    sim.balance()
    sim.release(["t9"])
    assert "t9" not in sim.state.tasks
    assert sim.state.steal_counts()["in_flight"] == 4
    answers = dict(sim.answer_steals("a"))
    assert answers["t9"] is False  # the simulated worker dropped it on free-keys


def test_a_worker_joining_takes_half_of_a_long_backlog():
    sim = loaded_worker(n=100)
    sim.balance()
    sim.answer_steals("a")
    assert len(sim.computing["a"]) + len(sim.computing["b"]) == 100
    assert abs(len(sim.computing["a"]) - len(sim.computing["b"])) <= 2


def test_no_balance_with_one_worker_or_without_waiting_work():
    sim = Sim()
    sim.add_worker("a", 1)
    sim.submit([task("x"), task("y")], ["x", "y"])
    assert len(sim.computing["a"]) == 2
    before = sim.state.counters()["stimuli"]
    assert sim.state.balance("b1") == ({}, {})
    assert sim.state.counters()["stimuli"] == before  # not counted

    sim = Sim()
    sim.add_worker("a", 1)
    sim.add_worker("b", 1)
    sim.submit([task("x"), task("y")], ["x", "y"])
    assert len(sim.computing["a"]) == len(sim.computing["b"]) == 1
    assert sim.state.balance("b2") == ({}, {})  # one task a worker: nothing waits


def test_restricted_and_seceded_tasks_stay():
    """A busy victim gives up only tasks free to move: not those restricted to it, not
    the one that seceded (it is running)."""
    sim = Sim()
    sim.add_worker("a", 1)
    free = [f"u{i}" for i in range(6)]
    sim.submit([task("r")] + [task(f"t{i}", "r", workers=["a"]) for i in range(3)]
               + [task("s", "r")] + [task(u, "r") for u in free],
               ["t0", "t1", "t2", "s"] + free)
    sim.finish("r")
    assert len(sim.computing["a"]) == 10
    sim.add_worker("b", 1)
    sim.record(sim.state.task_seceded("a", "s", "secede"))
    sim.balance()
    asked = steal_asks(sim, "a")
    assert asked and set(asked) <= set(free), asked


def test_seceded_tasks_are_counted_once_in_a_victims_floor():
    """A worker with 1 thread and 1 seceded task runs 2 at once; the queue's saturation
    gives it one slot more: 3 tasks make it no victim, 4 do."""
    for n, victim in ((3, False), (4, True)):
        sim = Sim()
        sim.add_worker("a", 1)
        sim.submit([task("r")] + [task(f"t{i}", "r") for i in range(n)],
                   [f"t{i}" for i in range(n)])
        sim.finish("r")
        sim.add_worker("b", 1)
        sim.record(sim.state.task_seceded("a", "t0", "secede"))
        sim.balance()
        assert bool(steal_asks(sim, "a")) is victim, (n, steal_asks(sim, "a"))


def test_durations_learned_decide_how_much_moves():
    """Short tasks learned as such move only while the thief would start them sooner."""
    sim = Sim()
    sim.add_worker("a", 1)
    sim.submit([task("r")] + [task(("t", i), "r") for i in range(8)],
               [("t", i) for i in range(8)])
    sim.finish("r")
    sim.finish(("t", 0), duration=1.0)  # t's prefix: 1 s a task
    sim.add_worker("b", 2)
    sim.balance()
    asked = steal_asks(sim, "a")
    # a: 7 tasks of 1 s; b: 2 threads. Moves while b's work per thread plus the task is
    # below a's remaining work minus half a task: 4 tasks (a fifth would not be).
    assert asked == [("t", 7), ("t", 6), ("t", 5), ("t", 4)][:len(asked)]
    assert len(asked) == 4


def test_the_steal_request_and_compute_task_messages():
    # 3 tasks on 1 thread: one more than the queue's saturation (1.1) gives a worker
    sim = loaded_worker(n=3)
    _, worker_msgs = sim.balance(stimulus_id="bal")
    assert worker_msgs == {"a": [{"op": "steal-request", "key": "t2", "request": 1,
                                  "stimulus_id": "bal"}]}
    sim.steal_asks["a"].clear()
    del sim.computing["a"]["t2"]
    _, worker_msgs = sim.record(sim.state.steal_response("a", "t2", 1, True, "given"))
    assert computed(worker_msgs) == {"t2": "b"}


def test_a_worker_holding_only_its_saturation_is_no_victim():
    """The queue gives each worker ceil(threads x 1.1) tasks; stealing between equally
    busy workers would only move them back and forth."""
    sim = loaded_worker(n=2)
    assert sim.balance(stimulus_id="bal")[1] == {}
    assert sim.state.steal_counts()["requests"] == 0


@pytest.mark.parametrize("args, match", [
    (("a", "t9", "1", True), "request must be an int"),
    (("a", "t9", 1, 1), "given must be a bool"),
    (("a", ["t9"], 1, True), "steal_response"),
    ((None, "t9", 1, True), "worker"),
])
def test_bad_steal_responses_are_refused_and_change_nothing(args, match):
    sim = loaded_worker()
    sim.balance()
    assert_refused(sim.state, lambda: sim.state.steal_response(*args, "bad"),
                   InvalidStimulus, match)


def test_validation_catches_a_task_listed_on_two_workers():
    sim = loaded_worker()
    ts = sim.state.tasks["t9"]
    sim.state.workers["b"].processing.add(ts)
    with pytest.raises(AssertionError):
        sim.state.validate_state()
    sim.state.workers["b"].processing.discard(ts)
    sim.state.validate_state()


def test_no_stealing_while_the_scheduler_queue_feeds_the_workers():
    """Queued tasks (no inputs) go to any worker with room: stealing would only add
    round trips."""
    sim = loaded_worker()
    sim.submit([task(f"q{i}") for i in range(20)], [f"q{i}" for i in range(20)])
    assert sim.state.n_queued > 0
    assert sim.state.balance("b") == ({}, {})


def test_answers_of_one_batch_are_one_stimulus_and_one_bad_answer_refuses_them_all():
    sim = loaded_worker(n=4)
    _, worker_msgs = sim.balance(stimulus_id="bal")
    asked = [(m["key"], m["request"]) for m in worker_msgs["a"]]
    assert len(asked) == 2
    assert_refused(sim.state, lambda: sim.state.steal_responses(
        "a", [(asked[0][0], asked[0][1], True), (asked[1][0], "2", True)], "bad"),
        InvalidStimulus, "request must be an int")
    for key, _ in asked:
        del sim.computing["a"][key]
    sim.steal_asks["a"].clear()
    _, worker_msgs = sim.record(sim.state.steal_responses(
        "a", [(key, request, True) for key, request in asked], "given"))
    assert computed(worker_msgs) == {key: "b" for key, _ in asked}
    assert sim.state.steal_counts()["moved"] == 2


def test_the_core_says_when_a_report_wants_a_balance_at_once():
    """`balance_wanted`: two workers or more, and (given a worker that reported) it has
    room with nothing waiting there; the server only rate-limits it. A read: no change."""
    sim = Sim()
    sim.add_worker("a", 2)
    assert not sim.state.balance_wanted() and not sim.state.balance_wanted("a")
    sim.add_worker("b", 1)
    assert sim.state.balance_wanted() and sim.state.balance_wanted("a")
    assert not sim.state.balance_wanted("ghost")
    sim.submit([task(f"t{i}") for i in range(5)], [f"t{i}" for i in range(5)])
    busy = max(["a", "b"], key=lambda w: len(sim.computing[w]) - sim.state.workers[w].nthreads)
    assert len(sim.computing[busy]) > sim.state.workers[busy].nthreads
    before = sim.state.counters()
    assert not sim.state.balance_wanted(busy)  # tasks wait there: the timer's balance
    assert sim.state.counters() == before
    for key in list(sim.computing[busy])[:len(sim.computing[busy])
                                         - sim.state.workers[busy].nthreads]:
        sim.finish(key, worker=busy)
    assert sim.state.balance_wanted(busy)


def test_among_many_thieves_the_holder_of_a_tasks_input_is_weighed_too():
    """A balance weighs, for each task, only the few least loaded thieves and those
    holding its inputs: the holder of a big input gets the tasks even when it is not
    among the least loaded (all thieves idle here, the holder joined last)."""
    sim = Sim()
    sim.add_worker("a", 1)
    sim.submit([task("r")] + [task(f"t{i}", "r") for i in range(FANOUT)],
               [f"t{i}" for i in range(FANOUT)])
    sim.finish("r", nbytes=10**9)  # 10 s to move at the assumed bandwidth
    for i in range(20):
        sim.add_worker(f"b{i:02d}", 1)
    sim.add_worker("c", 1)
    sim.record(sim.state.acquire_replicas("c", ["r"], sim.sid("acquire")))
    sim.copied("c", "r")
    sim.balance()
    asked = steal_asks(sim, "a")
    assert asked  # without weighing "c", moving r (10 s) is never worth it
    sim.answer_steals("a")
    assert set(sim.computing["c"]) == set(asked)
    assert not any(sim.computing[f"b{i:02d}"] for i in range(20))
