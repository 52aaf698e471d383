"""Every failure is a typed error that names what went wrong, and the server keeps serving."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from flowgrpo.bus import (
    BusClient,
    BusConfig,
    DataLost,
    ErrorCode,
    Evicted,
    NotFound,
    Released,
    Unauthenticated,
    wire,
)

from .conftest import Producer

PING = [wire.PING, wire.encode(wire.PingRequest(77))]


@pytest.fixture
def raw() -> Iterator[Any]:
    """A bare DEALER socket factory, to send what a BusClient never would."""
    socks: list[zmq.Socket[bytes]] = []

    def connect(endpoint: str) -> zmq.Socket[bytes]:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(endpoint)
        socks.append(sock)
        return sock

    yield connect
    for sock in socks:
        sock.close()


@pytest.fixture(scope="module")
def small_headers() -> Iterator[Producer]:
    """One producer (max_request_header_bytes=4096) shared by the malformed-input tests."""
    producer = Producer({"max_request_header_bytes": 4096})
    yield producer
    producer.close()


def _error_reply(sock: zmq.Socket[bytes], frames: list[bytes]) -> wire.ErrorReply:
    sock.send_multipart(frames)
    token, header = sock.recv_multipart()
    reply = wire.decode_reply(token, wire.unpack(header, 1 << 20))
    assert isinstance(reply, wire.ErrorReply), reply
    return reply


def _assert_still_serving(sock: zmq.Socket[bytes]) -> None:
    sock.send_multipart(PING)
    token, header = sock.recv_multipart()
    assert token == wire.PING and wire.unpack(header, 1 << 20)["rid"] == 77


def _header(**fields: Any) -> bytes:
    return msgpack.packb({"v": wire.PROTOCOL, "rid": 5, **fields})


def _fetch_header(**fields: Any) -> bytes:
    return _header(**{"store_id": "", "shm": False, "items": [["k", 0, -1]], **fields})


@pytest.mark.parametrize(
    ("frames", "fragment"),
    [
        ([wire.PING], "2 frames (type, header), got 1"),
        ([*PING, b"x", b"y"], "2 frames (type, header), got 4"),
        ([b"Z", wire.encode(wire.PingRequest(1))], "unknown message type b'Z'"),
        ([wire.ERROR, wire.encode(wire.PingRequest(1))], "unknown message type b'E'"),
        ([wire.FETCH, b"\xc1\x00garbage"], "header is not valid msgpack"),
        ([wire.FETCH, msgpack.packb([1, 2])], "header must be a msgpack map"),
        ([wire.FETCH, _fetch_header(rid="5")], "'rid' must be int, got str"),
        ([wire.FETCH, _fetch_header(items="k")], "'items' must be list, got str"),
        ([wire.FETCH, _fetch_header(items=[["k", -5, 1]])], "int >= 0"),
        ([wire.FETCH, _fetch_header(pad="x" * 5000)], "exceeds max_request_header_bytes=4096"),
        ([wire.RELEASE, _header(keys=[], prefix="")], "empty prefix refused"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_malformed_requests_get_a_named_error(
    small_headers: Producer, raw: Any, frames: list[bytes], fragment: str
) -> None:
    sock = raw(small_headers.endpoint)
    reply = _error_reply(sock, frames)
    assert reply.code is ErrorCode.INVALID_ARGUMENT and fragment in reply.message, reply.message
    _assert_still_serving(sock)


def test_frames_beyond_the_size_cap_drop_only_that_peer(small_headers: Producer, raw: Any) -> None:
    rogue, good = raw(small_headers.endpoint), raw(small_headers.endpoint)
    _assert_still_serving(rogue)  # connected, and a request within the cap is answered
    dropped = rogue.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    rogue.send_multipart([wire.FETCH, b"x" * 4000])  # the control: malformed, within the cap
    assert rogue.recv_multipart()[0] == wire.ERROR and not dropped.poll(300)  # answered, still connected
    rogue.send_multipart([wire.FETCH, b"x" * 100_000])  # > MAXMSGSIZE: zmq drops the connection
    assert dropped.poll(5000), "the server kept a peer that sent a frame beyond its cap"
    assert recv_monitor_message(dropped)["event"] == zmq.EVENT_DISCONNECTED
    _assert_still_serving(good)


def test_missing_keys_name_close_matches(start_producer: Any) -> None:
    producer: Producer = start_producer()
    ref = producer.put("step3/p17/s4/latents")
    wrong = dataclasses.replace(ref, key="step3/p17/s4/latent")
    with BusClient(BusConfig()) as client:
        with pytest.raises(NotFound) as info:
            client.fetch([wrong])
        assert info.value.code is ErrorCode.NOT_FOUND and info.value.key == wrong.key
        assert "did you mean 'step3/p17/s4/latents'" in info.value.message
        assert [f.key for f in client.fetch([ref])] == [ref.key]  # still serving


def test_released_and_evicted_keys_say_why(start_producer: Any) -> None:
    producer: Producer = start_producer(max_bytes=4096, when_full="evict_oldest")
    first, second = producer.put("a", shape=[512]), producer.put("b", shape=[512])  # 2 KiB each
    assert producer.command(op="release", keys=["a"]) == {"released": 1}
    third = producer.put("c", shape=[512])
    fourth = producer.put("d", shape=[512])  # full: evicts b, the oldest held
    with BusClient(BusConfig()) as client:
        results = client.fetch([first, second, third, fourth], errors="return")
    assert isinstance(results[0], Released) and "released" in results[0].message
    assert (
        isinstance(results[1], Evicted)
        and "evicted" in results[1].message
        and "max_bytes" in results[1].message
    )
    assert [getattr(r, "key", None) for r in results[2:]] == ["c", "d"]


def test_release_over_the_wire_by_tag_and_prefix(start_producer: Any) -> None:
    producer: Producer = start_producer()
    refs = producer.put_many(
        [{"key": f"s1/{i}", "dtype": "uint8", "shape": [3], "tag": "s1"} for i in range(3)]
    )
    producer.put("s2/0")
    with BusClient(BusConfig()) as client:
        assert client.release(producer.endpoint, tag="s1") == 3
        assert client.release(producer.endpoint, prefix="s2/") == 1
        assert client.stat(producer.endpoint).count == 0
        with pytest.raises(Released):
            client.fetch(refs[:1])


def test_schema_violation_on_put_leaves_the_store_serving(start_producer: Any) -> None:
    producer: Producer = start_producer()
    bad = {
        "key": "x",
        "column": "latents",
        "dtype": "float32",
        "shape": [2, 3, 63],
        "seed": 0,
        "policy_version": 1,
    }
    answer = producer.command(op="put", items=[bad])
    assert answer["error"] == "SchemaViolation" and "dimension 2 must be 64, got 63" in answer["message"]
    ref = producer.put("y", column="latents", shape=[2, 3, 64])
    with BusClient(BusConfig()) as client:
        assert client.fetch([ref])[0].shape == (2, 3, 64)


def test_dead_producer_is_data_lost_within_the_deadline(start_producer: Any) -> None:
    producer: Producer = start_producer()
    refs = [producer.put("a"), producer.put("b")]
    producer.kill()
    with BusClient(BusConfig()) as client:
        start = time.monotonic()
        with pytest.raises(DataLost) as info:
            client.fetch(refs, timeout_s=1.5)
        waited = time.monotonic() - start
    assert 1.4 < waited < 4
    assert info.value.code is ErrorCode.DATA_LOST and info.value.endpoint == producer.endpoint
    message = info.value.message
    assert f"producer {producer.endpoint} did not answer 2 keys within 1.5 s" in message
    assert "'a', 'b'" in message and "re-produced" in message


def test_dead_producer_loses_only_its_keys(start_producer: Any) -> None:
    alive, dead = start_producer(), start_producer()
    good, lost = alive.put("good"), dead.put("lost")
    dead.kill()
    with BusClient(BusConfig()) as client:
        results = client.fetch([good, lost], timeout_s=1.0, errors="return")
        with pytest.raises(DataLost, match="did not answer PING"):
            client.ping(dead.endpoint, timeout_s=0.5)
    assert getattr(results[0], "key", None) == "good" and isinstance(results[1], DataLost)


def test_restarted_store_is_data_lost(start_producer: Any) -> None:
    producer: Producer = start_producer()
    current = producer.put("k")
    stale = dataclasses.replace(current, store_id="0" * 16)  # a ref from before a restart
    with BusClient(BusConfig()) as client:
        with pytest.raises(DataLost, match="producer restarted"):
            client.fetch([stale])
        results = client.fetch([stale, current], errors="return")
    assert isinstance(results[0], DataLost) and getattr(results[1], "key", None) == "k"


def test_a_secret_refuses_strangers_at_the_handshake_and_admits_the_run(
    start_producer: Any, monkeypatch: Any
) -> None:
    producer: Producer = start_producer(secret="s3cret-of-this-run")
    ref = producer.put("k", seed=3)
    for client_cfg, fragment in [
        (BusConfig(), "requires the run's bus secret and this process has none"),
        (BusConfig(secret="wrong-secret-of-another-run"), "it holds another bus secret"),
    ]:
        with BusClient(client_cfg) as client:
            started = time.monotonic()
            with pytest.raises(Unauthenticated, match=fragment) as info:
                client.fetch([ref], timeout_s=20)
            assert info.value.code is ErrorCode.UNAUTHENTICATED and "FLOWGRPO_BUS_SECRET" in str(info.value)
            assert time.monotonic() - started < 10  # named at the handshake, not at the deadline
            with pytest.raises(Unauthenticated):
                client.stat(producer.endpoint, timeout_s=20)
    monkeypatch.setenv("FLOWGRPO_BUS_SECRET", "s3cret-of-this-run")
    with BusClient(BusConfig()) as client:
        [got] = client.fetch([ref], timeout_s=5)
        assert got.array.nbytes == 16
        client.ping(producer.endpoint, timeout_s=5)  # answered: it raises on a refusal or a timeout


def test_client_with_a_secret_refuses_a_store_without_one(start_producer: Any) -> None:
    producer: Producer = start_producer()
    ref = producer.put("k")
    with BusClient(BusConfig(secret="s3cret-of-this-run")) as client:
        for call in (lambda: client.fetch([ref], timeout_s=20), lambda: client.ping(producer.endpoint)):
            with pytest.raises(Unauthenticated, match=r"has no bus secret and this process has one|or none"):
                call()
