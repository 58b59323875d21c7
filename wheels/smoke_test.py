"""What every built wheel must do, run from outside the source tree after installing it.

Checks that the expected core is loaded (``EXPECT_COMPILED=1`` or ``0``), then starts a
LocalCluster of real processes, runs a small graph with dependencies between workers, a
task that raises, and releases everything; reads the status page, its assets (package
data the wheel must carry) and /metrics. Exits non-zero on any failure.
"""
import os
import sys
import urllib.request

import distributed_core
from distributed_server import Client, LocalCluster


def square(x):
    return x * x


def fail(x):
    raise ValueError(f"bad input {x}")


def check_dashboard(cluster) -> None:
    """The page and every asset it loads come from the installed package."""
    base = cluster.dashboard_url.rsplit("/status", 1)[0]
    headers = {"Authorization": f"Bearer {cluster.security.dashboard_token()}"}
    for path in ("/status", "/static/status.js", "/static/status.css", "/static/favicon.svg",
                 "/api/v1/status", "/metrics"):
        request = urllib.request.Request(base + path, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200 and response.read(), path


def main() -> int:
    expected = os.environ.get("EXPECT_COMPILED")
    print(f"distributed-core {distributed_core.__version__}: COMPILED={distributed_core.COMPILED}"
          f" ({distributed_core.CORE_FILE}, {distributed_core.WORKER_CORE_FILE})")
    if expected is not None and distributed_core.COMPILED != (expected == "1"):
        print(f"FAIL: expected COMPILED={expected == '1'}")
        return 1
    with LocalCluster(n_workers=2, threads_per_worker=1) as cluster, \
            Client(cluster, set_as_default=False) as client:
        squares = client.map(square, range(100))
        total = client.submit(sum, squares)
        assert total.result(timeout=60) == sum(i * i for i in range(100)), total.result()
        try:
            client.submit(fail, 1).result(timeout=60)
        except ValueError as exc:
            assert "bad input 1" in str(exc)
        else:
            raise AssertionError("the failing task did not raise")
        del squares, total
        info = client.scheduler_info()
        assert len(info["workers"]) == 2 and info["compiled"] == distributed_core.COMPILED
        check_dashboard(cluster)
    print("smoke test passed: 101 tasks on 2 worker processes, errors and cleanup, "
          "the status page and /metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
