"""What the coordination primitives may hold, shared by the clients that check their
requests before sending and the scheduler that enforces them."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BLOB_MIN_BYTES", "COORDINATION_CLIENT", "CoordinationLimits", "MAX_HOLDER_CHARS",
           "MAX_LEASES", "MAX_NAME_CHARS", "MAX_TIMEOUT"]

#: The client id under which primitives want the task keys of the Futures they hold.
#: No real client may connect with it.
COORDINATION_CLIENT = "coordination"
#: The longest name of a primitive, in characters.
MAX_NAME_CHARS = 256
#: The longest id a Lock or Semaphore object gives itself (a uuid's hex is 32).
MAX_HOLDER_CHARS = 64
#: Timeouts above this many seconds mean "no timeout".
MAX_TIMEOUT = 1e8
#: Most leases a Semaphore may have.
MAX_LEASES = 2**31 - 1
#: Values at least this large are sent back as out-of-band buffers.
BLOB_MIN_BYTES = 64 * 1024


@dataclass(frozen=True)
class CoordinationLimits:
    """What the scheduler holds for primitives at most; past a limit a request is refused
    with an error that names it, and nothing changes."""

    #: Bytes of one value (a Variable's, a Queue item, a Pub message), pickled.
    max_value_bytes: int = 16 * 2**20
    #: Bytes of all values held together (each buffered copy of a Pub message counts).
    max_total_bytes: int = 512 * 2**20
    #: Names in use per kind (variables set, queues, locks, semaphores, events, topics).
    max_names: int = 10_000
    #: Items in one queue (its ``maxsize`` may be lower).
    max_queue_items: int = 100_000
    #: Futures inside one value (a persisted collection of as many chunks).
    max_keys_per_value: int = 100_000
    #: Requests one client may have waiting at once.
    max_waiting_per_client: int = 10_000
    #: Messages one subscription buffers; past it the oldest are dropped (and counted).
    max_sub_buffer: int = 10_000
    #: Subscriptions one client may have.
    max_subscriptions_per_client: int = 1_000
    #: Values handed to one client whose receipt it has not confirmed yet.
    max_handoffs_per_client: int = 10_000
