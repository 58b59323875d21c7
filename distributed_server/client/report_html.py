"""The HTML of a performance report: one self-contained file, no scripts, no external assets.

What this module does
---------------------
`render` turns a run's task stream (``{"key", "worker", "start", "stop", "status"}``
dicts) and the scheduler's counters at its start and end into a page: a summary,
per-prefix and per-worker tables, the counters, and the task stream as an inline SVG
(one row per worker, tasks that overlap on a worker stacked into lanes, coloured by key
prefix, failed tasks red; hovering a bar shows its key and times). Tasks are grouped by
`distributed_core.key_prefix`, the grouping the dashboard shows too. Everything is
escaped; the file opens offline in any browser.

What it never does
------------------
It never fetches anything (the caller passes the data in) and never writes files.
"""
from __future__ import annotations

import collections
import html
import time

from distributed_core import key_prefix

__all__ = ["MAX_DRAWN", "render"]

#: Most task bars drawn (a file stays a few MB); the tables always count every task.
MAX_DRAWN = 20_000
_WIDTH = 1000  # px of the time axis
_LANE = 12  # px per lane
_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac", "#86bcb6")
_ERRED = "#d62728"


def render(tasks: list[dict], counters_before: dict, counters_after: dict, start: float,
           stop: float, title: str = "distributed-core performance report") -> str:
    """The report's HTML for the tasks that ran between ``start`` and ``stop``."""
    tasks = sorted(tasks, key=lambda t: t["start"])
    sections = [
        _summary(tasks, counters_before, counters_after, start, stop),
        _task_stream_svg(tasks, start, stop),
        _prefix_table(tasks),
        _worker_table(tasks, stop - start),
        _counters_table(counters_before, counters_after),
    ]
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{_e(title)}</h1>{''.join(sections)}</body></html>\n")


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}"
        "svg{border:1px solid #ccc;background:#fff}.note{color:#666}")


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def _table(header: list | None, rows: list) -> str:
    head = "" if header is None else \
        "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _summary(tasks, before: dict, after: dict, start: float, stop: float) -> str:
    wall = max(stop - start, 1e-9)
    busy = sum(t["stop"] - t["start"] for t in tasks)
    erred = sum(t["status"] == "erred" for t in tasks)
    rows = [("from", _when(start)), ("to", _when(stop)), ("wall time", f"{wall:.3f} s"),
            ("tasks run", len(tasks)), ("tasks erred", erred),
            ("workers that ran tasks", len({t["worker"] for t in tasks})),
            ("compute time (all workers)", f"{busy:.3f} s"),
            ("average tasks running at once", f"{busy / wall:.2f}")]
    if isinstance(before.get("transitions"), int) and isinstance(after.get("transitions"), int):
        rows.append(("scheduler transitions", after["transitions"] - before["transitions"]))
    for name in ("workers", "threads", "compiled", "version"):
        if name in after:
            rows.append((name, after[name]))
    return "<h2>Summary</h2>" + _table(None, rows)


def _lanes(tasks: list) -> tuple[dict, list]:
    """``(lane of each drawn task, [(worker, first lane, lanes)])``: per worker, a task
    goes to the first lane free at its start."""
    ends: dict = collections.defaultdict(list)  # worker -> last stop per lane
    lane_of = {}
    for i, task in enumerate(tasks):
        free = ends[task["worker"]]
        for lane, end in enumerate(free):
            if end <= task["start"]:
                free[lane] = task["stop"]
                break
        else:
            lane = len(free)
            free.append(task["stop"])
        lane_of[i] = lane
    rows, first = [], 0
    for worker in sorted(ends):
        rows.append((worker, first, len(ends[worker])))
        first += len(ends[worker])
    return lane_of, rows


def _task_stream_svg(tasks: list, start: float, stop: float) -> str:
    if not tasks:
        return "<h2>Task stream</h2><p class=\"note\">No task ran in this time.</p>"
    drawn = tasks[:MAX_DRAWN]
    lane_of, rows = _lanes(drawn)
    offset = {worker: first for worker, first, _ in rows}
    n_lanes = sum(n for _, _, n in rows)
    label = 220
    height = n_lanes * _LANE + 30
    span = max(stop - start, 1e-9)
    colour: dict = {}
    parts = []
    for worker, first, n in rows:
        y = first * _LANE
        parts.append(f'<text x="4" y="{y + _LANE - 2}" font-size="10">{_e(worker)}</text>'
                     f'<line x1="0" x2="{label + _WIDTH}" y1="{y}" y2="{y}" stroke="#eee"/>')
    for i, task in enumerate(drawn):
        prefix = key_prefix(task["key"])
        fill = _ERRED if task["status"] == "erred" else colour.setdefault(
            prefix, _PALETTE[len(colour) % len(_PALETTE)])
        x = label + (max(task["start"], start) - start) / span * _WIDTH
        w = max((min(task["stop"], stop) - max(task["start"], start)) / span * _WIDTH, 0.5)
        y = (offset[task["worker"]] + lane_of[i]) * _LANE + 1
        tip = (f"{task['key']!r} on {task['worker']}: {task['status']}, "
               f"{1e3 * (task['stop'] - task['start']):.1f} ms from +{task['start'] - start:.3f} s")
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{_LANE - 2}" '
                     f'fill="{fill}"><title>{_e(tip)}</title></rect>')
    axis_y = n_lanes * _LANE + 15
    for i in range(6):
        x = label + i * _WIDTH / 5
        parts.append(f'<text x="{x:.0f}" y="{axis_y}" font-size="10" text-anchor="middle">'
                     f'+{span * i / 5:.2f} s</text>')
    note = (f'<p class="note">{len(drawn)} of {len(tasks)} tasks drawn (the first by start '
            f'time); the tables count all.</p>' if len(drawn) < len(tasks) else "")
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {_e(p)}'
                      for p, c in colour.items())
    return (f"<h2>Task stream</h2><p>{legend}</p>{note}"
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{label + _WIDTH + 20}" '
            f'height="{height}">{"".join(parts)}</svg>')


def _prefix_table(tasks: list) -> str:
    stats: dict = collections.defaultdict(lambda: [0, 0, 0.0])
    for task in tasks:
        entry = stats[key_prefix(task["key"])]
        entry[0] += 1
        entry[1] += task["status"] == "erred"
        entry[2] += task["stop"] - task["start"]
    rows = [(prefix, n, erred, f"{total:.3f}", f"{1e3 * total / n:.2f}")
            for prefix, (n, erred, total) in sorted(stats.items(), key=lambda kv: -kv[1][2])]
    return "<h2>Tasks by prefix</h2>" + _table(
        ["prefix", "tasks", "erred", "compute s", "mean ms"], rows)


def _worker_table(tasks: list, wall: float) -> str:
    stats: dict = collections.defaultdict(lambda: [0, 0.0])
    for task in tasks:
        entry = stats[task["worker"]]
        entry[0] += 1
        entry[1] += task["stop"] - task["start"]
    rows = [(worker, n, f"{busy:.3f}", f"{100 * busy / max(wall, 1e-9):.0f}%")
            for worker, (n, busy) in sorted(stats.items())]
    return "<h2>Workers</h2>" + _table(["worker", "tasks", "compute s", "busy"], rows)


def _counters_table(before: dict, after: dict) -> str:
    rows = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if name == "time" or isinstance(new, dict) or isinstance(old, dict):
            continue  # the times are the summary's from and to
        change = new - old if type(old) in (int, float) and type(new) in (int, float) \
            and not isinstance(new, bool) else ""
        rows.append((name, "" if old is None else old, "" if new is None else new, change))
    return "<h2>Scheduler counters</h2>" + _table(["counter", "at start", "at end", "change"],
                                                  rows)
