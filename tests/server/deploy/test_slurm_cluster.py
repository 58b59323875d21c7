"""SLURMCluster against stand-ins for sbatch, squeue and scancel (shims/: each job runs as
a local process group, `bash SCRIPT`, with SLURM_JOB_ID set; state in $SLURM_SHIM_DIR).
The scheduler, the nannies and the workers are the real processes, on loopback; the
scheduler's output (our stdout/stderr) and the jobs' output files must hold no ERROR."""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import random
import re
import signal
import stat
import sys
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest
from server_helpers import wait_for

from distributed_server import Client, wait
from distributed_server.deploy.processes import ClusterError
from distributed_server.deploy.slurm import SLURMCluster, parse_bytes, slurm_memory

SHIMS = Path(__file__).resolve().parent / "shims"

pytestmark = pytest.mark.timeout(120)
# Worker processes cannot import test modules: these functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def slow_square(x, delay=0.0):
    if delay:
        time.sleep(delay)
    return x * x


@pytest.fixture
def slurm(tmp_path, monkeypatch, capfd):
    """SLURM's commands are the shims (state in tmp_path/slurm); at the end no job process
    is left (any that is, is killed and fails the test), and nothing logged an ERROR."""
    state = tmp_path / "slurm"
    monkeypatch.setenv("SLURM_SHIM_DIR", str(state))
    monkeypatch.setenv("SLURM_SHIM_CLUSTER", "shimcluster")  # --parsable: "JOBID;CLUSTER"
    monkeypatch.setenv("PATH", os.pathsep.join([str(SHIMS), str(Path(sys.executable).parent),
                                                os.environ["PATH"]]))
    yield state
    left = []
    for job in shim_jobs(state):
        if job["pgid"] and group_alive(job["pgid"]):
            left.append(job["id"])
            os.killpg(job["pgid"], signal.SIGKILL)
    out, err = capfd.readouterr()
    sys.stdout.write(out)
    sys.stderr.write(err)
    assert not left, f"jobs {left} still ran after the test"
    assert " ERROR " not in out + err
    for path in glob.glob(str(tmp_path / "logs" / "*")):
        assert " ERROR " not in Path(path).read_text(), path


def shim_jobs(state: Path) -> list:
    return [json.loads(p.read_text()) for p in sorted((state / "jobs").glob("*.json"))]


def group_alive(pgid: int) -> bool:
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            pass
    return False


def make_cluster(tmp_path, **kwargs) -> SLURMCluster:
    options = {"cores": 1, "memory": "1GiB", "host": "127.0.0.1", "dashboard_address": None,
               "log_directory": str(tmp_path / "logs"),
               "shared_temp_directory": str(tmp_path), "check_interval": 0.5, "timeout": 60}
    options.update(kwargs)
    return SLURMCluster(**options)


def names_of(client) -> list:
    return sorted(w["name"] for w in client.scheduler_info()["workers"].values())


def test_sizes_and_arguments_are_checked_before_anything_starts(tmp_path):
    assert parse_bytes("4GiB") == 4 * 2**30 and parse_bytes("4GB") == 4 * 10**9
    assert parse_bytes(2**30) == 2**30
    assert slurm_memory(4 * 2**30) == "4G" and slurm_memory(4 * 10**9) == "3815M"
    for bad in ("0.5", "lots", "4 bytes"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(TypeError):
        parse_bytes(True)
    with pytest.raises(ValueError, match="cores"):
        SLURMCluster(cores=1, memory="1GiB", processes=2)
    with pytest.raises(ValueError, match="walltime"):
        SLURMCluster(cores=1, memory="1GiB", walltime="1 hour")
    with pytest.raises(ValueError, match="job_name"):
        SLURMCluster(cores=1, memory="1GiB", job_name="a b")
    assert not list(tmp_path.iterdir())


def test_the_job_script_asks_for_what_was_given_and_credentials_stay_off_it(slurm, tmp_path):
    cluster = make_cluster(
        tmp_path, cores=2, memory="1GiB", processes=2, walltime="00:10:00", queue="debug",
        account="proj-1", job_name="dcw", job_extra_directives=["--exclusive",
                                                                "#SBATCH --qos=short"],
        job_script_prologue=['echo "prologue ran in $SLURM_JOB_ID"'])
    token = cluster.security.token
    try:
        script = cluster.job_script()
        for directive in ("--job-name=dcw", "--ntasks=1", "--cpus-per-task=2", "--mem=1G",
                          "--time=00:10:00", "--partition=debug", "--account=proj-1",
                          "--exclusive", "--qos=short",
                          f"--output={tmp_path}/logs/dcw-%j.out",
                          f"--error={tmp_path}/logs/dcw-%j.err"):
            assert f"\n#SBATCH {directive}\n" in script, directive
        assert token not in script
        assert script.count(" worker tcp://127.0.0.1:") == 2 and script.rstrip().endswith("wait")
        credentials = re.search(r"^DCORE_CREDENTIALS=(\S+)$", script, re.MULTILINE).group(1)
        assert stat.S_IMODE(os.stat(credentials).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(credentials)).st_mode) == 0o700
        assert f"DCORE_TOKEN={token}" in Path(credentials).read_text()

        cluster.scale(jobs=1)
        (job_id,) = cluster.job_ids
        cluster.wait_for_workers(2, timeout=60)
        with Client(cluster, set_as_default=False) as client:
            assert client.submit(slow_square, 7).result(timeout=30) == 49
            workers = client.scheduler_info()["workers"].values()
            assert sorted(w["name"] for w in workers) == [f"dcw-{job_id}-0", f"dcw-{job_id}-1"]
            assert {w["nthreads"] for w in workers} == {1}
            assert {w["memory_limit"] for w in workers} == {2**29}
        # what sbatch was given holds no credential, nor does any command line
        (job,) = shim_jobs(slurm)
        assert token not in Path(job["script"]).read_text()
        in_job = []
        for proc in psutil.process_iter(["cmdline", "environ"]):
            try:
                assert token not in " ".join(proc.info["cmdline"] or ()), proc.info["cmdline"]
                environ = proc.info["environ"] or {}
                # this test's job: job ids restart at 1001 in every shim directory
                if environ.get("SLURM_JOB_ID") == job_id and \
                        environ.get("SLURM_SHIM_DIR") == os.environ.get("SLURM_SHIM_DIR"):
                    in_job.append(proc.info)
            except psutil.Error:
                pass
        # 2 nannies and their workers got the token from the file the batch shell read
        # (the shell's own environment, as sbatch started it, has none)
        dcore = [p for p in in_job if "distributed_server.cli" in p["cmdline"]]
        assert len(dcore) == 4, in_job
        assert all(p["environ"].get("DCORE_TOKEN") == token for p in dcore)
        assert all("DCORE_TOKEN" not in p["environ"] for p in in_job if p not in dcore)
        assert f"prologue ran in {job_id}" in (tmp_path / "logs" / f"dcw-{job_id}.out").read_text()
    finally:
        cluster.close()
    assert not os.path.exists(os.path.dirname(credentials))
    (job,) = shim_jobs(slurm)
    assert job["state"] == "CANCELLED"
    assert not group_alive(job["pgid"])


def test_scale_by_jobs_and_down_to_one_job_keeps_every_result(slurm, tmp_path):
    with make_cluster(tmp_path, cores=2, processes=2) as cluster, \
            Client(cluster, set_as_default=False) as client:
        cluster.scale(jobs=2)
        assert len(cluster.job_ids) == 2 and len(cluster.worker_names) == 4
        cluster.wait_for_workers(4, timeout=60)
        total = client.submit(sum, client.map(slow_square, range(20)))
        assert total.result(timeout=60) == sum(i * i for i in range(20))
        # one result only each worker holds
        held = [client.submit(random.random, pure=False, workers=[address])
                for address in client.scheduler_info()["workers"]]
        wait(held, timeout=30)
        values = client.gather(held)

        cluster.scale(jobs=1)
        (stays,) = cluster.job_ids
        assert cluster.worker_names == [f"dcore-worker-{stays}-0", f"dcore-worker-{stays}-1"]
        wait_for(lambda: len(client.scheduler_info()["workers"]) == 2, timeout=30)
        assert names_of(client) == cluster.worker_names
        # the results of the workers that left moved before they went: not recomputed
        assert client.gather(held) == values
        for future in held:
            story = [(e.start, e.finish) for e in client.story(future) if e.where == "scheduler"]
            assert story == [("released", "waiting"), ("waiting", "processing"),
                             ("processing", "memory")], story
        assert total.result(timeout=30) == sum(i * i for i in range(20))
        cluster.scale(1)  # a job holds 2 workers: still one job
        assert cluster.job_ids == [stays]
    # close() cancels the job and waits up to its timeout (10 s) for squeue to list it
    # ended; on a loaded machine (CI, 2 cores) its workers can take longer to go
    wait_for(lambda: sorted(job["state"] for job in shim_jobs(slurm)) == ["CANCELLED"] * 2,
             timeout=60)


def test_adapt_grows_from_zero_with_a_burst_and_goes_back_to_zero(slurm, tmp_path):
    with make_cluster(tmp_path) as cluster, Client(cluster, set_as_default=False) as client:
        assert cluster.job_ids == []
        adaptive = cluster.adapt(minimum=0, maximum=3, interval="200ms", wait_count=3,
                                 target_duration="1s")
        futures = client.map(slow_square, range(12), delay=0.5)
        wait(futures, timeout=60)
        assert client.gather(futures) == [i * i for i in range(12)]
        assert any(action == "up" for *_, action in adaptive.log)
        assert 1 <= max(wanted for _, _, wanted, _ in adaptive.log) <= 3  # maximum: 3 jobs
        assert shim_jobs(slurm)
        del futures  # nothing held: the cluster may go to zero
        wait_for(lambda: cluster.job_ids == [], timeout=30)
        wait_for(lambda: not client.scheduler_info()["workers"], timeout=30)
        assert any(action == "down" for *_, action in adaptive.log)
        wait_for(lambda: all(job["state"] == "CANCELLED" for job in shim_jobs(slurm)),
                 timeout=30)


def test_a_job_killed_while_wanted_is_replaced_and_the_work_finishes(slurm, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="distributed_server.slurm")
    with make_cluster(tmp_path) as cluster, Client(cluster, set_as_default=False) as client:
        cluster.scale(jobs=2)
        first, second = cluster.job_ids
        cluster.wait_for_workers(2, timeout=60)
        futures = client.map(slow_square, range(16), delay=0.3)
        wait_for(lambda: sum(f.done() for f in futures) >= 2, timeout=30)
        (killed,) = [job for job in shim_jobs(slurm) if job["id"] == first]
        os.killpg(killed["pgid"], signal.SIGKILL)  # the node is lost, say
        wait(futures, timeout=60)
        assert client.gather(futures) == [i * i for i in range(16)]
        wait_for(lambda: len(cluster.job_ids) == 2 and first not in cluster.job_ids,
                 timeout=30)
        assert cluster.job_ids[0] == second
        replacement = cluster.job_ids[1]
        wait_for(lambda: names_of(client) == sorted([f"dcore-worker-{second}-0",
                                                      f"dcore-worker-{replacement}-0"]),
                 timeout=60)
        assert client.submit(slow_square, 9).result(timeout=30) == 81
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "distributed_server.slurm"]
    assert any(f"job {first} " in m and "while still wanted" in m for m in warnings), warnings
    states = {job["id"]: job["state"] for job in shim_jobs(slurm)}
    assert states == {first: "FAILED", second: "CANCELLED", replacement: "CANCELLED"}, states


def test_sbatch_failing_or_missing_is_a_clear_cluster_error(slurm, tmp_path, monkeypatch):
    with pytest.raises(ClusterError, match="sbatch failed .*Invalid partition name specified"):
        make_cluster(tmp_path, n_workers=1, queue="gpu")
    # the constructor cleaned up: no scheduler left, no private directory
    assert not list(tmp_path.glob(".dcore-slurm-*"))
    assert not [p for p in psutil.Process().children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE and "scheduler" in p.cmdline()]

    with make_cluster(tmp_path, job_extra_directives=["--no-such-option"]) as cluster:
        with pytest.raises(ClusterError, match="unrecognized option '--no-such-option'"):
            cluster.scale(jobs=1)
        assert cluster.job_ids == []
        monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
        with pytest.raises(ClusterError, match="sbatch: command not found"):
            cluster.scale(2)
    assert not (slurm / "jobs").exists() or shim_jobs(slurm) == []


def test_the_documented_example_adapts_and_sums(slurm, tmp_path, monkeypatch, capfd):
    """docs/deploy/slurm/slurm_cluster.py, with this machine's address and a small job."""
    path = Path(__file__).resolve().parents[3] / "docs" / "deploy" / "slurm" / "slurm_cluster.py"
    spec = importlib.util.spec_from_file_location("slurm_cluster_example", path)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)
    spec.loader.exec_module(example)
    cloudpickle.register_pickle_by_value(example)  # `python slurm_cluster.py` pickles __main__
    monkeypatch.chdir(tmp_path)  # its log_directory and private directory go here
    monkeypatch.delenv("SLURM_SHIM_CLUSTER")  # --parsable prints "JOBID" alone
    total = example.main(200, maximum=2, cores=2, memory="1GiB", host="127.0.0.1",
                         dashboard_address=None, check_interval=0.5, log_directory="logs")
    assert total == sum(i * i for i in range(200))
    out, err = capfd.readouterr()
    sys.stdout.write(out)  # captured again, for the fixture's check
    sys.stderr.write(err)
    assert "#SBATCH --job-name=dcore-example" in out and "sum of squares 200" in out
    assert shim_jobs(slurm) and all(job["state"] == "CANCELLED" for job in shim_jobs(slurm))
    assert not list(tmp_path.glob(".dcore-slurm-*"))
