"""The documentation builds cleanly, documents every public name, and loads nothing from
another host.

The build runs with warnings as errors (``sphinx-build -W``): a broken cross-reference,
a page missing from the table of contents or a docstring that does not parse fails here.
"""
import importlib.util
import re
import zlib

from docs_helpers import DOCS

import distributed_core
import distributed_server


def documented_names(site) -> set[str]:
    """The Python objects in the built site's inventory (``objects.inv``).

    Read directly (four header lines, then zlib-compressed lines ``name domain:role
    priority uri display-name``), so no Sphinx version's inventory API is assumed."""
    data = (site / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    names = set()
    for line in zlib.decompress(data[header_end:]).decode().splitlines():
        match = re.match(r"(.+?)\s+py:\w+\s+-?\d+\s", line)
        if match:
            names.add(match.group(1))
    return names


def test_the_docs_build_with_warnings_as_errors(built_docs):
    assert (built_docs / "index.html").is_file()
    for page in ("getting-started", "migrating", "architecture", "performance", "protocol",
                 "changelog", "api/client", "deploy/README"):
        assert (built_docs / f"{page}.html").is_file(), page


def test_every_public_name_of_distributed_server_is_in_the_api_reference(built_docs):
    names = documented_names(built_docs)
    missing = [n for n in distributed_server.__all__ if f"distributed_server.{n}" not in names]
    assert not missing, (
        f"distributed_server.__all__ names missing from the API reference (docs/api/): "
        f"{missing}; document each by its public path, e.g. "
        f"`.. autofunction:: distributed_server.{missing[0]}` (or autoclass, autodata)")


def test_every_public_name_of_distributed_core_is_in_the_api_reference(built_docs):
    names = documented_names(built_docs)
    missing = [n for n in distributed_core.__all__ if f"distributed_core.{n}" not in names]
    assert not missing, f"distributed_core.__all__ names missing from docs/api/core.rst: {missing}"


def load_extension(name: str):
    """A local Sphinx extension of docs/_ext/, as a module."""
    spec = importlib.util.spec_from_file_location(f"docs_ext_{name}", DOCS / "_ext" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_state_diagrams_show_every_move_of_the_cores_tables(built_docs):
    page = (built_docs / "architecture.html").read_text()
    assert page.count('<svg class="dcore-states"') == 2
    states = load_extension("dcore_states")
    for machine, at_least in (("scheduler", 15), ("worker", 20)):
        _, moves, _ = states.read_machine(machine)
        assert len(moves) >= at_least, (machine, moves)
        for start, finish in moves:
            assert f"{start} \u2192 {finish}</title>" in page, (machine, start, finish)


def test_the_layout_table_shows_every_unit_of_the_layout_test_in_its_order(built_docs):
    page = (built_docs / "architecture.html").read_text()
    layout = load_extension("dcore_layout")
    table, package, _ = layout.read_layout(DOCS)
    start = page.index('<table class="dcore-layout')
    body = page[page.index("<tbody>", start):page.index("</table>", start)]
    first_cells = re.findall(r'<tr[^>]*>\s*<td><p><code[^>]*><span class="pre">([^<]+)<', body)
    assert first_cells == [layout.unit_label(unit, package) for unit in table]


# Tags that make a browser fetch something when the page loads.
_LOADING_TAG = re.compile(
    r"<(?:script|link|img|iframe|source|audio|video|embed|object)\b[^>]*?"
    r"\b(?:src|href|data|srcset)\s*=\s*[\"']?\s*(?:https?:)?//", re.IGNORECASE)
_REMOTE_CSS = re.compile(r"(?:url\(\s*[\"']?|@import\s+[\"'])\s*(?:https?:)?//", re.IGNORECASE)


def test_no_page_loads_anything_from_another_host(built_docs):
    offenders = []
    for path in sorted(built_docs.rglob("*")):
        if path.suffix in (".html", ".css", ".js") and path.is_file():
            text = path.read_text(errors="replace")
            pattern = _REMOTE_CSS if path.suffix == ".css" else _LOADING_TAG
            if path.suffix == ".html":
                found = pattern.findall(text) + _REMOTE_CSS.findall(text)
            else:
                found = pattern.findall(text)
            if found:
                offenders.append(f"{path.relative_to(built_docs)}: {found[:3]}")
    assert not offenders, "remote assets (every asset must be local):\n" + "\n".join(offenders)


def test_the_docs_sources_name_no_result_file_outside_the_baselines():
    cited = set()
    for page in [*DOCS.rglob("*.md"), DOCS.parent / "README.md"]:
        cited.update(re.findall(r"benchmarks/(?:baselines|results)/[\w.-]+\.(?:json|png)",
                                page.read_text()))
    root = DOCS.parent
    missing = sorted(c for c in cited if not (root / c).is_file())
    assert not missing, f"the docs cite result files that are not in the repository: {missing}"
