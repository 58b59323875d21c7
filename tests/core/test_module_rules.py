"""The rules the cores' headers state (the scheduler's _core.pyx and the worker's
_worker_core.pyx): no I/O, no clock, the documented API, one source, and one copy of
what both cores share (the input checks live in _core; the worker core uses them)."""
from __future__ import annotations

import ast
import os

import distributed_core

CORE_DIR = os.path.dirname(distributed_core.__file__)
ALLOWED_IMPORTS = {
    "_core.pyx": {"__future__", "cython", "cython_shim", "heapq", "math", "collections",
                  "typing", "array"},
    "_worker_core.pyx": {"__future__", "cython", "cython_shim", "heapq", "collections",
                         "typing", "_core"},
    "cython_shim.py": {"dataclasses"},
    "__init__.py": {"importlib", "os", "sys", "_core", "_worker_core"},
}
STATE_MACHINES = ("_core.pyx", "_worker_core.pyx")


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


def module_functions(filename: str) -> set:
    with open(os.path.join(CORE_DIR, filename), encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename)
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


#: What the worker core takes from _core rather than define again.
SHARED = ("_check", "_check_key", "_check_keys", "_check_resources", "_check_str",
          "_zero_clock")


def test_no_function_is_written_in_both_cores():
    assert not module_functions("_core.pyx") & module_functions("_worker_core.pyx")


def test_the_worker_core_uses_the_scheduler_cores_checks():
    core, worker_core = distributed_core._core, distributed_core._worker_core
    for name in SHARED:
        assert getattr(worker_core, name) is getattr(core, name), name


def test_core_source_names_no_clock_or_io():
    for filename in STATE_MACHINES:
        with open(os.path.join(CORE_DIR, filename), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert not names & {"time", "datetime", "open", "print", "socket", "pickle", "logging",
                            "threading", "os", "sys", "random"}, filename


def test_documented_api_is_exported():
    assert distributed_core.TASK_STATES == (
        "released", "waiting", "queued", "no-worker", "processing", "memory", "erred",
        "forgotten")
    for name in distributed_core.__all__:
        assert hasattr(distributed_core, name), name
    assert issubclass(distributed_core.InvariantError, AssertionError)
    assert issubclass(distributed_core.GraphError, ValueError)


def test_compiled_flag_matches_the_loaded_modules():
    core, worker_core = distributed_core._core, distributed_core._worker_core
    assert distributed_core.COMPILED is (core.COMPILED and worker_core.COMPILED)
    for module in (core, worker_core):
        assert module.COMPILED == (not module.__file__.endswith(".pyx"))
    assert distributed_core.COMPILED == (not worker_core.__file__.endswith(".pyx"))
    assert distributed_core.WORKER_CORE_FILE == worker_core.__file__
    if os.environ.get("DISTRIBUTED_CORE_PURE", "").strip().lower() not in ("", "0", "false",
                                                                            "no"):
        assert distributed_core.COMPILED is False
