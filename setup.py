"""Build the distributed_core extensions, each from its one .pyx source: _core (the
scheduler's state machine) and _worker_core (a worker's); and three small extensions of
the shell, which the interpreted install goes without: distributed_server.diagnostics.
pool_pages (C: gives the small-object allocator's empty pools back to the OS after a big
release), distributed_server.client._part_writer (Cython: writes a slice of a dask
graph's nodes as one pickle without the pickler's Python callbacks) and
distributed_server.client.lean_order (Cython's pure-Python mode, so the same .py runs
interpreted: orders a big dask graph in flat arrays).

DISTRIBUTED_CORE_PURE=1              build no extension (the interpreted fallback)
DISTRIBUTED_CORE_REQUIRE_COMPILED=1  a failed compile of any extension fails the
                                     install instead of silently installing the slow
                                     variant
"""
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _flag(name):
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


PURE = _flag("DISTRIBUTED_CORE_PURE")
REQUIRE = _flag("DISTRIBUTED_CORE_REQUIRE_COMPILED")

if PURE and REQUIRE:
    sys.exit("DISTRIBUTED_CORE_PURE and DISTRIBUTED_CORE_REQUIRE_COMPILED contradict each other")


class OptionalBuildExt(build_ext):
    """Turn a failed compile into a pure install, unless the compiled core is required."""

    def run(self):
        try:
            super().run()
        except Exception as exc:
            self._fallback(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._fallback(exc)

    def _fallback(self, exc):
        if REQUIRE:
            raise
        print(f"WARNING: distributed_core extension not built ({exc}); "
              "installing the interpreted core", file=sys.stderr)


def _extensions():
    if PURE:
        return []
    pool_pages = Extension("distributed_server.diagnostics.pool_pages",
                           ["distributed_server/diagnostics/pool_pages.c"])
    try:
        from Cython.Build import cythonize
    except ImportError:
        if REQUIRE:
            raise
        print("WARNING: Cython is not installed; installing the interpreted core",
              file=sys.stderr)
        return [pool_pages]
    return cythonize(
        ["distributed_core/_core.pyx", "distributed_core/_worker_core.pyx",
         "distributed_server/client/_part_writer.pyx",
         "distributed_server/client/lean_order.py"],
        compiler_directives={"language_level": 3},
    ) + [pool_pages]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
