"""How user functions, task specs, results and errors become bytes, and back.

The scheduler never calls anything here: specs, results and errors pass through it as
opaque bytes. Clients and workers use cloudpickle (functions defined in ``__main__`` and
lambdas travel by value) with pickle protocol 5, so large buffers (numpy arrays, bytes)
travel out of band as separate frames instead of being copied into the pickle.

A task spec is any callable taking ``{dependency key: value}`` and returning the result:
``Call`` for ``submit``/``map``/``get`` tasks, or a dask task-spec node.
"""
from __future__ import annotations

import pickle
import sys
import traceback as traceback_module
import weakref
from typing import Any

import cloudpickle

#: Pickled buffers larger than this travel out of band.
OUT_OF_BAND_MIN_BYTES = 64 * 1024
#: Results whose pickle is at most this large ride along with the task-finished report.
INLINE_RESULT_MAX_BYTES = 1024
_INLINE_TYPES = (int, float, bool, type(None), str, bytes, complex)


class TaskRef:
    """A reference to another task's result inside a task's arguments."""

    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key

    def __reduce__(self):
        return (TaskRef, (self.key,))

    def __repr__(self):
        return f"TaskRef({self.key!r})"


def substitute(obj, data: dict):
    """Replace every TaskRef inside lists, tuples, sets and dicts of ``obj`` by its value."""
    typ = type(obj)
    if typ is TaskRef:
        return data[obj.key]
    if typ is tuple or typ is list or typ is set or typ is frozenset:
        return typ([substitute(item, data) for item in obj])
    if typ is dict:
        return {k: substitute(v, data) for k, v in obj.items()}
    if typ is Call:
        return obj(data)
    return obj


class Call:
    """``func(*args, **kwargs)``, with TaskRefs and nested Calls in the arguments;
    ``func`` itself may be a TaskRef (a function shared by many tasks)."""

    __slots__ = ("func", "args", "kwargs")

    def __init__(self, func, args: tuple = (), kwargs: dict | None = None):
        self.func = func
        self.args = args
        self.kwargs = kwargs or None

    def __call__(self, data: dict):
        func = self.func
        if type(func) is TaskRef:  # a function shared by the tasks of a map
            func = data[func.key]
        args = [substitute(a, data) for a in self.args] if self.args else ()
        if self.kwargs:
            return func(*args, **substitute(self.kwargs, data))
        return func(*args)

    def __reduce__(self):
        return (Call, (self.func, self.args, self.kwargs))

    def __repr__(self):
        name = getattr(self.func, "__name__", repr(self.func))
        return f"Call({name}, {len(self.args)} args)"


def dumps_spec(spec) -> bytes:
    """Pickle a task spec (functions by value where needed)."""
    return cloudpickle.dumps(spec, protocol=5)


def loads_spec(payload) -> Any:
    """Unpickle a task spec on a worker."""
    return pickle.loads(payload)


def dumps_data(value) -> list:
    """Pickle a result into frames: the pickle, then its large buffers (out of band)."""
    buffers: list = []

    def keep_large(buffer: pickle.PickleBuffer):
        if buffer.raw().nbytes >= OUT_OF_BAND_MIN_BYTES:
            buffers.append(buffer.raw())
            return False
        return True

    try:
        head = pickle.dumps(value, protocol=5, buffer_callback=keep_large)
    except Exception:
        buffers.clear()
        head = cloudpickle.dumps(value, protocol=5, buffer_callback=keep_large)
    return [head, *buffers]


def loads_data(frames) -> Any:
    """Rebuild a value from the frames that ``dumps_data`` made."""
    return pickle.loads(frames[0], buffers=frames[1:])


def dumps_inline_result(value) -> bytes | None:
    """A small result's pickle, to send along with the report; None if not small."""
    if type(value) not in _INLINE_TYPES:
        return None
    if type(value) in (str, bytes) and len(value) > INLINE_RESULT_MAX_BYTES:
        return None
    return pickle.dumps(value, protocol=5)


def sizeof(value) -> int:
    """An estimate of the memory a result holds, in bytes.

    pandas DataFrames, Series and Indexes without object columns, and the dict of
    frames a dask task shuffle's split makes (``ShuffleGroupResult``), are sized from
    their arrays' ``nbytes`` directly (`_pandas_size`): the figure ``dask.sizeof`` gives
    them, without the Series it builds per column. Other values, where dask is already
    imported (a worker running dask tasks), take ``dask.sizeof``: it knows containers
    and samples object columns, where ``sys.getsizeof`` of a DataFrame measures every
    string. Measured on the seed shuffle's pieces (273 rows, 5 columns, one of arrow
    strings): 10 us against dask.sizeof's 420 us, which made the size estimate take
    longer than the tasks themselves.
    """
    typ = type(value)
    if typ in _INLINE_TYPES:
        return sys.getsizeof(value)
    fast = _FAST_SIZES.get(typ, _MISSING)
    if fast is _MISSING:
        fast = _fast_size_for(typ)
    if fast is not None:
        size = fast(value)
        if size is not None:
            return size
    else:  # (a pandas object's nbytes leaves out what its object values point to)
        nbytes = getattr(value, "nbytes", None)
        if isinstance(nbytes, int):
            return nbytes
    if "dask" in sys.modules:
        try:
            from dask.sizeof import sizeof as dask_sizeof
        except ImportError:  # a broken or partial dask install: fall back
            pass
        else:
            return int(dask_sizeof(value))
    try:
        return sys.getsizeof(value)
    except TypeError:
        return 64


_MISSING = object()
#: type -> its cheap size function (None: none); filled as types are first seen.
_FAST_SIZES: dict = {}
#: dask adds this much per run of same-dtype columns (a block, here) and per Series.
_PANDAS_OVERHEAD = 1200
#: ... and this much per Index.
_INDEX_OVERHEAD = 400


def _fast_size_for(typ) -> Any:
    """The cheap size function for ``typ``, or None; remembered per type."""
    fast = None
    module = typ.__module__
    if (module == "pandas" or module.startswith("pandas.")) and "pandas" in sys.modules:
        import pandas as pd

        if typ is pd.DataFrame:
            fast = _frame_size
        elif typ is pd.Series:
            fast = _series_size
        elif issubclass(typ, pd.Index) and not issubclass(typ, pd.MultiIndex):
            fast = _index_size
    elif typ.__name__ == "ShuffleGroupResult" and issubclass(typ, dict):
        fast = _group_size
    _FAST_SIZES[typ] = fast
    return fast


def _array_bytes(values) -> int | None:
    """The bytes of one column's (or block's) array, None for object values (which
    dask samples)."""
    dtype = values.dtype
    if dtype.kind == "O" and (type(values).__module__ == "numpy"
                              or getattr(dtype, "storage", None) == "python"):
        return None
    return int(values.nbytes)


def _index_size(index) -> int | None:
    try:
        if type(index).__name__ == "RangeIndex":  # its _values would build the array
            return _INDEX_OVERHEAD + int(index.nbytes)
        size = _array_bytes(index._values)
    except Exception:  # noqa: BLE001 - an unusual index: dask.sizeof decides
        return None
    return None if size is None else _INDEX_OVERHEAD + size


#: (weak reference to the array of the last column labels sized, their size): the
#: frames a task makes from one frame share that array, and sizing arrow-backed labels
#: costs as much as a column.
_last_columns: tuple = (None, 0)


def _columns_size(columns) -> int | None:
    global _last_columns
    try:
        values = columns._values
    except AttributeError:
        return None
    ref, size = _last_columns
    if ref is not None and ref() is values:
        return size
    size = _index_size(columns)
    if size is not None:
        try:
            _last_columns = (weakref.ref(values), size)
        except TypeError:  # not weakly referenceable
            pass
    return size


def _frame_size(frame) -> int | None:
    """A DataFrame's bytes: its blocks' arrays, index and column labels, plus dask's
    per-block overhead. None (dask.sizeof decides) for object columns or anything
    unexpected."""
    try:
        total = 0
        for block in frame._mgr.blocks:
            size = _array_bytes(block.values)
            if size is None:
                return None
            total += size + _PANDAS_OVERHEAD
        index = _index_size(frame.index)
        columns = _columns_size(frame.columns)
    except Exception:  # noqa: BLE001 - pandas internals changed: dask.sizeof decides
        return None
    if index is None or columns is None:
        return None
    return max(_PANDAS_OVERHEAD, total + index + columns)


def _series_size(series) -> int | None:
    try:
        size = _array_bytes(series._values)
    except Exception:  # noqa: BLE001
        return None
    index = _index_size(series.index)
    if size is None or index is None:
        return None
    return _PANDAS_OVERHEAD + size + index


def _group_size(group: dict) -> int:
    """dask's ShuffleGroupResult (its shuffle's split: a few dozen frames by output
    partition): the dict and every key and frame, as its own ``__sizeof__`` counts."""
    total = dict.__sizeof__(group)
    for key, frame in group.items():
        total += sizeof(key) + sizeof(frame)
    return total


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised on a worker."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self):
        return self.text


def dumps_error(exc: BaseException) -> tuple[bytes, bytes, str]:
    """``(pickled exception, traceback text as bytes, short text)`` for a failed task."""
    text = f"{type(exc).__name__}: {exc}"
    tb_text = "".join(traceback_module.format_exception(type(exc), exc, exc.__traceback__))
    try:
        payload = cloudpickle.dumps(exc, protocol=5)
        pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        payload = cloudpickle.dumps(RuntimeError(text), protocol=5)
    return payload, tb_text.encode(), text


def loads_error(exception: bytes | None, traceback: bytes | None, text: str) -> BaseException:
    """The original exception, with the remote traceback attached as its cause."""
    exc: BaseException
    if exception is None:
        exc = RuntimeError(text)
    else:
        try:
            exc = pickle.loads(exception)
        except Exception:
            exc = RuntimeError(text)
    if traceback:
        exc.__cause__ = RemoteTraceback("\n\nRemote traceback:\n" + bytes(traceback).decode())
    return exc
