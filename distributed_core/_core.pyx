# cython: language_level=3
"""The scheduler's state machine: which task is where, and where it goes next.

Rules of this module (everything that decides a task's state lives in this file):

- No I/O. No sockets, files, threads, logging, pickle, and no clock reads: the clock is
  passed in. User code and data never appear here: a task's run spec and its error are
  opaque bytes that arrive and leave unchanged.
- Stimuli in, messages out. Each public stimulus (``update_graph``, ``task_finished``,
  ``remove_worker``, ...) takes plain data and a stimulus id, changes the state only
  through transitions, and returns ``(client_msgs, worker_msgs)``: dicts mapping a client
  id / worker address to a list of msgpack-ready message dicts.
- Stimuli are transactions. A stimulus checks all of its input, and the sender's right to
  say it, before it changes anything; refused input raises ``InvalidStimulus`` and leaves
  the state exactly as it was. Roles are enforced here: a worker speaks only about tasks
  processing on it and inputs it was told to fetch, a client only about keys it wants
  (``Unauthorized``). One bad report in a worker's batch errs (or is ignored for) that
  one task, never the batch. Any other exception is a bug; work it left pending
  (recommendations, messages) is carried out by the next stimulus, and a stimulus that
  runs away (``max_transitions_per_stimulus``) raises ``TransitionLimitExceeded``.
- One table, one engine. ``MOVES`` (beside the states, below) lists each allowed move
  (start, finish) and ``SchedulerState._move`` runs it: one case per entry, held equal to
  the table by a test, compiled to C int compares and direct calls (states are C ints
  inside the core, names at every interface). A transition changes one task and may
  *recommend* states for others; the engine applies recommendations until none are left.
  A move with no entry goes through ``released``. Transitions that carry data from a
  stimulus (a result, scattered data) are called directly by that stimulus.
- Lean tasks. Collections a task needs only for part of its life are ``None`` until
  needed and set back to ``None`` when done; tiny, rarely changing ones (who holds a
  result, who wants it) are tuples, and so are a task's dependents while they are few;
  counters stand in for sets where only the count matters (``n_waiting_on``,
  ``n_waiters``). Tasks of one graph with the same inputs share one dependencies tuple.
- Nothing grows without bound once its tasks are gone: a prefix is dropped with its last
  task (its learned duration stays in a bounded table), and the hash tables that a big
  graph grew (tasks, a client's wants, a worker's results, the recommendations) are
  rebuilt at their new size once most of it is forgotten (a dict or set never shrinks).
- The same source runs compiled by Cython and imported as plain Python.
"""
from __future__ import annotations

try:
    import cython
except ImportError:  # the pure-Python install runs without Cython
    from . import cython_shim as cython

import heapq
import math
from array import array
from typing import Optional

COMPILED: bool = cython.compiled

RELEASED = "released"
WAITING = "waiting"
QUEUED = "queued"
NO_WORKER = "no-worker"
PROCESSING = "processing"
MEMORY = "memory"
ERRED = "erred"
FORGOTTEN = "forgotten"
TASK_STATES = (RELEASED, WAITING, QUEUED, NO_WORKER, PROCESSING, MEMORY, ERRED, FORGOTTEN)
# A state's slot in the counters and its ``TaskState.state_id``: its position in
# TASK_STATES.
_STATE_INDEX = {state: i for i, state in enumerate(TASK_STATES)}
# The states a task can be held in: all but forgotten (the last slot, which counts
# tasks forgotten so far).
HELD_STATES = TASK_STATES[:-1]
# A task in one of these states needs the results of its dependencies.
ACTIVE_STATES = frozenset((WAITING, QUEUED, NO_WORKER, PROCESSING))

#: The one list of allowed moves (start, finish), by name: nothing else decides which
#: move is a transition of its own. ``SchedulerState._move`` has exactly one case per entry
#: (each calls ``_transition_<start>_<finish>``) and refuses any other pair;
#: tests/core/scheduler/test_transitions_table.py holds the two equal. A move missing here
#: goes through released.
MOVES = frozenset([
    (RELEASED, WAITING), (RELEASED, ERRED), (RELEASED, FORGOTTEN),
    (WAITING, PROCESSING), (WAITING, QUEUED), (WAITING, NO_WORKER), (WAITING, RELEASED),
    (WAITING, ERRED),
    (QUEUED, PROCESSING), (QUEUED, RELEASED),
    (NO_WORKER, PROCESSING), (NO_WORKER, WAITING), (NO_WORKER, RELEASED),
    (PROCESSING, RELEASED), (PROCESSING, WAITING), (PROCESSING, ERRED),
    (MEMORY, RELEASED),
    (ERRED, RELEASED),
])
# MOVES as one bit per (start, finish), bit 8 * start + finish of the states' indexes: the
# engine's test of a move (``_allowed``) is one shift.
_MOVE_BITS = cython.declare(cython.ulonglong,
                            sum([1 << (8 * _STATE_INDEX[a] + _STATE_INDEX[b]) for a, b in MOVES]))

# Inside the core a task's state is its index in TASK_STATES (``TaskState.state_id``):
# these C constants when compiled, so a state test is an integer comparison and a move is
# dispatched by C int compares (``_move``), never a string compare or a dict lookup. Every
# interface (messages, the transition log, ``ts.state``, counters) shows the names.
_S_RELEASED = cython.declare(cython.int, 0)
_S_WAITING = cython.declare(cython.int, 1)
_S_QUEUED = cython.declare(cython.int, 2)
_S_NO_WORKER = cython.declare(cython.int, 3)
_S_PROCESSING = cython.declare(cython.int, 4)
_S_MEMORY = cython.declare(cython.int, 5)
_S_ERRED = cython.declare(cython.int, 6)
_S_FORGOTTEN = cython.declare(cython.int, 7)
_NAMES = cython.declare(tuple, TASK_STATES)

WORKER_RUNNING = "running"
WORKER_RETIRING = "retiring"  # being retired: takes no new task, its results move away
WORKER_CLOSED = "closed"

_UNLIMITED_SLOTS = 2 ** 62
_INT32_MIN = -2 ** 31
_INT32_MAX = 2 ** 31 - 1
# Every task counts at least this long in a worker's occupancy: the scheduling overhead
# of a task. It bounds how many tiny tasks the queue horizon lets a worker hold.
_MIN_TASK_ESTIMATE = 0.0005
# Tasks of one victim that one balance looks at, at most (it offers the least urgent of
# them: with a larger backlog, of an arbitrary sample of this many): a balance costs the
# same with a backlog of a million.
_STEAL_SCAN = 10_000
# Thieves one task's steal weighs, at most: the least loaded of them when the balance
# began, plus those that hold some of its inputs. Weighing every thief for every task
# made a balance among 1,000 workers cost ~20 ms (victims x tasks x thieves).
_STEAL_THIEVES = 8
_NO_DEPENDENCIES = ()
_LOG_FIELDS = 5  # key, start, finish, stimulus_id, time
_LAYER_CACHE_SIZE = 10_000  # layer names (key[0] of tuple keys) remembered at most
_SUSPICIOUS_MAX = 2 ** 15 - 1  # TaskState.suspicious is 16 bits
_DURATIONS_KEPT = 10_000  # learned durations of dropped prefixes remembered at most
# A table is rebuilt at its size once it holds less than 1/_SHRINK_FACTOR of the most it
# held, if that was at least _SHRINK_MIN entries.
_SHRINK_FACTOR = 8
_SHRINK_MIN = 4096
#: The most queued tasks a worker takes off the heap at once (SchedulerState._pop_queued):
#: long enough that a run rarely splits a group of tasks whose results meet, short
#: enough to keep the order of what runs close to the priority order.
_RUN_MAX = 256
#: A run whose worker took none of it while the others took this many queued tasks per
#: thread is stuck (a long task): workers done with their runs take from it first.
_RUN_STUCK_PICKS = 4
_DEPENDENTS_TUPLE_MAX = 8  # a task's dependents: a tuple up to this many, then a set
_INT64_MIN = -2 ** 63
_INT64_MAX = 2 ** 63 - 1
#: adaptive_target wants enough workers to keep their results under this share of their
#: memory limit (the rest is for the tasks running and for spilling's margin)
_ADAPT_MEMORY_FRACTION = 0.6
_MIN_TARGET_DURATION = 0.001  # seconds: adaptive_target's bounds
_MAX_TARGET_DURATION = 1e9
_MAX_NBYTES = 2 ** 62  # the largest result size a report may claim
_MAX_DURATION = 1e7  # seconds; a longer (or negative) reported run time counts as unknown
_EXACT_FLOAT_INT = 2 ** 53  # ints a report's start / stop may be (exact as floats)
_QUOTE_LIMIT = 200  # characters of a refused value that an error message quotes
# Transitions one stimulus may run, unless max_transitions_per_stimulus says otherwise:
# no legitimate stimulus moves a task more than a few times.
_TRANSITIONS_PER_TASK_LIMIT = 50
_TRANSITIONS_LIMIT_BASE = 100_000
#: The reason a restart gives the clients in its ``cancelled-keys`` messages.
RESTART_REASON = ("the cluster was restarted (Client.restart): every task was forgotten and "
                  "the workers' results dropped")
#: Recipients a retirement tries for one result before it gives up on it (each a fresh
#: one): SchedulerState.retirement_plan.
MAX_RECIPIENTS_PER_KEY = 3
#: Rebalance leaves alone workers within this fraction of the mean bytes (either side), so
#: results do not bounce between workers that are nearly even: SchedulerState.rebalance_moves.
REBALANCE_HALF_GAP = 0.05


class InvalidTransition(RuntimeError):
    """A recommendation asked for a move that the transition table does not allow."""


class InvariantError(AssertionError):
    """Validation found the state inconsistent (only raised when ``validate`` is on)."""


class InvalidStimulus(ValueError):
    """A stimulus refused its input before changing anything: the state is as it was."""


class Unauthorized(InvalidStimulus):
    """A peer spoke about tasks that are not its business (a worker about a transfer it
    was not given, a client about keys it does not want); nothing was changed."""


class GraphError(InvalidStimulus):
    """A graph submitted by a client was refused; nothing was changed."""


class TransitionLimitExceeded(RuntimeError):
    """One stimulus ran more transitions than ``max_transitions_per_stimulus``: a
    recommendation loop, i.e. a bug in the state machine, not bad input."""


# TaskTable keeps many str and tuple keys in 2 ** _TABLE_SHARD_BITS dicts, keys with
# neighbouring indexes (blocks of 2 ** _TABLE_BLOCK_BITS) in the same one; TaskSet
# keeps many tasks in as many dicts, by the block of memory they lie in.
_TABLE_SHARD_BITS = cython.declare(cython.int, 8)
_TABLE_BLOCK_BITS = cython.declare(cython.int, 10)
#: A TaskTable or TaskSet of more tasks than this spreads them over its shards.
_SET_SPLIT_AT = cython.declare(cython.Py_ssize_t, 16_384)
#: Entries the scheduler's tables rebuild at most (about) at the end of one stimulus once
#: they shrank (SchedulerState._shrink_tables): a shrink of a big graph's tables is spread.
_SHRINK_STEP_ENTRIES = cython.declare(cython.Py_ssize_t, 32_768)
_ADDRESS_BITS = cython.declare(cython.Py_hash_t, (1 << 60) - 1)  # of an identity hash
_ADDRESS_BLOCK_BITS = cython.declare(cython.int, 10)  # of an identity hash: 16 KiB of memory
_KEY_INDEX_DIGITS = cython.declare(cython.int, 18)  # a longer run of digits: the stem keeps the rest
_KEY_STEM_CHARS = cython.declare(cython.int, 12)  # of a str key's stem, the last ones mixed
_FIBONACCI = cython.declare(cython.ulonglong, 0x9E3779B97F4A7C15)
_UINT64 = 0xFFFFFFFFFFFFFFFF
_DIGITS = "0123456789"


@cython.cclass
class _Shards:
    """What `TaskTable` and `TaskSet` share: one dict while they hold few entries, 256
    dicts past _SET_SPLIT_AT (the subclass picks an entry's dict), and rebuilding the
    dicts at their size now a few at a time (a dict never shrinks by deletion)."""

    _one: dict  # every entry while few; once split, those no shard takes
    _shards: list  # None until split
    _n: cython.Py_ssize_t
    _cursor: cython.Py_ssize_t  # the next dict a compaction rebuilds (0: _one); -1 if none

    if not cython.compiled:
        __slots__ = ("_one", "_shards", "_n", "_cursor")

    def __init__(self):
        self._one = {}
        self._shards = None
        self._n = 0
        self._cursor = -1

    @cython.ccall
    def begin_compaction(self) -> None:
        """Start rebuilding the dicts at their size now, a few at a time (`compact_some`);
        back to one dict at once if the entries are few again."""
        if self._shards is not None and self._n <= _SET_SPLIT_AT // 2:
            for table in self._shards:
                self._one.update(table)
            self._shards = None
        self._cursor = 0

    @cython.ccall
    def compact_some(self, budget: cython.Py_ssize_t) -> cython.Py_ssize_t:
        """Go on with the compaction `begin_compaction` started: rebuild the next dicts
        until about ``budget`` entries are rebuilt. Returns how many were (a dict counts
        one more than it holds); 0 once the compaction is over."""
        done: cython.Py_ssize_t = 0
        last: cython.Py_ssize_t = 0 if self._shards is None else len(self._shards)
        table: dict
        while self._cursor >= 0 and done < budget:
            if self._cursor == 0:
                table = self._one
            else:
                table = self._shards[self._cursor - 1]
            _rebuild_dict(table)
            done += len(table) + 1
            self._cursor = -1 if self._cursor >= last else self._cursor + 1
        return done

    @cython.ccall
    def compact(self) -> None:
        """Rebuild every dict at its size now, in one go."""
        self.begin_compaction()
        while self.compact_some(_SHRINK_STEP_ENTRIES):
            pass

    def __len__(self) -> cython.Py_ssize_t:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def sizes(self) -> list:
        """How many entries each dict holds: the one dict while few; once split, the
        one of entries no shard takes first, then the 256 others."""
        return [len(self._one)] + ([len(t) for t in self._shards] if self._shards else [])


@cython.final
@cython.cclass
class TaskTable(_Shards):
    """The tasks the scheduler holds, by key: read like a dict (``[key]``, ``get``,
    ``in``, ``len``, iteration, ``keys``/``values``/``items``).

    A dict grows by copying all its entries into a table twice the size, in one go:
    at 700,000 tasks that held the scheduler 66-112 ms inside one update-graph, and
    each doubling takes twice as long as the one before. So past 16,384 tasks the keys
    go to 256 dicts: a doubling copies about a 256th of them, and the dicts double at
    different moments. Fewer tasks stay in one dict, in the order they came.

    A key's dict is picked by its stem and its index divided by 1,024: for a dask
    chunk ``(name, ..., i)`` the other parts and ``i``; for a str key that ends in
    digits after a ``-`` or ``_`` (``map``'s keys end in ``-<i>``) those digits and the
    12 characters before them. Keys with neighbouring indexes (a block of 1,024) share
    a dict: a graph's tasks arrive, run and leave in about that order, so lookups stay
    where the last ones were (spread by the whole hash, a million lookups in the order
    the keys came cost 2-3 times as much). Other str keys are spread by their hash.
    Keys that are neither str nor tuple stay in one dict of their own. Iteration:
    those, then the dicts one by one, each in the order its keys came.
    """

    if not cython.compiled:
        __slots__ = ()

    @cython.cfunc
    @cython.inline
    def _dict_of(self, key) -> dict:
        """The dict that holds ``key`` if any."""
        if self._shards is None:
            return self._one
        if type(key) is str:
            return self._shards[_shard_of_str(key)]
        if type(key) is tuple:
            return self._shards[_shard_of_tuple(key)]
        return self._one

    # The core calls has / at / put / drop (C calls when compiled); the rest of the
    # world reads it as a mapping.

    @cython.ccall
    def has(self, key) -> cython.bint:
        """Whether ``key`` is in the table (``key in table``)."""
        return key in self._dict_of(key)

    @cython.ccall
    def at(self, key):
        """The task of ``key``; KeyError if none (``table[key]``)."""
        return self._dict_of(key)[key]

    @cython.ccall
    def put(self, key, ts) -> None:
        """Store ``ts`` under ``key`` (``table[key] = ts``)."""
        table: dict = self._dict_of(key)
        n: cython.Py_ssize_t = len(table)
        table[key] = ts
        self._n += len(table) - n
        if self._shards is None and self._n > _SET_SPLIT_AT:
            self._split()

    @cython.ccall
    def drop(self, key) -> None:
        """Remove ``key``; KeyError if it is not there (``del table[key]``)."""
        del self._dict_of(key)[key]
        self._n -= 1

    @cython.cfunc
    def _split(self) -> None:
        every: dict = self._one
        self._one = {}
        self._shards = [{} for _ in range(1 << _TABLE_SHARD_BITS)]
        for key, ts in every.items():
            self._dict_of(key)[key] = ts

    def __contains__(self, key) -> bool:
        return self.has(key)

    def __getitem__(self, key):
        return self.at(key)

    def __setitem__(self, key, ts) -> None:
        self.put(key, ts)

    def __delitem__(self, key) -> None:
        self.drop(key)

    @cython.ccall
    def get(self, key, default=None):
        """The task of ``key``, or ``default``."""
        return self._dict_of(key).get(key, default)

    def __iter__(self):
        if self._shards is None:
            return iter(self._one)
        return _chained_keys(self._one, self._shards)

    def keys(self):
        """The keys (an iterator)."""
        return iter(self)

    def values(self):
        """The tasks (an iterator)."""
        if self._shards is None:
            return iter(self._one.values())
        return _chained_values(self._one, self._shards)

    def items(self):
        """``(key, task)`` pairs (an iterator)."""
        if self._shards is None:
            return iter(self._one.items())
        return _chained_items(self._one, self._shards)

    def __eq__(self, other):
        """Equal to a dict or another table (of either core) with the same items."""
        if not isinstance(other, dict):
            if type(other).__name__ != "TaskTable":
                return NotImplemented
            other = dict(other.items())
        return len(other) == self._n and dict(self.items()) == other

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __repr__(self):
        return f"<TaskTable of {self._n} tasks>"


@cython.final
@cython.cclass
class TaskSet(_Shards):
    """A set of tasks (a client's wanted ones, a worker's results): ``add``,
    ``discard``, ``in``, ``len``, iteration.

    Few tasks are kept in one dict, in the order they came. Past 16,384 they go to 256
    dicts, for the reason `TaskTable` does (a dict of a million doubles in one go), each
    task to the dict of the block of memory it lies in: tasks made one after the other
    (a graph's) lie together, so lookups in that order stay where the last ones were.
    Iteration is then dict by dict, each in the order its tasks came.
    """

    if not cython.compiled:
        __slots__ = ()

    def __init__(self, tasks=()):
        _Shards.__init__(self)
        for ts in tasks:
            self.add(ts)

    @cython.cfunc
    @cython.inline
    def _dict_of(self, ts) -> dict:
        if self._shards is None:
            return self._one
        return self._shards[_shard_of_object(ts)]

    @cython.ccall
    def add(self, ts) -> None:
        """Add ``ts`` (nothing if it is in)."""
        table: dict = self._dict_of(ts)
        n: cython.Py_ssize_t = len(table)
        table[ts] = None
        self._n += len(table) - n
        if self._shards is None and self._n > _SET_SPLIT_AT:
            self._split()

    @cython.ccall
    def discard(self, ts) -> None:
        """Remove ``ts`` if it is in."""
        table: dict = self._dict_of(ts)
        n: cython.Py_ssize_t = len(table)
        table.pop(ts, None)
        self._n -= n - len(table)

    @cython.cfunc
    def _split(self) -> None:
        every: dict = self._one
        self._one = {}
        self._shards = [{} for _ in range(1 << _TABLE_SHARD_BITS)]
        for ts in every:
            self._shards[_shard_of_object(ts)][ts] = None

    def __contains__(self, ts) -> bool:
        return ts in self._dict_of(ts)

    def __iter__(self):
        if self._shards is None:
            return iter(self._one)
        return _chained_keys(self._one, self._shards)

    def __repr__(self):
        return f"<TaskSet of {self._n} tasks>"


@cython.cfunc
@cython.inline
def _shard_of_object(obj) -> cython.Py_ssize_t:
    """The dict of an object hashed by identity: its address (the hash is the address
    rotated right by 4 bits) in blocks of 16 KiB."""
    h: cython.Py_hash_t = hash(obj) & _ADDRESS_BITS
    return _top_bits(cython.cast(cython.ulonglong, h) >> _ADDRESS_BLOCK_BITS)


@cython.cfunc
@cython.inline
def _top_bits(h: cython.ulonglong) -> cython.Py_ssize_t:
    """A shard from a mix of a key's parts: the top bits of h times _FIBONACCI (a dict
    picks its slots by the bottom bits of the hash)."""
    if cython.compiled:
        return cython.cast(cython.Py_ssize_t, (h * _FIBONACCI) >> (64 - _TABLE_SHARD_BITS))
    return ((h * _FIBONACCI) & _UINT64) >> (64 - _TABLE_SHARD_BITS)


@cython.cfunc
@cython.inline
def _shard_of_tuple(key: tuple) -> cython.Py_ssize_t:
    """The dict of a tuple key: all its parts' hashes, the last one's (the chunk's
    index, for dask) divided by the block size. Equal keys have equal parts, hence
    equal part hashes: they always share a dict."""
    h: cython.ulonglong
    last: cython.Py_hash_t
    n: cython.Py_ssize_t = len(key)
    i: cython.Py_ssize_t
    if n == 0:
        return 0
    last = hash(key[n - 1])
    h = cython.cast(cython.ulonglong, last >> _TABLE_BLOCK_BITS)
    for i in range(n - 1):
        h = (h * 1_000_003) ^ cython.cast(cython.ulonglong, hash(key[i]))
    return _top_bits(h)


@cython.cfunc
@cython.inline
def _shard_of_str(key: str) -> cython.Py_ssize_t:
    """The dict of a str key. A key that ends in an index (digits after a ``-`` or a
    ``_``, at most _KEY_INDEX_DIGITS of them): the index divided by the block size,
    mixed with the _KEY_STEM_CHARS characters before it. Any other key: its hash (cached
    in the str). A function of the characters alone: equal keys share a dict."""
    n: cython.Py_ssize_t = len(key)
    j: cython.Py_ssize_t = n
    i: cython.Py_ssize_t
    index: cython.ulonglong = 0
    scale: cython.ulonglong = 1
    digit: cython.long
    h: cython.ulonglong
    if not cython.compiled:
        return _shard_of_str_interpreted(key)
    while j > 0 and n - j < _KEY_INDEX_DIGITS:
        digit = ord(key[j - 1]) - 48
        if digit < 0 or digit > 9:
            break
        index += digit * scale
        scale *= 10
        j -= 1
    if j == n or j == 0 or (key[j - 1] != "-" and key[j - 1] != "_"):
        return _top_bits(cython.cast(cython.ulonglong, hash(key)))
    h = index >> _TABLE_BLOCK_BITS
    for i in range(j - _KEY_STEM_CHARS if j > _KEY_STEM_CHARS else 0, j):
        h = (h * 1_000_003) ^ ord(key[i])
    return _top_bits(h)


def _shard_of_str_interpreted(key: str) -> int:
    """`_shard_of_str` without the C loop: the stem's hash, not its characters, mixed
    (which dict a key goes to may differ from the compiled core's; no one sees it)."""
    stem = key.rstrip(_DIGITS)
    if len(key) - len(stem) > _KEY_INDEX_DIGITS:
        stem = key[:len(key) - _KEY_INDEX_DIGITS]
    if len(stem) == len(key) or stem[-1:] not in ("-", "_"):
        return _top_bits(hash(key) & _UINT64)
    index = int(key[len(stem):])
    return _top_bits(((index >> _TABLE_BLOCK_BITS) ^ hash(stem[-_KEY_STEM_CHARS:])) & _UINT64)


@cython.cfunc
def _rebuild_dict(table: dict) -> None:
    """Rebuild ``table`` at its size now, in place: a dict never shrinks by deletion.
    The same dict object is kept: one made anew during a big release would land among
    the release's freed blocks, in an arena of the small-object allocator that it alone
    would then keep mapped (one arena each, after a ten-million-task release)."""
    if table:
        entries = dict(table)  # a temporary copy, freed on return
        table.clear()
        table.update(entries)
    else:
        table.clear()  # frees the large table an empty dict may keep


@cython.cfunc
def _rebuild_set(members: set) -> None:
    """`_rebuild_dict` for a set."""
    if members:
        kept = set(members)
        members.clear()
        members.update(kept)
    else:
        members.clear()


def _pack_log(entries: list) -> tuple:
    """Logged transitions, ``(key, start, finish, stimulus_id, time)`` each, as five
    objects: the keys, the moves (a byte each: start and finish state), the distinct
    stimulus ids, which of them each entry has, and the times."""
    state_index = {name: i for i, name in enumerate(_NAMES)}
    moves = bytes([8 * state_index[entry[1]] + state_index[entry[2]] for entry in entries])
    stimulus_ids = [entry[3] for entry in entries]
    distinct = list(dict.fromkeys(stimulus_ids))
    index = {stimulus_id: i for i, stimulus_id in enumerate(distinct)}
    which = array("I", [index[stimulus_id] for stimulus_id in stimulus_ids])
    times = [entry[4] for entry in entries]
    try:
        times = array("d", times)
    except TypeError:  # a clock that does not give numbers: kept as they are
        times = tuple(times)
    return _joined([entry[0] for entry in entries]), moves, _joined(distinct), which, times


def _unpack_log(packed: tuple) -> list:
    """The entries `_pack_log` packed, as tuples."""
    keys, moves, distinct, which, times = packed
    distinct = _unjoined(distinct)
    return [(key, _NAMES[move >> 3], _NAMES[move & 7], distinct[i], at)
            for key, move, i, at in zip(_unjoined(keys), moves, which, times)]


def _joined(values: list):
    """Strs as ``(prefix, rest)``: the prefix they all share, and the rest of each,
    each after the first after a NUL (two objects, off the small-object arenas; a map's
    keys share all but their last digits). Dask keys (tuples of a name and ints) as
    `_joined_dask_keys` packs them. Other values, or a str that holds a NUL, as a list."""
    try:
        joined = "\0".join(values)
    except TypeError:
        return _joined_dask_keys(values)
    if joined.count("\0") != len(values) - 1:
        return list(values)
    first, last = values[0], values[-1]
    n: cython.Py_ssize_t = 0
    while n < len(first) and n < len(last) and first[n] == last[n]:
        n += 1
    prefix = first[:n]
    for value in values:
        while not value.startswith(prefix):
            prefix = prefix[:-1]
    if not prefix:
        return "", joined
    n = len(prefix)
    return prefix, "\0".join([value[n:] for value in values])


def _joined_dask_keys(values: list):
    """Tuples of a str and at most 255 ints (a dask key: a name, then where the chunk
    or partition is) as four objects: their distinct names (`_joined`), which name each
    one has, how many ints each one has, and the ints. A tuple key held as it is would
    keep its tuple and ints in the arenas of the job that made it. Values of any other
    kind, or ints out of 64 bits, as a list."""
    names: dict = {}
    which = array("I")
    counts = bytearray()
    ints = array("q")
    for value in values:
        if (type(value) is not tuple or not value or type(value[0]) is not str
                or len(value) > 256):
            return list(values)
        for item in value[1:]:
            if type(item) is not int:  # a bool would come back an int
                return list(values)
        which.append(names.setdefault(value[0], len(names)))
        counts.append(len(value) - 1)
        try:
            ints.extend(value[1:])
        except OverflowError:
            return list(values)
    return _joined(list(names)), which, bytes(counts), ints


def _unjoined(packed) -> list:
    """The values `_joined` packed."""
    if type(packed) is list:
        return packed
    if len(packed) == 4:
        return _unjoined_dask_keys(packed)
    prefix, joined = packed
    rests = joined.split("\0")
    return [prefix + rest for rest in rests] if prefix else rests


def _unjoined_dask_keys(packed: tuple) -> list:
    """The dask keys `_joined_dask_keys` packed."""
    names, which, counts, ints = packed
    names = _unjoined(names)
    keys = []
    at: cython.Py_ssize_t = 0
    for name, n in zip(which, counts):
        keys.append((names[name], *ints[at:at + n]))
        at += n
    return keys


def _chained_keys(other: dict, shards: list):
    yield from other
    for table in shards:
        yield from table


def _chained_values(other: dict, shards: list):
    yield from other.values()
    for table in shards:
        yield from table.values()


def _chained_items(other: dict, shards: list):
    yield from other.items()
    for table in shards:
        yield from table.items()


@cython.dataclasses.dataclass(init=False, repr=False, eq=False)
@cython.final
@cython.cclass
class TaskPrefix:
    """Tasks that share a key prefix (the function name): learned run durations, and the
    counters the transitions keep for its tasks (read by ``SchedulerState.prefix_counts``).
    """

    name: str
    duration_average: cython.double  # seconds; negative while unknown
    n_durations: cython.Py_ssize_t
    # Slots in TASK_STATES order. counts: tasks in each state now (the forgotten slot:
    # tasks forgotten so far); totals: times a task entered each state (released: tasks
    # created, and every move back to released).
    counts: cython.Py_ssize_t[8]
    totals: cython.Py_ssize_t[8]
    n_tasks: cython.Py_ssize_t  # tasks held (not forgotten)
    nbytes_in_memory: cython.Py_ssize_t  # result sizes of its tasks in memory, each once

    if not cython.compiled:
        __slots__ = tuple(__annotations__)

    def __init__(self, name: str):
        self.name = name
        self.duration_average = -1.0
        self.n_durations = 0
        if not cython.compiled:  # compiled: C arrays, zeroed with the object
            self.counts = [0] * 8
            self.totals = [0] * 8
        self.n_tasks = 0
        self.nbytes_in_memory = 0

    def add_duration(self, duration: cython.double) -> None:
        """Fold one measured run time into the running average."""
        _add_duration(self, duration)

    def __repr__(self):
        return f"<TaskPrefix {self.name!r} avg={self.duration_average:.3g}s>"


@cython.cfunc
def _add_duration(prefix: TaskPrefix, duration: cython.double) -> None:
    """TaskPrefix.add_duration, as a C call for the core."""
    if duration < 0:
        return
    prefix.n_durations += 1
    if prefix.duration_average < 0:
        prefix.duration_average = duration
    else:
        weight: cython.double = 1.0 / min(prefix.n_durations, 20)
        prefix.duration_average += (duration - prefix.duration_average) * weight


@cython.dataclasses.dataclass(init=False, repr=False, eq=False)
@cython.final
@cython.cclass
class ClientState:
    """A connected client and the tasks whose results it wants."""

    client_id: str
    wants_what: TaskSet
    alone: tuple  # (self,): the who_wants of every task only this client wants

    if not cython.compiled:
        __slots__ = tuple(__annotations__)

    def __init__(self, client_id: str):
        self.client_id = client_id
        self.wants_what = TaskSet()
        self.alone = (self,)

    def __repr__(self):
        return f"<ClientState {self.client_id!r} wants {len(self.wants_what)}>"


@cython.dataclasses.dataclass(init=False, repr=False, eq=False)
@cython.final
@cython.cclass
class WorkerState:
    """A worker as the scheduler sees it: capacity, running tasks and held results."""

    address: str
    name: object
    nthreads: cython.Py_ssize_t
    slots: cython.Py_ssize_t  # tasks it may run at once before it counts as saturated
    resources: Optional[dict]
    processing: set
    has_what: TaskSet  # its results
    nbytes: cython.Py_ssize_t
    occupancy: cython.double  # estimated seconds of work assigned and not yet finished
    status: str
    alone: tuple  # (self,): the who_has of every result only this worker holds
    # [address]: what compute-task messages list for a result only it holds (shared by
    # the messages, never changed)
    addresses: list
    long_running: Optional[set]  # seceded tasks: each adds a slot while it waits
    # key -> TaskState it was asked to copy here (acquire-replicas), not answered yet
    acquiring: Optional[dict]
    # queued tasks taken off the queue's heap for it to run next, most urgent last (a
    # run: see SchedulerState._pop_queued); they stay queued until it has room
    queue_run: Optional[list]
    queue_picks: cython.Py_ssize_t  # SchedulerState.queue_picks when it last took one
    memory_limit: cython.Py_ssize_t  # bytes its process may use, as it registered; 0: none
    idle_since: cython.double  # the clock when it last had no task to run

    if not cython.compiled:
        __slots__ = tuple(__annotations__)

    def __init__(self, address: str, nthreads: cython.Py_ssize_t, name=None,
                 resources: Optional[dict] = None):
        self.address = address
        self.name = address if name is None else name
        self.nthreads = nthreads
        self.slots = nthreads
        self.resources = resources or None
        self.processing = set()
        self.has_what = TaskSet()
        self.nbytes = 0
        self.occupancy = 0.0
        self.status = WORKER_RUNNING
        self.alone = (self,)
        self.addresses = [address]
        self.long_running = None
        self.acquiring = None
        self.queue_run = None
        self.queue_picks = 0
        self.memory_limit = 0
        self.idle_since = 0.0

    def __repr__(self):
        return (f"<WorkerState {self.address!r} processing={len(self.processing)} "
                f"memory={len(self.has_what)}>")


@cython.dataclasses.dataclass(init=False, repr=False, eq=False)
@cython.final
@cython.cclass
class TaskOptions:
    """What few tasks have: placement restrictions, annotations and an error (kept off
    TaskState, which stays small for the many tasks without them)."""

    workers: Optional[frozenset]  # addresses or names it may run on
    resources: Optional[dict]  # name -> quantity it needs on its worker
    loose: cython.bint  # may run elsewhere if no allowed worker exists
    annotations: Optional[dict]
    error: Optional[tuple]  # TaskState.error

    if not cython.compiled:
        __slots__ = tuple(__annotations__)

    def __init__(self, workers: Optional[frozenset], resources: Optional[dict],
                 loose: cython.bint, annotations: Optional[dict]):
        self.workers = workers
        self.resources = resources
        self.loose = loose
        self.annotations = annotations
        self.error = None

    @property
    def restricted(self) -> bool:
        """Whether it limits where the task may run."""
        return self.workers is not None or self.resources is not None

    def __repr__(self):
        return (f"<TaskOptions workers={self.workers} resources={self.resources} "
                f"loose={self.loose}>")


#: How a task's reference into a spec part begins, on the wire to a worker: then the
#: part's number (8 bytes) and the task's index in it (4 bytes), little-endian. A pickle
#: never begins so (its first byte is 0x80).
SPEC_PART_PREFIX = b"dcore-spec-part:"


@cython.dataclasses.dataclass(init=False, repr=False, eq=False)
@cython.final
@cython.cclass
class SpecPart:
    """The run specs of a slice of a graph, pickled together by the client: one pickle of
    a list, whose memo they share (a dask node's classes, functions and names once per
    slice, not once per task). Opaque bytes like any spec: held once for all its tasks,
    sent as they are, once, to each worker that is given one of them (``holders``).

    A task of a part holds the part as its run spec and its index in the list as its
    ``order``; a worker is sent ``SPEC_PART_PREFIX``, the part's number and that index.
    When the last of its tasks is forgotten, its holders are told to drop it.
    """

    number: cython.Py_ssize_t  # unique in this state; 0 until its graph is taken
    blob: object  # the pickled list (bytes)
    n_tasks: cython.Py_ssize_t  # tasks holding it, not forgotten
    holders: set  # WorkerStates it was sent to

    if not cython.compiled:
        __slots__ = tuple(__annotations__)

    def __init__(self, blob):
        self.number = 0
        self.blob = blob
        self.n_tasks = 0
        self.holders = set()

    def reference(self, index: cython.Py_ssize_t) -> bytes:
        """What a worker is sent as the spec of the task at ``index``."""
        number: object = self.number
        position: object = index
        return SPEC_PART_PREFIX + number.to_bytes(8, "little") + position.to_bytes(4, "little")

    def __repr__(self):
        return (f"<SpecPart {self.number} {len(self.blob)} bytes tasks={self.n_tasks} "
                f"holders={len(self.holders)}>")


@cython.dataclasses.dataclass(init=False, repr=False, eq=False)
@cython.final
@cython.no_gc
@cython.cclass
class TaskState:
    """One task: where it is in its life, what it needs, who needs it and who holds it.

    Compiled, the cyclic garbage collector never walks tasks (``no_gc``): a large graph
    would make every full collection visit every task. The references between tasks,
    workers and clients form cycles, so the state machine breaks them itself: a
    forgotten task refers to no other task, worker or client, and a SchedulerState that
    is dropped cuts the links of the tasks it still holds.
    """

    # Compiled, this is 144 bytes a task (a pymalloc size class): 32- and 16-bit
    # counters (update_graph checks the ranges), and the rarely set fields (restrictions,
    # annotations, an error) in one optional TaskOptions.
    key: object
    prefix: TaskPrefix
    run_spec: object  # opaque bytes or a SpecPart; None for data scattered, not computed
    generation: cython.Py_ssize_t  # which update_graph brought it
    priority_user: cython.int  # negated user priority: lower runs first
    order: cython.int  # position in its graph's order
    n_waiting_on: cython.int  # while waiting: dependencies not yet in memory
    n_waiters: cython.int  # dependents in an active state (they need this result)
    retries: cython.int
    state_id: cython.short  # the state's index in TASK_STATES (``state`` gives its name)
    suspicious: cython.short  # workers that died while running it (at most _SUSPICIOUS_MAX)
    dependencies: tuple
    dependents: object  # None; a tuple while few (most tasks have 1-2); a set when many
    who_wants: Optional[tuple]  # ClientStates
    who_has: Optional[tuple]  # WorkerStates holding the result
    processing_on: Optional[WorkerState]
    estimate: cython.double  # duration estimate while processing (kept for occupancy)
    nbytes: cython.Py_ssize_t  # size of the result; -1 while unknown
    type_name: Optional[str]
    options: Optional[TaskOptions]  # restrictions, annotations, error, if it has any

    if not cython.compiled:
        __slots__ = tuple(__annotations__)

    def __init__(self, key, prefix: TaskPrefix, run_spec):
        self.key = key
        self.prefix = prefix
        self.state_id = 0  # released
        self.run_spec = run_spec
        self.priority_user = 0
        self.generation = 0
        self.order = 0
        self.dependencies = _NO_DEPENDENCIES
        self.dependents = None
        self.n_waiting_on = 0
        self.n_waiters = 0
        self.who_wants = None
        self.who_has = None
        self.processing_on = None
        self.estimate = 0.0
        self.nbytes = -1
        self.type_name = None
        self.retries = 0
        self.suspicious = 0
        self.options = None

    @property
    def error(self) -> Optional[tuple]:
        """(exception bytes, traceback bytes, text, key to blame) of an erred task (or one
        about to err); None otherwise. Kept in ``options``: few tasks err."""
        return None if self.options is None else self.options.error

    @error.setter
    def error(self, value: Optional[tuple]) -> None:
        if self.options is None:
            if value is None:
                return
            self.options = TaskOptions(None, None, False, None)
        self.options.error = value
        if value is None and not self.options.restricted \
                and self.options.annotations is None:
            self.options = None

    @property
    def state(self) -> str:
        """The task's state, by name (one of TASK_STATES)."""
        return TASK_STATES[self.state_id]

    @state.setter
    def state(self, name: str) -> None:
        self.state_id = _STATE_INDEX[name]

    @property
    def priority(self) -> tuple:
        """The sort key: (negated user priority, generation, graph order); lower first."""
        return (self.priority_user, self.generation, self.order)

    def __repr__(self):
        return f"<TaskState {self.key!r} {self.state}>"


@cython.cfunc
@cython.inline
def _is_active(state: cython.int) -> cython.bint:
    """Whether a task in ``state`` needs its dependencies' results (ACTIVE_STATES)."""
    return _S_WAITING <= state <= _S_PROCESSING


@cython.cfunc
@cython.inline
def _allowed(start: cython.int, finish: cython.int) -> cython.bint:
    """Whether ``start -> finish`` is a transition of its own (in MOVES)."""
    return (_MOVE_BITS >> (8 * start + finish)) & 1 == 1


@cython.cfunc
def _no_move(ts: TaskState, start: cython.int, finish: cython.int) -> object:
    """The error of a move that MOVES does not list (``SchedulerState._move`` raises it)."""
    return InvalidTransition(f"{ts.key!r}: no transition {_NAMES[start]} -> {_NAMES[finish]}")


@cython.cfunc
def _tuple_with(items: Optional[tuple], item, alone: tuple) -> tuple:
    if items is None:
        return alone  # shared: most tasks are wanted by one client, held by one worker
    return items + (item,)


@cython.cfunc
def _needed_by_active(ts: TaskState) -> cython.bint:
    """Whether a task still to run needs the result of ``ts``."""
    dts: TaskState
    for dts in ts.dependents:
        if _is_active(dts.state_id):
            return True
    return False


@cython.cfunc
def _holder_addresses(ts: TaskState) -> list:
    """The addresses of the workers holding ``ts``: those still here, or if only
    departing ones are left (their slice has not come yet), those."""
    ws: WorkerState
    alive = [ws.address for ws in ts.who_has if ws.status != WORKER_CLOSED]
    return alive if alive else [ws.address for ws in ts.who_has]


@cython.cfunc
def _tuple_without(items: Optional[tuple], item) -> Optional[tuple]:
    if items is None:
        return None
    rest = tuple([x for x in items if x is not item])
    return rest if rest else None


@cython.cfunc
def _is_layer_key(key) -> cython.bint:
    """A dask chunk key: ``(layer name, index, ...)``. Only str names are cached: 1, 1.0
    and True are equal keys, and a cached one must not change a key's type."""
    return type(key) is tuple and len(key) > 0 and type(key[0]) is str


@cython.cfunc
def _with_dependent(dependents, ts: TaskState) -> object:
    # A set costs 216 bytes even for one member, a tuple 40 + 8 a member.
    if dependents is None:
        return (ts,)
    if type(dependents) is tuple:
        if len(dependents) < _DEPENDENTS_TUPLE_MAX:
            return dependents + (ts,)
        dependents = set(dependents)
    dependents.add(ts)
    return dependents


@cython.cfunc
def _without_dependent(dependents, ts: TaskState) -> object:
    """What remains of ``dependents`` without ``ts``; None if nothing."""
    if type(dependents) is tuple:
        rest = tuple([x for x in dependents if x is not ts])
        return rest if rest else None
    dependents.discard(ts)
    return dependents if dependents else None


@cython.cfunc
def _is_hash_token(part: str) -> cython.bint:
    if part.isdigit():
        return True
    return len(part) >= 8 and not part.strip("0123456789abcdef")


_UUID_GROUPS = (8, 4, 4, 4, 12)


@cython.cfunc
def _is_uuid_at(parts: list, i: cython.Py_ssize_t) -> cython.bint:
    """Whether ``parts[i:i + 5]`` are the five hex groups of a uuid (``uuid4()``)."""
    j: cython.Py_ssize_t
    if i + 5 > len(parts):
        return False
    for j in range(5):
        part: str = parts[i + j]
        if len(part) != _UUID_GROUPS[j] or part.strip("0123456789abcdef"):
            return False
    return True


def key_prefix(key) -> str:
    """The name shared by tasks of one kind: ``"inc-1f3a9c0d..."`` → ``"inc"``,
    ``("sum-aggregate-9ab1c2d3e4", 0)`` → ``"sum-aggregate"``, and
    ``"work-2b66532a-49c4-4a05-8f1e-0c2d4e6f8a9b"`` (a ``pure=False`` key) → ``"work"``."""
    if isinstance(key, tuple):
        if not key:
            return "tuple"
        key = key[0]
    if not isinstance(key, str):
        return type(key).__name__
    parts = key.split("-")
    words = []
    i: cython.Py_ssize_t = 0
    n: cython.Py_ssize_t = len(parts)
    while i < n:
        part = parts[i]
        if len(part) == 8 and n - i >= 5 and _is_uuid_at(parts, i):
            i += 5  # its 4-digit groups are no words either
            continue
        if part and not _is_hash_token(part):
            words.append(part)
        i += 1
    return "-".join(words) if words else parts[0]


_BYTES = (bytes, bytearray, memoryview)
_SEQUENCE = (list, tuple)
_BRACKETS = {list: ("[", "]"), tuple: ("(", ")"), set: ("{", "}"),
             frozenset: ("frozenset({", "})"), dict: ("{", "}")}


def bounded_repr(value, limit: int = _QUOTE_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that quote input.

    The work is bounded too: a long list, string or int is not rendered whole first, and
    a repr that raises is replaced by a placeholder."""
    text = _repr_within(value, max(limit, 4), 0)
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."


def _repr_within(value, budget, depth) -> str:
    """A repr that stops a little past ``budget`` characters (the caller cuts it)."""
    kind = type(value)
    if kind is str or kind is bytes or kind is bytearray:
        return repr(value[:budget + 1])
    if kind is int:
        if value.bit_length() > 4 * budget:
            return f"<int of {value.bit_length()} bits>"
        return repr(value)
    brackets = _BRACKETS.get(kind)
    if brackets is None:
        try:
            text = repr(value)
        except Exception:
            text = f"<{kind.__name__} object>"
        return text[:budget + 1]
    if kind is set and not value:
        return "set()"
    opening, closing = brackets
    if depth >= 8:
        return opening + "..." + closing
    parts = []
    used = len(opening)
    for item in (value.items() if kind is dict else value):
        if used > budget:
            parts.append("...")
            break
        if kind is dict:
            text = _repr_within(item[0], budget - used, depth + 1)
            text += ": " + _repr_within(item[1], budget - used - len(text), depth + 1)
        else:
            text = _repr_within(item, budget - used, depth + 1)
        parts.append(text)
        used += len(text) + 2
    if kind is tuple and len(value) == 1:
        closing = ",)"
    return opening + ", ".join(parts) + closing


# The input checks below (to _check_resources) are the ones of both cores: _worker_core.pyx
# calls these. They are cpdef (``ccall``) so that it can: a call from here is still a C
# call; one from the worker core is a Python call, a few ns dearer than a cfunc call.


@cython.ccall
def _key_problem(key) -> object:
    """Why ``key`` cannot name a task (a text), or None if it can."""
    try:
        hash(key)
    except Exception:
        return f"key {bounded_repr(key)} is not hashable"
    if type(key) is float and key != key:
        return "a key must not be NaN (it is not equal to itself)"
    return None


@cython.ccall
def _check_keys(keys, what: str) -> None:
    """Refuse anything but a list or tuple of keys."""
    if not isinstance(keys, _SEQUENCE):
        raise InvalidStimulus(f"{what}: keys must be a list of keys, not {bounded_repr(keys)}")
    for key in keys:
        problem = _key_problem(key)
        if problem is not None:
            raise InvalidStimulus(f"{what}: {problem}")


@cython.ccall
def _check_key(key, what: str) -> None:
    """Refuse a key that cannot name a task (``_key_problem``)."""
    problem = _key_problem(key)
    if problem is not None:
        raise InvalidStimulus(f"{what}: {problem}")


@cython.ccall
def _check_str(value, what: str) -> None:
    """Refuse anything but a str."""
    if not isinstance(value, str):
        raise InvalidStimulus(f"{what} must be a str, not {bounded_repr(value)}")


@cython.ccall
def _is_quantity(value) -> cython.bint:
    """A resource quantity: a non-negative, finite number (no bool)."""
    kind = type(value)
    if kind is int:
        return 0 <= value <= _INT64_MAX
    if kind is float:
        return value >= 0.0 and math.isfinite(value)
    return False


@cython.ccall
def _check_resources(resources, what: str) -> object:
    """``resources`` as a dict of its own (None if empty), or InvalidStimulus."""
    if resources is None:
        return None
    if type(resources) is not dict:
        raise InvalidStimulus(f"{what}: resources must be a dict, not {bounded_repr(resources)}")
    for name, quantity in resources.items():
        if not isinstance(name, str) or not _is_quantity(quantity):
            raise InvalidStimulus(f"{what}: resources must map names (str) to non-negative "
                                  f"finite numbers, not {bounded_repr(name)}: "
                                  f"{bounded_repr(quantity)}")
    return dict(resources) if resources else None


@cython.cfunc
def _is_real(value) -> cython.bint:
    kind = type(value)
    return kind is float or (kind is int and -_EXACT_FLOAT_INT <= value <= _EXACT_FLOAT_INT)


@cython.cfunc
def _reported_duration(report: dict) -> cython.double:
    """``stop - start`` of a report; -1 (unknown) unless both are numbers and it is a
    plausible run time: a duration only feeds estimates, it fails no task."""
    start = report.get("start")
    stop = report.get("stop")
    if not _is_real(start) or not _is_real(stop):
        return -1.0
    duration: cython.double = float(stop) - float(start)
    if not 0.0 <= duration <= _MAX_DURATION:
        return -1.0
    return duration


@cython.cfunc
def _finished_problem(nbytes, type_name, data) -> object:
    """What is impossible in a task-finished report (a text), or None."""
    if type(nbytes) is not int or not 0 <= nbytes <= _MAX_NBYTES:
        return f"nbytes must be an int from 0 to 2**62, not {bounded_repr(nbytes)}"
    if type_name is not None and not isinstance(type_name, str):
        return f"type must be a str, not {bounded_repr(type_name)}"
    if data is not None and not isinstance(data, _BYTES):
        return f"data must be bytes, not {bounded_repr(data)}"
    return None


@cython.cfunc
def _erred_problem(report: dict) -> object:
    """What is impossible in a task-erred report (a text), or None."""
    for field in ("exception", "traceback"):
        value = report.get(field)
        if value is not None and not isinstance(value, _BYTES):
            return f"{field} must be bytes, not {bounded_repr(value)}"
    text = report.get("text")
    if text is not None and not isinstance(text, str):
        return f"text must be a str, not {bounded_repr(text)}"
    return None


@cython.cfunc
def _check_task_entry(i: cython.Py_ssize_t, entry) -> object:
    """Check one task dict of ``update_graph``; return its key or raise GraphError."""
    if type(entry) is not dict:
        raise GraphError(f"task #{i} is not a dict: {bounded_repr(entry)}")
    if "key" not in entry:
        raise GraphError(f"task #{i} has no 'key'")
    key = entry["key"]
    problem = _key_problem(key)
    if problem is not None:
        raise GraphError(f"task #{i}: {problem}")
    return key


@cython.cfunc
def _check_new_task(key, entry: dict) -> None:
    """Check the fields of a task dict whose key the scheduler does not know yet."""
    spec = entry.get("spec")
    if not isinstance(spec, _BYTES) and type(spec) is not SpecPart:
        raise GraphError(f"task {bounded_repr(key)} has no run spec (bytes)")
    deps = entry.get("deps")
    if deps is not None and not isinstance(deps, _SEQUENCE):
        raise GraphError(f"task {bounded_repr(key)}: 'deps' must be a list of keys, not "
                         f"{bounded_repr(deps)}")
    for field in ("priority", "order", "retries"):
        value = entry.get(field)
        if value is not None and (type(value) is not int or not _INT32_MIN < value <= _INT32_MAX):
            raise GraphError(f"task {bounded_repr(key)}: {field!r} must be an int of 32 bits, "
                             f"not {bounded_repr(value)}")
    if (entry.get("retries") or 0) < 0:
        raise GraphError(f"task {bounded_repr(key)}: 'retries' must not be negative")
    workers = entry.get("workers")
    if workers is not None and (not isinstance(workers, _SEQUENCE)
                                or not all([isinstance(w, str) for w in workers])):
        raise GraphError(f"task {bounded_repr(key)}: 'workers' must be a list of addresses "
                         f"or names, not {bounded_repr(workers)}")
    resources = entry.get("resources")
    if resources is not None and (
            type(resources) is not dict
            or not all([isinstance(k, str) and _is_quantity(v) for k, v in resources.items()])):
        raise GraphError(f"task {bounded_repr(key)}: 'resources' must map names to "
                         f"non-negative finite quantities, not {bounded_repr(resources)}")
    annotations = entry.get("annotations")
    if annotations is not None and not isinstance(annotations, dict):
        raise GraphError(f"task {bounded_repr(key)}: 'annotations' must be a dict, not "
                         f"{bounded_repr(annotations)}")


@cython.cfunc
def _part_entries(part) -> list:
    """The task dicts of an update-graph's ``part``: ``{"blob": bytes, "keys": [key,
    ...], "deps": [key, ...], "ndeps": [int, ...]}``, the keys' dependencies one after
    another (``ndeps`` of them for each key). The task at index ``i`` holds the part as
    its spec and ``i`` as its order. Raise GraphError if the part is malformed."""
    if type(part) is not dict:
        raise GraphError(f"'part' must be a dict, not {bounded_repr(part)}")
    blob = part.get("blob")
    keys = part.get("keys")
    deps = part.get("deps")
    counts = part.get("ndeps")
    if not isinstance(blob, _BYTES):
        raise GraphError(f"the part's 'blob' must be bytes, not {bounded_repr(blob)}")
    for name, value in (("keys", keys), ("deps", deps), ("ndeps", counts)):
        if not isinstance(value, _SEQUENCE):
            raise GraphError(f"the part's {name!r} must be a list, not {bounded_repr(value)}")
    n: cython.Py_ssize_t = len(keys)
    if len(counts) != n or n > _INT32_MAX:
        raise GraphError(f"the part has {n} keys and {len(counts)} dependency counts")
    spec = SpecPart(blob if type(blob) is bytes else bytes(blob))
    entries = []
    start: cython.Py_ssize_t = 0
    stop: cython.Py_ssize_t
    i: cython.Py_ssize_t
    n_deps: cython.Py_ssize_t = len(deps)
    for i in range(n):
        count = counts[i]
        if type(count) is not int or not 0 <= count <= n_deps - start:
            raise GraphError(f"the part's dependency count #{i} is {bounded_repr(count)}, "
                             f"with {n_deps - start} dependencies left")
        entry = {"key": keys[i], "spec": spec, "order": i}
        if count:
            stop = start + count
            entry["deps"] = deps[start:stop]
            start = stop
        entries.append(entry)
    if start != n_deps:
        raise GraphError(f"the part lists {n_deps} dependencies and counts {start}")
    return entries


@cython.cfunc
def _first_wanted(cs: ClientState, n: cython.Py_ssize_t) -> list:
    """The first ``n`` (at most) tasks ``cs`` wants, in its set's order (a list: the
    caller drops them from the set)."""
    wanted: list = []
    for ts in cs.wants_what:
        if len(wanted) >= n:
            break
        wanted.append(ts)
    return wanted


@cython.dataclasses.dataclass(init=False, repr=False, eq=False)
@cython.final
@cython.cclass
class SchedulerState:
    """All the scheduler knows: tasks, workers, clients; changed only by stimuli.

    ``validate=True`` checks every invariant after each stimulus and the local
    invariants of each task after each of its transitions. ``worker_saturation`` is how
    many tasks per thread a worker is given before tasks without dependencies wait in
    the scheduler's queue (``inf`` turns queuing off). ``queue_horizon`` is the estimated
    work (seconds per thread) a worker is given regardless: with tiny tasks, a count of
    1.1 per thread would leave the worker idle for every round trip to the scheduler.
    ``clock`` is a callable returning seconds; it stamps the transition log.
    ``max_transitions_per_stimulus`` bounds the recommendations one stimulus may carry
    out before it raises TransitionLimitExceeded (a loop is a bug); by default
    ``50 * (tasks + 1) + 100,000``, far more than any legitimate stimulus needs.

    Counters: the transitions keep the figures that ``counters()``, ``task_counts()``,
    ``prefix_counts()`` and ``worker_counts()`` return (tasks per state, per state and
    prefix, bytes in memory, transitions, stimuli), so reading them never walks the
    tasks. Validation checks them against a walk after every stimulus.
    """

    tasks: TaskTable
    workers: dict
    departing: dict  # address -> WorkerState removed whose results are not all let go
    clients: dict
    prefixes: dict
    _prefix_of_name: dict  # key[0] of tuple keys -> (that key[0], its TaskPrefix); a cache
    idle: dict  # address -> WorkerState that is not saturated
    queued: list  # heap of TaskStates, most urgent first (_heap_push); may hold left ones
    n_queued: cython.Py_ssize_t
    unrunnable: dict  # TaskState -> None, in arrival order
    validate: cython.bint
    worker_saturation: cython.double
    queue_horizon: cython.double
    allowed_failures: cython.Py_ssize_t
    default_duration: cython.double
    clock: object
    _log_entries: list  # ring buffer, flat: key, start, finish, stimulus_id, time, key, ...
    _log_capacity: cython.Py_ssize_t
    _log_next: cython.Py_ssize_t
    _log_packed: object  # None, or older entries packed by pack_transition_log
    _recording: cython.bint  # record_transitions is on
    _recorded: list  # flat: key, start, finish, stimulus_id, key, ...
    transition_counter: cython.Py_ssize_t
    stimulus_counter: cython.Py_ssize_t  # stimuli that were taken (not refused)
    _state_counts: cython.Py_ssize_t[8]  # as TaskPrefix.counts, over all tasks
    _state_totals: cython.Py_ssize_t[8]  # as TaskPrefix.totals, over all tasks
    nbytes_in_memory: cython.Py_ssize_t  # result sizes of tasks in memory, each once
    total_nthreads: cython.Py_ssize_t  # of the registered workers
    _active_prefixes: dict  # name -> TaskPrefix that has tasks held
    _durations: dict  # name -> (duration_average, n_durations) of a dropped prefix; bounded
    _tasks_peak: cython.Py_ssize_t  # most tasks held since the tables were last rebuilt
    _shrinking: list  # the tables a shrink is still rebuilding (_shrink_step), or None
    max_transitions_per_stimulus: cython.Py_ssize_t  # 0: scaled to the number of tasks
    _idle_since: cython.double  # the clock when the last task to run left; -1: work now
    forget_slice: cython.Py_ssize_t  # most tasks one stimulus forgets; 0: no limit
    _forget_budget: cython.Py_ssize_t  # forgets this stimulus may still do; -1: no limit
    _forget_later: dict  # TaskState -> None: to forget, left for forget_more
    generation: cython.Py_ssize_t
    _n_spec_parts: cython.Py_ssize_t  # SpecParts taken in, ever (the last one's number)
    queue_picks: cython.Py_ssize_t  # queued tasks taken for workers, ever
    _picked_task: TaskState  # _pop_queued chose it for _picked_worker; taken next
    _picked_worker: WorkerState
    _recs: dict
    _client_msgs: dict
    _worker_msgs: dict
    _stimulus_id: str
    _now: object
    # work stealing (section "work stealing" below)
    _steals: dict  # TaskState -> [thief WorkerState or None, request id]: not answered yet
    _steal_refused: dict  # TaskState -> None: its worker would not give it back
    steal_requests: cython.Py_ssize_t  # steal requests sent so far (the last request id)
    steals_done: cython.Py_ssize_t  # tasks given back by their victim and placed again
    steal_bandwidth: cython.double  # bytes/s assumed for moving a stolen task's inputs
    steal_latency: cython.double  # seconds a move costs besides its inputs' transfer
    # Called as hook(state, ts, start, finish) after every transition when set: the seam
    # tests use to inject a fault into a transition. None otherwise.
    _transition_hook: object

    if not cython.compiled:
        __slots__ = tuple(__annotations__)

    def __init__(self, *, validate: bool = False, worker_saturation: float = 1.1,
                 queue_horizon: float = 0.05, allowed_failures: int = 3, default_duration: float = 0.5,
                 transition_log_length: int = 10_000, clock=None,
                 max_transitions_per_stimulus=None, forget_slice=None):
        self.tasks = TaskTable()
        if not worker_saturation > 0:
            raise ValueError(f"worker_saturation must be positive, not {worker_saturation!r}")
        if max_transitions_per_stimulus is not None and (
                type(max_transitions_per_stimulus) is not int
                or not 1 <= max_transitions_per_stimulus <= _INT64_MAX):
            raise ValueError("max_transitions_per_stimulus must be a positive int or None, "
                             f"not {max_transitions_per_stimulus!r}")
        self.max_transitions_per_stimulus = max_transitions_per_stimulus or 0
        if forget_slice is not None and (type(forget_slice) is not int
                                         or not 1 <= forget_slice <= _INT64_MAX):
            raise ValueError(f"forget_slice must be a positive int or None, not "
                             f"{forget_slice!r}")
        self.forget_slice = forget_slice or 0
        self._forget_budget = -1
        self._forget_later = {}
        self.workers = {}
        self.departing = {}
        self.clients = {}
        self.prefixes = {}
        self._prefix_of_name = {}
        self.idle = {}
        self.queued = []
        self.n_queued = 0
        self.unrunnable = {}
        self.validate = validate
        self.worker_saturation = worker_saturation
        self.queue_horizon = queue_horizon
        self.allowed_failures = allowed_failures
        self.default_duration = default_duration
        self.clock = clock if clock is not None else _zero_clock
        self._idle_since = self.clock()
        self._log_entries = []
        self._log_capacity = transition_log_length
        self._log_next = 0
        self._log_packed = None
        self._recording = False
        self._recorded = []
        self.transition_counter = 0
        self.stimulus_counter = 0
        if not cython.compiled:  # compiled: C arrays, zeroed with the object
            self._state_counts = [0] * 8
            self._state_totals = [0] * 8
        self.nbytes_in_memory = 0
        self.total_nthreads = 0
        self._active_prefixes = {}
        self._durations = {}
        self._tasks_peak = 0
        self._shrinking = None
        self.generation = 0
        self._n_spec_parts = 0
        self.queue_picks = 0
        self._picked_task = None
        self._picked_worker = None
        self._recs = {}
        self._client_msgs = {}
        self._worker_msgs = {}
        self._stimulus_id = ""
        self._now = 0.0
        self._steals = {}
        self._steal_refused = {}
        self.steal_requests = 0
        self.steals_done = 0
        self.steal_bandwidth = 100e6
        self.steal_latency = 0.002
        self._transition_hook = None

    def __repr__(self):
        return (f"<SchedulerState tasks={len(self.tasks)} workers={len(self.workers)} "
                f"clients={len(self.clients)}>")

    def __del__(self):
        # Tasks are invisible to the cyclic GC: cut their links so refcounting frees them.
        ts: TaskState
        if self.tasks is None:
            return  # __init__ refused its arguments
        for ts in self.tasks.values():
            ts.dependencies = _NO_DEPENDENCIES
            ts.dependents = None
            ts.who_wants = None
            ts.who_has = None
            ts.processing_on = None
            ts.run_spec = None  # a SpecPart refers to the workers it went to
        self._picked_task = None
        self.queued = []
        self.unrunnable = {}
        self._steals = {}
        self._steal_refused = {}

    # ------------------------------------------------------------------ stimuli
    #
    # Each stimulus first checks all of its input and the sender's right to say it, and
    # raises InvalidStimulus (Unauthorized) before _begin, so a refused call changes
    # nothing. Only then does it change the state.

    def add_client(self, client, stimulus_id) -> tuple:
        """A client connected."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(client, "client")
        self._begin(stimulus_id)
        self._client(client)
        return self._end()

    def remove_client(self, client, stimulus_id, max_keys=None) -> tuple:
        """A client left: release everything it wanted and forget it.

        ``max_keys`` (a positive int) does it in slices: this call releases at most that
        many of its keys, and the client stays registered while it still wants some;
        call again until it is not in ``clients``. Without it, all in one call (a client
        that wanted millions of keys holds the scheduler for seconds)."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(client, "client")
        if max_keys is not None and (type(max_keys) is not int
                                     or not 1 <= max_keys <= _INT64_MAX):
            raise InvalidStimulus(f"remove_client: max_keys must be a positive int or None, "
                                  f"not {bounded_repr(max_keys)}")
        self._begin(stimulus_id)
        cs: ClientState = self.clients.get(client)
        ts: TaskState
        if cs is not None:
            budget: cython.Py_ssize_t = max_keys if max_keys is not None else _INT64_MAX
            for ts in _first_wanted(cs, budget):
                self._drop_want(ts, cs)
            if not cs.wants_what:
                del self.clients[client]
        return self._end()

    def add_worker(self, address, nthreads, stimulus_id, name=None, resources=None,
                   memory_limit=None) -> tuple:
        """A worker joined: give it queued and previously unrunnable tasks.

        ``nthreads`` is an int from 1 to 2**31-1, ``name`` a str, an int or None (then
        the address), ``resources`` a dict of names to non-negative finite quantities,
        ``memory_limit`` the bytes its process may use (an int >= 0 or None: none; read
        by `adaptive_target`)."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(address, "worker address")
        if address in self.workers:
            raise InvalidStimulus(f"worker {bounded_repr(address)} is already registered")
        if type(nthreads) is not int or not 1 <= nthreads <= _INT32_MAX:
            raise InvalidStimulus(f"worker {bounded_repr(address)}: nthreads must be an int "
                                  f"from 1 to {_INT32_MAX}, not {bounded_repr(nthreads)}")
        if name is not None and not isinstance(name, str) and (
                type(name) is not int or not _INT64_MIN <= name <= _INT64_MAX):
            raise InvalidStimulus(f"worker {bounded_repr(address)}: name must be a str or "
                                  f"an int of 64 bits, not {bounded_repr(name)}")
        resources = _check_resources(resources, f"worker {bounded_repr(address)}")
        if memory_limit is not None and (type(memory_limit) is not int
                                         or not 0 <= memory_limit <= _INT64_MAX):
            raise InvalidStimulus(f"worker {bounded_repr(address)}: memory_limit must be an "
                                  f"int >= 0 or None, not {bounded_repr(memory_limit)}")
        self._begin(stimulus_id)
        departed: WorkerState = self.departing.get(address)
        if departed is not None:  # back at the same address: the old one's results go now
            self._let_go_of_results(departed, None)
        ws = WorkerState(address, nthreads, name, resources)
        ws.slots = self._slots_for(nthreads)
        ws.memory_limit = memory_limit or 0
        ws.idle_since = self._now
        self.workers[address] = ws
        self.idle[address] = ws
        self.total_nthreads += nthreads
        ts: TaskState
        for ts in self.unrunnable:
            self._recs[ts] = _S_PROCESSING
        return self._end()

    def remove_worker(self, address, stimulus_id, max_keys=None) -> tuple:
        """A worker left or died: reschedule its tasks, recompute results only it held.

        ``max_keys`` (a positive int) lets go of at most that many of its results in this
        call: the worker stays in ``departing``, still the holder of the rest, until
        calls for its address with ``max_keys`` again have let go of them all. No task is
        sent to fetch from it (a result only it holds is recomputed when a task needs
        it), and ``who_has`` names it only for results no other worker holds. Without
        ``max_keys``, all go at once."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(address, "worker address")
        if max_keys is not None and (type(max_keys) is not int
                                     or not 1 <= max_keys <= _INT64_MAX):
            raise InvalidStimulus(f"remove_worker: max_keys must be a positive int or None, "
                                  f"not {bounded_repr(max_keys)}")
        self._begin(stimulus_id)
        ws: WorkerState = self.workers.pop(address, None)
        if ws is None:
            ws = self.departing.get(address)
            if ws is not None:
                self._let_go_of_results(ws, max_keys)
            return self._end()
        self.idle.pop(address, None)
        self.total_nthreads -= ws.nthreads
        ws.status = WORKER_CLOSED
        self._return_run(ws)
        if self._steals:
            self._thief_gone(ws)
        ts: TaskState
        for ts in sorted(ws.processing, key=_priority_of):
            if ts.suspicious < _SUSPICIOUS_MAX:
                ts.suspicious += 1
            if ts.suspicious >= self.allowed_failures:
                ts.error = (None, None,
                            f"KilledWorker: {bounded_repr(ts.key)} was running on "
                            f"{ts.suspicious} workers that died, the last one {address}",
                            ts.key)
                self._recs[ts] = _S_ERRED
            else:
                self._recs[ts] = _S_WAITING
        self.departing[address] = ws
        if max_keys is not None and len(ws.has_what) > max_keys:
            # First the results that tasks still to run need: they must not wait for a
            # later slice, nor be fetched from a worker that is gone.
            needed = [ts for ts in ws.has_what
                      if ts.dependents is not None and _needed_by_active(ts)]
            for ts in needed:
                ws.has_what.discard(ts)
            self._let_go(ws, needed)
        self._let_go_of_results(ws, max_keys)
        return self._end()

    @cython.cfunc
    def _let_go_of_results(self, ws: WorkerState, max_keys) -> None:
        """Drop ``ws`` (departing) as a holder of up to ``max_keys`` of its results (all
        with None); it leaves ``departing`` once it holds none."""
        ts: TaskState
        if max_keys is None or len(ws.has_what) <= max_keys:
            batch = ws.has_what
            ws.has_what = TaskSet()
        else:
            batch = []
            for ts in ws.has_what:
                batch.append(ts)
                if len(batch) >= max_keys:
                    break
            for ts in batch:
                ws.has_what.discard(ts)
        self._let_go(ws, batch)

    @cython.cfunc
    def _let_go(self, ws: WorkerState, batch) -> None:
        """Drop departing ``ws`` as the holder of ``batch`` (already out of its
        ``has_what``); a result nobody else holds is recomputed or forgotten at once (a
        task in memory must have a holder)."""
        ts: TaskState
        lost = []
        for ts in batch:
            ts.who_has = _tuple_without(ts.who_has, ws)
            ws.nbytes -= ts.nbytes
            if ts.who_has is None:
                lost.append(ts)
        if not ws.has_what:
            ws.nbytes = 0
            self.departing.pop(ws.address, None)
        for ts in lost:
            self._transition(ts, _S_RELEASED)

    def update_graph(self, client, tasks, keys, stimulus_id, part=None) -> tuple:
        """A client submits tasks and names the keys it wants.

        ``part``: more tasks, whose specs were pickled together (`SpecPart`;
        `_part_entries` gives its form). Known keys are reused. A bad graph changes
        nothing (the client is not even registered): the client is sent one
        ``graph-refused`` message saying why.
        """
        _check_str(stimulus_id, "stimulus_id")
        _check_str(client, "client")
        cs: ClientState
        spec_part: SpecPart = None
        try:
            if part is not None:
                entries = _part_entries(part)
                if entries:
                    spec_part = entries[0]["spec"]
                if isinstance(tasks, _SEQUENCE):
                    tasks = [*tasks, *entries] if tasks else entries
            new = self._check_graph(tasks, keys)
        except GraphError as exc:
            self._begin(stimulus_id)
            self.stimulus_counter -= 1  # refused: it only answers, it is not counted
            cs = self.clients.get(client)
            if cs is None:
                cs = ClientState(client)  # to address the reply; not registered
            wanted = list(keys) if isinstance(keys, _SEQUENCE) else []
            self._send_client(cs, {"op": "graph-refused", "error": str(exc), "keys": wanted})
            return self._end()
        self._begin(stimulus_id)
        if spec_part is not None:
            self._n_spec_parts += 1
            spec_part.number = self._n_spec_parts
        cs = self._client(client)
        created = self._create_tasks(new)
        ts: TaskState
        wanted = [self.tasks.at(key) for key in keys]
        wanted.sort(key=_priority_of, reverse=True)  # recommendations pop LIFO
        for ts in wanted:
            self._add_want(ts, cs)
        for ts in created:
            if ts.dependents is None and ts.who_wants is None:
                self._recs[ts] = _S_FORGOTTEN
        return self._end()

    def update_data(self, client, who_has, nbytes, stimulus_id) -> tuple:
        """A client placed data on workers itself (scatter): those keys are in memory.

        ``who_has``: ``{key: [address, ...]}``; ``nbytes``: ``{key: int}``. A key that
        already exists may only be overwritten by a client that wants it (Unauthorized).
        """
        _check_str(stimulus_id, "stimulus_id")
        _check_str(client, "client")
        if type(who_has) is not dict:
            raise InvalidStimulus(f"update_data: who_has must be a dict, not "
                                  f"{bounded_repr(who_has)}")
        if type(nbytes) is not dict:
            raise InvalidStimulus(f"update_data: nbytes must be a dict, not "
                                  f"{bounded_repr(nbytes)}")
        ts: TaskState
        ws: WorkerState
        cs: ClientState = self.clients.get(client)
        refused = []
        for key, addresses in who_has.items():
            _check_key(key, "update_data")
            if not isinstance(addresses, _SEQUENCE) \
                    or not all([isinstance(a, str) for a in addresses]):
                raise InvalidStimulus(f"update_data: the holders of {bounded_repr(key)} must "
                                      f"be a list of addresses, not {bounded_repr(addresses)}")
            ts = self.tasks.get(key)
            if ts is not None and not _wants(ts, cs):
                refused.append(key)
        for key, size in nbytes.items():
            if type(size) is not int or not 0 <= size <= _MAX_NBYTES:
                raise InvalidStimulus(f"update_data: nbytes of {bounded_repr(key)} must be an "
                                      f"int from 0 to 2**62, not {bounded_repr(size)}")
        if refused:
            raise Unauthorized(f"client {bounded_repr(client)} may not overwrite keys it "
                               f"does not want: {_some(refused)}")
        self._begin(stimulus_id)
        cs = self._client(client)
        lost = []
        for key, addresses in who_has.items():
            holders = [self.workers[a] for a in addresses if a in self.workers]
            if not holders:
                lost.append(key)
                continue
            ts = self.tasks.get(key)
            if ts is None:
                ts = TaskState(key, self._prefix_for(key), None)
                self.tasks[key] = ts
                self._count_new(ts.prefix)
                if len(self.tasks) > self._tasks_peak:
                    self._tasks_peak = len(self.tasks)
            elif ts.state_id != _S_RELEASED and ts.state_id != _S_MEMORY:
                self._transition(ts, _S_RELEASED)
                self._recs.pop(ts, None)
            self._add_want_quiet(ts, cs)
            size = nbytes.get(key, 0)
            if ts.state_id == _S_RELEASED:
                self._released_memory(ts, holders, size)
            else:
                for ws in holders:
                    self._add_holder(ts, ws, size)
        if lost:
            self._send_client(cs, {"op": "cancelled-keys", "keys": lost})
        return self._end()

    def task_finished(self, worker, reports, stimulus_id) -> tuple:
        """A worker finished tasks: each report is
        ``{"key", "nbytes", "type", "start", "stop", "data"?}`` (data: a small result,
        forwarded to the clients that want it, never kept).

        Only a report of a task processing on that worker counts. Any other report is
        stale or not the worker's business: the worker is told to free the key (unless
        it is a known holder of that result). A report with an impossible field (nbytes
        not an int in 0..2**62, type not a str, data not bytes) errs that one task if
        it is processing there; a report that names no usable key is ignored.
        """
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        if not isinstance(reports, _SEQUENCE):
            raise InvalidStimulus(f"task_finished: reports must be a list, not "
                                  f"{bounded_repr(reports)}")
        self._begin(stimulus_id)
        ws: WorkerState = self.workers.get(worker)
        if ws is None:
            return self._end()  # a worker already removed: its results are gone
        ts: TaskState
        report: dict
        for item in reports:
            if type(item) is not dict or "key" not in item:
                continue
            report = item
            key = report["key"]
            try:
                ts = self.tasks.get(key)
            except TypeError:
                continue  # unhashable: it names no task
            nbytes = report.get("nbytes", 0)
            type_name = report.get("type")
            data = report.get("data")
            problem = _finished_problem(nbytes, type_name, data)
            if ts is None:
                self._free_key(ws, key)
            elif ts.state_id == _S_PROCESSING and ts.processing_on is ws:
                if problem is None:
                    self._processing_memory(ts, ws, nbytes, type_name,
                                            _reported_duration(report), data)
                else:
                    self._free_key(ws, key)
                    ts.error = (None, None, f"invalid task-finished report from {worker} "
                                            f"for {bounded_repr(key)}: {problem}", ts.key)
                    self._transition(ts, _S_ERRED)
            elif ts.who_has is None or ws not in ts.who_has:
                # A stale result (the task moved on), or one it was never asked for: a
                # worker names only results it was told to compute.
                self._free_key(ws, key)
        return self._end()

    def task_erred(self, worker, reports, stimulus_id) -> tuple:
        """Tasks raised on a worker: each report is
        ``{"key", "exception", "traceback", "text"}`` (bytes, bytes, str; bytes may be
        None). Only reports of tasks processing on that worker count; one with a field
        of the wrong type errs its task with a text that says so (no retry)."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        if not isinstance(reports, _SEQUENCE):
            raise InvalidStimulus(f"task_erred: reports must be a list, not "
                                  f"{bounded_repr(reports)}")
        self._begin(stimulus_id)
        ws: WorkerState = self.workers.get(worker)
        if ws is None:
            return self._end()
        ts: TaskState
        report: dict
        for item in reports:
            if type(item) is not dict or "key" not in item:
                continue
            report = item
            key = report["key"]
            try:
                ts = self.tasks.get(key)
            except TypeError:
                continue
            if ts is None or ts.state_id != _S_PROCESSING or ts.processing_on is not ws:
                continue
            problem = _erred_problem(report)
            if problem is not None:
                ts.error = (None, None, f"invalid task-erred report from {worker} for "
                                        f"{bounded_repr(key)}: {problem}", ts.key)
                self._recs[ts] = _S_ERRED
            elif ts.retries > 0:
                ts.retries -= 1
                self._recs[ts] = _S_WAITING
            else:
                ts.error = (report.get("exception"), report.get("traceback"),
                            report.get("text") or "", ts.key)
                self._recs[ts] = _S_ERRED
        return self._end()

    def client_releases_keys(self, client, keys, stimulus_id) -> tuple:
        """A client no longer wants these keys (its futures were released). Keys it
        does not want, and unknown clients, are no-ops."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(client, "client")
        _check_keys(keys, "client_releases_keys")
        self._begin(stimulus_id)
        cs: ClientState = self.clients.get(client)
        ts: TaskState
        if cs is not None:
            for key in keys:
                ts = self.tasks.get(key)
                if ts is not None:
                    self._drop_want(ts, cs)
        return self._end()

    def client_desires_keys(self, client, keys, stimulus_id) -> tuple:
        """A client wants keys that already exist (e.g. a future it was handed)."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(client, "client")
        _check_keys(keys, "client_desires_keys")
        self._begin(stimulus_id)
        cs: ClientState = self._client(client)
        ts: TaskState
        gone = []
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None:
                gone.append(key)
            else:
                self._add_want(ts, cs)
        if gone:
            self._send_client(cs, {"op": "cancelled-keys", "keys": gone})
        return self._end()

    def cancel(self, client, keys, stimulus_id, force=False) -> tuple:
        """Stop wanting keys; with ``force`` for every client that wants them.

        Only keys the client wants (Unauthorized otherwise, nothing changed); unknown
        keys are reported cancelled."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(client, "client")
        _check_keys(keys, "cancel")
        if type(force) is not bool:
            raise InvalidStimulus(f"cancel: force must be a bool, not {bounded_repr(force)}")
        self._check_wanted(client, keys, "cancel")
        self._begin(stimulus_id)
        cs: ClientState = self._client(client)
        ts: TaskState
        other: ClientState
        told = {}
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None:
                told.setdefault(cs, []).append(key)
                continue
            if force and ts.who_wants is not None:
                wanting = list(ts.who_wants)
            else:
                wanting = [cs]
            for other in wanting:
                told.setdefault(other, []).append(key)
                self._drop_want(ts, other)
        for other, cancelled in told.items():
            self._send_client(other, {"op": "cancelled-keys", "keys": cancelled})
        return self._end()

    def retry(self, client, keys, stimulus_id) -> tuple:
        """Run erred tasks again, with the erred tasks they depend on.

        Only keys the client wants (Unauthorized otherwise); unknown keys are ignored."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(client, "client")
        _check_keys(keys, "retry")
        self._check_wanted(client, keys, "retry")
        self._begin(stimulus_id)
        ts: TaskState
        dep: TaskState
        stack = [self.tasks[k] for k in keys if k in self.tasks]
        roots = list(stack)
        while stack:
            ts = stack.pop()
            if ts.state_id != _S_ERRED:
                continue
            self._transition(ts, _S_RELEASED)
            for dep in ts.dependencies:
                stack.append(dep)
        for ts in roots:
            if ts.state_id == _S_RELEASED:
                self._recs[ts] = _S_WAITING
        return self._end()

    def missing_data(self, worker, key, errant_worker, stimulus_id) -> tuple:
        """``worker`` could not fetch ``key`` from ``errant_worker``: that worker no
        longer counts as a holder and is told to free the key.

        Only a worker that runs a task needing ``key`` (it was told to fetch it), or that
        was asked to copy it (``acquire_replicas``), may say so: anything else raises
        Unauthorized and changes nothing."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        _check_str(errant_worker, "errant_worker")
        _check_key(key, "missing_data")
        ts: TaskState = self.tasks.get(key)
        if not self._fetches(self.workers.get(worker), ts) \
                and not self._asked_to_acquire(self.workers.get(worker), key):
            raise Unauthorized(f"worker {bounded_repr(worker)} reported {bounded_repr(key)} "
                               "missing but runs no task that needs it and was not asked "
                               "to copy it")
        self._begin(stimulus_id)
        ws: WorkerState = self.workers.get(errant_worker)
        if ws is None:
            ws = self.departing.get(errant_worker)
        if ts is not None and ts.state_id == _S_MEMORY and ws is not None \
                and ts.who_has is not None and ws in ts.who_has:
            self._remove_holder(ts, ws)
            # No longer counted as a holder, it would keep its copy (if it has one)
            # forever: no later free-keys would name it.
            self._free_key(ws, ts.key)
            if ts.who_has is None:
                self._transition(ts, _S_RELEASED)
        return self._end()

    def reschedule(self, worker, key, stimulus_id) -> tuple:
        """A worker gives a task back (e.g. it could not fetch a dependency). Ignored
        unless the task is processing on that worker."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        _check_key(key, "reschedule")
        self._begin(stimulus_id)
        ts: TaskState = self.tasks.get(key)
        if ts is not None and ts.state_id == _S_PROCESSING and ts.processing_on is not None \
                and ts.processing_on.address == worker:
            self._recs[ts] = _S_WAITING
        return self._end()

    def task_seceded(self, worker, key, stimulus_id) -> tuple:
        """A task processing on ``worker`` gave its thread back to wait for other tasks
        (``secede``): it no longer counts against the worker's threads, so queued tasks
        (those it may be waiting for among them) can go there. Ignored unless the task
        is processing on that worker."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        _check_key(key, "task_seceded")
        self._begin(stimulus_id)
        ts: TaskState = self.tasks.get(key)
        ws: WorkerState
        if ts is not None and ts.state_id == _S_PROCESSING and ts.processing_on is not None \
                and ts.processing_on.address == worker:
            ws = ts.processing_on
            if ws.long_running is None:
                ws.long_running = set()
            if ts not in ws.long_running:
                ws.long_running.add(ts)
                ws.slots += 1
                if ws.status == WORKER_RUNNING and not self._saturated(ws):
                    self.idle[ws.address] = ws
        return self._end()

    def restart(self, stimulus_id, max_keys=None) -> tuple:
        """The cluster is being restarted: every client stops wanting every key, and every
        task is forgotten (results in memory, work in flight, errors).

        Each client that wanted keys is told ``{"op": "cancelled-keys", "keys": [...],
        "reason": RESTART_REASON}``; each worker is told to free what it runs or holds.
        Workers and clients stay registered (the server restarts the worker processes).
        ``max_keys`` (a positive int) does it in slices: this call drops at most that many
        wanted keys (and forgets what no longer needed); call again until ``tasks`` is
        empty. Without it, everything goes in one call."""
        _check_str(stimulus_id, "stimulus_id")
        if max_keys is not None and (type(max_keys) is not int
                                     or not 1 <= max_keys <= _INT64_MAX):
            raise InvalidStimulus(f"restart: max_keys must be a positive int or None, not "
                                  f"{bounded_repr(max_keys)}")
        self._begin(stimulus_id)
        cs: ClientState
        ts: TaskState
        budget: cython.Py_ssize_t = max_keys if max_keys is not None else _INT64_MAX
        self._forget_budget = -1  # a restart forgets all it drops (its slices: max_keys)
        for cs in self.clients.values():
            if budget <= 0:
                break
            if not cs.wants_what:
                continue
            wanted = _first_wanted(cs, budget)
            budget -= len(wanted)
            self._send_client(cs, {"op": "cancelled-keys", "keys": [ts.key for ts in wanted],
                                   "reason": RESTART_REASON})
            for ts in wanted:
                self._drop_want(ts, cs)
        self._recommend_forget_later(len(self._forget_later))
        self._engine()
        if self.validate and not any([cs.wants_what for cs in self.clients.values()]):
            _check(not self.tasks, f"{len(self.tasks)} tasks survived a restart, e.g. "
                                   f"{next(iter(self.tasks.values()), None)}")
        return self._end()

    def forget_more(self, stimulus_id) -> tuple:
        """Forget what earlier stimuli left to forget (`forget_backlog`).

        With ``forget_slice`` set, one stimulus forgets at most that many tasks; the rest
        of what nobody needs any more (the tasks of a released graph of a million) stays
        released, or in memory, or erred, until this forgets the next slice. Call it
        while ``forget_backlog`` is not 0. A task that became needed again meanwhile is
        kept."""
        _check_str(stimulus_id, "stimulus_id")
        self._begin(stimulus_id)
        self._recommend_forget_later(self.forget_slice if self.forget_slice > 0
                                     else len(self._forget_later))
        return self._end()

    @property
    def forget_backlog(self) -> int:
        """How many tasks wait to be forgotten by `forget_more` (0: nothing to do)."""
        return len(self._forget_later)

    @cython.cfunc
    def _recommend_forget_later(self, n: cython.Py_ssize_t) -> None:
        """Take up to ``n`` tasks off the forget backlog, oldest first, and recommend
        forgetting those that nobody needs (one needed again meanwhile is kept)."""
        ts: TaskState
        later: dict = self._forget_later
        if n >= len(later):
            taken = list(later)
            self._forget_later = {}
        else:
            taken = []
            for ts in later:
                if len(taken) >= n:
                    break
                taken.append(ts)
            for ts in taken:
                del later[ts]
        for ts in taken:
            if (ts.state_id != _S_FORGOTTEN and ts.who_wants is None
                    and ts.dependents is None and ts.n_waiters == 0):
                self._recs[ts] = _S_FORGOTTEN

    # ------------------------------------------------------------------ replicas, retirement
    #
    # The server moves results between workers (Client.retire_workers, replicate,
    # rebalance) with these: it asks a worker to copy keys (acquire_replicas), the worker
    # answers once per key (replicas_added: it holds the copy; replicas_failed: it could
    # not get one), and copies that are no longer wanted go (remove_replicas). A retiring
    # worker takes no new task (retire_worker, unretire_worker); it leaves through
    # remove_worker.

    def acquire_replicas(self, worker, keys, stimulus_id) -> tuple:
        """Ask ``worker`` to fetch a copy of each of ``keys`` from their holders.

        It is sent ``{"op": "acquire-replicas", "who_has": {key: [address, ...]},
        "stimulus_id"}`` and counts as a holder of a key only once it confirms
        (``replicas_added``). Refused (InvalidStimulus, nothing changed) unless
        ``worker`` is registered and running, and every key is in memory, not held by
        ``worker`` and not already asked of it."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        _check_keys(keys, "acquire_replicas")
        ws: WorkerState = self.workers.get(worker)
        ts: TaskState
        if ws is None or ws.status != WORKER_RUNNING:
            raise InvalidStimulus(f"acquire_replicas: {bounded_repr(worker)} is not a "
                                  "running worker")
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None or ts.state_id != _S_MEMORY:
                raise InvalidStimulus(f"acquire_replicas: {bounded_repr(key)} is not in memory")
            if ws in ts.who_has:
                raise InvalidStimulus(f"acquire_replicas: {worker} already holds "
                                      f"{bounded_repr(key)}")
            if ws.acquiring is not None and key in ws.acquiring:
                raise InvalidStimulus(f"acquire_replicas: {worker} was already asked for "
                                      f"{bounded_repr(key)}")
        self._begin(stimulus_id)
        who_has = {}
        for key in keys:
            ts = self.tasks[key]
            if ws.acquiring is None:
                ws.acquiring = {}
            ws.acquiring[key] = ts
            who_has[key] = [holder.address for holder in ts.who_has]
        if who_has:
            self._send_worker(ws, {"op": "acquire-replicas", "who_has": who_has,
                                   "stimulus_id": stimulus_id})
        return self._end()

    def replicas_added(self, worker, keys, stimulus_id) -> tuple:
        """``worker`` holds the copies it was asked for (its ``add-keys``): it counts as
        a holder of each key still in memory; a key that left memory meanwhile is freed
        there. Only keys it was asked to copy (Unauthorized otherwise, nothing changed);
        a worker no longer registered is ignored."""
        ws: WorkerState = self._answering_worker(worker, keys, stimulus_id, "replicas_added")
        self._begin(stimulus_id)
        ts: TaskState
        asked: TaskState
        if ws is not None:
            for key in keys:
                asked = ws.acquiring.pop(key, None)
                if asked is None:
                    continue  # named twice
                ts = self.tasks.get(key)
                if ts is asked and ts.state_id == _S_MEMORY:
                    self._add_holder(ts, ws, ts.nbytes)
                elif ts is None or (ts.processing_on is not ws
                                    and (ts.who_has is None or ws not in ts.who_has)):
                    self._free_key(ws, key)  # a copy nobody counts on: dropped
            if not ws.acquiring:
                ws.acquiring = None
        return self._end()

    def replicas_failed(self, worker, keys, stimulus_id) -> tuple:
        """``worker`` could not get copies of these keys (its ``acquire-failed``): the
        requests end, nothing else changes. Only keys it was asked to copy
        (Unauthorized otherwise); a worker no longer registered is ignored."""
        ws: WorkerState = self._answering_worker(worker, keys, stimulus_id, "replicas_failed")
        self._begin(stimulus_id)
        if ws is not None:
            for key in keys:
                ws.acquiring.pop(key, None)
            if not ws.acquiring:
                ws.acquiring = None
        return self._end()

    def remove_replicas(self, worker, keys, stimulus_id) -> tuple:
        """``worker`` no longer counts as a holder of these keys and is told to free them
        (a task there that needs one keeps its copy until it is done). Refused unless
        every key is in memory, held by ``worker`` and by at least one other worker: the
        last copy of a result is never dropped this way."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        _check_keys(keys, "remove_replicas")
        ws: WorkerState = self.workers.get(worker)
        ts: TaskState
        if ws is None:
            raise InvalidStimulus(f"remove_replicas: {bounded_repr(worker)} is not a "
                                  "registered worker")
        for key in dict.fromkeys(keys):
            ts = self.tasks.get(key)
            if ts is None or ts.state_id != _S_MEMORY or ws not in ts.who_has:
                raise InvalidStimulus(f"remove_replicas: {worker} holds no "
                                      f"{bounded_repr(key)}")
            if len(ts.who_has) < 2:
                raise InvalidStimulus(f"remove_replicas: {worker} holds the only copy of "
                                      f"{bounded_repr(key)}")
        self._begin(stimulus_id)
        for key in dict.fromkeys(keys):
            ts = self.tasks[key]
            self._remove_holder(ts, ws)
            self._free_key(ws, key)
        return self._end()

    def retire_worker(self, worker, stimulus_id) -> tuple:
        """``worker`` is being retired: it takes no new task (tasks it runs go on, and
        its results stay until they are copied or it leaves). Refused unless it is a
        running worker."""
        ws: WorkerState = self._worker_in(worker, WORKER_RUNNING, stimulus_id, "retire_worker")
        self._begin(stimulus_id)
        ws.status = WORKER_RETIRING
        self.idle.pop(worker, None)
        self._return_run(ws)
        return self._end()

    def unretire_worker(self, worker, stimulus_id) -> tuple:
        """A retirement was given up: ``worker`` takes tasks again. Refused unless it is
        retiring."""
        ws: WorkerState = self._worker_in(worker, WORKER_RETIRING, stimulus_id,
                                          "unretire_worker")
        self._begin(stimulus_id)
        ws.status = WORKER_RUNNING
        if not self._saturated(ws):
            self.idle[worker] = ws
        ts: TaskState
        for ts in self.unrunnable:
            self._recs[ts] = _S_PROCESSING
        return self._end()

    @cython.cfunc
    def _worker_in(self, worker, status: str, stimulus_id, what: str) -> WorkerState:
        """The registered worker ``worker`` in ``status``, or InvalidStimulus."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        ws: WorkerState = self.workers.get(worker)
        if ws is None or ws.status != status:
            raise InvalidStimulus(f"{what}: {bounded_repr(worker)} is not a {status} worker")
        return ws

    @cython.cfunc
    def _answering_worker(self, worker, keys, stimulus_id, what: str) -> object:
        """The checks of a worker's answer to acquire-replicas: its WorkerState (None if
        it is not registered: then the answer is ignored), or Unauthorized if it names
        a key it was not asked to copy."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        _check_keys(keys, what)
        ws: WorkerState = self.workers.get(worker)
        if ws is None:
            return None
        refused = [key for key in keys if ws.acquiring is None or key not in ws.acquiring]
        if refused:
            raise Unauthorized(f"{what}: worker {bounded_repr(worker)} was not asked to copy "
                               f"{_some(refused)}")
        return ws

    # ------------------------------------------------------------------ plans for moving results
    #
    # Where results should go when the server moves them (Client.retire_workers, replicate,
    # rebalance): queries that read the state and never change it, so they take no
    # stimulus id. Plain data in and out (addresses, keys); the server carries the plans
    # out with the stimuli above, one operation at a time. Each costs O(keys asked +
    # workers), plus the results held by the workers whose results it looks through.
    #
    # Every choice is by the bytes the scheduler counts (``WorkerState.nbytes``: the sizes
    # of the results a worker holds, as reported), not by process memory: deterministic,
    # and the same figure the scheduler places tasks by.

    def workers_to_retire(self, workers, n) -> tuple:
        """The workers a retirement takes: ``(addresses, unknown)``.

        ``workers`` (addresses or names, or None) name them: each is taken once, in the
        order given, if it is running; ``unknown`` lists the names that match no
        registered worker. Without ``workers``, the ``n`` running workers holding the
        fewest bytes (then running the fewest tasks; ``n`` None: all of them)."""
        ws: WorkerState
        if workers is not None:
            by_name = {ws.name: address for address, ws in self.workers.items()}
            chosen = {}
            unknown = []
            for worker in workers:
                address = worker if worker in self.workers else by_name.get(worker)
                if address is None:
                    unknown.append(worker)
                else:
                    chosen[address] = None
            running = []
            for address in chosen:
                ws = self.workers[address]
                if ws.status == WORKER_RUNNING:
                    running.append(address)
            return running, unknown
        running = [(ws.nbytes, len(ws.processing), ws.address)
                   for ws in self.workers.values() if ws.status == WORKER_RUNNING]
        running.sort()
        if n is not None:
            running = running[:n]
        return [entry[2] for entry in running], []

    # ------------------------------------------------------------------ adaptive scaling
    #
    # How many workers the work wants, and which to let go: read from the counters (per
    # prefix and per worker), never by a walk over the tasks, so each costs
    # O(prefixes + workers) however many tasks there are. Cluster managers (adapt, the
    # Kubernetes operator) ask; the server carries the answer out by retirement.

    def adaptive_target(self, target_duration=5.0) -> int:
        """The number of workers the work wants now.

        CPU: the estimated seconds of the tasks queued, unrunnable and processing (each
        priced at its prefix's learned average, ``default_duration`` while unknown),
        spread over workers of the running workers' threads (1 without workers) so
        that they finish within ``target_duration`` seconds, and no more workers than
        those tasks could keep busy. Memory: enough workers to keep the results held
        under 60% of their average ``memory_limit`` (when the workers have limits; at
        most twice the workers running), and at least 1 while any result is held. At
        least 1 while any task waits to run. Shrinking never counts out a worker that
        is running tasks: the answer is at least the number of busy running workers."""
        if type(target_duration) not in (int, float) \
                or not _MIN_TARGET_DURATION <= target_duration <= _MAX_TARGET_DURATION:
            raise ValueError(f"target_duration must be a number of seconds from "
                             f"{_MIN_TARGET_DURATION} to {_MAX_TARGET_DURATION:g}, not "
                             f"{bounded_repr(target_duration)}")
        prefix: TaskPrefix
        ws: WorkerState
        work: cython.double = 0.0
        runnable: cython.Py_ssize_t = 0
        n: cython.Py_ssize_t
        for prefix in self._active_prefixes.values():
            n = (prefix.counts[_S_QUEUED] + prefix.counts[_S_NO_WORKER]
                 + prefix.counts[_S_PROCESSING])
            if n:
                runnable += n
                work += n * (prefix.duration_average if prefix.duration_average >= 0
                             else self.default_duration)
        running: cython.Py_ssize_t = 0
        busy: cython.Py_ssize_t = 0
        threads: cython.Py_ssize_t = 0
        limited: cython.Py_ssize_t = 0
        limits: cython.double = 0.0
        held: cython.double = 0.0  # by the workers with a limit
        held_anywhere: cython.bint = False
        for ws in self.workers.values():
            if ws.status != WORKER_RUNNING:
                continue
            running += 1
            threads += ws.nthreads
            if ws.processing:
                busy += 1
            if ws.has_what:
                held_anywhere = True
            if ws.memory_limit > 0:
                limited += 1
                limits += ws.memory_limit
                held += ws.nbytes
        per_worker: cython.double = threads / running if running else 1.0
        cpu: cython.Py_ssize_t = 0
        if runnable:
            cpu = min(math.ceil(work / target_duration / per_worker),
                      math.ceil(runnable / per_worker))
        memory: cython.Py_ssize_t = 0
        if limited and held > 0:  # (at most twice the workers: as dask, one step at a time)
            memory = min(math.ceil(held / (_ADAPT_MEMORY_FRACTION * limits / limited)),
                         2 * max(running, 1))
        if held_anywhere:  # results held need a worker to live on, limit or not
            memory = max(memory, 1)
        pending: cython.Py_ssize_t = (self._state_counts[_S_WAITING] + runnable)
        target: cython.Py_ssize_t = max(cpu, memory, 1 if pending else 0)
        if target < running:
            target = max(target, busy)
        return target

    def workers_to_close(self, n) -> list:
        """The addresses of the ``n`` running workers (an int >= 0) that are best let go:
        those running no task first, holding the fewest bytes, then idle the longest;
        then busy ones, holding the fewest bytes, then with the least work assigned.
        Fewer if fewer are running."""
        if type(n) is not int or n < 0:
            raise ValueError(f"n must be an int >= 0, not {bounded_repr(n)}")
        ws: WorkerState
        idle = []
        busy = []
        for ws in self.workers.values():
            if ws.status != WORKER_RUNNING:
                continue
            if ws.processing:
                busy.append((ws.nbytes, ws.occupancy, ws.address))
            else:
                idle.append((ws.nbytes, ws.idle_since, ws.address))
        idle.sort()
        out = [entry[2] for entry in idle[:n]]
        if len(out) < n:
            busy.sort()
            out.extend(entry[2] for entry in busy[:n - len(out)])
        return out

    def check_idle(self):
        """The clock's time since when no task has been waiting, queued, unrunnable or
        processing (None while some is): a cluster idle that long may be shut down."""
        if self._has_work():
            return None
        # a stimulus that raised (a bug, logged) may have skipped _end's update
        return self._idle_since if self._idle_since >= 0 else self._now

    @cython.cfunc
    def _has_work(self) -> cython.bint:
        """Some task is waiting, queued, unrunnable or processing."""
        return (self._state_counts[_S_WAITING] + self._state_counts[_S_QUEUED]
                + self._state_counts[_S_NO_WORKER] + self._state_counts[_S_PROCESSING]) > 0

    def copy_recipients(self, workers=None, exclude=(), paused=()) -> list:
        """The addresses of the workers that may take copies: running ones, neither in
        ``exclude`` nor in ``paused`` (addresses), and, if ``workers`` (addresses or names)
        is given, among those; in the order they joined."""
        ws: WorkerState
        names = None if workers is None else set(workers)
        exclude = set(exclude)
        paused = set(paused)
        return [address for address, ws in self.workers.items()
                if ws.status == WORKER_RUNNING and address not in exclude
                and address not in paused
                and (names is None or address in names or ws.name in names)]

    def registered(self, addresses) -> list:
        """Those of ``addresses`` that are registered workers, in the order given."""
        return [address for address in addresses if address in self.workers]

    def results_held(self, worker) -> list:
        """The keys of the results ``worker`` holds, in the order it came to hold them
        (none if it is not registered)."""
        ws: WorkerState = self.workers.get(worker)
        ts: TaskState
        if ws is None:
            return []
        return [ts.key for ts in ws.has_what]

    def keys_not_in_memory(self, keys) -> list:
        """Those of ``keys`` (hashable) whose result is not in memory, in the order given."""
        ts: TaskState
        out = []
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None or ts.state_id != _S_MEMORY:
                out.append(key)
        return out

    def keys_not_wanted(self, client, keys) -> list:
        """Those of ``keys`` (hashable) that the scheduler knows and ``client`` does not
        want: keys a client may not act on (unknown keys are not its business either way)."""
        ts: TaskState
        cs: ClientState = self.clients.get(client)
        out = []
        for key in keys:
            ts = self.tasks.get(key)
            if ts is not None and not _wants(ts, cs):
                out.append(key)
        return out

    def retirement_plan(self, leaving, recipients, tried) -> tuple:
        """Where the results that only the ``leaving`` workers hold should go:
        ``(plan, stuck)``.

        ``leaving`` and ``recipients`` are addresses (those no longer registered are left
        out), ``tried`` is ``{key: set of addresses that failed to copy it}``. A result no
        worker outside ``leaving`` holds is listed once, under the first of ``leaving``
        that holds it; each sender's results go largest first, each to the recipient
        holding the fewest bytes (counting what this plan gives it; then by address) that
        neither holds it nor failed it. ``plan`` is ``{recipient address: [key, ...]}``,
        ``stuck`` ``{sender address: [key, ...]}`` for results with no recipient left
        (none at all, or `MAX_RECIPIENTS_PER_KEY` failed). Both empty: nothing is left
        that only ``leaving`` workers hold."""
        ws: WorkerState
        ts: TaskState
        holder: WorkerState
        senders = [self.workers[address] for address in leaving if address in self.workers]
        gone = set(senders)
        # (bytes, address, WorkerState): addresses are unique, so a WorkerState is never
        # compared
        load = [(ws.nbytes, ws.address, ws)
                for ws in [self.workers.get(address) for address in recipients]
                if ws is not None]
        heapq.heapify(load)
        seen = set()
        plan = {}
        stuck = {}
        for ws in senders:
            mine = []
            for ts in ws.has_what:
                if ts in seen:
                    continue
                for holder in ts.who_has:
                    if holder not in gone:
                        break
                else:
                    seen.add(ts)
                    mine.append((-ts.nbytes, len(mine), ts))
            mine.sort()  # largest first; equal sizes in the order it came to hold them
            for entry in mine:
                ts = entry[2]
                failed = tried.get(ts.key, ())
                if len(failed) >= MAX_RECIPIENTS_PER_KEY:
                    stuck.setdefault(ws.address, []).append(ts.key)
                    continue
                best = self._least_loaded(load, ts, failed, 1)
                if not best:
                    stuck.setdefault(ws.address, []).append(ts.key)
                    continue
                plan.setdefault(best[0][1], []).append(ts.key)
                self._load_back(load, best, ts)
        return plan, stuck

    def replication(self, keys, pool, n, branching_factor, tried) -> dict:
        """One round of copies toward ``n`` holders of each key within ``pool``:
        ``{recipient address: [key, ...]}``.

        ``pool`` is a list of addresses (those no longer registered are left out),
        ``tried`` ``{key: set of addresses that failed to copy it}``; keys not in memory
        are left out. A key with fewer than ``n`` holders in the pool gets at most
        ``branching_factor`` new copies per holder it has (a tree: the copies of one round
        are sources in the next), on the pool's workers holding the fewest bytes
        (counting what this plan gives them; then by address) that do not hold it and have
        not failed it."""
        ws: WorkerState
        ts: TaskState
        members = {}  # WorkerState -> None
        for address in pool:
            ws = self.workers.get(address)
            if ws is not None:
                members[ws] = None
        load = [(ws.nbytes, ws.address, ws) for ws in members]
        heapq.heapify(load)
        plan = {}
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None or ts.state_id != _S_MEMORY:
                continue
            missing: cython.Py_ssize_t = n
            for ws in ts.who_has:
                if ws in members:
                    missing -= 1
            if missing <= 0:
                continue
            best = self._least_loaded(load, ts, tried.get(key, ()),
                                      min(missing, branching_factor * len(ts.who_has)))
            for entry in best:
                plan.setdefault(entry[1], []).append(key)
            self._load_back(load, best, ts)
        return plan

    def surplus_holders(self, keys, pool, n) -> dict:
        """The copies past ``n`` (>= 1) within ``pool`` (addresses) to drop: ``{address:
        [key, ...]}``, from the holders with the most bytes (then by address); never a
        key's last copy. Keys unknown or held by no worker are left out; the state of
        the others is not checked: callers first check that every key is in memory
        (`keys_not_in_memory`)."""
        ws: WorkerState
        ts: TaskState
        members = set(pool)
        drop = {}
        for key in keys:
            ts = self.tasks.get(key)
            if ts is None or ts.who_has is None:
                continue
            holders = sorted([(-ws.nbytes, ws.address) for ws in ts.who_has
                              if ws.address in members])
            for entry in holders[:max(len(holders) - n, 0)]:
                drop.setdefault(entry[1], []).append(key)
        return drop

    def rebalance_moves(self, pool, keys=None) -> list:
        """``[(sender address, recipient address, key), ...]``: moves that bring every
        worker of ``pool`` (addresses; those no longer registered are left out) toward
        the mean of the bytes they hold.

        Workers more than `REBALANCE_HALF_GAP` of the mean above it send, those as far
        below it receive. Repeatedly the sender farthest above the mean gives its largest
        result that takes neither it more than that gap below the mean nor its recipient
        more than the gap above it, to the recipient farthest below the mean that does
        not hold it already (so replication never drops). Both stop once within the gap
        of the mean. Only ``keys``, if given. A simplification of dask's rebalance, which
        measures process memory and takes the least recently inserted result first."""
        ws: WorkerState
        ts: TaskState
        members = [ws for ws in [self.workers.get(address) for address in pool]
                   if ws is not None]
        if not members:
            return []
        wanted = None if keys is None else set(keys)
        mean = sum([ws.nbytes for ws in members]) // len(members)
        half_gap = int(REBALANCE_HALF_GAP * mean)
        senders = []  # (-bytes it may still give, address, ws, its results largest first)
        recipients = []  # (-bytes it may still take, address, ws)
        for ws in members:
            if ws.nbytes >= mean + half_gap and ws.nbytes > mean and ws.has_what:
                ranked = sorted([(-ts.nbytes, i, ts) for i, ts in enumerate(ws.has_what)
                                 if wanted is None or ts.key in wanted])
                senders.append((mean - ws.nbytes, ws.address, ws,
                                [entry[2] for entry in ranked]))
            elif ws.nbytes < mean - half_gap:
                recipients.append((ws.nbytes - mean, ws.address, ws))
        heapq.heapify(senders)
        heapq.heapify(recipients)
        moves = []
        recipient: WorkerState
        while senders and recipients:
            give, address, sender, tasks = senders[0]
            moved = None
            for i, ts in enumerate(tasks):
                if ts.nbytes + give > half_gap:
                    continue  # it would take the sender too far below the mean
                skipped = []
                while recipients and moved is None:
                    take, _, recipient = recipients[0]
                    if ts.nbytes + take > half_gap:
                        break  # the neediest recipient cannot take it: none can
                    heapq.heappop(recipients)
                    if recipient in ts.who_has:
                        skipped.append((take, recipient.address, recipient))
                    else:
                        moved = (i, recipient, take)
                for entry in skipped:
                    heapq.heappush(recipients, entry)
                if moved is not None:
                    break
            if moved is None:
                heapq.heappop(senders)  # nothing more it can give
                continue
            i, recipient, take = moved
            ts = tasks.pop(i)
            moves.append((address, recipient.address, ts.key))
            give += ts.nbytes
            take += ts.nbytes
            if give + half_gap < 0 and tasks:
                heapq.heapreplace(senders, (give, address, sender, tasks))
            else:
                heapq.heappop(senders)
            if take + half_gap < 0:
                heapq.heappush(recipients, (take, recipient.address, recipient))
        return moves

    def holders_short(self, keys, pool, n) -> list:
        """Those of ``keys`` held by fewer than ``n`` of the workers of ``pool``
        (addresses), unknown keys included, in the order given."""
        ws: WorkerState
        ts: TaskState
        members = set(pool)
        out = []
        for key in keys:
            ts = self.tasks.get(key)
            held: cython.Py_ssize_t = 0
            if ts is not None and ts.who_has is not None:
                for ws in ts.who_has:
                    if ws.address in members:
                        held += 1
            if ts is None or held < n:
                out.append(key)
        return out

    def droppable(self, worker, keys) -> list:
        """Those of ``keys`` whose result ``worker`` still holds along with another
        worker: the copies `remove_replicas` would drop now."""
        ws: WorkerState = self.workers.get(worker)
        ts: TaskState
        if ws is None:
            return []
        out = []
        for key in keys:
            ts = self.tasks.get(key)
            if ts is not None and ts.who_has is not None and ws in ts.who_has \
                    and len(ts.who_has) > 1:
                out.append(key)
        return out

    def copies_pending(self, copies) -> bool:
        """Whether any of ``copies`` (``(address, key)`` pairs asked with
        `acquire_replicas`) is still unanswered by a registered worker."""
        ws: WorkerState
        for address, key in copies:
            ws = self.workers.get(address)
            if ws is not None and ws.acquiring is not None and key in ws.acquiring:
                return True
        return False

    def copies_held(self, copies) -> list:
        """Those of ``copies`` (``(address, key)`` pairs) whose worker is registered and
        counts as a holder of the key's result."""
        ws: WorkerState
        ts: TaskState
        out = []
        for address, key in copies:
            ws = self.workers.get(address)
            ts = self.tasks.get(key)
            if ws is not None and ts is not None and ts.who_has is not None \
                    and ws in ts.who_has:
                out.append((address, key))
        return out

    @cython.cfunc
    def _least_loaded(self, load: list, ts: TaskState, failed, k: cython.Py_ssize_t) -> list:
        """The ``k`` (at most) entries of the heap ``load`` (``(bytes, address,
        WorkerState)``) with the fewest bytes, then the lowest address, whose worker
        neither holds ``ts`` nor is in ``failed`` (addresses), taken off the heap (the
        others stay). Only workers it passes over or takes cost a step each."""
        best = []
        skipped = []
        while load and len(best) < k:
            entry = heapq.heappop(load)
            if entry[1] in failed or entry[2] in ts.who_has:
                skipped.append(entry)
            else:
                best.append(entry)
        for entry in skipped:
            heapq.heappush(load, entry)
        return best

    @cython.cfunc
    def _load_back(self, load: list, taken: list, ts: TaskState) -> None:
        """Put the entries `_least_loaded` took back on the heap, each counting ``ts``'s
        result as one more it holds."""
        nbytes: cython.Py_ssize_t = max(ts.nbytes, 0)
        for entry in taken:
            heapq.heappush(load, (entry[0] + nbytes, entry[1], entry[2]))

    # ------------------------------------------------------------------ work stealing
    #
    # balance() moves tasks that wait behind others on a busy worker (the victim) to a
    # worker with room (the thief); the server calls it periodically and when a worker
    # joins. Only the victim knows whether it began a task, so it is asked first
    # (steal-request {key, request}); until it answers, the task stays processing on the
    # victim, and steal_response() enacts the answer: a task given back goes to the thief
    # (or through waiting when the thief is gone or can no longer take it), a refused one
    # stays and is not asked for again while it runs there. A task is processing on
    # exactly one worker at all times, runs at most once per assignment, and a task given
    # back is never lost: its record leaves _steals only when the answer comes or the task
    # leaves processing on the victim (then the answer is stale, and ignored).

    def balance(self, stimulus_id) -> tuple:
        """Work stealing: ask busy workers to give back tasks they have not begun, for
        workers with room (a worker that just joined, one whose tasks turned out short).

        A victim is a worker with more tasks than `_victim_floor`: its threads plus its
        seceded tasks, plus what the queue's saturation gives it beyond its threads;
        a thief a running worker with a free thread or less than half the mean work per
        thread. Each victim, most loaded first, offers its least urgent tasks beyond
        one per thread (those it runs last; of a sample of ``_STEAL_SCAN`` tasks when it
        has more); one moves to the thief where it would start
        soonest (its work per thread plus the transfer of the inputs it lacks at
        ``steal_bandwidth``, plus ``steal_latency``) if it starts there before it would
        on the victim: ``thief load + (estimate + cost) / thief threads <= victim load -
        estimate / (2 * victim threads)`` (as dask's stealing). Tasks with worker or
        resource restrictions, seceded tasks and tasks whose worker refused once stay.
        The victim is sent ``{"op": "steal-request", "key", "request": int,
        "stimulus_id"}`` and answers with ``steal_response``. Without a victim and a
        thief, or while tasks are queued in the scheduler (the queue feeds workers with
        room), this returns at once and is not counted as a stimulus."""
        _check_str(stimulus_id, "stimulus_id")
        if len(self.workers) < 2 or not self._may_steal():
            return ({}, {})
        self._begin(stimulus_id)
        self._balance()
        return self._end()

    def steal_response(self, worker, key, request, given, stimulus_id) -> tuple:
        """A worker answers a steal request: ``given`` True, it gave the task back
        without beginning it (the task goes to the thief); False, it keeps it. Answers
        that match no pending request of that worker (stale: the task moved on meanwhile,
        or not the worker's business) change nothing."""
        return self.steal_responses(worker, [(key, request, given)], stimulus_id)

    def steal_responses(self, worker, answers, stimulus_id) -> tuple:
        """Several answers of one worker, ``[(key, request, given), ...]``, as one
        stimulus (a victim answers a balance's requests together). Every answer is
        checked before any is applied: one bad answer refuses them all."""
        _check_str(stimulus_id, "stimulus_id")
        _check_str(worker, "worker")
        if type(answers) is not list:
            raise InvalidStimulus(f"steal_responses: answers must be a list, not "
                                  f"{bounded_repr(answers)}")
        for answer in answers:
            if type(answer) is not tuple or len(answer) != 3:
                raise InvalidStimulus(f"steal_responses: an answer must be (key, request, "
                                      f"given), not {bounded_repr(answer)}")
            _check_key(answer[0], "steal_response")
            if type(answer[1]) is not int:
                raise InvalidStimulus(f"steal_response: request must be an int, not "
                                      f"{bounded_repr(answer[1])}")
            if type(answer[2]) is not bool:
                raise InvalidStimulus(f"steal_response: given must be a bool, not "
                                      f"{bounded_repr(answer[2])}")
        self._begin(stimulus_id)
        for key, request, given in answers:
            ts: TaskState = self.tasks.get(key)
            if ts is not None and ts.processing_on is not None \
                    and ts.processing_on.address == worker:
                record = self._steals.get(ts)
                if record is not None and record[1] == request:
                    del self._steals[ts]
                    if given:
                        self._steal_given(ts, record[0])
                    else:
                        self._steal_refused[ts] = None
        return self._end()

    def steal_counts(self) -> dict:
        """Work stealing so far: ``requests`` sent, ``moved`` (given back and placed
        again), ``in_flight`` (asked, not answered), ``refused_running`` (tasks whose
        worker refused, still processing there)."""
        return {"requests": self.steal_requests, "moved": self.steals_done,
                "in_flight": len(self._steals), "refused_running": len(self._steal_refused)}

    def balance_wanted(self, worker=None) -> bool:
        """Whether a `balance` is worth calling now: two workers or more are registered
        and, given ``worker`` (an address that just reported finished tasks), it is
        registered and has room with nothing waiting there (no more tasks than threads),
        so it should not wait for the next periodic balance. A read: no stimulus."""
        ws: WorkerState
        if len(self.workers) < 2:
            return False
        if worker is None:
            return True
        ws = self.workers.get(worker)
        return ws is not None and len(ws.processing) <= ws.nthreads

    @cython.cfunc
    def _spare(self, ws: WorkerState) -> cython.Py_ssize_t:
        """Tasks ``ws`` runs at once: one a thread, plus its seceded tasks."""
        if ws.long_running is None:
            return ws.nthreads
        return ws.nthreads + len(ws.long_running)

    @cython.cfunc
    def _victim_floor(self, ws: WorkerState) -> cython.Py_ssize_t:
        """Tasks ``ws`` may hold before it counts as a victim: its `_spare`, plus what
        the queue's saturation gives every worker beyond its threads (queued tasks are
        balanced by the queue itself; stealing them between equally busy workers only
        moves them back and forth)."""
        spare: cython.Py_ssize_t = self._spare(ws)
        # slots count the seceded tasks too (one more each), as `_spare` does
        if ws.slots < _UNLIMITED_SLOTS and ws.slots > spare:
            return ws.slots
        return spare

    @cython.cfunc
    def _may_steal(self) -> cython.bint:
        """Whether some worker has tasks waiting behind its threads while a running one
        has a free thread or none waiting: the cheap test before any balancing."""
        ws: WorkerState
        victim: cython.bint = False
        thief: cython.bint = False
        if self.n_queued > 0:
            return False  # the queue feeds every worker with room: nobody waits for work
        for ws in self.workers.values():
            n: cython.Py_ssize_t = len(ws.processing)
            if n > self._victim_floor(ws):
                victim = True
            elif ws.status == WORKER_RUNNING:
                thief = True
        return victim and thief

    @cython.cfunc
    def _balance(self) -> None:
        ws: WorkerState
        ts: TaskState
        thief: WorkerState
        load = {}  # WorkerState -> estimated seconds of work, steals in flight moved
        count = {}  # WorkerState -> tasks, steals in flight moved
        for ws in self.workers.values():
            load[ws] = ws.occupancy
            count[ws] = len(ws.processing)
        for ts, record in self._steals.items():
            ws = ts.processing_on
            load[ws] -= ts.estimate
            count[ws] -= 1
            if record[0] is not None:
                thief = record[0]
                load[thief] += ts.estimate
                count[thief] += 1
        mean: cython.double = sum(load.values()) / max(self.total_nthreads, 1)
        victims = []
        thieves = []
        for ws in self.workers.values():
            if count[ws] > self._victim_floor(ws):
                victims.append((load[ws] / ws.nthreads, ws.address, ws))
            elif ws.status == WORKER_RUNNING and (count[ws] < self._spare(ws)
                                                  or load[ws] / ws.nthreads < mean / 2):
                thieves.append(ws)
        if not victims or not thieves:
            return
        victims.sort(reverse=True)
        order = [(load[ws] / ws.nthreads, i, ws) for i, ws in enumerate(thieves)]
        order.sort()
        thieves = [entry[2] for entry in order]  # the least loaded first
        thief_set = set(thieves)
        for entry in victims:
            ws = entry[2]
            extra: cython.Py_ssize_t = count[ws] - self._victim_floor(ws)
            candidates = []
            for ts in ws.processing:
                if ts in self._steals or ts in self._steal_refused or (
                        ts.options is not None and ts.options.restricted) or (
                        ws.long_running is not None and ts in ws.long_running):
                    continue
                candidates.append(ts)
                if len(candidates) >= _STEAL_SCAN:
                    break  # a bounded look at a huge backlog: the least urgent of these
            for ts in heapq.nlargest(extra, candidates, key=_priority_of):
                self._steal_one(ts, ws, thieves, thief_set, load)

    @cython.cfunc
    def _steal_one(self, ts: TaskState, victim: WorkerState, thieves: list,
                   thief_set: set, load: dict) -> None:
        """Ask ``victim`` for ``ts`` if some thief would start it sooner: of the
        `_STEAL_THIEVES` least loaded when the balance began (``thieves`` is in that
        order) and the thieves that hold some of its inputs, the one where it would
        start soonest."""
        thief: WorkerState
        dep: TaskState
        best: WorkerState = None
        best_start: cython.double = 0.0
        best_cost: cython.double = 0.0
        weighed = thieves[:_STEAL_THIEVES]
        for dep in ts.dependencies:
            if dep.who_has is not None:
                for thief in dep.who_has:
                    if thief in thief_set and thief not in weighed:
                        weighed.append(thief)
        for thief in weighed:
            if not self._worker_fits(thief, ts, True):
                continue
            cost: cython.double = self._move_cost(ts, thief)
            start: cython.double = (load[thief] + cost) / thief.nthreads
            if best is None or start < best_start:
                best, best_start, best_cost = thief, start, cost
        if best is None:
            return
        estimate: cython.double = ts.estimate
        if best_start + estimate / best.nthreads \
                > load[victim] / victim.nthreads - estimate / (2 * victim.nthreads):
            return
        load[victim] -= estimate
        load[best] += estimate + best_cost
        self.steal_requests += 1
        self._steals[ts] = [best, self.steal_requests]
        self._send_worker(victim, {"op": "steal-request", "key": ts.key,
                                   "request": self.steal_requests,
                                   "stimulus_id": self._stimulus_id})

    @cython.cfunc
    def _move_cost(self, ts: TaskState, thief: WorkerState) -> cython.double:
        """Seconds moving ``ts`` to ``thief`` costs: the inputs it lacks, and latency."""
        dep: TaskState
        nbytes: cython.Py_ssize_t = 0
        for dep in ts.dependencies:
            if dep.who_has is None or thief not in dep.who_has:
                nbytes += max(dep.nbytes, 0)
        return nbytes / self.steal_bandwidth + self.steal_latency

    @cython.cfunc
    def _steal_given(self, ts: TaskState, thief: Optional[WorkerState]) -> None:
        """The victim gave ``ts`` back: it goes to the thief if the thief can still
        take it, else through waiting to wherever fits now."""
        if thief is None or thief.status != WORKER_RUNNING \
                or self.workers.get(thief.address) is not thief \
                or (self.departing and ts.dependencies):
            self._transition(ts, _S_WAITING)
            return
        self._unassign(ts)
        self._assign(ts, thief)
        self.steals_done += 1
        if self.validate:
            self._validate_task(ts)

    @cython.cfunc
    def _thief_gone(self, ws: WorkerState) -> None:
        """``ws`` left: steals meant for it are void, but their tasks still wait for
        the victims' answers (a task given back is then placed anew)."""
        for record in self._steals.values():
            if record[0] is ws:
                record[0] = None

    @cython.cfunc
    def _validate_steals(self) -> None:
        ts: TaskState
        ws: WorkerState
        n_listed: cython.Py_ssize_t = 0
        n_processing: cython.Py_ssize_t = 0
        for ws in self.workers.values():
            n_listed += len(ws.processing)
        for ts in self.tasks.values():
            if ts.state_id == _S_PROCESSING:
                n_processing += 1
        # with "listed on ws => processing on ws": each task is on exactly one worker
        _check(n_listed == n_processing, f"{n_listed} tasks listed as processing on "
                                         f"workers, {n_processing} are processing")
        requests = set()
        for ts, record in self._steals.items():
            _check(self.tasks.get(ts.key) is ts and ts.state_id == _S_PROCESSING
                   and ts.processing_on is not None,
                   f"a steal of {ts} is in flight but it is not processing")
            _check(type(record) is list and len(record) == 2
                   and type(record[1]) is int and 0 < record[1] <= self.steal_requests
                   and record[1] not in requests, f"steal record {record!r} of {ts}")
            requests.add(record[1])
            thief = record[0]
            if thief is not None:
                ws = thief
                _check(ws is not ts.processing_on and self.workers.get(ws.address) is ws,
                       f"the thief {ws} of {ts} is its victim or not registered")
            _check(ts not in self._steal_refused, f"{ts} is refused and asked again")
        for ts in self._steal_refused:
            _check(self.tasks.get(ts.key) is ts and ts.state_id == _S_PROCESSING,
                   f"{ts} was refused to a thief but is not processing")

    # ------------------------------------------------------------------ authorization

    def check_cancel(self, client, keys, force=False) -> None:
        """Raise what ``cancel(client, keys, ..., force)`` would refuse with (InvalidStimulus
        or Unauthorized), else nothing; changes nothing. A server that cancels a huge list
        in slices checks it whole first, so a bad key refuses all of it."""
        _check_str(client, "client")
        _check_keys(keys, "cancel")
        if type(force) is not bool:
            raise InvalidStimulus(f"cancel: force must be a bool, not {bounded_repr(force)}")
        self._check_wanted(client, keys, "cancel")

    @cython.cfunc
    def _check_wanted(self, client, keys, what: str) -> None:
        """Unauthorized unless ``client`` wants every key of ``keys`` that exists."""
        cs: ClientState = self.clients.get(client)
        ts: TaskState
        refused = []
        for key in keys:
            ts = self.tasks.get(key)
            if ts is not None and not _wants(ts, cs):
                refused.append(key)
        if refused:
            raise Unauthorized(f"{what}: client {bounded_repr(client)} does not want "
                               f"{_some(refused)}")

    @cython.cfunc
    def _asked_to_acquire(self, ws: Optional[WorkerState], key) -> cython.bint:
        """Whether ``ws`` was asked to copy ``key`` and has not answered yet."""
        return ws is not None and ws.acquiring is not None and key in ws.acquiring

    @cython.cfunc
    def _fetches(self, ws: Optional[WorkerState], ts: Optional[TaskState]) -> cython.bint:
        """Whether ``ws`` runs a task that needs the result of ``ts``."""
        dts: TaskState
        if ws is None or ts is None or ts.dependents is None:
            return False
        if type(ts.dependents) is tuple or len(ts.dependents) <= len(ws.processing):
            for dts in ts.dependents:
                if dts.processing_on is ws:
                    return True
            return False
        for dts in ws.processing:
            if ts in dts.dependencies:
                return True
        return False

    # ------------------------------------------------------------------ queries

    def who_has(self, keys) -> dict:
        """``{key: [worker address, ...]}`` for the given keys that are in memory.

        ``keys``: a list or tuple of hashable keys, or InvalidStimulus."""
        _check_keys(keys, "who_has")
        out = {}
        ts: TaskState
        for key in keys:
            ts = self.tasks.get(key)
            if ts is not None and ts.who_has is not None:
                out[key] = _holder_addresses(ts)
        return out

    @property
    def transition_log(self) -> list:
        """The latest transitions, oldest first: ``(key, start, finish, stimulus_id, time)``.

        Bounded by ``transition_log_length``; a copy, so reading it changes nothing."""
        flat = self._log_entries
        entries = [tuple(flat[i:i + _LOG_FIELDS]) for i in range(0, len(flat), _LOG_FIELDS)]
        entries = entries[self._log_next:] + entries[:self._log_next]
        room = self._log_capacity - len(entries)
        if self._log_packed is not None and room > 0:
            entries = _unpack_log(self._log_packed)[-room:] + entries
        return entries

    def pack_transition_log(self) -> None:
        """Hold the logged transitions in a few large objects rather than five small ones
        each: what a server calls once a big job is gone. Kept one by one, the last
        transitions of a released job (its keys, stimulus ids and times) are among the
        few objects left in many of the allocator's arenas, which then cannot go back to
        the system. Reads are the same (`transition_log`, `story`); new transitions are
        logged as before, and the packed ones are dropped once as many new ones fill the
        log."""
        if not self._log_entries:
            return  # nothing logged since the last packing
        entries = self.transition_log
        self._log_entries = []
        self._log_next = 0
        self._log_packed = _pack_log(entries) if entries else None

    def record_transitions(self, on: bool) -> None:
        """Start (True) or stop recording every transition for `take_transitions`: what a
        server turns on while a plugin wants to be told of transitions. Unlike the
        bounded `transition_log`, nothing is dropped; stopping discards what was not
        taken."""
        self._recording = bool(on)
        self._recorded = []

    def take_transitions(self) -> list:
        """The transitions recorded since the last call, oldest first: ``(key, start,
        finish, stimulus_id)`` each (none unless `record_transitions` is on)."""
        flat = self._recorded
        self._recorded = []
        return [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]

    def clear_transition_log(self) -> None:
        """Forget the logged transitions (the counter keeps counting)."""
        self._log_entries = []
        self._log_next = 0
        self._log_packed = None

    def story(self, *keys) -> list:
        """The logged transitions of these keys: ``(key, start, finish, stimulus_id, time)``."""
        wanted = set(keys)
        return [entry for entry in self.transition_log if entry[0] in wanted]

    # Reads of the counters. None of them walks the tasks: they cost the same with a
    # million tasks as with one (worker_counts: one entry a worker, prefix_counts: one
    # a prefix that has tasks).

    def task_counts(self) -> dict:
        """How many tasks are in each state: ``{state: n}`` for the states a task can be
        held in (``HELD_STATES``: every state but forgotten)."""
        counts = {}
        i: cython.int
        for i in range(7):
            counts[TASK_STATES[i]] = self._state_counts[i]
        return counts

    def counters(self) -> dict:
        """The scheduler's figures, as plain data, read from the counters:

        ``tasks`` held; ``task_counts`` (as ``task_counts()``); ``tasks_entered``:
        ``{state: times a task entered it}`` since the state was made (``released``
        counts tasks created too, ``forgotten`` is the tasks forgotten); ``nbytes_in_memory``:
        the sizes of the results in memory, each result once however many workers hold
        it; ``transitions``, ``stimuli`` (taken, not refused) so far; ``workers``,
        ``idle_workers``, ``nthreads`` (of all workers), ``clients``, ``prefixes`` (task
        prefixes that have tasks held)."""
        entered = {}
        i: cython.int
        for i in range(8):
            entered[TASK_STATES[i]] = self._state_totals[i]
        return {
            "tasks": self._n_held(),
            "task_counts": self.task_counts(),
            "tasks_entered": entered,
            "nbytes_in_memory": self.nbytes_in_memory,
            "transitions": self.transition_counter,
            "stimuli": self.stimulus_counter,
            "workers": len(self.workers),
            "idle_workers": len(self.idle),
            "nthreads": self.total_nthreads,
            "clients": len(self.clients),
            "prefixes": len(self._active_prefixes),
        }

    def prefix_counts(self, every: bool = False) -> dict:
        """Per task prefix: ``{name: {"tasks": held, "task_counts": {state: n},
        "tasks_entered": {state: n}, "nbytes_in_memory": n}}`` (as in ``counters()``).

        Only prefixes that have tasks held: a prefix is dropped with its last task (its
        learned duration is kept apart). ``every`` is accepted for compatibility; it
        adds nothing, as no prefix without tasks is kept."""
        prefix: TaskPrefix
        out = {}
        for prefix in (self.prefixes if every else self._active_prefixes).values():
            out[prefix.name] = _prefix_figures(prefix)
        return out

    def worker_counts(self) -> dict:
        """Per worker: ``{address: {"name", "nthreads", "processing": tasks running or
        assigned, "in_memory": results it holds, "nbytes": their sizes, "occupancy":
        estimated seconds of work assigned, "status": "running" or "retiring"}}``."""
        ws: WorkerState
        out = {}
        for address, ws in self.workers.items():
            out[address] = {"name": ws.name, "nthreads": ws.nthreads,
                            "processing": len(ws.processing), "in_memory": len(ws.has_what),
                            "nbytes": ws.nbytes, "occupancy": ws.occupancy,
                            "status": ws.status}
        return out

    @cython.cfunc
    def _shrink_tables(self) -> None:
        """Most of what a big graph brought is forgotten: rebuild the tables it grew at
        their size now (a dict or set never shrinks by deletion; what it held stays
        mapped), so that the memory goes back with the tasks. O(tasks left), once per
        shrink by _SHRINK_FACTOR: the task tables and sets a few dicts per stimulus
        (`_shrink_step`), the others at once."""
        cs: ClientState
        ws: WorkerState
        self._tasks_peak = len(self.tasks)
        _rebuild_dict(self.unrunnable)
        shrinking = [self.tasks]
        for cs in self.clients.values():
            shrinking.append(cs.wants_what)
        for ws in self.workers.values():
            shrinking.append(ws.has_what)
            _rebuild_set(ws.processing)
        for ws in self.departing.values():
            shrinking.append(ws.has_what)
        table: _Shards
        for table in shrinking:
            table.begin_compaction()
        self._shrinking = shrinking

    @cython.cfunc
    def _shrink_step(self) -> None:
        """Rebuild about _SHRINK_STEP_ENTRIES entries' worth of the tables that
        `_shrink_tables` began to rebuild."""
        budget: cython.Py_ssize_t = _SHRINK_STEP_ENTRIES
        n: cython.Py_ssize_t
        table: _Shards
        while self._shrinking and budget > 0:
            table = self._shrinking[-1]
            n = table.compact_some(budget)
            if n == 0:
                self._shrinking.pop()
            budget -= n
        if not self._shrinking:
            self._shrinking = None  # the list was made during the release: not kept

    @cython.cfunc
    def _n_held(self) -> cython.Py_ssize_t:
        n: cython.Py_ssize_t = 0
        i: cython.int
        for i in range(7):
            n += self._state_counts[i]
        return n

    # ------------------------------------------------------------------ engine

    @cython.cfunc
    def _begin(self, stimulus_id: str) -> None:
        # Recommendations and messages that a stimulus which raised left behind are not
        # dropped: this stimulus carries them out and delivers them with its own.
        self._stimulus_id = stimulus_id
        self._now = self.clock()
        self.stimulus_counter += 1
        self._forget_budget = self.forget_slice if self.forget_slice > 0 else -1

    @cython.cfunc
    def _end(self) -> tuple:
        self._engine()
        if self._has_work():
            self._idle_since = -1.0
        elif self._idle_since < 0:
            self._idle_since = self._now
        if self._shrinking:
            self._shrink_step()
        if self._tasks_peak >= _SHRINK_MIN \
                and len(self.tasks) * _SHRINK_FACTOR < self._tasks_peak:
            self._shrink_tables()
        if self.validate:
            self.validate_state()  # before the messages are handed out: kept if it raises
        result = (self._client_msgs, self._worker_msgs)
        self._client_msgs = {}
        self._worker_msgs = {}
        return result

    @cython.cfunc
    def _engine(self) -> None:
        """Apply recommendations until none are left; fill idle workers from the queue."""
        recs = self._recs
        ts: TaskState
        finish: cython.int
        n: cython.Py_ssize_t = 0
        limit: cython.Py_ssize_t = self.max_transitions_per_stimulus
        if limit <= 0:
            limit = _TRANSITIONS_PER_TASK_LIMIT * (len(self.tasks) + 1) + _TRANSITIONS_LIMIT_BASE
        while True:
            while recs:
                ts, finish = recs.popitem()
                n += 1
                if n > limit:
                    self._runaway(ts, finish, limit)
                self._transition(ts, finish)
            # Workers with room take queued tasks (in runs: _pop_queued) until saturated.
            if not (self.n_queued > 0 and self.idle and self._pop_queued()):
                break
        if n >= _SHRINK_MIN:
            recs.clear()  # empty now, but its table kept the size of the peak

    @cython.cfunc
    def _runaway(self, ts: TaskState, finish: cython.int, limit: cython.Py_ssize_t) -> None:
        """Raise TransitionLimitExceeded; drop the pending recommendations (the loop).

        The messages collected so far are kept and go out with the next stimulus."""
        pending = len(self._recs)
        self._recs.clear()
        sid = self._stimulus_id
        recent = [f"{bounded_repr(key, 60)}: {start} -> {end}"
                  for key, start, end, stimulus_id, _ in self.transition_log[-5:]
                  if stimulus_id == sid]
        raise TransitionLimitExceeded(
            f"stimulus {bounded_repr(sid)} ran more than {limit} transitions (a "
            f"recommendation loop): next {bounded_repr(ts.key, 60)}: {ts.state} -> "
            f"{_NAMES[finish]}; "
            f"last transitions {recent}; {pending} more pending recommendations dropped")

    @cython.cfunc
    def _transition(self, ts: TaskState, finish: cython.int) -> None:
        start: cython.int = ts.state_id
        if start == _S_FORGOTTEN:
            return
        if _is_active(finish) and ts.who_wants is None and ts.n_waiters == 0:
            # A later recommendation can outdate an earlier one: run nothing unneeded.
            finish = _S_RELEASED if ts.dependents is not None else _S_FORGOTTEN
        if start == finish:
            return
        if finish == _S_FORGOTTEN and self._forget_budget >= 0:
            if self._forget_budget == 0:
                # this stimulus forgot its share: the rest waits for forget_more (a
                # released graph of a million tasks must not hold the server for seconds)
                if start == _S_RELEASED or start == _S_MEMORY or start == _S_ERRED:
                    self._forget_later[ts] = None
                    return
                finish = _S_RELEASED  # stop it here; _after_release parks it
            else:
                self._forget_budget -= 1
        # try/finally: a transition that raises (a bug) after it moved the task still
        # has the move counted and logged, so the counters stay true to the tasks.
        if _allowed(start, finish):
            try:
                self._move(ts, start, finish)
            finally:
                self._log(ts, start)
        else:  # through released
            if not _allowed(start, _S_RELEASED) or not _allowed(_S_RELEASED, finish):
                raise InvalidTransition(f"{ts.key!r}: no transition {_NAMES[start]} -> "
                                        f"{_NAMES[finish]}")
            try:
                self._move(ts, start, _S_RELEASED)
            finally:
                self._log(ts, start)
            if ts.state_id == _S_RELEASED:
                try:
                    self._move(ts, _S_RELEASED, finish)
                finally:
                    self._log(ts, _S_RELEASED)
        if self.validate:
            self._validate_task(ts)

    @cython.cfunc
    def _move(self, ts: TaskState, start: cython.int, finish: cython.int) -> None:
        """Run the transition ``start -> finish`` on ``ts``: one case per entry of MOVES,
        each a direct call when compiled; any other pair raises InvalidTransition before
        anything changes."""
        if start == _S_WAITING:
            if finish == _S_PROCESSING:
                self._transition_waiting_processing(ts)
            elif finish == _S_QUEUED:
                self._transition_waiting_queued(ts)
            elif finish == _S_NO_WORKER:
                self._transition_waiting_no_worker(ts)
            elif finish == _S_RELEASED:
                self._transition_waiting_released(ts)
            elif finish == _S_ERRED:
                self._transition_waiting_erred(ts)
            else:
                raise _no_move(ts, start, finish)
        elif start == _S_RELEASED:
            if finish == _S_WAITING:
                self._transition_released_waiting(ts)
            elif finish == _S_FORGOTTEN:
                self._transition_released_forgotten(ts)
            elif finish == _S_ERRED:
                self._transition_released_erred(ts)
            else:
                raise _no_move(ts, start, finish)
        elif start == _S_PROCESSING:
            if finish == _S_RELEASED:
                self._transition_processing_released(ts)
            elif finish == _S_WAITING:
                self._transition_processing_waiting(ts)
            elif finish == _S_ERRED:
                self._transition_processing_erred(ts)
            else:
                raise _no_move(ts, start, finish)
        elif start == _S_MEMORY:
            if finish == _S_RELEASED:
                self._transition_memory_released(ts)
            else:
                raise _no_move(ts, start, finish)
        elif start == _S_QUEUED:
            if finish == _S_PROCESSING:
                self._transition_queued_processing(ts)
            elif finish == _S_RELEASED:
                self._transition_queued_released(ts)
            else:
                raise _no_move(ts, start, finish)
        elif start == _S_NO_WORKER:
            if finish == _S_PROCESSING:
                self._transition_no_worker_processing(ts)
            elif finish == _S_WAITING:
                self._transition_no_worker_waiting(ts)
            elif finish == _S_RELEASED:
                self._transition_no_worker_released(ts)
            else:
                raise _no_move(ts, start, finish)
        elif start == _S_ERRED:
            if finish == _S_RELEASED:
                self._transition_erred_released(ts)
            else:
                raise _no_move(ts, start, finish)
        else:
            raise _no_move(ts, start, finish)
        if self._transition_hook is not None:
            self._transition_hook(self, ts, _NAMES[start], _NAMES[finish])

    @cython.cfunc
    def _log(self, ts: TaskState, start: cython.int) -> None:
        """Count and log a move of ``ts`` from ``start`` to its state; every change of a
        task's state goes through here (a task is born released: ``_count_new``)."""
        if ts.state_id != start:
            self._count_move(ts, start)
            self.transition_counter += 1
            if self._recording:
                self._recorded.extend((ts.key, _NAMES[start], _NAMES[ts.state_id],
                                       self._stimulus_id))
            if self._log_capacity <= 0:
                return
            # Flat, not a tuple an entry: 40 bytes a transition instead of 88.
            log = self._log_entries
            i: cython.Py_ssize_t = self._log_next * 5  # _LOG_FIELDS, as a C constant
            if i == len(log):
                log.extend((ts.key, _NAMES[start], _NAMES[ts.state_id], self._stimulus_id,
                            self._now))
                if self._log_packed is not None and self._log_next + 1 >= self._log_capacity:
                    self._log_packed = None  # the log is full of newer transitions
            else:
                log[i] = ts.key
                log[i + 1] = _NAMES[start]
                log[i + 2] = _NAMES[ts.state_id]
                log[i + 3] = self._stimulus_id
                log[i + 4] = self._now
            self._log_next = (self._log_next + 1) % self._log_capacity

    @cython.cfunc
    def _count_move(self, ts: TaskState, start: cython.int) -> None:
        """The counters follow ``ts`` from ``start`` to ``ts.state_id``: a few C increments."""
        prefix: TaskPrefix = ts.prefix
        i: cython.int = start
        j: cython.int = ts.state_id
        self._state_counts[i] -= 1
        self._state_counts[j] += 1
        self._state_totals[j] += 1
        prefix.counts[i] -= 1
        prefix.counts[j] += 1
        prefix.totals[j] += 1
        # A result's size is set before its task enters memory and stays while it is there.
        if i == 5:  # left memory
            self.nbytes_in_memory -= ts.nbytes
            prefix.nbytes_in_memory -= ts.nbytes
        elif j == 5:  # entered memory
            self.nbytes_in_memory += ts.nbytes
            prefix.nbytes_in_memory += ts.nbytes

    @cython.cfunc
    def _count_new(self, prefix: TaskPrefix) -> None:
        """A task of ``prefix`` was created: it is released."""
        self._state_counts[0] += 1  # 0: released
        self._state_totals[0] += 1
        prefix.counts[0] += 1
        prefix.totals[0] += 1
        prefix.n_tasks += 1
        if prefix.n_tasks == 1:
            self._active_prefixes[prefix.name] = prefix

    # ------------------------------------------------------------------ transitions

    @cython.cfunc
    def _transition_released_waiting(self, ts: TaskState) -> None:
        dep: TaskState
        if ts.run_spec is None:
            ts.error = (None, None, f"lost data: {ts.key!r} was scattered and every "
                                    "worker that held it is gone", ts.key)
            self._recs[ts] = _S_ERRED
            return
        n: cython.Py_ssize_t = 0
        for dep in ts.dependencies:
            if dep.state_id == _S_ERRED:
                ts.error = dep.error
                self._recs[ts] = _S_ERRED
                return
            if dep.state_id != _S_MEMORY:
                n += 1
        for dep in ts.dependencies:
            if dep.state_id == _S_RELEASED:
                self._recs[dep] = _S_WAITING
        ts.state_id = _S_WAITING
        ts.n_waiting_on = n
        self._enter_active(ts)
        if n == 0:
            self._recs[ts] = _S_QUEUED if not self.idle and self._queue_eligible(ts) \
                else _S_PROCESSING

    @cython.cfunc
    def _transition_waiting_processing(self, ts: TaskState) -> None:
        if self.departing and ts.dependencies and self._release_departed_inputs(ts):
            return  # waits for them again
        ws: WorkerState = self._decide_worker(ts)
        if ws is None:
            self._recs[ts] = _S_QUEUED if self._queue_eligible(ts) else _S_NO_WORKER
            return
        self._assign(ts, ws)

    @cython.cfunc
    def _transition_waiting_queued(self, ts: TaskState) -> None:
        self.n_queued += 1
        self._push_queued(ts)
        ts.state_id = _S_QUEUED

    @cython.cfunc
    def _transition_waiting_no_worker(self, ts: TaskState) -> None:
        self.unrunnable[ts] = None
        ts.state_id = _S_NO_WORKER

    @cython.cfunc
    def _transition_queued_processing(self, ts: TaskState) -> None:
        ws: WorkerState
        if ts is self._picked_task:
            ws = self._picked_worker
            self._picked_task = None
            self._picked_worker = None
        else:
            ws = self._decide_worker(ts)
            if ws is None:
                self._push_queued(ts)  # popped for a slot that is taken by now
                return
        self.n_queued -= 1
        self._assign(ts, ws)

    @cython.cfunc
    def _transition_no_worker_processing(self, ts: TaskState) -> None:
        if self.departing and ts.dependencies and self._release_departed_inputs(ts):
            return  # recommended waiting: it waits for them again
        ws: WorkerState = self._decide_worker(ts)
        if ws is None:
            return
        del self.unrunnable[ts]
        self._assign(ts, ws)

    @cython.cfunc
    def _transition_processing_waiting(self, ts: TaskState) -> None:
        """Start over without leaving the active states: inputs keep their waiter counts,
        so none of them is recommended 'released' on the way."""
        ws: WorkerState = ts.processing_on
        if self._input_erred(ts):
            self._transition_processing_released(ts)
            self._transition_released_waiting(ts)  # errs it
            return
        self._unassign(ts)
        self._free_key(ws, ts.key)
        self._rewait(ts)

    @cython.cfunc
    def _transition_no_worker_waiting(self, ts: TaskState) -> None:
        if self._input_erred(ts):
            self._transition_no_worker_released(ts)
            self._transition_released_waiting(ts)
            return
        del self.unrunnable[ts]
        self._rewait(ts)

    @cython.cfunc
    def _input_erred(self, ts: TaskState) -> cython.bint:
        dep: TaskState
        for dep in ts.dependencies:
            if dep.state_id == _S_ERRED:
                return True
        return False

    @cython.cfunc
    def _rewait(self, ts: TaskState) -> None:
        dep: TaskState
        n: cython.Py_ssize_t = 0
        for dep in ts.dependencies:
            if dep.state_id != _S_MEMORY:
                n += 1
                if dep.state_id == _S_RELEASED:
                    self._recs[dep] = _S_WAITING
        ts.state_id = _S_WAITING
        ts.n_waiting_on = n
        if n == 0:
            self._recs[ts] = _S_PROCESSING

    @cython.cfunc
    def _transition_waiting_released(self, ts: TaskState) -> None:
        ts.n_waiting_on = 0
        self._deactivate(ts)

    @cython.cfunc
    def _transition_queued_released(self, ts: TaskState) -> None:
        self.n_queued -= 1
        if ts is self._picked_task:
            self._picked_task = None
            self._picked_worker = None
        if self.n_queued == 0:
            self._drop_queue()  # what is left in the heap and the runs left the queue
        elif len(self.queued) > 2 * self.n_queued + 64:
            self._compact_queue()
        self._deactivate(ts)

    @cython.cfunc
    def _transition_no_worker_released(self, ts: TaskState) -> None:
        del self.unrunnable[ts]
        self._deactivate(ts)

    @cython.cfunc
    def _transition_processing_released(self, ts: TaskState) -> None:
        ws: WorkerState = ts.processing_on
        self._unassign(ts)
        self._free_key(ws, ts.key)
        self._deactivate(ts)

    @cython.cfunc
    def _transition_processing_erred(self, ts: TaskState) -> None:
        self._unassign(ts)
        ts.state_id = _S_ERRED
        self._leave_active(ts)
        self._announce_error(ts)

    @cython.cfunc
    def _transition_waiting_erred(self, ts: TaskState) -> None:
        ts.n_waiting_on = 0
        ts.state_id = _S_ERRED
        self._leave_active(ts)
        self._announce_error(ts)

    @cython.cfunc
    def _transition_released_erred(self, ts: TaskState) -> None:
        ts.state_id = _S_ERRED
        self._announce_error(ts)

    @cython.cfunc
    def _transition_erred_released(self, ts: TaskState) -> None:
        ts.error = None
        ts.state_id = _S_RELEASED
        self._after_release(ts)

    @cython.cfunc
    def _transition_memory_released(self, ts: TaskState) -> None:
        ws: WorkerState
        dts: TaskState
        if ts.who_has is not None:
            for ws in ts.who_has:
                ws.has_what.discard(ts)
                ws.nbytes -= ts.nbytes
                self._free_key(ws, ts.key)
            ts.who_has = None
        ts.state_id = _S_RELEASED
        if ts.dependents is not None:
            for dts in ts.dependents:
                if dts.state_id == _S_WAITING:
                    dts.n_waiting_on += 1
                elif dts.state_id == _S_PROCESSING or dts.state_id == _S_NO_WORKER:
                    self._recs[dts] = _S_WAITING  # its input is gone: start it over
        self._after_release(ts)

    @cython.cfunc
    def _transition_released_forgotten(self, ts: TaskState) -> None:
        dep: TaskState
        if ts.who_wants is not None or ts.dependents is not None or ts.n_waiters:
            return  # needed again since this was recommended
        for dep in ts.dependencies:
            dep.dependents = _without_dependent(dep.dependents, ts)
            if dep.dependents is None:
                if dep.who_wants is None and (dep.state_id == _S_RELEASED or dep.state_id == _S_ERRED
                                              or dep.state_id == _S_MEMORY):
                    self._recs[dep] = _S_FORGOTTEN
        ts.dependencies = _NO_DEPENDENCIES
        if type(ts.run_spec) is SpecPart:
            self._part_task_gone(ts.run_spec)
        ts.run_spec = None
        ts.error = None
        ts.state_id = _S_FORGOTTEN
        self.tasks.drop(ts.key)
        if not self.tasks:
            self.tasks = TaskTable()  # a dict never shrinks: hand a big graph's table back
        prefix: TaskPrefix = ts.prefix
        prefix.n_tasks -= 1
        if prefix.n_tasks == 0:
            self._drop_prefix(prefix)

    # ------------------------------------------------------------------ direct transitions

    @cython.cfunc
    def _processing_memory(self, ts: TaskState, ws: WorkerState, nbytes: cython.Py_ssize_t,
                           type_name, duration: cython.double, data) -> None:
        cs: ClientState
        self._unassign(ts)
        _add_duration(ts.prefix, duration)
        ts.type_name = type_name
        ts.state_id = _S_MEMORY
        self._add_holder(ts, ws, nbytes)
        self._log(ts, _S_PROCESSING)
        self._leave_active(ts)
        self._dependents_gain_input(ts)
        if ts.who_wants is not None:
            msg = {"op": "key-in-memory", "key": ts.key, "type": type_name}
            if data is not None:
                msg["data"] = data
            for cs in ts.who_wants:
                self._send_client(cs, msg)
        elif ts.n_waiters == 0:
            self._recs[ts] = _S_RELEASED  # nobody needs it any more
        if self.validate:
            self._validate_task(ts)

    @cython.cfunc
    def _released_memory(self, ts: TaskState, holders: list, nbytes: cython.Py_ssize_t) -> None:
        ws: WorkerState
        cs: ClientState
        ts.state_id = _S_MEMORY
        for ws in holders:
            self._add_holder(ts, ws, nbytes)
        self._log(ts, _S_RELEASED)
        self._dependents_gain_input(ts)
        if ts.who_wants is not None:
            for cs in ts.who_wants:
                self._send_client(cs, {"op": "key-in-memory", "key": ts.key,
                                       "type": ts.type_name})

    # ------------------------------------------------------------------ helpers

    @cython.cfunc
    def _client(self, client: str) -> ClientState:
        cs: ClientState = self.clients.get(client)
        if cs is None:
            cs = ClientState(client)
            self.clients[client] = cs
        return cs

    @cython.cfunc
    def _prefix_for(self, key) -> TaskPrefix:
        if _is_layer_key(key):
            return self._layer_of(key)[1]
        return self._prefix_named(key_prefix(key))

    @cython.cfunc
    def _layer_of(self, key: tuple) -> tuple:
        """``(key[0], prefix)`` for a dask chunk key, from the cache of recent layer names.

        Chunks of one dask layer share key[0]: its prefix is computed once, and the
        cached ``key[0]`` lets new keys share one copy of the name (each key decoded
        from a message has a copy of its own).
        """
        layer = self._prefix_of_name.get(key[0])
        if layer is None:
            if len(self._prefix_of_name) >= _LAYER_CACHE_SIZE:
                self._prefix_of_name.clear()  # a long-lived scheduler sees endless names
            layer = (key[0], self._prefix_named(key_prefix(key)))
            self._prefix_of_name[key[0]] = layer
        return layer

    @cython.cfunc
    def _prefix_named(self, name: str) -> TaskPrefix:
        prefix: TaskPrefix = self.prefixes.get(name)
        if prefix is None:
            prefix = TaskPrefix(name)
            learned = self._durations.pop(name, None)
            if learned is not None:
                prefix.duration_average, prefix.n_durations = learned
            self.prefixes[name] = prefix
        return prefix

    @cython.cfunc
    def _drop_prefix(self, prefix: TaskPrefix) -> None:
        """The last task of ``prefix`` was forgotten: the prefix goes, its learned
        duration stays (bounded: the oldest goes first) for the next tasks of that name."""
        del self._active_prefixes[prefix.name]
        if self.prefixes.get(prefix.name) is prefix:
            del self.prefixes[prefix.name]
        if self._prefix_of_name:
            self._prefix_of_name.clear()  # no layer may lead to the dropped prefix
        if prefix.n_durations > 0:
            if len(self._durations) >= _DURATIONS_KEPT:
                del self._durations[next(iter(self._durations))]
            self._durations[prefix.name] = (prefix.duration_average, prefix.n_durations)

    @cython.cfunc
    def _slots_for(self, nthreads: cython.Py_ssize_t) -> cython.Py_ssize_t:
        if math.isinf(self.worker_saturation):
            return _UNLIMITED_SLOTS
        return max(1, math.ceil(nthreads * self.worker_saturation))

    @cython.cfunc
    def _send_client(self, cs: ClientState, msg: dict) -> None:
        msgs = self._client_msgs.get(cs.client_id)
        if msgs is None:
            self._client_msgs[cs.client_id] = [msg]
        else:
            msgs.append(msg)

    @cython.cfunc
    def _send_worker(self, ws: WorkerState, msg: dict) -> None:
        if ws.status == WORKER_CLOSED:
            return
        msgs = self._worker_msgs.get(ws.address)
        if msgs is None:
            self._worker_msgs[ws.address] = [msg]
        else:
            msgs.append(msg)

    @cython.cfunc
    def _free_key(self, ws: WorkerState, key) -> None:
        """Tell a worker to drop a key; consecutive ones share one message, in order."""
        if ws.status == WORKER_CLOSED:
            return
        msgs = self._worker_msgs.get(ws.address)
        if msgs is not None and msgs[-1]["op"] == "free-keys":
            msgs[-1]["keys"].append(key)
        else:
            self._send_worker(ws, {"op": "free-keys", "keys": [key],
                                   "stimulus_id": self._stimulus_id})

    @cython.cfunc
    def _add_want(self, ts: TaskState, cs: ClientState) -> None:
        """The client wants ``ts``: tell it at once if the answer is known, else run it."""
        self._add_want_quiet(ts, cs)
        if ts.state_id == _S_MEMORY:
            self._send_client(cs, {"op": "key-in-memory", "key": ts.key,
                                   "type": ts.type_name})
        elif ts.state_id == _S_ERRED:
            self._send_client(cs, self._error_msg(ts))
        elif ts.state_id == _S_RELEASED:
            self._recs[ts] = _S_WAITING

    @cython.cfunc
    def _add_want_quiet(self, ts: TaskState, cs: ClientState) -> None:
        if ts.who_wants is None or cs not in ts.who_wants:
            ts.who_wants = _tuple_with(ts.who_wants, cs, cs.alone)
            cs.wants_what.add(ts)

    @cython.cfunc
    def _drop_want(self, ts: TaskState, cs: ClientState) -> None:
        if ts.who_wants is None or cs not in ts.who_wants:
            return
        ts.who_wants = _tuple_without(ts.who_wants, cs)
        cs.wants_what.discard(ts)
        if ts.who_wants is None and ts.n_waiters == 0:
            if ts.state_id == _S_RELEASED:
                if ts.dependents is None:
                    self._recs[ts] = _S_FORGOTTEN
            else:
                self._recs[ts] = _S_RELEASED if ts.dependents is not None else _S_FORGOTTEN

    @cython.cfunc
    def _add_holder(self, ts: TaskState, ws: WorkerState, nbytes: cython.Py_ssize_t) -> None:
        if ts.who_has is not None and ws in ts.who_has:
            return
        if ts.who_has is None:
            ts.nbytes = nbytes
        ts.who_has = _tuple_with(ts.who_has, ws, ws.alone)
        ws.has_what.add(ts)
        ws.nbytes += ts.nbytes

    @cython.cfunc
    def _remove_holder(self, ts: TaskState, ws: WorkerState) -> None:
        ts.who_has = _tuple_without(ts.who_has, ws)
        ws.has_what.discard(ts)
        ws.nbytes -= ts.nbytes

    @cython.cfunc
    def _enter_active(self, ts: TaskState) -> None:
        dep: TaskState
        for dep in ts.dependencies:
            dep.n_waiters += 1

    @cython.cfunc
    def _leave_active(self, ts: TaskState) -> None:
        """``ts`` no longer needs its inputs: release inputs nobody else needs."""
        dep: TaskState
        for dep in ts.dependencies:
            dep.n_waiters -= 1
            if dep.n_waiters == 0 and dep.who_wants is None and dep.state_id != _S_RELEASED \
                    and dep.state_id != _S_ERRED:
                self._recs[dep] = _S_RELEASED

    @cython.cfunc
    def _deactivate(self, ts: TaskState) -> None:
        ts.state_id = _S_RELEASED
        self._leave_active(ts)
        self._after_release(ts)

    @cython.cfunc
    def _after_release(self, ts: TaskState) -> None:
        """A task just became released: run it again if needed, forget it if unused."""
        if ts.who_wants is not None or ts.n_waiters > 0:
            self._recs[ts] = _S_WAITING
        elif ts.dependents is None:
            self._recs[ts] = _S_FORGOTTEN

    @cython.cfunc
    def _dependents_gain_input(self, ts: TaskState) -> None:
        dts: TaskState
        if ts.dependents is None:
            return
        ready = []
        for dts in ts.dependents:
            if dts.state_id == _S_WAITING:
                dts.n_waiting_on -= 1
                if dts.n_waiting_on == 0:
                    ready.append(dts)
        if len(ready) > 1:
            ready.sort(key=_priority_of, reverse=True)  # recommendations pop LIFO
        for dts in ready:
            self._recs[dts] = _S_PROCESSING

    @cython.cfunc
    def _error_msg(self, ts: TaskState) -> dict:
        exception, traceback, text, blame = ts.error
        return {"op": "task-erred", "key": ts.key, "exception": exception,
                "traceback": traceback, "text": text, "blame": blame}

    @cython.cfunc
    def _announce_error(self, ts: TaskState) -> None:
        """Tell the clients, err the dependents that were waiting for this result."""
        dts: TaskState
        cs: ClientState
        if ts.who_wants is not None:
            msg = self._error_msg(ts)
            for cs in ts.who_wants:
                self._send_client(cs, msg)
        if ts.dependents is not None:
            for dts in ts.dependents:
                if dts.state_id == _S_WAITING or dts.state_id == _S_RELEASED and dts.who_wants is not None:
                    dts.error = ts.error
                    self._recs[dts] = _S_ERRED
        if ts.who_wants is None and ts.dependents is None and ts.n_waiters == 0:
            self._recs[ts] = _S_FORGOTTEN

    # ------------------------------------------------------------------ placement

    @cython.cfunc
    def _queue_eligible(self, ts: TaskState) -> cython.bint:
        return (not ts.dependencies and (ts.options is None or not ts.options.restricted)
                and not math.isinf(self.worker_saturation))

    @cython.cfunc
    def _worker_fits(self, ws: WorkerState, ts: TaskState, strict: cython.bint) -> cython.bint:
        options: TaskOptions = ts.options
        if options is None:
            return True
        if strict and options.workers is not None \
                and ws.address not in options.workers and ws.name not in options.workers:
            return False
        if options.resources is not None:
            if ws.resources is None:
                return False
            for name, quantity in options.resources.items():
                if ws.resources.get(name, 0) < quantity:
                    return False
        return True

    @cython.cfunc
    def _release_departed_inputs(self, ts: TaskState) -> cython.bint:
        """Whether an input of ``ts`` was held only by departing workers (their slice
        has not come yet); such inputs are released now, to be recomputed, so that no
        worker is sent to fetch from a worker that is gone."""
        dep: TaskState
        ws: WorkerState
        lost = []
        for dep in ts.dependencies:
            if dep.who_has is None:
                continue
            here: cython.bint = False
            for ws in dep.who_has:
                if ws.status != WORKER_CLOSED:
                    here = True
                    break
            if not here:
                lost.append(dep)
        for dep in lost:
            self._transition(dep, _S_RELEASED)
        return len(lost) > 0

    @cython.cfunc
    def _decide_worker(self, ts: TaskState) -> WorkerState:
        """The worker to run ``ts`` now, or None.

        Tasks with inputs go to the valid worker holding most of their input bytes,
        ties broken by estimated occupancy per thread. Tasks without inputs go to the
        least busy worker with a free slot (any valid worker when restricted).
        """
        ws: WorkerState
        best: WorkerState = None
        dep: TaskState
        loose: cython.bint = ts.options is not None and ts.options.loose
        if ts.dependencies:
            local = {}
            for dep in ts.dependencies:
                if dep.who_has is not None:
                    for ws in dep.who_has:
                        local[ws] = local.get(ws, 0) + max(dep.nbytes, 0)
            for strict in (True, False):
                if not strict and not loose:
                    break
                best = self._best_by_bytes(ts, local, True, strict)
                if best is None:
                    best = self._best_by_bytes(ts, local, False, strict)
                if best is not None:
                    break
            return best
        if ts.options is None or not ts.options.restricted:
            return self._least_busy(self.idle.values(), ts, True)
        best = self._least_busy(self.workers.values(), ts, True)
        if best is None and loose:
            best = self._least_busy(self.workers.values(), ts, False)
        return best

    @cython.cfunc
    def _best_by_bytes(self, ts: TaskState, local: dict, holders_only: cython.bint,
                       strict: cython.bint) -> WorkerState:
        ws: WorkerState
        best: WorkerState = None
        best_bytes: cython.Py_ssize_t = -1
        best_load: cython.double = 0.0
        candidates = local if holders_only else self.workers.values()
        for ws in candidates:
            if ws.status != WORKER_RUNNING or not self._worker_fits(ws, ts, strict):
                continue
            nbytes: cython.Py_ssize_t = local.get(ws, 0)
            load: cython.double = ws.occupancy / ws.nthreads
            if nbytes > best_bytes or (nbytes == best_bytes and load < best_load):
                best, best_bytes, best_load = ws, nbytes, load
        return best

    @cython.cfunc
    def _least_busy(self, candidates, ts: TaskState, strict: cython.bint) -> WorkerState:
        ws: WorkerState
        best: WorkerState = None
        best_load: cython.double = 0.0
        for ws in candidates:
            if ws.status != WORKER_RUNNING or not self._worker_fits(ws, ts, strict):
                continue
            load: cython.double = (len(ws.processing) + ws.occupancy) / ws.nthreads
            if best is None or load < best_load:
                best, best_load = ws, load
        return best

    @cython.cfunc
    def _estimate(self, ts: TaskState) -> cython.double:
        average: cython.double = ts.prefix.duration_average
        if average < 0:
            return self.default_duration
        return max(average, _MIN_TASK_ESTIMATE)

    @cython.cfunc
    def _assign(self, ts: TaskState, ws: WorkerState) -> None:
        dep: TaskState
        holder: WorkerState
        ts.processing_on = ws
        ts.estimate = self._estimate(ts)
        ws.processing.add(ts)
        ws.occupancy += ts.estimate
        if self._saturated(ws):
            self.idle.pop(ws.address, None)
        ts.state_id = _S_PROCESSING
        spec = ts.run_spec
        if type(spec) is SpecPart:
            spec = self._part_reference(spec, ts, ws)
        msg = {"op": "compute-task", "key": ts.key, "spec": spec,
               "priority": (ts.priority_user, ts.generation, ts.order),
               "stimulus_id": self._stimulus_id}
        if ts.dependencies:
            if self.departing:
                msg["who_has"] = {dep.key: _holder_addresses(dep) for dep in ts.dependencies}
            else:
                who_has = {}
                for dep in ts.dependencies:
                    holders: tuple = dep.who_has
                    if len(holders) == 1:
                        holder = holders[0]
                        who_has[dep.key] = holder.addresses
                    else:
                        who_has[dep.key] = [dws.address for dws in holders]
                msg["who_has"] = who_has
        if ts.options is not None and ts.options.resources is not None:
            msg["resources"] = ts.options.resources
        self._send_worker(ws, msg)

    @cython.cfunc
    def _part_reference(self, part: SpecPart, ts: TaskState, ws: WorkerState) -> bytes:
        """The spec ``ws`` is sent for ``ts`` of ``part``; the part goes first if ``ws``
        does not have it yet."""
        if ws not in part.holders:
            part.holders.add(ws)
            self._send_worker(ws, {"op": "spec-part", "part": part.number, "blob": part.blob})
        return part.reference(ts.order)

    @cython.cfunc
    def _part_task_gone(self, part: SpecPart) -> None:
        """A task of ``part`` was forgotten; with the last one, its holders drop it."""
        ws: WorkerState
        part.n_tasks -= 1
        if part.n_tasks == 0:
            for ws in part.holders:
                self._send_worker(ws, {"op": "free-spec-parts", "parts": [part.number]})
            part.holders = set()

    @cython.cfunc
    def _unassign(self, ts: TaskState) -> None:
        """Take a processing task off its worker; a freed slot takes a queued task."""
        ws: WorkerState = ts.processing_on
        ws.processing.discard(ts)
        if ws.long_running is not None and ts in ws.long_running:
            ws.long_running.discard(ts)
            ws.slots -= 1
            if not ws.long_running:
                ws.long_running = None
        if ws.processing:
            ws.occupancy -= ts.estimate
        else:
            ws.occupancy = 0.0
            ws.idle_since = self._now
        ts.processing_on = None
        ts.estimate = 0.0
        if self._steals:  # a steal asked of ws is void: ws no longer runs ts
            self._steals.pop(ts, None)
        if self._steal_refused:
            self._steal_refused.pop(ts, None)
        if ws.status == WORKER_RUNNING and not self._saturated(ws) \
                and ws.address not in self.idle:
            self.idle[ws.address] = ws

    @cython.cfunc
    def _saturated(self, ws: WorkerState) -> cython.bint:
        """Enough tasks for its threads, and enough estimated work to outlast a round trip."""
        return (len(ws.processing) >= ws.slots
                and ws.occupancy >= ws.nthreads * self.queue_horizon)

    @cython.cfunc
    def _push_queued(self, ts: TaskState) -> None:
        _heap_push(self.queued, ts)

    @cython.cfunc
    def _pop_queued(self) -> cython.bint:
        """Recommend a queued task for the least busy worker with room; False if none.

        Workers take queued tasks in runs: a batch of consecutive ones off the heap, most
        urgent first, which the worker works through before it takes more. Tasks next to
        each other in priority order are mostly the inputs of one later task (a
        shuffle's group, a reduction's branch): run on one worker, their results need not
        travel. A task in the heap more urgent than the run's next goes first. A worker
        done with its run takes a new one off the heap, or the more urgent half of
        another's: of the run with the most urgent next task when the heap is empty, or
        when a stuck run (its worker busy with a long task, _RUN_STUCK_PICKS) has a task
        more urgent than the heap's, which must not wait for that worker."""
        ws: WorkerState
        ts: TaskState
        if self.n_queued == 0:
            return False
        ws = self._least_busy_idle()
        if ws is None:
            return False
        ts = self._next_queued_for(ws)
        if ts is None:
            return False
        self._picked_task = ts
        self._picked_worker = ws
        self.queue_picks += 1
        ws.queue_picks = self.queue_picks
        self._recs[ts] = _S_PROCESSING
        return True

    @cython.cfunc
    def _least_busy_idle(self) -> WorkerState:
        """The idle worker with the least work per thread (queued tasks fit any: they are
        never restricted, so _least_busy's fit test, which needs a task, is not asked)."""
        ws: WorkerState
        best: WorkerState = None
        best_load: cython.double = 0.0
        for ws in self.idle.values():
            load: cython.double = (len(ws.processing) + ws.occupancy) / ws.nthreads
            if best is None or load < best_load:
                best, best_load = ws, load
        return best

    @cython.cfunc
    def _next_queued_for(self, ws: WorkerState) -> TaskState:
        """The queued task ``ws`` runs next: its run's, the heap's if more urgent, the
        first of half of another worker's run or of a new run off the heap, whichever is
        more urgent; None if none is left."""
        ts: TaskState
        head: TaskState
        victim: WorkerState
        while True:
            ts = self._next_in_run(ws)
            if ts is not None:
                head = self._queue_head()
                if head is None or _urgency_cmp(head, ts) >= 0:
                    ws.queue_run.pop()
                    if not ws.queue_run:
                        ws.queue_run = None
                    return ts
                _heap_pop(self.queued)
                return head
            head = self._queue_head()
            victim = self._most_urgent_run(ws, head is not None)
            if victim is not None and (
                    head is None or _urgency_cmp(victim.queue_run[-1], head) < 0):
                self._steal_run(ws, victim)
            elif head is not None:
                ws.queue_run = self._run_off_heap()
            else:
                return None

    @cython.cfunc
    def _next_in_run(self, ws: WorkerState) -> TaskState:
        """The next task of ``ws``'s run, dropping those that left the queue; None (and no
        run) if none is left."""
        ts: TaskState
        run: list = ws.queue_run
        if run is None:
            return None
        while run:
            ts = run[-1]
            if self._takeable(ts):
                return ts
            run.pop()
        ws.queue_run = None
        return None

    @cython.cfunc
    def _takeable(self, ts: TaskState) -> cython.bint:
        return ts.state_id == _S_QUEUED and ts not in self._recs

    @cython.cfunc
    def _queue_head(self) -> TaskState:
        """The heap's most urgent queued task, left in the heap; None if none."""
        ts: TaskState
        while self.queued:
            ts = self.queued[0]
            if self._takeable(ts):
                return ts
            _heap_pop(self.queued)
        return None

    @cython.cfunc
    def _run_off_heap(self) -> list:
        """Take the next run off the heap: one thread's share of what it holds, at most
        _RUN_MAX tasks, most urgent last."""
        ts: TaskState
        n: cython.Py_ssize_t = len(self.queued) // max(self.total_nthreads, 1)
        n = max(1, min(n, _RUN_MAX))
        run = []
        while self.queued and len(run) < n:
            ts = _heap_pop(self.queued)
            if self._takeable(ts):
                run.append(ts)
        run.reverse()
        return run

    @cython.cfunc
    def _most_urgent_run(self, thief: WorkerState, stuck_only: cython.bint) -> WorkerState:
        """The worker other than ``thief`` whose run's next task is the most urgent (of
        the stuck runs only, if ``stuck_only``)."""
        ws: WorkerState
        ts: TaskState
        best: WorkerState = None
        best_next: TaskState = None
        stuck_after: cython.Py_ssize_t = (self.queue_picks
                                          - _RUN_STUCK_PICKS * self.total_nthreads)
        for ws in self.workers.values():
            if ws is thief or ws.queue_run is None:
                continue
            if stuck_only and ws.queue_picks > stuck_after:
                continue
            ts = self._next_in_run(ws)
            if ts is not None and (best is None or _urgency_cmp(ts, best_next) < 0):
                best, best_next = ws, ts
        return best

    @cython.cfunc
    def _steal_run(self, thief: WorkerState, victim: WorkerState) -> None:
        """Give ``thief`` the more urgent half of ``victim``'s run (the whole of a run of
        one)."""
        run: list = victim.queue_run
        keep: cython.Py_ssize_t = len(run) // 2
        thief.queue_run = run[keep:]
        del run[keep:]
        if not run:
            victim.queue_run = None

    @cython.cfunc
    def _return_run(self, ws: WorkerState) -> None:
        """Put the tasks of ``ws``'s run back in the heap (it takes no more tasks)."""
        ts: TaskState
        if ws.queue_run is None:
            return
        for ts in ws.queue_run:
            if ts.state_id == _S_QUEUED:
                self._push_queued(ts)
        ws.queue_run = None

    @cython.cfunc
    def _drop_queue(self) -> None:
        """Empty the heap and the runs (nothing in them is queued any more: entries would
        keep forgotten tasks alive)."""
        ws: WorkerState
        self.queued = []
        for ws in self.workers.values():
            ws.queue_run = None

    @cython.cfunc
    def _compact_queue(self) -> None:
        """Drop heap and run entries of tasks that left the queue."""
        ts: TaskState
        ws: WorkerState
        seen = set()
        entries = []
        for ts in self.queued:
            if ts.state_id == _S_QUEUED and ts not in seen:
                seen.add(ts)
                entries.append(ts)
        _heapify(entries)
        self.queued = entries
        for ws in self.workers.values():
            if ws.queue_run is not None:
                ws.queue_run = [ts for ts in ws.queue_run if ts.state_id == _S_QUEUED] or None

    # ------------------------------------------------------------------ graph intake

    @cython.cfunc
    def _check_graph(self, tasks, keys) -> list:
        """Check a submitted graph whole; return its new entries, dependencies first."""
        if not isinstance(tasks, _SEQUENCE):
            raise GraphError(f"'tasks' must be a list of task dicts, not {bounded_repr(tasks)}")
        if not isinstance(keys, _SEQUENCE):
            raise GraphError(f"'keys' must be a list of keys, not {bounded_repr(keys)}")
        known: TaskTable = self.tasks
        position = {}
        entries = []
        i: cython.Py_ssize_t
        n: cython.Py_ssize_t
        for i, item in enumerate(tasks):
            key = _check_task_entry(i, item)
            if known.has(key):
                continue
            n = len(entries)
            if position.setdefault(key, n) != n:
                raise GraphError(f"key {bounded_repr(key)} appears twice in the graph")
            _check_new_task(key, item)
            entries.append(item)
        in_order: cython.bint = True
        entry: dict
        for i, entry in enumerate(entries):
            deps = entry.get("deps")
            if not deps:
                continue
            for dep in deps:
                try:
                    j = position.get(dep)  # most inputs are new: one lookup for them
                except TypeError:
                    j = None
                if j is None:
                    problem = _key_problem(dep)
                    if problem is not None:
                        raise GraphError(f"task {bounded_repr(entry['key'])}: dependency "
                                         f"{problem}")
                    if known.has(dep):
                        continue
                    raise GraphError(f"task {bounded_repr(entry['key'])} depends on unknown "
                                     f"key {bounded_repr(dep)}")
                if j >= i:
                    in_order = False
        for key in keys:
            problem = _key_problem(key)
            if problem is not None:
                raise GraphError(f"wanted {problem}")
            if not known.has(key) and key not in position:
                raise GraphError(f"wanted key {bounded_repr(key)} is not in the graph")
        return entries if in_order else _topological(entries, position, known)

    @cython.cfunc
    def _create_tasks(self, entries: list) -> list:
        ts: TaskState
        dep: TaskState
        prefix: TaskPrefix
        layer: tuple
        generation: cython.Py_ssize_t = self.generation
        self.generation += 1
        tasks: TaskTable = self.tasks
        part: SpecPart
        created = []
        same_deps = None  # the last deps list, and its tuple: shared by tasks after it
        same_tuple: tuple = _NO_DEPENDENCIES
        entry: dict
        i: cython.Py_ssize_t
        for i, entry in enumerate(entries):
            key = entry["key"]
            spec = entry["spec"]
            if _is_layer_key(key):
                layer = self._layer_of(key)
                if layer[0] is not key[0]:
                    key = (layer[0],) + key[1:]  # the shared copy of the name
                prefix = layer[1]
            else:
                prefix = self._prefix_named(key_prefix(key))
            if type(spec) is SpecPart:
                part = spec
                part.n_tasks += 1
            elif type(spec) is not bytes:
                spec = bytes(spec)
            ts = TaskState(key, prefix, spec)
            ts.generation = generation
            ts.priority_user = -(entry.get("priority") or 0)
            order = entry.get("order")
            ts.order = i if order is None else order
            ts.retries = entry.get("retries") or 0
            deps = entry.get("deps")
            if deps:
                if same_deps is not None and deps == same_deps:
                    ts.dependencies = same_tuple  # e.g. map over one future: one tuple
                else:
                    same_deps = deps
                    if len(deps) > 1:
                        deps = dict.fromkeys(deps)
                    same_tuple = tuple([tasks.at(d) for d in deps])
                    ts.dependencies = same_tuple
                for dep in ts.dependencies:
                    dep.dependents = _with_dependent(dep.dependents, ts)
            workers = entry.get("workers")
            resources = entry.get("resources")
            annotations = entry.get("annotations")
            if workers or resources or annotations:
                ts.options = TaskOptions(
                    frozenset(workers) if workers else None,
                    dict(resources) if resources else None,
                    bool(workers) and bool(entry.get("allow_other_workers", False)),
                    annotations or None)
            tasks.put(key, ts)
            self._count_new(prefix)
            created.append(ts)
        if len(tasks) > self._tasks_peak:
            self._tasks_peak = len(tasks)
        return created

    # ------------------------------------------------------------------ validation

    def validate_state(self) -> None:
        """Check every invariant of the whole state; raise InvariantError if one fails."""
        ts: TaskState
        ws: WorkerState
        cs: ClientState
        for key, ts in self.tasks.items():
            _check(ts.key == key, f"{key!r} is stored as {ts.key!r}")
            self._validate_task(ts)
            self._validate_settled(ts)
        for ts in self._forget_later:
            _check(ts.state_id == _S_FORGOTTEN or self.tasks.get(ts.key) is ts,
                   f"{ts} waits to be forgotten but is not stored")
        self._validate_spec_parts()
        n_queued = 0
        for ts in self.tasks.values():
            if ts.state_id == _S_QUEUED:
                n_queued += 1
        _check(n_queued == self.n_queued, f"{self.n_queued} counted queued, {n_queued} are")
        in_queue = {ts for ts in self.queued if ts.state_id == _S_QUEUED}
        for i in range(1, len(self.queued)):
            _check(_urgency_cmp(self.queued[(i - 1) // 2], self.queued[i]) <= 0,
                   f"the queue's heap is out of order at {i}")
        for ws in self.workers.values():
            if ws.queue_run is not None:
                _check(ws.status == WORKER_RUNNING and len(ws.queue_run) > 0,
                       f"{ws} ({ws.status}) has a run of {len(ws.queue_run)} queued tasks")
                in_queue.update(ts for ts in ws.queue_run if ts.state_id == _S_QUEUED)
        _check(len(in_queue) == n_queued, "a queued task is missing from the queue")
        _check(self._picked_task is None, f"{self._picked_task} was picked and not taken")
        if n_queued:
            _check(not self.idle, f"tasks are queued while workers are idle: {self.idle}")
        for ts in self.unrunnable:
            _check(ts.state_id == _S_NO_WORKER, f"{ts} is unrunnable")
            _check(self._decide_worker(ts) is None, f"{ts} is unrunnable but fits a worker")
        for address, ws in self.departing.items():
            _check(ws.address == address and ws.status == WORKER_CLOSED
                   and address not in self.workers and not ws.processing,
                   f"{ws} departing")
            for ts in ws.has_what:
                _check(ts.state_id == _S_MEMORY and ws in ts.who_has, f"{ts} listed in {ws}")
            nbytes = sum([ts.nbytes for ts in ws.has_what])
            _check(ws.nbytes == nbytes, f"{ws} holds {nbytes} bytes, counted {ws.nbytes}")
        for address, ws in self.workers.items():
            _check(ws.address == address
                   and (ws.status == WORKER_RUNNING or ws.status == WORKER_RETIRING),
                   f"{ws} registered")
            _check(ws.acquiring is None or len(ws.acquiring) > 0,
                   f"{ws} has an empty acquiring dict")
            for ts in ws.processing:
                _check(ts.state_id == _S_PROCESSING and ts.processing_on is ws,
                       f"{ts} listed as processing on {ws}")
            for ts in ws.has_what:
                _check(ts.state_id == _S_MEMORY and ws in ts.who_has, f"{ts} listed in {ws}")
            nbytes = sum([ts.nbytes for ts in ws.has_what])
            _check(ws.nbytes == nbytes, f"{ws} holds {nbytes} bytes, counted {ws.nbytes}")
            occupancy = sum([ts.estimate for ts in ws.processing])
            _check(abs(ws.occupancy - occupancy) < 1e-6 * (1 + occupancy),
                   f"{ws} occupancy {ws.occupancy} != {occupancy}")
            _check((address in self.idle)
                   == (ws.status == WORKER_RUNNING and not self._saturated(ws)),
                   f"{ws} idle status is wrong")
            seceded = ws.long_running if ws.long_running is not None else set()
            _check(seceded <= ws.processing and (ws.long_running is None or seceded),
                   f"{ws} lists seceded tasks it does not run")
            _check(ws.slots == self._slots_for(ws.nthreads) + len(seceded),
                   f"{ws} has {ws.slots} slots for {len(seceded)} seceded tasks")
        for address in self.idle:
            _check(address in self.workers, f"idle worker {address} is not registered")
        for client, cs in self.clients.items():
            for ts in cs.wants_what:
                _check(ts.who_wants is not None and cs in ts.who_wants,
                       f"{cs} wants {ts} but is not in its who_wants")
        self._validate_steals()
        self._validate_counters()

    @cython.cfunc
    def _validate_spec_parts(self) -> None:
        """Each spec part counts the tasks that hold it; it went only to registered
        workers, or to workers since removed."""
        ts: TaskState
        ws: WorkerState
        part: SpecPart
        held: dict = {}
        for ts in self.tasks.values():
            if type(ts.run_spec) is SpecPart:
                held[ts.run_spec] = held.get(ts.run_spec, 0) + 1
        for part, n in held.items():
            _check(part.n_tasks == n, f"{part} is held by {n} tasks")
            _check(0 < part.number <= self._n_spec_parts, f"{part} was not numbered")
            for ws in part.holders:
                _check(ws.status == WORKER_CLOSED or self.workers.get(ws.address) is ws,
                       f"{part} went to {ws}, neither registered nor closed")

    @cython.cfunc
    def _validate_counters(self) -> None:
        """The counters the transitions keep agree with a walk over every task.

        (Messages are only made for a failure: this runs after every stimulus.)"""
        ts: TaskState
        ws: WorkerState
        prefix: TaskPrefix
        held: list  # counters as lists (compiled: copies of the C arrays)
        entered: list
        counts = [0] * 7
        nbytes = 0
        by_prefix = {}  # TaskPrefix -> [tasks in each held state..., bytes in memory]
        i: cython.int
        for ts in self.tasks.values():
            i = ts.state_id
            if not 0 <= i < 7:
                raise InvariantError(f"task {ts.key!r} is in no state a task can be held in "
                                     f"(state_id {i})")
            counts[i] += 1
            figures = by_prefix.get(ts.prefix)
            if figures is None:
                figures = by_prefix[ts.prefix] = [0] * 8
            figures[i] += 1
            if i == 5:  # memory
                nbytes += ts.nbytes
                figures[7] += ts.nbytes
        held = self._state_counts
        entered = self._state_totals
        if held[:7] != counts:
            raise InvariantError(f"counted tasks per state {dict(zip(TASK_STATES, held))}, "
                                 f"there are {dict(zip(TASK_STATES, counts))}")
        if self.nbytes_in_memory != nbytes:
            raise InvariantError(f"counted {self.nbytes_in_memory} bytes in memory, "
                                 f"there are {nbytes}")
        if held[7] != entered[7] or not all([e >= h for e, h in zip(entered, held)]):
            raise InvariantError(f"counted tasks per state {held}, but only {entered} "
                                 "entered them")
        zero = [0] * 8
        active = self._active_prefixes
        for name, prefix in self.prefixes.items():
            figures = by_prefix.pop(prefix, None)
            if figures is None:
                raise InvariantError(f"{prefix!r} (registered as {name!r}) is kept with no "
                                     f"task held (counted {prefix.n_tasks}); active: "
                                     f"{name in active}")
            held = prefix.counts
            if (held[:7] != figures[:7] or prefix.nbytes_in_memory != figures[7]
                    or prefix.n_tasks != sum(figures[:7]) or prefix.name != name
                    or (active.get(name) is prefix) != (figures is not zero)):
                raise InvariantError(
                    f"{prefix!r} (registered as {name!r}): counted {prefix.n_tasks} tasks "
                    f"{dict(zip(TASK_STATES, held))} and {prefix.nbytes_in_memory} bytes in "
                    f"memory, there are {dict(zip(TASK_STATES, figures))} (bytes last); "
                    f"active: {name in active}")
            entered = prefix.totals
            if not all([e >= h for e, h in zip(entered, held)]):
                raise InvariantError(f"{prefix!r}: counted tasks per state {held}, but "
                                     f"only {entered} entered them")
        if by_prefix:
            raise InvariantError(f"tasks have unregistered prefixes: {list(by_prefix)[:3]}")
        if len(self._active_prefixes) != len(self.prefixes):
            raise InvariantError(f"{len(self._active_prefixes)} active prefixes, "
                                 f"{len(self.prefixes)} registered")
        if len(self._durations) > _DURATIONS_KEPT:
            raise InvariantError(f"{len(self._durations)} durations kept")
        if self.total_nthreads != sum([ws.nthreads for ws in self.workers.values()]):
            raise InvariantError(f"counted {self.total_nthreads} threads")

    @cython.cfunc
    def _validate_settled(self, ts: TaskState) -> None:
        """Between stimuli nothing is stuck and nothing is kept that nobody needs."""
        needed: cython.bint = ts.who_wants is not None or ts.n_waiters > 0
        later: cython.bint = ts in self._forget_later  # kept until forget_more
        if ts.state_id == _S_RELEASED:
            _check(not needed, f"{ts} is needed but not running")
            _check(ts.dependents is not None or later, f"{ts} is kept but nothing refers to it")
        elif ts.state_id == _S_ERRED:
            _check(ts.who_wants is not None or ts.dependents is not None or later,
                   f"{ts} is kept but nothing refers to it")
        else:
            _check(needed or (later and ts.state_id == _S_MEMORY),
                   f"{ts} is {ts.state} but nobody needs it")
        if ts.state_id == _S_WAITING:
            _check(ts.n_waiting_on > 0, f"{ts} is waiting on nothing")

    @cython.cfunc
    def _validate_task(self, ts: TaskState) -> None:
        dep: TaskState
        dts: TaskState
        ws: WorkerState
        cs: ClientState
        state: cython.int = ts.state_id
        if state == _S_FORGOTTEN:
            _check(ts.key not in self.tasks or self.tasks[ts.key] is not ts,
                   f"{ts} is forgotten but still stored")
            return
        _check(self.tasks.get(ts.key) is ts, f"{ts} is not stored under its key")
        for dep in ts.dependencies:
            _check(dep.state_id != _S_FORGOTTEN, f"{ts} depends on forgotten {dep}")
            _check(dep.dependents is not None and ts in dep.dependents,
                   f"{ts} missing from the dependents of {dep}")
        if ts.dependents is not None:
            _check(len(ts.dependents) > 0, f"{ts} has an empty dependents set")
            _check(len(set(ts.dependents)) == len(ts.dependents),
                   f"{ts} lists a dependent twice")
            n_active = 0
            for dts in ts.dependents:
                _check(ts in dts.dependencies, f"{dts} is a dependent of {ts} but not inverse")
                if _is_active(dts.state_id):
                    n_active += 1
            _check(ts.n_waiters == n_active,
                   f"{ts} counts {ts.n_waiters} waiters, {n_active} dependents are active")
        else:
            _check(ts.n_waiters == 0, f"{ts} has waiters but no dependents")
        if ts.who_wants is not None:
            _check(len(ts.who_wants) > 0, f"{ts} has an empty who_wants")
            for cs in ts.who_wants:
                _check(ts in cs.wants_what, f"{ts} wanted by {cs}, not in its wants_what")
        if state == _S_WAITING:
            n = len([dep for dep in ts.dependencies if dep.state_id != _S_MEMORY])
            _check(ts.n_waiting_on == n, f"{ts} waits on {ts.n_waiting_on}, {n} are missing")
            _check(all([dep.state_id != _S_ERRED for dep in ts.dependencies]),
                   f"{ts} waits on an erred dependency")
        if state == _S_PROCESSING:
            ws = ts.processing_on
            _check(ws is not None and ts in ws.processing, f"{ts} not on its worker")
            _check(all([dep.state_id == _S_MEMORY for dep in ts.dependencies]),
                   f"{ts} is processing without all its inputs")
        else:
            _check(ts.processing_on is None, f"{ts} has processing_on {ts.processing_on}")
        if state == _S_MEMORY:
            _check(ts.who_has is not None, f"{ts} is in memory nowhere")
            for ws in ts.who_has:
                _check(ts in ws.has_what, f"{ts} not in has_what of {ws}")
                _check(self.workers.get(ws.address) is ws
                       or self.departing.get(ws.address) is ws,
                       f"{ts} held by {ws}, neither registered nor departing")
        else:
            _check(ts.who_has is None, f"{ts} has holders while {ts.state}")
        if state == _S_QUEUED:
            _check(not ts.dependencies, f"{ts} is queued but has dependencies")
        if state == _S_NO_WORKER:
            _check(ts in self.unrunnable, f"{ts} is no-worker but not unrunnable")
        if state == _S_ERRED:
            _check(ts.error is not None, f"{ts} erred without an error")


def _zero_clock() -> float:
    """The clock of a core given none (both cores): always 0."""
    return 0.0


@cython.cfunc
def _prefix_figures(prefix: TaskPrefix) -> dict:
    counts = {}
    entered = {}
    i: cython.int
    for i in range(8):
        if i < 7:
            counts[TASK_STATES[i]] = prefix.counts[i]
        entered[TASK_STATES[i]] = prefix.totals[i]
    return {"tasks": prefix.n_tasks, "task_counts": counts, "tasks_entered": entered,
            "nbytes_in_memory": prefix.nbytes_in_memory}


@cython.cfunc
def _wants(ts: TaskState, cs: Optional[ClientState]) -> cython.bint:
    return cs is not None and ts.who_wants is not None and cs in ts.who_wants


@cython.cfunc
def _some(keys: list) -> str:
    """A few of ``keys`` for an error message."""
    if len(keys) <= 3:
        return bounded_repr(keys)
    return f"{bounded_repr(keys[:3])} and {len(keys) - 3} more"


def _priority_of(ts: TaskState) -> tuple:
    return (ts.priority_user, ts.generation, ts.order)


@cython.cfunc
@cython.boundscheck(False)  # every index is below len(heap)
@cython.wraparound(False)
def _heap_push(heap: list, ts: TaskState) -> None:
    """Add ``ts`` to a heap of tasks whose most urgent (`_urgency_cmp`) is ``heap[0]``.

    The heap holds the tasks themselves, 8 bytes a queued task; a heapq entry, a tuple of
    the task's priority with an int to break ties, took 152 (a million queued tasks, 145
    MiB). A task's priority never changes once it is made, so the order holds. Tasks of
    equal priority (a client gave them the same order) come out in no set order."""
    pos: cython.Py_ssize_t = len(heap)
    parent: cython.Py_ssize_t
    above: TaskState
    heap.append(ts)
    while pos > 0:
        parent = (pos - 1) >> 1
        above = heap[parent]
        if _urgency_cmp(ts, above) >= 0:
            break
        heap[pos] = above
        pos = parent
    heap[pos] = ts


@cython.cfunc
def _heap_pop(heap: list) -> TaskState:
    """Take the most urgent task off a heap `_heap_push` made (not empty)."""
    last: TaskState = heap.pop()
    if not heap:
        return last
    top: TaskState = heap[0]
    _sift_down(heap, 0, last)
    return top


@cython.cfunc
def _heapify(heap: list) -> None:
    """Make a list of tasks a heap, as `_heap_push` keeps it."""
    pos: cython.Py_ssize_t
    for pos in range(len(heap) // 2 - 1, -1, -1):
        _sift_down(heap, pos, heap[pos])


@cython.cfunc
@cython.boundscheck(False)  # every index is below len(heap)
@cython.wraparound(False)
def _sift_down(heap: list, pos: cython.Py_ssize_t, ts: TaskState) -> None:
    """Put ``ts`` at ``pos`` of the heap and move it down to where it belongs."""
    n: cython.Py_ssize_t = len(heap)
    child: cython.Py_ssize_t
    below: TaskState
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        below = heap[child]
        if child + 1 < n and _urgency_cmp(heap[child + 1], below) < 0:
            child += 1
            below = heap[child]
        if _urgency_cmp(below, ts) >= 0:
            break
        heap[pos] = below
        pos = child
    heap[pos] = ts


@cython.cfunc
def _urgency_cmp(a: TaskState, b: TaskState) -> cython.int:
    """Negative if ``a`` runs before ``b``, positive if after, 0 for the same priority."""
    if a.priority_user != b.priority_user:
        return -1 if a.priority_user < b.priority_user else 1
    if a.generation != b.generation:
        return -1 if a.generation < b.generation else 1
    if a.order != b.order:
        return -1 if a.order < b.order else 1
    return 0


def _check(condition, message) -> None:
    """Validation (both cores): InvariantError(message) unless ``condition``."""
    if not condition:
        raise InvariantError(message)


def _topological(entries: list, position: dict, known: TaskTable) -> list:
    """Order new task entries so dependencies come first; refuse a cycle."""
    n = len(entries)
    pending = [0] * n
    dependents = [[] for _ in range(n)]
    for i in range(n):
        for dep in dict.fromkeys(entries[i].get("deps") or ()):
            if not known.has(dep):
                j = position[dep]
                pending[i] += 1
                dependents[j].append(i)
    ready = [i for i in range(n) if pending[i] == 0]
    ordered = []
    while ready:
        i = ready.pop()
        ordered.append(entries[i])
        for j in dependents[i]:
            pending[j] -= 1
            if pending[j] == 0:
                ready.append(j)
    if len(ordered) < n:
        stuck = [entries[i]["key"] for i in range(n) if pending[i]][:5]
        raise GraphError(f"the graph has a cycle through {bounded_repr(stuck)}")
    return ordered
