"""A cluster across hosts: `dcore scheduler` and `dcore worker` on separate network hosts.

Each "host" is a Linux network namespace made by the test (`ip netns`, a veth pair, its
own private address on a /30 link that exists only between the two namespaces), so the
processes really talk over a network interface that is not loopback, as on two
machines. Needs root and iproute2 (CI has both); skipped with the reason otherwise.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

SCHEDULER_IP, WORKER_IP = "10.231.77.1", "10.231.77.2"
PORT = 8786
PROCESS_TIMEOUT = 60


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    """(scheduler_ns, worker_ns): two namespaces joined by a veth pair."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = uuid.uuid4().hex[:6]
    a, b = f"dcore-a-{tag}", f"dcore-b-{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        _ip("link", "set", f"va{tag}", "netns", a)
        _ip("link", "set", f"vb{tag}", "netns", b)
        for ns, dev, ip in ((a, f"va{tag}", SCHEDULER_IP), (b, f"vb{tag}", WORKER_IP)):
            _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {e}")
    yield a, b
    for ns in (a, b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Processes:
    """Processes started in namespaces; all killed at the end, their output kept."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.procs: list = []

    def start(self, ns: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.tmp_path / f"proc-{len(self.procs)}.log", "w+")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args],
                                stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
        proc.log = log
        self.procs.append(proc)
        return proc

    def output(self, proc) -> str:
        proc.log.flush()
        proc.log.seek(0)
        return proc.log.read()

    def wait_for_line(self, proc, text: str, timeout: float = 30) -> str:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.output(proc)
            if text in out:
                return out
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} from {proc.args}:\n{self.output(proc)}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.log.close()


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.stop()


CLIENT = textwrap.dedent("""
    import sys
    from distributed_server import Client
    from distributed_server.comm import parse_address

    with Client(sys.argv[1], set_as_default=False, timeout=30) as client:
        workers = client.scheduler_info()["workers"]
        hosts = sorted({parse_address(address)[1] for address in workers})
        squares = client.map(lambda x: x * x, range(200))
        pairs = [client.submit(lambda a, b: a + b, squares[i], squares[i + 1])
                 for i in range(0, 200, 2)]
        total = client.submit(sum, pairs)
        print("hosts", *hosts)
        print("total", total.result(timeout=60))
""")


def dcore(*args: str) -> list:
    return ["-m", "distributed_server.cli", *args]


def test_a_tls_and_token_cluster_runs_across_two_hosts(two_hosts, processes, tmp_path):
    sched_ns, worker_ns = two_hosts
    creds = tmp_path / "creds"
    subprocess.run([sys.executable, *dcore("tls-files", str(creds), SCHEDULER_IP)],
                   check=True, capture_output=True, timeout=30)
    token = subprocess.run([sys.executable, *dcore("token")], check=True,
                           capture_output=True, text=True, timeout=30).stdout.strip()
    (creds / "token").write_text(token + "\n")
    flags = ["--token-file", str(creds / "token"), "--tls-ca-file", str(creds / "ca.pem"),
             "--tls-cert", str(creds / "cert.pem"), "--tls-key", str(creds / "key.pem")]
    address = f"tls://{SCHEDULER_IP}:{PORT}"

    scheduler = processes.start(sched_ns, *dcore("scheduler", "--host", SCHEDULER_IP,
                                                 "--port", str(PORT), "--validate", *flags))
    processes.wait_for_line(scheduler, f"Scheduler at {address}")
    local = processes.start(sched_ns, *dcore("worker", address, "--name", "local", *flags))
    remote = processes.start(worker_ns, *dcore("worker", address, "--name", "remote", *flags))
    for worker in (local, remote):
        processes.wait_for_line(worker, "Worker at tls://")
    assert f"Worker at tls://{WORKER_IP}:" in processes.output(remote)

    env = {"DCORE_TOKEN_FILE": str(creds / "token"),
           "DCORE_TLS_CA_FILE": str(creds / "ca.pem"),
           "DCORE_TLS_CERT": str(creds / "cert.pem"), "DCORE_TLS_KEY": str(creds / "key.pem")}
    client = processes.start(worker_ns, "-c", CLIENT, address, env=env)
    assert client.wait(PROCESS_TIMEOUT) == 0, processes.output(client)
    out = processes.output(client)
    assert f"hosts {SCHEDULER_IP} {WORKER_IP}" in out
    assert f"total {sum(i * i for i in range(200))}" in out

    # From the other host: no token, or plain TCP, gets nothing.
    intruder = processes.start(worker_ns, *dcore(
        "worker", address, "--name", "intruder", "--tls-ca-file", str(creds / "ca.pem"),
        "--tls-cert", str(creds / "cert.pem"), "--tls-key", str(creds / "key.pem")))
    assert intruder.wait(PROCESS_TIMEOUT) != 0
    assert "requires its token" in processes.output(intruder)
    plain = processes.start(worker_ns, *dcore(
        "worker", f"tcp://{SCHEDULER_IP}:{PORT}", "--name", "plain",
        "--token-file", str(creds / "token")))
    assert plain.wait(PROCESS_TIMEOUT) != 0
    assert " ERROR " not in processes.output(scheduler), processes.output(scheduler)


def test_dcore_refuses_to_listen_beyond_loopback_without_credentials(two_hosts, processes):
    sched_ns, _ = two_hosts
    refused = processes.start(sched_ns, *dcore("scheduler", "--host", SCHEDULER_IP))
    assert refused.wait(PROCESS_TIMEOUT) == 2
    out = processes.output(refused).strip()
    assert len(out.splitlines()) == 1 and "without credentials" in out and "--insecure" in out
    insecure = processes.start(sched_ns, *dcore("scheduler", "--host", SCHEDULER_IP,
                                                "--port", str(PORT), "--insecure"))
    processes.wait_for_line(insecure, f"Scheduler at tcp://{SCHEDULER_IP}:{PORT}")
