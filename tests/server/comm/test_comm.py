"""Tests for distributed_server.comm (framing, connector, listener, handshake): framing,
batching, handshake, bad input, TLS.

Every test is a plain function that runs its coroutine with `run` (asyncio.run plus a
deadline); every connection is real loopback TCP. Raw peers (asyncio streams speaking
bytes built here with struct + msgpack) check the wire format against protocol.md
independently of the module's own encoder.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import (
    Recorder,
    echo,
    raw_client,
    raw_frame,
    raw_frame_from_body,
    raw_hello,
    raw_listener_handshake,
    read_raw_frame,
    run,
    start_raw_server,
)

from distributed_server.comm import framing as comm_module
from distributed_server.comm.addresses import parse_address
from distributed_server.comm.connector import connect
from distributed_server.comm.framing import (
    BURST_FRAMES,
    Blob,
    CommClosedError,
    HandshakeError,
    ProtocolError,
    _Encoder,
)
from distributed_server.comm.handshake import PROTOCOL_VERSION
from distributed_server.comm.listener import Listener, listen
from distributed_server.security import Security


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    "address, expected",
    [
        ("tcp://127.0.0.1:8786", ("tcp", "127.0.0.1", 8786)),
        ("tls://scheduler.example.org:0", ("tls", "scheduler.example.org", 0)),
        ("tcp://[::1]:65535", ("tcp", "::1", 65535)),
    ],
)
def test_parse_address_splits_scheme_host_port(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:8786", "udp://h:1", "tcp://h", "tcp://:80", "tcp://h:port", "tcp://h:70000",
     "tcp://::1:80", "tcp://h:-1", "", None, 8786, "tcp://a\nFORGED:1", "tcp://a b:1",
     "tcp://a\x00b:1"],
)
def test_parse_address_rejects_bad_input_with_value_error(address):
    with pytest.raises(ValueError, match="address"):
        parse_address(address)


def test_listener_address_is_the_real_port():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        assert isinstance(listener, Listener)
        assert listener.port > 0
        assert listener.address == f"tcp://127.0.0.1:{listener.port}"
        await listener.stop()

    run(main())


# ---------------------------------------------------------------- round trips


def test_round_trip_of_a_batch():
    batch = [
        {"op": "compute-task", "key": "inc-1", "priority": (0, 1, 2), "spec": b"\x00\x01"},
        {"op": "free-keys", "keys": ("a", "b"), "stimulus_id": "s1"},
        {"op": "nested", "x": {"y": [1, 2.5, None, True, "z"]}},
    ]

    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        comm = await connect(listener.address, {})
        await comm.write(batch)
        got = await comm.read()
        assert isinstance(got, list) and len(got) == 3
        assert got[0] == batch[0] and got[1] == batch[1]
        assert got[2]["x"]["y"] == (1, 2.5, None, True, "z")  # sequences decode as tuples
        await comm.close()
        await listener.stop()

    run(main())


def test_blob_of_10_mb_arrives_intact():
    payload = bytes(range(256)) * (10 * 1024 * 1024 // 256)

    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        comm = await connect(listener.address, {})
        await comm.write([{"op": "put-data", "data": {"k": Blob(payload)}, "after": 1}])
        (msg,) = await comm.read()
        data = msg["data"]["k"]
        assert isinstance(data, (bytes, memoryview))
        assert len(data) == len(payload) and bytes(data) == payload
        assert msg["after"] == 1
        await comm.close()
        await listener.stop()

    run(main())


def test_blob_is_not_copied_into_the_body():
    payload = bytearray(b"x" * (1 << 20))
    chunks = _Encoder().encode([{"op": "data", "data": Blob(payload)}])
    assert chunks[-1].obj is payload  # the caller's buffer itself, handed to the socket
    assert sum(len(c) for c in chunks[:-1]) < 100  # header + body only


def test_wire_format_matches_protocol_md():
    payload = b"P" * 100_000

    async def main():
        received = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            await raw_listener_handshake(reader, writer)
            received.set_result(await read_raw_frame(reader))
            writer.close()

        server, address = await start_raw_server(handle)
        comm = await connect(address, {})
        await comm.write([{"op": "a", "b": Blob(b"small")}, {"op": "c", "d": Blob(payload)}])
        msgs, buffers = await received
        assert msgs == ({"op": "a", "b": ("blob", 0)}, {"op": "c", "d": ("blob", 1)})
        assert buffers == [b"small", payload]
        comm.abort()
        server.close()

    run(main())


def test_tuple_keys_survive_as_values_and_as_dict_keys():
    key = ("x", 0, 1)
    nested = ("y", ("z", 2), 3.5)

    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        comm = await connect(listener.address, {})
        await comm.write([{"op": "k", "key": key, "who_has": {key: ["tcp://a:1"], nested: []}}])
        (msg,) = await comm.read()
        assert msg["key"] == key and type(msg["key"]) is tuple
        assert msg["who_has"] == {key: ("tcp://a:1",), nested: ()}
        await comm.close()
        await listener.stop()

    run(main())


# ---------------------------------------------------------------- batched send


def test_batched_send_coalesces_many_sends_into_few_frames():
    count = 10_000

    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {})
        comm = await connect(listener.address, {}, interval=0.005)
        for i in range(count):
            comm.send({"op": "n", "i": i})
            if i % 100 == 99:
                await asyncio.sleep(0)  # let the loop run, as a real producer would
        received, frames = [], 0
        while len(received) < count:
            received += await recorder.frames.get()
            frames += 1
        assert [m["i"] for m in received] == list(range(count))
        assert frames <= count // 50, frames
        await comm.close()
        await listener.stop()

    run(main())


def test_a_large_batch_goes_out_as_frames_of_whole_messages(monkeypatch):
    """The receiver decodes a frame at once: a batch larger than FRAME_SPLIT_BYTES is cut
    into several frames, between messages, in order, Blobs intact."""
    monkeypatch.setattr(comm_module, "FRAME_SPLIT_BYTES", 20_000)
    blob = bytes(range(256)) * 40

    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {})
        comm = await connect(listener.address, {}, interval=0.05)
        for i in range(60):
            msg = {"op": "n", "i": i, "pad": "x" * 3_000}
            if i % 7 == 0:
                msg["blob"] = Blob(blob)
            comm.send(msg)
        frames = []
        while sum(map(len, frames)) < 60:
            frames.append(await recorder.frames.get())
        assert len(frames) >= 8
        assert all(len(frame) <= 7 for frame in frames)  # 3 kB messages, 20 kB frames
        received = [msg for frame in frames for msg in frame]
        assert [m["i"] for m in received] == list(range(60))
        for m in received:
            assert ("blob" in m) == (m["i"] % 7 == 0)
            if "blob" in m:
                assert bytes(m["blob"]) == blob
        comm.send({"op": "alone", "pad": "y" * 50_000})  # one large message: one frame
        assert [m["op"] for m in await recorder.frames.get()] == ["alone"]
        await comm.close()
        await listener.stop()

    run(main())


def test_a_few_sends_go_out_at_once_and_a_stream_waits_for_the_window():
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {})
        comm = await connect(listener.address, {}, interval=1.0)
        await asyncio.sleep(1.1)  # nothing sent for longer than the interval
        start = time.monotonic()
        for i in range(BURST_FRAMES):  # request/response traffic: never delayed
            comm.send({"op": "burst", "i": i})
            assert await recorder.frames.get() == [{"op": "burst", "i": i}]
        assert time.monotonic() - start < 0.5  # did not wait for the 1 s window
        comm.send({"op": "second"})  # the burst is used up: these wait for the window
        comm.send({"op": "third"})
        assert await recorder.frames.get() == [{"op": "second"}, {"op": "third"}]
        assert time.monotonic() - start >= 0.9
        await comm.close()
        await listener.stop()

    run(main())


def test_flush_now_writes_what_waits_for_the_window_and_gives_its_future():
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {})
        comm = await connect(listener.address, {}, interval=10.0)
        await comm.write([{"op": "now"}])  # starts a 10 s window
        assert await recorder.frames.get() == [{"op": "now"}]
        comm.send({"op": "late"})  # would wait for the window
        written = comm.flush_now()
        await asyncio.wait_for(written, 5)
        assert await asyncio.wait_for(recorder.frames.get(), 5) == [{"op": "late"}]
        assert comm.flush_now() is written  # nothing queued: the last write's
        await comm.close()
        await listener.stop()

    run(main())


def test_send_schedules_one_flush_and_no_task_per_message():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", Recorder(), {})
        comm = await connect(listener.address, {})
        tasks_before = len(asyncio.all_tasks())
        for i in range(1000):
            comm.send({"op": "n", "i": i})
        assert len(asyncio.all_tasks()) == tasks_before
        assert comm._flush_handle is not None and len(comm._queue) == 1000
        await comm.close()
        await listener.stop()

    run(main())


def test_close_flushes_queued_messages():
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {})
        comm = await connect(listener.address, {}, interval=10.0)
        await comm.write([{"op": "now"}])  # starts a 10 s window
        for i in range(5):
            comm.send({"op": "late", "i": i})
        await comm.close()
        assert comm.closed
        assert await recorder.frames.get() == [{"op": "now"}]
        assert [m["i"] for m in await recorder.frames.get()] == list(range(5))
        with pytest.raises(CommClosedError):
            comm.send({"op": "after-close"})
        await listener.stop()

    run(main())


def test_write_puts_queued_messages_first():
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {})
        comm = await connect(listener.address, {}, interval=10.0)
        await comm.write([{"op": "start-window"}])
        comm.send({"op": "queued"})
        await comm.write([{"op": "direct"}])
        ops = []
        while len(ops) < 3:
            ops += [m["op"] for m in await recorder.frames.get()]
        assert ops == ["start-window", "queued", "direct"]
        await comm.close()
        await listener.stop()

    run(main())


# ---------------------------------------------------------------- closing and errors


def test_read_after_peer_closes_raises_comm_closed_not_protocol_error():
    async def main():
        async def hang_up(comm):
            await comm.close()

        listener = await listen("tcp://127.0.0.1:0", hang_up, {})
        comm = await connect(listener.address, {})
        with pytest.raises(CommClosedError) as info:
            await comm.read()
        assert not isinstance(info.value, ProtocolError)
        assert comm.closed
        with pytest.raises(CommClosedError):
            await comm.write([{"op": "x"}])
        await listener.stop()

    run(main())


def test_unencodable_message_raises_type_error_and_the_comm_survives():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        comm = await connect(listener.address, {})
        with pytest.raises(TypeError, match="set"):
            await comm.write([{"op": "bad", "x": {1, 2}}])
        await comm.write([{"op": "good"}])
        assert await comm.read() == [{"op": "good"}]
        await comm.close()
        await listener.stop()

    run(main())


# ---------------------------------------------------------------- handshake


def test_handshake_fills_extra_with_the_peers_info():
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {"role": "scheduler"})
        comm = await connect(listener.address, {"role": "worker", "nthreads": 4})
        assert comm.extra == {"role": "scheduler"}
        await comm.write([{"op": "ping"}])
        await recorder.frames.get()
        (server_comm,) = recorder.comms
        assert server_comm.extra == {"role": "worker", "nthreads": 4}
        assert server_comm.peer_address == comm.local_address
        assert server_comm.local_address == comm.peer_address == listener.address
        await comm.close()
        await listener.stop()

    run(main())


def test_protocol_mismatch_raises_handshake_error():
    async def main():
        async def newer(reader, writer):
            await raw_listener_handshake(reader, writer, protocol=PROTOCOL_VERSION + 1)

        server, address = await start_raw_server(newer)
        with pytest.raises(HandshakeError, match="protocol mismatch"):
            await connect(address, {}, timeout=5)
        server.close()

    run(main())


def test_client_with_wrong_protocol_is_refused_and_listener_keeps_serving():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        _, host, port = parse_address(listener.address)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(raw_frame([raw_hello(protocol="0.0")]))
        (error,), _ = await read_raw_frame(reader)
        assert error["op"] == "error" and "protocol mismatch" in error["error"]
        assert await reader.read() == b""
        writer.close()
        comm = await connect(listener.address, {})
        await comm.write([{"op": "still-alive"}])
        assert await comm.read() == [{"op": "still-alive"}]
        await comm.close()
        await listener.stop()

    run(main())


def test_peer_error_message_is_in_the_handshake_error():
    async def main():
        async def refuse(reader, writer):
            writer.write(raw_frame([{"op": "error", "error": "go away, bad credentials"}]))
            await writer.drain()
            writer.close()

        server, address = await start_raw_server(refuse)
        with pytest.raises(HandshakeError, match="go away, bad credentials"):
            await connect(address, {}, timeout=5)
        server.close()

    run(main())


def test_first_message_not_a_handshake_is_refused_with_an_error_message():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        _, host, port = parse_address(listener.address)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(raw_frame([{"op": "handshake", "role": "worker"}]))
        (error,), _ = await read_raw_frame(reader)
        assert error["op"] == "error" and "expected 'hello'" in error["error"]
        assert await reader.read() == b""  # then the server hangs up
        writer.close()
        await listener.stop()

    run(main())


def test_connect_to_a_closed_port_times_out_naming_the_address():
    address = f"tcp://127.0.0.1:{free_port()}"

    async def main():
        start = time.monotonic()
        with pytest.raises(OSError, match=address) as info:
            await connect(address, {}, timeout=0.5)
        elapsed = time.monotonic() - start
        assert isinstance(info.value, TimeoutError)
        assert 0.5 <= elapsed < 3
        assert "0.5" in str(info.value)

    run(main())


def test_connect_retries_until_the_listener_appears():
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"

    async def main():
        async def start_late():
            await asyncio.sleep(0.3)
            return await listen(address, echo, {})

        starter = asyncio.ensure_future(start_late())
        comm = await connect(address, {}, timeout=5)
        await comm.write([{"op": "hi"}])
        assert await comm.read() == [{"op": "hi"}]
        await comm.close()
        await (await starter).stop()

    run(main())


def test_stopped_listener_refuses_connections():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        await listener.stop()
        with pytest.raises(OSError):
            await connect(listener.address, {}, timeout=0.3)

    run(main())


# ---------------------------------------------------------------- malformed input

GOOD_HEADER = struct.pack("<QQ", 0, 10)

MALFORMED = {
    "garbage bytes": b"\xde\xad\xbe\xef" * 8,
    "huge length header": struct.pack("<QQ", 0, 1 << 40),
    "too many buffers": struct.pack("<QQ", 1 << 40, 1),
    "body is an int": raw_frame_from_body(msgpack.packb(42)),
    "body is a map": raw_frame_from_body(msgpack.packb({"op": "x"})),
    "message without op": raw_frame([{"key": "x"}]),
    "op is not a str": raw_frame([{"op": 3}]),
    "message is a list": raw_frame([[1, 2]]),
    "bad msgpack": raw_frame_from_body(b"\xc1\xc1\xc1"),
    "trailing bytes in body": raw_frame_from_body(msgpack.packb([{"op": "x"}]) + b"\x00"),
    "empty body": struct.pack("<QQ", 0, 0),
    "blob index out of range": raw_frame_from_body(
        msgpack.packb([{"op": "x", "b": msgpack.ExtType(1, struct.pack("<I", 5))}])
    ),
    "unknown ext type": raw_frame_from_body(
        msgpack.packb([{"op": "x", "b": msgpack.ExtType(7, b"abcd")}])
    ),
    "truncated frame": GOOD_HEADER + b"\x91",  # then the peer hangs up
}


@pytest.mark.parametrize("payload", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_frame_closes_that_connection_with_protocol_error(payload):
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {})
        reader, writer = await raw_client(listener.address)
        writer.write(payload)
        await writer.drain()
        writer.write_eof()  # a truncated frame only shows when the peer hangs up
        comm, error = await recorder.errors.get()
        assert isinstance(error, ProtocolError), repr(error)
        assert comm.closed
        assert await reader.read() == b""  # we hung up on the bad peer
        writer.close()

        good = await connect(listener.address, {})  # the listener still accepts
        await good.write([{"op": "fine"}])
        assert await recorder.frames.get() == [{"op": "fine"}]
        await good.close()
        await listener.stop()

    run(main())


def test_frame_above_the_configured_limit_is_refused():
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {}, max_frame_bytes=1000)
        comm = await connect(listener.address, {})
        await comm.write([{"op": "small"}])
        assert await recorder.frames.get() == [{"op": "small"}]
        await comm.write([{"op": "big", "data": Blob(b"x" * 2000)}])
        _, error = await recorder.errors.get()
        assert isinstance(error, ProtocolError) and "limit 1000" in str(error)
        await comm.close()
        await listener.stop()

    run(main())


@pytest.mark.parametrize("payload", [b"GET / HTTP/1.1\r\n\r\n", struct.pack("<QQ", 0, 1 << 50)],
                         ids=["http request", "huge header"])
def test_malformed_handshake_does_not_break_the_listener(payload):
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {})
        _, host, port = parse_address(listener.address)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(payload)
        await writer.drain()
        assert await reader.read() == b""  # it hangs up on us, having said nothing
        writer.close()
        assert recorder.comms == []  # the handler never saw the bad connection

        good = await connect(listener.address, {})
        await good.write([{"op": "fine"}])
        assert await recorder.frames.get() == [{"op": "fine"}]
        await good.close()
        await listener.stop()

    run(main())


# ---------------------------------------------------------------- property: any batch round-trips

keys = st.recursive(
    st.text(max_size=8) | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False),
    lambda inner: st.tuples(inner, inner) | st.tuples(inner),
    max_leaves=5,
)
values = st.recursive(
    st.none() | st.booleans() | st.binary(max_size=20) | keys,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)
messages = st.builds(lambda op, extra: {**extra, "op": op},
                     st.text(min_size=1, max_size=10), st.dictionaries(st.text(max_size=5), values))


def as_tuples(obj):
    """What msgpack with use_list=False gives back for ``obj``."""
    if isinstance(obj, (list, tuple)):
        return tuple(as_tuples(x) for x in obj)
    if isinstance(obj, dict):
        return {as_tuples(k): as_tuples(v) for k, v in obj.items()}
    return obj


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(messages, min_size=1, max_size=5), min_size=1, max_size=4))
def test_any_batch_of_plain_data_round_trips(batches):
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        comm = await connect(listener.address, {})
        for batch in batches:
            await comm.write(batch)
            assert await comm.read() == [as_tuples(m) for m in batch]
        await comm.close()
        await listener.stop()

    run(main())


# ---------------------------------------------------------------- TLS


def test_tls_round_trip_between_members_of_one_ca():
    security = Security.temporary(token=False)
    payload = b"secret" * 200_000

    async def main():
        listener = await listen("tls://127.0.0.1:0", echo, {"tls": True}, security)
        assert listener.address.startswith("tls://127.0.0.1:")
        comm = await connect(listener.address, {}, security=security)
        assert comm.peer_address == listener.address and comm.extra["tls"] is True
        await comm.write([{"op": "x", "key": ("k", 1), "data": Blob(payload)}])
        (msg,) = await comm.read()
        assert msg["key"] == ("k", 1) and bytes(msg["data"]) == payload
        comm.send({"op": "batched"})
        assert await comm.read() == [{"op": "batched"}]
        await comm.close()
        await listener.stop()

    run(main())


def test_address_scheme_must_fit_the_security_given():
    async def main():
        with pytest.raises(ValueError, match="security"):
            await connect("tls://127.0.0.1:1", {})
        with pytest.raises(ValueError, match="tls://"):
            await listen("tcp://127.0.0.1:0", echo, {}, Security.temporary(token=False))

    run(main())


def test_tls_peer_of_another_ca_is_refused_at_once():
    ours, theirs = Security.temporary(token=False), Security.temporary(token=False)

    async def main():
        recorder = Recorder()
        listener = await listen("tls://127.0.0.1:0", recorder, {}, ours)
        start = time.monotonic()
        with pytest.raises(HandshakeError, match="TLS"):
            await connect(listener.address, {}, timeout=5, security=theirs)
        assert time.monotonic() - start < 2  # not retried until the timeout
        assert recorder.comms == []
        await listener.stop()

    run(main())


def test_plain_tcp_peer_of_a_tls_listener_is_refused_at_once():
    security = Security.temporary(token=False)

    async def main():
        recorder = Recorder()
        listener = await listen("tls://127.0.0.1:0", recorder, {}, security)
        plain_address = listener.address.replace("tls://", "tcp://")
        with pytest.raises(HandshakeError, match="tls://"):
            await connect(plain_address, {}, timeout=5)
        assert recorder.comms == []
        await listener.stop()

    run(main())


# ---------------------------------------------------------------- Blob and misc API


def test_blob_accepts_any_contiguous_buffer_and_reports_its_size():
    import array

    doubles = array.array("d", [1.0, 2.0, 3.0])
    blob = Blob(doubles)
    assert len(blob) == 24 and blob.buffer.format == "B"
    assert len(Blob(memoryview(b"abcd"))) == len(Blob(bytearray(4))) == 4
    with pytest.raises(ValueError, match="contiguous"):
        Blob(memoryview(b"abcdef")[::2])
    with pytest.raises(TypeError):
        Blob("not a buffer")


def test_write_refuses_a_single_dict():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        comm = await connect(listener.address, {})
        with pytest.raises(TypeError, match="list of message dicts"):
            await comm.write({"op": "oops"})
        await comm.close()
        await listener.stop()

    run(main())


def test_listen_on_a_busy_port_names_the_address():
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            busy = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            with pytest.raises(OSError, match=busy):
                await listen(busy, echo, {})

    run(main())
