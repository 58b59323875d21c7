"""Published datasets as the scheduler keeps them: plain data, no I/O.

What this module does
---------------------
`DatasetStore` is the scheduler's side of ``Client.publish_dataset`` and its siblings
(`distributed_server.client.datasets`): a mapping from a name (a str) to a value, the client's
pickle as opaque bytes with the keys of the Futures inside it. It extends the
coordination primitives' state (`Coordination.extend`) instead of keeping a second
bookkeeping: a published value is a stored `Value` like a Variable's, so its Futures'
tasks stay alive (wanted by the pseudo-client ``coordination``) while it is published,
a client that gets it receives a handoff it confirms with ``value-received``, and the
limits of `CoordinationLimits` (bytes per value, total bytes, names) apply.

Ops (each with a ``reqid``; the reply's ``result`` carries a ``status``):

- ``dataset-put {datasets: [{name, value, keys}], override}``: publish them all, or
  none: ``{"status": "exists", "names": [...]}`` if some are published already and
  ``override`` is false;
- ``dataset-get {name}``: ``{"status": "ok", "value", "handoff"?}`` or ``{"status":
  "missing"}``;
- ``dataset-list``: ``{"status": "ok", "names": [...]}`` in publication order;
- ``dataset-delete {name}``: ``{"status": "ok", "deleted": bool}``.

What it never does
------------------
It never unpickles, never reads a clock, never sends: it works through the
`Coordination` it extends, whose ``handle`` returns the effects. A refused message
changes nothing: every name and value is checked before the first one is stored.
"""
from __future__ import annotations

from distributed_core import bounded_repr

from .coordination import Coordination, check_name, check_reqid, refuse, wire_value

__all__ = ["OPS", "DatasetStore"]

#: The client ops the store adds to `Coordination`.
OPS = frozenset({"dataset-put", "dataset-get", "dataset-list", "dataset-delete"})


class DatasetStore:
    """The published datasets (``values``: name -> `Value`), kept in ``coordination``."""

    def __init__(self, coordination: Coordination) -> None:
        self.coordination = coordination
        self.values: dict = {}
        coordination.extend({"dataset-put": self._put, "dataset-get": self._get,
                             "dataset-list": self._list, "dataset-delete": self._delete},
                            self.values.values)

    def _put(self, client: str, msg: dict, now: float) -> None:
        coordination = self.coordination
        reqid = check_reqid(msg)
        override = msg.get("override", False)
        if type(override) is not bool:
            refuse(f"'dataset-put': override must be a bool, not {bounded_repr(override, 60)}")
        entries = msg.get("datasets")
        limits = coordination.limits
        if type(entries) not in (list, tuple) or not 0 < len(entries) <= limits.max_names:
            refuse(f"'dataset-put': 'datasets' must be a list of 1 to {limits.max_names:,} "
                   f"datasets, not {bounded_repr(entries, 80)}")
        checked: dict = {}
        exists = []
        added = freed = 0
        for entry in entries:
            if type(entry) is not dict:
                refuse(f"'dataset-put': each dataset must be a map, not "
                       f"{bounded_repr(entry, 80)}")
            name = check_name({"op": "dataset-put", "name": entry.get("name")})
            if name in checked:
                refuse(f"'dataset-put': the name {bounded_repr(name, 80)} appears twice")
            old = self.values.get(name)
            if old is not None and not override:
                exists.append(name)
            value = coordination.checked_value({"op": "dataset-put", "value": entry.get("value"),
                                                "keys": entry.get("keys", ())})
            checked[name] = value
            added += value.nbytes
            freed += old.nbytes if old is not None else 0
        new_names = [name for name in checked if name not in self.values]
        if len(self.values) + len(new_names) > limits.max_names:
            refuse(f"the scheduler holds {len(self.values):,} datasets; {len(new_names):,} "
                   f"more would pass the most it may ({limits.max_names:,})")
        if coordination.total_bytes - freed + added > limits.max_total_bytes:
            refuse(f"'dataset-put': the scheduler already holds "
                   f"{coordination.total_bytes:,} bytes of shared values and may hold at "
                   f"most {limits.max_total_bytes:,}; these datasets ({added:,} bytes) do "
                   f"not fit")
        if exists:
            coordination.reply(client, reqid, {"status": "exists", "names": exists})
            return
        for name, value in checked.items():
            old = self.values.get(name)
            coordination.retain(value)
            self.values[name] = value
            if old is not None:
                coordination.release(old)
        coordination.reply(client, reqid, {"status": "ok"})

    def _get(self, client: str, msg: dict, now: float) -> None:
        reqid, name = check_reqid(msg), check_name(msg)
        value = self.values.get(name)
        if value is None:
            self.coordination.reply(client, reqid, {"status": "missing"})
            return
        self.coordination.check_can_receive(client)
        self.coordination.reply(client, reqid, self.coordination.hand_over(
            client, [value], {"status": "ok", "value": wire_value(value.data)}))

    def _list(self, client: str, msg: dict, now: float) -> None:
        self.coordination.reply(client, check_reqid(msg),
                                {"status": "ok", "names": list(self.values)})

    def _delete(self, client: str, msg: dict, now: float) -> None:
        reqid, name = check_reqid(msg), check_name(msg)
        old = self.values.pop(name, None)
        if old is not None:
            self.coordination.release(old)
        self.coordination.reply(client, reqid, {"status": "ok", "deleted": old is not None})
