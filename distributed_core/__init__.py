"""distributed-core's state machines: data in, messages out, no I/O.

Two of them, each in one Cython source written in Cython's pure-Python syntax:
``_core.pyx``, the scheduler's (``SchedulerState``), and ``_worker_core.pyx``, a
worker's (``WorkerCore``). Installed with a compiler each is a C extension; otherwise
(or with ``DISTRIBUTED_CORE_PURE=1`` in the environment) the same file is imported as
Python source, module by module. ``COMPILED`` is True only when both are compiled.
"""
import importlib.machinery
import importlib.util
import os
import sys

__version__ = "0.1.0"


def _pure_requested():
    return os.environ.get("DISTRIBUTED_CORE_PURE", "").strip().lower() not in (
        "", "0", "false", "no")


def _load(module_name, import_extension):
    """The C extension ``module_name`` (``import_extension()``), or its ``.pyx`` source
    run as Python."""
    if not _pure_requested():
        try:
            return import_extension()
        except ImportError:
            pass
    name = f"{__name__}.{module_name}"
    path = os.path.join(os.path.dirname(__file__), module_name + ".pyx")
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _core_extension():
    from . import _core
    return _core


def _worker_core_extension():
    from . import _worker_core
    return _worker_core


_core = _load("_core", _core_extension)
# after _core: the worker's core uses the scheduler core's exception classes
_worker_core = _load("_worker_core", _worker_core_extension)

COMPILED: bool = _core.COMPILED and _worker_core.COMPILED
#: The file the scheduler's core was loaded from: the extension module, or ``_core.pyx``.
CORE_FILE: str = _core.__file__
#: The file the worker's core was loaded from: the extension, or ``_worker_core.pyx``.
WORKER_CORE_FILE: str = _worker_core.__file__
TaskState = _core.TaskState
WorkerState = _core.WorkerState
ClientState = _core.ClientState
TaskPrefix = _core.TaskPrefix
TaskTable = _core.TaskTable
TaskSet = _core.TaskSet
SpecPart = _core.SpecPart
#: How a worker's spec that refers into a `SpecPart` begins.
SPEC_PART_PREFIX = _core.SPEC_PART_PREFIX
SchedulerState = _core.SchedulerState
InvalidTransition = _core.InvalidTransition
InvariantError = _core.InvariantError
InvalidStimulus = _core.InvalidStimulus
Unauthorized = _core.Unauthorized
GraphError = _core.GraphError
TransitionLimitExceeded = _core.TransitionLimitExceeded
bounded_repr = _core.bounded_repr
key_prefix = _core.key_prefix
TASK_STATES = _core.TASK_STATES
#: Recipients a retirement tries for one result before it gives up on it.
MAX_RECIPIENTS_PER_KEY = _core.MAX_RECIPIENTS_PER_KEY
WorkerTask = _worker_core.WorkerTask
WorkerCore = _worker_core.WorkerCore
WORKER_TASK_STATES = _worker_core.WORKER_TASK_STATES
Execute = _worker_core.Execute
Fetch = _worker_core.Fetch
SendMessage = _worker_core.SendMessage
StoreData = _worker_core.StoreData
ReleaseData = _worker_core.ReleaseData
ReportHeld = _worker_core.ReportHeld
#: What an execution came to: the kinds of ``WorkerCore.executions_done`` outcomes.
FINISHED = _worker_core.FINISHED
ERRED = _worker_core.ERRED
SKIPPED = _worker_core.SKIPPED

__all__ = [
    "COMPILED", "CORE_FILE", "WORKER_CORE_FILE", "TaskState", "WorkerState", "ClientState",
    "TaskPrefix", "TaskTable", "TaskSet", "SpecPart", "SPEC_PART_PREFIX", "SchedulerState", "InvalidTransition", "InvariantError",
    "InvalidStimulus",
    "Unauthorized", "GraphError", "TransitionLimitExceeded", "bounded_repr", "TASK_STATES",
    "key_prefix", "WorkerTask", "WorkerCore", "WORKER_TASK_STATES", "Execute", "Fetch",
    "SendMessage", "StoreData", "ReleaseData", "ReportHeld", "FINISHED", "ERRED", "SKIPPED",
    "__version__",
    "MAX_RECIPIENTS_PER_KEY",
]
