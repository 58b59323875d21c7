"""One log format for every process of a cluster, and the recent log lines each one keeps.

What this module does
---------------------
- Every line a scheduler, worker, nanny or client process writes reads the same way::

      2026-01-31 12:00:00,123 worker tcp://10.0.0.7:40123 WARNING worker ... could not ...

  the time, the process's role and address (a scheduler or worker: the address it
  listens on; a nanny: ``pid:N``; a client: its id), the level, the message.
  `configure` sets this up for a process (the ``dcore`` command calls it with
  ``--log-level``); the scheduler or worker fills in its address once it listens
  (`claim_address`).
- `LogBuffer` is a `logging.Handler` that keeps the last `BUFFER_LINES` formatted lines
  in memory (packed in chunks of bytes: old chunks fall out, memory stays bounded).
  The scheduler and every worker install one (`install_buffer`), and the client reads
  it over the existing connections (``Client.get_scheduler_logs``,
  ``Client.get_worker_logs``).

What it never does
------------------
It never writes files and never configures logging on import. A library process that
did not call `configure` (a user's script running servers in-process) keeps its own
handlers; `install_buffer` only adds the in-memory buffer, once per process, so servers
sharing a process share one buffer.
"""
from __future__ import annotations

import array
import collections
import logging
import os
import struct
import threading
import time
from typing import Any

__all__ = ["BUFFER_LINES", "FORMAT", "LogBuffer", "PackedLines", "QuietLog", "buffer",
           "check_line_count", "claim_address", "configure", "install_buffer", "level_of",
           "recent_lines", "set_identity"]

#: Lines a process keeps in memory for `Client.get_scheduler_logs` / `get_worker_logs`.
BUFFER_LINES = 10_000
#: The format of every line: time, role, address, level, message.
FORMAT = "%(asctime)s %(dcore_role)s %(dcore_address)s %(levelname)s %(message)s"
#: The level names ``--log-level`` accepts (any case), besides a number.
LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")

_LENGTH = struct.Struct("<I")  # a packed line's length, before it
_identity = {"role": "process", "address": f"pid:{os.getpid()}"}
_buffer: LogBuffer | None = None
_lock = threading.Lock()


class _IdentityFilter(logging.Filter):
    """Puts this process's role and address on every record a handler formats."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.dcore_role = _identity["role"]
        record.dcore_address = _identity["address"]
        return True


def formatter() -> logging.Formatter:
    """A formatter for `FORMAT` (records must pass through an identity filter)."""
    return logging.Formatter(FORMAT)


class PackedLines:
    """The last ``capacity`` lines (at least), packed into chunks of bytes.

    Why not a deque of str: a line is a small object, and CPython's small-object allocator
    gives memory back to the system only by whole 1 MiB arenas. A line logged while a big
    release frees millions of objects lands in one of the arenas being emptied, and keeps
    it: after a million-task release, about thirty lines of "client ... left" held about
    thirty MiB of the scheduler's RSS. Here a line is copied, length first, into one
    preallocated chunk; a full chunk becomes one bytes object (big enough for the system's
    allocator, which returns it page by page) and the oldest chunks fall out. The counts
    it keeps are in an array and in small ints (cached by CPython), so adding a line
    leaves no new small object behind either. Not thread-safe: `LogBuffer` calls it
    under its handler's lock.
    """

    CHUNK_BYTES = 16_384
    CHUNK_LINES = 256  # at most: a chunk's count of lines is a cached small int

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._open = bytearray(self.CHUNK_BYTES)
        # bytes used in the open chunk, lines in it, lines in the sealed chunks
        self._counts = array.array("q", [0, 0, 0])
        self._chunks: collections.deque = collections.deque()
        self._chunk_lines: collections.deque = collections.deque()

    def append(self, line: str) -> None:
        """Keep ``line`` (any str: lone surrogates come back as they went in)."""
        data = line.encode("utf-8", "surrogatepass")
        need = _LENGTH.size + len(data)
        counts = self._counts
        if counts[0] + need > self.CHUNK_BYTES or counts[1] == self.CHUNK_LINES:
            self._seal()
        if need > self.CHUNK_BYTES:  # a line longer than a chunk is a chunk of its own
            self._chunks.append(_LENGTH.pack(len(data)) + data)
            self._chunk_lines.append(1)
            counts[2] += 1
        else:
            used = counts[0]
            _LENGTH.pack_into(self._open, used, len(data))
            self._open[used + _LENGTH.size:used + need] = data
            counts[0] += need
            counts[1] += 1
        self._drop_oldest()

    def recent(self, n: int | None = None) -> list[str]:
        """The last ``n`` lines kept (the last ``capacity`` for None), oldest first."""
        want = self.capacity if n is None else min(n, self.capacity)
        if want <= 0:
            return []
        chunks = list(self._chunks)
        chunks.append(bytes(memoryview(self._open)[:self._counts[0]]))
        lines: list[str] = []
        for chunk in chunks:
            at = 0
            while at < len(chunk):
                (size,) = _LENGTH.unpack_from(chunk, at)
                at += _LENGTH.size
                lines.append(chunk[at:at + size].decode("utf-8", "surrogatepass"))
                at += size
        return lines[-want:]

    def _seal(self) -> None:
        counts = self._counts
        if counts[1]:
            self._chunks.append(bytes(memoryview(self._open)[:counts[0]]))
            self._chunk_lines.append(counts[1])
            counts[2] += counts[1]
            counts[0] = counts[1] = 0

    def _drop_oldest(self) -> None:
        counts = self._counts
        while self._chunk_lines and (counts[2] - self._chunk_lines[0] + counts[1]
                                     >= self.capacity):
            counts[2] -= self._chunk_lines.popleft()
            self._chunks.popleft()


class LogBuffer(logging.Handler):
    """The last ``capacity`` formatted log lines of this process, oldest first.

    Appending is O(1) and thread-safe (under the handler's lock); reading copies. The
    lines are packed (`PackedLines`), so that the buffer never keeps the system from
    getting back memory a big job freed.
    """

    def __init__(self, capacity: int = BUFFER_LINES, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.lines = PackedLines(capacity)
        self.addFilter(_IdentityFilter())
        self.setFormatter(formatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never break the caller
            self.handleError(record)

    def recent(self, n: int | None = None) -> list[str]:
        """The last ``n`` lines (all kept lines for None), oldest first."""
        self.acquire()
        try:
            return self.lines.recent(n)
        finally:
            self.release()


def level_of(text) -> int:
    """A log level from a name in any case (``info``, ``WARNING``) or a number;
    ValueError naming the choices otherwise."""
    if isinstance(text, int):
        return text
    name = str(text).strip().upper()
    if name in LEVELS:
        return getattr(logging, name)
    if name.isdigit():
        return int(name)
    raise ValueError(f"unknown log level {text!r}: use one of {', '.join(LEVELS)} "
                     "(any case) or a number")


def set_identity(role: str | None = None, address: str | None = None) -> None:
    """Name this process in every later line: its role (scheduler, worker, nanny,
    client) and its address."""
    if role is not None:
        _identity["role"] = role
    if address is not None:
        _identity["address"] = address


def claim_address(role: str, address: str) -> None:
    """A server of ``role`` learned its address: it names this process from now on if
    the process was configured for that role and has no address yet (a process running
    several servers keeps its pid)."""
    if _identity["role"] == role and _identity["address"].startswith("pid:"):
        _identity["address"] = address


def configure(role: str, level="INFO", address: str | None = None) -> None:
    """Log this process's lines to stderr in `FORMAT` at ``level``, and keep the recent
    ones in the in-memory buffer: INFO and above, or down to ``level`` if it is lower (so
    that a quiet process still tells `Client.get_worker_logs` what it did). For a process
    that runs one server (the ``dcore`` command) or a script that wants the cluster's
    format; replaces the root logger's handlers."""
    set_identity(role, address if address is not None else f"pid:{os.getpid()}")
    printed = level_of(level)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if not isinstance(handler, LogBuffer):
            root.removeHandler(handler)
    stream = logging.StreamHandler()
    stream.setLevel(printed)
    stream.addFilter(_IdentityFilter())
    stream.setFormatter(formatter())
    root.addHandler(stream)
    kept = min(printed, logging.INFO)
    root.setLevel(kept)
    install_buffer().setLevel(kept)


def install_buffer() -> LogBuffer:
    """This process's `LogBuffer` on the root logger, added at the first call."""
    global _buffer
    with _lock:
        if _buffer is None:
            _buffer = LogBuffer()
            logging.getLogger().addHandler(_buffer)
        return _buffer


def buffer() -> LogBuffer | None:
    """This process's `LogBuffer`, or None if none was installed."""
    return _buffer


def recent_lines(n: int | None = None) -> list[str]:
    """The last ``n`` lines this process kept (all for None); empty without a buffer."""
    return _buffer.recent(n) if _buffer is not None else []


def check_line_count(n) -> int | None:
    """``n`` for `recent_lines`, checked: None or an int from 0 to `BUFFER_LINES`;
    ValueError saying so otherwise."""
    if n is None:
        return None
    if type(n) is not int or not 0 <= n <= BUFFER_LINES:
        raise ValueError(f"n must be None (every kept line) or an int from 0 to "
                         f"{BUFFER_LINES}, not {n!r:.60}")
    return n


class QuietLog:
    """Logs a repeated event at most ``burst`` times per ``period`` seconds, then once
    more with the number of events it kept quiet: one bad peer cannot flood the log."""

    def __init__(self, level: int, burst: int = 5, period: float = 10.0,
                 log: logging.Logger | None = None) -> None:
        self.level = level
        self.logger = log if log is not None else logging.getLogger("distributed_server")
        self.burst = burst
        self.period = period
        self._window_start = float("-inf")
        self._count = 0
        self._suppressed = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.period:
            if self._suppressed:
                self.logger.log(self.level, "(%d similar messages suppressed in the last "
                                "%.0f s)", self._suppressed, self.period)
            self._window_start, self._count, self._suppressed = now, 0, 0
        self._count += 1
        if self._count <= self.burst:
            self.logger.log(self.level, msg, *args)
        else:
            self._suppressed += 1
