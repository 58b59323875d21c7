"""Random stimuli, right and hostile, against a validating state (hypothesis, stateful).

Each step calls one stimulus with arguments that are valid or not: wrong types, huge
ints, NaN, unhashable keys, unknown workers / clients / keys, keys another client wants,
reports of tasks the worker does not run, impossible sizes, data loss reported by a
worker that fetches nothing, ... Every call must either succeed (the state then passes
validation: validate=True) or raise InvalidStimulus and leave the state exactly as it
was; any other exception fails the test. A refused graph (a ``graph-refused`` reply)
must change nothing either. At the end every client leaves and nothing may be left.

Valid calls are built from the current state where they need to be (a report of a task
a worker runs, a missing-data report of an input it fetches), by index into sorted
options, so that replays draw the same data.
"""
from __future__ import annotations

from core_sim import snapshot
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from distributed_core import InvalidStimulus, SchedulerState

KEYS = ("k0", "k1", "k2", "k3", "k4", ("x", 0), ("x", 1), 3)
CLIENTS = ("c1", "c2")
WORKERS = ("w0", "w1", "w2")
INDEX = st.integers(0, 255)


def mostly(good, junk):
    """Mostly (7 in 8) a value of ``good``, sometimes ``junk``. (Not ``one_of``: it would
    flatten ``junk``'s own branches and pick among all of them alike.)"""
    return st.sampled_from((True,) * 7 + (False,)).flatmap(lambda ok: good if ok else junk)


def often(values, junk):
    """Mostly one of ``values``, sometimes ``junk``."""
    return mostly(st.sampled_from(values), junk)


JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3),
    st.sampled_from([2 ** 31, 2 ** 62 + 1, 2 ** 63, -2 ** 63 - 1, 10 ** 30]),
    st.builds(pow, st.just(10), st.just(4000)),  # not in the strategy's repr: it is long
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3), st.binary(max_size=3),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.tuples(st.text(max_size=2), st.lists(st.integers(), max_size=1)),  # unhashable tuple
    st.just(float("nan")))
KEY = often(KEYS, JUNK)
KEY_LIST = st.sampled_from(["list", "tuple", "valid", "junk"]).flatmap(lambda kind: {
    "list": st.lists(KEY, max_size=4), "tuple": st.lists(KEY, max_size=4).map(tuple),
    "valid": st.lists(st.sampled_from(KEYS), max_size=4), "junk": JUNK}[kind])
CLIENT = often(CLIENTS + ("stranger",), JUNK)
WORKER = often(WORKERS + ("ghost",), JUNK)
SID = often(("sid",), st.one_of(st.none(), st.integers(), st.binary(max_size=2)))
FIELDS = ("nbytes", "type", "data", "start", "stop", "exception", "traceback", "text")


def pick(options, i: int):
    return options[i % len(options)]


@st.composite
def graphs(draw):
    """``(tasks, keys)`` for update_graph: mostly well-formed, often refused anyway."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JUNK), draw(KEY_LIST)
    tasks = []
    for _ in range(draw(st.integers(0, 5))):
        key = draw(KEY)
        earlier = [entry["key"] for entry in tasks if isinstance(entry, dict) and "key" in entry
                   and isinstance(entry["key"], (str, int, tuple))]
        entry = {"key": key, "spec": b"run " + repr(key).encode()[:20]}
        deps = draw(st.lists(often(earlier, st.sampled_from(KEYS)) if earlier else
                             st.sampled_from(KEYS), max_size=2))
        if deps:
            entry["deps"] = deps
        for field, value in draw(st.lists(st.tuples(
                st.sampled_from(["priority", "retries", "workers", "resources", "spec", "deps",
                                 "annotations", "allow_other_workers", "order"]),
                st.one_of(JUNK, st.integers(0, 2), st.just(["w0"]), st.just({"GPU": 1}))),
                max_size=1)):
            entry[field] = value
        if draw(st.integers(0, 19)) == 0:
            entry = draw(JUNK)
        tasks.append(entry)
    keys = [entry["key"] for entry in tasks if isinstance(entry, dict) and "key" in entry]
    wanted = draw(st.lists(st.sampled_from(keys), max_size=3)) if keys else []
    if draw(st.integers(0, 9)) == 0:
        wanted.append(draw(KEY))
    return tasks, wanted


class AdversarialMachine(RuleBasedStateMachine):

    def __init__(self):
        super().__init__()
        self.state = SchedulerState(validate=True)
        self.n = 0

    def call(self, stimulus, *args, **kwargs):
        """Run one stimulus: it succeeds, or it raises InvalidStimulus changing nothing."""
        state = self.state
        before = snapshot(state)
        try:
            result = getattr(state, stimulus)(*args, **kwargs)
        except InvalidStimulus:
            event(f"{stimulus}: refused")
            assert snapshot(state) == before, f"refused {stimulus} changed the state"
            return None
        event(f"{stimulus}: accepted")
        if stimulus == "who_has":
            assert type(result) is dict
            return result
        client_msgs, worker_msgs = result
        assert set(worker_msgs) <= set(state.workers), worker_msgs
        for msgs in list(client_msgs.values()) + list(worker_msgs.values()):
            assert msgs and all(type(msg) is dict and "op" in msg for msg in msgs)
        if any(msg["op"] == "graph-refused" for msgs in client_msgs.values() for msg in msgs):
            after = snapshot(state)
            after["pending"] = before["pending"]  # only the last stimulus id differs
            assert after == before, "a refused graph changed the state"
        return result

    def sid(self, sid):
        self.n += 1
        return f"{sid}-{self.n}" if sid == "sid" else sid

    def processing_on(self, address) -> list:
        ws = self.state.workers.get(address) if isinstance(address, str) else None
        return [] if ws is None else sorted((ts.key for ts in ws.processing), key=repr)

    @initialize(nthreads=st.integers(1, 2))
    def start(self, nthreads):
        """Two workers, two clients and a few tasks to begin with."""
        for address in WORKERS[:2]:
            self.call("add_worker", address, nthreads, "join")
        for client in CLIENTS:
            self.call("add_client", client, "hello")
        tasks = [{"key": "k0", "spec": b"0"}, {"key": "k1", "spec": b"1", "deps": ["k0"]},
                 {"key": ("x", 0), "spec": b"x0"}, {"key": ("x", 1), "spec": b"x1"},
                 {"key": "k2", "spec": b"2", "deps": ["k1", ("x", 0), ("x", 1)]}]
        self.call("update_graph", "c1", tasks, ["k2", ("x", 1)], "graph")

    # -- clients ---------------------------------------------------------------------------

    @rule(client=CLIENT, sid=SID)
    def add_client(self, client, sid):
        self.call("add_client", client, self.sid(sid))

    @rule(client=CLIENT, sid=SID)
    def remove_client(self, client, sid):
        self.call("remove_client", client, self.sid(sid))

    @rule(client=CLIENT, graph=graphs(), sid=SID)
    def update_graph(self, client, graph, sid):
        tasks, keys = graph
        self.call("update_graph", client, tasks, keys, self.sid(sid))

    @rule(client=CLIENT, entries=st.lists(st.tuples(
              KEY, mostly(st.lists(WORKER, max_size=2), JUNK), often((0, 1, 100), JUNK)),
              max_size=3),
          whole=mostly(st.none(), JUNK), sid=SID)
    def update_data(self, client, entries, whole, sid):
        who_has, nbytes = {}, {}
        for key, holders, size in entries:
            try:
                who_has[key] = holders
                nbytes[key] = size
            except TypeError:  # an unhashable key cannot even be put in a dict
                pass
        if whole is not None:
            who_has = whole
        self.call("update_data", client, who_has, nbytes, self.sid(sid))

    @rule(client=CLIENT, keys=KEY_LIST, sid=SID)
    def client_releases_keys(self, client, keys, sid):
        self.call("client_releases_keys", client, keys, self.sid(sid))

    @rule(client=CLIENT, keys=KEY_LIST, sid=SID)
    def client_desires_keys(self, client, keys, sid):
        self.call("client_desires_keys", client, keys, self.sid(sid))

    @rule(client=CLIENT, keys=KEY_LIST, force=often((False, True), JUNK), sid=SID)
    def cancel(self, client, keys, force, sid):
        self.call("cancel", client, keys, self.sid(sid), force=force)

    @rule(client=CLIENT, keys=KEY_LIST, sid=SID)
    def retry(self, client, keys, sid):
        self.call("retry", client, keys, self.sid(sid))

    @rule(keys=KEY_LIST)
    def who_has(self, keys):
        self.call("who_has", keys)

    # -- workers ---------------------------------------------------------------------------

    @rule(address=WORKER, nthreads=often((1, 2, 3), JUNK),
          name=mostly(st.one_of(st.none(), st.text(max_size=3), st.integers(0, 9)), JUNK),
          resources=mostly(st.sampled_from([None, {"GPU": 1}, {}, {"GPU": 0.5, "MEM": 10}]),
                           st.one_of(st.dictionaries(st.text(max_size=2), JUNK, max_size=2),
                                     JUNK)),
          sid=SID)
    def add_worker(self, address, nthreads, name, resources, sid):
        self.call("add_worker", address, nthreads, self.sid(sid), name=name,
                  resources=resources)

    @rule(address=WORKER, sid=SID)
    def remove_worker(self, address, sid):
        self.call("remove_worker", address, self.sid(sid))

    @rule(address=WORKER, how=st.lists(st.tuples(
              st.sampled_from(["mine", "mine", "any", "bad-field", "not-a-dict", "no-key"]),
              INDEX, st.sampled_from(FIELDS), JUNK), max_size=4),
          whole=mostly(st.none(), JUNK), sid=SID)
    def task_finished(self, address, how, whole, sid):
        self.call("task_finished", address, whole if whole is not None else
                  self.reports(address, how, {"nbytes": 1, "type": "int"}), self.sid(sid))

    @rule(address=WORKER, how=st.lists(st.tuples(
              st.sampled_from(["mine", "mine", "any", "bad-field", "not-a-dict", "no-key"]),
              INDEX, st.sampled_from(FIELDS), JUNK), max_size=3),
          whole=mostly(st.none(), JUNK), sid=SID)
    def task_erred(self, address, how, whole, sid):
        fields = {"exception": b"e", "traceback": b"t", "text": "boom"}
        self.call("task_erred", address, whole if whole is not None else
                  self.reports(address, how, fields), self.sid(sid))

    def reports(self, address, how, fields) -> list:
        mine = self.processing_on(address)
        reports = []
        for kind, i, field, junk in how:
            key = pick(mine, i) if mine and kind in ("mine", "bad-field") else pick(KEYS, i)
            report = {"key": key, **fields, "start": 1.0, "stop": 1.5}
            if kind == "bad-field":
                report[field] = junk
            elif kind == "not-a-dict":
                report = junk
            elif kind == "no-key":
                del report["key"]
            reports.append(report)
        return reports

    @rule(i=INDEX)
    def a_worker_finishes_everything_it_runs(self, i):
        """Valid reports, so that the graph moves on (and inputs get fetched)."""
        busy = sorted(address for address, ws in self.state.workers.items() if ws.processing)
        if busy:
            address = pick(busy, i)
            reports = [{"key": key, "nbytes": 8, "type": "int", "start": 1.0, "stop": 1.5}
                       for key in self.processing_on(address)]
            assert self.call("task_finished", address, reports, self.sid("sid")) is not None

    @rule(valid=st.booleans(), i=INDEX, address=WORKER, key=KEY, errant=WORKER, sid=SID)
    def missing_data(self, valid, i, address, key, errant, sid):
        fetches = sorted({(ws.address, dep.key, holder.address)
                          for ws in self.state.workers.values() for ts in ws.processing
                          for dep in ts.dependencies for holder in dep.who_has}, key=repr)
        if valid and fetches:
            address, key, errant = pick(fetches, i)
        self.call("missing_data", address, key, errant, self.sid(sid))

    @rule(valid=st.booleans(), i=INDEX, address=WORKER, key=KEY, sid=SID)
    def reschedule(self, valid, i, address, key, sid):
        running = sorted(((ws.address, ts.key) for ws in self.state.workers.values()
                          for ts in ws.processing), key=repr)
        if valid and running:
            address, key = pick(running, i)
        self.call("reschedule", address, key, self.sid(sid))

    # -- copies between workers, retirement ---------------------------------------------

    @rule(valid=st.booleans(), i=INDEX, address=WORKER, keys=KEY_LIST, sid=SID)
    def acquire_replicas(self, valid, i, address, keys, sid):
        copies = sorted(((ws.address, ts.key) for ts in self.state.tasks.values()
                         if ts.state == "memory" for ws in self.state.workers.values()
                         if ws not in ts.who_has and ws.status == "running"
                         and (ws.acquiring is None or ts.key not in ws.acquiring)), key=repr)
        if valid and copies:
            address, key = pick(copies, i)
            keys = [key]
        self.call("acquire_replicas", address, keys, self.sid(sid))

    @rule(valid=st.booleans(), added=st.booleans(), i=INDEX, address=WORKER, keys=KEY_LIST,
          sid=SID)
    def answer_copies(self, valid, added, i, address, keys, sid):
        """A worker's add-keys or acquire-failed: for copies it was asked for, or lies."""
        asked = sorted(((ws.address, key) for ws in self.state.workers.values()
                        for key in ws.acquiring or ()), key=repr)
        if valid and asked:
            address, key = pick(asked, i)
            keys = [key]
        self.call("replicas_added" if added else "replicas_failed", address, keys,
                  self.sid(sid))

    @rule(valid=st.booleans(), i=INDEX, address=WORKER, keys=KEY_LIST, sid=SID)
    def remove_replicas(self, valid, i, address, keys, sid):
        copies = sorted(((ws.address, ts.key) for ts in self.state.tasks.values()
                         if ts.who_has is not None and len(ts.who_has) > 1
                         for ws in ts.who_has), key=repr)
        if valid and copies:
            address, key = pick(copies, i)
            keys = [key]
        self.call("remove_replicas", address, keys, self.sid(sid))

    @rule(retire=st.booleans(), address=WORKER, sid=SID)
    def retire_or_unretire(self, retire, address, sid):
        self.call("retire_worker" if retire else "unretire_worker", address, self.sid(sid))

    # -- checks ----------------------------------------------------------------------------

    @invariant()
    def state_is_valid(self):
        self.state.validate_state()

    def teardown(self):
        state = self.state
        for client in sorted(state.clients):
            state.remove_client(client, "bye")
        assert state.tasks == {}
        assert state.n_queued == 0 and len(state.unrunnable) == 0
        for ws in state.workers.values():
            assert (len(ws.has_what), ws.nbytes, len(ws.processing)) == (0, 0, 0)


TestAdversarial = AdversarialMachine.TestCase
