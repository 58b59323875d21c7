"""Plugins end to end: real ``dcore`` processes on loopback.

Worker plugins go from a client through a validating scheduler (which keeps them as
bytes) to the workers of nannies: set up on the workers connected at registration and on
one that joins later, told of task transitions, torn down when unregistered; a failing
setup comes back to the client as its exception. Scheduler plugins cannot come from a
client: the refusal says how to install one, and a scheduler started with ``--preload``
of a real file runs one, whose hooks write what they saw to a file.
"""
import json
import sys
import textwrap

import cloudpickle
import pytest
from server_helpers import one_nanny_cluster, wait_for

from distributed_server import Client, SchedulerPlugin, WorkerPlugin, get_worker
from distributed_server.client.futures import SchedulerError
from distributed_server.plugins import NannyPluginRefused, SchedulerPluginRefused

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def inc(x):
    return x + 1


class Marker(WorkerPlugin):
    """Sets ``worker.marker``; records the transitions it is told of; its teardown
    sets ``worker.marker_torn_down``."""

    name = "marker"

    def __init__(self, value):
        self.value = value
        self.transitions = []

    def setup(self, worker):
        worker.marker = self.value

    def teardown(self, worker):
        worker.marker_torn_down = self.value

    def transition(self, key, start, finish, **kwargs):
        self.transitions.append((key, start, finish, kwargs["stimulus_id"]))


class Failing(WorkerPlugin):
    def setup(self, worker):
        raise ValueError("setup went wrong on purpose")


class DuckTyped:
    """No base class: dask's register_worker_plugin accepts any object with setup()."""

    async def setup(self, worker):
        worker.duck = "quack"


class NotAPlugin:
    pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A validating scheduler and one nanny of one worker with two threads."""
    with one_nanny_cluster(tmp_path_factory.mktemp("plugins"), "--nthreads", "2") as processes:
        yield processes


@pytest.fixture
def client(cluster):
    with Client(cluster.address, security=cluster.security, set_as_default=False) as c:
        c.wait_for_workers(1, timeout=30)
        yield c
    cluster.assert_no_errors()


def on_workers(client, function) -> dict:
    return client.run(function)


def test_a_worker_plugin_is_set_up_on_every_worker_and_sees_transitions(client):
    workers = list(client.scheduler_info()["workers"])
    assert client.register_plugin(Marker("first")) == {w: {"status": "OK"} for w in workers}
    assert set(on_workers(client, lambda dask_worker: dask_worker.marker).values()) == {
        "first"}
    assert client.submit(inc, 1, key="watched").result(timeout=30) == 2

    def seen(dask_worker):
        return [t[:3] for t in dask_worker.plugins["marker"].transitions if t[0] == "watched"]

    moves = [move for moves in on_workers(client, seen).values() for move in moves]
    assert ("watched", "executing", "memory") in moves
    assert client.submit(lambda: get_worker().marker).result(timeout=30) == "first"
    client.unregister_worker_plugin("marker")
    assert set(on_workers(client, lambda dask_worker: (
        "marker" in dask_worker.plugins, dask_worker.marker_torn_down)).values()) == {
        (False, "first")}


def test_registering_a_name_again_replaces_the_plugin(client):
    client.register_plugin(Marker("one"))
    client.register_plugin(Marker("two"))
    assert set(on_workers(client, lambda dask_worker: (
        dask_worker.marker, dask_worker.marker_torn_down)).values()) == {("two", "one")}
    client.register_plugin(Marker("three"), idempotent=True)  # kept: "two" stays
    assert set(on_workers(client, lambda dask_worker: dask_worker.marker).values()) == {
        "two"}
    client.unregister_worker_plugin("marker")


def test_a_worker_that_joins_later_gets_the_plugins(cluster, client):
    client.register_worker_plugin(Marker("for-everyone"))  # dask's older name
    cluster.nanny("--nthreads", "1", name="late", log="late.log")
    client.wait_for_workers(2, timeout=60)
    markers = on_workers(client, lambda dask_worker: dask_worker.marker)
    assert len(markers) == 2 and set(markers.values()) == {"for-everyone"}
    client.unregister_worker_plugin("marker")


def test_a_failing_setup_raises_in_the_client_and_the_plugin_is_removed(client):
    with pytest.raises(ValueError, match="setup went wrong on purpose") as info:
        client.register_plugin(Failing(), name="failing")
    assert "remote traceback" in str(info.value.__cause__).lower()
    assert not any(on_workers(client, lambda dask_worker: "failing" in dask_worker.plugins)
                   .values())
    with pytest.raises(ValueError, match="The worker plugin failing does not exist"):
        client.unregister_worker_plugin("failing")


def test_a_duck_typed_plugin_with_an_async_setup(client):
    client.register_worker_plugin(DuckTyped(), name="duck")
    assert set(on_workers(client, lambda dask_worker: dask_worker.duck).values()) == {"quack"}
    client.unregister_worker_plugin("duck")


def test_scheduler_and_nanny_plugins_are_refused_with_what_to_do(client):
    class Mine(SchedulerPlugin):
        pass

    with pytest.raises(SchedulerPluginRefused, match="--preload") as info:
        client.register_plugin(Mine())
    assert "scheduler.add_plugin(Mine(...))" in str(info.value)
    dasks = type("SchedulerPlugin", (), {"__module__": "distributed.diagnostics.plugin"})
    with pytest.raises(SchedulerPluginRefused):
        client.register_plugin(type("Theirs", (dasks,), {})())
    nanny = type("NannyPlugin", (), {"__module__": "distributed.diagnostics.plugin"})
    with pytest.raises(NannyPluginRefused, match="not supported"):
        client.register_plugin(type("Theirs", (nanny,), {"setup": lambda s, n: None})())
    with pytest.raises(NannyPluginRefused):
        client.register_worker_plugin(Marker("x"), nanny=True)
    with pytest.raises(TypeError, match="not a plugin"):
        client.register_plugin(NotAPlugin())
    with pytest.raises(TypeError, match="not the class"):
        client.register_plugin(Marker)
    with pytest.raises(TypeError, match="name must be a str"):
        client.register_plugin(Marker("x"), name=3)


def test_the_scheduler_refuses_a_malformed_registration(client):
    with pytest.raises(SchedulerError, match="must be the plugin's pickle"):
        client._sync(lambda: client._request("register-worker-plugin", name="x",
                                             plugin="not bytes"))
    with pytest.raises(SchedulerError, match="timeout"):
        client._sync(lambda: client._request("register-worker-plugin", name="x",
                                             plugin=b"x", timeout=-1))


# ---------------------------------------------------------------- scheduler plugins

PRELOAD = '''
import json
import os

from distributed_server import SchedulerPlugin

EVENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "events.jsonl")


def record(*event):
    with open(EVENTS, "a") as f:
        f.write(json.dumps(event) + "\\n")


class Recorder(SchedulerPlugin):
    name = "recorder"

    async def start(self, scheduler):
        record("start", scheduler.address)

    async def close(self):
        record("close")

    def add_worker(self, scheduler, worker):
        record("add_worker", worker)

    def remove_worker(self, scheduler, worker, **kwargs):
        record("remove_worker", worker)

    def add_client(self, scheduler, client):
        record("add_client", client)

    def update_graph(self, scheduler, *, client, keys, tasks, dependencies, **kwargs):
        record("update_graph", client, sorted(map(str, keys)), sorted(map(str, tasks)),
               {str(k): sorted(map(str, v)) for k, v in dependencies.items()})

    def transition(self, key, start, finish, **kwargs):
        record("transition", str(key), start, finish)


def dcore_setup(scheduler):
    scheduler.add_plugin(Recorder())
'''


def events(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_scheduler_plugin_from_a_preload_file_sees_the_scheduler(tmp_path):
    preload = tmp_path / "recorder_preload.py"
    preload.write_text(textwrap.dedent(PRELOAD))
    path = tmp_path / "events.jsonl"
    with one_nanny_cluster(tmp_path, "--nthreads", "1",
                           scheduler_args=["--preload", str(preload)]) as processes:
        with Client(processes.address, security=processes.security,
                    set_as_default=False) as client:
            client.wait_for_workers(1, timeout=30)
            first = client.submit(inc, 1, key="sp-1")
            assert client.submit(inc, first, key="sp-2").result(timeout=30) == 3
            worker = list(client.scheduler_info()["workers"])[0]
            client_id = client.id
        wait_for(lambda: ["transition", "sp-1", "released", "forgotten"] in events(path))
        processes.nanny("--nthreads", "1", name="second", log="second.log")
        wait_for(lambda: len([e for e in events(path) if e[0] == "add_worker"]) == 2)
        processes.procs[-1].terminate()  # that nanny and its worker leave
        wait_for(lambda: [e for e in events(path) if e[0] == "remove_worker"])
    seen = events(path)
    assert seen[0] == ["start", processes.address]
    assert ["add_worker", worker] in seen and ["add_client", client_id] in seen
    graphs = [e for e in seen if e[0] == "update_graph"]
    assert ["update_graph", client_id, ["sp-1"], ["sp-1"], {"sp-1": []}] in graphs
    assert ["update_graph", client_id, ["sp-2"], ["sp-2"], {"sp-2": ["sp-1"]}] in graphs
    moves = [tuple(e[1:]) for e in seen if e[0] == "transition"]
    assert ("sp-1", "processing", "memory") in moves
    assert ("sp-2", "waiting", "processing") in moves
    second = [e[1] for e in seen if e[0] == "add_worker" and e[1] != worker]
    removed = [e[1] for e in seen if e[0] == "remove_worker"]
    assert removed[0] == second[0] and set(removed) <= {worker, *second}
    assert seen[-1] == ["close"], seen[-5:]  # and no hook after it


def test_a_scheduler_plugin_that_raises_is_logged_and_the_others_still_hear(caplog):
    from types import SimpleNamespace

    from distributed_core import SchedulerState
    from distributed_server.scheduler.plugins import SchedulerPluginHooks

    class Broken(SchedulerPlugin):
        def transition(self, key, start, finish, **kwargs):
            raise RuntimeError("broken on purpose")

    class Quiet(SchedulerPlugin):
        """Defines no transition: the state machine records nothing for it."""

    heard = []
    scheduler = SimpleNamespace(state=SchedulerState(validate=True), address="")
    hooks = SchedulerPluginHooks(scheduler)
    hooks.add(Quiet(), name="quiet")
    assert not hooks.watchers
    hooks.add(Broken(), name="broken")
    hooks.add(type("Ear", (SchedulerPlugin,), {
        "transition": lambda self, *args, **kwargs: heard.append(args)})(), name="ear")
    state = scheduler.state
    state.add_worker("tcp://w:1", 1, "join")
    state.update_graph("c", [{"key": "x", "spec": b"s"}], ["x"], "graph")
    with caplog.at_level("ERROR"):
        hooks.notify_transitions()
    assert heard == [("x", "released", "waiting"), ("x", "waiting", "processing")]
    assert "'broken' failed in transition (1 failures so far)" in caplog.text
    assert len(caplog.records) == 1  # the first failure (then every 1,000th)
    hooks.remove("broken")
    hooks.remove("ear")
    state.task_finished("tcp://w:1", [{"op": "task-finished", "key": "x", "nbytes": 1}],
                        "done")
    assert state.take_transitions() == []  # no watcher left: nothing recorded
