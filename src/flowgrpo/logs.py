"""Structured logging: one JSON object per line on stderr, or aligned text for a terminal.

Every line names its service and replica, and carries the trace and span ids of the span active
when it was logged, so a log line of a slow step leads to its trace. Fields passed with
``extra={...}`` become keys of the JSON object (``log.info("step done", extra={"step": 3})``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.trace import format_span_id, format_trace_id

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class _Formatter(logging.Formatter):
    """Base of the two formats: the fields of one record, extras and trace ids included."""

    def __init__(self, service: str, replica_id: str) -> None:
        super().__init__()
        self.service = service
        self.replica_id = replica_id

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "time": _iso_time(record.created),
            "level": record.levelname,
            "service": self.service,
            "replica": self.replica_id,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS})
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = format_trace_id(span.trace_id)
            entry["span_id"] = format_span_id(span.span_id)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return entry


class JsonFormatter(_Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(self.fields(record), default=str)


class TextFormatter(_Formatter):
    """``time level service/replica logger: message key=value ...`` with the traceback below."""

    def format(self, record: logging.LogRecord) -> str:
        entry = self.fields(record)
        head = (
            f"{entry.pop('time')} {entry.pop('level'):<7} {entry.pop('service')}/{entry.pop('replica')} "
            f"{entry.pop('logger')}: {entry.pop('message')}"
        )
        exception = entry.pop("exception", None)
        tail = "".join(f" {key}={value}" for key, value in entry.items())
        return head + tail + (f"\n{exception}" if exception else "")


_FORMATTERS: dict[str, type[_Formatter]] = {"json": JsonFormatter, "text": TextFormatter}


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler this module installed, so a second setup replaces it."""


def setup_logging(
    service: str, replica_id: str = "", level: str | int = "INFO", fmt: Literal["json", "text"] = "json"
) -> None:
    """Send the root logger's records to stderr as ``fmt``. Calling it again replaces the setup."""
    if fmt not in _FORMATTERS:
        raise ValueError(f"log format {fmt!r}: use one of {sorted(_FORMATTERS)}")
    handler = _Handler(sys.stderr)
    handler.setFormatter(_FORMATTERS[fmt](service, replica_id))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


class Throttled:
    """A repeated event logged at most once per ``every_s``: the first at once, the next after the
    interval with how many came since the last line. For what a stranger can cause (a refused
    request), which must not grow the log without bound."""

    def __init__(
        self,
        logger: logging.Logger,
        level: int = logging.WARNING,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger, self._level, self._every_s, self._clock = logger, level, every_s, clock
        self._last = -float("inf")
        self._since = 0

    def __call__(self, message: str, *args: object) -> bool:
        """Count the event; log it if the interval has passed. True when it was logged."""
        self._since += 1
        now = self._clock()
        if now - self._last < self._every_s:
            return False
        self._logger.log(self._level, message + " (%d such since the last line)", *args, self._since)
        self._last, self._since = now, 0
        return True


def _iso_time(created: float) -> str:
    """UTC with milliseconds: ``2025-01-31T12:00:00.123Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"
