"""The same-host CUDA IPC path for weights: a bucket exported by one process is opened by
another and holds the producer's bytes. The GPU test (marker ``gpu``) runs in bench/trainer_gpu.sh."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from flowgrpo.v1 import common_pb2

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
