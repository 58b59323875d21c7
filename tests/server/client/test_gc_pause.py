"""collector_paused: the automatic collector held off while Client.map makes its futures."""
from __future__ import annotations

import gc
import sys
import threading

import pytest

from distributed_server.client.gc_pause import collector_paused


def test_collector_paused_turns_collection_off_and_back_on_as_it_was():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: one pause
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # it was off: left off
    finally:
        gc.enable()


def test_collector_paused_in_two_threads_ends_with_the_last():
    inside, leave, left = threading.Event(), threading.Event(), threading.Event()

    def other():
        with collector_paused():
            inside.set()
            leave.wait(10)
        left.set()

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(10)
    with collector_paused():
        pass
    assert not gc.isenabled()  # the other thread's block still runs
    leave.set()
    assert left.wait(10)
    thread.join(10)
    assert gc.isenabled()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.skipif(sys.version_info[:2] == (3, 12),
                    reason="3.12 keeps immortal objects frozen: collected_apart does nothing")
def test_collected_apart_collects_the_cycles_made_inside_and_ages_the_rest():
    import weakref

    from distributed_server.client.gc_pause import collected_apart

    gc.collect()
    before = [[i] for i in range(10)]  # young, tracked objects made before the block
    assert any(o is before for o in gc.get_objects(generation=0))
    with collector_paused():  # as in GraphPlan: the automatic collector is off
        with collected_apart():
            garbage = _Cycle()
            gone = weakref.ref(garbage)
            del garbage
            assert gone() is not None  # a cycle: not freed by its reference count
        assert gone() is None  # collected at the end of the block
    assert gc.get_freeze_count() == 0
    assert any(o is before for o in gc.get_objects(generation=2))


def test_collected_apart_leaves_someone_elses_frozen_objects_frozen():
    from distributed_server.client.gc_pause import collected_apart

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with collected_apart():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


@pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="CPython 3.12 only")
def test_collected_apart_does_nothing_on_3_12():
    from distributed_server.client.gc_pause import collected_apart

    frozen = gc.get_freeze_count()
    with collected_apart():
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen


@pytest.mark.skipif(sys.version_info[:2] == (3, 12),
                    reason="3.12 keeps immortal objects frozen: collected_apart does nothing")
def test_collected_apart_collects_nothing_when_the_program_turned_the_collector_off():
    import weakref

    from distributed_server.client.gc_pause import collected_apart

    gc.disable()
    try:
        with collector_paused(), collected_apart():
            garbage = _Cycle()
            gone = weakref.ref(garbage)
            del garbage
        assert gone() is not None  # left for the program's own collections
    finally:
        gc.enable()
        gc.collect()
    assert gone() is None
