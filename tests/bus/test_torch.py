"""Torch tensors of every dtype with a byte view travel bit-exactly, over sockets and shm."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flowgrpo.bus import BusClient, BusConfig, BusServer, TensorStore, dtypes  # noqa: E402
from flowgrpo.bus.torch_tensors import TORCH_DTYPES, put_tensor, to_tensor_bytes, to_torch  # noqa: E402

SHAPES = [(), (0,), (3, 0), (5,), (4, 3)]


# Their values also need a scale and a zero point, which the bus does not carry.
QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    count = int(np.prod(shape)) * dtype.itemsize
    raw = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, max(count, 1), dtype=np.uint8))[
        :count
    ]
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*flat)


@pytest.fixture(scope="module")
def served() -> Iterator[TensorStore]:
    store = TensorStore(BusConfig(shm_min_bytes=16))
    server = BusServer(store, owns_store=True)
    yield store
    server.close()


def test_the_bus_knows_every_byte_viewable_torch_dtype() -> None:
    """Every dtype torch defines, once, under its canonical name (``torch.half`` is an alias of
    ``torch.float16``), except the quantized ones: every other dtype has a byte view."""
    canonical = {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
    named = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "complex32", "uint16"}
    assert named <= set(TORCH_DTYPES)
    assert canonical >= QUANTIZED, "a quantized dtype is gone from torch: update QUANTIZED"
    assert sorted(TORCH_DTYPES) == sorted(canonical - QUANTIZED)
    for name, dtype in TORCH_DTYPES.items():
        assert dtype is getattr(torch, name) and dtypes.itemsize(name) == dtype.itemsize, name


@pytest.mark.parametrize("via", ["socket", "shm", "inprocess"])
def test_every_dtype_round_trips_bitwise(served: TensorStore, via: str) -> None:
    tensors = {
        f"{via}/{name}/{i}": _random(getattr(torch, name), shape, seed=i)
        for name in sorted(TORCH_DTYPES)
        for i, shape in enumerate(SHAPES)
    }
    refs = [put_tensor(served, key, "weights", t) for key, t in tensors.items()]
    client = BusClient(BusConfig(shm=via == "shm"), local_stores=via == "inprocess")
    fetched = client.fetch(refs, timeout_s=30)
    client.close()
    for (key, tensor), got in zip(tensors.items(), fetched, strict=True):
        assert _same_bits(to_torch(got), tensor), key
        assert got.via == via or got.array.nbytes < 16  # small tensors always travel in frames


def test_bfloat16_values_and_torch_views(served: TensorStore) -> None:
    tensor = torch.randn(64, 32).to(torch.bfloat16)
    ref = served.put("bf16/bytes", "weights", to_tensor_bytes(tensor))  # the torch-free path
    with BusClient(BusConfig(), local_stores=False) as client:
        [got] = client.fetch([ref])
    assert got.array.dtype == np.uint16 and got.dtype == "bfloat16"
    back = to_torch(got)
    assert back.dtype == torch.bfloat16 and torch.equal(back, tensor)
    back[0, 0] = 1.5  # to_torch shares the fetched array's memory
    assert got.array[0, 0] == torch.tensor(1.5, dtype=torch.bfloat16).view(torch.uint16).item()


def test_put_tensor_accepts_non_contiguous_tensors_and_checks_the_schema(served: TensorStore) -> None:
    from flowgrpo.columns import SchemaViolation

    strided = torch.arange(24, dtype=torch.int64).reshape(4, 6)[:, ::2]
    ref = put_tensor(served, "ids/strided", "prompt_ids", strided.reshape(-1))
    [got] = BusClient(BusConfig()).fetch([ref])
    assert torch.equal(to_torch(got), strided.reshape(-1))
    with pytest.raises(SchemaViolation, match="dtype float32 does not match the schema's int64"):
        put_tensor(served, "ids/bad", "prompt_ids", torch.zeros(3))
    assert served.lookup("ids/bad").code.name == "NOT_FOUND"  # type: ignore[union-attr]
