"""How a client hands dask graphs to the scheduler: `Client.compute`, `persist` and `get`.

`distributed_server.client.dask_graphs` turns what dask gives a scheduler into task dicts
(materialize, order, plan, pickle in slices); this module is the client's side of it.
`GraphSender`, one per client:

- builds the futures of a graph's wanted keys, cutting the graph at keys the client
  holds already (`graph_futures`);
- sends the planned graph slice by slice (`send_plan`) from its turn in the client's
  ordered outbox (`scheduler_comm.GraphTurn`), so nothing queued after the graph (a cancel,
  a release) overtakes it: a sync client waits until it is sent, an asynchronous one
  sends it in the background (`sending` holds those sends);
- is the dask scheduler function that `compute` and `persist` hand to dask
  (`_futures_scheduler`), and `get` with or without dask (a dict graph of legacy
  ``(func, *args)`` tuples, `task_specs.LegacyGraph`).

What it uses of its client: the key table, through the client's delegates to its
`KeyTable` (`Client._hold_graph`, `_hold_present`, `_release_later`,
`_release_temporary`, `_register`), the connection
(``client._conn``: `take_turn`, `send_now`, `ping`, `end_turn`), ``client._refusals``
(graph-refused messages seen), `_check_running`, and the loop (`_loop`, `_on_loop`,
`_sync`, `_gather`, `gather`).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time

from . import dask_graphs
from .futures import FINISHED, PENDING, GraphRefusedError, SchedulerConnectionError
from .scheduler_comm import GraphTurn, log_background_failure
from .task_specs import LegacyGraph, flatten_keys, wire_spec

__all__ = ["GraphSender"]

#: Slices of a graph sent and not yet answered at most: the next one goes while the
#: scheduler takes in the previous one.
SLICES_IN_FLIGHT = 2

logger = logging.getLogger("distributed_server.client")


class GraphSender:
    """Submits one client's dask graphs (see the module's text)."""

    def __init__(self, client) -> None:
        self.client = client
        #: The background sends of an asynchronous client (the loop keeps only weak
        #: references to tasks); primitives wait for them before a value naming keys.
        self.sending: set = set()

    # ------------------------------------------------------------ compute, persist, get

    def compute(self, collections, sync: bool, optimize_graph: bool, options: dict):
        """`Client.compute` with its task options."""
        dask = dask_graphs.require_dask()
        singleton = not isinstance(collections, (list, tuple, set, frozenset))
        items = [collections] if singleton else list(collections)
        scheduler = functools.partial(_futures_scheduler, self, options)
        with dask_graphs.gc_paused():  # resumed once dask has let go of the graph (`submit`)
            futures = list(dask.compute(*items, scheduler=scheduler,
                                        optimize_graph=optimize_graph))
        result = futures[0] if singleton else futures
        return self.client.gather(result) if sync else result

    def persist(self, collections, optimize_graph: bool, options: dict):
        """`Client.persist` with its task options."""
        dask = dask_graphs.require_dask()
        singleton = not isinstance(collections, (list, tuple, set, frozenset))
        items = [collections] if singleton else list(collections)
        scheduler = functools.partial(_futures_scheduler, self, options)
        with dask_graphs.gc_paused():  # resumed once dask has let go of the graph (`submit`)
            persisted = list(dask.persist(*items, scheduler=scheduler,
                                          optimize_graph=optimize_graph))
        return persisted[0] if singleton else persisted

    def get(self, dsk, keys, options: dict):
        """`Client.get` with its task options."""
        client = self.client
        if not dask_graphs.dask_available():
            if not isinstance(dsk, dict):
                raise ImportError(dask_graphs.DASK_REQUIRED)
            return self._get_legacy(dsk, keys, options)
        futures, submission = self.graph_futures(dsk, keys, options)
        return client._sync(self._send_then_gather, submission, futures)

    def _get_legacy(self, graph: dict, keys, options: dict):
        """`get` without dask: a dict graph of legacy tuples converted by LegacyGraph."""
        client = self.client
        wanted = flatten_keys(keys)
        unknown = [k for k in wanted if k not in graph]
        if unknown:
            raise KeyError(f"keys not in the graph: {unknown[:5]!r}")
        futures = client._register(LegacyGraph(graph).tasks(options), wanted)
        by_key = dict(zip(wanted, futures))
        return client._sync(client._gather, _keys_to_futures(keys, by_key), "raise")

    def submit(self, dsk, keys, options: dict) -> list:
        """Futures for ``keys`` (a flat list) of a dask graph; sends the graph (in the
        background for an asynchronous client).

        The collector is paused from the graph's first object to its last slice; from
        `compute` and `persist`, until dask returns. Resumed while dask still held the
        graph it optimized, the collector's first pass walked all of its objects (a
        third of a second for 133,000 fused dask.array tasks); once dask has let go of
        it, they are freed by their reference counts and that pass finds little."""
        client = self.client
        with dask_graphs.gc_paused():  # from the graph's first object to its last slice
            futures, submission = self.graph_futures(dsk, keys, options)
            if submission is not None:
                if client.asynchronous:
                    self._send_in_background(submission)
                else:
                    turn = client._conn.take_turn()
                    client._sync(self.send_plan, *submission, turn)
        return futures

    # ------------------------------------------------------------ planning and sending

    def graph_futures(self, dsk, keys, options: dict) -> tuple:
        """Materialize, order and plan a dask graph for ``keys``.

        Returns ``(futures shaped like keys, submission or None)``; the submission,
        ``(plan, holds, new states)``, is for `send_plan`. Keys this client holds already
        are not sent again and the graph is cut there. Held keys the graph depends on
        are held (``holds``) until it is sent, so nothing releases them meanwhile.
        """
        client = self.client
        with dask_graphs.gc_paused():
            graph = dask_graphs.materialize(dsk)
        keys = dask_graphs.plain_keys(keys)  # as the graph's (numpy scalars made plain)
        wanted = list(dict.fromkeys(flatten_keys(keys)))
        by_key, new, known, created, first_holds = client._hold_graph(graph.nodes, wanted)
        futures = _keys_to_futures(keys, by_key)
        try:
            if not new:
                return futures, None
            with dask_graphs.gc_paused():
                plan = dask_graphs.GraphPlan(graph, new, known, options, wire=wire_spec)
            holds = client._hold_present(plan.external)
        finally:
            for state in first_holds:
                client._release_later(state)
        return futures, (plan, holds, created)

    async def _send_then_gather(self, submission, futures):
        client = self.client
        if submission is not None:
            await self.send_plan(*submission, client._conn.take_turn())
        return await client._gather(futures, "raise")

    def _send_in_background(self, submission) -> None:
        client = self.client
        turn = client._conn.take_turn()  # its place: before anything sent after compute()
        coro = self.send_plan(*submission, turn)
        if client._on_loop():
            task = client._loop.create_task(coro)
        else:
            task = asyncio.run_coroutine_threadsafe(coro, client._loop)
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)
        task.add_done_callback(log_background_failure)

    async def send_plan(self, plan, holds: list, created: list, turn: GraphTurn) -> None:
        """Send a planned dask graph: slice by slice, one update-graph at a time.

        The next slice is pickled while the scheduler takes in the previous one; a
        ``who-has`` request after each slice paces the sending: at most
        `SLICES_IN_FLIGHT` slices are unanswered, so the scheduler serves heartbeats and
        other clients in between, and it never waits for the client's next slice while
        the client waits for its answer. Slice sizes follow the time from sending a
        slice to that answer (over the slices in flight; it covers pickling the next
        one), aiming at `dask_graphs.SLICE_SECONDS`. Frontier
        keys are wanted only until their last dependent is sent
        (`dask_graphs.SlicePart`). A failure (a slice that cannot be
        pickled, a refused slice, a lost connection) fails the new keys and leaves
        nothing of the graph on the scheduler (`_give_up`).

        The automatic garbage collector stays paused until the last slice is sent
        (`dask_graphs.gc_paused`): resumed between slices, it walked the graph's
        objects again and again (about a fifth of our CPU for the graph's intake).
        """
        with dask_graphs.gc_paused():
            await self._send_slices(plan, holds, created, turn)

    async def _send_slices(self, plan, holds: list, created: list, turn: GraphTurn) -> None:
        client = self.client
        conn = client._conn
        temporary: set = set()
        sent: set = set()  # keys sent so far (wanted, or frontier)
        n_tasks_sent = 0
        try:
            await turn.wait(client._loop)  # what was queued before this graph goes first
            refusals = client._refusals
            acks: collections.deque = collections.deque()  # (reply, sent at, tasks)
            part = _encode(plan)

            async def taken_in(room: int) -> None:
                """Wait until at most ``room`` slices are unanswered; raise if the
                scheduler refused any slice answered by then."""
                while len(acks) > room:
                    ack, sent_at, n_sent = acks.popleft()
                    await ack
                    taken = time.monotonic() - sent_at
                    logger.debug("graph slice of %d tasks taken in by the scheduler "
                                 "in %.1f ms", n_sent, 1e3 * taken)
                    plan.adapt(n_sent, taken / SLICES_IN_FLIGHT)
                if client._refusals != refusals:
                    raise GraphRefusedError("the scheduler refused part of the graph; "
                                            "the rest was not sent or was released")

            while True:
                await taken_in(SLICES_IN_FLIGHT - 1)
                client._check_running()
                conn.send_now(part.message())
                sent_at, n_sent = time.monotonic(), part.n_tasks
                sent.update(part.keys)
                n_tasks_sent += n_sent
                temporary.update(part.temporary)
                if part.release:
                    temporary.difference_update(part.release)
                    client._release_temporary(part.release)
                if plan.done:
                    break
                acks.append((conn.ping(), sent_at, n_sent))
                part = _encode(plan)  # while the scheduler takes it in
            if n_tasks_sent > n_sent:  # more than one slice: any refused one fails all
                acks.append((conn.ping(), sent_at, n_sent))
                await taken_in(0)
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else SchedulerConnectionError(
                f"sending the graph was interrupted: {exc!r}")
            _give_up(client, created, sent, error, n_tasks_sent, len(plan.sequence))
            raise
        finally:
            if temporary:
                client._release_temporary(temporary)
            conn.end_turn(turn)  # at the head: the rest may go now
            for state in holds:
                client._release_later(state)


def _encode(plan):
    """The next slice of ``plan``, pickled right here on the loop while the scheduler
    takes in the previous one (in its own process).

    Not in a thread: it was no faster (on a small machine the workers, already running
    the first slices, compete for the same cores) and two busy threads share the GIL
    badly. The loop is busy for at most about one slice's time.
    """
    return plan.encode_next()


def _give_up(client, created: list, sent: set, error: BaseException, n_sent: int,
             n_tasks: int) -> None:
    """Sending a graph failed part way: all its new keys fail with ``error``, those of
    earlier slices that finished meanwhile too (the graph is all or nothing), and are
    no longer tracked (a result arriving later cannot turn a failed future into a
    finished one); the scheduler is told to release those it had received. Frontier
    keys are released by the caller."""
    released = []
    for state in created:
        if state.status in (PENDING, FINISHED):  # (finished: from an earlier slice)
            state.fail(functools.partial(_same_error, error), None)
            if client._detach(state) and state.key in sent:
                released.append(state.key)
    if released:
        client._release_temporary(released)
    if n_sent and isinstance(error, Exception) and hasattr(error, "add_note"):  # 3.11+
        error.add_note(f"distributed-core: sending the graph failed after {n_sent:,} of "
                       f"{n_tasks:,} tasks had gone to the scheduler; those were "
                       f"released, and every future of the graph fails with this error")


def _futures_scheduler(sender: GraphSender, options: dict, dsk, keys, **kwargs) -> list:
    """A dask scheduler function that returns the keys' futures instead of their values
    (what `Client.compute` and `Client.persist` hand to ``dask.compute``/``dask.persist``;
    a partial of it has no ``__self__``, so dask does not take it for a client)."""
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
    return sender.submit(dsk, keys, options)


def _keys_to_futures(keys, by_key: dict):
    if type(keys) is list:
        return [_keys_to_futures(k, by_key) for k in keys]
    return by_key[keys]


def _same_error(error: BaseException) -> BaseException:
    return error
