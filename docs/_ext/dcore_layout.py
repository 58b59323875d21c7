"""Sphinx extension: the import rule of ``distributed_server``, read from the test that
holds it.

``tests/test_layout.py`` declares in ``MAY_IMPORT`` what each unit of the shell (a
subpackage such as ``comm``, or a shared module such as ``config``) may import besides
itself, and fails on any import against it. The directive

    ```{dcore-layout}
    ```

loads that test file by its path (``../tests/test_layout.py`` from the docs folder) and
renders the table, one row per unit in the order of ``MAY_IMPORT``. Nothing is copied by
hand: when the rule changes, the next docs build shows it; a test file or a table that
cannot be read fails the build.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from docutils import nodes
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective

#: The test that holds the rule, relative to the docs folder.
LAYOUT_TEST = Path("..", "tests", "test_layout.py")


def read_layout(docs: Path) -> tuple[dict[str, set[str]], Path, Path]:
    """(``MAY_IMPORT`` of the layout test, the package folder it reads, the test's path),
    for the docs folder ``docs``."""
    path = (docs / LAYOUT_TEST).resolve()
    if not path.is_file():
        raise ExtensionError(f"dcore-layout: no layout test at {path}")
    spec = importlib.util.spec_from_file_location("dcore_docs_test_layout", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise ExtensionError(f"dcore-layout: cannot load {path}: {error}") from error
    table = getattr(module, "MAY_IMPORT", None)
    if not isinstance(table, dict) or not table:
        raise ExtensionError(f"dcore-layout: {path} has no MAY_IMPORT table")
    return table, Path(module.PACKAGE), path


def unit_label(unit: str, package: Path) -> str:
    """How a unit reads on the page: ``distributed_core``, ``comm/``, ``config.py``."""
    if unit == "core":
        return "distributed_core"
    return f"{unit}/" if (package / unit).is_dir() else f"{unit}.py"


def _literals(names: list[str]) -> nodes.paragraph:
    para = nodes.paragraph()
    for i, name in enumerate(names):
        if i:
            para += nodes.Text(", ")
        para += nodes.literal(name, name)
    if not names:
        para += nodes.Text("nothing of the project")
    return para


def render_table(table: dict[str, set[str]], package: Path) -> nodes.table:
    """One row per unit, in the table's order; what it may import in the same order
    (``distributed_core`` first)."""
    order = {unit: i for i, unit in enumerate(["core", *table])}
    result = nodes.table(classes=["dcore-layout"])
    group = nodes.tgroup(cols=2)
    result += group
    for width in (20, 80):
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    row = nodes.row()
    for title in ("unit of distributed_server", "may import, besides itself"):
        row += nodes.entry("", nodes.paragraph(text=title))
    head += row
    group += head
    body = nodes.tbody()
    for unit, allowed in table.items():
        row = nodes.row()
        row += nodes.entry("", _literals([unit_label(unit, package)]))
        names = sorted(allowed, key=lambda u: (order.get(u, len(order)), u))
        row += nodes.entry("", _literals([unit_label(u, package) for u in names]))
        body += row
    group += body
    return result


class LayoutDirective(SphinxDirective):
    """``{dcore-layout}``: the table of what each unit of the shell may import."""

    has_content = False

    def run(self):
        table, package, path = read_layout(Path(self.env.srcdir))
        self.env.note_dependency(str(path))
        return [render_table(table, package)]


def setup(app):
    app.add_directive("dcore-layout", LayoutDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
