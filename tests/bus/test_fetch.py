"""Fetching across processes: every dtype and shape over tcp, ipc and shared memory, pipelined
batches from two producers, 256 MiB tensors, and the in-process twin."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider

from flowgrpo.bus import BusClient, BusConfig, Fetched, TensorRef, serve_store
from flowgrpo.bus.dtypes import STORAGE

from .conftest import Producer
from .patterns import pattern

MiB = 1 << 20
SHAPES = [(), (0,), (2, 0, 3), (7,), (3, 5), (2, 3, 4)]

# transport -> (producer config, client config)
PATHS: dict[str, tuple[dict[str, Any], BusConfig]] = {
    "tcp": ({"transport": "tcp", "shm": False}, BusConfig(shm=False)),
    "ipc": ({"transport": "ipc", "shm": False}, BusConfig(shm=False)),
    "shm": ({"transport": "ipc", "shm": True, "shm_min_bytes": 1}, BusConfig(shm=True)),
}


def _assert_same(got: Fetched, ref: TensorRef, seed: int) -> None:
    want = pattern(ref.dtype, ref.shape, seed)
    assert (got.key, got.dtype, got.shape, got.array.shape) == (ref.key, ref.dtype, ref.shape, ref.shape)
    assert got.array.dtype == STORAGE[ref.dtype]
    assert got.array.tobytes() == want.flat_bytes().tobytes(), f"{ref.key}: bytes differ"


@pytest.mark.parametrize("path", PATHS)
def test_every_dtype_and_shape_round_trips_bitwise(start_producer: Any, path: str) -> None:
    producer_cfg, client_cfg = PATHS[path]
    producer: Producer = start_producer(chunk_bytes=MiB, **producer_cfg)
    items = [
        {"key": f"{dtype}/{i}", "dtype": dtype, "shape": list(shape), "seed": i, "policy_version": 3}
        for dtype in STORAGE
        for i, shape in enumerate(SHAPES)
    ]
    items.append({"key": "multi-chunk", "dtype": "float32", "shape": [1024, 1024 + 7], "seed": 99})
    refs = producer.put_many(items)
    client_cfg.max_request_bytes = 3 * MiB // 2  # splits the 4 MiB tensor into ranges
    with BusClient(client_cfg) as client:
        fetched = client.fetch(refs, timeout_s=30)
    for item, ref, got in zip(items, refs, fetched, strict=True):
        _assert_same(got, ref, item["seed"])
    assert fetched[0].policy_version == 3
    want_via = {"socket"} if path != "shm" else {"shm", "socket"}  # empty tensors need no segment
    assert {got.via for got in fetched} == want_via
    assert all(got.via == "shm" for got in fetched if path == "shm" and got.array.nbytes > 0)
    assert all(got.array.flags.writeable for got in fetched)


@pytest.mark.parametrize("path", PATHS)
def test_256_mib_tensor_round_trips(start_producer: Any, path: str) -> None:
    producer_cfg, client_cfg = PATHS[path]
    producer: Producer = start_producer(**producer_cfg)
    ref = producer.put("big", dtype="uint8", shape=[256 * MiB], seed=7)
    with BusClient(client_cfg) as client:
        [got] = client.fetch([ref], timeout_s=60)
    assert got.via == ("shm" if path == "shm" else "socket")
    assert np.array_equal(got.array, pattern("uint8", [256 * MiB], 7).data)


def test_pipelined_batch_from_two_stores(start_producer: Any) -> None:
    a: Producer = start_producer(transport="tcp", chunk_bytes=256 << 10)
    b: Producer = start_producer(transport="ipc", shm=False)
    sizes = [1, 100, 5000, 300_000, 1_500_000]
    items = [{"key": f"k{i}", "dtype": "uint8", "shape": [sizes[i % 5]], "seed": i} for i in range(120)]
    refs_a, refs_b = a.put_many(items[::2]), b.put_many(items[1::2])
    refs = [r for pair in zip(refs_a, refs_b, strict=True) for r in pair]
    cfg = BusConfig(shm=False, max_request_bytes=MiB, pipeline_depth=3)
    with BusClient(cfg) as client:
        fetched = client.fetch(refs, timeout_s=30)
        again = client.fetch(refs[:3], timeout_s=30)  # cached sockets serve a second call
    assert [f.key for f in fetched] == [r.key for r in refs]
    for item, ref, got in zip(items, refs, fetched, strict=True):
        _assert_same(got, ref, item["seed"])
    assert {r.endpoint for r in refs} == {a.endpoint, b.endpoint}
    assert [f.array.tobytes() for f in again] == [f.array.tobytes() for f in fetched[:3]]


def test_trace_context_and_policy_version_travel_with_the_tensor(start_producer: Any) -> None:
    producer: Producer = start_producer()
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    ref = producer.put("k", seed=1, trace=carrier, policy_version=12)
    with BusClient(BusConfig(shm=False)) as client:
        [got] = client.fetch([ref])
    assert got.trace == carrier and got.policy_version == 12 == ref.policy_version


def test_put_captures_the_current_trace_context() -> None:
    tracer = TracerProvider().get_tracer("test")
    with serve_store(BusConfig()) as server, BusClient(BusConfig(), local_stores=False) as client:
        with tracer.start_as_current_span("produce") as span:
            ref = server.store.put("traced", "weights", np.zeros(3))
        untraced = server.store.put("plain", "weights", np.zeros(3))
        got, plain = client.fetch([ref, untraced])
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert trace_id in got.trace["traceparent"] and plain.trace == {}


def test_in_process_twin_reads_without_sockets() -> None:
    data = np.random.default_rng(0).random((300, 200), np.float32)
    with serve_store(BusConfig(shm_min_bytes=1)) as server:
        ref = server.store.put("k", "weights", data, policy_version=4)
        with BusClient(BusConfig()) as local, BusClient(BusConfig(), local_stores=False) as remote:
            [twin] = local.fetch([ref])
            [socketed] = remote.fetch([ref])
            assert local._peers == {}  # no socket was opened
        assert twin.via == "inprocess" and socketed.via == "shm"
        assert np.array_equal(twin.array, data) and np.array_equal(socketed.array, data)
        twin.array[0, 0] = -1.0  # a private copy: the store's data is untouched
        [again] = BusClient(BusConfig()).fetch([ref])
        assert again.array[0, 0] == data[0, 0] and twin.policy_version == 4


def test_unserved_store_is_readable_in_process_only() -> None:
    from flowgrpo.bus import TensorStore

    with TensorStore(BusConfig()) as store:
        ref = store.put("k", "weights", np.arange(4))
        assert ref.endpoint == ""
        [got] = BusClient(BusConfig()).fetch([ref])
        assert got.array.tolist() == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="not served"):
            BusClient(BusConfig(), local_stores=False).fetch([ref])
