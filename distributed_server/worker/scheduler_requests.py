"""The answers a worker gives to the scheduler's requests about itself (not about tasks):
``story`` (its transitions of some keys), ``logs`` (its last log lines), ``plugin-add``
and ``plugin-remove`` (a worker plugin, plugins.py). Each answer is one ``{"op": "reply",
"reqid", "result" | "error"}`` on the scheduler stream (docs/protocol.md).
"""
from __future__ import annotations

import inspect
from collections.abc import Awaitable

from .. import logs
from ..plugins import WorkerPluginHost, check_plugin_name

__all__ = ["introspection_reply", "plugin_reply"]


def introspection_reply(state, msg: dict) -> dict:
    """The answer to ``story {keys, reqid}`` (the transitions of the keys in ``state``, the
    worker core) or ``logs {n, reqid}`` (the last n log lines)."""
    reply = {"op": "reply", "reqid": msg.get("reqid")}
    try:
        if msg["op"] == "story":
            keys = msg.get("keys")
            if not isinstance(keys, (list, tuple)):
                raise ValueError("story needs a list of keys")
            hash(tuple(keys))
            reply["result"] = state.story(*keys)
        else:
            reply["result"] = logs.recent_lines(logs.check_line_count(msg.get("n")))
    except (TypeError, ValueError) as exc:
        reply["error"] = f"{type(exc).__name__}: {exc}"
    return reply


def plugin_reply(host: WorkerPluginHost, msg: dict) -> dict | Awaitable[dict]:
    """``plugin-add {name, plugin, reqid?}`` / ``plugin-remove {name, reqid?}``: install or
    remove a worker plugin on ``host`` and answer with the outcome: the reply, or an
    awaitable of it when the plugin's hooks are coroutines (a plugin whose hooks are plain
    functions is set up at once, before the tasks that follow it)."""
    reqid = msg.get("reqid")
    try:
        name = check_plugin_name(msg.get("name"))
        data = msg.get("plugin")
        if msg["op"] == "plugin-add" and not isinstance(data, (bytes, memoryview)):
            raise TypeError("plugin-add needs the plugin's pickle as bytes")
    except TypeError as exc:
        return {"op": "reply", "reqid": reqid, "error": str(exc)}
    outcome = host.add(name, data) if msg["op"] == "plugin-add" else host.remove(name)
    if not inspect.isawaitable(outcome):
        return {"op": "reply", "reqid": reqid, "result": outcome}
    return _reply_when_done(reqid, outcome)


async def _reply_when_done(reqid, outcome: Awaitable) -> dict:
    return {"op": "reply", "reqid": reqid, "result": await outcome}

