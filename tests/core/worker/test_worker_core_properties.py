"""Random event sequences against a validating worker state machine.

Hypothesis draws a random graph of tasks, then random stimuli: compute-task (with random
holders for the inputs, some naming this worker), free-keys, execution outcomes
(finished, erred, skipped), fetch outcomes (values, missing keys, keys that cannot be
serialized, whole requests failing), peers gone, the scheduler lost, pause and unpause,
values that failed to serve, values put by a client, copies the scheduler asks for
(acquire-replicas). A model of the shell carries out
the instructions (a data mapping, outstanding executions and fetches) and checks what
the shell relies on after every step:

- the data mapping holds exactly the keys the machine has in memory;
- an ``Execute`` finds every input in the data mapping, and a key is never executed
  while an execution of it is outstanding or its value is held;
- ``ReleaseData`` / ``ReportHeld`` name held keys only;
- every copy asked for is answered exactly once (``add-keys`` naming a held key, or
  ``acquire-failed``), unless the scheduler is lost.

With the compiled core loaded, the same ``.pyx`` also runs as Python source in lockstep
and must return the same instructions. At the end, every outstanding operation is
answered and every task freed: the machine must hold nothing.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import distributed_core
from distributed_core import (
    Execute,
    Fetch,
    ReleaseData,
    ReportHeld,
    SendMessage,
    StoreData,
    WorkerCore,
)

ME = "tcp://me:1"
PEERS = ["tcp://p1:1", "tcp://p2:1", "tcp://p3:1"]
N_KEYS = 8
KEYS = [f"k{i}" for i in range(N_KEYS)]
OPS = {"task-finished", "task-erred", "missing-data", "reschedule", "add-keys",
       "acquire-failed"}


def load_source_worker_core():
    path = os.path.join(os.path.dirname(distributed_core.__file__), "_worker_core.pyx")
    name = "distributed_core._worker_core_as_source"
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "distributed_core"  # its `from . import _core`
    sys.modules[name] = module
    loader.exec_module(module)
    return module


def comparable(instructions: list) -> list:
    """Instructions of the compiled and the source machine as comparable tuples."""
    return [(type(i).__name__, *i) for i in instructions]


class WorkerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        # a recommendation loop fails fast instead of running 100,000 validated steps
        options = dict(resources={"R": 1}, prefetch=3, max_fetch_attempts=2, validate=True,
                       seed=7, max_transitions_per_stimulus=2_000)
        self.core = WorkerCore(ME, 2, **options)
        self.twin = None
        if distributed_core.COMPILED:
            self.twin = load_source_worker_core().WorkerCore(ME, 2, **options)
        self.data: dict = {}
        self.executions: dict = {}  # key -> number of outstanding executions (0 or 1)
        self.fetches: list = []  # (peer, keys) outstanding
        self.graph: dict = {}
        self.wanted: set = set()  # keys the scheduler asked for and has no answer about
        self.in_frame: set = set()  # keys a frame asked for (a later message may free them)
        self.answered: set = set()  # keys answered while a frame is applied
        self.acquiring: set = set()  # keys asked to copy here, not answered yet
        self.n = 0

    # ------------------------------------------------------------------ helpers

    def sid(self, name: str) -> str:
        self.n += 1
        return f"{name}-{self.n}"

    def call(self, method: str, *args, **kwargs):
        instructions = getattr(self.core, method)(*args, **kwargs)
        if self.twin is not None:
            assert comparable(getattr(self.twin, method)(*args, **kwargs)) == \
                comparable(instructions), method
        self.apply(instructions)

    def apply(self, instructions: list) -> None:
        for ins in instructions:
            kind = type(ins)
            if kind is Execute:
                key = ins.key
                ts = self.core.tasks[key]
                assert not self.executions.get(key), f"{key} executed twice at once"
                assert key not in self.data, f"{key} executed while its value is held"
                assert key in self.wanted or key in self.in_frame, f"{key} executed unasked"
                assert [dep.key for dep in ts.dependencies] == self.graph[key]
                for dep in self.graph[key]:
                    assert dep in self.data, f"{key} executed without input {dep}"
                self.executions[key] = 1
            elif kind is Fetch:
                assert ins.keys and ins.peer != ME
                assert len(set(ins.keys)) == len(ins.keys)
                self.fetches.append((ins.peer, list(ins.keys)))
            elif kind is SendMessage:
                op = ins.msg["op"]
                assert op in OPS, ins.msg
                if op == "add-keys" or op == "acquire-failed":  # once per copy asked
                    for key in ins.msg["keys"]:
                        assert key in self.acquiring, ins.msg
                        self.acquiring.discard(key)
                        if op == "add-keys":
                            assert key in self.data and self.core.tasks[key].reported
                elif op != "missing-data":  # an answer about a task: only one, if asked
                    key = ins.msg["key"]
                    assert key in self.wanted or key in self.in_frame, ins.msg
                    self.wanted.discard(key)
                    self.answered.add(key)
            elif kind is StoreData:
                self.data[ins.key] = ins.value
            elif kind is ReleaseData:
                assert ins.key in self.data, f"released {ins.key}, which is not held"
                del self.data[ins.key]
            elif kind is ReportHeld:
                assert ins.key in self.data, f"reported {ins.key} held, which is not"
                assert ins.key in self.wanted or ins.key in self.in_frame
                self.wanted.discard(ins.key)
                self.answered.add(ins.key)
            else:
                raise AssertionError(f"unknown instruction {ins!r}")

    # ------------------------------------------------------------------ rules

    @initialize(deps=st.lists(st.sets(st.integers(0, N_KEYS - 1), max_size=3),
                              min_size=N_KEYS, max_size=N_KEYS))
    def make_graph(self, deps):
        self.graph = {KEYS[i]: sorted(KEYS[j] for j in d if j < i) for i, d in enumerate(deps)}

    @rule(data=st.data(), batch=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4,
                                         unique=True))
    def compute(self, data, batch):
        msgs = []
        for i in batch:
            key = KEYS[i]
            who_has = {dep: data.draw(st.lists(st.sampled_from(PEERS + [ME]), max_size=3,
                                               unique=True))
                       for dep in self.graph[key]}
            msg = {"op": "compute-task", "key": key, "spec": key.encode(),
                   "priority": (0, 0, data.draw(st.integers(0, 3))),
                   "stimulus_id": self.sid("compute")}
            if who_has:
                msg["who_has"] = who_has
            if data.draw(st.booleans()) and i % 3 == 0:
                msg["resources"] = {"R": 1}
            msgs.append(msg)
            self.wanted.add(key)
        self.call("compute_tasks", msgs, self.sid("batch"))

    @rule(data=st.data(), frame=st.lists(st.tuples(st.booleans(), st.integers(0, N_KEYS - 1)),
                                         min_size=1, max_size=6))
    def scheduler_frame(self, data, frame):
        """One frame of the scheduler's stream: compute-tasks and free-keys mixed."""
        msgs = []
        for is_compute, i in frame:
            key = KEYS[i]
            if is_compute:
                who_has = {dep: data.draw(st.lists(st.sampled_from(PEERS), max_size=2,
                                                   unique=True)) for dep in self.graph[key]}
                msgs.append({"op": "compute-task", "key": key, "spec": key.encode(),
                             "priority": (0, 0, i), "who_has": who_has,
                             "stimulus_id": self.sid("compute")})
                self.in_frame.add(key)
            else:
                msgs.append({"op": "free-keys", "keys": [key], "stimulus_id": self.sid("free")})
        wanted_after = set(self.wanted)
        for is_compute, i in frame:  # what the scheduler wants once the frame is applied
            (wanted_after.add if is_compute else wanted_after.discard)(KEYS[i])
        self.answered = set()
        self.call("scheduler_messages", msgs, self.sid("frame"))
        self.wanted = wanted_after - self.answered  # reported held or erred at once
        self.in_frame = set()

    @rule(data=st.data(), in_frame=st.booleans())
    def acquire(self, data, in_frame):
        """The scheduler asks for copies of keys it has not asked for already."""
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
        keys = [key for key in keys if key not in self.acquiring]
        who_has = {key: data.draw(st.lists(st.sampled_from(PEERS + [ME]), min_size=1,
                                           max_size=3, unique=True)) for key in keys}
        self.acquiring.update(keys)
        if in_frame:
            self.call("scheduler_messages", [{"op": "acquire-replicas", "who_has": who_has,
                                              "stimulus_id": self.sid("acquire")}],
                      self.sid("frame"))
        else:
            self.call("acquire_replicas", who_has, self.sid("acquire"))

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def free(self, keys):
        self.wanted.difference_update(keys)
        self.call("free_keys", keys, self.sid("free"))

    @precondition(lambda self: any(self.executions.values()))
    @rule(data=st.data(), outcome=st.sampled_from(["success", "failure", "skipped"]))
    def finish_execution(self, data, outcome):
        key = data.draw(st.sampled_from(sorted(k for k, n in self.executions.items() if n)))
        self.executions[key] = 0
        sid = self.sid(outcome)
        if outcome == "success":
            report = {"op": "task-finished", "key": key, "nbytes": 10, "type": "str"}
            self.call("execute_success", key, f"value of {key}", report, sid)
        elif outcome == "failure":
            report = {"op": "task-erred", "key": key, "exception": None, "traceback": None,
                      "text": "boom"}
            self.call("execute_failure", key, report, sid)
        else:
            self.call("execute_skipped", key, sid)

    @precondition(lambda self: sum(self.executions.values()) > 1)
    @rule(data=st.data())
    def finish_burst(self, data):
        running = sorted(k for k, n in self.executions.items() if n)
        keys = data.draw(st.lists(st.sampled_from(running), min_size=2, unique=True))
        outcomes = []
        for key in keys:
            self.executions[key] = 0
            kind = data.draw(st.sampled_from(["finished", "erred", "skipped"]))
            if kind == "finished":
                outcomes.append((key, kind, f"value of {key}",
                                 {"op": "task-finished", "key": key, "nbytes": 10}))
            elif kind == "erred":
                outcomes.append((key, kind, None, {"op": "task-erred", "key": key,
                                                   "text": "boom"}))
            else:
                outcomes.append((key, kind, None, None))
        self.call("executions_done", outcomes, self.sid("burst"))

    @precondition(lambda self: self.fetches)
    @rule(data=st.data())
    def answer_fetch(self, data):
        i = data.draw(st.integers(0, len(self.fetches) - 1))
        peer, keys = self.fetches.pop(i)
        got, missing, errors = {}, [], {}
        for key in keys:
            outcome = data.draw(st.sampled_from(["value", "value", "missing", "cannot"]))
            if outcome == "value":
                got[key] = f"copy of {key}"
            else:
                missing.append(key)
                if outcome == "cannot":
                    errors[key] = f"{key} cannot be serialized"
        self.call("fetch_done", peer, got, missing, self.sid("fetched"),
                  nbytes={k: 10 for k in got}, errors=errors or None)

    @precondition(lambda self: self.fetches)
    @rule(data=st.data())
    def fail_fetch(self, data):
        i = data.draw(st.integers(0, len(self.fetches) - 1))
        peer, keys = self.fetches.pop(i)
        self.call("fetch_failed", peer, keys, self.sid("fetch-failed"))

    @rule(peer=st.sampled_from(PEERS))
    def peer_gone(self, peer):
        self.call("peer_gone", peer, self.sid("peer-gone"))

    @rule()
    def scheduler_lost(self):
        self.wanted.clear()
        self.acquiring.clear()
        self.call("scheduler_lost", self.sid("lost"))

    @rule(paused=st.booleans())
    def pause_or_unpause(self, paused):
        self.call("pause" if paused else "unpause", self.sid("memory"))

    @precondition(lambda self: self.data)
    @rule(data=st.data())
    def serve_failed(self, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.data)), min_size=1, max_size=2,
                                  unique=True))
        self.call("serve_failed", {k: f"{k} cannot be serialized" for k in keys},
                  self.sid("serve-failed"))

    @rule(key=st.sampled_from(KEYS))
    def put(self, key):
        self.wanted.discard(key)  # the scheduler takes the client's value instead
        self.call("data_put", {key: f"put {key}"}, self.sid("put"), nbytes={key: 5})

    # ------------------------------------------------------------------ checks

    @invariant()
    def data_mapping_matches_the_machine(self):
        held = {key for key, ts in self.core.tasks.items() if ts.state == "memory"}
        assert set(self.data) == held
        assert self.core.n_executing == sum(self.executions.values())

    def teardown(self):
        for _ in range(20):
            self.wanted.clear()
            self.call("free_keys", list(self.core.tasks), self.sid("free-all"))
            if not self.fetches and not any(self.executions.values()):
                break
            while self.fetches:
                peer, keys = self.fetches.pop()
                self.call("fetch_done", peer, {k: "late" for k in keys}, [], self.sid("late"))
            for key, n in list(self.executions.items()):
                if n:
                    self.executions[key] = 0
                    self.call("execute_success", key, "late",
                              {"op": "task-finished", "key": key, "nbytes": 1}, self.sid("late"))
        assert self.core.tasks == {}, self.core.tasks
        assert self.data == {}
        assert not self.acquiring, self.acquiring
        assert self.core.n_executing == 0 and not self.core.in_flight
        assert self.core.available_resources == {"R": 1}
        super().teardown()


TestWorkerCoreProperties = WorkerMachine.TestCase
