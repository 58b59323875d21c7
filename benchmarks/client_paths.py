"""Client-side CPU of the no-op hot paths, against a real scheduler with no workers.

Three phases, each timed with this process's CPU clock (the user's thread and the
client's loop thread; the scheduler is another process):

- map: ``client.map(inc, range(N), pure=False)`` until the update-graphs are out (spec
  encoding, key registration, the outbox, sending);
- release: dropping those N futures until the release-keys are out (``Future.__del__``,
  the outbox drain);
- submit: N/10 single ``client.submit`` calls until they are out.

Prints one JSON line: microseconds of CPU per task for each phase, the best of
``--repeat`` rounds. To compare two checkouts, interleave runs, e.g.::

    for i in 1 2 3 4 5 6; do for dir in /path/a /path/b; do
        PYTHONPATH=$dir python benchmarks/client_paths.py; done; done
"""
from __future__ import annotations

import argparse
import gc
import json
import time

from distributed_server.client.client import Client
from distributed_server.deploy.local_cluster import LocalCluster


def inc(x):
    """A no-op task (it never runs: the cluster has no workers)."""
    return x + 1


def measure(client: Client, n: int) -> dict:
    """CPU microseconds per task of map, release and submit, one round."""
    c0 = time.process_time()
    futures = client.map(inc, range(n), pure=False)
    client.scheduler_info()  # a request goes through the outbox after the update-graphs
    c1 = time.process_time()
    del futures
    gc.collect()
    client.scheduler_info()  # ... and after the release-keys
    c2 = time.process_time()
    submitted = [client.submit(inc, i, pure=False) for i in range(n // 10)]
    client.scheduler_info()
    c3 = time.process_time()
    del submitted
    gc.collect()
    client.scheduler_info()
    return {"map": (c1 - c0) / n * 1e6, "release": (c2 - c1) / n * 1e6,
            "submit": (c3 - c2) / (n // 10) * 1e6}


def main() -> None:
    """Run the rounds and print the best of each phase as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20_000, help="tasks per map (20,000)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (3)")
    args = parser.parse_args()
    with LocalCluster(n_workers=0) as cluster, Client(cluster, set_as_default=False) as client:
        client.scheduler_info()
        rounds = [measure(client, args.n) for _ in range(args.repeat)]
    print(json.dumps({phase: round(min(r[phase] for r in rounds), 2) for phase in rounds[0]}))


if __name__ == "__main__":
    main()
