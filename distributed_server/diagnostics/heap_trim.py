"""Give the heap memory that a big release freed back to the operating system.

When a million tasks are forgotten, CPython frees their objects, but glibc's malloc keeps
the freed pages of its heap mapped (only the top of the heap is returned by itself), so
the process's RSS stays near its peak. ``malloc_trim(0)`` returns every free page of the
heap. `HeapTrimmer` calls it after the scheduler has forgotten many tasks since its last
call; without glibc (another libc, another OS) it does nothing.

The small-object allocator's arenas are not glibc's heap: an arena goes back to the
system only once every pool in it is empty, and a few objects that outlive the release
keep many arenas mapped. `give_back_pool_tails` gives back whole the empty pools above
each arena's last pool in use, `retire_empty_pools` takes those below it out of the arena
and gives them back whole too, and `release_empty_pools` gives back the pages of any other
empty pools but their first (the compiled extension ``pool_pages``; the interpreted
install goes without it).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time

#: Tasks that must be forgotten (from the most held since the last trim) before a trim.
TRIM_AFTER_TASKS = 50_000
#: A trim with at most this many tasks still held runs a full collection first...
COLLECT_BELOW_TASKS = 1_024
#: ...if at least this many were held since the last collection (a smaller job leaves
#: little to give back, and the collections cost it a few per cent of its CPU).
COLLECT_AFTER_TASKS = 100_000
#: Trims (with a collection), a second apart, that follow a trim which left few tasks.
SETTLE_TRIMS = 3
#: And later ones, this many `settle` calls (about seconds) after that trim. Objects the
#: event loop makes anew every few seconds (timer handles, their contexts and times)
#: were made during the job, among its objects, and each keeps an arena of the
#: small-object allocator mapped; when one dies, the interpreter's free list keeps its
#: block for the next object of its type, in the same arena, so only a collection
#: (which empties the free lists) lets those arenas go. With a collection every second
#: after a ten-million-task map, 26 such arenas were 19 after 40 s (a scratch run).
LATE_TRIMS = (10, 25, 45)
#: Empty pools given back at most in one step (about 2 us each: one system call): one
#: step in a collecting trim, then one a second (`settle`) until none is left.
POOL_STEP = 4_096
#: Arenas whose empty pools above the last one in use are given back whole, at most in
#: one step, the same way (about 40 us an arena with 1 MiB of them: 1,198 such arenas
#: took 45 ms; finding the allocator's arena records, about 1 ms a step).
TAIL_STEP = 64
#: Arenas whose empty pools below the last one in use are taken out and given back, at
#: most in one step, the same way (about 25 us an arena, and 2 ms to find and check the
#: allocator's records and its list of arenas: 64 of 1,200 arenas kept by a row in
#: 3,000 took 3.7 ms, a scratch timing).
RETIRE_STEP = 64


#: The parts of a collecting trim done in steps (`HeapTrimmer.step`), in order.
_COLLECTING_STEPS = ("pack", "collect", "give back")


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()

try:
    from . import pool_pages
except ImportError:  # the interpreted install: no compiled extension
    pool_pages = None


def track_arenas() -> bool:
    """Make the allocator's arenas known from now on to `release_empty_pools`
    (process-wide, idempotent); False where that cannot be done."""
    return pool_pages is not None and pool_pages.install()


def release_empty_pools(max_pools: int = -1) -> tuple[int, bool]:
    """Give back the pages of the empty pools of the arenas known since `track_arenas`
    (all but each pool's first page), at most ``max_pools`` of them (negative: all):
    ``(bytes given back, whether all are given back now)``."""
    return (0, True) if pool_pages is None else pool_pages.release(max_pools)


def give_back_pool_tails(max_arenas: int = -1) -> tuple[int, bool]:
    """Give back whole (header page too) the empty pools above each known arena's last
    pool in use, which the arena then takes as pools it never used, in at most
    ``max_arenas`` arenas (negative: all): ``(bytes given back, whether all are given
    back now)``. Nothing without the extension, or where the allocator's arena records
    are not found."""
    return (0, True) if pool_pages is None else pool_pages.give_back_tails(max_arenas)


def retire_empty_pools(max_arenas: int = -1) -> tuple[int, bool]:
    """Take the empty pools below each known arena's last pool in use (all but the
    arena's first pool) out of the arena and give them back whole, in at most
    ``max_arenas`` arenas (negative: all): ``(bytes given back, whether all are given
    back now)``. The arena counts that many pools less, and goes back to the system once
    its pools in use are empty. Nothing without the extension, or where the allocator's
    arena records and list of arenas are not found."""
    return (0, True) if pool_pages is None else pool_pages.retire_pools(max_arenas)


def trim_heap() -> bool:
    """``malloc_trim(0)``: True if glibc gave memory back, False if not (or no glibc)."""
    return _MALLOC_TRIM is not None and bool(_MALLOC_TRIM(0))


class HeapTrimmer:
    """Follows how many tasks are held and trims the heap once ``after`` of them (from
    the most held since the last trim) are gone, or once almost all are (a tail smaller
    than ``after``).

    Once at most ``collect_below`` tasks are held, after ``collect_after`` or more were,
    it trims at once (however few tasks the last step freed), with a full collection
    first.
    Not for the cycles (the scheduler's `gc_pauses.LoopCollector` frees those by its
    thresholds) but for the interpreter's free lists, which only a full collection
    empties: the last few thousand tuples, dicts and floats that a release freed stay in
    them, each keeping a 1 MiB arena of the small-object allocator from going back to the
    system (after a million-task map: 195 MiB of RSS before the collection, 108 MiB
    after; the collection took 8.7 ms). A full collection walks every object still
    tracked: at the last trim of a million-task release (a sixteenth of the tasks or
    fewer left) it held the loop for 95-165 ms, and with 16,384 or fewer left at the end
    of a ten-million-task map's release 53 ms (the task table's emptied dicts, not yet
    rebuilt), so it waits until almost nothing is held. What the release's last
    messages free after that fills the free lists again (135 MiB instead of 107), so
    `settle`, called about once a second, trims ``SETTLE_TRIMS`` more times after such a
    trim, and again at `LATE_TRIMS`."""

    def __init__(self, after: int = TRIM_AFTER_TASKS, before_trim=None, before_collect=None,
                 collect_below: int = COLLECT_BELOW_TASKS,
                 collect_after: int = COLLECT_AFTER_TASKS):
        self.after = after
        self.collect_below = collect_below
        self.collect_after = collect_after
        self.peak = 0  # most tasks held since the last collection
        #: Called just before each trim: what should let go of memory first
        #: (the task stream packs its open entries).
        self.before_trim = before_trim
        #: Called in a collecting trim, before the collection: what can be made smaller
        #: once a big job is gone (the task stream squeezes its chunks, the transition
        #: log packs its entries).
        self.before_collect = before_collect
        self.high = 0  # most tasks held since the last trim
        self.trims = 0
        self.seconds = 0.0  # spent trimming, in all
        self.longest = 0.0  # the longest single trim
        #: `settle` calls since a trim that left few tasks (None: no trim owed)
        self._settles: int | None = None
        #: Bytes of empty pools given back after collecting trims, in all.
        self.pool_bytes = 0
        self._pools_owed = False  # empty pools still to give back (more than a step)
        self._steps_owed = 0  # parts of a collecting trim begun in steps, still to do
        track_arenas()

    def held(self, n_tasks: int, in_steps: bool = False) -> bool:
        """Tell it ``n_tasks`` are held now; True if it trimmed the heap.

        With ``in_steps``, a collecting trim is only begun: `step` does it, a part a
        call (`steps_owed` says whether one is owed), so that a caller with an event
        loop can let other callbacks run between the parts."""
        if self._steps_owed:
            return False  # a collecting trim is under way
        if n_tasks > self.peak:
            self.peak = n_tasks
        if n_tasks > self.high:
            self.high = n_tasks
            return False
        collect = n_tasks <= self.collect_below and self.peak >= self.collect_after
        gone = self.high - n_tasks
        # a collecting trim comes however few the last step freed: a trim just before may
        # have left a little over collect_below (a big job's release ends in steps)
        if not collect and gone < self.after and (gone < self.after // 10
                                                  or n_tasks * 16 > self.high):
            return False
        self.high = n_tasks
        if collect and in_steps:
            self.trims += 1
            self._steps_owed = len(_COLLECTING_STEPS)
            return True
        # the arena tails wait for `settle`: this trim's collection walks what the job
        # left (45-72 ms after ten million tasks), and the loop waits for all of it
        self._trim(collect, tails=False)
        self._settles = 0 if collect else None
        return True

    @property
    def steps_owed(self) -> bool:
        """Whether a collecting trim that `held` began in steps has a part left."""
        return self._steps_owed > 0

    def step(self) -> bool:
        """Do the next part of a collecting trim begun in steps: pack the histories;
        collect (a full collection); give back the empty pools and trim the heap. True
        if a part is still owed. After a ten-million-task map the parts took 16, 61
        and 12 ms (a scratch timing): done in one call, the loop waited for their sum
        and for the stimulus that called `held`, 104-123 ms."""
        if not self._steps_owed:
            return False
        started = time.perf_counter()
        part = _COLLECTING_STEPS[-self._steps_owed]
        self._steps_owed -= 1
        if part == "pack":
            if self.before_trim is not None:
                self.before_trim()
            if self.before_collect is not None:
                self.before_collect()
        elif part == "collect":
            gc.collect()
            self.peak = 0
        else:
            self._release_pools(tails=False)
            trim_heap()
            self._settles = 0
        self._timed(started)
        return self._steps_owed > 0

    def settle(self, n_tasks: int) -> bool:
        """Called about once a second: after a trim that left few tasks, trim (with a
        collection) again, ``SETTLE_TRIMS`` times and then at `LATE_TRIMS`, while few
        are held; between those, give back `POOL_STEP` more empty pools, and `TAIL_STEP`
        more arenas' tails and `RETIRE_STEP` more arenas' other empty pools, while some
        are left. True if it trimmed."""
        if self._steps_owed:
            return False
        if n_tasks > self.collect_below:
            self._settles = None
            return False
        if self._settles is not None:
            self._settles += 1
            settles = self._settles
            if settles >= LATE_TRIMS[-1]:
                self._settles = None
            if settles <= SETTLE_TRIMS or settles in LATE_TRIMS:
                self._trim(collect=True)
                return True
        if self._pools_owed:
            started = time.perf_counter()
            self._release_pools()
            self._timed(started)
        return False

    def _trim(self, collect: bool, tails: bool = True) -> None:
        self.trims += 1
        started = time.perf_counter()
        if self.before_trim is not None:
            self.before_trim()
        if collect:
            if self.before_collect is not None:
                self.before_collect()
            gc.collect()
            self.peak = 0
            # only with few tasks held: it reads one header per pool of every arena
            self._release_pools(tails)
        trim_heap()
        self._timed(started)

    def _release_pools(self, tails: bool = True) -> None:
        given, tails_done = give_back_pool_tails(TAIL_STEP) if tails else (0, False)
        retired, retired_all = retire_empty_pools(RETIRE_STEP) if tails else (0, False)
        got, done = release_empty_pools(POOL_STEP)
        self.pool_bytes += given + retired + got
        self._pools_owed = not (tails_done and retired_all and done)

    def _timed(self, started: float) -> None:
        took = time.perf_counter() - started
        self.seconds += took
        self.longest = max(self.longest, took)
