"""The rules the core's header states: no I/O, no clock, the documented API, one source."""
from __future__ import annotations

import ast
import os

import distributed_core

CORE_DIR = os.path.dirname(distributed_core.__file__)
ALLOWED_IMPORTS = {
    "_core.pyx": {"__future__", "cython", "_cython_shim", "heapq", "math", "collections",
                  "typing"},
    "_cython_shim.py": {"dataclasses"},
    "__init__.py": {"importlib", "os", "sys", "_core"},
}


def imported_modules(filename: str) -> set:
    with open(os.path.join(CORE_DIR, filename), encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x
                found.update(alias.name for alias in node.names)
            else:
                found.add(node.module.split(".")[0])
    return found


def test_core_imports_nothing_outside_its_allow_list():
    for filename, allowed in ALLOWED_IMPORTS.items():
        assert imported_modules(filename) <= allowed, filename


def test_core_source_names_no_clock_or_io():
    with open(os.path.join(CORE_DIR, "_core.pyx"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not names & {"time", "datetime", "open", "print", "socket", "pickle", "logging"}


def test_documented_api_is_exported():
    assert distributed_core.TASK_STATES == (
        "released", "waiting", "queued", "no-worker", "processing", "memory", "erred",
        "forgotten")
    for name in distributed_core.__all__:
        assert hasattr(distributed_core, name), name
    assert issubclass(distributed_core.InvariantError, AssertionError)
    assert issubclass(distributed_core.GraphError, ValueError)


def test_compiled_flag_matches_the_loaded_module():
    core = distributed_core._core
    assert distributed_core.COMPILED is core.COMPILED
    assert distributed_core.COMPILED == (not core.__file__.endswith(".pyx"))
    if os.environ.get("DISTRIBUTED_CORE_PURE", "").strip().lower() not in ("", "0", "false",
                                                                            "no"):
        assert distributed_core.COMPILED is False
