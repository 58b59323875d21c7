"""collector_paused: the automatic collector held off while Client.map makes its futures."""
from __future__ import annotations

import gc
import threading

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
