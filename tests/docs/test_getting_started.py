"""The examples of docs/getting-started.md run, against a real local cluster, and print
what the page says they print.

An example is a ```python block preceded by the line ``<!-- example -->``; the next
fenced block after it (```text) is its expected standard output. Each runs as a script
in its own process, as a reader would run it. Every ```python block of the page must be
such an example, so none goes untested.
"""
import os
import re
import subprocess
import sys

import pytest
from docs_helpers import DOCS

PAGE = DOCS / "getting-started.md"
_EXAMPLE = re.compile(
    r"<!-- example -->\s*\n```python\n(?P<code>.*?)\n```[ \t]*\n"
    r"(?P<between>(?:(?!```).)*?)```text\n(?P<output>.*?)\n```",
    re.DOTALL)


def examples() -> list[tuple[str, str]]:
    return [(m["code"], m["output"]) for m in _EXAMPLE.finditer(PAGE.read_text())]


def test_every_python_block_of_the_page_is_a_checked_example():
    text = PAGE.read_text()
    assert len(examples()) >= 3
    assert text.count("```python") == len(examples()), (
        "each ```python block of getting-started.md needs `<!-- example -->` before it and "
        "its output in a ```text block after it")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("number", range(len(examples())), ids=lambda n: f"example-{n + 1}")
def test_the_example_prints_what_the_page_shows(number, tmp_path):
    code, expected = examples()[number]
    script = tmp_path / f"example_{number + 1}.py"
    script.write_text(code + "\n")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, check=False,
                            capture_output=True,
                            text=True, timeout=150,
                            env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert result.returncode == 0, f"the example failed:\n{code}\n--- stderr:\n{result.stderr}"
    assert result.stdout.strip().splitlines() == expected.strip().splitlines(), (
        f"the example printed\n{result.stdout}\nthe page shows\n{expected}")
