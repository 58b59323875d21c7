# cython: language_level=3
"""The worker's state machine: which of its tasks waits, runs, travels or is held, and why.

Rules of this module (everything that decides a task's state on a worker lives here):

- No I/O. No sockets, files, threads, logging, pickle, and no clock reads: the clock is
  passed in. Run specs, results and errors are opaque: the machine never looks inside
  them. A result passes through only on its way into the shell's data mapping
  (``StoreData``); the machine keeps no reference to it.
- Stimuli in, instructions out. Each public stimulus (``compute_tasks``, ``free_keys``,
  ``execute_success``, ``fetch_done``, ``scheduler_lost``, ...) takes plain data and a
  stimulus id, changes the state only through transitions, and returns a list of
  instructions for the shell, in the order it must carry them out:

  ``Execute(key)``           run the task on an executor thread: its spec is
                             ``tasks[key].run_spec``, its inputs the values of
                             ``tasks[key].dependencies`` in the data mapping (all there)
  ``Fetch(peer, keys)``      ask one peer for these keys (one request per peer and burst)
  ``SendMessage(msg)``       send a message to the scheduler (docs/protocol.md)
  ``StoreData(key, value)``  put a value into the data mapping
  ``ReleaseData(key)``       drop a value from the data mapping
  ``ReportHeld(key)``        report the value held under ``key`` to the scheduler as
                             finished (a task-finished built from the value)

  The shell holds a value exactly while the machine's task for that key is ``memory``.
- Stimuli are transactions. A stimulus checks all of its input before it changes
  anything; refused input raises ``InvalidStimulus`` and leaves the state exactly as it
  was. Outcomes that no longer match the state (a fetch answered after its task was
  freed, an execution of a task put in memory meanwhile) are ignored, never refused:
  they are the ordinary races of a concurrent shell.
- One table, one engine. ``_TRANSITIONS`` (beside the states, below) lists every allowed
  move ``start -> finish``; its function is the method
  ``WorkerCore._transition_<start>_<finish>``, and the engine dispatches through a table
  built from the list (``_DISPATCH``); a transition changes one task and may *recommend*
  states for others;
  the engine applies recommendations until none are left, then feeds the executor and
  plans fetches. A move with no entry goes through ``released``. Transitions that carry
  data from a stimulus (a result, a fetched value) are called by that stimulus. A
  stimulus that runs away (``max_transitions_per_stimulus``) raises
  ``TransitionLimitExceeded``.
- ``validate=True`` checks every invariant after each stimulus; the transition log is
  bounded and ``story(key)`` tells what happened to a key, and why.
- Lean tasks: collections a task needs for part of its life are ``None`` until needed
  and set back to ``None`` when done.
- The same source runs compiled by Cython and imported as plain Python.

Task states on a worker:

``waiting``      to compute here; some inputs are not in memory yet
``ready``        to compute here; all inputs in memory; in the priority heap
``constrained``  ready, but the worker's free resources do not cover it
``executing``    handed to the executor (queued on its threads, or running)
``cancelled``    handed to the executor, but no longer wanted: the outcome is discarded
                 unless a new compute-task adopts the execution, or a task here needs
                 the result as an input
``fetch``        an input to fetch from a peer (planned at the end of the stimulus)
``flight``       an input asked of one peer; the answer is pending
``memory``       the value is in the shell's data mapping
``released``     transient: on its way to its next state
``forgotten``    gone from ``tasks``

A value in memory is kept while the scheduler counts this worker as its holder
(``reported``: it was computed here, reported held, put here by a client, or copied here
at the scheduler's request) or while a task here that has not finished needs it (a
fetched copy).

Copies the scheduler asks for (``acquire_replicas``: retirement, replicate, rebalance)
are fetched like inputs; each request is answered exactly once: ``add-keys`` once the
value is held (then it counts as reported), or ``acquire-failed`` if no holder gave it,
the scheduler freed the key first, or it left memory within the same stimulus.
"""
from __future__ import annotations

try:
    import cython
except ImportError:  # the pure-Python install runs without Cython
    from . import cython_shim as cython

import heapq
from collections import namedtuple
from typing import Optional

from . import _core

COMPILED: bool = cython.compiled

InvalidStimulus = _core.InvalidStimulus
InvalidTransition = _core.InvalidTransition
InvariantError = _core.InvariantError
TransitionLimitExceeded = _core.TransitionLimitExceeded
bounded_repr = _core.bounded_repr
# The input checks and helpers both cores share: one copy, in _core.
_check = _core._check
_check_key = _core._check_key
_check_keys = _core._check_keys
_check_resources = _core._check_resources
_check_str = _core._check_str
_zero_clock = _core._zero_clock

RELEASED = "released"
WAITING = "waiting"
READY = "ready"
CONSTRAINED = "constrained"
EXECUTING = "executing"
CANCELLED = "cancelled"
FETCH = "fetch"
FLIGHT = "flight"
MEMORY = "memory"
FORGOTTEN = "forgotten"
WORKER_TASK_STATES = (RELEASED, WAITING, READY, CONSTRAINED, EXECUTING, CANCELLED, FETCH,
                      FLIGHT, MEMORY, FORGOTTEN)
# A task in one of these states has not finished: it needs its inputs (the shell may
# run it again if its execution was skipped).
PENDING_STATES = frozenset((WAITING, READY, CONSTRAINED, EXECUTING, CANCELLED))

#: The one list of allowed moves: ``_TRANSITIONS[start]`` holds the states ``start`` may
#: go to directly, each by the method ``WorkerCore._transition_<start>_<finish>`` (the
#: engine calls them through ``_DISPATCH``, built from this table below the class). A move
#: missing here goes through ``released``.
_TRANSITIONS = {
    RELEASED: (WAITING, FETCH, EXECUTING, CANCELLED, FORGOTTEN),
    WAITING: (READY, RELEASED),
    READY: (EXECUTING, WAITING, CONSTRAINED, RELEASED),
    CONSTRAINED: (READY, WAITING, RELEASED),
    EXECUTING: (CANCELLED, WAITING, RELEASED),
    CANCELLED: (EXECUTING, RELEASED),
    FETCH: (FLIGHT, RELEASED),
    FLIGHT: (FETCH, RELEASED),
    MEMORY: (RELEASED,),
}

#: Instructions: what the shell must do, in order.
Execute = namedtuple("Execute", ["key"])
Fetch = namedtuple("Fetch", ["peer", "keys"])
SendMessage = namedtuple("SendMessage", ["msg"])
StoreData = namedtuple("StoreData", ["key", "value"])
ReleaseData = namedtuple("ReleaseData", ["key"])
ReportHeld = namedtuple("ReportHeld", ["key"])
_tuple_new = tuple.__new__  # builds an instruction without its Python-level __new__

#: What an execution came to (``executions_done``).
FINISHED = "finished"
ERRED = "erred"
SKIPPED = "skipped"

_LOG_FIELDS = 5  # key, start, finish, stimulus_id, time
_INT64_MAX = 2 ** 63 - 1
_MAX_NBYTES = 2 ** 62
_TRANSITIONS_PER_TASK_LIMIT = 50
_TRANSITIONS_LIMIT_BASE = 100_000
_SEQUENCE = (list, tuple)
_BYTES = (bytes, bytearray, memoryview)
_NO_TASKS = ()
#: Keys whose results failed to travel that a worker remembers (oldest forgotten first).
CANNOT_TRAVEL_MEMORY = 10_000


@cython.dataclasses.dataclass(init=False, repr=False, eq=False)
@cython.final
@cython.no_gc
@cython.cclass
class WorkerTask:
    """One key as this worker sees it: a task to compute, an input to fetch, a value held.

    Compiled, the cyclic garbage collector never walks these (``no_gc``): the machine
    cuts the links between tasks itself (a forgotten task refers to no other task, and a
    WorkerCore that is dropped cuts the links of the tasks it still holds).
    """

    key: object
    state: str
    run_spec: object  # opaque bytes while the scheduler wants it computed here, else None
    priority: tuple  # lower runs first
    arrival: cython.Py_ssize_t  # among equal priorities, the earlier compute-task runs first
    resources: Optional[dict]  # what one execution of it holds
    dependencies: tuple  # WorkerTasks whose values it needs (while it is to compute)
    dependents: Optional[dict]  # unfinished tasks here that need its value -> None
    n_missing: cython.int  # while waiting: dependencies not in memory
    who_has: Optional[list]  # peers that may hold it, not tried yet
    failed: Optional[list]  # peers that did not give it
    coming_from: Optional[str]  # while in flight: the peer asked
    nbytes: cython.Py_ssize_t  # size of the value; -1 while unknown
    reported: cython.bint  # in memory, and the scheduler counts this worker as a holder
    acquire: cython.bint  # the scheduler asked for a copy here (acquire-replicas); unanswered
    executing: cython.bint  # an execution is handed to the executor; its outcome is due
    # Exactly while executing: the executor is to run its execution. An executor thread
    # reads it (a plain attribute, atomic under the GIL) to skip an execution cancelled
    # before it began; only the transitions into and out of executing set it.
    execution_wanted: cython.bint
    check: cython.bint  # the execution must show its result can be serialized

    if not cython.compiled:
        __slots__ = tuple(__annotations__)

    def __init__(self, key):
        self.key = key
        self.state = RELEASED
        self.run_spec = None
        self.priority = ()
        self.arrival = 0
        self.resources = None
        self.dependencies = _NO_TASKS
        self.dependents = None
        self.n_missing = 0
        self.who_has = None
        self.failed = None
        self.coming_from = None
        self.nbytes = -1
        self.reported = False
        self.acquire = False
        self.executing = False
        self.execution_wanted = False
        self.check = False

    def __repr__(self):
        return f"<WorkerTask {self.key!r} {self.state}>"


@cython.cfunc
def _check_who_has(who_has, what: str) -> None:
    """``{key: [address, ...]}`` with at least one holder each, or InvalidStimulus."""
    if type(who_has) is not dict:
        raise InvalidStimulus(f"{what}: who_has must be a dict, not {bounded_repr(who_has)}")
    for key, holders in who_has.items():
        _check_key(key, what)
        if not isinstance(holders, _SEQUENCE) or not holders or not all(
                [isinstance(h, str) for h in holders]):
            raise InvalidStimulus(f"{what}: the holders of {bounded_repr(key, 80)} must be a "
                                  f"non-empty list of addresses, not {bounded_repr(holders)}")


@cython.cfunc
def _as_priority(priority) -> tuple:
    """A priority as a tuple of numbers (lower runs first)."""
    if priority is None:
        return ()
    if type(priority) is int or type(priority) is float:
        priority = (priority,)
    if not isinstance(priority, _SEQUENCE) or len(priority) > 16:
        raise InvalidStimulus(f"priority must be a list of numbers, not "
                              f"{bounded_repr(priority)}")
    for part in priority:
        kind = type(part)
        if (kind is not int and kind is not float) or part != part:
            raise InvalidStimulus(f"priority must be a list of numbers, not "
                                  f"{bounded_repr(priority)}")
    return tuple(priority)


@cython.cfunc
def _is_plain_priority(priority: tuple) -> cython.bint:
    """A tuple of up to 16 ints (what the scheduler sends)."""
    if len(priority) > 16:
        return False
    for part in priority:
        if type(part) is not int:
            return False
    return True


@cython.cfunc
def _check_compute(msg) -> tuple:
    """Check one compute-task message; its parts ``(key, spec, priority, who_has,
    resources, stimulus_id)`` or InvalidStimulus."""
    if type(msg) is not dict:
        raise InvalidStimulus(f"compute-task must be a dict, not {bounded_repr(msg)}")
    if "key" not in msg:
        raise InvalidStimulus("compute-task without a key")
    key = msg["key"]
    _check_key(key, "compute-task")
    spec = msg.get("spec")
    priority = msg.get("priority")
    who_has = msg.get("who_has")
    resources = msg.get("resources")
    stimulus_id = msg.get("stimulus_id")
    if type(spec) is bytes and type(priority) is tuple and who_has is None \
            and resources is None and (stimulus_id is None or type(stimulus_id) is str) \
            and _is_plain_priority(priority):
        return key, spec, priority, None, None, stimulus_id  # the common case, quickly
    try:  # the error names the key; built only when there is one
        return _check_compute_fields(key, spec, priority, who_has, resources, stimulus_id)
    except InvalidStimulus as exc:
        raise InvalidStimulus(f"compute-task {bounded_repr(key, 80)}: {exc}") from None


@cython.cfunc
def _check_compute_fields(key, spec, priority, who_has, resources, stimulus_id) -> tuple:
    if not isinstance(spec, _BYTES):
        raise InvalidStimulus(f"spec must be bytes, not {bounded_repr(spec)}")
    priority = _as_priority(priority)
    if who_has is not None:
        if type(who_has) is not dict:
            raise InvalidStimulus(f"who_has must be a dict, not {bounded_repr(who_has)}")
        for dep, holders in who_has.items():
            _check_key(dep, "who_has")
            if dep == key:
                raise InvalidStimulus("it depends on itself")
            if not isinstance(holders, _SEQUENCE) or not all(
                    [isinstance(h, str) for h in holders]):
                raise InvalidStimulus(f"the holders of {bounded_repr(dep, 80)} must be a "
                                      f"list of addresses, not {bounded_repr(holders)}")
    resources = _check_resources(resources, "resources")
    if stimulus_id is not None and not isinstance(stimulus_id, str):
        raise InvalidStimulus(f"stimulus_id must be a str, not {bounded_repr(stimulus_id)}")
    return key, spec, priority, who_has or None, resources, stimulus_id


@cython.cfunc
def _check_steal(key, request) -> None:
    _check_key(key, "steal-request")
    if type(request) is not int:
        raise InvalidStimulus(f"steal-request: request must be an int, not "
                              f"{bounded_repr(request)}")


@cython.cfunc
def _check_nbytes(nbytes, what: str) -> None:
    if type(nbytes) is not int or not -1 <= nbytes <= _MAX_NBYTES:
        raise InvalidStimulus(f"{what}: nbytes must be an int from -1 to 2**62, not "
                              f"{bounded_repr(nbytes)}")


@cython.cfunc
def _check_report(report, op: str, key, what: str) -> None:
    if type(report) is not dict or report.get("op") != op or report.get("key") != key:
        raise InvalidStimulus(f"{what}: the report must be a {op!r} dict for "
                              f"{bounded_repr(key, 80)}, not {bounded_repr(report)}")


@cython.cfunc
def _check_outcome(outcome) -> None:
    """One outcome of ``executions_done``, or InvalidStimulus."""
    if type(outcome) is not tuple or len(outcome) != 4:
        raise InvalidStimulus(f"executions_done: an outcome must be a tuple (key, kind, "
                              f"value, report), not {bounded_repr(outcome)}")
    key, kind, value, report = outcome
    _check_key(key, "executions_done")
    if kind == FINISHED:
        _check_report(report, "task-finished", key, "executions_done")
        _check_nbytes(report.get("nbytes", -1), "executions_done")
    elif kind == ERRED:
        _check_report(report, "task-erred", key, "executions_done")
    elif kind != SKIPPED:
        raise InvalidStimulus(f"executions_done: the kind of an outcome must be 'finished', "
                              f"'erred' or 'skipped', not {bounded_repr(kind)}")


@cython.dataclasses.dataclass(init=False, repr=False, eq=False)
@cython.final
@cython.cclass
class WorkerCore:
    """All a worker knows about its tasks; changed only by stimuli.

    ``address`` is the worker's own address (a holder list naming it means the
    scheduler believes this worker holds a value it does not). ``nthreads`` and
    ``prefetch`` (default ``max(4 * nthreads, 64)``) bound how many executions are
    handed to the executor at once: the rest wait in the priority heap, so a late
    urgent task overtakes a long backlog. ``resources`` (``{name: quantity}``) limit
    which tasks run at the same time. ``max_fetch_attempts`` bounds how many holders
    are asked for one input before its tasks are given back to the scheduler.
    ``clock`` stamps the transition log; ``seed`` is where the turns among equally
    loaded holders start (give each worker its own, so they do not all ask the same
    holder first).
    """

    address: str
    nthreads: cython.Py_ssize_t
    prefetch: cython.Py_ssize_t
    tasks: dict
    ready: list  # heap of (priority, arrival, sequence, WorkerTask); stale entries are skipped
    n_ready: cython.Py_ssize_t  # tasks in state ready (the heap may hold stale entries)
    constrained: dict  # WorkerTask -> None: ready, waiting for resources, in arrival order
    data_needed: dict  # WorkerTask -> None: in state fetch, to plan
    in_flight: dict  # peer -> {WorkerTask: None} asked of it
    executing_tasks: dict  # WorkerTask -> None whose execution outcome is due
    total_resources: Optional[dict]
    available_resources: Optional[dict]
    paused: cython.bint
    cannot_travel: Optional[dict]  # key -> why its result could not be serialized
    max_fetch_attempts: cython.Py_ssize_t
    validate: cython.bint
    clock: object
    transition_counter: cython.Py_ssize_t
    max_transitions_per_stimulus: cython.Py_ssize_t
    _picks: cython.Py_ssize_t  # turns among equally loaded holders (starts at the seed)
    _sequence: cython.Py_ssize_t
    _log_entries: list
    _log_capacity: cython.Py_ssize_t
    _log_next: cython.Py_ssize_t
    _recording: cython.bint  # record_transitions is on
    _recorded: list  # flat: key, start, finish, stimulus_id, key, ...
    _recs: dict
    _instructions: list
    _reschedules: list  # reschedule messages of this stimulus: sent after the rest
    _acquired: list  # keys copied here on request in this stimulus (add-keys at its end)
    _not_acquired: list  # copies asked for that will not come (acquire-failed, at the end)
    _stimulus_id: str
    _now: object

    if not cython.compiled:
        __slots__ = tuple(__annotations__)

    def __init__(self, address: str = "", nthreads: int = 1, *, resources=None,
                 prefetch=None, max_fetch_attempts: int = 5, validate: bool = False,
                 transition_log_length: int = 10_000, clock=None,
                 max_transitions_per_stimulus=None, seed: int = 0):
        self.tasks = {}
        if not isinstance(address, str):
            raise ValueError(f"address must be a str, not {address!r}")
        if type(nthreads) is not int or nthreads < 1:
            raise ValueError(f"nthreads must be a positive int, not {nthreads!r}")
        if prefetch is None:
            prefetch = max(4 * nthreads, 64)
        if type(prefetch) is not int or prefetch < 1:
            raise ValueError(f"prefetch must be a positive int, not {prefetch!r}")
        if type(max_fetch_attempts) is not int or max_fetch_attempts < 1:
            raise ValueError(f"max_fetch_attempts must be a positive int, not "
                             f"{max_fetch_attempts!r}")
        if max_transitions_per_stimulus is not None and (
                type(max_transitions_per_stimulus) is not int
                or not 1 <= max_transitions_per_stimulus <= _INT64_MAX):
            raise ValueError("max_transitions_per_stimulus must be a positive int or None, "
                             f"not {max_transitions_per_stimulus!r}")
        try:
            resources = _check_resources(resources, "WorkerCore")
        except InvalidStimulus as exc:
            raise ValueError(str(exc)) from None
        self.address = address
        self.nthreads = nthreads
        self.prefetch = prefetch
        self.ready = []
        self.n_ready = 0
        self.constrained = {}
        self.data_needed = {}
        self.in_flight = {}
        self.executing_tasks = {}
        self.total_resources = resources
        self.available_resources = dict(resources) if resources is not None else None
        self.paused = False
        self.cannot_travel = None
        self.max_fetch_attempts = max_fetch_attempts
        self.validate = validate
        self.clock = clock if clock is not None else _zero_clock
        self.transition_counter = 0
        self.max_transitions_per_stimulus = max_transitions_per_stimulus or 0
        if type(seed) is not int:
            raise ValueError(f"seed must be an int, not {seed!r}")
        self._picks = seed & 0xFFFFFFFF
        self._sequence = 0
        self._log_entries = []
        self._log_capacity = transition_log_length
        self._log_next = 0
        self._recording = False
        self._recorded = []
        self._recs = {}
        self._instructions = []
        self._reschedules = []
        self._acquired = []
        self._not_acquired = []
        self._stimulus_id = ""
        self._now = 0.0

    def __repr__(self):
        return (f"<WorkerCore {self.address!r} tasks={len(self.tasks)} "
                f"executing={len(self.executing_tasks)}>")

    def __del__(self):
        # Tasks refer to each other (dependencies / dependents): cut the links.
        ts: WorkerTask
        if self.tasks is None:
            return
        for ts in self.tasks.values():
            ts.dependencies = _NO_TASKS
            ts.dependents = None

    # ------------------------------------------------------------------ stimuli
    #
    # Each stimulus first checks all of its input and raises InvalidStimulus before
    # _begin, so a refused call changes nothing. Only then does it change the state.

    def compute_tasks(self, msgs, stimulus_id) -> list:
        """The scheduler asks this worker to compute tasks: a list of compute-task
        messages ``{"key", "spec": bytes, "priority": [numbers], "who_has": {input key:
        [address, ...]}, "resources": {name: quantity}, "stimulus_id"?}`` (one frame's
        worth: their executions are handed out in priority order).

        A key held here is reported held (``ReportHeld``), not run again; a key whose
        execution is pending is not run twice (a cancelled one is adopted); a key whose
        result failed to travel before runs with ``check`` (its result must be shown
        serializable) and one still held is reported erred with the reason.
        """
        _check_str(stimulus_id, "stimulus_id")
        if not isinstance(msgs, _SEQUENCE):
            raise InvalidStimulus(f"compute_tasks: msgs must be a list, not "
                                  f"{bounded_repr(msgs)}")
        checked = [_check_compute(msg) for msg in msgs]
        self._begin(stimulus_id)
        for parts in checked:
            self._compute_task(parts)
        self._stimulus_id = stimulus_id
        return self._end()

    def free_keys(self, keys, stimulus_id) -> list:
        """The scheduler no longer wants these keys computed or held here. A value that
        a task here still needs stays as a copy until that task is done; an execution
        in progress is cancelled (its outcome discarded unless adopted again)."""
        _check_str(stimulus_id, "stimulus_id")
        _check_keys(keys, "free_keys")
        self._begin(stimulus_id)
        self._free_keys(keys)
        return self._end()

    def scheduler_messages(self, msgs, stimulus_id, begun=None) -> list:
        """One frame of the scheduler's stream: its compute-task and free-keys messages
        (docs/protocol.md), applied in order as one stimulus, so that the executions it
        starts are handed out in priority order and the inputs it needs are asked of
        each peer in one request. ``acquire-replicas`` and ``steal-request`` messages
        are taken too (``acquire_replicas``, ``steal_request``, with ``begun``). Any
        other op is refused (the shell handles ``close``)."""
        _check_str(stimulus_id, "stimulus_id")
        if not isinstance(msgs, _SEQUENCE):
            raise InvalidStimulus(f"scheduler_messages: msgs must be a list, not "
                                  f"{bounded_repr(msgs)}")
        checked = []
        for msg in msgs:
            op = msg.get("op") if type(msg) is dict else None
            if op == "compute-task":
                checked.append(_check_compute(msg))
            elif op == "free-keys" or op == "acquire-replicas":
                if op == "free-keys":
                    keys = msg.get("keys")
                    _check_keys(keys, "free-keys")
                else:
                    keys = msg.get("who_has")
                    _check_who_has(keys, "acquire-replicas")
                sid = msg.get("stimulus_id")
                checked.append((op, keys, sid if isinstance(sid, str) else None))
            elif op == "steal-request":
                _check_steal(msg.get("key"), msg.get("request"))
                sid = msg.get("stimulus_id")
                checked.append((op, (msg["key"], msg["request"]),
                                sid if isinstance(sid, str) else None))
            else:
                raise InvalidStimulus(f"scheduler_messages: not a compute-task, free-keys or "
                                      f"acquire-replicas message (nor a steal-request): "
                                      f"{bounded_repr(msg)}")
        self._begin(stimulus_id)
        for parts in checked:
            if len(parts) == 3:
                if parts[2] is not None:
                    self._stimulus_id = parts[2]
                if parts[0] == "free-keys":
                    self._free_keys(parts[1])
                elif parts[0] == "steal-request":
                    self._steal(parts[1][0], parts[1][1], begun)
                else:
                    self._acquire_copies(parts[1])
            else:
                self._compute_task(parts)
        self._stimulus_id = stimulus_id
        return self._end()

    def steal_request(self, key, request, stimulus_id, begun=None) -> list:
        """The scheduler would move ``key`` to another worker (work stealing): a task
        still to compute here that has not begun is given back, as if freed: one not
        handed to the executor (``waiting``, ``ready``, ``constrained``), or one handed
        out (``executing``) whose key is not in ``begun``, the keys whose executions the
        shell says began (None: every execution may have begun; the shell must not let
        one begin until this stimulus returns). A task that began, finished or is
        unknown is kept. Either way the answer is one ``{"op": "steal-response", "key",
        "request", "given": bool, "state"}`` (the task's state here when asked, None if
        unknown), so a task never runs on two workers and is never dropped by both."""
        _check_str(stimulus_id, "stimulus_id")
        _check_steal(key, request)
        self._begin(stimulus_id)
        self._steal(key, request, begun)
        return self._end()

    @cython.cfunc
    def _steal(self, key, request, begun) -> None:
        ts: WorkerTask = self.tasks.get(key)
        state = None if ts is None else ts.state
        given: cython.bint = ts is not None and ts.run_spec is not None and (
            state == WAITING or state == READY or state == CONSTRAINED
            or (state == EXECUTING and begun is not None and key not in begun))
        if given:
            self._free_keys((key,))
        self._instructions.append(SendMessage(
            {"op": "steal-response", "key": key, "request": request, "given": given,
             "state": state, "stimulus_id": self._stimulus_id}))

    @cython.cfunc
    def _free_keys(self, keys) -> None:
        ts: WorkerTask
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None:
                continue
            ts.run_spec = None
            ts.reported = False
            if ts.acquire:  # the scheduler no longer wants the copy it asked for
                ts.acquire = False
                self._not_acquired.append(key)
            state = ts.state
            if state == EXECUTING:
                self._transition(ts, CANCELLED)
            elif state in PENDING_STATES:
                if state != CANCELLED:
                    self._recs[ts] = RELEASED
            elif not self._needed(ts):
                self._recs[ts] = RELEASED

    def execute_success(self, key, value, report, stimulus_id) -> list:
        """An execution finished: ``value`` is the result, ``report`` the task-finished
        message built for it (``{"op": "task-finished", "key", "nbytes", ...}``).
        The result is kept (``StoreData``) if the task is still wanted or needed here."""
        return self.executions_done([(key, FINISHED, value, report)], stimulus_id)

    def execute_failure(self, key, report, stimulus_id) -> list:
        """An execution raised: ``report`` is the task-erred message built for it."""
        return self.executions_done([(key, ERRED, None, report)], stimulus_id)

    def execute_skipped(self, key, stimulus_id) -> list:
        """The executor skipped an execution because it was cancelled before it began.
        If a compute-task adopted it meanwhile, it runs again."""
        return self.executions_done([(key, SKIPPED, None, None)], stimulus_id)

    def executions_done(self, outcomes, stimulus_id) -> list:
        """A burst of execution outcomes, in the order they happened: each
        ``(key, "finished", value, task-finished report)``, ``(key, "erred", None,
        task-erred report)`` or ``(key, "skipped", None, None)``. One stimulus for the
        burst: the executions they make room for start in priority order."""
        _check_str(stimulus_id, "stimulus_id")
        if not isinstance(outcomes, _SEQUENCE):
            raise InvalidStimulus(f"executions_done: outcomes must be a list, not "
                                  f"{bounded_repr(outcomes)}")
        for outcome in outcomes:
            _check_outcome(outcome)
        self._begin(stimulus_id)
        ts: WorkerTask
        for key, kind, value, report in outcomes:
            ts = self._finish_execution(key)
            if ts is None:
                continue  # stale: no execution of it was due
            if kind == FINISHED:
                if ts.state == EXECUTING:
                    if ts.check and self.cannot_travel is not None:
                        self.cannot_travel.pop(key, None)  # it can travel after all
                    ts.run_spec = None
                    self._to_memory(ts, report.get("nbytes", -1), value)
                    ts.reported = True
                    self._instructions.append(_tuple_new(SendMessage, (report,)))
                elif self._needed(ts):
                    self._to_memory(ts, report.get("nbytes", -1), value)  # a copy for here
                else:
                    self._transition(ts, RELEASED)
            elif kind == ERRED:
                if ts.state == EXECUTING:
                    ts.run_spec = None
                    self._instructions.append(_tuple_new(SendMessage, (report,)))
                self._transition(ts, RELEASED)
            elif ts.state == EXECUTING:  # skipped, and adopted since: run it again
                self._transition(ts, WAITING)
            else:
                self._transition(ts, RELEASED)
        return self._end()

    def fetch_done(self, peer, data, missing, stimulus_id, nbytes=None, errors=None) -> list:
        """A peer answered a fetch: ``data`` maps keys to the values received,
        ``missing`` lists the keys it did not give (every key asked and not in
        ``data``), ``nbytes`` the sizes it reported, ``errors`` why a key could not be
        sent (e.g. its result cannot be serialized: remembered, so a recomputation
        here checks it). A missing key is asked of its next holder at once, or given
        back."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(peer, "fetch_done: peer")
        if type(data) is not dict:
            raise InvalidStimulus(f"fetch_done: data must be a dict, not {bounded_repr(data)}")
        for key in data:
            _check_key(key, "fetch_done")
        _check_keys(missing, "fetch_done")
        if nbytes is not None:
            if type(nbytes) is not dict:
                raise InvalidStimulus(f"fetch_done: nbytes must be a dict, not "
                                      f"{bounded_repr(nbytes)}")
            for size in nbytes.values():
                _check_nbytes(size, "fetch_done")
        self._check_errors(errors, "fetch_done")
        self._begin(stimulus_id)
        ts: WorkerTask
        for key, value in data.items():
            ts = self.tasks.get(key)
            if ts is None or ts.state != FLIGHT or ts.coming_from != peer:
                continue  # not asked of this peer (any more): not kept
            if self._needed(ts):
                self._to_memory(ts, nbytes.get(key, -1) if nbytes else -1, value)
            else:
                self._transition(ts, RELEASED)
        if errors:
            for key, text in errors.items():
                self._remember_cannot_travel(key, text)
        for key in missing:
            ts = self.tasks.get(key)
            if ts is not None and ts.state == FLIGHT and ts.coming_from == peer:
                self._flight_failed(ts)
        return self._end()

    def fetch_failed(self, peer, keys, stimulus_id) -> list:
        """A fetch from ``peer`` failed as a whole (unreachable, timed out, a broken
        answer): each key is asked of its next holder at once, or given back."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(peer, "fetch_failed: peer")
        _check_keys(keys, "fetch_failed")
        self._begin(stimulus_id)
        ts: WorkerTask
        for key in keys:
            ts = self.tasks.get(key)
            if ts is not None and ts.state == FLIGHT and ts.coming_from == peer:
                self._flight_failed(ts)
        return self._end()

    def peer_gone(self, peer, stimulus_id) -> list:
        """``peer`` is gone (it refused the connection): it is asked for nothing more,
        and whatever was asked of it counts as failed."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(peer, "peer_gone: peer")
        self._begin(stimulus_id)
        ts: WorkerTask
        for ts in self.tasks.values():
            if ts.who_has is not None and peer in ts.who_has:
                ts.who_has.remove(peer)
                if not ts.who_has:
                    ts.who_has = None
                self._add_failed(ts, peer)
        asked = self.in_flight.get(peer)
        if asked is not None:
            for ts in list(asked):
                self._flight_failed(ts)
        return self._end()

    def scheduler_lost(self, stimulus_id) -> list:
        """The connection to the scheduler is lost: drop every value and every task
        (the scheduler will count this worker as a new one). Executions in progress are
        cancelled, fetches in flight are discarded when they answer."""
        _check_str(stimulus_id, "stimulus_id")
        self._begin(stimulus_id)
        ts: WorkerTask
        for ts in list(self.tasks.values()):
            ts.run_spec = None
            ts.reported = False
            ts.acquire = False  # nobody left to answer
        for ts in list(self.tasks.values()):
            state = ts.state
            if state == EXECUTING or state == CANCELLED:
                self._transition(ts, CANCELLED)
                self._unlink_dependencies(ts)
            elif state in PENDING_STATES:
                self._transition(ts, RELEASED)
        for ts in list(self.tasks.values()):
            if ts.state == MEMORY or ts.state == FLIGHT or ts.state == FETCH:
                self._recs[ts] = RELEASED
        return self._end()

    def pause(self, stimulus_id) -> list:
        """Start no new executions and no new fetches (memory is short) until
        ``unpause``; executions and transfers under way go on."""
        _check_str(stimulus_id, "stimulus_id")
        self._begin(stimulus_id)
        self.paused = True
        return self._end()

    def unpause(self, stimulus_id) -> list:
        """Start executions and fetches again."""
        _check_str(stimulus_id, "stimulus_id")
        self._begin(stimulus_id)
        self.paused = False
        return self._end()

    def serve_failed(self, errors, stimulus_id) -> list:
        """This worker could not send values a peer asked for: ``errors`` maps each key
        to why (e.g. its result cannot be serialized). The values are dropped unless a
        task here still needs them, the scheduler no longer counts on them (the peer
        reports them missing), and a recomputation here checks its result first."""
        _check_str(stimulus_id, "stimulus_id")
        self._check_errors(errors, "serve_failed")
        self._begin(stimulus_id)
        ts: WorkerTask
        for key, text in errors.items():
            self._remember_cannot_travel(key, text)
            ts = self.tasks.get(key)
            if ts is not None and ts.state == MEMORY:
                ts.reported = False
                if not self._needed(ts):
                    self._recs[ts] = RELEASED
        return self._end()

    def data_put(self, data, stimulus_id, nbytes=None) -> list:
        """A client put values here (``put-data``, before it tells the scheduler): each
        is held, and counted as known to the scheduler."""
        _check_str(stimulus_id, "stimulus_id")
        if type(data) is not dict:
            raise InvalidStimulus(f"data_put: data must be a dict, not {bounded_repr(data)}")
        for key in data:
            _check_key(key, "data_put")
        if nbytes is not None:
            if type(nbytes) is not dict:
                raise InvalidStimulus(f"data_put: nbytes must be a dict, not "
                                      f"{bounded_repr(nbytes)}")
            for size in nbytes.values():
                _check_nbytes(size, "data_put")
        self._begin(stimulus_id)
        ts: WorkerTask
        for key, value in data.items():
            ts = self._task_of(key)
            ts.run_spec = None
            size = nbytes.get(key, -1) if nbytes else -1
            if ts.state == MEMORY:
                ts.nbytes = size
                self._instructions.append(_tuple_new(StoreData, (key, value)))
            else:
                self._to_memory(ts, size, value)
            ts.reported = True
        return self._end()

    def acquire_replicas(self, who_has, stimulus_id) -> list:
        """The scheduler asks this worker to hold a copy of each key, fetched from the
        holders named: ``who_has`` is ``{key: [address, ...]}`` (its ``acquire-replicas``).

        Each key is answered once: ``{"op": "add-keys", "keys"}`` once the value is held
        here (a value already held is answered at once), ``{"op": "acquire-failed",
        "keys"}`` if no holder gave it (after a ``missing-data`` for each holder that
        failed) or the scheduler freed the key first. A key this worker is computing is
        answered when its execution is done."""
        _check_str(stimulus_id, "stimulus_id")
        _check_who_has(who_has, "acquire_replicas")
        self._begin(stimulus_id)
        self._acquire_copies(who_has)
        return self._end()

    # ------------------------------------------------------------------ stimulus parts

    @cython.cfunc
    def _acquire_copies(self, who_has: dict) -> None:
        ts: WorkerTask
        for key, holders in who_has.items():
            ts = self._task_of(key)
            if ts.state == MEMORY:
                ts.reported = True
                self._acquired.append(key)
                continue
            ts.acquire = True
            self._merge_holders(ts, holders)
            if ts.state == RELEASED:
                self._transition(ts, FETCH)

    @cython.cfunc
    def _compute_task(self, parts: tuple) -> None:
        key, spec, priority, who_has, resources, task_sid = parts
        if task_sid is not None:
            self._stimulus_id = task_sid  # the scheduler's cause, for the story
        ts: WorkerTask = self.tasks.get(key)
        if ts is None:
            ts = WorkerTask(key)
            self.tasks[key] = ts
        state = ts.state
        if state == MEMORY:
            text = self.cannot_travel.get(key) if self.cannot_travel is not None else None
            if text is not None:
                self._instructions.append(SendMessage(
                    {"op": "task-erred", "key": key, "exception": None, "traceback": None,
                     "text": text}))
            else:
                ts.reported = True
                self._instructions.append(_tuple_new(ReportHeld, (key,)))
            return
        if state == CANCELLED:
            ts.run_spec = spec
            if not ts.dependencies and who_has:  # dropped with everything else
                self._link_dependencies(ts, who_has)
                for dep in ts.dependencies:
                    if dep.state == RELEASED:
                        self._recs[dep] = FETCH
            elif who_has:
                self._add_holders(ts, who_has)
            self._transition(ts, EXECUTING)  # adopt the execution in progress
            return
        if state in PENDING_STATES:
            if ts.run_spec is None:  # freed earlier in this stimulus: wanted again
                ts.run_spec = spec
                self._recs.pop(ts, None)
            if who_has:
                self._add_holders(ts, who_has)
            return
        # released, fetch or flight: it is to be computed here now
        if state != RELEASED:
            self._transition(ts, RELEASED)
        ts.run_spec = spec
        ts.priority = priority
        self._sequence += 1
        ts.arrival = self._sequence
        ts.resources = resources
        if who_has:
            self._link_dependencies(ts, who_has)
        self._recs.pop(ts, None)
        self._transition(ts, WAITING)

    @cython.cfunc
    def _task_of(self, key) -> WorkerTask:
        """The task of ``key``, made (released) if there is none."""
        ts: WorkerTask = self.tasks.get(key)
        if ts is None:
            ts = WorkerTask(key)
            self.tasks[key] = ts
        return ts

    @cython.cfunc
    def _link_dependencies(self, ts: WorkerTask, who_has: dict) -> None:
        dep: WorkerTask
        deps = []
        for dep_key, holders in who_has.items():
            dep = self.tasks.get(dep_key)
            if dep is None:
                dep = WorkerTask(dep_key)
                self.tasks[dep_key] = dep
            self._merge_holders(dep, holders)
            if dep.dependents is None:
                dep.dependents = {ts: None}
            else:
                dep.dependents[ts] = None
            deps.append(dep)
        ts.dependencies = tuple(deps)

    @cython.cfunc
    def _add_holders(self, ts: WorkerTask, who_has: dict) -> None:
        dep: WorkerTask
        for dep in ts.dependencies:
            holders = who_has.get(dep.key)
            if holders:
                self._merge_holders(dep, holders)

    @cython.cfunc
    def _merge_holders(self, dep: WorkerTask, holders) -> None:
        """Remember the holders of ``dep`` not tried yet (this worker never counts)."""
        if dep.state == MEMORY:
            return
        for holder in holders:
            if holder == self.address:
                self._add_failed(dep, holder)  # the scheduler thinks it is here; it is not
            elif (dep.failed is None or holder not in dep.failed) and holder != dep.coming_from:
                if dep.who_has is None:
                    dep.who_has = [holder]
                elif holder not in dep.who_has:
                    dep.who_has.append(holder)

    @cython.cfunc
    def _add_failed(self, ts: WorkerTask, peer: str) -> None:
        if ts.failed is None:
            ts.failed = [peer]
        elif peer not in ts.failed:
            ts.failed.append(peer)

    @cython.cfunc
    def _finish_execution(self, key) -> WorkerTask:
        """The execution of ``key`` is over: free its slot and resources. Its task, or
        None if no execution of ``key`` was due (a stale outcome)."""
        ts: WorkerTask = self.tasks.get(key)
        if ts is None or not ts.executing:
            return None
        ts.executing = False
        del self.executing_tasks[ts]
        if ts.resources is not None and self.available_resources is not None:
            available = self.available_resources
            for name, quantity in ts.resources.items():
                available[name] = available.get(name, 0) + quantity
            self._unconstrain()
        if ts.state == EXECUTING or ts.state == CANCELLED:
            return ts
        if not self._needed(ts):
            self._recs[ts] = RELEASED  # e.g. put in memory by a client, then freed
        return None

    @cython.cfunc
    def _flight_failed(self, ts: WorkerTask) -> None:
        peer = ts.coming_from
        self._add_failed(ts, peer)
        self._transition(ts, FETCH if self._needed(ts) else RELEASED)

    @cython.cfunc
    def _check_errors(self, errors, what: str) -> None:
        if errors is None:
            return
        if type(errors) is not dict:
            raise InvalidStimulus(f"{what}: errors must be a dict, not {bounded_repr(errors)}")
        for key, text in errors.items():
            _check_key(key, what)
            if not isinstance(text, str):
                raise InvalidStimulus(f"{what}: the error of {bounded_repr(key, 80)} must be "
                                      f"a str, not {bounded_repr(text)}")

    @cython.cfunc
    def _remember_cannot_travel(self, key, text: str) -> None:
        if self.cannot_travel is None:
            self.cannot_travel = {}
        remembered = self.cannot_travel
        remembered.pop(key, None)
        remembered[key] = text
        if len(remembered) > CANNOT_TRAVEL_MEMORY:
            del remembered[next(iter(remembered))]

    # ------------------------------------------------------------------ queries

    @property
    def transition_log(self) -> list:
        """The latest transitions, oldest first: ``(key, start, finish, stimulus_id, time)``."""
        flat = self._log_entries
        entries = [tuple(flat[i:i + _LOG_FIELDS]) for i in range(0, len(flat), _LOG_FIELDS)]
        return entries[self._log_next:] + entries[:self._log_next]

    def record_transitions(self, on: bool) -> None:
        """Start (True) or stop recording every transition for `take_transitions`: what a
        server turns on while a plugin wants to be told of transitions. Unlike the
        bounded `transition_log`, nothing is dropped; stopping discards what was not
        taken."""
        self._recording = bool(on)
        self._recorded = []

    def take_transitions(self) -> list:
        """The transitions recorded since the last call, oldest first: ``(key, start,
        finish, stimulus_id)`` each (none unless `record_transitions` is on)."""
        flat = self._recorded
        self._recorded = []
        return [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]

    def story(self, *keys) -> list:
        """The logged transitions of these keys: ``(key, start, finish, stimulus_id, time)``."""
        wanted = set(keys)
        return [entry for entry in self.transition_log if entry[0] in wanted]

    def task_counts(self) -> dict:
        """How many tasks are in each state."""
        counts = dict.fromkeys(WORKER_TASK_STATES[:-1], 0)
        ts: WorkerTask
        for ts in self.tasks.values():
            counts[ts.state] += 1
        return counts

    @property
    def n_executing(self) -> int:
        """Executions handed to the executor whose outcome is due."""
        return len(self.executing_tasks)

    # ------------------------------------------------------------------ engine

    @cython.cfunc
    def _begin(self, stimulus_id: str) -> None:
        self._stimulus_id = stimulus_id
        self._now = self.clock()

    @cython.cfunc
    def _end(self) -> list:
        recs = self._recs
        ts: WorkerTask
        n: cython.Py_ssize_t = 0
        limit: cython.Py_ssize_t = self.max_transitions_per_stimulus
        if limit <= 0:
            limit = _TRANSITIONS_PER_TASK_LIMIT * (len(self.tasks) + 1) + _TRANSITIONS_LIMIT_BASE
        while True:
            while recs:
                ts, finish = recs.popitem()
                n += 1
                if n > limit:
                    self._runaway(ts, finish, limit)
                state = ts.state
                if state == RELEASED:
                    # released is transient: where it goes follows from what needs it
                    # now, which a later recommendation may have changed
                    finish = self._next_state(ts)
                elif finish == RELEASED and (state == MEMORY or state == FLIGHT) \
                        and self._needed(ts):
                    continue  # needed again since it was recommended
                self._transition(ts, finish)
            if self.data_needed and not self.paused:  # paused: memory is short
                self._plan_fetches()
            if recs:
                continue  # given-back tasks released their inputs
            if self.ready and not self.paused and len(self.executing_tasks) < self.prefetch:
                self._feed()
            if not recs:
                break
        if self._acquired:
            self._answer_acquired()
        if self._reschedules:
            # After every missing-data of the stimulus: the scheduler accepts a worker's
            # missing-data only while a task there needs the key, which a reschedule
            # ends.
            self._instructions.extend(self._reschedules)
            self._reschedules = []
        if self._not_acquired:  # last, for the same reason as the reschedules
            self._instructions.append(SendMessage(
                {"op": "acquire-failed", "keys": self._not_acquired,
                 "stimulus_id": self._stimulus_id}))
            self._not_acquired = []
        if self.validate:
            self.validate_state()
        result = self._instructions
        self._instructions = []
        return result

    @cython.cfunc
    def _answer_acquired(self) -> None:
        """``add-keys`` for the copies that arrived in this stimulus and are still held;
        ``acquire-failed`` for those that left memory again before its end."""
        ts: WorkerTask
        held = []
        for key in self._acquired:
            ts = self.tasks.get(key)
            if ts is not None and ts.state == MEMORY and ts.reported:
                held.append(key)
            else:
                self._not_acquired.append(key)
        self._acquired = []
        if held:
            self._instructions.append(SendMessage(
                {"op": "add-keys", "keys": held, "stimulus_id": self._stimulus_id}))

    @cython.cfunc
    def _runaway(self, ts: WorkerTask, finish: str, limit: cython.Py_ssize_t) -> None:
        pending = len(self._recs)
        self._recs.clear()
        sid = self._stimulus_id
        recent = [f"{bounded_repr(key, 60)}: {start} -> {end}"
                  for key, start, end, stimulus_id, _ in self.transition_log[-5:]
                  if stimulus_id == sid]
        raise TransitionLimitExceeded(
            f"stimulus {bounded_repr(sid)} ran more than {limit} transitions (a "
            f"recommendation loop): next {bounded_repr(ts.key, 60)}: {ts.state} -> {finish}; "
            f"last transitions {recent}; {pending} more pending recommendations dropped")

    @cython.cfunc
    def _transition(self, ts: WorkerTask, finish: str) -> None:
        start: str = ts.state
        if start == FORGOTTEN or start == finish:
            return
        row: dict = _DISPATCH[start]
        func = row.get(finish)
        if func is not None:
            func(self, ts)
            self._log(ts, start)
        else:
            to_released = row.get(RELEASED)
            from_released = _DISPATCH[RELEASED].get(finish)
            if to_released is None or from_released is None:
                raise InvalidTransition(f"{ts.key!r}: no transition {start} -> {finish}")
            to_released(self, ts)
            self._log(ts, start)
            if ts.state == RELEASED:
                self._recs.pop(ts, None)  # the settling recommendation: going on now
                from_released(self, ts)
                self._log(ts, RELEASED)
        if self.validate:
            self._validate_task(ts)

    @cython.cfunc
    def _log(self, ts: WorkerTask, start: str) -> None:
        if ts.state != start:
            self.transition_counter += 1
            if self._recording:
                self._recorded.extend((ts.key, start, ts.state, self._stimulus_id))
            if self._log_capacity <= 0:
                return
            log = self._log_entries
            i: cython.Py_ssize_t = self._log_next * 5  # _LOG_FIELDS, as a C constant
            if i == len(log):
                log.extend((ts.key, start, ts.state, self._stimulus_id, self._now))
            else:
                log[i] = ts.key
                log[i + 1] = start
                log[i + 2] = ts.state
                log[i + 3] = self._stimulus_id
                log[i + 4] = self._now
            self._log_next = (self._log_next + 1) % self._log_capacity

    @cython.cfunc
    def _feed(self) -> None:
        """Hand the most urgent ready tasks to the executor, up to ``prefetch``."""
        ready = self.ready
        ts: WorkerTask
        while ready and len(self.executing_tasks) < self.prefetch:
            ts = heapq.heappop(ready)[3]
            if ts.state != READY:
                continue  # freed or handed out since it was pushed
            if ts.resources is not None and not self._acquire(ts.resources):
                self._transition(ts, CONSTRAINED)
                continue
            self._transition_ready_executing(ts)  # the hot path: no table lookup
            self._log(ts, READY)
            if self.validate:
                self._validate_task(ts)

    @cython.cfunc
    def _acquire(self, resources: dict) -> cython.bint:
        available = self.available_resources
        if available is None:
            return False
        for name, quantity in resources.items():
            if available.get(name, 0) < quantity:
                return False
        for name, quantity in resources.items():
            available[name] -= quantity
        return True

    @cython.cfunc
    def _unconstrain(self) -> None:
        """Resources were freed: constrained tasks go back to the heap (the feed holds
        back those still not covered)."""
        ts: WorkerTask
        if self.constrained:
            for ts in list(self.constrained):
                self._transition(ts, READY)

    @cython.cfunc
    def _plan_fetches(self) -> None:
        """Ask one holder for each input to fetch: one request per peer."""
        by_peer: dict = {}
        ts: WorkerTask
        for ts in list(self.data_needed):
            if ts.state != FETCH:
                continue
            if not self._needed(ts):  # let go of by a give-up earlier in this loop
                if ts.failed is not None:
                    self._give_up(ts)  # the holders that failed are still reported
                continue
            peer = self._pick_holder(ts, by_peer)
            if peer is None:
                self._give_up(ts)
                continue
            ts.who_has.remove(peer)
            if not ts.who_has:
                ts.who_has = None
            ts.coming_from = peer
            self._transition(ts, FLIGHT)
            keys = by_peer.get(peer)
            if keys is None:
                by_peer[peer] = [ts.key]
            else:
                keys.append(ts.key)
        for peer, keys in by_peer.items():
            self._instructions.append(Fetch(peer, keys))

    @cython.cfunc
    def _pick_holder(self, ts: WorkerTask, chosen: dict) -> object:
        """A holder already asked in this burst (fewer requests), else one of the least
        loaded (taken in turn); None when no holder is left or too many failed."""
        holders = ts.who_has
        if holders is None:
            return None
        if ts.failed is not None and len(ts.failed) >= self.max_fetch_attempts:
            return None
        for peer in holders:
            if peer in chosen:
                return peer
        best = []
        least: cython.Py_ssize_t = -1
        load: cython.Py_ssize_t
        for peer in holders:
            asked = self.in_flight.get(peer)
            load = 0 if asked is None else len(asked)
            if least < 0 or load < least:
                least = load
                best = [peer]
            elif load == least:
                best.append(peer)
        if len(best) == 1:
            return best[0]
        self._picks += 1  # in turn: workers with other seeds start elsewhere
        return best[self._picks % len(best)]

    @cython.cfunc
    def _give_up(self, ts: WorkerTask) -> None:
        """No holder gave an input: tell the scheduler which ones failed, and give the
        tasks that need it back (``missing-data`` for each; the ``reschedule`` messages go
        out at the end of the stimulus, after every ``missing-data``). A ``missing-data``
        goes even when nothing here wants the key any more: it may be an input of a task
        given back earlier in this stimulus, which the scheduler still accepts; else the
        scheduler refuses it, which harms nothing.

        A dependent is waiting, or its execution is in progress: one adopted after the
        scheduler was lost fetches its inputs again, in case the executor skips it (the
        worker cannot tell whether it will). Such a task lets go of its inputs and is
        cancelled; if it was still wanted it is given back too, and its outcome is kept
        only if a compute-task adopts it again."""
        dts: WorkerTask
        if ts.failed is not None:
            for errant in ts.failed:
                self._instructions.append(SendMessage(
                    {"op": "missing-data", "key": ts.key, "errant_worker": errant}))
        if ts.acquire:
            ts.acquire = False
            self._not_acquired.append(ts.key)
        if ts.dependents is not None:
            for dts in list(ts.dependents):
                if dts.run_spec is not None:
                    self._reschedules.append(
                        SendMessage({"op": "reschedule", "key": dts.key}))
                    dts.run_spec = None
                if dts.executing:
                    if dts.state == EXECUTING:
                        self._transition(dts, CANCELLED)
                    self._unlink_dependencies(dts)
                else:
                    self._transition(dts, RELEASED)
        if ts.state == FETCH:
            self._transition(ts, RELEASED)

    # ------------------------------------------------------------------ helpers

    @cython.cfunc
    def _needed(self, ts: WorkerTask) -> cython.bint:
        """Whether anything keeps ``ts``: the scheduler's wish to compute it here, its
        count on the value held here, or a task here that needs the value."""
        return (ts.run_spec is not None or ts.reported or ts.dependents is not None
                or ts.acquire)

    @cython.cfunc
    def _next_state(self, ts: WorkerTask) -> str:
        """Where a released task goes next."""
        if ts.executing:
            return EXECUTING if ts.run_spec is not None else CANCELLED
        if ts.run_spec is not None:
            return WAITING
        if ts.dependents is not None or ts.acquire:
            return FETCH
        return FORGOTTEN

    @cython.cfunc
    def _settle(self, ts: WorkerTask) -> None:
        """Recommend where a released task goes next."""
        self._recs[ts] = self._next_state(ts)

    @cython.cfunc
    def _unlink_dependencies(self, ts: WorkerTask) -> None:
        """``ts`` no longer needs its inputs: inputs nobody needs any more go."""
        dep: WorkerTask
        for dep in ts.dependencies:
            if dep.dependents is not None:
                dep.dependents.pop(ts, None)
                if not dep.dependents:
                    dep.dependents = None
                    if not self._needed(dep) and dep.state not in PENDING_STATES:
                        self._recs[dep] = RELEASED
        ts.dependencies = _NO_TASKS
        ts.n_missing = 0

    @cython.cfunc
    def _to_memory(self, ts: WorkerTask, nbytes: cython.Py_ssize_t, value) -> None:
        """Put ``value`` in memory as the value of ``ts``, from any state."""
        dts: WorkerTask
        start: str = ts.state
        if start == READY or start == WAITING or start == EXECUTING or start == CANCELLED:
            self._unlink_dependencies(ts)
        elif start == CONSTRAINED:
            del self.constrained[ts]
            self._unlink_dependencies(ts)
        if start == READY:
            self._leave_ready()
        elif start == FETCH:
            del self.data_needed[ts]
        elif start == FLIGHT:
            self._leave_flight(ts)
        self._recs.pop(ts, None)
        ts.state = MEMORY
        ts.execution_wanted = False
        ts.nbytes = nbytes
        ts.who_has = None
        ts.failed = None
        ts.check = False
        if ts.acquire:  # the copy the scheduler asked for: it counts on it from now on
            ts.acquire = False
            ts.reported = True
            self._acquired.append(ts.key)
        self._instructions.append(_tuple_new(StoreData, (ts.key, value)))
        if ts.dependents is not None:
            for dts in ts.dependents:
                if dts.state == WAITING:
                    dts.n_missing -= 1
                    if dts.n_missing == 0:
                        self._recs[dts] = READY
        self._log(ts, start)
        if self.validate:
            self._validate_task(ts)

    @cython.cfunc
    def _leave_flight(self, ts: WorkerTask) -> None:
        peer = ts.coming_from
        asked: dict = self.in_flight[peer]
        del asked[ts]
        if not asked:
            del self.in_flight[peer]
        ts.coming_from = None

    @cython.cfunc
    def _push_ready(self, ts: WorkerTask) -> None:
        ts.state = READY
        self.n_ready += 1
        self._sequence += 1
        heapq.heappush(self.ready, (ts.priority, ts.arrival, self._sequence, ts))

    @cython.cfunc
    def _leave_ready(self) -> None:
        """A task left state ready; its heap entry stays, unless stale ones pile up
        (many ready tasks freed at once): then the heap is rebuilt without them."""
        self.n_ready -= 1
        if len(self.ready) > 2 * self.n_ready + 64:
            self.ready = [entry for entry in self.ready if entry[3].state == READY]
            heapq.heapify(self.ready)

    # ------------------------------------------------------------------ transitions

    def _transition_released_waiting(self, ts: WorkerTask) -> None:
        self._rewait(ts)

    @cython.cfunc
    def _rewait(self, ts: WorkerTask) -> None:
        """Ready at once if every input is in memory; else wait for the others, and
        fetch those nothing here produces."""
        dep: WorkerTask
        n: cython.int = 0
        for dep in ts.dependencies:
            if dep.state != MEMORY:
                n += 1
        ts.n_missing = n
        if n == 0:
            self._push_ready(ts)
            return
        ts.state = WAITING
        for dep in ts.dependencies:
            if dep.state == RELEASED:  # nothing here produces it: fetch it now
                self._recs.pop(dep, None)
                self._transition(dep, self._next_state(dep))

    def _transition_released_fetch(self, ts: WorkerTask) -> None:
        ts.state = FETCH
        self.data_needed[ts] = None

    def _transition_released_executing(self, ts: WorkerTask) -> None:
        ts.state = EXECUTING
        ts.execution_wanted = True

    def _transition_released_cancelled(self, ts: WorkerTask) -> None:
        ts.state = CANCELLED

    def _transition_released_forgotten(self, ts: WorkerTask) -> None:
        ts.state = FORGOTTEN
        ts.who_has = None
        ts.failed = None
        ts.dependencies = _NO_TASKS
        ts.dependents = None
        del self.tasks[ts.key]

    def _transition_waiting_ready(self, ts: WorkerTask) -> None:
        self._push_ready(ts)

    def _transition_waiting_released(self, ts: WorkerTask) -> None:
        self._unlink_dependencies(ts)
        ts.state = RELEASED
        self._settle(ts)

    def _transition_ready_executing(self, ts: WorkerTask) -> None:
        self.n_ready -= 1  # popped: its entry is gone
        ts.state = EXECUTING
        ts.execution_wanted = True
        ts.executing = True
        self.executing_tasks[ts] = None
        ts.check = self.cannot_travel is not None and ts.key in self.cannot_travel
        self._instructions.append(_tuple_new(Execute, (ts.key,)))

    def _transition_ready_waiting(self, ts: WorkerTask) -> None:
        """An input left memory (only when everything is dropped)."""
        self._leave_ready()
        self._rewait(ts)

    def _transition_ready_constrained(self, ts: WorkerTask) -> None:
        self.n_ready -= 1  # popped: its entry is gone
        ts.state = CONSTRAINED
        self.constrained[ts] = None

    def _transition_ready_released(self, ts: WorkerTask) -> None:
        self._leave_ready()  # its heap entry stays; the feed skips it
        self._unlink_dependencies(ts)
        ts.state = RELEASED
        self._settle(ts)

    def _transition_constrained_ready(self, ts: WorkerTask) -> None:
        del self.constrained[ts]
        self._push_ready(ts)

    def _transition_constrained_waiting(self, ts: WorkerTask) -> None:
        del self.constrained[ts]
        self._rewait(ts)

    def _transition_constrained_released(self, ts: WorkerTask) -> None:
        del self.constrained[ts]
        self._unlink_dependencies(ts)
        ts.state = RELEASED
        self._settle(ts)

    def _transition_executing_cancelled(self, ts: WorkerTask) -> None:
        # Its inputs stay until the outcome: if a compute-task adopts the execution and
        # the executor had skipped it, it runs again with them.
        ts.state = CANCELLED
        ts.execution_wanted = False

    def _transition_executing_waiting(self, ts: WorkerTask) -> None:
        """Its execution was skipped (cancelled, then adopted): it runs again."""
        ts.execution_wanted = False
        self._rewait(ts)

    def _transition_executing_released(self, ts: WorkerTask) -> None:
        self._unlink_dependencies(ts)
        ts.state = RELEASED
        ts.execution_wanted = False
        self._settle(ts)

    def _transition_cancelled_executing(self, ts: WorkerTask) -> None:
        ts.state = EXECUTING
        ts.execution_wanted = True

    def _transition_cancelled_released(self, ts: WorkerTask) -> None:
        self._unlink_dependencies(ts)
        ts.state = RELEASED
        self._settle(ts)

    def _transition_fetch_flight(self, ts: WorkerTask) -> None:
        del self.data_needed[ts]
        ts.state = FLIGHT
        asked = self.in_flight.get(ts.coming_from)
        if asked is None:
            self.in_flight[ts.coming_from] = {ts: None}
        else:
            asked[ts] = None

    def _transition_fetch_released(self, ts: WorkerTask) -> None:
        del self.data_needed[ts]
        ts.state = RELEASED
        self._settle(ts)

    def _transition_flight_fetch(self, ts: WorkerTask) -> None:
        """Its peer did not give it: plan it again at once (another holder, or give up)."""
        self._leave_flight(ts)
        ts.state = FETCH
        self.data_needed[ts] = None

    def _transition_flight_released(self, ts: WorkerTask) -> None:
        self._leave_flight(ts)
        ts.state = RELEASED
        self._settle(ts)

    def _transition_memory_released(self, ts: WorkerTask) -> None:
        dts: WorkerTask
        self._instructions.append(_tuple_new(ReleaseData, (ts.key,)))
        ts.state = RELEASED
        ts.reported = False
        ts.nbytes = -1
        if ts.dependents is not None:
            for dts in ts.dependents:
                if dts.state == WAITING:
                    dts.n_missing += 1
                elif dts.state == READY or dts.state == CONSTRAINED:
                    self._recs[dts] = WAITING  # counts its inputs again
        self._settle(ts)

    # ------------------------------------------------------------------ validation

    def validate_state(self) -> None:
        """Check every invariant of the whole state; raise InvariantError if one fails."""
        ts: WorkerTask
        for key, ts in self.tasks.items():
            _check(ts.key == key, f"{key!r} is stored as {ts.key!r}")
            self._validate_task(ts)
            self._validate_settled(ts)
        in_heap = {entry[3] for entry in self.ready if entry[3].state == READY}
        n_ready = 0
        for ts in self.tasks.values():
            if ts.state == READY:
                n_ready += 1
        _check(len(in_heap) == n_ready, "a ready task is missing from the heap")
        _check(self.n_ready == n_ready, f"{self.n_ready} counted ready, {n_ready} are")
        if n_ready and not self.paused:
            _check(len(self.executing_tasks) >= self.prefetch,
                   f"{n_ready} tasks are ready while the executor has room")
        for ts in self.constrained:
            _check(ts.state == CONSTRAINED, f"{ts} is listed as constrained")
        for ts in self.data_needed:
            _check(ts.state == FETCH, f"{ts} is listed as to fetch")
        _check(not self.data_needed or self.paused, "fetches were left unplanned")
        n_flight = 0
        for peer, asked in self.in_flight.items():
            _check(len(asked) > 0, f"an empty in-flight entry for {peer}")
            for ts in asked:
                _check(ts.state == FLIGHT and ts.coming_from == peer,
                       f"{ts} is listed in flight from {peer}")
                n_flight += 1
        _check(n_flight == len([t for t in self.tasks.values() if t.state == FLIGHT]),
               "a task in flight is not listed")
        for ts in self.executing_tasks:
            _check(ts.executing and self.tasks.get(ts.key) is ts,
                   f"{ts} is listed as executing")
        _check(len(self.executing_tasks) == len(
            [t for t in self.tasks.values() if t.executing]), "an execution is not listed")
        if self.total_resources is not None:
            used = dict.fromkeys(self.total_resources, 0)
            for ts in self.executing_tasks:
                if ts.resources is not None:
                    for name, quantity in ts.resources.items():
                        used[name] = used.get(name, 0) + quantity
            for name, total in self.total_resources.items():
                free = self.available_resources.get(name, 0)
                _check(abs(free + used[name] - total) < 1e-9,
                       f"resource {name}: {free} free + {used[name]} used != {total}")

    @cython.cfunc
    def _validate_settled(self, ts: WorkerTask) -> None:
        """Between stimuli nothing is kept that nobody needs, and nothing waits for a
        value that is not on its way."""
        state = ts.state
        _check(state != RELEASED, f"{ts} was left released")
        if state == CANCELLED:
            _check(ts.executing, f"{ts} is cancelled but not executing")
        else:
            _check(self._needed(ts), f"{ts} is {state} but nothing needs it")
        if state == WAITING:
            _check(ts.n_missing > 0, f"{ts} is waiting on nothing")

    @cython.cfunc
    def _validate_task(self, ts: WorkerTask) -> None:
        dep: WorkerTask
        dts: WorkerTask
        state = ts.state
        if state == FORGOTTEN:
            _check(self.tasks.get(ts.key) is not ts, f"{ts} is forgotten but still stored")
            _check(not ts.executing, f"{ts} is forgotten while its execution is due")
            return
        _check(self.tasks.get(ts.key) is ts, f"{ts} is not stored under its key")
        pending: cython.bint = state in PENDING_STATES
        if pending:
            for dep in ts.dependencies:
                _check(dep.state != FORGOTTEN, f"{ts} depends on forgotten {dep}")
                _check(dep.dependents is not None and ts in dep.dependents,
                       f"{ts} missing from the dependents of {dep}")
        else:
            _check(not ts.dependencies, f"{ts} is {state} and still lists dependencies")
        if ts.dependents is not None:
            _check(len(ts.dependents) > 0, f"{ts} has an empty dependents dict")
            for dts in ts.dependents:
                _check(ts in dts.dependencies, f"{dts} is a dependent of {ts} but not inverse")
                _check(dts.state in PENDING_STATES, f"{ts} lists finished dependent {dts}")
        if state == WAITING or state == READY or state == CONSTRAINED:
            _check(ts.run_spec is not None, f"{ts} is {state} without a run spec")
            n = len([dep for dep in ts.dependencies if dep.state != MEMORY])
            _check(ts.n_missing == n, f"{ts} misses {ts.n_missing} inputs, {n} are missing")
            if state != WAITING:
                _check(n == 0, f"{ts} is {state} without all its inputs")
            if state == CONSTRAINED:
                _check(ts in self.constrained, f"{ts} is constrained but not listed")
        if state == EXECUTING:
            _check(ts.executing and ts.run_spec is not None, f"{ts} executing inconsistently")
        _check(ts.execution_wanted == (state == EXECUTING),
               f"{ts}: execution_wanted is {ts.execution_wanted} while {state}")
        if state == CANCELLED:
            _check(ts.run_spec is None, f"{ts} is cancelled but wanted")
        if state == EXECUTING or state == CANCELLED:
            _check(ts in self.executing_tasks, f"{ts} is not listed as executing")
        if state == FETCH:
            _check(ts in self.data_needed, f"{ts} is to fetch but not listed")
            _check(ts.run_spec is None, f"{ts} is fetched although it is to compute here")
        if state == FLIGHT:
            _check(ts.coming_from is not None, f"{ts} in flight from nobody")
            _check(ts in self.in_flight.get(ts.coming_from, ()), f"{ts} in flight, unlisted")
            _check(ts.run_spec is None, f"{ts} is fetched although it is to compute here")
        else:
            _check(ts.coming_from is None, f"{ts} is {state} but coming from a peer")
        if ts.acquire:
            _check(state != MEMORY, f"{ts} is held and still to acquire")
        if state == MEMORY:
            _check(ts.run_spec is None, f"{ts} is in memory and still to compute")
            _check(ts.who_has is None and ts.failed is None,
                   f"{ts} is in memory with holders to try")
        else:
            _check(not ts.reported, f"{ts} is reported held while {state}")


#: The engine's dispatch, built from ``_TRANSITIONS``: ``_DISPATCH[start][finish]`` is the
#: method of that move (a name in the table without its method fails here, at import).
_DISPATCH = {start: {finish: getattr(WorkerCore, f"_transition_{start}_{finish}")
                     for finish in finishes}
             for start, finishes in _TRANSITIONS.items()}
