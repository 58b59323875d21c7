"""The state of the coordination primitives, kept by the scheduler: plain data, no I/O.

What this package does
----------------------
`Coordination` holds what `distributed_server.client.primitives` (Variable, Queue, Lock,
Semaphore, Event, Pub/Sub) share between clients: variables' values, queues' items,
lock and semaphore leases, events, subscriptions. The Scheduler holds one by
composition and hands it every client message of `OPS`, the departure of a client and
the passing of time; each call returns the effects the server carries out, in order:

- ``("send", client_id, msg)``: a message to that client (a ``reply`` to a request, or an
  ``error`` for a refused message that had no request id);
- ``("hold", keys)`` / ``("drop", keys)``: the coordination pseudo-client
  (`COORDINATION_CLIENT`) now wants, or no longer wants, these task keys.

Values are opaque bytes (the client's pickle) with the list of task keys of the
Futures inside them. Each stored copy of a value (a variable, a queue item, a parked put,
a subscription's buffer) and each handoff counts towards its keys: while any count is
above zero the pseudo-client wants the key, so its task is kept alive after every client
released it. A value handed to a client becomes a *handoff* that keeps its keys until the
client says ``value-received`` (after it asked for the keys itself), so no key dies in
between.

Modules: `requests` (checks of a request's fields, `CoordinationError`), `ledger` (what
the primitives share: values, key holds, parked requests, client records), one module
per primitive (`variables`, `queues`, `semaphores` with Lock, `events`, `pubsub`), and
`dispatch` (`Coordination`, which gathers their ops). Other modules import from this
package, not from the modules below.

What it never does
------------------
It never unpickles, never reads a clock (``now`` is passed in), never sends. A refused
message changes nothing: every handler checks its whole input before it changes state.
Waiting requests (a lock not free, an empty queue, an unset variable or event) are
parked: answered later, or at their deadline (`Coordination.expire`), never awaited.
Everything is bounded (`CoordinationLimits`): value sizes, total bytes, names, queue
items, parked requests, subscriptions and handoffs per client.

May import: comm (`Blob`), protocol (the limits) and distributed_core; never the server.
"""
from ...protocol.coordination_limits import (
    BLOB_MIN_BYTES,
    COORDINATION_CLIENT,
    MAX_HOLDER_CHARS,
    MAX_LEASES,
    MAX_NAME_CHARS,
    MAX_TIMEOUT,
    CoordinationLimits,
)
from .dispatch import OPS, Coordination
from .ledger import Value
from .requests import CoordinationError, check_name, check_reqid, refuse, wire_value

__all__ = [
    "BLOB_MIN_BYTES",
    "COORDINATION_CLIENT",
    "MAX_HOLDER_CHARS",
    "MAX_LEASES",
    "MAX_NAME_CHARS",
    "MAX_TIMEOUT",
    "OPS",
    "Coordination",
    "CoordinationError",
    "CoordinationLimits",
    "Value",
    "check_name",
    "check_reqid",
    "refuse",
    "wire_value",
]
