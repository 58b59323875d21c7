"""distributed_server.logs: the in-memory buffer of recent lines and log level names."""
import logging
import sys

import pytest

from distributed_server import logs


def test_the_buffer_keeps_only_the_most_recent_lines_formatted():
    buffer = logs.LogBuffer(capacity=3)
    logger = logging.getLogger("test_logs.bounded")
    logger.addHandler(buffer)
    logger.setLevel(logging.INFO)
    try:
        for i in range(10):
            logger.info("line %d", i)
    finally:
        logger.removeHandler(buffer)
    lines = buffer.recent()
    assert [line.rsplit(" ", 1)[1] for line in lines] == ["7", "8", "9"]
    assert all(" INFO line " in line for line in lines)
    assert buffer.recent(1) == lines[-1:] and buffer.recent(0) == []


def test_packed_lines_come_back_as_they_went_in_across_chunks():
    packed = logs.PackedLines(capacity=1_000)
    odd = ["", "two\nlines", "ünïcödé ✓", "lone \udc80 surrogate", "x" * 40_000]
    sent = [f"line {i}" for i in range(700)] + odd + [f"tail {i}" for i in range(600)]
    for line in sent:
        packed.append(line)
    assert packed.recent() == sent[-1_000:]
    assert packed.recent(3) == sent[-3:]
    assert len(packed._chunks) < 10  # old chunks fell out


def test_packed_lines_keep_at_most_a_chunk_more_than_asked():
    packed = logs.PackedLines(capacity=100)
    for i in range(10_000):
        packed.append(f"a line of the log, number {i}")
    assert packed.recent() == [f"a line of the log, number {i}" for i in range(9_900, 10_000)]
    kept = packed._counts[1] + packed._counts[2]
    assert 100 <= kept <= 100 + packed.CHUNK_LINES


def test_kept_lines_leave_no_small_objects_behind():
    # each one would hold a 1 MiB arena of the small-object allocator from the system
    packed = logs.PackedLines(capacity=10_000)
    for i in range(3_000):
        packed.append(f"warm-up line {i}")
    before = sys.getallocatedblocks()
    for i in range(3_000):
        packed.append(f"a line {i} that stays in the buffer")
    assert sys.getallocatedblocks() - before < 100


def test_a_failing_message_does_not_break_the_caller():
    buffer = logs.LogBuffer()
    buffer.handleError = lambda record: None  # what logging does: report, carry on
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%d", ("not a number",), None)
    buffer.handle(record)
    assert buffer.recent() == []


@pytest.mark.parametrize("name, level", [("info", logging.INFO), ("Warning", logging.WARNING),
                                         ("DEBUG", logging.DEBUG), ("15", 15)])
def test_log_levels_are_names_in_any_case_or_numbers(name, level):
    assert logs.level_of(name) == level


def test_an_unknown_log_level_names_the_choices():
    with pytest.raises(ValueError, match="unknown log level 'loud': use one of CRITICAL"):
        logs.level_of("loud")
