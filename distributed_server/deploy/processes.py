"""The processes a cluster manager starts on this machine: one spawner thread forks them
(so they die with this process, not with a short-lived thread), their output passes
through, the line that announces an address is read, and they are stopped together.
"""
from __future__ import annotations

import concurrent.futures
import queue
import signal
import subprocess
import sys
import threading
import time

__all__ = ["ClusterError", "die_with_parent", "pass_through", "read_address",
           "start_in_spawner", "stop_processes"]


class ClusterError(RuntimeError):
    """The cluster could not be started."""


_SPAWN_REQUESTS: queue.SimpleQueue | None = None
_SPAWNER_LOCK = threading.Lock()


def start_in_spawner(popen) -> subprocess.Popen:
    """``popen()`` on the one daemon thread that starts this process's cluster
    processes. Linux sends the parent-death signal when the *thread* that forked the
    child exits, so a child started from a short-lived thread (``cluster.scale`` called
    from one) would die with it; the spawner lives until the process exits (a daemon
    thread: not joined, not stopped before the cluster's own shutdown)."""
    global _SPAWN_REQUESTS
    with _SPAWNER_LOCK:
        if _SPAWN_REQUESTS is None:
            _SPAWN_REQUESTS = queue.SimpleQueue()
            threading.Thread(target=_spawn_forever, args=(_SPAWN_REQUESTS,), daemon=True,
                             name="distributed-core-spawner").start()
    done = concurrent.futures.Future()
    _SPAWN_REQUESTS.put((popen, done))
    return done.result()


def _spawn_forever(requests: queue.SimpleQueue) -> None:
    while True:
        popen, done = requests.get()
        try:
            done.set_result(popen())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            done.set_exception(exc)


def die_with_parent() -> None:
    """In the child, before exec: ask Linux to send SIGTERM when the parent dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; close() still stops the child
        pass


def pass_through(proc: subprocess.Popen, keep: tuple | str | None,
                  quiet: tuple) -> queue.Queue:
    """Copy a child's stdout to ours in a thread, line by line, as long as it runs (so it
    never blocks on a full pipe), keeping nothing: lines starting with ``keep`` go to the
    returned queue instead (the scheduler's address), lines starting with one of
    ``quiet`` are dropped, and None marks the end of the output."""
    lines: queue.Queue = queue.Queue()

    def pump():
        try:
            for line in proc.stdout:
                if keep is not None and line.startswith(keep):
                    lines.put(line)
                elif not line.startswith(quiet):
                    out = sys.stdout
                    if out is not None:
                        try:
                            out.write(line)
                            out.flush()
                        except (OSError, ValueError):  # our stdout is closed: drop it
                            pass
        finally:
            lines.put(None)

    threading.Thread(target=pump, daemon=True, name="distributed-core-stdout").start()
    return lines


def read_address(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = proc.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            raise ClusterError(f"no '{prefix}' line from {proc.args} within {timeout}s") \
                from None
        if line is None:
            raise ClusterError(f"{proc.args} exited (code {proc.wait()}) before starting")
        if line.startswith(prefix):
            return line[len(prefix):].split()[0]


def stop_processes(procs: list, timeout: float = 10.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    procs.clear()
