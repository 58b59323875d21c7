"""Give the heap memory that a big release freed back to the operating system.

When a million tasks are forgotten, CPython frees their objects, but glibc's malloc keeps
the freed pages of its heap mapped (only the top of the heap is returned by itself), so
the process's RSS stays near its peak. ``malloc_trim(0)`` returns every free page of the
heap. `HeapTrimmer` calls it after the scheduler has forgotten many tasks since its last
call; without glibc (another libc, another OS) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time

#: Tasks that must be forgotten (from the most held since the last trim) before a trim.
TRIM_AFTER_TASKS = 50_000


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


def trim_heap() -> bool:
    """``malloc_trim(0)``: True if glibc gave memory back, False if not (or no glibc)."""
    return _MALLOC_TRIM is not None and bool(_MALLOC_TRIM(0))


class HeapTrimmer:
    """Follows how many tasks are held and trims the heap once ``after`` of them (from
    the most held since the last trim) are gone, or once almost all are (a tail smaller
    than ``after``).

    It runs no garbage collection of its own: a full collection right after a big
    release held the scheduler's loop for 95-165 ms (benchmarks/big_job.py, a million
    tasks), and what a graph left in cycles is freed by the scheduler's collector
    (`gc_pauses.LoopCollector`) by its thresholds anyway."""

    def __init__(self, after: int = TRIM_AFTER_TASKS):
        self.after = after
        self.high = 0  # most tasks held since the last trim
        self.trims = 0
        self.seconds = 0.0  # spent trimming, in all
        self.longest = 0.0  # the longest single trim

    def held(self, n_tasks: int) -> bool:
        """Tell it ``n_tasks`` are held now; True if it trimmed the heap."""
        if n_tasks > self.high:
            self.high = n_tasks
            return False
        gone = self.high - n_tasks
        if gone < self.after and (gone < self.after // 10 or n_tasks * 16 > self.high):
            return False
        self.high = n_tasks
        self.trims += 1
        started = time.perf_counter()
        trim_heap()
        took = time.perf_counter() - started
        self.seconds += took
        self.longest = max(self.longest, took)
        return True
