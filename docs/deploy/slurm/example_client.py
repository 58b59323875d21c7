"""An example client script for dcore.sbatch: connects through the scheduler file, waits
for every worker of the job, runs a graph whose tasks move data between workers and prints
its result and where it ran.

    sbatch --nodes=2 docs/deploy/slurm/dcore.sbatch docs/deploy/slurm/example_client.py 2000
"""
import os
import sys

from distributed_server import Client


def square(x):
    """x squared."""
    return x * x


def add(a, b):
    """a + b."""
    return a + b


def memory_limit(dask_worker) -> int:
    """The memory limit of the worker this runs on (bytes): for `Client.run`."""
    return dask_worker.memory_limit


def main() -> None:
    """Sum of squares of 0..N-1 as a pairwise tree of tasks; prints it and the workers."""
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    with Client(scheduler_file=os.environ["DCORE_SCHEDULER_FILE"], timeout=120) as client:
        client.wait_for_workers(int(os.environ.get("DCORE_JOB_WORKERS", "1")), timeout=300)
        level = client.map(square, range(n))
        while len(level) > 1:
            pairs = [client.submit(add, level[i], level[i + 1])
                     for i in range(0, len(level) - 1, 2)]
            level = pairs + level[len(level) - len(level) % 2:]
        total = level[0].result()
        workers = client.scheduler_info()["workers"]
        limits = client.run(memory_limit)
        for address, info in sorted(workers.items()):
            print("worker", info["name"], address, "threads", info["nthreads"],
                  "memory_limit", limits[address])
        print("sum of squares", n, total, "expected", sum(i * i for i in range(n)))


if __name__ == "__main__":
    main()
