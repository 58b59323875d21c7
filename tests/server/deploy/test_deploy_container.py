"""docs/deploy/Containerfile: what it copies, installs and runs, checked for real here.

No container engine runs on this machine (the docker client has no daemon, and the base
image could not be pulled without network), so the image itself is built only where one
answers (`test_the_image_builds_and_runs_dcore`). Everything the image does is still run:
the build stage's `pip wheel` on exactly the files its COPY lines name, the runtime
stage's `pip install` of that wheel, and the entrypoint it leaves.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

import distributed_core

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "docs" / "deploy"
CONTAINERFILE = DEPLOY / "Containerfile"

pytestmark = pytest.mark.timeout(600)


def instructions(path: Path = CONTAINERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    result, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        result.append((word.upper(), " ".join(rest.split())))
        pending = ""
    assert not pending, "the Containerfile ends inside a continued line"
    return result


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each stage (a FROM starts one); ARGs before the first FROM
    are left out."""
    result: list = []
    for word, rest in instructions():
        if word == "FROM":
            result.append([])
        if result:
            result[-1].append((word, rest))
    return result


def exec_form(text: str) -> list[str]:
    """A JSON-array ENTRYPOINT/CMD (exec form: no shell in between)."""
    value = yaml.safe_load(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
    return value


def final_stage() -> dict:
    last = stages()[-1]
    return {word: rest for word, rest in last}


def test_the_image_runs_dcore_as_an_unprivileged_user():
    final = final_stage()
    assert exec_form(final["ENTRYPOINT"]) == ["dcore"]
    user = final["USER"]
    uid, _, gid = user.partition(":")
    # Numeric, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0), user
    assert any(f"useradd --uid {uid} " in rest for word, rest in stages()[-1] if word == "RUN")
    for manifest in ("scheduler.yaml", "worker.yaml"):
        for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / manifest).read_text()):
            if doc["kind"] == "Deployment":
                pod = doc["spec"]["template"]["spec"]
                assert pod["securityContext"]["runAsUser"] == int(uid), manifest
                assert pod["securityContext"]["runAsNonRoot"] is True


def test_every_file_the_build_copies_exists_and_the_manifests_name_this_version():
    copies = [rest for stage in stages() for word, rest in stage
              if word == "COPY" and not rest.startswith("--from")]
    assert copies
    for rest in copies:
        *sources, _target = shlex.split(rest)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the checkout"
    images = {container["image"]
              for manifest in ("scheduler.yaml", "worker.yaml")
              for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / manifest).read_text())
              if doc["kind"] == "Deployment"
              for container in doc["spec"]["template"]["spec"]["containers"]}
    assert images == {f"distributed-core:{distributed_core.__version__}"}
    assert f"-t distributed-core:{distributed_core.__version__} ." in CONTAINERFILE.read_text()


def _build_context(tmp_path: Path) -> Path:
    """The files the build stage copies, laid out as its COPY lines put them in /src."""
    src = tmp_path / "src"
    src.mkdir()
    build = stages()[0]
    for word, rest in build:
        if word != "COPY":
            continue
        *sources, target = shlex.split(rest)
        assert target.startswith("/src"), rest
        for source in sources:
            path = ROOT / source
            dest = src / target[len("/src/"):] if len(sources) == 1 and not \
                target.endswith("/") else src / target[len("/src/"):] / path.name
            if path.is_dir():
                shutil.copytree(path, dest, ignore=shutil.ignore_patterns(
                    "__pycache__", "*.so", "*.c", "build"))
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)
    return src


def _run_line(stage, fragment: str) -> str:
    lines = [rest for word, rest in stage if word == "RUN" and fragment in rest]
    assert len(lines) == 1, (fragment, stage)
    return lines[0]


def test_the_build_and_install_lines_make_a_working_dcore(tmp_path):
    """The build stage's `pip wheel` on the COPY'd files, then the runtime stage's
    `pip install` of that wheel, then the entrypoint. The wheel is built without
    compiling (DISTRIBUTED_CORE_PURE=1: a compile takes minutes on this machine, and
    ci/build_wheel.sh builds and tests the compiled wheel from the same sources)."""
    build, final = stages()[0], stages()[-1]
    src, wheels, site = _build_context(tmp_path), tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip"]

    # The RUN line as written, with its two container paths pointed at directories here.
    wheel_line = shlex.split(_run_line(build, "pip wheel"))
    assert wheel_line[:2] == ["pip", "wheel"] and {"/src", "/wheels"} <= set(wheel_line)
    here = {"/src": str(src), "/wheels": str(wheels)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRIBUTED_CORE_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    built = subprocess.run([*pip, *(here.get(arg, arg) for arg in wheel_line[1:])],
                           capture_output=True, text=True, timeout=500, cwd=tmp_path,
                           env={**env, "DISTRIBUTED_CORE_PURE": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    install_line = _run_line(final, "pip install")
    pattern = re.search(r'"\$\(ls /wheels/([^)\s]+)\)\[\$\{EXTRAS\}\]"', install_line)
    assert pattern, install_line
    [wheel] = wheels.glob(pattern.group(1))  # exactly one wheel matches the install's glob

    # The runtime stage installs "WHEEL[EXTRAS]": every extra must be one the wheel has.
    extras = re.search(r"^ARG EXTRAS=(\S+)$", CONTAINERFILE.read_text(), re.MULTILINE).group(1)
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"distributed_core-{distributed_core.__version__}.dist-info/"
                           "METADATA").decode()
    provided = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.MULTILINE))
    assert set(extras.split(",")) <= provided, (extras, provided)

    # The install itself, without dependencies (this interpreter has them), into a target
    # directory that comes first on the path.
    installed = subprocess.run([*pip, "install", "--no-deps", "--no-cache-dir", "--target",
                                str(site), str(wheel)], capture_output=True, text=True,
                               timeout=300, env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    entrypoint = exec_form(final_stage()["ENTRYPOINT"])
    cmd = exec_form(final_stage()["CMD"])
    script = site / "bin" / entrypoint[0]
    assert script.exists(), f"the wheel installs no {entrypoint[0]} console script"
    ran = subprocess.run([sys.executable, str(script), *cmd], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={**env, "PYTHONPATH": str(site)})
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.startswith(f"distributed-core {distributed_core.__version__} (core "
                                 "interpreted: "), ran.stdout
    assert str(site) in ran.stdout  # the installed copy ran, not the checkout's


def _engine() -> str | None:
    for name in ("podman", "docker", "buildah"):
        exe = shutil.which(name)
        if exe is None:
            continue
        probe = [exe, "info"]
        if subprocess.run(probe, capture_output=True, timeout=60).returncode == 0:
            return exe
    return None


def test_the_image_builds_and_runs_dcore(tmp_path):
    engine = _engine()
    if engine is None:
        found = [n for n in ("podman", "docker", "buildah") if shutil.which(n)]
        pytest.skip("no container engine answers here (" + (
            ", ".join(f"{n} info fails" for n in found) if found else "none installed")
            + "); the build and install lines are run without one by "
            "test_the_build_and_install_lines_make_a_working_dcore")
    tag = f"distributed-core-test:{os.getpid()}"
    build = subprocess.run([engine, "build", "-f", str(CONTAINERFILE), "-t", tag, str(ROOT)],
                           capture_output=True, text=True, timeout=560)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    try:
        ran = subprocess.run([engine, "run", "--rm", tag], capture_output=True, text=True,
                             timeout=60)
        assert ran.returncode == 0 and "(core compiled:" in ran.stdout, ran
        whoami = subprocess.run([engine, "run", "--rm", "--entrypoint", "id", tag, "-u"],
                                capture_output=True, text=True, timeout=60)
        assert whoami.stdout.strip() == final_stage()["USER"].partition(":")[0]
    finally:
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=60)
