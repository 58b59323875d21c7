"""The wire between the processes of a cluster: framed, batched msgpack over tornado TCP
(and TLS), the handshake that admits a peer only with the cluster's secret, and a pool of
connections to workers' peer ports.

Every other part of the shell imports what it needs from here, not from the modules
below: `framing` (frames, `Comm`, connect and listen) and `peer_pool`.
"""
from ..protocol.wire import Blob
from .framing import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    TRAFFIC,
    Comm,
    CommClosedError,
    HandshakeError,
    Listener,
    ListenerBusyError,
    ProtocolError,
    connect,
    listen,
    parse_address,
)

__all__ = ["Blob", "Comm", "CommClosedError", "DEFAULT_MAX_FRAME_BYTES", "HandshakeError",
           "Listener", "ListenerBusyError", "PROTOCOL_VERSION", "ProtocolError", "TRAFFIC",
           "connect", "listen", "parse_address"]
