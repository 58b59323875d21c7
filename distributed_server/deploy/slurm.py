"""SLURMCluster: a scheduler on this machine (a login node) and workers in SLURM batch
jobs that it submits, watches and cancels.

The manager starts ``dcore scheduler`` here, writes one batch script, and submits it with
``sbatch --parsable`` once per job; each job runs ``processes`` workers (``dcore
worker``, a nanny each) that connect back to the scheduler. `scale` and `adapt` (from
`Cluster`) count workers; a job holds ``processes`` of them, so counts are rounded up to
whole jobs. Scaling down closes whole jobs: jobs still waiting for their workers first;
then, under `adapt`, the scheduler ranks the workers best let go and a job is closed once
every worker of it has been ranked (`scale` closes the newest jobs, as `Cluster.scale`
lets go of the newest workers; see `_choose_to_close`). Their workers are retired first
(their results move to the workers that stay), then the job is cancelled with
``scancel``.

Every ``check_interval`` (and before every scaling decision) ``squeue`` is asked about the
jobs: one that ended while it was still wanted (killed, preempted, out of walltime, its
node lost) is replaced by a new job, with a WARNING. Three jobs in a row that end before
any of their workers joined stop the replacing: something in the job is broken, and
resubmitting it forever would only fill the queue (see the job's output file).

Credentials never appear on a command line nor in the batch script: they are written to a
file only the user can read (mode 0600) in a private directory (mode 0700) on a file
system the compute nodes share (``shared_temp_directory``, default the current
directory), which the script reads into the workers' environment; `close` removes it.
"""
from __future__ import annotations

import logging
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from ..config import parse_seconds
from ..security import ENVIRONMENT_VARIABLES, Security
from .cluster import Cluster
from .processes import ClusterError

__all__ = ["SLURMCluster"]

logger = logging.getLogger("distributed_server.slurm")

#: squeue's long state names (``%T``) of a job that has not ended. Any other state
#: (COMPLETED, CANCELLED, FAILED, TIMEOUT, NODE_FAIL, PREEMPTED, OUT_OF_MEMORY, BOOT_FAIL,
#: DEADLINE, COMPLETING ...), or a job squeue no longer lists, counts as ended.
ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED",
                           "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING",
                           "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"})
#: Jobs in a row that may end before any of their workers joined before replacing stops.
MAX_FAILED_STARTS = 3
#: Seconds a SLURM command may take before it counts as failed.
COMMAND_TIMEOUT = 60.0

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_JOB_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_WALLTIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")


def parse_bytes(value) -> int:
    """Bytes from ``4GiB``, ``4 GB``, ``4e9`` or an int."""
    if isinstance(value, bool):
        raise TypeError(f"memory {value!r}: give bytes, e.g. '4GiB'")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)",
                             str(value).strip().lower())
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(f"memory {value!r} is not a size such as '4GiB', '4GB' or '4e9'")
        number, unit = float(match.group(1)), match.group(2)
    result = int(number * _UNITS[unit])
    if result < 2**20:
        raise ValueError(f"memory {value!r} is less than 1 MiB: give the job's memory, "
                         "e.g. '4GiB'")
    return result


def slurm_memory(n: int) -> str:
    """``--mem`` for ``n`` bytes: whole GiB as ``NG``, else MiB rounded up (SLURM's units
    are powers of 1024, the default is MiB)."""
    if n % 2**30 == 0:
        return f"{n // 2**30}G"
    return f"{math.ceil(n / 2**20)}M"


def default_host() -> str:
    """An address of this machine that other machines can reach: the one its name
    resolves to, unless that is a loopback address, else the one of the interface of the
    default route (no packet is sent), else the name itself."""
    import ipaddress

    name = socket.gethostname()
    try:
        for *_, sockaddr in socket.getaddrinfo(name, None, socket.AF_INET):
            if not ipaddress.ip_address(sockaddr[0]).is_loopback:
                return sockaddr[0]
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
            if not ipaddress.ip_address(address).is_loopback:
                return address
        except OSError:
            pass
    return name


class _Job:
    __slots__ = ("id", "joined", "names", "submitted")

    def __init__(self, job_id: str, names: list) -> None:
        self.id = job_id
        self.names = names
        self.joined = False  # one of its workers was seen by the scheduler
        self.submitted = time.monotonic()


class SLURMCluster(Cluster):
    """A scheduler on this machine and workers in SLURM batch jobs.

    Each job asks for ``cores`` CPUs and ``memory`` (``"16GiB"``) on one node, for
    ``walltime`` (SLURM's ``--time``: ``"01:00:00"``, ``"2-00:00:00"``), in partition
    ``queue`` under ``account``, and runs ``processes`` workers there, each with
    ``cores // processes`` threads and a memory limit of ``memory // processes``. Workers
    are named ``<job_name>-<job id>-<i>``. ``job_extra_directives`` are more ``#SBATCH``
    options (``["--constraint=skylake", "--qos=short"]``); ``job_script_prologue`` shell
    lines run before the workers start (``["module load python", "source env/bin/activate"]``);
    ``python`` is the interpreter the jobs run ``distributed_server.cli`` with (default:
    this one, which must be reachable from the compute nodes); ``worker_extra_args`` more
    ``dcore worker`` flags; ``local_directory`` where workers spill (``--local-directory``,
    e.g. ``"$TMPDIR"``: the script expands it); ``death_timeout`` the seconds a worker
    waits for the scheduler before it gives up. ``log_directory`` receives each job's
    output (``<job_name>-<id>.out`` and ``.err``; default: SLURM's, ``slurm-<id>.out`` in
    the current directory).

    The scheduler listens on ``host`` (default: this machine's address as the compute
    nodes should see it, `default_host`; give e.g. the InfiniBand address where that is
    wrong) at ``scheduler_port`` (0: any free port), with its status page at
    ``dashboard_address`` (None: none). ``security`` (default: a fresh token) reaches the
    jobs through a file in a private directory created under ``shared_temp_directory``
    (default: the current directory; it must be on a file system the compute nodes see);
    with TLS, the certificate files are copied there too. ``n_workers`` workers (rounded up
    to whole jobs) are submitted at once; the constructor does not wait for them to start
    (`wait_for_workers` does). ``check_interval`` is how often ``squeue`` is asked whether
    jobs ended while still wanted (they are replaced); ``timeout`` bounds the scheduler's
    start and ``log_level`` is the scheduler's and the workers'.

    ``job_script()`` shows the batch script; ``scale(n)`` or ``scale(jobs=k)`` and
    ``adapt(minimum, maximum)`` change the number of workers; ``close()`` cancels every job
    and stops the scheduler.
    """

    def __init__(self, n_workers: int = 0, *, cores: int, memory, processes: int = 1,
                 walltime: str | None = "01:00:00", queue: str | None = None,
                 account: str | None = None, job_name: str = "dcore-worker",
                 job_extra_directives: list | tuple = (), job_script_prologue: list | tuple = (),
                 log_directory: str | None = None, python: str | None = None,
                 worker_extra_args: list | tuple = (), local_directory: str | None = None,
                 death_timeout: float = 60.0, host: str | None = None, scheduler_port: int = 0,
                 dashboard_address: str | None = ":8787", security: Security | None = None,
                 shared_temp_directory: str | None = None, check_interval="10s",
                 timeout: float = 30.0, log_level: str = "WARNING") -> None:
        if type(processes) is not int or processes < 1:
            raise ValueError(f"processes must be an int >= 1, not {processes!r}")
        if type(cores) is not int or cores < processes:
            raise ValueError(f"cores must be an int >= processes ({processes}), not {cores!r}")
        if not _JOB_NAME.fullmatch(job_name):
            raise ValueError(f"job_name {job_name!r}: use letters, digits and _.+- only")
        if walltime is not None and not _WALLTIME.fullmatch(walltime):
            raise ValueError(f"walltime {walltime!r} is not one of SLURM's formats "
                             "(MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)")
        for line in job_extra_directives:
            if not isinstance(line, str) or "\n" in line:
                raise ValueError(f"job_extra_directives takes one option per string, "
                                 f"not {line!r}")
        if type(n_workers) is not int or n_workers < 0:
            raise ValueError(f"n_workers must be an int >= 0, not {n_workers!r}")
        self.cores = cores
        self.memory = parse_bytes(memory)
        self.processes = processes
        self.worker_threads = cores // processes
        self.worker_memory = self.memory // processes
        self.walltime = walltime
        self.queue = queue
        self.account = account
        self.job_name = job_name
        self.job_extra_directives = [line.removeprefix("#SBATCH").strip()
                                     for line in job_extra_directives]
        self.job_script_prologue = list(job_script_prologue)
        self.log_directory = os.path.abspath(log_directory) if log_directory else None
        self.python = python or sys.executable
        self.worker_extra_args = [str(arg) for arg in worker_extra_args]
        self.local_directory = local_directory
        self.death_timeout = death_timeout
        self.check_interval = parse_seconds(check_interval)
        self._log_level = log_level
        super().__init__(security)
        self._jobs: dict = {}  # job id -> _Job, oldest first; the jobs wanted
        self._failed_starts = 0
        self._broken: str | None = None  # why jobs are not submitted any more
        self._closing = False
        self._directory = tempfile.mkdtemp(  # mode 0700
            prefix=".dcore-slurm-",
            dir=os.path.abspath(shared_temp_directory or os.getcwd()))
        self._credentials_file = os.path.join(self._directory, "credentials")
        self._script_file = os.path.join(self._directory, "job.sh")
        self._cleanup = weakref.finalize(self, _cancel_and_remove, self._jobs,
                                         self._directory)
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        try:
            if self.log_directory:
                os.makedirs(self.log_directory, exist_ok=True)
            self._write_credentials()
            self._start_scheduler(host or default_host(), scheduler_port, timeout, log_level,
                                  dashboard_address)
            _write_private(self._script_file, self.job_script())
            self.scale_to(n_workers)
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name="distributed-core-slurm-watch")
            self._watcher.start()
        except BaseException:
            self.close()
            raise

    def __repr__(self):
        return (f"<SLURMCluster {self.scheduler_address} {len(self._jobs)} jobs x "
                f"{self.processes} workers x {self.worker_threads} threads>")

    # ------------------------------------------------------------------ the batch script

    def job_script(self) -> str:
        """The batch script each job runs (the same for every job): ``#SBATCH`` options,
        the credentials file read into the environment, the prologue, then ``processes``
        ``dcore worker`` commands in the background and ``wait``."""
        directives = [f"--job-name={self.job_name}", "--nodes=1", "--ntasks=1",
                      f"--cpus-per-task={self.cores}", f"--mem={slurm_memory(self.memory)}"]
        if self.walltime:
            directives.append(f"--time={self.walltime}")
        if self.queue:
            directives.append(f"--partition={self.queue}")
        if self.account:
            directives.append(f"--account={self.account}")
        if self.log_directory:
            base = os.path.join(self.log_directory, self.job_name)
            directives += [f"--output={base}-%j.out", f"--error={base}-%j.err"]
        directives += self.job_extra_directives
        worker = [self.python, "-m", "distributed_server.cli", "worker",
                  self.scheduler_address, "--nthreads", str(self.worker_threads),
                  "--memory-limit", str(self.worker_memory), "--death-timeout",
                  str(self.death_timeout), "--log-level", self._log_level,
                  *self.worker_extra_args]
        command = " ".join(shlex.quote(arg) for arg in worker)
        if self.local_directory:  # may name a variable of the job ($TMPDIR): not quoted
            command += f' --local-directory "{self.local_directory}"'
        lines = ["#!/usr/bin/env bash", ""]
        lines += [f"#SBATCH {directive}" for directive in directives]
        lines += [
            "",
            (f"# distributed-core: {self.processes} worker(s) x {self.worker_threads} "
             f"thread(s), memory limit {self.worker_memory} bytes each,"),
            f"# for the scheduler at {self.scheduler_address}.",
            "# The cluster's credentials come from a file only you can read (no credential",
            "# in this script); SLURMCluster.close() removes it.",
            "unset " + " ".join(ENVIRONMENT_VARIABLES),
            f"DCORE_CREDENTIALS={shlex.quote(self._credentials_file)}",
            'if [ ! -r "$DCORE_CREDENTIALS" ]; then',
            ('  echo "dcore: $DCORE_CREDENTIALS is gone: the cluster that submitted this job'
             ' has closed" >&2'),
            "  exit 1",
            "fi",
            "set -a",
            '. "$DCORE_CREDENTIALS"',
            "set +a",
            "unset DCORE_CREDENTIALS",
        ]
        if self.job_script_prologue:
            lines += ["", *self.job_script_prologue]
        name = shlex.quote(f"{self.job_name}-")
        lines += [
            "",
            "# SLURM ends the job (scancel, walltime) with SIGTERM to its processes: each",
            "# nanny stops its worker; the job ends when they have all exited.",
            "PIDS=()",
            "trap 'kill -TERM \"${PIDS[@]}\" 2>/dev/null; wait' TERM INT",
        ]
        for i in range(self.processes):
            lines += [f'{command} --name {name}"$SLURM_JOB_ID-{i}" &', "PIDS+=($!)"]
        lines += ["wait", ""]
        return "\n".join(lines)

    def _write_credentials(self) -> None:
        """The cluster's credentials as ``NAME=value`` lines (shell-quoted) in a new file
        of mode 0600; TLS files are copied next to it (the compute nodes see them)."""
        env = self.security.environment()
        if self.security.tls:
            for var in ("DCORE_TLS_CA_FILE", "DCORE_TLS_CERT", "DCORE_TLS_KEY"):
                copy = os.path.join(self._directory, var.lower().removeprefix("dcore_"))
                with open(env[var], "rb") as f:
                    _write_private(copy, f.read())
                env[var] = copy
        _write_private(self._credentials_file,
                       "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()))

    # ------------------------------------------------------------------ SLURM's commands

    def _command(self, cmd: list, env: dict | None = None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                                  stdin=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT)
        except FileNotFoundError:
            raise ClusterError(f"{cmd[0]}: command not found (SLURMCluster runs SLURM's "
                               f"sbatch, squeue and scancel: start it on a machine that "
                               f"submits jobs, with them on PATH)") from None
        except subprocess.TimeoutExpired:
            raise ClusterError(f"{' '.join(cmd[:2])} did not answer within "
                               f"{COMMAND_TIMEOUT:.0f}s") from None

    def _submit(self) -> str:
        """``sbatch --parsable`` the script; the new job's id."""
        env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARIABLES}
        done = self._command(["sbatch", "--parsable", self._script_file], env)
        if done.returncode != 0:
            raise ClusterError(f"sbatch failed (exit code {done.returncode}): "
                               f"{done.stderr.strip() or done.stdout.strip()}")
        lines = done.stdout.strip().splitlines()
        # --parsable prints "JOBID" or "JOBID;CLUSTER"
        job_id = lines[-1].split(";")[0].strip() if lines else ""
        if not job_id.isdigit():
            raise ClusterError(f"sbatch --parsable printed no job id: {done.stdout!r}")
        return job_id

    def _states(self, job_ids: list) -> dict | None:
        """``{job id: state}`` of the jobs squeue lists (those it does not list have
        ended and been forgotten); None if squeue failed."""
        if not job_ids:
            return {}
        try:
            done = self._command(["squeue", "--noheader", "--format=%i %T",
                                  f"--jobs={','.join(job_ids)}"])
        except ClusterError as exc:
            logger.warning("cannot watch the jobs: %s", exc)
            return None
        if done.returncode != 0:
            if "invalid job id" in done.stderr.lower():
                if len(job_ids) == 1:  # the one id it no longer knows: that job ended
                    return {}
                # some squeue versions refuse a list with one forgotten id: ask one by one
                states: dict = {}
                for job_id in job_ids:
                    one = self._states([job_id])
                    if one is None:
                        return None
                    states.update(one)
                return states
            logger.warning("cannot watch the jobs: squeue failed (exit code %d): %s",
                           done.returncode, done.stderr.strip())
            return None
        states = {}
        for line in done.stdout.splitlines():
            fields = line.split()
            if len(fields) >= 2:
                states[fields[0]] = fields[1].upper()
        return states

    def _cancel(self, job_ids: list) -> None:
        if not job_ids:
            return
        try:
            done = self._command(["scancel", *job_ids])
        except ClusterError as exc:
            logger.warning("cannot cancel jobs %s: %s", ", ".join(job_ids), exc)
            return
        if done.returncode != 0:
            logger.info("scancel %s: %s", " ".join(job_ids), done.stderr.strip())

    # ------------------------------------------------------------------ the engine's part

    @property
    def job_ids(self) -> list:
        """The ids of the jobs submitted and not cancelled, oldest first."""
        with self._scale_lock:
            return list(self._jobs)

    @property
    def worker_names(self) -> list:
        """The names of the workers of the jobs submitted and not cancelled (queued or
        running, joined or not), oldest first."""
        with self._scale_lock:
            return [name for job in self._jobs.values() for name in job.names]

    def _start_worker(self) -> list:
        """Submit one more job; the names of its ``processes`` workers."""
        if self._broken is not None:
            raise ClusterError(self._broken)
        job_id = self._submit()
        names = [f"{self.job_name}-{job_id}-{i}" for i in range(self.processes)]
        with self._scale_lock:
            self._jobs[job_id] = _Job(job_id, names)
        logger.info("submitted job %s (workers %s)", job_id, ", ".join(names))
        return names

    def _stop_workers(self, names: list, timeout: float) -> None:
        """Cancel the jobs of the named workers (whole jobs: see `scale_down`)."""
        with self._scale_lock:
            leaving = self._jobs_of(names)
            for job_id in leaving:
                del self._jobs[job_id]
        self._cancel(leaving)

    def _jobs_of(self, names) -> list:
        names = set(names)
        return [job.id for job in self._jobs.values() if names.intersection(job.names)]

    def _check_workers(self) -> None:
        """Replace the jobs that ended while still wanted (a WARNING each)."""
        with self._scale_lock:
            if self._closing or not self._jobs:
                return
            states = self._states(list(self._jobs))
            if states is None:
                return
            # which jobs' workers joined (a job that ends before any did counts as failed)
            waiting = [job for job in self._jobs.values()
                       if not job.joined and states.get(job.id) != "PENDING"]
            if waiting:
                try:
                    joined = {info["name"] for info in
                              self.scheduler_info()["workers"].values()}
                except Exception as exc:  # noqa: BLE001 - checked again next time
                    logger.info("cannot ask the scheduler which workers joined: %s", exc)
                    joined = set()
                for job in waiting:
                    job.joined = bool(joined.intersection(job.names))
            for job in list(self._jobs.values()):
                state = states.get(job.id)
                if state in ACTIVE_STATES:
                    continue
                del self._jobs[job.id]
                if job.joined:
                    self._failed_starts = 0
                else:
                    self._failed_starts += 1
                why = "is no longer listed by squeue" if state is None else f"is {state}"
                if self._failed_starts >= MAX_FAILED_STARTS:
                    self._broken = (
                        f"{MAX_FAILED_STARTS} jobs in a row ended before any of their workers "
                        f"joined the scheduler (the last, {job.id}, {why}); not submitting "
                        f"more: see the job's output{self._output_hint(job.id)}")
                    logger.error("%s", self._broken)
                    continue
                if self._broken is not None:
                    continue
                logger.warning("job %s (workers %s) %s while still wanted: submitting a new "
                               "job in its place", job.id, ", ".join(job.names), why)
                try:
                    self._start_worker()
                except ClusterError as exc:
                    logger.warning("could not replace job %s: %s", job.id, exc)

    def _output_hint(self, job_id: str) -> str:
        if self.log_directory:
            return f" ({os.path.join(self.log_directory, f'{self.job_name}-{job_id}.err')})"
        return f" (slurm-{job_id}.out in the directory this cluster was started from)"

    def _watch(self) -> None:
        while not self._watch_stop.wait(self.check_interval):
            try:
                self._check_workers()
            except Exception as exc:  # noqa: BLE001 - watching must not die of one error
                logger.warning("checking the jobs failed: %s", exc)

    # ------------------------------------------------------------------ scaling

    def _round_to_jobs(self, n: int) -> int:
        return math.ceil(n / self.processes) * self.processes

    def scale(self, n: int | None = None, jobs: int | None = None, memory=None,
              cores: int | None = None, *, wait: bool = False, timeout: float = 60.0) -> None:
        """Run ``n`` workers, or ``jobs`` jobs, or enough jobs for ``memory`` bytes or
        ``cores`` threads in all (one of them), rounded up to whole jobs. Stops `adapt`.

        New jobs are submitted and this returns: they may wait in SLURM's queue
        (`wait_for_workers` waits for them), unless ``wait`` is true, when it waits until
        the scheduler lists exactly that many workers (up to ``timeout`` seconds).
        Scaling down closes whole jobs (see `_choose_to_close`); their workers are retired
        first, so the results only they hold move to the workers that stay."""
        given = [x is not None for x in (n, jobs, memory, cores)]
        if sum(given) != 1:
            raise ValueError("scale takes one of n (workers), jobs, memory or cores")
        if n is not None:
            workers = n
        elif jobs is not None:
            if type(jobs) is not int or jobs < 0:
                raise ValueError(f"scale needs a number of jobs >= 0, got {jobs!r}")
            workers = jobs * self.processes
        elif memory is not None:
            workers = math.ceil(parse_bytes(memory) / self.memory) * self.processes
        else:
            if type(cores) is not int or cores < 0:
                raise ValueError(f"scale needs a number of cores >= 0, got {cores!r}")
            workers = math.ceil(cores / self.cores) * self.processes
        if type(workers) is not int or workers < 0:
            raise ValueError(f"scale needs a number of workers >= 0, got {workers!r}")
        self._broken = None  # the user asks again: try again
        self._failed_starts = 0
        self._stop_adaptive("scale() was called")
        workers = self._round_to_jobs(workers)
        self.scale_to(workers, timeout, ask_scheduler=False)
        if wait:
            self._wait_for_exactly(workers, timeout)

    def scale_to(self, n: int, timeout: float = 30.0, ask_scheduler: bool = True) -> None:
        """Submit or close jobs until ``n`` workers (rounded up to whole jobs) are
        planned, without waiting for new ones to join (what `adapt` calls); the jobs
        closed are chosen by `_choose_to_close`."""
        super().scale_to(self._round_to_jobs(n), timeout, ask_scheduler)

    def adapt(self, minimum: int = 0, maximum: float = math.inf, target_duration="5s",
              interval="1s", wait_count: int = 3, *, minimum_jobs: int | None = None,
              maximum_jobs: int | None = None):
        """`Cluster.adapt`, counted in workers (``minimum``/``maximum``) or in jobs
        (``minimum_jobs``/``maximum_jobs``). Worker counts become whole jobs: the minimum
        rounded up, the maximum rounded down (not below the minimum)."""
        if minimum_jobs is not None:
            minimum = minimum_jobs * self.processes
        if maximum_jobs is not None:
            maximum = maximum_jobs * self.processes
        if type(minimum) is int and minimum >= 0:
            minimum = self._round_to_jobs(minimum)
        if type(maximum) is int and maximum >= 0 and maximum != math.inf:
            maximum = max(maximum // self.processes * self.processes, minimum)
        return super().adapt(minimum=minimum, maximum=maximum,
                             target_duration=target_duration, interval=interval,
                             wait_count=wait_count)

    def _choose_to_close(self, k: int, ask_scheduler: bool = True) -> list:
        """All the names of the ``ceil(k / processes)`` jobs best closed.

        Jobs none of whose workers has joined go first, newest first. Then, with
        ``ask_scheduler`` (`adapt`), the scheduler ranks the joined workers
        (`workers-to-close`: idle ones holding the least first) and, walking its
        ranking, a job is chosen once every one of its joined workers has been named:
        jobs are ordered by their worst-ranked worker, newest first among equals.
        Without (`scale`), the newest jobs go."""
        wanted = math.ceil(k / self.processes)
        with self._scale_lock:
            jobs = list(self._jobs.values())
        joined = {info["name"] for info in self.scheduler_info()["workers"].values()}
        pending = [job for job in reversed(jobs) if not joined.intersection(job.names)]
        started = [job for job in reversed(jobs) if job not in pending]  # newest first
        if ask_scheduler and len(pending) < wanted:
            ranking = self.request({"op": "workers-to-close", "n": len(joined)})
            rank = {entry["name"]: i for i, entry in enumerate(ranking)}

            def worst(job):
                return max(rank.get(name, math.inf) for name in job.names if name in joined)

            started.sort(key=worst)  # stable: newest first among equals
        chosen = (pending + started)[:wanted]
        return [name for job in chosen for name in job.names]

    def scale_down(self, names: list, timeout: float = 30.0, force: bool = True) -> list:
        """Close the jobs of the named workers: every worker of such a job leaves, named
        or not (a job is SLURM's unit). Their workers are retired first (results move to
        the workers that stay), then the jobs are cancelled (`Cluster.scale_down`)."""
        with self._scale_lock:
            whole = [name for job_id in self._jobs_of(names)
                     for name in self._jobs[job_id].names]
            return super().scale_down(whole, timeout, force)

    # ------------------------------------------------------------------ stop

    def close(self, timeout: float = 10.0) -> None:
        """Stop adaptive scaling and the watching, cancel every job (waiting up to
        ``timeout`` seconds for squeue to report them ended), stop the scheduler and
        remove the private directory with the credentials."""
        self._closing = True
        self._watch_stop.set()
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout)
        try:
            super().close(timeout)
        finally:
            self._cleanup()

    def _close_workers(self, timeout: float) -> None:
        with self._scale_lock:
            job_ids = list(self._jobs)
            self._jobs.clear()
        if not job_ids:
            return
        self._cancel(job_ids)
        deadline = time.monotonic() + timeout
        while True:
            states = self._states(job_ids)
            if states is None or not any(s in ACTIVE_STATES for s in states.values()):
                return
            if time.monotonic() > deadline:
                logger.warning("jobs %s still listed by squeue %.0fs after scancel",
                               ", ".join(j for j, s in states.items() if s in ACTIVE_STATES),
                               timeout)
                return
            time.sleep(0.2)


def _write_private(path: str, data) -> None:
    """A new file only the user can read and write (fails if ``path`` exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def _cancel_and_remove(jobs: dict, directory: str) -> None:
    """At garbage collection or exit of a cluster not closed (and after `close`): cancel
    its jobs and remove its private directory."""
    job_ids = list(jobs)
    jobs.clear()
    if job_ids:
        try:
            subprocess.run(["scancel", *job_ids], capture_output=True, check=False,
                           stdin=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT)
        except (OSError, subprocess.SubprocessError):
            pass
    shutil.rmtree(directory, ignore_errors=True)

