"""The task stream: which worker ran which task, and when (the scheduler's recent past).

The scheduler records one entry per task outcome it accepted from a worker's report:
``(key, worker, start, stop, ok)``, with the worker's own clock readings of when the
task began and ended. Entry number ``seq`` is its position since the scheduler started;
the newest ``maxlen`` entries are held, so a long run costs a fixed amount of memory, and
any held entry is found in O(1).

How entries are held matters more than what they cost to write. A report's key and times
are small objects made while the run goes on, and each one kept for long sits in an
allocator arena among the run's freed tasks: kept one by one, the last 100,000 entries
of a million-task map held 540 of the scheduler's 1 MiB arenas (566 MB of RSS, 44 MB of
it in use) after every task was released. So a report is not kept: when it arrives, its
key, worker and outcome go into open columns and its times into arrays of doubles
(holding a report until its chunk was packed cost the scheduler about 10 % more CPU per
task: fresh memory for every message). Every `CHUNK` entries are packed into a few large
buffers: the keys in one (str keys joined, each after a NUL; others in one msgpack
array), the start and stop times in one buffer of doubles, the outcomes in one of bytes,
the workers in one tuple. Large buffers come from the C heap, not the arenas, and leave
nothing behind when they are dropped. `pack` packs what is still open (the scheduler
calls it before it gives memory back after a big release). `squeeze` packs too, then
squeezes chunks packed since: a chunk's str keys are written after the prefix they all
share, once, then compressed (zlib: a map's 7 bytes a key become about 2), its workers
become an index byte each, then their addresses, and its times are compressed (16
bytes an entry become about 5). A read of a squeezed chunk decompresses its keys and
times, about 50 us, and keeps the last chunk's. Squeezed, the last 100,000 entries of a
map cost 0.95 MB, not 7.1 (a map's keys share all but their last digits; 1.3 MB with
the keys not compressed). Squeezing costs about 370 us a chunk of 1,024 entries, so the
scheduler squeezes only once a big job is gone (in its collecting trims,
`SQUEEZE_CHUNKS` chunks each), not as entries come in, nor after every release.

Everything that checks or converts an entry happens when it is read, and a read touches
only the entries it returns, one key each: a page that samples 100 of the last 100,000
reads 100 keys. (The first read in a chunk of keys that are not str also finds where
each of its keys ends, skipping over them without building one.)

A reader that polls asks for what came after the last number it saw and never gets an
entry twice.

What it never does: walk the scheduler's tasks, keep anything beyond ``maxlen`` entries
(and the chunk they are in), or trust a report's times (a worker is a member, but its
clock may be off or its figures odd: a time that is not a finite number is dropped from
what readers see).
"""
from __future__ import annotations

import math
import zlib
from array import array
from itertools import accumulate, repeat
from operator import itemgetter
from os.path import commonprefix
from struct import unpack_from

import msgpack

__all__ = ["TaskStream", "TaskStreamEntry"]

#: Entries kept by default.
DEFAULT_MAXLEN = 100_000
#: Entries packed together.
CHUNK = 1024
#: Chunks squeezed at most by one `TaskStream.squeeze` (about 320 us each).
SQUEEZE_CHUNKS = 32

_KEY = itemgetter("key")
_START = itemgetter("start")
_STOP = itemgetter("stop")
_NAN = float("nan")
#: Packs the keys that are not str (autoreset: each ``pack`` returns its own bytes).
_PACKER = msgpack.Packer(use_bin_type=True)


class TaskStreamEntry(tuple):
    """One task outcome as readers see it: ``(seq, key, worker, start, stop, ok)``."""

    __slots__ = ()

    @property
    def seq(self) -> int:
        """Its sequence number."""
        return self[0]


class TaskStream:
    """A bounded record of task outcomes, fed from workers' reports.

    ``record(worker, reports, ok)`` is the scheduler's one call per accepted batch of
    ``task-finished`` (``ok=True``) or ``task-erred`` reports; ``after(seq)`` and
    ``window(start, stop)`` read; ``pack()`` packs the entries still open; ``squeeze()``
    packs them and squeezes the chunks packed since.
    """

    def __init__(self, maxlen: int = DEFAULT_MAXLEN) -> None:
        if type(maxlen) is not int or maxlen < 1:
            raise ValueError(f"maxlen must be a positive int, not {maxlen!r}")
        self.maxlen = maxlen
        self.chunk = min(CHUNK, maxlen)
        #: Chunk ``c`` (entries ``c * chunk`` on) is in slot ``c % slots`` while held.
        self._slots = -(-maxlen // self.chunk) + 1
        self._keys: list = [None] * self._slots  # see _pack_keys
        #: Where each key ends in its blob (None while not needed yet: `_key_ends`).
        self._key_ends: list = [None] * self._slots
        self._workers: list = [None] * self._slots  # see _pack_workers
        #: n starts then n stops, as doubles (zlib-compressed once squeezed: `_times_of`)
        self._times: list = [None] * self._slots
        self._ok: list = [None] * self._slots  # n bytes of 0 or 1
        self._squeezed = bytearray(self._slots)  # 1: its chunk is squeezed
        #: The squeezed times read last, and what they decompress to.
        self._unzipped: tuple = (None, b"")
        #: The squeezed keys read last: (what is held, the blob, its `_key_ends` or None).
        self._unzipped_keys: list = [None, None, None]
        #: Open entries, numbered ``_base`` on, in columns.
        self._base = 0
        self._open_keys: list = []
        self._open_starts = array("d")
        self._open_stops = array("d")
        self._open_workers: list = []
        self._open_ok = bytearray()
        #: Entries recorded since the start (the next entry's sequence number).
        self.total = 0

    def __len__(self) -> int:
        return min(self.total, self.maxlen)

    @property
    def first(self) -> int:
        """The sequence number of the oldest entry held."""
        return max(self.total - self.maxlen, 0)

    def record(self, worker: str, reports: list, ok: bool) -> None:
        """Remember the outcome of every report of this batch."""
        n = len(reports)
        if n > self.maxlen:  # a batch over maxlen: its newest
            self._skip_to(self.total + n - self.maxlen)
            reports = reports[-self.maxlen:]
            n = self.maxlen
        _take_columns(reports, self._open_keys, self._open_starts, self._open_stops)
        self._open_workers += repeat(worker, n)
        self._open_ok += (b"\x01" if ok else b"\x00") * n
        self.total += n
        chunk = self.chunk
        end = self._base - self._base % chunk + chunk
        while self.total >= end:
            self._seal(end)
            end += chunk

    def pack(self) -> None:
        """Pack the open entries now (a part of a chunk), so that no key object is held."""
        if self.total > self._base:
            self._seal(self.total)

    def squeeze(self, chunks: int = SQUEEZE_CHUNKS) -> None:
        """`pack`, then squeeze at most ``chunks`` chunks not squeezed yet, the newest
        first."""
        self.pack()
        chunk = self.total // self.chunk - (self.total % self.chunk == 0)
        oldest = self.first // self.chunk
        while chunks > 0 and chunk >= oldest:
            slot = chunk % self._slots
            if not self._squeezed[slot]:
                self._keys[slot] = _zip_keys(_squeeze_keys(self._keys[slot]))
                self._key_ends[slot] = None  # the keys moved
                self._workers[slot] = _pack_workers(self._workers[slot])
                self._times[slot] = zlib.compress(self._times[slot], 1)
                self._squeezed[slot] = 1
                chunks -= 1
            chunk -= 1

    def _skip_to(self, seq: int) -> None:
        """Drop everything before ``seq``; the open entries start at its chunk."""
        self._base = seq - seq % self.chunk
        pad = seq - self._base
        self._open_keys = [None] * pad
        self._open_starts = array("d", repeat(_NAN, pad))
        self._open_stops = array("d", repeat(_NAN, pad))
        self._open_workers = [None] * pad
        self._open_ok = bytearray(pad)
        self.total = seq

    def _seal(self, end: int) -> None:
        """Pack the open entries before ``end`` into their chunk (the one ``_base`` is
        in), with what of that chunk an earlier `pack` packed."""
        n = end - self._base
        keys = self._open_keys[:n]
        times = self._open_starts[:n] + self._open_stops[:n]
        workers = self._open_workers[:n]
        ok = bytes(self._open_ok[:n])
        del self._open_keys[:n], self._open_starts[:n], self._open_stops[:n]
        del self._open_workers[:n], self._open_ok[:n]
        slot = self._base // self.chunk % self._slots
        if self._base % self.chunk:  # a part of this chunk is packed already
            had = array("d")
            had.frombytes(self._times_of(slot))
            half = len(had) // 2
            keys = _unpack_keys(self._keys_of(slot)[0]) + keys
            workers = _unpack_workers(self._workers[slot], len(self._ok[slot])) + workers
            times = had[:half] + times[:n] + had[half:] + times[n:]
            ok = self._ok[slot] + ok
        self._keys[slot], self._key_ends[slot] = _pack_keys(keys)
        self._workers[slot] = tuple(workers)
        self._squeezed[slot] = 0
        self._times[slot] = times.tobytes()
        self._ok[slot] = ok
        self._base = end

    def _raw(self, seq: int) -> tuple:
        """Entry ``seq`` (which the caller knows is held) as ``(key, worker, start, stop,
        ok)``."""
        if seq >= self._base:
            i = seq - self._base
            return (self._open_keys[i], self._open_workers[i], self._open_starts[i],
                    self._open_stops[i], self._open_ok[i] == 1)
        chunk, i = divmod(seq, self.chunk)
        slot = chunk % self._slots
        ok, times = self._ok[slot], self._times_of(slot)
        blob, ends = self._keys_of(slot, with_ends=True)
        return (_unpack_key(blob, ends, i), _unpack_worker(self._workers[slot], len(ok), i),
                unpack_from("d", times, 8 * i)[0],
                unpack_from("d", times, 8 * (len(ok) + i))[0], ok[i] == 1)

    def _times_of(self, slot: int) -> bytes:
        """The times of the chunk in ``slot`` as doubles: a squeezed chunk's are
        decompressed (about 30 us for 1,024 entries), the last ones read kept."""
        times = self._times[slot]
        if not self._squeezed[slot]:
            return times
        zipped, unzipped = self._unzipped
        if zipped is not times:
            unzipped = zlib.decompress(times)
            self._unzipped = (times, unzipped)
        return unzipped

    def _keys_of(self, slot: int, with_ends: bool = False) -> tuple:
        """``(blob, ends)``: the keys of the chunk in ``slot`` as `_pack_keys` packs them,
        and with ``with_ends`` where each ends (`_key_ends`; else None). A squeezed
        chunk's are decompressed (about 20 us for 1,024 map keys), the last ones read
        kept with their ends; an unsqueezed chunk's ends are kept with it."""
        held = self._keys[slot]
        if type(held) is tuple:
            return held, None
        if not self._squeezed[slot]:
            ends = self._key_ends[slot]
            if with_ends and ends is None:
                ends = self._key_ends[slot] = _key_ends(held)
            return held, ends
        cache = self._unzipped_keys
        if cache[0] is not held:
            cache[:] = held, _unzip_keys(held), None
        if with_ends and cache[2] is None:
            cache[2] = _key_ends(cache[1])
        return cache[1], cache[2]

    def _newest_first(self):
        """``(seq, raw entry)`` of every held entry, newest first, unpacked a chunk at a
        time (for reads that walk many)."""
        first, seq = self.first, self.total - 1
        while seq >= first:
            if seq >= self._base:
                low = max(self._base, first)
                rows = [self._raw(number) for number in range(low, seq + 1)]
            else:
                chunk = seq // self.chunk
                low = chunk * self.chunk
                rows = self._chunk_rows(chunk)
            for number in range(seq, max(low, first) - 1, -1):
                yield number, rows[number - low]
            seq = low - 1

    def _chunk_rows(self, chunk: int) -> list:
        """Every raw entry of a packed chunk, in order."""
        slot = chunk % self._slots
        ok = self._ok[slot]
        n = len(ok)
        times = array("d")
        times.frombytes(self._times_of(slot))
        keys = _unpack_keys(self._keys_of(slot)[0])
        workers = _unpack_workers(self._workers[slot], n)
        return list(zip(keys, workers, times[:n], times[n:], map(bool, ok)))

    def after(self, seq: int, limit: int = 1000, sample: bool = False) -> tuple:
        """``(entries, next_seq, skipped)``: at most ``limit`` entries numbered ``seq``
        or later, oldest first; the number to ask for next time; and how many entries
        after ``seq`` were not returned (fallen out of the ring, or over ``limit``).

        Over ``limit``, the newest ``limit`` are returned, or with ``sample`` ``limit``
        entries spread evenly over all of them (a chart of the last second stays even).
        Costs only the entries returned."""
        total = self.total
        seq = max(seq, 0)
        wanted = max(total - max(seq, self.first), 0)
        take = min(wanted, max(limit, 0))
        if sample and 0 < take < wanted:
            step = -(-wanted // take)  # every step-th, counted back from the newest
            numbers = range(total - 1 - step * ((wanted - 1) // step), total, step)
        else:
            numbers = range(total - take, total)
        out = []
        for number in numbers:
            entry = _checked(number, self._raw(number))
            if entry is not None:
                out.append(entry)
        skipped = max(total - seq, 0) - len(numbers)
        return out, total, skipped

    def window(self, start: float | None = None, stop: float | None = None,
               limit: int = 100_000) -> list:
        """Entries whose task ran at least partly between ``start`` and ``stop``
        (seconds since the epoch; None: unbounded), at most the newest ``limit``, oldest
        first. Walks back from the newest entry and stops at the first one that ended
        well before ``start`` (entries arrive roughly in order of their stop time)."""
        out = []
        slack = 60.0  # reports from different workers arrive out of order by this much
        for number, raw in self._newest_first():
            entry = _checked(number, raw)
            if entry is None:
                continue
            if start is not None and entry[4] < start:
                if entry[4] < start - slack:
                    break
                continue
            if stop is not None and entry[3] > stop:
                continue
            out.append(entry)
            if len(out) >= limit:
                break
        out.reverse()
        return out


def _take_columns(reports: list, keys: list, starts: array, stops: array) -> None:
    """Append the reports' keys, start times and stop times to these columns (a time
    that is not a number becomes NaN, which readers drop)."""
    had = len(keys)
    try:
        keys += map(_KEY, reports)
        starts.extend(map(_START, reports))
        stops.extend(map(_STOP, reports))
    except (KeyError, TypeError, OverflowError):  # a report without its times, or odd
        del keys[had:], starts[had:], stops[had:]
        keys += [msg.get("key") for msg in reports]
        starts.extend([_as_float(msg.get("start")) for msg in reports])
        stops.extend([_as_float(msg.get("stop")) for msg in reports])


def _pack_keys(keys: list) -> tuple:
    """``(blob, None)``: the keys in one blob; where each one ends in it is found when a
    read first needs it (`_key_ends`): most chunks are never read. str keys: a prefix
    they all share (none until `_squeeze_keys`), then each key without it, each after a
    NUL (a chunk with a key that holds a NUL goes the msgpack way). Other keys (a dask
    key is a tuple) are packed by msgpack as one array (packing a chunk in one call
    costs half what packing its keys one by one does). Keys msgpack cannot carry are
    kept as a tuple."""
    try:
        joined = "\0".join(keys)
    except TypeError:  # not all str
        joined = None
    if joined is not None and joined.count("\0") == len(keys) - 1:
        return "\0" + joined, None
    try:
        return _PACKER.pack(keys), None
    except (TypeError, ValueError, OverflowError):
        _PACKER.reset()
        return tuple(keys), None


def _squeeze_keys(blob):
    """A str blob of `_pack_keys` with the prefix its keys all share written once (the
    blob as it was if they share none, or it is not a str blob)."""
    if type(blob) is not str or blob[0] != "\0":
        return blob  # not str keys, or squeezed already
    joined = blob[1:]
    n = blob.count("\0")
    first_end = joined.find("\0")
    first = joined if first_end < 0 else joined[:first_end]
    prefix = commonprefix((first, joined[joined.rfind("\0") + 1:]))  # and the last
    if prefix and joined.count("\0" + prefix) != n - 1:  # not every key has it
        prefix = commonprefix(joined.split("\0"))
    if not prefix:
        return blob
    # a NUL comes only before a key, so every "NUL prefix" starts a key
    return prefix + "\0" + joined[len(prefix):].replace("\0" + prefix, "\0")


def _zip_keys(blob):
    """A squeezed chunk's keys compressed (zlib): a map's 1,024 keys, about 7 KB once
    their shared prefix is written once, become about 2 KB. A str blob is marked ``s``,
    a msgpack one ``m``; keys kept as a tuple stay so."""
    if type(blob) is tuple:
        return blob
    if type(blob) is str:
        return b"s" + zlib.compress(blob.encode("utf-8", "surrogatepass"), 1)
    return b"m" + zlib.compress(blob, 1)


def _unzip_keys(held):
    """The blob `_zip_keys` compressed."""
    unzipped = zlib.decompress(memoryview(held)[1:])
    return unzipped.decode("utf-8", "surrogatepass") if held[:1] == b"s" else unzipped


def _key_ends(blob) -> bytes:
    """Where each key of a blob `_pack_keys` made starts, and where the one after the
    last would (offsets as uint32 bytes). For a str blob the first offset is also where
    the shared prefix ends, plus one, and each key ends one before the next starts."""
    if type(blob) is str:
        ends = array("I", accumulate(map((1).__add__, map(len, blob.split("\0"))),
                                     initial=0))
        del ends[0]
        return ends.tobytes()
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(blob), 1))
    unpacker.feed(blob)
    n = unpacker.read_array_header()
    skip, tell = unpacker.skip, unpacker.tell
    ends = array("I", [tell()])
    for _ in range(n):
        skip()
        ends.append(tell())
    return ends.tobytes()


def _unpack_key(blob, ends, i: int):
    """Key ``i`` of a blob `_pack_keys` made, with its `_key_ends`."""
    if type(blob) is tuple:
        return blob[i]
    start, stop = unpack_from("2I", ends, 4 * i)
    if type(blob) is str:  # the shared prefix, then the key's own part
        return blob[:unpack_from("I", ends)[0] - 1] + blob[start:stop - 1]
    return msgpack.unpackb(blob[start:stop], use_list=False, raw=False,
                           strict_map_key=False)


def _unpack_keys(blob) -> list:
    """Every key of a blob `_pack_keys` made."""
    if type(blob) is tuple:
        return list(blob)
    if type(blob) is str:
        prefix, *rests = blob.split("\0")
        return [prefix + rest for rest in rests] if prefix else rests
    return list(msgpack.unpackb(blob, use_list=False, raw=False, strict_map_key=False))


def _pack_workers(workers: list | tuple):
    """The workers of a chunk as one bytes object: an index byte per entry, then the
    distinct addresses, NUL-separated. A tuple (as they are) if there are over 256 of
    them or one is not a str (or holds a NUL)."""
    names = list(dict.fromkeys(workers))
    if len(names) > 256 or not all(type(name) is str and "\0" not in name for name in names):
        return tuple(workers)
    index = {name: i for i, name in enumerate(names)}
    return bytes(map(index.__getitem__, workers)) + "\0".join(names).encode()


def _unpack_worker(packed, n: int, i: int):
    """Worker ``i`` of the ``n`` that `_pack_workers` packed."""
    if type(packed) is tuple:
        return packed[i]
    return packed[n:].decode().split("\0")[packed[i]]


def _unpack_workers(packed, n: int) -> list:
    """Every worker of the ``n`` that `_pack_workers` packed."""
    if type(packed) is tuple:
        return list(packed)
    names = packed[n:].decode().split("\0")
    return [names[i] for i in packed[:n]]


def _as_float(value) -> float:
    """The time as the chunks store it: a float if it is a number, else NaN."""
    try:
        return array("d", (value,))[0]
    except (TypeError, OverflowError):
        return _NAN


def _checked(seq: int, raw: tuple) -> TaskStreamEntry | None:
    """The entry as readers see it, or None if its times are not finite numbers."""
    key, worker, start, stop, ok = raw
    if type(start) is not float:
        start = _as_float(start)
    if type(stop) is not float:
        stop = _as_float(stop)
    if not (math.isfinite(start) and math.isfinite(stop)):
        return None
    return TaskStreamEntry((seq, key, worker, start, max(stop, start), ok))
