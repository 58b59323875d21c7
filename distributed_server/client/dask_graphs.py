"""Dask collections on distributed-core: from a dask expression to update-graph slices.

dask is optional. Nothing here imports it at module import time; every function that
needs it calls `require_dask`, which raises an ImportError naming the extra to install.

What this module does (all of it on the client)
-----------------------------------------------
- `materialize`: what dask hands a scheduler (an expression, a HighLevelGraph or a plain
  dict of legacy ``(func, *args)`` tuples) becomes one dict of dask task-spec nodes
  (``Task``, ``DataNode``, ``Alias``; nested containers stay inside their ``Task``):
  ``__dask_graph__()`` if it is not a mapping, then dask's own
  ``convert_legacy_graph``. Annotations come from ``__dask_annotations__()`` (the
  expression collects them from its HighLevelGraph layers; dataframe expressions have
  none, as in dask itself). dask.array's low-level fusion drops the layers, and with
  them the annotations (dask.distributed loses them too), so an expression with
  annotated layers is materialized with that fusion off.
- Futures of a Client (``__dask_future__``) inside a graph are its keys: dask turns a
  persisted collection's ``{key: future}`` into nothing (the scheduler has the key), and
  a future among a task's arguments into a dependency (see `SpecPickler`).
- `GraphPlan`: keeps only what the wanted keys need when the client already holds some
  keys of the graph, orders the nodes (``dask.order.order``, or above a million tasks
  our `LeanOrder`, which needs a tenth of its memory and a twentieth of its time)
  and encodes the tasks slice by slice, dependencies first; a task's place in that
  sequence is its ``order`` on the scheduler. A slice is one spec part
  (docs/protocol.md) where it can be: its nodes in one pickle, whose memo they share (a
  fused dask.array node pickled alone is ~760 B and ~18 us; in a part ~90 B and ~3 us),
  then its keys and their dependency keys, in order. Else (options or annotations on
  the tasks, keys that are not plain, a node that not even cloudpickle takes) each task
  dict holds the key, the node pickled alone (the run spec), the dependency keys, the
  order and the options/annotations the scheduler understands.
- Slices: a graph larger than `SLICE_TASKS` tasks (or `SLICE_BYTES` of specs) goes out
  as several update-graph messages of at most `SLICE_MAX_TASKS` tasks, so the
  scheduler serves heartbeats and other clients between them. The client sends a slice
  once the scheduler has answered a request sent after the previous one, and sizes
  slices (`GraphPlan.adapt`) so that this takes about `SLICE_SECONDS` (the time covers
  pickling the next slice too). The scheduler forgets at once a task that nobody wants
  and that has no dependents yet, so a slice also wants, temporarily, its "frontier":
  the keys whose dependents come in a later slice. Each is released right after the
  slice holding its last dependent (see `SlicePart.release`).
- `SpecPickler`: a node is pickled with the standard pickler (no Python callback per
  object) unless it refers to something a worker cannot import — ``__main__`` or a
  module registered with ``cloudpickle.register_pickle_by_value``, found by looking for
  those module names in the pickle — or the standard pickler fails (lambdas, local
  functions); then cloudpickle pickles it by value, each such function once per graph.
  A compiled install writes a slice's part with the part writer instead
  (``_part_writer.pyx``, two to three times as fast), which hands the pickler only the
  objects it does not write itself.
- `gc_paused`: the cyclic garbage collector is off while a graph is materialized,
  planned, pickled and sent (the objects made then live until the graph is sent).
- `DefaultScheduler`: makes a Client dask's default scheduler (``dask.config``
  ``scheduler``), with the task-based dataframe shuffle unless one is configured, and
  undoes it when the client closes.

A worker runs a spec as it runs every spec: ``pickle.loads(spec)(deps)``. A dask node
called with ``{dependency key: value}`` computes its value, so workers need dask (and
whatever the graph's functions import) but no code of their own for it.
"""
from __future__ import annotations

import bisect
import heapq
import importlib.util
import itertools
import logging
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence

from .. import config
from .gc_pause import collected_apart, collector_paused
from .lean_order import LeanOrder
from .spec_pickler import SpecPickler

# named as before the layout (the name users configure)
logger = logging.getLogger("distributed_server.dask_support")

DASK_REQUIRED = 'this needs dask: pip install "distributed-core[dask]"'

#: A graph of more tasks than this is sent in slices (else in one update-graph).
SLICE_TASKS = 10_000
#: Tasks per slice at most. The scheduler takes a slice in as one stimulus, which no
#: other peer can interrupt: at ~4 us per task of a spec part (graph_intake_seconds over
#: graph_tasks on /metrics, big_job.py), a slice of 2,000 holds its loop ~8 ms; as task
#: dicts, at ~12 us a task, ~25 ms. With 4,000 a probe waited 145-214 ms while ten
#: million tasks came in (big_job.py 3000000 --dask-unoptimized), with 2,000 90 ms.
SLICE_MAX_TASKS = 2_000
#: Size of a sliced graph's first slice, and the least any slice is cut down to.
SLICE_FIRST_TASKS = 1_000
SLICE_MIN_TASKS = 500
#: Scheduler time (seconds) a slice should take; slice sizes follow the measured rate.
SLICE_SECONDS = 0.1
#: Run-spec bytes per update-graph message (a slice ends at whichever comes first).
SLICE_BYTES = 64 * 1024 * 1024
#: A slice's specs are pickled together as one spec part (docs/protocol.md) if that
#: pickle is at most this big; a worker keeps a few parts it runs tasks of unpickled.
PART_MAX_BYTES = 4 * 1024 * 1024
#: Slices tried as spec parts before a graph none of whose slices could be one is sent
#: as task dicts without trying more.
PART_TRIES = 2

_TASK_FIELDS = ("workers", "allow_other_workers", "resources", "priority", "retries")
_PLAIN_SCALARS = (str, int, float, bool, type(None), bytes)
_FLAT_KEY_TYPES = frozenset((str, int, float, bytes))
_KEY_TYPES = _FLAT_KEY_TYPES | {tuple}

_DEPENDENCIES = operator.attrgetter("dependencies")

_dask_found: bool | None = None
_MISSING = object()


def gc_paused():
    """No automatic cyclic garbage collection inside (`gc_pause.collector_paused`: nested
    and concurrent blocks share one pause): materializing and ordering a large graph
    creates long-lived objects by the hundred thousand, and every full collection
    meanwhile would walk all of them (a quarter of the time for 200,000 tasks). Objects
    freed by reference counting are freed as usual."""
    return collector_paused()


def dask_available() -> bool:
    """Whether dask can be imported (without importing it)."""
    global _dask_found
    if _dask_found is None:
        try:
            _dask_found = importlib.util.find_spec("dask") is not None
        except (ImportError, ValueError, AttributeError):  # e.g. sys.modules["dask"] = None
            _dask_found = False
    return _dask_found


def require_dask():
    """Import dask, or raise an ImportError that says how to install it."""
    try:
        import dask
        import dask._task_spec  # the node API this module relies on
        import dask.order
    except ImportError as exc:
        raise ImportError(DASK_REQUIRED) from exc
    return dask


def is_dask_collection(obj) -> bool:
    """Whether ``obj`` is a dask collection or expression (imports nothing)."""
    return not isinstance(obj, type) and callable(getattr(obj, "__dask_graph__", None))


# ---------------------------------------------------------------------------- materialize


class DaskGraph:
    """A materialized dask graph: ``nodes`` (key -> task-spec node), ``annotations``
    (annotation name -> {key: value}) and ``plain``: True when every key is plain
    (`with_plain_keys` checked them), False when dask named some keys with numpy scalars
    (the nodes' own references still do)."""

    __slots__ = ("annotations", "nodes", "plain")

    def __init__(self, nodes: dict, annotations: dict, plain: bool = True) -> None:
        self.nodes = nodes
        self.annotations = annotations
        self.plain = plain


def materialize(obj) -> DaskGraph:
    """The task-spec nodes of an expression, a collection, a HighLevelGraph or a dict:
    dask's own work (`dask_nodes`), then the keys made plain (`with_plain_keys`)."""
    nodes, annotations = dask_nodes(obj)
    nodes, plain = with_plain_keys(nodes)
    return DaskGraph(nodes, annotations, plain)


def dask_nodes(obj) -> tuple[dict, dict]:
    """``(nodes, annotations)``: what dask itself does to hand a graph to a scheduler
    (``__dask_graph__()``, which optimizes an expression, and ``convert_legacy_graph``),
    and the annotations of its layers. Nothing of ours but choosing the calls; the
    benchmarks report its time as dask's own."""
    dask = require_dask()
    from dask._task_spec import convert_legacy_graph

    annotations: dict = {}
    if isinstance(obj, Mapping):
        dsk = obj
        layers = getattr(obj, "layers", None)  # a HighLevelGraph keeps them per layer
        if layers is not None:
            annotations = _layer_annotations(layers)
    elif is_dask_collection(obj):
        if _has_layer_annotations(obj):
            # dask.array's low-level fusion returns a plain dict with new keys: the
            # annotations of its layers would be lost (they are in dask.distributed)
            with dask.config.set({"optimization.fuse.active": False}):
                dsk = obj.__dask_graph__()
        else:
            dsk = obj.__dask_graph__()
        get_annotations = getattr(obj, "__dask_annotations__", None)
        if get_annotations is not None:
            annotations = get_annotations() or {}
        elif hasattr(dsk, "layers"):
            annotations = _layer_annotations(dsk.layers)
    else:
        raise TypeError(f"expected a dask collection, expression or graph (a dict), "
                        f"got {type(obj).__name__}")
    return convert_legacy_graph(dsk), annotations


def uses_lean_order(n_tasks: int) -> bool:
    """Whether a graph of ``n_tasks`` is ordered by our `LeanOrder` (above the setting
    ``dcore.client.lean-order-tasks``, a million) rather than by dask's own
    (`dask_priorities`). dask.order keeps about 1.8 KB a task and takes about 30 us a
    task (3.9 GiB and 40 s at 1.3 million tasks); the lean order at most about 130 B
    and 1.6 us, and it holds as few results at once as dask.order's on the graphs of
    the tests (tests/server/client/test_lean_order.py)."""
    return n_tasks > config.get("client.lean-order-tasks")


def dask_priorities(nodes: dict) -> dict:
    """``dask.order.order``'s priorities for ``nodes`` (key -> int), with the cyclic
    garbage it leaves collected right away (`collected_apart`): its working sets, held by
    closures that refer to themselves, which only the collector frees. The benchmarks
    report both as dask's ordering."""
    if not nodes:
        return {}
    require_dask()
    from dask.order import order

    with collected_apart():
        return order(nodes)


def plain_key(key):
    """``key`` with the numpy scalars in it made Python ints, floats and strs (dask.array's
    ``vindex`` names chunks ``('name', np.int64(1))``): the wire carries plain keys only.
    A key equal to its plain form hashes the same, so dask finds its results by either."""
    typ = type(key)
    if typ is str or typ is int or typ is float or typ is bytes:
        return key
    if typ is tuple:
        return tuple([plain_key(part) for part in key])
    if isinstance(key, str):  # numpy.str_ and other str subclasses
        return str(key)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int(key)
    if isinstance(key, numbers.Real) and not isinstance(key, bool):
        return float(key)
    return key  # refused with a clear error when sent (_check_key)


def plain_keys(keys):
    """`plain_key` over a key or nested lists of keys (what dask passes as ``keys``)."""
    if type(keys) is list:
        return [plain_keys(k) for k in keys]
    return plain_key(keys)


def with_plain_keys(nodes: dict) -> tuple[dict, bool]:
    """``(nodes keyed by plain keys, whether they were plain already)``: the same dict
    in the common case (one pass, no copy). The nodes themselves are not rewritten: the
    references inside them compare and hash equal to the plain keys, so a worker finds
    their values by either; what goes on the wire is made plain when it is sent."""
    if _all_plain(nodes):
        return nodes, True
    return {plain_key(key): node for key, node in nodes.items()}, False


def _all_plain(keys) -> bool:
    """Whether every key is plain (`_is_plain_key`). The types of the keys and of the
    items of tuple keys are gathered by C loops; only keys of other forms (nested
    tuples, say) are looked at one by one."""
    kinds = set(map(type, keys))
    if kinds <= _FLAT_KEY_TYPES:
        return True
    if kinds <= _KEY_TYPES:
        tuples = keys if len(kinds) == 1 else [key for key in keys if type(key) is tuple]
        if set(map(type, itertools.chain.from_iterable(tuples))) <= _FLAT_KEY_TYPES:
            return True
    return all(_is_plain_key(key) for key in keys)


def _is_plain_key(key) -> bool:
    """Whether every part of a key has a plain Python type (numpy scalars compare equal
    to ints, so equality cannot tell)."""
    if type(key) is tuple:
        return all(_is_plain_key(part) for part in key)
    return type(key) in (str, int, float, bytes)


def _has_layer_annotations(expr) -> bool:
    """Whether an expression holds HighLevelGraph layers with annotations (dask.array
    and dask.delayed keep ``dask.annotate`` there; dataframe expressions ignore it)."""
    find = getattr(expr, "find_operations", None)
    if find is None:
        return False
    from dask._expr import HLGExpr

    for hlg_expr in find(HLGExpr):
        layers = getattr(hlg_expr.hlg, "layers", None) or {}
        if any(getattr(layer, "annotations", None) for layer in layers.values()):
            return True
    return False


def _layer_annotations(layers: Mapping) -> dict:
    """``{name: {key: value}}`` from HighLevelGraph layers (callables are called per
    key)."""
    out: dict = {}
    for layer in layers.values():
        annotations = getattr(layer, "annotations", None)
        if not annotations:
            continue
        get_keys = getattr(layer, "get_output_keys", None)
        keys = get_keys() if get_keys is not None else layer.keys()
        for name, value in annotations.items():
            by_key = out.setdefault(name, {})
            for key in keys:
                by_key[key] = value(key) if callable(value) else value
    return out


# ---------------------------------------------------------------------------- plan


class SlicePart:
    """One update-graph message of a plan.

    ``tasks``: the task dicts; ``part``: or the slice's tasks as a spec part (`spec_part`),
    else None; ``keys``: what the message wants (the client's new wanted keys in this
    slice, and the frontier); ``temporary``: the frontier keys; ``release``: frontier
    keys of earlier slices whose last dependent is in this one, to release right after
    this message; ``n_tasks``: how many tasks it carries.
    """

    __slots__ = ("keys", "n_tasks", "part", "release", "tasks", "temporary")

    def __init__(self, tasks: list, keys: list, temporary: list, release: list,
                 part: dict | None = None) -> None:
        self.tasks = tasks
        self.part = part
        self.n_tasks = len(tasks) + (len(part["keys"]) if part is not None else 0)
        self.keys = keys
        self.temporary = temporary
        self.release = release

    def message(self) -> dict:
        """The update-graph message."""
        msg = {"op": "update-graph", "tasks": self.tasks, "keys": self.keys}
        if self.part is not None:
            msg["part"] = self.part
        return msg


class GraphPlan:
    """The tasks of a materialized graph to send for ``wanted`` keys, in order.

    ``held`` are keys of the graph the client holds already (the scheduler has them):
    they are not sent, and the graph is cut there. ``options`` are task-dict fields
    for every task (annotations override them per task). ``wire`` turns a spec into
    what goes in the message (e.g. a Blob for a large one). After construction:
    ``sequence`` (keys in sending order), ``external`` (dependencies outside what is
    sent: held keys or keys the scheduler has from elsewhere), ``n_slices_hint``.
    """

    def __init__(self, graph: DaskGraph, wanted: list, held, options: dict,
                 wire: Callable[[bytes], object] = lambda spec: spec,
                 slice_tasks: int | None = None, slice_bytes: int | None = None) -> None:
        nodes = graph.nodes
        self.plain = graph.plain  # else dependencies are made plain as they are sent
        self.wanted = set(wanted)
        self.options = options
        self.wire = wire
        whole = max(1, slice_tasks or SLICE_TASKS)
        self.max_slice_tasks = min(whole, SLICE_MAX_TASKS)
        self.slice_bytes = slice_bytes or SLICE_BYTES
        self.annotations = _task_annotations(graph.annotations)
        if held:
            nodes = {key: nodes[key] for key in _needed(nodes, wanted, held)}
        self.external: set = set()
        self.in_order: list = []  # the nodes, by position
        self.last_use: Sequence[int] = []  # by position: its last dependent's, or -1
        self._wanted_at: list = []  # the positions of the wanted keys, in order
        if uses_lean_order(len(nodes)):
            with collected_apart():  # as around dask.order: the graph's objects aged
                lean = LeanOrder(nodes)
            self.sequence, self.in_order = lean.sequence, lean.in_order
            self.last_use = lean.last_use
            self.external = (lean.external if self.plain
                             else set(map(plain_key, lean.external)))
            self._wanted_at = sorted(i for i in map(lean.place_of, self.wanted)
                                     if i is not None)
        else:
            order = dask_priorities(nodes)
            # dask.order names the keys as the nodes' references do: not plain, maybe
            self.sequence, position = (_in_order(nodes, order) if self.plain
                                       else _sorted_by(nodes, order))
            self._index(nodes, position)
        self.sliced = len(self.sequence) > whole
        self.slice_tasks = (min(SLICE_FIRST_TASKS, self.max_slice_tasks) if self.sliced
                            else whole)
        self.position = 0
        self.pickler = SpecPickler()
        self._parts_tried = 0  # slices tried as spec parts
        self._parts_made = 0  # ... and made
        self._pending_release: list = []  # heap of (last use, n, key)
        self._n = 0

    def _index(self, nodes: dict, position: dict) -> None:
        """Find external dependencies, each key's last dependent and where the wanted
        keys are; fix the order if a dependency would come after its dependent
        (dask.order does not do that). ``position``: key -> its place in the sequence.
        Positions are kept in lists, not dicts: a dask key is a tuple, whose hash is
        computed again at every lookup."""
        sequence = self.sequence
        find = position.get
        in_order = list(map(nodes.__getitem__, sequence))
        last_use = [-1] * len(sequence)
        external = self.external
        for i, dependencies in enumerate(map(_DEPENDENCIES, in_order)):
            for dep in dependencies:
                j = find(dep)
                if j is None:
                    external.add(dep if self.plain else plain_key(dep))
                elif j > i:
                    self.sequence = sequence = _topological(sequence, nodes)
                    external.clear()
                    return self._index(nodes, {key: i for i, key in enumerate(sequence)})
                else:
                    last_use[j] = i  # i grows: the last assignment is the last use
        self.in_order = in_order
        self.last_use = last_use
        self._wanted_at = sorted(i for i in map(find, self.wanted) if i is not None)

    def adapt(self, n_tasks: int, seconds: float) -> None:
        """The scheduler took ``seconds`` over a slice of ``n_tasks``: size the next
        slices to take about `SLICE_SECONDS` (moving halfway there each time)."""
        if not self.sliced or n_tasks <= 0:
            return
        fitting = n_tasks * SLICE_SECONDS / max(seconds, 1e-4)
        size = (self.slice_tasks + fitting) / 2
        low = min(SLICE_MIN_TASKS, self.max_slice_tasks)
        self.slice_tasks = int(min(max(size, low), self.max_slice_tasks))

    @property
    def done(self) -> bool:
        return self.position >= len(self.sequence)

    @property
    def remaining(self) -> int:
        return len(self.sequence) - self.position

    def encode_next(self) -> SlicePart:
        """Pickle and describe the next slice (call until `done`): as a spec part if
        it can be one (`spec_part`), else as task dicts, each spec pickled on its own."""
        start = self.position
        part = None
        if self._parts_tried < PART_TRIES or self._parts_made:
            part = self._spec_part()
        if part is not None:
            self.position = start + len(part["keys"])
            return self._slice(start, [], part)
        return self._task_dicts()

    def _spec_part(self) -> dict | None:
        """The next slice as one spec part: its nodes pickled together
        (`SpecPickler.dumps_together`), then its keys and dependencies, in order; None
        if the graph's tasks carry options or annotations, or its keys are not plain, or
        the slice cannot be a part (a node not even cloudpickle takes, or a part over
        `PART_MAX_BYTES`)."""
        if self.options or self.annotations or not self.plain:
            self._parts_tried = PART_TRIES  # never: the task dicts carry them
            return None
        self._parts_tried += 1
        start = self.position
        stop = min(len(self.sequence), start + self.slice_tasks)
        keys = self.sequence[start:stop]  # plain: `with_plain_keys` found them so
        slice_nodes = self.in_order[start:stop]
        blob = self.pickler.dumps_together(slice_nodes)
        if blob is None or len(blob) > PART_MAX_BYTES:
            return None
        dependencies = list(map(_DEPENDENCIES, slice_nodes))
        self._parts_made += 1
        return {"blob": self.wire(blob), "keys": keys,
                "deps": list(itertools.chain.from_iterable(dependencies)),
                "ndeps": list(map(len, dependencies))}

    def _task_dicts(self) -> SlicePart:
        """The next slice as task dicts."""
        sequence, in_order = self.sequence, self.in_order
        options, annotations, wire = self.options, self.annotations, self.wire
        dumps = self.pickler.dumps
        start = i = self.position
        stop = min(len(sequence), start + self.slice_tasks)
        budget = self.slice_bytes
        tasks = []
        while i < stop and budget > 0:
            key = sequence[i]
            if type(key) is not str:
                _check_key(key)
            node = in_order[i]
            spec = dumps(node)
            budget -= len(spec)
            task = {"key": key, "spec": wire(spec), "order": i}
            deps = node.dependencies
            if self.pickler.found:
                deps = deps | set(self.pickler.found)
            if deps:
                task["deps"] = list(deps) if self.plain else [plain_key(d) for d in deps]
            if options:
                task.update(options)
            if annotations:
                _annotate(task, key, annotations)
            tasks.append(task)
            i += 1
        self.position = i
        return self._slice(start, tasks, None)

    def _slice(self, start: int, tasks: list, part: dict | None) -> SlicePart:
        """The message for ``sequence[start:position]``: which keys it wants, keeps and
        lets go of."""
        sequence = self.sequence
        end = self.position
        wanted = self.wanted
        at = self._wanted_at
        keys = [sequence[i] for i in at[bisect.bisect_left(at, start):
                                        bisect.bisect_left(at, end)]]
        temporary: list = []
        if end < len(sequence):
            uses = self.last_use[start:end]
            for offset in itertools.compress(range(len(uses)), map(end.__le__, uses)):
                key = sequence[start + offset]  # a dependent comes in a later slice
                if key not in wanted:
                    temporary.append(key)
                    self._n += 1
                    heapq.heappush(self._pending_release, (uses[offset], self._n, key))
        release = []
        pending = self._pending_release
        while pending and pending[0][0] < end:
            release.append(heapq.heappop(pending)[2])
        return SlicePart(tasks, keys + temporary, temporary, release, part)


def _in_order(nodes: dict, order: dict) -> tuple[list, dict]:
    """``(the keys of nodes by their order, key -> place)``. dask.order numbers the keys
    0 to n - 1: each goes to its place, and ``order`` is the place, without a sort or a
    second dict. Any other numbering (gaps, repeats) is sorted."""
    n = len(nodes)
    if len(order) == n:
        sequence = [None] * n
        try:
            for key, i in order.items():
                sequence[i] = key
        except (IndexError, TypeError):
            pass
        else:
            if None not in sequence and (n == 0 or min(order.values()) >= 0):
                return sequence, order  # every place taken once: a permutation
    return _sorted_by(nodes, order)


def _sorted_by(nodes: dict, order: dict) -> tuple[list, dict]:
    """``(the keys of nodes sorted by order, key -> place)``."""
    sequence = sorted(nodes, key=order.__getitem__)
    return sequence, {key: i for i, key in enumerate(sequence)}


def _needed(nodes: dict, wanted: list, held) -> set:
    """The keys of ``nodes`` that ``wanted`` needs, not looking past ``held`` keys."""
    needed: set = set()
    stack = [key for key in wanted if key in nodes and key not in held]
    while stack:
        key = stack.pop()
        if key in needed:
            continue
        needed.add(key)
        for dep in nodes[key].dependencies:
            if dep in nodes and dep not in held and dep not in needed:
                stack.append(dep)
    return needed


def _topological(sequence: list, nodes: dict) -> list:
    """``sequence`` reordered so that dependencies come first, otherwise kept."""
    out: list = []
    placed: set = set()
    for root in sequence:
        if root in placed:
            continue
        stack = [(root, False)]
        while stack:
            key, expanded = stack.pop()
            if key in placed:
                continue
            if expanded:
                placed.add(key)
                out.append(key)
                continue
            stack.append((key, True))
            for dep in nodes[key].dependencies:
                if dep in nodes and dep not in placed:
                    stack.append((dep, False))
    return out


def _check_key(key) -> None:
    """Keys must survive msgpack and compare equal afterwards: str, int, float, bytes,
    or tuples of them."""
    typ = type(key)
    if typ is tuple:
        for part in key:
            if type(part) is not str:
                _check_key(part)
    elif typ not in (int, float, bytes, str):
        raise TypeError(f"a task key must be a str, int, float or a tuple of them, not "
                        f"{typ.__name__}: {key!r}")


# ---------------------------------------------------------------------------- annotations


def _task_annotations(annotations: dict) -> list:
    """``[(name, {key: value})]`` for the annotations that become task fields or the
    plain ``annotations`` dict; checks their types once per distinct value."""
    out = []
    for name, by_key in annotations.items():
        if not by_key:
            continue
        if name in _TASK_FIELDS:
            by_key = {key: _task_field(name, value) for key, value in by_key.items()}
        elif not all(_is_plain(value) for value in by_key.values()):
            logger.warning("annotation %r is not plain data (str, numbers, lists, dicts): "
                           "it is not sent to the scheduler", name)
            continue
        out.append((name, by_key))
    return out


def _task_field(name: str, value):
    """An annotation as the task-dict field of the same name (docs/protocol.md)."""
    if name == "workers":
        workers = [value] if isinstance(value, str) else list(value)
        if not all(isinstance(w, str) for w in workers):
            raise TypeError(f"the 'workers' annotation must be addresses or names (str), "
                            f"got {value!r}")
        return workers
    if name == "allow_other_workers":
        return bool(value)
    if name == "resources":
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) for k, v in value.items()):
            raise TypeError(f"the 'resources' annotation must map names to quantities, "
                            f"got {value!r}")
        return dict(value)
    return int(value)  # priority, retries


def _annotate(task: dict, key, annotations: list) -> None:
    for name, by_key in annotations:
        value = by_key.get(key, _MISSING)
        if value is _MISSING:
            continue
        if name in _TASK_FIELDS:
            task[name] = value
        else:
            extra = task.get("annotations")
            if extra is None:
                extra = task["annotations"] = {}
            extra[name] = value



def _is_plain(value) -> bool:
    typ = type(value)
    if typ in _PLAIN_SCALARS:
        return True
    if typ in (list, tuple):
        return all(_is_plain(v) for v in value)
    if typ is dict:
        return all(type(k) is str and _is_plain(v) for k, v in value.items())
    return False


# ---------------------------------------------------------------------------- default scheduler


#: The name under which the default client is dask's scheduler (``dask.config``
#: ``scheduler``): a plain string, so the config can be copied and pickled.
SCHEDULER_NAME = "distributed-core"


class _DefaultClientScheduler:
    """What ``dask.base.named_schedulers[SCHEDULER_NAME]`` holds: dask calls it as a
    ``get``, and its `persist` (dask looks for one) keeps results on the cluster; both go
    to the default client at the time of the call."""

    @staticmethod
    def _client():
        from .futures import default_client

        return default_client()

    def __call__(self, dsk, keys, **kwargs):
        return self._client().get(dsk, keys, **kwargs)

    def persist(self, collections, **kwargs):
        return self._client().persist(collections, **kwargs)


class DefaultScheduler:
    """Makes the default client dask's scheduler: ``dask.config`` ``scheduler`` is set to
    `SCHEDULER_NAME` (a name, never the client itself), with the task-based dataframe
    shuffle unless a shuffle method is configured; `undo` restores what was there once
    no client of ours is the default any more."""

    def __init__(self, client) -> None:
        import dask
        import dask.base

        dask.base.named_schedulers.setdefault(SCHEDULER_NAME, _DefaultClientScheduler())
        settings = {"scheduler": SCHEDULER_NAME}
        if dask.config.get("dataframe.shuffle.method", None) is None:
            settings["dataframe.shuffle.method"] = "tasks"
        self.client = client
        self._config = dask.config.set(settings)

    def undo(self) -> None:
        import dask

        from .futures import has_default_client

        if dask.config.get("scheduler", None) != SCHEDULER_NAME or has_default_client():
            # someone else's scheduler became the default meanwhile (leave theirs alone),
            # or another client of ours is the default now (the name still finds it)
            return
        self._config.__exit__(None, None, None)
        if dask.config.get("scheduler", None) == SCHEDULER_NAME and not has_default_client():
            # the default we replaced was a client of ours that closed in between
            dask.config.set({"scheduler": None})