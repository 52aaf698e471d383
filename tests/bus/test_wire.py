"""The wire format on its own: every message survives encode/decode, and bad headers are named."""

from __future__ import annotations

import json

import msgpack
import pytest
import zmq

from flowgrpo.bus import ErrorCode, Evicted, TensorRef, auth, wire
from flowgrpo.bus.errors import error_for
from flowgrpo.v1 import common_pb2

MESSAGES: list[wire.Message] = [
    wire.FetchRequest(1, "abc", [wire.KeyRange("k", 0, -1), wire.KeyRange("j", 16, 32)], shm=True),
    wire.ReleaseRequest(2, ["a", "b"], tag="step3", prefix=None),
    wire.StatRequest(3),
    wire.PingRequest(4),
]
REPLIES: list[wire.Message] = [
    wire.FetchReply(
        5,
        [
            wire.ItemMeta("k", "latents", "bfloat16", [2, 3], 12, 7, {"traceparent": "00-ab-cd-01"}, 0, [12]),
            wire.ItemError("x", ErrorCode.NOT_FOUND, "no key 'x'"),
            wire.ItemMeta("s", "weights", "float32", [1 << 20], 4 << 20, -1, {}, shm="flowgrpo-bus-1-2-ab"),
        ],
    ),
    wire.ReleaseReply(6, 3),
    wire.StatReply(
        7, wire.StoreInfo("id", 10, 100, 1, 0, ("flowgrpo-bus-1-2-ab.probe", "tok"), 1 << 20, 42, "h")
    ),
    wire.PingReply(8),
    wire.ErrorReply(9, ErrorCode.INVALID_ARGUMENT, "release with an empty prefix refused"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_requests_round_trip(msg: wire.Request) -> None:
    header = wire.encode(msg)
    assert wire.decode_request(wire.token_of(msg), wire.unpack(header, 1 << 20)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_replies_round_trip(msg: wire.Reply) -> None:
    header = wire.encode(msg)
    assert wire.decode_reply(wire.token_of(msg), wire.unpack(header, 1 << 20)) == msg


def test_error_codes_mirror_the_proto_enum() -> None:
    proto = {name.removeprefix("ERROR_CODE_"): number for name, number in common_pb2.ErrorCode.items()}
    assert proto == {code.name: code.value for code in ErrorCode}
    error = error_for(ErrorCode.EVICTED, "gone", key="k", endpoint="tcp://h:1").to_proto()
    assert (error.code, error.message, error.where) == (common_pb2.ERROR_CODE_EVICTED, "gone", "tcp://h:1 k")
    assert isinstance(error_for(ErrorCode.EVICTED, "gone"), Evicted)


def test_hkdf_matches_rfc_5869() -> None:
    okm = auth.hkdf_sha256(b"\x0b" * 22, bytes(range(0xF0, 0xFA)), 42, salt=bytes(range(13)))
    assert okm.hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )


def test_keys_derive_from_the_secret_alone() -> None:
    keys = auth.derive_keys(b"one run's secret")
    assert keys == auth.derive_keys(b"one run's secret")  # every process finds the same keys
    other = auth.derive_keys(b"another run's secret")
    assert len({keys.server_public, keys.client_public, other.server_public, other.client_public}) == 4
    assert keys.server_public == zmq.curve_public(keys.server_secret) and len(keys.server_secret) == 40


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "must be a msgpack map"),
        (msgpack.packb({"v": 99, "rid": 1}), "protocol version 99"),
        (msgpack.packb({1: 2}), "not valid msgpack"),  # strict_map_key: only str/bytes keys
        (msgpack.packb({"v": 1, "rid": msgpack.ExtType(5, b"x")}), "extension type 5"),
        (b"\x80" + b" " * 100, "exceeds max_header_bytes=64"),
    ],
)
def test_unpack_names_what_is_wrong(header: bytes, fragment: str) -> None:
    with pytest.raises(wire.WireError, match=fragment):
        wire.unpack(header, 64)


@pytest.mark.parametrize(
    ("token", "fields", "fragment"),
    [
        (wire.FETCH, {"rid": 1, "store_id": "", "shm": False}, "no field 'items'"),
        (wire.FETCH, {"rid": "1", "items": []}, "'rid' must be int"),
        (wire.FETCH, {"rid": True, "items": []}, "'rid' must be int"),
        (wire.FETCH, {"rid": 1, "store_id": "", "shm": False, "items": [["k", -1, 4]]}, "int >= 0"),
        (wire.FETCH, {"rid": 1, "store_id": "", "shm": False, "items": ["k"]}, r"\[key, offset, length\]"),
        (wire.RELEASE, {"rid": 1, "keys": [1, 2]}, "strings only"),
        (b"Z", {"rid": 1}, "unknown request type"),
    ],
)
def test_decode_request_names_bad_fields(token: bytes, fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(wire.WireError, match=fragment):
        wire.decode_request(token, {"v": 1, **fields})


def test_tensor_ref_converts_to_and_from_proto_and_json() -> None:
    ref = TensorRef("tcp://h:5", "step3/p1/s0/latents", "latents", "float32", (3, 5, 64), 3840, "ab12", 7)
    proto = ref.to_proto()
    fields = (proto.endpoint, proto.key, proto.column, proto.dtype, list(proto.shape), proto.nbytes)
    assert fields == ("tcp://h:5", "step3/p1/s0/latents", "latents", "float32", [3, 5, 64], 3840)
    assert (proto.store_id, proto.policy_version) == ("ab12", 7)  # field by field, not only a round trip
    assert TensorRef.from_proto(common_pb2.TensorRef.FromString(proto.SerializeToString())) == ref
    assert TensorRef.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref
