"""The client's key table: the one owner of its key states and their reference counts.

What this module does
---------------------
- `KeyTable` holds one `KeyState` per key the client holds (``states``), counted by
  reference under ``lock``: a `Future` is one reference, and so is a hold a dask graph
  being sent takes meanwhile. It takes references (`hold`, `register`, `hold_graph`,
  `hold_present`, `hold_all`) and drops them (`release_later` from any thread, then
  `release` on the loop as the outbox drains, in its order: a run of dropped references
  sends its released keys in ``release-keys`` messages of at most `RELEASE_BATCH_KEYS`
  keys each).
- It handles the scheduler's messages about keys (`handlers`: ``key-in-memory``,
  ``task-erred``, ``cancelled-keys``, ``graph-refused``) and the client's own ``cancel``
  and ``retry``, and fails what is pending when the connection is gone (`fail`).

Threads
-------
Every change of a key's status happens on the loop thread. Other threads only create
key states and take references (under ``lock``) and post to the outbox; `release_later`
never blocks and never takes the lock (``Future.__del__`` calls it).

The client (`distributed_server.client.client.Client`) delegates to it; this module never
imports the client: it is handed how to check that the client runs, and its outbox.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from ..protocol.serialize import loads_error
from .futures import PENDING, GraphRefusedError, KeyState, TaskFailedError
from .scheduler_comm import SchedulerComm

__all__ = ["RELEASE_BATCH_KEYS", "KeyTable", "task_error"]

#: Keys per release-keys message at most: a release of a million futures goes as many
#: small messages, which the scheduler handles in turns with everyone else's.
RELEASE_BATCH_KEYS = 10_000


def task_error(exception, traceback, text: str) -> BaseException:
    """The exception of a ``task-erred`` message (a core-made one has no pickle)."""
    if exception is None:
        return TaskFailedError(text)
    return loads_error(exception, traceback, text)


class KeyTable:
    """The key states of one client and their reference counts.

    ``check_running()`` raises unless the client is running (it is called under
    ``lock``, so that holding a key and closing the client do not interleave);
    ``is_running()`` says whether it is. ``outbox`` is the client's `SchedulerComm`,
    set once it is made (it is made with this table's `handlers`).
    """

    def __init__(self, check_running: Callable[[], None],
                 is_running: Callable[[], bool]) -> None:
        #: Guards ``states`` and every ``refs`` count; the client's status changes
        #: that must not interleave with taking a reference hold it too.
        self.lock = threading.Lock()
        #: key -> its `KeyState`, for every key held.
        self.states: dict = {}
        #: The scheduler connection's ordered outbox (`SchedulerComm`).
        self.outbox: SchedulerComm | None = None
        #: How many graph-refused messages came (a graph's slices stop at one).
        self.refusals = 0
        self._own_cancels: set = set()  # reqids of our cancels: their echoes are no news
        self._check_running = check_running
        self._is_running = is_running

    def handlers(self) -> dict:
        """The ops of the scheduler's messages about keys, and their handlers."""
        return {
            "key-in-memory": self.on_key_in_memory,
            "task-erred": self.on_task_erred,
            "cancelled-keys": self.on_cancelled_keys,
            "graph-refused": self.on_graph_refused,
        }

    # ------------------------------------------------------------ taking references

    def hold(self, key) -> KeyState:
        """A reference to ``key``'s state; the scheduler is asked about a key new here."""
        with self.lock:
            self._check_running()
            state = self.states.get(key)
            is_new = state is None
            if is_new:
                state = self.states[key] = KeyState(key)
            state.refs += 1
        if is_new:
            self.outbox.post({"op": "desire-keys", "keys": [key]})
        return state

    def register(self, tasks: list[dict], wanted: list | None = None) -> list[KeyState]:
        """A reference to the state of each ``wanted`` key (default: every task's key, in
        order).

        Keys held already are not sent again; if any wanted key is new, one update-graph
        goes out with the new wanted tasks and every task not wanted itself.
        """
        if wanted is None:
            wanted = [task["key"] for task in tasks]
        states = []
        new: dict = {}
        with self.lock:
            self._check_running()
            held = self.states
            for key in wanted:
                state = held.get(key)
                if state is None:
                    state = held[key] = new[key] = KeyState(key)
                state.refs += 1
                states.append(state)
        if new:
            self._send_graph(tasks, new, wanted)
        return states

    def _send_graph(self, tasks: list[dict], new: dict, wanted: list) -> None:
        if len(wanted) == len(tasks) and len(new) == len(tasks):
            send = tasks  # the common case: all new, no duplicates
        else:
            wanted_set = set(wanted)
            send_by_key: dict = {}
            for task in tasks:
                key = task["key"]
                if (key in new or key not in wanted_set) and key not in send_by_key:
                    send_by_key[key] = task
            send = list(send_by_key.values())
        self.outbox.post({"op": "update-graph", "tasks": send, "keys": list(new)})

    def hold_graph(self, nodes, wanted: list) -> tuple:
        """For a dask graph: a reference to the state of each of its ``wanted`` keys.

        Returns ``({key: state}, new keys, keys of the graph held already, states
        created, references taken on those held keys)``; the caller drops the last ones
        (`release_later`) once its plan holds what it needs. KeyError for a new wanted
        key that is not in the graph.
        """
        with self.lock:
            self._check_running()
            held = self.states
            new = [k for k in wanted if k not in held]
            missing = [k for k in new if k not in nodes]
            if missing:
                raise KeyError(f"keys not in the graph: {missing[:5]!r}")
            known = held.keys() & nodes.keys()
            first_holds = [held[k] for k in known]
            for state in first_holds:
                state.refs += 1
            by_key = {}
            created = []
            for key in wanted:
                state = held.get(key)
                if state is None:
                    state = held[key] = KeyState(key)
                    created.append(state)
                state.refs += 1
                by_key[key] = state
        return by_key, new, known, created, first_holds

    def hold_present(self, keys) -> list[KeyState]:
        """A reference to each of ``keys`` held already (dropped with `release_later`):
        a graph being sent needs them meanwhile."""
        with self.lock:
            held = self.states
            holds = [held[k] for k in keys if k in held]
            for state in holds:
                state.refs += 1
        return holds

    def hold_all(self, keys: list) -> list[KeyState]:
        """A reference to the state of each of ``keys``, made where new; nothing is sent
        (for keys whose data the client put on workers itself)."""
        states = []
        with self.lock:
            self._check_running()
            for key in keys:
                state = self.states.get(key)
                if state is None:
                    state = self.states[key] = KeyState(key)
                state.refs += 1
                states.append(state)
        return states

    def held_keys(self) -> list:
        """Every key held now."""
        with self.lock:
            return list(self.states)

    # ------------------------------------------------------------ dropping references

    def release_later(self, state: KeyState) -> None:
        """Drop one reference to ``state`` soon; safe in ``__del__`` (never blocks)."""
        if not self._is_running():
            return
        try:  # (not contextlib.suppress: this runs once per Future, and costs less)
            self.outbox.post(state)
        except Exception:  # noqa: BLE001, S110 - the loop is gone (e.g. at interpreter exit)
            pass

    def release(self, states: list[KeyState]) -> None:
        """On the loop, as the outbox drains: drop one reference to each of ``states``
        (consecutive in the outbox); the keys whose last reference that was are released,
        `RELEASE_BATCH_KEYS` keys per ``release-keys`` message at most."""
        send = self.outbox.send_now
        released: list = []
        for state in states:
            if self.drop_reference(state):
                released.append(state.key)
                if len(released) >= RELEASE_BATCH_KEYS:
                    send({"op": "release-keys", "keys": released})
                    released = []
        if released:
            send({"op": "release-keys", "keys": released})

    def drop_reference(self, state: KeyState) -> bool:
        """One reference to ``state`` is gone; True if it was the last and the key is
        released (its key no longer in the table)."""
        with self.lock:
            state.refs -= 1
            if state.refs > 0 or self.states.get(state.key) is not state:
                return False
            del self.states[state.key]
        return True

    def detach(self, state: KeyState) -> bool:
        """Forget ``state`` (its key is no longer wanted); False if it was not current."""
        with self.lock:
            if self.states.get(state.key) is not state:
                return False
            del self.states[state.key]
        return True

    def release_temporary(self, keys) -> None:
        """Release frontier keys the client wanted only while its graph was sent (keys it
        holds futures of meanwhile stay wanted); nothing once the client is closing."""
        if not self._is_running():
            return
        with self.lock:
            keys = [key for key in keys if key not in self.states]
        if keys:
            self.outbox.send_now({"op": "release-keys", "keys": keys})

    # ------------------------------------------------------------ the client's own changes

    def cancel(self, states: list[KeyState], force: bool) -> None:
        """On the loop: ask the scheduler to cancel these keys (for every client with
        ``force``), and cancel their states here at once."""
        reqid = self.outbox.next_reqid()
        self._own_cancels.add(reqid)
        self.outbox.send_in_order({"op": "cancel", "keys": [s.key for s in states],
                                   "force": force, "reqid": reqid})
        for state in states:
            self.detach(state)
            state.cancel()

    def retry(self, states: list[KeyState]) -> None:
        """On the loop: ask the scheduler to run these failed keys again; they are
        pending here at once."""
        self.outbox.send_in_order({"op": "retry", "keys": [s.key for s in states]})
        for state in states:
            state.reset()

    def pending(self) -> list[KeyState]:
        """The states still waiting for an answer (the caller holds ``lock``)."""
        return [s for s in self.states.values() if s.status == PENDING]

    @staticmethod
    def fail(states: list[KeyState], error: Callable[[], BaseException]) -> None:
        """Fail ``states`` with ``error()`` (the connection is gone: no answer will come)."""
        for state in states:
            state.fail(error, None)

    # ------------------------------------------------------------ messages from the scheduler

    def on_key_in_memory(self, msg: dict) -> None:
        """A key's result is ready (inline in ``data`` when small)."""
        state = self.states.get(msg["key"])
        if state is not None:
            state.finish(msg.get("data"), msg.get("type"))

    def on_task_erred(self, msg: dict) -> None:
        """A key's task failed (for good: its retries are used up)."""
        state = self.states.get(msg["key"])
        if state is None:
            return
        exception, traceback, text = msg.get("exception"), msg.get("traceback"), msg["text"]
        tb_text = bytes(traceback).decode(errors="replace") if traceback else None
        state.fail(functools.partial(task_error, exception, traceback, text), tb_text)

    def on_cancelled_keys(self, msg: dict) -> None:
        """Keys were cancelled (by another client with ``force``, or a restart)."""
        reqid = msg.get("reqid")
        if reqid is not None and reqid in self._own_cancels:
            self._own_cancels.discard(reqid)  # the answer to our own cancel: applied
            return
        reason = msg.get("reason")  # e.g. a restart
        for key in msg["keys"]:
            state = self.states.get(key)
            if state is not None and self.detach(state):
                state.cancel(reason if isinstance(reason, str) else None)

    def on_graph_refused(self, msg: dict) -> None:
        """The scheduler refused a graph: its pending keys fail with `GraphRefusedError`."""
        self.refusals += 1
        error = functools.partial(GraphRefusedError, f"the scheduler refused the graph: "
                                                     f"{msg['error']}")
        for key in msg["keys"]:
            state = self.states.get(key)
            if state is not None and state.status == PENDING and self.detach(state):
                state.fail(error, None)
