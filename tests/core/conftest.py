"""Shared pieces of the core tests: a settable clock, task-dict builders, and `Sim`.

`Sim` wraps a `SchedulerState(validate=True)` and plays the workers: it remembers every
`compute-task` each worker was sent and every result each worker holds, applies the
`free-keys` it is sent, and can report tasks finished or failed. Tests drive the state
through it (or directly) and assert on the messages each stimulus returns.
"""
from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

from distributed_core import SPEC_PART_PREFIX, InvalidStimulus, SchedulerState

# Test modules import the helpers below with `from core_sim import ...`. This file's own
# module name depends on pytest's import mode (prepend / importlib), so give it one name.
sys.modules.setdefault("core_sim", sys.modules[__name__])

settings.register_profile(
    "default", max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "ci", max_examples=500, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


class Clock:
    """A clock the test sets: ``clock()`` is ``clock.now``."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def task(key, *deps, spec=None, **fields) -> dict:
    """A task dict for update_graph: ``task("b", "a", retries=1)``."""
    entry = {"key": key, "spec": spec if spec is not None else spec_of(key)}
    if deps:
        entry["deps"] = list(deps)
    entry.update(fields)
    return entry


def as_part(tasks: list, blob: bytes = b"pickled list") -> tuple:
    """``(other tasks, part)``: the tasks of ``tasks`` that have no field but a key, a
    spec and dependencies, as an update-graph ``part`` (their specs pickled together into
    ``blob``), and the rest as they were. The part is None if no task fits."""
    plain, rest = [], []
    for entry in tasks:
        (plain if set(entry) <= {"key", "spec", "deps"} else rest).append(entry)
    if not plain:
        return rest, None
    deps = [dep for entry in plain for dep in entry.get("deps", ())]
    return rest, {"blob": blob, "keys": [entry["key"] for entry in plain], "deps": deps,
                  "ndeps": [len(entry.get("deps", ())) for entry in plain]}


def spec_of(key) -> bytes:
    """The run spec `task` gives a key by default."""
    return f"run {key}".encode()


def compute(key, stimulus_id, priority, who_has=None, spec=None) -> dict:
    """The compute-task message the scheduler sends for a task built by `task`."""
    msg = {"op": "compute-task", "key": key, "spec": spec if spec is not None else spec_of(key),
           "priority": priority, "stimulus_id": stimulus_id}
    if who_has is not None:
        msg["who_has"] = who_has
    return msg


def free(keys, stimulus_id) -> dict:
    return {"op": "free-keys", "keys": list(keys), "stimulus_id": stimulus_id}


def ops(worker_msgs, address) -> list:
    """``(op, key-or-keys)`` of the messages sent to one worker, in order."""
    out = []
    for msg in worker_msgs.get(address, []):
        out.append((msg["op"], msg["key"] if "key" in msg else sorted(msg["keys"], key=repr)))
    return out


def computed(worker_msgs) -> dict:
    """``{key: address}`` of every compute-task in one stimulus's worker messages."""
    return {msg["key"]: address for address, msgs in worker_msgs.items()
            for msg in msgs if msg["op"] == "compute-task"}


def freed(worker_msgs) -> dict:
    """``{address: sorted keys}`` of every free-keys message in one stimulus."""
    out = {}
    for address, msgs in worker_msgs.items():
        for msg in msgs:
            if msg["op"] == "free-keys":
                out.setdefault(address, []).extend(msg["keys"])
    return {address: sorted(keys, key=repr) for address, keys in out.items()}


def states(state) -> dict:
    """``{key: state}`` of every task the scheduler knows."""
    return {key: ts.state for key, ts in state.tasks.items()}


def _keys(tasks) -> list:
    return sorted((ts.key for ts in tasks), key=repr)


def snapshot(state) -> dict:
    """Everything a stimulus can change, as plain data: a refused stimulus must leave it
    exactly as it was (``snapshot(state)`` before and after compare equal)."""
    def addresses(workers):
        return None if workers is None else [ws.address for ws in workers]

    tasks = {}
    for key, ts in state.tasks.items():
        tasks[key] = (
            ts.state, ts.run_spec, ts.priority, ts.retries, ts.suspicious, ts.nbytes,
            ts.type_name, ts.error, ts.n_waiting_on, ts.n_waiters, ts.estimate,
            [dep.key for dep in ts.dependencies],
            None if ts.dependents is None else _keys(ts.dependents),
            None if ts.who_wants is None else [cs.client_id for cs in ts.who_wants],
            addresses(ts.who_has),
            None if ts.processing_on is None else ts.processing_on.address,
            None if ts.options is None else (ts.options.workers, ts.options.resources,
                                              ts.options.loose, ts.options.annotations))
    return {
        "tasks": tasks,
        "workers": {address: (ws.name, ws.nthreads, ws.slots, ws.resources, ws.status,
                              _keys(ws.processing), _keys(ws.has_what), ws.nbytes,
                              ws.occupancy,
                              None if ws.acquiring is None else
                              {key: id(ts) for key, ts in ws.acquiring.items()},
                              None if ws.queue_run is None else
                              [ts.key for ts in ws.queue_run])
                    for address, ws in state.workers.items()},
        "departing": {address: (_keys(ws.has_what), ws.nbytes)
                      for address, ws in state.departing.items()},
        "clients": {client: _keys(cs.wants_what) for client, cs in state.clients.items()},
        "idle": list(state.idle),
        "queued": (state.n_queued, [ts.key for ts in state.queued]),
        "unrunnable": [ts.key for ts in state.unrunnable],
        "prefixes": {name: (p.duration_average, p.n_durations)
                     for name, p in state.prefixes.items()},
        "counters": (state.transition_counter, state.generation,
                     state.counters(), state.prefix_counts(every=True),
                     state.worker_counts()),
        "log": state.transition_log,
        "pending": ({ts.key: finish for ts, finish in state._recs.items()},
                    state._client_msgs, state._worker_msgs, state._stimulus_id),
    }


def assert_refused(state, call, exception=None, match=None):
    """``call()`` raises ``exception`` (InvalidStimulus by default) and leaves ``state``
    exactly as it was, still valid. Returns the exception."""
    before = snapshot(state)
    with pytest.raises(exception or InvalidStimulus, match=match) as info:
        call()
    assert snapshot(state) == before
    state.validate_state()
    return info.value


class Sim:
    """A validating SchedulerState plus simulated workers that do what they are told."""

    def __init__(self, state_class=SchedulerState, **options):
        options.setdefault("validate", True)
        self.clock = options.pop("clock", None) or Clock()
        self.state = state_class(clock=self.clock, **options)
        self.computing: dict = {}  # address -> {key: compute-task message}
        self.data: dict = {}  # address -> set of keys held
        self.log: list = []  # every (client_msgs, worker_msgs) the state returned
        self.asked: dict = {}  # address -> keys it was asked to copy (acquire-replicas)
        self.steal_asks: dict = {}  # address -> steal-request messages not answered yet
        self.parts: dict = {}  # address -> {number: blob} of the spec parts it holds
        self.n = 0

    # -- stimuli -------------------------------------------------------------------------------

    def sid(self, name: str, given: str | None = None) -> str:
        """``given`` if a test named the stimulus, else a fresh ``name-<n>``."""
        self.n += 1
        return given or f"{name}-{self.n}"

    def record(self, result: tuple) -> tuple:
        """Apply worker messages to the simulated workers; return the result unchanged.

        Checks that a task the workers are left computing can fetch its inputs: every
        holder named in its ``who_has`` still holds them once the stimulus is applied."""
        self.log.append(result)
        sent = []
        for address, msgs in result[1].items():
            assert address in self.state.workers, f"message for unknown worker {address}"
            computing = self.computing[address]
            data = self.data[address]
            for msg in msgs:
                if msg["op"] == "compute-task":
                    spec = msg["spec"]
                    if spec.startswith(SPEC_PART_PREFIX):  # the worker holds its part
                        number = int.from_bytes(spec[len(SPEC_PART_PREFIX):][:8], "little")
                        assert number in self.parts[address], (msg, self.parts[address])
                    computing[msg["key"]] = msg
                    sent.append((address, msg))
                elif msg["op"] == "spec-part":
                    assert msg["part"] not in self.parts[address], msg
                    self.parts[address][msg["part"]] = msg["blob"]
                elif msg["op"] == "free-spec-parts":
                    for number in msg["parts"]:
                        del self.parts[address][number]
                elif msg["op"] == "free-keys":
                    for key in msg["keys"]:
                        computing.pop(key, None)
                        data.discard(key)
                elif msg["op"] == "acquire-replicas":
                    for key, holders in msg["who_has"].items():
                        assert holders and all(key in self.data[h] for h in holders), msg
                    self.asked.setdefault(address, set()).update(msg["who_has"])
                elif msg["op"] == "steal-request":
                    # what the worker computes under that key when the request arrives
                    held = computing.get(msg["key"])
                    self.steal_asks.setdefault(address, []).append(dict(msg, held=held))
                else:
                    raise AssertionError(f"unexpected worker message {msg}")
        for address, msg in sent:
            if self.computing[address].get(msg["key"]) is not msg:
                continue  # taken back by the same stimulus
            for dep, holders in msg.get("who_has", {}).items():
                assert holders, f"{msg['key']!r}: no holder of {dep!r}"
                for holder in holders:
                    assert dep in self.data.get(holder, ()), \
                        f"{msg['key']!r} is sent to fetch {dep!r} from {holder}, which drops it"
        return result

    def add_worker(self, address: str, nthreads: int = 1, stimulus_id=None, **kwargs):
        self.computing[address] = {}
        self.data[address] = set()
        self.parts[address] = {}
        sid = self.sid("add-worker", stimulus_id)
        return self.record(self.state.add_worker(address, nthreads, sid, **kwargs))

    def remove_worker(self, address: str, stimulus_id=None, max_keys=None) -> tuple:
        """The worker is gone at once; with ``max_keys`` the state lets go of its results
        in slices (call again while the address is in ``state.departing``)."""
        self.computing.pop(address, None)
        self.data.pop(address, None)
        self.parts.pop(address, None)
        self.steal_asks.pop(address, None)
        sid = self.sid("remove-worker", stimulus_id)
        return self.record(self.state.remove_worker(address, sid, max_keys=max_keys))

    def submit(self, tasks: list, keys: list, client: str = "c", stimulus_id=None,
               part=None) -> tuple:
        sid = self.sid("graph", stimulus_id)
        return self.record(self.state.update_graph(client, tasks, keys, sid, part=part))

    def scatter(self, who_has: dict, nbytes: dict, client: str = "c", stimulus_id=None):
        for key, addresses in who_has.items():
            for address in addresses:
                if address in self.data:
                    self.data[address].add(key)
        sid = self.sid("scatter", stimulus_id)
        return self.record(self.state.update_data(client, who_has, nbytes, sid))

    def release(self, keys: list, client: str = "c", stimulus_id=None) -> tuple:
        sid = self.sid("release", stimulus_id)
        return self.record(self.state.client_releases_keys(client, keys, sid))

    def remove_client(self, client: str = "c", stimulus_id=None, max_keys=None) -> tuple:
        sid = self.sid("remove-client", stimulus_id)
        return self.record(self.state.remove_client(client, sid, max_keys=max_keys))

    def copied(self, address: str, *keys, stimulus_id=None) -> tuple:
        """The worker at ``address`` holds the copies of ``keys`` it was asked for."""
        self.asked[address].difference_update(keys)
        self.data[address].update(keys)
        sid = self.sid("add-keys", stimulus_id)
        return self.record(self.state.replicas_added(address, list(keys), sid))

    def balance(self, stimulus_id=None) -> tuple:
        return self.record(self.state.balance(self.sid("balance", stimulus_id)))

    def answer_steals(self, address: str, give: bool = True, keys=None) -> list:
        """The worker at ``address`` answers its pending steal requests (those of
        ``keys`` only, if given), each as one steal_response stimulus: it gives a task
        back if ``give`` and it still computes what it computed under that key when the
        request arrived (it drops it then), else refuses (it began it; a task that
        finished, was freed or was sent again since then is not given: a real worker
        answers on arrival). Returns the ``(key, given)`` answers."""
        answers = []
        pending = self.steal_asks.get(address, [])
        for msg in list(pending):
            if keys is not None and msg["key"] not in keys:
                continue
            pending.remove(msg)
            held = msg["held"]
            given = give and held is not None and self.computing[address].get(msg["key"]) is held
            if given:
                del self.computing[address][msg["key"]]
            answers.append((msg["key"], given))
            self.record(self.state.steal_response(address, msg["key"], msg["request"], given,
                                                  self.sid("steal-response")))
        return answers

    def where(self, key) -> str:
        """The one worker that was told to compute ``key`` and has not finished it."""
        found = [a for a, computing in self.computing.items() if key in computing]
        assert len(found) == 1, f"{key!r} is being computed on {found}"
        return found[0]

    def finish(self, *keys, nbytes: int = 1, worker: str | None = None, duration=None,
               stimulus_id=None, **extra) -> tuple:
        """Report ``keys`` finished, in one task_finished stimulus from one worker."""
        worker = worker or self.where(keys[0])
        reports = []
        for key in keys:
            self.computing[worker].pop(key, None)
            self.data[worker].add(key)
            report = {"key": key, "nbytes": nbytes, "type": "int", **extra}
            if duration is not None:
                report["start"] = self.clock.now
                report["stop"] = self.clock.now + duration
            reports.append(report)
        sid = self.sid("finished", stimulus_id)
        return self.record(self.state.task_finished(worker, reports, sid))

    def fail(self, *keys, worker: str | None = None, exception=b"exc", traceback=b"tb",
             text="ValueError('boom')", stimulus_id=None) -> tuple:
        """Report ``keys`` erred, in one task_erred stimulus from one worker."""
        worker = worker or self.where(keys[0])
        reports = []
        for key in keys:
            self.computing[worker].pop(key, None)
            reports.append({"key": key, "exception": exception, "traceback": traceback,
                            "text": text, "start": 0.0, "stop": 0.0})
        sid = self.sid("erred", stimulus_id)
        return self.record(self.state.task_erred(worker, reports, sid))

    def run_all(self, max_rounds: int = 10_000) -> list:
        """Finish everything the workers were told to compute until nothing is left.

        Each round every worker reports all its tasks in one batch. Returns the keys
        finished, in order."""
        done = []
        for _ in range(max_rounds):
            busy = [address for address, computing in self.computing.items() if computing]
            if not busy:
                return done
            for address in busy:
                keys = list(self.computing.get(address, ()))
                if keys:
                    self.finish(*keys, worker=address)
                    done.extend(keys)
        raise AssertionError("tasks keep coming")

    # -- checks --------------------------------------------------------------------------------

    def check_workers_agree(self) -> None:
        """The simulated workers hold exactly what the scheduler thinks they hold."""
        for address, ws in self.state.workers.items():
            assert self.data[address] == {ts.key for ts in ws.has_what}, address
