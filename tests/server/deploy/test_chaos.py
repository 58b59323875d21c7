"""The chaos soak, short: real processes, real signals (issue 11, item 7a).

`benchmarks/chaos_soak.py` is the one implementation; this test runs 3 rounds of it. A
``dcore scheduler --validate`` process and ``dcore worker --nworkers 3`` (a nanny and 3
worker processes) compute a dask.dataframe task shuffle per round while worker processes
are SIGKILLed (the nanny restarts them), SIGSTOPped past the transfer timeout (1 s
here), and SIGSTOPped past the worker TTL (3 s here: the scheduler removes the worker,
which registers again after SIGCONT). Fails on a wrong result, an exception or no result
within 30 s (a hang), tasks left on the scheduler or on a worker, or an ERROR line in the
scheduler's (or a worker's) log. The full run, with its figures: ``python
benchmarks/chaos_soak.py --rounds 30``.
"""
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("dask.dataframe")

pytestmark = pytest.mark.timeout(240)

SOAK_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "chaos_soak.py"


def load_soak():
    name = "chaos_soak"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SOAK_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: cloudpickle registers it by name
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_task_shuffle_rounds_stay_right_while_workers_are_killed_and_stopped(tmp_path):
    soak = load_soak()
    config = soak.SoakConfig(
        rounds=3, seed=11, end="2000-01-09", npartitions=8,  # 8 days, 8 partitions
        transfer_timeout=1.0, worker_ttl=3.0,  # stops of 1.5 s and 4.5 s
        round_timeout=30.0, heal_timeout=30.0, drain_timeout=20.0,
        # every kind of event in 3 rounds, at most one worker lost per round planned (a
        # worker a loaded machine's scheduler misses for the TTL would be one more)
        kinds=(("kill", "stop"), ("long-stop", "stop"), ("stop", "kill")))
    report = soak.run_soak(config, tmp_path)
    summary = report.summary()
    print("\n" + summary)
    assert report.ok, f"{summary}\nlogs: {tmp_path}"
    assert len(report.rounds) == 3 and all(r.ok for r in report.rounds)
    # the first event of each round is planned within half the undisturbed round's time,
    # so it lands while the graph runs: every kind happened
    for kind in ("kill", "stop", "long-stop"):
        assert report.count(kind) >= 1, summary
    assert report.restarts >= report.count("kill"), summary
    assert report.ttl_removals >= 1, summary
    assert report.leaked_tasks == 0
    assert report.held_by_workers and not any(report.held_by_workers.values())
    assert not report.scheduler_errors
