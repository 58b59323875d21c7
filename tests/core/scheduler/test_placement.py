"""Where tasks go: data locality, occupancy, learned durations, queuing, restrictions."""
from __future__ import annotations

import pytest
from core_sim import Sim, compute, computed, states, task

INF = float("inf")


def sim_with_data(sizes: dict, saturation=INF) -> Sim:
    """Workers A and B; each key of ``sizes`` computed on the worker named beside it."""
    sim = Sim(worker_saturation=saturation)
    sim.add_worker("A", 2)
    sim.add_worker("B", 2)
    sim.submit([task(key, workers=[where]) for key, (where, _) in sizes.items()], list(sizes))
    for key, (where, nbytes) in sizes.items():
        sim.finish(key, nbytes=nbytes, worker=where)
    return sim


# -- data locality and occupancy -----------------------------------------------------------


def test_ready_task_goes_to_the_worker_holding_most_of_its_input_bytes():
    sim = sim_with_data({"x": ("A", 10), "y": ("B", 1000)})
    _, worker_msgs = sim.submit([task("z", "x", "y")], ["z"], stimulus_id="g")
    assert worker_msgs == {"B": [compute("z", "g", (0, 1, 0),
                                         who_has={"x": ["A"], "y": ["B"]})]}


def test_input_bytes_add_up_per_worker():
    sim = sim_with_data({"x1": ("A", 400), "x2": ("A", 400), "y": ("B", 700)})
    _, worker_msgs = sim.submit([task("z", "x1", "x2", "y")], ["z"])
    assert computed(worker_msgs) == {"z": "A"}


@pytest.mark.parametrize("busy,expected", [("A", "B"), ("B", "A")])
def test_tie_in_input_bytes_is_broken_by_occupancy(busy, expected):
    sim = sim_with_data({"x": ("A", 100), "y": ("B", 100)})
    sim.submit([task("long", workers=[busy])], ["long"])
    assert sim.state.workers[busy].occupancy > 0
    _, worker_msgs = sim.submit([task("z", "x", "y")], ["z"])
    assert computed(worker_msgs) == {"z": expected}


def test_root_task_goes_to_the_least_busy_worker():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    sim.add_worker("B", 1)
    sim.submit([task("a1", workers=["A"]), task("a2", workers=["A"])], ["a1", "a2"])
    _, worker_msgs = sim.submit([task("r")], ["r"])
    assert computed(worker_msgs) == {"r": "B"}


def test_unknown_prefix_is_estimated_at_the_default_duration():
    sim = Sim(default_duration=0.25)
    sim.add_worker("A", 1)
    sim.submit([task("inc-1")], ["inc-1"])
    assert sim.state.workers["A"].occupancy == 0.25
    assert sim.state.prefixes["inc"].duration_average < 0


def test_finished_tasks_teach_their_prefix_its_average_duration():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 2)
    sim.submit([task("inc-1"), task("inc-2")], ["inc-1", "inc-2"])
    sim.finish("inc-1", duration=1.0)
    sim.finish("inc-2", duration=3.0)
    prefix = sim.state.prefixes["inc"]
    assert (prefix.name, prefix.duration_average, prefix.n_durations) == ("inc", 2.0, 2)


def test_learned_duration_is_the_estimate_of_the_next_task_of_that_prefix():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    sim.submit([task("inc-1")], ["inc-1"])
    sim.finish("inc-1", duration=2.0)
    sim.submit([task("inc-2"), task("dec-1")], ["inc-2", "dec-1"])
    assert sim.state.tasks["inc-2"].estimate == 2.0
    assert sim.state.workers["A"].occupancy == 2.0 + sim.state.default_duration


def test_hash_like_key_parts_share_a_prefix():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    sim.submit([task("sum-aggregate-9ab1c2d3e4"), task(("sum-aggregate-1f3a9c0d7e", 0))],
               ["sum-aggregate-9ab1c2d3e4", ("sum-aggregate-1f3a9c0d7e", 0)])
    assert list(sim.state.prefixes) == ["sum-aggregate"]


# -- queuing of root tasks -----------------------------------------------------------------


def test_queuing_sends_only_as_many_root_tasks_as_the_worker_has_slots():
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 2)
    client_msgs, worker_msgs = sim.submit([task(f"r{i}") for i in range(5)],
                                          [f"r{i}" for i in range(5)])
    assert client_msgs == {}
    assert [m["op"] for m in worker_msgs["A"]] == ["compute-task", "compute-task"]
    assert sim.state.task_counts()["queued"] == 3
    assert sim.state.n_queued == 3


def test_each_finished_task_releases_exactly_one_queued_task_in_priority_order():
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 2)
    sim.submit([task("r0"), task("r1")], ["r0", "r1"])
    priorities = {"q1": 1, "q5": 5, "q3": 3, "q2": 2, "q4": 4}
    assert sim.submit([task(k, priority=p) for k, p in priorities.items()],
                      list(priorities)) == ({}, {})
    _, worker_msgs = sim.finish("r0", stimulus_id="f")
    assert worker_msgs == {"A": [compute("q5", "f", (-5, 1, 1))]}
    released = ["q5"]
    for done in ["r1", "q5", "q4", "q3"]:
        _, worker_msgs = sim.finish(done)
        assert [m["op"] for m in worker_msgs["A"]] == ["compute-task"]
        released.append(worker_msgs["A"][0]["key"])
    assert released == ["q5", "q4", "q3", "q2", "q1"]
    assert sim.state.n_queued == 0


def test_queuing_first_sends_the_highest_priority_root_tasks():
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 2)
    _, worker_msgs = sim.submit([task(f"r{i}") for i in range(5)],
                                [f"r{i}" for i in range(5)])
    assert sorted(m["key"] for m in worker_msgs["A"]) == ["r0", "r1"]
    assert states(sim.state)["r4"] == "queued"


def test_dependents_made_ready_together_are_sent_in_priority_order():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    keys = [f"d{i:02d}" for i in range(30)]
    sim.submit([task("root")] + [task(key, "root") for key in keys], keys)
    _, worker_msgs = sim.finish("root")
    assert [msg["key"] for msg in worker_msgs["A"]] == keys


def test_slot_freed_by_a_failed_task_goes_to_the_next_queued_task_that_is_still_needed():
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.submit([task("r")], ["r"])
    sim.submit([task("q1", priority=1), task("q2"), task("d", "r", "q1")], ["d", "q2"])
    assert states(sim.state) == {"r": "processing", "q1": "queued", "q2": "queued",
                                 "d": "waiting"}
    _, worker_msgs = sim.fail("r")  # d errs, so q1 is not needed any more
    assert computed(worker_msgs) == {"q2": "A"}


def test_queue_horizon_lets_a_worker_take_more_tiny_tasks_than_its_slots():
    sim = Sim(worker_saturation=1.0, queue_horizon=1 / 16)
    sim.add_worker("A", 1)
    sim.submit([task("inc-0")], ["inc-0"])
    sim.finish("inc-0", duration=1 / 64)  # inc tasks take 1/64 s
    keys = [f"inc-{i}" for i in range(1, 11)]
    _, worker_msgs = sim.submit([task(key) for key in keys], keys)
    assert len(computed(worker_msgs)) == 4  # 4 x 1/64 s fill the 1/16 s horizon
    assert sim.state.n_queued == 6


def test_infinite_worker_saturation_queues_nothing():
    sim = Sim(worker_saturation=INF)
    sim.add_worker("A", 1)
    _, worker_msgs = sim.submit([task(f"r{i}") for i in range(10)],
                                [f"r{i}" for i in range(10)])
    assert len(worker_msgs["A"]) == 10
    assert sim.state.n_queued == 0
    assert sim.state.task_counts()["processing"] == 10


def test_root_tasks_wait_in_the_queue_for_a_worker_to_join():
    sim = Sim(worker_saturation=1.0)
    sim.submit([task(f"r{i}") for i in range(3)], [f"r{i}" for i in range(3)])
    assert sim.state.n_queued == 3
    _, worker_msgs = sim.add_worker("A", 2, stimulus_id="join")
    assert sorted(worker_msgs["A"], key=lambda m: m["key"]) == [
        compute("r0", "join", (0, 0, 0)), compute("r1", "join", (0, 0, 1))]
    assert sim.state.n_queued == 1


def queued_roots(n: int, workers=("A", "B")) -> tuple:
    """A Sim with workers of one thread each and ``n`` root tasks submitted: each worker
    was sent the first it could take, the rest wait in the queue. Returns it and the
    keys, in priority order."""
    sim = Sim(worker_saturation=1.0)
    for address in workers:
        sim.add_worker(address, 1)
    keys = [f"r{i:03d}" for i in range(n)]
    sim.submit([task(key) for key in keys], keys)
    return sim, keys


def drain_in_turns(sim: Sim) -> dict:
    """Finish tasks until none is left, the workers in turn, each finishing one task at a
    time. Returns each worker's keys in the order it ran them."""
    ran: dict = {address: [] for address in sim.computing}
    while any(sim.computing.values()):
        for address, computing in sim.computing.items():
            for key in list(computing):
                sim.finish(key, worker=address)
                ran[address].append(key)
    return ran


def test_workers_take_queued_tasks_in_runs_of_consecutive_priorities():
    # Neighbours in priority order are mostly the inputs of one later task (a shuffle's
    # group): one worker runs them, so their results need not travel.
    sim, keys = queued_roots(400)
    ran = drain_in_turns(sim)
    assert sorted(ran["A"] + ran["B"]) == keys
    where = {key: address for address, done in ran.items() for key in done}
    switches = sum(where[a] != where[b] for a, b in zip(keys, keys[1:]))
    assert switches <= 30  # 3 now; handed one by one as the workers free up: 399
    assert abs(len(ran["A"]) - len(ran["B"])) <= 2


def test_a_more_urgent_queued_task_goes_before_the_rest_of_a_run():
    sim, _ = queued_roots(40, workers=["A"])
    sim.finish("r000")
    assert sim.where("r001") == "A" and sim.state.workers["A"].queue_run
    sim.submit([task("urgent", priority=1)], ["urgent"])
    _, worker_msgs = sim.finish("r001")
    assert computed(worker_msgs) == {"urgent": "A"}
    _, worker_msgs = sim.finish("urgent")
    assert computed(worker_msgs) == {"r002": "A"}  # back to its run


def test_a_busy_workers_run_does_not_hold_back_the_most_urgent_tasks():
    # A takes a run, then is stuck on a long task; B, done with its own, takes the more
    # urgent half of A's run (again and again) before anything less urgent, even while
    # other graphs keep arriving.
    sim, _ = queued_roots(400)
    sim.finish(*list(sim.computing["A"]), worker="A")
    held = [ts.key for ts in reversed(sim.state.workers["A"].queue_run)]
    assert len(held) > 100
    ran_by_b = []
    for round_number in range(600):
        for key in list(sim.computing["B"]):
            sim.finish(key, worker="B")
            ran_by_b.append(key)
        if round_number % 50 == 0:
            later = [f"g{round_number}-{i}" for i in range(20)]
            sim.submit([task(key) for key in later], later, client=f"c{round_number}")
    first_later = next(i for i, key in enumerate(ran_by_b) if key.startswith("g"))
    assert set(held) <= set(ran_by_b[:first_later])
    assert sim.state.workers["A"].queue_run is None


def test_the_last_queued_task_released_leaves_no_run_behind():
    sim, keys = queued_roots(60)
    sim.finish(sim.computing["A"].popitem()[0], worker="A")
    assert sim.state.workers["A"].queue_run
    sim.release(keys)
    assert not sim.state.tasks and sim.state.n_queued == 0
    assert sim.state.queued == []
    assert all(ws.queue_run is None for ws in sim.state.workers.values())


@pytest.mark.parametrize("leaves", ["retired", "removed"])
def test_a_run_goes_back_to_the_queue_when_its_worker_stops_taking_tasks(leaves):
    sim, _ = queued_roots(60)
    sim.finish(sim.computing["A"].popitem()[0], worker="A")
    run = [ts.key for ts in sim.state.workers["A"].queue_run]
    assert run
    if leaves == "retired":
        sim.record(sim.state.retire_worker("A", "retire"))
    else:
        sim.remove_worker("A")
    assert states(sim.state)[run[0]] == "queued"
    sim.run_all()
    assert all(ts.state == "memory" for ts in sim.state.tasks.values())
    assert set(run) <= sim.data["B"]


def test_tasks_with_dependencies_are_not_queued():
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.submit([task("x"), task("y1", "x"), task("y2", "x")], ["y1", "y2"])
    _, worker_msgs = sim.finish("x")
    assert sorted(computed(worker_msgs)) == ["y1", "y2"]  # beyond the worker's one slot
    assert sim.state.n_queued == 0


# -- worker and resource restrictions ------------------------------------------------------


def test_task_restricted_to_an_absent_worker_has_no_worker():
    sim = Sim()
    sim.add_worker("A", 1)
    assert sim.submit([task("t", workers=["B"])], ["t"]) == ({}, {})
    assert states(sim.state) == {"t": "no-worker"}
    assert list(sim.state.unrunnable) == [sim.state.tasks["t"]]


def test_no_worker_task_is_scheduled_when_a_worker_with_its_address_joins():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t", workers=["B"])], ["t"])
    assert sim.add_worker("B", 1, stimulus_id="join") == (
        {}, {"B": [compute("t", "join", (0, 0, 0))]})
    assert len(sim.state.unrunnable) == 0


def test_no_worker_task_is_scheduled_when_a_worker_with_its_name_joins():
    sim = Sim()
    sim.submit([task("t", workers=["bob"])], ["t"])
    assert states(sim.state) == {"t": "no-worker"}
    assert sim.add_worker("tcp://10.0.0.2:4000", 1, name="bob", stimulus_id="join") == (
        {}, {"tcp://10.0.0.2:4000": [compute("t", "join", (0, 0, 0))]})


def test_joining_worker_that_does_not_match_leaves_the_task_waiting_for_one():
    sim = Sim()
    sim.submit([task("t", workers=["B"])], ["t"])
    assert sim.add_worker("A", 1) == ({}, {})
    assert states(sim.state) == {"t": "no-worker"}


def test_allow_other_workers_falls_back_to_any_worker():
    sim = Sim()
    sim.add_worker("A", 1)
    _, worker_msgs = sim.submit([task("t", workers=["B"], allow_other_workers=True)], ["t"])
    assert computed(worker_msgs) == {"t": "A"}


def test_restricted_dependent_runs_on_its_worker_not_where_its_input_is():
    sim = sim_with_data({"x": ("A", 1000)})
    _, worker_msgs = sim.submit([task("y", "x", workers=["B"])], ["y"], stimulus_id="g")
    assert worker_msgs == {"B": [compute("y", "g", (0, 1, 0), who_has={"x": ["A"]})]}


def test_allow_other_workers_still_prefers_a_live_restricted_worker():
    sim = sim_with_data({"x": ("A", 1000)})
    _, worker_msgs = sim.submit([task("y", "x", workers=["B"], allow_other_workers=True)],
                                ["y"])
    assert computed(worker_msgs) == {"y": "B"}


def test_task_needing_a_resource_goes_to_a_worker_that_has_it():
    sim = Sim()
    sim.add_worker("A", 4)
    sim.add_worker("B", 1, resources={"GPU": 2})
    _, worker_msgs = sim.submit([task("t", resources={"GPU": 1})], ["t"], stimulus_id="g")
    assert worker_msgs == {"B": [{**compute("t", "g", (0, 0, 0)), "resources": {"GPU": 1}}]}


def test_task_needing_more_of_a_resource_than_any_worker_has_waits_for_one():
    sim = Sim()
    sim.add_worker("A", 1, resources={"GPU": 1})
    sim.submit([task("t", resources={"GPU": 2})], ["t"])
    assert states(sim.state) == {"t": "no-worker"}
    assert sim.add_worker("B", 1, resources={"MEM": 10}) == ({}, {})
    _, worker_msgs = sim.add_worker("C", 1, resources={"GPU": 4})
    assert computed(worker_msgs) == {"t": "C"}


def test_allow_other_workers_does_not_relax_resources():
    sim = Sim()
    sim.add_worker("A", 1)
    sim.submit([task("t", workers=["B"], allow_other_workers=True, resources={"GPU": 1})],
               ["t"])
    assert states(sim.state) == {"t": "no-worker"}


def test_queued_tasks_of_random_priorities_run_most_urgent_first():
    """The queue's heap (tasks themselves, ordered by their priority) gives every queued
    task in priority order, however they came; validation checks the heap's order."""
    import random

    rng = random.Random(7)
    sim = Sim(worker_saturation=1.0)
    sim.add_worker("A", 1)
    sim.submit([task("r0")], ["r0"])
    priorities = {f"q{i}": rng.randrange(-5, 6) for i in range(300)}
    for start in range(0, 300, 70):  # several graphs: generation breaks equal priorities
        part = list(priorities)[start:start + 70]
        sim.submit([task(k, priority=priorities[k]) for k in part], part)
    ran = []
    done = "r0"
    while True:
        _, worker_msgs = sim.finish(done)
        if not worker_msgs.get("A"):
            break
        done = worker_msgs["A"][0]["key"]
        ran.append(done)
    position = {key: i for i, key in enumerate(priorities)}
    assert ran == sorted(priorities, key=lambda k: (-priorities[k], position[k] // 70,
                                                     position[k]))


def test_validation_finds_a_queue_heap_out_of_order():
    from distributed_core import InvariantError

    sim, _ = queued_roots(40)
    heap = sim.state.queued
    assert len(heap) > 3
    heap[0], heap[-1] = heap[-1], heap[0]
    with pytest.raises(InvariantError, match="out of order"):
        sim.state.validate_state()
