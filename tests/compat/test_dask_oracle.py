"""dask's own tests as an oracle (ci/dask_oracle.py --quick): a file of each of
dask.delayed, dask.bag, dask.array and dask.dataframe, run as shipped and with every
compute sent to a LocalCluster of this project; every test that passes as shipped passes
here too, except those listed in ci/dask_oracle_known.txt with their reason."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("dask.dataframe")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_dask_own_tests_pass_through_this_project_as_shipped():
    run = subprocess.run([sys.executable, str(ROOT / "ci" / "dask_oracle.py"), "--quick"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    shipped = re.search(r"as shipped\s+(\d+)", run.stdout)
    routed = re.search(r"through distributed-core\s+(\d+)", run.stdout)
    assert shipped and routed, run.stdout
    assert int(routed.group(1)) > 100, run.stdout  # the selection really ran here
