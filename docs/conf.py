"""Sphinx configuration of distributed-core's documentation.

Built in CI by tests/docs/ with warnings as errors::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST); the API reference is generated from the docstrings of the
installed packages (autodoc), by their public names. Every asset is local: the theme
ships its CSS and JavaScript, and no page loads anything from another host.
"""
import os
import re
import sys

# Only the local extensions: distributed_core and distributed_server are imported from
# wherever the running interpreter has them (an editable checkout or an installed wheel).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ext"))

import distributed_core  # noqa: E402

project = "distributed-core"
author = "the distributed-core developers"
copyright = "the distributed-core developers"
release = distributed_core.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "dcore_states",
    "dcore_settings",
    "dcore_layout",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = []

# MyST: heading anchors for links like [x](page.md#a-section), ::: fences, and
# definition lists. No extension that needs a remote script (no dollar math).
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: members in source order; type hints in the signature, one parameter a line
# once a signature is long. `name` in a docstring is a cross-reference when it names a
# documented object (plain text otherwise).
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
python_maximum_signature_line_length = 88
autodoc_default_options = {"members": True}
default_role = "py:obj"
add_module_names = False

html_theme = "furo"
html_title = f"distributed-core {release}"
html_static_path = ["_static"]
html_css_files = ["dcore.css"]
html_show_sourcelink = False
html_copy_source = False
html_theme_options = {"navigation_with_keys": True}


# A docstring may write `set`s (a role's end-string glued to a letter), which
# reStructuredText rejects; read it as `set`\ s. Only the text autodoc reads is changed.
_ROLE_SPAN = re.compile(r"``.+?``|`[^`]+`", re.DOTALL)


def _unglue_roles(app, what, name, obj, options, lines):
    def one(match):
        end = match.end()
        glued = end < len(text) and (text[end].isalnum() or text[end] == "_")
        return match.group(0) + ("\\ " if glued else "")

    # the whole docstring at once: a literal may continue on the next line
    text = "\n".join(lines)
    lines[:] = _ROLE_SPAN.sub(one, text).split("\n")


def _drop_type_docstrings(app, what, name, obj, options, lines):
    """A constant without a docstring of its own (``COMPILED``, ``ALL_COMPLETED``) would
    show its type's (bool's, str's): drop that; the page says what the constant means."""
    type_doc = getattr(type(obj), "__doc__", None)
    if what not in ("data", "attribute") or not isinstance(type_doc, str):
        return
    own = " ".join("\n".join(lines).split())
    if own and own == " ".join(type_doc.split()):
        lines[:] = []


def setup(app):
    app.connect("autodoc-process-docstring", _unglue_roles)
    app.connect("autodoc-process-docstring", _drop_type_docstrings)
