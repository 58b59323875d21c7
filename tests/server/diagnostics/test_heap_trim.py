"""HeapTrimmer: when the scheduler gives freed heap memory back (malloc_trim)."""
import pytest

from distributed_server.diagnostics import heap_trim
from distributed_server.diagnostics.heap_trim import HeapTrimmer


@pytest.fixture(autouse=True)
def no_empty_pools(monkeypatch):
    """The trimmer's logic alone: the process's own empty pools stay where they are."""
    monkeypatch.setattr(heap_trim, "release_empty_pools", lambda max_pools=-1: (0, True))
    monkeypatch.setattr(heap_trim, "give_back_pool_tails", lambda max_arenas=-1: (0, True))
    monkeypatch.setattr(heap_trim, "retire_empty_pools", lambda max_arenas=-1: (0, True))


def test_a_big_release_trims_every_after_tasks_and_at_its_end():
    trimmer = HeapTrimmer(after=50_000)
    held = [0, 1_000_000] + list(range(990_000, -1, -10_000))
    trimmed = [n for n in held if trimmer.held(n)]
    assert trimmed == list(range(950_000, -1, -50_000))


def test_a_small_tail_is_trimmed_once_almost_everything_is_gone():
    trimmer = HeapTrimmer(after=50_000)
    assert [trimmer.held(n) for n in (30_000, 20_000, 1_000)] == [False, False, True]


def test_small_changes_never_trim():
    trimmer = HeapTrimmer(after=50_000)
    assert not any(trimmer.held(n) for n in (30_000, 29_000, 28_000, 40_000, 39_000))
    assert trimmer.trims == 0


def test_trim_heap_answers_without_glibc_too(monkeypatch):
    assert type(heap_trim.trim_heap()) is bool
    monkeypatch.setattr(heap_trim, "_MALLOC_TRIM", None)
    assert heap_trim.trim_heap() is False


def test_trims_are_timed(monkeypatch):
    import time

    monkeypatch.setattr(heap_trim, "trim_heap", lambda: time.sleep(0.02) or True)
    trimmer = HeapTrimmer(after=10)
    assert trimmer.seconds == trimmer.longest == 0.0
    assert [trimmer.held(n) for n in (100, 50, 45)] == [False, True, False]
    assert trimmer.trims == 1 and 0.02 <= trimmer.longest == trimmer.seconds < 1.0


def _recording_trimmer(monkeypatch, calls: list) -> HeapTrimmer:
    """A trimmer whose hooks, collections and trims append to ``calls``: "pack"
    (before every trim), "squeeze" (before a collection), "collect", "trim"."""
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: calls.append("trim") or True)
    monkeypatch.setattr(heap_trim.gc, "collect", lambda *a: calls.append("collect") or 0)
    return HeapTrimmer(after=50_000, before_trim=lambda: calls.append("pack"),
                       before_collect=lambda: calls.append("squeeze"),
                       collect_below=1_024, collect_after=100_000)


def test_before_a_trim_the_hook_runs_and_with_few_tasks_left_a_full_collection(monkeypatch):
    """The task stream packs before every trim; the free lists are emptied (a full
    collection) only once few tasks are left, when a collection walks little; only
    then, just before it, the task stream squeezes its chunks."""
    calls = []
    trimmer = _recording_trimmer(monkeypatch, calls)
    for n in (1_000_000, 900_000):
        trimmer.held(n)
    assert calls == ["pack", "trim"]
    calls.clear()
    for n in (10_000, 0):
        trimmer.held(n)
    assert calls == ["pack", "trim", "pack", "squeeze", "collect", "trim"]
    calls.clear()
    assert trimmer.settle(0) and calls == ["pack", "squeeze", "collect", "trim"]


def test_after_a_trim_that_left_few_tasks_it_trims_a_few_times_more_as_it_settles(monkeypatch):
    calls = []
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: calls.append("trim") or True)
    monkeypatch.setattr(heap_trim.gc, "collect", lambda *a: calls.append("collect") or 0)
    trimmer = HeapTrimmer(after=50_000, collect_below=1_024, collect_after=100_000)
    assert not trimmer.settle(0)  # nothing owed
    trimmer.held(100_000)
    trimmer.held(40_000)  # a trim that left many: owes nothing
    assert not trimmer.settle(40_000) and calls == ["trim"]
    trimmer.held(0)
    calls.clear()
    assert [trimmer.settle(0) for _ in range(heap_trim.SETTLE_TRIMS + 1)] == \
        [True] * heap_trim.SETTLE_TRIMS + [False]
    assert calls == ["collect", "trim"] * heap_trim.SETTLE_TRIMS
    trimmer.held(60_000)
    trimmer.held(0)
    assert not trimmer.settle(30_000)  # a new graph came in meanwhile: not now


def test_later_collecting_trims_come_at_their_counts_of_settles_and_then_none(monkeypatch):
    calls = []
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: calls.append("trim") or True)
    monkeypatch.setattr(heap_trim.gc, "collect", lambda *a: calls.append("collect") or 0)
    trimmer = HeapTrimmer(after=50_000, collect_below=1_024, collect_after=100_000)
    trimmer.held(100_000)
    trimmer.held(0)
    calls.clear()
    settles = range(1, heap_trim.LATE_TRIMS[-1] + 20)
    trimmed = [i for i in settles if trimmer.settle(0)]
    assert trimmed == [*range(1, heap_trim.SETTLE_TRIMS + 1), *heap_trim.LATE_TRIMS]
    assert calls == ["collect", "trim"] * len(trimmed)


def test_a_small_job_is_trimmed_without_a_collection(monkeypatch):
    """Under ``collect_after`` tasks held, a release frees too little for a collection
    to be worth its CPU: the trim runs alone, and nothing is owed."""
    calls = []
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: calls.append("trim") or True)
    monkeypatch.setattr(heap_trim.gc, "collect", lambda *a: calls.append("collect") or 0)
    trimmer = HeapTrimmer(after=50_000, collect_below=1_024, collect_after=100_000)
    for n in (20_000, 0):
        trimmer.held(n)
    assert calls == ["trim"] and not trimmer.settle(0)
    for n in (100_000, 0):  # a big one after it collects
        trimmer.held(n)
    assert calls == ["trim", "collect", "trim"]


def test_the_collection_comes_however_small_the_last_step_of_a_big_release(monkeypatch):
    """A big release ends in steps of thousands of tasks: a trim may leave a little
    over ``collect_below``, and the rest then goes in a step too small for a trim of
    its own. The collecting trim still comes once few tasks are left."""
    calls = []
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: calls.append("trim") or True)
    monkeypatch.setattr(heap_trim.gc, "collect", lambda *a: calls.append("collect") or 0)
    trimmer = HeapTrimmer(after=50_000, collect_below=1_024, collect_after=100_000)
    for n in (1_000_000, 50_000, 2_000):
        trimmer.held(n)
    assert calls == ["trim", "trim"]  # 2,000 left: no collection yet
    assert trimmer.held(0) and calls[2:] == ["collect", "trim"]
    assert trimmer.settle(0) and not trimmer.held(0)  # once: nothing left to collect


def test_a_collecting_trim_gives_back_the_empty_pools_and_counts_their_bytes(monkeypatch):
    calls = []
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: calls.append("trim") or True)
    monkeypatch.setattr(heap_trim.gc, "collect", lambda *a: calls.append("collect") or 0)
    left = [3]  # steps until every empty pool is given back

    def release(max_pools=-1):
        assert max_pools == heap_trim.POOL_STEP
        calls.append("pools")
        left[0] -= 1
        return 12_288, left[0] <= 0

    monkeypatch.setattr(heap_trim, "release_empty_pools", release)
    trimmer = HeapTrimmer(after=50_000, collect_below=1_024, collect_after=100_000)
    for n in (1_000_000, 900_000):
        trimmer.held(n)
    assert calls == ["trim"] and trimmer.pool_bytes == 0  # many tasks held: not yet
    trimmer.held(0)
    assert calls[1:] == ["collect", "pools", "trim"] and trimmer.pool_bytes == 12_288
    del calls[:]
    for _ in range(heap_trim.SETTLE_TRIMS):  # each settling trim takes a step too
        assert trimmer.settle(0)
    assert calls == ["collect", "pools", "trim"] * heap_trim.SETTLE_TRIMS
    assert trimmer.pool_bytes == (1 + heap_trim.SETTLE_TRIMS) * 12_288
    del calls[:]
    assert not trimmer.settle(0) and calls == []  # none left: nothing more


def test_empty_pools_left_after_the_settling_trims_go_a_step_a_second(monkeypatch):
    calls = []
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: calls.append("trim") or True)
    monkeypatch.setattr(heap_trim.gc, "collect", lambda *a: 0)
    left = [heap_trim.SETTLE_TRIMS + 3]

    def release(max_pools=-1):
        calls.append("pools")
        left[0] -= 1
        return 4096, left[0] == 0

    monkeypatch.setattr(heap_trim, "release_empty_pools", release)
    trimmer = HeapTrimmer(after=50_000, collect_below=1_024, collect_after=100_000)
    trimmer.held(200_000)
    trimmer.held(0)
    for _ in range(heap_trim.SETTLE_TRIMS):
        trimmer.settle(0)
    del calls[:]
    assert not trimmer.settle(5_000) and calls == []  # a new job: not while it runs
    assert [trimmer.settle(0) for _ in range(3)] == [False] * 3 and calls == ["pools"] * 2
    assert left == [0] and trimmer.pool_bytes == 4096 * (heap_trim.SETTLE_TRIMS + 3)


@pytest.mark.parametrize("give_back, step", [("give_back_pool_tails", "TAIL_STEP"),
                                             ("retire_empty_pools", "RETIRE_STEP")])
def test_arena_tails_wait_for_the_next_settle_then_go_a_step_a_second(monkeypatch, give_back,
                                                                      step):
    """The trim that follows the release collects what the job left, the longest pause
    of the release: the arenas' empty pools (their tails, and the pools below their last
    pool in use) are not given back whole in it, but a second later."""
    calls = []
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: True)
    monkeypatch.setattr(heap_trim.gc, "collect", lambda *a: 0)
    left = [heap_trim.SETTLE_TRIMS + 3]

    def tails(max_arenas=-1):
        assert max_arenas == getattr(heap_trim, step)
        calls.append("tails")
        left[0] -= 1
        return 2**20, left[0] == 0

    monkeypatch.setattr(heap_trim, give_back, tails)
    trimmer = HeapTrimmer(after=50_000, collect_below=1_024, collect_after=100_000)
    trimmer.held(200_000)
    assert trimmer.held(0) and calls == []
    for _ in range(heap_trim.SETTLE_TRIMS):
        assert trimmer.settle(0)
    assert calls == ["tails"] * heap_trim.SETTLE_TRIMS
    del calls[:]
    assert [trimmer.settle(0) for _ in range(4)] == [False] * 4 and calls == ["tails"] * 3
    assert left == [0] and trimmer.pool_bytes == 2**20 * (heap_trim.SETTLE_TRIMS + 3)


def test_a_collecting_trim_in_steps_does_one_part_a_step(monkeypatch):
    """Begun in steps, a collecting trim waits for `step`: the histories packed, then
    the collection, then the pools and the heap; nothing else trims meanwhile, and the
    settling trims follow as after a trim in one go."""
    calls = []
    trimmer = _recording_trimmer(monkeypatch, calls)
    trimmer.held(1_000_000, in_steps=True)
    assert trimmer.held(0, in_steps=True) and trimmer.steps_owed and calls == []
    assert trimmer.trims == 1
    assert not trimmer.held(0, in_steps=True) and not trimmer.settle(0) and calls == []
    parts = []
    while True:
        more = trimmer.step()
        parts.append(calls[:])
        calls.clear()
        if not more:
            break
    assert parts == [["pack", "squeeze"], ["collect"], ["trim"]]
    assert not trimmer.steps_owed and not trimmer.step() and trimmer.peak == 0
    assert trimmer.settle(0) and calls == ["pack", "squeeze", "collect", "trim"]
    assert trimmer.trims == 2


def test_in_steps_only_a_collecting_trim_waits(monkeypatch):
    calls = []
    monkeypatch.setattr(heap_trim, "trim_heap", lambda: calls.append("trim") or True)
    trimmer = HeapTrimmer(after=10)
    assert [trimmer.held(n, in_steps=True) for n in (100, 50)] == [False, True]
    assert calls == ["trim"] and not trimmer.steps_owed
