"""Pickling a dask graph's nodes into run specs, for `dask_graphs.GraphPlan`: one by one
(`SpecPickler.dumps`), or a slice's together into one spec part
(`SpecPickler.dumps_together`, docs/protocol.md), by the compiled part writer
(`_part_writer`, two to three times as fast) where it is installed.

dask is optional: nothing here imports it at module import time.
"""
from __future__ import annotations

import copyreg
import io
import operator
import pickle
import types

import cloudpickle

try:
    from ._part_writer import PartWriter
except ImportError:  # installed without a C compiler: the standard pickler does it all
    PartWriter = None

_MISSING = object()


class SpecPickler:
    """Pickles nodes: the standard pickler when the result is usable on a worker,
    cloudpickle (by value) otherwise. Not thread-safe; one per graph.

    dask recognizes only its own futures as arguments of a task; ours, placed in a
    task's arguments as plain values (``delayed(f)(future)``, ``delayed(f)([future])``),
    cannot be pickled. Such a node is rebuilt with ``Alias(key)`` in place of each
    future (`_with_future_refs`) and `dumps` leaves those keys in ``found`` (else None):
    dependencies of the task that the original node did not list.
    """

    def __init__(self) -> None:
        names = ["__main__", *cloudpickle.list_registry_pickle_by_value()]
        self.markers = [name.encode() for name in names]
        self.count = 0
        self.by_value = 0
        self.found: list | None = None
        self._buffer = io.BytesIO()
        self._cloud = _CachingPickler(self._buffer)
        self._plain_buffer = io.BytesIO()
        self._plain = pickle.Pickler(self._plain_buffer, protocol=5)
        self._plain.dispatch_table = _slim_reducers()
        self._together_by_value = False  # a slice needed cloudpickle: the next ones too
        self._writer = _MISSING  # the part writer, made at the first slice

    def dumps(self, node) -> bytes:
        self.count += 1
        self.found = None
        if self.by_value > 64 and 2 * self.by_value > self.count:
            return self._by_value(node)  # most of this graph needs cloudpickle
        try:
            spec = _pickled(self._plain_buffer, self._plain, node)
        except Exception:  # noqa: BLE001 - lambdas, local functions, futures...
            return self._by_value(node)
        for marker in self.markers:
            if marker in spec:  # refers to __main__ or a by-value module: not importable
                return self._by_value(node)
        return spec

    def dumps_together(self, nodes: list) -> bytes | None:
        """``nodes`` in one pickle (their classes, functions and names pickled once,
        then referred to): by the standard pickler, or by cloudpickle if it refuses one
        of them or one refers to ``__main__`` or a by-value module (then at once for the
        graph's later slices). None if cloudpickle refuses too (our futures among a
        task's arguments: those nodes are pickled one by one, `dumps`).

        Where the compiled part writer is installed, it writes the pickle instead, the
        objects it does not know (functions, arrays...) pickled together by `_opaque`;
        if it fails (an object neither pickler takes), the pickler is tried as above."""
        blob = self._written(nodes)
        if blob is not None:
            return blob
        if not self._together_by_value:
            try:
                blob = _pickled(self._plain_buffer, self._plain, nodes)
            except Exception:  # noqa: BLE001 - lambdas, local functions, futures...
                blob = None
            if blob is not None and not any(marker in blob for marker in self.markers):
                return blob
            self._together_by_value = True
        try:
            return self._cloudpickle(nodes)
        except Exception:  # noqa: BLE001 - our futures among a task's arguments
            return None

    def _part_writer(self):
        """The compiled part writer, or None (not installed, or dask's node classes are
        not the ones it knows)."""
        if self._writer is _MISSING:
            try:
                self._writer = PartWriter(self._opaque) if PartWriter is not None else None
            except Exception:  # noqa: BLE001 - another dask: the pickler does it
                self._writer = None
        return self._writer

    def _written(self, nodes: list) -> bytes | None:
        """``nodes`` by the part writer, or None (none, or it could not write them)."""
        writer = self._part_writer()
        if writer is None:
            return None
        try:
            return writer.write(nodes)
        except Exception:  # noqa: BLE001 - the pickler's path says what it can do
            return None

    def _opaque(self, objects: list) -> bytes:
        """The objects of a part that the part writer does not write itself, pickled
        together (what they share stays shared): by the standard pickler, or by
        cloudpickle (by value) if that refuses one or one refers to ``__main__`` or a
        by-value module."""
        try:
            blob = _pickled(self._plain_buffer, self._plain, objects)
        except Exception:  # noqa: BLE001 - lambdas, local functions...
            return self._cloudpickle(objects)
        for marker in self.markers:
            if marker in blob:
                return self._cloudpickle(objects)
        return blob

    def _by_value(self, node) -> bytes:
        self.by_value += 1
        try:
            return self._cloudpickle(node)
        except Exception:
            found: list = []
            rebuilt = _with_future_refs(node, found)
            if not found:
                raise
            self.found = found
            return self._cloudpickle(rebuilt)

    def _cloudpickle(self, obj) -> bytes:
        return _pickled(self._buffer, self._cloud, obj)


def _pickled(buffer: io.BytesIO, pickler, obj) -> bytes:
    """``obj`` pickled by ``pickler`` (which writes to ``buffer``), on its own: the memo
    is empty before and emptied after (it holds every object pickled)."""
    buffer.seek(0)
    buffer.truncate()
    pickler.clear_memo()
    try:
        pickler.dump(obj)
    finally:
        pickler.clear_memo()
    return buffer.getvalue()


def _slim_reducers() -> dict:
    """A dispatch table (type -> reducer) for objects whose standard pickle carries
    bytes a worker does not need: a ``toolz.curry`` pickles its ``__dict__``, which
    dask.array's wrapped numpy functions (``ones_like``, ``full``...) fill with numpy's
    docstring: 2 KB in every such task's spec. Its reducer drops ``__doc__``, the only
    change being the docstring on the worker. A plain dict, copied from ``copyreg``'s
    table (which it replaces: numpy's ufuncs are registered there), so the pickler looks
    types up in C and other objects cost nothing more."""
    table = dict(copyreg.dispatch_table)
    try:
        from dask._task_spec import Task
    except ImportError:
        pass
    else:
        table[Task] = _TaskReducer(Task)
    try:
        from toolz.functoolz import curry
    except ImportError:
        return table
    table[curry] = _CurryWithoutDoc()
    return table


class _TaskReducer:
    """Reduces a dask ``Task`` (that exact type; its subclasses have state of their own)
    as pickle does by default, ``(copyreg.__newobj__, (Task,), state)``, with the state
    read by one C call (``operator.attrgetter`` of its slots) rather than by
    ``Task.__getstate__``'s generator: the same bytes, and a fused dask.array node (a
    task of tasks) pickles in about a fifth less time (17.5 against 22 us)."""

    def __init__(self, task_type) -> None:
        self._args = (task_type,)
        self._state = operator.attrgetter(*task_type.get_all_slots())

    def __call__(self, task):
        return copyreg.__newobj__, self._args, self._state(task)


class _CurryWithoutDoc:
    """Reduces a ``toolz.curry`` without its ``__doc__``; each curry once (the tasks of a
    layer share theirs), so a graph's pickler holds one of these."""

    def __init__(self) -> None:
        self._reduced: dict = {}  # id -> (curry, its reduction): the curry kept alive

    def __call__(self, curried):
        found = self._reduced.get(id(curried))
        if found is not None:
            return found[1]
        restore, state = curried.__reduce__()
        if len(state) >= 5 and type(state[4]) is tuple:  # else a toolz this does not know
            userdict = tuple(item for item in state[4] if item[0] != "__doc__")
            state = (*state[:4], userdict, *state[5:])
        self._reduced[id(curried)] = (curried, (restore, state))
        return restore, state


class _CachingPickler(cloudpickle.Pickler):
    """cloudpickle that pickles each function it must pickle by value (``__main__``,
    lambdas, by-value modules) once: later specs embed the same bytes, which the worker
    turns back into the function with ``pickle.loads``. A graph of 100,000 calls of a
    function defined in ``__main__`` pickles it once instead of 100,000 times."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=5)
        self._functions: dict = {}

    def reducer_override(self, obj):
        if type(obj) is not types.FunctionType:
            return super().reducer_override(obj)
        reduced = self._functions.get(obj, _MISSING)
        if reduced is _MISSING:
            if super().reducer_override(obj) is NotImplemented:
                reduced = NotImplemented  # importable: pickled by reference
            else:
                reduced = (pickle.loads, (cloudpickle.dumps(obj, protocol=5),))
            self._functions[obj] = reduced
        return reduced


def _is_future(obj) -> bool:
    return getattr(type(obj), "__dask_future__", False) is True and hasattr(obj, "key")


def _with_future_refs(obj, found: list):
    """``obj`` with every future (in task arguments, nested containers and tasks)
    replaced by ``Alias(key)``; the keys are appended to ``found``."""
    from dask._task_spec import Alias, GraphNode, Task, TaskRef, parse_input

    if _is_future(obj) and not isinstance(obj, TaskRef):
        found.append(obj.key)
        return Alias(obj.key)
    typ = type(obj)
    if typ in (list, tuple, set, frozenset):
        items = [_with_future_refs(item, found) for item in obj]
        if any(isinstance(item, GraphNode) for item in items):
            return parse_input(list(items) if typ is list else typ(items))
        return obj
    if typ is dict:
        values = {k: _with_future_refs(v, found) for k, v in obj.items()}
        return parse_input(values) if any(isinstance(v, GraphNode)
                                          for v in values.values()) else obj
    if isinstance(obj, Task):
        n = len(found)
        args = [_with_future_refs(a, found) for a in obj.args]
        kwargs = {k: _with_future_refs(v, found) for k, v in obj.kwargs.items()}
        if len(found) == n:
            return obj
        # a plain Task calling the same function (a container node's ``func`` builds
        # the container from its arguments)
        return Task(obj.key, obj.func, *args, _data_producer=obj.data_producer, **kwargs)
    return obj
