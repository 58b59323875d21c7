"""The client's connection to its scheduler: one ordered outbox, replies matched by id.

What this module does
---------------------
- `SchedulerComm` connects to the scheduler (handshake ``{"role": "client"}``; the peer
  must say it is the scheduler), sends a heartbeat every `HEARTBEAT_INTERVAL` seconds
  (the scheduler answers each one, and sends its own every 5 s) and gives up on a
  scheduler silent for longer than ``scheduler_timeout`` (judged only by a heartbeat
  that came on time: a late one means this loop was held, and frames may wait unread),
  reads the scheduler's frames and hands each message to the
  client's handler for its ``op``. When the connection ends it tells the client once
  (``on_lost``).
- The outbox: everything the client says to the scheduler goes through it, in order.
  Any thread may `post`: a message (dict), or a key state (`KeyState`) whose reference
  is dropped; each run of consecutive key states goes to the client's ``release`` (its
  key table, which sends the ``release-keys`` messages). The loop drains the outbox in
  order and is woken once per drain, not per item, so a task always goes out before the
  release of a future it depends on.
- `GraphTurn`: a dask graph's place in the outbox. Draining stops there until the
  graph's slices are all sent (`take_turn`, then `end_turn`), so nothing queued after
  the graph (a cancel, a release) overtakes it.
- Requests: `request` sends ``{"op", "reqid", ...}`` through the outbox and waits for the
  ``reply`` carrying the same ``reqid``; an ``error`` in the reply raises
  `SchedulerError`. `ping` is an empty ``who-has`` sent at once: its reply says the
  scheduler has handled everything sent before it.

It never touches the client's key states beyond handing them to ``release``, and never
unpickles: what the messages carry is the client's business.

Threads
-------
`post` is the only method for other threads; everything else runs on the client's loop.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Callable

from ..comm import Comm, CommClosedError, connect
from ..security import Security
from .futures import KeyState, SchedulerError

__all__ = ["GraphTurn", "SchedulerComm", "log_background_failure"]

logger = logging.getLogger("distributed_server.client")

#: Seconds between the client's heartbeats to the scheduler (it answers each one).
HEARTBEAT_INTERVAL = 5.0


class GraphTurn:
    """A dask graph's place in the outbox: draining stops there until the graph's
    slices are sent (`SchedulerComm.take_turn`, `SchedulerComm.end_turn`)."""

    __slots__ = ("_at_head", "_waiter")

    def __init__(self) -> None:
        self._at_head = False
        self._waiter: asyncio.Future | None = None

    def reached(self) -> None:
        """On the loop: everything before it is sent."""
        self._at_head = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, loop) -> None:
        """Until everything queued before it is sent."""
        if not self._at_head:
            self._waiter = loop.create_future()
            await self._waiter


class WrittenMark:
    """A place in the outbox: ``event`` is set once everything posted before it has been
    handed to the kernel (or the connection is gone): `SchedulerComm.mark_written`."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()


def log_background_failure(task) -> None:
    """Done callback of a task the client runs in the background: log its failure."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("the client's background task %s failed: %r", task.get_name(), exc)


def _ignore(msg: dict) -> None:
    """A message that only proves the scheduler is alive."""


def _undo_abandoned(on_abandon: Callable, reply: asyncio.Future) -> None:
    """The reply of a request its caller gave up on: undo what it granted."""
    if reply.cancelled() or reply.exception() is not None:
        return
    try:
        on_abandon(reply.result())
    except Exception:
        logger.exception("undoing the abandoned request %r failed", on_abandon)


class SchedulerComm:
    """One client's connection to its scheduler, with the ordered outbox.

    ``handlers`` maps the ops of the scheduler's messages to the client's callables
    (``reply``, ``error`` and ``heartbeat`` are handled here); ``release(states)`` drops
    one reference to each key state of a run of them taken from the outbox (and sends
    what that releases); ``on_lost(reason)`` is called once when the connection ends,
    closed or lost.
    """

    def __init__(self, client_id: str, handlers: dict,
                 release: Callable[[list[KeyState]], None],
                 on_lost: Callable[[Exception], None]) -> None:
        self.client_id = client_id
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread_id: int | None = None
        self.comm: Comm | None = None
        self.address: str | None = None
        self.scheduler_timeout = 30.0
        self._handlers = {**handlers, "reply": self._handle_reply,
                          "error": self._handle_error, "heartbeat": _ignore}
        self._release = release
        self._on_lost = on_lost
        self._outbox: collections.deque = collections.deque()
        self._drain_scheduled = False
        self._replies: dict[int, asyncio.Future] = {}
        self._reqids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._last_heard = 0.0  # loop time of the last frame from the scheduler
        self._beat_due = 0.0  # loop time the next heartbeat is due
        self._closing = False

    # ------------------------------------------------------------ connecting and closing

    async def connect(self, address: str, timeout: float, security: Security | None,
                      scheduler_timeout: float) -> None:
        """Connect from the client's loop, start reading and the heartbeats."""
        self.loop = loop = asyncio.get_running_loop()
        self.loop_thread_id = threading.get_ident()
        self.scheduler_timeout = scheduler_timeout
        self.address = address
        comm = await connect(address, {"role": "client", "client_id": self.client_id},
                             timeout=timeout, security=security)
        if comm.extra.get("role") != "scheduler":
            comm.abort()
            raise ConnectionError(f"{address} is not a scheduler "
                                  f"(it says role={comm.extra.get('role')!r})")
        self.comm = comm
        self._last_heard = loop.time()
        self._reader = loop.create_task(self._read_loop(comm))
        self._beat_due = loop.time() + HEARTBEAT_INTERVAL
        loop.call_later(HEARTBEAT_INTERVAL, self._heartbeat)

    async def close(self) -> None:
        """Send what the outbox holds and ``close-client``, close, wait for the reader."""
        self._closing = True
        comm = self.comm
        if comm is not None and not comm.closed:
            self.drain()
            comm.send({"op": "close-client"})
            await comm.close()
        if self._reader is not None:
            await self._reader

    def _heartbeat(self) -> None:
        """Tell the scheduler we are alive (it drops clients silent for too long), and
        give up on a scheduler that has not answered for ``scheduler_timeout``."""
        comm = self.comm
        if self._closing or comm is None or comm.closed:
            return
        now = self.loop.time()
        silent = now - self._last_heard
        # a beat that comes late found this loop held: what the scheduler sent meanwhile
        # may be waiting unread, so the silence is judged at the next beat
        on_time = now - self._beat_due < HEARTBEAT_INTERVAL
        if silent > self.scheduler_timeout and on_time:
            logger.warning("the scheduler at %s has not answered for %.1f s",
                           self.address, silent)
            comm.abort()  # the read loop fails what is pending
            return
        with contextlib.suppress(CommClosedError):
            comm.send({"op": "heartbeat"})
        self._beat_due = now + HEARTBEAT_INTERVAL
        self.loop.call_later(HEARTBEAT_INTERVAL, self._heartbeat)

    # ------------------------------------------------------------ the outbox

    def on_loop(self) -> bool:
        """Whether the caller runs on the client's loop thread."""
        return threading.get_ident() == self.loop_thread_id

    def post(self, item) -> None:
        """Queue a message (dict) or a reference to drop (`KeyState`), from any thread.

        The loop drains the outbox in order; it is woken once per drain, not per item.
        """
        self._outbox.append(item)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            if self.on_loop():
                self.loop.call_soon(self.drain)
            else:
                self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        """Send what the outbox holds, in order; each run of consecutive key states goes
        to ``release`` at once (so that their released keys share messages).

        A dask graph's turn (`GraphTurn`) stops the draining: its slices go out next,
        and the rest of the outbox after them (`end_turn`).
        """
        self._drain_scheduled = False
        outbox = self._outbox
        while outbox:
            item = outbox[0]
            if type(item) is GraphTurn:
                item.reached()
                return
            if type(item) is WrittenMark:
                outbox.popleft()
                self._set_when_written(item.event)
                continue
            if type(item) is KeyState:
                run = []
                while outbox and type(outbox[0]) is KeyState:
                    run.append(outbox.popleft())
                self._release(run)
                continue
            outbox.popleft()
            self.send_now(item)

    def mark_written(self) -> WrittenMark:
        """Post a `WrittenMark` (any thread): a caller that sends much (``Client.map``)
        waits on one to stay a batch or two ahead of the socket, not the whole job."""
        mark = WrittenMark()
        self.post(mark)
        return mark

    def _set_when_written(self, event: threading.Event) -> None:
        comm = self.comm
        written = None if comm is None or comm.closed else comm.flush_now()
        if written is None or written.done():
            event.set()
        else:  # its future also settles if the stream closes
            written.add_done_callback(lambda _: event.set())

    def send_now(self, msg: dict) -> None:
        """Send at once, past the outbox (a graph's slices while it has the turn)."""
        comm = self.comm
        if comm is not None and not comm.closed:
            comm.send(msg)

    def send_in_order(self, msg: dict) -> None:
        """Send from the loop thread, after everything queued before it: through the
        outbox, so that nothing overtakes a dask graph still going out in slices."""
        self._outbox.append(msg)
        self.drain()

    def take_turn(self) -> GraphTurn:
        """A graph's place in the outbox, queued now (any thread)."""
        turn = GraphTurn()
        self.post(turn)
        return turn

    def end_turn(self, turn: GraphTurn) -> None:
        """On the loop: the graph is sent (or given up); what was queued after it goes."""
        with contextlib.suppress(ValueError):  # (gone if the client was closed)
            self._outbox.remove(turn)
        self.drain()

    # ------------------------------------------------------------ requests and replies

    def next_reqid(self) -> int:
        """A fresh request id (for messages whose answer is matched by it)."""
        return next(self._reqids)

    async def request(self, op: str, on_abandon: Callable | None, fields: dict):
        """Send a request in order and wait for its ``reply``.

        With ``on_abandon`` (requests the scheduler may park: coordination primitives), a
        caller that stops waiting (cancelled, interrupted) makes the client send
        ``abandon-request`` and, once the reply comes anyway, call
        ``on_abandon(result)`` to undo what it granted (a lock acquired meanwhile)."""
        reqid = next(self._reqids)
        reply = self.loop.create_future()
        self._replies[reqid] = reply
        abandoned = False
        try:
            self.send_in_order({"op": op, "reqid": reqid, **fields})
            if on_abandon is None:
                return await reply
            return await asyncio.shield(reply)
        except asyncio.CancelledError:
            if on_abandon is not None:
                abandoned = True
                if not reply.done():
                    self.send_in_order({"op": "abandon-request", "reqid": reqid})
                reply.add_done_callback(functools.partial(_undo_abandoned, on_abandon))
            raise
        finally:
            if not abandoned:
                self._replies.pop(reqid, None)

    def ping(self) -> asyncio.Future:
        """An empty who-has request, sent now; its reply says the scheduler has handled
        everything sent before it."""
        reqid = next(self._reqids)
        reply = self.loop.create_future()
        self._replies[reqid] = reply
        self.send_now({"op": "who-has", "reqid": reqid, "keys": []})
        return reply

    def fail_requests(self, error: Callable[[], BaseException]) -> None:
        """Every request still waiting raises ``error()`` (the connection is gone)."""
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(error())
        self._replies.clear()

    # ------------------------------------------------------------ messages from the scheduler

    async def _read_loop(self, comm: Comm) -> None:
        handlers = self._handlers
        try:
            while True:
                msgs = await comm.read()
                self._last_heard = self.loop.time()
                for msg in msgs:
                    handler = handlers.get(msg["op"])
                    if handler is None:
                        logger.warning("unknown message from the scheduler: %.200r", msg)
                        continue
                    try:
                        handler(msg)
                    except Exception:
                        logger.exception("cannot handle %.200r", msg)
                del msgs  # not kept alive while waiting for the next frame
        except CommClosedError as e:
            self._on_lost(e)

    def _handle_reply(self, msg: dict) -> None:
        reply = self._replies.pop(msg["reqid"], None)
        if reply is None or reply.done():
            return
        if "error" in msg:
            reply.set_exception(SchedulerError(msg["error"]))
        else:
            reply.set_result(msg.get("result"))

    def _handle_error(self, msg: dict) -> None:
        """The scheduler refused one of our messages; it changed nothing."""
        logger.warning("the scheduler refused a %r message: %s", msg.get("request"),
                       msg.get("error"))
