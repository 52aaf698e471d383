"""Tracing: OpenTelemetry in every process, gRPC instrumented, bus hops linked.

Every process given a run folder appends its spans to
``<run_dir>/traces/<service>-<replica_id>-<hostname>.otlp.jsonl`` in the OTLP/JSON file format of
the OpenTelemetry file exporter: one ``TracesData`` per line (one line per export batch), protobuf
JSON with hex trace and span ids, as an OpenTelemetry collector's ``otlpjsonfile`` receiver reads
it. A restarted process of the same replica and host appends to the same file; the resource's
``process.pid`` tells the two apart. When ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces-only
variant) is set the spans also go over OTLP/gRPC, to a collector or Jaeger; the files stay, so
``read_spans`` (the waterfall CLI, the report) always finds them. ``http://`` endpoints are
plaintext; for a bare ``host:port`` set ``OTEL_EXPORTER_OTLP_INSECURE=true`` or the exporter will
try TLS.

Heartbeats are not traced: a replica beats every few seconds, and in a short run their spans
would outnumber all others.

The data bus breaks the call tree: a sample is produced under one span and consumed, with many
others, under another. The producer stores :func:`carrier` in the bus header; the consumer
opens its own span with ``links=links_from(carriers)``, so a training step links to the
rollouts it learned from without pretending to be their child.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc.aio
from google.protobuf import json_format
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span, Status, TracesData
from opentelemetry.sdk.resources import HOST_NAME, PROCESS_PID, SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link

OTLP_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACES_DIR = "traces"
TRACES_SUFFIX = ".otlp.jsonl"
UNTRACED_METHODS = ("/flowgrpo.v1.Coordinator/Heartbeat",)  # besides the gRPC health probes

_provider: TracerProvider | None = None
_file_name = ""  # the traces file of this process, named once with its resource


class _Destination(SpanExporter):
    """Where the process's spans go now. The OpenTelemetry provider is set once per process,
    but one process may hold several runs in turn (a benchmark, the tests): each run points
    this at its own traces file (and at the collector, if any)."""

    def __init__(self) -> None:
        self.target: SpanExporter | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        target = self.target
        return target.export(spans) if target is not None else SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self.target is not None:
            self.target.shutdown()
            self.target = None


# One batch processor each: a collector that is down delays its own exports, never the file's.
_to_file = _Destination()
_to_collector = _Destination()


def setup_tracing(
    service_name: str, *, replica_id: str = "", run_dir: str | Path | None = None
) -> TracerProvider:
    """Install the process's tracer provider (once: the resource of the first call stays) and
    send spans to ``run_dir``'s traces file, and to an OTLP collector when one is configured.

    Without an OTLP endpoint and without ``run_dir`` spans are recorded (logs still carry trace
    ids) but exported nowhere.
    """
    global _provider, _file_name
    if _provider is None:
        host = socket.gethostname()
        _provider = _install_provider(service_name, replica_id or f"{host}-{os.getpid()}", host)
        _file_name = traces_file_name(service_name, replica_id, host)
    _provider.force_flush()  # what an earlier run recorded goes to that run's file
    _to_file.shutdown()
    _to_collector.shutdown()
    if run_dir is not None:
        _to_file.target = OtlpJsonFileExporter(Path(run_dir) / TRACES_DIR / _file_name)
    if any(os.environ.get(name) for name in OTLP_ENDPOINT_ENVS):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        _to_collector.target = OTLPSpanExporter()
    return _provider


def _install_provider(service_name: str, instance: str, host: str) -> TracerProvider:
    resource = Resource.create(
        {SERVICE_NAME: service_name, SERVICE_INSTANCE_ID: instance, HOST_NAME: host, PROCESS_PID: os.getpid()}
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_to_file))
    provider.add_span_processor(BatchSpanProcessor(_to_collector))
    trace.set_tracer_provider(provider)
    return provider


def shutdown_tracing() -> None:
    """Export the spans still buffered and close the exporters; call it at the end of a run (the
    provider stays, for a next run in this process)."""
    if _provider is not None:
        _provider.force_flush()
        _to_file.shutdown()
        _to_collector.shutdown()


def traces_file_name(service_name: str, replica_id: str, host: str) -> str:
    """``<service>-<replica_id>-<host>.otlp.jsonl`` (``<service>-<host>`` without a replica id),
    each part reduced to ``[A-Za-z0-9_.-]``; never the PID: in containers every one is 1."""
    parts = (service_name, replica_id, host)
    return "-".join(re.sub(r"[^A-Za-z0-9_.-]", "_", part) for part in parts if part) + TRACES_SUFFIX


def grpc_server_interceptor() -> grpc.aio.ServerInterceptor:
    """The official aio server interceptor, tracing every call but the health probes and
    :data:`UNTRACED_METHODS` (noise: a replica's heartbeat every few seconds)."""
    return aio_server_interceptor(filter_=_traced_calls())  # type: ignore[no-untyped-call]


def grpc_client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The official aio client interceptors; they send the trace context with each traced call
    (the same calls as :func:`grpc_server_interceptor`'s)."""
    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(  # type: ignore[no-untyped-call]
        filter_=_traced_calls()
    )
    return interceptors


def _traced_calls() -> filters.Condition[Any]:
    untraced = [filters.full_method_name(method) for method in UNTRACED_METHODS]
    return filters.negate(filters.any_of(filters.health_check(), *untraced))


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


class OtlpJsonFileExporter(SpanExporter):
    """Append each export batch to a file as one OTLP/JSON ``TracesData`` line.

    The line goes out in one ``write`` to a file opened for appending, so processes sharing the
    file (a restarted replica) never interleave inside a line; a process killed mid-write leaves
    a last line without its newline, which readers skip.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()  # the batch worker and a final flush may export at once

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = (traces_json(spans) + "\n").encode()
        with self._lock:
            while line:  # one pass but for a short write (a full disk, a signal)
                line = line[os.write(self._fd, line) :]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            os.close(self._fd)


_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def traces_json(spans: Sequence[ReadableSpan]) -> str:
    """``spans`` as one OTLP/JSON ``TracesData``: protobuf's JSON mapping (lowerCamelCase keys,
    64-bit integers as strings) with enums as integers and ids as hex, as OTLP/JSON requires."""
    data = TracesData(resource_spans=encode_spans(spans).resource_spans)
    message = json_format.MessageToDict(data, use_integers_for_enums=True)
    _recode_ids(message, lambda value: base64.b64decode(value).hex())
    return json.dumps(message, separators=(",", ":"))


def parse_traces(line: str) -> TracesData:
    """One OTLP/JSON line back into ``TracesData`` (its hex ids made protobuf's base64 first)."""
    message = json.loads(line)
    _recode_ids(message, lambda value: base64.b64encode(bytes.fromhex(value)).decode())
    return json_format.ParseDict(message, TracesData())


def _recode_ids(message: dict[str, Any], recode: Callable[[str], str]) -> None:
    """Rewrite in place the id fields of every span and span link of a ``TracesData`` dict."""
    for resource_spans in message.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for item in (span, *span.get("links", [])):
                    for key in _ID_FIELDS:
                        if key in item:
                            item[key] = recode(item[key])


def read_spans(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every span of a run, from all its processes' trace files, in start order, as the records
    of :func:`span_records`. A last line without its newline (a process killed mid-write, or one
    writing now) is skipped."""
    spans: list[dict[str, Any]] = []
    for path in sorted((Path(run_dir) / TRACES_DIR).glob(f"*{TRACES_SUFFIX}")):
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if line.endswith("\n") and line.strip():
                spans.extend(span_records(parse_traces(line).resource_spans))
    spans.sort(key=lambda span: span["start_ns"])
    return spans


def span_records(resource_spans: Iterable[ResourceSpans]) -> Iterator[dict[str, Any]]:
    """Each span as a plain dict: ``name``, hex ``trace_id``/``span_id``/``parent_span_id`` (None
    for a root), ``kind`` (``SERVER``...), ``start_ns``/``end_ns``, ``attributes``, ``status``,
    ``events``, ``links``, ``service.name`` and the ``resource`` attributes."""
    for group in resource_spans:
        resource = _attributes(group.resource.attributes)
        for scope_spans in group.scope_spans:
            service = _service_of(scope_spans.scope.name) or resource.get(SERVICE_NAME)
            for span in scope_spans.spans:
                yield _record(span) | {"service.name": service, "resource": resource}


def _record(span: Span) -> dict[str, Any]:
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "kind": Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
        "start_ns": span.start_time_unix_nano,
        "end_ns": span.end_time_unix_nano,
        "attributes": _attributes(span.attributes),
        "status": {
            "code": Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_"),
            "description": span.status.message or None,
        },
        "events": [
            {"name": event.name, "time_ns": event.time_unix_nano, "attributes": _attributes(event.attributes)}
            for event in span.events
        ],
        "links": [
            {
                "trace_id": link.trace_id.hex(),
                "span_id": link.span_id.hex(),
                "attributes": _attributes(link.attributes),
            }
            for link in span.links
        ],
    }


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as the Python value it holds (arrays as lists, key-value lists as dicts)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def _service_of(scope: str) -> str | None:
    """The service whose code made the span (its instrumentation scope, the module
    ``flowgrpo.services.<role>.*``): with the ``inprocess`` launcher all four share one process,
    and its resource names only the first."""
    parts = scope.split(".")
    if len(parts) > 2 and parts[:2] == ["flowgrpo", "services"]:
        return parts[2]
    return None
