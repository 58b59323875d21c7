"""Who gets in, and what an outsider can cost a listener (distributed_server.comm.listener,
distributed_server.comm.handshake).

Every test runs real loopback connections: the cluster token's challenge-response, the
small frame limit before the handshake, buffers that grow only as bytes arrive, the caps
on open and half-open connections, and the handshake deadline.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import struct

import msgpack
import psutil
import pytest
from server_helpers import (
    Recorder,
    echo,
    raw_frame,
    raw_frame_from_body,
    raw_hello,
    read_raw_frame,
    run,
)

from distributed_server.comm import handshake as handshake_module
from distributed_server.comm import listener as listener_module
from distributed_server.comm.addresses import parse_address
from distributed_server.comm.connector import connect
from distributed_server.comm.framing import HandshakeError
from distributed_server.comm.handshake import HANDSHAKE_MAX_FRAME_BYTES
from distributed_server.comm.listener import listen
from distributed_server.security import Security, SecurityError

TOKEN = "a-cluster-token-of-some-length"


async def open_raw(address: str, source: str | None = None):
    _, host, port = parse_address(address)
    return await asyncio.open_connection(
        host, port, local_addr=None if source is None else (source, 0))


# ---------------------------------------------------------------- the token


def test_peers_holding_the_token_are_admitted():
    async def main():
        security = Security(token=TOKEN)
        listener = await listen("tcp://127.0.0.1:0", echo, {"role": "scheduler"}, security)
        comm = await connect(listener.address, {"role": "client"}, security=security)
        assert comm.extra == {"role": "scheduler"}
        await comm.write([{"op": "ping"}])
        assert await comm.read() == [{"op": "ping"}]
        await comm.close()
        await listener.stop()

    run(main())


@pytest.mark.parametrize("connector, match", [
    (Security(token="another-token-of-some-length"), "wrong cluster token"),
    (Security(), "requires its token"),
], ids=["wrong token", "no token"])
def test_a_peer_without_the_token_is_refused_and_never_reaches_the_handler(connector, match):
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {}, Security(token=TOKEN))
        with pytest.raises(HandshakeError, match=match):
            await connect(listener.address, {"role": "worker"}, timeout=5, security=connector)
        assert recorder.comms == []
        good = await connect(listener.address, {}, security=Security(token=TOKEN))
        await good.write([{"op": "fine"}])
        assert await recorder.frames.get() == [{"op": "fine"}]
        await good.close()
        await listener.stop()

    run(main())


def test_a_connector_with_a_token_refuses_a_listener_without_one():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {})
        with pytest.raises(HandshakeError, match="expects a cluster token"):
            await connect(listener.address, {}, timeout=5, security=Security(token=TOKEN))
        await listener.stop()

    run(main())


def test_an_impostor_listener_that_cannot_prove_the_token_is_refused():
    """It answers the hello as if it had the token, but its proof is made up."""
    async def main():
        async def impostor(reader, writer):
            await read_raw_frame(reader)
            writer.write(raw_frame([raw_hello(auth="token")]))
            await read_raw_frame(reader)
            writer.write(raw_frame([{"op": "handshake", "proof": b"\0" * 32}]))
            await reader.read()

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        address = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        with pytest.raises(HandshakeError, match="could not prove"):
            await connect(address, {}, timeout=5, security=Security(token=TOKEN))
        server.close()

    run(main())


def test_the_token_never_crosses_the_wire():
    """A relay between connector and listener records every byte of both directions."""
    seen = bytearray()

    async def main():
        security = Security(token=TOKEN)
        listener = await listen("tcp://127.0.0.1:0", echo, {}, security)
        _, host, port = parse_address(listener.address)

        async def pipe(reader, writer):
            while data := await reader.read(65536):
                seen.extend(data)
                writer.write(data)
            writer.close()

        async def relay(client_reader, client_writer):
            reader, writer = await asyncio.open_connection(host, port)
            await asyncio.gather(pipe(client_reader, writer), pipe(reader, client_writer))

        server = await asyncio.start_server(relay, "127.0.0.1", 0)
        address = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        comm = await connect(address, {}, security=security)
        await comm.write([{"op": "x"}])
        await comm.read()
        await comm.close()
        server.close()
        await listener.stop()

    run(main())
    assert len(seen) > 100
    assert TOKEN.encode() not in seen


def test_a_replayed_proof_is_useless_because_nonces_are_fresh():
    """Recording a whole successful handshake and replaying the connector's side to a
    new connection fails: the listener picked a new nonce."""
    async def main():
        security = Security(token=TOKEN)
        listener = await listen("tcp://127.0.0.1:0", echo, {}, security)
        good = await connect(listener.address, {}, security=security)
        await good.close()

        reader, writer = await open_raw(listener.address)
        ours = raw_hello(auth="token")
        writer.write(raw_frame([ours]))
        (theirs,), _ = await read_raw_frame(reader)
        stale_nonce = b"s" * 32  # any nonce but the one just received
        stale = handshake_module._proof(TOKEN, handshake_module._CONNECTOR, stale_nonce,
                                        ours["nonce"])
        writer.write(raw_frame([{"op": "handshake", "proof": stale}]))
        (error,), _ = await read_raw_frame(reader)
        assert error == {"op": "error", "error": "wrong cluster token"}
        assert theirs["nonce"] != stale_nonce
        writer.close()
        await listener.stop()

    run(main())


def test_short_tokens_and_half_tls_settings_are_refused_with_a_clear_error():
    with pytest.raises(SecurityError, match="at least 16"):
        Security(token="short")
    with pytest.raises(SecurityError, match="all three"):
        Security(tls_ca_file=__file__)
    assert "hidden" in repr(Security(token=TOKEN)) and TOKEN not in repr(Security(token=TOKEN))


# ---------------------------------------------------------------- limits before admission


def test_a_large_frame_before_the_handshake_is_refused_without_reading_it():
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {}, Security(token=TOKEN))
        reader, writer = await open_raw(listener.address)
        writer.write(struct.pack("<QQ", 0, HANDSHAKE_MAX_FRAME_BYTES + 1))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # hung up, nothing said
        writer.close()
        assert recorder.comms == []
        await listener.stop()

    run(main())


def test_an_announced_gigabyte_costs_nothing_until_it_arrives():
    """After the handshake a peer announces a 1 GiB buffer and sends 10 bytes of it:
    the receiver holds about what arrived, not what was announced."""
    async def main():
        recorder = Recorder()
        listener = await listen("tcp://127.0.0.1:0", recorder, {})
        comm = await connect(listener.address, {})
        gc.collect()
        before = psutil.Process().memory_info().rss
        blob_ref = msgpack.ExtType(1, struct.pack("<I", 0))
        frame = raw_frame_from_body(msgpack.packb([{"op": "big", "data": blob_ref}]),
                                    [b"x" * 10])
        n, body_len, _ = struct.unpack("<QQQ", frame[:24])
        comm._stream.write(struct.pack("<QQQ", n, body_len, 1 << 30) + frame[24:])
        await asyncio.sleep(0.5)
        grown = psutil.Process().memory_info().rss - before
        assert grown < 64 * 1024**2, f"RSS grew by {grown / 1e6:.0f} MB"
        comm.abort()
        _, error = await recorder.errors.get()  # the cut frame ends that connection only
        await listener.stop()

    run(main())


def test_a_silent_peer_is_dropped_after_the_handshake_timeout():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {}, handshake_timeout=0.3)
        reader, writer = await open_raw(listener.address)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await asyncio.sleep(0.05)
        assert listener.n_open == 0
        await listener.stop()

    run(main())


# ---------------------------------------------------------------- connection caps


def test_connections_beyond_the_cap_are_refused_with_a_clear_error():
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {}, max_connections=3,
                                max_connections_per_host=3)
        comms = [await connect(listener.address, {}) for _ in range(3)]
        assert listener.n_open == 3
        with pytest.raises(OSError, match="too many connections"):
            await connect(listener.address, {}, timeout=1)  # retried while busy, then given up
        comms.pop().abort()
        await asyncio.sleep(0.05)
        assert listener.n_open == 2
        comms.append(await connect(listener.address, {}))  # room again
        for comm in comms:
            await comm.write([{"op": "still-served"}])
            assert await comm.read() == [{"op": "still-served"}]
            comm.abort()
        await listener.stop()

    run(main())


def test_a_flood_from_several_hosts_evicts_its_own_handshakes_not_a_peers():
    """Over the cap on all handshakes, the oldest connection of the most crowded host
    goes: a peer whose handshake is the oldest of all is not the one dropped by a flood
    from hosts that each stay under their own cap."""
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {}, Security(token=TOKEN),
                                handshake_timeout=5.0)
        peer = await open_raw(listener.address, "127.0.0.1")
        sources = [f"127.0.0.{i}" for i in range(2, 7)]
        per_host = listener_module.MAX_PENDING_PER_HOST - 4
        assert len(sources) * per_host > listener_module.MAX_PENDING
        flood = [await open_raw(listener.address, source)
                 for _ in range(per_host) for source in sources]
        await asyncio.sleep(0.2)
        assert len(listener._pending) == listener_module.MAX_PENDING
        assert list(listener._pending.values()).count("127.0.0.1") == 1
        assert all(n <= per_host for n in listener._pending_by_host.values())
        peer[1].close()
        for _, writer in flood:
            writer.close()
        await listener.stop()

    run(main())


def test_one_host_cannot_hold_every_handshake_slot(caplog):
    """Half-open connections from one host are capped: a new one evicts the oldest, so
    an honest peer gets in at once while silent ones keep coming, and the evictions do
    not flood the log."""
    async def main():
        listener = await listen("tcp://127.0.0.1:0", echo, {}, Security(token=TOKEN),
                                handshake_timeout=5.0)
        idle = [await open_raw(listener.address)
                for _ in range(listener_module.MAX_PENDING_PER_HOST + 20)]
        await asyncio.sleep(0.2)
        assert len(listener._pending) == listener_module.MAX_PENDING_PER_HOST
        evicted = [reader for reader, _ in idle[:20]]
        assert all([await asyncio.wait_for(r.read(), 1) == b"" for r in evicted])
        started = asyncio.get_running_loop().time()
        comm = await connect(listener.address, {}, security=Security(token=TOKEN), timeout=5)
        assert asyncio.get_running_loop().time() - started < 1  # long before the deadline
        await comm.write([{"op": "in"}])
        assert await comm.read() == [{"op": "in"}]
        comm.abort()
        for _, writer in idle:
            writer.close()
        await listener.stop()

    with caplog.at_level(logging.WARNING, logger="distributed_server.comm.framing"):
        run(main())
    evictions = [r for r in caplog.records if "oldest connection" in r.getMessage()]
    assert 1 <= len(evictions) <= 6, len(evictions)
