"""Framed, batched msgpack messages over tornado TCP (and TLS): the wire of distributed-core.

What this module does
---------------------
- Parses addresses ``tcp://host:port`` and ``tls://host:port`` (`parse_address`).
- Frames batches of message dicts (docs/protocol.md, section 2)::

      n                      8 bytes, little-endian: number of out-of-band buffers
      len(body), len(b0)...  n + 1 lengths, 8 bytes each, little-endian
      body                   msgpack: one array of message dicts (a batch)
      b0 ... b(n-1)          the out-of-band buffers, raw

  A `Blob` anywhere in a message is not copied into the body: it becomes buffer ``i``
  and the body holds ``ExtType(1, i as 4 little-endian bytes)`` in its place. The
  receiver gets each such buffer back as a ``memoryview`` (over a ``bytearray`` read
  straight from the socket). msgpack arrays decode as tuples, so tuple keys round-trip.
- `Comm`: ``await read()``, ``await write(msgs)`` (one frame now) and ``send(msg)``
  (batched: the first few frames of each ``interval`` flush on the next loop
  iteration, later ones wait for the window to end). At most one flush is ever pending; no asyncio Task is created per message.
- A handshake on every connection (`connect`, `listen`): both sides first write
  ``{"op": "handshake", "protocol": PROTOCOL_VERSION, **info}`` and then read the
  peer's. On a mismatch the side that notices writes ``{"op": "error", "error": ...}``
  and closes; `connect` raises `HandshakeError`.
- Refuses bad input from the peer: oversized frames (``max_frame_bytes``, 2 GiB by
  default), too many buffers, invalid msgpack, a body that is not an array of dicts
  with a str ``"op"``, unknown ext types, frames cut off by a closed connection. Each
  raises `ProtocolError` from ``read()`` and closes that one connection.

What it never does
------------------
- It never unpickles, evaluates or imports anything the peer sends: the only decoder
  is msgpack with an ext hook that hands back raw buffers. Pickled payloads pass
  through as opaque bytes/memoryviews.
- It never creates a Task per message, never blocks the event loop on I/O, and never
  retries on its own except inside `connect` (until its timeout).

Errors
------
``CommClosedError`` (a ``ConnectionError``, hence an ``OSError``): the connection is
closed. Its subclasses, so that one ``except CommClosedError`` catches every way a
connection can end:

- ``ProtocolError``: the peer sent something that is not a valid frame; the connection
  has been closed by us.
- ``HandshakeError``: the handshake failed (version mismatch, the peer refused us, or a
  first message that is not a handshake). `connect` never retries it.

A comm is meant to have one reader at a time (one ``await read()`` in flight); writers
may interleave freely, frames go out whole and in call order.

Costs (benchmarks/comm_bench.py): batched, ~0.5 µs of sender CPU and ~1.5 µs of receiver
CPU per small message, nearly all of it msgpack. `send` has no backpressure: if the peer
stops reading, queued frames accumulate in tornado's write buffer. Pausing the cyclic GC
around ``unpackb`` was measured and gave no gain in the best case, so it is not done here;
GC tuning belongs to the process (e.g. ``gc.freeze()`` after start-up).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
from tornado.iostream import IOStream, StreamClosedError
from tornado.netutil import bind_sockets
from tornado.tcpclient import TCPClient
from tornado.tcpserver import TCPServer

__all__ = [
    "PROTOCOL_VERSION",
    "Blob",
    "Comm",
    "CommClosedError",
    "HandshakeError",
    "Listener",
    "ProtocolError",
    "connect",
    "listen",
    "parse_address",
]

logger = logging.getLogger(__name__)

#: Version of the wire protocol; both ends of a connection must agree on it.
PROTOCOL_VERSION = 1

#: msgpack ExtType code of an out-of-band buffer reference.
BLOB_EXT_CODE = 1

#: Default limit on the total size of one incoming frame (header + body + buffers).
DEFAULT_MAX_FRAME_BYTES = 2 * 1024**3
#: Default limit on the number of out-of-band buffers in one incoming frame.
DEFAULT_MAX_BUFFERS = 1 << 20
#: Default batching window of `Comm.send`, in seconds.
DEFAULT_INTERVAL = 0.002
#: Frames `send` may flush at once within one ``interval`` before it waits out the window:
#: a request/response exchange never waits, a stream of sends is batched.
BURST_FRAMES = 4
#: A batch that encodes to more than this goes out as several frames of about this size
#: (whole messages each): the receiver decodes a frame at once, so this bounds the
#: memory a burst of large messages (graph slices) takes there at a time.
FRAME_SPLIT_BYTES = 1024 * 1024

_SCHEMES = ("tcp", "tls")
_HEAD = struct.Struct("<QQ")  # buffer count n, body length
_INDEX = struct.Struct("<I")  # payload of a Blob ExtType
# Parts of a frame smaller than this are copied together into one write (one syscall);
# larger ones are handed to tornado as memoryviews, without a copy.
_COALESCE_BYTES = 64 * 1024
# Bodies at least this large are read straight into a fresh bytearray (no extra copy).
_READ_INTO_BYTES = 64 * 1024


class CommClosedError(ConnectionError):
    """The connection is closed (by the peer, by us, or because of an error)."""


class ProtocolError(CommClosedError):
    """The peer sent bytes that are not a valid frame; the connection has been closed."""


class HandshakeError(CommClosedError):
    """The handshake failed: protocol mismatch, refusal by the peer, or no handshake."""


# ---------------------------------------------------------------------------- addresses


def parse_address(address: str) -> tuple[str, str, int]:
    """Split ``"tcp://host:port"`` or ``"tls://host:port"`` into ``(scheme, host, port)``.

    IPv6 hosts are written in brackets (``tcp://[::1]:8786``) and returned without them.
    Raises ``ValueError`` naming the address for anything else.
    """
    if not isinstance(address, str):
        # ValueError, not TypeError: every bad address is one kind of error for callers
        message = f"address must be a str like 'tcp://host:port', got {address!r}"
        raise ValueError(message)  # noqa: TRY004
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ValueError(f"address {address!r} must start with 'tcp://' or 'tls://'")
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host or not port_text:
        raise ValueError(f"address {address!r} must look like '{scheme}://host:port'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"address {address!r}: write an IPv6 host in brackets, [::1]")
    if not host or any(c in host for c in "/[]@ "):
        raise ValueError(f"address {address!r} has an invalid host {host!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"address {address!r} has an invalid port {port_text!r}")
    return scheme, host, int(port_text)


def _format_address(scheme: str, host: str, port: int) -> str:
    """The inverse of `parse_address`."""
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _check_ssl(address: str, scheme: str, ssl_context: ssl.SSLContext | None) -> None:
    """``tls://`` needs an SSLContext and ``tcp://`` must not get one."""
    if scheme == "tls" and ssl_context is None:
        raise ValueError(f"{address!r} is a tls:// address: pass ssl_context=")
    if scheme == "tcp" and ssl_context is not None:
        raise ValueError(f"{address!r} is a tcp:// address but ssl_context= was given")


# ---------------------------------------------------------------------------- framing


class Blob:
    """A binary payload that travels next to the msgpack body, not inside it.

    Wrap bytes, a bytearray, a memoryview (or any C-contiguous buffer) to have it sent
    without being copied into the body. The receiver gets a ``memoryview`` in its place.
    """

    __slots__ = ("buffer",)

    def __init__(self, buffer: bytes | bytearray | memoryview) -> None:
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise ValueError("Blob needs a C-contiguous buffer")
        self.buffer = view.cast("B") if view.format != "B" or view.ndim != 1 else view

    def __len__(self) -> int:
        return self.buffer.nbytes

    def __repr__(self) -> str:
        return f"Blob(<{self.buffer.nbytes} bytes>)"


class _Encoder:
    """Turns a batch of message dicts into the byte chunks of a frame (or of a few).

    Holds one reused ``msgpack.Packer``; its ``default`` hook moves each `Blob` into
    the frame's buffer list. Not reentrant, which is fine: packing never awaits.
    """

    __slots__ = ("_buffers", "_packer")

    def __init__(self) -> None:
        self._buffers: list[memoryview] = []
        self._packer = msgpack.Packer(default=self._default)

    def _default(self, obj: Any) -> msgpack.ExtType:
        if type(obj) is Blob:
            self._buffers.append(obj.buffer)
            return msgpack.ExtType(BLOB_EXT_CODE, _INDEX.pack(len(self._buffers) - 1))
        raise TypeError(f"cannot serialize a {type(obj).__name__!r} object in a message")

    def encode(self, msgs: list[dict]) -> list[bytes | memoryview]:
        """The frame for ``msgs``, as chunks to write in order. Raises TypeError."""
        self._buffers = []
        return self._frame(self._packer.pack(msgs))

    def encode_frames(self, msgs: list[dict], split_bytes: int) -> list[list]:
        """``msgs`` as one frame, or as several of about ``split_bytes`` of body each
        (never splitting a message) if one frame would be larger."""
        self._buffers = []
        body = self._packer.pack(msgs)
        if len(msgs) == 1 or len(body) <= split_bytes:
            return [self._frame(body)]
        frames, parts, size = [], [], 0
        self._buffers = []
        for msg in msgs:
            part = self._packer.pack(msg)
            parts.append(part)
            size += len(part)
            if size >= split_bytes:
                frames.append(self._frame(self._array(parts)))
                parts, size, self._buffers = [], 0, []
        if parts:
            frames.append(self._frame(self._array(parts)))
        return frames

    def _array(self, packed: list[bytes]) -> bytes:
        return self._packer.pack_array_header(len(packed)) + b"".join(packed)

    def _frame(self, body: bytes) -> list[bytes | memoryview]:
        """Header, body and the Blobs collected while packing it, as chunks to write."""
        buffers = self._buffers
        if buffers:
            n = len(buffers)
            lengths = [len(body)] + [b.nbytes for b in buffers]
            header = struct.pack(f"<{n + 2}Q", n, *lengths)
            self._buffers = []
            return _coalesce([header, body, *buffers])
        header = _HEAD.pack(0, len(body))
        if len(body) < _COALESCE_BYTES:
            return [header + body]
        return [header, body]


def _coalesce(parts: list) -> list:
    """Join runs of small parts into one bytes object; keep large parts as they are."""
    out: list = []
    run: list = []
    for part in parts:
        if len(part) < _COALESCE_BYTES:
            run.append(part)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(part)
    if run:
        out.append(b"".join(run))
    return out


def _check_batch(batch: Any) -> list[dict]:
    """The decoded body as a list of messages, or ProtocolError if it is not a batch."""
    if type(batch) is not tuple:
        raise ProtocolError(f"frame body must be an array of messages, got {type(batch).__name__}")
    for msg in batch:
        if type(msg) is not dict or type(msg.get("op")) is not str:
            raise ProtocolError(f"every message must be a map with a str 'op': {msg!r:.200}")
    return list(batch)


# ---------------------------------------------------------------------------- Comm


class Comm:
    """One framed, handshaken connection to a peer.

    Created by `connect` and `listen`; not meant to be built by hand. ``extra`` holds
    the peer's handshake info (its handshake message without ``"op"``).
    ``interval`` is the batching window of `send`, in seconds; ``max_frame_bytes`` and
    ``max_buffers`` bound what `read` accepts from the peer.
    """

    def __init__(
        self,
        stream: IOStream,
        scheme: str = "tcp",
        *,
        interval: float = DEFAULT_INTERVAL,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_buffers: int = DEFAULT_MAX_BUFFERS,
    ) -> None:
        self._stream = stream
        self._loop = asyncio.get_running_loop()
        self._encoder = _Encoder()
        self.interval = interval
        self.max_frame_bytes = max_frame_bytes
        self.max_buffers = max_buffers
        self.extra: dict = {}
        self.local_address, self.peer_address = _socket_addresses(stream, scheme)
        self._closed = False  # closed by either side: send() refuses
        self._aborted = False  # closed by us: read() refuses, even with data buffered
        self._queue: list[dict] = []
        self._flush_handle: asyncio.Handle | None = None
        self._window_start = float("-inf")
        self._frames_in_window = 0
        self._last_write: Awaitable | None = None
        self._in_buffers: list = []
        stream.max_buffer_size = max(stream.max_buffer_size, max_frame_bytes + (1 << 20))
        stream.set_close_callback(self._on_stream_closed)
        _set_nodelay(stream)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Comm {self.local_address} -> {self.peer_address} ({state})>"

    @property
    def closed(self) -> bool:
        """True once the comm is closed, by either side."""
        return self._closed or self._stream.closed()

    # ------------------------------------------------------------ writing

    async def write(self, msgs: list[dict]) -> None:
        """Write ``msgs`` now (one frame; several if large, see `FRAME_SPLIT_BYTES`) and
        wait until it is handed to the kernel.

        Messages queued by `send` go out first. Raises TypeError (comm unharmed) if a
        message cannot be encoded, CommClosedError if the comm is closed.
        """
        if type(msgs) is not list and type(msgs) is not tuple:
            raise TypeError(f"write() takes a list of message dicts, got {type(msgs).__name__}")
        self._check_open()
        try:
            if self._queue:
                self._flush()
            if msgs:
                await self._write_frame(msgs)
        except StreamClosedError as e:
            raise self._closed_error() from e

    def send(self, msg: dict) -> None:
        """Queue ``msg``; all queued messages go out together as one frame.

        The first ``BURST_FRAMES`` frames of each ``interval`` flush on the next loop
        iteration, so a request/response exchange adds no delay; after that the flush
        waits for the window to end, so a stream of sends shares frames. Raises
        CommClosedError if the comm is known to be closed. Encoding happens at flush
        time: a message that cannot be encoded is logged and aborts the comm, since
        the peer would otherwise silently miss the whole batch.
        """
        if self._closed:
            raise self._closed_error()
        self._queue.append(msg)
        if self._flush_handle is None:
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        loop = self._loop
        now = loop.time()
        if now - self._window_start >= self.interval:
            self._window_start = now
            self._frames_in_window = 0
        wait = self._window_start + self.interval - now
        if self._frames_in_window >= BURST_FRAMES and wait > 0:
            self._flush_handle = loop.call_later(wait, self._flush)
        else:
            self._flush_handle = loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write every queued message as one frame (a loop callback, never awaits)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        msgs, self._queue = self._queue, []
        if not msgs or self._stream.closed():
            return
        try:
            self._write_frame(msgs)
        except StreamClosedError:
            self._on_stream_closed()
        except Exception:
            logger.exception("cannot encode a batch for %s; aborting the comm", self.peer_address)
            self.abort()

    def _write_frame(self, msgs: list[dict]) -> Awaitable:
        """Encode and hand the batch to tornado (one frame, or several if it is large:
        `FRAME_SPLIT_BYTES`); returns the last chunk's future."""
        frames = self._encoder.encode_frames(msgs, FRAME_SPLIT_BYTES)
        write = self._stream.write
        for chunks in frames:
            for chunk in chunks:
                future = write(chunk)
        self._frames_in_window += len(frames)
        self._last_write = future
        return future

    # ------------------------------------------------------------ reading

    async def read(self) -> list[dict]:
        """Wait for the next frame and return its messages.

        Raises CommClosedError once the comm is closed, ProtocolError (after closing
        the comm) if the peer sent something that is not a valid frame.
        """
        if self._aborted:
            raise self._closed_error()
        try:
            body, buffers = await self._read_frame()
            return self._decode(body, buffers)
        except ProtocolError:
            self.abort()
            raise
        except StreamClosedError as e:
            self._on_stream_closed()
            raise self._closed_error() from e

    async def _read_frame(self) -> tuple[bytes | bytearray, list]:
        stream = self._stream
        head = await stream.read_bytes(_HEAD.size, partial=True)
        try:
            if len(head) < _HEAD.size:
                head += await stream.read_bytes(_HEAD.size - len(head))
            n, body_len = _HEAD.unpack(head)
            lengths = await self._read_lengths(n, body_len)
            body = await self._read_chunk(body_len, as_bytes=body_len < _READ_INTO_BYTES)
            buffers = [await self._read_chunk(size, as_bytes=False) for size in lengths]
        except StreamClosedError as e:
            if self._aborted:
                raise
            raise ProtocolError(f"{self.peer_address} closed the connection mid-frame") from e
        return body, buffers

    async def _read_lengths(self, n: int, body_len: int) -> tuple[int, ...]:
        """Read and check the buffer lengths of a frame whose header says n, body_len."""
        if n > self.max_buffers:
            raise ProtocolError(f"frame from {self.peer_address} announces {n} buffers "
                                f"(limit {self.max_buffers})")
        lengths = struct.unpack(f"<{n}Q", await self._stream.read_bytes(8 * n)) if n else ()
        total = _HEAD.size + 8 * n + body_len + sum(lengths)
        if total > self.max_frame_bytes:
            raise ProtocolError(f"frame from {self.peer_address} announces {total} bytes "
                                f"(limit {self.max_frame_bytes})")
        if body_len == 0:
            raise ProtocolError(f"frame from {self.peer_address} has an empty body")
        return lengths

    async def _read_chunk(self, size: int, as_bytes: bool) -> bytes | memoryview:
        if as_bytes:
            return await self._stream.read_bytes(size)
        buffer = bytearray(size)
        if size:
            await self._stream.read_into(buffer)
        return memoryview(buffer)

    def _decode(self, body: bytes | bytearray, buffers: list) -> list[dict]:
        self._in_buffers = buffers
        try:
            batch = msgpack.unpackb(
                body, use_list=False, strict_map_key=False, ext_hook=self._ext_hook
            )
        except ProtocolError:
            raise
        except Exception as e:
            raise ProtocolError(f"undecodable frame body from {self.peer_address}: {e}") from e
        finally:
            self._in_buffers = []
        return _check_batch(batch)

    def _ext_hook(self, code: int, data: bytes) -> memoryview:
        if code != BLOB_EXT_CODE or not 0 < len(data) <= 8:
            raise ProtocolError(f"unknown msgpack ext type {code} from {self.peer_address}")
        index = int.from_bytes(data, "little")
        if index >= len(self._in_buffers):
            raise ProtocolError(f"buffer reference {index} out of range from {self.peer_address}")
        return self._in_buffers[index]

    # ------------------------------------------------------------ closing

    async def close(self, timeout: float = 5.0) -> None:
        """Flush queued messages (best effort, up to ``timeout`` seconds), then close."""
        if self._closed:
            return
        try:
            if self._queue:
                self._flush()
            pending = self._last_write
            if pending is not None and not pending.done():
                # shield: a writer awaiting the same future must not see it cancelled
                await asyncio.wait_for(asyncio.shield(pending), timeout)
        except (StreamClosedError, asyncio.TimeoutError, OSError):
            pass
        finally:
            self.abort()

    def abort(self) -> None:
        """Close now; queued and unsent messages are dropped."""
        self._closed = self._aborted = True
        self._queue = []
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._stream.close()

    def _on_stream_closed(self) -> None:
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None

    def _check_open(self) -> None:
        if self.closed:
            raise self._closed_error()

    def _closed_error(self) -> CommClosedError:
        reason = self._stream.error
        suffix = f": {reason}" if reason else ""
        return CommClosedError(f"comm to {self.peer_address} is closed{suffix}")


def _socket_addresses(stream: IOStream, scheme: str) -> tuple[str, str]:
    """(local_address, peer_address) of a connected stream, as ``scheme://host:port``."""
    sock = stream.socket
    local = sock.getsockname()
    try:
        peer = sock.getpeername()
    except OSError:  # the peer is already gone
        return _format_address(scheme, local[0], local[1]), f"{scheme}://<unknown>"
    return _format_address(scheme, local[0], local[1]), _format_address(scheme, peer[0], peer[1])


def _set_nodelay(stream: IOStream) -> None:
    try:
        stream.set_nodelay(True)
    except OSError:  # already closed, or not a TCP socket
        pass


# ---------------------------------------------------------------------------- handshake


def _handshake_msg(info: dict) -> dict:
    """Our first message: ``{"op": "handshake", "protocol": PROTOCOL_VERSION, **info}``.

    As protocol.md spells it, ``info`` comes last, so an explicit ``"protocol"`` in it
    wins: tests use that to provoke a mismatch.
    """
    return {"op": "handshake", "protocol": PROTOCOL_VERSION, **info}


def _handshake_problem(ours: dict, msgs: list[dict]) -> str | None:
    """What is wrong with the peer's first frame ``msgs``, or None if it is a good handshake."""
    if len(msgs) != 1:
        return f"expected one handshake message, got a frame of {len(msgs)}"
    msg = msgs[0]
    if msg["op"] != "handshake":
        return f"expected a handshake, got op {msg['op']!r}"
    if msg.get("protocol") != ours["protocol"]:
        return (f"protocol mismatch: peer speaks {msg.get('protocol')!r}, "
                f"we speak {ours['protocol']!r}")
    return None


async def _handshake(comm: Comm, info: dict) -> None:
    """Exchange handshakes on a fresh comm; on success fill ``comm.extra``.

    Raises HandshakeError (after telling the peer why and closing) on failure.
    """
    ours = _handshake_msg(info)
    await comm.write([ours])
    try:
        msgs = await comm.read()
    except ProtocolError as e:
        raise HandshakeError(f"handshake with {comm.peer_address} failed: {e}") from e
    first = msgs[0] if msgs else {}
    if first.get("op") == "error":
        comm.abort()
        raise HandshakeError(f"{comm.peer_address} refused the handshake: {first.get('error')}")
    problem = _handshake_problem(ours, msgs)
    if problem is not None:
        await _refuse(comm, problem)
        raise HandshakeError(f"handshake with {comm.peer_address} failed: {problem}")
    comm.extra = {k: v for k, v in first.items() if k != "op"}


async def _refuse(comm: Comm, reason: str) -> None:
    """Tell the peer why we hang up (best effort), then close."""
    try:
        await asyncio.wait_for(comm.write([{"op": "error", "error": reason}]), 1.0)
    except (OSError, asyncio.TimeoutError):
        pass
    comm.abort()


# ---------------------------------------------------------------------------- connect


async def connect(
    address: str,
    handshake: dict,
    timeout: float = 10,
    ssl_context: ssl.SSLContext | None = None,
    *,
    interval: float = DEFAULT_INTERVAL,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Comm:
    """Connect to ``address``, exchange handshakes and return the `Comm`.

    Refused or dropped attempts are retried with exponential backoff (10 ms doubling,
    capped at 1 s) until ``timeout`` seconds have passed; then ``TimeoutError`` (an
    OSError) names the address and the last error. ``HandshakeError`` and TLS errors
    are raised at once, never retried.
    """
    scheme, host, port = parse_address(address)
    _check_ssl(address, scheme, ssl_context)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    backoff = 0.01
    while True:
        remaining = deadline - loop.time()
        try:
            return await _connect_once(
                scheme, host, port, handshake, remaining, ssl_context,
                interval=interval, max_frame_bytes=max_frame_bytes,
            )
        except HandshakeError:
            raise
        except ssl.SSLError as e:
            raise ConnectionError(f"TLS connection to {address} failed: {e}") from e
        except (OSError, asyncio.TimeoutError, StreamClosedError) as e:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(
                    f"could not connect to {address} within {timeout}s: "
                    f"{type(e).__name__}: {e}"
                ) from e
            await asyncio.sleep(min(backoff, remaining))
            backoff = min(backoff * 2, 1.0)


async def _connect_once(
    scheme: str,
    host: str,
    port: int,
    handshake: dict,
    timeout: float,
    ssl_context: ssl.SSLContext | None,
    **comm_options: Any,
) -> Comm:
    """One attempt: open the stream and shake hands, all within ``timeout`` seconds."""
    if timeout <= 0:
        raise asyncio.TimeoutError("no time left")
    stream = await TCPClient().connect(
        host, port, ssl_options=ssl_context, timeout=timeout,
        max_buffer_size=comm_options["max_frame_bytes"] + (1 << 20),
    )
    comm = Comm(stream, scheme, **comm_options)
    try:
        await asyncio.wait_for(_handshake(comm, handshake), timeout)
    except BaseException:
        comm.abort()
        raise
    return comm


# ---------------------------------------------------------------------------- listen


class Listener:
    """Accepts connections on one address, shakes hands, and hands each `Comm` over.

    ``address`` is the address actually bound (the real port when 0 was asked for).
    """

    def __init__(
        self,
        scheme: str,
        on_connection: Callable[[Comm], Any],
        handshake: dict,
        ssl_context: ssl.SSLContext | None,
        comm_options: dict,
        handshake_timeout: float,
    ) -> None:
        self._scheme = scheme
        self._on_connection = on_connection
        self._handshake = dict(handshake)
        self._comm_options = comm_options
        self._handshake_timeout = handshake_timeout
        self._tasks: set[asyncio.Task] = set()
        self._pending: set[Comm] = set()
        self._server = _StreamServer(
            self._accept,
            ssl_options=ssl_context,
            max_buffer_size=comm_options["max_frame_bytes"] + (1 << 20),
        )
        self.address = ""

    def __repr__(self) -> str:
        return f"<Listener {self.address}>"

    @property
    def port(self) -> int:
        """The port actually bound."""
        return parse_address(self.address)[2]

    def _bind(self, host: str, port: int) -> None:
        try:
            sockets = bind_sockets(port, address=host)
        except OSError as e:
            address = _format_address(self._scheme, host, port)
            raise OSError(f"cannot listen on {address}: {e}") from e
        self._server.add_sockets(sockets)
        bound_host, bound_port = sockets[0].getsockname()[:2]
        self.address = _format_address(self._scheme, bound_host, bound_port)

    def _accept(self, stream: IOStream) -> None:
        """tornado's per-connection callback: one task per connection."""
        task = asyncio.get_running_loop().create_task(self._serve(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, stream: IOStream) -> None:
        try:
            comm = Comm(stream, self._scheme, **self._comm_options)
        except OSError as e:  # the peer left before we looked at the socket
            logger.info("connection to %s dropped before the handshake: %s", self.address, e)
            stream.close()
            return
        self._pending.add(comm)
        try:
            await asyncio.wait_for(_handshake(comm, self._handshake), self._handshake_timeout)
        except Exception as e:  # noqa: BLE001 - one bad peer must not break the listener
            logger.warning("handshake on %s failed: %s", self.address, e)
            comm.abort()
            return
        finally:
            self._pending.discard(comm)
        await self._run_handler(comm)

    async def _run_handler(self, comm: Comm) -> None:
        try:
            result = self._on_connection(comm)
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("connection handler failed for %s; closing it", comm.peer_address)
            comm.abort()

    async def stop(self) -> None:
        """Stop accepting and drop connections still in their handshake.

        Handshaken comms belong to ``on_connection`` and are left alone.
        """
        self._server.stop()
        for comm in list(self._pending):
            comm.abort()


class _StreamServer(TCPServer):
    """A TCPServer that passes each accepted stream to a plain callback."""

    def __init__(self, accept: Callable[[IOStream], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._accept_stream = accept

    def handle_stream(self, stream: IOStream, address: Any) -> None:
        self._accept_stream(stream)


async def listen(
    address: str,
    on_connection: Callable[[Comm], Awaitable[None] | None],
    handshake: dict,
    ssl_context: ssl.SSLContext | None = None,
    *,
    interval: float = DEFAULT_INTERVAL,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    handshake_timeout: float = 10.0,
) -> Listener:
    """Listen on ``address`` (port 0 picks a free port) and return the `Listener`.

    Each accepted connection is handshaken (within ``handshake_timeout`` seconds), then
    ``await on_connection(comm)`` runs in a task of its own. A failed handshake is
    logged and closes only that connection; an exception in ``on_connection`` is
    logged and closes that comm. When ``on_connection`` returns the comm stays open:
    the handler may keep it.
    """
    scheme, host, port = parse_address(address)
    _check_ssl(address, scheme, ssl_context)
    options = {"interval": interval, "max_frame_bytes": max_frame_bytes}
    listener = Listener(scheme, on_connection, handshake, ssl_context, options, handshake_timeout)
    listener._bind(host, port)
    return listener
