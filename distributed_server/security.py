"""Credentials of a cluster: a shared token, mutual TLS, or both.

A `Security` object holds what one process needs to be admitted by its peers and to
admit them: the cluster's token (a shared secret, proven by challenge-response in the
comm handshake, never sent) and/or TLS files (the cluster's CA, this process's
certificate and key). Every role takes one: ``Scheduler(security=)``,
``Worker(security=)``, ``Client(address, security=)``, ``LocalCluster(security=)``,
and ``dcore`` builds one from its flags and the environment.

Trust model: whoever holds the token, or a certificate signed by the cluster's CA, is a
member of the cluster and may run code on it. Certificates are checked against the CA
(both directions), not against host names, so one CA serves a cluster whose hosts change.
TLS also encrypts and protects every message; the token alone authenticates peers but
leaves the traffic readable and alterable by someone on the network path, so across
untrusted networks use TLS (with or without the token).

Environment variables (read by `Security.from_environment`, written by `environment`
for child processes): ``DCORE_TOKEN``, ``DCORE_TOKEN_FILE``, ``DCORE_TLS_CA_FILE``,
``DCORE_TLS_CERT``, ``DCORE_TLS_KEY``.
"""
from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import shutil
import socket
import ssl
import tempfile
import weakref

from . import config

__all__ = ["Security", "SecurityError", "check_listen_security", "is_loopback", "new_token",
           "write_tls_files"]

#: A token shorter than this is refused: it could be guessed.
MIN_TOKEN_LENGTH = 16

_ENV_TOKEN = "DCORE_TOKEN"
_ENV_TOKEN_FILE = "DCORE_TOKEN_FILE"
_ENV_CA = "DCORE_TLS_CA_FILE"
_ENV_CERT = "DCORE_TLS_CERT"
_ENV_KEY = "DCORE_TLS_KEY"
#: Every environment variable that carries credentials.
ENVIRONMENT_VARIABLES = (_ENV_TOKEN, _ENV_TOKEN_FILE, _ENV_CA, _ENV_CERT, _ENV_KEY)


class SecurityError(ValueError):
    """The credentials given are incomplete or unusable."""


def new_token() -> str:
    """A fresh random cluster token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


class Security:
    """The credentials of one process of a cluster.

    ``token``: the cluster's shared secret (text), or ``token_file``: a file holding it
    (surrounding white space ignored). ``tls_ca_file``, ``tls_cert``, ``tls_key``: PEM
    files of the cluster's CA and of this process's certificate and private key; give
    all three or none. With TLS, both ends of every connection present a certificate
    signed by the CA (mutual TLS) and speak at least ``tls_min_version``.
    ``Security()`` has no credentials: it admits anyone and is only allowed on loopback
    by `dcore` and the servers, unless they are told ``insecure``.
    """

    def __init__(self, *, token: str | None = None, token_file: str | None = None,
                 tls_ca_file: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None,
                 tls_min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2) -> None:
        if token is not None and token_file is not None:
            raise SecurityError("give token= or token_file=, not both")
        if token_file is not None:
            token = _read_token_file(token_file)
        if token is not None:
            _check_token(token)
        tls = (tls_ca_file, tls_cert, tls_key)
        if any(tls) and not all(tls):
            raise SecurityError("TLS needs all three of tls_ca_file, tls_cert and tls_key "
                                f"(got ca={tls_ca_file!r}, cert={tls_cert!r}, key={tls_key!r})")
        for path in filter(None, tls):
            if not os.path.isfile(path):
                raise SecurityError(f"TLS file {path!r} does not exist")
        if tls_min_version < ssl.TLSVersion.TLSv1_2:
            raise SecurityError("TLS older than 1.2 is not allowed")
        self.token = token
        self.tls_ca_file, self.tls_cert, self.tls_key = tls
        self.tls_min_version = tls_min_version
        self._contexts: dict = {}
        self._tempdir_finalizer = None  # set by temporary(): removes its files

    def __repr__(self) -> str:
        parts = []
        if self.token is not None:
            parts.append("token=<hidden>")
        if self.tls:
            parts.append(f"tls_ca_file={self.tls_ca_file!r}, tls_cert={self.tls_cert!r}")
        return f"Security({', '.join(parts)})"

    @property
    def tls(self) -> bool:
        """True if this process speaks (mutual) TLS."""
        return self.tls_cert is not None

    @property
    def scheme(self) -> str:
        """The address scheme its connections use: ``"tls"`` or ``"tcp"``."""
        return "tls" if self.tls else "tcp"

    @property
    def has_credentials(self) -> bool:
        """True if peers must prove something to be admitted (a token or a certificate)."""
        return self.token is not None or self.tls

    # ------------------------------------------------------------------ construction

    @classmethod
    def temporary(cls, *, token: bool = True, tls: bool = True,
                  directory: str | None = None) -> Security:
        """Throwaway credentials for a cluster on this machine or a test: a fresh token
        and/or a new CA with one certificate for every role (needs ``cryptography``).

        The PEM files go to a private temporary directory (or ``directory``), removed
        when this object is garbage collected or the interpreter exits.
        """
        tls_files: dict = {}
        own_directory = tls and directory is None
        if own_directory:
            directory = tempfile.mkdtemp(prefix="dcore-tls-")
        if tls:
            tls_files = write_tls_files(directory)
        security = cls(token=new_token() if token else None, **tls_files)
        if own_directory:
            security._tempdir_finalizer = weakref.finalize(security, shutil.rmtree,
                                                           directory, True)
        return security

    @classmethod
    def from_environment(cls, environ=None, role: str | None = None) -> Security:
        """Credentials from ``DCORE_TOKEN`` / ``DCORE_TOKEN_FILE`` and ``DCORE_TLS_*``.

        White space around ``DCORE_TOKEN`` is ignored, as in a token file: a value taken
        from a file (a Kubernetes Secret made with ``--from-file``) ends with a newline.

        Reading this process's environment (``environ`` None), what the variables leave
        unset comes from configuration (config.py): a token file from
        ``dcore.comm.token-file``; with ``role`` (``"client"``, ``"scheduler"`` or
        ``"worker"``) and no ``DCORE_TLS_*`` set, TLS from dask's keys as a dask user set
        them: ``distributed.comm.tls.ca-file`` and ``distributed.comm.tls.<role>.cert`` /
        ``.key`` (or the same under ``dcore.``). ValueError if only some are set."""
        env = os.environ if environ is None else environ
        token = (env.get(_ENV_TOKEN) or "").strip() or None
        token_file = env.get(_ENV_TOKEN_FILE) or None
        tls = [env.get(_ENV_CA) or None, env.get(_ENV_CERT) or None,
               env.get(_ENV_KEY) or None]
        if environ is None:
            if token is None and token_file is None:
                token_file = config.get("comm.token-file")
            if role is not None and not any(tls):
                tls = _tls_from_configuration(role)
        return cls(token=token, token_file=token_file, tls_ca_file=tls[0], tls_cert=tls[1],
                   tls_key=tls[2])

    def environment(self) -> dict:
        """The environment variables that give a child process these credentials."""
        env = {}
        if self.token is not None:
            env[_ENV_TOKEN] = self.token
        if self.tls:
            env.update({_ENV_CA: self.tls_ca_file, _ENV_CERT: self.tls_cert,
                        _ENV_KEY: self.tls_key})
        return env

    # ------------------------------------------------------------------ TLS contexts

    def ssl_context(self, server_side: bool) -> ssl.SSLContext | None:
        """The SSLContext to listen (``server_side``) or connect with; None without TLS.

        Both sides require the peer's certificate and check it against the CA; host
        names are not checked (membership is proven by the CA's signature).
        """
        if not self.tls:
            return None
        context = self._contexts.get(server_side)
        if context is None:
            purpose = ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT
            context = ssl.SSLContext(purpose)
            context.minimum_version = self.tls_min_version
            context.check_hostname = False
            context.verify_mode = ssl.CERT_REQUIRED
            try:
                context.load_verify_locations(cafile=self.tls_ca_file)
                context.load_cert_chain(self.tls_cert, self.tls_key)
            except (ssl.SSLError, OSError) as e:
                raise SecurityError(f"cannot load the TLS files: {e}") from e
            self._contexts[server_side] = context
        return context


    # ------------------------------------------------------------------ HTTP

    def dashboard_token(self) -> str | None:
        """The token of the HTTP endpoints (dashboard, ``/metrics``): derived from the
        cluster's token, it admits to them and to nothing else, so a link or a scrape
        config that carries it cannot join the cluster. None without a cluster token."""
        if self.token is None:
            return None
        digest = hmac.new(self.token.encode(), _DASHBOARD_TOKEN_LABEL, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def http_ssl_context(self) -> ssl.SSLContext | None:
        """The SSLContext of an HTTPS endpoint; None without TLS. It presents this
        process's certificate; a client certificate is asked for and, if one is
        presented, checked against the CA (so a browser without one still connects, and
        then needs the dashboard token)."""
        if not self.tls:
            return None
        context = self._contexts.get("http")
        if context is None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = self.tls_min_version
            context.verify_mode = ssl.CERT_OPTIONAL
            try:
                context.load_verify_locations(cafile=self.tls_ca_file)
                context.load_cert_chain(self.tls_cert, self.tls_key)
            except (ssl.SSLError, OSError) as e:
                raise SecurityError(f"cannot load the TLS files: {e}") from e
            self._contexts["http"] = context
        return context


#: What the dashboard token is derived with (an HMAC keyed by the cluster token).
_DASHBOARD_TOKEN_LABEL = b"distributed-core dashboard v1"


def is_loopback(host: str) -> bool:
    """True if ``host`` is reachable only from this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen_security(host: str, security: Security, insecure: bool, role: str) -> None:
    """Refuse to listen beyond loopback with no credentials, unless ``insecure``."""
    if insecure or security.has_credentials or is_loopback(host):
        return
    raise SecurityError(
        f"refusing to run a {role} on {host} without credentials: anyone who reaches "
        "it could run code here. Give a token (--token-file or DCORE_TOKEN) and/or TLS "
        "files (--tls-ca-file --tls-cert --tls-key), or pass --insecure (insecure=True)."
    )


def _check_token(token) -> None:
    if not isinstance(token, str):
        raise SecurityError(f"the cluster token must be text, not {type(token).__name__}")
    if len(token) < MIN_TOKEN_LENGTH:
        raise SecurityError(f"the cluster token must have at least {MIN_TOKEN_LENGTH} "
                            "characters (`dcore token` prints a fresh one)")


def _read_token_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as e:
        raise SecurityError(f"cannot read the token file {path!r}: {e}") from e


def write_tls_files(directory: str, hosts: tuple = (), days: int = 365) -> dict:
    """Make a new CA and one certificate signed by it, for every role of a cluster.

    Writes ``ca.pem``, ``cert.pem`` and ``key.pem`` (the key readable by the owner only)
    into ``directory`` and returns them as ``Security`` keyword arguments. The
    certificate names localhost, this host and ``hosts``, though peers check only the
    CA's signature. Needs the ``cryptography`` package (the ``tls`` extra).
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:
        raise ImportError("making TLS certificates needs the cryptography package: "
                          "pip install 'distributed-core[tls]'") from e

    os.makedirs(directory, mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(text):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder().subject_name(name("distributed-core cluster CA"))
        .issuer_name(name("distributed-core cluster CA")).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    dns = {"localhost", socket.gethostname(), *(h for h in hosts if not _is_ip(h))}
    ips = {"127.0.0.1", "::1", *(h for h in hosts if _is_ip(h))}
    san = [x509.DNSName(d) for d in sorted(dns)]
    san += [x509.IPAddress(ipaddress.ip_address(i)) for i in sorted(ips)]
    cert = (
        x509.CertificateBuilder().subject_name(name("distributed-core member"))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"tls_ca_file": os.path.join(directory, "ca.pem"),
             "tls_cert": os.path.join(directory, "cert.pem"),
             "tls_key": os.path.join(directory, "key.pem")}
    pem = serialization.Encoding.PEM
    _write(paths["tls_ca_file"], ca_cert.public_bytes(pem), 0o644)
    _write(paths["tls_cert"], cert.public_bytes(pem), 0o644)
    _write(paths["tls_key"], key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()), 0o600)
    return paths


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _write(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _tls_from_configuration(role: str) -> list:
    """``[ca_file, cert, key]`` for ``role`` from configuration: all three, or none."""
    if role not in ("client", "scheduler", "worker"):
        raise ValueError(f"role must be client, scheduler or worker, not {role!r}")
    names = ["comm.tls.ca-file", f"comm.tls.{role}.cert", f"comm.tls.{role}.key"]
    values = [config.get(name) for name in names]
    if any(values) and not all(values):
        missing = [f"distributed.{name}" for name, value in zip(names, values) if not value]
        raise ValueError(f"TLS configuration for the {role} is incomplete: "
                         f"{', '.join(missing)} not set (a CA file, a certificate and "
                         f"its key are needed together)")
    return values
