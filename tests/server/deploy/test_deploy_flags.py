"""The dcore flags batch systems and containers use, with real processes: a scheduler
file shared by the scheduler, workers and a client; preload modules; a worker's death
timeout, lifetime, listen and contact addresses."""
import os
import signal
import subprocess
import time

import pytest
from server_helpers import DCORE, wait_for

from distributed_server import Client, Security
from distributed_server.security import ENVIRONMENT_VARIABLES, new_token

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def env():
    security = Security(token=new_token())
    environment = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARIABLES}
    environment.update(security.environment())
    return security, environment


def spawn(args, env, log):
    out = open(log, "ab")
    proc = subprocess.Popen(DCORE + args, stdout=out, stderr=out, env=env,
                            stdin=subprocess.DEVNULL)
    out.close()
    return proc


def stop(*procs):
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_scheduler_file_connects_workers_and_clients_started_at_once(env, tmp_path):
    security, environment = env
    path = tmp_path / "shared" / "scheduler.json"
    # Workers first, as a batch system may start them: they wait for the file.
    workers = spawn(["worker", "--scheduler-file", str(path), "--nworkers", "2"],
                    environment, tmp_path / "workers.log")
    time.sleep(0.5)
    scheduler = spawn(["scheduler", "--port", "0", "--scheduler-file", str(path)],
                      environment, tmp_path / "scheduler.log")
    try:
        with Client(scheduler_file=str(path), security=security, timeout=30,
                    set_as_default=False) as client:
            client.wait_for_workers(2, timeout=30)
            assert client.submit(pow, 2, 5).result(timeout=30) == 32
    finally:
        stop(workers, scheduler)
    assert not path.exists()  # removed when the scheduler stopped


def test_preloads_run_their_setup_and_teardown_in_scheduler_and_worker(env, tmp_path):
    security, environment = env
    marks = tmp_path / "marks"
    plugin = tmp_path / "my_preload.py"
    plugin.write_text(
        "import os\n"
        f"MARKS = {str(marks)!r}\n"
        "def dcore_setup(server):\n"
        "    with open(MARKS, 'a') as f:\n"
        "        f.write(f'setup {type(server).__name__} {server.address}\\n')\n"
        "async def dcore_teardown(server):\n"
        "    with open(MARKS, 'a') as f:\n"
        "        f.write(f'teardown {type(server).__name__}\\n')\n")
    path = tmp_path / "scheduler.json"
    scheduler = spawn(["scheduler", "--port", "0", "--scheduler-file", str(path),
                       "--preload", str(plugin)], environment, tmp_path / "s.log")
    worker = spawn(["worker", "--scheduler-file", str(path), "--preload", str(plugin)],
                   environment, tmp_path / "w.log")
    try:
        wait_for(lambda: marks.exists() and marks.read_text().count("setup") == 2)
        lines = marks.read_text().splitlines()
        assert {line.split()[1] for line in lines} == {"Scheduler", "Worker"}
    finally:
        stop(worker)
        wait_for(lambda: "teardown Worker" in marks.read_text())
        stop(scheduler)
    assert "teardown Scheduler" in marks.read_text()
    bad = subprocess.run(DCORE + ["scheduler", "--preload", "no_such_module_here"],
                         capture_output=True, text=True, env=environment, timeout=30)
    assert bad.returncode == 2 and "no_such_module_here" in bad.stderr


def test_a_worker_gives_up_after_its_death_timeout(env, tmp_path):
    _, environment = env
    start = time.monotonic()
    out = subprocess.run(DCORE + ["worker", "tcp://127.0.0.1:9", "--no-nanny",
                                  "--death-timeout", "1"],
                         capture_output=True, text=True, env=environment, timeout=60)
    assert out.returncode != 0 and time.monotonic() - start < 30
    missing = subprocess.run(DCORE + ["worker", "--scheduler-file",
                                      str(tmp_path / "never.json"), "--death-timeout", "0.5"],
                             capture_output=True, text=True, env=environment, timeout=60)
    assert missing.returncode == 2 and "no scheduler file" in missing.stderr


def test_lifetime_closes_a_worker_and_lifetime_restart_replaces_it(env, tmp_path):
    security, environment = env
    path = tmp_path / "scheduler.json"
    scheduler = spawn(["scheduler", "--port", "0", "--scheduler-file", str(path)],
                      environment, tmp_path / "s.log")
    once = spawn(["worker", "--scheduler-file", str(path), "--no-nanny", "--lifetime", "1",
                  "--name", "once"], environment, tmp_path / "once.log")
    renewed = spawn(["worker", "--scheduler-file", str(path), "--lifetime", "1.5",
                     "--lifetime-restart", "--name", "renewed"], environment,
                    tmp_path / "renewed.log")
    try:
        assert once.wait(timeout=30) == 0
        with Client(scheduler_file=str(path), security=security,
                    set_as_default=False) as client:
            seen = set()

            def two_generations():
                seen.update(client.scheduler_info()["workers"])
                return len(seen) >= 2 and all(
                    w["name"] == "renewed" for w in client.scheduler_info()["workers"].values())
            wait_for(two_generations, timeout=30)
        assert "reached its --lifetime" in (tmp_path / "renewed.log").read_text()
    finally:
        stop(once, renewed, scheduler)


def test_listen_and_contact_addresses(env, tmp_path):
    security, environment = env
    path = tmp_path / "scheduler.json"
    scheduler = spawn(["scheduler", "--port", "0", "--scheduler-file", str(path)],
                      environment, tmp_path / "s.log")
    # The worker listens on 127.0.0.1:<port> and announces 127.0.0.2:<port> (what a NAT
    # or a container's port mapping would forward there; on Linux 127.0.0.2 is loopback).
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = spawn(["worker", "--scheduler-file", str(path), "--no-nanny",
                    "--listen-address", f"tcp://0.0.0.0:{port}", "--insecure",
                    "--contact-address", f"tcp://127.0.0.2:{port}"], environment,
                   tmp_path / "w.log")
    try:
        with Client(scheduler_file=str(path), security=security, timeout=30,
                    set_as_default=False) as client:
            client.wait_for_workers(1, timeout=30)
            assert list(client.scheduler_info()["workers"]) == [f"tcp://127.0.0.2:{port}"]
            future = client.submit(bytes, 100_000)  # large: fetched from the worker
            assert client.gather(future) == bytes(100_000)
        bad = subprocess.run(DCORE + ["worker", "--scheduler-file", str(path), "--nworkers",
                                      "2", "--contact-address", "tcp://127.0.0.2:1"],
                             capture_output=True, text=True, env=environment, timeout=30)
        assert bad.returncode == 2 and "--nworkers 1" in bad.stderr
    finally:
        stop(worker, scheduler)
