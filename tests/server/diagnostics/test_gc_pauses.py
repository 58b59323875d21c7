"""Garbage-collection pauses: timed per generation, logged when long, in the metrics."""
from __future__ import annotations

import asyncio
import gc
import logging

from server_helpers import fetch, metrics

from distributed_server.diagnostics.gc_pauses import GC_PAUSES, GCPauses, LoopCollector
from distributed_server.scheduler.server import Scheduler

LOCAL = "127.0.0.1:0"


def test_collections_are_timed_by_generation_until_uninstalled():
    pauses = GCPauses()
    pauses.install()
    pauses.install()  # once only
    try:
        assert gc.callbacks.count(pauses._callback) == 1
        gc.collect(0)
        gc.collect(2)
        assert pauses.count[0] >= 1 and pauses.count[2] >= 1
        freed = sum(pauses.collected)
        cycle: list = []
        cycle.append(cycle)
        del cycle
        gc.collect(2)
        assert sum(pauses.collected) >= freed + 1  # the list in a cycle with itself
        assert pauses.total[2] > 0 and pauses.longest[2] <= pauses.total[2]
        assert pauses.take_recent_longest() >= pauses.longest[2]
        assert pauses.take_recent_longest() == 0.0
    finally:
        pauses.uninstall()
    counted = pauses.count[2]
    gc.collect(2)
    assert pauses.count[2] == counted and pauses._callback not in gc.callbacks


def test_a_long_collection_is_logged(caplog):
    pauses = GCPauses(warn_seconds=0.0)
    pauses.install()
    try:
        with caplog.at_level(logging.WARNING, logger="distributed_server.gc"):
            gc.collect(2)
    finally:
        pauses.uninstall()
    assert any("generation-2 garbage collection stopped this process" in r.getMessage()
               for r in caplog.records)


def test_the_scheduler_metrics_show_gc_pauses_once_timed():
    async def main():
        async with Scheduler(validate=True, dashboard_address=LOCAL) as s:
            m = metrics((await fetch(s.http.url + "/metrics")).body.decode())
            assert ("dcore_scheduler_gc_pause_seconds_total", (("generation", "2"),)) \
                not in m
            assert m[("dcore_scheduler_heap_trim_seconds_total", ())] == 0.0
            assert m[("dcore_scheduler_heap_trim_max_seconds", ())] == 0.0
            assert m[("dcore_scheduler_empty_pool_bytes_released_total", ())] == 0.0
            GC_PAUSES.install()
            try:
                gc.collect(2)
                m = metrics((await fetch(s.http.url + "/metrics")).body.decode())
            finally:
                GC_PAUSES.uninstall()
            label = (("generation", "2"),)
            assert m[("dcore_scheduler_gc_pause_seconds_total", label)] > 0
            assert 0 < m[("dcore_scheduler_gc_pause_max_seconds", label)] <= \
                m[("dcore_scheduler_gc_pause_seconds_total", label)]

    asyncio.run(main())


def test_the_loop_collector_collects_between_callbacks_by_the_thresholds():
    """Automatic collection off; the timer collects cyclic garbage once the count passes
    the threshold, and not before; stopping turns automatic collection back on."""
    class Cycle:
        def __init__(self):
            self.me = self

    async def main():
        old = gc.get_threshold()
        gc.set_threshold(5_000, 10, 10)
        collector = LoopCollector(interval=0.01)
        pauses = GCPauses()
        try:
            gc.collect()
            collector.start()
            pauses.install()
            assert not gc.isenabled()
            assert collector.collect_if_due() is None  # under the threshold
            garbage = [Cycle() for _ in range(20_000)]
            del garbage
            assert pauses.count == [0, 0, 0]  # nothing collected inside this callback
            while pauses.count[0] == 0:  # the next tick collects (the test's timeout bounds it)
                await asyncio.sleep(0.01)
            assert gc.get_count()[0] < 5_000
        finally:
            pauses.uninstall()
            collector.stop()
            gc.set_threshold(*old)
        assert gc.isenabled()

    asyncio.run(main())


def test_worker_processes_collect_by_the_worker_thresholds(client):
    """A worker process holds many small objects (its results); it collects by
    WORKER_GC_THRESHOLDS, not by the default (700, 10, 10)."""
    from distributed_server.cli import WORKER_GC_THRESHOLDS

    thresholds = client.run(gc.get_threshold)
    assert len(thresholds) == 2
    assert all(tuple(t) == WORKER_GC_THRESHOLDS for t in thresholds.values())
    assert gc.get_threshold() != WORKER_GC_THRESHOLDS  # the client's process is the user's
