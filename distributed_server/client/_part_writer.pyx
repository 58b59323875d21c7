# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A slice of dask task-spec nodes written as one pickle, without the pickler's Python
callbacks (compiled only: an install without a C compiler goes without it and
`spec_pickler.SpecPickler` pickles the slice with the standard pickler).

What the standard pickler costs here (a fused dask.array node, 86 B of pickle): about
5 us, most of it calling back into Python (dask's ``Task.__getstate__`` and each
``Alias.__reduce__``, ``DataNode.__reduce__``) and memoizing every tuple.
`PartWriter.write` walks the nodes in C and writes pickle opcodes (protocol 5) itself: what
``pickle.loads`` makes of its output is what it makes of the standard pickle (the same
classes, built the same way: ``Task`` by ``__new__`` and ``__setstate__`` of its slots,
``Alias``/``DataNode``/``TaskRef`` by calling them), so workers need nothing new.

Written natively: dask's ``Task`` (that exact type), ``List``, ``Tuple``, ``Set``,
``Dict``, ``Alias``, ``DataNode``, ``TaskRef``; ``None``, booleans, ``int`` (64 bits),
``float``, ``str``, ``bytes``, ``tuple``, ``list``, ``dict``, ``set``, ``frozenset``,
``slice``. Strings are written once per part and referred to after. Lists, dicts and sets
are shared as in the standard pickle (one object met twice is one object when loaded),
and so are the objects that could be large or nested: Tasks inside other nodes, tuples
of more than four items or holding more than scalars, frozensets of more than eight,
bytes of 64 or more. A dask key (a tuple of a string and an int) or a small frozenset of
them is written again where it is met again: immutable and small, and looking it up
would cost more than writing it.

Anything else (functions, numpy dtypes and arrays, classes, other node types) is
"opaque". A part's opaque objects are pickled together, in one list, by
``opaque(objects)`` (the caller decides how: the standard pickler or cloudpickle), so
that what they share is shared once loaded (a bound method's instance, a function by
value inside many partials). That pickle comes first in the part (``pickle.loads`` of
it, memo 0) and an opaque object is ``operator.getitem`` of that list (memoized).
Objects shared between an opaque object's insides and natively written containers are
not shared once loaded. ``opaque`` may raise: `PartWriter.write` then raises too, and the
caller pickles the slice another way.
"""
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy, memset

cdef extern from "Python.h":
    # declared here: Cython before 3.0.7 declares it without "except NULL", and a string
    # with a lone surrogate then read from NULL instead of raising UnicodeEncodeError
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL

cdef int _MAX_DEPTH = 200  # deeper: an error (the caller falls back to the pickler)

# opcodes of pickle's protocols 2 to 5 (Lib/pickletools.py documents each)
cdef enum:
    PROTO = 0x80
    STOP = 0x2e            # .
    MARK = 0x28            # (
    EMPTY_LIST = 0x5d      # ]
    APPENDS = 0x65         # e
    EMPTY_TUPLE = 0x29     # )
    TUPLE = 0x74           # t
    TUPLE1 = 0x85
    TUPLE2 = 0x86
    TUPLE3 = 0x87
    EMPTY_DICT = 0x7d      # }
    SETITEMS = 0x75        # u
    EMPTY_SET = 0x8f
    ADDITEMS = 0x90
    FROZENSET = 0x91
    NONE = 0x4e            # N
    NEWTRUE = 0x88
    NEWFALSE = 0x89
    BININT1 = 0x4b         # K
    BININT2 = 0x4d         # M
    BININT = 0x4a          # J
    LONG1 = 0x8a
    BINFLOAT = 0x47        # G
    SHORT_BINUNICODE = 0x8c
    BINUNICODE8 = 0x8d
    SHORT_BINBYTES = 0x43  # C
    BINBYTES8 = 0x8e
    MEMOIZE = 0x94
    BINGET = 0x68          # h
    LONG_BINGET = 0x6a     # j
    NEWOBJ = 0x81
    BUILD = 0x62           # b
    REDUCE = 0x52          # R
    STACK_GLOBAL = 0x93
    POP = 0x30             # 0

cdef int _SHORT_STRING = 4  # shorter strings are written in place, not memoized
cdef int _SHARED_BYTES = 64  # bytes objects this long or longer are memoized
cdef int _SHARED_FROZENSET = 8  # frozensets longer than this are memoized
cdef enum:
    _SEEN_SLOTS = 512  # the seen cache's size (a power of two)

cdef int _OPAQUE_LIST = 0  # memo index of the list of opaque objects
cdef int _GETITEM = 1  # memo index of operator.getitem


cdef class _Buffer:
    """A growable byte buffer."""
    cdef unsigned char* data
    cdef Py_ssize_t size, capacity

    def __cinit__(self):
        self.capacity = 1 << 16
        self.data = <unsigned char*>PyMem_Malloc(self.capacity)
        if self.data == NULL:
            raise MemoryError()
        self.size = 0

    def __dealloc__(self):
        PyMem_Free(self.data)

    cdef inline int reserve(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t want = self.size + n
        cdef unsigned char* grown
        if want <= self.capacity:
            return 0
        while self.capacity < want:
            self.capacity *= 2
        grown = <unsigned char*>PyMem_Realloc(self.data, self.capacity)
        if grown == NULL:
            raise MemoryError()
        self.data = grown
        return 0

    cdef inline int byte(self, unsigned char b) except -1:
        self.reserve(1)
        self.data[self.size] = b
        self.size += 1
        return 0

    cdef inline int uint(self, uint64_t value, int n) except -1:
        """``value`` in ``n`` bytes, little-endian."""
        cdef int i
        self.reserve(n)
        for i in range(n):
            self.data[self.size + i] = (value >> (8 * i)) & 0xff
        self.size += n
        return 0

    cdef inline int raw(self, const char* src, Py_ssize_t n) except -1:
        self.reserve(n)
        memcpy(self.data + self.size, src, n)
        self.size += n
        return 0


cdef class PartWriter:
    """Writes lists of nodes as pickles (`write`); one per graph (it holds dask's node
    classes and each class's slots), not thread-safe."""

    cdef _Buffer buf
    cdef Py_ssize_t memo  # the next memo index
    cdef dict strings  # str -> memo index
    cdef dict by_id  # id(obj) -> memo index of the objects shared (see the module doc)
    cdef list alive  # the objects whose ids are in by_id, until the part is written
    cdef list opaques  # the part's opaque objects, in the order of their indices
    cdef object opaque
    cdef object task_type, alias_type, datanode_type, taskref_type
    cdef object task_state  # attrgetter of all of Task's slots
    cdef Py_ssize_t task_args, task_kwargs  # the indices of "args" and "kwargs" in them
    cdef dict containers  # List/Tuple/Set/Dict type -> (attrgetter of slots, kwargs index)
    # The seen cache: the objects last found in (or put in) by_id and strings, by
    # address, with their memo indices. A slice's nodes meet the same few objects again
    # and again (their function, dask's classes, their keys' name), and a dict lookup
    # costs ten times this check. Every object in it is kept alive (by alive or strings)
    # until the part is written, so no other object can take its address meanwhile.
    cdef void* seen_objects[_SEEN_SLOTS]
    cdef Py_ssize_t seen_indices[_SEEN_SLOTS]

    def __init__(self, opaque):
        from operator import attrgetter

        from dask._task_spec import Alias, DataNode, Dict, List, Set, Task, TaskRef
        from dask._task_spec import Tuple as TupleNode

        self.opaque = opaque
        self.task_type = Task
        self.alias_type = Alias
        self.datanode_type = DataNode
        self.taskref_type = TaskRef
        slots = list(Task.get_all_slots())
        self.task_state = attrgetter(*slots)
        self.task_args = slots.index("args")
        self.task_kwargs = slots.index("kwargs")
        self.containers = {}
        for kind in (List, TupleNode, Set, Dict):
            slots = kind.get_all_slots()
            self.containers[kind] = (attrgetter(*slots), list(slots).index("kwargs"))

    def write(self, list nodes):
        """``nodes`` as the pickle of one list (`pickle.loads` gives it back)."""
        cdef object node
        cdef _Buffer head
        cdef bytes opaque_pickle
        cdef bytes out
        self.buf = _Buffer()
        self.memo = 2  # 0: the list of opaque objects, 1: operator.getitem (the head)
        self.strings = {}
        self.by_id = {}
        self.alive = []
        self.opaques = []
        memset(self.seen_objects, 0, sizeof(self.seen_objects))
        try:
            self.buf.byte(EMPTY_LIST)
            self._memoize()
            if nodes:
                self.buf.byte(MARK)
                for node in nodes:
                    self._save(node, 0)
                self.buf.byte(APPENDS)
            self.buf.byte(STOP)
            opaque_pickle = self.opaque(self.opaques)
            head = _Buffer()
            head.byte(PROTO)
            head.byte(5)
            _global(head, b"pickle", b"loads")
            _bytes(head, opaque_pickle)
            head.byte(TUPLE1)
            head.byte(REDUCE)
            head.byte(MEMOIZE)  # _OPAQUE_LIST
            head.byte(POP)
            _global(head, b"operator", b"getitem")
            head.byte(MEMOIZE)  # _GETITEM
            head.byte(POP)
            out = PyBytes_FromStringAndSize(NULL, head.size + self.buf.size)
            memcpy(<char*>out, head.data, head.size)
            memcpy((<char*>out) + head.size, self.buf.data, self.buf.size)
            return out
        finally:
            self.buf = None
            self.strings = None
            self.by_id = None
            self.alive = None
            self.opaques = None

    cdef inline int _memoize(self) except -1:
        self.buf.byte(MEMOIZE)
        self.memo += 1
        return 0

    cdef inline int _get(self, Py_ssize_t index) except -1:
        if index < 256:
            self.buf.byte(BINGET)
            self.buf.byte(<unsigned char>index)
        else:
            self.buf.byte(LONG_BINGET)
            self.buf.uint(<uint64_t>index, 4)
        return 0

    cdef int _save(self, object obj, int depth) except -1:
        cdef type kind = type(obj)
        if depth > _MAX_DEPTH:
            raise RecursionError("a task spec nested too deeply for the part writer")
        if obj is None:
            return self.buf.byte(NONE)
        if kind is str:
            return self._save_str(<str>obj)
        if kind is tuple:
            return self._save_shared_tuple(<tuple>obj, depth)
        if kind is int:
            return self._save_int(obj)
        if kind is bool:
            return self.buf.byte(NEWTRUE if obj else NEWFALSE)
        if kind is self.task_type:
            if depth:  # a Task inside a node: dask's fusion may share it among nodes
                if self._refer(obj):
                    return 0
                self._save_task(obj, depth)
                return self._remember(obj)
            return self._save_task(obj, depth)
        if kind is self.alias_type:
            return self._save_call(self.alias_type, (obj.key, obj.target), depth)
        if kind is self.datanode_type:
            return self._save_call(self.datanode_type, (obj.key, obj.value), depth)
        if kind is self.taskref_type:
            return self._save_call(self.taskref_type, (obj.key,), depth)
        if kind is dict:
            return self._save_dict(<dict>obj, depth)
        if kind is list:
            return self._save_list(<list>obj, depth)
        if kind is frozenset:
            return self._save_frozenset(<frozenset>obj, depth)
        if kind is float:
            return self._save_float(<double>obj)
        if kind is bytes:
            if len(<bytes>obj) < _SHARED_BYTES:
                return _bytes(self.buf, <bytes>obj)
            if self._refer(obj):
                return 0
            _bytes(self.buf, <bytes>obj)
            return self._remember(obj)
        if kind is set:
            return self._save_set(<set>obj, depth)
        if kind is slice:
            return self._save_call(slice, (obj.start, obj.stop, obj.step), depth)
        if kind in self.containers:
            return self._save_container(obj, kind, depth)
        return self._save_opaque(obj)

    cdef int _save_str(self, str text) except -1:
        cdef Py_ssize_t n
        cdef const char* utf8
        cdef Py_ssize_t slot = _slot(<void*>text)
        if self.seen_objects[slot] == <void*>text:
            return self._get(self.seen_indices[slot])
        found = self.strings.get(text)
        if found is not None:
            self.alive.append(text)  # an equal string's index: keep this one's address
            self._cache(<void*>text, <Py_ssize_t>found)
            return self._get(<Py_ssize_t>found)
        utf8 = PyUnicode_AsUTF8AndSize(text, &n)  # raises for lone surrogates
        if n < 256:
            self.buf.byte(SHORT_BINUNICODE)
            self.buf.byte(<unsigned char>n)
        else:
            self.buf.byte(BINUNICODE8)
            self.buf.uint(<uint64_t>n, 8)
        self.buf.raw(utf8, n)
        if len(text) >= _SHORT_STRING:
            self.strings[text] = self.memo  # which keeps it alive
            self._cache(<void*>text, self.memo)
            self._memoize()
        return 0

    cdef int _save_int(self, object value) except -1:
        cdef int64_t v
        cdef int n
        try:
            v = value
        except OverflowError:
            return self._save_opaque(value)
        if 0 <= v < 256:
            self.buf.byte(BININT1)
            self.buf.byte(<unsigned char>v)
        elif 0 <= v < 65536:
            self.buf.byte(BININT2)
            self.buf.uint(<uint64_t>v, 2)
        elif -2147483648 <= v <= 2147483647:
            self.buf.byte(BININT)
            self.buf.uint(<uint64_t>v & 0xffffffff, 4)
        else:  # two's complement, little-endian, in as few bytes as keep the sign
            n = 8
            while n > 1 and ((v >> (8 * (n - 1) - 1)) == 0 or (v >> (8 * (n - 1) - 1)) == -1):
                n -= 1
            self.buf.byte(LONG1)
            self.buf.byte(<unsigned char>n)
            self.buf.uint(<uint64_t>v, n)
        return 0

    cdef int _save_float(self, double value) except -1:
        cdef uint64_t bits
        cdef int i
        memcpy(&bits, &value, 8)
        self.buf.byte(BINFLOAT)
        self.buf.reserve(8)
        for i in range(8):  # big-endian
            self.buf.data[self.buf.size + i] = (bits >> (8 * (7 - i))) & 0xff
        self.buf.size += 8
        return 0

    cdef int _save_shared_tuple(self, tuple items, int depth) except -1:
        """A tuple met in a value: memoized if it has more than four items or an item
        that is not a scalar (it may be shared, and large: dask's chunks)."""
        cdef object item
        cdef type kind
        cdef bint shared = len(items) > 4
        if not shared:
            for item in items:
                kind = type(item)
                if not (kind is str or kind is int or item is None or kind is float
                        or kind is bool):
                    shared = True
                    break
        if not shared:
            return self._save_tuple(items, depth)
        if self._refer(items):
            return 0
        self._save_tuple(items, depth)
        return self._remember(items)

    cdef int _save_tuple(self, tuple items, int depth) except -1:
        cdef Py_ssize_t n = len(items)
        cdef object item
        if n == 0:
            return self.buf.byte(EMPTY_TUPLE)
        if n > 3:
            self.buf.byte(MARK)
        for item in items:
            self._save(item, depth + 1)
        if n == 1:
            self.buf.byte(TUPLE1)
        elif n == 2:
            self.buf.byte(TUPLE2)
        elif n == 3:
            self.buf.byte(TUPLE3)
        else:
            self.buf.byte(TUPLE)
        return 0

    cdef inline void _cache(self, void* obj, Py_ssize_t index):
        cdef Py_ssize_t slot = _slot(obj)
        self.seen_objects[slot] = obj
        self.seen_indices[slot] = index

    cdef bint _seen(self, object obj) except -1:
        """Refer to ``obj`` if it was written already (True); else note that the memo
        index the caller's next MEMOIZE takes is its (False)."""
        if self._refer(obj):
            return True
        self.by_id[id(obj)] = self.memo
        self.alive.append(obj)
        self._cache(<void*>obj, self.memo)
        return False

    cdef bint _refer(self, object obj) except -1:
        """Refer to ``obj`` if it was written already (True)."""
        cdef Py_ssize_t slot = _slot(<void*>obj)
        if self.seen_objects[slot] == <void*>obj:
            self._get(self.seen_indices[slot])
            return True
        found = self.by_id.get(id(obj))
        if found is None:
            return False
        self._cache(<void*>obj, <Py_ssize_t>found)
        self._get(<Py_ssize_t>found)
        return True

    cdef int _remember(self, object obj) except -1:
        """Memoize ``obj``, just written (on the stack), for later references."""
        self.by_id[id(obj)] = self.memo
        self.alive.append(obj)
        self._cache(<void*>obj, self.memo)
        return self._memoize()

    cdef int _save_list(self, list items, int depth) except -1:
        cdef object item
        if self._seen(items):
            return 0
        self.buf.byte(EMPTY_LIST)
        self._memoize()
        if items:
            self.buf.byte(MARK)
            for item in items:
                self._save(item, depth + 1)
            self.buf.byte(APPENDS)
        return 0

    cdef int _save_dict(self, dict items, int depth) except -1:
        if self._seen(items):
            return 0
        self.buf.byte(EMPTY_DICT)
        self._memoize()
        if items:
            self.buf.byte(MARK)
            for key, value in items.items():
                self._save(key, depth + 1)
                self._save(value, depth + 1)
            self.buf.byte(SETITEMS)
        return 0

    cdef int _save_set(self, set items, int depth) except -1:
        cdef object item
        if self._seen(items):
            return 0
        self.buf.byte(EMPTY_SET)
        self._memoize()
        if items:
            self.buf.byte(MARK)
            for item in items:
                self._save(item, depth + 1)
            self.buf.byte(ADDITEMS)
        return 0

    cdef int _save_frozenset(self, frozenset items, int depth) except -1:
        if len(items) > _SHARED_FROZENSET:
            if self._refer(items):
                return 0
            self._write_frozenset(items, depth)
            return self._remember(items)
        return self._write_frozenset(items, depth)

    cdef int _write_frozenset(self, frozenset items, int depth) except -1:
        cdef object item
        self.buf.byte(MARK)
        for item in items:
            self._save(item, depth + 1)
        return self.buf.byte(FROZENSET)

    cdef int _save_call(self, object function, tuple args, int depth) except -1:
        """``function(*args)`` when unpickled (REDUCE)."""
        self._save_opaque(function)
        self._save_tuple(args, depth + 1)
        return self.buf.byte(REDUCE)

    cdef int _save_task(self, object task, int depth) except -1:
        """As the pickler reduces a Task: ``Task.__new__(Task)``, then BUILD with the
        tuple of its slots (``Task.__setstate__`` sets them). Its own arguments tuple
        and an empty kwargs dict are written as they are, never looked up (their items
        are, by the rules above)."""
        cdef tuple state = self.task_state(task)
        cdef Py_ssize_t i
        cdef object item
        self._save_opaque(self.task_type)
        self.buf.byte(EMPTY_TUPLE)
        self.buf.byte(NEWOBJ)
        self.buf.byte(MARK)
        for i in range(len(state)):
            item = state[i]
            if i == self.task_args and type(item) is tuple:
                self._save_tuple(<tuple>item, depth + 1)
            elif i == self.task_kwargs and type(item) is dict and not item:
                self.buf.byte(EMPTY_DICT)
            else:
                self._save(item, depth + 1)
        self.buf.byte(TUPLE)
        return self.buf.byte(BUILD)

    cdef int _save_container(self, object node, object kind, int depth) except -1:
        """A List, Tuple, Set or Dict node, as its ``__getstate__`` gives it: a list of
        its slots, with ``constructor`` left out of its kwargs (its ``__setstate__``
        puts the class's back)."""
        getter, kwargs_index = self.containers[kind]
        state = list(getter(node))
        kwargs = dict(state[kwargs_index])
        kwargs.pop("constructor", None)
        state[kwargs_index] = kwargs
        self._save_opaque(kind)
        self.buf.byte(EMPTY_TUPLE)
        self.buf.byte(NEWOBJ)
        self.buf.byte(EMPTY_LIST)  # a new list: not memoized, nothing refers to it
        self.buf.byte(MARK)
        for item in state:
            self._save(item, depth + 1)
        self.buf.byte(APPENDS)
        return self.buf.byte(BUILD)

    cdef int _save_opaque(self, object obj) except -1:
        """``obj`` as ``operator.getitem(opaque objects, i)``, once per part."""
        if self._refer(obj):
            return 0
        self._get(_GETITEM)
        self._get(_OPAQUE_LIST)
        self._save_int(len(self.opaques))
        self.buf.byte(TUPLE2)
        self.buf.byte(REDUCE)
        self.opaques.append(obj)
        return self._remember(obj)


cdef inline Py_ssize_t _slot(void* obj):
    """An object's slot in the seen cache: its address without the bits that
    allocation alignment leaves zero."""
    return (<size_t>obj >> 4) & (_SEEN_SLOTS - 1)


cdef int _bytes(_Buffer buf, bytes data) except -1:
    """SHORT_BINBYTES or BINBYTES8."""
    cdef Py_ssize_t n = len(data)
    if n < 256:
        buf.byte(SHORT_BINBYTES)
        buf.byte(<unsigned char>n)
    else:
        buf.byte(BINBYTES8)
        buf.uint(<uint64_t>n, 8)
    buf.raw(<const char*>data, n)
    return 0


cdef int _global(_Buffer buf, bytes module, bytes name) except -1:
    """``module.name`` by STACK_GLOBAL (the two strings not memoized)."""
    buf.byte(SHORT_BINUNICODE)
    buf.byte(<unsigned char>len(module))
    buf.raw(<const char*>module, len(module))
    buf.byte(SHORT_BINUNICODE)
    buf.byte(<unsigned char>len(name))
    buf.raw(<const char*>name, len(name))
    return buf.byte(STACK_GLOBAL)
