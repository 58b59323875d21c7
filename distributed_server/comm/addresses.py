"""Addresses of the wire: ``tcp://host:port`` and ``tls://host:port``, parsed, formatted,
and checked against the credentials a connection will use (`connect`, `listen`, `Comm`).
"""

from __future__ import annotations

from ..security import Security

_SCHEMES = ("tcp", "tls")


def parse_address(address: str) -> tuple[str, str, int]:
    """Split ``"tcp://host:port"`` or ``"tls://host:port"`` into ``(scheme, host, port)``.

    IPv6 hosts are written in brackets (``tcp://[::1]:8786``) and returned without them.
    Raises ``ValueError`` naming the address for anything else.
    """
    if not isinstance(address, str):
        # ValueError, not TypeError: every bad address is one kind of error for callers
        message = f"address must be a str like 'tcp://host:port', got {address!r}"
        raise ValueError(message)  # noqa: TRY004
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ValueError(f"address {address!r} must start with 'tcp://' or 'tls://'")
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host or not port_text:
        raise ValueError(f"address {address!r} must look like '{scheme}://host:port'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"address {address!r}: write an IPv6 host in brackets, [::1]")
    if not host or any(c in host for c in "/[]@") or not host.isprintable() \
            or any(c.isspace() for c in host):
        raise ValueError(f"address {address!r} has an invalid host {host!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"address {address!r} has an invalid port {port_text!r}")
    return scheme, host, int(port_text)


def format_address(scheme: str, host: str, port: int) -> str:
    """The inverse of `parse_address`."""
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def security_for(address: str, security: Security | None) -> Security:
    """``security`` (or no credentials), checked against the address's scheme."""
    if security is None:
        security = Security()
    scheme = parse_address(address)[0]
    if scheme == "tls" and not security.tls:
        raise ValueError(f"{address!r} is a tls:// address: pass security= with TLS files")
    if scheme == "tcp" and security.tls:
        raise ValueError(f"{address!r} is a tcp:// address, but security= has TLS files: "
                         "use tls://")
    return security
