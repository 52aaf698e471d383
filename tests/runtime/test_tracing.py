"""One trace across two processes, written to the run folder's OTLP/JSON trace files and, with an
endpoint set, exported over OTLP to a receiver run by the test as well; heartbeats untraced;
links from a consumer span to the spans that produced its inputs.

The client side runs as this module (``python -m tests.runtime.test_tracing``): one traced step
that calls a probe server's ``Heartbeat`` and ``RunStatus``, then a consumer linked to two
producers, as a train step would be.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowgrpo.runtime import ClientConfig, open_channel, wait_ready
from flowgrpo.telemetry import carrier, links_from, read_spans, setup_tracing, shutdown_tracing
from flowgrpo.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.otlp import Receiver, otlp_receiver

from .probe import heartbeat, kill_if_running, read_ready_file, spawn

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = "/flowgrpo.v1.Coordinator/Heartbeat"
RUN_STATUS = "/flowgrpo.v1.Coordinator/RunStatus"
HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
tracer = trace.get_tracer(__name__)


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    with otlp_receiver() as running:
        yield running


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return env | extra


def _client(env: dict[str, str], *args: str) -> None:
    """Run this module's traced client to its end."""
    done = subprocess.run([sys.executable, "-m", "tests.runtime.test_tracing", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr


def _serve_and_call(tmp_path: Path, env: dict[str, str], run_dir: Path) -> None:
    """A server process and a client process calling it; both end before this returns."""
    ready = tmp_path / "ready.json"
    server = spawn(
        "serve", "--name", "probe-server", "--ready-file", str(ready), "--run-dir", str(run_dir), env=env
    )
    try:
        address = read_ready_file(ready, server)["grpc_address"]
        _client(env, "--address", address, "--run-dir", str(run_dir))
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
    client = one(RUN_STATUS, "probe-client")
    server = one(RUN_STATUS, "probe-server")
    assert (client["kind"], server["kind"]) == ("CLIENT", "SERVER")
    assert {span["trace_id"] for span in (client, server)} == {step["trace_id"]}
    assert client["parent_span_id"] == step["span_id"]
    assert server["parent_span_id"] == client["span_id"]  # the context crossed the process boundary
    assert server["resource"]["service.instance.id"] == "probe-0"
    assert client["resource"]["service.instance.id"] == "client-0"
    # the Heartbeat call left no span on either side; what its handler traced is still there
    assert not [s for s in spans if s["name"] == HEARTBEAT]
    handle = one("probe.handle", "probe-server")
    compute = one("probe.compute", "probe-server")
    assert compute["parent_span_id"] == handle["span_id"]  # the context reached the worker thread
    producers = [one("producer.a", "probe-client"), one("producer.b", "probe-client")]
    consumer = one("consumer", "probe-client")
    assert consumer["trace_id"] not in {p["trace_id"] for p in producers}
    assert {(link["trace_id"], link["span_id"]) for link in consumer["links"]} == {
        (p["trace_id"], p["span_id"]) for p in producers
    }


def _trace_files(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "traces").iterdir())


def test_trace_files_are_otlp_json_one_traces_data_per_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _serve_and_call(tmp_path, _env(), run_dir)
    expected = {  # file: (service.name, service.instance.id, some of its spans)
        f"probe-client-client-0-{HOST}.otlp.jsonl": ("probe-client", "client-0", {"client.step", RUN_STATUS}),
        f"probe-server-probe-0-{HOST}.otlp.jsonl": ("probe-server", "probe-0", {RUN_STATUS, "probe.handle"}),
    }
    assert _trace_files(run_dir) == sorted(expected)
    for name, (service, replica, some_spans) in expected.items():
        names = set()
        for line in (run_dir / "traces" / name).read_text().splitlines():
            data = json_format.Parse(line, TracesData())  # protobuf's JSON mapping, as OTLP/JSON is
            for resource_spans in data.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                assert (resource["service.name"], resource["service.instance.id"]) == (service, replica)
                names |= {span.name for scope in resource_spans.scope_spans for span in scope.spans}
            for resource_spans in json.loads(line)["resourceSpans"]:  # OTLP/JSON's own rules
                for span in (s for scope in resource_spans["scopeSpans"] for s in scope["spans"]):
                    assert re.fullmatch("[0-9a-f]{32}", span["traceId"]), span  # hex, not base64
                    assert re.fullmatch("[0-9a-f]{16}", span["spanId"]), span
                    assert isinstance(span["kind"], int)  # enums as integers
        assert names >= some_spans and HEARTBEAT not in names
    spans = read_spans(run_dir)
    assert [s["start_ns"] for s in spans] == sorted(s["start_ns"] for s in spans)
    _assert_one_trace_across_processes(spans)


def test_with_an_otlp_endpoint_spans_go_to_the_collector_and_the_files(
    tmp_path: Path, receiver: tuple[Receiver, int]
) -> None:
    collector, port = receiver
    run_dir = tmp_path / "run"
    _serve_and_call(tmp_path, _env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}"), run_dir)
    assert {span["service.name"] for span in collector.spans} == {"probe-server", "probe-client"}
    _assert_one_trace_across_processes(collector.spans)
    files = read_spans(run_dir)
    _assert_one_trace_across_processes(files)
    assert sorted(s["span_id"] for s in files) == sorted(s["span_id"] for s in collector.spans)


def test_two_replicas_write_two_files_and_a_restart_appends_to_its_own(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for replica in ("client-0", "client-1", "client-0"):  # the last: client-0 started again
        _client(_env(), "--replica", replica, "--run-dir", str(run_dir))
    assert _trace_files(run_dir) == [f"probe-client-client-{i}-{HOST}.otlp.jsonl" for i in (0, 1)]
    spans = read_spans(run_dir)
    pids: dict[str, set[int]] = {}
    for span in spans:
        pids.setdefault(span["resource"]["service.instance.id"], set()).add(span["resource"]["process.pid"])
    assert {replica: len(p) for replica, p in pids.items()} == {"client-0": 2, "client-1": 1}


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    """A process killed mid-write leaves a line without its newline: the rest still reads."""
    run_dir = tmp_path / "run"
    _client(_env(), "--run-dir", str(run_dir))
    [path] = (run_dir / "traces").iterdir()
    whole = len(read_spans(run_dir))
    with path.open("a") as f:
        f.write(path.read_text().splitlines()[0][:100])
    assert len(read_spans(run_dir)) == whole > 0


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
    for run in ("first", "second"):
        setup_tracing("coordinator", run_dir=tmp_path / run)
        with trace.get_tracer("t").start_as_current_span(f"{run}.span"):
            pass
        shutdown_tracing()
    assert [s["name"] for s in read_spans(tmp_path / "first")] == ["first.span"]
    assert [s["name"] for s in read_spans(tmp_path / "second")] == ["second.span"]


async def _call(address: str) -> None:
    """A traced step calling ``Heartbeat`` (untraced) and ``RunStatus``; then a consumer linked
    to two producers."""
    if address:
        channel = open_channel(address, ClientConfig())
        await wait_ready(address, role="coordinator", timeout_s=10, channel=channel)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        with tracer.start_as_current_span("client.step"):
            await stub.Heartbeat(heartbeat("sleep 0.05", 1))
            await stub.RunStatus(coordinator_pb2.RunStatusRequest())
        await channel.close()
    carriers = []
    for name in ("producer.a", "producer.b"):
        with tracer.start_as_current_span(name, context=otel_context.Context()):
            carriers.append(carrier())
    with tracer.start_as_current_span("consumer", context=otel_context.Context(), links=links_from(carriers)):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", default="", help="a probe server to call; none: only the linked spans")
    parser.add_argument("--replica", default="client-0")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    setup_tracing("probe-client", replica_id=args.replica, run_dir=args.run_dir)
    try:
        asyncio.run(_call(args.address))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
