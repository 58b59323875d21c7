"""Hypothesis fuzz of the scheduler's port and a worker's peer port (issue 10, item 6).

An in-process ``Scheduler(validate=True)`` and ``Worker`` share a token and one event
loop in a background thread. Examples throw at them:

- before the handshake: random bytes, random msgpack in a frame, hellos with random
  fields (and handshakes with made-up proofs), random frame headers. The listener must
  never admit the peer (never answer with a ``handshake``) and must close the connection.
- after a valid token handshake: clients and workers with random handshake info, sending
  random message dicts (the ops the scheduler knows, and others) with fields of random
  types and half-plausible graphs, plus random frame headers on the admitted stream; and
  peers of the worker sending random ``get-data``/``put-data``/``ping`` requests.

Clients also send the coordination primitives' messages (variables, queues, locks, ...).
After every example the scheduler's state validates (and the primitives' bookkeeping,
which keeps nothing of a departed client), the real worker is still
registered, every attacking connection is gone, and nothing was logged at ERROR by
``distributed_server`` (a bug, never bad input: docs/architecture.md, "Stimuli are
transactions").
At the end an honest round trip (update-graph of one task, computed by the real worker,
key-in-memory back) still works.
"""
from __future__ import annotations

import asyncio
import logging
import operator
import os
import pickle
import socket
import struct
import threading
import uuid

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import raw_frame_from_body

from distributed_server.comm.addresses import parse_address
from distributed_server.comm.connector import connect
from distributed_server.comm.framing import CommClosedError, HandshakeError
from distributed_server.comm.handshake import PROTOCOL_VERSION
from distributed_server.protocol.serialize import Call, dumps_spec
from distributed_server.scheduler.coordination import OPS as COORDINATION_OPS
from distributed_server.scheduler.server import Scheduler
from distributed_server.security import Security
from distributed_server.worker.server import Worker

#: DCORE_FUZZ_EXAMPLES=1000 for a deeper run than CI's.
EXAMPLES = int(os.environ.get("DCORE_FUZZ_EXAMPLES", "50"))
pytestmark = pytest.mark.timeout(120 * max(1, EXAMPLES // 50))

SECURITY = Security(token="fuzz-token-" + "t" * 24)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
GOOD_SPEC = dumps_spec(Call(operator.add, (1, 2)))
WORKER = "$worker"  # replaced by the real worker's address when sent
FAKE_WORKER = "$fake"  # replaced by an address where nothing listens


# ---------------------------------------------------------------- the servers


class Harness:
    """A scheduler and a worker on an event loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="fuzz-loop")
        self.thread.start()
        self.scheduler = self.call(Scheduler(validate=True, security=SECURITY).start())
        self.worker = self.call(Worker(self.scheduler.address, nthreads=1,
                                       security=SECURITY, connect_timeout=0.5).start())
        with socket.socket() as s:  # a port where nothing listens
            s.bind(("127.0.0.1", 0))
            self.fake_address = f"tcp://127.0.0.1:{s.getsockname()[1]}"

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def substitute(self, value):
        """Place the real worker's (and a dead) address where the strategies say."""
        if value == WORKER:
            return self.worker.address
        if value == FAKE_WORKER:
            return self.fake_address
        if type(value) is list or type(value) is tuple:
            return [self.substitute(v) for v in value]
        if type(value) is dict:
            return {self.substitute(k) if isinstance(k, str) else k: self.substitute(v)
                    for k, v in value.items()}
        return value

    async def settle(self) -> None:
        """Wait until every attacker is gone; then the state must validate."""
        scheduler, worker = self.scheduler, self.worker
        for _ in range(500):
            if not scheduler.client_comms and set(scheduler.worker_comms) == {worker.address} \
                    and scheduler._listener.n_open == 1 and worker._listener.n_open == 0:
                break
            await asyncio.sleep(0.01)
        assert set(scheduler.worker_comms) == {worker.address}, scheduler.worker_comms
        assert not scheduler.client_comms, scheduler.client_comms
        assert scheduler._listener.n_open == 1, scheduler._listener
        assert worker._listener.n_open == 0, worker._listener
        scheduler.state.validate_state()
        scheduler.coordination.validate()
        assert not scheduler.coordination.clients, scheduler.coordination.clients

    def close(self) -> None:
        self.call(self.worker.close())
        self.call(self.scheduler.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def harness():
    h = Harness()
    yield h
    h.close()


@pytest.fixture
def no_errors(caplog):
    """Fails the test if distributed_server logs anything at ERROR (checked per example
    by `check_example` too, so that the failing example is the one reported)."""
    caplog.set_level(logging.WARNING)
    yield caplog
    assert not _errors(caplog)


def _errors(caplog, since: int = 0) -> list:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records[since:]
            if r.levelno >= logging.ERROR and r.name.startswith("distributed_server")]


def check_example(harness: Harness, caplog, since: int) -> None:
    harness.call(harness.settle())
    errors = _errors(caplog, since)
    assert not errors, errors


# ---------------------------------------------------------------- strategies

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.binary(max_size=8))  # short: a worker may unpickle it (put-data, specs)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6) | st.integers(-3, 3), inner, max_size=4),
    max_leaves=10)
small_keys = st.sampled_from(["a", "b", "c", ("t", 0), ("t", 1), 1, 1.0, "honest"])
keys = small_keys | scalars
key_lists = st.lists(keys, max_size=4) | anything
addresses = st.sampled_from([WORKER, FAKE_WORKER, "tcp://127.0.0.1:1", "nonsense"])
task = st.fixed_dictionaries(
    {"key": keys},
    optional={
        "spec": st.sampled_from([GOOD_SPEC, b"\x80\x05not a pickle"]) | anything,
        "deps": st.lists(small_keys, max_size=3) | anything,
        "priority": st.integers(-5, 5) | anything,
        "order": st.integers(0, 5) | anything,
        "retries": st.integers(0, 2) | anything,
        "workers": st.lists(addresses, max_size=2) | anything,
        "allow_other_workers": st.booleans() | anything,
        "resources": st.dictionaries(st.text(max_size=3), st.integers(0, 2), max_size=2)
        | anything,
        "annotations": anything,
    })
FIELDS = {
    "key": keys,
    "keys": key_lists,
    "tasks": st.lists(task, max_size=4) | anything,
    "who_has": st.dictionaries(small_keys, st.lists(addresses, max_size=2), max_size=3)
    | anything,
    "nbytes": st.dictionaries(small_keys, st.integers(-1, 2**63), max_size=3) | anything,
    "force": st.booleans() | anything,
    "reqid": st.integers(0, 10) | anything,
    "data": st.sampled_from([pickle.dumps(3)]) | anything,
    "exception": anything,
    "traceback": anything,
    "text": anything,
    "type": anything,
    "start": st.floats() | anything,
    "stop": st.floats() | anything,
    "errant_worker": addresses | anything,
    "spec": anything,
    # coordination primitives
    "name": st.sampled_from(["n1", "n2"]) | anything,
    "value": st.sampled_from([pickle.dumps(1), b"opaque"]) | anything,
    "timeout": st.none() | st.sampled_from([0, 0.01, 0.05]) | anything,
    "maxsize": st.integers(0, 2) | anything,
    "batch": st.booleans() | st.integers(1, 2) | anything,
    "holder": st.sampled_from(["h1", "h2"]) | anything,
    "max_leases": st.integers(1, 2) | anything,
    "sub_id": st.integers(0, 2) | anything,
    "handoff": st.integers(0, 3) | anything,
}
COORDINATION_OPS = sorted(COORDINATION_OPS)
CLIENT_OPS = ["update-graph", "update-data", "release-keys", "desire-keys", "cancel",
              "retry", "who-has", "identity", "heartbeat", "story", "scheduler-logs",
              "worker-logs", "task-stream", *COORDINATION_OPS]
WORKER_OPS = ["task-finished", "task-erred", "missing-data", "reschedule", "heartbeat",
              "reply"]
PEER_OPS = ["get-data", "put-data", "ping"]


@st.composite
def plausible_graphs(draw) -> dict:
    """An update-graph an honest client could send: distinct keys, dependencies on
    earlier tasks of the graph (or on keys that may already exist)."""
    graph_keys = draw(st.lists(small_keys, min_size=1, max_size=4, unique=True))
    tasks = []
    for i, key in enumerate(graph_keys):
        task = {"key": key,
                "spec": draw(st.sampled_from([GOOD_SPEC, GOOD_SPEC, b"\x80\x05no pickle"]))}
        deps = draw(st.lists(st.sampled_from(graph_keys[:i]) if i else small_keys,
                             max_size=2, unique=True))
        if deps:
            task["deps"] = deps
        task.update(draw(st.fixed_dictionaries({}, optional={
            "priority": st.integers(-2, 2), "retries": st.integers(0, 2),
            "workers": st.lists(addresses, min_size=1, max_size=2),
            "allow_other_workers": st.booleans()})))
        tasks.append(task)
    wanted = draw(st.lists(st.sampled_from(graph_keys), min_size=1, unique=True))
    return {"tasks": tasks, "keys": wanted}


report = {"key": small_keys, "nbytes": st.integers(0, 100), "type": st.just("int"),
          "start": st.just(1.0), "stop": st.just(1.5)}
#: Messages as an honest peer would send them (then mutated or replaced by the fuzz).
PLAUSIBLE = {
    "update-data": {"who_has": st.dictionaries(
        small_keys, st.lists(st.sampled_from([WORKER, FAKE_WORKER]), min_size=1, max_size=2),
        min_size=1, max_size=3),
        "nbytes": st.dictionaries(small_keys, st.integers(0, 100), max_size=3)},
    "release-keys": {"keys": st.lists(small_keys, max_size=3)},
    "desire-keys": {"keys": st.lists(small_keys, max_size=3)},
    "cancel": {"keys": st.lists(small_keys, max_size=3), "force": st.booleans()},
    "retry": {"keys": st.lists(small_keys, max_size=3)},
    "who-has": {"keys": st.lists(small_keys, max_size=3), "reqid": st.integers(0, 9)},
    "identity": {"reqid": st.integers(0, 9)},
    "heartbeat": {},
    "story": {"keys": st.lists(small_keys, min_size=1, max_size=3),
              "timeout": st.just(0.2), "reqid": st.integers(0, 9)},
    "scheduler-logs": {"n": st.none() | st.integers(0, 5), "reqid": st.integers(0, 9)},
    "worker-logs": {"n": st.none() | st.integers(0, 5), "timeout": st.just(0.2),
                    "reqid": st.integers(0, 9)},
    "task-stream": {"start": st.none() | st.floats(), "stop": st.none() | st.floats(),
                    "reqid": st.integers(0, 9)},
    "reply": {"reqid": st.integers(0, 9), "result": anything},
    "task-finished": {**report, "data": st.just(pickle.dumps(3))},
    "task-erred": {"key": small_keys, "exception": st.none() | st.just(b"x"),
                   "traceback": st.none() | st.just(b"tb"), "text": st.just("boom"),
                   "start": st.just(1.0), "stop": st.just(1.5)},
    "missing-data": {"key": small_keys, "errant_worker": addresses},
    "reschedule": {"key": small_keys},
    "get-data": {"keys": st.lists(small_keys, max_size=3)},
    "put-data": {"data": st.dictionaries(small_keys, st.just([pickle.dumps(7)]), max_size=2)},
    "ping": {},
    **{op: {"reqid": st.integers(0, 9), "name": st.sampled_from(["n1", "n2"]),
            "value": st.sampled_from([pickle.dumps(1), b"opaque"]),
            "keys": st.lists(small_keys, max_size=2),
            "timeout": st.none() | st.sampled_from([0, 0.01, 0.05]),
            "maxsize": st.integers(0, 2), "batch": st.booleans() | st.integers(1, 2),
            "holder": st.sampled_from(["h1", "h2"]), "max_leases": st.integers(1, 2),
            "sub_id": st.integers(0, 2), "handoff": st.integers(0, 3)}
       for op in COORDINATION_OPS},
}


def plausible_messages(ops: list) -> st.SearchStrategy:
    """Messages of ``ops`` as an honest peer would send them."""
    return st.one_of([
        st.builds(lambda graph: {"op": "update-graph", **graph}, plausible_graphs())
        if op == "update-graph" else st.fixed_dictionaries({"op": st.just(op), **PLAUSIBLE[op]})
        for op in ops])


def messages(ops: list) -> st.SearchStrategy:
    """Well-formed messages of ``ops``, the same with one field swapped for anything,
    and messages of random fields (and random ops)."""
    plausible = plausible_messages(ops)
    mutated = st.builds(lambda msg, field, value: {**msg, field: value}, plausible,
                        st.sampled_from(sorted(FIELDS)), anything)
    random = st.fixed_dictionaries(
        {"op": st.sampled_from(ops) | st.text(max_size=8)},
        optional={name: strategy for name, strategy in FIELDS.items()})
    return plausible | mutated | random


def frame_headers() -> st.SearchStrategy:
    """Bytes that start a frame: a random header and a little of what it announces."""
    counts = st.integers(0, 4) | st.integers(0, 2**64 - 1)
    lengths = st.integers(0, 64) | st.integers(0, 2**64 - 1)
    return st.builds(
        lambda n, body, extra, tail: struct.pack("<QQ", n, body)
        + b"".join(struct.pack("<Q", x) for x in extra) + tail,
        counts, lengths, st.lists(lengths, max_size=3), st.binary(max_size=64))


def hellos() -> st.SearchStrategy:
    """A hello with random fields, maybe followed by a handshake with a made-up proof."""
    hello = st.fixed_dictionaries(
        {"op": st.just("hello")},
        optional={"protocol": st.just(PROTOCOL_VERSION) | anything,
                  "auth": st.sampled_from(["token", "none"]) | anything,
                  "nonce": st.binary(min_size=32, max_size=32) | anything})
    handshake = st.fixed_dictionaries(
        {"op": st.just("handshake")},
        optional={"proof": st.binary(min_size=32, max_size=32) | anything,
                  "role": st.sampled_from(["client", "worker", "peer"]) | anything,
                  "client_id": anything, "address": addresses, "nthreads": anything})
    return st.builds(
        lambda h, s: _frame([h]) + (_frame([s]) if s is not None else b""),
        hello, st.none() | handshake)


def _frame(body) -> bytes:
    return raw_frame_from_body(msgpack.packb(body))


pre_handshake_payloads = (st.binary(max_size=200)
                          | st.builds(_frame, anything)
                          | hellos()
                          | frame_headers())


def client_info() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"role": st.just("client"),
         "client_id": st.sampled_from(["fuzz-a", "fuzz-b"]) | anything})


def worker_info() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"role": st.just("worker"), "address": addresses | anything},
        optional={"nthreads": st.integers(1, 4) | anything,
                  "name": st.none() | st.text(max_size=5) | anything,
                  "resources": st.none() | st.dictionaries(st.text(max_size=3),
                                                           st.integers(0, 3)) | anything})


# ---------------------------------------------------------------- wire actions


async def _read_all(reader: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


def _parse_frames(data: bytes) -> list:
    """The messages of the complete frames in ``data`` (a refusal is one small frame)."""
    msgs, offset = [], 0
    while len(data) - offset >= 16:
        n, body_len = struct.unpack_from("<QQ", data, offset)
        start = offset + 16 + 8 * n
        if n > 16 or start + body_len > len(data):
            break
        lengths = struct.unpack_from(f"<{n}Q", data, offset + 16)
        msgs.extend(msgpack.unpackb(data[start:start + body_len], strict_map_key=False))
        offset = start + body_len + sum(lengths)
    return msgs


async def poke_before_handshake(address: str, payload: bytes) -> list:
    """Send ``payload`` on a fresh connection, half-close, and return what came back
    before the listener closed the connection."""
    _, host, port = parse_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(payload)
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except ConnectionError:
        pass
    try:
        data = await _read_all(reader, 10)
    except ConnectionError:
        data = b""
    assert reader.at_eof() or data is not None
    writer.close()
    return _parse_frames(data)


async def _send(comm, action) -> None:
    """One action on an admitted comm: a batch of messages, or raw bytes."""
    try:
        if isinstance(action, bytes):
            await comm._stream.write(action)
        else:
            await comm.write(action)
    except (CommClosedError, OSError):
        pass
    except Exception as exc:  # StreamClosedError from the raw write
        if type(exc).__name__ != "StreamClosedError":
            raise


class Peer:
    """An admitted comm with one reader task (a read must never be cancelled midway:
    tornado would be left reading), whose messages wait in a queue."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                for msg in await self.comm.read():
                    self.inbox.put_nowait(msg)
        except CommClosedError:
            self.inbox.put_nowait(None)

    async def send(self, action) -> None:
        await _send(self.comm, action)

    async def next(self, timeout: float) -> dict | None:
        """The next message; None if the comm closed or nothing came within ``timeout``."""
        try:
            msg = await asyncio.wait_for(self.inbox.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if msg is None:
            self.inbox.put_nowait(None)  # closed: stays closed
        return msg

    async def until(self, op: str, timeout: float = 2.0) -> dict | None:
        """The next message with ``op``; None if the comm closes first, or if nothing
        comes within ``timeout`` (e.g. the peer still waits for the rest of a frame
        we began)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            msg = await self.next(max(deadline - loop.time(), 0))
            if msg is None or msg.get("op") == op:
                return msg

    async def answer_compute_tasks(self) -> None:
        """As a worker: report every compute-task received so far as finished."""
        reports = []
        while (msg := await self.next(0.02)) is not None:
            if msg.get("op") == "compute-task":
                reports.append({"op": "task-finished", "key": msg["key"], "nbytes": 8,
                                "type": "int", "start": 1.0, "stop": 1.5,
                                "data": pickle.dumps(3)})
        if reports:
            await self.send(reports)

    async def close(self) -> None:
        self.comm.abort()
        await asyncio.wait([self.reader], timeout=5)


async def admitted(address: str, info: dict) -> Peer:
    try:
        comm = await connect(address, info, timeout=5, security=SECURITY)
    except HandshakeError as exc:
        raise AssertionError(f"the token handshake failed: {exc}") from exc
    return Peer(comm)


# ---------------------------------------------------------------- tests


@FUZZ
@given(target=st.sampled_from(["scheduler", "worker"]), payload=pre_handshake_payloads)
def test_nothing_before_a_valid_handshake_is_admitted(harness, no_errors, target, payload):
    since = len(no_errors.records)
    address = harness.scheduler.address if target == "scheduler" else harness.worker.address
    replies = harness.call(poke_before_handshake(address, payload))
    ops = [m.get("op") if isinstance(m, dict) else m for m in replies]
    assert set(ops) <= {"hello", "error"}, replies
    check_example(harness, no_errors, since)


@FUZZ
@given(data=st.data())
def test_admitted_peers_sending_anything_leave_the_scheduler_valid(harness, no_errors, data):
    since = len(no_errors.records)
    n_peers = data.draw(st.integers(1, 2), label="peers")
    infos = [harness.substitute(data.draw(st.one_of(client_info(), worker_info(),
                                                    client_info(), worker_info(),
                                                    st.just({"role": "client",
                                                             "client_id": "fuzz-c"}),
                                                    st.just({"role": "worker",
                                                             "address": FAKE_WORKER})),
                                          label="handshake"))
             for _ in range(n_peers)]
    actions = []
    for _ in range(data.draw(st.integers(0, 8), label="actions")):
        i = data.draw(st.integers(0, n_peers - 1), label="peer")
        ops = CLIENT_OPS if infos[i]["role"] == "client" else WORKER_OPS
        # mostly well-formed, so that the cluster gets somewhere before a bad message
        # closes the connection
        well_formed = st.lists(plausible_messages(ops), min_size=1, max_size=3)
        action = data.draw(well_formed | well_formed | well_formed
                           | st.sampled_from(["answer", "wait", "answer"])
                           | st.lists(messages(ops), min_size=1, max_size=3)
                           | frame_headers()
                           | st.builds(_frame, anything), label="send")
        actions.append((i, action if isinstance(action, (bytes, str))
                        else harness.substitute(action)))

    async def session():
        peers = []
        try:
            for info in infos:
                peers.append(await admitted(harness.scheduler.address, info))
            for i, action in actions:
                if action == "wait":  # let the cluster move on
                    await asyncio.sleep(0.02)
                elif action == "answer":
                    await peers[i].answer_compute_tasks()
                else:
                    await peers[i].send(action)
            for peer, info in zip(peers, infos):
                if info["role"] == "client":  # has the scheduler processed all of it?
                    await peer.send([{"op": "identity", "reqid": -1}])
                    await peer.until("reply")
        finally:
            for peer in peers:
                await peer.close()

    harness.call(session())
    check_example(harness, no_errors, since)


@FUZZ
@given(actions=st.lists(st.lists(messages(PEER_OPS), min_size=1, max_size=3)
                        | frame_headers() | st.builds(_frame, anything), max_size=5))
def test_admitted_peers_sending_anything_to_a_worker_leave_it_serving(harness, no_errors,
                                                                      actions):
    since = len(no_errors.records)

    async def session():
        peer = await admitted(harness.worker.address, {"role": "peer"})
        try:
            for action in actions:
                await peer.send(action if isinstance(action, bytes)
                                else harness.substitute(action))
            # (no answer if a frame we began is still open)
            await peer.send([{"op": "ping"}])
            await peer.until("pong", timeout=0.5)
        finally:
            await peer.close()
        # the worker still answers a well-formed request on a new connection
        peer = await admitted(harness.worker.address, {"role": "peer"})
        try:
            await peer.send([{"op": "ping"}])
            assert await peer.next(5) == {"op": "pong"}
        finally:
            await peer.close()

    harness.call(session())
    check_example(harness, no_errors, since)


def test_an_honest_round_trip_works_after_the_fuzzing(harness, no_errors):
    """Runs after the fuzz tests above (same scheduler and worker)."""
    since = len(no_errors.records)
    key = f"honest-{uuid.uuid4().hex}"

    async def session():
        peer = await admitted(harness.scheduler.address,
                              {"role": "client", "client_id": f"honest-{os.getpid()}"})
        try:
            await peer.send([{"op": "update-graph", "keys": [key],
                              "tasks": [{"key": key, "spec": GOOD_SPEC}]}])
            done = await peer.until("key-in-memory", timeout=10)
            assert done is not None and done["key"] == key, done
            assert pickle.loads(bytes(done["data"])) == 3
            await peer.send([{"op": "who-has", "keys": [key], "reqid": 1}])
            reply = await peer.until("reply")
            assert reply["result"] == {key: (harness.worker.address,)}
            await peer.send([{"op": "release-keys", "keys": [key]},
                             {"op": "identity", "reqid": 2}])
            reply = await peer.until("reply")
            assert reply["result"]["n_tasks"] == 0, reply["result"]["task_counts"]
        finally:
            await peer.close()

    harness.call(session())
    check_example(harness, no_errors, since)
