"""The shape of the shell, held by reading the code: every import of every module of
`distributed_server` (at any depth, lazy imports inside functions included) goes in the
declared direction, and no modules import each other in a circle.

The units are the subpackages (``comm``, ``scheduler``, ...) and the shared leaf modules
(``config``, ``security``, ...). `MAY_IMPORT` is the whole rule: what each unit may import
besides itself. Reading the table top-down gives the direction
client -> deploy -> {scheduler, worker} -> dashboard -> comm -> protocol -> distributed_core.
"""
from __future__ import annotations

import ast
import pathlib

import distributed_server

PACKAGE = pathlib.Path(distributed_server.__file__).resolve().parent
CORE = "distributed_core"

#: unit -> the other units it may import. "core" is distributed_core.
MAY_IMPORT: dict[str, set[str]] = {
    "config": set(),
    "logs": set(),
    "versions": {"core"},
    "diagnostics": set(),
    "protocol": {"core"},
    "security": {"config"},
    "plugins": {"protocol"},
    "comm": {"core", "protocol", "config", "logs", "security"},
    "dashboard": {"core", "protocol", "comm", "config", "logs", "security", "diagnostics"},
    "scheduler": {"core", "protocol", "comm", "dashboard", "diagnostics", "config", "logs",
                  "security", "versions", "plugins"},
    "worker": {"core", "protocol", "comm", "dashboard", "diagnostics", "config", "logs",
               "security", "versions", "plugins"},
    "deploy": {"core", "protocol", "comm", "scheduler", "worker", "diagnostics", "config",
               "logs", "security", "versions"},
    "client": {"core", "protocol", "comm", "deploy", "worker", "config", "logs", "security",
               "versions", "plugins"},
    "cli": {"core", "protocol", "comm", "dashboard", "scheduler", "worker", "deploy", "client",
            "diagnostics", "config", "logs", "security", "versions", "demo"},
    "demo": {"core", "client", "deploy"},
    "__init__": {"core", "protocol", "client", "deploy", "scheduler", "worker", "plugins",
                 "security"},
}


def _module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = ["distributed_server", *path.relative_to(package).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    return {_module_name(path, package): path for path in sorted(package.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The modules of distributed_server / distributed_core that ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module
            # each imported name may be a module of its own (resolved in _graph)
            targets = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] in ("distributed_server", CORE))
    return found


def _resolve(target: str, modules: dict) -> str:
    """The module an import target names: itself, or the module it is an attribute of."""
    while target not in modules and "." in target and target.split(".")[0] != CORE:
        target = target.rpartition(".")[0]
    return target


def _unit(module: str) -> str:
    parts = module.split(".")
    if parts[0] == CORE:
        return "core"
    return parts[1] if len(parts) > 1 else "__init__"


def _graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(package)
    return {name: {_resolve(t, modules) for t in _imports(name, path)}
            for name, path in modules.items()}


def test_every_unit_of_the_package_is_declared():
    units = {_unit(name) for name in _modules()}
    assert units == set(MAY_IMPORT), units ^ set(MAY_IMPORT)


def _wrong_directions(graph: dict) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        unit = _unit(module)
        for target in targets:
            other = _unit(target)
            if other != unit and other not in MAY_IMPORT[unit]:
                wrong.append(f"{module} imports {target} ({unit} may not import {other})")
    return sorted(wrong)


def _circles(graph: dict) -> list[str]:
    """Every circle a depth-first walk meets (a package's __init__ re-exporting its own
    modules is an edge like any other: a module importing its package's names closes a
    circle through it)."""
    graph = {m: {t for t in ts if t.startswith("distributed_server") and t != m}
             for m, ts in graph.items()}
    visiting, done, circles = set(), set(), []

    def visit(module, path):
        visiting.add(module)
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target in visiting:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path)
        path.pop()
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [])
    return circles


def test_every_import_goes_in_the_declared_direction():
    wrong = _wrong_directions(_graph())
    assert not wrong, "\n".join(wrong)


def test_the_scheduler_and_the_worker_never_import_each_other_nor_the_client():
    for unit in ("scheduler", "worker"):
        assert not MAY_IMPORT[unit] & {"scheduler", "worker", "client", "deploy"}, unit


def test_no_modules_import_each_other_in_a_circle():
    circles = _circles(_graph())
    assert not circles, "\n".join(circles)


def test_no_private_name_is_imported_from_another_module():
    wrong = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").startswith(("distributed_server", CORE))):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        wrong.append(f"{name}: {alias.name} from {'.' * node.level}"
                                     f"{node.module or ''}")
    assert not wrong, "\n".join(wrong)


def test_the_checks_catch_a_wrong_import_and_a_circle(tmp_path):
    fake = tmp_path / "distributed_server"
    (fake / "worker").mkdir(parents=True)
    (fake / "client").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "worker" / "__init__.py").write_text("")
    (fake / "client" / "__init__.py").write_text("from ..worker import server\n")
    (fake / "worker" / "server.py").write_text("def f():\n    from ..client import Client\n")
    graph = _graph(fake)
    assert _wrong_directions(graph) == [
        "distributed_server.worker.server imports distributed_server.client "
        "(worker may not import client)"]
    assert _circles(graph) == ["distributed_server.client -> distributed_server.worker.server"
                               " -> distributed_server.client"]


def test_the_schedulers_services_use_only_its_public_surface():
    """No module of the scheduler package reads a private attribute of the scheduler it
    serves (``scheduler._x``, ``self.scheduler._x``, ``server._x``): the services act
    through `Scheduler`'s public surface (``stimulus``, ``reply``, ``sid``, ...). Its own
    ``self._x`` is not concerned."""
    owners = {"scheduler", "server"}
    wrong = []
    for path in sorted((PACKAGE / "scheduler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            value = node.value
            if (isinstance(value, ast.Name) and value.id in owners) or (
                    isinstance(value, ast.Attribute) and value.attr in owners):
                where = path.relative_to(PACKAGE)
                wrong.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)
