"""One trace across two processes, exported over OTLP to a receiver run by the test, or to the
run folder's JSONL files; links from a consumer span to the spans that produced its inputs."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowgrpo.telemetry import carrier, links_from, read_spans
from tests.otlp import Receiver, otlp_receiver

from .probe import kill_if_running, read_ready_file, spawn

HEARTBEAT = "/flowgrpo.v1.Coordinator/Heartbeat"


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    with otlp_receiver() as running:
        yield running


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return env | extra


def _serve_and_call(tmp_path: Path, env: dict[str, str], *extra: str) -> None:
    """A server process and a client process calling it once; both end before this returns."""
    ready = tmp_path / "ready.json"
    server = spawn("serve", "--name", "probe-server", "--ready-file", str(ready), *extra, env=env)
    try:
        address = read_ready_file(ready, server)["grpc_address"]
        client = spawn("call", "--name", "probe-client", "--address", address, *extra, env=env)
        try:
            _, client_err = client.communicate(timeout=30)
        finally:
            kill_if_running(client)
        assert client.returncode == 0, client_err
        server.send_signal(signal.SIGTERM)
        _, server_err = server.communicate(timeout=30)
        assert server.returncode == 0, server_err
    finally:
        kill_if_running(server)


def _assert_one_trace_across_processes(spans: list[dict[str, Any]]) -> None:
    def one(name: str, service: str) -> dict[str, Any]:
        [span] = [s for s in spans if s["name"] == name and s["service.name"] == service]
        return span

    step = one("client.step", "probe-client")
    client = one(HEARTBEAT, "probe-client")
    server = one(HEARTBEAT, "probe-server")
    handle = one("probe.handle", "probe-server")
    compute = one("probe.compute", "probe-server")
    assert (client["kind"], server["kind"]) == ("CLIENT", "SERVER")
    assert {span["trace_id"] for span in (client, server, handle, compute)} == {step["trace_id"]}
    assert client["parent_span_id"] == step["span_id"]
    assert server["parent_span_id"] == client["span_id"]  # the context crossed the process boundary
    assert handle["parent_span_id"] == server["span_id"]  # ... and the actor's mailbox
    assert compute["parent_span_id"] == handle["span_id"]  # ... and its worker thread
    assert server["resource"]["service.instance.id"] == "probe-0"
    producers = [one("producer.a", "probe-client"), one("producer.b", "probe-client")]
    consumer = one("consumer", "probe-client")
    assert consumer["trace_id"] not in {p["trace_id"] for p in producers}
    assert {(link["trace_id"], link["span_id"]) for link in consumer["links"]} == {
        (p["trace_id"], p["span_id"]) for p in producers
    }


def test_one_trace_across_two_processes_over_otlp(tmp_path: Path, receiver: tuple[Receiver, int]) -> None:
    collector, port = receiver
    _serve_and_call(tmp_path, _env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}"))
    assert {span["service.name"] for span in collector.spans} == {"probe-server", "probe-client"}
    _assert_one_trace_across_processes(collector.spans)


def test_without_a_collector_spans_land_in_the_run_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _serve_and_call(tmp_path, _env(), "--run-dir", str(run_dir))
    files = sorted(path.name.rsplit("-", 1)[0] for path in (run_dir / "traces").glob("*.jsonl"))
    assert files == ["probe-client", "probe-server"]
    spans = read_spans(run_dir)
    assert [s["start_ns"] for s in spans] == sorted(s["start_ns"] for s in spans)
    _assert_one_trace_across_processes(spans)


def test_links_from_links_each_producer_once() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    carriers, producers = [], []
    for name in ("produce.a", "produce.b"):
        with tracer.start_as_current_span(name) as producer:
            carriers.append(carrier())
            producers.append(producer.get_span_context())
    assert carriers[0]["traceparent"].split("-")[2] == f"{producers[0].span_id:016x}"
    links = links_from([carriers[0], carriers[1], carriers[0], {}])  # a duplicate and an empty header
    with tracer.start_as_current_span("train.step", links=links):
        pass
    [step] = [s for s in exporter.get_finished_spans() if s.name == "train.step"]
    assert [(link.context.trace_id, link.context.span_id) for link in step.links] == [
        (p.trace_id, p.span_id) for p in producers
    ]
    assert trace.get_current_span().get_span_context().is_valid is False  # nothing leaked into this context


def test_runs_in_turn_in_one_process_each_get_their_spans(tmp_path: Path) -> None:
    """The provider is set once per process; each run's spans still land in that run's folder
    (a benchmark or a test that trains twice in one process)."""
    from flowgrpo.telemetry import setup_tracing, shutdown_tracing

    for run in ("first", "second"):
        setup_tracing("coordinator", run_dir=tmp_path / run)
        with trace.get_tracer("t").start_as_current_span(f"{run}.span"):
            pass
        shutdown_tracing()
    assert [s["name"] for s in read_spans(tmp_path / "first")] == ["first.span"]
    assert [s["name"] for s in read_spans(tmp_path / "second")] == ["second.span"]
