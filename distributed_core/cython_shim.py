"""The few names of the `cython` module that our sources in Cython's pure-Python syntax use
(distributed_core's _core.pyx and _worker_core.pyx, distributed_server.client.lean_order),
for running them without Cython."""
import dataclasses  # noqa: F401  (used as cython.dataclasses)

compiled = False


def _identity(obj):
    return obj


cclass = cfunc = ccall = final = inline = no_gc = _identity


def cast(type_, value):
    """``cython.cast(T, value)``: a C cast when compiled; the value itself here."""
    return value


def declare(type_=None, value=None, **kwargs):
    """``x = cython.declare(T, value)``: a typed (C) module variable when compiled."""
    return value


# C types named in ``cython.declare(T, value)``: placeholders, only the value is used.
int = ulonglong = Py_ssize_t = Py_hash_t = None  # noqa: A001


def boundscheck(flag: bool):
    """``@cython.boundscheck(False)``: no index checks when compiled; nothing here."""
    return _identity


wraparound = boundscheck  # ``@cython.wraparound(False)``: no negative indices compiled
