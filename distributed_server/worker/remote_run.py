"""``Client.run``: a function a client sends to run once in each worker process.

The client pickles ``(function, args, kwargs)`` with cloudpickle; the worker runs it —
a coroutine function on its event loop, any other on a thread of its own, so a slow
function never stalls the worker's transfers — and answers with the pickled result or
error. A function with a ``dask_worker`` parameter gets the `Worker` object there, as in
dask. Only client connections may ask (a client may already run any code on workers by
submitting tasks; peers and the scheduler may not).
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import pickle
import sys
import tempfile

import cloudpickle

from ..protocol.serialize import dumps_data, dumps_error, loads_data, loads_error

__all__ = ["install_file", "pack_call", "run_packed_call", "unpack_reply"]


def pack_call(function, args: tuple, kwargs: dict) -> bytes:
    """The ``run`` request's payload."""
    return cloudpickle.dumps((function, args, kwargs), protocol=5)


async def run_packed_call(payload: bytes, worker) -> dict:
    """Run a ``pack_call`` payload here: ``{"op": "run-result", "status": "OK", "result":
    frames}`` or ``{"op": "run-result", "status": "error", "exception", "traceback",
    "text"}``."""
    try:
        function, args, kwargs = pickle.loads(payload)
        if _takes_dask_worker(function):
            kwargs = {**kwargs, "dask_worker": worker}
        if inspect.iscoroutinefunction(function):
            result = await function(*args, **kwargs)
        else:
            result = await asyncio.to_thread(function, *args, **kwargs)
        return {"op": "run-result", "status": "OK", "result": dumps_data(result)}
    except Exception as exc:  # noqa: BLE001 - the caller's error travels back to it
        exception, traceback, text = dumps_error(exc)
        return {"op": "run-result", "status": "error", "exception": exception,
                "traceback": traceback, "text": text}


def unpack_reply(reply: dict):
    """The function's result from a ``run-result`` reply, or its exception (returned,
    not raised: the caller decides)."""
    if reply.get("op") != "run-result":
        return RuntimeError(f"the worker answered run with {reply.get('op')!r}")
    if reply.get("status") == "OK":
        return loads_data(reply["result"])
    return loads_error(reply.get("exception"), reply.get("traceback"), reply.get("text", ""))


def _takes_dask_worker(function) -> bool:
    try:
        return "dask_worker" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def install_file(name: str, data: bytes) -> None:
    """``Client.upload_file`` on a worker: write the file into this process's upload
    directory (on ``sys.path``) and import the module it holds, again if it was."""
    directory = _upload_directory()
    path = os.path.join(directory, os.path.basename(name))
    with open(path, "wb") as f:
        f.write(data)
    if name.endswith((".zip", ".egg", ".whl")) and path not in sys.path:
        sys.path.insert(0, path)
    module = os.path.basename(name).split(".")[0].split("-")[0]
    importlib.invalidate_caches()
    if module in sys.modules:
        importlib.reload(sys.modules[module])
    else:
        importlib.import_module(module)


def _upload_directory() -> str:
    directory = getattr(_upload_directory, "path", None)
    if directory is None:
        directory = tempfile.mkdtemp(prefix=f"dcore-uploads-{os.getpid()}-")
        sys.path.insert(0, directory)
        _upload_directory.path = directory
    return directory
