"""Micro-benchmark of distributed_server.comm.framing: batched `send` between two processes.

A receiver process listens on loopback; the sender connects, then pushes N small
messages (the 180-byte compute-task message of docs/../notes/per-task-budget.md) with
`Comm.send`, yielding to the event loop every `--yield-every` messages as a real
producer would. The receiver reads frames until it has N messages and replies "done"
with its CPU time. Prints each run and the median of the runs.

    python benchmarks/comm_bench.py                  # 100,000 messages, 3 runs
    python benchmarks/comm_bench.py --unbatched      # also: one `await write` per message
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distributed_server.comm.connector import connect
from distributed_server.comm.framing import CommClosedError
from distributed_server.comm.listener import listen


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def message(i: int) -> dict:
    return {"op": "compute-task", "key": f"inc-{i:032x}", "priority": (0, 1, 12345),
            "duration": 0.5, "who_has": {}, "nbytes": {}, "run_spec": b"r" * 60}


# ------------------------------------------------------------------ receiver process


async def receive(comm) -> None:
    """Per run: a "start" message with n, then n messages, then reply "done"."""
    try:
        while True:
            (start,) = await comm.read()
            expected, received, frames = start["n"], 0, 0
            cpu0 = cpu_seconds()
            while received < expected:
                received += len(await comm.read())
                frames += 1
            await comm.write([{"op": "done", "cpu": cpu_seconds() - cpu0, "frames": frames}])
    except CommClosedError:
        pass


async def serve(conn) -> None:
    listener = await listen("tcp://127.0.0.1:0", receive, {"role": "bench-receiver"})
    conn.send(listener.address)
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # wait for "stop"
    await listener.stop()


def receiver_main(conn) -> None:
    asyncio.run(serve(conn))


# ------------------------------------------------------------------ sender


async def one_run(comm, n: int, batched: bool, yield_every: int) -> dict:
    msgs = [message(i) for i in range(n)]  # built beforehand: time the comm, not dicts
    await comm.write([{"op": "start", "n": n}])
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    if batched:
        send = comm.send
        for i, msg in enumerate(msgs):
            send(msg)
            if i % yield_every == yield_every - 1:
                await asyncio.sleep(0)
    else:
        for msg in msgs:
            await comm.write([msg])
    (done,) = await comm.read()
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    return {"us_per_msg": wall / n * 1e6, "msgs_per_s": n / wall, "send_cpu_us": cpu / n * 1e6,
            "recv_cpu_us": done["cpu"] / n * 1e6, "frames": done["frames"]}


async def bench(address: str, n: int, runs: int, batched: bool, yield_every: int) -> list:
    comm = await connect(address, {"role": "bench-sender"})
    results = [await one_run(comm, n, batched, yield_every) for _ in range(runs)]
    await comm.close()
    return results


def report(title: str, results: list) -> None:
    print(title)
    for r in results:
        print(f"  run: {r['msgs_per_s']:>11,.0f} msgs/s  {r['us_per_msg']:6.2f} us/msg wall  "
              f"send CPU {r['send_cpu_us']:5.2f} us/msg  recv CPU {r['recv_cpu_us']:5.2f} us/msg  "
              f"{r['frames']} frames")
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(f"  median of {len(results)}: {med['msgs_per_s']:,.0f} msgs/s, "
          f"{med['us_per_msg']:.2f} us/msg wall (send CPU {med['send_cpu_us']:.2f}, "
          f"recv CPU {med['recv_cpu_us']:.2f} us/msg)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=100_000, help="messages per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--yield-every", type=int, default=100,
                        help="sender yields to the loop after this many send() calls")
    parser.add_argument("--unbatched", action="store_true",
                        help="also time one `await write([msg])` per message (n/5 messages)")
    args = parser.parse_args()

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child,), daemon=True)
    proc.start()
    try:
        address = parent.recv()
        print(f"python {sys.version.split()[0]}, receiver at {address}, {os.cpu_count()} CPUs")
        results = asyncio.run(bench(address, args.n, args.runs, True, args.yield_every))
        report(f"batched send(), {args.n:,} messages, yield every {args.yield_every}:", results)
        if args.unbatched:
            n = args.n // 5
            results = asyncio.run(bench(address, n, args.runs, False, 1))
            report(f"unbatched await write([msg]), {n:,} messages:", results)
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.terminate()


if __name__ == "__main__":
    main()
