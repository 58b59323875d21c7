"""Task specs: how `Client.submit`, `Client.map` and `Client.get` turn calls into task dicts.

What this module does
---------------------
The worker runs ``pickle.loads(spec)(deps)`` and gets ``Call(func, args, kwargs)``. `map`
pickles the function once (cloudpickle: by value where needed; `_PickledFunction`). When
the arguments are builtin scalars, containers of them, and futures (`_ArgWalker`), each
task's spec is that pickle's fixed opening followed by the standard pickle of its
arguments, so the per-task cost is one small ``pickle.dumps`` instead of a cloudpickle of
the whole call (which pickles a function defined in ``__main__`` by value every time).
Other arguments go through cloudpickle. `submit` builds its spec the same way
(`TaskEncoder`), so ``submit(f, x)`` and ``map(f, [x])`` give the same key. A pure task's
key is ``f"{funcname}-{blake2b(spec)}"``. Specs larger than `SPEC_BLOB_BYTES` travel as an
out-of-band `Blob` (`wire_spec`). Without dask, `Client.get` converts dict graphs of
``(func, *args)`` tuples with `LegacyGraph`.

A future in a task's arguments becomes a ``TaskRef`` to its key (a dependency); this
module knows futures (`distributed_server.client.futures`) and their `FutureClient`, but not
the client.
"""
from __future__ import annotations

import functools
import hashlib
import pickle
import struct
import uuid
from collections.abc import Callable, Iterator

from ..comm import Blob
from ..protocol.serialize import Call, TaskRef, dumps_spec
from .futures import CANCELLED, CancelledError, Future, FutureClient

#: Task specs larger than this travel as an out-of-band Blob.
SPEC_BLOB_BYTES = 64 * 1024
#: In `map`, a constant argument (the same object in every task, or a ``map``
#: keyword) whose pickle is at least this large is sent once, as a task of its own that
#: every task depends on (`MapEncoder`).
SHARE_MIN_BYTES = 512
#: The same for the function, once its pickle is this large: a closure or partial
#: carrying data. A plain function pickled by value (``__main__``, a lambda) is
#: 300-1,500 bytes and stays in every spec: shared, it would be a task of its own that
#: users see in their task counts, progress bars and reports (the worker's cost of
#: rebuilding it, ~8 us a task, is what that leaves unsaved).
SHARE_FUNCTION_MIN_BYTES = 2048


_ATOMIC = frozenset({int, float, complex, bool, str, bytes, type(None), TaskRef})
SEQUENCES = (tuple, list, set, frozenset)


class _PickledFunction:
    """A function pickled once; each task's spec embeds these bytes.

    Pickled inside a spec it is ``pickle.loads(payload)``, so the worker gets the function
    back with nothing of this module needed on its side.
    """

    __slots__ = ("payload",)

    def __init__(self, func: Callable) -> None:
        self.payload = dumps_spec(func)

    def __reduce__(self):
        return (pickle.loads, (self.payload,))

    def spec_head(self) -> bytes:
        """The opening of ``pickle.dumps(Call(self, args, kwargs))``, up to ``args``.

        Protocol-3 opcodes: PROTO 3, GLOBAL Call, GLOBAL pickle.loads, BINBYTES payload,
        TUPLE1, REDUCE. It writes nothing to the memo, so pickles of ``args`` and
        ``kwargs`` made separately (each numbering its memo from 0, and reading only
        what it wrote) may follow it: see `_plain_spec_body`.
        """
        loads = pickle.loads
        return _call_head(b"".join([
            f"c{loads.__module__}\n{loads.__name__}\n".encode(),
            b"B", struct.pack("<I", len(self.payload)), self.payload, b"\x85R",
        ]))


def _call_head(func_ops: bytes) -> bytes:
    """PROTO 3, GLOBAL Call, then ``func_ops`` (opcodes pushing the function, no memo)."""
    return b"".join([b"\x80\x03", f"c{Call.__module__}\n{Call.__qualname__}\n".encode(),
                     func_ops])


def _shared_function_head(key: str) -> bytes:
    """The opening of ``pickle.dumps(Call(TaskRef(key), args, kwargs))`` up to ``args``:
    the worker finds the function among the task's dependencies (`Call.__call__`)."""
    encoded = key.encode()
    return _call_head(b"".join([
        f"c{TaskRef.__module__}\n{TaskRef.__qualname__}\n".encode(),
        b"X", struct.pack("<I", len(encoded)), encoded, b"\x85R"]))


def _pickle_segment(obj) -> bytes:
    """``obj``'s protocol-3 pickle without PROTO and STOP: opcodes that push ``obj``."""
    return pickle.dumps(obj, protocol=3)[2:-1]


def _plain_spec_body(args: tuple, kwargs: dict | None) -> bytes:
    """What follows `_PickledFunction.spec_head`: args, kwargs, TUPLE3, REDUCE, STOP."""
    kwargs_ops = _pickle_segment(kwargs) if kwargs else b"N"
    return b"".join([_pickle_segment(args), kwargs_ops, b"\x87R."])


class _ArgWalker:
    """Replaces this client's futures in nested tuples, lists, sets and dicts by TaskRefs.

    Collects their keys in ``deps`` and clears ``plain`` on meeting anything that is not
    a builtin scalar, a container of those, or a future: only plain arguments may be
    pickled with the standard pickler (which would pickle ``__main__`` objects by
    reference, useless on a worker).
    """

    __slots__ = ("client", "deps", "plain")

    def __init__(self, client: FutureClient) -> None:
        self.client = client
        self.deps: list = []
        self.plain = True

    def walk(self, obj):
        typ = type(obj)
        if typ in _ATOMIC:
            return obj
        if typ in SEQUENCES:
            return typ([self.walk(item) for item in obj])
        if typ is dict:
            if not all(type(k) in _ATOMIC for k in obj):
                self.plain = False
            return {k: self.walk(v) for k, v in obj.items()}
        if isinstance(obj, Future):
            return self._reference(obj)
        self.plain = False
        return obj

    def _reference(self, future: Future) -> TaskRef:
        if future.client is not self.client:
            raise ValueError(f"{future!r} belongs to another client")
        if future.status == CANCELLED:
            raise CancelledError(f"{future.key!r} was cancelled; it cannot be an argument")
        self.deps.append(future.key)
        return TaskRef(future.key)


def _funcname(func) -> str:
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__name__", None) or type(func).__name__
    return "lambda" if name == "<lambda>" else name


def key_digest(*buffers) -> str:
    h = hashlib.blake2b(digest_size=16)
    for buffer in buffers:
        h.update(buffer)
    return h.hexdigest()


def wire_spec(spec: bytes):
    return Blob(spec) if len(spec) > SPEC_BLOB_BYTES else spec


def task_options(retries, priority, workers, resources, allow_other_workers) -> dict:
    """The optional task dict fields that differ from their defaults."""
    options: dict = {}
    if priority:
        options["priority"] = int(priority)
    if retries:
        options["retries"] = int(retries)
    if workers:
        options["workers"] = [workers] if isinstance(workers, str) else list(workers)
        if allow_other_workers:
            options["allow_other_workers"] = True
    if resources:
        options["resources"] = dict(resources)
    return options


class TaskEncoder:
    """Turns calls of one function into task dicts; the function is pickled once.

    Plain arguments (see `_ArgWalker`) take the fast path: the spec is the function's
    pickled head plus the arguments' standard pickle, and a pure key hashes the head
    once. Other arguments are pickled with cloudpickle, task by task. Either way the
    spec unpickles to ``Call(func, args, kwargs)`` (``func`` a TaskRef to the function's
    shared task once `share_function` was called) and a pure key is
    ``f"{prefix}-{blake2b(spec)}"``.
    """

    def __init__(self, client: FutureClient, func: Callable, pure: bool, options: dict,
                 prefix: str | None = None) -> None:
        if not callable(func):
            raise TypeError(f"{func!r} is not callable")
        self.client = client
        self.func = _PickledFunction(func)
        self.head = self.func.spec_head()
        self.head_hash = hashlib.blake2b(self.head, digest_size=16)
        self.prefix = prefix or _funcname(func)
        self.pure = pure
        self.options = options
        #: Keys of shared values (`MapEncoder`) every task of this encoder depends on.
        self.shared_deps: tuple = ()
        #: What a spec calls: the function, or a reference to its shared task.
        self.callee = self.func

    def share_function(self, key: str) -> None:
        """Tasks from now on find the function under ``key`` among their dependencies
        (`MapEncoder` adds the key to `shared_deps`)."""
        self.head = _shared_function_head(key)
        self.head_hash = hashlib.blake2b(self.head, digest_size=16)
        self.callee = TaskRef(key)

    def task(self, args: tuple, kwargs: dict | None, key=None) -> dict:
        walker = _ArgWalker(self.client)
        args = tuple([walker.walk(a) for a in args])
        kwargs = walker.walk(kwargs) if kwargs else None
        if self.shared_deps:
            walker.deps.extend(self.shared_deps)
        if walker.plain:
            body = _plain_spec_body(args, kwargs)
            spec = self.head + body
            if key is None and self.pure:
                digest = self.head_hash.copy()
                digest.update(body)
                key = f"{self.prefix}-{digest.hexdigest()}"
        else:
            spec = dumps_spec(Call(self.callee, args, kwargs))
            if key is None and self.pure:
                key = f"{self.prefix}-{key_digest(spec)}"
        if key is None:
            key = f"{self.prefix}-{uuid.uuid4().hex}"
        task = {"key": key, "spec": wire_spec(spec)}
        if walker.deps:
            task["deps"] = walker.deps
        if self.options:
            task.update(self.options)
        return task


_NEVER_SHARED = frozenset({int, float, complex, bool, type(None), TaskRef})
#: Argument types whose tasks take `MapEncoder`'s fast path (the standard pickler is
#: right for them and they hold no futures).
_FAST = frozenset({int, float, complex, bool, str, bytes, type(None), TaskRef})


class MapEncoder:
    """The tasks of one `Client.map` call: shared values first, then one task per row.

    Sharing: with at least two tasks, the function (if its pickle is at least
    `SHARE_FUNCTION_MIN_BYTES`), and every argument column that holds one and the same
    object in every row and every ``map`` keyword argument (the same in every task by
    definition) whose pickle is at least `SHARE_MIN_BYTES` are each pickled once into a
    task of their own, ``shared-<type>-<hash of the pickle>``, which computes the value
    (``Call(_identity, (value,))``). The tasks refer to it by a TaskRef and depend on it,
    so it travels to the scheduler once, is decoded once per worker (a worker that did
    not compute it fetches the value like any dependency) and lives on the workers
    only while tasks that need it are held. `shared` lists these tasks: the caller
    sends them first and wants them until the last batch of the map is sent.

    Rows whose arguments are builtin scalars, str, bytes or shared references take the
    fast path (one ``pickle.dumps`` of the row per task, no per-argument walk); others
    go through `TaskEncoder.task`.
    """

    def __init__(self, encoder: TaskEncoder, columns: list, n: int,
                 kwargs: dict | None) -> None:
        self.encoder = encoder
        self.columns = columns
        self.n = n
        self.kwargs = kwargs or None
        self.shared: list[dict] = []
        if n > 1:
            self._share()

    def _share(self) -> None:
        encoder = self.encoder
        payload = encoder.func.payload
        if len(payload) >= SHARE_FUNCTION_MIN_BYTES:
            spec = pickle.dumps(Call(_identity, (encoder.func,)), protocol=5)
            key = self._shared_task(f"shared-{encoder.prefix}", spec)
            encoder.share_function(key)
        for i, column in enumerate(self.columns):
            first = column[0]
            if type(first) in _NEVER_SHARED or not _all_same(column, first):
                continue
            ref = self._share_value(first)
            if ref is not None:
                self.columns[i] = [ref] * self.n
        if self.kwargs:
            kwargs = dict(self.kwargs)
            for name, value in kwargs.items():
                if type(value) not in _NEVER_SHARED:
                    ref = self._share_value(value)
                    if ref is not None:
                        kwargs[name] = ref
            self.kwargs = kwargs

    def _share_value(self, value) -> TaskRef | None:
        """A reference to a shared task computing ``value``, or None (too small, or it
        holds futures: those stay dependencies of each task)."""
        walker = _ArgWalker(self.encoder.client)
        walker.walk(value)
        if walker.deps:
            return None
        spec = dumps_spec(Call(_identity, (value,)))
        if len(spec) < SHARE_MIN_BYTES:
            return None
        return TaskRef(self._shared_task(f"shared-{type(value).__name__}", spec))

    def _shared_task(self, prefix: str, spec: bytes) -> str:
        key = f"{prefix}-{key_digest(spec)}"
        if all(task["key"] != key for task in self.shared):
            self.shared.append({"key": key, "spec": wire_spec(spec)})
            self.encoder.shared_deps += (key,)
        return key

    def batches(self, keys: list | None, step: int) -> Iterator[list[dict]]:
        """The tasks, ``step`` rows at a time, in order (``keys``: the caller's keys, or
        None). Each batch is built when it is asked for, so the first can be sent (and
        run) before the last is built: a map of ten million rows sent its first task
        after 23 s when every task was built first."""
        fast = self._fast()
        if keys is None and not self.encoder.pure:
            # one token per map, then the index: the scheduler keeps neighbouring
            # indexes together (distributed_core.TaskTable)
            token = uuid.uuid4().hex
            prefix = f"{self.encoder.prefix}-{token}-"
            keys = _IndexKeys(prefix)
        for start in range(0, self.n, step):
            stop = min(start + step, self.n)
            rows = zip(*[column[start:stop] for column in self.columns])
            batch_keys = None if keys is None else keys[start:stop]
            yield self._fast_tasks(rows, batch_keys) if fast else \
                self._slow_tasks(rows, batch_keys)

    def _slow_tasks(self, rows, keys: list | None) -> list[dict]:
        encoder, kwargs = self.encoder, self.kwargs
        if keys is None:
            return [encoder.task(args, kwargs) for args in rows]
        return [encoder.task(args, kwargs, key) for args, key in zip(rows, keys)]

    def _fast_tasks(self, rows, keys: list | None) -> list[dict]:
        encoder, kwargs = self.encoder, self.kwargs
        tail = (_pickle_segment(kwargs) if kwargs else b"N") + b"\x87R."
        head, head_hash, prefix = encoder.head, encoder.head_hash, encoder.prefix
        deps = list(encoder.shared_deps)
        options = encoder.options
        dumps, limit = pickle.dumps, SPEC_BLOB_BYTES
        out = []
        append = out.append
        for i, args in enumerate(rows):
            body = dumps(args, 3)[2:-1] + tail
            spec = head + body
            if keys is not None:
                key = keys[i]
            else:
                digest = head_hash.copy()
                digest.update(body)
                key = f"{prefix}-{digest.hexdigest()}"
            task = {"key": key, "spec": spec if len(spec) <= limit else Blob(spec)}
            if deps:
                task["deps"] = deps
            if options:
                task.update(options)
            append(task)
        return out

    def _fast(self) -> bool:
        for column in self.columns:
            if not set(map(type, column)) <= _FAST:
                return False
        if self.kwargs:
            walker = _ArgWalker(self.encoder.client)
            walker.walk(self.kwargs)
            return walker.plain and not walker.deps
        return True


class _IndexKeys:
    """The keys ``<prefix><i>`` of a map's rows, made a slice at a time."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __getitem__(self, rows: slice) -> list[str]:
        prefix = self.prefix
        return [f"{prefix}{i}" for i in range(rows.start, rows.stop)]


def _all_same(column: list, first) -> bool:
    """Whether every item of ``column`` is ``first`` itself (identity, not equality)."""
    if column[-1] is not first or column[len(column) // 2] is not first:
        return False
    return len(set(map(id, column))) == 1


def map_columns(iterables) -> tuple[list, int]:
    """``map``'s arguments as columns of equal length (zip's: the shortest), and that
    length."""
    if not iterables:
        return [], 0
    if all(hasattr(it, "__len__") and hasattr(it, "__getitem__") for it in iterables):
        n = min(len(it) for it in iterables)
        return [it if type(it) is list and len(it) == n else list(it)[:n]
                for it in iterables], n
    rows = list(zip(*iterables))
    return [list(column) for column in zip(*rows)] or [[] for _ in iterables], len(rows)


def _identity(value):
    """The spec of a legacy graph entry that is a literal or an alias of another key."""
    return value


class LegacyGraph:
    """Converts a dict graph of ``(func, *args)`` tuples into Call/TaskRef task specs.

    An argument that is a key of the graph becomes a TaskRef (a dependency); a tuple
    starting with a callable is a nested task; lists are walked; anything else is a
    literal. An entry that is not a task (a literal, an alias, a list of keys) becomes a
    Call of `_identity`.
    """

    def __init__(self, graph: dict) -> None:
        self.graph = graph

    def tasks(self, options: dict) -> list[dict]:
        out = []
        for key, value in self.graph.items():
            deps: list = []
            spec = self._convert(value, deps)
            if type(spec) is not Call:
                spec = Call(_identity, (spec,))
            task = {"key": key, "spec": wire_spec(dumps_spec(spec)), **options}
            if deps:
                task["deps"] = deps
            out.append(task)
        return out

    def _convert(self, obj, deps: list):
        if self._is_key(obj):
            deps.append(obj)
            return TaskRef(obj)
        typ = type(obj)
        if typ is tuple and obj and callable(obj[0]):
            return Call(obj[0], tuple([self._convert(a, deps) for a in obj[1:]]))
        if typ is list:
            return [self._convert(item, deps) for item in obj]
        return obj

    def _is_key(self, obj) -> bool:
        if type(obj) not in (str, int, float, tuple):
            return False
        try:
            return obj in self.graph
        except TypeError:  # a tuple holding something unhashable
            return False


def flatten_keys(keys) -> list:
    if type(keys) is list:
        return [k for item in keys for k in flatten_keys(item)]
    return [keys]
