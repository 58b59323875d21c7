"""A client's messages about keys it already submitted: ``release-keys``,
``desire-keys``, ``cancel``, ``retry``, ``who-has``, ``has-what`` and
``fire-and-forget`` (`OPS`).

`ClientKeyRequests` turns each into one stimulus of the `Scheduler`'s state machine (or
a reply read from it). A huge release or cancel (over ``slice_keys`` keys) is checked
whole first, so a bad key refuses all of it as a single stimulus would, then applied one
slice per stimulus with every other peer served in between. Fire-and-forget keys are
wanted by the pseudo-client `FIRE_AND_FORGET` until each is done, whatever their clients
do meanwhile.
"""
from __future__ import annotations

import asyncio
import logging

from distributed_core import InvalidStimulus

from .streams import checked_keys, require

__all__ = ["FIRE_AND_FORGET", "OPS", "ClientKeyRequests"]

logger = logging.getLogger("distributed_server.scheduler")

#: The client messages this module handles.
OPS = ("release-keys", "desire-keys", "cancel", "retry", "who-has", "has-what",
       "fire-and-forget")
#: The client id under which the scheduler wants fire-and-forget keys until they are
#: done; not printable, so no real client can take it.
FIRE_AND_FORGET = "fire-and-forget\t"


class ClientKeyRequests:
    """Handles a `Scheduler`'s clients' messages about their keys (`OPS`)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self._handlers = {"release-keys": self._release_keys, "desire-keys": self._desire_keys,
                          "cancel": self._cancel, "retry": self._retry,
                          "who-has": self._who_has, "has-what": self._has_what,
                          "fire-and-forget": self._fire_and_forget}

    def handle(self, client_id: str, msg: dict):
        """Handle one message (`OPS`); an awaitable comes back for a huge release or
        cancel, handled in slices (the client's batch waits for it)."""
        return self._handlers[msg["op"]](client_id, msg)

    def _release_keys(self, client_id: str, msg: dict):
        scheduler = self.scheduler
        keys = msg.get("keys")
        if type(keys) not in (list, tuple) or len(keys) <= scheduler.slice_keys:
            scheduler.stimulus(client_id, "release-keys", scheduler.state.client_releases_keys,
                                client_id, keys)
            return None
        return self._release_keys_in_slices(client_id, keys)

    async def _release_keys_in_slices(self, client_id: str, keys) -> None:
        """A huge release, one stimulus per slice with a turn for everyone in between.

        Every key is checked first, so a bad key refuses the whole message as a single
        stimulus would."""
        scheduler = self.scheduler
        try:
            hash(tuple(keys))
        except TypeError:
            scheduler.reply_error(client_id, "release-keys",
                                   ValueError("keys must be hashable"))
            logger.warning("refused 'release-keys' from %s (%s): unhashable keys", client_id,
                           scheduler.sid("release-keys"))
            return
        size = scheduler.slice_keys
        for i in range(0, len(keys), size):
            scheduler.stimulus(client_id, "release-keys", scheduler.state.client_releases_keys,
                                client_id, keys[i:i + size])
            await asyncio.sleep(0)

    def _desire_keys(self, client_id: str, msg: dict) -> None:
        scheduler = self.scheduler
        scheduler.stimulus(client_id, "desire-keys", scheduler.state.client_desires_keys,
                            client_id, msg.get("keys"))

    def _cancel(self, client_id: str, msg: dict):
        """The core's cancel; its answer to the canceller carries the request's ``reqid``
        so the client tells it from a cancel by someone else (``force``)."""
        scheduler = self.scheduler
        reqid = msg.get("reqid")
        require(reqid is None or type(reqid) is int, "cancel: reqid must be an int")
        force = msg.get("force", False) is True
        keys = msg.get("keys")
        if type(keys) in (list, tuple) and len(keys) > scheduler.slice_keys:
            return self._cancel_in_slices(client_id, keys, force, reqid)
        if scheduler.stimulus(client_id, "cancel", self._tagged_cancel(client_id, reqid),
                               client_id, keys, force=force) \
                and force and scheduler.coordination.held:
            # the pseudo-client's wants may be gone too
            scheduler.coordination_service.keys_lost()
        return None

    def _tagged_cancel(self, client_id: str, reqid, answer: bool = True):
        """The core's cancel, its answer to ``client_id`` tagged with ``reqid``; without
        ``answer`` that answer is dropped (the canceller applied the cancel itself and
        waits for one answer, the last slice's)."""
        state = self.scheduler.state

        def cancel(*args, **kwargs):
            client_msgs, worker_msgs = state.cancel(*args, **kwargs)
            if not answer:
                mine = [m for m in client_msgs.get(client_id, ())
                        if m.get("op") != "cancelled-keys"]
                if mine:
                    client_msgs[client_id] = mine
                else:
                    client_msgs.pop(client_id, None)
            elif reqid is not None:
                for reply in client_msgs.get(client_id, ()):
                    if reply.get("op") == "cancelled-keys":
                        reply["reqid"] = reqid
            return client_msgs, worker_msgs
        return cancel

    async def _cancel_in_slices(self, client_id: str, keys, force: bool, reqid) -> None:
        """A huge cancel, checked whole (a bad key refuses all of it), then one stimulus
        per slice with a turn for everyone in between."""
        scheduler = self.scheduler
        try:
            scheduler.state.check_cancel(client_id, keys, force)
        except InvalidStimulus as exc:
            logger.warning("refused 'cancel' from %s (%s): %s", client_id,
                           scheduler.sid("cancel"), exc)
            scheduler.reply_error(client_id, "cancel", exc)
            return
        size = scheduler.slice_keys
        for i in range(0, len(keys), size):
            last = i + size >= len(keys)
            if not scheduler.stimulus(client_id, "cancel",
                                       self._tagged_cancel(client_id, reqid, answer=last),
                                       client_id, keys[i:i + size], force=force):
                return
            if not last:
                await asyncio.sleep(0)
        if force and scheduler.coordination.held:
            scheduler.coordination_service.keys_lost()

    def _retry(self, client_id: str, msg: dict) -> None:
        scheduler = self.scheduler
        scheduler.stimulus(client_id, "retry", scheduler.state.retry, client_id,
                            msg.get("keys"))

    def _who_has(self, client_id: str, msg: dict) -> None:
        scheduler = self.scheduler
        scheduler.reply(client_id, msg, scheduler.state.who_has(checked_keys(msg)))

    def _has_what(self, client_id: str, msg: dict) -> None:
        state = self.scheduler.state
        workers = msg.get("workers")
        if workers is None:
            workers = list(state.workers)
        require(type(workers) in (list, tuple) and all(type(w) is str for w in workers),
                "has-what: workers must be a list of addresses")
        result = {}
        for address in workers:
            ws = state.workers.get(address)
            result[address] = [ts.key for ts in ws.has_what] if ws is not None else []
        self.scheduler.reply(client_id, msg, result)

    def _fire_and_forget(self, client_id: str, msg: dict) -> None:
        """Keep the keys wanted (by `FIRE_AND_FORGET`) until each is done, whatever
        their clients do meanwhile."""
        scheduler = self.scheduler
        scheduler.stimulus(client_id, "fire-and-forget", scheduler.state.client_desires_keys,
                            FIRE_AND_FORGET, checked_keys(msg))

    def fired_and_done(self, msgs: list) -> None:
        """The core told `FIRE_AND_FORGET` that keys are done (``msgs``, its messages to
        that pseudo-client): it stops wanting them (in a stimulus of its own, after the
        current one)."""
        done = [msg["key"] for msg in msgs if msg.get("op") in ("key-in-memory", "task-erred")]
        if done:
            scheduler = self.scheduler
            asyncio.get_running_loop().call_soon(
                scheduler.stimulus, FIRE_AND_FORGET, "fire-and-forget-done",
                scheduler.state.client_releases_keys, FIRE_AND_FORGET, done)
