"""Fixtures and helpers shared by the server tests."""
import asyncio
import contextlib
import datetime
import ipaddress
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import msgpack
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from distributed_server import Client, LocalCluster, Security
from distributed_server.comm.addresses import parse_address
from distributed_server.comm.framing import Comm, CommClosedError
from distributed_server.comm.handshake import PROTOCOL_VERSION
from distributed_server.security import ENVIRONMENT_VARIABLES, new_token

# Test modules import the helpers below with `from server_helpers import ...`. This file's
# own module name depends on pytest's import mode (prepend / importlib), so give it one name.
sys.modules.setdefault("server_helpers", sys.modules[__name__])

#: The ``dcore`` command of this interpreter.
DCORE = [sys.executable, "-m", "distributed_server.cli"]


def workers_of(client) -> list[str]:
    """The addresses of the scheduler's workers, sorted."""
    return sorted(client.scheduler_info()["workers"])


def wait_until_no_tasks(client, timeout: float = 20) -> None:
    """Wait until the scheduler holds no task; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while client.scheduler_info()["n_tasks"]:
        assert time.monotonic() < deadline, client.scheduler_info()["task_counts"]
        time.sleep(0.02)


# ---------------------------------------------------------------- comm tests: loop and raw wire


def run(coro, timeout: float = 30):
    """Run one test coroutine on a fresh event loop, failing it after ``timeout`` s."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Recorder:
    """An on_connection handler that keeps every comm and reads all of its frames."""

    def __init__(self) -> None:
        self.comms: list[Comm] = []
        self.frames: asyncio.Queue = asyncio.Queue()
        self.errors: asyncio.Queue = asyncio.Queue()

    async def __call__(self, comm: Comm) -> None:
        self.comms.append(comm)
        while True:
            try:
                msgs = await comm.read()
            except CommClosedError as e:
                await self.errors.put((comm, e))
                return
            await self.frames.put(msgs)


async def echo(comm: Comm) -> None:
    """An on_connection handler that writes every frame straight back."""
    try:
        while True:
            await comm.write(await comm.read())
    except CommClosedError:
        pass


# ---------------------------------------------------------------- raw wire helpers


def raw_frame(msgs, buffers=()) -> bytes:
    """A frame built exactly as protocol.md describes it."""
    return raw_frame_from_body(msgpack.packb(msgs), buffers)


def raw_frame_from_body(body: bytes, buffers=()) -> bytes:
    n = len(buffers)
    lengths = struct.pack(f"<{n + 1}Q", len(body), *(len(b) for b in buffers))
    return struct.pack("<Q", n) + lengths + body + b"".join(buffers)


async def read_raw_frame(reader: asyncio.StreamReader):
    """Parse one frame by hand: (messages, buffers); Blob refs become ('blob', i)."""
    (n,) = struct.unpack("<Q", await reader.readexactly(8))
    lengths = struct.unpack(f"<{n + 1}Q", await reader.readexactly(8 * (n + 1)))
    body = await reader.readexactly(lengths[0])
    buffers = [await reader.readexactly(size) for size in lengths[1:]]

    def ext_hook(code, data):
        assert code == 1
        return ("blob", int.from_bytes(data, "little"))

    msgs = msgpack.unpackb(body, use_list=False, strict_map_key=False, ext_hook=ext_hook)
    return msgs, buffers


def raw_hello(**fields) -> dict:
    """A hello as protocol.md describes it (no token)."""
    return {"op": "hello", "protocol": PROTOCOL_VERSION, "auth": "none", "nonce": b"n" * 32,
            **fields}


async def raw_client(address: str):
    """A raw asyncio connection that has done its half of the handshake correctly."""
    _, host, port = parse_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(raw_frame([raw_hello()]))
    (hello,), _ = await read_raw_frame(reader)
    assert hello["op"] == "hello"
    writer.write(raw_frame([{"op": "handshake"}]))
    (handshake,), _ = await read_raw_frame(reader)
    assert handshake["op"] == "handshake"
    return reader, writer


async def raw_listener_handshake(reader, writer, **hello_fields) -> None:
    """The listener's half of the handshake, by hand."""
    await read_raw_frame(reader)  # the connector's hello
    writer.write(raw_frame([raw_hello(**hello_fields)]))
    await read_raw_frame(reader)  # its handshake
    writer.write(raw_frame([{"op": "handshake"}]))


async def start_raw_server(handle):
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"tcp://127.0.0.1:{port}"



# ---------------------------------------------------------------- clusters


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes of one thread each, shared by the tests of one module."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True) as c:
        yield c


@pytest.fixture
def client(cluster):
    """A client of the module's cluster, closed after the test."""
    with Client(cluster) as c:
        yield c


@pytest.fixture
def self_signed_cert(tmp_path) -> tuple:
    """(cert_path, key_path) for localhost/127.0.0.1; skips the test if no tool can."""
    return make_self_signed_cert(tmp_path)


def make_self_signed_cert(directory) -> tuple[str, str]:
    """(cert_path, key_path) for localhost/127.0.0.1; skips the test if no tool can."""
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    try:
        write_cert_with_cryptography(cert, key)
        return cert, key
    except ImportError:
        pass
    if shutil.which("openssl") is None:
        pytest.skip("neither the cryptography package nor the openssl CLI is available")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", key, "-out", cert, "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return cert, key


def write_cert_with_cryptography(cert_path: str, key_path: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))


# ---------------------------------------------------------------- real processes


class Processes:
    """A validating scheduler process and the nannies started against it."""

    def __init__(self, directory, scheduler_args=()):
        self.directory = directory
        self.security = Security(token=new_token())
        env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARIABLES}
        env.update(self.security.environment())
        self.env = env
        self.scheduler_log = directory / "scheduler.log"
        self.procs: list = []
        self.scheduler = self.spawn(["scheduler", "--port", "0", "--validate",
                                     "--log-level", "INFO", *scheduler_args],
                                    self.scheduler_log)
        line = self.scheduler.stdout.readline()
        assert line.startswith("Scheduler at "), (line, self.log())
        self.address = line.split()[2]

    def spawn(self, args, log, stdout=subprocess.PIPE):
        """``dcore ARGS``: stderr (the log) to ``log``; stdout a pipe, or ``log`` too."""
        with open(log, "ab") as stderr:
            proc = subprocess.Popen(DCORE + args, stderr=stderr, stdin=subprocess.DEVNULL,
                                    stdout=stderr if stdout == "log" else stdout,
                                    text=True, env=self.env)
        self.procs.append(proc)
        return proc

    def nanny(self, *args, name="w", log="nanny.log"):
        """``dcore worker ADDRESS --name NAME ARGS``: a nanny; stdout and stderr to ``log``."""
        return self.spawn(["worker", self.address, "--name", name, "--log-level", "INFO",
                           *args], self.directory / log, stdout="log")

    def log(self, name="scheduler.log") -> str:
        path = self.directory / name
        return path.read_text(errors="replace") if path.exists() else ""

    def assert_no_errors(self):
        errors = [line for line in self.log().splitlines() if " ERROR " in line]
        assert not errors, f"the scheduler logged errors: {errors[:5]}\n{self.log()}"

    def close(self):
        for proc in reversed(self.procs):  # nannies first
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@contextlib.contextmanager
def one_nanny_cluster(directory, *nanny_args, scheduler_args=()):
    """A validating scheduler and one nanny (``dcore worker ADDRESS NANNY_ARGS``, kept as
    ``processes.main``); at the end both stop, and the scheduler's log must hold no ERROR
    line."""
    processes = Processes(directory, scheduler_args)
    try:
        processes.main = processes.nanny(*nanny_args)
        yield processes
    finally:
        processes.close()
    processes.assert_no_errors()


def nanny_processes(directory, *nanny_args):
    """A generator for fixtures: `one_nanny_cluster` of ``directory``."""
    with one_nanny_cluster(directory, *nanny_args) as processes:
        yield processes


def nanny_client(processes, n_workers: int):
    """A generator for fixtures: a Client of ``processes`` once its scheduler has
    ``n_workers`` workers, all children of its nanny ``main``."""
    with Client(processes.address, security=processes.security, set_as_default=False) as c:
        c.wait_for_workers(n_workers, timeout=30)
        wait_for(lambda: len(children(processes.main)) == n_workers)
        yield c


def children(proc) -> list:
    try:
        return psutil.Process(proc.pid).children()
    except psutil.Error:
        return []


def wait_for(condition, timeout=30.0, interval=0.01):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval)


async def fetch(url, *, method="GET", headers=None, follow_redirects=False, **kwargs):
    """The response, whatever its status (never raises for 4xx)."""
    request = HTTPRequest(url, method=method, headers=headers or {},
                          follow_redirects=follow_redirects,
                          body=kwargs.pop("body", b"" if method in ("POST", "PUT") else None),
                          allow_nonstandard_methods=True, **kwargs)
    return await AsyncHTTPClient(force_instance=True).fetch(request, raise_error=False)


def metrics(text: str) -> dict:
    """``{(name, labels as a sorted tuple): value}`` of a Prometheus text page."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out
