"""The seams between the client's modules: what futures need from a client
(`FutureClient`), who imports whom, the key table as the one owner of the key states
(`KeyTable`, driven directly), and the peer connection pool that clients and workers
share (`PeerPool`, over real sockets)."""
from __future__ import annotations

import ast
import asyncio
import pathlib

import pytest
from server_helpers import echo, run

import distributed_server
from distributed_server.client import key_table
from distributed_server.client.client import Client
from distributed_server.client.futures import (
    CANCELLED,
    ERROR,
    FINISHED,
    PENDING,
    FutureClient,
    GraphRefusedError,
    KeyState,
    SchedulerConnectionError,
    TaskFailedError,
)
from distributed_server.client.key_table import KeyTable
from distributed_server.comm import listen
from distributed_server.comm.peer_pool import PeerPool

PACKAGE = pathlib.Path(distributed_server.__file__).parent


def _imported_modules(name: str) -> set[str]:
    """The modules ``distributed_server/<name>.py`` imports (relative ones as ``.x``)."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_modules_the_client_is_made_of_do_not_import_it():
    for name in ("client/futures", "client/task_specs", "client/scheduler_comm",
                 "client/dask_compute", "client/transfers", "client/loop_thread",
                 "client/key_table", "client/results", "client/scatter",
                 "client/cluster_info", "client/cluster_control", "client/history",
                 "client/worker_calls", "client/datasets", "comm/peer_pool"):
        imported = _imported_modules(name)
        assert ".client" not in imported, name
        assert "distributed_server.client.client" not in imported, name


def _protocol_members() -> set[str]:
    members = set(FutureClient.__annotations__)
    members.update(name for name, value in vars(FutureClient).items()
                   if callable(value) and not name.startswith("__"))
    return members


def _client_attributes_used(name: str) -> set[str]:
    """The attributes ``distributed_server/<name>.py`` reads of anything it calls a
    client (``client.x``, ``self.client.x``, ``self._client.x``)."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "client") or (
                    isinstance(owner, ast.Attribute) and owner.attr in ("client", "_client")):
                used.add(node.attr)
    return used


def test_futures_reach_their_client_only_through_the_protocol():
    members = _protocol_members()
    assert {"_hold_key", "_release_later", "_sync", "asynchronous"} <= members
    for name in ("client/futures", "client/task_specs"):
        assert _client_attributes_used(name) <= members, name


def test_the_client_implements_the_protocol():
    client = Client.__new__(Client)  # not started: only its members are looked at
    client._asynchronous, client._loop_thread_id = False, None
    assert isinstance(client, FutureClient)
    assert _protocol_members() <= set(dir(client))


def _client_modules() -> list[pathlib.Path]:
    return sorted((PACKAGE / "client").glob("*.py"))


def test_only_the_key_table_changes_reference_counts_or_the_table_of_keys():
    for path in _client_modules():
        if path.name == "key_table.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else node.targets if isinstance(node, ast.Delete) else [])
            for target in targets:
                if isinstance(target, ast.Subscript):
                    target = target.value
                # (``self.refs = 0`` is KeyState making its own slot)
                assert not (isinstance(target, ast.Attribute)
                            and target.attr in ("refs", "states", "_states")
                            and not (isinstance(target.value, ast.Name)
                                     and target.value.id == "self")), (
                    f"{path.name}:{node.lineno} changes {target.attr}")


def test_no_client_module_is_over_800_lines():
    long = {path.name: n for path in _client_modules()
            if (n := len(path.read_text().splitlines())) > 800}
    assert not long, long


class _Outbox:
    """What a `KeyTable` sends, recorded (a `SchedulerComm` stand-in)."""

    def __init__(self) -> None:
        self.sent: list = []
        self.reqids = iter(range(1, 100))

    def post(self, item) -> None:
        self.sent.append(item)

    send_now = send_in_order = post

    def next_reqid(self) -> int:
        return next(self.reqids)


def _key_table(running: bool = True) -> tuple[KeyTable, _Outbox]:
    def check_running():
        if not running:
            raise SchedulerConnectionError("closed")

    table = KeyTable(check_running, lambda: running)
    table.outbox = _Outbox()
    return table, table.outbox


def test_the_key_table_counts_references_and_releases_on_the_last():
    table, outbox = _key_table()
    first, again = table.register([{"key": "x"}, {"key": "y"}], ["x", "x"])
    assert first is again and first.refs == 2
    assert outbox.sent == [{"op": "update-graph", "tasks": [{"key": "x"}, {"key": "y"}],
                            "keys": ["x"]}]
    assert table.hold("x") is first and first.refs == 3
    assert len(outbox.sent) == 1  # a key held already: nothing asked
    assert [table.drop_reference(first) for _ in range(3)] == [False, False, True]
    assert table.held_keys() == []
    table.hold("z")
    assert outbox.sent[-1] == {"op": "desire-keys", "keys": ["z"]}


def test_the_key_table_sends_the_keys_a_run_of_drops_releases_in_batches(monkeypatch):
    monkeypatch.setattr(key_table, "RELEASE_BATCH_KEYS", 2)
    table, outbox = _key_table()
    kept, *gone = table.hold_all(["k", "a", "b", "c"])
    kept.refs += 1  # a second Future of "k": its drop releases nothing
    table.release([kept, *gone])
    assert outbox.sent == [{"op": "release-keys", "keys": ["a", "b"]},
                           {"op": "release-keys", "keys": ["c"]}]
    assert table.held_keys() == ["k"]


def test_the_key_table_applies_the_schedulers_key_messages():
    table, _ = _key_table()
    done, failed, cancelled, refused = table.hold_all(["a", "b", "c", "d"])
    handlers = table.handlers()
    handlers["key-in-memory"]({"key": "a", "data": b"x", "type": "int"})
    handlers["task-erred"]({"key": "b", "text": "boom"})
    handlers["cancelled-keys"]({"keys": ["c"], "reason": "restart"})
    handlers["graph-refused"]({"keys": ["d"], "error": "too big"})
    handlers["key-in-memory"]({"key": "unknown"})  # not held: ignored
    assert (done.status, failed.status, cancelled.status, refused.status) == (
        FINISHED, ERROR, CANCELLED, ERROR)
    assert isinstance(failed.exception(), TaskFailedError)
    assert isinstance(refused.exception(), GraphRefusedError)
    assert table.refusals == 1 and table.held_keys() == ["a", "b"]


def test_the_key_table_takes_the_echo_of_its_own_cancel_as_no_news():
    table, outbox = _key_table()
    state = table.hold_all(["x"])[0]
    table.cancel([state], force=False)
    assert outbox.sent == [{"op": "cancel", "keys": ["x"], "force": False, "reqid": 1}]
    assert state.status == CANCELLED and table.held_keys() == []
    again = table.hold_all(["x"])[0]  # held again before the echo came
    table.handlers()["cancelled-keys"]({"keys": ["x"], "reqid": 1})
    assert again.status == PENDING and table.held_keys() == ["x"]


def test_a_closed_client_holds_no_key_and_releases_nothing():
    table, outbox = _key_table(running=False)
    with pytest.raises(SchedulerConnectionError):
        table.hold("x")
    table.release_later(KeyState("x"))
    table.release_temporary(["x"])
    assert outbox.sent == []


def test_a_peer_pool_reuses_an_idle_connection_and_keeps_at_most_max_idle():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {"role": "worker"})
        pool = PeerPool(None, max_idle=1)
        hello = {"role": "client", "client_id": "test"}
        try:
            first = await pool.connection(listener.address, hello, timeout=5)
            second = await pool.connection(listener.address, hello, timeout=5)
            assert first is not second
            await first.write([{"op": "ping"}])
            assert await first.read() == [{"op": "ping"}]
            pool.give_back(listener.address, first)
            pool.give_back(listener.address, second)  # over max_idle: aborted
            assert second.closed and not first.closed
            assert pool.idle(listener.address) == 1
            assert await pool.connection(listener.address, hello, timeout=5) is first
            pool.give_back(listener.address, first, keep=False)
            assert first.closed
        finally:
            pool.close()
            await listener.stop()

    run(main())


def test_a_peer_pool_skips_closed_idle_connections_and_keeps_none_once_closed():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {"role": "worker"})
        pool = PeerPool(None, max_idle=4)
        hello = {"role": "client", "client_id": "test"}
        try:
            comm = await pool.connection(listener.address, hello, timeout=5)
            pool.give_back(listener.address, comm)
            comm.abort()  # e.g. the worker went away while the connection was idle
            fresh = await pool.connection(listener.address, hello, timeout=5)
            assert fresh is not comm and not fresh.closed
            pool.give_back(listener.address, fresh)
            pool.close()
            assert fresh.closed
            late = await pool.connection(listener.address, hello, timeout=5)
            pool.give_back(listener.address, late)  # after close: not kept
            assert late.closed
            await asyncio.sleep(0)
        finally:
            pool.close()
            await listener.stop()

    run(main())
