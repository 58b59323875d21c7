"""The seams between the client's modules: what futures need from a client
(`FutureClient`), who imports whom, and the peer connection pool that clients and workers
share (`PeerPool`, over real sockets)."""
from __future__ import annotations

import ast
import asyncio
import pathlib

from server_helpers import echo, run

import distributed_server
from distributed_server.client.client import Client
from distributed_server.client.futures import FutureClient
from distributed_server.comm.framing import listen
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
                 "comm/peer_pool"):
        imported = _imported_modules(name)
        assert ".client" not in imported and "distributed_server.client.client" not in imported, name


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
    client.asynchronous = False
    assert isinstance(client, FutureClient)
    assert _protocol_members() <= set(dir(client))


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
