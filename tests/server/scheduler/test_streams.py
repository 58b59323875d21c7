"""The scheduler's read loop gives every other peer its turn.

A peer that sends faster than the scheduler handles its messages leaves frames buffered:
reading one then completes without suspending, so a read loop that only yields inside a
batch would hold the event loop for the whole backlog. These drive `read_loop` with a
comm whose frames are always ready and check, by order of events (not by timing), that
other work runs between its frames once a turn is over.
"""
import asyncio
import time

import pytest

from distributed_server.comm import CommClosedError
from distributed_server.scheduler.streams import LoopTurn, read_loop

pytestmark = pytest.mark.timeout(60)


class BufferedComm:
    """A comm with ``n`` frames already buffered: ``read`` never suspends."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.aborted = False

    async def read(self):
        if self.left == 0:
            raise CommClosedError("no more frames")
        self.left -= 1
        return [{"op": "work"}]

    def abort(self) -> None:
        self.aborted = True


def test_a_backlog_of_frames_gives_way_between_frames():
    events = []

    def handle(peer, msgs):
        time.sleep(0.001)  # a millisecond of work per frame
        events.append("frame")

    async def main():
        async def other_peer():
            events.append("other")

        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(other_peer()))
        await read_loop(BufferedComm(200), "flood", handle)

    asyncio.run(main())
    assert events.count("frame") == 200
    # one turn is a few frames of a millisecond each; the other peer ran long before the
    # backlog was through
    assert "other" in events[:50]


def test_a_batch_handled_in_turns_is_awaited_before_the_next_frame():
    events = []

    async def handle_in_turns(peer, msgs):
        events.append("start")
        await asyncio.sleep(0)
        events.append("end")

    async def main():
        await read_loop(BufferedComm(3), "peer", lambda p, m: handle_in_turns(p, m))

    asyncio.run(main())
    assert events == ["start", "end"] * 3


def test_a_turn_runs_out_and_a_new_one_starts_after_giving_way():
    turn = LoopTurn(seconds=0.01)

    async def main():
        assert not turn.over()
        time.sleep(0.02)
        assert turn.over()
        await turn.give_way()
        assert not turn.over()

    asyncio.run(main())
    assert turn.yields == 1


def test_after_the_loop_idled_a_new_turn_starts_without_giving_way():
    """A request that reaches an idle scheduler is answered without an extra loop
    iteration: the turn began when the loop last turned, not at the last give_way."""
    turn = LoopTurn(seconds=0.005)

    async def main():
        assert not turn.over()
        await asyncio.sleep(0.02)  # the loop idles, well past the turn's end
        assert not turn.over()

    asyncio.run(main())
    assert turn.yields == 0
