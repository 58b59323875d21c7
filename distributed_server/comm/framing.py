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
- A handshake on every connection (`connect`, `listen`), in two rounds: ``hello``
  (protocol version, auth mode, a fresh nonce) and ``handshake`` (the role's info and,
  when the cluster has a token, an HMAC proof over both nonces; the token never crosses
  the wire). Under TLS (`Security` with TLS files) both sides also present certificates
  of the cluster's CA. The listener checks the connector before it says anything about
  itself; on any mismatch the side that notices writes ``{"op": "error", "error": ...}``
  and closes, and `connect` raises `HandshakeError`.
- Admits peers carefully: until the handshake is done a frame may hold at most
  ``HANDSHAKE_MAX_FRAME_BYTES`` (64 KiB) and the peer has ``handshake_timeout`` seconds;
  a listener caps open connections (in all and per host) and connections still in
  their handshake, refuses the rest with a clear error, and pauses accepting (instead
  of spinning) when the process runs out of file descriptors. Refusals and failed
  handshakes are logged at most a few times per 10 s.
- Refuses bad input from the peer: oversized frames (``max_frame_bytes``, 2 GiB by
  default after the handshake), too many buffers, invalid msgpack, a body that is not
  an array of dicts with a str ``"op"``, unknown ext types, frames cut off by a closed
  connection. Each raises `ProtocolError` from ``read()`` and closes that one
  connection. Receive buffers grow as bytes arrive, never to an announced length at once.

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
import contextlib
import hashlib
import hmac
import inspect
import logging
import secrets
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import msgpack
from tornado.iostream import IOStream, SSLIOStream, StreamClosedError
from tornado.netutil import bind_sockets
from tornado.tcpclient import TCPClient

from distributed_core import bounded_repr

from ..logs import QuietLog
from ..protocol.wire import Blob
from ..security import Security

__all__ = [
    "PROTOCOL_VERSION",
    "Blob",
    "Comm",
    "CommClosedError",
    "HandshakeError",
    "Listener",
    "ListenerBusyError",
    "ProtocolError",
    "TRAFFIC",
    "connect",
    "listen",
    "parse_address",
]

logger = logging.getLogger(__name__)


def _drop_tls_handshake_noise(record: logging.LogRecord) -> bool:
    """tornado logs every failed TLS handshake and read at WARNING; the listener and the
    comm report them themselves, rate-limited, so a peer cannot flood the log."""
    return not str(record.msg).startswith(("SSL Error on", "error on read"))


logging.getLogger("tornado.general").addFilter(_drop_tls_handshake_noise)

#: Version of the wire protocol; both ends of a connection must agree on it.
PROTOCOL_VERSION = 2

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
    if not host or any(c in host for c in "/[]@") or not host.isprintable() \
            or any(c.isspace() for c in host):
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


class Traffic:
    """Bytes and frames this process has written to and read from its comms, handshakes
    included (counted per frame, not per message: a few additions a frame). Read by
    the ``/metrics`` endpoints; increments from two threads (a Client's loop and a
    server's in one process) may race and lose a count, which metrics can bear."""

    __slots__ = ("bytes_sent", "bytes_received", "frames_sent", "frames_received")

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
        return _format_address(scheme, local[0], local[1]), f"{scheme}://<unknown>"
    return _format_address(scheme, local[0], local[1]), _format_address(scheme, peer[0], peer[1])


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


# ---------------------------------------------------------------------------- handshake
#
# Two rounds, connector first (docs/protocol.md, section 3):
#   connector -> {"op": "hello", "protocol", "auth", "nonce"}
#   listener  -> {"op": "hello", "protocol", "auth", "nonce"}   (or an error, and close)
#   connector -> {"op": "handshake", "proof"?, **info}
#   listener  -> {"op": "handshake", "proof"?, **info}           (or an error, and close)
# With a token, "auth" is "token" and each proof is an HMAC-SHA256 keyed by the token over
# both nonces and the sender's side; the token itself never crosses the wire. The listener
# checks the connector's proof before it sends anything about itself. Until the handshake
# is done a frame may hold at most HANDSHAKE_MAX_FRAME_BYTES and no out-of-band buffer.

#: Limit on one frame before the handshake is done.
HANDSHAKE_MAX_FRAME_BYTES = 64 * 1024
#: Default time a peer has to complete the handshake (TLS included).
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
_NONCE_BYTES = 32
_PROOF_LABEL = b"distributed-core handshake v2\0"
_CONNECTOR, _LISTENER = b"connector", b"listener"
_HINT = " (is the address's scheme, tcp:// or tls://, right, and does the cluster need a token?)"


def _proof(token: str, side: bytes, listener_nonce: bytes, connector_nonce: bytes) -> bytes:
    """What ``side`` sends to prove it holds ``token``, bound to this connection's nonces."""
    message = _PROOF_LABEL + side + b"\0" + listener_nonce + connector_nonce
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def _hello(token: str | None) -> dict:
    return {"op": "hello", "protocol": PROTOCOL_VERSION,
            "auth": "token" if token is not None else "none",
            "nonce": secrets.token_bytes(_NONCE_BYTES)}


def _hello_problem(ours: dict, theirs: dict) -> str | None:
    """Why the peer's hello does not fit ours, or None."""
    if theirs.get("protocol") != ours["protocol"]:
        return (f"protocol mismatch: peer speaks {bounded_repr(theirs.get('protocol'), 40)}, "
                f"we speak {ours['protocol']!r}")
    nonce = theirs.get("nonce")
    if type(nonce) is not bytes or len(nonce) != _NONCE_BYTES:
        return "the hello carries no valid nonce"
    if theirs.get("auth") != ours["auth"]:
        if ours["auth"] == "token":
            return ("this cluster requires its token: give the peer Security(token=...) or "
                    "set DCORE_TOKEN / DCORE_TOKEN_FILE")
        return "the peer expects a cluster token, but this process has none"
    return None


async def _read_handshake_msg(comm: Comm, expected_op: str) -> dict:
    """The peer's next handshake message; HandshakeError (after closing) if it is not one."""
    try:
        msgs = await comm.read()
    except ProtocolError as e:
        raise HandshakeError(f"handshake with {comm.peer_address} failed: {e}{_HINT}") from e
    except CommClosedError as e:
        raise HandshakeError(f"{comm.peer_address} closed the connection during the "
                             f"handshake{_HINT}") from e
    msg = msgs[0] if len(msgs) == 1 else {"op": f"a frame of {len(msgs)} messages"}
    if msg["op"] == "error":
        comm.abort()
        error = ListenerBusyError if msg.get("busy") is True else HandshakeError
        raise error(f"{comm.peer_address} refused the connection: "
                    f"{bounded_repr(msg.get('error'))}")
    if msg["op"] != expected_op:
        problem = f"expected {expected_op!r}, got {bounded_repr(msg['op'], 60)}"
        await _refuse(comm, problem)
        raise HandshakeError(f"handshake with {comm.peer_address} failed: {problem}")
    return msg


async def _fail(comm: Comm, problem: str) -> NoReturn:
    """Refuse the peer with ``problem`` and raise HandshakeError."""
    await _refuse(comm, problem)
    raise HandshakeError(f"handshake with {comm.peer_address} failed: {problem}")


def _peer_info(msg: dict) -> dict:
    return {k: v for k, v in msg.items() if k not in ("op", "proof")}


async def _check_proof(comm: Comm, msg: dict, expected: bytes, problem: str) -> None:
    """Refuse the peer with ``problem`` unless ``msg`` carries the ``expected`` proof
    (compared in constant time)."""
    proof = msg.get("proof")
    if type(proof) is not bytes or not hmac.compare_digest(proof, expected):
        await _fail(comm, problem)


async def _connector_handshake(comm: Comm, info: dict, token: str | None) -> None:
    ours = _hello(token)
    await comm.write([ours])
    theirs = await _read_handshake_msg(comm, "hello")
    problem = _hello_problem(ours, theirs)
    if problem is not None:
        await _fail(comm, problem)
    msg = {**info, "op": "handshake"}
    if token is not None:
        msg["proof"] = _proof(token, _CONNECTOR, theirs["nonce"], ours["nonce"])
    await comm.write([msg])
    reply = await _read_handshake_msg(comm, "handshake")
    if token is not None:
        await _check_proof(comm, reply, _proof(token, _LISTENER, theirs["nonce"], ours["nonce"]),
                           "the listener could not prove it holds the cluster token")
    comm.extra = _peer_info(reply)


async def _listener_handshake(comm: Comm, info: dict, token: str | None) -> None:
    theirs = await _read_handshake_msg(comm, "hello")
    ours = _hello(token)
    problem = _hello_problem(ours, theirs)
    if problem is not None:
        await _fail(comm, problem)
    await comm.write([ours])
    msg = await _read_handshake_msg(comm, "handshake")
    if token is not None:
        await _check_proof(comm, msg, _proof(token, _CONNECTOR, ours["nonce"], theirs["nonce"]),
                           "wrong cluster token")
    reply = {**info, "op": "handshake"}
    if token is not None:
        reply["proof"] = _proof(token, _LISTENER, ours["nonce"], theirs["nonce"])
    await comm.write([reply])
    comm.extra = _peer_info(msg)


async def _refuse(comm: Comm, reason: str) -> None:
    """Tell the peer why we hang up (best effort), then close."""
    try:
        await asyncio.wait_for(comm.write([{"op": "error", "error": reason}]), 1.0)
    except (OSError, asyncio.TimeoutError):
        pass
    comm.abort()


def _admit(comm: Comm, max_frame_bytes: int) -> None:
    """The handshake is done: lift the pre-handshake limits."""
    comm.max_frame_bytes = max_frame_bytes
    comm.max_buffers = DEFAULT_MAX_BUFFERS


def _security_of(address: str, security: Security | None) -> Security:
    """``security`` (or no credentials), checked against the address's scheme."""
    if security is None:
        security = Security()
    scheme = parse_address(address)[0]
    if scheme == "tls" and not security.tls:
        raise ValueError(f"{address!r} is a tls:// address: pass security= with TLS files")
    if scheme == "tcp" and security.tls:
        raise ValueError(f"{address!r} is a tcp:// address, but security= has TLS files: "
                         "use tls://")
    return security


# ---------------------------------------------------------------------------- connect


async def connect(
    address: str,
    handshake: dict,
    timeout: float = 10,
    security: Security | None = None,
    *,
    interval: float = DEFAULT_INTERVAL,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Comm:
    """Connect to ``address``, prove our credentials, exchange ``handshake`` info, and
    return the `Comm` (its ``extra`` holds the peer's info).

    ``security`` gives the token and TLS files (``tls://`` needs TLS files, ``tcp://``
    must have none). Refused or dropped attempts to reach the address are retried with
    exponential backoff (10 ms doubling, capped at 1 s) until ``timeout`` seconds have
    passed; then ``TimeoutError`` (an OSError) names the address and the last error.
    So are refusals of a listener that has too many connections (``ListenerBusyError``).
    Once connected, a failed handshake (``HandshakeError``: a wrong token, a refusal, a
    TLS/plain mismatch) or a TLS error is raised at once, never retried.
    """
    scheme, host, port = parse_address(address)
    security = _security_of(address, security)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    backoff = 0.01
    error: BaseException | None = None
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0 and error is not None:
            raise TimeoutError(f"could not connect to {address} within {timeout}s: "
                               f"{type(error).__name__}: {error}") from error
        try:
            return await _connect_once(
                scheme, host, port, handshake, max(remaining, 0.001), security,
                interval=interval, max_frame_bytes=max_frame_bytes,
            )
        except HandshakeError:
            raise
        except ssl.SSLError as e:
            raise HandshakeError(f"TLS connection to {address} failed: {e}") from e
        except (OSError, asyncio.TimeoutError, StreamClosedError) as e:
            error = e
            await asyncio.sleep(min(backoff, max(deadline - loop.time(), 0)))
            backoff = min(backoff * 2, 1.0)


async def _connect_once(
    scheme: str,
    host: str,
    port: int,
    handshake: dict,
    timeout: float,
    security: Security,
    *,
    interval: float,
    max_frame_bytes: int,
) -> Comm:
    """One attempt: open the stream and shake hands, all within ``timeout`` seconds."""
    stream = await TCPClient().connect(
        host, port, ssl_options=security.ssl_context(server_side=False), timeout=timeout,
        max_buffer_size=max_frame_bytes + (1 << 20),
    )
    comm = Comm(stream, scheme, interval=interval, max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES,
                max_buffers=0)
    try:
        await asyncio.wait_for(_connector_handshake(comm, handshake, security.token), timeout)
    except (CommClosedError, StreamClosedError) as e:
        comm.abort()
        if isinstance(stream.error, ssl.SSLError) and not isinstance(e, HandshakeError):
            # TLS 1.3: a listener that refuses our certificate says so after the TLS
            # handshake, so we learn it only now. Not worth retrying.
            raise HandshakeError(f"TLS connection to {_format_address(scheme, host, port)} "
                                 f"failed: {stream.error}") from e
        raise
    except BaseException:
        comm.abort()
        raise
    _admit(comm, max_frame_bytes)
    return comm


# ---------------------------------------------------------------------------- listen

#: Connections still in their handshake, at most, in all and from one host.
MAX_PENDING = 128
MAX_PENDING_PER_HOST = 32
#: File descriptors a process keeps free for everything but incoming connections.
_RESERVED_FDS = 64
#: Accepts handled per wake-up of a listening socket.
_ACCEPTS_PER_WAKEUP = 64
#: How long accepting pauses when the process is out of file descriptors.
_ACCEPT_PAUSE = 1.0


def default_max_connections() -> int:
    """Open connections a listener allows by default: what the process's file
    descriptor limit leaves after a reserve, at most 16,384."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        soft = 1024
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        soft = 1 << 20
    return max(16, min(soft - _RESERVED_FDS, 16_384))


class Listener:
    """Accepts connections on one address, shakes hands, and hands each `Comm` over.

    ``address`` is the address actually bound (the real port when 0 was asked for).
    It refuses a connection beyond ``max_connections`` open ones (``max_per_host`` from
    one host), or beyond `MAX_PENDING` (`MAX_PENDING_PER_HOST`) still in their
    handshake; out of file descriptors, it stops accepting for a moment instead of
    spinning, and says so once.
    """

    def __init__(
        self,
        scheme: str,
        on_connection: Callable[[Comm], Any],
        handshake: dict,
        security: Security,
        comm_options: dict,
        handshake_timeout: float,
        max_connections: int,
        max_per_host: int,
    ) -> None:
        self._scheme = scheme
        self._on_connection = on_connection
        self._handshake = dict(handshake)
        self._security = security
        self._ssl_context = security.ssl_context(server_side=True)
        self._comm_options = comm_options
        self._handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.max_per_host = max_per_host
        self._loop = asyncio.get_running_loop()
        self._sockets: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()
        self._pending: dict[Comm, str] = {}  # comm -> host, oldest first
        self._pending_by_host: dict[str, int] = {}
        self._open_by_host: dict[str, int] = {}
        self.n_open = 0
        self._paused = False
        self._stopped = False
        self._log_refusal = QuietLog(logging.WARNING, log=logger)
        self._log_handshake = QuietLog(logging.WARNING, log=logger)
        self.address = ""

    def __repr__(self) -> str:
        return f"<Listener {self.address} open={self.n_open}>"

    @property
    def port(self) -> int:
        """The port actually bound."""
        return parse_address(self.address)[2]

    def set_handshake_info(self, **info: Any) -> None:
        """Change what this listener tells its peers in the handshake from now on."""
        self._handshake.update(info)

    def _bind(self, host: str, port: int) -> None:
        try:
            sockets = bind_sockets(port, address=host)
        except OSError as e:
            address = _format_address(self._scheme, host, port)
            raise OSError(f"cannot listen on {address}: {e}") from e
        self._sockets = sockets
        bound_host, bound_port = sockets[0].getsockname()[:2]
        self.address = _format_address(self._scheme, bound_host, bound_port)
        self._resume()

    # ------------------------------------------------------------ accepting

    def _resume(self) -> None:
        self._paused = False
        if self._stopped:
            return
        for sock in self._sockets:
            self._loop.add_reader(sock.fileno(), self._accept_ready, sock)

    def _pause(self, error: OSError) -> None:
        self._paused = True
        for sock in self._sockets:
            self._loop.remove_reader(sock.fileno())
        self._log_refusal("%s cannot accept connections (%s); pausing for %.1f s",
                          self.address, error.strerror or error, _ACCEPT_PAUSE)
        self._loop.call_later(_ACCEPT_PAUSE, self._resume)

    def _accept_ready(self, sock: socket.socket) -> None:
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                conn, peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS, ENOMEM ...
                self._pause(e)
                return
            self._admit_socket(conn, peer[0] if isinstance(peer, tuple) else str(peer))

    def _refusal(self, host: str) -> str | None:
        if self.n_open >= self.max_connections:
            return f"too many connections ({self.n_open}, limit {self.max_connections})"
        if self._open_by_host.get(host, 0) >= self.max_per_host:
            return f"too many connections from {host} (limit {self.max_per_host})"
        return None

    def _make_room_for_a_handshake(self, host: str) -> None:
        """Over a cap on connections in their handshake, drop the oldest one (of this
        host first): whoever keeps the caps full with silent connections only ever
        evicts its own, while a peer that completes its handshake promptly gets in."""
        if self._pending_by_host.get(host, 0) >= MAX_PENDING_PER_HOST:
            victim = next(c for c, h in self._pending.items() if h == host)
        elif len(self._pending) >= MAX_PENDING:
            victim = next(iter(self._pending))
        else:
            return
        self._log_refusal("%s dropped %s, the oldest connection in its handshake: too many "
                          "(limits %d, %d per host)", self.address, victim.peer_address,
                          MAX_PENDING, MAX_PENDING_PER_HOST)
        self._end_pending(victim)
        victim.abort()

    def _end_pending(self, comm: Comm) -> None:
        host = self._pending.pop(comm, None)
        if host is not None:
            _decrement(self._pending_by_host, host)

    def _admit_socket(self, conn: socket.socket, host: str) -> None:
        conn.setblocking(False)
        reason = self._refusal(host)
        if reason is not None:
            self._log_refusal("%s refused a connection from %s: %s", self.address, host, reason)
            if self._ssl_context is None:  # a plain peer can read why
                with contextlib.suppress(OSError):
                    conn.send(_busy_frame(reason))
            conn.close()
            return
        self._make_room_for_a_handshake(host)
        max_buffer = self._comm_options["max_frame_bytes"] + (1 << 20)
        try:
            if self._ssl_context is not None:
                conn = self._ssl_context.wrap_socket(conn, server_side=True,
                                                     do_handshake_on_connect=False)
                stream: IOStream = SSLIOStream(conn, max_buffer_size=max_buffer)
            else:
                stream = IOStream(conn, max_buffer_size=max_buffer)
            comm = Comm(stream, self._scheme, interval=self._comm_options["interval"],
                        max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES, max_buffers=0)
        except (OSError, ssl.SSLError) as e:  # the peer left before we looked at it
            logger.debug("connection to %s from %s dropped at once: %s", self.address, host, e)
            conn.close()
            return
        self.n_open += 1
        self._open_by_host[host] = self._open_by_host.get(host, 0) + 1
        comm.add_close_callback(lambda: self._forget(host))
        self._pending[comm] = host
        self._pending_by_host[host] = self._pending_by_host.get(host, 0) + 1
        task = self._loop.create_task(self._serve(comm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget(self, host: str) -> None:
        """A connection closed: it no longer counts against the limits."""
        self.n_open -= 1
        _decrement(self._open_by_host, host)

    async def _serve(self, comm: Comm) -> None:
        try:
            await asyncio.wait_for(
                _listener_handshake(comm, self._handshake, self._security.token),
                self._handshake_timeout)
        except Exception as exc:  # noqa: BLE001 - one bad peer must not break the listener
            error = exc
            if isinstance(exc, asyncio.TimeoutError):
                error = HandshakeError(f"no handshake within {self._handshake_timeout}s")
            self._log_handshake("%s refused %s: %s", self.address, comm.peer_address, error)
            # The traceback runs through asyncio.wait_for, whose frame holds the task that
            # holds the exception: a cycle that would keep this comm alive until the
            # cyclic GC runs (rarely, in a server), a flood of bad peers with it.
            exc.__traceback__ = None
            comm.abort()
            return
        finally:
            self._end_pending(comm)
        _admit(comm, self._comm_options["max_frame_bytes"])
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
        self._stopped = True
        for sock in self._sockets:
            if not self._paused:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._sockets = []
        for comm in list(self._pending):
            comm.abort()


def _busy_frame(reason: str) -> bytes:
    """The whole frame that tells a plain-TCP peer the listener is too busy."""
    body = msgpack.packb([{"op": "error", "error": reason, "busy": True}])
    return _HEAD.pack(0, len(body)) + body


def _decrement(counts: dict, key: str) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


async def listen(
    address: str,
    on_connection: Callable[[Comm], Awaitable[None] | None],
    handshake: dict,
    security: Security | None = None,
    *,
    interval: float = DEFAULT_INTERVAL,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    max_connections: int | None = None,
    max_connections_per_host: int | None = None,
) -> Listener:
    """Listen on ``address`` (port 0 picks a free port) and return the `Listener`.

    Each accepted connection must complete the handshake (proving ``security``'s token,
    and under TLS presenting a certificate of its CA) within ``handshake_timeout``
    seconds; then ``await on_connection(comm)`` runs in a task of its own. A failed
    handshake is logged (rate-limited) and closes only that connection; an exception in
    ``on_connection`` is logged and closes that comm. When ``on_connection`` returns the
    comm stays open: the handler may keep it. ``max_connections`` (default: what the
    file descriptor limit allows) and ``max_connections_per_host`` (default: three
    quarters of that) bound the open connections.
    """
    scheme, host, port = parse_address(address)
    security = _security_of(address, security)
    if max_connections is None:
        max_connections = default_max_connections()
    if max_connections_per_host is None:  # leave other hosts a quarter
        max_connections_per_host = max(1, max_connections * 3 // 4)
    options = {"interval": interval, "max_frame_bytes": max_frame_bytes}
    listener = Listener(scheme, on_connection, handshake, security, options, handshake_timeout,
                        max_connections, max_connections_per_host)
    listener._bind(host, port)
    return listener
