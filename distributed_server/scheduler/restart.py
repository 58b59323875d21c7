"""The scheduler's restart (``Client.restart``) and the nannies it goes through.

Nannies (`distributed_server.deploy.nanny`) connect with the role ``"nanny"`` and keep the
scheduler told which workers they supervise (``nanny-workers``; any other op but
``heartbeat`` closes the nanny's connection). A client's ``restart`` forgets every task
(the core's ``restart`` stimulus, in slices: each client is told its keys were
cancelled), asks every nanny to restart its workers (``restart-workers``), and answers
once as many workers as before have registered again, or after the request's timeout. It
is refused, with nothing changed, while any worker has no nanny (it could not come back),
and while another restart is under way.

`RestartService` holds the nanny registry and counts worker registrations (a restart
waits for workers that joined after it began); the `Scheduler` routes the role
``"nanny"`` to `RestartService.serve_nanny`, the client op ``restart`` (`OPS`) to
`RestartService.handle`, and tells it when a worker joins or leaves.
"""
from __future__ import annotations

import asyncio
import itertools
import logging

from distributed_core import bounded_repr

from .streams import MessageError, read_loop, refuse, require, send_quietly

__all__ = ["MAX_NANNY_WORKERS", "NANNY_GRACE_SECONDS", "OPS", "RestartService",
           "nanny_workers"]

logger = logging.getLogger("distributed_server.scheduler")

#: The client requests this module answers.
OPS = ("restart",)
#: A restart waits this long for the nannies of workers that joined a moment ago to say
#: they supervise them (a nanny learns its worker's address after the worker registered).
NANNY_GRACE_SECONDS = 2.0
#: Most worker addresses one nanny may name.
MAX_NANNY_WORKERS = 4096


class RestartService:
    """Restarts every worker of a `Scheduler` through its nanny, for a client.

    ``nanny_comms`` (nanny id -> Comm) and ``nanny_workers`` (nanny id -> tuple of the
    worker addresses it runs) are the nanny registry; ``under_way`` is True from the
    moment a restart is accepted until it is answered."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.nanny_comms: dict = {}  # nanny id -> Comm
        self.nanny_workers: dict = {}  # nanny id -> tuple of the worker addresses it runs
        self.under_way = False
        self._registrations = 0  # workers registered so far (a restart counts new ones)
        self._joined: dict = {}  # worker address -> its registration number
        self._workers_changed = asyncio.Event()  # set when a worker or a nanny comes or goes
        self._waits: set = set()  # the running waits for the workers to come back

    # ------------------------------------------------------------------ workers, nannies

    def worker_joined(self, address: str) -> None:
        """A worker registered (a restart under way may be waiting for it)."""
        self._registrations += 1
        self._joined[address] = self._registrations
        self._workers_changed.set()

    def worker_left(self, address: str) -> None:
        """A worker is gone."""
        self._joined.pop(address, None)
        self._workers_changed.set()

    def supervised(self) -> set:
        """The addresses of the workers some nanny says it runs."""
        return {address for workers in self.nanny_workers.values() for address in workers}

    def workers_without_nanny(self) -> list:
        """The registered workers no nanny runs, sorted."""
        supervised = self.supervised()
        return sorted(address for address in self.scheduler.state.workers
                      if address not in supervised)

    async def serve_nanny(self, comm, nanny_id: str) -> None:
        """Serve a nanny's connection (handshake role ``"nanny"``) until it leaves."""
        try:
            workers = nanny_workers(comm.extra.get("workers", ()))
        except MessageError as exc:
            logger.warning("refusing nanny from %s: %s", comm.peer_address, exc)
            await refuse(comm, str(exc))
            return
        self.nanny_comms[nanny_id] = comm
        self.nanny_workers[nanny_id] = workers
        self._workers_changed.set()
        logger.info("nanny %s (pid %s) connected from %s", nanny_id,
                    bounded_repr(comm.extra.get("pid"), 20), comm.peer_address)
        try:
            await read_loop(comm, nanny_id, self._handle_nanny_batch)
        finally:
            del self.nanny_comms[nanny_id]
            del self.nanny_workers[nanny_id]
            logger.info("nanny %s left", nanny_id)

    def _handle_nanny_batch(self, nanny_id: str, msgs: list) -> None:
        """A nanny only says which workers it runs (or that it is alive)."""
        for msg in msgs:
            op = msg["op"]
            if op == "nanny-workers":
                self.nanny_workers[nanny_id] = nanny_workers(msg.get("workers"))
                self._workers_changed.set()
            elif op != "heartbeat":
                raise MessageError(f"unknown operation {bounded_repr(op, 60)} from "
                                   f"{nanny_id}")

    # ------------------------------------------------------------------ restart

    def handle(self, client_id: str, msg: dict):
        """``restart {timeout, reqid}``: forget every task, restart every worker through
        its nanny, answer once as many workers as before are back (or at the timeout).

        The client's later messages are handled after the tasks are forgotten (while the
        nannies of just-joined workers are awaited, its batch waits); the wait for the
        workers to come back runs in the background."""
        reqid, timeout = msg.get("reqid"), msg.get("timeout", 30.0)
        if type(timeout) not in (int, float) or not 0 < timeout < 1e6:
            self.scheduler.reply_failure(client_id, reqid, f"restart: timeout must be a "
                                          f"positive number, not {bounded_repr(timeout)}")
            return None
        if self.under_way:
            self.scheduler.reply_failure(client_id, reqid,
                                          "restart: a restart is already under way")
            return None
        self.under_way = True
        return self._begin(client_id, reqid, float(timeout))

    async def _begin(self, client_id: str, reqid, timeout: float) -> None:
        scheduler = self.scheduler
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            grace_end = started + min(NANNY_GRACE_SECONDS, timeout)
            while self.workers_without_nanny() and loop.time() < grace_end:
                await asyncio.sleep(0.02)
            orphans = self.workers_without_nanny()
            if orphans:
                text = (f"restart refused: {len(orphans)} worker(s) have no nanny to restart "
                        f"them: {', '.join(orphans[:10])}{' ...' if len(orphans) > 10 else ''}"
                        " (started with --no-nanny, or in a LocalCluster(processes=False)); "
                        "nothing was changed")
                logger.warning("%s (asked by client %s)", text, client_id)
                scheduler.reply_failure(client_id, reqid, text)
                self.under_way = False
                return
            n_before, mark = len(scheduler.state.workers), self._registrations
            forgotten = await self._forget_everything(client_id)
            scheduler.coordination_service.keys_lost()
            if not forgotten:
                scheduler.reply_failure(client_id, reqid, "restart: the scheduler could not "
                                                           "forget its tasks (see its log)")
                self.under_way = False
                return
            logger.info("restarting %d workers through %d nannies (asked by client %s)",
                        n_before, len(self.nanny_comms), client_id)
            for comm in self.nanny_comms.values():
                send_quietly(comm, {"op": "restart-workers",
                                    "reason": f"Client.restart by {client_id}"})
        except BaseException:
            self.under_way = False
            raise
        task = loop.create_task(self._wait(client_id, reqid, n_before, mark, started,
                                           timeout))
        self._waits.add(task)
        task.add_done_callback(self._waits.discard)

    async def _forget_everything(self, client_id: str) -> bool:
        """The core's restart in slices of ``slice_keys`` wanted keys, one stimulus
        each, serving every other peer in between; the last call takes whatever is left
        (work other clients submit meanwhile is forgotten too)."""
        scheduler = self.scheduler
        state = scheduler.state
        wanted = sum(len(cs.wants_what) for cs in state.clients.values())
        last = wanted // scheduler.slice_keys + 10  # then one call without a limit
        for i in itertools.count():
            final = i >= last
            if not scheduler.stimulus(client_id, "restart", state.restart,
                                       max_keys=None if final else scheduler.slice_keys):
                return False
            if final or not state.tasks:
                return True
            await asyncio.sleep(0)
        return False  # not reached

    async def _wait(self, client_id: str, reqid, n_before: int, mark: int,
                    started: float, timeout: float) -> None:
        """Wait until every registered worker joined after the restart began and there
        are as many as before; then answer the client."""
        state = self.scheduler.state
        loop = asyncio.get_running_loop()
        deadline = started + timeout
        try:
            while True:
                fresh = sum(self._joined.get(address, 0) > mark for address in state.workers)
                if fresh == len(state.workers) and fresh >= n_before:
                    status = "OK"
                    break
                if loop.time() >= deadline:
                    status = "timed-out"
                    break
                self._workers_changed.clear()
                try:
                    await asyncio.wait_for(self._workers_changed.wait(),
                                           deadline - loop.time())
                except asyncio.TimeoutError:
                    pass
        finally:
            self.under_way = False
        seconds = loop.time() - started
        log = logger.info if status == "OK" else logger.warning
        log("restart %s after %.2f s: %d of %d workers are back", status, seconds, fresh,
            n_before)
        self.scheduler.reply(client_id, {"reqid": reqid},
                              {"status": status, "workers": fresh, "expected": n_before,
                               "seconds": seconds})


def nanny_workers(workers) -> tuple:
    """Check a nanny's list of worker addresses."""
    require(isinstance(workers, (list, tuple)) and len(workers) <= MAX_NANNY_WORKERS
            and all(isinstance(a, str) and len(a) <= 1000 for a in workers),
            f"a nanny's 'workers' must be a list of at most {MAX_NANNY_WORKERS} addresses, "
            f"not {bounded_repr(workers, 100)}")
    return tuple(workers)
