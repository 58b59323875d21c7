"""The state shared by the sbatch, squeue and scancel stand-ins (not a command): one JSON
file per job in ``$SLURM_SHIM_DIR/jobs``, read and changed under a lock file.

A job's record: ``id``, ``name``, ``partition``, ``state`` (SLURM's long state name),
``script``, ``output``, ``error``, ``cwd``, ``supervisor`` (pid of the process that plays
slurmstepd for it), ``pgid`` (the batch shell's process group, once RUNNING),
``exit_code``, ``submitted``/``started``/``ended`` (time.time())."""
import contextlib
import fcntl
import json
import os
import sys

#: States in which squeue lists a job without --jobs (SLURM's default state filter).
SHOWN_BY_DEFAULT = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")
#: squeue's compact state names (%t).
COMPACT = {"PENDING": "PD", "RUNNING": "R", "COMPLETING": "CG", "COMPLETED": "CD",
           "CANCELLED": "CA", "FAILED": "F", "TIMEOUT": "TO", "NODE_FAIL": "NF",
           "CONFIGURING": "CF", "OUT_OF_MEMORY": "OOM"}


def state_dir() -> str:
    directory = os.environ.get("SLURM_SHIM_DIR")
    if not directory:
        print(f"{os.path.basename(sys.argv[0])} (test shim): SLURM_SHIM_DIR is not set",
              file=sys.stderr)
        sys.exit(1)
    os.makedirs(os.path.join(directory, "jobs"), exist_ok=True)
    return directory


@contextlib.contextmanager
def locked():
    """Hold the state's lock (an flock on ``$SLURM_SHIM_DIR/lock``)."""
    with open(os.path.join(state_dir(), "lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _path(job_id: str) -> str:
    return os.path.join(state_dir(), "jobs", f"{job_id}.json")


def load(job_id: str):
    """A job's record, or None for an id never submitted."""
    try:
        with open(_path(job_id)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def save(job: dict) -> None:
    tmp = _path(job["id"]) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(job, f)
    os.replace(tmp, _path(job["id"]))


def update(job_id: str, **fields) -> dict:
    """Change fields of a job's record under the lock; the record."""
    with locked():
        job = load(job_id)
        job.update(fields)
        save(job)
    return job


def all_jobs() -> list:
    """Every job's record, by id."""
    directory = os.path.join(state_dir(), "jobs")
    ids = sorted(int(name[:-5]) for name in os.listdir(directory) if name.endswith(".json"))
    return [job for job in (load(str(i)) for i in ids) if job is not None]


def next_id() -> str:
    """A new job id (from 1001), under the lock."""
    with locked():
        counter = os.path.join(state_dir(), "next_id")
        try:
            with open(counter) as f:
                job_id = int(f.read())
        except FileNotFoundError:
            job_id = 1001
        with open(counter, "w") as f:
            f.write(str(job_id + 1))
    return str(job_id)
