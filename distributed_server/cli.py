"""The ``dcore`` command: run a scheduler, a worker, or the demo; print the version.

    dcore scheduler [--host HOST] [--port PORT] [--dashboard-address :8787 | --no-dashboard]
                    [--open-cluster-api] [credentials]
    dcore worker [tcp://SCHEDULER:PORT] [--nthreads N] [--name NAME] [--resources GPU=1,MEM=4e9]
                 [--nworkers N] [--memory-limit 4GiB|0.5|auto|0] [--no-nanny] [credentials]
                 [--memory-{target,spill,pause}-fraction F] [--local-directory DIR]
                 [--dashboard-address :0 | --no-dashboard]
    dcore demo [--workers N] [--threads N] [--tasks N]
    dcore token                  print a fresh random cluster token
    dcore dashboard-token        print the token of the HTTP endpoints (from the cluster's)
    dcore tls-files DIR [HOST..] write a new CA and a certificate for every role into DIR
    dcore --version

Credentials: --token-file FILE (or DCORE_TOKEN / DCORE_TOKEN_FILE in the environment),
--tls-ca-file, --tls-cert, --tls-key (or DCORE_TLS_CA_FILE / _CERT / _KEY). A scheduler
or worker with none of them listens only on loopback unless given --insecure.

`dcore worker` given neither an address nor --scheduler-file reads the scheduler's
address from DASK_SCHEDULER_ADDRESS, and its name (without --name) from DASK_WORKER_NAME:
the variables the dask-kubernetes operator gives worker pods. `dcore scheduler
--open-cluster-api` serves the routes that operator calls (/api/v1/adaptive_target,
retire_workers, get_workers, check_idle) without credentials, since it sends none: only
behind a network policy (docs/deploy/README.md).

`dcore worker` runs its workers under a nanny (`distributed_server.deploy.nanny`): one process
that starts ``--nworkers`` worker processes (``dcore worker ... --no-nanny``, credentials
and the memory limit in their environment), restarts them when they die or pass their
memory limit, and restarts them all when the scheduler asks (`Client.restart`).
``--no-nanny`` runs one worker in this process instead.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys

import distributed_core

from . import config, logs
from .comm import parse_address
from .dashboard.http import DEFAULT_DASHBOARD_PORT, parse_http_address
from .deploy.launch import Preload, close_after, read_scheduler_file, write_scheduler_file
from .deploy.nanny import MEMORY_LIMIT_ENV, TERMINATE_FRACTION, format_bytes, parse_memory_limit
from .diagnostics.gc_pauses import GC_PAUSES, LoopCollector
from .security import (
    Security,
    SecurityError,
    check_listen_security,
    new_token,
    write_tls_files,
)
from .worker.memory import PAUSE_FRACTION, SPILL_FRACTION, TARGET_FRACTION
from .worker.server import SCHEDULER_TIMEOUT


def main(argv: list | None = None) -> int:
    """Entry point of the ``dcore`` console script."""
    args = _parser().parse_args(argv)
    if args.version:
        print(version_text())
        return 0
    if args.command is None:
        _parser().print_help()
        return 2
    logs.configure(_role_of(args), getattr(args, "log_level", "INFO"))
    if args.command in ("scheduler", "worker"):
        try:
            if args.command == "worker":
                _resolve_worker_addresses(args)
            args.security = _security_from(args)
            check_listen_security(args.host, args.security, args.insecure, args.command)
            if args.command == "scheduler" and args.open_cluster_api and args.no_dashboard:
                raise ValueError("--open-cluster-api opens routes of the dashboard's HTTP "
                                 "server: drop --no-dashboard")
            if not args.no_dashboard:
                dashboard_host, _ = parse_http_address(args.dashboard_address, args.host)
                check_listen_security(dashboard_host, args.security, args.insecure,
                                      f"{args.command} HTTP server")
            preload_here = args.command == "scheduler" or args.no_nanny
            args.preloads = [Preload(n) for n in args.preload] if preload_here else []
        except (SecurityError, ValueError, TimeoutError, ImportError, OSError) as e:
            print(f"dcore {args.command}: {e}", file=sys.stderr)
            return 2
        _raise_fd_limit()
    if args.command == "scheduler":
        return asyncio.run(_run_scheduler(args))
    if args.command == "worker":
        try:
            memory_limit = _worker_memory_limit(args)
        except ValueError as e:
            print(f"dcore worker: {e}", file=sys.stderr)
            return 2
        if args.no_nanny:
            os.environ[MEMORY_LIMIT_ENV] = str(memory_limit)  # for the worker to read
            return asyncio.run(_run_worker(args))
        return asyncio.run(_run_nanny(args, memory_limit))
    if args.command == "token":
        print(new_token())
        return 0
    if args.command == "dashboard-token":
        token = Security(token_file=args.token_file).dashboard_token() if args.token_file \
            else Security.from_environment().dashboard_token()
        if token is None:
            print("dcore dashboard-token: no cluster token (give --token-file, or set "
                  "DCORE_TOKEN / DCORE_TOKEN_FILE)", file=sys.stderr)
            return 2
        print(token)
        return 0
    if args.command == "tls-files":
        paths = write_tls_files(args.directory, tuple(args.hosts))
        print("\n".join(f"{name}: {path}" for name, path in paths.items()))
        return 0
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
    scheduler.add_argument("--worker-ttl", type=float, default=None,
                           help="seconds of silence after which a worker is removed "
                                "(default: configuration, else 300)")
    scheduler.add_argument("--worker-saturation", type=float, default=None,
                           help="tasks per thread before root tasks queue (inf: no queue; "
                                "default: configuration, else 1.1)")
    scheduler.add_argument("--validate", action="store_true",
                           help="check every invariant after each stimulus (slow)")
    scheduler.add_argument("--client-idle-timeout", type=float, default=None,
                           help="seconds of silence after which a client is disconnected "
                                "(default: configuration, else 300)")
    scheduler.add_argument("--scheduler-file", default=None,
                           help="write the scheduler's address to this JSON file (for "
                                "workers and clients started with the same path)")
    scheduler.add_argument("--preload", action="append", default=[],
                           help="a module or .py file to import at start; its "
                                "dcore_setup(scheduler) runs once the scheduler listens")
    scheduler.add_argument("--log-level", default="INFO", type=_log_level,
                           help="CRITICAL, ERROR, WARNING, INFO (default) or DEBUG")
    scheduler.add_argument("--dashboard-address", default=f":{DEFAULT_DASHBOARD_PORT}",
                           help="where the status page, JSON API and /metrics are served: "
                                "PORT, :PORT or HOST:PORT (default %(default)s on --host; a "
                                "busy port gives way to a free one)")
    scheduler.add_argument("--no-dashboard", action="store_true",
                           help="serve no HTTP endpoints")
    scheduler.add_argument("--open-cluster-api", action="store_true",
                           help="serve the routes the dask-kubernetes operator scales the "
                                "cluster with (/api/v1/adaptive_target, retire_workers, "
                                "get_workers, check_idle) without credentials, as the "
                                "operator sends none: only where a network policy lets "
                                "nothing but the operator reach the dashboard's port")
    _add_security_flags(scheduler)

    worker = commands.add_parser("worker", help="run a worker")
    worker.add_argument("address", nargs="?", default=None,
                        help="the scheduler, e.g. tcp://10.0.0.5:8786 (or --scheduler-file; "
                             "default: $DASK_SCHEDULER_ADDRESS)")
    worker.add_argument("--scheduler-file", default=None,
                        help="read the scheduler's address from this file (waits for it "
                             "up to --death-timeout)")
    worker.add_argument("--listen-address", default=None,
                        help="where to listen for peers, e.g. tcp://0.0.0.0:9000 (instead "
                             "of --host/--port)")
    worker.add_argument("--contact-address", default=None,
                        help="the address other processes reach this worker at, when it "
                             "differs from where it listens (containers, NAT)")
    worker.add_argument("--death-timeout", type=float, default=None,
                        help="seconds to wait for the scheduler at start (and to find it "
                             "again once lost) before exiting")
    worker.add_argument("--lifetime", type=float, default=None,
                        help="close the worker after this many seconds (its data is then "
                             "recomputed elsewhere if still wanted)")
    worker.add_argument("--lifetime-restart", action="store_true",
                        help="with --lifetime: the nanny starts a fresh worker")
    worker.add_argument("--preload", action="append", default=[],
                        help="a module or .py file to import at start; its "
                             "dcore_setup(worker) runs once the worker is registered")
    worker.add_argument("--nthreads", type=int, default=1)
    worker.add_argument("--name", default=None,
                        help="the worker's name (default: $DASK_WORKER_NAME, else none)")
    worker.add_argument("--resources", default="", type=_resources,
                        help="abstract resources, e.g. GPU=1,MEM=4e9")
    worker.add_argument("--host", default=None,
                        help="interface to listen on for peers (default: the one that "
                             "reaches the scheduler)")
    worker.add_argument("--port", type=int, default=0)
    worker.add_argument("--nworkers", type=_positive_int, default=1,
                        help="worker processes to start, each supervised by the nanny")
    worker.add_argument("--no-nanny", action="store_true",
                        help="run one worker in this process, unsupervised")
    worker.add_argument("--memory-limit", default=None,
                        help="each worker's memory limit: bytes ('4GiB', '4GB', '4e9'), a "
                             "fraction of this machine's memory ('0.5'), 'auto' (the "
                             "machine's memory divided by --nworkers; the default) or 0 "
                             "(none). The nanny restarts a worker past "
                             "--memory-terminate-fraction of it")
    worker.add_argument("--memory-terminate-fraction", type=_fraction, default=None,
                        help="fraction of the memory limit past which the nanny kills and "
                             f"restarts a worker (default: configuration, else "
                             f"{TERMINATE_FRACTION}; 0: never)")
    for step, default, what in (
            ("target", TARGET_FRACTION, "results held in memory (by their sizes) past which "
                                        "the least recently used spill to disk"),
            ("spill", SPILL_FRACTION, "process memory past which results spill until it "
                                      "is back under the target"),
            ("pause", PAUSE_FRACTION, "process memory past which no new task starts")):
        worker.add_argument(f"--memory-{step}-fraction", type=_fraction, default=None,
                            help=f"fraction of the memory limit: {what} (default: "
                                 f"configuration, else {default}; 0: off)")
    worker.add_argument("--scheduler-timeout", type=float, default=None,
                        help="seconds without a word from the scheduler after which the "
                             "worker drops its data and registers again (default: "
                             f"configuration, else {SCHEDULER_TIMEOUT})")
    worker.add_argument("--reconnect-timeout", type=float, default=10.0,
                        help="seconds a worker that lost the scheduler tries to register "
                             "again before it exits (default %(default)s)")
    worker.add_argument("--local-directory", default=None,
                        help="where spilled results go (default: the temporary directory)")
    worker.add_argument("--log-level", default="INFO", type=_log_level,
                        help="CRITICAL, ERROR, WARNING, INFO (default) or DEBUG; the "
                             "nanny's and its workers'")
    worker.add_argument("--dashboard-address", default=":0",
                        help="where each worker serves /metrics: :PORT or HOST:PORT "
                             "(default: a free port on --host)")
    worker.add_argument("--no-dashboard", action="store_true",
                        help="serve no HTTP endpoints")
    _add_security_flags(worker)

    commands.add_parser("token", help="print a fresh random cluster token")
    dashboard_token = commands.add_parser(
        "dashboard-token", help="print the token of the HTTP endpoints: derived from the "
        "cluster's token, it admits to the dashboard and /metrics only")
    dashboard_token.add_argument("--token-file", help="file holding the cluster's token "
                                 "(default: DCORE_TOKEN / DCORE_TOKEN_FILE)")
    tls = commands.add_parser("tls-files", help="write a new CA, certificate and key "
                              "(for every role of one cluster) into a directory")
    tls.add_argument("directory")
    tls.add_argument("hosts", nargs="*", help="host names or addresses the certificate "
                     "also names (peers check only the CA's signature)")

    demo = commands.add_parser("demo", help="run a graph on a local cluster and report")
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--threads", type=int, default=1)
    demo.add_argument("--tasks", type=int, default=5000,
                      help="leaves of the graph (about twice as many tasks in all)")
    return parser


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("credentials (default: DCORE_* environment variables)")
    group.add_argument("--token-file", help="file holding the cluster's token")
    group.add_argument("--tls-ca-file", help="PEM file of the cluster's CA")
    group.add_argument("--tls-cert", help="PEM file of this process's certificate")
    group.add_argument("--tls-key", help="PEM file of this process's private key")
    group.add_argument("--insecure", action="store_true",
                       help="allow listening beyond loopback without any credentials")


def _security_from(args) -> Security:
    """Credentials from the flags, else from the environment, else from configuration
    (dask's ``distributed.comm.tls.*`` keys for this role; ``dcore.comm.token-file``)."""
    tls = (args.tls_ca_file, args.tls_cert, args.tls_key)
    env = Security.from_environment(role=None if any(tls) else args.command)
    return Security(
        token=None if args.token_file else env.token, token_file=args.token_file,
        **(dict(zip(("tls_ca_file", "tls_cert", "tls_key"), tls)) if any(tls) else
           {"tls_ca_file": env.tls_ca_file, "tls_cert": env.tls_cert,
            "tls_key": env.tls_key}))


def _raise_fd_limit() -> None:
    """Let a server hold as many connections as the hard limit allows (most systems
    start processes with a soft limit of 1,024 open files)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < min(target, 1 << 16):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(target, 1 << 16), hard))
    except (ImportError, OSError, ValueError):
        pass


def _role_of(args) -> str:
    """The role this process plays, as its log lines name it."""
    if args.command == "worker":
        return "worker" if args.no_nanny else "nanny"
    return "client" if args.command == "demo" else args.command


def _log_level(text: str) -> str:
    """A ``--log-level``: a level name in any case (given on as upper case) or a number."""
    try:
        logs.level_of(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip().upper()


def _off_if_zero(fraction: float | None):
    """A fraction flag: None (unset: configuration decides), 0 (off: False), or itself."""
    return False if fraction == 0 else fraction


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction from 0 to 1")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return value


def _worker_memory_limit(args) -> int:
    """Each worker's memory limit in bytes (0: none), checking the nanny's flags too.

    A worker run by a nanny (``--no-nanny``, no ``--memory-limit``) keeps the limit its
    nanny put in its environment."""
    if args.no_nanny:
        if args.nworkers != 1:
            raise ValueError("--nworkers needs the nanny (drop --no-nanny)")
        if args.memory_limit is None and os.environ.get(MEMORY_LIMIT_ENV, "").isdigit():
            return int(os.environ[MEMORY_LIMIT_ENV])
    elif args.nworkers > 1 and args.port:
        raise ValueError(f"--port {args.port} cannot serve {args.nworkers} workers "
                         "(leave it out: each worker picks a free port)")
    elif args.nworkers > 1 and not args.no_dashboard \
            and parse_http_address(args.dashboard_address, args.host)[1]:
        raise ValueError(f"--dashboard-address {args.dashboard_address} cannot serve "
                         f"{args.nworkers} workers (give port 0: each picks a free one)")
    return parse_memory_limit(args.memory_limit, args.nworkers)


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


#: The scheduler's collector thresholds: generation 0 every 100,000 net allocations (the
#: default is 700), generation 1 every 10 of those, generation 2 every 5,000 of those.
#: A generation-1 collection walks what survived the generation-0 ones since the last:
#: with 50 of them (as before) 158 ms at ten million tasks coming in (big_job.py); every
#: object is walked there once whatever the number, so 10 costs no more in all.
SCHEDULER_GC_THRESHOLDS = (100_000, 10, 5_000)


def _tune_gc_for_a_server() -> None:
    """The scheduler process allocates a few short-lived objects per message; the default
    threshold (700) runs a collection every few hundred tasks. Collect far less often, and
    never walk what existed at start-up (measured: about 18% less scheduler CPU per task,
    benchmarks/e2e.py). Collections run between the loop's callbacks, never inside a
    stimulus, and are timed (gc_pauses.py): the metrics show them and one over a second
    is logged."""
    gc.freeze()
    gc.set_threshold(*SCHEDULER_GC_THRESHOLDS)
    GC_PAUSES.install()
    LoopCollector().start()


#: A worker's collector thresholds: generation 0 every 10,000 net allocations (the
#: default is 700), a full collection after 20 x 100 of those.
WORKER_GC_THRESHOLDS = (10_000, 20, 100)


def _tune_gc_for_a_worker() -> None:
    """A worker holds many results made of many small objects (a DataFrame piece of a
    shuffle is dozens), and every full collection walks all of them: with the default
    thresholds the two workers of the two-month seed spent 5.6-7.7 s of their ~27 CPU
    seconds in the collector, 14-20 full collections of 120-200 ms each, which freed a
    few hundred objects at most (measured with ``gc.callbacks``,
    benchmarks/seed_cpu.py). With these thresholds they spend 1.5-1.7 s. The collector
    stays automatic: task threads allocate too. A worker whose memory passes the spill
    line with nothing left to spill collects at once (memory.MemoryMonitor), so cyclic
    garbage cannot pass for results."""
    gc.set_threshold(*WORKER_GC_THRESHOLDS)


async def _serve_until_signal(server) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: loop.create_task(server.close()))
    await server.finished()


async def _run_scheduler(args) -> int:
    from .scheduler.server import Scheduler

    scheduler = Scheduler(args.host, args.port, worker_ttl=args.worker_ttl,
                          validate=args.validate, worker_saturation=args.worker_saturation,
                          security=args.security, insecure=args.insecure,
                          client_idle_timeout=args.client_idle_timeout,
                          dashboard_address=None if args.no_dashboard
                          else args.dashboard_address,
                          open_cluster_api=args.open_cluster_api)
    preloads = args.preloads
    await scheduler.start()
    _tune_gc_for_a_server()
    for preload in preloads:
        await preload.setup(scheduler)
    if args.scheduler_file:
        write_scheduler_file(args.scheduler_file, scheduler.address)
    kind = "compiled" if distributed_core.COMPILED else "interpreted"
    print(f"Scheduler at {scheduler.address} (distributed-core "
          f"{distributed_core.__version__}, core {kind})", flush=True)
    if scheduler.dashboard_url is not None:
        print(f"Dashboard at {scheduler.dashboard_url}", flush=True)
    try:
        await _serve_until_signal(scheduler)
    finally:
        if args.scheduler_file:
            with contextlib.suppress(OSError):
                os.remove(args.scheduler_file)
    for preload in preloads:
        await preload.teardown(scheduler)
    return 0


#: Where the dask-kubernetes operator puts a worker pod's scheduler address and its name.
SCHEDULER_ADDRESS_ENV = "DASK_SCHEDULER_ADDRESS"
WORKER_NAME_ENV = "DASK_WORKER_NAME"


def _resolve_worker_addresses(args) -> None:
    """The scheduler's address (given, or from --scheduler-file, or from
    DASK_SCHEDULER_ADDRESS), the worker's name (--name, else DASK_WORKER_NAME) and where
    to listen (--listen-address, else --host/--port, else the interface that reaches the
    scheduler). ValueError or TimeoutError with a one-line reason."""
    if args.name is None:
        args.name = os.environ.get(WORKER_NAME_ENV, "").strip() or None
    if args.address is None and args.scheduler_file is None:
        args.address = os.environ.get(SCHEDULER_ADDRESS_ENV, "").strip() or None
        if args.address is None:
            raise ValueError(f"give the scheduler's address or --scheduler-file (or set "
                             f"{SCHEDULER_ADDRESS_ENV})")
        try:
            parse_address(args.address)
        except ValueError as exc:
            raise ValueError(f"{SCHEDULER_ADDRESS_ENV}: {exc}") from None
    if args.address is None:
        args.address = read_scheduler_file(args.scheduler_file,
                                           timeout=args.death_timeout or 60.0)
    if args.listen_address is not None:
        _, args.host, args.port = parse_address(args.listen_address)
    if args.host is None:
        args.host = _listen_host_for(args.address)
    if args.contact_address is not None:
        parse_address(args.contact_address)  # ValueError if malformed
        if args.nworkers > 1 and not args.no_nanny:
            raise ValueError("--contact-address names one worker: use it with "
                             "--nworkers 1")


def _task_client(address: str, **kwargs):
    """The client a task's ``get_client()`` gets in a worker process: the client package
    is imported on that first use, so a worker whose tasks never ask starts without it."""
    from .client.client import Client

    return Client(address, **kwargs)


async def _run_worker(args) -> int:
    from .deploy.nanny import LIFETIME_EXIT_CODE
    from .worker.server import Worker
    from .worker.task_context import install_client_factory

    preloads = args.preloads
    install_client_factory(_task_client)
    _tune_gc_for_a_worker()
    GC_PAUSES.install()
    worker = Worker(args.address, nthreads=args.nthreads, name=args.name,
                    resources=args.resources or None, host=args.host, port=args.port,
                    security=args.security, insecure=args.insecure,
                    memory_target_fraction=_off_if_zero(args.memory_target_fraction),
                    memory_spill_fraction=_off_if_zero(args.memory_spill_fraction),
                    memory_pause_fraction=_off_if_zero(args.memory_pause_fraction),
                    local_directory=args.local_directory,
                    scheduler_timeout=args.scheduler_timeout,
                    reconnect_timeout=args.death_timeout or args.reconnect_timeout,
                    connect_timeout=args.death_timeout or 10.0,
                    contact_address=args.contact_address,
                    dashboard_address=None if args.no_dashboard else args.dashboard_address)
    await worker.start()
    print(f"Worker at {worker.address} connected to {args.address}", flush=True)
    _tell_nanny(worker.address)
    for preload in preloads:
        await preload.setup(worker)
    lifetime = None
    if args.lifetime:
        lifetime = asyncio.get_running_loop().create_task(close_after(worker, args.lifetime))
    await _serve_until_signal(worker)
    for preload in preloads:
        await preload.teardown(worker)
    if lifetime is not None and lifetime.done() and args.lifetime_restart:
        return LIFETIME_EXIT_CODE
    return 0


def _tell_nanny(address: str) -> None:
    """Under a nanny: write our address to the pipe it gave us (then close it)."""
    from .deploy.nanny import ADDRESS_FD_ENV

    fd = os.environ.pop(ADDRESS_FD_ENV, None)  # not for the processes tasks start
    if fd is None or not fd.isdigit():
        return
    try:
        os.write(int(fd), f"{address}\n".encode())
        os.close(int(fd))
    except OSError:
        pass


async def _run_nanny(args, memory_limit: int) -> int:
    """Supervise ``--nworkers`` worker processes until SIGTERM/SIGINT, or until they all
    exited cleanly (the scheduler closed them)."""
    from .deploy.nanny import Nanny

    worker_args = ["--nthreads", str(args.nthreads), "--host", args.host,
                   "--port", str(args.port), "--log-level", args.log_level]
    if args.resources:
        worker_args += ["--resources",
                        ",".join(f"{name}={quantity!r}" for name, quantity in
                                 args.resources.items())]
    if args.insecure:
        worker_args.append("--insecure")
    for step in ("target", "spill", "pause"):  # unset: the worker reads configuration
        value = getattr(args, f"memory_{step}_fraction")
        if value is not None:
            worker_args += [f"--memory-{step}-fraction", repr(value)]
    if args.local_directory:
        worker_args += ["--local-directory", args.local_directory]
    worker_args += ["--reconnect-timeout", repr(args.reconnect_timeout)]
    for flag in ("contact_address", "death_timeout", "lifetime", "scheduler_timeout"):
        value = getattr(args, flag)
        if value is not None:
            worker_args += ["--" + flag.replace("_", "-"), str(value)]
    if args.lifetime_restart:
        worker_args.append("--lifetime-restart")
    for name in args.preload:
        worker_args += ["--preload", name]
    worker_args += ["--no-dashboard"] if args.no_dashboard else \
        ["--dashboard-address", args.dashboard_address]
    if args.name is None:
        names = [None] * args.nworkers
    elif args.nworkers == 1:
        names = [args.name]
    else:
        names = [f"{args.name}-{i}" for i in range(args.nworkers)]
    nanny = Nanny(args.address, args.nworkers, worker_args=worker_args, names=names,
                  memory_limit=memory_limit,
                  terminate_fraction=config.get("worker.memory.terminate",
                                                args.memory_terminate_fraction),
                  security=args.security)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, nanny.stop)
    # Logged, not printed: stdout is the workers' own ("Worker at ..." lines first).
    logging.getLogger("distributed_server.nanny").info(
        "nanny (pid %d) starting %d worker(s) for %s, memory limit %s each", os.getpid(),
        args.nworkers, args.address, format_bytes(memory_limit) if memory_limit else "none")
    return await nanny.run()


if __name__ == "__main__":
    sys.exit(main())
