"""logfmt: kvgate's log line formats: ``text`` for people, ``json`` for log pipelines.

A JSON line is one object: ``time`` (RFC 3339, UTC, milliseconds, ``Z``), ``level``,
``logger``, ``message``, and ``exception`` (the formatted traceback) when there is one.
"""

from __future__ import annotations

import logging
import time

import orjson

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """JsonFormatter writes each record as one JSON object on one line, timestamps in UTC."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        millis = int((record.created - seconds) * 1000)
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


class UtcTextFormatter(logging.Formatter):
    """UtcTextFormatter is the text format with its times in UTC (``...Z``)."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def configure(level: str, fmt: str) -> None:
    """configure sends every log record at ``level`` or above to stderr in format ``fmt`` (FORMATS)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else UtcTextFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
