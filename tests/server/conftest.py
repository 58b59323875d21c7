"""Fixtures and helpers shared by the server tests."""
import datetime
import ipaddress
import shutil
import subprocess
import sys
import time

import pytest

from distributed_server import Client, LocalCluster

# Test modules import the helpers below with `from server_helpers import ...`. This file's
# own module name depends on pytest's import mode (prepend / importlib), so give it one name.
sys.modules.setdefault("server_helpers", sys.modules[__name__])


def workers_of(client) -> list[str]:
    """The addresses of the scheduler's workers, sorted."""
    return sorted(client.scheduler_info()["workers"])


def wait_until_no_tasks(client, timeout: float = 20) -> None:
    """Wait until the scheduler holds no task; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while client.scheduler_info()["n_tasks"]:
        assert time.monotonic() < deadline, client.scheduler_info()["task_counts"]
        time.sleep(0.02)


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
