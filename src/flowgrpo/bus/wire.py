"""The bus wire format: every message type, its header fields and its frames.

A message is a list of ZMQ frames::

    [type token] [msgpack header] [data frame]*

- type token: one byte (``FETCH`` ...), so a router dispatches without decoding a payload;
- header: a msgpack map, decoded with ``raw=False, strict_map_key=True`` and no extension
  types, so a peer can only ever send plain data (never pickle, never objects);
- data frames: a tensor's bytes, split into frames of at most ``chunk_bytes``. The receiver
  preallocates the tensor from the header and receives each frame straight into its slice.

Requests are [type, header] and carry no data frames. Replies answer the request id ``rid``
they were sent for; a reply of type ``ERROR`` says that the whole request was refused
(malformed, too large, a RELEASE of everything). Shape letters in field docs: B keys of a
request.

Authentication is not in the messages: with the run's secret the sockets speak CURVE
(``flowgrpo.bus.auth``), which authenticates the peer at the handshake and then encrypts and
authenticates every frame, payload included. Protocol 1 carried an HMAC frame over the type,
the header and the frame sizes; CURVE covers all of that and the payload, so it was removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgpack
import zmq

from flowgrpo.bus.errors import ErrorCode

PROTOCOL = 2  # 2: no MAC frame (authentication moved to CURVE)
FETCH, RELEASE, STAT, PING, ERROR = b"F", b"R", b"S", b"P", b"E"
TOKEN_NAMES = {FETCH: "FETCH", RELEASE: "RELEASE", STAT: "STAT", PING: "PING", ERROR: "ERROR"}
COPY_BELOW = 64 << 10  # frames smaller than this are copied: cheaper than a zero-copy handoff
# zmq's flags as plain ints: arithmetic on its IntFlag members costs microseconds per frame.
SNDMORE, NOBLOCK, RCVMORE = int(zmq.SNDMORE), int(zmq.NOBLOCK), int(zmq.RCVMORE)

T = TypeVar("T")


class WireError(ValueError):
    """A message breaks the format; the text says what was wrong."""


# --- requests ---------------------------------------------------------------------------------


@dataclass
class KeyRange:
    """Bytes [offset, offset + length) of one key; length -1 = to the end."""

    key: str
    offset: int = 0
    length: int = -1


@dataclass
class FetchRequest:
    rid: int
    store_id: str  # the store the refs point to ("" = any); another id means it restarted
    items: list[KeyRange]  # (B,)
    shm: bool = False  # the client maps shared-memory segments: answer with handles


@dataclass
class ReleaseRequest:
    rid: int
    keys: list[str] = field(default_factory=list)
    tag: str | None = None
    prefix: str | None = None


@dataclass
class StatRequest:
    rid: int


@dataclass
class PingRequest:
    rid: int


Request = FetchRequest | ReleaseRequest | StatRequest | PingRequest

# --- replies ----------------------------------------------------------------------------------


@dataclass
class ItemMeta:
    """One key's bytes [offset, offset + sum(chunks)) follow as len(chunks) data frames, or,
    when ``shm`` names a segment, the whole tensor lies there and no frame follows."""

    key: str
    column: str
    dtype: str
    shape: list[int]
    nbytes: int
    policy_version: int
    trace: dict[str, str]
    offset: int = 0
    chunks: list[int] = field(default_factory=list)
    shm: str | None = None


@dataclass
class ItemError:
    key: str
    code: ErrorCode
    message: str


@dataclass
class FetchReply:
    rid: int
    items: list[ItemMeta | ItemError]  # (B,) in request order


@dataclass
class ReleaseReply:
    rid: int
    released: int


@dataclass
class StoreInfo:
    store_id: str
    used_bytes: int
    capacity_bytes: int
    count: int  # tensors held (committed)
    pending: int  # allocations not committed yet
    shm_probe: tuple[str, str] | None  # (file name, token) when the store uses shared memory
    shm_min_bytes: int
    pid: int
    hostname: str
    # bytes this store has sent per tag (socket frames, or whole tensors mapped from shared
    # memory), for the tags it holds: what a publisher or a relay sent of each weight version
    served: dict[str, int] = field(default_factory=dict)
    served_bytes: int = 0  # tensor bytes this store has answered fetches with (socket or shared memory)


@dataclass
class StatReply:
    rid: int
    info: StoreInfo


@dataclass
class PingReply:
    rid: int


@dataclass
class ErrorReply:
    rid: int  # -1 when the request was too broken to read its id
    code: ErrorCode
    message: str


Reply = FetchReply | ReleaseReply | StatReply | PingReply | ErrorReply
Message = Request | Reply

# --- encoding ---------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    return cast(bytes, msgpack.packb(_to_wire(msg), use_bin_type=True))


def _to_wire(msg: Message) -> dict[str, Any]:
    data: dict[str, Any] = {"v": PROTOCOL, "rid": msg.rid}
    if isinstance(msg, FetchRequest):
        data.update(
            store_id=msg.store_id, shm=msg.shm, items=[[i.key, i.offset, i.length] for i in msg.items]
        )
    elif isinstance(msg, ReleaseRequest):
        data.update(keys=msg.keys, tag=msg.tag, prefix=msg.prefix)
    elif isinstance(msg, FetchReply):
        data["items"] = [_item_to_wire(item) for item in msg.items]
    elif isinstance(msg, ReleaseReply):
        data["released"] = msg.released
    elif isinstance(msg, StatReply):
        info = msg.info
        data.update(info.__dict__, shm_probe=list(info.shm_probe) if info.shm_probe else None)
    elif isinstance(msg, ErrorReply):
        data.update(code=msg.code.name, message=msg.message)
    return data


def _item_to_wire(item: ItemMeta | ItemError) -> dict[str, Any]:
    if isinstance(item, ItemError):
        return {"key": item.key, "code": item.code.name, "message": item.message}
    return dict(item.__dict__)


def token_of(msg: Message) -> bytes:
    for token, kinds in _KINDS.items():
        if isinstance(msg, kinds):
            return token
    raise TypeError(f"not a bus message: {type(msg).__name__}")


_KINDS: dict[bytes, tuple[type, ...]] = {
    FETCH: (FetchRequest, FetchReply),
    RELEASE: (ReleaseRequest, ReleaseReply),
    STAT: (StatRequest, StatReply),
    PING: (PingRequest, PingReply),
    ERROR: (ErrorReply,),
}

# --- decoding ---------------------------------------------------------------------------------


def unpack(header: bytes, max_bytes: int) -> dict[str, Any]:
    """Decode a header map; WireError says why it is not one."""
    if len(header) > max_bytes:
        raise WireError(f"header of {len(header)} bytes exceeds max_header_bytes={max_bytes}")
    try:
        data = msgpack.unpackb(header, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise WireError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise WireError(f"header must be a msgpack map, got {type(data).__name__}")
    if data.get("v") != PROTOCOL:
        raise WireError(f"header protocol version {data.get('v')!r} is not {PROTOCOL}")
    return data


def peek_rid(header: Sequence[bytes], max_bytes: int) -> int:
    """The request id in ``header`` (a list of zero or one frame) when readable, else -1."""
    try:
        rid = unpack(header[0], max_bytes).get("rid", -1)
    except (IndexError, WireError):
        return -1
    return rid if _is_int(rid) else -1


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError(f"header uses msgpack extension type {code}; only plain data is accepted")


def decode_request(token: bytes, data: dict[str, Any]) -> Request:
    rid = _get(data, "rid", int)
    if token == FETCH:
        items = [_key_range(entry) for entry in _get(data, "items", list)]
        return FetchRequest(rid, _get(data, "store_id", str), items, _get(data, "shm", bool))
    if token == RELEASE:
        keys = _strings(_get(data, "keys", list), "keys")
        return ReleaseRequest(rid, keys, _optional(data, "tag", str), _optional(data, "prefix", str))
    if token == STAT:
        return StatRequest(rid)
    if token == PING:
        return PingRequest(rid)
    raise WireError(f"unknown request type {token!r}; known: {_known(exclude=ERROR)}")


def decode_reply(token: bytes, data: dict[str, Any]) -> Reply:
    rid = _get(data, "rid", int)
    if token == FETCH:
        return FetchReply(rid, [_item(entry) for entry in _get(data, "items", list)])
    if token == RELEASE:
        return ReleaseReply(rid, _get(data, "released", int))
    if token == STAT:
        return StatReply(rid, _store_info(data))
    if token == PING:
        return PingReply(rid)
    if token == ERROR:
        return ErrorReply(rid, ErrorCode.parse(_get(data, "code", str)), _get(data, "message", str))
    raise WireError(f"unknown reply type {token!r}; known: {_known()}")


def _known(exclude: bytes = b"") -> str:
    return ", ".join(f"{t!r} ({n})" for t, n in TOKEN_NAMES.items() if t != exclude)


def _key_range(entry: Any) -> KeyRange:
    if not (isinstance(entry, list) and len(entry) == 3):
        raise WireError(f"fetch item must be [key, offset, length], got {entry!r:.80}")
    key, offset, length = entry
    if not (isinstance(key, str) and _is_int(offset) and _is_int(length)) or offset < 0 or length < -1:
        raise WireError(f"fetch item must be [str, int >= 0, int >= -1], got {entry!r:.80}")
    return KeyRange(key, offset, length)


def _item(entry: Any) -> ItemMeta | ItemError:
    if not isinstance(entry, dict):
        raise WireError(f"reply item must be a map, got {type(entry).__name__}")
    key = _get(entry, "key", str)
    if "code" in entry:
        return ItemError(key, ErrorCode.parse(_get(entry, "code", str)), _get(entry, "message", str))
    return ItemMeta(
        key=key,
        column=_get(entry, "column", str),
        dtype=_get(entry, "dtype", str),
        shape=_sizes(_get(entry, "shape", list), "shape"),
        nbytes=_get(entry, "nbytes", int),
        policy_version=_get(entry, "policy_version", int),
        trace=_string_map(_get(entry, "trace", dict), "trace"),
        offset=_get(entry, "offset", int),
        chunks=_sizes(_get(entry, "chunks", list), "chunks"),
        shm=_optional(entry, "shm", str),
    )


def _store_info(data: dict[str, Any]) -> StoreInfo:
    probe = _optional(data, "shm_probe", list)
    if probe is not None and len(_strings(probe, "shm_probe")) != 2:
        raise WireError("header field 'shm_probe' must be [name, token]")
    return StoreInfo(
        store_id=_get(data, "store_id", str),
        used_bytes=_get(data, "used_bytes", int),
        capacity_bytes=_get(data, "capacity_bytes", int),
        count=_get(data, "count", int),
        pending=_get(data, "pending", int),
        shm_probe=(probe[0], probe[1]) if probe is not None else None,
        shm_min_bytes=_get(data, "shm_min_bytes", int),
        pid=_get(data, "pid", int),
        hostname=_get(data, "hostname", str),
        served=_served(_optional(data, "served", dict) or {}),
        served_bytes=_optional(data, "served_bytes", int) or 0,
    )


def _served(data: dict[Any, Any]) -> dict[str, int]:
    if not all(isinstance(k, str) and _is_int(v) and v >= 0 for k, v in data.items()):
        raise WireError("header field 'served' must map tags to byte counts >= 0")
    return dict(data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(data: dict[str, Any], name: str, kind: type[T]) -> T:
    if name not in data:
        raise WireError(f"header has no field {name!r}")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"header field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _optional(data: dict[str, Any], name: str, kind: type[T]) -> T | None:
    return None if data.get(name) is None else _get(data, name, kind)


def _strings(values: list[Any], name: str) -> list[str]:
    if not all(isinstance(v, str) for v in values):
        raise WireError(f"header field {name!r} must hold strings only")
    return values


def _string_map(values: dict[Any, Any], name: str) -> dict[str, str]:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()):
        raise WireError(f"header field {name!r} must map strings to strings")
    return values


def _sizes(values: list[Any], name: str) -> list[int]:
    if not all(_is_int(v) and v >= 0 for v in values):
        raise WireError(f"header field {name!r} must hold integers >= 0 only")
    return values


# --- frames -----------------------------------------------------------------------------------


def send(
    sock: zmq.Socket[Any],
    msg: Message,
    data: Sequence[memoryview] = (),
    *,
    route: bytes | None = None,
    flags: int = 0,
) -> None:
    """Send ``msg`` and its data frames; frames of COPY_BELOW bytes or more go zero-copy.

    ``route`` is the peer identity a ROUTER socket sends to. The caller keeps the buffers
    behind ``data`` alive and unchanged until ZMQ has sent them (the store never reuses them).
    ``flags`` (zmq.NOBLOCK) apply to every frame; ZMQ checks the queue limit on the first only.
    """
    token, header = token_of(msg), encode(msg)
    if route is not None:
        sock.send(route, flags | SNDMORE)
    sock.send(token, flags | SNDMORE)
    sock.send(header, flags | (SNDMORE if data else 0))
    for i, chunk in enumerate(data):
        more = SNDMORE if i < len(data) - 1 else 0
        sock.send(chunk, flags | more, copy=chunk.nbytes < COPY_BELOW)
