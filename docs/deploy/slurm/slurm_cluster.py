"""SLURMCluster from end to end: the scheduler runs here (on a login node), the workers in
SLURM batch jobs that are submitted as the work grows and cancelled when it is done.

    python docs/deploy/slurm/slurm_cluster.py [N]

Change the job's size, partition and account below to your site's. The workers run this
interpreter (`python=` changes it): it must be reachable from the compute nodes, with
distributed-core and your tasks' libraries installed.
"""
import sys

from distributed_server import Client
from distributed_server.deploy.slurm import SLURMCluster


def square(x):
    """x squared."""
    return x * x


def main(n: int = 2000, maximum: int = 20, **options) -> int:
    """Adapt between 0 and ``maximum`` workers while summing N squares; the sum."""
    settings = {"cores": 4, "memory": "8GiB", "processes": 2, "walltime": "00:30:00",
                "job_name": "dcore-example", "log_directory": "dcore-logs"}
    settings.update(options)  # e.g. queue="normal", account="my-project"
    with SLURMCluster(**settings) as cluster:
        print(cluster.job_script())  # what each job runs: no credential in it
        cluster.adapt(minimum=0, maximum=maximum)  # jobs come with the work, go without
        with Client(cluster) as client:
            total = client.submit(sum, client.map(square, range(n))).result()
            print("sum of squares", n, total, "expected", sum(i * i for i in range(n)))
            print("jobs submitted:", len(cluster.job_ids), "now;",
                  len(client.scheduler_info()["workers"]), "workers joined")
    return total


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
