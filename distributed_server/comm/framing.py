"""Framed, batched msgpack messages over tornado TCP (and TLS): the wire of distributed-core.

What this module does
---------------------
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
  iteration, later ones wait for the window to end). At most one flush is ever pending;
  no asyncio Task is created per message.
- Refuses bad input from the peer: oversized frames (``max_frame_bytes``, 2 GiB by
  default after the handshake), too many buffers, invalid msgpack, a body that is not
  an array of dicts with a str ``"op"``, unknown ext types, frames cut off by a closed
  connection. Each raises `ProtocolError` from ``read()`` and closes that one
  connection. Receive buffers grow as bytes arrive, never to an announced length at once.

A `Comm` is made by `connect` (`distributed_server.comm.connector`) or a `Listener`
(`distributed_server.comm.listener`), after the handshake that admits the peer
(`distributed_server.comm.handshake`); addresses are parsed in
`distributed_server.comm.addresses`.

What it never does
------------------
- It never unpickles, evaluates or imports anything the peer sends: the only decoder
  is msgpack with an ext hook that hands back raw buffers. Pickled payloads pass
  through as opaque bytes/memoryviews.
- It never creates a Task per message, never blocks the event loop on I/O, and never
  retries on its own (only `connect` does, until its timeout).

Errors
------
``CommClosedError`` (a ``ConnectionError``, hence an ``OSError``): the connection is
closed. Its subclasses, so that one ``except CommClosedError`` catches every way a
connection can end:

- ``ProtocolError``: the peer sent something that is not a valid frame; the connection
  has been closed by us.
- ``HandshakeError``: the handshake failed (version mismatch, the peer refused us, or a
  first message that is not a handshake). `connect` never retries it.
- ``ListenerBusyError``: a listener refused the connection for now; `connect` retries it.

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
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
from tornado.iostream import IOStream, StreamClosedError

from ..protocol.wire import Blob
from .addresses import format_address

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "TRAFFIC",
    "Blob",
    "Comm",
    "CommClosedError",
    "HandshakeError",
    "ListenerBusyError",
    "ProtocolError",
    "frame_bytes",
]


logger = logging.getLogger(__name__)


def _drop_tls_handshake_noise(record: logging.LogRecord) -> bool:
    """tornado logs every failed TLS handshake and read at WARNING; the listener and the
    comm report them themselves, rate-limited, so a peer cannot flood the log."""
    return not str(record.msg).startswith(("SSL Error on", "error on read"))


logging.getLogger("tornado.general").addFilter(_drop_tls_handshake_noise)

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

_HEAD = struct.Struct("<QQ")  # buffer count n, body length
_INDEX = struct.Struct("<I")  # payload of a Blob ExtType
# Parts of a frame smaller than this are copied together into one write (one syscall);
# larger ones are handed to tornado as memoryviews, without a copy.
_COALESCE_BYTES = 64 * 1024
# Bodies at least this large are read straight into a fresh bytearray (no extra copy).
_READ_INTO_BYTES = 64 * 1024
# A large body or buffer is first read into this many bytes, then the buffer doubles.
_FIRST_READ_BYTES = 1024 * 1024
# The initial buffer of each comm's Packer (msgpack's default is 256 KiB); it grows as
# large messages need.
_PACKER_BUFFER_BYTES = 16 * 1024


class CommClosedError(ConnectionError):
    """The connection is closed (by the peer, by us, or because of an error)."""


class ProtocolError(CommClosedError):
    """The peer sent bytes that are not a valid frame; the connection has been closed."""


class HandshakeError(CommClosedError):
    """The handshake failed: protocol mismatch, refusal by the peer, or no handshake."""


class ListenerBusyError(CommClosedError):
    """The listener refused the connection for now: it has too many. `connect` retries."""




# ---------------------------------------------------------------------------- framing


class Traffic:
    """Bytes and frames this process has written to and read from its comms, handshakes
    included (counted per frame, not per message: a few additions a frame). Read by
    the ``/metrics`` endpoints; increments from two threads (a Client's loop and a
    server's in one process) may race and lose a count, which metrics can bear."""

    __slots__ = ("bytes_received", "bytes_sent", "frames_received", "frames_sent")

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0


#: This process's comm traffic.
TRAFFIC = Traffic()


class _Encoder:
    """Turns a batch of message dicts into the byte chunks of a frame (or of a few).

    Holds one reused ``msgpack.Packer``; its ``default`` hook moves each `Blob` into
    the frame's buffer list. Not reentrant, which is fine: packing never awaits. The
    hook is a closure over that list, not a bound method: a cycle through the Packer
    would keep it (and its buffer) alive until the cyclic GC runs, which servers make
    rare.
    """

    __slots__ = ("_buffers", "_packer")

    def __init__(self) -> None:
        buffers: list[memoryview] = []

        def default(obj: Any) -> msgpack.ExtType:
            if type(obj) is Blob:
                buffers.append(obj.buffer)
                return msgpack.ExtType(BLOB_EXT_CODE, _INDEX.pack(len(buffers) - 1))
            raise TypeError(f"cannot serialize a {type(obj).__name__!r} object in a message")

        self._buffers = buffers  # cleared in place, never replaced
        self._packer = msgpack.Packer(default=default, buf_size=_PACKER_BUFFER_BYTES)

    def encode(self, msgs: list[dict]) -> list[bytes | memoryview]:
        """The frame for ``msgs``, as chunks to write in order. Raises TypeError."""
        self._buffers.clear()
        return self._frame(self._packer.pack(msgs))

    def encode_frames(self, msgs: list[dict], split_bytes: int) -> list[list]:
        """``msgs`` as one frame, or as several of about ``split_bytes`` of body each
        (never splitting a message) if one frame would be larger."""
        self._buffers.clear()
        body = self._packer.pack(msgs)
        if len(msgs) == 1 or len(body) <= split_bytes:
            return [self._frame(body)]
        frames, parts, size = [], [], 0
        self._buffers.clear()
        for msg in msgs:
            part = self._packer.pack(msg)
            parts.append(part)
            size += len(part)
            if size >= split_bytes:
                frames.append(self._frame(self._array(parts)))
                parts, size = [], 0
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
            chunks = _coalesce([header, body, *buffers])
            buffers.clear()
            return chunks
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


def frame_bytes(msgs: list[dict]) -> bytes:
    """The whole frame of ``msgs`` (no out-of-band buffers) as one bytes object, for a
    raw socket that has no `Comm` (a listener refusing a connection before it makes one)."""
    body = msgpack.packb(msgs)
    return _HEAD.pack(0, len(body)) + body


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
        self._close_callbacks: list[Callable[[], Any]] = []
        stream.max_buffer_size = max(stream.max_buffer_size, max_frame_bytes + (1 << 20))
        stream.set_close_callback(self._on_stream_closed)
        _tune_socket(stream)

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

    def flush_now(self):
        """Write what `send` queued now (not at the end of its window); the future of the
        last write handed to tornado, done once it is in the kernel (None if nothing was
        ever written)."""
        if self._queue and not self._stream.closed():
            self._flush()
        return self._last_write

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
        size = 0
        for chunks in frames:
            for chunk in chunks:
                size += chunk.nbytes if type(chunk) is memoryview else len(chunk)
                future = write(chunk)
        self._frames_in_window += len(frames)
        TRAFFIC.bytes_sent += size
        TRAFFIC.frames_sent += len(frames)
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
            TRAFFIC.bytes_received += _HEAD.size + 8 * n + body_len + sum(lengths)
            TRAFFIC.frames_received += 1
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
        if _HEAD.size + 8 * n + body_len > self.max_frame_bytes:
            raise ProtocolError(f"frame from {self.peer_address} announces over "
                                f"{self.max_frame_bytes} bytes (limit)")
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
        # The buffer grows as bytes arrive (doubling), never to the announced size at
        # once: a peer that announces gigabytes and sends nothing costs us nothing.
        buffer = bytearray(min(size, _FIRST_READ_BYTES))
        filled = 0
        while filled < size:
            if filled == len(buffer):
                buffer.extend(bytes(min(len(buffer), size - len(buffer))))
            chunk = memoryview(buffer)[filled:]
            try:
                filled += await self._stream.read_into(chunk)
            finally:
                chunk.release()  # the bytearray cannot grow while a view of it lives
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
        self._aborted = True
        self._queue = []
        self._stream.close()
        self._on_stream_closed()

    def add_close_callback(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` once, when the comm closes (at once if it is closed)."""
        if self.closed:
            callback()
        else:
            self._close_callbacks.append(callback)

    def _on_stream_closed(self) -> None:
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            callback()

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
    try:
        local = sock.getsockname()
    except (OSError, AttributeError):  # closed already: no socket any more
        return f"{scheme}://<closed>", f"{scheme}://<closed>"
    try:
        peer = sock.getpeername()
    except OSError:  # the peer is already gone
        return format_address(scheme, local[0], local[1]), f"{scheme}://<unknown>"
    return format_address(scheme, local[0], local[1]), format_address(scheme, peer[0], peer[1])


def _tune_socket(stream: IOStream) -> None:
    """No Nagle delay; TCP keepalive, so a peer whose machine vanished is noticed."""
    try:
        stream.set_nodelay(True)
        sock = stream.socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in _KEEPALIVE_OPTIONS:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
    except (OSError, AttributeError):  # already closed, or not a TCP socket
        pass


# Probe an idle connection after 10 s, every 5 s, give up after 3 unanswered probes.
_KEEPALIVE_OPTIONS = tuple(
    (getattr(socket, name), value)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)
)
