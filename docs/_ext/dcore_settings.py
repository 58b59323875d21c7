"""Sphinx extension: the table of configuration settings, read from the code.

``distributed_server.config.SETTINGS`` maps each setting's name to the dask key it
corresponds to (or None), its default and its parser. The directive

    ```{dcore-settings}
    ```

renders it as a table (our key under ``dcore.``, dask's key, the default), so the page
lists exactly the settings the code reads. A missing or unreadable table fails the build.
"""
from __future__ import annotations

import importlib
import math

from docutils import nodes
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective


def read_settings() -> list[tuple[str, str | None, object]]:
    """``[(our key, dask's key or None, default)]`` in the code's order."""
    try:
        config = importlib.import_module("distributed_server.config")
    except ImportError as error:
        raise ExtensionError(f"dcore-settings: cannot import the configuration: {error}")
    settings = getattr(config, "SETTINGS", None)
    if not isinstance(settings, dict) or not settings:
        raise ExtensionError("dcore-settings: distributed_server.config.SETTINGS is missing")
    rows = []
    for name, entry in settings.items():
        if not (isinstance(entry, tuple) and len(entry) >= 2):
            raise ExtensionError(f"dcore-settings: cannot read the setting {name!r}")
        rows.append((f"dcore.{name}", entry[0], entry[1]))
    return rows


def _default_text(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, float) and value.is_integer() and value >= 1:
        return f"{int(value)}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _cell(text: str | None, literal: bool = True) -> nodes.entry:
    para = nodes.paragraph()
    if text is None:
        para += nodes.Text("\u2014")
    elif literal:
        para += nodes.literal(text, text)
    else:
        para += nodes.Text(text)
    return nodes.entry("", para)


class SettingsDirective(SphinxDirective):
    has_content = False

    def run(self):
        rows = read_settings()
        table = nodes.table(classes=["dcore-settings"])
        group = nodes.tgroup(cols=3)
        table += group
        for width in (40, 42, 18):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        row = nodes.row()
        for title in ("key", "dask's key, also read", "default"):
            row += nodes.entry("", nodes.paragraph(text=title))
        head += row
        group += head
        body = nodes.tbody()
        for ours, dasks, default in rows:
            row = nodes.row()
            row += _cell(ours)
            row += _cell(dasks)
            row += _cell(_default_text(default), literal=False)
            body += row
        group += body
        return [table]


def setup(app):
    app.add_directive("dcore-settings", SettingsDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
