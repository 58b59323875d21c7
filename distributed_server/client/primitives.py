"""Coordination primitives shared by clients: Variable, Queue, Lock, Semaphore, Event,
Pub and Sub, with dask.distributed's names and signatures.

What this module does
---------------------
Each primitive is a name plus a client (the one given, else the default client at first
use); its state lives in the scheduler (`distributed_server.scheduler.coordination`), so every
client, and every task that opens a client, sees the same one. Values are pickled here
(cloudpickle) and travel as opaque bytes: the scheduler never unpickles them.

A value may hold Futures, anywhere inside it: each one pickles as its key (the list of
keys goes along, so the scheduler keeps those tasks alive while it holds the value) and
unpickles on the receiving client as a Future of the same key. The receiver asks for
the keys it did not hold, then confirms receipt (``value-received``); only then does the
scheduler stop holding them for the handoff.

Waiting (Lock.acquire, Queue.get, Event.wait, Variable.get before a set, ...) happens in
the scheduler: the request is parked there and answered when it can be, or at its
timeout. A caller that gives up on the client side (an interrupt, a cancelled coroutine)
tells the scheduler, and a lease granted meanwhile is given back. A client's leases and
parked requests end with its connection: a process killed while holding a Lock frees it.

Sync and async: with an asynchronous client the methods return awaitables.
"""
from __future__ import annotations

import asyncio
import datetime
import functools
import itertools
import logging
import math
import pickle
import re
import uuid

import cloudpickle

from ..comm import Blob
from ..protocol.coordination_limits import BLOB_MIN_BYTES, MAX_NAME_CHARS, CoordinationLimits
from .futures import pickled_keys, unpickling_client
from .worker_client import get_client

__all__ = ["Event", "Lock", "Pub", "Queue", "Semaphore", "Sub", "Variable"]

logger = logging.getLogger(__name__)

#: The most bytes one pickled value may have (the scheduler's default limit).
MAX_VALUE_BYTES = CoordinationLimits().max_value_bytes
#: The most Futures' keys one value may hold (the scheduler's default limit).
MAX_KEYS_PER_VALUE = CoordinationLimits().max_keys_per_value
_sub_ids = itertools.count()


# ---------------------------------------------------------------------------- values


def dumps_value(value, where: str, holder: str = "a primitive") -> tuple:
    """``(bytes, keys)``: ``value`` pickled, and the keys of the Futures inside it.

    Raises ValueError if the pickle is larger than ``holder`` may hold."""
    keys: list = []
    token = pickled_keys.set(keys)
    try:
        data = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        pickled_keys.reset(token)
    if len(data) > MAX_VALUE_BYTES:
        raise ValueError(f"{where}: the value is {len(data):,} bytes pickled; {holder} "
                         f"holds at most {MAX_VALUE_BYTES:,} bytes per value (share large "
                         "data as a Future: scatter it, then put the Future in)")
    keys = list(dict.fromkeys(keys))
    if len(keys) > MAX_KEYS_PER_VALUE:
        raise ValueError(f"{where}: the value holds Futures of {len(keys):,} keys; "
                         f"{holder} may hold at most {MAX_KEYS_PER_VALUE:,} per value")
    return (Blob(data) if len(data) >= BLOB_MIN_BYTES else data), keys


def loads_value(data, client):
    """A value from the scheduler, unpickled; its Futures belong to ``client``."""
    token = unpickling_client.set(client)
    try:
        return pickle.loads(data)
    finally:
        unpickling_client.reset(token)


async def graphs_sent(client, keys: list) -> None:
    """Before a value naming ``keys`` goes out: wait for the dask graphs an asynchronous
    client is still sending in the background (they may define those keys, and the
    scheduler refuses a value holding Futures of keys it does not know)."""
    sends = list(client._graphs.sending) if keys else []
    if sends:
        await asyncio.wait([s if isinstance(s, asyncio.Future) else asyncio.wrap_future(s)
                            for s in sends])


def confirm(client, result: dict) -> None:
    """Tell the scheduler the values of ``result`` arrived (after their Futures asked
    for their keys: both go through the client's ordered outbox)."""
    handoff = result.get("handoff")
    if handoff is not None:
        client._post({"op": "value-received", "handoff": handoff})


def receive(client, result: dict):
    """The value (or list of values) of a reply, unpickled; receipt confirmed."""
    try:
        if "values" in result:
            return [loads_value(data, client) for data in result["values"]]
        return loads_value(result["value"], client)
    finally:
        confirm(client, result)


def _seconds(timeout) -> float | None:
    """A timeout as seconds: None, a number, a timedelta, or a string like "200ms"."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    elif isinstance(timeout, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(us|ms|s|m|h|)\s*",
                             timeout)
        if match is None:
            raise ValueError(f"cannot read {timeout!r} as a timeout (e.g. 2, '200ms', '1.5s')")
        scale = {"us": 1e-6, "ms": 1e-3, "": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
        timeout = float(match.group(1)) * scale[match.group(2)]
    elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be None or a number of seconds, not {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds, not {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def check_name(name, kind: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a {kind}'s name must be a str, not {type(name).__name__}")
    if not 0 < len(name) <= MAX_NAME_CHARS:
        raise ValueError(f"a {kind}'s name must have 1 to {MAX_NAME_CHARS} characters")
    return name


def _served(result: dict, what: str) -> bool:
    """True if the request was served, False if it timed out; raises if it was closed."""
    status = result["status"]
    if status == "ok":
        return True
    if status == "closed":
        raise RuntimeError(f"{what} was closed while waiting")
    return False


# ---------------------------------------------------------------------------- shared base


class _Primitive:
    """A named primitive and the client it talks through."""

    _kind = "primitive"

    def __init__(self, name, client) -> None:
        if name is None:
            name = f"{self._kind}-{uuid.uuid4().hex}"
        self.name = check_name(name, self._kind)
        self._client = client

    @property
    def client(self):
        """The client given; else, in a task, the worker's client; else the default
        client (the most recent one open)."""
        if self._client is None:
            try:
                self._client = get_client()
            except ValueError:
                raise ValueError(f"{self!r} has no client: pass client=, or create a Client "
                                 "first (in a task too)") from None
        return self._client

    def _call(self, method, *args):
        return self.client._sync(method, *args)

    async def _ask(self, op: str, on_abandon=None, **fields) -> dict:
        return await self.client._request(op, on_abandon=on_abandon, name=self.name, **fields)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.name!r}>"

    def __reduce__(self):
        return (type(self), (self.name,))


def _give_back(client, op: str, fields: dict, result: dict) -> None:
    """A lease granted to a caller that gave up: release it again."""
    if result.get("status") == "ok":
        client._post({"op": op, "reqid": 0, **fields})


# ---------------------------------------------------------------------------- Variable


class Variable(_Primitive):
    """A named value shared by clients: `set` it in one, `get` it in another.

    The value may be anything picklable up to 16 MiB, Futures included (anywhere inside
    it): the scheduler keeps their tasks alive while the variable holds them.
    """

    _kind = "variable"

    def __init__(self, name: str | None = None, client=None) -> None:
        super().__init__(name, client)

    def set(self, value, timeout=None):
        """Set the value (``timeout`` is accepted for dask's signature; a set never waits)."""
        data, keys = dumps_value(value, f"Variable {self.name!r}")
        return self._call(self._set, data, keys)

    async def _set(self, data, keys) -> None:
        await graphs_sent(self.client, keys)
        await self._ask("variable-set", value=data, keys=keys)

    def get(self, timeout=None):
        """The value; waits until one is set (``TimeoutError`` after ``timeout`` s)."""
        return self._call(self._get, _seconds(timeout))

    async def _get(self, timeout):
        client = self.client
        result = await self._ask("variable-get", functools.partial(confirm, client),
                                 timeout=timeout)
        if result["status"] != "ok":
            raise TimeoutError(f"Variable {self.name!r} was not set within {timeout} s")
        return receive(client, result)

    def delete(self):
        """Delete the variable (for every client); its Futures' tasks may then go."""
        return self._call(self._delete)

    async def _delete(self) -> None:
        await self._ask("variable-delete")


# ---------------------------------------------------------------------------- Queue


class Queue(_Primitive):
    """A first-in first-out queue shared by clients.

    ``maxsize`` (0: up to 100,000 items, then `put` is refused) makes `put` wait while
    the queue is full; it is fixed by whoever first uses the queue's name while it is
    empty. Items may hold Futures, as a Variable's value.
    """

    _kind = "queue"

    def __init__(self, name: str | None = None, client=None, maxsize: int = 0) -> None:
        super().__init__(name, client)
        if isinstance(maxsize, bool) or not isinstance(maxsize, int):
            raise TypeError(f"maxsize must be an int, not {maxsize!r}")
        limit = CoordinationLimits().max_queue_items
        if not 0 <= maxsize <= limit:
            raise ValueError(f"maxsize must be from 0 to {limit:,}, not {maxsize}")
        self.maxsize = maxsize

    def put(self, value, timeout=None):
        """Append ``value``; waits while the queue is full (``TimeoutError`` after
        ``timeout`` s)."""
        data, keys = dumps_value(value, f"Queue {self.name!r}")
        return self._call(self._put, data, keys, _seconds(timeout))

    async def _put(self, data, keys, timeout) -> None:
        await graphs_sent(self.client, keys)
        result = await self._ask("queue-put", _ignore, value=data, keys=keys,
                                 timeout=timeout, maxsize=self.maxsize)
        if result["status"] != "ok":
            raise TimeoutError(f"Queue {self.name!r} stayed full for {timeout} s")

    def get(self, timeout=None, batch=False):
        """The first item; waits for one (``TimeoutError`` after ``timeout`` s).

        ``batch=True``: every item there now, as a list (maybe empty; never waits);
        ``batch=n``: a list of the first ``n`` items, once there are ``n``."""
        if not isinstance(batch, bool) and (not isinstance(batch, int) or batch < 1):
            raise ValueError(f"batch must be True, False or an int >= 1, not {batch!r}")
        return self._call(self._get, _seconds(timeout), batch)

    async def _get(self, timeout, batch):
        client = self.client
        result = await self._ask("queue-get", functools.partial(confirm, client),
                                 timeout=timeout, batch=batch, maxsize=self.maxsize)
        if result["status"] != "ok":
            raise TimeoutError(f"Queue {self.name!r} had nothing to get within {timeout} s")
        return receive(client, result)

    def qsize(self):
        """How many items the queue holds now."""
        return self._call(self._qsize)

    async def _qsize(self) -> int:
        return (await self._ask("queue-qsize"))["size"]

    def __reduce__(self):
        return (Queue, (self.name, None, self.maxsize))


def _ignore(result) -> None:
    """An abandoned request whose late answer needs no undoing."""


# ---------------------------------------------------------------------------- Lock, Semaphore


class Semaphore(_Primitive):
    """At most ``max_leases`` holders at once, across every client.

    `acquire` waits (in the scheduler) for a free lease and returns True, or False after
    ``timeout`` seconds; `release` gives one back. A lease is tied to its client's
    connection, not renewed by a timer: when a client disconnects or dies, its leases
    are released at once (a client that hangs without closing its connection keeps them
    until the scheduler drops it, after ``--client-idle-timeout``). All users of a name
    must agree on ``max_leases``.
    """

    _kind = "semaphore"

    def __init__(self, max_leases: int = 1, name: str | None = None, client=None) -> None:
        if isinstance(max_leases, bool) or not isinstance(max_leases, int):
            raise TypeError(f"max_leases must be an int, not {max_leases!r}")
        if max_leases < 1:
            raise ValueError(f"max_leases must be at least 1, not {max_leases}")
        super().__init__(name, client)
        self.max_leases = max_leases
        self.id = uuid.uuid4().hex  # leases are held by this object
        self._leases = 0

    def _fields(self) -> dict:
        return {"holder": self.id, "max_leases": self.max_leases}

    def acquire(self, timeout=None):
        """Take a lease: True, or False if none was free within ``timeout`` seconds."""
        return self._call(self._acquire, _seconds(timeout))

    async def _acquire(self, timeout) -> bool:
        op = f"{self._kind}-release"
        undo = functools.partial(_give_back, self.client, op,
                                 {"name": self.name, "holder": self.id})
        result = await self._ask(f"{self._kind}-acquire", undo, timeout=timeout,
                                 **self._fields())
        if _served(result, repr(self)):
            self._leases += 1
            return True
        return False

    def release(self):
        """Give back a lease this object took (RuntimeError if it holds none)."""
        if not self._leases:
            raise RuntimeError(f"{self!r} was released more often than acquired")
        self._leases -= 1
        return self._call(self._release)

    async def _release(self) -> bool:
        await self._ask(f"{self._kind}-release", holder=self.id)
        return True

    def get_value(self):
        """How many leases are held now, by anyone."""
        return self._call(self._get_value)

    async def _get_value(self) -> int:
        return (await self._ask("semaphore-value"))["value"]

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    async def __aenter__(self):
        await self.acquire()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.release()

    def __reduce__(self):
        return (Semaphore, (self.max_leases, self.name))


class Lock(Semaphore):
    """A lock across every client: one holder at a time (not reentrant).

    ``acquire(blocking=True, timeout=None)`` returns True once acquired, False if not
    within ``timeout`` seconds (at once with ``blocking=False``). Its holder is this Lock
    object; a client that disconnects or dies releases the locks it holds.
    """

    _kind = "lock"

    def __init__(self, name: str | None = None, client=None) -> None:
        super().__init__(1, name, client)

    def _fields(self) -> dict:
        return {"holder": self.id}

    def acquire(self, blocking: bool = True, timeout=None):
        """Take the lock: True, or False if it was not free within ``timeout`` s."""
        if not blocking:
            if timeout is not None:
                raise ValueError("can't specify a timeout for a non-blocking call")
            timeout = 0
        return super().acquire(timeout)

    def locked(self):
        """Whether anyone holds the lock now."""
        return self._call(self._locked)

    async def _locked(self) -> bool:
        return (await self._ask("lock-locked"))["locked"]

    def get_value(self):
        """1 if anyone holds the lock now, else 0."""
        return self._call(self._get_value)

    async def _get_value(self) -> int:
        return int(await self._locked())

    def __reduce__(self):
        return (Lock, (self.name,))


# ---------------------------------------------------------------------------- Event


class Event(_Primitive):
    """A flag shared by clients: `wait` until some client `set`s it."""

    _kind = "event"

    def __init__(self, name: str | None = None, client=None) -> None:
        super().__init__(name, client)

    def set(self):
        """Set the flag; every waiter wakes."""
        return self._call(self._simple, "event-set")

    def clear(self):
        """Clear the flag."""
        return self._call(self._simple, "event-clear")

    async def _simple(self, op: str) -> None:
        await self._ask(op)

    def wait(self, timeout=None):
        """True once the flag is set, False if it was not within ``timeout`` seconds."""
        return self._call(self._wait, _seconds(timeout))

    async def _wait(self, timeout) -> bool:
        return _served(await self._ask("event-wait", _ignore, timeout=timeout), repr(self))

    def is_set(self):
        """Whether the flag is set now."""
        return self._call(self._is_set)

    async def _is_set(self) -> bool:
        return (await self._ask("event-is-set"))["is_set"]


# ---------------------------------------------------------------------------- Pub / Sub


class Pub(_Primitive):
    """Publish messages to every `Sub` of the same name that exists at the time.

    `put` does not wait: messages go through the scheduler, in order, to the
    subscriptions open when they arrive (none open: the message is dropped, as in dask).
    A message may hold Futures. Errors (a message too large for the scheduler) are
    logged by the client as WARNINGs.
    """

    _kind = "pub"

    def __init__(self, name: str, client=None) -> None:
        super().__init__(name, client)

    def put(self, msg) -> None:
        """Publish ``msg`` (any picklable object up to 16 MiB)."""
        data, keys = dumps_value(msg, f"Pub {self.name!r}")
        client = self.client
        client._check_running()
        client._post({"op": "pub-put", "name": self.name, "value": data, "keys": keys})


class Sub(_Primitive):
    """Receive the messages published under a name from now on.

    ``get(timeout=None)`` returns the next one (``TimeoutError`` after ``timeout``
    seconds); iterate with ``for msg in sub`` (or ``async for``). The scheduler keeps up
    to 10,000 messages per subscription for you; past that the oldest are dropped and a
    WARNING says how many. `close` (or garbage collection) ends the subscription.
    """

    _kind = "sub"

    def __init__(self, name: str, client=None) -> None:
        super().__init__(name, client)
        self.sub_id = next(_sub_ids)
        self._closed = True  # until the scheduler took the subscription
        client = self.client
        if client.asynchronous:
            self._started = client._loop.create_task(self._subscribe())
        else:
            self._started = None
            client._sync(self._subscribe)

    async def _subscribe(self) -> None:
        await self._ask("sub-subscribe", sub_id=self.sub_id)
        self._closed = False

    def __await__(self):
        async def started():
            if self._started is not None:
                await self._started
            return self
        return started().__await__()

    def get(self, timeout=None):
        """The next message (``TimeoutError`` after ``timeout`` seconds)."""
        return self._call(self._get, _seconds(timeout))

    async def _get(self, timeout):
        if self._started is not None:
            await self._started
        client = self.client
        result = await client._request("sub-get", functools.partial(confirm, client),
                                       sub_id=self.sub_id, timeout=timeout)
        if not _served(result, repr(self)):
            raise TimeoutError(f"Sub {self.name!r} received nothing within {timeout} s")
        if result.get("dropped"):
            logger.warning("Sub %r missed %d messages: its buffer at the scheduler was full",
                           self.name, result["dropped"])
        return receive(client, result)

    def __iter__(self):
        return self

    def __next__(self):
        return self.get()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.get()

    def close(self) -> None:
        """End the subscription (messages not yet received are dropped)."""
        if not self._closed:
            self._closed = True
            client = self._client
            if client is not None and client.status == "running":
                client._post({"op": "sub-unsubscribe", "sub_id": self.sub_id})

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # the loop is gone (interpreter exit)
            pass

    def __reduce__(self):
        return (Sub, (self.name,))
