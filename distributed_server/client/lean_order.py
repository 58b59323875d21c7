# cython: language_level=3
"""A lean ordering of a big dask graph: ``dask.order``'s job in about 130 B a task.

``dask.order.order`` keeps a set of dependencies and a set of dependents per task and
more besides: about 1.8 KB a task on top of the graph (3.9 GiB of working memory at
1.3 million tasks, measured on the client) and about 30 us a task. At ten million tasks
it does not fit beside the graph on a 24 GiB machine. `lean_order` gives a big graph
its places in flat arrays of task indices instead, in two passes:

1. A depth-first walk from the graph's outputs (tasks no task depends on), each task's
   dependencies in the graph's own order, numbers the tasks as the walk finishes them.
   Inputs that feed the same output come out together: a column of chunks before the
   mean of that column, the chunks of one reduction branch side by side.
2. The tasks with no dependencies are then taken in that walk's order, and each task
   placed makes its dependents one input closer to ready: a dependent whose last input
   was just placed goes next (last ready, first placed), so a reduction's partial
   follows its inputs at once and frees them, and a result needed by many waits in
   memory only while its dependents are completed.

Walking down from the outputs alone (the first pass as the order) holds every input of
a shared dependency (a column mean that all rows need) until the end; placing only
what became ready, in the walk's order, completes each column first.

The same source runs compiled (Cython's pure-Python mode; a compiled install builds it
as an extension) and as plain Python (slow, for tests and the interpreted install).
"""
from __future__ import annotations

from array import array

try:
    import cython
except ImportError:  # the interpreted install has no Cython
    from distributed_core import cython_shim as cython

COMPILED: bool = cython.compiled


def lean_order(nodes: dict) -> dict:
    """``{key: place}`` for the keys of ``nodes`` (key -> a node with
    ``.dependencies``), places 0 to n - 1, every task after its dependencies inside
    ``nodes`` (dependencies outside it are ignored), as `dask.order.order` returns."""
    return LeanOrder(nodes).places


class LeanOrder:
    """The lean order of ``nodes`` (key -> a node with ``.dependencies``) with what a
    plan to send them needs, found in the same pass over their dependencies:

    - ``place_of(key)``: its place, 0 to n - 1, after its dependencies among the nodes
      (``places``: all of them as a dict);
    - ``sequence`` and ``in_order``: the keys and the nodes by place;
    - ``last_use``: by place, the place of the task's last dependent (-1: none);
    - ``external``: the dependencies that are not among the nodes.

    Raises ValueError if the nodes depend on each other in a cycle."""

    __slots__ = ("_index", "_places", "external", "in_order", "last_use", "sequence")

    def __init__(self, nodes: dict) -> None:
        n: cython.Py_ssize_t = len(nodes)
        i: cython.Py_ssize_t
        place: cython.Py_ssize_t
        external: set = set()
        index: dict = dict(zip(nodes, range(n)))  # key -> index
        find = index.get
        dep_start = array("q", bytes(8 * (n + 1)))
        flat: list = []
        for i, node in enumerate(nodes.values()):
            for dep in node.dependencies:
                j = find(dep)
                if j is None:
                    external.add(dep)
                else:
                    flat.append(j)
            dep_start[i + 1] = len(flat)
        deps = array("i", flat)
        del flat
        places_array = _places(n, dep_start, deps) if n else array("i")
        places: cython.int[:] = places_array
        self.last_use = array("i", [-1]) * n
        _last_uses(places, dep_start, deps, self.last_use, n)
        del deps, dep_start
        sequence: list = [None] * n
        in_order: list = [None] * n
        for i, (key, node) in enumerate(nodes.items()):
            place = places[i]
            sequence[place] = key
            in_order[place] = node
        # not a dict of places: storing each key's place again costs as much as the
        # index did (a tuple's hash is not cached), and a plan looks up a few keys
        self._index = index
        self._places = places_array
        self.sequence = sequence
        self.in_order = in_order
        self.external = external

    def place_of(self, key):
        """The place of ``key``; None if it is not among the nodes."""
        i = self._index.get(key)
        return None if i is None else self._places[i]

    @property
    def places(self) -> dict:
        """key -> its place, for every key (a new dict)."""
        return dict(zip(self.sequence, range(len(self.sequence))))


def _places(n: cython.Py_ssize_t, dep_start, deps):
    """Each task's place (an array by task index), from its dependencies (``deps``,
    ``dep_start[i]:dep_start[i + 1]`` for task i): of the two orders, the one that holds
    fewer results at once when its tasks run one by one."""
    for i in _long_runs(dep_start, n, _SHORT_RUN):  # else the insertion sort is quadratic
        deps[dep_start[i]:dep_start[i + 1]] = array("i", sorted(
            deps[dep_start[i]:dep_start[i + 1]]))
    _sort_runs(dep_start, deps, n)
    dependent_start = array("q", bytes(8 * (n + 1)))
    dependents = array("i", bytes(4 * len(deps)))
    _invert(dep_start, deps, dependent_start, dependents, n)
    walk = array("i", bytes(4 * n))  # tasks with no dependencies, in the walk's order
    walked = array("i", bytes(4 * n))  # the walk's places
    n_roots = _walk_from_outputs(dep_start, deps, dependent_start, walk, walked, n)
    if n_roots == 0 and n > 0:
        raise ValueError(_CYCLE)
    placed = array("i", bytes(4 * n))
    if _place(dep_start, dependent_start, dependents, walk, n_roots, placed, n) != n:
        raise ValueError(_CYCLE)
    del walk
    if (_peak_live(walked, dep_start, deps, dependent_start, n)
            < _peak_live(placed, dep_start, deps, dependent_start, n)):
        return walked
    return placed


#: Dependencies of a task sorted by insertion at most; longer runs by Python's sort.
_SHORT_RUN = 32

_CYCLE = ("the dask graph has a cycle: some of its tasks depend on themselves through "
          "others")


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _long_runs(start: cython.longlong[:], n: cython.Py_ssize_t,
               longest: cython.Py_ssize_t) -> list:
    """The tasks with more than ``longest`` dependencies."""
    i: cython.Py_ssize_t
    found: list = []
    for i in range(n):
        if start[i + 1] - start[i] > longest:
            found.append(i)
    return found


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _sort_runs(start: cython.longlong[:], items: cython.int[:], n: cython.Py_ssize_t):
    """Sort each task's dependencies by index (an insertion sort: most have a few, and
    the long runs are sorted already)."""
    i: cython.Py_ssize_t
    a: cython.Py_ssize_t
    b: cython.Py_ssize_t
    item: cython.int
    for i in range(n):
        for a in range(start[i] + 1, start[i + 1]):
            item = items[a]
            b = a - 1
            while b >= start[i] and items[b] > item:
                items[b + 1] = items[b]
                b -= 1
            items[b + 1] = item


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _invert(dep_start: cython.longlong[:], deps: cython.int[:],
            dependent_start: cython.longlong[:], dependents: cython.int[:],
            n: cython.Py_ssize_t):
    """The dependents of each task, by index, from the dependencies."""
    i: cython.Py_ssize_t
    a: cython.Py_ssize_t
    j: cython.int
    for a in range(dep_start[n]):
        dependent_start[deps[a] + 1] += 1
    for i in range(n):
        dependent_start[i + 1] += dependent_start[i]
    fill = array("q", dependent_start)
    filled: cython.longlong[:] = fill
    for i in range(n):  # i grows: each task's dependents come out sorted
        for a in range(dep_start[i], dep_start[i + 1]):
            j = deps[a]
            dependents[filled[j]] = i
            filled[j] += 1


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _walk_from_outputs(dep_start: cython.longlong[:], deps: cython.int[:],
                       dependent_start: cython.longlong[:], walk: cython.int[:],
                       walked: cython.int[:], n: cython.Py_ssize_t) -> cython.Py_ssize_t:
    """Walk depth-first from each output (in index order) down its dependencies (in
    index order). Each task's place in ``walked``: the order the walk finishes them
    (dependencies first); into ``walk`` the tasks without dependencies in that order.
    Returns how many tasks are without dependencies."""
    seen_array = array("b", bytes(n))
    seen: cython.schar[:] = seen_array
    stack_array = array("i", bytes(4 * n))  # tasks on the path down
    stack: cython.int[:] = stack_array
    next_array = array("q", bytes(8 * n))  # the path's next dependency to walk down
    next_dep: cython.longlong[:] = next_array
    top: cython.Py_ssize_t
    n_roots: cython.Py_ssize_t = 0
    finished: cython.int = 0
    output: cython.Py_ssize_t
    task: cython.int
    dep: cython.int
    for output in range(n):
        if dependent_start[output + 1] != dependent_start[output]:
            continue  # not an output
        seen[output] = 1
        stack[0] = output
        next_dep[0] = dep_start[output]
        top = 0
        while top >= 0:
            task = stack[top]
            if next_dep[top] < dep_start[task + 1]:
                dep = deps[next_dep[top]]
                next_dep[top] += 1
                if not seen[dep]:
                    seen[dep] = 1
                    top += 1
                    stack[top] = dep
                    next_dep[top] = dep_start[dep]
                continue
            walked[task] = finished
            finished += 1
            if dep_start[task + 1] == dep_start[task]:
                walk[n_roots] = task
                n_roots += 1
            top -= 1
    return n_roots


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _place(dep_start: cython.longlong[:], dependent_start: cython.longlong[:],
           dependents: cython.int[:], walk: cython.int[:], n_roots: cython.Py_ssize_t,
           places: cython.int[:], n: cython.Py_ssize_t) -> cython.Py_ssize_t:
    """Place the tasks without dependencies in the walk's order, each followed at once
    by the dependents it made ready (last ready, first placed); return how many tasks
    were placed (fewer than n: a cycle)."""
    waiting_array = array("i", bytes(4 * n))  # inputs not yet placed
    waiting: cython.int[:] = waiting_array
    ready_array = array("i", bytes(4 * n))
    ready: cython.int[:] = ready_array
    i: cython.Py_ssize_t
    a: cython.Py_ssize_t
    r: cython.Py_ssize_t
    top: cython.Py_ssize_t
    task: cython.int
    dependent: cython.int
    place: cython.int = 0
    for i in range(n):
        waiting[i] = dep_start[i + 1] - dep_start[i]
    for r in range(n_roots):
        ready[0] = walk[r]
        top = 0
        while top >= 0:
            task = ready[top]
            top -= 1
            places[task] = place
            place += 1
            # the last dependents first onto the stack: the first made ready goes next
            a = dependent_start[task + 1] - 1
            while a >= dependent_start[task]:
                dependent = dependents[a]
                waiting[dependent] -= 1
                if waiting[dependent] == 0:
                    top += 1
                    ready[top] = dependent
                a -= 1
    return place


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _peak_live(places: cython.int[:], dep_start: cython.longlong[:], deps: cython.int[:],
               dependent_start: cython.longlong[:], n: cython.Py_ssize_t) -> cython.Py_ssize_t:
    """The most results held at once when the tasks run one by one in ``places``'
    order, each result held until its last dependent has run."""
    by_place_array = array("i", bytes(4 * n))
    by_place: cython.int[:] = by_place_array
    uses_array = array("i", bytes(4 * n))  # dependents not yet run
    uses: cython.int[:] = uses_array
    i: cython.Py_ssize_t
    a: cython.Py_ssize_t
    task: cython.int
    dep: cython.int
    live: cython.Py_ssize_t = 0
    peak: cython.Py_ssize_t = 0
    for i in range(n):
        by_place[places[i]] = i
        uses[i] = dependent_start[i + 1] - dependent_start[i]
    for i in range(n):
        task = by_place[i]
        live += 1
        peak = max(peak, live)
        for a in range(dep_start[task], dep_start[task + 1]):
            dep = deps[a]
            uses[dep] -= 1
            if uses[dep] == 0:
                live -= 1
    return peak


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _last_uses(places: cython.int[:], dep_start: cython.longlong[:], deps: cython.int[:],
               last_use: cython.int[:], n: cython.Py_ssize_t):
    """By place, the place of each task's last dependent (``last_use`` holds -1)."""
    i: cython.Py_ssize_t
    a: cython.Py_ssize_t
    used: cython.int
    for i in range(n):
        for a in range(dep_start[i], dep_start[i + 1]):
            used = places[deps[a]]
            last_use[used] = max(last_use[used], places[i])
