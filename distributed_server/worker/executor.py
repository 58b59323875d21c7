"""The worker's executor threads: they run tasks' code, never on the event loop.

``Execute`` instructions become jobs on a thread-safe queue (`Executor.put`); the worker
core hands out at most ``prefetch`` executions, so a late urgent task is never stuck
behind thousands. A daemon thread takes a job, runs ``loads_spec(spec)(inputs)``, builds
the report (sized and, when small, pickled inline, on the thread: reports.py) and
appends the outcome to a deque; one ``call_soon_threadsafe`` per burst of outcomes wakes
the loop, which hands the burst to the worker as one ``executions_done`` stimulus.

A job whose execution the core no longer wants (cancelled before a thread began it) is
skipped: the thread reads the core's ``execution_wanted`` flag on the job's task, a plain
attribute that the core's transitions keep, and never calls into the core. A thread
begins a job only under `Executor.claim`, noting its key in `Executor.begun` until its
outcome is drained: a steal request, answered under the same lock, gives back a job
handed to the threads exactly when no thread began it.

Tasks that launch tasks: a task that secedes gets a new executor thread in its place
(`seceded`); when it rejoins, one thread retires after its current job (`rejoined`), so
the pool comes back to ``nthreads``.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from queue import SimpleQueue

from distributed_core import ERRED, FINISHED, SKIPPED

from ..protocol.serialize import dumps_data, loads_spec
from .memory import ON_DISK, ExecutionGate
from .reports import ResultCannotTravel, cannot_travel_text, erred_report, finished_report
from .spec_parts import PartSpec
from .task_context import enter_task, leave_task

__all__ = ["THREAD_JOIN_TIMEOUT", "Executor", "run_job"]

#: How long stopping waits for executor threads to finish their current task.
THREAD_JOIN_TIMEOUT = 1.0


class Executor:
    """A pool of daemon threads that run jobs and report their outcomes in bursts.

    A job is ``(key, task, run spec, {input key: value}, check, read_back)``: ``task`` is
    the core's `WorkerTask` (its ``execution_wanted`` says whether to run it), ``check``
    that the result must show it serializes, ``read_back`` the mapping to read inputs
    spilled meanwhile (``ON_DISK``) from. An outcome is ``(key, kind, value, report)``
    with kind ``FINISHED``, ``ERRED`` or ``SKIPPED`` (distributed_core). ``deliver(burst)``
    is called on the loop with the outcomes of a burst, in order. ``worker`` is what a
    running task's `get_worker` returns.
    """

    def __init__(self, worker, nthreads: int, deliver: Callable[[list], None]) -> None:
        self._worker = worker
        self.nthreads = nthreads
        self._deliver = deliver
        self._queue: SimpleQueue = SimpleQueue()  # jobs (or None: stop) for the threads
        #: Hands a job to the threads (from the loop).
        self.put = self._queue.put
        #: ``(key, kind, value, report)`` from the threads, not yet delivered.
        self.outcomes: deque = deque()
        self._wake_pending = False  # a call_soon_threadsafe to drain outcomes is queued
        self.stopping = False  # threads skip queued jobs and exit
        #: A thread begins a job only under this lock (see the module's text).
        self.claim = threading.Lock()
        #: Keys of the jobs begun whose outcomes are not delivered yet.
        self.begun: set = set()
        self.threads: list = []
        self._threads_lock = threading.Lock()
        self._retiring = 0  # executor threads to retire (tasks that rejoined)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gate: ExecutionGate | None = None

    def start(self, loop: asyncio.AbstractEventLoop, gate: ExecutionGate | None) -> None:
        """Start the threads; outcomes wake ``loop``. ``gate`` (memory management) holds
        threads that outrun the memory monitor."""
        self._loop = loop
        self._gate = gate
        for i in range(self.nthreads):
            thread = threading.Thread(target=self._run_jobs, daemon=True,
                                      name=f"dcore-worker-{i}")
            thread.start()
            self.threads.append(thread)

    def _run_jobs(self) -> None:
        """An executor thread: run queued jobs, append outcomes, wake the loop per burst."""
        get = self._queue.get
        append = self.outcomes.append
        loop = self._loop
        drain = self._drain
        gate = self._gate
        stopping = self._is_stopping
        worker = self._worker
        while True:
            job = get()
            if job is None:
                return
            if gate is not None and not gate.is_open:
                gate.wait(stopping)
            extra = False
            with self.claim:
                begin = not self.stopping and job[1].execution_wanted
                if begin:
                    self.begun.add(job[0])
            if not begin:
                append((job[0], SKIPPED, None, None))  # cancelled before it began
            else:
                enter_task(worker, job[0])
                try:
                    outcome = run_job(job)
                    append(outcome)
                    if gate is not None and outcome[1] is FINISHED:
                        gate.produced(outcome[3]["nbytes"])
                    del outcome
                finally:
                    extra = leave_task()  # seceded: another thread took this one's place
            del job
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    loop.call_soon_threadsafe(drain)
                except RuntimeError:  # the loop is closed: nobody wants the outcome
                    return
            if extra or self._retire_one():
                return

    def _is_stopping(self) -> bool:
        return self.stopping

    def _retire_one(self) -> bool:
        """True for one executor thread per rejoined task: it leaves the pool."""
        if not self._retiring:
            return False
        with self._threads_lock:
            if self._retiring:
                self._retiring -= 1
                return True
        return False

    def _drain(self) -> None:
        """On the loop: the outcomes the threads produced, delivered as one burst."""
        # cleared before draining: an outcome appended from now on schedules a new call
        self._wake_pending = False
        outcomes = self.outcomes
        begun = self.begun
        burst = []
        while outcomes:
            outcome = outcomes.popleft()
            begun.discard(outcome[0])
            burst.append(outcome)
        self._deliver(burst)

    def seceded(self) -> None:
        """A task's thread seceded (from that thread): start an executor thread in its
        place."""
        with self._threads_lock:
            thread = threading.Thread(target=self._run_jobs, daemon=True,
                                      name=f"dcore-worker-{len(self.threads)}")
            self.threads.append(thread)
        thread.start()

    def rejoined(self) -> None:
        """A seceded task's thread is an executor thread again (from that thread): one
        other executor thread retires after its current job."""
        with self._threads_lock:
            self._retiring += 1

    async def stop(self) -> int:
        """Tell the threads to stop; wait briefly for those busy with a task. Returns how
        many are still running one (left behind as daemon threads)."""
        self.stopping = True
        if self._gate is not None:
            self._gate.release()
        for _ in self.threads:
            self._queue.put(None)
        deadline = time.monotonic() + THREAD_JOIN_TIMEOUT
        while any(t.is_alive() for t in self.threads) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return sum(t.is_alive() for t in self.threads)


def run_job(job: tuple) -> tuple:
    """On an executor thread: run one job; ``(key, kind, value, report)``."""
    key, _, spec, inputs, check, read_back = job
    if read_back is not None:  # inputs spilled since the task was queued: not task time
        for name, value in inputs.items():
            if value is ON_DISK:
                try:
                    inputs[name] = read_back[name]
                except Exception as exc:  # noqa: BLE001 - a failing disk: the task says so
                    now = time.time()
                    error = RuntimeError(
                        f"could not read input {name!r} of {key!r} back from the worker's "
                        f"spill directory: {type(exc).__name__}: {exc}")
                    return key, ERRED, None, erred_report(key, error, now, now)
    start = time.time()
    try:
        value = (spec.load() if type(spec) is PartSpec else loads_spec(spec))(inputs)
    except BaseException as exc:  # noqa: BLE001 - any failure of user code is the task's
        stop = time.time()
        return key, ERRED, None, erred_report(key, exc, start, stop)
    stop = time.time()
    del job, inputs, spec  # release the inputs as soon as possible
    if check:  # its result failed to travel before: it must show that it serializes now
        try:
            dumps_data(value)
        except Exception as exc:  # noqa: BLE001
            error = ResultCannotTravel(cannot_travel_text(key, value, exc))
            return key, ERRED, None, erred_report(key, error, start, stop)
    return key, FINISHED, value, finished_report(key, value, start, stop)
