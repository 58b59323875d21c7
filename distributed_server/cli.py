"""The ``dcore`` command: run a scheduler, a worker, or the demo; print the version.

    dcore scheduler [--host HOST] [--port PORT]
    dcore worker tcp://SCHEDULER:PORT [--nthreads N] [--name NAME] [--resources GPU=1,MEM=4e9]
    dcore demo [--workers N] [--threads N] [--tasks N]
    dcore --version
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import socket
import sys

import distributed_core

from .comm import parse_address


def main(argv: list | None = None) -> int:
    """Entry point of the ``dcore`` console script."""
    args = _parser().parse_args(argv)
    if args.version:
        print(version_text())
        return 0
    if args.command is None:
        _parser().print_help()
        return 2
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "scheduler":
        return asyncio.run(_run_scheduler(args))
    if args.command == "worker":
        return asyncio.run(_run_worker(args))
    from .demo import run_demo

    return run_demo(n_workers=args.workers, threads_per_worker=args.threads,
                    n_tasks=args.tasks)


def version_text() -> str:
    """The version line: package version and which core is loaded."""
    kind = "compiled" if distributed_core.COMPILED else "interpreted"
    return (f"distributed-core {distributed_core.__version__} (core {kind}: "
            f"{distributed_core.CORE_FILE})")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcore", description="distributed-core: a "
                                     "distributed task scheduler with a compiled core")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command")

    scheduler = commands.add_parser("scheduler", help="run a scheduler")
    scheduler.add_argument("--host", default="127.0.0.1",
                           help="interface to listen on (0.0.0.0 for every interface)")
    scheduler.add_argument("--port", type=int, default=8786)
    scheduler.add_argument("--worker-ttl", type=float, default=30.0,
                           help="seconds of silence after which a worker is removed")
    scheduler.add_argument("--worker-saturation", type=float, default=1.1,
                           help="tasks per thread before root tasks queue (inf: no queue)")
    scheduler.add_argument("--validate", action="store_true",
                           help="check every invariant after each stimulus (slow)")
    scheduler.add_argument("--log-level", default="INFO")

    worker = commands.add_parser("worker", help="run a worker")
    worker.add_argument("address", help="the scheduler, e.g. tcp://10.0.0.5:8786")
    worker.add_argument("--nthreads", type=int, default=1)
    worker.add_argument("--name", default=None)
    worker.add_argument("--resources", default="", type=_resources,
                        help="abstract resources, e.g. GPU=1,MEM=4e9")
    worker.add_argument("--host", default=None,
                        help="interface to listen on for peers (default: the one that "
                             "reaches the scheduler)")
    worker.add_argument("--port", type=int, default=0)
    worker.add_argument("--log-level", default="INFO")

    demo = commands.add_parser("demo", help="run a graph on a local cluster and report")
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--threads", type=int, default=1)
    demo.add_argument("--tasks", type=int, default=5000,
                      help="leaves of the graph (about twice as many tasks in all)")
    return parser


def _resources(text: str) -> dict:
    resources = {}
    for item in filter(None, text.split(",")):
        name, sep, quantity = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"resource {item!r} is not NAME=QUANTITY")
        try:
            resources[name.strip()] = float(quantity)
        except ValueError:
            raise argparse.ArgumentTypeError(f"resource {item!r}: bad quantity") from None
    return resources


def _listen_host_for(scheduler_address: str) -> str:
    """The local interface that reaches the scheduler (no packet is sent)."""
    _, host, port = parse_address(scheduler_address)
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return probe.getsockname()[0]
        except OSError:
            return "0.0.0.0"


def _tune_gc_for_a_server() -> None:
    """The scheduler process allocates a few short-lived objects per message; the default
    threshold (700) runs a collection every few hundred tasks. Collect far less often, and
    never walk what existed at start-up (measured: about 18% less scheduler CPU per task,
    benchmarks/e2e.py)."""
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)


async def _serve_until_signal(server) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: loop.create_task(server.close()))
    await server.finished()


async def _run_scheduler(args) -> int:
    from .scheduler import Scheduler

    scheduler = Scheduler(args.host, args.port, worker_ttl=args.worker_ttl,
                          validate=args.validate, worker_saturation=args.worker_saturation)
    await scheduler.start()
    _tune_gc_for_a_server()
    kind = "compiled" if distributed_core.COMPILED else "interpreted"
    print(f"Scheduler at {scheduler.address} (distributed-core "
          f"{distributed_core.__version__}, core {kind})", flush=True)
    await _serve_until_signal(scheduler)
    return 0


async def _run_worker(args) -> int:
    from .worker import Worker

    host = args.host or _listen_host_for(args.address)
    worker = Worker(args.address, nthreads=args.nthreads, name=args.name,
                    resources=args.resources or None, host=host, port=args.port)
    await worker.start()
    print(f"Worker at {worker.address} connected to {args.address}", flush=True)
    await _serve_until_signal(worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
