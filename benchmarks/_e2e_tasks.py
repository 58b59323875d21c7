"""The functions that benchmarks/e2e.py has the workers run.

They live in this importable module, not in ``e2e.py``'s ``__main__``, so both
distributed-core and dask.distributed pickle them by reference (module + name, a few
dozen bytes) instead of by value with cloudpickle (hundreds of bytes and ~20 µs per
pickle, ~8 µs per unpickle). The benchmark puts this directory on the PYTHONPATH of
every scheduler, worker and client process it starts.
"""


def noop(x):
    """Workload 1: a task that does nothing (returns None)."""


def noop_leaf(i):
    """Workload 2: a leaf of the tree reduction."""
    return i


def add(a, b):
    """Workload 2: an inner node of the tree reduction."""
    return a + b


def inc(x):
    """Workload 3: the round-trip task."""
    return x + 1


def dask_scheduler_n_tasks(dask_scheduler):
    """Run on dask's scheduler (``client.run_on_scheduler``): how many tasks it holds."""
    return len(dask_scheduler.tasks)


def dask_scheduler_saturation(dask_scheduler):
    """Run on dask's scheduler: the worker-saturation it actually uses."""
    return repr(dask_scheduler.WORKER_SATURATION)


def second(a, b):
    """A task that waits on ``a`` (a dependency) and returns ``b``."""
    return b


def wait_for_event(name):
    """A task that runs until some client sets the event ``name``."""
    from distributed_server import Event

    Event(name).wait()


def sleep_and_record(i, delay, record_dir):
    """adaptive_burst.py: sleep ``delay`` seconds, leave a file per run (so that runs
    can be counted) and return ``i``."""
    import os
    import time

    time.sleep(delay)
    with open(os.path.join(record_dir, f"{i}-{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    return i
