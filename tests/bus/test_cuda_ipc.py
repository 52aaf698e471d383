"""The same-host CUDA IPC path for weights: a bucket exported by one process is opened by
another and holds the producer's bytes; the handles' layouts, checked on the CPU against what
torch was recorded to export (cuda_ipc_layouts.json) and on a GPU against what it exports now.
The GPU tests (marker ``gpu``) run in bench/gpu_check.sh."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from flowgrpo.v1 import common_pb2

from .cuda_ipc_layouts import LAYOUTS_FILE, fields_of, record_this_torch, recorded, torch_minor

LAYOUTS = recorded()

CONSUMER = textwrap.dedent(
    """
    import sys, torch
    from flowgrpo.bus.cuda_ipc import can_open, open_bucket
    from flowgrpo.v1 import common_pb2
    bucket = common_pb2.CudaIpcBucket.FromString(sys.stdin.buffer.read())
    assert can_open(bucket)
    views = open_bucket(bucket)
    for name, view in sorted(views.items()):
        copy = view.to("cuda:0")  # what a rollout's apply does
        print(name, view.dtype, tuple(view.shape), float(copy.double().sum()), flush=True)
    """
)


@pytest.mark.gpu
def test_another_process_reads_the_exported_tensors() -> None:
    from flowgrpo.bus.cuda_ipc import BucketWriter, bucket_bytes

    device = torch.device("cuda", torch.cuda.device_count() - 1)  # another GPU than the consumer's, if any
    tensors = {
        "a.weight": torch.randn(257, 33, device=device),
        "b.bias": torch.randn(5, device=device).to(torch.bfloat16),
        "c.scalar": torch.ones((), device=device),
    }
    writer = BucketWriter(bucket_bytes((n, t.shape, t.dtype) for n, t in tensors.items()), device)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    bucket = writer.finish()
    assert all(e.offset % 256 == 0 for e in bucket.proto.tensors)
    done = subprocess.run(
        [sys.executable, "-c", CONSUMER],
        input=bucket.proto.SerializeToString(),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    lines = done.stdout.decode().splitlines()
    expected = [
        f"{n} {t.dtype} {tuple(t.shape)} {float(t.double().sum())}" for n, t in sorted(tensors.items())
    ]
    assert lines == expected


def test_a_bucket_of_another_host_is_refused() -> None:
    from flowgrpo.bus.cuda_ipc import CudaIpcError, can_open, open_bucket

    bucket = common_pb2.CudaIpcBucket(host_id="another-host", device_uuid="GPU-0")
    assert not can_open(bucket)
    with pytest.raises(CudaIpcError, match="another-host"):
        open_bucket(bucket)


@pytest.mark.gpu
def test_this_torch_exports_the_recorded_layout() -> None:
    """What ``_share_cuda_()`` returns here, field by field, is what the CPU tests build their
    handles from: a torch that changed it fails here first, printing the entry to record."""
    live = record_this_torch()
    entry = recorded().get(torch_minor(torch.__version__))
    assert entry is not None, (
        f"torch {torch.__version__} has no layout in {LAYOUTS_FILE.name}; add under "
        f"{torch_minor(torch.__version__)!r}: {json.dumps(live)}"
    )
    assert live["fields"] == entry["fields"], f"torch {torch.__version__} exports {json.dumps(live)}"


def recorded_bucket(version: str = "2.11", **fields: object) -> common_pb2.CudaIpcBucket:
    """A bucket whose handles are shaped as torch ``version`` was recorded to export them."""
    shaped = fields_of(LAYOUTS[version]) | fields
    return common_pb2.CudaIpcBucket(host_id="h", device_uuid="GPU-x", storage_bytes=4096, **shaped)  # type: ignore[arg-type]


@pytest.mark.parametrize("version", sorted(LAYOUTS))
def test_what_torch_was_recorded_to_export_passes_the_consumers_check(version: str) -> None:
    from flowgrpo.bus.cuda_ipc import check_handles

    check_handles(recorded_bucket(version))
    check_handles(recorded_bucket(version, event_handle=b"", event_sync_required=False))
    check_handles(recorded_bucket(version, event_sync_required=True))


def test_a_bare_handle_and_torch_2_13s_header_pass() -> None:
    """torch before versioned handles sends the bare 64 bytes; torch 2.13 writes version 3 with
    2.11's payload (torch's source; not recorded on a GPU here)."""
    from flowgrpo.bus.cuda_ipc import check_handles

    handle = recorded_bucket().handle
    check_handles(recorded_bucket(handle=handle[2:]))
    check_handles(recorded_bucket(handle=bytes([3]) + handle[1:]))


HOSTILE_HANDLES = [
    ("an expandable segment", lambda h: h[:1] + b"e" + h[2:], "expandable-segment handle"),
    ("an expandable segment, long", lambda h: h[:1] + b"e" + b"\xff" * 4096, "expandable-segment handle"),
    ("one byte short", lambda h: h[:-1], "handle: 65 bytes"),
    ("one byte long", lambda h: h + b"\x00", "handle: 67 bytes"),
    ("the header alone", lambda h: h[:2], "handle: 2 bytes"),
    ("a byte", lambda h: h[:1], "handle: 1 bytes"),
    ("nothing", lambda h: b"", "handle: 0 bytes"),
    ("version 0", lambda h: b"\x00" + h[1:], "version byte 0"),
    ("an unknown type", lambda h: h[:1] + b"x" + h[2:], "type byte 0x78"),
]


@pytest.mark.parametrize(("case", "forge", "message"), HOSTILE_HANDLES, ids=[c[0] for c in HOSTILE_HANDLES])
def test_a_handle_torchs_opener_would_misread_is_refused(case: str, forge: object, message: str) -> None:
    """Lengths that make the opener read past the handle, a payload that names another process's
    file descriptors, a header no torch writes: refused before torch sees them."""
    from flowgrpo.bus.cuda_ipc import check_handles

    bucket = recorded_bucket()
    bucket.handle = forge(bucket.handle)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        check_handles(bucket)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"event_handle": b"e" * 63}, "event_handle: 63 bytes; need 0 or 64"),
        ({"event_handle": b"e" * 66}, "event_handle: 66 bytes"),
        ({"event_handle": b"", "event_sync_required": True}, "event_handle: 0 bytes; need 64"),
    ],
)
def test_an_event_handle_of_another_size_is_refused(fields: dict[str, object], message: str) -> None:
    from flowgrpo.bus.cuda_ipc import check_handles

    with pytest.raises(ValueError, match=message):
        check_handles(recorded_bucket(**fields))
