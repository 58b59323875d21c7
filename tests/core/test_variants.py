"""The compiled core and the same .pyx run as Python source agree, message for message.

When the C extension is loaded, the .pyx is also loaded as source (as the package's
fallback does, under another module name) and one scenario runs on both. The scenario
avoids the places where the core iterates a set of tasks (several dependents becoming
ready at once, several results lost at once): there the order of messages follows
memory addresses, which differ between any two runs, compiled or not.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

import pytest
from core_sim import Sim, task

import distributed_core

pytestmark = pytest.mark.skipif(not distributed_core.COMPILED,
                                reason="the compiled core is not loaded")


def load_source_core():
    path = os.path.join(os.path.dirname(distributed_core.__file__), "_core.pyx")
    name = "distributed_core._core_as_source"
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while it loads
    loader.exec_module(module)
    return module


def scenario(state_class) -> Sim:
    """Queuing, placement, batches, retries, errors, scatter, a dead worker, restrictions,
    retry, cancel, lost data, a bad report, a refused stimulus, reschedule and release,
    each at least once."""
    sim = Sim(state_class=state_class, worker_saturation=1.0, allowed_failures=2)
    sim.state.add_client("c", "hello")
    sim.add_worker("A", 2)
    sim.add_worker("B", 1, name="bob", resources={"GPU": 1})
    sim.clock.now = 1.0
    sim.submit([task("load-0"), task("load-1"), task("load-2", priority=3), task("load-3"),
                task("clean-1", "load-1", retries=1), task("sum-1", "clean-1", "load-2"),
                task("gpu-1", resources={"GPU": 1}), task("on-bob", workers=["bob"]),
                task("fail-1", workers=["A"])],
               ["load-0", "sum-1", "gpu-1", "on-bob", "load-3", "fail-1"])
    failed_once = False
    while sim.computing["A"]:
        sim.clock.now += 0.5
        if "fail-1" in sim.computing["A"]:
            sim.fail("fail-1", exception=b"E0", traceback=b"T0", text="ValueError(0)")
        elif "clean-1" in sim.computing["A"] and not failed_once:
            sim.fail("clean-1", exception=b"E1", traceback=b"T1", text="ValueError(1)")
            failed_once = True
        else:
            sim.finish(*sorted(sim.computing["A"]), worker="A", duration=0.25, nbytes=10)
    sim.scatter({"data-0": ["B"]}, {"data-0": 100})
    sim.submit([task("use-0", "data-0"), task("use-1", "sum-1")], ["use-0", "use-1"])
    sim.remove_worker("B")  # gpu-1, on-bob wait for a worker; data-0 is lost
    sim.add_worker("C", 1, name="bob", resources={"GPU": 2})
    sim.record(sim.state.reschedule("C", sim.state.tasks["gpu-1"].key, "give-back"))
    sim.run_all()
    sim.record(sim.state.retry("c", ["fail-1", "use-0"], "retry"))
    sim.run_all()
    sim.submit([task("use-2", "sum-1", workers=["C"]), task("lied-about", workers=["A"])],
               ["use-2", "lied-about"])
    sim.record(sim.state.missing_data("C", "sum-1", "A", "missing"))
    sim.record(sim.state.task_finished("A", [{"key": "lied-about", "nbytes": -1}], "lie"))
    with pytest.raises(ValueError, match="runs no task that needs it"):  # each its own class
        sim.state.missing_data("A", "use-1", "C", "not-fetching")
    sim.run_all()
    sim.release(["load-0", "gpu-1"])
    sim.submit([task("bad", "bad")], ["bad"])
    sim.record(sim.state.cancel("c", ["use-1"], "cancel"))
    sim.release(["sum-1", "on-bob", "load-3", "use-2", "lied-about"])
    sim.release(["fail-1", "use-0", "data-0"])  # in this order: remove_client's is a set's
    sim.remove_client("c")
    return sim


def test_compiled_and_source_cores_send_the_same_messages():
    source = load_source_core()
    assert source.COMPILED is False
    compiled_run = scenario(distributed_core.SchedulerState)
    source_run = scenario(source.SchedulerState)
    assert len(compiled_run.log) == len(source_run.log) > 25
    for i, (got, expected) in enumerate(zip(compiled_run.log, source_run.log)):
        assert got == expected, f"stimulus #{i}"
    assert list(compiled_run.state.transition_log) == list(source_run.state.transition_log)
    assert compiled_run.state.tasks == source_run.state.tasks == {}
    assert compiled_run.state.counters() == source_run.state.counters()
    assert compiled_run.state.prefix_counts(every=True) == \
        source_run.state.prefix_counts(every=True)
    assert compiled_run.state.counters()["tasks_entered"]["forgotten"] > 10
