"""One log line per event: ``key=value`` text, or the same fields as one JSON object."""

from __future__ import annotations

import json
import logging

import pytest

from shared.logs import JSONFormatter, configure_logging


def record(message: str, *args) -> logging.LogRecord:
    return logging.LogRecord("cleave.router", logging.INFO, __file__, 1, message, args, None)


def test_json_line_carries_the_event_and_its_fields():
    line = JSONFormatter().format(
        record("request request_id=%s method=POST status=%d error=%r", "cmpl-1", 400, "bad value")
    )
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["event"] == "request" and entry["level"] == "info" and entry["logger"] == "cleave.router"
    assert (entry["request_id"], entry["method"], entry["status"], entry["error"]) == (
        "cmpl-1",
        "POST",
        "400",
        "bad value",
    )
    assert entry["ts"].endswith("Z")


def test_json_line_keeps_a_traceback_on_one_line():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "request_failed request_id=r1", (), sys.exc_info())
    line = JSONFormatter().format(rec)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exc_info"]


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="text, json"):
        configure_logging("info", "xml")
