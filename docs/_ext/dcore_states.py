"""Sphinx extension: the cores' state diagrams, generated from their own transition tables.

``distributed_core`` keeps each state machine's allowed moves in one table: the
scheduler's in ``_core.MOVES`` (a set of ``(start, finish)`` pairs), a worker's in
``_worker_core._TRANSITIONS`` (``{start: {finish: function}}``). The directive

    ```{dcore-states} scheduler
    ```

(or ``worker``) imports the installed ``distributed_core``, reads that table and emits
an inline SVG diagram (HTML builders only) and a table of each state's moves. Nothing is
copied by hand: when a move is added to a table, the next docs build shows it. A table
that cannot be found or read fails the build, so the page never shows a stale diagram.

The reading is defensive about the table's shape (a set or list of pairs, a mapping of
pairs, or a mapping of a start state to its finish states, states as names or as indexes
into the machine's tuple of states), since only the table's name is a promise.
"""
from __future__ import annotations

import html
import importlib
import math
from collections.abc import Iterable, Mapping

from docutils import nodes
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective

#: What each machine is: its module, the name of its table, the name of its states.
MACHINES = {
    "scheduler": ("distributed_core._core", "MOVES", "TASK_STATES"),
    "worker": ("distributed_core._worker_core", "_TRANSITIONS", "WORKER_TASK_STATES"),
}


def _module(name: str):
    """The core module ``name``, imported the way ``distributed_core`` loads it (the C
    extension, or the ``.pyx`` source read as Python)."""
    import distributed_core

    attribute = name.rsplit(".", 1)[1]
    module = getattr(distributed_core, attribute, None)
    return module if module is not None else importlib.import_module(name)


def _state_name(value, states: tuple) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and 0 <= value < len(states):
        return states[value]
    raise ExtensionError(f"dcore-states: cannot read the state {value!r}")


def _pairs(table, states: tuple) -> list[tuple[str, str]]:
    """Every ``(start, finish)`` of ``table``, as state names, in the machine's order."""
    raw: list = []
    if isinstance(table, Mapping):
        for start, finishes in table.items():
            if isinstance(start, tuple) and len(start) == 2:
                raw.append(start)
            elif isinstance(finishes, Iterable) and not isinstance(finishes, (str, bytes)):
                raw.extend((start, finish) for finish in finishes)
            else:
                raise ExtensionError(f"dcore-states: cannot read the entry {start!r}")
    elif isinstance(table, Iterable):
        raw.extend(table)
    else:
        raise ExtensionError(f"dcore-states: the table is a {type(table).__name__}")
    pairs = set()
    for pair in raw:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ExtensionError(f"dcore-states: {pair!r} is not a (start, finish) pair")
        pairs.add((_state_name(pair[0], states), _state_name(pair[1], states)))
    order = {state: i for i, state in enumerate(states)}
    return sorted(pairs, key=lambda p: (order.get(p[0], len(order)), order.get(p[1], len(order))))


def read_machine(which: str) -> tuple[tuple[str, ...], list[tuple[str, str]], str]:
    """(the machine's states, its moves, where they were read) for ``scheduler`` or
    ``worker``."""
    module_name, table_name, states_name = MACHINES[which]
    try:
        module = _module(module_name)
    except ImportError as error:
        raise ExtensionError(f"dcore-states: cannot import {module_name}: {error}") from error
    table = getattr(module, table_name, None)
    if table is None:
        raise ExtensionError(f"dcore-states: {module_name} has no table {table_name}")
    states = tuple(getattr(module, states_name, ()))
    moves = _pairs(table, states)
    if not moves:
        raise ExtensionError(f"dcore-states: {module_name}.{table_name} lists no move")
    # States that only appear in the table (none today) still get a place.
    extra = [s for pair in moves for s in pair if s not in states]
    states = states + tuple(dict.fromkeys(extra))
    return states, moves, f"{module_name}.{table_name}"


# --- the SVG ----------------------------------------------------------------------------

_CHAR_W = 7.6     # px per character of the 13 px monospace labels (an estimate)
_BOX_H = 28


def _box(center, label):
    w = len(label) * _CHAR_W + 22
    return (center[0] - w / 2, center[1] - _BOX_H / 2, w, _BOX_H)


def _inside(point, box, margin=3.0):
    x, y, w, h = box
    return (x - margin <= point[0] <= x + w + margin) and (y - margin <= point[1] <= y + h + margin)


def _bezier(p0, c, p1, t):
    a, b, d = (1 - t) ** 2, 2 * (1 - t) * t, t ** 2
    return (a * p0[0] + b * c[0] + d * p1[0], a * p0[1] + b * c[1] + d * p1[1])


def _leave(p0, c, p1, box, from_start: bool) -> float:
    """The curve's parameter where it crosses ``box``'s border (bisection)."""
    lo, hi = (0.0, 0.5) if from_start else (0.5, 1.0)
    for _ in range(30):
        mid = (lo + hi) / 2
        in_box = _inside(_bezier(p0, c, p1, mid), box)
        if from_start:
            lo, hi = (mid, hi) if in_box else (lo, mid)
        else:
            lo, hi = (lo, mid) if in_box else (mid, hi)
    return (lo + hi) / 2


def _hub(states: tuple, moves: list):
    """The state most moves touch, if it touches most states (``released`` in both
    machines): drawn in the middle, so its moves are short spokes."""
    degree = {s: sum(s in pair for pair in moves) for s in states}
    hub = max(states, key=lambda s: degree[s])
    neighbours = {f for s, f in moves if s == hub} | {s for s, f in moves if f == hub}
    return hub if len(neighbours) >= (len(states) - 1) / 2 else None


def render_svg(states: tuple, moves: list, title: str) -> str:
    """An inline SVG: the states on an ellipse in the machine's order (the hub, if any,
    in the middle), an arrow per move (a pair of opposite moves as two arcs)."""
    hub = _hub(states, moves)
    ring = [s for s in states if s != hub]
    n = len(ring)
    width, height = 720, 470
    cx, cy, rx, ry = width / 2, height / 2, width / 2 - 90, height / 2 - 45
    centers = {}
    if hub is not None:
        centers[hub] = (cx, cy)
    for i, state in enumerate(ring):
        angle = -math.pi / 2 + 2 * math.pi * i / n
        centers[state] = (cx + rx * math.cos(angle), cy + ry * math.sin(angle))
    boxes = {s: _box(centers[s], s) for s in states}
    pair_set = set(moves)
    marker_id = "dcore-arrow-" + title.split()[0].lower()  # unique per machine
    parts = [
        (f'<svg class="dcore-states" role="img" viewBox="0 0 {width} {height}" '
         f'xmlns="http://www.w3.org/2000/svg" aria-label="{html.escape(title)}">'),
        f"<title>{html.escape(title)}</title>",
        (f'<defs><marker id="{marker_id}" viewBox="0 0 10 10" refX="9" refY="5" '
         'markerWidth="7" markerHeight="7" orient="auto">'
         '<path d="M 0 0 L 10 5 L 0 10 z" fill="currentColor"/></marker></defs>'),
    ]
    for start, finish in moves:
        p0, p1 = centers[start], centers[finish]
        dx, dy = p1[0] - p0[0], p1[1] - p0[1]
        length = math.hypot(dx, dy) or 1.0
        bend = 22.0 if (finish, start) in pair_set else 8.0
        mx, my = (p0[0] + p1[0]) / 2, (p0[1] + p1[1]) / 2
        # to the right of the direction of travel: opposite moves bend apart
        c = (mx + bend * dy / length, my - bend * dx / length)
        t0 = _leave(p0, c, p1, boxes[start], from_start=True)
        t1 = _leave(p0, c, p1, boxes[finish], from_start=False)
        a, b = _bezier(p0, c, p1, t0), _bezier(p0, c, p1, t1)
        # the control point of the sub-curve from t0 to t1 (de Casteljau on the hull)
        ctrl = (
            (1 - t0) * ((1 - t1) * p0[0] + t1 * c[0]) + t0 * ((1 - t1) * c[0] + t1 * p1[0]),
            (1 - t0) * ((1 - t1) * p0[1] + t1 * c[1]) + t0 * ((1 - t1) * c[1] + t1 * p1[1]),
        )
        parts.append(
            f'<path d="M {a[0]:.1f} {a[1]:.1f} Q {ctrl[0]:.1f} {ctrl[1]:.1f} '
            f'{b[0]:.1f} {b[1]:.1f}" fill="none" stroke="currentColor" stroke-opacity="0.7" '
            f'stroke-width="1.3" marker-end="url(#{marker_id})">'
            f"<title>{html.escape(start)} \u2192 {html.escape(finish)}</title></path>")
    for state in states:
        x, y, w, h = boxes[state]
        parts.append(
            f'<g><rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h}" rx="6" '
            f'class="dcore-state-box" stroke="currentColor" stroke-width="1.2"/>'
            f'<text x="{centers[state][0]:.1f}" y="{centers[state][1] + 4.5:.1f}" '
            f'text-anchor="middle" font-family="monospace" font-size="13" '
            f'fill="currentColor">{html.escape(state)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


# --- the table --------------------------------------------------------------------------

def _literal_list(names: list) -> nodes.paragraph:
    para = nodes.paragraph()
    for i, name in enumerate(names):
        if i:
            para += nodes.Text(", ")
        para += nodes.literal(name, name)
    if not names:
        para += nodes.Text("\u2014")
    return para


def render_table(states: tuple, moves: list) -> nodes.table:
    header = ("state", "moves to (run by the engine)", "reached from")
    table = nodes.table(classes=["dcore-moves"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for width in (18, 41, 41):
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    row = nodes.row()
    for title in header:
        row += nodes.entry("", nodes.paragraph(text=title))
    head += row
    group += head
    body = nodes.tbody()
    for state in states:
        row = nodes.row()
        row += nodes.entry("", _literal_list([state]))
        row += nodes.entry("", _literal_list([f for s, f in moves if s == state]))
        row += nodes.entry("", _literal_list([s for s, f in moves if f == state]))
        body += row
    group += body
    return table


class StatesDirective(SphinxDirective):
    """``{dcore-states} scheduler|worker``: a machine's diagram and table of moves."""

    required_arguments = 1
    has_content = False

    def run(self):
        which = self.arguments[0].strip()
        if which not in MACHINES:
            raise self.error(f"dcore-states: expected one of {sorted(MACHINES)}, not {which!r}")
        states, moves, source = read_machine(which)
        title = f"{which.capitalize()} task states and the moves between them"
        figure = nodes.container(classes=["dcore-states-figure"])
        figure += nodes.raw("", render_svg(states, moves, title), format="html")
        caption = nodes.paragraph(classes=["dcore-states-caption"])
        caption += nodes.Text("Generated when these pages were built, from ")
        caption += nodes.literal(source, source)
        caption += nodes.Text(f": {len(moves)} moves between {len(states)} states.")
        figure += caption
        return [figure, render_table(states, moves)]


def setup(app):
    app.add_directive("dcore-states", StatesDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
