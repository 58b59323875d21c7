"""Client.story, Client.get_scheduler_logs, Client.get_worker_logs and the log format,
against a validating ``dcore scheduler`` process and one nanny of two worker processes."""
import re
import signal
import subprocess
import threading
import time

import pytest
from server_helpers import DCORE, Processes, children, wait_for

from distributed_server import Client, StoryEntry, WorkerSilent
from distributed_server.client.futures import SchedulerError

#: time, role, address, level, message
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (scheduler|worker|nanny|client) "
                  r"(\S+) (DEBUG|INFO|WARNING|ERROR|CRITICAL) .")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A validating scheduler, and a nanny of two workers (w-0 and w-1)."""
    processes = Processes(tmp_path_factory.mktemp("introspection"))
    try:
        processes.main = processes.nanny("--nworkers", "2", "--memory-limit", "0")
        yield processes
    finally:
        processes.close()
    processes.assert_no_errors()


@pytest.fixture
def client(cluster):
    with Client(cluster.address, security=cluster.security, set_as_default=False) as c:
        c.wait_for_workers(2, timeout=30)
        yield c
    cluster.assert_no_errors()


def request(client, op: str, **fields):
    """A raw request on the client's stream, as a misbehaving client could send it."""
    return client._sync(lambda: client._request(op, **fields))


def by_name(client) -> dict:
    """{worker name: address}"""
    return {info["name"]: address for address, info in client.scheduler_info()["workers"].items()}


class stopped:
    """SIGSTOP one worker process of the nanny for the duration of a with block."""

    def __init__(self, cluster):
        self.proc = wait_for(lambda: children(cluster.main))[0]

    def __enter__(self):
        self.proc.send_signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGCONT)


# ---------------------------------------------------------------------------- story


def test_story_merges_the_schedulers_and_the_workers_transitions_by_time(client):
    workers = by_name(client)
    x = client.submit(sum, [1, 2], key="story-x", workers=["w-0"])
    y = client.submit(lambda v: v + 1, x, key="story-y", workers=["w-1"])
    assert y.result() == 4
    story = client.story(x)
    assert story and all(isinstance(e, StoryEntry) and e.key == "story-x" for e in story)
    assert [e.time for e in story] == sorted(e.time for e in story)
    on = {where: [(e.start, e.finish) for e in story if e.where == where]
          for where in ("scheduler", workers["w-0"], workers["w-1"])}
    assert on["scheduler"][:2] == [("released", "waiting"), ("waiting", "processing")]
    assert ("processing", "memory") in on["scheduler"]
    assert ("executing", "memory") in on[workers["w-0"]]  # it ran there
    assert ("flight", "memory") in on[workers["w-1"]]  # and was fetched there
    # the scheduler's compute-task stimulus is the one that started it on the worker
    started = next(e for e in story if e.where == "scheduler" and e.finish == "processing")
    assert any(e.stimulus_id == started.stimulus_id for e in story
               if e.where == workers["w-0"])


def test_story_of_several_keys_and_of_futures_or_keys_alike(client):
    a, b = client.map(lambda v: v * 2, [10, 11], key=["story-a", "story-b"])
    client.gather([a, b])
    story = client.story(a, "story-b")
    assert {e.key for e in story} == {"story-a", "story-b"}
    assert [e.time for e in story] == sorted(e.time for e in story)


def test_story_of_a_tuple_key_travels_as_it_is(client):
    f = client.submit(int, "5", key=("story-tuple", 0))
    assert f.result() == 5
    story = client.story(("story-tuple", 0))
    assert {e.key for e in story} == {("story-tuple", 0)}
    assert any(e.where != "scheduler" for e in story)


def test_story_of_an_unknown_key_is_a_key_error_and_harms_nothing(client):
    with pytest.raises(KeyError, match="no story for.*never-submitted"):
        client.story("never-submitted")
    with pytest.raises(TypeError, match="hashable"):
        client.story(["a", "list"])
    with pytest.raises(TypeError, match="at least one"):
        client.story()
    with pytest.raises(ValueError, match="timeout"):
        client.story("x", timeout=0)
    assert client.submit(pow, 2, 5).result() == 32


def test_a_malformed_story_request_gets_an_error_reply_and_the_client_stays(client):
    for fields in ({"keys": 5}, {"keys": []}, {"keys": [{"a": 1}]},
                   {"keys": ["k"], "timeout": "soon"}, {"keys": ["k"] * 1001}):
        with pytest.raises(SchedulerError, match="story"):
            request(client, "story", **fields)
    assert client.submit(pow, 3, 2).result() == 9


def test_story_leaves_out_a_stopped_worker_within_the_timeout_and_says_so(cluster, client):
    f = client.submit(sum, [4, 5], key="story-stopped")
    f.result()
    with stopped(cluster):
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match="1 worker.s. left out.*no answer within 1 s"):
            story = client.story(f, timeout=1)
        assert time.monotonic() - start < 5
    assert any(e.where == "scheduler" for e in story)


# ---------------------------------------------------------------------------- logs


def test_scheduler_logs_are_recent_lines_in_the_common_format(cluster, client):
    lines = client.get_scheduler_logs()
    assert 0 < len(lines) <= 10_000
    assert all(LINE.match(line) for line in lines), lines[:3]
    assert all(LINE.match(line).group(2) == cluster.address for line in lines)
    assert any(f"client {client.id} connected" in line for line in lines)
    assert len(client.get_scheduler_logs(n=2)) == 2
    assert client.get_scheduler_logs(n=0) == []
    assert client.get_scheduler_logs(n=3) == client.get_scheduler_logs()[-3:]


def test_worker_logs_come_from_every_worker_in_the_common_format(client):
    logs = client.get_worker_logs()
    assert sorted(logs) == sorted(by_name(client).values())
    for address, lines in logs.items():
        assert lines and all(LINE.match(line) for line in lines), lines[:3]
        assert any(LINE.match(line).groups()[:2] == ("worker", address) for line in lines)
        assert any("connected to the scheduler" in line for line in lines)
    assert all(len(lines) <= 1 for lines in client.get_worker_logs(n=1).values())


def test_a_stopped_worker_is_reported_silent_and_not_waited_for(cluster, client):
    with stopped(cluster):
        start = time.monotonic()
        logs = client.get_worker_logs(timeout=1)
        assert time.monotonic() - start < 5
    silent = [a for a, v in logs.items() if isinstance(v, WorkerSilent)]
    answered = [a for a, v in logs.items() if isinstance(v, list)]
    assert len(silent) == 1 and len(answered) == 1
    assert "did not answer: no answer within 1 s" in str(logs[silent[0]])
    wait_for(lambda: all(isinstance(v, list) for v in client.get_worker_logs().values()))


@pytest.mark.parametrize("n", [-1, 1.5, "3", 10_001, True])
def test_a_bad_line_count_is_a_clear_error(client, n):
    with pytest.raises(ValueError, match="n must be None .* or an int from 0 to 10000"):
        client.get_scheduler_logs(n)
    with pytest.raises(ValueError, match="n must be None"):
        client.get_worker_logs(n)
    with pytest.raises(SchedulerError, match="n must be None"):  # past the client's check
        request(client, "worker-logs", n=n)
    assert client.submit(pow, 2, 3).result() == 8


def test_a_workers_log_line_about_a_key_names_the_stimulus_in_its_story(client):
    """A result that cannot be pickled fails to travel: the worker says so in its log,
    naming the stimulus, and the same stimulus id is in the key's story."""
    x = client.submit(threading.Lock, key="lock-x", workers=["w-0"], pure=False)
    y = client.submit(type, x, key="lock-y", workers=["w-1"])
    with pytest.raises(TypeError, match="cannot be serialized"):
        y.result(timeout=30)
    w0 = by_name(client)["w-0"]
    lines = [line for line in client.get_worker_logs()[w0] if "'lock-x'" in line]
    assert lines, "no log line about lock-x"
    sid = re.search(r"\((serve-failed-\d+)\)", lines[0]).group(1)
    assert any(e.stimulus_id == sid and e.where == w0 for e in client.story(x))


# ---------------------------------------------------------------------------- --log-level


def test_log_level_sets_what_is_printed_the_buffer_keeps_info(tmp_path):
    processes = Processes(tmp_path)  # its scheduler runs with --log-level INFO
    try:
        quiet = processes.spawn(["scheduler", "--port", "0", "--log-level", "warning"],
                                tmp_path / "quiet.log")
        address = quiet.stdout.readline().split()[2]
        with Client(address, security=processes.security, set_as_default=False) as c:
            kept = c.get_scheduler_logs()
        assert any(" INFO " in line and "connected" in line for line in kept)
        printed = processes.log("quiet.log")
        assert " INFO " not in printed
        assert all(LINE.match(line) for line in processes.log().splitlines()
                   if line[:2] == "20")
    finally:
        processes.close()


def test_an_unknown_log_level_is_refused_by_name():
    result = subprocess.run(DCORE + ["scheduler", "--log-level", "chatty"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown log level 'chatty'" in result.stderr
    assert "CRITICAL, ERROR, WARNING, INFO, DEBUG" in result.stderr


def test_nanny_and_worker_lines_name_their_role_and_address(cluster, client):
    text = cluster.log("nanny.log")
    roles = {m.group(1) for m in map(LINE.match, text.splitlines()) if m}
    assert {"nanny", "worker"} <= roles
    for address in by_name(client).values():
        assert f" worker {address} INFO " in text
