"""distributed-core's scheduler state machine: data in, messages out, no I/O.

The logic lives in one Cython source, ``_core.pyx``, written in Cython's pure-Python
syntax. Installed with a compiler it is a C extension; otherwise (or with
``DISTRIBUTED_CORE_PURE=1`` in the environment) the same file is imported as Python
source. ``COMPILED`` says which one is running.
"""
import importlib.machinery
import importlib.util
import os
import sys

__version__ = "0.1.0"


def _pure_requested():
    return os.environ.get("DISTRIBUTED_CORE_PURE", "").strip().lower() not in (
        "", "0", "false", "no")


def _load_core():
    name = __name__ + "._core"
    if not _pure_requested():
        try:
            from . import _core  # the C extension
            return _core
        except ImportError:
            pass
    path = os.path.join(os.path.dirname(__file__), "_core.pyx")
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


_core = _load_core()

COMPILED: bool = _core.COMPILED
#: The file the core was loaded from: the extension module, or ``_core.pyx``.
CORE_FILE: str = _core.__file__
TaskState = _core.TaskState
WorkerState = _core.WorkerState
ClientState = _core.ClientState
TaskPrefix = _core.TaskPrefix
SchedulerState = _core.SchedulerState
InvalidTransition = _core.InvalidTransition
InvariantError = _core.InvariantError
InvalidStimulus = _core.InvalidStimulus
Unauthorized = _core.Unauthorized
GraphError = _core.GraphError
TransitionLimitExceeded = _core.TransitionLimitExceeded
bounded_repr = _core.bounded_repr
TASK_STATES = _core.TASK_STATES

__all__ = [
    "COMPILED", "CORE_FILE", "TaskState", "WorkerState", "ClientState", "TaskPrefix", "SchedulerState",
    "InvalidTransition", "InvariantError", "InvalidStimulus", "Unauthorized", "GraphError",
    "TransitionLimitExceeded", "bounded_repr", "TASK_STATES", "__version__",
]
