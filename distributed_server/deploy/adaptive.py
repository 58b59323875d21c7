"""Adaptive scaling, the cluster manager's side: `Adaptive` grows and shrinks a
`Cluster` with its work, in a thread of its own.

Every ``interval`` it asks the scheduler how many workers the work wants
(`SchedulerState.adaptive_target`: the queued and running work priced at the durations
the scheduler learned, over ``target_duration``; the memory held), bounds the answer by
``minimum`` and ``maximum``, and:

- scales up at once when the answer is above the workers planned;
- scales down only once the answer has stayed below them ``wait_count`` times in a row
  (a burst's gaps do not cost a worker's start), and then by graceful retirement: the
  scheduler picks the workers best let go and moves their results before they stop.

Each decision is kept in ``log`` (time, target, workers wanted, action: ``"up"``,
``"down"`` or ``"keep"``), written before it is carried out; an error
while asking or scaling is logged and retried at the next step, never raised into the
user's program.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time

from ..config import parse_seconds

__all__ = ["Adaptive"]

logger = logging.getLogger("distributed_server.adaptive")

#: Decisions kept in ``Adaptive.log``.
LOG_LENGTH = 1000


class Adaptive:
    """Grows and shrinks ``cluster`` (a `Cluster`) with its work; see the module's text.

    ``minimum`` and ``maximum`` bound the workers (``maximum`` may be ``math.inf``);
    ``target_duration`` and ``interval`` are seconds or duration strings (``"5s"``,
    ``"500ms"``); ``wait_count`` is how many steps in a row the target must stay lower
    before workers are let go."""

    def __init__(self, cluster, minimum: int = 0, maximum: float = math.inf,
                 target_duration="5s", interval="1s", wait_count: int = 3) -> None:
        if type(minimum) is not int or minimum < 0:
            raise ValueError(f"minimum must be an int >= 0, not {minimum!r}")
        if not (maximum == math.inf or (type(maximum) is int and maximum >= minimum)):
            raise ValueError(f"maximum must be an int >= minimum ({minimum}) or math.inf, "
                             f"not {maximum!r}")
        if type(wait_count) is not int or wait_count < 1:
            raise ValueError(f"wait_count must be an int >= 1, not {wait_count!r}")
        self.target_duration = parse_seconds(target_duration)
        self.interval = parse_seconds(interval)
        if not 0 < self.target_duration < math.inf or not 0 < self.interval < math.inf:
            raise ValueError("target_duration and interval must be positive durations")
        self.cluster = cluster
        self.minimum = minimum
        self.maximum = maximum
        self.wait_count = wait_count
        #: (time.time(), target, planned, action) of each step, the newest last
        self.log: collections.deque = collections.deque(maxlen=LOG_LENGTH)
        self._lower = 0  # steps in a row whose target was below the workers planned
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self):
        state = "running" if self.running else "stopped"
        return (f"<Adaptive minimum={self.minimum} maximum={self.maximum} "
                f"target_duration={self.target_duration}s {state}>")

    @property
    def running(self) -> bool:
        """True while the thread steps."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Step now and then every ``interval`` seconds, in a daemon thread."""
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="distributed-core-adaptive")
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop stepping; wait for a step under way to finish."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - adaptivity must not die of one error
                logger.warning("adaptive scaling: this step failed (%s); trying again in "
                               "%.3g s", exc, self.interval)
            self._stop.wait(self.interval)

    def recommendation(self, target: int, planned: int) -> int:
        """The workers to plan for, given the scheduler's ``target`` and the workers
        ``planned`` now (counts the steps whose target stays lower)."""
        wanted = int(min(max(target, self.minimum), self.maximum))
        if wanted > planned:
            self._lower = 0
            return wanted
        if wanted == planned:
            self._lower = 0
            return planned
        self._lower += 1
        if self._lower < self.wait_count:
            return planned
        self._lower = 0
        return wanted

    def step(self) -> int:
        """One decision: ask, bound, scale. Returns the workers planned after it."""
        cluster = self.cluster
        cluster.check_workers()
        target = cluster.request({"op": "adaptive-target",
                                  "target_duration": self.target_duration})
        planned = len(cluster.worker_names)
        wanted = self.recommendation(target, planned)
        if self._stop.is_set():
            return planned
        action = "keep" if wanted == planned else "up" if wanted > planned else "down"
        self.log.append((time.time(), target, wanted, action))
        if action != "keep":
            logger.info("adaptive scaling: %s from %d to %d workers (target %d)", action,
                        planned, wanted, target)
            cluster.scale_to(wanted)
        return wanted
