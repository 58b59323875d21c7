"""Where results should go: the plans behind retirement, replicate and rebalance.

Pure functions over the scheduler's state (read, never written): they take
`distributed_core` WorkerStates and TaskStates and return which worker should copy which
key. `retirement.py` carries the plans out through the core's stimuli. No I/O here.

Every choice is by bytes the scheduler counts (``WorkerState.nbytes``: the sizes of the
results a worker holds, as reported), not by process memory: deterministic, and the same
figure the scheduler places tasks by.
"""
from __future__ import annotations

import heapq

#: Recipients tried for one key before a retirement gives up on it (each a fresh one).
MAX_RECIPIENTS_PER_KEY = 3
#: Rebalance leaves alone workers within this fraction of the mean bytes (either side),
#: so results do not bounce between workers that are nearly even.
REBALANCE_HALF_GAP = 0.05


def unique_results(workers: list) -> dict:
    """``{WorkerState: [TaskState, ...]}``: the results that only ``workers`` hold (no
    worker outside them has a copy), each listed once, under one of its holders, largest
    first."""
    leaving = set(workers)
    out: dict = {}
    seen = set()
    for ws in workers:
        mine = []
        for ts in ws.has_what:
            if ts.key in seen or any(holder not in leaving for holder in ts.who_has):
                continue
            seen.add(ts.key)
            mine.append(ts)
        if mine:
            mine.sort(key=lambda ts: -ts.nbytes)
            out[ws] = mine
    return out


def spread(results: dict, recipients: list, tried: dict) -> tuple[dict, dict]:
    """Assign each result to a recipient: ``({recipient address: [key, ...]}, stuck)``.

    ``results`` is `unique_results`'s answer, ``recipients`` the WorkerStates that may take
    copies, ``tried`` ``{key: set of addresses that failed to copy it}``. Each key goes to
    the recipient holding the fewest bytes (counting what this plan gives it) that has not
    failed it; ``stuck`` is ``{sender WorkerState: [key, ...]}`` for keys with no
    recipient left (none at all, or `MAX_RECIPIENTS_PER_KEY` failed)."""
    plan: dict = {}
    stuck: dict = {}
    load = [(ws.nbytes, ws.address, ws) for ws in recipients]
    for sender, tasks in results.items():
        for ts in tasks:
            failed = tried.get(ts.key, ())
            if len(failed) >= MAX_RECIPIENTS_PER_KEY:
                stuck.setdefault(sender, []).append(ts.key)
                continue
            best = None
            for i, (nbytes, address, ws) in enumerate(load):
                if address in failed or ws in ts.who_has:
                    continue
                if best is None or (nbytes, address) < load[best][:2]:
                    best = i
            if best is None:
                stuck.setdefault(sender, []).append(ts.key)
                continue
            nbytes, address, ws = load[best]
            load[best] = (nbytes + max(ts.nbytes, 0), address, ws)
            plan.setdefault(address, []).append(ts.key)
    return plan, stuck


def replication(tasks: list, pool: list, n: int, branching_factor: int,
                tried: dict) -> dict:
    """One round of copies toward ``n`` holders of each task within ``pool``:
    ``{recipient address: [key, ...]}``.

    A key with fewer than ``n`` holders in the pool gets at most ``branching_factor``
    new copies per holder it has (a tree: the copies of one round are sources in the
    next), on the pool's workers holding the fewest bytes that do not hold it and have
    not failed it (``tried``)."""
    plan: dict = {}
    load = {ws: ws.nbytes for ws in pool}
    for ts in tasks:
        holders = ts.who_has or ()
        missing = n - sum(1 for ws in holders if ws in load)
        if missing <= 0:
            continue
        failed = tried.get(ts.key, ())
        candidates = sorted((ws for ws in load if ws not in holders and ws.address not in failed),
                            key=lambda ws: (load[ws], ws.address))
        for ws in candidates[:min(missing, branching_factor * len(holders))]:
            load[ws] += max(ts.nbytes, 0)
            plan.setdefault(ws.address, []).append(ts.key)
    return plan


def surplus_holders(tasks: list, pool: list, n: int) -> dict:
    """``{address: [key, ...]}``: the copies past ``n`` in the pool to drop (from the
    holders with the most bytes); never a key's last copy."""
    members = set(pool)
    drop: dict = {}
    for ts in tasks:
        holders = sorted((ws for ws in ts.who_has or () if ws in members),
                         key=lambda ws: (-ws.nbytes, ws.address))
        for ws in holders[:max(len(holders) - n, 0)]:
            drop.setdefault(ws.address, []).append(ts.key)
    return drop


def rebalance(pool: list, keys: set | None = None) -> list:
    """``[(sender, recipient, TaskState), ...]``: moves that bring every worker of the
    pool toward the mean of the bytes they hold.

    Workers more than `REBALANCE_HALF_GAP` of the mean above it send, those as far below
    it receive. Repeatedly the sender farthest above the mean gives its largest result
    that takes neither it more than that gap below the mean nor its recipient more than
    the gap above it, to the recipient farthest below the mean that does not hold it
    already (so replication never drops). Both stop once within the gap of the mean.
    Only ``keys``, if given. A simplification of dask's rebalance, which measures process
    memory and takes the least recently inserted result first."""
    if not pool:
        return []
    mean = sum(ws.nbytes for ws in pool) // len(pool)
    half_gap = int(REBALANCE_HALF_GAP * mean)
    senders = []  # (-bytes it may still give, address, ws, its results largest first)
    recipients = []  # (-bytes it may still take, address, ws)
    for ws in pool:
        if ws.nbytes >= mean + half_gap and ws.nbytes > mean and ws.has_what:
            tasks = sorted((ts for ts in ws.has_what if keys is None or ts.key in keys),
                           key=lambda ts: -ts.nbytes)
            senders.append((mean - ws.nbytes, ws.address, ws, tasks))
        elif ws.nbytes < mean - half_gap:
            recipients.append((ws.nbytes - mean, ws.address, ws))
    heapq.heapify(senders)
    heapq.heapify(recipients)
    moves = []
    while senders and recipients:
        give, address, sender, tasks = senders[0]
        moved = None
        for i, ts in enumerate(tasks):
            if ts.nbytes + give > half_gap:
                continue  # it would take the sender too far below the mean
            skipped = []
            while recipients and moved is None:
                take, _, recipient = recipients[0]
                if ts.nbytes + take > half_gap:
                    break  # the neediest recipient cannot take it: none can
                heapq.heappop(recipients)
                if recipient in ts.who_has:
                    skipped.append((take, recipient.address, recipient))
                else:
                    moved = (i, recipient, take)
            for entry in skipped:
                heapq.heappush(recipients, entry)
            if moved is not None:
                break
        if moved is None:
            heapq.heappop(senders)  # nothing more it can give
            continue
        i, recipient, take = moved
        ts = tasks.pop(i)
        moves.append((sender, recipient, ts))
        give += ts.nbytes
        take += ts.nbytes
        if give + half_gap < 0 and tasks:
            heapq.heapreplace(senders, (give, address, sender, tasks))
        else:
            heapq.heappop(senders)
        if take + half_gap < 0:
            heapq.heappush(recipients, (take, recipient.address, recipient))
    return moves
