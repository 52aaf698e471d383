"""The wire format on its own: every message survives encode/decode, and bad headers are named."""

from __future__ import annotations

import json

import msgpack
import pytest

from flowgrpo.bus import ErrorCode, Evicted, TensorRef, wire
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
    wire.ErrorReply(9, ErrorCode.UNAUTHENTICATED, "bad MAC"),
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


def test_mac_covers_type_header_and_frame_sizes() -> None:
    key, header = b"secret", wire.encode(wire.PingRequest(1))
    mac = wire.mac(key, wire.PING, header, [10, 20])
    wire.check_mac(key, wire.PING, header, [10, 20], mac)
    for token, sizes in ((wire.STAT, [10, 20]), (wire.PING, [10, 21]), (wire.PING, [10])):
        with pytest.raises(wire.AuthError, match="does not match"):
            wire.check_mac(key, token, header, sizes, mac)
    with pytest.raises(wire.AuthError, match="no MAC"):
        wire.check_mac(key, wire.PING, header, [10, 20], b"")
    assert wire.mac(None, wire.PING, header, []) == b""


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
    assert isinstance(proto, common_pb2.TensorRef) and list(proto.shape) == [3, 5, 64]
    assert TensorRef.from_proto(common_pb2.TensorRef.FromString(proto.SerializeToString())) == ref
    assert TensorRef.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref
