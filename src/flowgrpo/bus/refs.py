"""The values the bus hands out: references to stored tensors, raw tensor bytes, fetched data."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from flowgrpo.bus import dtypes

if TYPE_CHECKING:
    from flowgrpo.v1 import common_pb2


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: the producer's store at ``endpoint`` holds it under ``key``.

    The Python twin of ``flowgrpo.v1.TensorRef``. ``store_id`` changes when the store restarts,
    so a reference to a restarted store's data is detected as lost instead of read as
    whatever now has that key.
    """

    endpoint: str
    key: str
    column: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    store_id: str
    policy_version: int = -1

    def to_proto(self) -> common_pb2.TensorRef:
        from flowgrpo.v1 import common_pb2

        return common_pb2.TensorRef(**{**asdict(self), "shape": list(self.shape)})

    @classmethod
    def from_proto(cls, msg: common_pb2.TensorRef) -> TensorRef:
        return cls(
            endpoint=msg.endpoint,
            key=msg.key,
            column=msg.column,
            dtype=msg.dtype,
            shape=tuple(msg.shape),
            nbytes=msg.nbytes,
            store_id=msg.store_id,
            policy_version=msg.policy_version,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (for logs and for processes that pass refs as text)."""
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorRef:
        return cls(**{**data, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class TensorBytes:
    """A tensor as raw bytes plus its dtype name: how dtypes numpy lacks (bfloat16, float8)
    reach :meth:`TensorStore.put` without torch. ``data`` is any C-contiguous array whose
    bytes are the tensor's, e.g. the uint16 view of a bfloat16 tensor."""

    data: npt.NDArray[Any]
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        want = dtypes.nbytes_of(self.dtype, self.shape)
        if self.data.nbytes != want:
            raise ValueError(
                f"TensorBytes holds {self.data.nbytes} bytes but {self.dtype}{list(self.shape)} needs {want}"
            )
        if not self.data.flags.c_contiguous:
            raise ValueError("TensorBytes.data must be C-contiguous (its bytes are sent as they lie)")

    def flat_bytes(self) -> npt.NDArray[np.uint8]:
        return self.data.reshape(-1).view(np.uint8)


Via = Literal["socket", "shm", "inprocess"]


@dataclass
class Fetched:
    """One fetched tensor.

    ``array`` is private to the consumer and writable (a copy-on-write mapping on the shared
    memory path), with ``dtypes.storage_dtype(dtype)`` as numpy dtype: bfloat16 arrives as
    uint16 bits; ``flowgrpo.bus.torch_tensors.to_torch`` gives the real torch dtype. ``trace``
    is the producer's OpenTelemetry context at put time, to link consumer spans to it.
    """

    key: str
    column: str
    dtype: str
    shape: tuple[int, ...]
    array: npt.NDArray[Any]
    policy_version: int = -1
    trace: dict[str, str] = field(default_factory=dict)
    via: Via = "socket"


# --- endpoints a consumer may be pointed at (a request's refs are checked with this) -----

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_PORT = re.compile(r"[0-9]{1,5}")
MAX_IPC_PATH = 107  # a Unix socket path (sun_path holds 108 bytes with the NUL)


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a bus endpoint ("tcp://HOST:PORT" or "ipc:///PATH"), or None."""
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        if path.startswith("/") and 1 < len(path) <= MAX_IPC_PATH and path.isprintable():
            return None
        return f"an ipc endpoint needs an absolute socket path of at most {MAX_IPC_PATH} characters"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if _PORT.fullmatch(port) and 0 < int(port) < 65536 and _is_host(host):
            return None
        return "a tcp endpoint needs a host name or IP address and a port in [1, 65535]"
    return "an endpoint is tcp://HOST:PORT or ipc:///PATH"


def _is_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return len(host) <= 253 and _HOST.fullmatch(host) is not None
