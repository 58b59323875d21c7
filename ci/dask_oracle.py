"""dask's own test files as an oracle: run them as shipped, then with every compute sent to
a distributed-core cluster (ci/dask_routing.py), and compare test by test.

    python ci/dask_oracle.py                  # the full selection (FULL below)
    python ci/dask_oracle.py --quick          # the short selection CI runs
    python ci/dask_oracle.py FILE_OR_DIR ...  # your own selection (paths inside dask)

The test files are the ones inside the installed dask package (``[dask]`` extra). Prints,
per system, the tests that passed and the wall time, then every test that passed as
shipped and did not pass through distributed-core, with the first line of its error.
Differences listed in ci/dask_oracle_known.txt (a test id and the reason, per line) are
expected: they are shown apart and do not fail the run. Exit status 1 when a difference
is not listed (or a listed one no longer happens, so the list stays true), else 0.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
KNOWN = HERE / "dask_oracle_known.txt"

#: The whole comparison: a selection of the core test files of dask.delayed, dask.bag,
#: dask.array and dask.dataframe that runs in minutes (name others on the command line).
FULL = [
    "tests/test_delayed.py",
    "bag/tests/test_bag.py", "bag/tests/test_random.py", "bag/tests/test_text.py",
    "array/tests/test_reductions.py", "array/tests/test_overlap.py",
    "dataframe/tests/test_indexing.py", "dataframe/tests/test_shuffle.py",
]
#: What CI runs: a file of each collection, well under a minute per system.
QUICK = ["tests/test_delayed.py", "bag/tests/test_random.py", "array/tests/test_overlap.py",
         "dataframe/tests/test_indexing.py"]


def dask_root() -> pathlib.Path:
    import dask

    return pathlib.Path(dask.__file__).resolve().parent


def run_pytest(paths: list, routed: bool, workdir: pathlib.Path, timeout: float,
               root: pathlib.Path) -> tuple:
    """Run pytest on ``paths`` in a child process; ``(outcomes, wall seconds)`` where
    outcomes maps a test id to "passed", "failed", "error", "skipped" or "xfailed"."""
    report = workdir / ("routed.xml" if routed else "shipped.xml")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            f"--junitxml={report}", "--timeout", str(timeout), "-o", "junit_family=xunit1",
            f"--rootdir={root}",
            *map(str, paths)]
    env = dict(os.environ)
    if routed:
        args[3:3] = ["-p", "dask_routing"]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    subprocess.run(args, cwd=workdir, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    return read_report(report), wall


def read_report(path: pathlib.Path) -> dict:
    """Test id (its file relative to dask, ``::``, its name) -> (outcome, first line of
    the message), from a JUnit XML report."""
    outcomes: dict = {}
    if not path.exists():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('file')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = ("failed" if child.tag == "failure" else "error",
                                    (child.get("message") or "").splitlines()[:1])
                message = message[0] if message else ""
            elif child.tag == "skipped":
                outcome = ("xfailed" if (child.get("type") or "") == "pytest.xfail"
                           else "skipped")
        outcomes[test_id] = (outcome, message)
    return outcomes


def read_known() -> dict:
    """Test id -> the reason it is expected to differ (ci/dask_oracle_known.txt)."""
    known = {}
    if KNOWN.exists():
        for line in KNOWN.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                test_id, _, reason = line.partition("  ")
                known[test_id.strip()] = reason.strip()
    return known


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="test files or folders, relative to dask")
    parser.add_argument("--quick", action="store_true", help="the short selection (CI)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per test")
    args = parser.parse_args(argv)
    root = dask_root()
    selection = args.paths or (QUICK if args.quick else FULL)
    paths = [root / p for p in selection]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        parser.error(f"not in the installed dask: {', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="dask-oracle-") as tmp:
        workdir = pathlib.Path(tmp)
        shipped, shipped_wall = run_pytest(paths, False, workdir, args.timeout, root)
        routed, routed_wall = run_pytest(paths, True, workdir, args.timeout, root)
    if not shipped or not routed:
        print("a pytest run produced no report", file=sys.stderr)
        return 2
    known = read_known()
    passed_shipped = {t for t, (o, _) in shipped.items() if o == "passed"}
    passed_routed = {t for t, (o, _) in routed.items() if o == "passed"}
    lost = sorted(passed_shipped - passed_routed)
    print(f"dask {__import__('dask').__version__}: {len(paths)} files, {len(shipped)} tests")
    print(f"{'':24}{'passed':>8}{'wall':>10}")
    print(f"{'as shipped':24}{len(passed_shipped):>8}{shipped_wall:>9.1f}s")
    print(f"{'through distributed-core':24}{len(passed_routed):>8}{routed_wall:>9.1f}s")
    unexpected = [t for t in lost if t not in known]
    expected = [t for t in lost if t in known]
    for title, tests in (("differences listed in ci/dask_oracle_known.txt", expected),
                         ("UNEXPECTED differences", unexpected)):
        if tests:
            print(f"\n{title} ({len(tests)}):")
            for test in tests:
                outcome, message = routed.get(test, ("missing", ""))
                reason = known.get(test, message)
                print(f"  {test}  [{outcome}] {reason[:160]}")
    stale = sorted(t for t in known if t in passed_routed)
    if stale:
        print(f"\nlisted but passing now ({len(stale)}): remove them from the list")
        for test in stale:
            print(f"  {test}")
    return 1 if unexpected or stale else 0


if __name__ == "__main__":
    sys.exit(main())
