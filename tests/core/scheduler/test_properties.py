"""Random graphs under random interleavings of stimuli (hypothesis, stateful).

The machine submits random DAGs (up to ~200 tasks, dependencies on earlier tasks only,
random retries and priorities, occasional worker and resource restrictions) and then
interleaves: workers joining and leaving (1-4 alive), simulated workers finishing or
failing tasks they were told to compute (in batches), late reports of tasks a worker
was told to drop, lost data (reported by a worker told to fetch it), rescheduling,
retries, scatter, client 1 releasing keys and client 2 wanting overlapping keys, work
stealing (balance, and victims giving back or refusing what they were asked for, in
any order with the rest). The
state runs with validate=True, so every stimulus checks every invariant; the machine
also checks after each step that the simulated workers hold and run exactly what the
scheduler thinks they do.

At the end (teardown) it adds workers until every restriction can be met and runs
everything: every wanted key must be in memory or erred. Then both clients let go and
the scheduler must hold nothing.
"""
from __future__ import annotations

import random
import zlib

from core_sim import Sim, as_part, task
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

POOL = ("w0", "w1", "w2", "w3", "w4")  # addresses workers may have
GPU_WORKERS = ("w0", "w3")
ACTIVE = ("waiting", "queued", "no-worker", "processing")
INDEX = st.integers(0, 255)
PICKS = st.lists(INDEX, min_size=1, max_size=6)


def pick(options, i: int):
    return options[i % len(options)]


def name_of(address: str) -> str:
    return "name-" + address


def size_of(key) -> int:
    """Every copy of one result has the same size, whoever reports it."""
    return zlib.crc32(repr(key).encode()) % 1000


@st.composite
def graphs(draw, prefix: str):
    """Task dicts in dependency order, plus the keys to want."""
    n = draw(st.one_of(st.integers(1, 20), st.integers(20, 200)))
    rnd = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    tasks = []
    for i in range(n):
        deps = rnd.sample(range(i), k=min(i, rnd.choice((0, 0, 1, 1, 1, 2, 3))))
        entry = task(f"{prefix}{i}", *[f"{prefix}{d}" for d in deps])
        if rnd.random() < 0.15:
            entry["retries"] = rnd.randint(1, 2)
        if rnd.random() < 0.2:
            entry["priority"] = rnd.randint(-3, 3)
        if rnd.random() < 0.05:
            entry["workers"] = rnd.sample(POOL + tuple(map(name_of, POOL)), rnd.randint(1, 2))
            entry["allow_other_workers"] = rnd.random() < 0.3
        if rnd.random() < 0.03:
            entry["resources"] = {"GPU": 1}
            entry.pop("workers", None)  # GPU workers are fixed: keep it satisfiable
        tasks.append(entry)
    keys = [entry["key"] for entry in tasks]
    wanted = rnd.sample(keys, k=rnd.randint(1, max(1, n // 3)))
    wanted.append(keys[-1])
    return tasks, list(dict.fromkeys(wanted))


class SchedulerMachine(RuleBasedStateMachine):
    check_needed_results_kept = False  # see KeepsNeededResults below

    def __init__(self):
        super().__init__()
        self.sim: Sim | None = None
        self.defs: dict = {}  # key -> task dict of every task ever submitted
        self.told: dict = {}  # address -> keys it was ever told to compute
        self.n_graphs = 0
        self.n_scattered = 0
        self.n_restarts = 0
        self.in_memory: dict = {}  # key -> holders, as of the end of the previous step
        self.lost: set = set()  # (key, address) lost in this step: worker left / lost data

    # -- helpers -------------------------------------------------------------------------------

    @property
    def state(self):
        return self.sim.state

    def alive(self) -> list:
        return sorted(self.state.workers)

    def join(self, address: str, nthreads: int) -> None:
        resources = {"GPU": 1} if address in GPU_WORKERS else None
        self.sim.add_worker(address, nthreads, name=name_of(address), resources=resources)
        self.told[address] = set()

    def remember_told(self) -> None:
        for address, computing in self.sim.computing.items():
            self.told.setdefault(address, set()).update(computing)

    def closure(self, keys) -> list:
        """The task dicts of ``keys`` and everything they depend on, in any order."""
        seen, stack = {}, list(keys)
        while stack:
            key = stack.pop()
            if key not in seen:
                seen[key] = self.defs[key]
                stack.extend(self.defs[key].get("deps", ()))
        return list(seen.values())

    def busy(self) -> list:
        return sorted(a for a, computing in self.sim.computing.items() if computing)

    def report(self, address: str, keys: list) -> None:
        """``address`` reports ``keys`` finished in one stimulus, each at its one size."""
        reports = []
        for key in keys:
            self.sim.computing[address].pop(key, None)
            self.sim.data[address].add(key)
            reports.append({"key": key, "nbytes": size_of(key), "type": "int",
                            "start": 1.0, "stop": 1.25})
        self.sim.record(self.state.task_finished(address, reports, self.sim.sid("finished")))
        self.remember_told()

    def wanted(self, client: str) -> list:
        cs = self.state.clients.get(client)
        return [] if cs is None else sorted((ts.key for ts in cs.wants_what), key=repr)

    # -- rules ---------------------------------------------------------------------------------
    #
    # Rules pick among the current options with fixed-range integers (``pick``), never with
    # ``sampled_from(<current options>)``, and do nothing when there is nothing to pick:
    # which worker gets a task can depend on the order the core iterates sets of tasks in
    # (memory addresses, different in every run), and
    # draws whose shape followed the state would make hypothesis's replays inconsistent.

    @initialize(saturation=st.sampled_from([1.0, 1.1, 2.0, float("inf")]),
                allowed_failures=st.integers(1, 3),
                workers=st.lists(st.sampled_from(POOL), min_size=1, max_size=4, unique=True),
                nthreads=st.integers(1, 3), graph=graphs("t"),
                forget_slice=st.sampled_from([None, 1, 2, 5]), in_part=st.booleans())
    def start(self, saturation, allowed_failures, workers, nthreads, graph, forget_slice,
              in_part):
        self.sim = Sim(worker_saturation=saturation, allowed_failures=allowed_failures,
                       forget_slice=forget_slice)
        for address in workers:
            self.join(address, nthreads)
        tasks, keys = graph
        self.defs.update((entry["key"], entry) for entry in tasks)
        part = None
        if in_part:  # the plain tasks' specs pickled together, as the client sends them
            tasks, part = as_part(tasks)
        self.sim.submit(tasks, keys, client="c1", part=part)
        self.remember_told()

    @rule(i=INDEX, nthreads=st.integers(1, 3))
    def worker_joins(self, i, nthreads):
        absent = [a for a in POOL if a not in self.state.workers]
        if len(self.state.workers) < 4:
            self.join(pick(absent, i), nthreads)
            self.remember_told()

    @rule(i=INDEX, nthreads=st.integers(1, 3))
    def worker_joins_and_work_is_balanced(self, i, nthreads):
        """As the server does: a worker that joins may take work the others wait on."""
        absent = [a for a in POOL if a not in self.state.workers]
        if len(self.state.workers) < 4:
            self.join(pick(absent, i), nthreads)
        self.sim.balance()
        self.remember_told()

    @rule(i=INDEX, max_keys=st.one_of(st.none(), st.integers(1, 3)))
    def worker_leaves(self, i, max_keys):
        """A worker leaves; with ``max_keys`` the state lets go of its results in slices."""
        if self.state.workers:
            address = pick(self.alive(), i)
            self.lost.update((ts.key, address) for ts in self.state.workers[address].has_what)
            self.sim.remove_worker(address, max_keys=max_keys)
            self.remember_told()

    @rule(i=INDEX, max_keys=st.integers(1, 3))
    def departure_goes_on(self, i, max_keys):
        """The next slice of a departure in slices."""
        if self.state.departing:
            self.sim.remove_worker(pick(sorted(self.state.departing), i), max_keys=max_keys)
            self.remember_told()

    @rule()
    def forgetting_goes_on(self):
        """The next slice of what a stimulus left to forget (with ``forget_slice``)."""
        if self.state.forget_backlog:
            self.sim.record(self.state.forget_more(self.sim.sid("forget")))
            self.remember_told()

    @rule(i=INDEX, picks=PICKS)
    def worker_finishes_some_tasks(self, i, picks):
        """One task_finished stimulus with several reports from one worker."""
        busy = self.busy()
        if not busy:
            return
        address = pick(busy, i)
        computing = sorted(self.sim.computing[address], key=repr)
        keys = list(dict.fromkeys(pick(computing, j) for j in picks))
        self.report(address, keys)

    @rule(i=INDEX)
    def worker_finishes_everything_it_runs(self, i):
        busy = self.busy()
        if busy:
            address = pick(busy, i)
            self.report(address, sorted(self.sim.computing[address], key=repr))

    @rule()
    def work_is_balanced(self):
        """The periodic balance: busy workers are asked for tasks they have not begun."""
        self.sim.balance()
        self.remember_told()

    @rule(gives=st.lists(st.booleans(), min_size=1, max_size=4))
    def work_is_balanced_and_victims_answer(self, gives):
        """A balance whose answers come before anything else happens."""
        self.sim.balance()
        for address, give in zip(sorted(self.sim.steal_asks), gives * 4):
            self.sim.answer_steals(address, give=give)
        self.remember_told()

    @rule(i=INDEX, give=st.booleans())
    def victim_answers_steal_requests(self, i, give):
        """A victim answers its steal requests: gives back what it still computes, or
        refuses (the tasks began); answers for tasks that moved on meanwhile are stale."""
        asking = sorted(a for a, msgs in self.sim.steal_asks.items() if msgs)
        if asking:
            self.sim.answer_steals(pick(asking, i), give=give)
            self.remember_told()

    @rule(i=INDEX, j=INDEX)
    def task_fails(self, i, j):
        busy = self.busy()
        if busy:
            address = pick(busy, i)
            self.sim.fail(pick(sorted(self.sim.computing[address], key=repr), j),
                          worker=address)
            self.remember_told()

    @rule(i=INDEX, j=INDEX)
    def late_report(self, i, j):
        """A worker reports a task it was once told to compute, whatever became of it."""
        told = [a for a in self.alive() if self.told.get(a)]
        if told:
            address = pick(told, i)
            self.report(address, [pick(sorted(self.told[address], key=repr), j)])

    @rule(i=INDEX, j=INDEX)
    def worker_gives_a_task_back(self, i, j):
        busy = self.busy()
        if busy:
            address = pick(busy, i)
            key = pick(sorted(self.sim.computing[address], key=repr), j)
            self.sim.computing[address].pop(key)
            self.sim.record(self.state.reschedule(address, key, self.sim.sid("reschedule")))
            self.remember_told()

    @rule(i=INDEX, j=INDEX)
    def a_task_secedes(self, i, j):
        """A task gives its thread back (it waits for other tasks); sometimes a stale or
        repeated report of it."""
        told = [a for a in self.alive() if self.told.get(a)]
        if told:
            address = pick(told, i)
            key = pick(sorted(self.told[address], key=repr), j)
            self.sim.record(self.state.task_seceded(address, key, self.sim.sid("secede")))
            self.remember_told()

    @rule(i=INDEX)
    def worker_loses_data(self, i):
        """A holder loses an input; a worker told to fetch it from there says so."""
        fetches = sorted({(ws.address, dep.key, holder.address)
                          for ws in self.state.workers.values() for ts in ws.processing
                          for dep in ts.dependencies for holder in dep.who_has}, key=repr)
        if fetches:
            asking, key, address = pick(fetches, i)
            self.sim.data[address].discard(key)
            self.lost.add((key, address))
            self.sim.record(self.state.missing_data(asking, key, address,
                                                    self.sim.sid("missing")))
            self.remember_told()

    @rule(picks=PICKS)
    def client_releases_keys(self, picks):
        wanted = self.wanted("c1")
        if wanted:
            self.sim.release(list(dict.fromkeys(pick(wanted, j) for j in picks)), client="c1")
            self.remember_told()

    @rule(picks=PICKS, shuffle=st.randoms(use_true_random=False))
    def second_client_wants_overlapping_keys(self, picks, shuffle):
        known = sorted(self.defs, key=repr)
        keys = list(dict.fromkeys(pick(known, j) for j in picks))
        tasks = self.closure(keys)
        shuffle.shuffle(tasks)  # any order of an acyclic graph is accepted
        client_msgs, _ = self.sim.submit(tasks, keys, client="c2")
        assert all(msg["op"] != "graph-refused" for msg in client_msgs.get("c2", ()))
        self.remember_told()

    @rule(graph=graphs("u"), links=st.lists(st.tuples(INDEX, INDEX), max_size=5),
          in_part=st.booleans())
    def client_submits_a_graph_on_known_keys(self, graph, links, in_part):
        """A second graph of client 1, some of whose tasks depend on earlier keys."""
        if self.n_graphs >= 2:
            return
        prefix = f"u{self.n_graphs}-"
        self.n_graphs += 1
        tasks, keys = graph
        old = sorted(self.defs, key=repr)
        renamed = {entry["key"]: prefix + entry["key"] for entry in tasks}
        fresh = [dict(entry, key=renamed[entry["key"]],
                      deps=[renamed[d] for d in entry.get("deps", ())]) for entry in tasks]
        for i, j in links:
            fresh[i % len(fresh)]["deps"].append(pick(old, j))
        self.defs.update((entry["key"], entry) for entry in fresh)
        wanted = [renamed[k] for k in keys]
        fresh_keys = {entry["key"] for entry in fresh}
        ancestors = [e for e in self.closure(fresh_keys) if e["key"] not in fresh_keys]
        tasks, part = ancestors + fresh, None
        if in_part:
            tasks, part = as_part(tasks, blob=prefix.encode())
        client_msgs, _ = self.sim.submit(tasks, wanted, client="c1", part=part)
        assert all(msg["op"] != "graph-refused" for msg in client_msgs.get("c1", ()))
        self.remember_told()

    @rule(picks=PICKS)
    def client_scatters_data(self, picks):
        if self.state.workers:
            key = f"s{self.n_scattered}"
            self.n_scattered += 1
            holders = sorted({pick(self.alive(), j) for j in picks})
            self.sim.scatter({key: holders}, {key: size_of(key)}, client="c1")

    @rule(i=INDEX)
    def client_retries_an_erred_key(self, i):
        """An erred key the client wants (its erred inputs are retried with it)."""
        erred = sorted((k for k in self.wanted("c1") if self.state.tasks[k].state == "erred"),
                       key=repr)
        if erred:
            self.sim.record(self.state.retry("c1", [pick(erred, i)], self.sim.sid("retry")))
            self.remember_told()

    @rule(max_keys=st.sampled_from([None, 1, 3]))
    def cluster_restarts(self, max_keys):
        """Client.restart, whole or in slices: every task is forgotten and every client
        told (at most once a run: it empties the state, and later rules build it up
        again)."""
        if self.n_restarts:
            return
        self.n_restarts += 1
        wanted = {client: self.wanted(client) for client in ("c1", "c2")}
        told: dict = {}
        for _ in range(1000):
            client_msgs, _ = self.sim.record(self.state.restart(self.sim.sid("restart"),
                                                                max_keys=max_keys))
            for client, msgs in client_msgs.items():
                told.setdefault(client, []).extend(k for msg in msgs for k in msg["keys"])
            if not self.state.tasks:
                break
        told = {client: sorted(keys, key=repr) for client, keys in told.items()}
        assert told == {client: keys for client, keys in wanted.items() if keys}
        assert self.state.tasks == {}
        assert not any(self.sim.computing.values()) and not any(self.sim.data.values())

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def workers_hold_and_run_what_the_scheduler_thinks(self):
        if self.sim is None:
            return
        self.sim.check_workers_agree()
        for address, ws in self.state.workers.items():
            assert set(self.sim.computing[address]) == {ts.key for ts in ws.processing}

    @invariant()
    def needed_results_stay_in_memory(self):
        """A result that is still needed is never released while a holder still has it."""
        if self.sim is None:
            return
        if self.check_needed_results_kept:
            for key, holders in self.in_memory.items():
                ts = self.state.tasks.get(key)
                if ts is None or ts.state == "memory":
                    continue
                if all((key, address) in self.lost for address in holders):
                    continue
                assert ts.who_wants is None and ts.n_waiters == 0, \
                    f"{key!r} was released although still needed and held by {holders}"
        self.in_memory = {key: {ws.address for ws in ts.who_has}
                          for key, ts in self.state.tasks.items() if ts.state == "memory"}
        # A departing worker's results stay lost until its departure is over.
        self.lost = {(key, address) for key, address in self.lost
                     if address in self.state.departing}

    @invariant()
    def adaptive_answers_follow_the_work(self):
        """adaptive_target never counts out a busy worker and wants a worker while any
        task waits; workers_to_close names running workers, idle ones first; check_idle
        says None exactly while some task is left to run."""
        if self.sim is None:
            return
        state = self.state
        running = [ws for ws in state.workers.values() if ws.status == "running"]
        busy = {ws.address for ws in running if ws.processing}
        counts = state.task_counts()
        to_run = sum(counts[s] for s in ("waiting", "queued", "no-worker", "processing"))
        target = state.adaptive_target(5.0)
        if any(ws.has_what for ws in running):
            assert target >= 1  # held results need a worker to live on
        if to_run:
            assert target >= 1
            assert state.check_idle() is None
        else:
            assert state.check_idle() is not None
        closing = state.workers_to_close(len(running))
        assert sorted(closing) == sorted(ws.address for ws in running)
        n_idle = len(running) - len(busy)
        assert not busy & set(closing[:n_idle]), closing

    # -- the end -------------------------------------------------------------------------------

    def teardown(self):
        if self.sim is None:
            return
        for address in POOL:
            if address not in self.state.workers:
                self.join(address, 2)
        self.sim.run_all()
        counts = self.state.task_counts()
        assert not any(counts[s] for s in ACTIVE), counts
        for client in ("c1", "c2"):
            for key in self.wanted(client):
                assert self.state.tasks[key].state in ("memory", "erred"), key

        self.sim.release(self.wanted("c1"), client="c1")
        self.sim.remove_client("c2")
        self.sim.remove_client("c1")
        for _ in range(1000):
            if not self.state.forget_backlog:
                break
            self.sim.record(self.state.forget_more(self.sim.sid("forget")))
        assert self.state.forget_backlog == 0
        assert self.state.tasks == {}
        assert self.state.n_queued == 0 and len(self.state.unrunnable) == 0
        for ws in self.state.workers.values():
            assert (len(ws.has_what), ws.nbytes, len(ws.processing)) == (0, 0, 0)
        assert not any(self.sim.data.values())


TestScheduler = SchedulerMachine.TestCase


class KeepsNeededResults(SchedulerMachine):
    """The same, also checking that no step releases a result that is still needed."""

    check_needed_results_kept = True


TestKeepsNeededResults = KeepsNeededResults.TestCase




class StealsWithoutQueue(SchedulerMachine):
    """The same with queuing off (``worker_saturation=inf``): every runnable task goes to
    a worker at once, so balance finds the most to move (with tasks queued in the
    scheduler it moves nothing: the queue feeds every worker with room)."""

    @initialize(allowed_failures=st.integers(1, 3),
                workers=st.lists(st.sampled_from(POOL), min_size=1, max_size=4, unique=True),
                nthreads=st.integers(1, 3), graph=graphs("t"), in_part=st.booleans())
    def start(self, allowed_failures, workers, nthreads, graph, in_part):
        SchedulerMachine.start(self, float("inf"), allowed_failures, workers, nthreads, graph,
                               forget_slice=None, in_part=in_part)


TestStealsWithoutQueue = StealsWithoutQueue.TestCase
