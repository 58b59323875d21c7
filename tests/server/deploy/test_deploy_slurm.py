"""docs/deploy/slurm/dcore.sbatch run under bash on this machine, as SLURM would run it on
the first node of a 2-node allocation: SLURM's environment variables are set, and `srun`
is a stand-in (shims/srun) that starts one task per "node" here, each with the
SLURM_PROCID / SLURM_NODEID / SLURMD_NODENAME a real srun gives it. The scheduler, the
nannies, their workers and the example client are the real processes the script starts,
on loopback."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed_server.security import ENVIRONMENT_VARIABLES

ROOT = Path(__file__).resolve().parents[3]
SLURM = ROOT / "docs" / "deploy" / "slurm"
SCRIPT = SLURM / "dcore.sbatch"
SHIMS = Path(__file__).resolve().parent / "shims"

pytestmark = pytest.mark.timeout(240)


def slurm_env(tmp_path: Path, **extra: str) -> dict:
    """The environment of a batch script on the first of 2 nodes with 2 CPUs and 1 GiB
    each; this interpreter's `dcore` and `python3` first on PATH, after the srun shim."""
    env = {k: v for k, v in os.environ.items()
           if k not in ENVIRONMENT_VARIABLES and not k.startswith(("SLURM", "DCORE_JOB"))}
    env.update(
        PATH=os.pathsep.join([str(SHIMS), str(Path(sys.executable).parent), env["PATH"]]),
        SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2",
        SLURM_SUBMIT_DIR=str(tmp_path), SLURM_CPUS_PER_TASK="2", SLURM_MEM_PER_NODE="1024",
        SLURMD_NODENAME="node0",
        # The first node's address: loopback here (a real node's name resolves to its IP).
        DCORE_JOB_SCHEDULER_HOST="127.0.0.1")
    env.update(extra)
    return env


def sbatch_options() -> dict:
    options = {}
    for line in SCRIPT.read_text().splitlines():
        if line.startswith("#SBATCH "):
            name, _, value = line.split()[1].partition("=")
            options[name] = value
    return options


def test_the_batch_script_runs_a_graph_on_workers_started_by_srun_on_every_node(tmp_path):
    job = subprocess.run(["bash", str(SCRIPT), str(SLURM / "example_client.py"), "500"],
                         cwd=tmp_path, env=slurm_env(tmp_path), capture_output=True,
                         text=True, timeout=200)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    assert f"sum of squares 500 {sum(i * i for i in range(500))} expected" in job.stdout, out
    # Each node's nanny started 2 workers (--nworkers), named after its node, with 1 thread
    # (2 CPUs / 2 workers) and 90% of 1 GiB / 2 as --memory-limit.
    workers = re.findall(r"^worker (\S+) tcp://127\.0\.0\.1:\d+ threads (\d+) memory_limit "
                         r"(\d+)$", job.stdout, re.MULTILINE)
    limit = 1024 * 1048576 // 10 * 9 // 2
    assert sorted(workers) == [(f"node{n}-{w}", "1", str(limit))
                               for n in (0, 1) for w in (0, 1)], out
    assert " ERROR " not in out, out
    # The job directory (token, scheduler file) is removed; every process has exited.
    assert not (tmp_path / "dcore-4242").exists()
    assert "scheduler at tcp://127.0.0.1:" in out and "nanny: every worker has exited" in out


def test_the_job_fails_with_the_client_scripts_status_and_still_stops_the_cluster(tmp_path):
    client = tmp_path / "failing_client.py"
    client.write_text(
        "import os, sys\n"
        "from distributed_server import Client\n"
        "with Client(scheduler_file=os.environ['DCORE_SCHEDULER_FILE'], timeout=60) as c:\n"
        "    c.wait_for_workers(int(os.environ['DCORE_JOB_WORKERS']), timeout=60)\n"
        "    print('workers', len(c.scheduler_info()['workers']), flush=True)\n"
        "    print('token file', os.environ['DCORE_TOKEN_FILE'], flush=True)\n"
        "    print('token mode', oct(os.stat(os.environ['DCORE_TOKEN_FILE']).st_mode & 0o777),"
        " flush=True)\n"
        "sys.exit(3)\n")
    job = subprocess.run(["bash", str(SCRIPT), str(client)], cwd=tmp_path,
                         env=slurm_env(tmp_path, DCORE_JOB_NWORKERS="1"),
                         capture_output=True, text=True, timeout=200)
    out = job.stdout + job.stderr
    assert job.returncode == 3, out
    assert "workers 2" in job.stdout, out
    assert f"token file {tmp_path}/dcore-4242/token" in job.stdout
    assert "token mode 0o600" in job.stdout
    assert not (tmp_path / "dcore-4242").exists()
    assert " ERROR " not in out, out


def test_scancel_stops_every_process_of_the_job(tmp_path):
    """SLURM ends a job (scancel, time limit) with SIGTERM to the batch shell and its
    steps: the script stops its workers and scheduler and exits."""
    client = tmp_path / "waiting_client.py"
    client.write_text(
        "import os, time\n"
        "from distributed_server import Client\n"
        "with Client(scheduler_file=os.environ['DCORE_SCHEDULER_FILE'], timeout=60) as c:\n"
        "    c.wait_for_workers(int(os.environ['DCORE_JOB_WORKERS']), timeout=60)\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(120)\n")
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(["bash", str(SCRIPT), str(client)], cwd=tmp_path,
                               env=slurm_env(tmp_path, DCORE_JOB_NWORKERS="1"), stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "ready" not in log.read_text():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGTERM)  # as slurmd signals every process of the job
        assert job.wait(60) != 0
        survivors = subprocess.run(["pgrep", "-s", str(job.pid)], capture_output=True,
                                   text=True).stdout.split()
        deadline = time.monotonic() + 30
        while survivors and time.monotonic() < deadline:
            time.sleep(0.2)
            survivors = subprocess.run(["pgrep", "-s", str(job.pid)], capture_output=True,
                                       text=True).stdout.split()
        assert not survivors, log.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert not (tmp_path / "dcore-4242").exists(), log.read_text()
    assert " ERROR " not in log.read_text(), log.read_text()


def test_the_script_asks_for_one_task_per_node_and_refuses_to_run_outside_slurm(tmp_path):
    options = sbatch_options()
    assert options["--ntasks-per-node"] == "1" and int(options["--nodes"]) >= 1
    assert "--mem" in options and "--cpus-per-task" in options
    env = slurm_env(tmp_path)
    del env["SLURM_JOB_ID"]
    outside = subprocess.run(["bash", str(SCRIPT), "x.py"], env=env, capture_output=True,
                             text=True, timeout=30, cwd=tmp_path)
    assert outside.returncode != 0 and "submit this script with sbatch" in outside.stderr
    no_script = subprocess.run(["bash", str(SCRIPT)], env=slurm_env(tmp_path),
                               capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert no_script.returncode == 2 and "usage: sbatch dcore.sbatch" in no_script.stderr
    assert not (tmp_path / "dcore-4242").exists()
