"""Tracing: OpenTelemetry in every process, gRPC instrumented, bus hops linked.

Export goes over OTLP/gRPC when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces-only variant) is
set, as it is beside a collector or Jaeger; otherwise each process appends its spans to
``<run_dir>/traces/<service>-<pid>.jsonl``, so a run without a collector still keeps its traces
and ``read_spans`` (the waterfall CLI) finds them. ``http://`` endpoints are plaintext; for a bare
``host:port`` set ``OTEL_EXPORTER_OTLP_INSECURE=true`` or the exporter will try TLS.

The data bus breaks the call tree: a sample is produced under one span and consumed, with many
others, under another. The producer stores :func:`carrier` in the bus header; the consumer
opens its own span with ``links=links_from(carriers)``, so a training step links to the
rollouts it learned from without pretending to be their child.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc.aio
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, format_span_id, format_trace_id

OTLP_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACES_DIR = "traces"

_provider: TracerProvider | None = None


class _Destination(SpanExporter):
    """Where the process's spans go now. The OpenTelemetry provider is set once per process,
    but one process may hold several runs in turn (a benchmark, the tests): each run points
    this at its own traces file."""

    def __init__(self) -> None:
        self.target: SpanExporter | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        target = self.target
        return target.export(spans) if target is not None else SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self.target is not None:
            self.target.shutdown()
            self.target = None


_destination = _Destination()


def setup_tracing(
    service_name: str, *, replica_id: str = "", run_dir: str | Path | None = None
) -> TracerProvider:
    """Install the process's tracer provider (once: the service name of the first call stays)
    and send spans to ``run_dir``'s traces file (or an OTLP collector when configured).

    Without an OTLP endpoint and without ``run_dir`` spans are recorded (logs still carry trace
    ids) but exported nowhere.
    """
    global _provider
    if _provider is None:
        instance = replica_id or f"{socket.gethostname()}-{os.getpid()}"
        _provider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: service_name, SERVICE_INSTANCE_ID: instance})
        )
        _provider.add_span_processor(BatchSpanProcessor(_destination))
        trace.set_tracer_provider(_provider)
    _provider.force_flush()  # what an earlier run recorded goes to that run's file
    _destination.shutdown()
    _destination.target = _exporter(service_name, run_dir)
    return _provider


def shutdown_tracing() -> None:
    """Export the spans still buffered and close the exporter; call it at the end of a run (the
    provider stays, for a next run in this process)."""
    if _provider is not None:
        _provider.force_flush()
        _destination.shutdown()


def _exporter(service_name: str, run_dir: str | Path | None) -> SpanExporter | None:
    if any(os.environ.get(name) for name in OTLP_ENDPOINT_ENVS):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if run_dir is not None:
        safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", service_name)
        return JsonlSpanExporter(Path(run_dir) / TRACES_DIR / f"{safe_name}-{os.getpid()}.jsonl")
    return None


def grpc_server_interceptor() -> grpc.aio.ServerInterceptor:
    """The official aio server interceptor; health probes are not traced (they are noise)."""
    return aio_server_interceptor(filter_=filters.negate(filters.health_check()))  # type: ignore[no-untyped-call]


def grpc_client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The official aio client interceptors; they send the trace context with each call."""
    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(  # type: ignore[no-untyped-call]
        filter_=filters.negate(filters.health_check())
    )
    return interceptors


def carrier() -> dict[str, str]:
    """The current trace context as a W3C carrier (``traceparent``), for a bus header."""
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


def links_from(carriers: Iterable[Mapping[str, str]]) -> list[Link]:
    """Links to the spans that produced the given carriers, each span once.

    Samples of one rollout request share its span, so a step of hundreds of samples links to a
    few dozen producers (OpenTelemetry keeps 128 links per span by default).
    """
    seen: set[tuple[int, int]] = set()
    links = []
    for headers in carriers:
        context = trace.get_current_span(propagate.extract(headers)).get_span_context()
        key = (context.trace_id, context.span_id)
        if context.is_valid and key not in seen:
            seen.add(key)
            links.append(Link(context))
    return links


class JsonlSpanExporter(SpanExporter):
    """Append each finished span to a file as one JSON object per line."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()  # the batch worker and a final flush may export at once

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(span), default=str) + "\n" for span in spans)
        with self._lock:
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as the JSON object written to the traces file; ids are lowercase hex."""
    context = span.get_span_context()
    assert context is not None  # a finished SDK span always has one
    resource = dict(span.resource.attributes)
    return {
        "name": span.name,
        "trace_id": format_trace_id(context.trace_id),
        "span_id": format_span_id(context.span_id),
        "parent_span_id": format_span_id(span.parent.span_id) if span.parent else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "events": [
            {"name": event.name, "time_ns": event.timestamp, "attributes": dict(event.attributes or {})}
            for event in span.events
        ],
        "links": [
            {
                "trace_id": format_trace_id(link.context.trace_id),
                "span_id": format_span_id(link.context.span_id),
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
        "service.name": _service_of(span) or resource.get(SERVICE_NAME),
        "resource": resource,
    }


def _service_of(span: ReadableSpan) -> str | None:
    """The service whose code made the span (its module: ``flowgrpo.services.<role>.*``): with the
    ``inprocess`` launcher all four share one process, and its resource names only the first."""
    scope = span.instrumentation_scope.name if span.instrumentation_scope else ""
    parts = scope.split(".")
    if len(parts) > 2 and parts[:2] == ["flowgrpo", "services"]:
        return parts[2]
    return None


def read_spans(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every span of a run, from all its processes' trace files, in start order.

    A process killed mid-write leaves a last line without its newline; that line is skipped.
    """
    spans = []
    for path in sorted((Path(run_dir) / TRACES_DIR).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if line.endswith("\n") and line.strip():
                spans.append(json.loads(line))
    spans.sort(key=lambda span: span["start_ns"])
    return spans
