"""The packaging and architecture contract of distributed-core.

- ``distributed_core.COMPILED`` is what the CI variant promises (``EXPECT_COMPILED=0``
  or ``1``; these tests skip when it is unset), and the core came from the matching file:
  the C extension, or ``_core.pyx`` read as Python source.
- ``distributed_core`` imports only from an allow-list: no I/O, threads, clocks, logging,
  pickling or randomness, and never ``distributed_server`` (docs/architecture.md).
- ``distributed_server`` reaches ``distributed_core`` only through the package root.

The source checks read the checkout next to this file, not the installed copy, so they
check the same code whichever variant is installed.
"""
import ast
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

import distributed_core

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE_DIR = ROOT / "distributed_core"
SERVER_DIR = ROOT / "distributed_server"

# Top-level modules distributed_core may import (plus relative imports of itself).
CORE_IMPORT_ALLOW_LIST = frozenset({
    "__future__", "cython", "typing", "collections", "heapq", "math", "itertools",
    "dataclasses", "importlib", "os", "sys", "array",
})
# Public names of distributed_core that start with an underscore.
PUBLIC_DUNDERS = frozenset({"__version__", "__all__"})


def expected_compiled():
    value = os.environ.get("EXPECT_COMPILED", "")
    if value == "":
        pytest.skip("EXPECT_COMPILED is not set (ci/test.sh sets it per variant)")
    if value not in ("0", "1"):
        pytest.fail(f"EXPECT_COMPILED must be 0 or 1, not {value!r}")
    return value == "1"


def parse(path):
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        pytest.fail(f"{path.name} is not plain Python syntax (line {exc.lineno}): {exc.msg}. "
                    "The core must stay in Cython's pure-Python syntax.")


def dynamic_import_target(node):
    """The module name of an ``__import__(...)`` / ``import_module(...)`` call, or None
    when ``node`` is no such call ("" when the name is not a literal)."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if name not in ("__import__", "import_module"):
        return None
    if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return ""


def imports(tree):
    """(line, module, level, names) for every import in ``tree``, at any depth, including
    literal ``__import__``/``importlib.import_module`` calls (level 0, no names)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, 0, ()
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or "", node.level, tuple(a.name for a in node.names)
        else:
            target = dynamic_import_target(node)
            if target is not None:
                yield node.lineno, target or "<a computed module name>", 0, ()


def core_sources():
    return sorted(CORE_DIR.glob("*.py")) + sorted(CORE_DIR.glob("*.pyx"))


def server_sources():
    return sorted(SERVER_DIR.rglob("*.py"))


def relative(path):
    return str(path.relative_to(ROOT))


# --- which core is running ---------------------------------------------------------


def test_compiled_flag_matches_the_variant_under_test():
    assert distributed_core.COMPILED is expected_compiled()


def test_core_is_loaded_from_the_file_of_the_variant_under_test():
    core = distributed_core._core
    assert sys.modules["distributed_core._core"] is core
    if expected_compiled():
        assert core.__file__.endswith((".so", ".pyd")), core.__file__
    else:
        assert pathlib.Path(core.__file__).name == "_core.pyx", core.__file__


def test_pure_switch_loads_the_pyx_as_python_source(tmp_path):
    # Works in both variants: the compiled install ships _core.pyx as the fallback.
    code = "import distributed_core as d; print(d.COMPILED); print(d._core.__file__)"
    env = dict(os.environ, DISTRIBUTED_CORE_PURE="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "False"
    assert pathlib.Path(out[1]).name == "_core.pyx"


def test_import_emits_no_warnings(tmp_path):
    result = subprocess.run([sys.executable, "-W", "error", "-c", "import distributed_core"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_package_version_matches_the_installed_metadata():
    assert importlib.metadata.version("distributed-core") == distributed_core.__version__


# --- the architecture contract, read from the source ---------------------------------


def test_core_sources_include_the_state_machine():
    assert CORE_DIR / "_core.pyx" in core_sources()


@pytest.mark.parametrize("path", core_sources(), ids=relative)
def test_core_imports_only_from_the_allow_list(path):
    violations = []
    for line, module, level, _ in imports(parse(path)):
        top = module.split(".")[0]
        if level == 1 or (level == 0 and (top in CORE_IMPORT_ALLOW_LIST
                                          or top == "distributed_core")):
            continue
        shown = "." * level + module
        violations.append(f"{relative(path)}:{line}: imports {shown}")
    assert not violations, (
        "distributed_core may import only " + ", ".join(sorted(CORE_IMPORT_ALLOW_LIST))
        + " and itself (no I/O, threads, clocks, logging, pickle, randomness, "
        "distributed_server):\n" + "\n".join(violations))


@pytest.mark.parametrize("path", server_sources(), ids=relative)
def test_server_uses_only_the_core_package_root(path):
    tree = parse(path)
    violations = []
    core_aliases = set()
    for line, module, level, names in imports(tree):
        if level or module.split(".")[0] != "distributed_core":
            continue
        if module != "distributed_core":
            violations.append(f"{relative(path)}:{line}: imports {module}")
        for name in names:
            if name.startswith("_") and name not in PUBLIC_DUNDERS:
                violations.append(f"{relative(path)}:{line}: imports distributed_core.{name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            core_aliases.update(a.asname or a.name for a in node.names
                                if a.name == "distributed_core")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in core_aliases and node.attr.startswith("_")
                and node.attr not in PUBLIC_DUNDERS):
            violations.append(f"{relative(path)}:{node.lineno}: uses "
                              f"distributed_core.{node.attr}")
    assert not violations, (
        "distributed_server may use only distributed_core's public names "
        "(`from distributed_core import X`), not its internals:\n" + "\n".join(violations))


def test_every_public_name_of_the_shell_resolves_and_a_server_process_skips_the_client():
    """``distributed_server`` exports its names on first use (PEP 562): each name in
    ``__all__`` resolves to the object of its module, and importing the package and the
    worker's modules, as a worker process does, imports nothing of the client."""
    import distributed_server

    for name in distributed_server.__all__:
        assert getattr(distributed_server, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        distributed_server.nothing  # noqa: B018
    code = ("import sys, distributed_server.cli, distributed_server.deploy.nanny, "
            "distributed_server.worker.server; "
            "print(sorted(m for m in sys.modules if m.startswith('distributed_server.client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
