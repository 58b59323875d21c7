"""A worker's spec parts: kept from the scheduler's spec-part to its free-spec-parts,
unpickled once for the tasks that run from them."""
from __future__ import annotations

import operator
import pickle
import threading
import time

import pytest

from distributed_core import SPEC_PART_PREFIX
from distributed_server.worker.executor import run_job
from distributed_server.worker.spec_parts import PartSpec, SpecPartMissing, SpecParts


def reference(number: int, index: int) -> bytes:
    return SPEC_PART_PREFIX + number.to_bytes(8, "little") + index.to_bytes(4, "little")


class Counted:
    """A node that counts how often it was unpickled."""

    loads = 0

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _counted, (self.value,)

    def __call__(self, inputs):
        return self.value + sum(inputs.values())


def _counted(value):
    Counted.loads += 1
    return Counted(value)


def test_a_spec_that_is_not_a_reference_passes_through():
    parts = SpecParts()
    spec = pickle.dumps(operator.neg)
    assert parts.resolve(spec) is spec


def test_a_part_is_unpickled_once_for_its_tasks_and_kept_while_recently_used():
    parts = SpecParts(loaded_nodes=6)  # two parts of three
    for number in (1, 2, 3):
        parts.add(number, pickle.dumps([Counted(10 * number + i) for i in range(3)]))
    Counted.loads = 0
    assert [parts.resolve(reference(1, i)).load().value for i in range(3)] == [10, 11, 12]
    assert Counted.loads == 3  # one list of three
    parts.resolve(reference(2, 0)).load()
    parts.resolve(reference(3, 0)).load()  # part 1 is the least recently used: dropped
    assert Counted.loads == 9
    parts.resolve(reference(1, 2)).load()
    assert Counted.loads == 12
    parts.resolve(reference(3, 1)).load()
    assert Counted.loads == 12
    assert parts.loads == 4
    parts.free([1, 2, 3])
    assert parts._n_loaded == 0


def test_a_part_over_the_budget_is_still_kept_while_it_is_the_last_used():
    parts = SpecParts(loaded_nodes=2)
    parts.add(1, pickle.dumps([Counted(i) for i in range(5)]))
    for i in range(5):
        assert parts.resolve(reference(1, i)).load().value == i
    assert parts.loads == 1


def test_a_job_runs_its_node_with_its_inputs():
    parts = SpecParts()
    parts.add(7, pickle.dumps([Counted(1), Counted(100)]))
    spec = parts.resolve(reference(7, 1))
    assert isinstance(spec, PartSpec)
    key, kind, value, _ = run_job(("k", None, spec, {"a": 5}, False, None))
    assert (key, kind, value) == ("k", "finished", 105)


def test_a_freed_part_is_gone_but_a_job_that_took_it_still_runs():
    parts = SpecParts()
    parts.add(1, pickle.dumps([Counted(1)]))
    spec = parts.resolve(reference(1, 0))
    parts.free([1])
    assert len(parts) == 0
    assert spec.load().value == 1
    with pytest.raises(SpecPartMissing, match="spec part 1, which this worker was not sent"):
        parts.resolve(reference(1, 0)).load()


def test_a_missing_part_or_index_errs_the_task_with_a_clear_error():
    parts = SpecParts()
    parts.add(1, pickle.dumps([Counted(1)]))
    _, kind, _, report = run_job(("k", None, parts.resolve(reference(2, 0)), {}, False, None))
    assert kind == "erred" and "SpecPartMissing" in report["text"]
    _, kind, _, report = run_job(("k", None, parts.resolve(reference(1, 5)), {}, False, None))
    assert kind == "erred" and "has 1 specs, not #5" in report["text"]


@pytest.mark.parametrize("number, blob", [("1", b"x"), (1, "text"), (None, None)])
def test_a_malformed_part_is_refused(number, blob):
    parts = SpecParts()
    with pytest.raises(ValueError, match="a spec part is a number and bytes"):
        parts.add(number, blob)
    assert len(parts) == 0


def test_clear_drops_every_part():
    parts = SpecParts()
    parts.add(1, pickle.dumps([1]))
    parts.add(2, pickle.dumps([2]))
    parts.clear()
    assert len(parts) == 0


def test_a_new_scheduler_reusing_a_number_never_gets_the_old_parts_specs():
    """A job that took part 1 before the scheduler was lost loads after a new scheduler
    sent its own part 1: each gets its own part's specs."""
    parts = SpecParts()
    parts.add(1, pickle.dumps(["old-a", "old-b"]))
    stale = parts.resolve(reference(1, 0))
    parts.clear()
    parts.add(1, pickle.dumps(["new-a", "new-b"]))
    assert stale.load() == "old-a"
    assert parts.resolve(reference(1, 1)).load() == "new-b"
    assert stale.load() == "old-a"


class Slow:
    """A node whose unpickling takes a while, and says when it began."""

    began = threading.Event()

    def __reduce__(self):
        return _slow, ()


def _slow():
    Slow.began.set()
    time.sleep(0.5)
    return "slow"


def test_the_loop_does_not_wait_for_a_thread_that_unpickles_a_part():
    parts = SpecParts()
    parts.add(1, pickle.dumps([Slow()]))
    parts.add(2, pickle.dumps([Counted(2)]))
    spec = parts.resolve(reference(1, 0))
    thread = threading.Thread(target=spec.load)
    thread.start()
    assert Slow.began.wait(5)
    started = time.monotonic()
    parts.free([2])  # the loop, handling free-spec-parts
    parts.add(3, pickle.dumps([Counted(3)]))
    assert parts.resolve(reference(3, 0)).load().value == 3  # another executor thread
    assert time.monotonic() - started < 0.4
    thread.join()
