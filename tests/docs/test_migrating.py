"""docs/migrating.md lists every method of Client and Future and every flag of
``dcore scheduler`` and ``dcore worker``: a new one fails here until the page says
what it is."""
import re
import subprocess
import sys

import pytest
from docs_helpers import DOCS

from distributed_server import Client, Future

PAGE = (DOCS / "migrating.md").read_text()


def section(heading: str) -> str:
    """The text of the ``## heading`` section of the page."""
    start = PAGE.index(f"\n## {heading}\n")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start:end if end != -1 else None]


def table_after(text: str, first_cell: str) -> str:
    """The Markdown table whose header row starts with ``| first_cell |``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_cell} |"))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end])


def public_members(cls) -> list[str]:
    names = set()
    for klass in cls.__mro__[:-1]:  # not object's
        names.update(n for n in vars(klass) if not n.startswith("_"))
    return sorted(names)


def flags(command: str) -> list[str]:
    """Every ``--flag`` that ``dcore COMMAND --help`` shows."""
    result = subprocess.run([sys.executable, "-m", "distributed_server.cli", command, "--help"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    found = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", result.stdout)) - {"--help"}
    assert found, result.stdout
    return sorted(found)


@pytest.mark.parametrize("name", public_members(Client))
def test_every_client_method_is_in_the_client_table(name):
    assert f"`{name}`" in section("The Client"), (
        f"Client.{name} is not in docs/migrating.md's Client table: say what it is")


@pytest.mark.parametrize("name", public_members(Future))
def test_every_future_method_is_listed(name):
    assert f"`{name}`" in section("The Client"), f"Future.{name} is not in docs/migrating.md"


@pytest.mark.parametrize("command", ["scheduler", "worker"])
def test_every_flag_is_in_its_commands_table(command):
    table = table_after(section("Command-line flags"), f"`dcore {command}`")
    missing = [flag for flag in flags(command) if f"`{flag}`" not in table]
    assert not missing, f"dcore {command} flags missing from docs/migrating.md: {missing}"
