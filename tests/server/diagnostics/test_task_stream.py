"""TaskStream and LoopLagMonitor on their own: bounded, cheap, numbered, and honest about
odd input."""
import asyncio
import time

import pytest

from distributed_server.diagnostics import task_stream
from distributed_server.diagnostics.loop_lag import LoopLagMonitor
from distributed_server.diagnostics.task_stream import TaskStream


def reports(n, start=0):
    return [{"key": f"t-{i}", "start": 10.0 + i, "stop": 10.5 + i}
            for i in range(start, start + n)]


def test_entries_are_numbered_and_read_after_a_number():
    stream = TaskStream()
    stream.record("w1", reports(3), True)
    stream.record("w2", reports(1, 3), False)
    entries, next_seq, skipped = stream.after(0)
    assert [tuple(e) for e in entries] == [
        (0, "t-0", "w1", 10.0, 10.5, True), (1, "t-1", "w1", 11.0, 11.5, True),
        (2, "t-2", "w1", 12.0, 12.5, True), (3, "t-3", "w2", 13.0, 13.5, False)]
    assert (next_seq, skipped) == (4, 0)
    assert stream.after(4) == ([], 4, 0)
    assert [e.seq for e in stream.after(2)[0]] == [2, 3]


def test_a_reader_gets_the_newest_entries_within_its_limit_and_learns_what_it_missed():
    stream = TaskStream()
    stream.record("w", reports(10), True)
    entries, next_seq, skipped = stream.after(0, limit=3)
    assert [e.seq for e in entries] == [7, 8, 9] and (next_seq, skipped) == (10, 7)


def test_the_stream_is_bounded_and_old_entries_fall_off():
    stream = TaskStream(maxlen=5)
    stream.record("w", reports(12), True)
    assert len(stream) == 5 and stream.total == 12
    entries, next_seq, skipped = stream.after(0)
    assert [e.seq for e in entries] == [7, 8, 9, 10, 11] and skipped == 7
    assert stream.after(100) == ([], 12, 0)  # a number from the future: nothing, resync


def test_entries_with_odd_times_are_not_shown():
    stream = TaskStream()
    stream.record("w", [{"key": "a", "start": "x", "stop": 1.0},
                        {"key": "b", "start": float("nan"), "stop": 1.0},
                        {"key": "c"},
                        {"key": "d", "start": 5, "stop": 4},
                        {"key": "e", "start": 10**400, "stop": 1.0}], True)
    (entry,) = stream.after(0)[0]
    assert tuple(entry) == (3, "d", "w", 5.0, 5.0, True)  # stop before start: clamped
    stream.pack()
    assert [tuple(e) for e in stream.after(0)[0]] == [(3, "d", "w", 5.0, 5.0, True)]


def test_a_window_holds_the_tasks_that_ran_in_it():
    stream = TaskStream()
    stream.record("w", reports(100), True)
    window = stream.window(50.0, 52.0)
    assert [e[1] for e in window] == ["t-40", "t-41", "t-42"]  # t-39 ended at 49.5
    assert len(stream.window()) == 100 and len(stream.window(limit=7)) == 7


def test_maxlen_must_be_positive():
    with pytest.raises(ValueError):
        TaskStream(maxlen=0)


def test_recording_costs_about_one_append_per_task():
    stream = TaskStream()
    batch = reports(1000)
    started = time.perf_counter()
    for _ in range(100):
        stream.record("w", batch, True)
    per_task = (time.perf_counter() - started) / 100_000
    assert per_task < 5e-6, per_task  # measured ~0.1 us; loose for loaded machines


def test_loop_lag_sees_a_blocked_loop():
    async def main():
        monitor = LoopLagMonitor(interval=0.01)
        monitor.start()
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # the loop is blocked: the probe fires late
        await asyncio.sleep(0.05)
        monitor.stop()
        assert monitor.recent_max >= 0.15 and monitor.count >= 3
        assert monitor.total >= monitor.recent_max
        histogram = dict(monitor.cumulative())
        assert histogram[float("inf")] == monitor.count
        assert histogram[0.1] <= monitor.count - 1  # the blocked probe: over 100 ms late
        assert list(histogram.values()) == sorted(histogram.values())

    asyncio.run(main())


def test_a_sample_spreads_evenly_over_what_a_reader_missed():
    stream = TaskStream()
    stream.record("w", reports(100), True)
    entries, next_seq, skipped = stream.after(0, limit=4, sample=True)
    assert [e.seq for e in entries] == [24, 49, 74, 99] and (next_seq, skipped) == (100, 96)
    assert [e.seq for e in stream.after(98, limit=4, sample=True)[0]] == [98, 99]


class CountingUnpacks:
    """Counts the packed keys a read unpacks."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = task_stream._unpack_key

        def counting(blob, ends, i):
            self.count += 1
            return real(blob, ends, i)

        monkeypatch.setattr(task_stream, "_unpack_key", counting)


def test_after_wrap_around_a_read_returns_the_right_entries():
    """Batches of every size, some crossing the ring's end or larger than the ring: each
    read answers what a list of every entry ever recorded answers."""
    import random

    rng = random.Random(12)
    maxlen = 7
    stream = TaskStream(maxlen=maxlen)
    recorded = []  # (key, start) of every entry, by sequence number
    for round_ in range(200):
        n = rng.choice([0, 1, 2, 3, 6, 7, 8, 15])
        batch = reports(n, len(recorded))
        stream.record("w", batch, True)
        recorded += [(r["key"], r["start"]) for r in batch]
        if rng.random() < 0.25:  # as before a trim: packs part of a chunk
            stream.pack()
        total = len(recorded)
        assert stream.total == total and len(stream) == min(total, maxlen)
        held = list(range(max(total - maxlen, 0), total))
        for seq in (0, total - 3, total - 1, total, total + 5):
            for limit, sample in ((1000, False), (2, False), (3, True), (1, True), (0, True)):
                entries, next_seq, skipped = stream.after(seq, limit, sample)
                wanted = [s for s in held if s >= seq]
                if sample and 0 < limit < len(wanted):
                    step = -(-len(wanted) // limit)
                    expected = wanted[::-1][::step][::-1]
                else:
                    expected = wanted[len(wanted) - min(limit, len(wanted)):]
                assert [e.seq for e in entries] == expected, (round_, seq, limit, sample)
                assert [(e[1], e[3]) for e in entries] == [recorded[s] for s in expected]
                assert next_seq == total
                assert skipped == max(total - max(seq, 0), 0) - len(expected)
        window = stream.window()
        assert [e.seq for e in window] == held
        assert [e[1] for e in window] == [recorded[s][0] for s in held]


def test_a_sample_after_wrap_around_unpacks_only_the_keys_it_returns(monkeypatch):
    """100 entries sampled from the last 100,000 of a ring that has wrapped unpack 100
    keys, one each: a read costs what it returns, not what was recorded."""
    stream = TaskStream(maxlen=100_000)
    batch = reports(1000)
    for _ in range(250):  # 250,000 entries: the ring wrapped twice and a half
        stream.record("w", batch, True)
    unpacks = CountingUnpacks(monkeypatch)
    entries, next_seq, skipped = stream.after(150_000, limit=100, sample=True)
    assert unpacks.count == sum(e.seq < stream._base for e in entries) >= 99
    assert len(entries) == 100
    assert [e.seq for e in entries] == list(range(150_999, 250_000, 1000))
    assert (next_seq, skipped) == (250_000, 99_900)
    assert entries[-1][1] == "t-999" and entries[0][1] == "t-999"  # each batch's last
    unpacks.count = 0
    entries = stream.after(0, limit=5)[0]
    assert [e.seq for e in entries] == list(range(249_995, 250_000))
    assert unpacks.count == sum(e.seq < stream._base for e in entries)


def test_no_report_is_held_and_packed_entries_read_as_they_came():
    """No report is held (its fields are taken when it comes); once packed (a full
    chunk, or `pack` before a trim) not even its key is: the entries are in a few large
    buffers, and read back with their keys' own types."""
    import sys

    keys = ["plain", ("x", 1, 2), b"raw", 7, ("nested", ("a", 0))]
    batch = [{"key": key, "start": 1.0 + i, "stop": 2.0 + i} for i, key in enumerate(keys)]
    held = [sys.getrefcount(msg) for msg in batch]
    held_keys = [sys.getrefcount(key) for key in keys]
    stream = TaskStream()
    stream.record("w", batch, True)
    assert [sys.getrefcount(msg) for msg in batch] == held
    assert [sys.getrefcount(key) for key in keys] == [n + 1 for n in held_keys]
    stream.pack()
    assert [sys.getrefcount(key) for key in keys] == held_keys
    stream.record("w2", [{"key": "after", "start": 9.0, "stop": 9.5}], False)
    stream.pack()  # merges into the chunk packed before
    entries = stream.after(0)[0]
    assert [e[1] for e in entries] == keys + ["after"]
    assert [type(e[1]) for e in entries] == [type(k) for k in keys] + [str]
    assert [(e[2], e[3], e[5]) for e in entries] == [("w", 1.0 + i, True)
                                                     for i in range(5)] + [("w2", 9.0, False)]


def test_keys_msgpack_cannot_carry_are_kept_as_they_are():
    class Odd:
        pass

    odd = Odd()
    stream = TaskStream(maxlen=4)
    stream.record("w", [{"key": odd, "start": 1.0, "stop": 2.0}] * 6, True)
    assert [e[1] for e in stream.after(0)[0]] == [odd] * 4


def test_keys_that_are_not_str_are_found_when_first_read(monkeypatch):
    """A chunk of tuple keys is packed without where each key ends; the first read in
    it finds them (once) and unpacks only the key it returns."""
    stream = TaskStream(maxlen=4096)
    batch = [{"key": ("x", i), "start": 1.0, "stop": 2.0} for i in range(3000)]
    stream.record("w", batch, True)
    packed = stream._base // stream.chunk
    assert packed == 2 and stream._key_ends[:packed] == [None, None]
    unpacks = CountingUnpacks(monkeypatch)
    entries = stream.after(1030, limit=1, sample=True)[0]
    assert [(e.seq, e[1]) for e in entries] == [(2999, ("x", 2999))]
    assert unpacks.count == 0 and stream._key_ends[:packed] == [None, None]  # open
    first = stream._raw(1030)
    ends = stream._key_ends[1]
    assert first[0] == ("x", 1030) and ends is not None and stream._key_ends[0] is None
    assert stream._raw(2047)[0] == ("x", 2047) and stream._key_ends[1] is ends
    assert unpacks.count == 2
    assert [e[1] for e in stream.window()] == [("x", i) for i in range(3000)]


@pytest.mark.parametrize("keys", [
    [f"noop-{'ab' * 16}-{i}" for i in range(300)],  # a map's: all but the digits shared
    [f"x-{i}" if i % 2 else f"y-{i}" for i in range(300)],  # only "" shared
    ["same-a", "other", "same-b"],  # first and last share more than the middle does
    ["only"],
    ["", "a", ""],
    ["nul\0inside", "nul\0too"],  # goes the msgpack way
    [("dask", 1), ("dask", 2), "mixed"],
])
def test_packed_keys_and_workers_read_back_as_they_were(keys):
    stream = TaskStream(maxlen=1_000)
    stream.chunk = len(keys)  # one chunk, sealed when full
    workers = [f"tcp://w{i % 3}" for i in range(len(keys))]
    for i, key in enumerate(keys):
        stream.record(workers[i], [{"key": key, "start": 1.0, "stop": 2.0}], True)
    assert stream._base == len(keys)  # packed
    for squeezed in (False, True):
        assert stream._squeezed[0] == squeezed
        assert [(e.seq, e[1], e[2]) for e in stream.after(0)[0]] == \
            [(i, key, workers[i]) for i, key in enumerate(keys)]
        assert [(e[1], e[2]) for e in stream.window()] == list(zip(keys, workers))
        stream.squeeze()


def test_the_last_100_000_entries_of_a_map_cost_under_11_bytes_each():
    """Keys that share all but their last digits are held once with their prefix, then
    compressed; workers as an index byte each, the times (16 bytes an entry) compressed."""
    import sys

    stream = TaskStream()
    prefix = "noop-" + "0123456789abcdef" * 2 + "-"
    started = 1_796_489_026.0
    for first in range(0, 300_000, 500):
        batch = [{"key": f"{prefix}{i}", "start": started + i * 4.1e-5 + (i * 7919 % 97) * 1e-7,
                  "stop": started + i * 4.1e-5 + 1e-5 + (i * 104_729 % 89) * 3e-7}
                 for i in range(first, first + 500)]
        stream.record(f"tcp://127.0.0.1:{40_000 + first % 2}", batch, True)
    expected = [tuple(entry) for entry in stream.after(0, limit=300_000)[0]]
    stream.squeeze(stream._slots)
    held = sum(sys.getsizeof(part) for column in (stream._keys, stream._key_ends,
                                                   stream._workers, stream._times,
                                                   stream._ok)
               for part in column if part is not None)
    assert held / len(stream) < 11, held / len(stream)
    assert [tuple(entry) for entry in stream.after(0, limit=300_000)[0]] == expected
    assert stream.window(stop=expected[500][4]) == [
        entry for entry in expected if entry[3] <= expected[500][4]]


def test_squeeze_takes_a_few_chunks_a_call_and_more_entries_unsqueeze_a_chunk(monkeypatch):
    monkeypatch.setattr(task_stream, "CHUNK", 10)
    stream = TaskStream(maxlen=100)
    for i in range(95):
        stream.record("w", [{"key": f"k-{i}", "start": 1.0, "stop": 2.0}], True)
    stream.pack()  # the open 5 sealed into chunk 9: packing squeezes nothing
    assert not any(stream._squeezed)
    stream.squeeze(3)  # chunks 9, 8, 7
    assert [c for c in range(10) if stream._squeezed[c]] == [7, 8, 9]
    stream.squeeze(100)
    assert all(stream._squeezed[c] for c in range(10))
    stream.record("w", [{"key": "k-95", "start": 1.0, "stop": 2.0}], True)
    stream.pack()  # chunk 9 packed anew, with its squeezed part: not squeezed
    assert not stream._squeezed[9] and stream._squeezed[8]
    assert [e[1] for e in stream.after(0)[0]] == [f"k-{i}" for i in range(96)]
