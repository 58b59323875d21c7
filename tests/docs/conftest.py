"""The documentation, built once per test session for the docs tests.

The checkout's ``docs/`` is found next to this file (tests/docs/ -> the checkout), not
through the installed package: the compiled variant's package is installed elsewhere and
carries no docs. The build imports ``distributed_core`` and ``distributed_server`` from
the running interpreter, so it documents the variant under test.
"""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Test modules import the names below with `from docs_helpers import ...`. This file's
# own module name depends on pytest's import mode (prepend / importlib), so give it one.
sys.modules.setdefault("docs_helpers", sys.modules[__name__])


def sphinx_build(out: pathlib.Path, builder: str = "html") -> subprocess.CompletedProcess:
    """``python -m sphinx -W --keep-going`` of the running interpreter, into ``out``."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", builder, "-q",
         "-d", str(out / ".doctrees"), str(DOCS), str(out)],
        check=False, capture_output=True, text=True, timeout=300, env=env, cwd=out)


@pytest.fixture(scope="session")
def built_docs(tmp_path_factory) -> pathlib.Path:
    """The HTML site, built with warnings as errors; the build's failure fails the test."""
    out = tmp_path_factory.mktemp("docs-html")
    result = sphinx_build(out)
    assert result.returncode == 0, (
        f"sphinx-build -W failed (exit {result.returncode}):\n{result.stderr}\n{result.stdout}")
    return out
