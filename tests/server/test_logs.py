"""distributed_server.logs: the in-memory buffer of recent lines and log level names."""
import logging

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
