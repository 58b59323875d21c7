"""Spec parts on a worker: run specs a client pickled together, one pickle per slice of
a graph (docs/protocol.md).

The scheduler sends a part (``spec-part``: its number and the pickled list) before the
first task of it this worker is to run, and the task's spec then only names the part and
the task's index in it (``SPEC_PART_PREFIX``, the number, the index). The part is kept,
as bytes, until the scheduler has forgotten every task of it (``free-spec-parts``). An
executor thread unpickles the list the first time one of its tasks runs. Lists are kept, the least
recently used dropped first, while they hold at most `LOADED_NODES` specs in all: a
graph whose ready tasks interleave many parts (a shuffle's) would otherwise unpickle a
whole part for a task again and again. Unpickling happens outside the lock, so the loop
(``free-spec-parts``) and the other threads never wait for it.

The tasks of one part share the objects their specs shared on the client (as with dask's
local schedulers), and a task run again on this worker reuses its kept spec: a task that
changes one of its arguments in place changes it for those too.
"""
from __future__ import annotations

import pickle
import threading
from collections import OrderedDict

from distributed_core import SPEC_PART_PREFIX

#: Specs the unpickled parts kept hold at most in all (the last part used is always kept).
LOADED_NODES = 50_000

_HEAD = len(SPEC_PART_PREFIX)


class SpecPartMissing(RuntimeError):
    """A task's spec names a part the scheduler did not send (a bug, not user error)."""


class PartSpec:
    """A task's spec in a part, as a job carries it: the part's bytes (kept alive by the
    job, should the part be freed meanwhile) and the task's index."""

    __slots__ = ("blob", "index", "number", "parts")

    def __init__(self, parts: SpecParts, number: int, blob, index: int) -> None:
        self.parts = parts
        self.number = number
        self.blob = blob
        self.index = index

    def load(self):
        """The task's node (on an executor thread)."""
        return self.parts.node(self)


class SpecParts:
    """The spec parts a worker holds: ``{number: bytes}`` and the lists last unpickled."""

    def __init__(self, loaded_nodes: int = LOADED_NODES) -> None:
        self._blobs: dict = {}
        #: number -> (its bytes, its list of nodes), the last used last
        self._loaded: OrderedDict = OrderedDict()
        self._n_loaded = 0  # nodes in those lists
        self._max_loaded = loaded_nodes
        #: Parts unpickled so far (a part dropped and needed again counts again).
        self.loads = 0
        self._lock = threading.Lock()  # the executor threads share _loaded

    def __len__(self) -> int:
        return len(self._blobs)

    def add(self, number, blob) -> None:
        """The scheduler sent a part (``spec-part``)."""
        if type(number) is not int or not isinstance(blob, (bytes, bytearray, memoryview)):
            raise ValueError(f"a spec part is a number and bytes, not {type(number).__name__} "
                             f"and {type(blob).__name__}")
        with self._lock:
            self._blobs[number] = blob
            self._unload(number)  # a new scheduler numbers its parts from 1 again

    def free(self, numbers) -> None:
        """The scheduler forgot every task of these parts (``free-spec-parts``)."""
        with self._lock:
            for number in numbers:
                self._blobs.pop(number, None)
                self._unload(number)

    def _unload(self, number) -> None:
        entry = self._loaded.pop(number, None)
        if entry is not None:
            self._n_loaded -= len(entry[1])

    def clear(self) -> None:
        """Drop every part (the scheduler was lost: it sends them again)."""
        self.free(list(self._blobs))

    def resolve(self, spec):
        """A task's spec as its job carries it: ``spec`` itself, or a `PartSpec` if it
        refers into a part (on the loop, as the task is handed to the executor; a part
        not held makes a spec whose `PartSpec.load` raises SpecPartMissing)."""
        if type(spec) is not bytes or not spec.startswith(SPEC_PART_PREFIX):
            return spec
        number = int.from_bytes(spec[_HEAD:_HEAD + 8], "little")
        index = int.from_bytes(spec[_HEAD + 8:_HEAD + 12], "little")
        return PartSpec(self, number, self._blobs.get(number), index)

    def node(self, spec: PartSpec):
        """The node of ``spec``: its part unpickled once, kept while recently used."""
        if spec.blob is None:
            raise SpecPartMissing(f"the task's spec is #{spec.index} of spec part "
                                  f"{spec.number}, which this worker was not sent")
        nodes = None
        with self._lock:
            entry = self._loaded.get(spec.number)
            if entry is not None and entry[0] is spec.blob:  # the same part, not a namesake
                self._loaded.move_to_end(spec.number)
                nodes = entry[1]
        if nodes is None:
            nodes = pickle.loads(spec.blob)
            with self._lock:
                self.loads += 1
                if self._blobs.get(spec.number) is spec.blob:  # still held
                    self._unload(spec.number)  # another thread's copy, if it was quicker
                    self._loaded[spec.number] = (spec.blob, nodes)
                    self._n_loaded += len(nodes)
                    while self._n_loaded > self._max_loaded and len(self._loaded) > 1:
                        self._n_loaded -= len(self._loaded.popitem(last=False)[1][1])
        if not 0 <= spec.index < len(nodes):
            raise SpecPartMissing(f"spec part {spec.number} has {len(nodes)} specs, not "
                                  f"#{spec.index}")
        return nodes[spec.index]
