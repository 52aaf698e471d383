"""A minimal OTLP/gRPC trace receiver for tests: what a collector would get, as span dicts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from flowgrpo.telemetry import span_records


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC collector: keeps every exported span as the record ``read_spans``
    gives for the same span read from a traces file."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.spans.extend(span_records(request.resource_spans))
        return trace_service_pb2.ExportTraceServiceResponse()


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
