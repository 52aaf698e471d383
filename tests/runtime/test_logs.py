"""Structured logs: JSON lines with service, replica, extras and the active trace ids; text for humans."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from flowgrpo.logs import Throttled, setup_logging

log = logging.getLogger("flowgrpo.test")


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_service_extras_and_trace_ids(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("trainer", "trainer-0", level="DEBUG")
    setup_logging("trainer", "trainer-0", level="DEBUG")  # idempotent: still one line per record
    span = TracerProvider().get_tracer("test").start_span("step")
    with trace.use_span(span, end_on_exit=True):
        log.debug("step done", extra={"step": 3, "loss": 0.25})
    log.warning("no span here")
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    context = span.get_span_context()
    assert (
        first["message"] == "step done" and first["level"] == "DEBUG" and first["logger"] == "flowgrpo.test"
    )
    assert (first["service"], first["replica"], first["step"], first["loss"]) == (
        "trainer",
        "trainer-0",
        3,
        0.25,
    )
    assert first["trace_id"] == f"{context.trace_id:032x}" and first["span_id"] == f"{context.span_id:016x}"
    assert first["time"].endswith("Z")
    assert "trace_id" not in second and second["level"] == "WARNING"


def test_text_lines_are_for_humans_and_keep_tracebacks(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("reward", "reward-1", fmt="text")
    try:
        raise ValueError("bad image")
    except ValueError:
        log.exception("scoring failed", extra={"sample": "p0/1"})
    err = capsys.readouterr().err
    head = err.splitlines()[0]
    assert "ERROR" in head and "reward/reward-1 flowgrpo.test: scoring failed sample=p0/1" in head
    assert "Traceback" in err and "ValueError: bad image" in err


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format 'xml'"):
        setup_logging("x", fmt="xml")  # type: ignore[arg-type]


def test_a_throttled_event_is_logged_once_an_interval_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    throttled = Throttled(log, logging.INFO, every_s=10.0, clock=lambda: now[0])
    logged = []
    with caplog.at_level(logging.INFO, logger="flowgrpo.test"):
        for t in [100.0, 101.0, 105.0, 109.9, 110.0, 110.5, 125.0]:
            now[0] = t
            logged.append(throttled("refused %s", t))
    assert logged == [True, False, False, False, True, False, True]
    assert [r.getMessage() for r in caplog.records] == [
        "refused 100.0 (1 such since the last line)",
        "refused 110.0 (4 such since the last line)",  # 101, 105, 109.9 and itself
        "refused 125.0 (2 such since the last line)",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)
