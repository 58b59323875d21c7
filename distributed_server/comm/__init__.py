"""The wire between the processes of a cluster: framed, batched msgpack over tornado TCP
(and TLS), the handshake that admits a peer only with the cluster's secret, and a pool of
connections to workers' peer ports.

Modules: `addresses` (parse and format ``tcp://`` / ``tls://`` addresses), `framing`
(frames, `Comm`, its errors, traffic counters), `handshake` (the hello/proof exchange and
admission: the trust boundary), `connector` (`connect` and its retries), `listener`
(`Listener`, `listen`, connection limits) and `peer_pool`. Every other part of the shell
imports what it needs from this package, not from the modules below.

May import: protocol, distributed_core, and the shared leaves config, logs and security.
"""
from ..protocol.wire import Blob
from .addresses import parse_address
from .connector import connect
from .framing import (
    DEFAULT_MAX_FRAME_BYTES,
    TRAFFIC,
    Comm,
    CommClosedError,
    HandshakeError,
    ListenerBusyError,
    ProtocolError,
)
from .handshake import PROTOCOL_VERSION
from .listener import Listener, listen

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "TRAFFIC",
    "Blob",
    "Comm",
    "CommClosedError",
    "HandshakeError",
    "Listener",
    "ListenerBusyError",
    "ProtocolError",
    "connect",
    "listen",
    "parse_address",
]
