"""``flowgrpo trace RUN_DIR --step N``: one training step as a waterfall across the services,
from the trace files of the run (``<run_dir>/traces/*.otlp.jsonl``, OTLP/JSON: one per service
replica and host), read by :func:`flowgrpo.telemetry.read_spans` into plain span records.

A step is the coordinator's ``coordinator.draw`` (rollouts and rewards of its samples) and
``coordinator.train`` (the trainer step, the weight loads) spans with that step, plus every span
of their traces: the services' server spans are children through the gRPC trace context.
"""

from __future__ import annotations

from typing import Any

from flowgrpo.telemetry import read_spans

ROOTS = ("coordinator.draw", "coordinator.train", "coordinator.validate")
WIDTH = 50  # characters of the bar column


def step_spans(run_dir: str, step: int, spans: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The spans of training step ``step``; ``spans``: the run's, when already read."""
    spans = read_spans(run_dir) if spans is None else spans
    roots = [s for s in spans if s["name"] in ROOTS and s["attributes"].get("step") == step]
    traces = {s["trace_id"] for s in roots}
    return [s for s in spans if s["trace_id"] in traces]


def waterfall(spans: list[dict[str, Any]]) -> str:
    """One line per span: start offset, duration, service, name, and a bar on the step's timeline."""
    if not spans:
        return "no spans"
    begin = min(s["start_ns"] for s in spans)
    total = max(max(s["end_ns"] for s in spans) - begin, 1)
    lines = [f"{'start ms':>9} {'dur ms':>9}  {'service':<12} {'span':<44} timeline"]
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        left = int((s["start_ns"] - begin) / total * WIDTH)
        width = max(1, int((s["end_ns"] - s["start_ns"]) / total * WIDTH))
        bar = " " * left + "#" * min(width, WIDTH - left)
        lines.append(
            f"{(s['start_ns'] - begin) / 1e6:9.1f} {(s['end_ns'] - s['start_ns']) / 1e6:9.1f}  "
            f"{s.get('service.name')!s:<12} {s['name'][:44]:<44} |{bar:<{WIDTH}}|"
        )
    return "\n".join(lines)


def busy_by_service(spans: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds each service spent serving: the union of the intervals of its outermost spans
    (those whose parent belongs to another service: the gRPC server spans, or with the
    ``inprocess`` launcher the services' own top spans); overlapping calls, e.g. two rollout
    replicas of one service, count once. The coordinator is not a served service here."""
    service_of = {s["span_id"]: s.get("service.name") for s in spans}
    intervals: dict[str, list[tuple[int, int]]] = {}
    for s in spans:
        name = s.get("service.name")
        if name == "coordinator" or service_of.get(s.get("parent_span_id")) == name:
            continue
        intervals.setdefault(str(name), []).append((s["start_ns"], s["end_ns"]))
    busy = {}
    for service, spans_of in intervals.items():
        total, end = 0, -1
        for a, b in sorted(spans_of):
            if b > end:
                total += b - max(a, end)
                end = b
        busy[service] = total / 1e9
    return busy


def busy_per_step(run_dir: str, steps: list[int]) -> list[dict[str, float]]:
    """:func:`busy_by_service` of each step, reading the run's trace files once."""
    spans = read_spans(run_dir)
    return [busy_by_service(step_spans(run_dir, step, spans)) for step in steps]
