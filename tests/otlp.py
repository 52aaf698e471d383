"""A minimal OTLP/gRPC trace receiver for tests: what a collector would get, as span dicts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC collector: keeps every exported span as a dict like the JSONL records."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(_record(span, resource) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _record(span: trace_pb2.Span, resource: dict[str, str]) -> dict[str, Any]:
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "kind": trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
        "links": [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()} for link in span.links],
        "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
        "service.name": resource["service.name"],
        "resource": resource,
    }


def _value(value: Any) -> Any:
    """An OTLP AnyValue as the Python value it holds."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, int]]:
    """A Receiver serving OTLP/gRPC on a free loopback port: (receiver, port)."""
    collector = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, port
    server.stop(None)
