"""Log setup shared by the router and the workers: one line per event.

Events are logged as ``event key=value ...`` (a request's lines carry
``request_id=``). ``--log-format text`` (default) prints them after a
timestamp, level and logger name; ``--log-format json`` prints one JSON object
per line with the ``key=value`` pairs as fields, for log shippers.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_FIELD = re.compile(r"""(\w+)=('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\S+)""")


class JSONFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "event", "message", <key=value fields>, "exc_info"?}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        created = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry: dict[str, object] = {
            "ts": f"{created}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": message.split(" ", 1)[0] if message else "",
            "message": message,
        }
        for key, value in _FIELD.findall(message):
            entry.setdefault(key, value[1:-1] if value[:1] in "'\"" else value)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Root logger to stderr at ``level`` in ``log_format`` (replaces earlier handlers)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
