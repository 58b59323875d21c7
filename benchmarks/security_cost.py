"""What security costs: the comm handshake, and TLS + token on e2e.py's hot paths.

Measures, for each way a cluster can be secured (issue 10: TLS + token must stay within
1.5x of no security on the map and round-trip rows)::

    none    Security()                      no credentials (loopback only)
    token   Security(token=new_token())     the HMAC challenge-response in the handshake;
                                            what LocalCluster does by default
    tls     Security.temporary()            mutual TLS (a throwaway CA) + the token

1. The handshake: ``comm.connect()`` to a listener in this process (same event loop)
   and ``close()``, ``--connects`` times per mode (default 200), the modes interleaved in
   batches of 25. Reported: the median wall time of connect + close, and of connect
   alone, and the CPU time per connect (user+sys of this process over the batches,
   so both ends of the connection, the listener's side of each close included: the
   next batch starts only when the listener has seen every connection close). Also a
   ``tls-only`` row (``Security.temporary(token=False)``) to split TLS from the token.
2. The hot paths of ``benchmarks/compare.py`` (its map and round-trip rows): map of
   ``--tasks`` (20,000) no-op tasks on 1 worker x 1 thread and on 2 x 1 (tasks/s), and
   ``submit(inc, i).result()`` x ``--iterations`` (300) on 1 x 1 (median ms per round
   trip). Each run is ``e2e.py``'s own child (a fresh ``LocalCluster(processes=True,
   security=...)`` via ``e2e.DcoreSystem``, a warm-up round, then the workload of
   ``e2e.run_map`` / ``e2e.run_round_trips``), with ``e2e.py --security MODE``'s
   credentials. The modes are interleaved run by run (none, token, tls, then token,
   tls, none, ...: each round starts one mode later) so machine noise hits all alike;
   ``--rounds`` rounds (5; ``--quick`` 1), medians per mode.

The table gives each figure per mode (and the CPU per task of the scheduler, the
workers, the client), its cost relative to ``none`` (none's tasks/s / the mode's, or
the mode's ms / none's: 1.00x = free, higher = slower), whether TLS + token is within
1.5x on the three rows, and, as a check on the noise, the paired cost: the median over
the rounds of each mode against none's run of the same round. The token is checked
only in the handshake (nothing per message), so token's row is also a noise gauge: what
it shows beyond 1.00x on the hot paths is the machine, not the token. Results go to
``benchmarks/results/security-cost-<date>[-quick].json``. Run it with the python of an
environment where the package is installed (``pip install ".[bench,tls]"``; without it
the checkout is used, as by e2e.py), e.g.::

    python benchmarks/security_cost.py --quick     # 1 round, ~15 s
    python benchmarks/security_cost.py             # 5 rounds, ~1 minute on 2 cores
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import e2e  # noqa: E402  - the workloads, DcoreSystem, the child runner, save_results

MODES = e2e.SECURITY_MODES  # none, token, tls (TLS + token)
HANDSHAKE_MODES = MODES + ("tls-only",)
MODE_LABELS = {"none": "none", "token": "token", "tls": "TLS + token",
               "tls-only": "TLS, no token"}
TARGET_RATIO = 1.5
CELLS = [("map", 1), ("map", 2), ("rt", 1)]  # compare.py's map and round-trip rows
BATCH = 25


# ====================================================================== the handshake


def handshake_security(mode: str):
    from distributed_server.security import Security

    if mode == "tls-only":
        return Security.temporary(token=False)
    return e2e.make_security(mode)


class _Drain:
    """The listener's handler: read until the connector closes; `wait` until ``n``
    connections have closed on the listener's side."""

    def __init__(self) -> None:
        self.closed = 0
        self._waiter: tuple | None = None

    async def __call__(self, comm) -> None:
        from distributed_server.comm.framing import CommClosedError

        try:
            while True:
                await comm.read()
        except CommClosedError:
            pass
        self.closed += 1
        if self._waiter and self.closed >= self._waiter[0] and not self._waiter[1].done():
            self._waiter[1].set_result(None)

    async def wait(self, n: int) -> None:
        if self.closed < n:
            self._waiter = (n, asyncio.get_running_loop().create_future())
            await asyncio.wait_for(self._waiter[1], 10)


async def measure_handshakes(modes: tuple, n: int) -> dict:
    """Per mode: connect + close ``n`` times to an in-process listener, in interleaved
    batches; wall times per connect and CPU per connect."""
    from distributed_server.comm.connector import connect
    from distributed_server.comm.listener import listen

    setups = {}
    for mode in modes:
        security = handshake_security(mode)
        drain = _Drain()
        listener = await listen(f"{security.scheme}://127.0.0.1:0", drain,
                                {"role": "bench-listener"}, security)
        setups[mode] = (security, listener, drain)
    stats = {m: {"total_s": [], "connect_s": [], "cpu_s": 0.0, "n": 0} for m in modes}

    async def batch(mode: str, count: int, record: bool) -> None:
        security, listener, drain = setups[mode]
        expected = drain.closed + count
        cpu0 = time.process_time()
        for _ in range(count):
            t0 = time.perf_counter()
            comm = await connect(listener.address, {"role": "bench-connector"},
                                 timeout=10, security=security)
            t1 = time.perf_counter()
            await comm.close()
            t2 = time.perf_counter()
            if record:
                stats[mode]["connect_s"].append(t1 - t0)
                stats[mode]["total_s"].append(t2 - t0)
        await drain.wait(expected)  # the listener's side of the closes belongs to the cost
        if record:
            stats[mode]["cpu_s"] += time.process_time() - cpu0
            stats[mode]["n"] += count

    for mode in modes:  # warm-up: imports, SSL contexts, code paths
        await batch(mode, 5, record=False)
    done = 0
    while done < n:
        count = min(BATCH, n - done)
        for mode in modes:
            await batch(mode, count, record=True)
        done += count
    for _, listener, _ in setups.values():
        await listener.stop()
    out = {}
    for mode, s in stats.items():
        out[mode] = {"connects": s["n"],
                     "connect_close_ms": 1e3 * statistics.median(s["total_s"]),
                     "connect_close_p90_ms": 1e3 * e2e.percentile(s["total_s"], 90),
                     "connect_ms": 1e3 * statistics.median(s["connect_s"]),
                     "cpu_ms_per_connect": 1e3 * s["cpu_s"] / s["n"]}
    base = out.get("none")
    for r in out.values():
        r["wall_ratio"] = r["connect_close_ms"] / base["connect_close_ms"] if base else None
        r["cpu_ratio"] = r["cpu_ms_per_connect"] / base["cpu_ms_per_connect"] if base \
            else None
    return out


def print_handshakes(hs: dict, n: int) -> None:
    print(f"handshake: comm.connect() + close() to an in-process listener, {n} per mode "
          f"(interleaved batches of {BATCH})")
    cols = ["mode", "connect+close ms", "p90 ms", "connect ms", "CPU ms/connect",
            "wall x", "CPU x"]
    lines = [[MODE_LABELS[m], f"{r['connect_close_ms']:.2f}", f"{r['connect_close_p90_ms']:.2f}",
              f"{r['connect_ms']:.2f}", f"{r['cpu_ms_per_connect']:.2f}",
              _x(r["wall_ratio"]), _x(r["cpu_ratio"])] for m, r in hs.items()]
    _print_table(cols, lines)
    print("  medians; CPU: user+sys of this process per connect, both ends; x: / none's")


# ====================================================================== the hot paths


def spec_of(cell: tuple, mode: str, args) -> dict:
    return {"system": e2e.DCORE, "workload": cell[0], "workers": cell[1], "threads": 1,
            "n": args.tasks, "leaves": 0, "iterations": args.iterations, "security": mode}


def run_rounds(args, env: dict, rounds: int) -> dict:
    """raw[(workload, workers)][mode] = [e2e child results], modes interleaved."""
    raw: dict = {}
    total = rounds * len(CELLS) * len(MODES)
    k = 0
    for r in range(rounds):
        for cell in CELLS:
            order = [MODES[(r + i) % len(MODES)] for i in range(len(MODES))]
            for mode in order:
                k += 1
                t0 = time.perf_counter()
                result = e2e.run_child(spec_of(cell, mode, args), env, args.timeout)
                result["round"] = r
                raw.setdefault(cell, {}).setdefault(mode, []).append(result)
                if result.get("error"):
                    status = result["error"]
                elif cell[0] == "rt":
                    status = f"{result['rt_median_ms']:.3f} ms"
                else:
                    status = f"{result['tasks_per_s']:,.0f} tasks/s"
                if result.get("scheme") and result["scheme"] != ("tls" if mode == "tls"
                                                                 else "tcp"):
                    status += f"  (unexpected scheme {result['scheme']})"
                print(f"  [{k}/{total}] round {r + 1} {cell[0]:<3} {cell[1]}x1 "
                      f"{MODE_LABELS[mode]:<12} {status}  ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
    return raw


METRICS = [  # (field, label, higher is better, format)
    ("tasks_per_s", "tasks/s", True, ",.0f"),
    ("rt_median_ms", "round trip ms", False, ".3f"),
    ("sched_cpu_us", "sched CPU us/task", False, ".1f"),
    ("workers_cpu_us", "workers CPU us/task", False, ".1f"),
    ("client_cpu_us", "client CPU us/task", False, ".1f"),
    ("all_cpu_us", "all CPU us/task", False, ".1f"),
]


def _value(run: dict, field: str):
    if "error" in run:
        return None
    if field == "all_cpu_us":
        parts = [run.get(f) for f in ("sched_cpu_us", "workers_cpu_us", "client_cpu_us")]
        return None if None in parts else sum(parts)
    return run.get(field)


def _cost(value, base, higher_better: bool):
    """How many times worse than ``base`` (1.0 = the same)."""
    if not value or not base:
        return None
    return base / value if higher_better else value / base


def build_rows(raw: dict, args) -> list:
    rows = []
    for cell in CELLS:
        per_mode = raw.get(cell, {})
        main = "rt_median_ms" if cell[0] == "rt" else "tasks_per_s"
        for field, label, higher, fmt in METRICS:
            if field == "tasks_per_s" and cell[0] == "rt" or \
                    field == "rt_median_ms" and cell[0] != "rt":
                continue
            row = {"workload": cell[0], "workers": cell[1], "field": field, "metric": label,
                   "higher_better": higher, "fmt": fmt, "primary": field == main,
                   "values": {}, "runs": {}, "errors": {}}
            by_round: dict = {}  # round -> mode -> value
            for mode in MODES:
                runs = per_mode.get(mode, [])
                values = []
                for run in runs:
                    v = _value(run, field)
                    if v is not None:
                        values.append(v)
                        by_round.setdefault(run["round"], {})[mode] = v
                row["values"][mode] = statistics.median(values) if values else None
                row["runs"][mode] = len(values)
                errors = [r["error"] for r in runs if r.get("error")]
                if errors:
                    row["errors"][mode] = errors[0]
            base = row["values"].get("none")
            row["cost"] = {m: _cost(row["values"].get(m), base, higher) for m in MODES}
            # paired: the median over rounds of (mode / none of the same round), whose
            # runs followed one another, so slow phases of the machine cancel out
            row["paired_cost"] = {}
            for mode in MODES:
                costs = [_cost(vals.get(mode), vals.get("none"), higher)
                         for vals in by_round.values()]
                costs = [c for c in costs if c is not None]
                row["paired_cost"][mode] = statistics.median(costs) if costs else None
            if row["primary"]:
                c = row["cost"].get("tls")
                row["tls_within_target"] = None if c is None else c <= TARGET_RATIO
            rows.append(row)
    return rows


def print_rows(rows: list, args, rounds: int) -> None:
    names = {"map": f"map {args.tasks:,} no-op", "rt": f"submit().result() x{args.iterations}"}
    print(f"hot paths: e2e.py's workloads on LocalCluster(processes=True, security=...), "
          f"median of {rounds} round(s), modes interleaved")
    cols = ["workload", "cluster", "metric"] + [MODE_LABELS[m] for m in MODES] + \
        [f"{MODE_LABELS[m]} x" for m in MODES if m != "none"] + \
        [f"TLS+token <= {TARGET_RATIO:g}x", "paired token/TLS x", "runs"]
    lines = []
    last = None
    for r in rows:
        cell = (r["workload"], r["workers"])
        first = cell != last
        last = cell
        line = [names[r["workload"]] if first else "", f"{r['workers']}x1" if first else "",
                r["metric"]]
        for m in MODES:
            v = r["values"].get(m)
            line.append(format(v, r["fmt"]) if v is not None else
                        r["errors"].get(m, "-")[:30])
        line += [_x(r["cost"].get(m)) for m in MODES if m != "none"]
        if r["primary"]:
            within = r.get("tls_within_target")
            line.append({True: "yes", False: "NO", None: "-"}[within])
        else:
            line.append("")
        line.append(" / ".join(_x(r["paired_cost"].get(m)) for m in MODES if m != "none"))
        line.append("/".join(str(r["runs"][m]) for m in MODES) if r["primary"] else "")
        lines.append(line)
    _print_table(cols, lines, left=3, gap_at_col0=True)
    print("  x: cost relative to none (none's tasks/s / the mode's; the mode's ms or CPU / "
          "none's): 1.00x = free, higher = slower")
    print("  paired x: median over the rounds of the mode's cost relative to none's run "
          "of the same round")
    print("  CPU: user+sys (psutil, 10 ms ticks) per task; all = scheduler + workers + "
          "client; runs: none/token/tls runs without error")


# ====================================================================== shared


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _print_table(cols: list, lines: list, left: int = 1, gap_at_col0: bool = False) -> None:
    widths = [max(len(c), *(len(ln[i]) for ln in lines)) for i, c in enumerate(cols)]

    def fmt(line):
        return "  ".join(c.ljust(widths[i]) if i < left else c.rjust(widths[i])
                         for i, c in enumerate(line)).rstrip()

    print(fmt(cols))
    print("  ".join("-" * w for w in widths))
    for i, line in enumerate(lines):
        if gap_at_col0 and i and line[0]:
            print()
        print(fmt(line))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round instead of 5")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of the hot-path runs (default 5; --quick 1)")
    parser.add_argument("--tasks", type=int, default=20_000, help="map tasks (20,000)")
    parser.add_argument("--iterations", type=int, default=300,
                        help="submit().result() round trips (300)")
    parser.add_argument("--connects", type=int, default=200,
                        help="handshakes per mode (200)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds per run, cluster start included (300)")
    parser.add_argument("--only", choices=("handshake", "paths"), default=None,
                        help="run one part only")
    parser.add_argument("--no-save", action="store_true",
                        help="do not write benchmarks/results/security-cost-*.json")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    started = datetime.datetime.now()

    env, core_info, _ = e2e.core_env_and_info(argparse.Namespace(variant="auto",
                                                                  both_cores=False))
    try:  # as e2e.py's clusters: the installed package, else this checkout
        import distributed_server
    except ImportError:
        sys.path.insert(1, e2e.REPO)
        import distributed_server

    header = {"date": started.isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
              "python": platform.python_version(), "platform": platform.platform(),
              "distributed_core": core_info,
              "distributed_server": os.path.dirname(distributed_server.__file__),
              "versions": e2e.versions(), "quick": args.quick, "rounds": rounds,
              "tasks": args.tasks, "iterations": args.iterations, "connects": args.connects,
              "target_ratio": TARGET_RATIO,
              "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"security cost   {header['date']}{'   (--quick)' if args.quick else ''}")
    print(f"  machine   {header['cpu_count']} CPUs, {header['platform']}, Python "
          f"{header['python']}, load average "
          f"{'/'.join(f'{x:.1f}' for x in header['loadavg_at_start'])} at start")
    print(f"  dcore     distributed-core {core_info['version']}  COMPILED="
          f"{core_info['compiled']}  ({core_info['file']})")
    print("  modes     none = Security(); token = Security(token=new_token()); "
          "TLS + token = Security.temporary()", flush=True)
    doc: dict = {"header": header}

    if args.only != "paths":
        print()
        doc["handshake"] = asyncio.run(measure_handshakes(HANDSHAKE_MODES, args.connects))
        print_handshakes(doc["handshake"], args.connects)
    if args.only != "handshake":
        print(flush=True)
        raw = run_rounds(args, env, rounds)
        rows = build_rows(raw, args)
        doc["rows"] = rows
        doc["runs"] = [{"workload": c[0], "workers": c[1], "mode": m, **res}
                       for c, per_mode in raw.items() for m, results in per_mode.items()
                       for res in results]
        print_rows(rows, args, rounds)
        verdicts = [r.get("tls_within_target") for r in rows if r["primary"]]
        doc["tls_within_target"] = None if None in verdicts else all(verdicts)
        verdict = {True: "yes", False: "NO", None: "not measured"}[doc["tls_within_target"]]
        print(f"\nTLS + token within {TARGET_RATIO:g}x of no security on every row "
              f"(map 1x1, map 2x1, round trip): {verdict}")
    doc["header"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["elapsed_s"] = (datetime.datetime.now() - started).total_seconds()
    if not args.no_save:
        doc["saved_to"] = e2e.save_results("security-cost", doc, started, args.quick)
        print(f"\nresults: {doc['saved_to']}  (total {doc['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
