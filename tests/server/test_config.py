"""Settings from configuration (config.py): our keys, dask's keys, their environment
variables, explicit arguments first; a scheduler process started with dask's variable."""
import os
import subprocess
import sys
import textwrap

import pytest

from distributed_server import config
from distributed_server.scheduler.server import Scheduler
from distributed_server.worker.server import Worker


def test_durations_parse_as_dask_writes_them():
    assert config.parse_seconds(5) == 5.0
    assert config.parse_seconds("300s") == 300.0
    assert config.parse_seconds("5 minutes") == 300.0
    assert config.parse_seconds("100ms") == pytest.approx(0.1)
    assert config.parse_seconds("2h") == 7200.0
    for bad in ("soon", "5 parsecs", ""):
        with pytest.raises(ValueError, match="duration"):
            config.parse_seconds(bad)


def test_explicit_then_ours_then_dasks_then_the_default(monkeypatch):
    dask_config = pytest.importorskip("dask.config")
    assert config.get("scheduler.worker-ttl") == 300.0
    with dask_config.set({"distributed.scheduler.worker-ttl": "2 minutes"}):
        assert config.get("scheduler.worker-ttl") == 120.0
        with dask_config.set({"dcore.scheduler.worker-ttl": 42}):
            assert config.get("scheduler.worker-ttl") == 42.0
            assert config.get("scheduler.worker-ttl", 7.0) == 7.0
    with dask_config.set({"distributed.worker.memory.spill": False,
                          "distributed.scheduler.worker-saturation": "inf"}):
        assert config.get("worker.memory.spill") is None
        assert config.get("scheduler.worker-saturation") == float("inf")
    with dask_config.set({"distributed.scheduler.allowed-failures": "many"}):
        with pytest.raises(ValueError, match="distributed.scheduler.allowed-failures"):
            config.get("scheduler.allowed-failures")
    with dask_config.set({"distributed.scheduler.work-stealing-interval": "0ms"}):
        with pytest.raises(ValueError, match="at least 1 ms"):
            config.get("scheduler.work-stealing-interval")
    with dask_config.set({"distributed.scheduler.work-stealing-interval": "50ms"}):
        assert config.get("scheduler.work-stealing-interval") == pytest.approx(0.05)


def test_servers_take_their_defaults_from_configuration():
    dask_config = pytest.importorskip("dask.config")
    with dask_config.set({"distributed.scheduler.worker-ttl": "1 minute",
                          "distributed.scheduler.worker-saturation": 2.0,
                          "distributed.comm.timeouts.tcp": "7s",
                          "distributed.worker.memory.target": 0.5,
                          "distributed.worker.memory.pause": False}):
        scheduler = Scheduler()
        assert scheduler.worker_ttl == 60.0 and scheduler.state.worker_saturation == 2.0
        assert Scheduler(worker_ttl=5).worker_ttl == 5
        worker = Worker("tcp://127.0.0.1:1")
        assert worker.transfer_timeout == 7.0
        assert worker.memory_target_fraction == 0.5 and worker.memory_pause_fraction is None
        assert worker.memory_spill_fraction == 0.7  # not set: the default
        assert Worker("tcp://127.0.0.1:1", memory_pause_fraction=0.9) \
            .memory_pause_fraction == 0.9


def test_dasks_environment_variables_reach_a_dcore_process():
    script = textwrap.dedent("""
        from distributed_server.scheduler.server import Scheduler
        s = Scheduler()
        print(s.worker_ttl, s.client_idle_timeout)
    """)
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": "90s",
           "DASK_DCORE__SCHEDULER__CLIENT_IDLE_TIMEOUT": "30"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.stdout.split() == ["90.0", "30.0"], out.stderr


def test_without_dask_the_environment_is_read_directly(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask.config", None)  # import fails
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES", "5")
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "False")
    assert config.get("scheduler.allowed-failures") == 5
    assert config.get("worker.memory.target") is None
    assert config.get("worker.memory.pause") == 0.8


def test_tls_from_dasks_keys_for_each_role(tmp_path, monkeypatch):
    """A dask user's TLS settings (``distributed.comm.tls.*``, as dask's environment
    variables) make a real scheduler and worker speak TLS, and a client configured with
    ``dask.config`` reaches them; a partial setting is a clear error."""
    dask_config = pytest.importorskip("dask.config")
    from distributed_server import Client
    from distributed_server.security import ENVIRONMENT_VARIABLES, Security, write_tls_files

    files = write_tls_files(str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARIABLES}
    env["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"] = files["tls_ca_file"]
    for role in ("scheduler", "worker"):
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role.upper()}__CERT"] = files["tls_cert"]
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role.upper()}__KEY"] = files["tls_key"]
    dcore = [sys.executable, "-m", "distributed_server.cli"]
    scheduler = subprocess.Popen(dcore + ["scheduler", "--port", "0", "--validate",
                                          "--no-dashboard"], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    worker = None
    try:
        address = scheduler.stdout.readline().split()[2]
        assert address.startswith("tls://")
        worker = subprocess.Popen(dcore + ["worker", address, "--no-nanny", "--no-dashboard"],
                                  env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        for name in ENVIRONMENT_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        with dask_config.set({"distributed.comm.tls.ca-file": files["tls_ca_file"],
                              "distributed.comm.tls.client.cert": files["tls_cert"],
                              "distributed.comm.tls.client.key": files["tls_key"]}):
            assert Security.from_environment(role="client").tls
            with Client(address, set_as_default=False, timeout=30) as client:
                client.wait_for_workers(1, timeout=30)
                assert client.submit(pow, 2, 10).result(timeout=30) == 1024
        with dask_config.set({"distributed.comm.tls.ca-file": files["tls_ca_file"]}):
            with pytest.raises(ValueError, match="distributed.comm.tls.client.cert"):
                Security.from_environment(role="client")
        partial = {k: v for k, v in env.items() if "SCHEDULER__KEY" not in k}
        out = subprocess.run(dcore + ["scheduler", "--port", "0"], env=partial, timeout=60,
                             capture_output=True, text=True)
        assert out.returncode == 2
        assert "distributed.comm.tls.scheduler.key not set" in out.stderr
    finally:
        for proc in (worker, scheduler):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=20)
        scheduler.stdout.close()
